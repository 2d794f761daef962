#!/usr/bin/env bash
# bench/cluster.sh: load balancing over a cluster of 4 backends, zcrelay against HAProxy and
# nginx stream in the same run, with zcrelay's single-upstream relay as the baseline (what
# choosing a backend costs).
#
# Usage: bench/cluster.sh [--quick]
#   --quick   2 short runs per relay and workload, for a smoke run (< 2 minutes); the full run
#             is 5 runs (< 8 minutes). Quick output is named *-quick* (git-ignored): not results.
#
# Backends: 4 x <build>/bench/echo_server on 127.0.0.1, ports picked by the kernel (--port 0,
# read from its first line) as bench/run does, started once per workload and shared by every
# relay. Relays (each on a free port from PORT_BASE up, started fresh for every run, stopped by
# PID through bench/relays.sh's stop_relay):
#
#   zcrelay-rr      zcrelay -c cluster.yaml: `clusters: [{name: app, balance: round_robin,
#                   backends: 4 x {address: 127.0.0.1:P}}]`, mode splice, workers: 1,
#                   metrics: {listen: ""}
#   zcrelay-lc      the same with balance: least_conn
#   zcrelay-single  the same listener with `upstream:` to the first backend only (baseline)
#   haproxy-rr/-lc  haproxy -db, peers/haproxy-cluster.cfg: mode tcp, nbthread 1, 4 servers,
#                   balance roundrobin / leastconn, option splice-auto (the better of HAProxy's
#                   splice configs for connection rate in bench/run; see the template)
#   nginx-rr/-lc    nginx stream, peers/nginx-stream-cluster.conf: 1 worker, an `upstream`
#                   block of 4 servers, round robin / least_conn
#
# None runs health checks. Placement, as bench/run: every relay pinned to RELAY_CPU (1), the
# load generators and the 4 backends to LOAD_CPU (0).
#
# Workloads, all through the cluster:
#   connrate  <build>/bench/conn_rate --conns 50: connect + 64 B + echo + close, RUNS runs of
#             CONNRATE_SECONDS; conn/s, the connection's p99, relay CPU per connection. The
#             backends run with --close-after 64 (ECHO_CLOSE_AFTER): they send the first FIN,
#             so TIME_WAIT lands on the backends' listening side and not on the relay's
#             ephemeral ports toward each backend, where the 1-backend baseline would hit the
#             ~14k conn/s port-hunting limit that bench/echo_server.cpp describes and 4
#             backends would not: that would measure the topology, not the relay.
#             Caveat: LOAD_CPU carries the client and all 4 backends. In trials on this VM,
#             4 backends instead of 1 cost nginx and zcrelay alike ~35% of the rate and ~7 µs
#             more relay CPU per connection (more wake-ups, less batching per epoll_wait), with
#             the relay's CPU well short of busy: the load CPU sets the rate. The table shows
#             the relay's busy %; compare relays on relay CPU µs/conn as well as on conn/s.
#   pingpong  <build>/bench/pingpong client --conns 1 --size 64: PP_ITERS round trips after
#             PP_WARMUP, RUNS runs; p50 and p99 in µs (plain echo backends: the 1 connection
#             lands on one of them).
# Runs are interleaved: round r runs every relay once, the order rotated by one each round, so
# drift of the machine does not favour a relay. After the connrate rounds, one extra run per
# zcrelay balance with metrics on scrapes zcrelay_backend_connections_total and prints how the
# connections spread over the 4 backends (round_robin with 1 worker: within 1 of each other).
#
# Output: progress on stderr; a Markdown report on stdout and in
# bench/results/<date>-<host>-cluster.md (date +%F, hostname -s): per relay the median, min and
# max over the runs, and zcrelay / best peer per balance with the ratio of the medians and its
# range (zcrelay's worst run against the peer's best, and the other way round). The raw samples
# (one number per line, one file per relay and quantity, as bench/stats.py reads them) and the
# metrics scrapes go to bench/results/<date>-<host>-cluster-samples/.
#
# Environment: ZCRELAY_BUILD (<repo>/build), RELAY_CPU (1), LOAD_CPU (0), PORT_BASE (23000),
# RUNS, CONNRATE_SECONDS, PP_ITERS, PP_WARMUP, ECHO_CLOSE_AFTER (64; 0 = passive backends),
# TIME_BUDGET (s: no run starts after it; 420, quick 100). Every wait is bounded; all traffic
# is on 127.0.0.1. A failed run (tool error, timeout, relay not starting or not stopping as it
# should) is reported and never averaged in; the script then exits 1.
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}"
BENCH="$BUILD/bench"
RELAY_CPU="${RELAY_CPU:-1}"
LOAD_CPU="${LOAD_CPU:-0}"
PORT_BASE="${PORT_BASE:-23000}"
NEXT_PORT=$PORT_BASE
ECHO_CLOSE_AFTER="${ECHO_CLOSE_AFTER:-64}"
readonly N_BACKENDS=4
readonly INFLIGHT=50
readonly BACKEND_LIFETIME=900   # s: a backend exits on its own after this, whatever happens here
readonly RELAYS=(zcrelay-rr zcrelay-lc zcrelay-single haproxy-rr haproxy-lc nginx-rr nginx-lc)
QUICK=0
WORK=""
OWN_PIDS=()
FAILURES=0
SKIPPED=0

die() { echo "bench/cluster.sh: $*" >&2; exit 1; }
log() { echo "bench/cluster.sh: $*" >&2; }

# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"
# shellcheck source=relays.sh
source "$SCRIPT_DIR/relays.sh"   # stop_relay, relay_cpu_ticks, relay_version, _relay_ready

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

# ---------------------------------------------------------------- backends

BACKEND_PORTS=()
BACKEND_PIDS=()

# start_backends ECHO_ARGS...: 4 echo servers on LOAD_CPU, kernel-picked ports.
start_backends() {
    local i port
    BACKEND_PORTS=()
    BACKEND_PIDS=()
    for ((i = 0; i < N_BACKENDS; i++)); do
        start_port_server port "backend-$i" "$BENCH/echo_server" --port 0 --seconds "$BACKEND_LIFETIME" "$@"
        BACKEND_PIDS+=("$SERVER_PID")
        BACKEND_PORTS+=("$port")
    done
    log "backends: echo_server $* on 127.0.0.1:$(IFS=,; echo "${BACKEND_PORTS[*]}") (CPU $LOAD_CPU)"
}

stop_backends() {
    local pid
    for pid in "${BACKEND_PIDS[@]}"; do
        is_alive "$pid" && kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${BACKEND_PIDS[@]}"; do
        wait_gone "$pid" 5 || kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    local -a keep=()
    for pid in "${OWN_PIDS[@]}"; do
        [[ " ${BACKEND_PIDS[*]} " == *" $pid "* ]] || keep+=("$pid")
    done
    OWN_PIDS=("${keep[@]}")
    BACKEND_PIDS=()
}

# ---------------------------------------------------------------- relays

relay_label() {
    case "$1" in
        zcrelay-*) echo "zcrelay-splice" ;;
        haproxy-*) echo "haproxy (splice-auto)" ;;
        nginx-*) echo "nginx stream" ;;
    esac
}
relay_balance() {
    case "$1" in
        zcrelay-rr) echo round_robin ;;
        zcrelay-lc) echo least_conn ;;
        zcrelay-single) echo "single upstream (baseline)" ;;
        haproxy-rr) echo roundrobin ;;
        haproxy-lc) echo leastconn ;;
        nginx-rr) echo "round robin" ;;
        nginx-lc) echo least_conn ;;
    esac
}

# fill_template TEMPLATE OUT BALANCE SERVER_LINE: @LISTEN_PORT@, @RUN_DIR@, @BALANCE@, and the
# @SERVERS@ line becomes one SERVER_LINE per backend, at its indentation, with {N} the backend's
# number (1..4) and {P} its port.
fill_template() {
    local tpl=$1 out=$2 balance=$3 fmt=$4
    [[ -r "$tpl" ]] || { RELAY_ERR="template $tpl not found"; return 1; }
    awk -v lport="$RELAY_PORT" -v dir="$RELAY_DIR" -v bal="$balance" -v fmt="$fmt" \
        -v ports="${BACKEND_PORTS[*]}" '
        /@SERVERS@/ {
            indent = substr($0, 1, index($0, "@") - 1)
            n = split(ports, p, " ")
            for (i = 1; i <= n; i++) {
                line = fmt
                gsub(/\{N\}/, i, line)
                gsub(/\{P\}/, p[i], line)
                print indent line
            }
            next
        }
        { gsub(/@LISTEN_PORT@/, lport); gsub(/@RUN_DIR@/, dir); gsub(/@BALANCE@/, bal); print }
    ' "$tpl" >"$out" || { RELAY_ERR="cannot write $out"; return 1; }
    if grep -q '@[A-Z_]*@' "$out"; then
        RELAY_ERR="$out: unfilled placeholder $(grep -o -m1 '@[A-Z_]*@' "$out")"
        return 1
    fi
}

# write_zcrelay_yaml OUT NAME METRICS_ADDR
write_zcrelay_yaml() {
    local out=$1 name=$2 metrics=$3 p
    {
        echo "# bench/cluster.sh: $name"
        echo "workers: 1"
        echo "metrics: {listen: \"$metrics\"}"
        if [[ "$name" != zcrelay-single ]]; then
            echo "clusters:"
            echo "  - name: app"
            echo "    balance: $(relay_balance "$name")"
            echo "    backends:"
            for p in "${BACKEND_PORTS[@]}"; do echo "      - {address: 127.0.0.1:$p}"; done
        fi
        echo "listeners:"
        echo "  - name: bench"
        echo "    listen: 127.0.0.1:$RELAY_PORT"
        echo "    mode: splice"
        if [[ "$name" == zcrelay-single ]]; then
            echo "    upstream: 127.0.0.1:${BACKEND_PORTS[0]}"
        else
            echo "    cluster: app"
        fi
    } >"$out"
}

# start_cluster_relay NAME [METRICS_ADDR]: like relays.sh's start_relay (whose relays have one
# upstream), for a relay over BACKEND_PORTS. Sets the state relays.sh's stop_relay and
# relay_cpu_ticks read (RELAY_NAME, RELAY_PID, RELAY_DIR, RELAY_PORT, _RELAY_SHELL); the names
# match its patterns (zcrelay-*, haproxy-*, nginx*), which decide readiness and the expected
# exit status. Returns 1 (RELAY_ERR) if the relay does not get ready; nothing is left running.
_SEQ=0
start_cluster_relay() {
    local name=$1 metrics=${2:-}
    RELAY_NAME=$name RELAY_PID="" RELAY_ERR=""
    pick_port RELAY_PORT
    _SEQ=$((_SEQ + 1))
    RELAY_DIR="$WORK/relay-$_SEQ-$name"
    mkdir -p "$RELAY_DIR"
    RELAY_LOG="$RELAY_DIR/output.log"
    local -a argv
    case "$name" in
        zcrelay-*)
            write_zcrelay_yaml "$RELAY_DIR/zcrelay.yaml" "$name" "$metrics"
            # stdbuf: "zcrelay: ready" must reach the file at once though stdout is no tty.
            argv=(stdbuf -oL "$BUILD/zcrelay" -c "$RELAY_DIR/zcrelay.yaml") ;;
        haproxy-*)
            local bal=roundrobin
            [[ "$name" == haproxy-lc ]] && bal=leastconn
            fill_template "$SCRIPT_DIR/peers/haproxy-cluster.cfg" "$RELAY_DIR/haproxy.cfg" "$bal" \
                'server b{N} 127.0.0.1:{P}' || { log "$name: $RELAY_ERR"; return 1; }
            argv=(haproxy -db -f "$RELAY_DIR/haproxy.cfg") ;;
        nginx-*)
            local bal="# round robin: nginx's default"
            [[ "$name" == nginx-lc ]] && bal="least_conn;"
            fill_template "$SCRIPT_DIR/peers/nginx-stream-cluster.conf" "$RELAY_DIR/nginx.conf" \
                "$bal" 'server 127.0.0.1:{P};' || { log "$name: $RELAY_ERR"; return 1; }
            RELAY_LOG="$RELAY_DIR/error.log"
            argv=(nginx -p "$RELAY_DIR/" -c "$RELAY_DIR/nginx.conf" -e "$RELAY_DIR/error.log") ;;
        *) die "unknown relay $name" ;;
    esac
    RELAY_CMD="taskset -c $RELAY_CPU ${argv[*]}"
    taskset -c "$RELAY_CPU" "${argv[@]}" >"$RELAY_DIR/output.log" 2>&1 </dev/null &
    RELAY_PID=$!
    _RELAY_SHELL=$BASHPID
    OWN_PIDS+=("$RELAY_PID")
    local deadline=$((SECONDS + ${RELAY_READY_TIMEOUT:-10}))
    until _relay_ready "$name"; do
        if ! is_alive "$RELAY_PID" || ((SECONDS >= deadline)); then
            RELAY_ERR="$name did not get ready; $RELAY_LOG: $(_relay_tail "$RELAY_LOG")"
            [[ "$RELAY_LOG" == "$RELAY_DIR/output.log" ]] ||
                RELAY_ERR+="; output: $(_relay_tail "$RELAY_DIR/output.log")"
            log "$RELAY_ERR"
            stop_relay >/dev/null 2>&1 || true
            return 1
        fi
        sleep 0.05
    done
}

# finish_relay: stop_relay, and a wrong exit status or a needed SIGKILL is a failure.
finish_relay() {
    stop_relay
    if [[ -n "${RELAY_STOP_ERR:-}" ]]; then
        log "  $RELAY_NAME: $RELAY_STOP_ERR"
        FAILURES=$((FAILURES + 1))
        return 1
    fi
}

# ---------------------------------------------------------------- measuring

json_field() { sed -nE "s/.*\"$2\": *(-?[0-9.eE+-]+).*/\1/p" <<<"$1"; }
sample() { mkdir -p "$(dirname "$1")"; echo "$2" >>"$1"; }
over_budget() { ((SECONDS >= TIME_BUDGET)); }

# rotated R: the relays in the order of round R (rotated by R-1).
rotated() {
    local r=$1 n=${#RELAYS[@]} i
    for ((i = 0; i < n; i++)); do echo "${RELAYS[$(((i + r - 1) % n))]}"; done
}

# one_connrate RELAY: one conn_rate run through a fresh relay; samples under connrate/.
one_connrate() {
    local relay=$1 base="$SAMPLES/connrate/$1" line t0 t1
    start_cluster_relay "$relay" || { FAILURES=$((FAILURES + 1)); return 1; }
    relay_cpu_ticks >/dev/null
    t0=$RELAY_CPU_TICKS
    if ! line=$(timeout $((CONNRATE_SECONDS + 20)) taskset -c "$LOAD_CPU" "$BENCH/conn_rate" \
            --port "$RELAY_PORT" --conns "$INFLIGHT" --seconds "$CONNRATE_SECONDS" 2>"$WORK/rate.err"); then
        log "  connrate $relay: conn_rate failed: $(tail -n2 "$WORK/rate.err" | tr '\n' ' ')"
        finish_relay || true
        FAILURES=$((FAILURES + 1))
        return 1
    fi
    relay_cpu_ticks >/dev/null
    t1=$RELAY_CPU_TICKS
    finish_relay || return 1
    local completed errors rate us pct
    completed=$(json_field "$line" completed)
    errors=$(json_field "$line" errors)
    rate=$(json_field "$line" conns_per_s)
    us=$(awk -v d=$((t1 - t0)) -v hz="$CLK_TCK" -v n="$completed" 'BEGIN {printf "%.2f", n ? d / hz * 1e6 / n : 0}')
    pct=$(awk -v d=$((t1 - t0)) -v hz="$CLK_TCK" -v s="$CONNRATE_SECONDS" 'BEGIN {printf "%.1f", d / hz / s * 100}')
    sample "$base.conns_per_s" "$rate"
    sample "$base.p99_us" "$(json_field "$line" p99_us)"
    sample "$base.relay_cpu_us_per_conn" "$us"
    sample "$base.relay_cpu_pct" "$pct"
    sample "$base.errors" "$errors"
    log "  connrate $relay: $rate conn/s, errors $errors, relay CPU $us µs/conn ($pct % of its CPU)"
}

# one_pingpong RELAY: one 1-connection ping-pong run through a fresh relay.
one_pingpong() {
    local relay=$1 base="$SAMPLES/pingpong/$1" line k
    start_cluster_relay "$relay" || { FAILURES=$((FAILURES + 1)); return 1; }
    if ! line=$(timeout 120 taskset -c "$LOAD_CPU" "$BENCH/pingpong" client \
            --connect "127.0.0.1:$RELAY_PORT" --conns 1 --size 64 --iters "$PP_ITERS" \
            --warmup "$PP_WARMUP" 2>"$WORK/pingpong.err"); then
        log "  pingpong $relay: failed: $(tail -n2 "$WORK/pingpong.err" | tr '\n' ' ')"
        finish_relay || true
        FAILURES=$((FAILURES + 1))
        return 1
    fi
    finish_relay || return 1
    for k in p50_us p99_us req_per_s; do sample "$base.$k" "$(json_field "$line" "$k")"; done
    log "  pingpong $relay: p50 $(json_field "$line" p50_us) µs, p99 $(json_field "$line" p99_us) µs"
}

# rounds WORKLOAD_FN: RUNS interleaved rounds over all relays, none started past TIME_BUDGET.
rounds() {
    local fn=$1 r relay
    for ((r = 1; r <= RUNS; r++)); do
        log "$fn round $r/$RUNS"
        for relay in $(rotated "$r"); do
            if over_budget; then
                SKIPPED=$((SKIPPED + 1))
                continue
            fi
            "$fn" "$relay" || true
        done
    done
}

# spread NAME: one conn_rate run through zcrelay with metrics on; keeps the scrape and prints
# zcrelay_backend_connections_total per backend to stderr.
spread() {
    local name=$1 mport line body out="$SAMPLES/spread/$1"
    pick_port mport
    start_cluster_relay "$name" "127.0.0.1:$mport" || { FAILURES=$((FAILURES + 1)); return 1; }
    line=$(timeout $((SPREAD_SECONDS + 20)) taskset -c "$LOAD_CPU" "$BENCH/conn_rate" \
        --port "$RELAY_PORT" --conns "$INFLIGHT" --seconds "$SPREAD_SECONDS" 2>"$WORK/rate.err") || line=""
    body=$(curl -s --max-time 5 "http://127.0.0.1:$mport/metrics") || body=""
    finish_relay || true
    mkdir -p "$(dirname "$out")"
    printf '%s\n' "$body" >"$out.prom"
    printf '%s\n' "$line" >"$out.conn_rate.json"
    printf '%s\n' "${BACKEND_PORTS[@]}" >"$out.backends"
    if [[ -z "$line" || -z "$body" ]]; then
        log "  spread $name: conn_rate or the scrape failed"
        FAILURES=$((FAILURES + 1))
        return 1
    fi
    log "  spread $name: $(grep '^zcrelay_backend_connections_total' "$out.prom" | sed -E 's/.*backend="([^"]+)".* ([0-9]+)$/\1=\2/' | paste -sd' ')"
}

# ---------------------------------------------------------------- main

configure() {
    if ((QUICK)); then
        RUNS=${RUNS:-2}; CONNRATE_SECONDS=${CONNRATE_SECONDS:-2}; PP_ITERS=${PP_ITERS:-3000}
        PP_WARMUP=${PP_WARMUP:-300}; SPREAD_SECONDS=2; TIME_BUDGET=${TIME_BUDGET:-100}
    else
        RUNS=${RUNS:-5}; CONNRATE_SECONDS=${CONNRATE_SECONDS:-4}; PP_ITERS=${PP_ITERS:-20000}
        PP_WARMUP=${PP_WARMUP:-500}; SPREAD_SECONDS=3; TIME_BUDGET=${TIME_BUDGET:-420}
    fi
}

main() {
    while (($#)); do
        case "$1" in
            --quick) QUICK=1 ;;
            -h|--help) usage 0 ;;
            *) echo "bench/cluster.sh: unknown argument '$1'" >&2; usage 2 ;;
        esac
        shift
    done
    configure
    (($(nproc) >= 2)) || die "needs 2 CPUs (relay on $RELAY_CPU, load on $LOAD_CPU)"
    local t
    for t in conn_rate pingpong echo_server; do
        [[ -x "$BENCH/$t" ]] || die "$BENCH/$t missing: build first (bench/README.md)"
    done
    [[ -x "$BUILD/zcrelay" ]] || die "$BUILD/zcrelay missing: build first"
    for t in haproxy nginx curl taskset stdbuf timeout ss awk python3; do
        command -v "$t" >/dev/null || die "needs $t (deploy/install-deps.sh)"
    done
    CLK_TCK=$(getconf CLK_TCK)
    HOST=$(hostname -s)
    KERNEL=$(uname -r)
    DATE=$(date +%F)
    local suffix=cluster
    ((QUICK)) && suffix=cluster-quick
    mkdir -p "$SCRIPT_DIR/results"
    REPORT="$SCRIPT_DIR/results/$DATE-$HOST-$suffix.md"
    SAMPLES="$SCRIPT_DIR/results/$DATE-$HOST-$suffix-samples"
    rm -rf -- "$SAMPLES"
    mkdir -p "$SAMPLES"
    WORK=$(mktemp -d /dev/shm/zcbench-cluster.XXXXXX)
    trap 'stop_relay >/dev/null 2>&1 || true; cleanup' EXIT
    log "relays: ${RELAYS[*]}; $RUNS runs each; relay on CPU $RELAY_CPU, load + backends on CPU $LOAD_CPU; $HOST, $KERNEL"

    local close_args=()
    ((ECHO_CLOSE_AFTER > 0)) && close_args=(--close-after "$ECHO_CLOSE_AFTER")
    start_backends "${close_args[@]}"
    rounds one_connrate
    if over_budget; then
        log "time budget spent: no spread check"
    else
        spread zcrelay-rr || true
        spread zcrelay-lc || true
    fi
    stop_backends

    start_backends
    rounds one_pingpong
    stop_backends

    ELAPSED_MIN=$(awk -v s="$SECONDS" 'BEGIN{printf "%.1f", s/60}')
    report | tee "$REPORT"
    log "report: $REPORT; samples: $SAMPLES"
    if ((FAILURES || SKIPPED)); then
        log "$FAILURES failed run(s), $SKIPPED skipped for the time budget"
        exit 1
    fi
}

report() {
    local versions
    versions=$(printf '%s\n' zcrelay-splice haproxy-splice nginx |
        while read -r r; do relay_version "$r" 2>/dev/null || echo "$r"; done | paste -sd';' - | sed 's/;/; /g')
    echo "### bench/cluster.sh on $HOST ($KERNEL), $DATE$( ((QUICK)) && echo ', --quick: a smoke run, not results to quote')"
    echo
    echo "4 echo_server backends and the load on CPU $LOAD_CPU, the relay (1 worker/thread) on CPU $RELAY_CPU."
    echo "$(nproc) CPUs ($(lscpu | sed -nE 's/^Model name: *//p' | head -n1)); $versions."
    echo "$RUNS runs per relay and workload, interleaved; connrate: conn_rate --conns $INFLIGHT," \
        "${CONNRATE_SECONDS} s a run, backends --close-after $ECHO_CLOSE_AFTER; pingpong: 1 connection," \
        "64 B, $PP_ITERS round trips after $PP_WARMUP. Measuring took $ELAPSED_MIN minutes."
    ((FAILURES || SKIPPED)) && echo "**$FAILURES failed run(s), $SKIPPED skipped for the time budget** (stderr says which)."
    echo
    python3 - "$SAMPLES" "${RELAYS[@]}" <<'EOF'
import glob, os, re, statistics, sys

samples, relays = sys.argv[1], sys.argv[2:]
LABEL = {"zcrelay": "zcrelay-splice", "haproxy": "haproxy (splice-auto)", "nginx": "nginx stream"}
BALANCE = {"zcrelay-rr": "round_robin", "zcrelay-lc": "least_conn",
           "zcrelay-single": "single upstream (baseline)", "haproxy-rr": "roundrobin",
           "haproxy-lc": "leastconn", "nginx-rr": "round robin", "nginx-lc": "least_conn"}

def read(workload, relay, key):
    path = os.path.join(samples, workload, f"{relay}.{key}")
    try:
        with open(path) as f:
            return [float(x) for x in f.read().split()]
    except FileNotFoundError:
        return []

def stat(xs):
    return (statistics.median(xs), min(xs), max(xs)) if xs else None

def fmt(v, digits=0):
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"

def cells(s, digits=0):
    return ["-"] * 3 if s is None else [fmt(v, digits) for v in s]

def name(r):
    return LABEL[r.split("-")[0]]

print("#### Connection rate through the cluster (conn/s, higher is better)")
print()
print("| relay | balance | conn/s median | min | max | relay CPU µs/conn median | min | max | relay CPU busy % | connection p99 µs | errors | runs |")
print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
for r in relays:
    rate = read("connrate", r, "conns_per_s")
    p99, pct = (stat(read("connrate", r, k)) for k in ("p99_us", "relay_cpu_pct"))
    cpu = stat(read("connrate", r, "relay_cpu_us_per_conn"))
    print(f"| {name(r)} | {BALANCE[r]} | " + " | ".join(cells(stat(rate))) + " | " +
          " | ".join(cells(cpu, 1)) + f" | {fmt(pct and pct[0])} | {fmt(p99 and p99[0])} | "
          f"{int(sum(read('connrate', r, 'errors')))} | {len(rate)} |")
print()
print("Relay CPU: user+sys of the relay's process tree over the run, per completed connection, and")
print("as a share of its one CPU (busy % well under 100: the load CPU, not the relay, set the rate).")
print()
print("#### Ping-pong, 1 connection, 64 B, through the cluster (µs, lower is better)")
print()
print("| relay | balance | p50 median | min | max | p99 median | min | max | runs |")
print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
for r in relays:
    p50, p99 = read("pingpong", r, "p50_us"), read("pingpong", r, "p99_us")
    print(f"| {name(r)} | {BALANCE[r]} | " + " | ".join(cells(stat(p50), 1)) + " | " +
          " | ".join(cells(stat(p99), 1)) + f" | {len(p50)} |")
print()

# zcrelay / best peer. The range pairs zcrelay's worst run with the peer's best and the other way
# round: if it excludes 1, no run of one beat any run of the other.
metrics = [("conn/s", "connrate", "conns_per_s", True),
           ("relay CPU µs/conn", "connrate", "relay_cpu_us_per_conn", False),
           ("ping-pong p50", "pingpong", "p50_us", False), ("ping-pong p99", "pingpong", "p99_us", False)]
print("#### zcrelay / best peer, per balance")
print()
print("Ratio of the medians; the range is zcrelay's worst run against the peer's best run, and")
print("zcrelay's best against the peer's worst. conn/s: above 1 is zcrelay ahead; CPU and latency: below 1 is.")
print()
print("| metric | balance | zcrelay median | best peer | its median | ratio | range |")
print("|---|---|--:|---|--:|--:|--:|")

def ratio_cells(ours, theirs, higher):
    a, b = stat(ours), stat(theirs)
    med = a[0] / b[0]
    worst = (a[1] / b[2]) if higher else (a[2] / b[1])
    best = (a[2] / b[1]) if higher else (a[1] / b[2])
    lo, hi = sorted((worst, best))
    return f"{med:.3f}", f"{lo:.3f}–{hi:.3f}"

for label, wl, key, higher in metrics:
    for fam, bal in (("rr", "round robin"), ("lc", "least conn")):
        ours = read(wl, f"zcrelay-{fam}", key)
        peers = [(p, read(wl, p, key)) for p in (f"haproxy-{fam}", f"nginx-{fam}")]
        peers = [(p, xs) for p, xs in peers if xs]
        if not ours or not peers:
            print(f"| {label} | {bal} | - | - | - | - | - |")
            continue
        pick = max if higher else min
        best, bxs = pick(peers, key=lambda t: statistics.median(t[1]))
        med, rng = ratio_cells(ours, bxs, higher)
        d = 0 if higher else 1
        print(f"| {label} | {bal} | {fmt(statistics.median(ours), d)} | {name(best)} {BALANCE[best]} | "
              f"{fmt(statistics.median(bxs), d)} | {med} | {rng} |")
print()
print("#### What balancing costs zcrelay: cluster of 4 / single upstream")
print()
print("| metric | balance | cluster median | single median | ratio | range |")
print("|---|---|--:|--:|--:|--:|")
for label, wl, key, higher in metrics:
    base = read(wl, "zcrelay-single", key)
    for fam in ("rr", "lc"):
        ours = read(wl, f"zcrelay-{fam}", key)
        if not ours or not base:
            print(f"| {label} | {BALANCE['zcrelay-' + fam]} | - | - | - | - |")
            continue
        med, rng = ratio_cells(ours, base, higher)
        d = 0 if higher else 1
        print(f"| {label} | {BALANCE['zcrelay-' + fam]} | {fmt(statistics.median(ours), d)} | "
              f"{fmt(statistics.median(base), d)} | {med} | {rng} |")
print()

print("#### Spread over the backends (zcrelay, metrics on, one extra connrate run)")
print()
print("zcrelay_backend_connections_total per backend after the run; conn_rate's completed and errors beside.")
print()
print("| balance | " + " | ".join(f"backend {i + 1}" for i in range(4)) + " | max − min | share of the busiest | conn_rate completed (errors) |")
print("|---|" + "--:|" * 4 + "--:|--:|--:|")
notes = []
for fam in ("rr", "lc"):
    r = f"zcrelay-{fam}"
    base = os.path.join(samples, "spread", r)
    try:
        ports = open(base + ".backends").read().split()
        prom = open(base + ".prom").read()
        cr = open(base + ".conn_rate.json").read()
    except FileNotFoundError:
        print(f"| {BALANCE[r]} | (not run) |")
        continue
    counts = []
    for p in ports:
        m = re.search(r'^zcrelay_backend_connections_total\{[^}]*backend="127\.0\.0\.1:%s"[^}]*\} (\d+)' % p, prom, re.M)
        counts.append(int(m.group(1)) if m else None)
    if None in counts or not sum(counts):
        print(f"| {BALANCE[r]} | (no zcrelay_backend_connections_total in the scrape) |")
        continue
    comp = re.search(r'"completed": *(\d+)', cr)
    errs = re.search(r'"errors": *(\d+)', cr)
    done = f"{int(comp.group(1)):,}" if comp else "-"
    print(f"| {BALANCE[r]} | " + " | ".join(f"{c:,}" for c in counts) +
          f" | {max(counts) - min(counts):,} | {max(counts) / sum(counts):.4f} | "
          f"{done} ({errs.group(1) if errs else '-'}) |")
    if fam == "rr" and max(counts) - min(counts) > 1:
        notes.append(f"**round_robin with 1 worker should leave the counts within 1 of each "
                     f"other: these differ by {max(counts) - min(counts)}.**")
print()
print("Even is a share of 0.25 for the busiest backend.")
for n in notes:
    print()
    print(n)
EOF
}

main "$@"
