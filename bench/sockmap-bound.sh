#!/usr/bin/env bash
# bench/sockmap-bound.sh: what the sockmap program's in-flight bound (4 x pipe_size per
# direction) buys and costs. For each pipe_size in SIZES (256KiB 1MiB 4MiB 16MiB), a fresh
# zcrelay in mode sockmap (one worker on RELAY_CPU, metrics on a loopback port):
#   bulk     ROUNDS (5) transfers of 100 MiB through it (bench's transfer tool on LOAD_CPU):
#            median MB/s, and the share of the bytes the program passed to user space
#            (zcrelay_sockmap_copied_bytes_total against zcrelay_bytes_total);
#   stalled  a client writing for 3 s into an upstream that accepts and never reads: the
#            kernel's TCP memory (/proc/net/sockstat, "TCP: ... mem", pages) above what it was
#            before, the machine's MemAvailable below what it was (which also sees the psock's
#            backlog of redirected skbs: an egress redirect is charged to no socket), and the
#            relay's RSS, once the writer is held back.
# Prints one Markdown table. Loopback only; every load bounded by count and timeout; stops only
# the processes it started.
#
# Usage: bench/sockmap-bound.sh
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}"
RELAY_CPU="${RELAY_CPU:-1}"
LOAD_CPU="${LOAD_CPU:-0}"
ROUNDS="${ROUNDS:-5}"
SIZES="${SIZES:-256KiB 1MiB 4MiB 16MiB}"
PORT_BASE="${PORT_BASE:-28000}"
NEXT_PORT=$PORT_BASE
OWN_PIDS=()
die() { echo "bench/sockmap-bound.sh: $*" >&2; exit 1; }
# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"
WORK=$(mktemp -d)
trap cleanup EXIT

tcp_mem_pages() { awk '/^TCP:/ { for (i = 1; i < NF; i++) if ($i == "mem") print $(i + 1) }' /proc/net/sockstat; }

# start_relay SIZE UPSTREAM_PORT: RELAY, RELAY_PORT, METRICS_PORT.
start_relay() {
    pick_port RELAY_PORT
    pick_port METRICS_PORT
    printf '%s\n' "workers: 1" "drain_timeout: 0s" "metrics: {listen: \"127.0.0.1:$METRICS_PORT\"}" "listeners:" \
        "  - listen: \"127.0.0.1:$RELAY_PORT\"" "    upstream: \"127.0.0.1:$2\"" \
        "    mode: sockmap" "    pipe_size: $1" >"$WORK/relay.yaml"
    taskset -c "$RELAY_CPU" "$BUILD/zcrelay" -c "$WORK/relay.yaml" >"$WORK/relay.log" 2>&1 &
    RELAY=$!
    OWN_PIDS+=("$RELAY")
    local i
    for i in $(seq 100); do grep -q 'zcrelay: ready' "$WORK/relay.log" && return 0; sleep 0.05; done
    die "relay did not start: $(cat "$WORK/relay.log")"
}
stop_relay() { kill "$RELAY"; wait_gone "$RELAY" 5 || kill -KILL "$RELAY"; }

start_port_server sink_port sink "$BUILD/bench/transfer" sink --listen 127.0.0.1:0
# An upstream that accepts and never reads, and a client that writes as fast as it may.
python3 - "$WORK/holder.port" >/dev/null 2>&1 <<'PY' &
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(16)
open(sys.argv[1], "w").write(str(s.getsockname()[1]))
held = []
end = time.time() + 3600
while time.time() < end:
    c, _ = s.accept(); held.append(c)
PY
OWN_PIDS+=($!)
for _ in $(seq 100); do [[ -s "$WORK/holder.port" ]] && break; sleep 0.05; done
holder_port=$(cat "$WORK/holder.port")

echo "| pipe_size | in-flight bound | bulk 100 MiB MB/s, median (min–max) | passed to user space | stalled writer: TCP mem above idle | MemAvailable below idle | relay RSS |"
echo "|---|---|---|---|---|---|---|"
for size in $SIZES; do
    start_relay "$size" "$sink_port"
    : >"$WORK/mbps"
    for ((r = 0; r < ROUNDS; r++)); do
        line=$(timeout 120 taskset -c "$LOAD_CPU" "$BUILD/bench/transfer" client \
            --connect "127.0.0.1:$RELAY_PORT" --conns 1 --size-mib 100 --verify)
        python3 -c 'import json,sys; print(json.loads(sys.argv[1])["mb_per_s"])' "$line" >>"$WORK/mbps"
    done
    total=$(scrape_sum "$METRICS_PORT" zcrelay_bytes_total)
    passed=$(scrape_sum "$METRICS_PORT" zcrelay_sockmap_copied_bytes_total)
    stop_relay

    start_relay "$size" "$holder_port"
    idle_mem=$(tcp_mem_pages)
    idle_avail=$(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo)
    # Measured while the writer is still connected and held back.
    read -r stalled_mem avail rss < <(timeout 10 python3 - "$RELAY_PORT" "$RELAY" <<'PY'
import re, socket, sys, time
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
c.setblocking(False)
chunk = b"x" * 65536
end = time.time() + 3
while time.time() < end:
    try:
        c.send(chunk)
    except BlockingIOError:
        time.sleep(0.01)
time.sleep(0.5)
mem = re.search(r"^TCP:.* mem (\d+)", open("/proc/net/sockstat").read(), re.M).group(1)
rss = re.search(r"VmRSS:\s+(\d+)", open(f"/proc/{sys.argv[2]}/status").read()).group(1)
avail = re.search(r"^MemAvailable:\s+(\d+)", open("/proc/meminfo").read(), re.M).group(1)
print(mem, avail, rss)
PY
    )
    stop_relay
    printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$size" \
        "$(python3 -c "import re; v,u=re.match(r'(\d+)(\w+)','$size').groups(); print(f'{4*int(v)} {u}')")" \
        "$(python3 "$SCRIPT_DIR/stats.py" median "$WORK/mbps") ($(sort -n "$WORK/mbps" | head -1)–$(sort -n "$WORK/mbps" | tail -1))" \
        "$(python3 -c "print(f'{100 * $passed / max($total, 1):.1f} %')")" \
        "$(python3 -c "print(f'{($stalled_mem - $idle_mem) * 4096 / 2**20:.1f} MiB')")" \
        "$(python3 -c "print(f'{($idle_avail - $avail) / 1024:.1f} MiB')")" \
        "${rss} KiB"
done
