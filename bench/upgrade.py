#!/usr/bin/env python3
"""An upgrade under load: zcrelay's triggers against HAProxy's and nginx's, in the same run.

Usage: bench/upgrade.py [ROUNDS (5)]   (ZCRELAY_BUILD picks the build dir)

An echo upstream (bench/echo_server from the build, else a small Python one), and a load of
short connections, each: connect, send a few bytes, read them echoed, close. The load is
bench/conn_rate from the build (8 connections in flight, 64 B each, --log: every connection's
times and outcome), else 2 Python client processes (8 B, one connection at a time each, one loop
per process so no GIL between them; ZCRELAY_UPGRADE_CLIENT=python picks these anyway). The
Python clients stall 2-4 ms now and then on their own, which hides a shorter gap. About
1.5 s into the load the relay in front of the echo is upgraded (or restarted), and the load goes
on for 2.5 s after that. Each attempt is recorded with its start, its end and its outcome: ok,
refused, reset, timeout (1 s for the whole attempt), or other (e.g. closed before the echo).

The ways, each ROUNDS times, interleaved round-robin (the order rotated every round):
  zcrelay-takeover  relay A runs with takeover_socket; `zcrelay -c SAMEFILE --takeover` (B) gets
                    its listening sockets; A drains and exits. Ready: B's "zcrelay: ready".
  zcrelay-sigusr2   `kill -USR2 A`: A re-executes its binary as a child that takes the sockets
                    over. Ready: the child's "zcrelay: ready" (on the same stdout).
  zcrelay-socket    this script holds the listening socket and gives it to each relay as fd 3
                    (LISTEN_FDS, as systemd); SIGTERM A, wait for its exit, start B on it.
                    Ready: B's ready line.
  zcrelay-restart   SIGTERM A, wait for its exit, start B, which binds its own socket: the
                    baseline that refuses. Ready: B's ready line.
  haproxy-reload    haproxy -W -S master.sock, `stats socket ... expose-fd listeners`; SIGUSR2
                    to the master, which re-executes itself and forks a worker that takes the
                    listeners from the old one (-x sockpair@N, checked on its command line).
                    Ready: the master's "Loading success." after its "New worker (N) forked".
  haproxy-sf        plain `haproxy -f cfg` (no master, no -x); `haproxy -f cfg -sf OLD` started
                    beside it binds its own socket (SO_REUSEPORT) and tells the old one to stop.
                    Ready: the old one's "Proxy f stopped" (it got the new one's SIGUSR1).
  nginx-usr2        nginx (stream module, daemon, own prefix and pid file); SIGUSR2 to the master
                    (a new master execs with the inherited sockets), then, once the new master
                    has started its 2 workers (ready), SIGQUIT to the old master.
Each relay: 2 workers (zcrelay workers 2, haproxy nbthread 2, nginx worker_processes 2),
backlog 4096, all on 127.0.0.1, on a fresh random free port below the ephemeral range (so a
client's source port can never be the listener's during a restart's gap).

Per way it reports: attempts; refused, reset, timeouts and other failures; the longest gap
between two consecutive successful completions in [trigger - 0.5 s, trigger + 2 s] (the window's
edges count as completions), and the same measure in [trigger - 1.4 s, trigger - 0.5 s], where
nothing happens (the round's noise floor: a loaded 2-CPU machine stalls a client now and then;
a round where that gap exceeds 100 ms is run again, at most twice, and listed);
the successful connections in the 1 s after the trigger divided by those in the 1 s before it;
and the upgrade's duration (trigger to ready, as above). stdout: the host line, the command and
one Markdown table of medians (min-max over the rounds); stderr: one line per round, and the
relay's log when a zcrelay way (other than the restart baseline) failed a connection.

Loopback only; every wait is bounded; it stops only the processes it started or that those
reported (the SIGUSR2 child's pid from the old relay's log, nginx's new master from its log and
pid file), by pid. It becomes a child subreaper so those orphans are reaped here.
"""
import collections
import ctypes
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.environ.get("ZCRELAY_BUILD", os.path.join(HERE, "..", "build"))
RELAY = os.path.join(BUILD, "zcrelay")
ECHO = os.path.join(BUILD, "bench", "echo_server")
CONN_RATE = os.path.join(BUILD, "bench", "conn_rate")
# The load: bench/conn_rate (C, 8 connections in flight, 64 B echoed each; ~0.1 ms resolution)
# when the build has it, else the Python clients (8 B, one at a time, ~2-4 ms stalls of their
# own). ZCRELAY_UPGRADE_CLIENT=python picks the latter anyway.
C_CLIENT = os.access(CONN_RATE, os.X_OK) and os.environ.get("ZCRELAY_UPGRADE_CLIENT") != "python"
C_CONNS = 8
PAYLOAD = 64 if C_CLIENT else 8
HAPROXY = "/usr/sbin/haproxy"
NGINX = "/usr/sbin/nginx"
NGINX_STREAM = "/usr/lib/nginx/modules/ngx_stream_module.so"

WAYS = ("zcrelay-takeover", "zcrelay-sigusr2", "zcrelay-socket", "zcrelay-restart",
        "haproxy-reload", "haproxy-sf", "nginx-usr2")
BEFORE = 1.5        # s of load before the trigger
AFTER = 2.5         # s of load after it
ATTEMPT_TIMEOUT = 1.0
MAX_ATTEMPTS = 200000   # per client process and round
CLIENTS = 2
GAP_WINDOW = (-0.5, 2.0)
STALLED_MS = 100    # a longer gap before the trigger: the machine was busy, run the round again
OUTCOMES = ("ok", "refused", "reset", "timeout", "other")


def pin_relay(tmp):
    """One binary for a whole run, whatever happens to the build meanwhile: RELAY copied into
    `tmp` and used from there. Returns its sha256 and when the copied build was made."""
    global RELAY
    import hashlib
    import shutil
    binary = os.path.join(tmp, "zcrelay")
    shutil.copy2(RELAY, binary)
    with open(binary, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    built = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(os.stat(RELAY).st_mtime))
    RELAY = binary
    return sha, built


def die(msg):
    raise SystemExit(f"upgrade.py: {msg}")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- client process

def client_main(port, max_n, out):
    """One load loop: short connections one after another from start_at until end_at
    (CLOCK_MONOTONIC), both read from stdin once this process has said it is up."""
    print("up", flush=True)
    start_at, end_at = map(float, sys.stdin.readline().split())
    now = time.monotonic()
    if start_at > now:
        time.sleep(start_at - now)
    recs = []
    addr = ("127.0.0.1", port)
    payload = b"upgrade!"
    mono = time.monotonic
    while len(recs) < max_n:
        t0 = mono()
        if t0 >= end_at:
            break
        deadline = t0 + ATTEMPT_TIMEOUT
        s = socket.socket()
        outcome = 0
        try:
            s.settimeout(ATTEMPT_TIMEOUT)
            s.connect(addr)
            s.settimeout(max(0.001, deadline - mono()))
            s.sendall(payload)
            got = 0
            while got < 8:
                s.settimeout(max(0.001, deadline - mono()))
                b = s.recv(8 - got)
                if not b:
                    outcome = 4        # closed before the echo
                    break
                got += len(b)
        except ConnectionRefusedError:
            outcome = 1
        except (ConnectionResetError, BrokenPipeError):
            outcome = 2
        except socket.timeout:
            outcome = 3
        except OSError:
            outcome = 4
        finally:
            s.close()
        recs.append((t0, mono(), outcome))
    with open(out, "w") as f:
        f.write("".join(f"{a:.6f} {b:.6f} {c}\n" for a, b, c in recs))


# --------------------------------------------------------------------------- processes

OWNED = {}   # pid -> Popen or None: everything this script started or was told about


def set_subreaper():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:   # PR_SET_CHILD_SUBREAPER
        die(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")


def alive(pid):
    p = OWNED.get(pid)
    if p is not None:
        return p.poll() is None
    try:
        got, _ = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return False
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_gone(pid, timeout):
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def clean_up(tmp):
    """The end of a run: every process it owns stopped, the orphans handed to this subreaper
    reaped, `tmp` removed."""
    for pid in list(OWNED):
        stop(pid)
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    subprocess.run(["rm", "-rf", "--", tmp], timeout=60)


def stop(pid, sig=signal.SIGTERM, timeout=15):
    """Stops one process of ours by pid: sig, a bounded wait, then SIGKILL."""
    if pid is None:
        return
    if alive(pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        if not wait_gone(pid, timeout):
            log(f"pid {pid} still there {timeout} s after signal {sig}; SIGKILL")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_gone(pid, 5)
    OWNED.pop(pid, None)


def own(pid, popen=None):
    OWNED[pid] = popen
    return pid


def popen(args, **kw):
    kw.setdefault("stdin", subprocess.DEVNULL)
    p = subprocess.Popen(args, **kw)
    own(p.pid, p)
    return p


class Tap:
    """Reads a pipe line by line in a thread; the lines with the time each was read."""

    def __init__(self, f):
        self.lines = []
        self.cond = threading.Condition()
        self.closed = False
        threading.Thread(target=self._run, args=(f,), daemon=True).start()

    def _run(self, f):
        for raw in iter(f.readline, b""):
            with self.cond:
                self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))
                self.cond.notify_all()
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def mark(self):
        with self.cond:
            return len(self.lines)

    def wait(self, regex, start=0, timeout=10.0):
        """The first line at or after index start matching regex: (index, time, match), or None."""
        rx = re.compile(regex)
        deadline = time.monotonic() + timeout
        i = start
        with self.cond:
            while True:
                while i < len(self.lines):
                    m = rx.search(self.lines[i][1])
                    if m:
                        return i, self.lines[i][0], m
                    i += 1
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    return None
                self.cond.wait(left)

    def text(self, start=0):
        with self.cond:
            return "\n".join(l for _, l in self.lines[start:])


def free_port():
    """A random port that binds now, below the ephemeral range (no self-connect in a gap)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(200):
        port = random.randint(12000, low - 1)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    die("no free port found")


def echo_once(port, timeout=2.0):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
            c.settimeout(timeout)
            c.sendall(b"probe!!!")
            got = b""
            while len(got) < 8:
                b = c.recv(8 - len(got))
                if not b:
                    return False
                got += b
            return got == b"probe!!!"
    except OSError:
        return False


def wait_serving(port, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if echo_once(port):
            return True
        time.sleep(0.02)
    return False


# --------------------------------------------------------------------------- echo upstream

PY_ECHO = r"""
import selectors, socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0)); srv.listen(4096); srv.setblocking(False)
print(srv.getsockname()[1], flush=True)
sel = selectors.DefaultSelector(); sel.register(srv, selectors.EVENT_READ)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for key, _ in sel.select(0.2):
        if key.fileobj is srv:
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            c.setblocking(False); sel.register(c, selectors.EVENT_READ)
            continue
        c = key.fileobj
        try:
            b = c.recv(65536)
        except OSError:
            b = b""
        if b:
            try:
                c.sendall(b)
                continue
            except OSError:
                pass
        sel.unregister(c); c.close()
"""


def start_echo(seconds):
    if os.access(ECHO, os.X_OK):
        args = [ECHO, "--port", "0", "--seconds", str(int(seconds)), "--close-after",
                str(PAYLOAD)]
        what = f"bench/echo_server --close-after {PAYLOAD}"
    else:
        args = [sys.executable, "-c", PY_ECHO, str(int(seconds))]
        what = "a Python echo (no bench/echo_server in the build)"
    p = popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    tap = Tap(p.stdout)
    got = tap.wait(r"^\d+$", timeout=10)
    if got is None:
        die("the echo upstream did not start")
    return p, int(got[2].group(0)), what


# --------------------------------------------------------------------------- the ways

class Way:
    """start(port) -> serving; upgrade() -> the ready time; settle() after the load; close()."""

    def __init__(self, tmp, tag, echo_port):
        self.tmp, self.tag, self.echo = tmp, tag, echo_port
        self.problems = []   # anything unexpected, reported per round

    def path(self, name):
        return os.path.join(self.tmp, f"{self.tag}-{name}")


class Zcrelay(Way):
    def __init__(self, kind, *a):
        super().__init__(*a)
        self.kind = kind
        self.held = None
        self.procs = []       # (Popen, stdout Tap, stderr Tap) of relays started here
        self.current = None   # pid of the relay serving now
        self.extra = None     # the SIGUSR2 child's pid

    def config(self, port):
        cfg = self.path("zcrelay.yaml")
        tk = f"takeover_socket: {self.path('takeover.sock')}\n" if self.kind == "takeover" else ""
        with open(cfg, "w") as f:
            f.write(f"workers: 2\ndrain_timeout: 10s\n{tk}"
                    'metrics: {listen: "127.0.0.1:0"}\n'
                    f"listeners:\n  - name: t\n    listen: 127.0.0.1:{port}\n"
                    f"    upstream: 127.0.0.1:{self.echo}\n    mode: splice\n")
        return cfg

    def launch(self, extra_args=()):
        args = [RELAY, "-c", self.cfg, *extra_args]
        if self.held is None:
            p = popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        else:
            fd = self.held.fileno()
            move = f"exec 3<&{fd} {fd}<&-; " if fd != 3 else ""
            script = move + 'LISTEN_FDS=1 LISTEN_PID=$$ exec "$@"'
            p = popen(["/bin/bash", "-c", script, "bash"] + args, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, pass_fds=(fd,))
        rec = (p, Tap(p.stdout), Tap(p.stderr))
        self.procs.append(rec)
        return rec

    def wait_ready(self, rec, start=0, timeout=10):
        got = rec[1].wait(r"^zcrelay: ready", start, timeout)
        if got is None:
            die(f"{self.tag}: relay pid {rec[0].pid} not ready within {timeout} s; its log:\n"
                + rec[2].text())
        return got[1]

    def start(self, port):
        if self.kind == "socket":
            self.held = socket.socket()
            self.held.bind(("127.0.0.1", port))
            self.held.listen(4096)
        self.cfg = self.config(port)
        rec = self.launch()
        self.wait_ready(rec)
        self.current = rec[0].pid
        return True

    def upgrade(self):
        a = self.procs[-1]
        if self.kind == "takeover":
            t0 = time.monotonic()
            b = self.launch(["--takeover"])
            ready = self.wait_ready(b)
            self.current = b[0].pid
        elif self.kind == "sigusr2":
            mark = a[1].mark()
            t0 = time.monotonic()
            os.kill(a[0].pid, signal.SIGUSR2)
            ready = self.wait_ready(a, mark)
            got = a[2].wait(r"SIGUSR2: started .* as pid (\d+)", 0, 5)
            if got is None:
                die(f"{self.tag}: no 'SIGUSR2: started ... as pid N' in the relay's log:\n"
                    + a[2].text())
            self.extra = own(int(got[2].group(1)))
            self.current = self.extra
        else:   # socket, restart: SIGTERM, wait for the exit, start again
            t0 = time.monotonic()
            a[0].send_signal(signal.SIGTERM)
            try:
                a[0].wait(timeout=15)
            except subprocess.TimeoutExpired:
                die(f"{self.tag}: relay pid {a[0].pid} still running 15 s after SIGTERM")
            b = self.launch()
            ready = self.wait_ready(b)
            self.current = b[0].pid
        return t0, ready

    def settle(self):
        # The old relay of a takeover or SIGUSR2 drains and exits 0.
        if self.kind in ("takeover", "sigusr2"):
            a = self.procs[0][0]
            try:
                rc = a.wait(timeout=15)
            except subprocess.TimeoutExpired:
                rc = None
                self.problems.append(f"old relay pid {a.pid} still running 15 s after the upgrade")
            if rc not in (0, None):
                self.problems.append(f"old relay pid {a.pid} exited {rc}")
            if not any("no longer accepting" in l for _, l in self.procs[0][2].lines):
                self.problems.append("the old relay never logged 'no longer accepting'")
        for p, _, _ in self.procs:
            if p.pid != self.current and p.poll() not in (0, None):
                self.problems.append(f"relay pid {p.pid} exited {p.returncode}")

    def log_text(self):
        # The log lines (timestamped) and the stdout lines, not the effective config's dump.
        out = []
        for p, o, e in self.procs:
            err = "\n".join(l for l in e.text().splitlines() if re.match(r"\d{4}-\d\d-\d\dT", l))
            out.append(f"--- relay pid {p.pid} stdout:\n{o.text()}\n--- stderr:\n{err}")
        return "\n".join(out)

    def close(self):
        stop(self.current)
        for p, _, _ in self.procs:
            stop(p.pid)
        if self.extra is not None:
            stop(self.extra)
        if self.held is not None:
            self.held.close()


def write_haproxy_cfg(path, port, echo, stats=""):
    """HAProxy in front of the echo, mode tcp, 2 threads; `stats` is one more global line."""
    with open(path, "w") as f:
        f.write(f"""global
    nbthread 2
    maxconn 8000
{"    " + stats + chr(10) if stats else ""}defaults
    mode tcp
    timeout connect 2s
    timeout client 10s
    timeout server 10s
frontend f
    bind 127.0.0.1:{port} backlog 4096
    default_backend b
backend b
    server s1 127.0.0.1:{echo}
""")


class HaproxyReload(Way):
    p = None

    def start(self, port):
        cfg = self.path("haproxy.cfg")
        write_haproxy_cfg(cfg, port, self.echo,
                          f"stats socket {self.path('stats.sock')} mode 600 level admin "
                          "expose-fd listeners")
        self.p = popen([HAPROXY, "-W", "-S", self.path("master.sock"), "-f", cfg],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.err = Tap(self.p.stderr)
        w = self.err.wait(r"New worker \((\d+)\) forked", 0, 10)
        if w is None or self.err.wait(r"Loading success", w[0], 10) is None:
            die(f"{self.tag}: haproxy did not start:\n" + self.err.text())
        self.worker = int(w[2].group(1))
        return wait_serving(port)

    def upgrade(self):
        mark = self.err.mark()
        t0 = time.monotonic()
        os.kill(self.p.pid, signal.SIGUSR2)
        w = self.err.wait(r"New worker \((\d+)\) forked", mark, 10)
        ok = w and self.err.wait(r"Loading success", w[0], 10)
        if not ok:
            die(f"{self.tag}: no new worker after SIGUSR2:\n" + self.err.text(mark))
        new = int(w[2].group(1))
        if new == self.worker:
            die(f"{self.tag}: the worker did not change ({new})")
        try:
            with open(f"/proc/{new}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if b"-x" not in cmd:
                self.problems.append(f"new worker {new} ran without -x: {cmd}")
        except OSError:
            pass
        self.old_worker, self.worker = self.worker, new
        return t0, ok[1]

    def settle(self):
        if self.err.wait(rf"Former worker \({self.old_worker}\) exited", 0, 15) is None:
            self.problems.append(f"old worker {self.old_worker} not gone 15 s after the reload")

    def log_text(self):
        return self.err.text()

    def close(self):
        if self.p is not None:
            stop(self.p.pid)


class HaproxySf(Way):
    a = b = None

    def start(self, port):
        self.cfg = self.path("haproxy.cfg")
        write_haproxy_cfg(self.cfg, port, self.echo)
        self.a = popen([HAPROXY, "-f", self.cfg], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
        self.a_err = Tap(self.a.stderr)
        self.b = None
        return wait_serving(port)

    def upgrade(self):
        t0 = time.monotonic()
        self.b = popen([HAPROXY, "-f", self.cfg, "-sf", str(self.a.pid)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.b_err = Tap(self.b.stderr)
        got = self.a_err.wait(r"Proxy f stopped", 0, 10)
        if got is None:
            die(f"{self.tag}: the old haproxy was not told to stop:\n" + self.a_err.text()
                + "\n" + self.b_err.text())
        return t0, got[1]

    def settle(self):
        try:
            self.a.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.problems.append(f"old haproxy {self.a.pid} still running 15 s after -sf")
        if self.b.poll() is not None:
            self.problems.append(f"new haproxy exited {self.b.returncode}")

    def log_text(self):
        return self.a_err.text() + "\n" + (self.b_err.text() if self.b else "")

    def close(self):
        for p in (self.b, self.a):
            if p is not None:
                stop(p.pid)


class NginxUsr2(Way):
    master = new_master = None

    def start(self, port):
        self.prefix = self.path("nginx")
        os.makedirs(os.path.join(self.prefix, "logs"))
        self.pidfile = os.path.join(self.prefix, "nginx.pid")
        conf = os.path.join(self.prefix, "nginx.conf")
        with open(conf, "w") as f:
            f.write(f"""load_module {NGINX_STREAM};
worker_processes 2;
pid {self.pidfile};
error_log stderr notice;
events {{ worker_connections 8000; }}
stream {{
    upstream echo {{ server 127.0.0.1:{self.echo}; }}
    server {{ listen 127.0.0.1:{port} backlog=4096; proxy_pass echo; }}
}}
""")
        # daemon (the default): a master whose parent is still its starter ignores SIGUSR2
        # ("the changing binary signal is ignored"), so `daemon off` under a supervisor cannot
        # upgrade. Its stderr stays this pipe; as subreaper this script reaps the masters.
        launcher = popen([NGINX, "-p", self.prefix, "-c", conf], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
        self.err = Tap(launcher.stderr)
        try:
            rc = launcher.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        OWNED.pop(launcher.pid, None)
        if rc != 0:
            die(f"{self.tag}: nginx did not start ({rc}):\n" + self.err.text())
        deadline = time.monotonic() + 10
        while self.master is None and time.monotonic() < deadline:
            try:
                with open(self.pidfile) as f:
                    self.master = own(int(f.read().strip()))
            except (OSError, ValueError):
                time.sleep(0.01)
        if self.master is None:
            die(f"{self.tag}: no nginx pid file:\n" + self.err.text())
        self.workers_of(self.master, 0)
        return wait_serving(port)

    def workers_of(self, master, start, timeout=10):
        """Waits for master's 2 'start worker process' lines; the time of the second."""
        t = None
        for _ in range(2):
            got = self.err.wait(rf" {master}#\d+: start worker process \d+", start, timeout)
            if got is None:
                die(f"{self.tag}: nginx master {master} did not start 2 workers:\n"
                    + self.err.text())
            start, t = got[0] + 1, got[1]
        return t

    def upgrade(self):
        mark = self.err.mark()
        t0 = time.monotonic()
        os.kill(self.master, signal.SIGUSR2)
        got = self.err.wait(r"start new binary process (\d+)", mark, 10)
        if got is None:
            die(f"{self.tag}: nginx did not start a new binary:\n" + self.err.text(mark))
        self.new_master = own(int(got[2].group(1)))
        ready = self.workers_of(self.new_master, mark)
        os.kill(self.master, signal.SIGQUIT)
        return t0, ready

    def settle(self):
        if not wait_gone(self.master, 15):
            self.problems.append(f"old nginx master {self.master} not gone 15 s after QUIT")
        try:
            with open(self.pidfile) as f:
                if int(f.read().strip()) != self.new_master:
                    self.problems.append("nginx.pid does not name the new master")
        except (OSError, ValueError) as e:
            self.problems.append(f"nginx.pid: {e}")

    def log_text(self):
        return self.err.text()

    def close(self):
        stop(self.new_master, signal.SIGQUIT)
        stop(self.master, signal.SIGQUIT)


def make_way(name, tmp, tag, echo_port):
    if name.startswith("zcrelay-"):
        return Zcrelay(name.split("-", 1)[1], tmp, tag, echo_port)
    return {"haproxy-reload": HaproxyReload, "haproxy-sf": HaproxySf,
            "nginx-usr2": NginxUsr2}[name](tmp, tag, echo_port)


# --------------------------------------------------------------------------- one round

def run_clients(tmp, tag, port):
    """Starts the client processes; once all are up, the times of the load, (start, trigger,
    end), are sent to them."""
    if C_CLIENT:
        # conn_rate waits for start_at itself; 0.3 s covers its start.
        out = os.path.join(tmp, f"{tag}-conn_rate.txt")
        start_at = time.monotonic() + 0.3
        trig_at, end_at = start_at + BEFORE, start_at + BEFORE + AFTER
        p = popen([CONN_RATE, "--port", str(port), "--conns", str(C_CONNS), "--seconds",
                   str(BEFORE + AFTER), "--start-at", repr(start_at), "--log", out,
                   "--max-count", str(MAX_ATTEMPTS * CLIENTS)],
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return [p], [out], trig_at, end_at
    outs = [os.path.join(tmp, f"{tag}-client{i}.txt") for i in range(CLIENTS)]
    procs = [popen([sys.executable, os.path.abspath(__file__), "--client", str(port),
                    str(MAX_ATTEMPTS), out], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
             for out in outs]
    for p in procs:
        if Tap(p.stdout).wait(r"^up$", 0, 15) is None:
            die("a client process did not come up within 15 s")
    start_at = time.monotonic() + 0.05
    trig_at, end_at = start_at + BEFORE, start_at + BEFORE + AFTER
    for p in procs:
        p.stdin.write(f"{start_at!r} {end_at!r}\n".encode())
        p.stdin.close()
    return procs, outs, trig_at, end_at


def collect(procs, outs, end_at):
    recs = []
    for p, out in zip(procs, outs):
        try:
            p.wait(timeout=max(1.0, end_at - time.monotonic()) + 10)
        except subprocess.TimeoutExpired:
            stop(p.pid)
            die("a client did not finish")
        OWNED.pop(p.pid, None)
        if p.returncode != 0:
            die(f"a client exited {p.returncode}")
        with open(out) as f:
            for line in f:
                a, b, c = line.split()
                recs.append((float(a), float(b), int(c)))
    return recs


def analyse(recs, t_trig):
    counts = collections.Counter(OUTCOMES[c] for _, _, c in recs)
    ok_ends = sorted(e for _, e, c in recs if c == 0)
    lo, hi = t_trig + GAP_WINDOW[0], t_trig + GAP_WINDOW[1]
    pts = [lo] + [e for e in ok_ends if lo <= e <= hi] + [hi]
    gap = max(b - a for a, b in zip(pts, pts[1:]))
    # The same measure before the window, without an upgrade: the noise floor of this round.
    blo, bhi = t_trig - BEFORE + 0.1, lo
    bpts = [blo] + [e for e in ok_ends if blo <= e <= bhi] + [bhi]
    base = max(b - a for a, b in zip(bpts, bpts[1:]))
    before = sum(1 for e in ok_ends if t_trig - 1.0 <= e < t_trig)
    after = sum(1 for e in ok_ends if t_trig <= e < t_trig + 1.0)
    fails = [(s, e, c) for s, e, c in recs if c != 0]
    return {"attempts": len(recs), **{k: counts.get(k, 0) for k in OUTCOMES},
            "gap_ms": gap * 1000, "base_gap_ms": base * 1000, "ratio": after / before if before else float("nan"),
            "before": before, "after": after, "fails": fails}


def one_round(name, rnd, tmp, echo_port):
    tag = f"r{rnd}-{name}"
    for attempt in range(3):   # a port taken in the meantime: another one
        port = free_port()
        way = make_way(name, tmp, f"{tag}-{attempt}", echo_port)
        try:
            why = "" if way.start(port) else "not serving"
        except SystemExit as e:
            why = str(e)
        if not why:
            break
        way.close()
        log(f"{tag}: no start on port {port}: {why}")
    else:
        die(f"{tag}: could not start in 3 tries")
    try:
        procs, outs, trig_at, end_at = run_clients(tmp, tag, port)
        time.sleep(max(0.0, trig_at - time.monotonic()))
        t_trig, t_ready = way.upgrade()
        recs = collect(procs, outs, end_at)
        way.settle()
        if not echo_once(port):
            way.problems.append("not serving after the upgrade")
        res = analyse(recs, t_trig)
        res["upgrade_ms"] = (t_ready - t_trig) * 1000
        res["problems"] = way.problems
        failed = res["attempts"] - res["ok"]
        if way.problems or (name.startswith("zcrelay-") and name != "zcrelay-restart" and failed):
            log(f"{tag}: FAILED CONNECTIONS OR PROBLEMS; failures at (s after the trigger): "
                + ", ".join(f"{s - t_trig:+.4f}..{e - t_trig:+.4f} {OUTCOMES[c]}"
                            for s, e, c in res["fails"][:20])
                + f"\n{way.log_text()}")
        return res
    finally:
        way.close()


# --------------------------------------------------------------------------- report

def cell(xs, fmt):
    sys.path.insert(0, HERE)
    from stats import describe   # bench/stats.py
    d = describe(xs)
    if d["n"] == 0:
        return "-"
    if d["min"] == d["max"]:
        return fmt.format(d["median"])
    return f"{fmt.format(d['median'])} ({fmt.format(d['min'])}–{fmt.format(d['max'])})"


def host_line():
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "-C", os.path.join(HERE, ".."), "rev-parse", "--short",
                              "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", os.path.join(HERE, ".."), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        if dirty:
            rev += " + uncommitted changes"
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    hv = subprocess.run([HAPROXY, "-v"], capture_output=True, text=True).stdout.split()[2]
    nv = subprocess.run([NGINX, "-v"], capture_output=True, text=True).stderr.strip()
    nv = nv.split("/")[-1]
    return (f"host: Linux {platform.release()}, {os.cpu_count()} CPUs ({model}); zcrelay at "
            f"{rev}; HAProxy {hv}; nginx {nv}")


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    if rounds < 1:
        die("ROUNDS must be at least 1")
    for what, path in (("zcrelay (build it first; ZCRELAY_BUILD picks the build dir)", RELAY),
                       ("haproxy (apt-get install haproxy)", HAPROXY),
                       ("nginx (apt-get install nginx-core)", NGINX)):
        if not os.access(path, os.X_OK):
            die(f"{path} is missing: {what}")
    if not os.path.exists(NGINX_STREAM):
        die(f"{NGINX_STREAM} is missing (apt-get install libnginx-mod-stream)")
    set_subreaper()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = tempfile.mkdtemp(prefix="zcrelay-upgrade-")
    results = {w: [] for w in WAYS}
    redone = []
    try:
        echo, echo_port, echo_what = start_echo(rounds * len(WAYS) * 30 + 120)
        host = host_line()
        log(f"upstream: {echo_what} on 127.0.0.1:{echo_port}; temp dir {tmp}")
        for rnd in range(1, rounds + 1):
            k = (rnd - 1) % len(WAYS)
            for name in WAYS[k:] + WAYS[:k]:
                for tries in range(1, 4):
                    r = one_round(name, rnd, tmp, echo_port)
                    if r["base_gap_ms"] <= STALLED_MS or tries == 3:
                        break
                    redone.append((name, rnd, r["base_gap_ms"]))
                    log(f"round {rnd} {name}: the load stalled {r['base_gap_ms']:.0f} ms before "
                        "the trigger (the machine busy elsewhere); this round again")
                results[name].append(r)
                log(f"round {rnd} {name:17} attempts {r['attempts']:6} ok {r['ok']:6} "
                    f"refused {r['refused']:5} reset {r['reset']:5} timeout {r['timeout']:3} "
                    f"other {r['other']:3} gap {r['gap_ms']:7.1f} ms (before {r['base_gap_ms']:5.1f})  rate {r['after']}/"
                    f"{r['before']} = {r['ratio']:.2f}  upgrade {r['upgrade_ms']:6.1f} ms"
                    + (f"  PROBLEMS: {'; '.join(r['problems'])}" if r["problems"] else ""))
        stop(echo.pid)
    finally:
        clean_up(tmp)

    print(host)
    load = (f"bench/conn_rate, {C_CONNS} connections in flight" if C_CLIENT
            else f"{CLIENTS} Python client processes")
    print(f"command: bench/upgrade.py {rounds}   ({load}, short connections of {PAYLOAD} echoed "
          f"bytes; load {BEFORE} s before the trigger, {AFTER} s after)")
    print()
    print("| way | attempts | refused | reset | timeouts | other | longest gap ms "
          "| gap before ms | rate after/before | upgrade ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w in WAYS:
        rs = results[w]
        col = lambda k, fmt="{:.0f}": cell([r[k] for r in rs], fmt)   # noqa: E731
        print(f"| {w} | {col('attempts')} | {col('refused')} | {col('reset')} | "
              f"{col('timeout')} | {col('other')} | {col('gap_ms', '{:.1f}')} | "
              f"{col('base_gap_ms', '{:.1f}')} | "
              f"{col('ratio', '{:.2f}')} | {col('upgrade_ms', '{:.1f}')} |")
    print()
    print(f"medians (min–max) over {rounds} rounds; longest gap: between two successful "
          f"completions in [trigger {GAP_WINDOW[0]:+} s, trigger {GAP_WINDOW[1]:+} s]; gap before: "
          f"the same in [trigger {-BEFORE + 0.1:+} s, trigger {GAP_WINDOW[0]:+} s], no upgrade in "
          "it (the noise floor); rate: successful connections in the 1 s after the trigger / in "
          "the 1 s before it; upgrade: trigger to the new process ready.")
    for name, rnd, ms in redone:
        print(f"redone: {name} round {rnd}: the load stalled {ms:.0f} ms before the trigger")
    problems = [(w, i + 1, p) for w in WAYS for i, r in enumerate(results[w]) for p in r["problems"]]
    for w, i, p in problems:
        print(f"problem: {w} round {i}: {p}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        port, max_n, out = sys.argv[2:5]
        client_main(int(port), int(max_n), out)
        sys.exit(0)
    sys.exit(main())
