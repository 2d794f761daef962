#!/usr/bin/env python3
"""slow_start measured: the share of new connections a backend takes as it comes back, against
the configured ramp; zcrelay (round_robin, least_conn) and HAProxy's `slowstart` in the same run.

Usage: bench/slow_start.py [--slow-start S (10)] [--backends N (2)] [--no-haproxy]
                           [--out PREFIX (bench/results/<date>-<host>-slow-start)]
       (ZCRELAY_BUILD picks the build dir)

The zcrelay binary is copied at the start and that copy runs throughout (its sha256 is on the
host line), so a rebuild during the run does not mix binaries.

One helper process (this script with --serve) holds N TCP backends, a, b, c: each accepts,
sends its 1-byte tag and closes. Beside each is an HTTP check endpoint (GET /health) that
answers 200 or 503, as this script tells it over a pipe; it logs every answer with its time
(CLOCK_MONOTONIC, which every process here shares).

The ways, one after another, each on a fresh relay with one worker and one listener:
  zcrelay-round_robin  zcrelay, `workers: 1`, cluster `balance: round_robin`,
                       `slow_start: S`, health_check {interval: 100ms, timeout: 300ms, rise 1,
                       fall 1, http {path: /health, expect_status: "200"}}, each backend's
                       `check_address` its endpoint.
  zcrelay-least_conn   the same with `balance: least_conn`.
  haproxy-roundrobin   haproxy -db, nbthread 1, `balance roundrobin`, `option httpchk GET
                       /health`, `http-check expect status 200`, `server X ADDR check port C
                       inter 100ms fall 1 rise 1 slowstart Ss`, `timeout check 300ms`.
Per way: wait until every backend is up (zcrelay_backend_up from /metrics; HAProxy: `show
stat` on its stats socket), then b's endpoint answers 503 until the relay marks b down, then 200
again (each switch after a random part of the check interval, so that it does not always land
just after a check: the time to the next check is then what a backend's return would see). The
ramp's origin is the moment b's endpoint answered its first 200 after that switch:
with rise 1 that is the check that brings b up. From the moment the relay shows b up (polled
every 5 ms), short connections go through the relay in a paced loop, one every 5 ms, until
origin + S + 5 s: connect, read the tag byte and the EOF, close (2 s bound each). Each is placed
in a 250 ms window by its start, counted from the origin.

Expected share of b in a window (the mean over the window of the share at each instant):
  zcrelay   weight x ramp, ramp r = min(1, t / S) (at least 1/1000): with N equal-weight
            backends, round robin gives b r / (N - 1 + r). least_conn with short connections
            sees every backend idle at each pick, and its ties go through the same smooth
            weighted round robin, so the same; a connection still open at the next pick would
            steer that pick away from its backend.
  HAProxy   its own ramp (src/server.c, server_recalc_eweight): whole seconds since the server
            came up, k, re-evaluated every max(1 s, S/20); b's effective weight
            w = min(16, (16 k + S) // S) against 16 for the others (BE_WEIGHT_SCALE), so a
            staircase that starts at 1/S of full at once: w / (16 (N - 1) + w).

Before each way it waits until `pgrep -x ctest` and `pgrep -f "cmake --build"` print nothing
(polled every 15 s, at most SLOW_START_IDLE_WAIT s, default 1800; past that it measures anyway
and says so), and it looks again every second of the load. A way whose load saw one start, or
a gap over 50 ms between two connection starts (the client not run: the machine busy
elsewhere), is run again, at most twice, and listed.

stdout: the host line, the command and Markdown tables (with, per way, the load average at its
start and the share of all CPUs busy during its load, from /proc/stat); stderr: progress.
Files: PREFIX.csv (one row per way and window) and PREFIX.png (gnuplot: measured share of b
against the expected ramps, per way). Loopback only, every wait bounded; stops only the processes it
started, by pid.
"""
import argparse
import math
import os
import random
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import upgrade as U   # noqa: E402  bench/upgrade.py: importing it starts nothing
from upgrade import Tap, free_port, popen, stop   # noqa: E402

TAGS = "abc"
B = "b"                 # the backend that goes down and comes back
WINDOW = 0.25           # s per window
PACE = 0.005            # s between connection starts
TAIL = 5.0              # s of load after the ramp's end
CONN_TIMEOUT = 2.0      # s for one connection, connect to EOF
POLL = 0.005            # s between polls of the relay's view of b
CHECK_INTERVAL = 0.1    # s, both relays' health check interval
UP_TIMEOUT = 10.0       # s for every backend to be up after the start
MARK_TIMEOUT = 5.0      # s for the relay to mark b down, and up again
IDLE_POLL = 15.0        # s between looks for a running test suite
IDLE_WAIT = float(os.environ.get("SLOW_START_IDLE_WAIT", "1800"))
STALLED_MS = 50         # a longer gap between two connection starts: the way again
TRIES = 3               # at most, per way
HAPROXY_SCALE = 16      # HAProxy's BE_WEIGHT_SCALE: a weight-1 server's full effective weight
WAYS = ("zcrelay-round_robin", "zcrelay-least_conn", "haproxy-roundrobin")
HAPROXY = U.HAPROXY

mono = time.monotonic
log = U.log


def die(msg):
    raise SystemExit(f"slow_start.py: {msg}")


# --------------------------------------------------------------------------- backends (--serve)

def serve_main(tags, seconds):
    """The TCP backends and their HTTP check endpoints, in one selector loop. stdout: a line
    `backend TAG PORT CHECKPORT` per backend, then `ready`; then `set TAG STATUS T` when a
    command took effect, `check TAG STATUS T` per answer, `counts TAG=N ...` when asked.
    stdin: `set TAG 200|503`, `counts`, `quit`."""
    sel = selectors.DefaultSelector()
    status, accepted = {}, {}

    def listener():
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(4096)
        s.setblocking(False)
        return s

    def accept_all(sock):
        """Every connection the non-blocking listener has queued now."""
        while True:
            try:
                c, _ = sock.accept()
            except BlockingIOError:
                return
            yield c

    for tag in tags:
        t, h = listener(), listener()
        sel.register(t, selectors.EVENT_READ, ("tag", tag))
        sel.register(h, selectors.EVENT_READ, ("check", tag))
        status[tag], accepted[tag] = 200, 0
        print(f"backend {tag} {t.getsockname()[1]} {h.getsockname()[1]}")
    print("ready", flush=True)
    os.set_blocking(0, False)
    sel.register(0, selectors.EVENT_READ, ("stdin", None))
    pending = {}     # check connection -> (tag, bytes so far)
    inbuf = b""
    end = mono() + seconds
    while mono() < end:
        for key, _ in sel.select(0.5):
            kind, tag = key.data
            if kind == "tag":
                for c in accept_all(key.fileobj):
                    accepted[tag] += 1
                    try:
                        c.send(tag.encode())   # 1 byte into an empty socket buffer
                    except OSError:
                        pass
                    c.close()
            elif kind == "check":
                for c in accept_all(key.fileobj):
                    c.setblocking(False)
                    pending[c] = (tag, b"")
                    sel.register(c, selectors.EVENT_READ, ("req", tag))
            elif kind == "req":
                c = key.fileobj
                try:
                    got = c.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    got = b""
                t, so_far = pending[c]
                so_far += got
                if got and b"\r\n\r\n" not in so_far and len(so_far) < 8192:
                    pending[c] = (t, so_far)
                    continue
                sel.unregister(c)
                del pending[c]
                if got:
                    code = status[tag]
                    body = b"ok\n" if code == 200 else b"down\n"
                    reason = "OK" if code == 200 else "Service Unavailable"
                    try:
                        c.send(f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\n"
                               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                               .encode() + body)
                        print(f"check {tag} {code} {mono():.6f}", flush=True)
                    except OSError:
                        pass
                c.close()
            else:
                try:
                    chunk = os.read(0, 4096)
                except BlockingIOError:
                    continue
                if not chunk:
                    return
                inbuf += chunk
                while b"\n" in inbuf:
                    line, inbuf = inbuf.split(b"\n", 1)
                    words = line.decode().split()
                    if words[:1] == ["set"]:
                        status[words[1]] = int(words[2])
                        print(f"set {words[1]} {words[2]} {mono():.6f}", flush=True)
                    elif words[:1] == ["counts"]:
                        print("counts " + " ".join(f"{k}={v}" for k, v in accepted.items()),
                              flush=True)
                    elif words[:1] == ["quit"]:
                        return


class Backends:
    def __init__(self, n, seconds):
        self.tags = TAGS[:n]
        self.p = popen([sys.executable, os.path.abspath(__file__), "--serve", self.tags,
                        str(int(seconds))], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.tap = Tap(self.p.stdout)
        if self.tap.wait(r"^ready$", 0, 10) is None:
            die("the backends did not start")
        self.port, self.check = {}, {}
        for _, line in self.tap.lines:
            m = re.match(r"backend (\w) (\d+) (\d+)", line)
            if m:
                self.port[m[1]], self.check[m[1]] = int(m[2]), int(m[3])

    def say(self, line):
        self.p.stdin.write(line.encode() + b"\n")
        self.p.stdin.flush()

    def set(self, tag, code):
        mark = self.tap.mark()
        self.say(f"set {tag} {code}")
        got = self.tap.wait(rf"^set {tag} {code} ([\d.]+)$", mark, 5)
        if got is None:
            die("the backends did not take a command")
        return mark, float(got[2].group(1))

    def first_answer(self, tag, code, mark, after, timeout=MARK_TIMEOUT):
        got = self.tap.wait(rf"^check {tag} {code} ([\d.]+)$", mark, timeout)
        while got is not None and float(got[2].group(1)) < after:
            got = self.tap.wait(rf"^check {tag} {code} ([\d.]+)$", got[0] + 1, timeout)
        return None if got is None else float(got[2].group(1))

    def counts(self):
        mark = self.tap.mark()
        self.say("counts")
        got = self.tap.wait(r"^counts (.*)$", mark, 5)
        return {} if got is None else dict((kv.split("=")[0], int(kv.split("=")[1]))
                                           for kv in got[2].group(1).split())


# --------------------------------------------------------------------------- the relays

def read_all(s):
    """What the peer sends until it closes."""
    data = b""
    while True:
        b = s.recv(65536)
        if not b:
            return data
        data += b


def http_get(port, path, timeout=1.0):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                      .encode())
            data = read_all(s)
        return data.decode(errors="replace")
    except OSError:
        return ""


class Zcrelay:
    def __init__(self, tmp, balance, backends, slow_start):
        self.name = f"zcrelay-{balance}"
        self.bk = backends
        self.listen, self.metrics = free_port(), free_port()
        self.cfg = os.path.join(tmp, f"{self.name}.yaml")
        lines = ["workers: 1", f"metrics: {{listen: 127.0.0.1:{self.metrics}}}", "clusters:",
                 "  - name: ss", f"    balance: {balance}", f"    slow_start: {slow_start}s",
                 f"    health_check: {{interval: {CHECK_INTERVAL * 1000:.0f}ms, timeout: 300ms, "
                 "rise: 1, fall: 1, "
                 'http: {path: /health, expect_status: "200"}}', "    backends:"]
        for t in backends.tags:
            lines.append(f"      - {{address: 127.0.0.1:{backends.port[t]}, "
                         f"check_address: \"127.0.0.1:{backends.check[t]}\"}}")
        lines += ["listeners:", f"  - {{name: in, listen: 127.0.0.1:{self.listen}, cluster: ss}}"]
        with open(self.cfg, "w") as f:
            f.write("\n".join(lines) + "\n")
        r = subprocess.run([U.RELAY, "--check-config", self.cfg], capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            die(f"zcrelay --check-config {self.cfg} failed:\n{r.stdout}{r.stderr}")
        self.command = f"zcrelay -c {os.path.basename(self.cfg)}"

    def start(self):
        self.p = popen([U.RELAY, "-c", self.cfg], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out, self.err = Tap(self.p.stdout), Tap(self.p.stderr)
        if self.out.wait(r"^zcrelay: ready", 0, 10) is None:
            die(f"{self.name}: not ready within 10 s; its log:\n{self.err.text()}")

    def view(self):
        """{tag: (up, connections so far, slow-start ratio or None)} from /metrics."""
        text = http_get(self.metrics, "/metrics")
        got = {}
        for t in self.bk.tags:
            addr = re.escape(f"127.0.0.1:{self.bk.port[t]}")

            def value(name):
                m = re.search(rf'^{name}\{{[^}}]*backend="{addr}"[^}}]*\}} (\S+)$', text, re.M)
                return None if m is None else float(m.group(1))
            up = value("zcrelay_backend_up")
            if up is not None:
                got[t] = (up == 1, value("zcrelay_backend_connections_total") or 0,
                          value("zcrelay_backend_slow_start_ratio"))
        return got

    def log_text(self):
        return "\n".join(l for l in self.err.text().splitlines()
                         if re.match(r"\d{4}-\d\d-\d\dT", l))

    def close(self):
        stop(self.p.pid)
        rc = self.p.returncode
        return [] if rc in (0, None) else [f"zcrelay exited {rc}"]


class Haproxy:
    name = "haproxy-roundrobin"

    def __init__(self, tmp, backends, slow_start):
        self.bk = backends
        self.listen = free_port()
        self.sock = os.path.join(tmp, "haproxy.sock")
        self.cfg = os.path.join(tmp, "haproxy.cfg")
        servers = "".join(f"    server {t} 127.0.0.1:{backends.port[t]} check port "
                          f"{backends.check[t]}\n" for t in backends.tags)
        with open(self.cfg, "w") as f:
            f.write(f"""global
    nbthread 1
    maxconn 4000
    stats socket {self.sock} level admin
defaults
    mode tcp
    timeout connect 2s
    timeout client 10s
    timeout server 10s
    timeout check 300ms
frontend f
    bind 127.0.0.1:{self.listen}
    default_backend ss
backend ss
    balance roundrobin
    option httpchk GET /health
    http-check expect status 200
    default-server inter {CHECK_INTERVAL * 1000:.0f}ms fall 1 rise 1 slowstart {slow_start}s
{servers}""")
        r = subprocess.run([HAPROXY, "-c", "-f", self.cfg], capture_output=True, text=True,
                           timeout=30)
        if r.returncode != 0:
            die(f"haproxy -c -f {self.cfg} failed:\n{r.stdout}{r.stderr}")
        self.command = f"haproxy -f {os.path.basename(self.cfg)} -db"

    def start(self):
        self.p = popen([HAPROXY, "-f", self.cfg, "-db"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
        self.out, self.err = Tap(self.p.stdout), Tap(self.p.stderr)
        deadline = mono() + 10
        while mono() < deadline:
            if self.view():
                return
            time.sleep(0.05)
        die(f"haproxy not answering on its stats socket within 10 s:\n{self.err.text()}")

    def view(self):
        """{tag: (up, sessions so far, None)} from `show stat`."""
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(1.0)
                s.connect(self.sock)
                s.sendall(b"show stat\n")
                data = read_all(s)
        except OSError:
            return {}
        rows = data.decode(errors="replace").splitlines()
        if not rows or not rows[0].startswith("# "):
            return {}
        head = rows[0][2:].split(",")
        ix = {k: i for i, k in enumerate(head)}
        got = {}
        for row in rows[1:]:
            f = row.split(",")
            if len(f) <= ix["status"] or f[ix["pxname"]] != "ss":
                continue
            if f[ix["svname"]] in tuple(self.bk.tags):
                got[f[ix["svname"]]] = (f[ix["status"]].startswith("UP"),
                                        int(f[ix["stot"]] or 0), None)
        return got

    def log_text(self):
        return self.err.text() + self.out.text()

    def close(self):
        stop(self.p.pid)
        rc = self.p.returncode
        # haproxy -db exits 0 on SIGUSR1's soft stop and 130/143 on SIGTERM's hard stop.
        return [] if rc in (0, None, 130, 143, -15) else [f"haproxy exited {rc}"]


# --------------------------------------------------------------------------- one way

def cpu_times():
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v[:8]) - idle, sum(v[:8])


def busy():
    ctest = subprocess.run(["pgrep", "-x", "ctest"], capture_output=True, text=True).stdout
    build = subprocess.run(["pgrep", "-f", "cmake --build"], capture_output=True, text=True).stdout
    return ctest.strip() or build.strip()


def wait_idle():
    """Until no test suite or build runs (polled every 15 s, at most IDLE_WAIT s): the seconds
    waited and whether one still ran."""
    t0 = mono()
    while busy():
        if mono() - t0 > IDLE_WAIT:
            log(f"a test suite or build still runs after {IDLE_WAIT:.0f} s; measuring anyway")
            return mono() - t0, True
        log("a test suite or build runs (ctest / cmake --build); waiting 15 s")
        time.sleep(IDLE_POLL)
    return mono() - t0, False


def wait_view(relay, cond, timeout):
    deadline = mono() + timeout
    while mono() < deadline:
        v = relay.view()
        if v and cond(v):
            return mono(), v
        time.sleep(POLL)
    return None, relay.view()


def one_way(relay, bk, slow_start):
    r = {"way": relay.name, "command": relay.command, "problems": []}
    r["waited_s"], r["busy"] = wait_idle()
    r["loadavg"] = os.getloadavg()
    relay.start()
    try:
        t, v = wait_view(relay, lambda v: len(v) == len(bk.tags) and all(x[0] for x in v.values()),
                         UP_TIMEOUT)
        if t is None:
            die(f"{relay.name}: not every backend up within {UP_TIMEOUT} s: {v}\n"
                + relay.log_text())
        # b down: its endpoint answers 503 until the relay marks it down. Each switch waits a
        # random part of the check interval first: right after the relay's start or its mark,
        # a switch would always land just after a check and wait a whole interval for the next.
        time.sleep(random.uniform(0, CHECK_INTERVAL))
        _, t_503 = bk.set(B, 503)
        t_down, v = wait_view(relay, lambda v: B in v and not v[B][0], MARK_TIMEOUT)
        if t_down is None:
            die(f"{relay.name}: b not marked down within {MARK_TIMEOUT} s\n" + relay.log_text())
        # b back: 200 again; the first 200 b's endpoint answers brings it up (rise 1).
        time.sleep(random.uniform(0, CHECK_INTERVAL))
        mark, t_switch = bk.set(B, 200)
        t_seen, v = wait_view(relay, lambda v: B in v and v[B][0], MARK_TIMEOUT)
        if t_seen is None:
            die(f"{relay.name}: b not marked up within {MARK_TIMEOUT} s\n" + relay.log_text())
        t_origin = bk.first_answer(B, 200, mark, t_switch)
        if t_origin is None or t_origin > t_seen:
            die(f"{relay.name}: no 200 answered by b's endpoint before the relay showed it up")
        before = {t: x[1] for t, x in v.items()}
        r.update(t_503=t_503, t_down=t_down, t_switch=t_switch, t_origin=t_origin, t_seen=t_seen,
                 ratio_seen=v[B][2])
        # The load: one short connection every PACE s from now until origin + S + TAIL.
        served0 = bk.counts()
        cpu0 = cpu_times()
        watch = {"seen": False, "stop": threading.Event()}

        def watcher():
            while not watch["stop"].wait(1.0):
                if busy():
                    watch["seen"] = True
        th = threading.Thread(target=watcher, daemon=True)
        th.start()
        conns = []   # (start - origin, tag or '?', duration)
        end = t_origin + slow_start + TAIL
        start = mono()
        k = 0
        while True:
            at = start + k * PACE
            now = mono()
            if at >= end:
                break
            if at > now:
                time.sleep(at - now)
            k += 1
            t0 = mono()
            tag = "?"
            try:
                with socket.create_connection(("127.0.0.1", relay.listen),
                                              timeout=CONN_TIMEOUT) as s:
                    s.settimeout(max(0.001, t0 + CONN_TIMEOUT - mono()))
                    got = s.recv(1)
                    if got and s.recv(16) == b"":
                        tag = got.decode(errors="replace")
            except OSError:
                pass
            conns.append((t0 - t_origin, tag, mono() - t0))
        cpu1 = cpu_times()
        watch["stop"].set()
        th.join(10)
        r["suite_during"] = watch["seen"]
        starts = [c[0] for c in conns]
        r["max_gap_ms"] = 1000 * max((b - a for a, b in zip(starts, starts[1:])), default=0)
        r["cpu_busy"] = (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1])
        served1 = bk.counts()
        after = {t: x[1] for t, x in relay.view().items()}
        r["conns"] = conns
        r["relay_counts"] = {t: int(after.get(t, 0) - before.get(t, 0)) for t in bk.tags}
        r["served_counts"] = {t: served1.get(t, 0) - served0.get(t, 0) for t in bk.tags}
        client = {t: sum(1 for c in conns if c[1] == t) for t in bk.tags}
        r["client_counts"] = client
        if client != r["served_counts"]:
            r["problems"].append(f"tags read {client} != accepted by the backends "
                                 f"{r['served_counts']}")
        if r["relay_counts"] != client:
            r["problems"].append(f"the relay's own count {r['relay_counts']} != tags read {client}")
        failed = sum(1 for c in conns if c[1] == "?")
        if failed:
            r["problems"].append(f"{failed} connections failed")
    finally:
        r["problems"] += relay.close()
    return r


# --------------------------------------------------------------------------- expectations

def zc_share(t, s, n):
    ramp = min(1.0, max(0.001, t / s)) if t >= 0 else 0.0
    return ramp / (n - 1 + ramp)


def haproxy_share(t, s, n):
    if t < 0:
        return 0.0
    w = min(HAPROXY_SCALE, (HAPROXY_SCALE * int(t) + s) // s)
    return w / (HAPROXY_SCALE * (n - 1) + w)


def window_mean(f, a, b):
    """The mean of f over [a, b), sampled every millisecond."""
    steps = max(1, round((b - a) * 1000))
    return sum(f(a + (i + 0.5) * (b - a) / steps) for i in range(steps)) / steps


def windows_of(r, nwin):
    rows = []
    for w in range(nwin):
        a, b = w * WINDOW, (w + 1) * WINDOW
        cs = [c for c in r["conns"] if a <= c[0] < b]
        counts = {}
        for c in cs:
            counts[c[1]] = counts.get(c[1], 0) + 1
        ok = sum(v for k, v in counts.items() if k != "?")
        rows.append({"a": a, "n": len(cs), "counts": counts, "ok": ok,
                     "share": counts.get(B, 0) / ok if ok else None})
    return rows


# --------------------------------------------------------------------------- output

def gnuplot_terminal(panels):
    size = f"1100,{300 + 400 * panels}"
    r = subprocess.run(["gnuplot", "-e", "set terminal pngcairo"], capture_output=True,
                       text=True, timeout=30)
    if r.returncode == 0 and not r.stderr.strip():
        return f"pngcairo size {size} font 'DejaVu Sans,11'"
    return f"png size {size}"


def chart(path, tmp, ways, table, slow_start, n, title):
    """Measured shares at the windows' midpoints; the expected ramps as curves, sampled every
    10 ms (the instantaneous share, not the window means)."""
    data, curve = os.path.join(tmp, "chart.dat"), os.path.join(tmp, "curve.dat")
    with open(data, "w") as f:
        f.write("# mid " + " ".join(ways) + "\n")
        for row in table:
            f.write(f"{row['mid']:.3f} " + " ".join(
                "NaN" if row[w]["share"] is None else f"{row[w]['share']:.5f}" for w in ways)
                + "\n")
    with open(curve, "w") as f:
        for i in range(int((slow_start + TAIL) * 100) + 1):
            t = i / 100
            f.write(f"{t:.2f} {zc_share(t, slow_start, n):.5f} "
                    f"{haproxy_share(t, slow_start, n):.5f}\n")
    styles = {"zcrelay-round_robin": "lw 1.5 pt 6 ps 1.3 lc rgb '#1f77b4'",
              "zcrelay-least_conn": "lw 1.5 pt 5 ps 0.5 lc rgb '#2ca02c'",
              "haproxy-roundrobin": "lw 1.5 pt 9 ps 0.8 lc rgb '#d62728'"}
    zc_curve = (f"'{curve}' using 1:2 with lines lw 3 lc rgb '#555555' "
                "title 'expected, zcrelay: r/(N-1+r), r = t/S'")
    hap_curve = (f"'{curve}' using 1:3 with lines lw 2 dt 2 lc rgb '#d62728' "
                 "title 'expected, HAProxy: its whole-second ramp from 1/S'")

    def measured(w):
        return (f"'{data}' using 1:{2 + ways.index(w)} with linespoints {styles[w]} "
                f"title '{w}, measured (per 250 ms)'")
    # One panel for zcrelay's two modes, one for HAProxy (zcrelay's ramp drawn thin for
    # reference): on one panel the three lines hide each other.
    panels = [[zc_curve] + [measured(w) for w in ways if w.startswith("zcrelay")]]
    if "haproxy-roundrobin" in ways:
        panels.append([zc_curve.replace("lw 3", "lw 1").replace("expected, zcrelay",
                                                                 "for reference, zcrelay"),
                       hap_curve,
                       measured("haproxy-roundrobin")])
    full = 1.0 / n
    body = "".join(f"plot {', '.join(p)}\n" for p in panels)
    script = f"""set terminal {gnuplot_terminal(len(panels))}
set output '{path}'
set multiplot layout {len(panels)},1 title "{title}" noenhanced
set datafile missing "NaN"
set ylabel "b's share of new connections" noenhanced
set xrange [0:{slow_start + TAIL}]
set yrange [0:{min(1.0, full * 1.25):.3f}]
set grid
set key right bottom noenhanced
set arrow 1 from {slow_start}, graph 0 to {slow_start}, graph 1 nohead dt 3 lc rgb '#333333'
set label 1 "slow_start = {slow_start} s" at {slow_start}, graph 0.95 right offset -0.5,0 noenhanced
set xlabel "seconds since b's first passing check (the ramp's origin)" noenhanced
{body}unset multiplot
"""
    gp = os.path.join(tmp, "chart.gp")
    with open(gp, "w") as f:
        f.write(script)
    r = subprocess.run(["gnuplot", gp], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        log(f"gnuplot failed:\n{r.stderr}")
        return False
    return True


def fmt_share(x):
    return "-" if x is None else f"{x * 100:.1f} %"


def main():
    ap = argparse.ArgumentParser(description="slow_start measured against its ramp")
    ap.add_argument("--slow-start", type=int, default=10, help="seconds (whole: HAProxy's unit)")
    ap.add_argument("--backends", type=int, default=2, choices=(2, 3))
    ap.add_argument("--no-haproxy", action="store_true")
    ap.add_argument("--out", default=None, help="prefix of the .csv and .png")
    args = ap.parse_args()
    s, n = args.slow_start, args.backends
    if s < 1:
        die("--slow-start must be at least 1 s")
    ways = [w for w in WAYS if not (args.no_haproxy and w.startswith("haproxy"))]
    if not os.access(U.RELAY, os.X_OK):
        die(f"{U.RELAY} is missing (build it first; ZCRELAY_BUILD picks the build dir)")
    if "haproxy-roundrobin" in ways and not os.access(HAPROXY, os.X_OK):
        die(f"{HAPROXY} is missing (apt-get install haproxy), or pass --no-haproxy")
    if shutil.which("gnuplot") is None:
        die("gnuplot is missing (apt-get install gnuplot-nox)")
    date, host = time.strftime("%F"), socket.gethostname().split(".")[0]
    prefix = args.out or os.path.join(HERE, "results", f"{date}-{host}-slow-start")
    cmdline = "bench/slow_start.py" + "".join(f" {a}" for a in sys.argv[1:])
    tmp = tempfile.mkdtemp(prefix="zcrelay-slow-start-")
    results = []
    redone = []
    t_run = mono()
    try:
        sha, built = U.pin_relay(tmp)
        bk = Backends(n, len(ways) * TRIES * (s + TAIL + 60 + IDLE_WAIT) + 600)
        for way in ways:
            if way.startswith("zcrelay-"):
                relay = Zcrelay(tmp, way[len("zcrelay-"):], bk, s)
            else:
                relay = Haproxy(tmp, bk, s)
            for tries in range(1, TRIES + 1):
                r = one_way(relay, bk, s)
                if (r["max_gap_ms"] <= STALLED_MS and not r["suite_during"]) or tries == TRIES:
                    break
                redone.append((way, r["max_gap_ms"], r["suite_during"]))
                log(f"{way}: the load's longest gap between starts {r['max_gap_ms']:.0f} ms"
                    + (", a test suite or build started during it" if r["suite_during"] else "")
                    + "; this way again")
            r["tries"] = tries
            results.append(r)
            log(f"{way:20} b: 503 -> marked down {1000 * (r['t_down'] - r['t_503']):.0f} ms; "
                f"200 -> first 200 answered {1000 * (r['t_origin'] - r['t_switch']):.0f} ms, "
                f"relay shows up {1000 * (r['t_seen'] - r['t_switch']):.0f} ms; "
                f"{len(r['conns'])} connections {r['client_counts']}"
                + (f"  PROBLEMS: {'; '.join(r['problems'])}" if r["problems"] else ""))
        bk.say("quit")
        try:
            bk.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        stop(bk.p.pid)

        nwin = math.ceil((s + TAIL) / WINDOW)
        per = {r["way"]: windows_of(r, nwin) for r in results}
        table = []
        for w in range(nwin):
            a, b = w * WINDOW, (w + 1) * WINDOW
            row = {"a": a, "mid": a + WINDOW / 2,
                   "exp_zc": window_mean(lambda t: zc_share(t, s, n), a, b),
                   "exp_hap": window_mean(lambda t: haproxy_share(t, s, n), a, b)}
            for way in ways:
                row[way] = per[way][w]
            table.append(row)

        with open(prefix + ".csv", "w") as f:
            f.write("way,window_start_s,window_end_s,connections,"
                    + ",".join(f"to_{t}" for t in bk.tags)
                    + ",failed,b_share,expected_b_share,expected_haproxy_model\n")
            for row in table:
                for way in ways:
                    c = row[way]
                    exp = row["exp_hap"] if way.startswith("haproxy") else row["exp_zc"]
                    f.write(f"{way},{row['a']:.2f},{row['a'] + WINDOW:.2f},{c['n']},"
                            + ",".join(str(c["counts"].get(t, 0)) for t in bk.tags)
                            + f",{c['counts'].get('?', 0)},"
                            + ("" if c["share"] is None else f"{c['share']:.4f}")
                            + f",{row['exp_zc']:.4f},{row['exp_hap']:.4f}\n")
        title = (f"slow_start {s} s: b's share of new connections as it comes back "
                 f"({n} equal backends, 1 every {PACE * 1000:.0f} ms; {host}, {date})")
        drawn = chart(prefix + ".png", tmp, ways, table, s, n, title)
    finally:
        U.clean_up(tmp)

    u = os.uname()
    hv = subprocess.run([HAPROXY, "-v"], capture_output=True, text=True).stdout.split()
    print(f"host: {u.sysname} {u.release} {u.machine}; nproc {os.cpu_count()}; "
          f"HAProxy {hv[2] if len(hv) > 2 else '?'}; zcrelay binary sha256 {sha[:16]} "
          f"(built {built})")
    print(f"command: {cmdline}   (took {mono() - t_run:.0f} s)")
    print()
    print("### How each way went")
    print()
    print("| way | waited for tests, s | load avg at start (1/5/15) | CPUs busy during the load | "
          "test suite during the load | longest gap between starts, ms | "
          "b: 503 to marked down, ms | b: 200 to first 200 answered, ms | 200 to relay shows b "
          "up, ms | connections | to each backend (tags read) | relay's own count | slowest, ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        la = "/".join(f"{x:.2f}" for x in r["loadavg"])
        print(f"| {r['way']} | {r['waited_s']:.0f}{' (still busy)' if r['busy'] else ''} | {la} | "
              f"{100 * r['cpu_busy']:.0f} % | {'yes' if r['suite_during'] else 'no'} | "
              f"{r['max_gap_ms']:.1f} | "
              f"{1000 * (r['t_down'] - r['t_503']):.0f} | "
              f"{1000 * (r['t_origin'] - r['t_switch']):.1f} | "
              f"{1000 * (r['t_seen'] - r['t_switch']):.1f} | {len(r['conns'])} | "
              + ", ".join(f"{t} {v}" for t, v in r["client_counts"].items()) + " | "
              + ", ".join(f"{t} {v}" for t, v in r["relay_counts"].items()) + " | "
              f"{1000 * max(c[2] for c in r['conns']):.1f} |")
    print()
    print("### b's share of new connections per 250 ms window")
    print()
    head = "| window, s | expected (zcrelay) |"
    for way in ways:
        if way.startswith("haproxy"):
            head += " HAProxy's ramp |"
        head += f" {way}: connections | {way}: b |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for row in table:
        line = f"| {row['a']:.2f}–{row['a'] + WINDOW:.2f} | {fmt_share(row['exp_zc'])} |"
        for way in ways:
            c = row[way]
            if way.startswith("haproxy"):
                line += f" {fmt_share(row['exp_hap'])} |"
            line += f" {c['ok']} | {fmt_share(c['share'])} |"
        print(line)
    print()
    print("### Over the ramp and after it")
    print()
    print(f"| way | b's connections in [0, {s}) s: measured / expected | mean abs. deviation "
          f"per window in [0, {s}) s, points | same in [{s}, {s + TAIL:.0f}) s |")
    print("|---|---|---|---|")
    for r in results:
        f = (lambda t: haproxy_share(t, s, n)) if r["way"].startswith("haproxy") else \
            (lambda t: zc_share(t, s, n))
        ramp = [c for c in r["conns"] if 0 <= c[0] < s and c[1] != "?"]
        got = sum(1 for c in ramp if c[1] == B)
        exp = sum(f(c[0]) for c in ramp)
        dev_in, dev_after = [], []
        for row in table:
            c = row[r["way"]]
            if c["share"] is None:
                continue
            e = row["exp_hap"] if r["way"].startswith("haproxy") else row["exp_zc"]
            (dev_in if row["a"] < s else dev_after).append(abs(c["share"] - e) * 100)
        print(f"| {r['way']} | {got} / {exp:.0f} ({got / exp:.3f}) | "
              f"{sum(dev_in) / len(dev_in):.2f} | {sum(dev_after) / len(dev_after):.2f} |")
    print()
    print(f"Windows count from b's ramp origin: the moment its check endpoint answered the first "
          f"200 after it was switched back (with rise 1, the check that brings b up). The load "
          f"starts when the relay shows b up ({POLL * 1000:.0f} ms polls), so the first window "
          f"is a little short. Expected: the mean over the window of the share at each instant "
          f"(zcrelay: r / ({n - 1} + r), r = t / {s} s; HAProxy: its own whole-second ramp, "
          f"w / ({HAPROXY_SCALE * (n - 1)} + w), w = min(16, (16 k + {s}) // {s}), k = whole "
          f"seconds since up). Files: {os.path.relpath(prefix, os.path.join(HERE, '..'))}.csv, "
          f".png{'' if drawn else ' (not drawn: gnuplot failed)'}.")
    for r in results:
        if r["ratio_seen"] is not None:
            print(f"- {r['way']}: zcrelay_backend_slow_start_ratio read {r['ratio_seen']:.3f} "
                  f"at the scrape that showed b up, {1000 * (r['t_seen'] - r['t_origin']):.1f} ms "
                  f"after b's first 200 (a ratio of {(r['t_seen'] - r['t_origin']) / s:.4f} "
                  "by the origin used here, at the scrape's end)")
    for way, gap, suite in redone:
        print(f"- redone: {way}: the load's longest gap between starts {gap:.0f} ms"
              + (", a test suite or build started during it" if suite else ""))
    for r in results:
        for p in r["problems"]:
            print(f"problem: {r['way']}: {p}")
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve_main(sys.argv[2], float(sys.argv[3]))
        sys.exit(0)
    sys.exit(main())
