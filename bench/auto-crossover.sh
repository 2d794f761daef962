#!/usr/bin/env bash
# bench/auto-crossover.sh: where sockmap stops paying for ping-pong, the basis of mode auto's
# auto_sockmap_max (docs/how-it-works.md). One zcrelay worker per mode on RELAY_CPU (1), the
# bench's pingpong server and client on LOAD_CPU (0), 64-byte round trips over 1, 2, 4, 8, 16,
# 32 and 100 persistent connections, RUNS (3) runs each; prints one line per run and the
# medians. Loopback only; every run bounded by `timeout`; stops only the processes it started.
#
# Usage: bench/auto-crossover.sh [MODE...]      (default: splice sockmap auto)
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}"
RELAY_CPU="${RELAY_CPU:-1}"
LOAD_CPU="${LOAD_CPU:-0}"
RUNS="${RUNS:-3}"
CONNS="${CONNS:-1 2 4 8 16 32 100}"
PORT_BASE="${PORT_BASE:-27000}"
NEXT_PORT=$PORT_BASE
MODES=("$@")
((${#MODES[@]})) || MODES=(splice sockmap auto)
OWN_PIDS=()
die() { echo "bench/auto-crossover.sh: $*" >&2; exit 1; }
# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"
WORK=$(mktemp -d)
trap cleanup EXIT

start_port_server server_port pingpong "$BUILD/bench/pingpong" server --listen 127.0.0.1:0 \
    --seconds 3600
for mode in "${MODES[@]}"; do
    pick_port relay_port
    taskset -c "$RELAY_CPU" "$BUILD/zcrelay" --listen "127.0.0.1:$relay_port" \
        --upstream "127.0.0.1:$server_port" --mode "$mode" --workers 1 --metrics off \
        >"$WORK/relay-$mode.log" 2>&1 &
    relay=$!
    OWN_PIDS+=("$relay")
    for _ in $(seq 100); do grep -q 'zcrelay: ready' "$WORK/relay-$mode.log" && break; sleep 0.05; done
    grep -q 'zcrelay: ready' "$WORK/relay-$mode.log" || die "$mode: $(cat "$WORK/relay-$mode.log")"
    for conns in $CONNS; do
        iters=$((40000 / conns)); ((iters < 400)) && iters=400
        : >"$WORK/rps" ; : >"$WORK/p50"
        for ((r = 0; r < RUNS; r++)); do
            line=$(timeout 60 taskset -c "$LOAD_CPU" "$BUILD/bench/pingpong" client \
                --connect "127.0.0.1:$relay_port" --conns "$conns" --iters "$iters" --warmup 200)
            rps=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["req_per_s"])' "$line")
            p50=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["p50_us"])' "$line")
            echo "$rps" >>"$WORK/rps"; echo "$p50" >>"$WORK/p50"
            echo "$mode conns=$conns run=$r req/s $rps p50_us $p50"
        done
        echo "$mode conns=$conns median req/s $(python3 "$SCRIPT_DIR/stats.py" median "$WORK/rps")" \
            "p50_us $(python3 "$SCRIPT_DIR/stats.py" median "$WORK/p50")"
    done
    kill "$relay"; wait_gone "$relay" 5 || kill -KILL "$relay"
done
