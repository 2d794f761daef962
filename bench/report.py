#!/usr/bin/env python3
"""bench/report.py RESULTS.jsonl: one Markdown table per workload and parameter of a bench/run
result file: each relay's median (min-max), ok/runs, relay CPU seconds, peak RSS, and where the
records carry them, latency percentiles and relay CPU per GB. Standard library only."""
import json
import sys


def num(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def main(path):
    recs = [json.loads(line) for line in open(path) if line.strip()]
    keys = []
    for r in recs:
        key = (r["workload"], r["param"])
        if key not in keys:
            keys.append(key)
    for workload, param in keys:
        rows = [r for r in recs if (r["workload"], r["param"]) == (workload, param)]
        latency = any("p99_us" in r for r in rows)
        per_gb = any("relay_cpu_s_per_gb" in r for r in rows)
        print(f"#### {workload} {param} ({rows[0]['unit']})\n")
        cols = ["relay", "median (min–max)", "ok/runs", "relay CPU s", "peak RSS KiB"]
        if latency:
            cols.append("p50 / p99 / p99.9 µs")
        if per_gb:
            cols.append("relay CPU s/GB")
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            cells = [r["relay"], f"{num(r['median'])} ({num(r['min'])}–{num(r['max'])})",
                     f"{r['runs'] - r['failures']}/{r['runs']}", num(r.get("relay_cpu_s"), "{:.2f}"),
                     "-" if r.get("peak_rss_kib") is None else str(r["peak_rss_kib"])]
            if latency:
                cells.append(f"{num(r.get('p50_us'))} / {num(r.get('p99_us'))} / "
                             f"{num(r.get('p999_us'))}")
            if per_gb:
                cells.append(num(r.get("relay_cpu_s_per_gb"), "{:.3f}"))
            print("| " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
