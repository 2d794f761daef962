#!/usr/bin/env python3
"""Idle relayed connections: what any relay (zcrelay, HAProxy, nginx, socat) spends holding them.

    idle.py hold [--seconds S]
        The upstream: listens on 127.0.0.1 (port printed alone on the first stdout line), accepts
        and holds every connection without reading, until SIGTERM or S seconds (default 600).
    idle.py open --connect PORT --count N --pids PID[,PID...] [--settle S]
        Opens N connections to the relay at 127.0.0.1:PORT, each sending one byte so that the
        relay must have connected upstream and moved it (relays may connect lazily), waits
        --settle seconds (default 2), and prints one JSON line: the relay's RSS (sum of VmRSS
        over PIDS and their children) and threads before and after, RSS per connection, and how
        many connections were opened. Exits 1 if fewer than N could be opened.

Loopback only; every wait is bounded. A process may hold at most 20,000 fds on these machines,
so the holder and the opener are separate processes (N sockets each).
"""
import argparse
import json
import os
import signal
import socket
import sys
import time


def tree(pids):
    """PIDS and all their descendants (haproxy and nginx run worker processes)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def status_sum(pids, key):
    total = 0
    for pid in tree(pids):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def hold(args):
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(4096)
    server.settimeout(0.2)
    print(server.getsockname()[1], flush=True)
    held = []
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    deadline = time.monotonic() + args.seconds
    while not stop and time.monotonic() < deadline:
        try:
            conn, _ = server.accept()
            held.append(conn)
        except socket.timeout:
            pass
    for c in held:
        c.close()


def open_conns(args):
    pids = [int(p) for p in args.pids.split(",") if p]
    rss0, threads0 = status_sum(pids, "VmRSS"), status_sum(pids, "Threads")
    conns = []
    deadline = time.monotonic() + 120
    try:
        for _ in range(args.count):
            if time.monotonic() > deadline:
                break
            c = socket.create_connection(("127.0.0.1", args.connect), timeout=10)
            c.sendall(b"x")
            conns.append(c)
    except OSError as e:
        print(f"idle.py: opened {len(conns)} of {args.count}: {e}", file=sys.stderr)
    time.sleep(args.settle)
    rss1, threads1 = status_sum(pids, "VmRSS"), status_sum(pids, "Threads")
    n = len(conns)
    print(json.dumps({"connections": n, "rss_kib_before": rss0, "rss_kib_after": rss1,
                      "rss_bytes_per_conn": round((rss1 - rss0) * 1024 / n, 1) if n else None,
                      "threads_before": threads0, "threads_after": threads1}))
    for c in conns:
        c.close()
    return 0 if n == args.count else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hold")
    h.add_argument("--seconds", type=float, default=600)
    o = sub.add_parser("open")
    o.add_argument("--connect", type=int, required=True)
    o.add_argument("--count", type=int, required=True)
    o.add_argument("--pids", required=True)
    o.add_argument("--settle", type=float, default=2)
    args = p.parse_args()
    if args.cmd == "hold":
        hold(args)
        return 0
    return open_conns(args)


if __name__ == "__main__":
    sys.exit(main())
