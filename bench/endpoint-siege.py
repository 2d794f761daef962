#!/usr/bin/env python3
"""bench/endpoint-siege.py: probe latency of zcrelay's metrics endpoint while its port is under
siege by idle and slowloris connections, and while /metrics is scraped.

Why: a Kubernetes liveness probe (httpGet, timeoutSeconds 1 by default) that gets no complete
answer in time counts as a failure, and a few in a row restart the pod. The probes share the
metrics port with whatever else can reach it: a port scanner, a load balancer holding idle
connections, a client that stalls mid-request, an attacker. None of them may starve the probes:
the endpoint should answer a probe within 100 ms while thousands of idle or trickling connections
are open and scrapes run. A thread-per-connection server with a few threads fails this with as
few connections as it has threads; this script shows where each relay binary stands.

Usage: bench/endpoint-siege.py [--relay NAME=PATH ...] [--hostile 2,200,5000] [--kinds idle,trickle]
                               [--probes 30] [--runs 3] [--probe-timeout 1.0] [--quick]
                               [--out-dir DIR]
  --relay     repeatable; replaces the default list, which is zcrelay=$ZCRELAY_BUILD/zcrelay.
              A binary that is missing is reported, the others still run, and the exit status
              is 1. With exactly two relays the report adds second / first ratios.
  --quick     a smoke run: hostile 2,200, 1 run, 10 probes (explicit flags still win). Its
              files are named *-quick* (git-ignored): not results.

One cell is (run, hostile count N, kind, relay). Cells are interleaved: for each run, for each
N, for each kind, every relay once, the relay order rotated from cell to cell so that none always
goes first (and so none always meets the machine in the same state). Per cell:
  1. A fresh relay: taskset -c RELAY_CPU zcrelay --listen 127.0.0.1:P --upstream 127.0.0.1:U
     --metrics 127.0.0.1:M --workers 1, ports free from PORT_BASE up. Nothing listens on U: the
     relay connects upstream only for a client of P, and this script never connects to P. It is
     ready when GET /healthz answers 200 (at most 10 s). Its RLIMIT_NOFILE, inherited from this
     script, is checked against N.
  2. A load process (this script with --siege-child, on LOAD_CPU like this script) opens N
     hostile connections to M: all connects non-blocking, then at most 20 s for the handshakes.
     Those still pending stay open, as a real flood's retransmitted SYNs would. Kinds:
       idle     connect, send nothing.
       trickle  slowloris: "GET /metrics HTTP/1.1\\r\\n" at once, then "X-a: b\\r\\n" every 500 ms
                on each connection still open, never ending the headers (non-blocking sends,
                EAGAIN ignored). A server whose timeout counts idle time never times these out.
     It watches every hostile connection for EOF or RST: the server closing it (timeout,
     eviction, refusal) is counted, and, as an attacker would, the load opens another in its
     place (at most RECONNECT_BATCH per 100 ms; --no-reconnect turns it off), so N stay open
     or connecting for the whole cell, not just until the server has shed them.
  3. The load process also starts a scraper: GET /metrics every 200 ms on a new connection, 2 s
     timeout, 200 and a complete body counted as ok.
  4. This process sends --probes probes, one after another with 100 ms between the end of one
     and the start of the next, alternating /healthz and /readyz, each on a new connection with
     kubelet's request (Host, User-Agent kube-probe/1.31, Connection: close). Latency runs from
     just before connect() to the complete response (headers and Content-Length bytes, or EOF).
     A probe without a complete 200 within --probe-timeout s fails: it is counted, with its
     reason, and left out of the percentiles. The probes run in their own process so that the
     load's Python threads cannot hold the GIL against them.
  5. The scraper stops, the hostile connections close, the relay gets SIGTERM (10 s, then
     SIGKILL) and must exit 0.

Output: progress on stderr. On stdout and in bench/results/<date>-<host>-endpoint-siege[-quick].md
a Markdown report: one table per kind, rows relay x N, with probes answered / sent (summed over
runs), p50, p99 and max ms as the median over runs (min-max across runs; each run's statistics
cover its answered probes only, nearest rank, so with 30 probes a run's p99 is its max), scrapes
ok / total, hostile connections established and closed by the server (median over runs); with
two relays, second / first for p50 and p99 where both answered. One JSON line per cell, raw
latencies included, goes to ...-endpoint-siege[-quick].jsonl (written as *.tmp until the end).

Environment: ZCRELAY_BUILD (directory of the default relay, <repo>/build), RELAY_CPU (1),
LOAD_CPU (0), PORT_BASE (26000). Bounds: relay start 10 s, handshakes 20 s, each probe
--probe-timeout, each scrape 2 s, relay stop 10 s + 5 s after SIGKILL, the load process exits on
its own after 900 s; a relay that fails to start twice is skipped for the rest of the run. All
traffic is on 127.0.0.1, and only processes this script started are signalled, by PID.
Exit status: 0; 1 if a relay was missing, failed to start, did not exit 0 after SIGTERM, or a
load process failed (probe and scrape failures are results, not errors); 2 on bad usage.
"""

import argparse
import collections
import errno
import hashlib
import json
import math
import os
import resource
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "127.0.0.1"

PROBE_GAP_S = 0.1
SCRAPE_EVERY_S = 0.2
SCRAPE_TIMEOUT_S = 2.0
TRICKLE_EVERY_S = 0.5
READY_BOUND_S = 10.0
CONNECT_BOUND_S = 20.0
STOP_BOUND_S = 10.0
KILL_BOUND_S = 5.0
CHILD_LIFETIME_S = 900.0  # the load process ends itself even if this script vanished
CONNECT_BATCH = 512       # connects issued between two looks at completions
RECONNECT_BATCH = 64      # replacements for closed hostile connections, per 100 ms at most
FD_HEADROOM = 200         # probes, scrapes, pipes, the interpreter's own files
START_FAILURES_TO_DROP = 2

TRICKLE_FIRST = b"GET /metrics HTTP/1.1\r\n"
TRICKLE_LINE = b"X-a: b\r\n"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- HTTP client

def http_get(port, path, timeout, user_agent):
    """One GET on a new connection. Returns (status or None, seconds, failure reason or None).

    Complete means headers plus Content-Length bytes (or EOF when there is no Content-Length):
    kubelet needs the whole answer, and waiting for EOF after it would time the server's close
    instead of its answer."""
    request = (f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nUser-Agent: {user_agent}\r\n"
               "Connection: close\r\n\r\n").encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    t0 = time.perf_counter()
    deadline = t0 + timeout
    phase = "connect"

    def left():
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise socket.timeout()
        return remaining

    try:
        s.settimeout(left())
        s.connect((HOST, port))
        phase = "send"
        s.settimeout(left())
        s.sendall(request)
        phase = "response"
        buf = bytearray()
        head_end, status, length = -1, None, None
        while True:
            s.settimeout(left())
            chunk = s.recv(65536)
            if not chunk:
                if status is not None and length is None:
                    break
                return None, time.perf_counter() - t0, f"closed ({phase})"
            buf += chunk
            if head_end < 0:
                head_end = buf.find(b"\r\n\r\n")
                if head_end < 0:
                    continue
                lines = bytes(buf[:head_end]).split(b"\r\n")
                parts = lines[0].split(None, 2)
                if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
                    return None, time.perf_counter() - t0, "bad status line"
                status = int(parts[1])
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length" and value.strip().isdigit():
                        length = int(value.strip())
            if length is not None and len(buf) - head_end - 4 >= length:
                break
        elapsed = time.perf_counter() - t0
        return status, elapsed, None if status == 200 else f"status {status}"
    except socket.timeout:
        return None, time.perf_counter() - t0, f"timeout ({phase})"
    except ConnectionRefusedError:
        return None, time.perf_counter() - t0, "refused"
    except ConnectionResetError:
        return None, time.perf_counter() - t0, f"reset ({phase})"
    except OSError as e:
        return None, time.perf_counter() - t0, f"{phase}: {e.strerror or e}"
    finally:
        s.close()


# --------------------------------------------------------------------------- load process

class Conn:
    __slots__ = ("sock", "fd", "state")

    def __init__(self, sock):
        self.sock, self.fd, self.state = sock, sock.fileno(), "pending"


class Siege:
    """N hostile connections, driven by one thread through epoll (level-triggered).

    Connections are objects, not fds, wherever they outlive one event (the trickle queue): an fd
    closed here can be reused at once by another socket of this process."""

    def __init__(self, port, n, kind, reconnect):
        self.port, self.n, self.kind, self.reconnect = port, n, kind, reconnect
        self.ep = select.epoll()
        self.live = {}  # fd -> Conn, pending or open
        self.trickle = collections.deque()  # (due, Conn), due in order: every gap is the same
        self.issued = self.established = self.connect_failed = self.reopened = 0
        self.closed_eof = self.closed_rst = 0
        self.lines_sent = self.bytes_from_server = 0
        self.connect_errors = collections.Counter()
        self.stop_opening = None

    def counts(self):
        pending = sum(1 for c in self.live.values() if c.state == "pending")
        return {"issued": self.issued, "established": self.established, "pending": pending,
                "open": len(self.live) - pending, "connect_failed": self.connect_failed,
                "closed_by_server": self.closed_eof + self.closed_rst,
                "closed_eof": self.closed_eof, "closed_rst": self.closed_rst,
                "trickle_lines": self.lines_sent, "bytes_from_server": self.bytes_from_server,
                "connect_errors": dict(self.connect_errors), "stopped_opening": self.stop_opening,
                "reopened": self.reopened}

    def _forget(self, c):
        self.live.pop(c.fd, None)
        try:
            self.ep.unregister(c.fd)
        except OSError:
            pass
        c.sock.close()

    def _server_closed(self, c, rst):
        if rst:
            self.closed_rst += 1
        else:
            self.closed_eof += 1
        c.state = "closed"
        self._forget(c)

    def _send(self, c, data):
        try:
            c.sock.send(data)
            self.lines_sent += 1
        except BlockingIOError:
            pass  # a server that does not read fills the buffer: that is the point
        except (ConnectionResetError, BrokenPipeError):
            self._server_closed(c, True)
        except OSError:
            self._server_closed(c, True)

    def _now_open(self, c):
        c.state = "open"
        self.established += 1
        self.ep.modify(c.fd, select.EPOLLIN | select.EPOLLRDHUP)
        if self.kind == "trickle":
            self._send(c, TRICKLE_FIRST)
            if c.state == "open":
                self.trickle.append((time.monotonic() + TRICKLE_EVERY_S, c))

    def _open_one(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        self.issued += 1
        err = s.connect_ex((HOST, self.port))
        c = Conn(s)
        if err in (0, errno.EINPROGRESS):
            self.live[c.fd] = c
            self.ep.register(c.fd, select.EPOLLOUT)
            if err == 0:
                self._now_open(c)
            return True
        self.connect_failed += 1
        self.connect_errors[errno.errorcode.get(err, str(err))] += 1
        s.close()
        if err in (errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.EAGAIN):
            self.stop_opening = errno.errorcode.get(err, str(err))
            return False
        return True

    def _event(self, fd, ev):
        c = self.live.get(fd)
        if c is None:
            return
        if c.state == "pending":
            err = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err == 0:
                self._now_open(c)  # a FIN already queued shows as EPOLLIN on the next wait
            elif err in (errno.ECONNRESET, errno.EPIPE):
                self.established += 1  # RST after the handshake: it was open, then closed
                self._server_closed(c, True)
            else:
                self.connect_failed += 1
                self.connect_errors[errno.errorcode.get(err, str(err))] += 1
                c.state = "failed"
                self._forget(c)
            return
        for _ in range(64):  # bounded: a server answering a trickle sends a few hundred bytes
            try:
                data = c.sock.recv(65536)
            except BlockingIOError:
                return
            except ConnectionResetError:
                self._server_closed(c, True)
                return
            except OSError:
                self._server_closed(c, True)
                return
            if not data:
                self._server_closed(c, False)
                return
            self.bytes_from_server += len(data)

    def _wait(self, timeout_s):
        try:
            events = self.ep.poll(max(timeout_s, 0.0), 1024)
        except InterruptedError:
            return
        for fd, ev in events:
            self._event(fd, ev)

    def _trickle_due(self):
        now = time.monotonic()
        for _ in range(len(self.trickle)):
            due, c = self.trickle[0]
            if due > now:
                return due
            self.trickle.popleft()
            if c.state != "open":
                continue
            self._send(c, TRICKLE_LINE)
            if c.state == "open":
                self.trickle.append((due + TRICKLE_EVERY_S, c))
        return self.trickle[0][0] if self.trickle else None

    def connect_all(self, deadline):
        while time.monotonic() < deadline:
            if self.issued < self.n and self.stop_opening is None:
                for _ in range(min(CONNECT_BATCH, self.n - self.issued)):
                    if not self._open_one():
                        break
                self._wait(0)
                continue
            if not any(c.state == "pending" for c in self.live.values()):
                return
            self._wait(min(0.05, deadline - time.monotonic()))
            if self.kind == "trickle":
                self._trickle_due()

    def run(self, stop, deadline):
        while not stop.is_set() and time.monotonic() < deadline:
            if self.reconnect and self.stop_opening is None:
                for _ in range(min(RECONNECT_BATCH, self.n - len(self.live))):
                    self.reopened += 1
                    if not self._open_one():
                        break
            due = self._trickle_due() if self.kind == "trickle" else None
            wait = 0.1 if due is None else min(0.1, due - time.monotonic())
            self._wait(wait)

    def close_all(self):
        for c in list(self.live.values()):
            self._forget(c)
        self.ep.close()


class Scraper(threading.Thread):
    def __init__(self, port, stop, deadline):
        super().__init__(daemon=True)
        self.port, self.stop, self.deadline = port, stop, deadline
        self.ok = self.total = 0
        self.failures = collections.Counter()

    def run(self):
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            t0 = time.monotonic()
            status, _, why = http_get(self.port, "/metrics", SCRAPE_TIMEOUT_S, "endpoint-siege-scraper")
            self.total += 1
            if why is None:
                self.ok += 1
            else:
                self.failures[why] += 1
            self.stop.wait(max(0.0, t0 + SCRAPE_EVERY_S - time.monotonic()))


def child_main(config_json):
    """The load of one cell. Talks to the parent in JSON lines: "ready" once the connections are
    made and the scraper runs, "done" after "stop" (or EOF) arrives on stdin."""
    cfg = json.loads(config_json)
    t0 = time.monotonic()
    lifetime_end = t0 + CHILD_LIFETIME_S
    siege = Siege(cfg["port"], cfg["hostile"], cfg["kind"], cfg["reconnect"])
    siege.connect_all(t0 + CONNECT_BOUND_S)
    ready = {"event": "ready", "connect_s": round(time.monotonic() - t0, 3), **siege.counts()}
    stop = threading.Event()
    siege_thread = threading.Thread(target=siege.run, args=(stop, lifetime_end), daemon=True)
    siege_thread.start()
    scraper = Scraper(cfg["port"], stop, lifetime_end)
    scraper.start()
    print(json.dumps(ready), flush=True)
    # Any line or EOF means stop: if the parent dies, its end of the pipe closes.
    select.select([sys.stdin], [], [], max(0.0, lifetime_end - time.monotonic()))
    stop.set()
    scraper.join(SCRAPE_TIMEOUT_S + 2)
    siege_thread.join(2)
    done = {"event": "done", **siege.counts(), "scrapes_ok": scraper.ok,
            "scrapes_total": scraper.total, "scrape_failures": dict(scraper.failures)}
    siege.close_all()
    print(json.dumps(done), flush=True)
    return 0


class LineReader:
    """Lines from a pipe with a deadline (select on a buffered text file can miss lines)."""

    def __init__(self, fd):
        self.fd, self.buf = fd, b""

    def readline(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            r, _, _ = select.select([self.fd], [], [], remaining)
            if not r:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()


# --------------------------------------------------------------------------- relay

class Ports:
    """Free ports from PORT_BASE upwards, never the same one twice in a run: a port just used
    still has TIME_WAIT sockets of the previous cell."""

    def __init__(self, base):
        self.next, self.limit = base, min(65535, base + 20000)

    def take(self):
        while self.next < self.limit:
            port = self.next
            self.next += 1
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((HOST, port))
                return port
            except OSError:
                continue
            finally:
                s.close()
        raise RuntimeError(f"no free port left below {self.limit}")


def nofile_of(pid):
    try:
        with open(f"/proc/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max open files"):
                    soft = line.split()[3]
                    return None if soft == "unlimited" else int(soft)
    except (OSError, ValueError, IndexError):
        pass
    return None


def log_tail(path, lines=15):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]) or "    (no output)\n"
    except OSError:
        return "    (no output)\n"


def start_relay(path, ports, relay_cpu, workdir, tag):
    """(Popen, metrics port, log path) once /healthz answers 200, or (None, why, log path)
    after stopping whatever started."""
    listen, upstream, metrics = ports.take(), ports.take(), ports.take()
    logpath = os.path.join(workdir, f"{tag}.log")
    cmd = ["taskset", "-c", str(relay_cpu), path, "--listen", f"{HOST}:{listen}",
           "--upstream", f"{HOST}:{upstream}", "--metrics", f"{HOST}:{metrics}", "--workers", "1"]
    with open(logpath, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_BOUND_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        status, _, _ = http_get(metrics, "/healthz", 0.5, "endpoint-siege-start")
        if status == 200:
            return proc, metrics, logpath
        time.sleep(0.05)
    if proc.poll() is None:
        stop_relay(proc)
        return None, "no /healthz 200 within 10 s", logpath
    return None, f"exited {proc.returncode} before /healthz answered", logpath


def stop_relay(proc):
    """Exit status after SIGTERM, and whether SIGKILL was needed."""
    if proc.poll() is not None:
        return proc.returncode, False
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=STOP_BOUND_S), False
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            return proc.wait(timeout=KILL_BOUND_S), True
        except subprocess.TimeoutExpired:
            return None, True


# --------------------------------------------------------------------------- one cell

def nearest_rank(sorted_xs, q):
    return sorted_xs[max(0, math.ceil(q * len(sorted_xs)) - 1)]


def run_cell(name, path, kind, hostile, run, args, ports, workdir):
    rec = {"bench": "endpoint-siege", "relay": name, "path": path, "kind": kind,
           "hostile": hostile, "run": run, "quick": int(args.quick), "started": False}
    tag = f"{name}-{kind}-{hostile}-r{run}"
    proc, mport, logpath = start_relay(path, ports, args.relay_cpu, workdir, tag)
    if proc is None:
        rec["error"] = f"relay did not start: {mport}"
        log(f"  {name}: did not start ({mport}); last lines of its output:\n{log_tail(logpath)}")
        return rec
    rec["started"] = True
    rec["metrics_port"] = mport
    rec["relay_nofile"] = nofile_of(proc.pid)
    if rec["relay_nofile"] is not None and rec["relay_nofile"] < hostile + 100:
        log(f"  warning: {name}'s RLIMIT_NOFILE is {rec['relay_nofile']}, short of {hostile} "
            "connections: it may refuse them for lack of fds")
    status, _, why = http_get(mport, "/readyz", 1.0, "endpoint-siege-start")
    if status != 200:
        log(f"  warning: {name} /readyz before the siege: {why}")
    child = None
    try:
        cfg = json.dumps({"port": mport, "hostile": hostile, "kind": kind,
                          "reconnect": not args.no_reconnect})
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--siege-child", cfg],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        reader = LineReader(child.stdout.fileno())
        line = reader.readline(CONNECT_BOUND_S + 10)
        ready = json.loads(line) if line else None
        if not ready or ready.get("event") != "ready":
            rec["error"] = "load process did not report its connections"
            return rec
        rec["hostile_connect"] = {k: v for k, v in ready.items() if k != "event"}
        latencies, failed = [], []
        for i in range(args.probes):
            if i:
                time.sleep(PROBE_GAP_S)
            probe_path = "/healthz" if i % 2 == 0 else "/readyz"
            status, secs, why = http_get(mport, probe_path, args.probe_timeout, "kube-probe/1.31")
            if why is None:
                latencies.append(round(secs * 1000, 3))
            else:
                failed.append({"i": i, "path": probe_path, "reason": why,
                               "after_ms": round(secs * 1000, 3)})
        child.stdin.write(b"stop\n")
        child.stdin.flush()
        line = reader.readline(SCRAPE_TIMEOUT_S + 15)
        done = json.loads(line) if line else None
        if not done or done.get("event") != "done":
            rec["error"] = "load process did not report its end"
        else:
            rec["hostile_end"] = {k: v for k, v in done.items()
                                  if k not in ("event", "scrapes_ok", "scrapes_total",
                                               "scrape_failures")}
            rec["scrapes_ok"], rec["scrapes_total"] = done["scrapes_ok"], done["scrapes_total"]
            rec["scrape_failures"] = done["scrape_failures"]
            rec["hostile_established"] = ready["established"]
            rec["closed_before_probes"] = ready["closed_by_server"]
            rec["closed_by_server"] = done["closed_by_server"]
        rec["probes_sent"] = args.probes
        rec["probes_answered"] = len(latencies)
        rec["failure_reasons"] = dict(collections.Counter(f["reason"] for f in failed))
        xs = sorted(latencies)
        for key, q in (("p50_ms", 0.5), ("p99_ms", 0.99)):
            rec[key] = nearest_rank(xs, q) if xs else None
        rec["max_ms"] = xs[-1] if xs else None
        rec["latencies_ms"] = latencies
        rec["failed_probes"] = failed
        return rec
    finally:
        if child is not None:
            try:
                child.stdin.close()
            except OSError:
                pass
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=5)
            child.stdout.close()
            if child.returncode != 0 and "error" not in rec:
                rec["error"] = f"load process exited {child.returncode}"
        code, killed = stop_relay(proc)
        rec["relay_exit"], rec["relay_killed"] = code, killed
        if code != 0:
            log(f"  {name}: exit status {code} after SIGTERM{' (SIGKILL needed)' if killed else ''};"
                f" last lines of its output:\n{log_tail(logpath)}")


# --------------------------------------------------------------------------- report

def fmt_ms(x):
    if x is None:
        return "—"
    if x < 10:
        return f"{x:.2f}"
    if x < 100:
        return f"{x:.1f}"
    return f"{x:.0f}"


def fmt_runs(values, runs):
    """median (min–max) over the runs that answered; "—" if none did."""
    if not values:
        return "—"
    text = fmt_ms(statistics.median(values))
    if len(values) > 1:
        text += f" ({fmt_ms(min(values))}–{fmt_ms(max(values))})"
    if len(values) < runs:
        text += f" [{len(values)}/{runs} runs]"
    return text


def fmt_count(values):
    if not values:
        return "—"
    m = statistics.median(values)
    text = f"{m:g}"
    if min(values) != max(values):
        text += f" ({min(values)}–{max(values)})"
    return text


def cell_median(recs, key):
    xs = [r[key] for r in recs if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def render(meta, relays, args, results):
    out = ["# endpoint-siege: probes while the metrics port is under siege", ""]
    out += [f"- date: {meta['date']}; host: {meta['host']}; kernel: {meta['kernel']}; "
            f"CPUs: {meta['cpus']} ({meta['cpu_model']}); load average at start: {meta['loadavg']}"]
    for name, path, info in relays:
        out.append(f"- relay `{name}`: `{path}` ({info})")
    out += [f"- hostile connections: {', '.join(map(str, args.hostile))}; kinds: "
            f"{', '.join(args.kinds)}; runs: {args.runs}; probes per run: {args.probes} "
            f"(/healthz and /readyz alternately, {PROBE_GAP_S * 1000:.0f} ms apart, timeout "
            f"{args.probe_timeout:g} s); scraper: GET /metrics every {SCRAPE_EVERY_S * 1000:.0f} "
            f"ms, timeout {SCRAPE_TIMEOUT_S:g} s; trickle: a header line every "
            f"{TRICKLE_EVERY_S * 1000:.0f} ms",
            f"- relay (`--workers 1`) on CPU {args.relay_cpu}; probes, hostile connections and "
            f"scraper on CPU {args.load_cpu}; RLIMIT_NOFILE {meta['nofile']}"
            + ("; **quick run: a smoke test, not a result**" if args.quick else ""), ""]
    ran = [name for name, _, info in relays if info != "missing"]
    for kind in args.kinds:
        out += [f"## {kind}", "",
                "| relay | hostile | connected | probes answered | p50 ms | p99 ms | max ms "
                "| scrapes ok | closed by server |",
                "|---|---:|---:|---:|---|---|---|---:|---:|"]
        for name in ran:
            for n in args.hostile:
                recs = results.get((name, kind, n), [])
                started = [r for r in recs if r["started"]]
                measured = [r for r in started if "probes_sent" in r]
                if not measured:
                    why = "did not start" if recs and not started else (
                        "skipped" if not recs else "load failed")
                    out.append(f"| {name} | {n} | {why} | | | | | | |")
                    continue
                answered = sum(r["probes_answered"] for r in measured)
                sent = sum(r["probes_sent"] for r in measured)
                stats = [fmt_runs([r[k] for r in measured if r[k] is not None], len(measured))
                         for k in ("p50_ms", "p99_ms", "max_ms")]
                sok = sum(r.get("scrapes_ok", 0) for r in measured)
                stot = sum(r.get("scrapes_total", 0) for r in measured)
                conn = fmt_count([r["hostile_established"] for r in measured
                                  if "hostile_established" in r])
                closed = fmt_count([r["closed_by_server"] for r in measured
                                    if "closed_by_server" in r])
                note = "" if len(measured) == args.runs else f" [{len(measured)}/{args.runs} runs]"
                out.append(f"| {name} | {n} | {conn} | {answered}/{sent}{note} | "
                           f"{' | '.join(stats)} | {sok}/{stot} | {closed} |")
        out.append("")
    failures = []
    for (name, kind, n), recs in sorted(results.items()):
        reasons = collections.Counter()
        for r in recs:
            reasons.update(r.get("failure_reasons", {}))
        if reasons:
            failures.append(f"- {name}, {kind}, {n} hostile: "
                            + ", ".join(f"{why} ×{k}" for why, k in reasons.most_common()))
    if failures:
        out += ["Failed probes by reason (summed over runs):", ""] + failures + [""]
    problems = [f"- {name}: `{path}` is missing; not measured"
                for name, path, info in relays if info == "missing"]
    for (name, kind, n), recs in sorted(results.items()):
        for r in recs:
            what = []
            if "error" in r:
                what.append(r["error"])
            if r["started"] and r.get("relay_exit") != 0:
                what.append(f"exit status {r.get('relay_exit')} after SIGTERM"
                            + (" (SIGKILL needed)" if r.get("relay_killed") else ""))
            if what:
                problems.append(f"- {name}, {kind}, {n} hostile, run {r['run']}: "
                                + "; ".join(what))
    if problems:
        out += ["**Failed runs** (the script exits 1; a run whose relay did not exit 0 still "
                "counts in the tables above):", ""] + problems + [""]
    started = [name for name in ran
               if any(r["started"] for (rn, _, _), recs in results.items() if rn == name
                      for r in recs)]
    if len(started) == 2:
        first, second = started
        lines = []
        for kind in args.kinds:
            for n in args.hostile:
                a = [r for r in results.get((first, kind, n), []) if r.get("p50_ms") is not None]
                b = [r for r in results.get((second, kind, n), []) if r.get("p50_ms") is not None]
                if not a or not b:
                    continue
                parts = []
                for key, label in (("p50_ms", "p50"), ("p99_ms", "p99")):
                    x, y = cell_median(a, key), cell_median(b, key)
                    if x and y is not None:
                        parts.append(f"{label} {y / x:.2f}×")
                if parts:
                    lines.append(f"- {kind}, {n} hostile: " + ", ".join(parts))
        out += [f"`{second}` / `{first}` (ratio of the medians over runs, only where both "
                "answered probes):", ""]
        out += lines if lines else ["- no cell where both answered probes"]
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench/endpoint-siege.py",
        description="Probe latency of zcrelay's metrics endpoint under idle and slowloris "
                    "connections and scrapes (see the header of this file).")
    p.add_argument("--relay", action="append", metavar="NAME=PATH",
                   help="a relay binary to measure (repeatable; replaces the default "
                        "zcrelay=$ZCRELAY_BUILD/zcrelay)")
    p.add_argument("--hostile", help="hostile connection counts (default 2,200,5000)")
    p.add_argument("--kinds", help="idle,trickle (default both)")
    p.add_argument("--probes", type=int, help="probes per cell and run (default 30)")
    p.add_argument("--runs", type=int, help="runs (default 3)")
    p.add_argument("--probe-timeout", type=float, default=1.0,
                   help="seconds a probe may take (default 1.0, kubelet's timeoutSeconds)")
    p.add_argument("--no-reconnect", action="store_true",
                   help="leave hostile connections the server closed closed")
    p.add_argument("--quick", action="store_true", help="smoke run: hostile 2,200, 1 run, 10 probes")
    p.add_argument("--out-dir", default=os.path.join(REPO, "bench", "results"))
    a = p.parse_args(argv)
    try:
        a.hostile = [int(x) for x in (a.hostile or ("2,200" if a.quick else "2,200,5000")).split(",")]
    except ValueError:
        p.error("--hostile takes comma-separated integers")
    if any(n < 0 for n in a.hostile):
        p.error("--hostile counts must be >= 0")
    a.kinds = (a.kinds or "idle,trickle").split(",")
    if any(k not in ("idle", "trickle") for k in a.kinds):
        p.error("--kinds: idle and/or trickle")
    a.probes = a.probes if a.probes is not None else (10 if a.quick else 30)
    a.runs = a.runs if a.runs is not None else (1 if a.quick else 3)
    if a.probes < 1 or a.runs < 1 or not 0 < a.probe_timeout <= 60:
        p.error("--probes and --runs must be >= 1, --probe-timeout in (0, 60]")
    build = os.environ.get("ZCRELAY_BUILD", os.path.join(REPO, "build"))
    relays = []
    for spec in a.relay or [f"zcrelay={os.path.join(build, 'zcrelay')}"]:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            p.error(f"--relay {spec!r}: expected NAME=PATH")
        if any(name == r[0] for r in relays):
            p.error(f"--relay: {name} given twice")
        relays.append((name, os.path.abspath(path)))
    a.relays = relays
    try:
        a.relay_cpu = int(os.environ.get("RELAY_CPU", "1"))
        a.load_cpu = int(os.environ.get("LOAD_CPU", "0"))
        a.port_base = int(os.environ.get("PORT_BASE", "26000"))
    except ValueError:
        p.error("RELAY_CPU, LOAD_CPU and PORT_BASE must be integers")
    return a


def describe_binary(path):
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return "missing"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    mtime = time.strftime("%F %T", time.localtime(os.path.getmtime(path)))
    return f"sha256 {h.hexdigest()[:12]}, built {mtime}"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown model"


def main(argv):
    if argv[:1] == ["--siege-child"]:
        return child_main(argv[1])
    args = parse_args(argv)
    allowed = os.sched_getaffinity(0)
    if args.relay_cpu not in allowed or args.load_cpu not in allowed:
        log(f"endpoint-siege: RELAY_CPU {args.relay_cpu} and LOAD_CPU {args.load_cpu} must be "
            f"among this process's CPUs {sorted(allowed)}")
        return 2
    if shutil.which("taskset") is None:
        log("endpoint-siege: taskset (util-linux) is needed to pin the relay")
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    need = max(args.hostile) + FD_HEADROOM
    if nofile != resource.RLIM_INFINITY and nofile < need:
        log(f"endpoint-siege: {max(args.hostile)} hostile connections need about {need} fds; "
            f"RLIMIT_NOFILE's hard limit is {hard}")
        return 2
    # Before any thread or child exists, so that all of them inherit it; the relay gets
    # RELAY_CPU from taskset instead.
    os.sched_setaffinity(0, {args.load_cpu})

    date, host = time.strftime("%F"), socket.gethostname().split(".")[0]
    meta = {"date": time.strftime("%F %T %Z"), "host": host, "kernel": os.uname().release,
            "cpus": os.cpu_count(), "cpu_model": cpu_model(),
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()), "nofile": nofile}
    relays, exit_status = [], 0
    for name, path in args.relays:
        info = describe_binary(path)
        relays.append((name, path, info))
        if info == "missing":
            log(f"endpoint-siege: relay {name}: {path} does not exist or is not executable; "
                "going on without it")
            exit_status = 1
    available = [(n, p) for n, p, info in relays if info != "missing"]

    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"{date}-{host}-endpoint-siege{'-quick' if args.quick else ''}")
    jsonl_tmp = stem + ".jsonl.tmp"
    workdir = tempfile.mkdtemp(prefix="endpoint-siege-")
    ports = Ports(args.port_base)
    results = collections.defaultdict(list)
    start_failures = collections.Counter()
    cell = 0
    t_start = time.monotonic()
    try:
        with open(jsonl_tmp, "w") as jsonl:
            for run in range(1, args.runs + 1):
                for n in args.hostile:
                    for kind in args.kinds:
                        k = cell % len(available) if available else 0
                        cell += 1
                        for name, path in available[k:] + available[:k]:
                            if start_failures[name] >= START_FAILURES_TO_DROP:
                                continue
                            log(f"[run {run}/{args.runs}] {kind} x{n}: {name} "
                                f"({time.monotonic() - t_start:.0f} s)")
                            rec = run_cell(name, path, kind, n, run, args, ports, workdir)
                            results[(name, kind, n)].append(rec)
                            jsonl.write(json.dumps(rec) + "\n")
                            jsonl.flush()
                            if not rec["started"]:
                                start_failures[name] += 1
                                exit_status = 1
                                if start_failures[name] >= START_FAILURES_TO_DROP:
                                    log(f"  {name} failed to start {START_FAILURES_TO_DROP} "
                                        "times: skipped from now on")
                                continue
                            if rec.get("relay_exit") != 0 or "error" in rec:
                                exit_status = 1
                            if "error" in rec:
                                log(f"  error: {rec['error']}")
                            if "probes_sent" in rec:
                                log(f"  {rec['probes_answered']}/{rec['probes_sent']} answered, "
                                    f"p50 {fmt_ms(rec['p50_ms'])} ms, max {fmt_ms(rec['max_ms'])} ms"
                                    f"; connected {rec.get('hostile_established', '?')}/{n}, "
                                    f"closed by server {rec.get('closed_by_server', '?')}; "
                                    f"scrapes {rec.get('scrapes_ok', '?')}/"
                                    f"{rec.get('scrapes_total', '?')}; relay exit "
                                    f"{rec['relay_exit']}")
        os.replace(jsonl_tmp, stem + ".jsonl")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = render(meta, relays, args, results)
    print(report)
    with open(stem + ".md", "w") as f:
        f.write(report + "\n")
    log(f"endpoint-siege: {stem}.md and .jsonl written ({time.monotonic() - t_start:.0f} s)")
    return exit_status


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
