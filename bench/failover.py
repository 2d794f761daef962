#!/usr/bin/env python3
"""Clients across a Patroni switchover and a kill -9 of the primary: zcrelay against HAProxy
with Patroni's reference config, in the same run.

Usage: bench/failover.py [ROUNDS (5)] [--modes splice,copy,sockmap] [--out FILE]
       (environment: ROUNDS, MODES; ZCRELAY_BUILD picks the build dir, <repo>/build)

Each run is one case of the integration tests, `Modes/PatroniFailover.ClientsFollowTheLeader
AndNoneStaysOnADemotedPrimary/MODE` (tests/integration/patroni_test.cpp): etcd and two
PostgreSQL 15 nodes under Patroni, synchronous mode, on loopback; zcrelay in front (HTTP check
OPTIONS /primary on the REST port, interval 500 ms, fall 2, rise 1, timeout 1 s,
on_marked_down: shutdown_sessions) and HAProxy beside it with the same timing; a probe session
and a writer session through each; `patronictl switchover`, then a kill -9 of the new primary's
postmaster. The case prints one line per relay, which this script parses:

  [ failover zcrelay splice ] probe on a non-primary at most 0.000 s (bound 2.0 s); no write for
  3.134 s across the switchover, 3.139 s across the kill -9; acked 325, lost 0 at the switchover
  (synchronous mode), 0 at the kill; probe reconnects 5

Both relays see the same cluster events in the same run, so they are compared within a run;
the modes are interleaved (splice, copy, sockmap in round 1, and so on) so that drift of the
machine does not favour one. Each run is, from <build>/tests:

  timeout 180 unshare -n bash -c 'ip link set lo up; exec <build>/tests/integration_tests
                                  --gtest_filter=...'

one at a time, never in parallel: they measure timing. Before each run it waits, polling every
15 s, until no ctest and no `cmake --build` runs, so that it does not measure beside a test
suite or a build.

A run passes when the case exits 0 (its assertions are zcrelay's only: the probe bound, no
write lost at the switchover, writes resumed). The figures of every run that printed its lines
are counted, passed or failed, so that a failure's numbers are not hidden; a run that printed
none (set-up failed, timeout) is listed with its reason and counted nowhere.

The outages come in steps of about 3 s: the case's writer sees a failed session open only at
its 3 s timeout (PsqlSession::open holds psql's stdout pipe open until it returns), so they do
not time a relay's move to the new primary; bench/results/2026-11-29-vm-failover.md has why.

stdout and --out (default bench/results/<date>-<host>-failover.md): the host, the command, a
Markdown table per mode (median, min and max per relay, HAProxy/zcrelay of the median outages,
totals of lost writes), every run with its result, and the printed lines. stderr: progress.
Each run's full output stays in a temporary directory (its path is printed).

Loopback only, in the runs' own network namespaces. Whatever a run leaves behind in them (a
timed-out case cannot stop its cluster) is reported and killed by pid.
"""
import argparse
import hashlib
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CASE = "Modes/PatroniFailover.ClientsFollowTheLeaderAndNoneStaysOnADemotedPrimary/"
RELAYS = ("zcrelay", "haproxy")
RUN_TIMEOUT = 180   # s per run; a run takes about 35 s
POLL_IDLE = 15      # s between looks for a running ctest or build

LINE_RX = re.compile(
    r"\[ failover (\S+) (\S+) \] probe on a non-primary at most (-?[\d.]+) s \(bound ([\d.]+) s\); "
    r"no write for (-?[\d.]+) s across the switchover, (-?[\d.]+) s across the kill -9; "
    r"acked (\d+), lost (\d+) at the switchover \(synchronous mode\), (\d+) at the kill; "
    r"probe reconnects (\d+)")


def log(msg):
    print(f"[{time.strftime('%T')}] {msg}", file=sys.stderr, flush=True)


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def sha(path):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "missing"


def pgrep(*args):
    r = subprocess.run(["pgrep", *args], capture_output=True, text=True)
    return r.stdout.strip()


def busy():
    """What runs that this bench must not measure beside: ctest, or a build."""
    what = []
    if pgrep("-x", "ctest"):
        what.append("ctest")
    if pgrep("-f", r"cmake --build"):
        what.append("cmake --build")
    return what


def wait_idle():
    waited = 0
    while True:
        what = busy()
        if not what:
            return waited
        if waited == 0 or waited % 300 == 0:
            log(f"waiting: {' and '.join(what)} running (every {POLL_IDLE} s)")
        time.sleep(POLL_IDLE)
        waited += POLL_IDLE


def netns(pid):
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def child_of(pid):
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    return int(d)
        except (OSError, IndexError, ValueError):
            continue
    return None


class RunNamespaces(threading.Thread):
    """The network namespaces a run's case lives in: unshare's, then the one the case's main
    moves itself into (tests/support/netns.hpp). Nothing else is in them, so after the run
    whatever is left there is the run's own. Not a subreaper: Patroni waits for its detached
    postmaster to be gone, and a zombie reparented to a parent that does not reap it at once
    kept a switchover's demotion "in progress" for a minute."""

    def __init__(self, timeout_pid):
        super().__init__(daemon=True)
        self.timeout_pid, self.seen, self.done = timeout_pid, set(), threading.Event()
        self.start()

    def run(self):
        mine, case = netns(os.getpid()), None
        while not self.done.is_set():
            case = case or child_of(self.timeout_pid)
            ns = netns(case) if case else None
            if ns and ns != mine:
                self.seen.add(ns)
                if len(self.seen) == 2:
                    return
            self.done.wait(0.05)

    def leftovers(self):
        self.done.set()
        self.join()
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit() and netns(int(d)) in self.seen:
                out.append(int(d))
        return out


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def clean_up_after_run(spaces):
    """The processes still in the run's namespaces once the case has exited, SIGKILLed by pid.
    A postgres backend may still be on its way out when the case returns, so 2 s first."""
    deadline = time.monotonic() + 2
    while spaces.leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = spaces.leftovers()
    names = [f"{p} {cmdline(p)}" for p in left]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return names


def failure_reasons(out):
    """gtest's failure messages: the lines after each 'FILE:LINE: Failure', up to 3 each."""
    lines = out.splitlines()
    reasons = []
    for i, line in enumerate(lines):
        if line.endswith(": Failure"):
            msg = []
            for x in lines[i + 1:i + 4]:
                if not x.strip() or x.startswith("[") or x.endswith(": Failure"):
                    break
                msg.append(x.strip())
            msg = " / ".join(msg)
            reasons.append(msg[:300])
    return reasons


def run_case(build, mode, logdir, rnd):
    tests = os.path.join(build, "tests")
    binary = os.path.join(tests, "integration_tests")
    inner = f"ip link set lo up; exec {binary} --gtest_filter={CASE}{mode}"
    argv = ["timeout", str(RUN_TIMEOUT), "unshare", "-n", "bash", "-c", inner]
    rec = {"mode": mode, "round": rnd, "start": time.strftime("%T"), "load": loadavg(),
           "relay_sha": sha(os.path.join(build, "zcrelay")), "tests_sha": sha(binary)}
    t = time.monotonic()
    proc = subprocess.Popen(argv, cwd=tests, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")
    spaces = RunNamespaces(proc.pid)
    try:
        stdout, _ = proc.communicate()
    finally:
        if proc.poll() is None:   # this script was stopped: the run goes too
            proc.terminate()       # timeout passes it on to the case
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        rec["left"] = clean_up_after_run(spaces)
    r = subprocess.CompletedProcess(argv, proc.returncode, stdout)
    rec["seconds"] = time.monotonic() - t
    rec["rc"] = r.returncode
    path = os.path.join(logdir, f"r{rnd}-{mode}.log")
    with open(path, "w") as f:
        f.write(r.stdout)
    rec["log"] = path
    rec["lines"] = {}
    rec["raw"] = []
    for m in LINE_RX.finditer(r.stdout):
        who, m_mode = m.group(1), m.group(2)
        if m_mode != mode or who not in RELAYS:
            continue
        rec["raw"].append(m.group(0))
        rec["lines"][who] = {
            "probe": float(m.group(3)), "bound": float(m.group(4)),
            "switch": float(m.group(5)), "kill": float(m.group(6)),
            "acked": int(m.group(7)), "lost_switch": int(m.group(8)),
            "lost_kill": int(m.group(9)), "reconnects": int(m.group(10))}
    ok_marker = f"[       OK ] {CASE}{mode}" in r.stdout
    rec["passed"] = r.returncode == 0 and ok_marker
    if rec["passed"]:
        rec["result"] = "pass"
    elif r.returncode == 124:
        rec["result"] = f"timeout ({RUN_TIMEOUT} s)"
    else:
        reasons = failure_reasons(r.stdout)
        rec["result"] = f"fail (exit {r.returncode})" + (": " + reasons[0] if reasons else "")
        if len(reasons) > 1:
            rec["result"] += f" (+{len(reasons) - 1} more)"
    return rec


def fmt(x, nd=2):
    return f"{x:.{nd}f}"


def spread(xs, nd=2):
    if not xs:
        return "–"
    return f"{fmt(statistics.median(xs), nd)} ({fmt(min(xs), nd)}–{fmt(max(xs), nd)})"


def outage_values(recs, who, key):
    """The outages printed; -1 (no write at all after the change, within its window) is kept
    apart: it is not a duration."""
    vals = [r["lines"][who][key] for r in recs if who in r["lines"]]
    return [v for v in vals if v >= 0], sum(1 for v in vals if v < 0)


def report(recs, modes, rounds, meta):
    out = []
    out.append(f"# Clients across a Patroni switchover and a kill -9, zcrelay against HAProxy: "
               f"{meta['date']}")
    out.append("")
    out.append(f"    {meta['command']}")
    out.append("")
    out.append(f"    host: {meta['host']}")
    out.append(f"    load average at start: {meta['load']}")
    out.append(f"    zcrelay at {meta['rev']}; binary sha256 {meta['relay_sha']} "
               f"({meta['relay_mtime']}); integration_tests sha256 {meta['tests_sha']}")
    out.append(f"    {meta['versions']}")
    out.append(f"    each run, from {meta['build']}/tests:")
    out.append(f"    timeout {RUN_TIMEOUT} unshare -n bash -c 'ip link set lo up; exec "
               f"{meta['build']}/tests/integration_tests --gtest_filter={CASE}MODE'")
    out.append(f"    took {meta['took']:.0f} s, of which {meta['waited']} s waiting for ctest or "
               f"a build to finish")
    out.append("")
    changed = sorted({(r["relay_sha"], r["tests_sha"]) for r in recs})
    if len(changed) > 1:
        out.append("**The binaries changed during the bench** (a build ran between runs): "
                   + "; ".join(f"zcrelay {a}, integration_tests {b}" for a, b in changed)
                   + ". Each run's pair is in the runs table.")
        out.append("")
    out.append(f"## Per mode ({rounds} runs each)")
    out.append("")
    out.append("| mode | relay | no write across the switchover, s | no write across the kill -9, "
               "s | probe on a non-primary, s | writes acked | lost at the switchover | lost at "
               "the kill | probe reconnects | runs counted (passed) |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        rs = [r for r in recs if r["mode"] == mode]
        meds = {}
        for who, label in (("zcrelay", "zcrelay"), ("haproxy", "HAProxy")):
            counted = [r for r in rs if who in r["lines"]]
            cells = []
            for key in ("switch", "kill"):
                vals, none = outage_values(rs, who, key)
                meds[(who, key)] = statistics.median(vals) if vals else None
                c = spread(vals)
                if none:
                    c += f"; no write at all in {none} run(s)"
                cells.append(c)
            probe = [r["lines"][who]["probe"] for r in counted]
            acked = sum(r["lines"][who]["acked"] for r in counted)
            ls = sum(r["lines"][who]["lost_switch"] for r in counted)
            lk = sum(r["lines"][who]["lost_kill"] for r in counted)
            rec_ = [r["lines"][who]["reconnects"] for r in counted]
            passed = sum(1 for r in counted if r["passed"])
            out.append(f"| {mode} | {label} | {cells[0]} | {cells[1]} | {spread(probe)} | "
                       f"{acked} | {ls} | {lk} | {spread(rec_, 0)} | {len(counted)} ({passed}) |")
        ratio = []
        for key in ("switch", "kill"):
            z, h = meds[("zcrelay", key)], meds[("haproxy", key)]
            ratio.append(f"{h / z:.2f}×" if z and h is not None else "–")
        out.append(f"| {mode} | HAProxy / zcrelay | {ratio[0]} | {ratio[1]} | | | | | | |")
    out.append("")
    out.append("Median (min–max) over the runs that printed their lines; writes acked and lost "
               "are totals over them. *No write across*: the longest time without an "
               "acknowledged INSERT from the change (the `patronictl switchover` call, the kill) "
               "to the first write after it, or between writes after it, until the next change "
               "(the kill) or the end of the case. *Probe on a non-primary*: the longest run of "
               "`pg_is_in_recovery()` = `t` answers on the probe session from the switchover on. "
               "*Lost*: INSERTs whose commit the writer saw, missing from the table on the final "
               "primary, by the side of the kill they were acknowledged on. HAProxy / zcrelay: "
               "the ratio of the medians. A run passes when the case exits 0; its assertions "
               "hold zcrelay only.")
    out.append("")
    out.append("## Every run")
    out.append("")
    out.append("| round | mode | start | load avg | s | result | zcrelay: switchover / kill / "
               "probe s; acked; lost | HAProxy: switchover / kill / probe s; acked; lost | "
               "left behind |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for r in recs:
        cells = []
        for who in RELAYS:
            v = r["lines"].get(who)
            cells.append("no line" if v is None else
                         f"{fmt(v['switch'], 3)} / {fmt(v['kill'], 3)} / {fmt(v['probe'], 3)}; "
                         f"{v['acked']}; {v['lost_switch']}+{v['lost_kill']}")
        left = f"{len(r['left'])} (killed)" if r["left"] else "0"
        out.append(f"| {r['round']} | {r['mode']} | {r['start']} | {r['load']} | "
                   f"{r['seconds']:.0f} | {r['result'].replace('|', '/')} | {cells[0]} | "
                   f"{cells[1]} | {left} |")
    out.append("")
    if len(changed) > 1:
        out.append("Binaries per run: " + "; ".join(
            f"r{r['round']} {r['mode']}: {r['relay_sha']}/{r['tests_sha']}" for r in recs))
        out.append("")
    lefts = [(r, p) for r in recs for p in r["left"]]
    if lefts:
        out.append("Processes a run left behind (killed by pid after it):")
        out.append("")
        for r, p in lefts:
            out.append(f"- round {r['round']} {r['mode']}: {p}")
        out.append("")
    out.append("## The lines the runs printed")
    out.append("")
    out.append("```")
    for r in recs:
        out.append(f"# round {r['round']} {r['mode']}: {r['result']}")
        out.extend(r["raw"] or ["(none)"])
    out.append("```")
    return "\n".join(out) + "\n"


def git_rev():
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def version(argv, stream="stdout", line=0):
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return (getattr(r, stream).strip().splitlines() or ["?"])[line]
    except (OSError, subprocess.SubprocessError):
        return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rounds", nargs="?", type=int, default=int(os.environ.get("ROUNDS", "5")))
    ap.add_argument("--modes", default=os.environ.get("MODES", "splice,copy,sockmap"))
    ap.add_argument("--out")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    build = os.path.abspath(os.environ.get("ZCRELAY_BUILD", os.path.join(REPO, "build")))
    binary = os.path.join(build, "tests", "integration_tests")
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"failover.py: {binary} is missing (build the tests)")
    date, host = time.strftime("%F"), socket.gethostname().split(".")[0]
    out_path = args.out or os.path.join(HERE, "results", f"{date}-{host}-failover.md")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logdir = tempfile.mkdtemp(prefix="zcrelay-failover-")
    log(f"each run's output goes to {logdir}")
    cpu = version(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"])
    meta = {
        "date": date,
        "command": "bench/failover.py " + str(args.rounds) +
                   ("" if args.modes == "splice,copy,sockmap" else f" --modes {args.modes}"),
        "host": f"{host}; Linux {os.uname().release}; nproc {os.cpu_count()} ({cpu.strip()})",
        "load": loadavg(), "rev": git_rev(), "build": build,
        "relay_sha": sha(os.path.join(build, "zcrelay")),
        "relay_mtime": time.strftime("built %F %T UTC", time.gmtime(
            os.path.getmtime(os.path.join(build, "zcrelay")))),
        "tests_sha": sha(binary),
        "versions": "; ".join([
            version(["patroni", "--version"]), version(["haproxy", "-v"]).split(" - ")[0],
            version(["etcd", "--version"]), version(["psql", "--version"])]),
    }
    recs, waited = [], 0
    t0 = time.monotonic()
    for rnd in range(1, args.rounds + 1):
        for mode in modes:
            waited += wait_idle()
            log(f"round {rnd}/{args.rounds} {mode}: load {loadavg()}")
            r = run_case(build, mode, logdir, rnd)
            recs.append(r)
            zc, ha = r["lines"].get("zcrelay"), r["lines"].get("haproxy")
            brief = ", ".join(
                f"{who} {v['switch']:.3f}/{v['kill']:.3f} s lost {v['lost_switch']}+"
                f"{v['lost_kill']}" for who, v in (("zcrelay", zc), ("haproxy", ha)) if v)
            log(f"  {r['result']} in {r['seconds']:.0f} s; {brief or 'no lines'}"
                + (f"; left {len(r['left'])} processes (killed)" if r["left"] else ""))
    meta["took"], meta["waited"] = time.monotonic() - t0, waited
    text = report(recs, modes, args.rounds, meta)
    sys.stdout.write(text)
    with open(out_path, "w") as f:
        f.write(text)
    log(f"written to {out_path}; runs' output in {logdir}")
    return 0 if all(r["passed"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
