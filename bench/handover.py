#!/usr/bin/env python3
"""Live connections across an upgrade: zcrelay's handover against its takeover-only drain,
HAProxy's reload and nginx's binary upgrade, in the same run; and the time zcrelay takes to hand
N idle connections over.

Usage: bench/handover.py [ROUNDS (3)]   (ZCRELAY_BUILD picks the build dir)

The zcrelay binary is copied at the start and that copy runs throughout (its sha256 is on the
host line), so a rebuild during the run does not mix binaries. Needs bench/echo_server in the
build (the upstream, without --close-after), haproxy and nginx with its stream module, as
bench/upgrade.py does; its helpers (processes, the log taps, ports, the peers' ways) are
imported from there.

Part 1, long-lived connections across an upgrade. L = 50 connections to the relay, each a
ping-pong stream from one selector loop in a client process: a 64-byte message carrying the
connection's number and a sequence number, the echo awaited and compared byte for byte with what
was sent, the next one 5 ms after the echo. 1.6 s of it, the upgrade, then 5 s more (past the
peers' 3 s hard stop). The ways, interleaved round-robin (order rotated every round):
  zcrelay-handover  `zcrelay -c SAMEFILE --takeover` beside a relay with takeover_socket, mode
                    splice: the live connections cross to the new relay, the old one exits.
                    Ready: the new relay's "zcrelay: ready".
  zcrelay-handover-sockmap  the same with the listener's mode sockmap: the connections' sockets
                    stay in the SOCKHASH they are in and the new relay adopts the old one's maps
                    (and each worker's wake-up ring) by fd.
  zcrelay-handover-copy     the same with mode copy: a direction first sends what it holds in
                    user space, reading nothing more, then crosses as on splice.
                    On these three, the old relay's zcrelay_sockmap_sockets is read once the
                    client's connections are up (before the load), and the new relay's at trigger
                    + 3.0 s (after the windows below, the load still running): 2 L on sockmap,
                    0 on splice and copy.
  zcrelay-kept      as zcrelay-handover (mode splice), except that the new relay's config names
                    the listener differently (t-new for t): it takes the listening sockets
                    (matched by address) but none of the connections (a connection crosses only
                    to a listener of its name), so the old relay keeps and drains them all
                    (drain_timeout 60s): a takeover as it was before the handover, on the same
                    data path. Every mode's connections can cross now, so renaming the listener
                    is the way to keep them.
  haproxy-reload    haproxy -W -S, `expose-fd listeners`, `hard-stop-after 3s`; SIGUSR2 to the
                    master. Ready: the master's "Loading success." after "New worker (N) forked".
  nginx-usr2        nginx stream, `worker_shutdown_timeout 3s`; SIGUSR2, then SIGQUIT to the old
                    master once the new master has started its 2 workers (ready).
Per way and round: the connections that ended (EOF, reset, error) before the client did; the
messages lost (an echo not back 1 s after its send at the end of the load, on a connection still
open) or out of order / wrong (an echo that differs from what was sent); the old process's
lifetime after the ready point (zcrelay: the old relay's exit; HAProxy: the old worker's; nginx:
the old master's), from /proc polled every 5 ms; and the pause each connection open through
trigger + 2.9 s saw (zcrelay's survivors; the peers' connections, which their hard stop cuts
later): its longest wait for one echo among the messages sent in [trigger - 0.5 s, trigger +
2 s], against the same among those sent in [trigger - 1.5 s, trigger - 0.5 s] and in [trigger +
2 s, trigger + 2.9 s] (nothing happening: the round's noise; a round where either exceeds 50 ms
is run again, at most twice, and listed). Median and max over the connections of a round, then
median (min-max) over the rounds.

Part 2, the time to hand N idle connections over (zcrelay-handover), N in 1000, 2000, 4000,
8000, each on mode splice and on mode sockmap (the 8 (mode, N) pairs interleaved, the order
rotated every round):
N connections opened from this process (non-blocking, selectors): connect, 1 byte 'x' echoed,
then idle; the echo server's open fds are checked to hold them. They are opened 500 at a time,
each batch once the relay's pipes are back (zcrelay_pipes_in_use 0): opened at once, 4,000
splice connections want 8,000 pipes within one tick, past max_pipes (4,096), and a direction
that finds none moves to copy for good (zcrelay_pipe_fallbacks_total, checked to be 0 before the
takeover). A sockmap connection takes no pipe once its sockets are in the map, so there the wait
returns at once; the same batches keep the two modes' rounds alike. ZCRELAY_HANDOVER_BATCH=0
opens them all at once anyway. On sockmap the old relay's zcrelay_sockmap_sockets is checked to
be 2 N and zcrelay_sockmap_fallbacks_total 0 before the takeover (none relayed by splice
instead). Then the takeover; from the new relay's log line "... and N connections in X ms after
READY", the handover time; the old relay's exit after the new one's ready line; every connection
checked to echo 1 byte afterwards; and zcrelay_handover_connections_total{result="taken"} read
from the metrics address (handed over too) checked to equal N; the echo check runs in the same
batches. Reported from the new relay after it: on splice its zcrelay_pipe_fallbacks_total (0
expected: an adopted idle direction takes no pipe); on sockmap its zcrelay_sockmap_sockets (2 N
expected: the adopted connections' sockets, counted by the relay that now serves them).
8,000 is near the most one relay holds with RLIMIT_NOFILE 20,000 (this machine's cap: ~9,900
connections with 2 workers); 10,000 and 100,000 need a higher limit.

stdout: the host line, the command and Markdown tables; stderr: one line per round (and the
relays' logs where something went wrong; ZCRELAY_HANDOVER_LOGS=1: every zcrelay round's; a
zcrelay round that paused over 100 ms: its timeline, the worst connections' messages and the
relays' log lines in ms from the trigger).
Loopback only, every wait bounded, only processes it started (or that those reported: the
peers' new masters and workers) are stopped, by pid; it becomes a child subreaper so nginx's
daemonised masters are reaped here.
"""
import errno
import heapq
import json
import os
import re
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import upgrade as U   # noqa: E402  bench/upgrade.py: importing it starts nothing
from upgrade import OWNED, Tap, free_port, popen, stop, echo_once   # noqa: E402

ECHO = U.ECHO
WAYS = ("zcrelay-handover", "zcrelay-handover-sockmap", "zcrelay-handover-copy", "zcrelay-kept",
        "haproxy-reload", "nginx-usr2")
# The zcrelay ways and their listener's mode (zcrelay-kept: see Zc).
ZC_MODE = {"zcrelay-handover": "splice", "zcrelay-handover-sockmap": "sockmap",
           "zcrelay-handover-copy": "copy", "zcrelay-kept": "splice"}
L = 50                 # long-lived connections per round
MSG = 64               # bytes per message
INTERVAL = 0.005       # s between an echo and the next message
BEFORE = 1.6           # s of ping-pong before the trigger (the baseline window needs 1.5)
AFTER = 5.0            # s after it: past the peers' 3 s hard stop
HARD_STOP = "3s"
WINDOW = (-0.5, 2.0)   # the pause window around the trigger
BASE = (-1.5, -0.5)    # the same measure without an upgrade, before it
CALM = (2.0, 2.9)      # and after it (the peers' hard stop comes at 3 s)
STALLED_MS = 50        # a longer wait in BASE or CALM: the machine was busy, the round again
SLOW_MS = 100          # a longer pause in a zcrelay round: its timeline and logs to stderr
LOST_AFTER = 1.0       # an echo not back this long after its send at the end: lost
POLL = 0.005           # /proc polling of the old process
NS = (1000, 2000, 4000, 8000)
IDLE_MODES = ("splice", "sockmap")
IDLE = [(m, n) for n in NS for m in IDLE_MODES]   # part 2's rounds, the modes interleaved
SOCKMAP_AT = CALM[1] + 0.1   # s after the trigger: the new relay's sockmap sockets, part 1
OPEN_INFLIGHT = 256    # idle connections being opened at once
# Opened in batches of this many, each once the relay's pipes are back (see idle_round);
# ZCRELAY_HANDOVER_BATCH=0 opens them all at once.
OPEN_BATCH = int(os.environ.get("ZCRELAY_HANDOVER_BATCH", "500"))
SHOW_LOGS = os.environ.get("ZCRELAY_HANDOVER_LOGS") == "1"   # the relays' logs every round
IDLE_OPEN_TIMEOUT = 30.0   # s to open N idle connections (8,000: about 8 s in batches)
IDLE_CHECK_TIMEOUT = 20.0  # s for all N to echo after the takeover
OLD_GONE_TIMEOUT = 6.0     # s the old relay may live past the load (or the trigger: idle)

TOOK_RX = (r"took (\d+) sockets \((\d+) listeners\) over from pid (\d+) \(zcrelay [^)]*\) in "
           r"([\d.]+) ms, and (\d+) connections in ([\d.]+) ms after READY")
HANDED_RX = r"handover: (\d+) connections handed over, (\d+) kept here to drain, (\d+) failed"


def die(msg):
    raise SystemExit(f"handover.py: {msg}")


log = U.log
mono = time.monotonic


# --------------------------------------------------------------------------- ping-pong client

def fill_table():
    return [bytes((k + i) & 0xFF for i in range(MSG - 6)) for k in range(256)]


def message(fill, cid, seq):
    return struct.pack("!HI", cid, seq & 0xFFFFFFFF) + fill[(cid * 7 + seq) & 0xFF]


def pingpong_main(port, nconns, out):
    """L connections, each a ping-pong of 64-byte messages 5 ms apart, from start_at to end_at
    (read from stdin once 'up' is said); writes every send and echo time to out (JSON)."""
    fill = fill_table()
    conns = []
    for cid in range(nconns):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(5)
        m = message(fill, cid, 0)   # one echo first: the connection relays before the load
        s.sendall(m)
        got = b""
        while len(got) < MSG:
            b = s.recv(MSG - len(got))
            if not b:
                raise SystemExit(f"pingpong: connection {cid} closed before its first echo")
            got += b
        if got != m:
            raise SystemExit(f"pingpong: connection {cid}: a wrong first echo")
        s.setblocking(False)
        conns.append(s)
    print("up", flush=True)
    start_at, end_at = map(float, sys.stdin.readline().split())
    now = mono()
    if start_at > now:
        time.sleep(start_at - now)
    sel = selectors.DefaultSelector()
    st = []
    heap = []
    for cid, s in enumerate(conns):
        sel.register(s, selectors.EVENT_READ, cid)
        st.append({"seq": 0, "expect": None, "buf": bytearray(), "sent": [], "recv": [],
                   "end": None, "bad": []})
        heapq.heappush(heap, (start_at + cid * INTERVAL / nconns, cid))

    def end(cid, reason):
        c = st[cid]
        if c["end"] is None:
            c["end"] = [mono(), reason]
            try:
                sel.unregister(conns[cid])
            except (KeyError, ValueError):
                pass

    def reason_of(e):
        if isinstance(e, ConnectionResetError):
            return "reset"
        if isinstance(e, BrokenPipeError):
            return "broken pipe"
        return errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__

    while True:
        now = mono()
        if now >= end_at:
            break
        while heap and heap[0][0] <= now:
            _, cid = heapq.heappop(heap)
            c = st[cid]
            if c["end"] is not None:
                continue
            c["seq"] += 1
            m = message(fill, cid, c["seq"])
            try:
                n = conns[cid].send(m)
            except OSError as e:
                end(cid, reason_of(e))
                continue
            if n != MSG:   # 64 bytes into an empty socket buffer: all of them, always
                end(cid, f"short send {n}")
                continue
            c["expect"] = m
            c["sent"].append(mono())
        wait = min(0.05, end_at - now, (heap[0][0] - now) if heap else 0.05)
        for key, _ in sel.select(max(0.0, wait)):
            cid = key.data
            c = st[cid]
            try:
                b = conns[cid].recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                end(cid, reason_of(e))
                continue
            t = mono()
            if not b:
                end(cid, "eof")
                continue
            c["buf"] += b
            if len(c["buf"]) < MSG:
                continue
            if c["expect"] is None or len(c["buf"]) != MSG or c["buf"] != c["expect"]:
                got_cid, got_seq = struct.unpack("!HI", bytes(c["buf"][:6]))
                c["bad"].append([t, c["seq"], got_cid, got_seq, len(c["buf"])])
                end(cid, "wrong echo")
                continue
            c["buf"].clear()
            c["expect"] = None
            c["recv"].append(t)
            heapq.heappush(heap, (t + INTERVAL, cid))
    for s in conns:
        s.close()
    with open(out, "w") as f:
        json.dump({"end_at": end_at, "conns": [
            {"sent": [round(x, 6) for x in c["sent"]], "recv": [round(x, 6) for x in c["recv"]],
             "end": c["end"], "bad": c["bad"]} for c in st]}, f)


# --------------------------------------------------------------------------- processes

def exited(pid):
    """Gone, or a zombie (exited, not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class ExitWatch:
    """Polls /proc/PID every 5 ms from a thread until the process exits or `until`."""

    def __init__(self, pid, until):
        self.pid, self.until, self.t = pid, until, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while mono() < self.until:
            if exited(self.pid):
                self.t = mono()
                return
            time.sleep(POLL)

    def join(self):
        self.thread.join(max(0.0, self.until - mono()) + 1)
        return self.t


def count_fds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def start_echo(seconds):
    if not os.access(ECHO, os.X_OK):
        die(f"{ECHO} is missing (build bench/echo_server)")
    p = popen([ECHO, "--port", "0", "--seconds", str(int(seconds))], stdout=subprocess.PIPE,
              stderr=subprocess.DEVNULL)
    got = Tap(p.stdout).wait(r"^\d+$", timeout=10)
    if got is None:
        die("the echo upstream did not start")
    return p, int(got[2].group(0))


# --------------------------------------------------------------------------- the ways

class Zc(U.Zcrelay):
    """A relay with takeover_socket, the listener's mode `mode` (splice, sockmap, copy),
    upgraded by --takeover. With kept, the new relay's config names the listener differently:
    it takes the listening sockets (matched by address) but no connection (a connection crosses
    only to a listener of its own name), so the old relay keeps and drains them all, as a
    takeover did before the handover."""

    def __init__(self, kept, mode, *a):
        super().__init__("takeover", *a)
        self.kept = kept
        self.mode = mode

    def config(self, port, name="t", suffix=""):
        cfg = self.path(f"zcrelay{suffix}.yaml")
        with open(cfg, "w") as f:
            f.write(f"workers: 2\ndrain_timeout: 60s\n"
                    f"takeover_socket: {self.path('takeover.sock')}\n"
                    "metrics:\n  listen: 127.0.0.1:0\n"
                    f"listeners:\n  - name: {name}\n    listen: 127.0.0.1:{port}\n"
                    f"    upstream: 127.0.0.1:{self.echo}\n    mode: {self.mode}\n")
        return cfg

    def start(self, port):
        self.port = port
        return super().start(port)

    def upgrade(self):
        if self.kept:
            self.cfg = self.config(self.port, "t-new", "-new")
        return super().upgrade()

    def old_pid(self):
        return self.procs[0][0].pid

    def metrics_addr(self):
        got = self.procs[0][1].wait(r"metrics on http://([\d.]+):(\d+)/metrics", 0, 1)
        if got is None:
            die(f"{self.tag}: no 'metrics on' line from the relay")
        return got[2].group(1), int(got[2].group(2))

    def took(self, timeout=10):
        """The new relay's takeover line: (sockets ms, connections, connections ms)."""
        got = self.procs[-1][2].wait(TOOK_RX, 0, timeout)
        if got is None:
            return None
        m = got[2]
        return float(m.group(4)), int(m.group(5)), float(m.group(6))

    def handed(self, timeout=5):
        """The old relay's per-worker handover lines, summed: (handed, kept, failed)."""
        a_err = self.procs[0][2]
        tot, i = [0, 0, 0], 0
        for _ in range(2):   # workers: 2
            got = a_err.wait(HANDED_RX, i, timeout)
            if got is None:
                break
            i = got[0] + 1
            for k in range(3):
                tot[k] += int(got[2].group(k + 1))
        return tuple(tot)

    def old_exit_code(self, timeout=1):
        try:
            return self.procs[0][0].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


class Haproxy(U.HaproxyReload):
    def start(self, port):
        # upgrade.py's HaproxyReload.start, with hard-stop-after in global.
        cfg = self.path("haproxy.cfg")
        U.write_haproxy_cfg(cfg, port, self.echo,
                            f"stats socket {self.path('stats.sock')} mode 600 level admin "
                            f"expose-fd listeners\n    hard-stop-after {HARD_STOP}")
        self.p = popen([U.HAPROXY, "-W", "-S", self.path("master.sock"), "-f", cfg],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.err = Tap(self.p.stderr)
        w = self.err.wait(r"New worker \((\d+)\) forked", 0, 10)
        if w is None or self.err.wait(r"Loading success", w[0], 10) is None:
            die(f"{self.tag}: haproxy did not start:\n" + self.err.text())
        self.worker = int(w[2].group(1))
        return U.wait_serving(port)

    def old_pid(self):
        return self.worker


class Nginx(U.NginxUsr2):
    def start(self, port):
        # upgrade.py's NginxUsr2.start, with worker_shutdown_timeout.
        self.prefix = self.path("nginx")
        os.makedirs(os.path.join(self.prefix, "logs"))
        self.pidfile = os.path.join(self.prefix, "nginx.pid")
        conf = os.path.join(self.prefix, "nginx.conf")
        with open(conf, "w") as f:
            f.write(f"""load_module {U.NGINX_STREAM};
worker_processes 2;
worker_shutdown_timeout {HARD_STOP};
pid {self.pidfile};
error_log stderr notice;
events {{ worker_connections 8000; }}
stream {{
    upstream echo {{ server 127.0.0.1:{self.echo}; }}
    server {{ listen 127.0.0.1:{port} backlog=4096; proxy_pass echo; }}
}}
""")
        # daemon (the default): see upgrade.py; as subreaper this script reaps the masters.
        launcher = popen([U.NGINX, "-p", self.prefix, "-c", conf], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
        self.err = Tap(launcher.stderr)
        try:
            rc = launcher.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        OWNED.pop(launcher.pid, None)
        if rc != 0:
            die(f"{self.tag}: nginx did not start ({rc}):\n" + self.err.text())
        deadline = mono() + 10
        while self.master is None and mono() < deadline:
            try:
                with open(self.pidfile) as f:
                    self.master = U.own(int(f.read().strip()))
            except (OSError, ValueError):
                time.sleep(0.01)
        if self.master is None:
            die(f"{self.tag}: no nginx pid file:\n" + self.err.text())
        self.workers_of(self.master, 0)
        return U.wait_serving(port)

    def old_pid(self):
        return self.master


def make_way(name, tmp, tag, echo_port):
    if name.startswith("zcrelay-idle-"):   # part 2: zcrelay-idle-MODE
        return Zc(False, name.rsplit("-", 1)[1], tmp, tag, echo_port)
    if name in ZC_MODE:
        return Zc(name == "zcrelay-kept", ZC_MODE[name], tmp, tag, echo_port)
    return {"haproxy-reload": Haproxy, "nginx-usr2": Nginx}[name](tmp, tag, echo_port)


def started(name, tag, tmp, echo_port):
    for attempt in range(3):   # a port taken in the meantime: another one
        port = free_port()
        way = make_way(name, tmp, f"{tag}-{attempt}", echo_port)
        try:
            why = "" if way.start(port) else "not serving"
        except SystemExit as e:
            why = str(e)
        if not why:
            return way, port
        way.close()
        log(f"{tag}: no start on port {port}: {why}")
    die(f"{tag}: could not start in 3 tries")


# --------------------------------------------------------------------------- part 1

def pause(c, lo, hi, end_at):
    """The longest wait for one echo among the messages sent in [lo, hi] (an unanswered one
    waits until end_at); None if none was sent there."""
    sent, recv = c["sent"], c["recv"]
    worst = None
    for i, s in enumerate(sent):
        if s < lo:
            continue
        if s > hi:
            break
        w = (recv[i] if i < len(recv) else end_at) - s
        worst = w if worst is None else max(worst, w)
    return worst


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return (xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2) if n else None


def analyse_pp(data, t_trig):
    end_at = data["end_at"]
    ended, reasons, lost, wrong, answered, survived, open_ = 0, {}, 0, 0, 0, 0, []
    for c in data["conns"]:
        answered += len(c["recv"])
        wrong += len(c["bad"])
        unanswered = len(c["sent"]) > len(c["recv"])
        if c["end"] is not None and c["end"][1] != "wrong echo":
            ended += 1
            reasons[c["end"][1]] = reasons.get(c["end"][1], 0) + 1
            if c["end"][0] > t_trig + CALM[1] and not c["bad"]:
                open_.append(c)   # ended after the windows: a peer's hard stop
            continue
        if c["bad"]:
            continue
        if unanswered and end_at - c["sent"][-1] > LOST_AFTER:
            lost += 1   # open, but its echo never came
            continue
        survived += 1
        open_.append(c)

    def measure(lo, hi):
        xs = [pause(c, t_trig + lo, t_trig + hi, end_at) for c in open_]
        return [x * 1000 for x in xs if x is not None]

    win, base, calm = measure(*WINDOW), measure(*BASE), measure(*CALM)
    return {"ended": ended, "reasons": reasons, "lost": lost, "wrong": wrong,
            "answered": answered, "survived": survived, "measured": len(open_),
            "pause_med": median(win), "pause_max": max(win) if win else None,
            "base_med": median(base), "base_max": max(base) if base else None,
            "calm_med": median(calm), "calm_max": max(calm) if calm else None}


def timeline(data, t_trig, way, worst=5):
    """The connections with the longest waits in the window, each message around its worst
    (sent at, waited, in ms from the trigger), and the relays' log lines (as read here)."""
    rows = []
    for i, c in enumerate(data["conns"]):
        w = []
        for k, s in enumerate(c["sent"]):
            if t_trig + WINDOW[0] <= s <= t_trig + WINDOW[1]:
                w.append(((c["recv"][k] if k < len(c["recv"]) else data["end_at"]) - s, k))
        if w:
            rows.append((max(w), i))
    rows.sort(reverse=True)
    out = []
    for (wait, k), i in rows[:worst]:
        c = data["conns"][i]
        msgs = " ".join(
            f"{(c['sent'][j] - t_trig) * 1000:+.1f}/{(c['recv'][j] - c['sent'][j]) * 1000:.1f}"
            for j in range(max(0, k - 3), min(len(c["recv"]), k + 3)))
        out.append(f"  conn {i}: worst {wait * 1000:.1f} ms; sent/waited: {msgs}")
    for p, o, e in way.procs:
        for t, line in sorted(o.lines + e.lines):
            if re.search(r"ready|takeover|handover|drain|exiting|warn|error", line):
                out.append(f"  {(t - t_trig) * 1000:+9.1f} pid {p.pid}: {line[-150:]}")
    return "\n".join(out)


def pp_round(name, rnd, tmp, echo_port):
    tag = f"r{rnd}-{name}"
    way, port = started(name, tag, tmp, echo_port)
    res = {"problems": way.problems}
    client = None
    try:
        out = os.path.join(tmp, f"{tag}-pingpong.json")
        client = popen([sys.executable, os.path.abspath(__file__), "--pingpong", str(port),
                        str(L), out], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
        ctap, cerr = Tap(client.stdout), Tap(client.stderr)
        if ctap.wait(r"^up$", 0, 15) is None:
            die(f"{tag}: the ping-pong client did not come up:\n{cerr.text()}")
        res["sockmap_old"] = res["sockmap_new"] = None
        if isinstance(way, Zc):   # before the load: the sockets the old relay has in its maps
            maddr = way.metrics_addr()
            res["sockmap_old"] = metric(scrape(maddr), "zcrelay_sockmap_sockets")
        start_at = mono() + 0.05
        trig_at, end_at = start_at + BEFORE, start_at + BEFORE + AFTER
        client.stdin.write(f"{start_at!r} {end_at!r}\n".encode())
        client.stdin.close()
        time.sleep(max(0.0, trig_at - mono()))
        old = way.old_pid()
        watch = ExitWatch(old, end_at + OLD_GONE_TIMEOUT)
        t_trig, t_ready = way.upgrade()
        if isinstance(way, Zc):
            # After the windows, the load still running: the new relay's (the metrics socket is
            # handed over with the rest).
            time.sleep(max(0.0, t_trig + SOCKMAP_AT - mono()))
            res["sockmap_new"] = metric(scrape(maddr), "zcrelay_sockmap_sockets")
        try:
            client.wait(timeout=max(0.0, end_at - mono()) + 5)
        except subprocess.TimeoutExpired:
            die(f"{tag}: the ping-pong client did not finish")
        OWNED.pop(client.pid, None)
        if client.returncode != 0:
            die(f"{tag}: the ping-pong client exited {client.returncode}:\n{cerr.text()}")
        with open(out) as f:
            data = json.load(f)
        t_exit = watch.join()
        res.update(analyse_pp(data, t_trig))
        res["upgrade_ms"] = (t_ready - t_trig) * 1000
        res["old_ms"] = (t_exit - t_ready) * 1000 if t_exit is not None else None
        res["old_before_end"] = t_exit is not None and t_exit < data["end_at"]
        if t_exit is None:
            way.problems.append(f"old process {old} still there "
                                f"{end_at + OLD_GONE_TIMEOUT - t_ready:.0f} s after the ready "
                                "point")
        res["handed"] = res["took"] = None
        if isinstance(way, Zc):
            res["took"] = way.took()
            res["handed"] = way.handed()
            rc = way.old_exit_code()
            if rc not in (0, None):
                way.problems.append(f"old relay {old} exited {rc}")
            if res["took"] is None:
                way.problems.append("no 'took ... connections ... after READY' line")
            want = (0, L, 0) if way.kept else (L, 0, 0)
            if res["handed"] != want:
                way.problems.append(f"the old relay handed over/kept/failed {res['handed']}, "
                                    f"not {want}")
            if way.mode == "sockmap":
                for k, who in (("sockmap_old", "old relay before"),
                               ("sockmap_new", "new relay after")):
                    if res[k] != 2 * L:
                        way.problems.append(f"sockmap sockets, {who}: {res[k]}, not {2 * L}")
        if not echo_once(port):
            way.problems.append("not serving after the upgrade")
        zc_bad = isinstance(way, Zc)
        if isinstance(way, Zc) and (SHOW_LOGS or (res["pause_max"] or 0) > SLOW_MS):
            log(f"{tag}: a pause of {fmt(res['pause_max'])} ms; the timeline (ms after the "
                f"trigger): ready {res['upgrade_ms']:+.1f}, old relay gone "
                f"{'-' if t_exit is None else f'{(t_exit - t_trig) * 1000:+.1f}'}\n"
                + timeline(data, t_trig, way))
        if way.problems or (zc_bad and (res["ended"] or res["lost"] or res["wrong"] or SHOW_LOGS)):
            bad = [(i, c["end"], c["bad"][:3]) for i, c in enumerate(data["conns"])
                   if c["end"] or c["bad"]][:10]
            log(f"{tag}: ENDED/LOST/WRONG OR PROBLEMS (trigger at {t_trig:.4f}): {bad}\n"
                + way.log_text())
        return res
    finally:
        if client is not None and client.poll() is None:
            stop(client.pid)
        way.close()


# --------------------------------------------------------------------------- part 2

def open_idle(port, n, deadline):
    """N connections: connect, 'x' echoed, then idle. (sockets, failures)."""
    sel = selectors.DefaultSelector()
    done, failed, i, inflight = [], 0, 0, 0
    addr = ("127.0.0.1", port)
    while len(done) + failed < n and mono() < deadline:
        while i < n and inflight < OPEN_INFLIGHT:
            s = socket.socket()
            s.setblocking(False)
            i += 1
            err = s.connect_ex(addr)
            if err not in (0, errno.EINPROGRESS):
                s.close()
                failed += 1
                continue
            sel.register(s, selectors.EVENT_WRITE, 0)
            inflight += 1
        for key, _ in sel.select(0.5):
            s = key.fileobj
            ok = True
            try:
                if key.data == 0:
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) or s.send(b"x") != 1:
                        ok = False
                    else:
                        sel.modify(s, selectors.EVENT_READ, 1)
                        continue
                else:
                    ok = s.recv(16) == b"x"
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                ok = False
            sel.unregister(s)
            inflight -= 1
            if ok:
                done.append(s)
            else:
                s.close()
                failed += 1
    for key in list(sel.get_map().values()):
        key.fileobj.close()
        failed += 1
    sel.close()
    return done, failed + (n - i)


def check_idle(socks, deadline):
    """Each connection echoes 1 byte 'y'. The count that did."""
    sel = selectors.DefaultSelector()
    for s in socks:
        try:
            if s.send(b"y") == 1:
                sel.register(s, selectors.EVENT_READ)
        except OSError:
            pass
    ok = 0
    while sel.get_map() and mono() < deadline:
        for key, _ in sel.select(0.5):
            s = key.fileobj
            try:
                b = s.recv(16)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                b = b""
            sel.unregister(s)
            ok += b == b"y"
    sel.close()
    return ok


def scrape(addr):
    """The metrics page's body (bytes), or an error string."""
    try:
        with socket.create_connection(addr, timeout=3) as c:
            c.settimeout(3)
            c.sendall(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            body = b""
            while len(body) < 4 << 20:
                b = c.recv(65536)
                if not b:
                    break
                body += b
            return body
    except OSError as e:
        return f"scrape failed: {e}"


def metric(body, name, labels=""):
    """The sum of the series of `name` whose labels contain `labels`, or an error string."""
    if isinstance(body, str):
        return body
    total, seen = 0.0, False
    for m in re.finditer(rb"^" + re.escape(name.encode()) + rb"(\{[^}]*\})?\s+(\S+)", body,
                         re.M):
        if labels.encode() in (m.group(1) or b""):
            total += float(m.group(2))
            seen = True
    return total if seen else f"no {name}{{{labels}}} series"


def wait_pipes_back(addr, deadline):
    """Waits until the relay holds no pipe (a quiet direction gives its pipe back within a
    250 ms tick); the pipes in use last seen."""
    while True:
        used = metric(scrape(addr), "zcrelay_pipes_in_use")
        if not isinstance(used, float) or used == 0 or mono() > deadline:
            return used
        time.sleep(0.05)


def idle_round(mode, n, rnd, tmp, echo, echo_port):
    tag = f"r{rnd}-idle-{mode}{n}"
    way, port = started(f"zcrelay-idle-{mode}", tag, tmp, echo_port)
    res = {"mode": mode, "n": n, "problems": way.problems}
    socks = []
    try:
        maddr = way.metrics_addr()
        echo_before = count_fds(echo.pid)
        t = mono()
        deadline = t + IDLE_OPEN_TIMEOUT
        # In batches, each once the last one's pipes are back: opened all at once, 4,000
        # connections want 8,000 pipes within one tick, past max_pipes (4,096), and the
        # directions left without one move to copy for good, which a handover leaves behind.
        # (Sockmap: the wait is harmless, its connections hold no pipe once in the map.)
        while len(socks) < n and mono() < deadline:
            more, failed = open_idle(port, min(OPEN_BATCH or n, n - len(socks)), deadline)
            socks += more
            if failed:
                die(f"{tag}: {failed} idle connections failed to open")
            wait_pipes_back(maddr, min(deadline, mono() + 3))
        res["open_s"] = mono() - t
        if len(socks) != n:
            die(f"{tag}: {len(socks)} of {n} idle connections opened in "
                f"{IDLE_OPEN_TIMEOUT:.0f} s")
        before = scrape(maddr)
        res["fallbacks"] = metric(before, "zcrelay_pipe_fallbacks_total")
        if res["fallbacks"] != 0:
            way.problems.append(f"pipe fallbacks to copy before the takeover: {res['fallbacks']}")
        res["sockmap_before"] = metric(before, "zcrelay_sockmap_sockets")
        res["sockmap_fallbacks"] = metric(before, "zcrelay_sockmap_fallbacks_total")
        if mode == "sockmap":
            if res["sockmap_before"] != 2 * n:
                way.problems.append(f"sockmap sockets before the takeover: "
                                    f"{res['sockmap_before']}, not {2 * n}")
            if res["sockmap_fallbacks"] != 0:
                way.problems.append("sockmap fallbacks (relayed by splice instead) before the "
                                    f"takeover: {res['sockmap_fallbacks']}")
        held = count_fds(echo.pid) - echo_before
        if held < n:
            die(f"{tag}: the echo server holds {held} more fds, not {n}")
        res["echo_held"] = held
        old = way.old_pid()
        watch = ExitWatch(old, mono() + OLD_GONE_TIMEOUT)
        t_trig, t_ready = way.upgrade()
        res["ready_ms"] = (t_ready - t_trig) * 1000
        took = way.took()
        t_exit = watch.join()
        res["old_ms"] = (t_exit - t_ready) * 1000 if t_exit is not None else None
        if t_exit is None:
            way.problems.append(f"old relay {old} still there {OLD_GONE_TIMEOUT:.0f} s after "
                                "the trigger")
        if took is None:
            way.problems.append("no 'took ... connections ... after READY' line")
            res["sockets_ms"] = res["conns"] = res["handover_ms"] = None
        else:
            res["sockets_ms"], res["conns"], res["handover_ms"] = took
            if res["conns"] != n:
                way.problems.append(f"the new relay took {res['conns']} connections, not {n}")
        res["handed"] = way.handed()
        rc = way.old_exit_code()
        if rc not in (0, None):
            way.problems.append(f"old relay {old} exited {rc}")
        # Checked in the same batches, each once the pipes are back: all N at once would want
        # 2 N pipes within a tick, and the directions left without one would move to copy.
        check_deadline = mono() + IDLE_CHECK_TIMEOUT
        res["echoed"] = 0
        for i in range(0, n, OPEN_BATCH or n):
            res["echoed"] += check_idle(socks[i:i + (OPEN_BATCH or n)], check_deadline)
            wait_pipes_back(maddr, min(check_deadline, mono() + 3))
        if res["echoed"] != n:
            way.problems.append(f"{n - res['echoed']} of {n} connections did not echo after")
        after = scrape(maddr)   # the new relay's, on the metrics socket it was handed
        res["taken"] = metric(after, "zcrelay_handover_connections_total", 'result="taken"')
        res["fallbacks_after"] = metric(after, "zcrelay_pipe_fallbacks_total")
        res["sockmap_after"] = metric(after, "zcrelay_sockmap_sockets")
        if res["taken"] != n:
            way.problems.append(f"taken metric {res['taken']}, not {n}")
        if mode == "sockmap" and res["sockmap_after"] != 2 * n:
            way.problems.append(f"the new relay's sockmap sockets {res['sockmap_after']}, "
                                f"not {2 * n}")
        if way.problems or SHOW_LOGS:
            log(f"{tag}: PROBLEMS: {'; '.join(way.problems) or 'none'}\n" + way.log_text())
        return res
    finally:
        for s in socks:
            s.close()
        way.close()


# --------------------------------------------------------------------------- report

cell = U.cell


def fmt(x):
    return "-" if x is None else f"{x:.1f}"


def num(x):
    """A metric read (a float, or the error string) as printed."""
    return f"{x:.0f}" if isinstance(x, float) else str(x)


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    if rounds < 1:
        die("ROUNDS must be at least 1")
    for what, path in (("zcrelay (build it first; ZCRELAY_BUILD picks the build dir)", U.RELAY),
                       ("haproxy (apt-get install haproxy)", U.HAPROXY),
                       ("nginx (apt-get install nginx-core)", U.NGINX)):
        if not os.access(path, os.X_OK):
            die(f"{path} is missing: {what}")
    if not os.path.exists(U.NGINX_STREAM):
        die(f"{U.NGINX_STREAM} is missing (apt-get install libnginx-mod-stream)")
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    U.set_subreaper()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = tempfile.mkdtemp(prefix="zcrelay-handover-")
    pp = {w: [] for w in WAYS}
    idle = {mn: [] for mn in IDLE}
    redone = []
    t_run = mono()
    try:
        sha, built = U.pin_relay(tmp)
        echo, echo_port = start_echo(rounds * (len(WAYS) * 30 + len(IDLE) * 40) + 120)
        u = os.uname()
        host = (f"host: {u.sysname} {u.release} {u.version} {u.machine}; nproc {os.cpu_count()}; "
                f"RLIMIT_NOFILE {nofile[0]}/{nofile[1]}; " + U.host_line()[len("host: "):]
                + f"; zcrelay binary sha256 {sha[:16]} (built {built})")
        log(f"upstream: bench/echo_server on 127.0.0.1:{echo_port} (pid {echo.pid}); "
            f"temp dir {tmp}")
        for rnd in range(1, rounds + 1):
            k = (rnd - 1) % len(WAYS)
            for name in WAYS[k:] + WAYS[:k]:
                for tries in range(1, 4):
                    r = pp_round(name, rnd, tmp, echo_port)
                    noise = max(r["base_max"] or 0, r["calm_max"] or 0)
                    if noise <= STALLED_MS or tries == 3:
                        break
                    redone.append((name, rnd, noise))
                    log(f"round {rnd} {name}: a wait of {noise:.0f} ms outside the upgrade's "
                        f"window (the machine busy elsewhere; pause {fmt(r['pause_max'])} ms); "
                        "this round again")
                pp[name].append(r)
                log(f"round {rnd} {name:24} ended {r['ended']:2} {r['reasons'] or ''} lost "
                    f"{r['lost']} wrong {r['wrong']} answered {r['answered']:6} survived "
                    f"{r['survived']:2}  pause med/max {fmt(r['pause_med'])}/"
                    f"{fmt(r['pause_max'])} ms over {r['measured']} (before {fmt(r['base_med'])}/"
                    f"{fmt(r['base_max'])}, after {fmt(r['calm_med'])}/{fmt(r['calm_max'])})  "
                    f"ready {r['upgrade_ms']:.1f} ms  old gone {fmt(r['old_ms'])} ms after ready"
                    + (f"  took {r['took']}" if r["took"] else "")
                    + (f"  old: handed/kept/failed {r['handed']}" if r["handed"] else "")
                    + (f"  sockmap sockets old before/new after {r['sockmap_old']}/"
                       f"{r['sockmap_new']}" if r["sockmap_old"] is not None else "")
                    + (f"  PROBLEMS: {'; '.join(r['problems'])}" if r["problems"] else ""))
            k = (rnd - 1) % len(IDLE)
            for mode, n in IDLE[k:] + IDLE[:k]:
                r = idle_round(mode, n, rnd, tmp, echo, echo_port)
                idle[(mode, n)].append(r)
                log(f"round {rnd} idle {mode:7} {n:5}: opened in {r['open_s']:.1f} s (echo holds "
                    f"{r['echo_held']} more fds; pipe fallbacks {r['fallbacks']}; sockmap "
                    f"sockets {r['sockmap_before']}, fallbacks {r['sockmap_fallbacks']}); ready "
                    f"{r['ready_ms']:.1f} ms after the trigger; took sockets in "
                    f"{r['sockets_ms']} ms, {r['conns']} connections in {r['handover_ms']} ms "
                    f"after READY; old gone {fmt(r['old_ms'])} ms after ready; old "
                    f"handed/kept/failed {r['handed']}; echoed after {r['echoed']}/{n}; taken "
                    f"metric {r['taken']}; the new relay's pipe fallbacks {r['fallbacks_after']}, "
                    f"sockmap sockets {r['sockmap_after']}"
                    + (f"  PROBLEMS: {'; '.join(r['problems'])}" if r["problems"] else ""))
        stop(echo.pid)
    finally:
        U.clean_up(tmp)

    print(host)
    print(f"command: bench/handover.py {rounds}   (took {mono() - t_run:.0f} s)")
    print()
    print(f"### Long-lived connections across an upgrade ({L} ping-pong connections, "
          f"{MSG} B every {INTERVAL * 1000:.0f} ms after the echo; trigger {BEFORE} s in, "
          f"{AFTER} s after it)")
    print()
    print("| way | ended (of 50) | how | lost or wrong messages | echoes | old process gone "
          "after ready, ms | gone before the load ended | pause, median conn, ms | pause, worst "
          "conn, ms | before: median / worst conn, ms | after: median / worst conn, ms "
          "| trigger to ready, ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w in WAYS:
        rs = pp[w]
        col = lambda k, fmt="{:.0f}": cell([r[k] for r in rs if r[k] is not None], fmt)  # noqa
        how = {}
        for r in rs:
            for k, v in r["reasons"].items():
                how[k] = how.get(k, 0) + v
        how_s = ", ".join(f"{k} {v}" for k, v in sorted(how.items())) or "-"
        lost = [r["lost"] + r["wrong"] for r in rs]
        print(f"| {w} | {col('ended')} | {how_s} (all rounds) | {cell(lost, '{:.0f}')} | "
              f"{col('answered')} | {col('old_ms', '{:.1f}')} | "
              f"{sum(r['old_before_end'] for r in rs)}/{len(rs)} | "
              f"{col('pause_med', '{:.1f}')} | {col('pause_max', '{:.1f}')} | "
              f"{col('base_med', '{:.1f}')} / {col('base_max', '{:.1f}')} | "
              f"{col('calm_med', '{:.1f}')} / {col('calm_max', '{:.1f}')} | "
              f"{col('upgrade_ms', '{:.1f}')} |")
    print()
    print(f"Median (min–max) over {rounds} rounds. Ended: connections that saw EOF, a reset or "
          f"an error before the client closed them. Lost or wrong: an echo not back "
          f"{LOST_AFTER:.0f} s after its send when the load ended, on a connection still open, "
          "or an echo that differs from the message sent (order and content). Old process gone: "
          "its exit (seen in /proc, polled every 5 ms) minus the ready point (zcrelay: the new "
          "relay's `zcrelay: ready`; HAProxy: the master's `Loading success.`; nginx: the new "
          "master's second worker started); zcrelay's old relay (and HAProxy's old worker, "
          "nginx's old master) exits only once its connections are gone, so where it kept them "
          "it outlives the load. Pause: per connection open through "
          f"trigger {CALM[1]:+} s (zcrelay: the survivors; HAProxy, nginx: theirs, cut by the "
          "hard stop later), the longest wait for one echo among the messages sent in [trigger "
          f"{WINDOW[0]:+} s, trigger {WINDOW[1]:+} s]; before and after: the same in [trigger "
          f"{BASE[0]:+} s, trigger {BASE[1]:+} s] and [trigger {CALM[0]:+} s, trigger "
          f"{CALM[1]:+} s], nothing happening (the round's noise; a round where either exceeds "
          f"{STALLED_MS} ms is run again, at most twice, and listed below). Median and worst over "
          "the connections of a round, then median (min–max) over the rounds.")
    print()
    for name, rnd, ms in redone:
        print(f"- redone: {name} round {rnd}: a {ms:.0f} ms wait outside the window")
    took_lines = [(w, i + 1, r) for w in WAYS if w in ZC_MODE for i, r in enumerate(pp[w])]
    for w, i, r in took_lines:
        took = r["took"]
        print(f"- {w} round {i}: the new relay took {took[1] if took else '?'} connections "
              f"({took[2] if took else '?'} ms after READY); the old one logged "
              f"handed over/kept/failed {r['handed']}; sockmap sockets: the old relay's before "
              f"the load {num(r['sockmap_old'])}, the new relay's at trigger +{SOCKMAP_AT:.1f} s "
              f"{num(r['sockmap_new'])}")
    print()
    for mode in IDLE_MODES:
        print(f"### Time to hand N idle connections over (zcrelay-handover, mode {mode}, "
              "2 workers)")
        print()
        last = ("pipe fallbacks: old before, new after" if mode == "splice" else
                "sockmap sockets: old before, new after (2 N expected); sockmap fallbacks "
                "before")
        print("| N | connections in, ms after READY (new relay's log) | sockets, ms (log) | "
              "trigger to ready, ms | old relay gone after ready, ms | echo after (of N) | "
              f"taken metric | old: handed/kept/failed | {last} |")
        print("|---|---|---|---|---|---|---|---|---|")
        for n in NS:
            rs = idle[(mode, n)]
            def col(k, fmt="{:.1f}", rs=rs):
                return cell([r[k] for r in rs if isinstance(r[k], (int, float))], fmt)
            hk = sorted({r["handed"] for r in rs})
            tk = sorted({str(r["taken"]) for r in rs})
            if mode == "splice":
                extra = f"{col('fallbacks', '{:.0f}')}; {col('fallbacks_after', '{:.0f}')}"
            else:
                extra = (f"{col('sockmap_before', '{:.0f}')}; {col('sockmap_after', '{:.0f}')}; "
                         f"{col('sockmap_fallbacks', '{:.0f}')}")
            print(f"| {n} | {col('handover_ms')} | {col('sockets_ms')} | {col('ready_ms')} | "
                  f"{col('old_ms')} | {col('echoed', '{:.0f}')} | {', '.join(tk)} | "
                  f"{'; '.join('/'.join(map(str, h)) for h in hk)} | {extra} |")
        print()
    batch = (f"in batches of {OPEN_BATCH}, each once the relay's pipes were back"
             if OPEN_BATCH else "all at once (ZCRELAY_HANDOVER_BATCH=0)")
    print(f"Median (min–max) over {rounds} rounds. N stops at 8,000: with RLIMIT_NOFILE "
          f"{nofile[0]} (this machine's cap, which cannot be raised) a relay with 2 workers "
          "holds at most ~9,900 connections, and the new one takes as many; 10,000 and 100,000 "
          "need a higher RLIMIT_NOFILE than this machine allows. Connections "
          f"opened from one Python process ({batch}; non-blocking, selectors; connect, 1 byte "
          "echoed, idle); the echo server was checked to hold N more fds; after the takeover each "
          f"connection echoed 1 more byte, in the same batches (bounded {IDLE_CHECK_TIMEOUT:.0f} "
          "s in all), and `zcrelay_handover_connections_total{result=\"taken\"}` was read from "
          "the same metrics address. Sockmap sockets: `zcrelay_sockmap_sockets`, the old "
          "relay's before the takeover and the new relay's after the echo check (2 per "
          "connection: client and upstream); sockmap fallbacks: "
          "`zcrelay_sockmap_fallbacks_total` before the takeover (connections relayed by splice "
          "instead).")
    problems = [(w, i + 1, p) for w in WAYS for i, r in enumerate(pp[w]) for p in r["problems"]]
    problems += [(f"idle {m} {n}", i + 1, p) for m, n in IDLE for i, r in enumerate(idle[(m, n)])
                 for p in r["problems"]]
    if problems:
        print()
    for w, i, p in problems:
        print(f"problem: {w} round {i}: {p}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--pingpong":
        port, nconns, out = sys.argv[2:5]
        pingpong_main(int(port), int(nconns), out)
        sys.exit(0)
    sys.exit(main())
