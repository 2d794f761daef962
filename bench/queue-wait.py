#!/usr/bin/env python3
"""What a client waiting in a cluster's queue costs a relay that holds many idle connections.

Usage: bench/queue-wait.py [--conns N (4000)] [--seconds S (10)] [--rounds R (3)]
                           [--mode splice|sockmap] RELAY [RELAY...]

Each RELAY binary (e.g. build/zcrelay and a build of an older commit) runs, one after another
and R rounds interleaved, with 2 workers and two listeners: `idle` relays to a holder (this
script: it reads what comes and keeps every connection open), and `q` to a cluster whose one
backend has max_connections 1 and a queue of 10 minutes. N connections through `idle` send one
byte each and stay open. Then the relay's CPU time (utime + stime of /proc/PID/stat) is read over
S seconds twice: with nobody in the queue, and with one client served through `q` and a second
one waiting in the queue behind it. Prints one Markdown row per binary: CPU ms per second without
and with the waiting client (medians, min-max over the rounds).

Loopback only; every wait is bounded; it stops only the relays it started, by pid.
"""
import argparse
import os
import re
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Holder:
    """Accepts on 127.0.0.1, reads whatever comes, keeps every connection open until close()."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4096)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ)
        self.conns = []
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            for key, _ in self.sel.select(0.1):
                if key.fileobj is self.sock:
                    try:
                        c, _ = self.sock.accept()
                    except BlockingIOError:
                        continue
                    c.setblocking(False)
                    self.conns.append(c)
                    self.sel.register(c, selectors.EVENT_READ)
                else:
                    try:
                        if not key.fileobj.recv(4096):
                            self.sel.unregister(key.fileobj)
                    except OSError:
                        self.sel.unregister(key.fileobj)

    def close(self):
        self.stop = True
        self.thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()


def start_relay(binary, tmp, holder_port, backend_port, mode):
    cfg = os.path.join(tmp, "zcrelay.yaml")
    with open(cfg, "w") as f:
        f.write(
            "workers: 2\n"
            'metrics: {listen: "127.0.0.1:0"}\n'
            "clusters:\n"
            "  - name: idle\n"
            f"    backends: [{{address: \"127.0.0.1:{holder_port}\"}}]\n"
            "  - name: db\n"
            "    queue_timeout: 600s\n"
            f"    backends: [{{address: \"127.0.0.1:{backend_port}\", max_connections: 1}}]\n"
            "listeners:\n"
            f"  - {{name: idle, listen: \"127.0.0.1:0\", cluster: idle, mode: {mode}}}\n"
            f"  - {{name: q, listen: \"127.0.0.1:0\", cluster: db, mode: {mode}}}\n")
    p = subprocess.Popen([binary, "-c", cfg], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True)
    ports = {}
    deadline = time.monotonic() + 20
    for line in p.stdout:
        m = re.match(r"zcrelay: listener (\S+) listening on 127\.0\.0\.1:(\d+)", line)
        if m:
            ports[m.group(1)] = int(m.group(2))
        if line.startswith("zcrelay: ready") or time.monotonic() > deadline:
            break
    if set(ports) != {"idle", "q"}:
        p.kill()
        p.wait()
        sys.exit(f"{binary}: not ready with both listeners ({ports})")
    return p, ports


def rate(pid, seconds):
    """The relay's CPU in ms per second over `seconds`."""
    t0, c0 = time.monotonic(), cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) * 1000 / (time.monotonic() - t0)


def one_round(binary, conns, seconds, mode):
    holder, backend = Holder(), Holder()
    clients = []
    with tempfile.TemporaryDirectory(prefix="zcrelay-queue-wait-") as tmp:
        relay, ports = start_relay(binary, tmp, holder.port, backend.port, mode)
        try:
            for _ in range(conns):
                c = socket.create_connection(("127.0.0.1", ports["idle"]), timeout=5)
                c.sendall(b"x")
                clients.append(c)
            deadline = time.monotonic() + 30
            while len(holder.conns) < conns and time.monotonic() < deadline:
                time.sleep(0.05)
            if len(holder.conns) < conns:
                sys.exit(f"{binary}: {len(holder.conns)} of {conns} reached the holder")
            time.sleep(1)
            without = rate(relay.pid, seconds)
            served = socket.create_connection(("127.0.0.1", ports["q"]), timeout=5)
            served.sendall(b"s")
            while len(backend.conns) < 1 and time.monotonic() < deadline + 10:
                time.sleep(0.01)
            waiting = socket.create_connection(("127.0.0.1", ports["q"]), timeout=5)
            waiting.sendall(b"w")
            clients += [served, waiting]
            time.sleep(1)
            if len(backend.conns) != 1:
                sys.exit(f"{binary}: the backend has {len(backend.conns)} connections, not 1")
            with_queue = rate(relay.pid, seconds)
        finally:
            relay.send_signal(signal.SIGINT)
            relay.send_signal(signal.SIGINT)  # the second closes every connection at once
            try:
                relay.wait(20)
            except subprocess.TimeoutExpired:
                relay.kill()
                relay.wait()
            for c in clients:
                c.close()
            holder.close()
            backend.close()
    return without, with_queue


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("relays", nargs="+")
    ap.add_argument("--conns", type=int, default=4000)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", default="splice", choices=("splice", "sockmap"))
    a = ap.parse_args()
    results = {r: [] for r in a.relays}
    for n in range(a.rounds):
        for r in a.relays:
            got = one_round(r, a.conns, a.seconds, a.mode)
            results[r].append(got)
            print(f"round {n + 1} {r}: {got[0]:.2f} ms/s without a waiting client, "
                  f"{got[1]:.2f} with one", file=sys.stderr)

    def cell(xs):
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    print(f"{a.conns} idle connections ({a.mode}), 2 workers; relay CPU ms per second over "
          f"{a.seconds:g} s, medians (min-max) of {a.rounds} rounds\n")
    print("| relay | nobody queued | one client queued |")
    print("|---|---|---|")
    for r, rows in results.items():
        print(f"| {r} | {cell([x[0] for x in rows])} | {cell([x[1] for x in rows])} |")


if __name__ == "__main__":
    main()
