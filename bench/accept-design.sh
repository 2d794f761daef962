#!/usr/bin/env bash
# accept-design.sh: numbers for choosing how zcrelay accepts connections.
#
# Design in use: one SO_REUSEPORT listening socket per worker, each with a multishot accept on
# that worker's ring; the kernel spreads connections by 4-tuple hash. The alternative: one
# acceptor thread and ring that accepts everything and hands each socket to a worker's ring
# with IORING_OP_MSG_RING. This script measures
#
#   (a) what one MSG_RING hand-off costs here (bench/msg_ring_probe: latency and CPU per
#       message, cross-CPU and same-CPU, against an eventfd wake-up);
#   (b) what the relay does today: connection rate through zcrelay with 1 and 2 workers
#       (bench/conn_rate, 50 connections in flight, each connect + 64 B echo + close, against
#       bench/echo_server), the relay's CPU per connection, and how SO_REUSEPORT split the
#       connections between the workers (zcrelay_worker_connections_total).
#   A no-relay row (client straight to the echo server) shows what the client side alone does.
#
# Who closes first: the echo server half-closes once it has echoed the 64 B (ECHO_CLOSE_AFTER).
# With a purely passive echo server the relay's upstream socket sends the first FIN, so every
# TIME_WAIT sits on the relay's own ephemeral ports toward the one upstream ip:port, and the
# relay's connect() caps the rate at ~14k conn/s hunting for a reusable port (measured here,
# see echo_server.cpp): a limit of the test topology that would hide any accept-path cost.
# ECHO_CLOSE_AFTER=0 restores the passive server. The client rotates over 16 source addresses
# for the same reason on its own side (conn_rate --src-ips).
#
# Placement: echo server and client on CPU 0. With 1 worker the relay is pinned to CPU 1; with
# 2 workers it is left unpinned (its workers share both CPUs with the client and echo server).
#
# Builds nothing: expects zcrelay in BUILD and the bench tools in BUILD/bench.
# Usage: bench/accept-design.sh
# Environment: ZCRELAY_BUILD (<repo>/build), RUNS (5), RUN_SECONDS (5), INFLIGHT (50),
#              PORT_BASE (17500), ECHO_CLOSE_AFTER (64; 0 = echo server never closes first). Loopback only. Markdown summary on stdout, progress on stderr.

set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}"
readonly BENCH="$BUILD/bench"
readonly RUNS="${RUNS:-5}"
readonly RUN_SECONDS="${RUN_SECONDS:-5}"
readonly INFLIGHT="${INFLIGHT:-50}"
readonly PORT_BASE="${PORT_BASE:-17500}"
readonly ECHO_CLOSE_AFTER="${ECHO_CLOSE_AFTER:-64}"

readonly LOAD_CPU=0          # client and echo server
readonly RELAY_CPU=1         # relay, when it runs one worker
readonly READY_TIMEOUT=10    # s for zcrelay to print "zcrelay: ready" / echo_server its port
readonly PROBE_TIMEOUT=150   # s for msg_ring_probe (it stops itself at 120 s)
readonly ECHO_LIFETIME=600   # s: echo_server exits on its own after this, whatever happens here
readonly CLK_TCK="$(getconf CLK_TCK)"

WORK=""
NEXT_PORT="$PORT_BASE"
declare -a OWN_PIDS=()   # every long-lived process we started

die() { echo "accept-design: $*" >&2; exit 1; }
log() { echo "accept-design: $*" >&2; }
# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"

# ---------------------------------------------------------------- processes



# stop_pid PID: SIGTERM, then SIGKILL after 5 s. zcrelay drains on SIGTERM; by the time we stop
# it no connection is left, so it exits at once.
stop_pid() {
    local pid=$1
    is_alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    wait_gone "$pid" 5 || kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

cleanup() {
    local pid
    for pid in "${OWN_PIDS[@]}"; do stop_pid "$pid"; done
    [[ -n "$WORK" && -d "$WORK" ]] && rm -rf -- "$WORK"
    return 0
}

# ---------------------------------------------------------------- ports



# ---------------------------------------------------------------- helpers

# json_num LINE KEY: the number after "KEY": in a flat JSON line (empty if absent).
json_num() { sed -nE "s/.*\"$2\":(-?[0-9.eE+-]+).*/\1/p" <<<"$1"; }

# stats N1 N2 ...: "median min max" (median of an even count = mean of the middle two).
stats() {
    printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {
        if (NR == 0) { print "- - -"; exit }
        m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
        printf "%.0f %.0f %.0f\n", m, v[1], v[NR] }'
}

median() { stats "$@" | cut -d' ' -f1; }

# cpu_ticks PID: utime + stime of the whole process (all threads), in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# affinity PID: the distinct CPU lists of the process's threads, e.g. "1" or "0-1".
affinity() {
    local t out=()
    for t in /proc/"$1"/task/*; do
        out+=("$(taskset -pc "${t##*/}" 2>/dev/null | sed -E 's/.*: //')")
    done
    printf '%s\n' "${out[@]}" | sort -u | paste -sd' '
}

# ---------------------------------------------------------------- (a) probe

PROBE_ROWS=""

run_probe() {
    log "(a) msg_ring_probe: 100k round trips after 1k warm-up per variant"
    local out="$WORK/probe.jsonl" line
    if ! timeout "$PROBE_TIMEOUT" "$BENCH/msg_ring_probe" >"$out" 2>"$WORK/probe.err"; then
        log "msg_ring_probe failed: $(cat "$WORK/probe.err")"
    fi
    cat "$WORK/probe.err" >&2
    while IFS= read -r line; do
        echo "  $line" >&2
        local probe placement
        probe=$(sed -nE 's/.*"probe":"([^"]+)".*/\1/p' <<<"$line")
        placement=$(sed -nE 's/.*"placement":"([^"]+)".*/\1/p' <<<"$line")
        if [[ "$probe" == msg_ring_burst ]]; then
            PROBE_ROWS+="| msg_ring, burst of 16 per submit | $placement (CPU $(json_num "$line" cpu_a) -> $(json_num "$line" cpu_b)) | $(json_num "$line" per_msg_p50_us) (RTT/16) | RTT p99 $(json_num "$line" rtt_p99_us) | $(json_num "$line" cpu_us_per_msg) |"$'\n'
        else
            PROBE_ROWS+="| $probe ping-pong | $placement (CPU $(json_num "$line" cpu_a) -> $(json_num "$line" cpu_b)) | $(json_num "$line" one_way_p50_us) | $(json_num "$line" one_way_p99_us) | $(json_num "$line" cpu_us_per_msg) |"$'\n'
        fi
    done <"$out"
    [[ -n "$PROBE_ROWS" ]] || PROBE_ROWS="| (probe produced no output: see stderr above) | | | | |"$'\n'
}

# ---------------------------------------------------------------- (b) connection rate

RATE_ROWS=""
SPREAD_ROWS=""

# start_echo -> ECHO_PID, ECHO_PORT
start_echo() {
    local out="$WORK/echo.$1.out"
    taskset -c "$LOAD_CPU" "$BENCH/echo_server" --port 0 --seconds "$ECHO_LIFETIME" \
        --close-after "$ECHO_CLOSE_AFTER" >"$out" 2>&1 </dev/null &
    ECHO_PID=$!
    OWN_PIDS+=("$ECHO_PID")
    local deadline=$((SECONDS + READY_TIMEOUT))
    ECHO_PORT=""
    until [[ -n "$ECHO_PORT" ]]; do
        ECHO_PORT=$(head -n1 "$out" 2>/dev/null | grep -E '^[0-9]+$' || true)
        [[ -n "$ECHO_PORT" ]] && break
        is_alive "$ECHO_PID" && ((SECONDS < deadline)) || die "echo_server did not start: $(cat "$out")"
        sleep 0.02
    done
}

# start_relay WORKERS LPORT MPORT -> RELAY_PID, RELAY_PIN
start_relay() {
    local w=$1 lport=$2 mport=$3 log_file="$WORK/relay.$1.log"
    local -a pin=()
    if ((w == 1)); then pin=(taskset -c "$RELAY_CPU"); RELAY_PIN="pinned to CPU $RELAY_CPU"
    else RELAY_PIN="unpinned"; fi
    # taskset and stdbuf both exec, so $! is zcrelay itself. stdbuf: the "ready" line must reach
    # the log promptly even though stdout is a file.
    "${pin[@]}" stdbuf -oL "$BUILD/zcrelay" --listen "127.0.0.1:$lport" --upstream "127.0.0.1:$ECHO_PORT" \
        --workers "$w" --mode splice --metrics "127.0.0.1:$mport" >"$log_file" 2>&1 </dev/null &
    RELAY_PID=$!
    OWN_PIDS+=("$RELAY_PID")
    local deadline=$((SECONDS + READY_TIMEOUT))
    until grep -q '^zcrelay: ready' "$log_file" 2>/dev/null; do
        is_alive "$RELAY_PID" && ((SECONDS < deadline)) || die "zcrelay ($w workers) not ready: $(tail -n5 "$log_file")"
        sleep 0.02
    done
}

# run_rate LABEL PORT PID_OR_EMPTY: RUNS conn_rate runs against PORT; appends a table row.
run_rate() {
    local label=$1 port=$2 pid=$3 pin=$4
    local -a rates=() p50s=() p99s=() cpu_per_conn=()
    local errors=0 r line
    for ((r = 1; r <= RUNS; r++)); do
        local t0=0 t1=0
        [[ -n "$pid" ]] && t0=$(cpu_ticks "$pid")
        # Bounded twice: conn_rate stops itself after RUN_SECONDS + 2 s at most; timeout backs it.
        if ! line=$(timeout $((RUN_SECONDS + 20)) taskset -c "$LOAD_CPU" "$BENCH/conn_rate" --port "$port" \
                --conns "$INFLIGHT" --seconds "$RUN_SECONDS" 2>"$WORK/rate.err"); then
            log "  $label run $r: conn_rate failed: $(cat "$WORK/rate.err")"
            continue
        fi
        [[ -n "$pid" ]] && t1=$(cpu_ticks "$pid")
        local c rate
        c=$(json_num "$line" completed)
        rate=$(json_num "$line" conns_per_s)
        rates+=("$rate")
        p50s+=("$(json_num "$line" p50_us)")
        p99s+=("$(json_num "$line" p99_us)")
        errors=$((errors + $(json_num "$line" errors)))
        local cpu_note=""
        if [[ -n "$pid" ]] && ((c > 0)); then
            local us
            us=$(awk -v d=$((t1 - t0)) -v hz="$CLK_TCK" -v n="$c" 'BEGIN {printf "%.1f", d / hz * 1e6 / n}')
            cpu_per_conn+=("$us")
            cpu_note=" relay_cpu_us_per_conn=$us"
        fi
        log "  $label run $r: $line$cpu_note ($(tr '\n' ' ' <"$WORK/rate.err"))"
    done
    local med="-" min="-" max="-" p50="-" p99="-" cpu="-"
    if ((${#rates[@]})); then
        read -r med min max <<<"$(stats "${rates[@]}")"
        p50=$(median "${p50s[@]}")
        p99=$(median "${p99s[@]}")
    fi
    ((${#cpu_per_conn[@]})) && cpu=$(printf '%s\n' "${cpu_per_conn[@]}" | sort -g |
        awk '{v[NR]=$1} END {m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.1f (%.1f-%.1f)", m, v[1], v[NR]}')
    RATE_ROWS+="| $label | $pin | $med | $min | $max | $p50 | $p99 | $errors | $cpu | ${#rates[@]}/$RUNS |"$'\n'
}

# scrape WORKERS MPORT: per-worker accept counts -> SPREAD_ROWS
scrape() {
    local w=$1 mport=$2 body w0 w1
    if ! body=$(curl -s --max-time 5 "http://127.0.0.1:$mport/metrics"); then
        SPREAD_ROWS+="| $w | (scrape failed) | | | |"$'\n'
        return
    fi
    w0=$(awk '$1 == "zcrelay_worker_connections_total{worker=\"0\"}" {print $2}' <<<"$body")
    w1=$(awk '$1 == "zcrelay_worker_connections_total{worker=\"1\"}" {print $2}' <<<"$body")
    local failures
    failures=$(awk '/^zcrelay_upstream_connect_failures_total/ {s += $2} END {print s + 0}' <<<"$body")
    log "  metrics: worker0=${w0:-absent} worker1=${w1:-absent} upstream_connect_failures=$failures"
    local ratio
    ratio=$(awk -v a="${w0:-0}" -v b="${w1:-0}" 'BEGIN {t = a + b; if (t == 0) print "-"; else printf "%.4f", (a > b ? a : b) / t}')
    SPREAD_ROWS+="| $w | ${w0:-absent} | ${w1:-absent (1 worker)} | $ratio | $failures |"$'\n'
}

run_direct() {
    log "(b0) no relay: client -> echo_server directly"
    start_echo direct
    run_rate "no relay (client -> echo)" "$ECHO_PORT" "" "-"
    stop_pid "$ECHO_PID"
}

run_relay() {
    local w=$1 lport mport
    pick_port lport
    pick_port mport
    start_echo "w$w"
    start_relay "$w" "$lport" "$mport"
    log "(b) zcrelay --workers $w: pid $RELAY_PID, $RELAY_PIN (thread affinities: $(affinity "$RELAY_PID")), listen $lport, upstream echo $ECHO_PORT (CPU $LOAD_CPU), metrics $mport; TIME_WAIT sockets now: $(ss -Htan state time-wait | wc -l)"
    run_rate "zcrelay, $w worker(s)" "$lport" "$RELAY_PID" "$RELAY_PIN (threads: $(affinity "$RELAY_PID"))"
    scrape "$w" "$mport"
    stop_pid "$RELAY_PID"
    stop_pid "$ECHO_PID"
}

# ---------------------------------------------------------------- main

main() {
    local t
    for t in "$BUILD/zcrelay" "$BENCH/conn_rate" "$BENCH/echo_server" "$BENCH/msg_ring_probe"; do
        [[ -x "$t" ]] || die "missing $t (build first: cmake --build $BUILD)"
    done
    for t in curl taskset stdbuf timeout ss; do command -v "$t" >/dev/null || die "needs $t"; done
    (($(nproc) >= 2)) || die "needs 2 CPUs (has $(nproc))"

    WORK=$(mktemp -d /tmp/accept-design.XXXXXX)
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM

    local started=$SECONDS load_before
    # Other work on this 2-CPU machine skews every number below; record how busy it was.
    load_before=$(cut -d' ' -f1-3 /proc/loadavg)
    run_probe
    run_direct
    run_relay 1
    run_relay 2

    cat <<EOF
# Accept design: SO_REUSEPORT per worker vs one acceptor + MSG_RING

Host $(hostname -s), kernel $(uname -r), $(nproc) CPUs, $(date -u +%Y-%m-%dT%H:%MZ); $((SECONDS - started)) s.
Load average (1/5/15 min) before: $load_before; after: $(cut -d' ' -f1-3 /proc/loadavg).

## (a) Cost of one MSG_RING hand-off (msg_ring_probe)

Two threads, each with its own ring (SINGLE_ISSUER | DEFER_TASKRUN, made on its own thread),
both blocked in the kernel between messages; 100k round trips after 1k warm-up. One-way =
RTT / 2. CPU µs/msg = CPU time of both threads / messages (each message: one send + one wake).

| variant | placement | one-way p50 µs | one-way p99 µs | CPU µs/msg |
|---|---|---|---|---|
${PROBE_ROWS}
## (b) Connection rate (conn_rate: $INFLIGHT in flight, $RUNS runs x $RUN_SECONDS s, connect + 64 B echo + close)

Echo server closes first after $ECHO_CLOSE_AFTER B (0 = never); client source addresses 127.0.0.2-17.

Client and echo server on CPU $LOAD_CPU. p50/p99 are the medians over runs of each run's
percentile (connect start to echo received). Relay CPU = utime+stime of all relay threads per
completed connection (${CLK_TCK} Hz ticks), median (min-max) over runs.

| setup | relay placement | conns/s median | min | max | p50 µs | p99 µs | errors | relay CPU µs/conn | runs ok |
|---|---|---|---|---|---|---|---|---|---|
${RATE_ROWS}
## SO_REUSEPORT spread (zcrelay_worker_connections_total at the end of the runs)

| workers | worker 0 | worker 1 | larger / total | upstream connect failures |
|---|---|---|---|---|
${SPREAD_ROWS}
EOF
}

main "$@"
