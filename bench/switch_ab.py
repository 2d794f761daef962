#!/usr/bin/env python3
"""bench/switch_ab.py A B ROUND.jsonl...: a switch's A/B inside one binary, as Markdown.

A and B are relay names of bench/relays.sh that differ by one setting (zcrelay-copy and
zcrelay-copy-zc: send_zerocopy). Each ROUND.jsonl is one bench/run invocation that ran both
(bench/switch-ab.sh alternates which goes first). Per cell (workload x parameter x metric):
A and B as median [min..max] over the rounds of each invocation's value, B/A as the median of
B over the median of A with [min..max] of the per-round ratios, and "outside noise" where A's
and B's ranges do not overlap. Standard library only.
"""
import json
import statistics
import sys

METRICS = [("median", None, "higher"), ("relay_cpu_s_per_gb", "relay CPU s/GB", "lower"),
           ("system_cpu_s_per_gb", "whole machine CPU s/GB", "lower"),
           ("peak_rss_kib", "relay peak RSS KiB", "lower")]


def fmt(v):
    return "-" if v is None else (f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}")


def main(argv):
    if len(argv) < 4:
        sys.exit(__doc__)
    a, b, files = argv[1], argv[2], argv[3:]
    rounds = []  # per round: {(workload, param, relay): record}
    for path in files:
        recs = {}
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    recs[(r["workload"], r["param"], r["relay"])] = r
        rounds.append(recs)
    cells = sorted({(w, p) for rec in rounds for (w, p, _) in rec})
    print(f"{len(rounds)} rounds; B = {b}, A = {a}\n")
    print(f"| workload | param | metric | {a} | {b} | B/A [per-round min..max] | |")
    print("|---|---|---|---|---|---|---|")
    for w, p in cells:
        for field, label, _better in METRICS:
            va, vb, ratios = [], [], []
            unit = None
            for rec in rounds:
                ra, rb = rec.get((w, p, a)), rec.get((w, p, b))
                xa = ra.get(field) if ra else None
                xb = rb.get(field) if rb else None
                unit = unit or (ra or rb or {}).get("unit")
                if xa is not None:
                    va.append(xa)
                if xb is not None:
                    vb.append(xb)
                if xa and xb:
                    ratios.append(xb / xa)
            if not va or not vb:
                continue
            ma, mb = statistics.median(va), statistics.median(vb)
            apart = len(va) > 1 and len(vb) > 1 and (max(va) < min(vb) or max(vb) < min(va))
            print(f"| {w} | {p} | {label or unit} | {fmt(ma)} [{fmt(min(va))}..{fmt(max(va))}] "
                  f"| {fmt(mb)} [{fmt(min(vb))}..{fmt(max(vb))}] "
                  f"| {mb / ma:.2f} [{min(ratios):.2f}..{max(ratios):.2f}] "
                  f"| {'outside noise' if apart else ''} |")


if __name__ == "__main__":
    main(sys.argv)
