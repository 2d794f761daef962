#!/usr/bin/env bash
# bench/discovery.sh: a cluster whose backends come from DNS, changed under load. Two parts:
#
#  1. Scale run, per balance (least_conn, then round_robin; --quick: least_conn only): 4
#     echo_server backends on 127.0.0.2..5:BACKEND_PORT (18080), all listening the whole run;
#     dnsmasq (TTL 1 s) names 2 of them (.2, .3) at the start, all 4 at PHASE s, only .5 at
#     2 x PHASE s, so the backends that held the run's first connections all leave. Load, for
#     3 x PHASE s: <build>/bench/discovery_load client (RATE short connections/s with a 64 B
#     echo, SESSIONS sessions of SESSION_MS ms and LONG long-lived connections that ping 16 B
#     every 100 ms, every echo checked), and one discovery_load transfer of TRANSFER_MIB MiB of
#     random bytes, paced to end shortly before the load, echoed back and compared by sha256.
#     Measured: zcrelay_backend_connections_active / _total and the listener's
#     zcrelay_connections_active every 250 ms from /metrics (bench/discovery.py sample), every
#     backend's own accepts and closes (echo_server --events, CLOCK_REALTIME ns), the relay's
#     "cluster web: A -> B backends" log lines, and each client's failures. Reported: how long
#     after each DNS change the relay logged it, the first connection reached an added backend
#     and the last new one reached a removed backend; the connections live on removed backends
#     and when they finished; failures by kind (expected 0); whether the transfer was byte-exact.
#     Chart: active connections and new connections/s per backend over time, DNS changes marked.
#  2. Connection rate, static vs discovery: <build>/bench/conn_rate --conns 50 (connect, 64 B
#     echo, close) against a cluster of the same 4 backends (--close-after 64), listed in the
#     config (static) or from DNS with refresh_min 1s and TTL 1 s (discovery: it asks every
#     second during the run). CONNRATE_RUNS runs per side of CONNRATE_SECONDS, interleaved (odd
#     rounds static first), a fresh relay each; conn/s, relay CPU µs/conn, connection p99,
#     medians with min/max, discovery/static with its range and a 95% Student's t interval.
#
# Usage: bench/discovery.sh [--quick] [--balances B1,B2,...]
#   --quick     a smoke run (~40 s): PHASE 6 s, a 64 MiB transfer, least_conn only, 2 runs per
#               side of 3 s. The full run (~2 minutes): PHASE 10 s, 256 MiB, least_conn and
#               round_robin, 5 runs per side of 5 s. Quick output is named *-quick* (git-ignored).
#   --balances  the scale runs' balances (least_conn, round_robin, random, source_hash)
#
# Placement, as bench/run: the relay (zcrelay -c, mode splice, workers: 1) on RELAY_CPU (1);
# the load, the backends, dnsmasq, dig and the metrics sampler on LOAD_CPU (0). All traffic is
# on 127.0.0.0/8: the relay, metrics and DNS on 127.0.0.1 (ports from PORT_BASE up, TCP and UDP
# free), the backends on 127.0.0.2-5. Every process is started here, recorded by PID and
# stopped by PID (trap). Every loop is bounded in count and time; no measurement is asserted
# against a time: delays are reported, not judged.
#
# Output: progress on stderr; a Markdown report on stdout and in
# bench/results/<date>-<host>-discovery.md, one JSON line per scale run and per connection-rate
# metric in bench/results/<date>-<host>-discovery.jsonl, the charts in
# bench/results/<date>-<host>-discovery-charts/scale-<balance>.svg, the raw data (metrics
# scrapes, backend events, client output, relay logs, DNS changes, conn_rate samples) in
# bench/results/<date>-<host>-discovery-samples/.
#
# Exit status: 1 if a client saw a failure (refused, reset, early EOF, timeout, echo
# mismatch; conn_rate errors too), the transfer was not byte-exact, a tool or the relay failed
# (including a relay that does not exit 0 after SIGTERM), or a run was skipped for the time
# budget.
#
# Environment: ZCRELAY_BUILD (<repo>/build), RELAY_CPU (1), LOAD_CPU (0), PORT_BASE (27000),
# BACKEND_PORT (18080), PHASE, TRANSFER_MIB, RATE (200), SESSIONS (40), SESSION_MS (2000),
# LONG (8), CONNRATE_RUNS, CONNRATE_SECONDS, TIME_BUDGET (s: no run starts after it; 230,
# quick 85), DNSMASQ (/usr/sbin/dnsmasq).
set -euo pipefail
export LC_ALL=C   # EPOCHREALTIME with a '.', and awk's numbers

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}"
BENCH="$BUILD/bench"
RELAY_CPU="${RELAY_CPU:-1}"
LOAD_CPU="${LOAD_CPU:-0}"
PORT_BASE="${PORT_BASE:-27000}"
NEXT_PORT=$PORT_BASE
BACKEND_PORT="${BACKEND_PORT:-18080}"
DNSMASQ="${DNSMASQ:-/usr/sbin/dnsmasq}"
readonly BACKEND_ADDRS=(127.0.0.2 127.0.0.3 127.0.0.4 127.0.0.5)
readonly DNS_NAME=web.test
readonly BACKEND_LIFETIME=600   # s: a backend exits on its own after this, whatever happens here
readonly SAMPLE_INTERVAL=0.25
QUICK=0
BALANCES=""
WORK=""
OWN_PIDS=()
FAILURES=0
SKIPPED=0

die() { echo "bench/discovery.sh: $*" >&2; exit 1; }
log() { echo "bench/discovery.sh: $*" >&2; }

# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"      # is_alive, wait_gone, pick_port, start_port_server, cleanup
# shellcheck source=relays.sh
source "$SCRIPT_DIR/relays.sh"   # stop_relay, relay_cpu_ticks, relay_version, _relay_ready

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

# now: CLOCK_REALTIME seconds (bash's EPOCHREALTIME, no fork).
now() { echo "$EPOCHREALTIME"; }
# sleep_until T: sleeps until the realtime T (seconds), if it is still ahead.
sleep_until() {
    local d
    d=$(awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { d = a - b; printf "%.3f", (d > 0 ? d : 0) }')
    [[ "$d" == 0.000 ]] || sleep "$d"
}
over_budget() { ((SECONDS >= TIME_BUDGET)); }

# other_pct TICKS0 TICKS1 SECONDS: those ticks as % of one CPU.
other_pct() { awk -v a="$1" -v b="$2" -v s="$3" -v hz="$CLK_TCK" 'BEGIN { printf "%.0f", (s > 0 ? (b - a) / hz / s * 100 : 0) }'; }

# ---------------------------------------------------------------- DNS

# pick_dns_port VAR: a port free in TCP (pick_port) and in UDP.
pick_dns_port() {
    local -n _dns_out=$1
    local dns_candidate
    while :; do
        pick_port dns_candidate   # (a name of its own: pick_port's nameref must not meet its local p)
        [[ -z "$(ss -Huan "sport = :$dns_candidate" 2>/dev/null)" ]] && { _dns_out=$dns_candidate; return 0; }
    done
}

# dig_set: the A records of DNS_NAME as dnsmasq answers now, sorted, comma-separated.
dig_set() {
    taskset -c "$LOAD_CPU" dig @127.0.0.1 -p "$DNS_PORT" "$DNS_NAME" A +short +time=1 +tries=1 2>/dev/null |
        grep -E '^[0-9.]+$' | sort -t. -k1,1n -k2,2n -k3,3n -k4,4n | paste -sd, - || true
}

# write_hosts ADDR...: the addn-hosts file dnsmasq reads, replaced in one rename.
write_hosts() {
    local a
    for a in "$@"; do echo "$a $DNS_NAME"; done >"$DNS_DIR/hosts.tmp"
    chmod 644 "$DNS_DIR/hosts.tmp"
    mv -f "$DNS_DIR/hosts.tmp" "$DNS_DIR/hosts"
}

start_dns() {
    DNS_DIR="$WORK/dns"
    mkdir -p "$DNS_DIR"
    chmod 755 "$WORK" "$DNS_DIR"
    pick_dns_port DNS_PORT
    write_hosts "${BACKEND_ADDRS[@]:0:2}"
    # --no-daemon: foreground (so $! is dnsmasq), no pid file, no change of user. Only what the
    # hosts file says is answered for .test (--local), with TTL 1 s (--local-ttl); --cache-size=0
    # caches nothing else, and SIGHUP makes it read the file again.
    taskset -c "$LOAD_CPU" "$DNSMASQ" --no-daemon --port="$DNS_PORT" --listen-address=127.0.0.1 \
        --bind-interfaces --no-resolv --no-hosts --conf-file=/dev/null --pid-file= \
        --addn-hosts="$DNS_DIR/hosts" --local=/test/ --local-ttl=1 --cache-size=0 \
        >"$WORK/dnsmasq.log" 2>&1 </dev/null &
    DNS_PID=$!
    OWN_PIDS+=("$DNS_PID")
    local i want
    want=$(IFS=,; echo "${BACKEND_ADDRS[*]:0:2}")
    for ((i = 0; i < 100; i++)); do
        [[ "$(dig_set)" == "$want" ]] && break
        is_alive "$DNS_PID" || die "dnsmasq exited: $(tail -n3 "$WORK/dnsmasq.log" | tr '\n' ' ')"
        sleep 0.05
    done
    [[ "$(dig_set)" == "$want" ]] || die "dnsmasq on port $DNS_PORT does not answer $DNS_NAME = $want"
    local ttl
    ttl=$(taskset -c "$LOAD_CPU" dig @127.0.0.1 -p "$DNS_PORT" "$DNS_NAME" A +noall +answer +time=1 +tries=1 |
        awk 'NR == 1 { print $2 }')
    [[ "$ttl" == 1 ]] || die "dnsmasq answers with TTL '$ttl', expected 1"
    log "dnsmasq (pid $DNS_PID) on 127.0.0.1:$DNS_PORT: $DNS_NAME = $want, TTL $ttl (dig)"
}

# set_dns FILE LABEL ADDR...: the new records, SIGHUP, and dig until it answers them (bounded:
# 100 tries, each at most 1 s). Appends "time<TAB>label<TAB>addrs<TAB>ms until dig saw
# them<TAB>dig tries<TAB>ms the last dig took" to FILE; the time is the SIGHUP's. The last
# dig's own time tells a slow answer from a slow dig (a process start on the loaded CPU).
set_dns() {
    local file=$1 label=$2 want t i seen="" try_t=""
    shift 2
    want=$(IFS=,; echo "$*")
    write_hosts "$@"
    t=$(now)
    kill -HUP "$DNS_PID"
    for ((i = 1; i <= 100; i++)); do
        try_t=$(now)
        [[ "$(dig_set)" == "$want" ]] && { seen=$(now); break; }
        sleep 0.02
    done
    if [[ -z "$seen" ]]; then
        log "dnsmasq did not answer $want after 100 tries since SIGHUP (it answers '$(dig_set)')"
        FAILURES=$((FAILURES + 1))
        printf '%s\t%s\t%s\t-\t100\n' "$t" "$label" "$want" >>"$file"
        return 1
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$label" "$want" \
        "$(awk -v a="$t" -v b="$seen" 'BEGIN { printf "%.0f", (b - a) * 1000 }')" "$i" \
        "$(awk -v a="$try_t" -v b="$seen" 'BEGIN { printf "%.0f", (b - a) * 1000 }')" >>"$file"
}

# ---------------------------------------------------------------- backends

BACKEND_PIDS=()

# start_backends EVENTS_DIR ECHO_ARGS...: an echo_server on each of BACKEND_ADDRS at
# BACKEND_PORT, on LOAD_CPU; with EVENTS_DIR, each logs its accepts and closes there.
start_backends() {
    local dir=$1 a port
    shift
    BACKEND_PIDS=()
    for a in "${BACKEND_ADDRS[@]}"; do
        local -a ev=()
        [[ -n "$dir" ]] && ev=(--events "$dir/backend-$a.events")
        start_port_server port "backend-$a" "$BENCH/echo_server" --addr "$a" --port "$BACKEND_PORT" \
            --seconds "$BACKEND_LIFETIME" "${ev[@]}" "$@"
        BACKEND_PIDS+=("$SERVER_PID")
        [[ "$port" == "$BACKEND_PORT" ]] || die "backend $a listens on $port, not $BACKEND_PORT"
    done
}

# stop_backends: SIGTERM (they write their --events file on the way out), bounded wait.
stop_backends() {
    local pid rc
    for pid in "${BACKEND_PIDS[@]}"; do
        is_alive "$pid" && kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${BACKEND_PIDS[@]}"; do
        wait_gone "$pid" 5 || { kill -KILL "$pid" 2>/dev/null || true; log "backend pid $pid SIGKILLed"; }
        rc=0
        wait "$pid" 2>/dev/null || rc=$?
        ((rc == 0)) || { log "backend pid $pid exited $rc"; FAILURES=$((FAILURES + 1)); }
    done
    local -a keep=()
    for pid in "${OWN_PIDS[@]}"; do
        [[ " ${BACKEND_PIDS[*]} " == *" $pid "* ]] || keep+=("$pid")
    done
    OWN_PIDS=("${keep[@]}")
    BACKEND_PIDS=()
}

# ---------------------------------------------------------------- relay

# write_yaml OUT KIND BALANCE METRICS_PORT REFRESH_MIN REFRESH_MAX: KIND discovery or static.
write_yaml() {
    local out=$1 kind=$2 balance=$3 mport=$4 rmin=$5 rmax=$6 a
    {
        echo "# bench/discovery.sh: $kind, $balance"
        echo "workers: 1"
        echo "metrics: {listen: 127.0.0.1:$mport}"
        [[ "$kind" == discovery ]] && echo "resolvers: {nameservers: [\"127.0.0.1:$DNS_PORT\"]}"
        echo "clusters:"
        echo "  - name: web"
        echo "    balance: $balance"
        if [[ "$kind" == discovery ]]; then
            echo "    discovery: {dns: $DNS_NAME, port: $BACKEND_PORT, refresh_min: $rmin, refresh_max: $rmax, hold: 30s}"
        else
            echo "    backends:"
            for a in "${BACKEND_ADDRS[@]}"; do echo "      - {address: $a:$BACKEND_PORT}"; done
        fi
        echo "listeners:"
        echo "  - {name: web, listen: 127.0.0.1:$RELAY_PORT, cluster: web, mode: splice}"
    } >"$out"
}

# start_zcrelay KIND BALANCE REFRESH_MIN REFRESH_MAX: zcrelay -c on RELAY_CPU, waits for
# "zcrelay: ready". Sets relays.sh's state (RELAY_NAME, RELAY_PID, RELAY_DIR, RELAY_PORT,
# _RELAY_SHELL) so that its stop_relay and relay_cpu_ticks work, and METRICS_URL.
_SEQ=0
start_zcrelay() {
    local kind=$1 balance=$2 rmin=$3 rmax=$4 mport
    RELAY_NAME="zcrelay-$kind" RELAY_PID="" RELAY_ERR=""
    pick_port RELAY_PORT
    pick_port mport
    METRICS_URL="http://127.0.0.1:$mport/metrics"
    _SEQ=$((_SEQ + 1))
    RELAY_DIR="$WORK/relay-$_SEQ-$kind-$balance"
    mkdir -p "$RELAY_DIR"
    RELAY_LOG="$RELAY_DIR/output.log"
    write_yaml "$RELAY_DIR/zcrelay.yaml" "$kind" "$balance" "$mport" "$rmin" "$rmax"
    # stdbuf: "zcrelay: ready" must reach the file at once though stdout is no tty.
    taskset -c "$RELAY_CPU" stdbuf -oL "$BUILD/zcrelay" -c "$RELAY_DIR/zcrelay.yaml" \
        >"$RELAY_LOG" 2>&1 </dev/null &
    RELAY_PID=$!
    _RELAY_SHELL=$BASHPID
    OWN_PIDS+=("$RELAY_PID")
    local deadline=$((SECONDS + 15))
    until _relay_ready "$RELAY_NAME"; do
        if ! is_alive "$RELAY_PID" || ((SECONDS >= deadline)); then
            log "zcrelay ($kind, $balance) did not get ready: $(_relay_tail "$RELAY_LOG")"
            stop_relay >/dev/null 2>&1 || true
            return 1
        fi
        sleep 0.05
    done
}

# finish_relay: stop_relay; a wrong exit status or a needed SIGKILL is a failure.
finish_relay() {
    local t0=$SECONDS
    stop_relay
    RELAY_STOP_S=$((SECONDS - t0))
    [[ -z "${RELAY_STOP_NOTE:-}" ]] || log "  relay: $RELAY_STOP_NOTE"
    if [[ -n "${RELAY_STOP_ERR:-}" ]]; then
        log "  relay: $RELAY_STOP_ERR"
        FAILURES=$((FAILURES + 1))
        return 1
    fi
}

# scrape: /metrics of the running relay on stdout (empty on failure).
scrape() { curl -s --max-time 2 "$METRICS_URL" 2>/dev/null || true; }
# metric BODY REGEX: the value of the first line of BODY matching ^REGEX (0 if none).
metric() { awk -v re="^$2" '$0 ~ re { print $NF; found = 1; exit } END { if (!found) print 0 }' <<<"$1"; }

# ---------------------------------------------------------------- 1. scale run

scale_run() {
    local balance=$1 d="$SAMPLES/scale-$1"
    rm -rf -- "$d"
    mkdir -p "$d"
    log "scale run, balance $balance: DNS ${BACKEND_ADDRS[*]:0:2}, then all 4 at ${PHASE} s, then ${BACKEND_ADDRS[3]} alone at $((2 * PHASE)) s; load for $LOAD_SECONDS s"
    set_dns "$d/dns.tsv" initial "${BACKEND_ADDRS[@]:0:2}" || return 1
    start_backends "$d"
    if ! start_zcrelay discovery "$balance" 200ms 1s; then
        FAILURES=$((FAILURES + 1))
        stop_backends
        return 1
    fi
    cp "$RELAY_DIR/zcrelay.yaml" "$d/zcrelay.yaml"

    taskset -c "$LOAD_CPU" python3 "$SCRIPT_DIR/discovery.py" sample "$METRICS_URL" "$d/metrics.tsv" \
        --interval "$SAMPLE_INTERVAL" --seconds $((LOAD_SECONDS + 8)) 2>"$d/sampler.err" </dev/null &
    local sampler=$!
    OWN_PIDS+=("$sampler")
    sleep 0.5   # a scrape or two before the load

    local t0 others0
    others_ticks
    others0=$OTHER_TICKS
    t0=$(now)
    echo "$t0" >"$d/t0"
    timeout $((LOAD_SECONDS + 30)) taskset -c "$LOAD_CPU" "$BENCH/discovery_load" client \
        --connect "127.0.0.1:$RELAY_PORT" --seconds "$LOAD_SECONDS" --rate "$RATE" \
        --sessions "$SESSIONS" --session-ms "$SESSION_MS" --long "$LONG" --interval-ms 100 \
        --timeline "$d/client.timeline" >"$d/client.json" 2>"$d/client.err" </dev/null &
    local client=$!
    OWN_PIDS+=("$client")

    sleep_until "$(awk -v a="$t0" -v s="$TRANSFER_START" 'BEGIN { printf "%.6f", a + s }')"
    timeout $((LOAD_SECONDS + 120)) taskset -c "$LOAD_CPU" "$BENCH/discovery_load" transfer \
        --connect "127.0.0.1:$RELAY_PORT" --in "$WORK/transfer.in" --out "$WORK/transfer.out" \
        --rate-mib "$TRANSFER_RATE" --timeout $((LOAD_SECONDS + 100)) \
        >"$d/transfer.json" 2>"$d/transfer.err" </dev/null &
    local transfer=$!
    OWN_PIDS+=("$transfer")

    sleep_until "$(awk -v a="$t0" -v s="$PHASE" 'BEGIN { printf "%.6f", a + s }')"
    set_dns "$d/dns.tsv" up "${BACKEND_ADDRS[@]}" || true
    log "  $(printf '%.1f' "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')") s: DNS now ${BACKEND_ADDRS[*]}"
    sleep_until "$(awk -v a="$t0" -v s="$((2 * PHASE))" 'BEGIN { printf "%.6f", a + s }')"
    set_dns "$d/dns.tsv" down "${BACKEND_ADDRS[3]}" || true
    log "  $(printf '%.1f' "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')") s: DNS now ${BACKEND_ADDRS[3]}"

    local rc_client=0 rc_transfer=0 other
    wait "$client" || rc_client=$?
    others_ticks
    other=$(other_pct "$others0" "$OTHER_TICKS" "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')")
    wait "$transfer" || rc_transfer=$?
    sleep 1   # the sampler sees the last connections close
    kill -TERM "$sampler" 2>/dev/null || true
    wait_gone "$sampler" 5 || kill -KILL "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    local -a keep=()
    local p
    for p in "${OWN_PIDS[@]}"; do [[ "$p" == "$client" || "$p" == "$transfer" || "$p" == "$sampler" ]] || keep+=("$p"); done
    OWN_PIDS=("${keep[@]}")

    finish_relay || true
    cp "$RELAY_LOG" "$d/relay.log"
    stop_backends
    ((rc_client == 0)) || { log "  client exited $rc_client: $(tail -n2 "$d/client.err" | tr '\n' ' ')"; FAILURES=$((FAILURES + 1)); }
    ((rc_transfer == 0)) || log "  transfer exited $rc_transfer: $(tail -n1 "$d/transfer.err")"
    { cat "$WORK/transfer.in.sha256"; sha256sum "$WORK/transfer.out" 2>/dev/null | awk '{ print $1 }'; } >"$d/transfer.sha256"
    rm -f -- "$WORK/transfer.out"
    python3 - "$d/meta.json" <<EOF
import json, sys
json.dump({"balance": "$balance", "load_seconds": $LOAD_SECONDS, "phase": $PHASE, "rate": $RATE,
           "sessions": $SESSIONS, "session_ms": $SESSION_MS, "long": $LONG, "interval_ms": 100,
           "transfer_mib": $TRANSFER_MIB, "transfer_rate_mib": $TRANSFER_RATE,
           "transfer_start_s": $TRANSFER_START, "refresh_min": "200ms", "refresh_max": "1s",
           "refresh_expected": "1 s", "ttl": 1, "backend_port": $BACKEND_PORT,
           "relay_exit": "$RELAY_RC", "relay_stop_s": $RELAY_STOP_S, "quick": $QUICK,
           "other_cpu_pct": $other,
           "host": "$HOST", "date": "$DATE"}, open(sys.argv[1], "w"))
EOF
    local c
    c=$(cat "$d/client.json" 2>/dev/null || true)
    log "  client: $c"
    log "  processes outside this bench used $other % of a CPU during the load"
    log "  transfer: $(cat "$d/transfer.json" 2>/dev/null); sha256 $(paste -sd' ' "$d/transfer.sha256")"
    log "  relay: $(grep -c '\[dns\] cluster' "$d/relay.log" || true) set changes logged; exit status $RELAY_RC after SIGTERM (${RELAY_STOP_S} s)"
}

# ---------------------------------------------------------------- 2. connection rate

# one_connrate SIDE: one conn_rate run through a fresh relay (SIDE static or discovery).
one_connrate() {
    local side=$1 base="$SAMPLES/connrate/$1" line before after t0 t1
    if ! start_zcrelay "$side" "$CONNRATE_BALANCE" 1s 30s; then
        FAILURES=$((FAILURES + 1)); CONNRATE_FAILED=$((CONNRATE_FAILED + 1)); return 1
    fi
    before=$(scrape)
    relay_cpu_ticks >/dev/null
    t0=$RELAY_CPU_TICKS
    local others0
    others_ticks
    others0=$OTHER_TICKS
    if ! line=$(timeout $((CONNRATE_SECONDS + 20)) taskset -c "$LOAD_CPU" "$BENCH/conn_rate" \
            --port "$RELAY_PORT" --conns 50 --seconds "$CONNRATE_SECONDS" 2>"$WORK/rate.err"); then
        log "  connrate $side: conn_rate failed: $(tail -n2 "$WORK/rate.err" | tr '\n' ' ')"
        finish_relay || true
        FAILURES=$((FAILURES + 1)); CONNRATE_FAILED=$((CONNRATE_FAILED + 1))
        return 1
    fi
    relay_cpu_ticks >/dev/null
    t1=$RELAY_CPU_TICKS
    others_ticks
    local other
    other=$(other_pct "$others0" "$OTHER_TICKS" "$CONNRATE_SECONDS")
    after=$(scrape)
    finish_relay || { CONNRATE_FAILED=$((CONNRATE_FAILED + 1)); return 1; }
    local completed errors rate us res resf gen
    completed=$(sed -nE 's/.*"completed": *([0-9]+).*/\1/p' <<<"$line")
    errors=$(sed -nE 's/.*"errors": *([0-9]+).*/\1/p' <<<"$line")
    rate=$(sed -nE 's/.*"conns_per_s": *([0-9.]+).*/\1/p' <<<"$line")
    us=$(awk -v d=$((t1 - t0)) -v hz="$CLK_TCK" -v n="$completed" 'BEGIN { printf "%.2f", n ? d / hz * 1e6 / n : 0 }')
    mkdir -p "$(dirname "$base")"
    echo "$rate" >>"$base.conns_per_s"
    echo "$us" >>"$base.relay_cpu_us_per_conn"
    sed -nE 's/.*"p99_us": *([0-9.]+).*/\1/p' <<<"$line" >>"$base.p99_us"
    echo "$errors" >>"$base.errors"
    echo "$other" >>"$base.other_cpu_pct"
    local extra=""
    if [[ "$side" == discovery ]]; then
        res=$(($(metric "$after" 'zcrelay_discovery_resolutions_total[{][^}]*outcome="success"') -
            $(metric "$before" 'zcrelay_discovery_resolutions_total[{][^}]*outcome="success"')))
        resf=$(( $(awk '/^zcrelay_discovery_resolutions_total/ && !/outcome="success"/ { s += $NF } END { print s + 0 }' <<<"$after") -
            $(awk '/^zcrelay_discovery_resolutions_total/ && !/outcome="success"/ { s += $NF } END { print s + 0 }' <<<"$before") ))
        gen=$(($(metric "$after" 'zcrelay_config_generation ') - $(metric "$before" 'zcrelay_config_generation ')))
        echo "$res" >>"$base.resolutions"
        echo "$resf" >>"$base.resolution_failures"
        echo "$gen" >>"$base.generation_changes"
        extra=", $res resolutions ($resf failed), $gen new generations"
    fi
    ((errors == 0)) || sed 's/^/    /' "$WORK/rate.err" >&2
    log "  connrate $side: $rate conn/s, errors $errors, relay CPU $us µs/conn$extra; other processes $other % of a CPU"
}

connrate_part() {
    mkdir -p "$SAMPLES/connrate"
    log "connection rate: static vs discovery, $CONNRATE_RUNS runs each of $CONNRATE_SECONDS s, balance $CONNRATE_BALANCE"
    set_dns "$SAMPLES/connrate/dns.tsv" connrate "${BACKEND_ADDRS[@]}" || return 1
    start_backends "" --close-after 64
    local r side
    for ((r = 1; r <= CONNRATE_RUNS; r++)); do
        local order=(static discovery)
        ((r % 2 == 0)) && order=(discovery static)
        for side in "${order[@]}"; do
            if over_budget; then
                SKIPPED=$((SKIPPED + 1))
                continue
            fi
            one_connrate "$side" || true
        done
    done
    stop_backends
}

# ---------------------------------------------------------------- main

configure() {
    if ((QUICK)); then
        PHASE=${PHASE:-6}; TRANSFER_MIB=${TRANSFER_MIB:-64}; CONNRATE_RUNS=${CONNRATE_RUNS:-2}
        CONNRATE_SECONDS=${CONNRATE_SECONDS:-3}; TIME_BUDGET=${TIME_BUDGET:-85}
        BALANCES=${BALANCES:-least_conn}
    else
        PHASE=${PHASE:-10}; TRANSFER_MIB=${TRANSFER_MIB:-256}; CONNRATE_RUNS=${CONNRATE_RUNS:-5}
        CONNRATE_SECONDS=${CONNRATE_SECONDS:-5}; TIME_BUDGET=${TIME_BUDGET:-230}
        BALANCES=${BALANCES:-least_conn,round_robin}
    fi
    RATE=${RATE:-200}; SESSIONS=${SESSIONS:-40}; SESSION_MS=${SESSION_MS:-2000}; LONG=${LONG:-8}
    LOAD_SECONDS=$((3 * PHASE))
    TRANSFER_START=1
    # Paced to end about 3 s before the load does, so it is live through every DNS change.
    TRANSFER_RATE=$(awk -v m="$TRANSFER_MIB" -v s="$LOAD_SECONDS" -v b="$TRANSFER_START" 'BEGIN { printf "%.2f", m / (s - b - 3) }')
    CONNRATE_BALANCE=least_conn
    CONNRATE_FAILED=0
}

main() {
    while (($#)); do
        case "$1" in
            --quick) QUICK=1 ;;
            --balances) BALANCES=${2:?--balances needs a list}; shift ;;
            -h|--help) usage 0 ;;
            *) echo "bench/discovery.sh: unknown argument '$1'" >&2; usage 2 ;;
        esac
        shift
    done
    configure
    (($(nproc) >= 2)) || die "needs 2 CPUs (relay on $RELAY_CPU, load on $LOAD_CPU)"
    local t
    for t in conn_rate echo_server discovery_load; do
        [[ -x "$BENCH/$t" ]] || die "$BENCH/$t missing: cmake --build build first"
    done
    [[ -x "$BUILD/zcrelay" ]] || die "$BUILD/zcrelay missing: build first"
    [[ -x "$DNSMASQ" ]] || die "needs dnsmasq ($DNSMASQ)"
    for t in dig gnuplot curl taskset stdbuf timeout ss awk python3 sha256sum; do
        command -v "$t" >/dev/null || die "needs $t"
    done
    "$BENCH/echo_server" --help | grep -q -- --events || die "$BENCH/echo_server has no --events: rebuild it"
    CLK_TCK=$(getconf CLK_TCK)
    HOST=$(hostname -s)
    KERNEL=$(uname -r)
    DATE=$(date +%F)
    local suffix=discovery
    ((QUICK)) && suffix=discovery-quick
    mkdir -p "$SCRIPT_DIR/results"
    REPORT="$SCRIPT_DIR/results/$DATE-$HOST-$suffix.md"
    RESULTS="$SCRIPT_DIR/results/$DATE-$HOST-$suffix.jsonl"
    SAMPLES="$SCRIPT_DIR/results/$DATE-$HOST-$suffix-samples"
    CHARTS="$SCRIPT_DIR/results/$DATE-$HOST-$suffix-charts"
    rm -rf -- "$SAMPLES" "$CHARTS" "$RESULTS"
    mkdir -p "$SAMPLES" "$CHARTS"
    WORK=$(mktemp -d /dev/shm/zcbench-discovery.XXXXXX)
    trap 'stop_relay >/dev/null 2>&1 || true; cleanup' EXIT
    LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
    log "relay on CPU $RELAY_CPU; load, backends, dnsmasq on CPU $LOAD_CPU; $HOST, $KERNEL; load average $LOAD_BEFORE"

    head -c $((TRANSFER_MIB * 1048576)) /dev/urandom >"$WORK/transfer.in"
    sha256sum "$WORK/transfer.in" | awk '{ print $1 }' >"$WORK/transfer.in.sha256"
    start_dns

    local b first=1
    for b in ${BALANCES//,/ }; do
        if over_budget; then
            log "time budget spent: no scale run for $b"
            SKIPPED=$((SKIPPED + 1))
            continue
        fi
        scale_run "$b" || true
        # The connection-rate part right after the first scale run: the second balance is the
        # optional one, so it goes last.
        if ((first)); then
            first=0
            connrate_part || true
        fi
    done
    cp "$WORK/dnsmasq.log" "$SAMPLES/dnsmasq.log"

    ELAPSED_MIN=$(awk -v s="$SECONDS" 'BEGIN { printf "%.1f", s / 60 }')
    LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
    python3 - "$SAMPLES/meta.json" <<EOF
import json, sys
json.dump({"quick": $QUICK, "host": "$HOST", "kernel": "$KERNEL", "date": "$DATE",
           "connrate_runs": $CONNRATE_RUNS, "connrate_seconds": $CONNRATE_SECONDS,
           "connrate_balance": "$CONNRATE_BALANCE", "connrate_failed_runs": $CONNRATE_FAILED,
           "backend_port": $BACKEND_PORT}, open(sys.argv[1], "w"))
EOF
    local rc_report
    {
        report_header
        python3 "$SCRIPT_DIR/discovery.py" report "$SAMPLES" --jsonl "$RESULTS" || echo "$?" >"$WORK/report.rc"
        charts
    } | tee "$REPORT"
    rc_report=$(cat "$WORK/report.rc" 2>/dev/null || echo 0)
    log "report: $REPORT; records: $RESULTS; charts: $CHARTS; samples: $SAMPLES"
    if ((FAILURES || SKIPPED || rc_report)); then
        log "$FAILURES failure(s), $SKIPPED run(s) skipped for the time budget$( ((rc_report)) && echo ', and clients saw failures or the transfer was not byte-exact (report)')"
        exit 1
    fi
}

report_header() {
    echo "### bench/discovery.sh on $HOST ($KERNEL), $DATE$( ((QUICK)) && echo ', --quick: a smoke run, not results to quote')"
    echo
    echo "$(relay_version zcrelay-splice 2>/dev/null || echo zcrelay) (\`$(realpath --relative-to="$SCRIPT_DIR/.." "$BUILD/zcrelay")\`, sha256" \
        "$(sha256sum "$BUILD/zcrelay" | cut -c1-12)…, mode splice, 1 worker) on CPU $RELAY_CPU;" \
        "load, backends (\`echo_server\`), $("$DNSMASQ" --version | head -n1 | awk '{ print "dnsmasq", $3 }') and the metrics sampler on CPU $LOAD_CPU." \
        "$(nproc) CPUs ($(lscpu | sed -nE 's/^Model name: *//p' | head -n1))." \
        "Load average $LOAD_BEFORE before, $LOAD_AFTER after (this bench keeps about 2 runnable itself)." \
        "Measuring took $ELAPSED_MIN minutes."
    ((FAILURES || SKIPPED)) && echo "**$FAILURES failure(s), $SKIPPED run(s) skipped for the time budget** (stderr says which)."
    echo
}

# charts: one SVG per scale run (discovery.py plotdata + discovery.gp); their names on stdout.
charts() {
    local d vars n=0
    for d in "$SAMPLES"/scale-*/; do
        [[ -d "$d" ]] || continue
        d=${d%/}
        if vars=$(python3 "$SCRIPT_DIR/discovery.py" plotdata "$d" "$CHARTS" 2>>"$WORK/plot.err") &&
            gnuplot "$vars" "$SCRIPT_DIR/discovery.gp" 2>>"$WORK/plot.err"; then
            n=$((n + 1))
            rm -f "$vars"   # it names this machine's paths; the .dat files beside it are the data
        else
            log "chart for $d failed: $(tail -n3 "$WORK/plot.err" | tr '\n' ' ')"
        fi
    done
    if ((n)); then
        echo "Charts (active connections and new connections/s per backend over time, DNS changes marked):"
        echo
        local f
        for f in "$CHARTS"/*.svg; do echo "- \`$(realpath --relative-to="$SCRIPT_DIR" "$f")\`"; done
    fi
}

main "$@"
