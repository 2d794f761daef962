#!/usr/bin/env bash
# nc-relay.sh: bulk transfer through a TCP relay, driven by netcat.
#
# This is the method published with FreeBSD's sendsock module (2007): an
# `nc -l` sink, the relay in front of it, and `nc relay < file` as the
# client, timing a 1 GiB transfer. We repeat it for several relays on one
# machine so the numbers can be compared:
#
#   direct          client nc straight to the sink (no relay; note both nc
#                   share CPU 0, so this is a one-CPU baseline, not a ceiling)
#   zcrelay-splice  zcrelay --mode splice
#   zcrelay-splice-nagle  the same with tcp_nodelay: false (Nagle on, as socat)
#   zcrelay-copy    zcrelay --mode copy
#   socat           socat TCP-LISTEN -> TCP, single connection (no fork)
#
# Per run we measure
#   - end-to-end MB/s (10^6 B/s): bytes / (client start -> sink nc exit);
#   - relay CPU (user+sys) from wait4() rusage via /usr/bin/time, as s/GiB;
#   - that the sink received exactly the source bytes (size + sha256).
# A run that fails any check is a failure: it is reported, never averaged in.
#
# nc itself tops out well below what a good relay can do on loopback, so on
# this workload compare relays on CPU s/GiB (see bench/README.md).
#
# Usage: bench/nc-relay.sh [--only direct,zcrelay-splice,...] [--size-mib N]
#                          [--runs N] [--sink file|null]
# Environment: SIZE_MIB (1024), RUNS (3), ZCRELAY_BUILD (<repo>/build),
#              PORT_BASE (17000), NC_TIMEOUT (300 s).

set -euo pipefail

readonly ALL_RELAYS="direct,zcrelay-splice,zcrelay-splice-nagle,zcrelay-copy,socat"
readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

SIZE_MIB="${SIZE_MIB:-1024}"
RUNS="${RUNS:-3}"
ONLY="$ALL_RELAYS"
BUILD="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}"
PORT_BASE="${PORT_BASE:-17000}"
NC_TIMEOUT="${NC_TIMEOUT:-300}"
# file: the sink writes to tmpfs and every run is checked (size + sha256), the default.
# null: the sink writes to /dev/null, so nothing is checked; it shows what storing the bytes
# costs the nc CPU (with splice that write was measured far dearer, see bench/README.md).
SINK="${SINK:-file}"
readonly READY_TIMEOUT=10   # s for zcrelay to print "zcrelay: ready"
readonly STOP_TIMEOUT=15    # s for a relay to exit after SIGTERM / EOF
readonly GRACE=30           # s for the sink to finish once the client is gone

# Relay on CPU 1, both nc on CPU 0: the relay never competes with the load
# for a core, and every hop pays the same cross-CPU wake-up.
readonly RELAY_CPU=1
readonly NC_CPU=0

readonly HOST="$(hostname -s)"
readonly RESULTS="$SCRIPT_DIR/results/nc-relay-$(date +%Y-%m-%d)-$HOST.jsonl"

WORK=""          # scratch dir on tmpfs (source, sink output, logs)
SRC=""           # source file
SRC_SHA=""
SRC_BYTES=0
NEXT_PORT="$PORT_BASE"
HAVE_TIME=1
declare -a OWN_PIDS=()   # every background process we started

die() { echo "nc-relay: $*" >&2; exit 1; }
log() { echo "nc-relay: $*" >&2; }
# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"

usage() {
    sed -n '2,/^$/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
    exit "${1:-0}"
}

parse_args() {
    while (($#)); do
        case "$1" in
            --only) ONLY="${2:?--only needs a list}"; shift 2 ;;
            --only=*) ONLY="${1#*=}"; shift ;;
            --size-mib) SIZE_MIB="${2:?--size-mib needs N}"; shift 2 ;;
            --size-mib=*) SIZE_MIB="${1#*=}"; shift ;;
            --runs) RUNS="${2:?--runs needs N}"; shift 2 ;;
            --runs=*) RUNS="${1#*=}"; shift ;;
            --sink) SINK="${2:?--sink needs file or null}"; shift 2 ;;
            --sink=*) SINK="${1#*=}"; shift ;;
            -h|--help) usage 0 ;;
            *) echo "unknown argument: $1" >&2; usage 2 ;;
        esac
    done
    [[ "$SIZE_MIB" =~ ^[1-9][0-9]*$ ]] || die "--size-mib must be a positive integer"
    [[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || die "--runs must be a positive integer"
    [[ "$SINK" == file || "$SINK" == null ]] || die "--sink must be file or null"
    local r
    for r in ${ONLY//,/ }; do
        [[ ",$ALL_RELAYS," == *",$r,"* ]] || die "unknown relay '$r' (known: $ALL_RELAYS)"
    done
}

# ---------------------------------------------------------------- processes



# cleanup() (lib.sh) stops what OWN_PIDS lists and removes $WORK.

# ---------------------------------------------------------------- ports



wait_listening() {
    local port=$1 pid=$2 deadline=$((SECONDS + READY_TIMEOUT))
    until [[ -n "$(ss -Hltn "sport = :$port" 2>/dev/null)" ]]; do
        is_alive "$pid" || return 1
        ((SECONDS < deadline)) || return 1
        sleep 0.02
    done
}

# ---------------------------------------------------------------- relays

# Set by start_relay for the current run.
RELAY_TOP=""     # pid we can wait on (time(1), or the relay without time)
RELAY_PID=""     # the relay process itself
RELAY_TIMEFILE=""
RELAY_LOG=""

# relay_cmd RELAY LISTEN_PORT SINK_PORT -> argv in global RELAY_ARGV
relay_cmd() {
    local relay=$1 lport=$2 sport=$3
    case "$relay" in
        zcrelay-splice|zcrelay-copy)
            # stdbuf: the "ready" line must reach the log file promptly even
            # if the binary only line-buffers on a tty.
            RELAY_ARGV=(stdbuf -oL "$BUILD/zcrelay"
                --listen "127.0.0.1:$lport" --upstream "127.0.0.1:$sport"
                --mode "${relay#zcrelay-}" --workers 1 --metrics off) ;;
        zcrelay-splice-nagle)
            # The same splice relay with tcp_nodelay: false (a config-file key): Nagle may
            # coalesce a bulk flow's small sends, as it does for socat, which leaves it on.
            printf 'workers: 1\nmetrics: {listen: ""}\nlisteners:\n  - {listen: "127.0.0.1:%s", upstream: "127.0.0.1:%s", mode: splice, tcp_nodelay: false}\n' \
                "$lport" "$sport" >"$WORK/nagle.yaml"
            RELAY_ARGV=(stdbuf -oL "$BUILD/zcrelay" -c "$WORK/nagle.yaml") ;;
        socat)
            # No fork: socat serves exactly one connection and then exits.
            RELAY_ARGV=(socat
                "TCP-LISTEN:$lport,bind=127.0.0.1,reuseaddr,backlog=1024"
                "TCP:127.0.0.1:$sport") ;;
        *) die "relay_cmd: $relay" ;;
    esac
}

# start_relay RELAY LISTEN_PORT SINK_PORT RUN_TAG; 1 if it did not come up.
start_relay() {
    local relay=$1 lport=$2 sport=$3 tag=$4
    RELAY_TIMEFILE="$WORK/$tag.time"
    RELAY_LOG="$WORK/$tag.log"
    relay_cmd "$relay" "$lport" "$sport"

    if ((HAVE_TIME)); then
        # time(1) reports the relay's rusage from wait4(): every thread, from
        # start to exit, whether we stop it or it exits on its own (socat).
        taskset -c "$RELAY_CPU" /usr/bin/time -f '%e %U %S' -o "$RELAY_TIMEFILE" \
            "${RELAY_ARGV[@]}" >"$RELAY_LOG" 2>&1 </dev/null &
        RELAY_TOP=$!
        OWN_PIDS+=("$RELAY_TOP")
        # taskset execs time(1), which forks the relay; stdbuf execs too.
        local deadline=$((SECONDS + READY_TIMEOUT))
        RELAY_PID=""
        while [[ -z "$RELAY_PID" ]]; do
            RELAY_PID=$(pgrep -P "$RELAY_TOP" | head -n1 || true)
            [[ -n "$RELAY_PID" ]] && break
            is_alive "$RELAY_TOP" && ((SECONDS < deadline)) || return 1
            sleep 0.01
        done
        OWN_PIDS+=("$RELAY_PID")
    else
        taskset -c "$RELAY_CPU" "${RELAY_ARGV[@]}" >"$RELAY_LOG" 2>&1 </dev/null &
        RELAY_TOP=$!
        RELAY_PID=$RELAY_TOP
        OWN_PIDS+=("$RELAY_TOP")
    fi

    case "$relay" in
        zcrelay-*)
            local deadline=$((SECONDS + READY_TIMEOUT))
            until grep -q '^zcrelay: ready' "$RELAY_LOG" 2>/dev/null; do
                is_alive "$RELAY_PID" || return 1
                ((SECONDS < deadline)) || return 1
                sleep 0.02
            done ;;
        socat)
            wait_listening "$lport" "$RELAY_PID" || return 1 ;;
    esac
}

# /proc/PID/stat utime+stime in seconds (fallback when time(1) is missing).
proc_cpu_s() {
    local f
    f=$(sed -E 's/^.*\) //' "/proc/$1/stat" 2>/dev/null) || return 1
    # after "comm) ": field 3 is state, so utime/stime (14/15) are $12/$13.
    awk -v tck="$(getconf CLK_TCK)" '{ printf "%.3f", ($12 + $13) / tck }' <<<"$f"
}

# stop_relay RELAY -> sets RELAY_CPU_S and RELAY_RC; 1 if it would not stop.
stop_relay() {
    local relay=$1
    RELAY_CPU_S=""
    RELAY_RC=0
    if ((!HAVE_TIME)); then
        RELAY_CPU_S=$(proc_cpu_s "$RELAY_PID" || true)
    fi
    case "$relay" in
        zcrelay-*)
            # zcrelay drains and exits 0 on SIGTERM.
            is_alive "$RELAY_PID" && kill -TERM "$RELAY_PID" 2>/dev/null || true ;;
        socat)
            # Exits by itself once both directions have closed.
            if ! wait_gone "$RELAY_PID" "$STOP_TIMEOUT"; then
                log "socat still running ${STOP_TIMEOUT}s after the transfer; SIGTERM"
                kill -TERM "$RELAY_PID" 2>/dev/null || true
            fi ;;
    esac
    if ! wait_gone "$RELAY_PID" "$STOP_TIMEOUT"; then
        kill -KILL "$RELAY_PID" 2>/dev/null || true
        wait "$RELAY_TOP" 2>/dev/null || true
        return 1
    fi
    wait "$RELAY_TOP" 2>/dev/null || RELAY_RC=$?
    if ((HAVE_TIME)); then
        # On a non-zero exit time(1) writes a "Command exited..." line first.
        RELAY_CPU_S=$(tail -n1 "$RELAY_TIMEFILE" 2>/dev/null |
                      awk 'NF == 3 { printf "%.3f", $2 + $3 }')
    fi
}

# ---------------------------------------------------------------- one run

make_source() {
    SRC="$WORK/src"
    log "creating ${SIZE_MIB} MiB source from /dev/urandom on tmpfs"
    head -c "$((SIZE_MIB * 1024 * 1024))" /dev/urandom >"$SRC"
    SRC_BYTES=$(stat -c %s "$SRC")
    SRC_SHA=$(sha256sum "$SRC" | cut -d' ' -f1)
}

# run_one RELAY IDX -> RUN_MBPS, RUN_CPU_S_GIB, RUN_ERR; 1 on failure.
run_one() {
    local relay=$1 idx=$2 tag="$1-$2"
    local sink_port lport client_port sink_out="$WORK/$tag.sink"
    [[ "$SINK" == file ]] || sink_out=/dev/null
    RUN_MBPS="" RUN_CPU_S_GIB="" RUN_ERR=""

    pick_port sink_port
    timeout "$NC_TIMEOUT" taskset -c "$NC_CPU" \
        nc -l 127.0.0.1 "$sink_port" </dev/null >"$sink_out" 2>"$WORK/$tag.sink.err" &
    local sink=$!
    OWN_PIDS+=("$sink")
    if ! wait_listening "$sink_port" "$sink"; then
        RUN_ERR="sink did not listen"; kill -TERM "$sink" 2>/dev/null; return 1
    fi

    if [[ "$relay" == direct ]]; then
        client_port=$sink_port
    else
        pick_port lport
        client_port=$lport
        if ! start_relay "$relay" "$lport" "$sink_port" "$tag"; then
            RUN_ERR="relay did not start: $(tail -n3 "$RELAY_LOG" 2>/dev/null | tr '\n' ' ')"
            kill -TERM "$sink" 2>/dev/null
            stop_relay "$relay" || true
            return 1
        fi
        if ((idx == 1)); then
            log "pinning: $relay pid $RELAY_PID -> $(taskset -cp "$RELAY_PID" | sed 's/.*: //' || true)," \
                "sink nc -> $(taskset -cp "$(pgrep -P "$sink" | head -n1)" 2>/dev/null | sed 's/.*: //' || echo '?')"
        fi
    fi

    # The clock runs from the client's start until the sink nc has exited,
    # i.e. every byte went through and the EOF reached the far end.
    local t0 t1 who rc client
    t0=$EPOCHREALTIME
    timeout "$NC_TIMEOUT" taskset -c "$NC_CPU" \
        nc -N 127.0.0.1 "$client_port" <"$SRC" >/dev/null 2>"$WORK/$tag.client.err" &
    client=$!
    OWN_PIDS+=("$client")

    rc=0; wait -n -p who "$sink" "$client" || rc=$?
    if [[ "$who" == "$sink" ]]; then
        t1=$EPOCHREALTIME
        local sink_rc=$rc client_rc=0
        wait "$client" || client_rc=$?
    else
        # Client gone first (normal only if the relay dropped the sink side
        # late); give the sink a bounded grace period.
        local client_rc=$rc sink_rc=0
        wait_gone "$sink" "$GRACE" || kill -TERM "$sink" 2>/dev/null || true
        t1=$EPOCHREALTIME
        wait "$sink" || sink_rc=$?
    fi

    if [[ "$relay" != direct ]]; then
        if ! stop_relay "$relay"; then
            RUN_ERR="relay did not exit within ${STOP_TIMEOUT}s"
        elif ((RELAY_RC != 0)); then
            RUN_ERR="relay exited with status $RELAY_RC"
        fi
    fi

    # Verify before anything is counted.
    local got_bytes=$SRC_BYTES got_sha=""
    if [[ "$SINK" == file ]]; then
        got_bytes=$(stat -c %s "$sink_out" 2>/dev/null || echo 0)
        if ((got_bytes == SRC_BYTES)); then
            got_sha=$(sha256sum "$sink_out" | cut -d' ' -f1)
        fi
        rm -f -- "$sink_out"
    fi

    local errs=()
    ((client_rc == 0)) || errs+=("client nc exit $client_rc")
    ((sink_rc == 0)) || errs+=("sink nc exit $sink_rc")
    ((got_bytes == SRC_BYTES)) || errs+=("size $got_bytes != $SRC_BYTES")
    [[ -z "$got_sha" || "$got_sha" == "$SRC_SHA" ]] || errs+=("sha256 mismatch")
    [[ -z "$RUN_ERR" ]] || errs+=("$RUN_ERR")
    RUN_ERR="${errs[*]:-}"

    RUN_MBPS=$(awk -v b="$SRC_BYTES" -v a="$t0" -v z="$t1" \
        'BEGIN { printf "%.1f", b / (z - a) / 1e6 }')
    if [[ "$relay" != direct && -n "$RELAY_CPU_S" ]]; then
        RUN_CPU_S_GIB=$(awk -v c="$RELAY_CPU_S" -v b="$SRC_BYTES" \
            'BEGIN { printf "%.3f", c / (b / 1073741824) }')
    fi
    [[ -z "$RUN_ERR" ]]
}

# ---------------------------------------------------------------- stats

# stats "v1 v2 ..." -> "median min max", or "" for no values.
stats() {
    [[ -n "${1// /}" ]] || { echo ""; return; }
    tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -g | awk '
        { v[NR] = $1 }
        END {
            m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
            printf "%.3f %.3f %.3f", m, v[1], v[NR]
        }'
}

fmt1() { [[ -n "$1" ]] && printf "%.1f" "$1" || echo "-"; }

json_num() { [[ -n "$1" ]] && echo "$1" || echo null; }

# ---------------------------------------------------------------- main

main() {
    parse_args "$@"
    local relays=(${ONLY//,/ })

    for t in nc taskset timeout ss pgrep sha256sum stdbuf; do
        command -v "$t" >/dev/null || die "missing tool: $t"
    done
    if [[ ! -x /usr/bin/time ]]; then
        HAVE_TIME=0
        log "/usr/bin/time missing (Debian package 'time'): relay CPU read from" \
            "/proc/PID/stat before stopping; socat's may be missing as it exits by itself"
    fi
    local r
    for r in "${relays[@]}"; do
        case "$r" in
            zcrelay-*) [[ -x "$BUILD/zcrelay" ]] || die "$BUILD/zcrelay not found (set ZCRELAY_BUILD)" ;;
            socat) command -v socat >/dev/null || die "socat not installed" ;;
        esac
    done
    (($(nproc) >= 2)) || die "needs 2 CPUs (relay on CPU $RELAY_CPU, nc on CPU $NC_CPU)"

    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    WORK=$(mktemp -d /dev/shm/nc-relay.XXXXXX)
    make_source

    log "pinning: relay on CPU $RELAY_CPU, nc client and nc sink on CPU $NC_CPU"
    log "size ${SIZE_MIB} MiB, runs $RUNS, relays ${relays[*]}, zcrelay from $BUILD"

    # Runs are interleaved (round-robin over relays) so that slow drift of
    # the machine spreads over all relays instead of biasing one of them.
    declare -A mbps=() cpu=() fails=()
    local i
    for r in "${relays[@]}"; do mbps[$r]=""; cpu[$r]=""; fails[$r]=0; done
    for ((i = 1; i <= RUNS; i++)); do
        for r in "${relays[@]}"; do
            if run_one "$r" "$i"; then
                mbps[$r]+=" $RUN_MBPS"
                [[ -z "$RUN_CPU_S_GIB" ]] || cpu[$r]+=" $RUN_CPU_S_GIB"
                log "run $i $r: $RUN_MBPS MB/s, relay CPU ${RUN_CPU_S_GIB:--} s/GiB, $([[ $SINK == file ]] && echo verified || echo "not checked (sink null)")"
            else
                fails[$r]=$((fails[$r] + 1))
                log "run $i $r: FAILED ($RUN_ERR) [${RUN_MBPS:-?} MB/s, not counted]"
            fi
        done
    done

    mkdir -p "$(dirname "$RESULTS")"
    local direct_med=""
    if [[ -n "${mbps[direct]:-}" ]]; then
        direct_med=$(stats "${mbps[direct]}" | cut -d' ' -f1)
    fi

    echo
    echo "### nc bulk, ${SIZE_MIB} MiB, $RUNS runs, sink $SINK ($HOST, $(date +%Y-%m-%d), relay CPU $RELAY_CPU, nc CPU $NC_CPU)"
    echo
    echo "| relay | ok/runs | median MB/s | min MB/s | max MB/s | vs direct | relay CPU s/GiB median (min-max) |"
    echo "|---|---|---|---|---|---|---|"
    for r in "${relays[@]}"; do
        local s c med="" mn="" mx="" cmed="" cmin="" cmax="" ratio="-" cpucol="-"
        s=$(stats "${mbps[$r]}")
        c=$(stats "${cpu[$r]}")
        [[ -z "$s" ]] || read -r med mn mx <<<"$s"
        [[ -z "$c" ]] || read -r cmed cmin cmax <<<"$c"
        if [[ -n "$med" && -n "$direct_med" ]]; then
            ratio=$(awk -v a="$med" -v b="$direct_med" 'BEGIN { printf "%.2f", a / b }')
        fi
        [[ -z "$cmed" ]] || cpucol="$cmed ($cmin-$cmax)"
        echo "| $r | $((RUNS - fails[$r]))/$RUNS | $(fmt1 "$med") | $(fmt1 "$mn") | $(fmt1 "$mx") | $ratio | $cpucol |"

        printf '{"relay":"%s","workload":"bulk-nc","param":"%sMiB sink=%s","unit":"MB/s","median":%s,"min":%s,"max":%s,"runs":%d,"failures":%d,"relay_cpu_s_per_gib":%s}\n' \
            "$r" "$SIZE_MIB" "$SINK" "$(json_num "$med")" "$(json_num "$mn")" "$(json_num "$mx")" \
            "$RUNS" "${fails[$r]}" "$(json_num "$cmed")" >>"$RESULTS"
    done
    echo
    echo "MB/s = 10^6 B/s, client start to sink exit; failed runs are not counted."
    echo "nc limits bulk throughput: compare relays on CPU s/GiB. JSON lines: bench/results/$(basename "$RESULTS")"

    local total=0
    for r in "${relays[@]}"; do total=$((total + fails[$r])); done
    ((total == 0)) || { log "$total failed run(s)"; return 1; }
}

main "$@"
