#!/usr/bin/env python3
"""bench/report.py [--summary] RESULTS.jsonl: one Markdown table per workload and parameter of a
bench/run result file: each relay's median (min-max), ok/runs, relay CPU seconds, peak RSS, and
where the records carry them, latency percentiles, relay CPU per GB and the whole machine's CPU
per GB (all CPUs, /proc/stat).

--summary: one table instead, a row per relay and a column per headline measurement (the
README's table); a cell is the median, "failed" when every run failed, "-" when not run.

--sni: what inspecting the ClientHello costs zcrelay (the sni workload): per mode, relay CPU µs
per connection with routes and without (a `cluster:` listener), median [min..max] over the
runs, and their ratio against the goal (inspection adds under 10 %).
Standard library only."""
import fnmatch
import json
import sys


def num(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


# The README's columns: (heading, workload, param, field, format). Field "cpu" is relay CPU per
# GB, shown beside the rate it belongs to.
SUMMARY = [
    ("half-close", "halfclose", "1MiB", "pass", None),
    ("nc 1 GiB up MB/s (CPU s/GB: relay, machine)", "bulk-nc-upload", "1024MiB", "median+cpu",
     "{:.0f}"),
    ("bulk 1×100 MiB MB/s (CPU s/GB: relay, machine)", "bulk", "1x100MiB", "median+cpu",
     "{:.0f}"),
    ("bulk 100×10 MiB MB/s (CPU s/GB: relay, machine)", "bulk", "100x10MiB", "median+cpu",
     "{:.0f}"),
    ("conn/s", "connrate", "50-in-flight", "median", "{:.0f}"),
    ("ping-pong 1 conn p50 / p99 µs", "pingpong", "1conn-64B", "p50+p99", "{:.1f}"),
    ("ping-pong 100 conns req/s", "pingpong", "100conn-64B", "median", "{:.0f}"),
    ("HTTP req/s", "http", "1KiB-50conns", "median", "{:.0f}"),
    ("idle B/conn", "idle", "*", "median", "{:.0f}"),
    ("SNI handshakes/s (relay CPU µs/conn)", "sni", "handshake-*conns", "median+us", "{:.0f}"),
    ("SNI 1 MiB downloads MB/s (CPU s/GB)", "sni", "1MiB-*", "median+cpu", "{:.0f}"),
]


def summary_cell(r, field, fmt):
    if r is None:
        return "-"
    if field == "pass":   # one sample a run: 1 passed, 0 failed
        return "pass" if r["min"] == 1 else "**fail**"
    if r["median"] is None:
        return "**failed**"
    if field == "median+cpu":
        cpu = r.get("relay_cpu_s_per_gb")
        system = r.get("system_cpu_s_per_gb")
        parts = [f"{v:.2f}" for v in (cpu, system) if v is not None]
        return fmt.format(r["median"]) + (f" ({', '.join(parts)})" if parts else "")
    if field == "median+us":
        us = r.get("relay_cpu_us_per_conn")
        return fmt.format(r["median"]) + ("" if us is None else f" ({us:.0f})")
    if field == "p50+p99":
        return f"{num(r.get('p50_us'))} / {num(r.get('p99_us'))}"
    return fmt.format(r["median"])


def summary(recs):
    relays = []
    for r in recs:
        if r["relay"] not in relays:
            relays.append(r["relay"])
    cols = [c for c in SUMMARY if any(r["workload"] == c[1] for r in recs)]
    print("| relay | " + " | ".join(c[0] for c in cols) + " |")
    print("|" + "---|" * (len(cols) + 1))
    for relay in relays:
        cells = []
        for _, workload, param, field, fmt in cols:
            r = next((x for x in recs if x["relay"] == relay and x["workload"] == workload
                      and fnmatch.fnmatchcase(x["param"], param)), None)
            cells.append(summary_cell(r, field, fmt))
        print(f"| {relay} | " + " | ".join(cells) + " |")


def main(path, only_summary=False):
    recs = [json.loads(line) for line in open(path) if line.strip()]
    if only_summary:
        return summary(recs)
    keys = []
    for r in recs:
        key = (r["workload"], r["param"])
        if key not in keys:
            keys.append(key)
    for workload, param in keys:
        rows = [r for r in recs if (r["workload"], r["param"]) == (workload, param)]
        latency = any("p99_us" in r for r in rows)
        per_gb = any("relay_cpu_s_per_gb" in r for r in rows)
        system_gb = any(r.get("system_cpu_s_per_gb") is not None for r in rows)
        per_conn = any("relay_cpu_us_per_conn" in r for r in rows)
        busy = any("load_cpu_busy_pct" in r for r in rows)
        print(f"#### {workload} {param} ({rows[0]['unit']})\n")
        cols = ["relay", "median (min–max)", "ok/runs", "relay CPU s", "peak RSS KiB"]
        if latency:
            cols.append("p50 / p99 / p99.9 µs")
        if per_gb:
            cols.append("relay CPU s/GB")
        if system_gb:
            cols.append("whole-machine CPU s/GB")
        if per_conn:
            cols.append("relay CPU µs/conn (min–max)")
        if busy:
            cols += ["relay's CPU busy %", "load CPU busy %", "other processes % CPU (max)"]
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
            if system_gb:
                cells.append(num(r.get("system_cpu_s_per_gb"), "{:.3f}"))
            if per_conn:
                cells.append(f"{num(r.get('relay_cpu_us_per_conn'))} "
                             f"({num(r.get('relay_cpu_us_per_conn_min'))}–"
                             f"{num(r.get('relay_cpu_us_per_conn_max'))})"
                             if r.get("relay_cpu_us_per_conn") is not None else "-")
            if busy:
                cells += [num(r.get("relay_busy_pct"), "{:.0f}"),
                          num(r.get("load_cpu_busy_pct"), "{:.0f}"),
                          f"{num(r.get('other_cpu_pct'))} ({num(r.get('other_cpu_pct_max'))})"]
            print("| " + " | ".join(cells) + " |")
        print()


SNI_GOAL = 1.10   # with routes / without, relay CPU per connection


def sni_inspection(path):
    """zcrelay's relay CPU per connection in the sni handshake cell, with routes against the
    same listener without routes, per mode."""
    recs = [json.loads(line) for line in open(path) if line.strip()]
    hs = [r for r in recs if r["workload"] == "sni" and r["param"].startswith("handshake-")]
    rows = []
    for r in hs:
        if r["param"].endswith("-noroutes"):
            continue
        base = next((x for x in hs if x["relay"] == r["relay"]
                     and x["param"] == r["param"] + "-noroutes"), None)
        if base is not None:
            rows.append((r, base))
    if not rows:
        print("(no zcrelay handshake records both with and without routes)")
        return
    print("| relay | handshakes/s with routes | without | relay CPU µs/conn with routes "
          "(min–max) | without (min–max) | with / without | goal < "
          f"{SNI_GOAL:g} |")
    print("|" + "---|" * 7)

    def us(r):
        if r.get("relay_cpu_us_per_conn") is None:
            return "-"
        return (f"{r['relay_cpu_us_per_conn']:.1f} ({r['relay_cpu_us_per_conn_min']:.1f}–"
                f"{r['relay_cpu_us_per_conn_max']:.1f})")
    for r, b in rows:
        a, z = r.get("relay_cpu_us_per_conn"), b.get("relay_cpu_us_per_conn")
        ratio = a / z if a is not None and z else None
        met = "n/a" if ratio is None else ("yes" if ratio < SNI_GOAL else "**no**")
        # The range pairs one side's best run with the other's worst.
        rng = ""
        if ratio is not None:
            rng = (f" ({r['relay_cpu_us_per_conn_min'] / b['relay_cpu_us_per_conn_max']:.3f}–"
                   f"{r['relay_cpu_us_per_conn_max'] / b['relay_cpu_us_per_conn_min']:.3f})")
        print(f"| {r['relay']} | {num(r['median'], '{:.0f}')} | {num(b['median'], '{:.0f}')} | "
              f"{us(r)} | {us(b)} | {num(ratio, '{:.3f}')}{rng} | {met} |")
    print()


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--sni"] and len(args) == 2:
        sys.exit(sni_inspection(args[1]))
    want_summary = args[:1] == ["--summary"]
    if want_summary:
        args = args[1:]
    if len(args) != 1:
        sys.exit(__doc__)
    main(args[0], want_summary)
