#!/usr/bin/env python3
"""bench/discovery.py: the Python side of bench/discovery.sh. Standard library only.

Subcommands:

  sample URL OUT --interval S --seconds T
        scrapes zcrelay's /metrics every S seconds for at most T seconds (or until SIGTERM) and
        appends one TSV line per value of interest: "time<TAB>what<TAB>label<TAB>value", time in
        CLOCK_REALTIME seconds. what: active / total / bytes_up (per backend), listener_active,
        discovery_backends, resolutions (label = outcome), generation; a failed scrape is a
        "scrape_error" line. Bounded: T / S + 10 scrapes at most, 1 s timeout each.
  report SAMPLES_DIR --jsonl FILE [--meta K=V ...]
        the Markdown report on stdout, and its records appended to FILE (one JSON line each).
        Exit status 3 if a client saw a failure (conn_rate errors included), a client left no
        result, or the transfer was not byte-exact.
  plotdata SCALE_DIR OUTDIR
        the data file and gnuplot variables of one scale run's chart (bench/discovery.gp), in
        SCALE_DIR; the chart goes to OUTDIR/scale-<balance>.svg. Prints the variables file's
        path for the caller to hand to gnuplot before discovery.gp.

What the scale run directories hold (written by discovery.sh): t0 (when the load started),
dns.tsv (each DNS change: time, label, the addresses, when dig saw it), metrics.tsv (above),
backend-ADDR.events (echo_server --events: "ns +" per accept, "ns -" per close), client.json
and client.err (discovery_load client), transfer.json and transfer.sha256, relay.log, meta.json.
"""

import json
import math
import os
import re
import signal
import statistics
import sys
import time
import urllib.request
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))

# --------------------------------------------------------------------------- sample

_LINE = re.compile(r'^(zcrelay_[a-z_]+)(\{[^}]*\})? ([-+0-9.eE]+|NaN)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text):
    """(what, label, value) for the series discovery.sh follows."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), m.group(3)
        if name == "zcrelay_backend_connections_active":
            out.append(("active", labels.get("backend", "?"), value))
        elif name == "zcrelay_backend_connections_total":
            out.append(("total", labels.get("backend", "?"), value))
        elif name == "zcrelay_backend_bytes_total" and labels.get("direction") == "upstream":
            out.append(("bytes_up", labels.get("backend", "?"), value))
        elif name == "zcrelay_connections_active":
            out.append(("listener_active", labels.get("listener", "-"), value))
        elif name == "zcrelay_discovery_backends":
            out.append(("discovery_backends", labels.get("cluster", "-"), value))
        elif name == "zcrelay_discovery_resolutions_total":
            out.append(("resolutions", labels.get("outcome", "?"), value))
        elif name == "zcrelay_config_generation":
            out.append(("generation", "-", value))
    return out


def cmd_sample(url, out, interval, seconds):
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    end = time.time() + seconds
    limit = int(seconds / interval) + 10
    nxt = time.time()
    with open(out, "a", buffering=1) as f:
        for _ in range(limit):
            if stop or time.time() >= end:
                break
            t = time.time()
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    body = r.read().decode("utf-8", "replace")
                lines = [f"{t:.3f}\t{w}\t{l}\t{v}" for w, l, v in parse_metrics(body)]
                f.write("\n".join(lines) + "\n")
            except Exception as e:  # noqa: BLE001 - any failure is one recorded error
                f.write(f"{t:.3f}\tscrape_error\t-\t1\t{type(e).__name__}\n")
            nxt += interval
            delay = nxt - time.time()
            if delay > 0:
                time.sleep(delay)
            else:
                nxt = time.time()
    return 0


# --------------------------------------------------------------------------- reading a run

def read_json(path, default=None):
    try:
        with open(path) as f:
            text = f.read().strip()
        return json.loads(text.splitlines()[-1]) if text else default
    except (FileNotFoundError, json.JSONDecodeError, IndexError):
        return default


def read_lines(path):
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


class ScaleRun:
    def __init__(self, d):
        self.dir = d
        self.meta = read_json(os.path.join(d, "meta.json"), {})
        self.balance = self.meta.get("balance", os.path.basename(d).removeprefix("scale-"))
        t0 = read_lines(os.path.join(d, "t0"))
        self.t0 = float(t0[0]) if t0 else None
        # DNS: (time, label, [addresses], dig_ms, dig tries, ms the confirming dig took)
        self.dns = []
        for line in read_lines(os.path.join(d, "dns.tsv")):
            f = line.split("\t")
            if len(f) >= 4:
                self.dns.append((float(f[0]), f[1], [a for a in f[2].split(",") if a],
                                 float(f[3]) if f[3] not in ("", "-") else None,
                                 int(f[4]) if len(f) > 4 else None,
                                 float(f[5]) if len(f) > 5 else None))
        # metrics: what -> label -> [(t, value)]
        self.metrics = {}
        self.scrape_errors = 0
        self.sample_times = []
        for line in read_lines(os.path.join(d, "metrics.tsv")):
            f = line.split("\t")
            if len(f) < 4:
                continue
            t = float(f[0])
            if f[1] == "scrape_error":
                self.scrape_errors += 1
                continue
            if not self.sample_times or self.sample_times[-1] != t:
                self.sample_times.append(t)
            try:
                v = float(f[3])
            except ValueError:
                continue
            self.metrics.setdefault(f[1], {}).setdefault(f[2], []).append((t, v))
        # backend events: addr -> [(t, +1/-1)]
        self.events = {}
        for name in sorted(os.listdir(d)):
            m = re.match(r"backend-(.+)\.events$", name)
            if not m:
                continue
            ev = []
            for line in read_lines(os.path.join(d, name)):
                f = line.split()
                if len(f) == 2:
                    ev.append((int(f[0]) / 1e9, 1 if f[1] == "+" else -1))
            self.events[m.group(1)] = ev
        self.client = read_json(os.path.join(d, "client.json"))
        # client.timeline: (t_s, short_started, short_done, short_max_us, pings, ping_max_us,
        # failures, loop_gap_us) per 100 ms, t_s since the client began (~t0).
        self.timeline = []
        for line in read_lines(os.path.join(d, "client.timeline")):
            if line.startswith("#"):
                continue
            f = line.split()
            if len(f) == 8:
                self.timeline.append(tuple(float(x) for x in f))
        self.transfer = read_json(os.path.join(d, "transfer.json"))
        sums = read_lines(os.path.join(d, "transfer.sha256"))
        self.sha_in = sums[0].split()[0] if len(sums) > 0 and sums[0] else None
        self.sha_out = sums[1].split()[0] if len(sums) > 1 and sums[1] else None
        self.relay_changes = []  # (time, from, to, text)
        for line in read_lines(os.path.join(d, "relay.log")):
            m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z .*\[dns\] (cluster \S+: (\d+) -> (\d+) backends.*)$", line)
            if m:
                t = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
                self.relay_changes.append((t, int(m.group(3)), int(m.group(4)), m.group(2)))
        self.backends = sorted(self.events, key=lambda a: tuple(int(x) for x in a.split(".")))

    def port(self):
        return self.meta.get("backend_port", 18080)

    def key(self, addr):
        return f"{addr}:{self.port()}"

    def changes(self):
        """The DNS changes after the initial set: (time, from_set, to_set, dig_ms, dig tries)."""
        out = []
        for i in range(1, len(self.dns)):
            out.append((self.dns[i][0], self.dns[i - 1][2], self.dns[i][2], self.dns[i][3],
                        (self.dns[i][4], self.dns[i][5])))
        return out

    def backend_active_at(self, addr, t):
        return sum(s for (te, s) in self.events.get(addr, []) if te <= t)

    def series(self, what, label):
        return self.metrics.get(what, {}).get(label, [])

    def last_value(self, what, label, before=None):
        xs = [v for (t, v) in self.series(what, label) if before is None or t <= before]
        return xs[-1] if xs else None

    def transfer_exact(self):
        tr = self.transfer or {}
        return bool(tr) and not tr.get("error") and self.sha_in is not None and \
            self.sha_in == self.sha_out and tr.get("bytes_sent") == tr.get("bytes_received")


def fmt_ms(x):
    return "-" if x is None else f"{x * 1000:,.0f} ms"


def fmt_s(x):
    return "-" if x is None else f"{x:.2f} s"


def short(addr):
    return addr


def change_label(frm, to):
    return f"{len(frm)} → {len(to)}"


def dig_text(ms, tries_took):
    """'131 ms', or '1,041 ms (1 try of 1,020 ms)' when the confirming dig itself was slow."""
    if ms is None:
        return "-"
    tries, took = tries_took if tries_took else (None, None)
    note = []
    if tries and tries > 1:
        note.append(f"{tries} tries")
    if took is not None and took >= 200:
        note.append(f"that dig ran {took:,.0f} ms")
    return f"{ms:,.0f} ms" + (f" ({', '.join(note)})" if note else "")


def analyse_change(run, t, frm, to, dig_ms, dig_tries, t_next):
    """Delays (s) after the DNS change at t."""
    added = [a for a in to if a not in frm]
    removed = [a for a in frm if a not in to]
    res = {"at_s": t - run.t0, "from": frm, "to": to, "added": added, "removed": removed,
           "dig_ms": dig_ms, "dig_tries": dig_tries[0] if dig_tries else None,
           "dig_last_ms": dig_tries[1] if dig_tries else None}
    # The relay's log line of this change: the first after t going to len(to).
    rl = [c for c in run.relay_changes if c[0] >= t - 0.002 and c[2] == len(to)]
    res["relay_logged_s"] = (rl[0][0] - t) if rl else None
    res["relay_line"] = rl[0][3] if rl else None
    # First accept at an added backend after t.
    firsts = []
    for a in added:
        acc = [te for (te, s) in run.events.get(a, []) if s > 0 and te >= t]
        if acc:
            firsts.append(acc[0] - t)
    res["first_new_s"] = min(firsts) if firsts else None
    res["first_new_each_s"] = {a: f for a, f in zip(added, firsts)}
    # Last accept at a removed backend after t (none: the last one before t, negative).
    lasts = []
    for a in removed:
        acc = [te for (te, s) in run.events.get(a, []) if s > 0 and te <= (t_next or 1e18)]
        if acc:
            lasts.append(acc[-1] - t)
    res["last_removed_s"] = max(lasts) if lasts else None
    # Accepts at removed backends after the relay logged the change (expected 0).
    if rl:
        res["removed_accepts_after_log"] = sum(
            1 for a in removed for (te, s) in run.events.get(a, []) if s > 0 and te > rl[0][0] + 0.001)
    else:
        res["removed_accepts_after_log"] = None
    # Live on removed backends at the change (backends' own count), and when the last closed.
    live = {a: run.backend_active_at(a, t) for a in removed}
    res["live_on_removed"] = sum(live.values())
    closes = [te for a in removed for (te, s) in run.events.get(a, []) if s < 0 and te >= t]
    res["last_removed_close_at_s"] = (max(closes) - run.t0) if closes and res["live_on_removed"] else None
    # From /metrics (250 ms samples): first sample showing a connection at an added backend.
    ms = []
    for a in added:
        pts = [tt for (tt, v) in run.series("total", run.key(a)) if tt >= t and v > 0]
        if pts:
            ms.append(pts[0] - t)
    res["metrics_first_new_s"] = min(ms) if ms else None
    return res


def latency_windows(run):
    """Worst short-connection time, ping and client loop gap (µs) in the second after the relay
    applied each change, and over the rest of the load (its first second left out: ramp-up)."""
    load = run.meta.get("load_seconds", 0)
    wins = []
    for (t, frm, to, _, _) in run.changes():
        rl = [c for c in run.relay_changes if c[0] >= t - 0.002 and c[2] == len(to)]
        start = (rl[0][0] if rl else t) - run.t0
        wins.append((f"{change_label(frm, to)}: the second after the relay applied it", start, start + 1.0))
    rows = []

    def worst(sel):
        pts = [r for r in run.timeline if sel(r[0])]
        if not pts:
            return None
        return (max(r[3] for r in pts), max(r[5] for r in pts), max(r[7] for r in pts), len(pts))
    for label, a, b in wins:
        rows.append((label, worst(lambda x, a=a, b=b: a - 0.1 < x < b)))
    rows.append(("rest of the load", worst(
        lambda x: 1.0 <= x < load and not any(a - 0.1 < x < b for _, a, b in wins))))
    return rows


def phase_table(run):
    """Per phase (between DNS changes), over its second half: mean relay-reported active, mean
    backend-side active, and accepts/s per backend."""
    bounds = [run.t0] + [c[0] for c in run.changes()] + [run.t0 + run.meta.get("load_seconds", 0)]
    sets = [run.dns[0][2]] + [c[2] for c in run.changes()]
    rows = []
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        lo = a + (b - a) / 2
        cells = {}
        for addr in run.backends:
            rel = [v for (t, v) in run.series("active", run.key(addr)) if lo <= t <= b]
            times = [t for t in run.sample_times if lo <= t <= b]
            own = [run.backend_active_at(addr, t) for t in times]
            acc = sum(1 for (te, s) in run.events.get(addr, []) if s > 0 and lo <= te <= b)
            cells[addr] = (statistics.mean(rel) if rel else None,
                           statistics.mean(own) if own else None,
                           acc / (b - lo) if b > lo else None)
        rows.append((i, a - run.t0, b - run.t0, sets[i], cells))
    return rows


def scale_report(runs, quick, host, kernel, out_records):
    p = print
    if not runs:
        p("(no scale run)")
        return 0
    first = runs[0]
    m = first.meta
    p("#### 1. Scale run: DNS 2 → 4 → 1 backends under load")
    p()
    p(f"Backends: 4 echo_server on {', '.join(first.key(a) for a in first.backends)}, all listening the whole run; "
      f"DNS (dnsmasq, TTL {m.get('ttl', 1)} s) lists {len(first.dns[0][2]) if first.dns else '?'} of them at the start, "
      f"then {' then '.join(str(len(c[2])) for c in first.changes())} "
      f"(at {', '.join(f'{c[0] - first.t0:.1f}' for c in first.changes())} s), "
      f"load for {m.get('load_seconds')} s. Relay: `discovery: {{dns: web.test, port: {first.port()}, "
      f"refresh_min: {m.get('refresh_min')}, refresh_max: {m.get('refresh_max')}, hold: 30s}}`, so it asks again every "
      f"{m.get('refresh_expected')} (TTL clamped). Load: {m.get('rate')} short connections/s (64 B echo), "
      f"{m.get('sessions')} sessions of {m.get('session_ms')} ms and {m.get('long')} long-lived connections, each "
      f"pinging 16 B every {m.get('interval_ms')} ms, and one transfer of {m.get('transfer_mib')} MiB paced at "
      f"{m.get('transfer_rate_mib')} MiB/s from {m.get('transfer_start_s')} s, echoed back and compared by sha256.")
    p()
    p("**What happened at each DNS change.** Times after the moment dnsmasq was sent SIGHUP with the new "
      "records. \"first connection at an added backend\" and \"last new connection at a removed backend\" "
      "are the backends' own accept times (echo_server --events, ns); \"relay logged it\" is the "
      "relay's `cluster web: A -> B backends` line (ms resolution). \"live on removed\": connections "
      "the removed backends still held then (their own count), which must finish there.")
    p()
    p("| balance | DNS change | at | dig saw it | relay logged it | first connection at an added backend "
      "| last new connection at a removed backend | accepted by removed backends after the log line "
      "| live on removed | last of them closed at |")
    p("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    analyses = {}
    for run in runs:
        ch = run.changes()
        res = []
        for i, (t, frm, to, dig_ms, dig_tries) in enumerate(ch):
            t_next = ch[i + 1][0] if i + 1 < len(ch) else None
            r = analyse_change(run, t, frm, to, dig_ms, dig_tries, t_next)
            res.append(r)
            added = ", ".join("+" + a for a in r["added"])
            removed = ", ".join("−" + a for a in r["removed"])
            what = f"{change_label(frm, to)} ({'; '.join(x for x in (added, removed) if x)})"
            last_rm = r["last_removed_s"]
            last_rm_txt = "-" if last_rm is None else (
                fmt_ms(last_rm) if last_rm >= 0 else f"none after; last {fmt_ms(-last_rm)} before")
            acc_after = r["removed_accepts_after_log"]
            p(f"| {run.balance} | {what} | {r['at_s']:.2f} s | "
                f"{dig_text(dig_ms, dig_tries)} | {fmt_ms(r['relay_logged_s'])} | "
              f"{fmt_ms(r['first_new_s'])} | {last_rm_txt if r['removed'] else 'n/a'} | "
              f"{'n/a' if not r['removed'] else ('-' if acc_after is None else acc_after)} | "
              f"{r['live_on_removed'] if r['removed'] else 'n/a'} | "
              f"{fmt_s(r['last_removed_close_at_s']) if r['removed'] and r['live_on_removed'] else 'n/a'} |")
        analyses[run.balance] = res
    p()
    p(f"Expected: every delay within one refresh ({first.meta.get('refresh_expected')}) plus a query; "
      "the relay asks on its own timer, so where in that window a change lands is chance.")
    p()

    p("**What the clients saw.** Failures are connection refusals, resets, early EOFs, timeouts and echo "
      "mismatches, from all three kinds of connection (expected 0). Ping round trips are the sessions' and "
      "long connections' 16 B messages.")
    p()
    p("| balance | short ok / failed (skipped) | sessions ok / failed | long ok / failed | pings "
      "| failures: refused, reset, early EOF, timeout, mismatch, other | short p99 / max | ping p99 / max "
      "| transfer | byte-exact (sha256) |")
    p("|---|--:|--:|--:|--:|---|--:|--:|---|---|")
    bad = 0
    for run in runs:
        c = run.client or {}
        tr = run.transfer or {}
        exact = run.transfer_exact()
        fails = c.get("failures")
        if not c or fails:
            bad += 1
        if not exact:
            bad += 1
        big = None
        best = 0
        for addr in run.backends:
            v = max([x for (_, x) in run.series("bytes_up", run.key(addr))] or [0])
            if v > best:
                best, big = v, addr
        tr_txt = (f"{tr.get('bytes_received', 0) / 1048576:,.0f} of {tr.get('bytes_sent', 0) / 1048576:,.0f} MiB back "
                  f"in {tr.get('seconds', 0):.1f} s ({tr.get('mib_per_s', 0):.1f} MiB/s), "
                  f"longest wait {tr.get('max_recv_gap_ms', 0):.0f} ms"
                  + (f", via {big}" if big else "")
                  + (f"; **{tr.get('error')}**" if tr.get("error") else "")) if tr else "**no result**"
        sha = ("yes" if exact else "**NO**") + (f" ({run.sha_in[:12]}…)" if run.sha_in else "")
        if not c:
            p(f"| {run.balance} | **no client result** | | | | | | | {tr_txt} | {sha} |")
            continue
        p(f"| {run.balance} | {c['short_ok']:,} / {c['short_failed']} ({c['short_skipped']}) | "
          f"{c['sessions_ok']:,} / {c['sessions_failed']} | {c['long_ok']} / {c['long_failed']} | {c['pings']:,} | "
          f"{'**' if fails else ''}{c['refused']}, {c['reset']}, {c['early_eof']}, {c['timeout']}, {c['mismatch']}, "
          f"{c['other']}{'**' if fails else ''} | {c['short_p99_us'] / 1000:.1f} / {c['short_max_us'] / 1000:.1f} ms | "
          f"{c['ping_p99_us'] / 1000:.1f} / {c['ping_max_us'] / 1000:.1f} ms | {tr_txt} | {sha} |")
    p()
    p("A client that stopped without a result, any failure, or a transfer that is not byte-exact makes "
      "the script exit 1. Where there were failures, each is listed with its time in the run's client.err.")
    p()
    p("**Stalls around the changes.** The slowest short connection (connect to echo) and ping in the second "
      "after the relay applied each change, against the rest of the load, with the longest gap between two "
      "turns of the client's own event loop in the same time (it waits at most 5 ms: a gap as long as a "
      "latency spike means the load's CPU did not run the client, not that the relay held the connections). "
      "\"other CPU\": what processes outside this bench used meanwhile, in % of one CPU.")
    p()
    p("| balance | when | slowest short connection | slowest ping | client loop gap | other CPU |")
    p("|---|---|--:|--:|--:|--:|")
    for run in runs:
        for j, (label, w) in enumerate(latency_windows(run)):
            oc = f"{run.meta.get('other_cpu_pct', '-')} %" if j == 0 else ""
            if w is None:
                p(f"| {run.balance} | {label} | - | - | - | {oc} |")
                continue
            p(f"| {run.balance} | {label} | {w[0] / 1000:.1f} ms | {w[1] / 1000:.1f} ms | {w[2] / 1000:.1f} ms | {oc} |")
    p()

    p("**Connections per backend, per phase** (the second half of each phase, so the moves have settled): "
      "active connections as the relay reports them (`zcrelay_backend_connections_active`, mean of the "
      "250 ms samples) / as the backend counts them itself / new connections per second at the backend. "
      "The relay drops a backend's series when it leaves DNS (docs/configuring.md: \"Its metric series go with it\"), "
      "so a removed backend's live connections show only in the backend's own count (the relay's "
      "`zcrelay_connections_active{listener}` still counts them).")
    p()
    for run in runs:
        p(f"{run.balance}:")
        p()
        p("| phase | in DNS | " + " | ".join(run.backends) + " | listener active (relay) |")
        p("|---|---|" + "--:|" * len(run.backends) + "--:|")
        for i, a, b, dset, cells in phase_table(run):
            lst = [v for (t, v) in run.series("listener_active", "web") if run.t0 + (a + b) / 2 <= t <= run.t0 + b]
            row = []
            for addr in run.backends:
                rel, own, rate = cells[addr]
                row.append(f"{'–' if rel is None else f'{rel:.1f}'} / {'-' if own is None else f'{own:.1f}'} / "
                           f"{'-' if rate is None else f'{rate:.0f}'}")
            tail = f" | {statistics.mean(lst):.1f} |" if lst else " | - |"
            p(f"| {a:.0f}–{b:.0f} s | {len(dset)} | " + " | ".join(row) + tail)
        p()
    p("– : no series for that backend in the relay's /metrics then (not in its set).")
    p()

    # Cross-check: relay's connections_total per backend vs the backend's accepts, for backends in
    # the set at the end (a removed backend's counter is gone with its series).
    p("**Relay counters against the backends' own counts** (backends in the set at the end of the run: "
      "`zcrelay_backend_connections_total` at the last scrape; the others' series left with them), and "
      "DNS resolutions during the run (`zcrelay_discovery_resolutions_total`):")
    p()
    p("| balance | backend | relay's connections_total | backend's accepts | resolutions ok | failed | scrapes failed |")
    p("|---|---|--:|--:|--:|--:|--:|")
    for run in runs:
        last_set = run.dns[-1][2] if run.dns else []
        res = run.metrics.get("resolutions", {})
        ok = res.get("success", [])
        ok_n = (ok[-1][1] - ok[0][1]) if len(ok) >= 2 else None
        fail_n = 0
        for lbl, pts in res.items():
            if lbl != "success" and len(pts) >= 2:
                fail_n += pts[-1][1] - pts[0][1]
        for j, addr in enumerate(last_set):
            rel = run.last_value("total", run.key(addr))
            acc = sum(1 for (_, s) in run.events.get(addr, []) if s > 0)
            extra = (f" | {ok_n:.0f} | {fail_n:.0f} | {run.scrape_errors} |" if j == 0 else " | | | |")
            p(f"| {run.balance} | {addr} | {'-' if rel is None else f'{rel:.0f}'} | {acc}" + extra)
    p()

    for run in runs:
        rec = {"bench": "discovery", "workload": "scale", "balance": run.balance,
               "quick": int(quick), "host": host, "kernel": kernel,
               "load_seconds": run.meta.get("load_seconds"), "refresh": run.meta.get("refresh_expected"),
               "changes": [{k: v for k, v in r.items() if k not in ("relay_line",)}
                           for r in analyses.get(run.balance, [])],
               "client": run.client, "transfer": run.transfer,
               "transfer_exact": run.transfer_exact(), "sha256": run.sha_in,
               "scrape_errors": run.scrape_errors,
               "other_cpu_pct": run.meta.get("other_cpu_pct"),
               "latency_windows_us": [{"when": l, "short_max": w[0], "ping_max": w[1], "loop_gap_max": w[2]}
                                      for l, w in latency_windows(run) if w],
               "samples": os.path.relpath(run.dir, os.path.dirname(out_records.name))}
        out_records.write(json.dumps(rec) + "\n")
    return bad


# --------------------------------------------------------------------------- conn rate

def read_samples(d, side, key):
    try:
        with open(os.path.join(d, f"{side}.{key}")) as f:
            return [float(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def connrate_report(d, quick, host, kernel, meta, out_records):
    p = print
    sys.path.insert(0, HERE)
    import stats  # bench/stats.py: ministat's Student's t comparison

    def s3(xs):
        return (statistics.median(xs), min(xs), max(xs)) if xs else None

    def f(v, digits=0):
        return "-" if v is None else f"{v:,.{digits}f}"

    p("#### 2. What discovery costs the connection rate")
    p()
    p(f"`conn_rate --conns 50`: connect, 64 B echoed, close; {meta.get('connrate_seconds')} s a run, "
      f"{meta.get('connrate_runs')} runs per side, interleaved (static first in odd rounds, discovery first "
      f"in even ones), a fresh relay each run. Both sides: the same 4 echo_server backends on "
      f"127.0.0.2–5:{meta.get('backend_port')} (--close-after 64), balance {meta.get('connrate_balance')}, "
      f"mode splice, 1 worker, metrics on (scraped only before and after the run). **static**: "
      f"`backends:` listing the 4; **discovery**: `discovery: {{dns: web.test, port: "
      f"{meta.get('backend_port')}, refresh_min: 1s}}` with the 4 in DNS at TTL 1 s, so it asks every "
      f"second during the run. Relay CPU: utime+stime of the relay process (all threads, the DNS thread "
      f"included) over the run, per completed connection.")
    p()
    rows = [("conn/s", "conns_per_s", 0, True), ("relay CPU µs/conn", "relay_cpu_us_per_conn", 2, False),
            ("connection p99 µs", "p99_us", 0, False)]
    p("| metric | static median | min | max | discovery median | min | max | discovery/static | range | "
      "discovery − static, mean ± 95% t | runs static/discovery |")
    p("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    verdicts = []
    for label, key, dg, higher in rows:
        a_x, b_x = read_samples(d, "static", key), read_samples(d, "discovery", key)
        a, b = s3(a_x), s3(b_x)
        if not a or not b:
            p(f"| {label} | " + " | ".join(["-"] * 9) + f" | {len(a_x)}/{len(b_x)} |")
            continue
        ratio = b[0] / a[0] if a[0] else float("nan")
        worst = b[1] / a[2] if higher else b[2] / a[1]
        best = b[2] / a[1] if higher else b[1] / a[2]
        lo, hi = sorted((worst, best))
        t_txt, ci = "-", None
        if len(a_x) >= 2 and len(b_x) >= 2:
            c = stats.compare(a_x, b_x, 95)
            t_txt = f"{c['percent']:+.2f}% ± {c['percent_halfwidth']:.2f}%"
            ci = (c["percent"] - c["percent_halfwidth"], c["percent"] + c["percent_halfwidth"])
        overlap = b[1] <= a[2] and a[1] <= b[2]
        p(f"| {label} | {f(a[0], dg)} | {f(a[1], dg)} | {f(a[2], dg)} | {f(b[0], dg)} | {f(b[1], dg)} | "
          f"{f(b[2], dg)} | {ratio:.4f} | {lo:.3f}–{hi:.3f} | {t_txt} | {len(a_x)}/{len(b_x)} |")
        verdicts.append((label, ratio, overlap, ci))
        out_records.write(json.dumps({
            "bench": "discovery", "workload": "connrate", "metric": label, "key": key,
            "static": {"median": a[0], "min": a[1], "max": a[2], "n": len(a_x)},
            "discovery": {"median": b[0], "min": b[1], "max": b[2], "n": len(b_x)},
            "ratio": ratio, "ratio_range": [lo, hi],
            "t95_pct": None if ci is None else [ci[0], ci[1]],
            "quick": int(quick), "host": host, "kernel": kernel}) + "\n")
    p()
    p("discovery/static: ratio of the medians. range: discovery's worst run against static's best, and its "
      "best against static's worst (if it excludes 1, no run of one side beat any run of the other). "
      "discovery − static: difference of the means in % of static's mean, with its 95% Student's t half-width "
      "(bench/stats.py compare -c 95).")
    p()
    errs = {s: sum(read_samples(d, s, "errors")) for s in ("static", "discovery")}
    res = read_samples(d, "discovery", "resolutions")
    resf = read_samples(d, "discovery", "resolution_failures")
    gens = read_samples(d, "discovery", "generation_changes")
    oth = {s: read_samples(d, s, "other_cpu_pct") for s in ("static", "discovery")}
    fails = meta.get("connrate_failed_runs", 0)
    p(f"conn_rate errors: static {errs['static']:.0f}, discovery {errs['discovery']:.0f}. "
      f"Resolutions during each discovery run: {', '.join(f'{x:.0f}' for x in res) or '-'} "
      f"(failed: {sum(resf):.0f}; config generations built during the runs: {sum(gens):.0f}, expected 0 "
      f"since the answer never changed). Failed runs: {fails}. Processes outside this bench used "
      + ", ".join(f"{s} {'/'.join(f'{x:.0f}' for x in oth[s]) or '-'}" for s in ("static", "discovery"))
      + " % of a CPU during each run (a shared machine: read the rates with that).")
    p()
    for label, ratio, overlap, ci in verdicts:
        if label != "conn/s" and label != "relay CPU µs/conn":
            continue
        v = "within noise (the min–max ranges overlap)" if overlap else "**outside noise** (the ranges do not overlap)"
        if ci and ci[0] <= 0 <= ci[1]:
            v += "; the 95% t interval includes 0"
        elif ci:
            v += f"; the 95% t interval excludes 0 ({ci[0]:+.2f}% to {ci[1]:+.2f}%)"
        p(f"- **{label}**: discovery/static {ratio:.3f}: {v}.")
    p()
    return int(errs["static"] + errs["discovery"] > 0)


def cmd_report(samples, jsonl, meta_kv):
    meta = read_json(os.path.join(samples, "meta.json"), {})
    for kv in meta_kv:
        k, _, v = kv.partition("=")
        meta[k] = v
    quick = int(meta.get("quick", 0))
    host, kernel = meta.get("host", "?"), meta.get("kernel", "?")
    runs = []
    for name in sorted(os.listdir(samples)):
        if name.startswith("scale-") and os.path.isdir(os.path.join(samples, name)):
            run = ScaleRun(os.path.join(samples, name))
            if run.t0 is not None:
                runs.append(run)
    order = {"least_conn": 0, "round_robin": 1}
    runs.sort(key=lambda r: order.get(r.balance, 9))
    with open(jsonl, "a") as out:
        bad = scale_report(runs, quick, host, kernel, out)
        cr = os.path.join(samples, "connrate")
        if os.path.isdir(cr):
            bad += connrate_report(cr, quick, host, kernel, meta, out)
        else:
            print("(no connection-rate runs)")
    return 0 if not bad else 3


# --------------------------------------------------------------------------- plot data

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f"]


def cmd_plotdata(d, outdir):
    run = ScaleRun(d)
    os.makedirs(outdir, exist_ok=True)
    if run.t0 is None or not run.sample_times:
        print("discovery.py: no samples to plot in " + d, file=sys.stderr)
        return 1
    data = os.path.join(d, f"scale-{run.balance}.dat")
    bin_s = 0.5
    with open(data, "w") as f:
        f.write("# t_s listener_active " + " ".join(
            f"{a}:relay {a}:own {a}:new_per_s" for a in run.backends) + "\n")
        for t in run.sample_times:
            cols = [f"{t - run.t0:.3f}"]
            la = [v for (tt, v) in run.series("listener_active", "web") if tt == t]
            cols.append(f"{la[0]:.0f}" if la else "NaN")
            for a in run.backends:
                rel = [v for (tt, v) in run.series("active", run.key(a)) if tt == t]
                own = run.backend_active_at(a, t)
                acc = sum(1 for (te, s) in run.events.get(a, []) if s > 0 and t - bin_s < te <= t)
                cols += [f"{rel[0]:.0f}" if rel else "NaN", str(own), f"{acc / bin_s:.1f}"]
            f.write(" ".join(cols) + "\n")
    tl = os.path.join(d, f"scale-{run.balance}.timeline.dat")
    with open(tl, "w") as f:
        f.write("# t_s short_max_ms ping_max_ms client_loop_gap_ms (per 100 ms)\n")
        for r in run.timeline:
            if r[0] <= run.meta.get("load_seconds", 1e9) + 0.5:
                sh = f"{r[3] / 1000:.3f}" if r[2] else "NaN"
                pg = f"{r[5] / 1000:.3f}" if r[4] else "NaN"
                f.write(f"{r[0]:.1f} {sh} {pg} {max(r[7], 1) / 1000:.3f}\n")
    marks = [(c[0] - run.t0, f"DNS: {len(c[2])} backend{'s' if len(c[2]) != 1 else ''}") for c in run.changes()]
    svg = os.path.join(outdir, f"scale-{run.balance}.svg")
    vars_file = os.path.join(d, f"scale-{run.balance}.vars.gp")
    m = run.meta
    title = (f"zcrelay, backends from DNS ({run.balance}): {len(run.dns[0][2]) if run.dns else '?'} → "
             + " → ".join(str(len(c[2])) for c in run.changes())
             + f" backends; {m.get('rate')} short conn/s + {m.get('sessions')} sessions + {m.get('long')} long + 1 transfer"
             + f" — {m.get('host', '')} {m.get('date', '')}" + (" (--quick)" if m.get("quick") else ""))

    def q(s):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
    with open(vars_file, "w") as f:
        f.write(f"datafile = {q(data)}\ntlfile = {q(tl)}\noutfile = {q(svg)}\ncharttitle = {q(title)}\n")
        f.write(f"nb = {len(run.backends)}\nnames = {q(' '.join(run.backends))}\n")
        f.write(f"colors = {q(' '.join(COLORS[i % len(COLORS)] for i in range(len(run.backends))))}\n")
        f.write(f"nmarks = {len(marks)}\nmarkx = {q(' '.join(f'{x:.3f}' for x, _ in marks))}\n")
        for k, (_, label) in enumerate(marks, 1):
            f.write(f"marklabel{k} = {q(label)}\n")
        f.write(f"xmax = {m.get('load_seconds', 30) + 1}\n")
    print(vars_file)
    return 0


def main(argv):
    if len(argv) >= 3 and argv[1] == "sample":
        args = argv[2:]
        url, out = args[0], args[1]
        interval = float(args[args.index("--interval") + 1]) if "--interval" in args else 0.25
        seconds = float(args[args.index("--seconds") + 1]) if "--seconds" in args else 60
        return cmd_sample(url, out, interval, seconds)
    if len(argv) >= 3 and argv[1] == "report":
        args = argv[2:]
        jsonl = args[args.index("--jsonl") + 1]
        meta = [args[i + 1] for i, a in enumerate(args) if a == "--meta"]
        return cmd_report(args[0], jsonl, meta)
    if len(argv) == 4 and argv[1] == "plotdata":
        return cmd_plotdata(argv[2], argv[3])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
