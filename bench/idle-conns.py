#!/usr/bin/env python3
"""Threads, RSS and fds of zcrelay holding N idle relayed connections (loopback only).

Usage: bench/idle-conns.py [N] [WORKERS] [MODE]   (defaults 1000, 2, splice; ZCRELAY_BUILD picks
the build dir). Also prints the relay's CPU over IDLE_SECONDS (default 5) of those connections
sitting idle: what the relay's timers cost when nothing moves (sockmap waits for its program's
signal, so nothing should). Every wait is bounded; only the relay this script starts is stopped, by PID.
"""
import os
import re
import socket
import subprocess
import sys
import time

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
workers = sys.argv[2] if len(sys.argv) > 2 else "2"
mode = sys.argv[3] if len(sys.argv) > 3 else "splice"
idle_seconds = float(os.environ.get("IDLE_SECONDS", "5"))
build = os.environ.get("ZCRELAY_BUILD", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))

upstream = socket.socket()
upstream.bind(("127.0.0.1", 0))
upstream.listen(4096)
upstream.settimeout(10)
relay = subprocess.Popen(
    [os.path.join(build, "zcrelay"), "--listen", "127.0.0.1:0", "--upstream",
     f"127.0.0.1:{upstream.getsockname()[1]}", "--metrics", "off", "--workers", workers,
     "--mode", mode],
    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
port = None
for line in relay.stdout:  # the relay prints "zcrelay: ready" once it accepts
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    if m:
        port = int(m.group(1))
    if "ready" in line:
        break


def cpu_seconds():
    with open(f"/proc/{relay.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def status(key):
    with open(f"/proc/{relay.pid}/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1))


before_threads, before_rss = status("Threads"), status("VmRSS")
clients, peers = [], []
try:
    for _ in range(n):
        clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        peers.append(upstream.accept()[0])  # the relay connected upstream: the pair is live
    threads, rss = status("Threads"), status("VmRSS")
    fds = len(os.listdir(f"/proc/{relay.pid}/fd"))
    cpu0 = cpu_seconds()
    time.sleep(idle_seconds)
    idle_cpu = (cpu_seconds() - cpu0) / idle_seconds
    print(f"mode {mode}, workers {workers}: threads {before_threads} -> {threads} with {n} idle "
          f"connections; RSS {before_rss} -> {rss} KiB ({(rss - before_rss) * 1024 / n:.0f} B per "
          f"connection); fds {fds}; relay CPU while idle {idle_cpu * 100:.2f}% of a CPU")
finally:
    for s in clients + peers:
        s.close()
    relay.terminate()
    relay.wait(timeout=30)
