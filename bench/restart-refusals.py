#!/usr/bin/env python3
"""Connections refused or reset while zcrelay restarts, with and without a held socket.

Usage: bench/restart-refusals.py [ROUNDS (3)]   (ZCRELAY_BUILD picks the build dir)

An echo upstream, and a client that keeps making short connections (8 bytes out, 8 echoed,
close) one after another. Midway the relay is restarted: SIGTERM, wait for its exit, start the
same command again. Two ways, ROUNDS times each, interleaved:
  own     the relay binds its listener itself, as without socket activation: between the old
          relay closing its socket and the new one binding, connections are refused;
  held    this script holds the listening socket, as systemd does for a .socket unit, and each
          relay gets it as fd 3 with LISTEN_FDS/LISTEN_PID (socket activation): connections that
          come in between wait in the socket's queue.
Prints one Markdown table: connections tried, failed (refused, reset or timed out) and the
restart's gap (SIGTERM to the new relay's ready line). Loopback only; every wait bounded; stops
only the processes it starts.
"""
import os
import socket
import subprocess
import sys
import threading
import time

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
build = os.environ.get("ZCRELAY_BUILD",
                       os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build"))
relay_bin = os.path.join(build, "zcrelay")


def echo_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1024)

    def serve(c):
        with c:
            c.settimeout(10)
            try:
                while True:
                    b = c.recv(4096)
                    if not b:
                        return
                    c.sendall(b)
            except OSError:
                return

    def loop():
        while True:
            c, _ = srv.accept()
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return srv.getsockname()[1]


def start_relay(port, upstream, held):
    args = [relay_bin, "--listen", f"127.0.0.1:{port}", "--upstream", f"127.0.0.1:{upstream}",
            "--workers", "2", "--metrics", "off"]
    if held is None:
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    else:
        # bash puts the held socket at fd 3 and names its own pid, then execs the relay in place.
        script = f'exec 3<&{held.fileno()} {held.fileno()}<&-; LISTEN_FDS=1 LISTEN_PID=$$ exec "$@"'
        p = subprocess.Popen(["/bin/bash", "-c", script, "bash"] + args, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, pass_fds=(held.fileno(),))
    deadline = time.time() + 10
    for line in p.stdout:
        if line.startswith("zcrelay: ready"):
            threading.Thread(target=p.stdout.read, daemon=True).start()
            return p
        if time.time() > deadline:
            break
    p.kill()
    raise SystemExit("relay did not start")


def client(port, stop, counts):
    while not stop.is_set():
        counts["tried"] += 1
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.settimeout(10)
                c.sendall(b"restart!")
                got = b""
                while len(got) < 8:
                    b = c.recv(8 - len(got))
                    if not b:
                        raise ConnectionError("closed")
                    got += b
        except OSError:
            counts["failed"] += 1


def one_round(way, upstream):
    held = None
    if way == "held":
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen(4096)
        port = held.getsockname()[1]
    else:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
    relay = start_relay(port, upstream, held)
    counts = {"tried": 0, "failed": 0}
    stop = threading.Event()
    t = threading.Thread(target=client, args=(port, stop, counts))
    t.start()
    time.sleep(1.0)
    t0 = time.time()
    relay.terminate()
    relay.wait(timeout=40)
    relay = start_relay(port, upstream, held)
    gap = time.time() - t0
    time.sleep(1.0)
    stop.set()
    t.join(timeout=30)
    relay.terminate()
    relay.wait(timeout=40)
    if held is not None:
        held.close()
    return counts["tried"], counts["failed"], gap


upstream = echo_server()
print("| way | round | connections | failed | restart gap ms |")
print("|---|---|---|---|---|")
for r in range(rounds):
    for way in ("own", "held"):
        tried, failed, gap = one_round(way, upstream)
        print(f"| {way} | {r + 1} | {tried} | {failed} | {gap * 1000:.0f} |", flush=True)
