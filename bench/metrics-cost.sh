#!/usr/bin/env bash
# bench/metrics-cost.sh: what zcrelay's metrics cost. The same relay with the metrics endpoint
# off, and with it on while a scraper GETs /metrics every SCRAPE_INTERVAL; the issue's goal is a
# cost under 2% on bulk and on ping-pong.
#
# Usage: bench/metrics-cost.sh [--quick]
#   --quick   3 short runs per side and workload, a smoke run (~1 minute); the full run is 7
#             runs (~4 minutes, < 8). Quick output is named *-quick* (git-ignored): not results.
#
# What differs between the sides: the per-worker counters are plain integers that zcrelay
# updates whether the endpoint is on or not (proxy/metrics.cpp), so "off" is not "no metrics"
# but "no endpoint, no scrapes". "on" adds the endpoint's thread (on RELAY_CPU with
# the worker: it inherits its affinity), the summing of every worker's counters at each scrape,
# and the scraper's own CPU on LOAD_CPU, which the load generator shares.
#
#   off   taskset -c RELAY_CPU zcrelay --listen 127.0.0.1:P --upstream 127.0.0.1:U --mode splice
#         --workers 1 --metrics off          (the same as `metrics: {listen: ""}` in a config)
#   on    the same with --metrics 127.0.0.1:M, and a scraper on LOAD_CPU: a bash loop that runs
#         `curl -sf --max-time 2 http://127.0.0.1:M/metrics` (each must answer 200), then waits
#         SCRAPE_INTERVAL (default 1 s) on a FIFO, which also tells it to stop; at most
#         SCRAPE_MAX_S seconds. The scrapes start with the load and stop when it ends; the
#         first one is at the start, so a run of T s sees about T / SCRAPE_INTERVAL + 1.
#         1 s is 15 times Prometheus' usual 15 s scrape_interval: a deliberately harsh case.
#         Each scrape costs the load CPU a curl fork+exec (a few ms, printed in the report).
#
# A fresh relay for every run (stopped by PID through bench/relays.sh's stop_relay; it must exit
# 0 after SIGTERM). Placement, as bench/run: the relay on RELAY_CPU (1), the load generators,
# their servers and the scraper on LOAD_CPU (0). Servers, started once and shared by both sides:
# <build>/bench/transfer sink and <build>/bench/pingpong server, on free ports from PORT_BASE up.
#
# Workloads:
#   bulk    transfer client --conns 10 --size-mib 100 --rounds BULK_ROUNDS: 10 connections of
#           100 MiB at once, BULK_ROUNDS times (one round lasts ~0.4 s here: too short for a
#           1 s scrape interval or for 10 ms CPU ticks). MB/s (10^6 B/s, from the client's
#           first connect to the last receipt) and relay CPU s per GB (10^9 B).
#   pp1     pingpong client --conns 1 --size 64: PP_ITERS round trips after PP_WARMUP. p50 and
#           p99 µs, relay CPU µs per round trip (warm-up included: it is in the CPU window).
#   pp100   pingpong client --conns 100 --size 64: PP100_ITERS round trips on each connection
#           (one epoll thread). req/s, relay CPU µs per round trip.
# Runs are interleaved: round r runs each side once, off first in odd rounds and on first in
# even ones, so drift of the machine does not favour a side. The relay's CPU is utime+stime of
# its process (all threads, the endpoint's included; /proc/PID/stat via relays.sh's
# relay_cpu_ticks) from just before the load starts to just after it ends. After each "on" run,
# outside that window, one more scrape checks that zcrelay_bytes_total (upstream) counted at
# least the bytes the load sent; the last one per workload is kept.
#
# Output: progress on stderr; a Markdown report on stdout and in
# bench/results/<date>-<host>-metrics-cost.md (date +%F, hostname -s): per side the median, min
# and max; on / off as the ratio of the medians with its range (on's worst run against off's
# best, and on's best against off's worst); the difference of the means with its 95% Student's t
# interval (bench/stats.py compare); and a verdict per workload and metric against the 2% goal.
# The raw samples (one number per line, one file per side and quantity, as bench/stats.py reads
# them) and the kept scrapes go to bench/results/<date>-<host>-metrics-cost-samples/.
#
# Environment: ZCRELAY_BUILD (<repo>/build), RELAY_CPU (1), LOAD_CPU (0), PORT_BASE (25000),
# RUNS (7, quick 3), SCRAPE_INTERVAL (s, 1), SCRAPE_MAX_S (120), BULK_ROUNDS (10, quick 3),
# PP_ITERS (20000, quick 3000), PP_WARMUP (500, quick 300), PP100_ITERS (3000, quick 500),
# TIME_BUDGET (s: no run starts after it; 420, quick 150), GOAL_PCT (2). Every wait is bounded;
# all traffic is on 127.0.0.1. A failed run (tool error, timeout, relay not starting or not
# exiting 0, a failed scrape, counters short of the bytes sent) is reported and never averaged
# in; the script then exits 1.
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}"
BENCH="$BUILD/bench"
RELAY_CPU="${RELAY_CPU:-1}"
LOAD_CPU="${LOAD_CPU:-0}"
PORT_BASE="${PORT_BASE:-25000}"
NEXT_PORT=$PORT_BASE
SCRAPE_INTERVAL="${SCRAPE_INTERVAL:-1}"
SCRAPE_MAX_S="${SCRAPE_MAX_S:-120}"
GOAL_PCT="${GOAL_PCT:-2}"
readonly BULK_CONNS=10 BULK_MIB=100 PP_SIZE=64 PP100_CONNS=100
readonly SERVER_LIFETIME=900   # s: a server exits on its own after this, whatever happens here
readonly SIDES=(off on)
readonly WORKLOADS=(bulk pp1 pp100)
QUICK=0
WORK=""
OWN_PIDS=()
FAILURES=0
SKIPPED=0

die() { echo "bench/metrics-cost.sh: $*" >&2; exit 1; }
log() { echo "bench/metrics-cost.sh: $*" >&2; }

# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"
# shellcheck source=relays.sh
source "$SCRIPT_DIR/relays.sh"   # stop_relay, relay_cpu_ticks, relay_version, _relay_ready

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

# ---------------------------------------------------------------- servers

SINK_PORT="" PP_PORT=""

# Both on LOAD_CPU; start_port_server (lib.sh) waits for the port each prints.
start_servers() {
    local port   # not "p": pick_port has a local p of its own
    pick_port port
    start_port_server SINK_PORT sink "$BENCH/transfer" sink --listen "127.0.0.1:$port" --seconds "$SERVER_LIFETIME"
    pick_port port
    start_port_server PP_PORT pingpong "$BENCH/pingpong" server --listen "127.0.0.1:$port" --size "$PP_SIZE" \
        --seconds "$SERVER_LIFETIME"
    log "servers: transfer sink on 127.0.0.1:$SINK_PORT, pingpong server on 127.0.0.1:$PP_PORT (CPU $LOAD_CPU)"
}

# ---------------------------------------------------------------- relay and scraper

# start_side SIDE UPSTREAM_PORT: a fresh zcrelay; for "on", METRICS_PORT is its endpoint.
# Sets the state relays.sh's stop_relay and relay_cpu_ticks read (RELAY_NAME zcrelay-off or
# zcrelay-on: its zcrelay-* patterns decide readiness and the expected exit status 0).
_SEQ=0
start_side() {
    local side=$1 up=$2 metrics=off
    RELAY_NAME="zcrelay-$side" RELAY_PID="" RELAY_ERR="" METRICS_PORT=""
    pick_port RELAY_PORT
    if [[ "$side" == on ]]; then
        pick_port METRICS_PORT
        metrics="127.0.0.1:$METRICS_PORT"
    fi
    _SEQ=$((_SEQ + 1))
    RELAY_DIR="$WORK/relay-$_SEQ-$side"
    mkdir -p "$RELAY_DIR"
    RELAY_LOG="$RELAY_DIR/output.log"
    # stdbuf: "zcrelay: ready" must reach the file at once though stdout is no tty.
    local -a argv=(stdbuf -oL "$BUILD/zcrelay" --listen "127.0.0.1:$RELAY_PORT"
        --upstream "127.0.0.1:$up" --mode splice --workers 1 --metrics "$metrics")
    RELAY_CMD="taskset -c $RELAY_CPU ${argv[*]:2}"
    taskset -c "$RELAY_CPU" "${argv[@]}" >"$RELAY_LOG" 2>&1 </dev/null &
    RELAY_PID=$!
    _RELAY_SHELL=$BASHPID
    OWN_PIDS+=("$RELAY_PID")
    local deadline=$((SECONDS + ${RELAY_READY_TIMEOUT:-10}))
    until _relay_ready "$RELAY_NAME"; do
        if ! is_alive "$RELAY_PID" || ((SECONDS >= deadline)); then
            RELAY_ERR="$RELAY_NAME did not get ready; $RELAY_LOG: $(_relay_tail "$RELAY_LOG")"
            log "$RELAY_ERR"
            stop_relay >/dev/null 2>&1 || true
            return 1
        fi
        sleep 0.05
    done
    if [[ "$side" == on ]] && ! grep -q "metrics on http://127.0.0.1:$METRICS_PORT/metrics" "$RELAY_LOG"; then
        RELAY_ERR="$RELAY_NAME: no 'metrics on' line in $RELAY_LOG"
        log "$RELAY_ERR"
        stop_relay >/dev/null 2>&1 || true
        return 1
    fi
}

# finish_relay: stop_relay; a wrong exit status or a needed SIGKILL is a failure.
finish_relay() {
    stop_relay
    if [[ -n "${RELAY_STOP_ERR:-}" ]]; then
        log "  $RELAY_NAME: $RELAY_STOP_ERR"
        FAILURES=$((FAILURES + 1))
        return 1
    fi
}

# _scrape_loop URL FIFO OUT: the scraper's body, in a background subshell. It pins itself to
# LOAD_CPU first (curl inherits it), scrapes, then waits SCRAPE_INTERVAL for a line on FIFO
# (the stop message; `read -t` is a builtin, so no sleep process). Bounded by SCRAPE_MAX_S.
# Leaves "OK FAILED" in OUT.count and bash's `times` (own, then children's CPU) in OUT.times.
_scrape_loop() {
    local url=$1 fifo=$2 out=$3 ok=0 bad=0 end=$((SECONDS + SCRAPE_MAX_S))
    taskset -pc "$LOAD_CPU" "$BASHPID" >/dev/null
    exec 3<>"$fifo"
    while ((SECONDS < end)); do
        if curl -sSf --max-time 2 -o "$out.prom" "$url"; then ok=$((ok + 1)); else bad=$((bad + 1)); fi
        read -r -t "$SCRAPE_INTERVAL" -u 3 _ && break
    done
    echo "$ok $bad" >"$out.count"
    times >"$out.times"
}

SCRAPER_PID="" SCRAPER_FIFO="" SCRAPER_OUT=""
start_scraper() {
    SCRAPER_FIFO="$RELAY_DIR/scraper.fifo"
    SCRAPER_OUT="$RELAY_DIR/scrape"
    mkfifo "$SCRAPER_FIFO"
    _scrape_loop "http://127.0.0.1:$METRICS_PORT/metrics" "$SCRAPER_FIFO" "$SCRAPER_OUT" \
        </dev/null 2>"$RELAY_DIR/scraper.err" &
    SCRAPER_PID=$!
    OWN_PIDS+=("$SCRAPER_PID")
}

# stop_scraper: the stop message (opened read-write: never blocks, even if the scraper died),
# a bounded wait, SIGTERM by PID as the fallback. Sets SCRAPES_OK, SCRAPES_BAD and
# SCRAPER_CPU_MS (its own CPU and that of the curls it reaped).
stop_scraper() {
    SCRAPES_OK=0 SCRAPES_BAD=0 SCRAPER_CPU_MS=""
    [[ -n "$SCRAPER_PID" ]] || return 0
    echo stop 1<>"$SCRAPER_FIFO"
    if ! wait_gone "$SCRAPER_PID" 5; then
        log "  scraper $SCRAPER_PID did not stop: SIGTERM"
        kill -TERM "$SCRAPER_PID" 2>/dev/null || true
        wait_gone "$SCRAPER_PID" 3 || kill -KILL "$SCRAPER_PID" 2>/dev/null || true
    fi
    wait "$SCRAPER_PID" 2>/dev/null || true
    local -a keep=()
    local p
    for p in "${OWN_PIDS[@]}"; do [[ "$p" == "$SCRAPER_PID" ]] || keep+=("$p"); done
    OWN_PIDS=("${keep[@]}")
    SCRAPER_PID=""
    [[ -s "$SCRAPER_OUT.count" ]] && read -r SCRAPES_OK SCRAPES_BAD <"$SCRAPER_OUT.count"
    # `times`: "0m0.003s 0m0.008s" (the shell), then the same for its reaped children.
    [[ -s "$SCRAPER_OUT.times" ]] && SCRAPER_CPU_MS=$(awk '
        { for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); t += a[1] * 60 + a[2] } }
        END { printf "%.1f", t * 1000 }' "$SCRAPER_OUT.times")
    return 0
}

# check_counters MIN_BYTES KEEP: one scrape after the load; zcrelay_bytes_total, upstream
# direction, summed over its series, must be at least MIN_BYTES. KEEP: where to keep the scrape.
check_counters() {
    local min=$1 keep=$2 body got
    body=$(curl -sf --max-time 5 "http://127.0.0.1:$METRICS_PORT/metrics") || {
        log "  final scrape failed"; return 1; }
    mkdir -p "$(dirname "$keep")"
    printf '%s\n' "$body" >"$keep"
    got=$(awk '/^zcrelay_bytes_total\{/ && /direction="upstream"/ { s += $NF } END { printf "%.0f", s }' "$keep")
    if awk -v g="$got" -v m="$min" 'BEGIN { exit !(g < m) }'; then
        log "  zcrelay_bytes_total upstream = $got < $min sent"
        return 1
    fi
}

# ---------------------------------------------------------------- measuring

json_field() { sed -nE "s/.*\"$2\": *(-?[0-9.eE+-]+).*/\1/p" <<<"$1"; }
sample() { mkdir -p "$(dirname "$1")"; echo "$2" >>"$1"; }
over_budget() { ((SECONDS >= TIME_BUDGET)); }

# load_cmd WORKLOAD: the load generator's argv for WORKLOAD, into LOAD_ARGV; MIN_BYTES and UNITS
# (bytes for bulk, round trips for ping-pong, warm-up included) describe its work.
load_cmd() {
    case "$1" in
        bulk)
            LOAD_ARGV=("$BENCH/transfer" client --connect "127.0.0.1:$RELAY_PORT" --conns "$BULK_CONNS"
                --size-mib "$BULK_MIB" --rounds "$BULK_ROUNDS" --timeout 60)
            UNITS=$((BULK_CONNS * BULK_MIB * BULK_ROUNDS * 1048576))
            MIN_BYTES=$UNITS ;;
        pp1)
            LOAD_ARGV=("$BENCH/pingpong" client --connect "127.0.0.1:$RELAY_PORT" --conns 1
                --size "$PP_SIZE" --iters "$PP_ITERS" --warmup "$PP_WARMUP")
            UNITS=$((PP_ITERS + PP_WARMUP))
            MIN_BYTES=$((PP_SIZE * PP_ITERS)) ;;
        pp100)
            LOAD_ARGV=("$BENCH/pingpong" client --connect "127.0.0.1:$RELAY_PORT" --conns "$PP100_CONNS"
                --size "$PP_SIZE" --iters "$PP100_ITERS" --warmup "$PP_WARMUP")
            UNITS=$((PP100_CONNS * (PP100_ITERS + PP_WARMUP)))
            MIN_BYTES=$((PP_SIZE * PP100_ITERS * PP100_CONNS)) ;;
    esac
}

# one_run WORKLOAD SIDE: one measurement through a fresh relay; samples under WORKLOAD/SIDE.*.
one_run() {
    local wl=$1 side=$2 base="$SAMPLES/$1/$2" up=$PP_PORT line t0 t1 ok=1 k
    [[ "$wl" == bulk ]] && up=$SINK_PORT
    start_side "$side" "$up" || { FAILURES=$((FAILURES + 1)); return 1; }
    load_cmd "$wl"
    relay_cpu_ticks >/dev/null
    t0=$RELAY_CPU_TICKS
    [[ "$side" == on ]] && start_scraper
    if ! line=$(timeout 120 taskset -c "$LOAD_CPU" "${LOAD_ARGV[@]}" 2>"$WORK/load.err"); then
        log "  $wl $side: ${LOAD_ARGV[0]##*/} failed: $(tail -n2 "$WORK/load.err" | tr '\n' ' ')"
        ok=0
    fi
    relay_cpu_ticks >/dev/null
    t1=$RELAY_CPU_TICKS
    local scrapes=""
    if [[ "$side" == on ]]; then
        stop_scraper
        scrapes=$SCRAPES_OK
        if ((SCRAPES_BAD || !SCRAPES_OK)); then
            log "  $wl on: $SCRAPES_BAD of $((SCRAPES_OK + SCRAPES_BAD)) scrapes failed: $(head -c 300 "$RELAY_DIR/scraper.err")"
            ok=0
        fi
        ((ok)) && { check_counters "$MIN_BYTES" "$SAMPLES/$wl/last-scrape.prom" || ok=0; }
    fi
    finish_relay || return 1
    if [[ "$wl" == bulk && "$(json_field "$line" failures)" != 0 ]]; then
        log "  bulk $side: transfer reported failures: $line"
        ok=0
    fi
    ((ok)) || { FAILURES=$((FAILURES + 1)); return 1; }

    local cpu_s msg
    cpu_s=$(awk -v d=$((t1 - t0)) -v hz="$CLK_TCK" 'BEGIN { printf "%.2f", d / hz }')
    sample "$base.relay_cpu_s" "$cpu_s"
    if [[ "$side" == on ]]; then
        sample "$base.scrapes" "$scrapes"
        sample "$base.scraper_cpu_ms_per_scrape" \
            "$(awk -v c="$SCRAPER_CPU_MS" -v n="$scrapes" 'BEGIN { printf "%.2f", c / n }')"
        msg=", $scrapes scrapes"
    fi
    case "$wl" in
        bulk)
            local rate per_gb
            rate=$(json_field "$line" mb_per_s)
            per_gb=$(awk -v c="$cpu_s" -v b="$UNITS" 'BEGIN { printf "%.4f", c / (b / 1e9) }')
            sample "$base.mb_per_s" "$rate"
            sample "$base.relay_cpu_s_per_gb" "$per_gb"
            log "  bulk $side: $rate MB/s, relay CPU $per_gb s/GB${msg:-}" ;;
        pp1|pp100)
            local us
            us=$(awk -v c="$cpu_s" -v n="$UNITS" 'BEGIN { printf "%.3f", c * 1e6 / n }')
            for k in p50_us p99_us req_per_s; do sample "$base.$k" "$(json_field "$line" "$k")"; done
            sample "$base.relay_cpu_us_per_rt" "$us"
            log "  $wl $side: $(json_field "$line" req_per_s) req/s, p50 $(json_field "$line" p50_us) µs," \
                "p99 $(json_field "$line" p99_us) µs, relay CPU $us µs/round trip${msg:-}" ;;
    esac
}

# rounds WORKLOAD: RUNS interleaved rounds (off first in odd rounds, on first in even ones).
rounds() {
    local wl=$1 r side
    for ((r = 1; r <= RUNS; r++)); do
        log "$wl round $r/$RUNS"
        local -a order=(off on)
        ((r % 2)) || order=(on off)
        for side in "${order[@]}"; do
            if over_budget; then
                SKIPPED=$((SKIPPED + 1))
                continue
            fi
            one_run "$wl" "$side" || true
        done
    done
}

# ---------------------------------------------------------------- main

configure() {
    if ((QUICK)); then
        RUNS=${RUNS:-3}; BULK_ROUNDS=${BULK_ROUNDS:-3}; PP_ITERS=${PP_ITERS:-3000}
        PP_WARMUP=${PP_WARMUP:-300}; PP100_ITERS=${PP100_ITERS:-500}; TIME_BUDGET=${TIME_BUDGET:-150}
    else
        RUNS=${RUNS:-7}; BULK_ROUNDS=${BULK_ROUNDS:-10}; PP_ITERS=${PP_ITERS:-20000}
        PP_WARMUP=${PP_WARMUP:-500}; PP100_ITERS=${PP100_ITERS:-3000}; TIME_BUDGET=${TIME_BUDGET:-420}
    fi
    [[ "$SCRAPE_INTERVAL" =~ ^[0-9]*\.?[0-9]+$ ]] && awk -v i="$SCRAPE_INTERVAL" 'BEGIN { exit !(i > 0) }' ||
        die "SCRAPE_INTERVAL must be a positive number of seconds"
    local v
    for v in RUNS BULK_ROUNDS PP_ITERS PP_WARMUP PP100_ITERS TIME_BUDGET SCRAPE_MAX_S; do
        [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer"
    done
}

main() {
    while (($#)); do
        case "$1" in
            --quick) QUICK=1 ;;
            -h|--help) usage 0 ;;
            *) echo "bench/metrics-cost.sh: unknown argument '$1'" >&2; usage 2 ;;
        esac
        shift
    done
    configure
    (($(nproc) >= 2)) || die "needs 2 CPUs (relay on $RELAY_CPU, load on $LOAD_CPU)"
    local t
    for t in transfer pingpong; do
        [[ -x "$BENCH/$t" ]] || die "$BENCH/$t missing: build first (bench/README.md)"
    done
    [[ -x "$BUILD/zcrelay" ]] || die "$BUILD/zcrelay missing: build first"
    for t in curl mkfifo taskset stdbuf timeout ss awk python3; do
        command -v "$t" >/dev/null || die "needs $t (deploy/install-deps.sh)"
    done
    CLK_TCK=$(getconf CLK_TCK)
    HOST=$(hostname -s)
    KERNEL=$(uname -r)
    DATE=$(date +%F)
    LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
    local suffix=metrics-cost
    ((QUICK)) && suffix=metrics-cost-quick
    mkdir -p "$SCRIPT_DIR/results"
    REPORT="$SCRIPT_DIR/results/$DATE-$HOST-$suffix.md"
    SAMPLES="$SCRIPT_DIR/results/$DATE-$HOST-$suffix-samples"
    rm -rf -- "$SAMPLES"
    mkdir -p "$SAMPLES"
    WORK=$(mktemp -d /dev/shm/zcbench-metrics.XXXXXX)
    trap 'stop_scraper >/dev/null 2>&1 || true; stop_relay >/dev/null 2>&1 || true; cleanup' EXIT
    log "zcrelay splice, 1 worker, metrics off vs on + a scrape every ${SCRAPE_INTERVAL}s; $RUNS runs each;" \
        "relay on CPU $RELAY_CPU, load on CPU $LOAD_CPU; $HOST, $KERNEL; load average $LOAD_BEFORE"

    start_servers
    local wl
    for wl in "${WORKLOADS[@]}"; do rounds "$wl"; done

    LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
    ELAPSED_MIN=$(awk -v s="$SECONDS" 'BEGIN{printf "%.1f", s/60}')
    report | tee "$REPORT"
    log "report: $REPORT; samples: $SAMPLES"
    if ((FAILURES || SKIPPED)); then
        log "$FAILURES failed run(s), $SKIPPED skipped for the time budget"
        exit 1
    fi
}

report() {
    echo "### bench/metrics-cost.sh on $HOST ($KERNEL), $DATE$( ((QUICK)) && echo ', --quick: a smoke run, not results to quote')"
    echo
    echo "$(relay_version zcrelay-splice 2>/dev/null || echo zcrelay), mode splice, 1 worker, on CPU $RELAY_CPU;" \
        "load generators, their servers and the scraper on CPU $LOAD_CPU. $(nproc) CPUs" \
        "($(lscpu | sed -nE 's/^Model name: *//p' | head -n1)). Load average $LOAD_BEFORE before, $LOAD_AFTER after" \
        "(this bench keeps about 2 tasks runnable itself: well above 2 after it, other work shared the CPUs)."
    echo "**off**: \`--metrics off\` (counters still updated, no endpoint). **on**: \`--metrics 127.0.0.1:PORT\`" \
        "and \`curl\` GET /metrics every ${SCRAPE_INTERVAL} s during the load (Prometheus' usual interval is 15 s)."
    echo "$RUNS runs per side and workload, interleaved, a fresh relay each. bulk: transfer --conns $BULK_CONNS" \
        "--size-mib $BULK_MIB --rounds $BULK_ROUNDS; pp1: pingpong --conns 1 --size $PP_SIZE, $PP_ITERS round trips" \
        "after $PP_WARMUP; pp100: pingpong --conns $PP100_CONNS, $PP100_ITERS round trips each after $PP_WARMUP." \
        "Measuring took $ELAPSED_MIN minutes."
    ((FAILURES || SKIPPED)) && echo "**$FAILURES failed run(s), $SKIPPED skipped for the time budget** (stderr says which)."
    echo
    python3 - "$SAMPLES" "$SCRIPT_DIR" "$GOAL_PCT" "$SCRAPE_INTERVAL" <<'EOF'
import os, statistics, sys

samples, bench_dir, goal, interval = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
sys.path.insert(0, bench_dir)
import stats  # bench/stats.py: ministat's Student's t comparison

def read(wl, side, key):
    try:
        with open(os.path.join(samples, wl, f"{side}.{key}")) as f:
            return [float(x) for x in f.read().split()]
    except FileNotFoundError:
        return []

def s3(xs):
    return (statistics.median(xs), min(xs), max(xs)) if xs else None

def f(v, d):
    return "-" if v is None else f"{v:,.{d}f}"

# (workload, title, key, label, digits, higher is better)
ROWS = [
    ("bulk", "bulk: 10 connections x 100 MiB", "mb_per_s", "MB/s", 0, True),
    ("bulk", None, "relay_cpu_s_per_gb", "relay CPU s/GB", 4, False),
    ("pp1", "ping-pong: 1 connection, 64 B", "p50_us", "p50 µs", 1, False),
    ("pp1", None, "p99_us", "p99 µs", 1, False),
    ("pp1", None, "relay_cpu_us_per_rt", "relay CPU µs/round trip", 2, False),
    ("pp100", "ping-pong: 100 connections, 64 B", "req_per_s", "req/s", 0, True),
    ("pp100", None, "relay_cpu_us_per_rt", "relay CPU µs/round trip", 2, False),
    ("pp100", None, "p99_us", "p99 µs", 0, False),
]

def cost_pct(on, off, higher):
    """How much worse on is than off, in %: positive = a cost."""
    return (1 - on / off) * 100 if higher else (on / off - 1) * 100

results = []
print("| workload | metric | off median | min | max | on median | min | max | on/off | range | on − off, mean ± 95% t | runs off/on |")
print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
for wl, title, key, label, d, higher in ROWS:
    off, on = read(wl, "off", key), read(wl, "on", key)
    a, b = s3(off), s3(on)
    if not a or not b:
        print(f"| {wl} | {label} | " + " | ".join(["-"] * 9) + f" | {len(off)}/{len(on)} |")
        continue
    ratio = b[0] / a[0]
    # on's worst run against off's best, and on's best against off's worst.
    worst = b[1] / a[2] if higher else b[2] / a[1]
    best = b[2] / a[1] if higher else b[1] / a[2]
    lo, hi = sorted((worst, best))
    t = "-"
    ci = None
    if len(off) >= 2 and len(on) >= 2:
        c = stats.compare(off, on, 95)
        p, h = c["percent"], c["percent_halfwidth"]
        t = f"{p:+.2f}% ± {h:.2f}%"
        # as a cost interval (positive = on worse)
        ci = sorted(((-1 if higher else 1) * (p - h), (-1 if higher else 1) * (p + h)))
    print(f"| {wl} | {label} | {f(a[0], d)} | {f(a[1], d)} | {f(a[2], d)} | {f(b[0], d)} | "
          f"{f(b[1], d)} | {f(b[2], d)} | {ratio:.4f} | {lo:.3f}–{hi:.3f} | {t} | {len(off)}/{len(on)} |")
    overlap = b[1] <= a[2] and a[1] <= b[2]
    results.append((wl, title, label, cost_pct(b[0], a[0], higher), ci, overlap,
                    (worst - 1) * 100 * (-1 if higher else 1)))
print()
print("on/off: ratio of the medians. range: on's worst run against off's best, and on's best against")
print("off's worst (if it excludes 1, no run of one side beat any run of the other). on − off: the")
print("difference of the means in % of off's mean, with its 95% Student's t half-width (bench/stats.py")
print("compare -c 95). Rates: below 1 / negative is a cost; latency and CPU: above 1 / positive is.")
print()

sc = read("bulk", "on", "scrapes") + read("pp1", "on", "scrapes") + read("pp100", "on", "scrapes")
cpu = read("bulk", "on", "scraper_cpu_ms_per_scrape") + read("pp1", "on", "scraper_cpu_ms_per_scrape") + \
      read("pp100", "on", "scraper_cpu_ms_per_scrape")
if sc:
    per = ", ".join(f"{wl} {f(statistics.median(x), 0)}" for wl in ("bulk", "pp1", "pp100")
                    if (x := read(wl, "on", "scrapes")))
    ms = statistics.median(cpu)
    print(f"Scrapes per \"on\" run (median): {per}; all answered 200. The scraper (a curl per scrape) used "
          f"{f(ms, 1)} ms of CPU per scrape (median) on the load CPU: {ms / (interval * 10):.2f}% of that CPU "
          f"at one scrape per {interval:g} s, charged to the \"on\" side wherever the load CPU sets the pace.")
    print()

print(f"#### Verdict against the goal: metrics on costs < {goal:g}%")
print()
for wl, title, label, c, ci, overlap, worst in results:
    head = f"- **{wl}, {label}**: median cost {c:+.2f}%"
    if ci:
        head += f" (95% t interval of the mean cost {ci[0]:+.2f}% to {ci[1]:+.2f}%)"
    if c <= goal:
        if overlap:
            v = f"within noise: the min–max ranges of off and on overlap, and the median cost is under {goal:g}%"
            if ci and ci[1] <= goal:
                v += f"; the interval stays under {goal:g}%: **goal met**"
            elif ci:
                v += (f"; the interval reaches {ci[1]:+.2f}%, so this run cannot exclude a cost above "
                      f"{goal:g}%: **met on the median, not proven**")
        elif c < 0:
            v = ("on was ahead and the ranges do not overlap: drift or noise, not a gain from the metrics; "
                 f"**goal met**")
        else:
            v = f"a measurable cost (the ranges do not overlap), under {goal:g}%: **goal met**"
    else:
        if overlap:
            v = (f"the median exceeds {goal:g}% but the ranges overlap: **not shown either way** "
                 f"(noise; rerun on a quiet machine)")
        else:
            v = f"**goal NOT met**: the ranges do not overlap (worst cross ratio: {worst:+.2f}%)"
    print(f"{head}: {v}.")
EOF
}

main "$@"
