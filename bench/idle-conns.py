#!/usr/bin/env python3
"""Threads, RSS and fds of zcrelay holding N idle relayed connections (loopback only).

Usage: bench/idle-conns.py [N] [WORKERS]   (defaults 1000, 2; ZCRELAY_BUILD picks the build dir)
Every wait is bounded; only the relay this script starts is stopped, by PID.
"""
import os
import re
import socket
import subprocess
import sys

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
workers = sys.argv[2] if len(sys.argv) > 2 else "2"
build = os.environ.get("ZCRELAY_BUILD", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))

upstream = socket.socket()
upstream.bind(("127.0.0.1", 0))
upstream.listen(4096)
upstream.settimeout(10)
relay = subprocess.Popen(
    [os.path.join(build, "zcrelay"), "--listen", "127.0.0.1:0", "--upstream",
     f"127.0.0.1:{upstream.getsockname()[1]}", "--metrics", "off", "--workers", workers],
    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
port = None
for line in relay.stdout:  # the relay prints "zcrelay: ready" once it accepts
    m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    if m:
        port = int(m.group(1))
    if "ready" in line:
        break


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
    print(f"workers {workers}: threads {before_threads} -> {threads} with {n} idle connections; "
          f"RSS {before_rss} -> {rss} KiB ({(rss - before_rss) * 1024 / n:.0f} B per connection); "
          f"fds {fds}")
finally:
    for s in clients + peers:
        s.close()
    relay.terminate()
    relay.wait(timeout=30)
