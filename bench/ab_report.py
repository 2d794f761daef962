#!/usr/bin/env python3
"""bench/ab_report.py DIR: the Markdown report of a bench/ab.sh directory (DIR/meta.tsv,
DIR/manifest.tsv and the bench/run records it lists), on stdout. Standard library only.

A cell is workload x parameter x relay x metric. Each bench/run invocation gives one value per
cell: its record's median over the runs of that invocation (or the record's CPU / RSS / latency
field). Over the rounds, each side gets median [min..max] of those values; after/before is the
median of the after values over the median of the before values, with [min..max] of the
per-round ratios (round r's after over round r's before). A cell is "outside noise" when the
after range and the before range do not overlap; with fewer than 2 rounds on a side there is no
range and no verdict.
"""
import glob
import json
import math
import os
import statistics
import sys
from datetime import datetime, timezone

# Metrics taken from every record: (field, label, unit or None for the record's own, better).
# The headline value is "median", in the record's unit.
HIGHER_UNITS = {"MB/s", "MiB/s", "conn/s", "req/s", "handshakes/s", "pass"}
LOWER_UNITS = {"B/conn", "s", "s/GB", "us", "µs", "KiB"}
EXTRA = [
    ("relay_cpu_s_per_gb", "relay CPU", "s/GB", "lower"),
    ("relay_cpu_s", "relay CPU (whole workload)", "s", "lower"),
    ("relay_cpu_us_per_conn", "relay CPU", "µs/conn", "lower"),
    ("p50_us", "p50", "µs", "lower"),
    ("p99_us", "p99", "µs", "lower"),
    ("p999_us", "p99.9", "µs", "lower"),
    ("peak_rss_kib", "relay peak RSS", "KiB", "lower"),
]
# Workloads in bench/run's order; stderr.log lines that end a cell of each.
LOG_PREFIX = [("halfclose ", "halfclose"), ("nc upload ", "upload"),
              ("nc download ", "download"), ("bulk ", "bulk"), ("connrate ", "connrate"),
              ("pingpong ", "pingpong"), ("http ", "http"), ("idle ", "idle"),
              ("sni ", "sni")]


def read_tsv(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n").split("\t") for line in f if line.strip()]


def fmt(v):
    if v is None:
        return "-"
    a = abs(v)
    if a >= 1000:
        return f"{v:.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 10:
        return f"{v:.2f}"
    return f"{v:.3f}"


def utc(epoch):
    return datetime.fromtimestamp(int(epoch), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def better_of(unit):
    if unit in HIGHER_UNITS:
        return "higher"
    if unit in LOWER_UNITS:
        return "lower"
    return "?"


def metrics_of(rec):
    """(metric label, unit, better, value) of one record; value None when absent or failed."""
    unit = rec.get("unit") or "?"
    label = "pass (1 = all runs passed)" if unit == "pass" else unit
    out = [(label, unit, better_of(unit), rec.get("median"))]
    has_per_gb = "relay_cpu_s_per_gb" in rec
    for field, name, u, better in EXTRA:
        if field == "relay_cpu_s" and has_per_gb:
            continue   # per GB says the same for byte rates, comparably
        if field not in rec or rec[field] is None:
            continue
        if field != "peak_rss_kib" and field != "relay_cpu_s" and rec.get("median") is None:
            continue
        out.append((f"{name} {u}", u, better, rec[field]))
    return out


def workload_times(stderr_log):
    """Seconds per workload of one invocation, from the time stamps ab.sh put on its stderr."""
    times, last, end = {}, None, None
    try:
        f = open(stderr_log, encoding="utf-8", errors="replace")
    except OSError:
        return times, None
    with f:
        for line in f:
            ts, _, msg = line.rstrip("\n").partition(" ")
            try:
                t = float(ts)
            except ValueError:
                continue
            if not msg.startswith("bench/run: "):
                continue
            msg = msg[len("bench/run: "):]
            if msg.startswith("workloads:"):
                last = t
                continue
            if msg.startswith("results:"):
                end = t
                if last is not None:
                    times["(report, charts)"] = times.get("(report, charts)", 0) + t - last
                continue
            for prefix, w in LOG_PREFIX:
                if msg.startswith(prefix) and last is not None:
                    times[w] = times.get(w, 0) + t - last
                    last = t
                    break
    return times, end


def main():
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 2
    d = sys.argv[1]
    meta = {k: v for k, v, *_ in (row + [""] for row in read_tsv(os.path.join(d, "meta.tsv")))}
    rows = read_tsv(os.path.join(d, "manifest.tsv"))
    header, runs = rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]

    cells = {}    # (workload, param, relay, label) -> {"unit", "better", "before": {round: v}, ...}
    order = []
    failures = {}  # (workload, param, relay) -> {side: sum}
    recs_per_run = {}
    for run in runs:
        rnd, side = int(run["round"]), run["side"]
        n = 0
        path = os.path.join(d, run["jsonl"]) if run.get("jsonl") else ""
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    if "relay" not in rec:
                        continue
                    n += 1
                    base = (rec["workload"], rec["param"], rec["relay"])
                    fs = failures.setdefault(base, {"before": 0, "after": 0, "errors": [0, 0]})
                    fs[side] += int(rec.get("failures") or 0)
                    fs["errors"][side == "after"] += int(rec.get("errors") or 0)
                    for label, unit, better, v in metrics_of(rec):
                        key = base + (label,)
                        if key not in cells:
                            cells[key] = {"unit": unit, "better": better, "before": {}, "after": {}}
                            order.append(key)
                        if v is not None:
                            cells[key][side][rnd] = float(v)
        recs_per_run[(rnd, side)] = n

    same = meta.get("before_sha256") == meta.get("after_sha256")
    starts = [int(r["start"]) for r in runs]
    ends = [int(r["end"]) for r in runs]
    # Rounds in which both sides' invocations left records (a stopped one may have some).
    rounds_done = sorted({rnd for (rnd, side), n in recs_per_run.items() if side == "before" and n} &
                         {rnd for (rnd, side), n in recs_per_run.items() if side == "after" and n})
    n_rounds = len(rounds_done)

    out = []
    p = out.append
    p(f"### bench/ab.sh on {meta.get('host', '?')} ({meta.get('kernel', '?')}): after / before")
    p("")
    if meta.get("quick") == "1":
        p("**`--quick`: bench/run's smoke settings (1 run per cell for most workloads); not results to quote.**")
        p("")
    if same:
        p("**A/A run: both sides are the same binary (same sha256); every difference below is noise.**")
        p("")
    p(f"- before: `{meta.get('before')}`, sha256 `{meta.get('before_sha256')}` ({meta.get('before_version')})")
    p(f"- after: `{meta.get('after')}`, sha256 `{meta.get('after_sha256')}` ({meta.get('after_version')})")
    p(f"- load generators (both sides): `{meta.get('tools')}` (sha256 of the set `{meta.get('tools_sha256')}`);"
      f" driver: bench/run sha256 `{meta.get('driver_run_sha256', '')[:16]}` from repo {meta.get('repo')}")
    p(f"- rounds: {n_rounds} of {meta.get('rounds')} with records on both sides (one bench/run per side per round; odd rounds"
      f" before first, even rounds after first); relays `{meta.get('only')}`; workloads"
      f" `{meta.get('workloads')}`; per-invocation timeout {meta.get('timeout')} s")
    if starts:
        p(f"- dates: {utc(min(starts))} to {utc(max(ends))} ({(max(ends) - min(starts)) / 60:.1f} min)")
    p(f"- machine: {meta.get('cpus')}; relay on CPU {meta.get('relay_cpu')}, load on CPU {meta.get('load_cpu')}")
    p("")
    p("| round | side | order | start | took s | exit | records |")
    p("|---|---|---|---|---|---|---|")
    bad = []
    for r in runs:
        rc = r["rc"]
        note = {"0": "0", "124": "124 (timeout)", "137": "137 (killed)"}.get(rc, rc)
        if rc != "0":
            bad.append(f"round {r['round']} {r['side']}")
        p(f"| {r['round']} | {r['side']} | {r['order']} | {utc(r['start'])} |"
          f" {int(r['end']) - int(r['start'])} | {note} | {recs_per_run.get((int(r['round']), r['side']), 0)} |")
    p("")
    if bad:
        p(f"**Invocations that did not exit 0: {', '.join(bad)}** (their records so far are used; see"
          " runs/rN-SIDE/stderr.log).")
        p("")

    # The cells.
    table, outside, problems = [], [], []
    k_ranged = 0
    for key in order:
        c = cells[key]
        b, a = c["before"], c["after"]
        if not b and not a:
            continue
        bv, av = list(b.values()), list(a.values())
        bm = statistics.median(bv) if bv else None
        am = statistics.median(av) if av else None

        def rng(vs, m):
            if not vs:
                return "failed"
            s = f"{fmt(m)} [{fmt(min(vs))}..{fmt(max(vs))}]"
            return s + (f" (n={len(vs)})" if len(vs) != n_rounds else "")

        ratio = "-"
        if bm is not None and am is not None and bm != 0:
            pr = [a[r] / b[r] for r in sorted(set(a) & set(b)) if b[r] != 0]
            ratio = f"{am / bm:.3f}"
            if pr:
                ratio += f" [{min(pr):.3f}..{max(pr):.3f}]"
        verdict = ""
        if c["unit"] == "s" and max(bv + av, default=0) < 0.1:
            # /proc's CPU times tick every 10 ms: under 10 ticks, a difference is rounding.
            verdict = "below resolution (10 ms ticks)"
        elif len(bv) >= 2 and len(av) >= 2:
            k_ranged += 1
            if min(av) > max(bv) or max(av) < min(bv):
                up = min(av) > max(bv)
                good = (up and c["better"] == "higher") or (not up and c["better"] == "lower")
                word = "better" if good else "worse" if c["better"] != "?" else "different"
                verdict = f"**outside noise: {word}**"
                outside.append((key, word, ratio))
            else:
                verdict = "within noise"
        elif bv or av:
            verdict = "no range (1 round)"
        fs = failures.get(key[:3], {})
        if fs.get("before") or fs.get("after"):
            verdict += f"; **failed runs** before/after {fs.get('before', 0)}/{fs.get('after', 0)}"
        if any(fs.get("errors", ())):
            # conn_rate's failed connections (its record's "errors"): a rate with errors is suspect.
            verdict += f"; **connection errors** before/after {fs['errors'][0]}/{fs['errors'][1]}"
        if (fs.get("before") or fs.get("after") or any(fs.get("errors", ()))) and key[:3] not in problems:
            problems.append(key[:3])
        table.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {c['better']} |"
                     f" {rng(bv, bm)} | {rng(av, am)} | {ratio} | {verdict} |")

    p("#### Summary")
    p("")
    if k_ranged:
        nr = min(n_rounds, 50)
        pchance = 2 / math.comb(2 * nr, nr) if nr >= 2 else 1.0
        p(f"{len(outside)} of {k_ranged} cells outside noise. With {nr} rounds a side, two samples of the"
          f" same distribution fail to overlap with probability 2/C({2 * nr},{nr}) = {pchance:.4f} per"
          f" cell, so about {k_ranged * pchance:.1f} such cells are expected by chance alone (cells are"
          " correlated, e.g. CPU s/GB with MB/s, which changes the count but not the expectation).")
    else:
        p("No cell has 2 or more rounds on both sides: no noise range, no verdicts (ratios only).")
    p("")
    for key, word, ratio in outside:
        p(f"- {' / '.join(key)}: {word}, after/before {ratio}")
    if outside:
        p("")
    if problems:
        p("Failed runs or connection errors (see the verdict column; bench/run's stderr.log of the round):"
          f" {', '.join(' / '.join(k) for k in problems)}.")
        p("")
    p("#### Cells")
    p("")
    p("Values: each invocation's median over its runs; per side, median [min..max] over the rounds."
      " after/before: median over median [min..max of the per-round ratios]. \"better\": which"
      " direction of the metric is better. Relay CPU (whole workload) for time-bounded workloads"
      " (connrate, http) grows with the work done: read it beside the rate.")
    p("")
    p("| workload | param | relay | metric | better | before | after | after/before | verdict |")
    p("|---|---|---|---|---|---|---|---|---|")
    out.extend(table)
    p("")

    # Time per workload, for sizing the next A/B.
    per_w, totals = {}, []
    for r in runs:
        t, _ = workload_times(os.path.join(d, "runs", f"r{r['round']}-{r['side']}", "stderr.log"))
        for w, s in t.items():
            per_w.setdefault(w, []).append(s)
        totals.append(int(r["end"]) - int(r["start"]))
    if per_w:
        p("#### Time per invocation")
        p("")
        p("Seconds, median [min..max] over the invocations, from the time stamps of bench/run's"
          " progress lines (a workload's time includes starting and stopping its relays and servers).")
        p("")
        p("| workload | s |")
        p("|---|---|")
        ws = [w for _, w in LOG_PREFIX if w in per_w] + [w for w in per_w if w not in dict(LOG_PREFIX).values()]
        for w in ws:
            v = per_w[w]
            p(f"| {w} | {statistics.median(v):.1f} [{min(v):.1f}..{max(v):.1f}] |")
        p(f"| whole invocation | {statistics.median(totals):.0f} [{min(totals)}..{max(totals)}] |")
        p("")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
