#!/usr/bin/env bash
# datapath.sh: the relay's data paths against no relay, measured in the same run.
#
# Modes:
#   direct   the client talks to the sink / echo server itself (no relay)
#   sockmap  zcrelay --mode sockmap (bytes redirected in the kernel by a BPF sockmap program)
#   splice   zcrelay --mode splice
#   copy     zcrelay --mode copy
# A relay mode that zcrelay does not accept (no "zcrelay: ready" on stdout) is reported as
# unavailable with its stderr, and the other modes still run.
#
# (a) Transfer matrix (bench/transfer): per-connection size 1/10/50/100 MiB with one client,
#     and 1/10/50/100 concurrent clients of --per-client-mib MiB (10) each. Each measurement
#     repeats rounds of the cell until at least --min-mib MiB (1000) went through, because one
#     1 MiB transfer lasts a millisecond and the CPU counters tick every 4-10 ms. Every byte is
#     confirmed by the sink's receipt (see transfer.cpp). Per cell and mode: MB/s, the relay
#     process's CPU s/GiB (utime+stime from /proc/PID/stat), system-wide busy CPU s/GiB from
#     /proc/stat (user+nice+system+irq+softirq+steal, all CPUs), and the CPU of processes that
#     are not part of this benchmark over the same window (a colleague's build on this shared
#     machine lands in the system column; this says how much). sockmap moves bytes in softirq
#     and kworker context, which no relay thread is charged for: compare it on the system
#     column. One extra untimed pass per mode sends every cell once with --verify (the sink
#     checks each byte against the pattern), so the timed runs pay no checking cost and the
#     data path is still checked byte for byte at every concurrency.
# (b) Latency (bench/pingpong): 64 B request/response over one connection, --iters (20000)
#     round trips after --warmup (1000), p50/p99/p99.9/max in µs. Placement "xcpu": client
#     and echo server on CPU 0, relay on CPU 1; "same": the relay on CPU 0 as well. direct runs
#     both ways too: "same" (client and server on CPU 0) is the baseline, "xcpu" (server on
#     CPU 1) shows what one cross-CPU wake-up costs on this machine; a relay on the other CPU
#     pays it on each of its four hops.
#
# The relay always runs with one worker, pinned (CPU 1 for the transfer matrix); client and
# sink are pinned to CPU 0, so `direct` is a one-CPU baseline, not a ceiling: a relay gets CPU 1
# on top. Modes are interleaved within each run so that drift of the machine does not favour
# one. A failed measurement (client error, missing receipt, count or pattern mismatch, relay
# not exiting 0 on SIGTERM, timeout) is reported and never averaged in; a mode that fails
# MAX_FAILS (3) times is dropped for the rest of the run so a broken mode cannot eat the
# time budget. The script then exits 1.
#
# Usage: bench/datapath.sh [--only direct,sockmap,splice,copy] [--runs N] [--quick]
#                          [--per-client-mib N] [--min-mib N] [--iters N] [--warmup N]
#                          [--verify-all] [--no-transfer] [--no-latency] [--no-same-cpu]
#   --quick        smoke run: 1 run, cells 1 and 10 only, --min-mib 50, 2000 round trips;
#                  its JSON lines carry "quick":1 (not results to quote)
#   --verify-all   also verify the pattern in the timed runs (costs CPU 0 time)
# Environment: ZCRELAY_BUILD (<repo>/build; tools in $ZCRELAY_BUILD/bench), PORT_BASE (18000),
#              TRANSFER_TIMEOUT (60 s per client run), RUNS, PER_CLIENT_MIB, MIN_MIB, ITERS,
#              WARMUP, SIZES ("1 10 50 100"), CLIENTS ("1 10 50 100").
# Output: Markdown tables on stdout, progress on stderr, JSON lines appended to
#         bench/results/datapath-<date>-<host>.jsonl.

set -euo pipefail

readonly ALL_MODES="direct,sockmap,splice,copy"
readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

BUILD="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}"
RUNS="${RUNS:-3}"
ONLY="$ALL_MODES"
SIZES="${SIZES:-1 10 50 100}"          # MiB per connection, one client
CLIENTS="${CLIENTS:-1 10 50 100}"      # concurrent clients, PER_CLIENT_MIB each
PER_CLIENT_MIB="${PER_CLIENT_MIB:-10}"
MIN_MIB="${MIN_MIB:-1000}"             # per measurement, reached by repeating rounds
ITERS="${ITERS:-20000}"
WARMUP="${WARMUP:-1000}"
MSG_SIZE=64
PORT_BASE="${PORT_BASE:-18000}"
TRANSFER_TIMEOUT="${TRANSFER_TIMEOUT:-60}"
VERIFY_ALL=0
DO_TRANSFER=1
DO_LATENCY=1
DO_SAME=1
QUICK=0

readonly LOAD_CPU=0        # client, sink, echo server
readonly RELAY_CPU=1       # relay (the latency matrix's "same" placement moves it to CPU 0)
readonly READY_TIMEOUT=10  # s for zcrelay to print "zcrelay: ready", a tool its port
readonly STOP_TIMEOUT=15   # s for zcrelay to exit after SIGTERM
readonly MAX_FAILS=3       # failures after which a mode is dropped from the rest of the run
readonly TOOL_LIFETIME=3600  # s: sink / echo server exit on their own after this, whatever happens
readonly CLK_TCK="$(getconf CLK_TCK)"

readonly HOST="$(hostname -s)"
readonly RESULTS="$SCRIPT_DIR/results/datapath-$(date +%Y-%m-%d)-$HOST.jsonl"

WORK=""
ZCRELAY_ID=""
NEXT_PORT="$PORT_BASE"
declare -a OWN_PIDS=()   # every background process we started

die() { echo "datapath: $*" >&2; exit 1; }
log() { echo "datapath: $*" >&2; }
# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"

usage() {
    sed -n '2,/^$/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
    exit "${1:-0}"
}

posint() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer (got '$2')"; }

parse_args() {
    while (($#)); do
        case "$1" in
            --only) ONLY="${2:?--only needs a list}"; shift 2 ;;
            --only=*) ONLY="${1#*=}"; shift ;;
            --runs) RUNS="${2:?--runs needs N}"; shift 2 ;;
            --runs=*) RUNS="${1#*=}"; shift ;;
            --per-client-mib) PER_CLIENT_MIB="${2:?}"; shift 2 ;;
            --per-client-mib=*) PER_CLIENT_MIB="${1#*=}"; shift ;;
            --min-mib) MIN_MIB="${2:?}"; shift 2 ;;
            --min-mib=*) MIN_MIB="${1#*=}"; shift ;;
            --iters) ITERS="${2:?}"; shift 2 ;;
            --iters=*) ITERS="${1#*=}"; shift ;;
            --warmup) WARMUP="${2:?}"; shift 2 ;;
            --warmup=*) WARMUP="${1#*=}"; shift ;;
            --quick) QUICK=1; shift ;;
            --verify-all) VERIFY_ALL=1; shift ;;
            --no-transfer) DO_TRANSFER=0; shift ;;
            --no-latency) DO_LATENCY=0; shift ;;
            --no-same-cpu) DO_SAME=0; shift ;;
            -h|--help) usage 0 ;;
            *) echo "unknown argument: $1" >&2; usage 2 ;;
        esac
    done
    if ((QUICK)); then
        RUNS=1 SIZES="1 10" CLIENTS="1 10" MIN_MIB=50 ITERS=2000 WARMUP=200
    fi
    posint --runs "$RUNS"
    posint --per-client-mib "$PER_CLIENT_MIB"
    posint --min-mib "$MIN_MIB"
    posint --iters "$ITERS"
    [[ "$WARMUP" =~ ^[0-9]+$ ]] || die "--warmup must be a non-negative integer"
    posint TRANSFER_TIMEOUT "$TRANSFER_TIMEOUT"
    local m
    for m in ${ONLY//,/ }; do
        [[ ",$ALL_MODES," == *",$m,"* ]] || die "unknown mode '$m' (known: $ALL_MODES)"
    done
}

# ---------------------------------------------------------------- processes

# stop_pid PID: SIGTERM, SIGKILL after STOP_TIMEOUT; sets STOP_RC (exit status, or "timeout").
stop_pid() {
    local pid=$1
    STOP_RC=0
    if is_alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        if ! wait_gone "$pid" "$STOP_TIMEOUT"; then
            kill -KILL "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
            STOP_RC=timeout
            return 1
        fi
    fi
    wait "$pid" 2>/dev/null || STOP_RC=$?
}

# cleanup() (lib.sh) stops what OWN_PIDS lists and removes $WORK.

# start_tool NAME CPU ARGV... -> TOOL_PID, TOOL_PORT: a bench tool that prints its port first.
start_tool() {
    local name=$1 cpu=$2 out="$WORK/$1.out"
    shift 2
    taskset -c "$cpu" "$@" >"$out" 2>"$WORK/$name.err" </dev/null &
    TOOL_PID=$!
    OWN_PIDS+=("$TOOL_PID")
    local deadline=$((SECONDS + READY_TIMEOUT))
    TOOL_PORT=""
    until [[ -n "$TOOL_PORT" ]]; do
        TOOL_PORT=$(head -n1 "$out" 2>/dev/null | grep -E '^[0-9]+$' || true)
        [[ -n "$TOOL_PORT" ]] && break
        is_alive "$TOOL_PID" && ((SECONDS < deadline)) ||
            die "$name did not start: $(cat "$WORK/$name.err")"
        sleep 0.02
    done
}

SINK_PID=""
SINK_PORT=""
SINK_STARTS=0

# ensure_sink: (re)start the transfer sink on CPU 0 if it is not running.
ensure_sink() {
    [[ -n "$SINK_PID" ]] && is_alive "$SINK_PID" && return 0
    if [[ -n "$SINK_PID" ]]; then
        log "sink (pid $SINK_PID) died: $(tail -n3 "$WORK/sink$SINK_STARTS.err" | tr '\n' ' '); restarting"
    fi
    SINK_STARTS=$((SINK_STARTS + 1))
    start_tool "sink$SINK_STARTS" "$LOAD_CPU" "$BUILD/bench/transfer" sink \
        --listen 127.0.0.1:0 --seconds "$TOOL_LIFETIME"
    SINK_PID=$TOOL_PID SINK_PORT=$TOOL_PORT
}

# ---------------------------------------------------------------- relay

RELAY_PID=""
RELAY_PORT=""
RELAY_ERR=""

# start_relay MODE UPSTREAM_PORT CPU TAG; 1 with RELAY_ERR set if it did not come up.
start_relay() {
    local mode=$1 up=$2 cpu=$3 tag=$4
    local out="$WORK/relay.$tag.out" err="$WORK/relay.$tag.err"
    pick_port RELAY_PORT
    # taskset and stdbuf both exec, so $! is zcrelay itself. stdbuf: the "ready" line must reach
    # the file promptly even though stdout is not a tty.
    taskset -c "$cpu" stdbuf -oL "$BUILD/zcrelay" --listen "127.0.0.1:$RELAY_PORT" \
        --upstream "127.0.0.1:$up" --mode "$mode" --workers 1 --metrics off \
        >"$out" 2>"$err" </dev/null &
    RELAY_PID=$!
    OWN_PIDS+=("$RELAY_PID")
    local deadline=$((SECONDS + READY_TIMEOUT))
    until grep -q '^zcrelay: ready' "$out" 2>/dev/null; do
        if ! is_alive "$RELAY_PID" || ((SECONDS >= deadline)); then
            local why
            why=$(grep -v '^$' "$err" | tail -n3 | tr '\n' ' ' | sed 's/ *$//')
            [[ -n "$why" ]] || why=$(tail -n3 "$out" | tr '\n' ' ')
            is_alive "$RELAY_PID" && why="no 'zcrelay: ready' within ${READY_TIMEOUT}s; $why"
            stop_pid "$RELAY_PID" || true
            RELAY_ERR="${why:-exited without a message}"
            return 1
        fi
        sleep 0.02
    done
}

# stop_relay -> STOP_ERR: "" or why the relay's end makes the measurement a failure. Not in a
# subshell: only the shell that started the relay can wait for its exit status.
stop_relay() {
    STOP_ERR=""
    if ! is_alive "$RELAY_PID"; then
        wait "$RELAY_PID" 2>/dev/null && STOP_RC=0 || STOP_RC=$?
        STOP_ERR="relay died during the run (status $STOP_RC)"
    elif ! stop_pid "$RELAY_PID"; then
        STOP_ERR="relay did not exit within ${STOP_TIMEOUT}s of SIGTERM"
    elif [[ "$STOP_RC" != 0 ]]; then
        STOP_ERR="relay exited with status $STOP_RC after SIGTERM"
    fi
    return 0
}

# affinity PID: the distinct CPU lists of the process's threads, e.g. "1".
affinity() {
    local t out=()
    for t in /proc/"$1"/task/*; do
        out+=("$(taskset -pc "${t##*/}" 2>/dev/null | sed -E 's/.*: //')")
    done
    printf '%s\n' "${out[@]}" | sort -u | paste -sd' '
}

# ---------------------------------------------------------------- CPU accounting

# Builtins only (no fork): these run inside the measured window, and every process we start
# there is busy CPU that /proc/stat would count.

# sys_busy_ticks -> SYS_TICKS: user+nice+system+irq+softirq+steal over all CPUs.
sys_busy_ticks() {
    local _cpu user nice system idle iowait irq softirq steal _rest
    read -r _cpu user nice system idle iowait irq softirq steal _rest </proc/stat
    SYS_TICKS=$((user + nice + system + irq + softirq + steal))
}

# proc_ticks PID -> PROC_TICKS: utime+stime of the whole process (all threads); "" if gone.
proc_ticks() {
    local line
    PROC_TICKS=""
    read -r line <"/proc/$1/stat" 2>/dev/null || return 0
    line=${line##*) }   # after "comm) ": state is field 1, so utime/stime (14/15) are 12/13
    local -a f=($line)
    PROC_TICKS=$((f[11] + f[12]))
}

# ---------------------------------------------------------------- stats

# stats "v1 v2 ..." -> "median min max", or "" for no values.
stats() {
    [[ -n "${1// /}" ]] || { echo ""; return; }
    tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -g | awk '
        { v[NR] = $1 }
        END {
            m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
            printf "%s %s %s", m, v[1], v[NR]
        }'
}

# cell_fmt "v1 v2 ..." DECIMALS -> "median (min–max)", or "-".
cell_fmt() {
    local s med mn mx
    s=$(stats "$1")
    [[ -n "$s" ]] || { echo "-"; return; }
    read -r med mn mx <<<"$s"
    awk -v a="$med" -v b="$mn" -v c="$mx" -v d="$2" \
        'BEGIN { printf "%.*f (%.*f–%.*f)", d, a, d, b, d, c }'
}

median_of() { local s; s=$(stats "$1"); echo "${s%% *}"; }

# json_stats "v1 v2 ..." KEY -> "\"KEY\":med,\"KEY_min\":min,\"KEY_max\":max" (null if empty).
json_stats() {
    local s med=null mn=null mx=null
    s=$(stats "$1")
    [[ -z "$s" ]] || read -r med mn mx <<<"$s"
    printf '"%s":%s,"%s_min":%s,"%s_max":%s' "$2" "$med" "$2" "$mn" "$2" "$mx"
}

# json_field LINE KEY: the number after "KEY": in a flat JSON line.
json_field() { sed -nE "s/.*\"$2\":(-?[0-9.eE+-]+).*/\1/p" <<<"$1"; }

# ---------------------------------------------------------------- modes

declare -a MODES=()         # modes asked for
declare -A UNAVAILABLE=()   # mode -> why zcrelay did not accept it
declare -A FAILS=()         # mode -> failures so far
declare -A DROPPED=()       # mode -> 1 once MAX_FAILS reached
TOTAL_FAILS=0

# probe_modes: start each relay mode once; a mode zcrelay refuses is unavailable, not a failure.
probe_modes() {
    local m
    for m in "${MODES[@]}"; do
        [[ "$m" == direct ]] && continue
        if start_relay "$m" "$SINK_PORT" "$RELAY_CPU" "probe-$m"; then
            log "mode $m: available (threads on CPU $(affinity "$RELAY_PID"))"
            stop_relay
            [[ -z "$STOP_ERR" ]] || log "mode $m: probe instance: $STOP_ERR"
        else
            UNAVAILABLE[$m]=$RELAY_ERR
            log "mode $m: UNAVAILABLE: $RELAY_ERR"
        fi
    done
}

runnable() { [[ -z "${UNAVAILABLE[$1]:-}" && -z "${DROPPED[$1]:-}" ]]; }

note_failure() {
    local m=$1
    FAILS[$m]=$((${FAILS[$m]:-0} + 1))
    TOTAL_FAILS=$((TOTAL_FAILS + 1))
    if ((FAILS[$m] >= MAX_FAILS)) && [[ -z "${DROPPED[$m]:-}" ]]; then
        DROPPED[$m]=1
        log "mode $m: $MAX_FAILS failures, dropped for the rest of this run"
    fi
}

# ---------------------------------------------------------------- (a) transfer

# Cells are "conns:size_mib"; the 1-client cell of the concurrency matrix is the same
# measurement as a cell of the size matrix when the sizes agree, and then runs only once.
declare -a CELLS=()
declare -A T_MBPS=() T_RELAY=() T_SYS=() T_OTHER=() T_OK=() T_RUNS=() T_VERIFY=() T_ROUNDS=()

build_cells() {
    local s c cell
    declare -A seen=()
    for s in $SIZES; do
        cell="1:$s"; [[ -n "${seen[$cell]:-}" ]] || { CELLS+=("$cell"); seen[$cell]=1; }
    done
    for c in $CLIENTS; do
        cell="$c:$PER_CLIENT_MIB"; [[ -n "${seen[$cell]:-}" ]] || { CELLS+=("$cell"); seen[$cell]=1; }
    done
}

rounds_for() {
    local conns=$1 size=$2
    echo $(((MIN_MIB + conns * size - 1) / (conns * size)))
}

# transfer_once MODE CONNS SIZE ROUNDS VERIFY(0/1) TAG
#   -> RUN_LINE (client JSON), RUN_ERR, and the tick deltas D_RELAY, D_SYS, D_OTHER.
# The relay (for relay modes) is started for this measurement alone and stopped after it.
transfer_once() {
    local mode=$1 conns=$2 size=$3 rounds=$4 verify=$5 tag=$6 port
    RUN_LINE="" RUN_ERR="" D_RELAY="" D_SYS="" D_OTHER=""
    ensure_sink
    if [[ "$mode" == direct ]]; then
        port=$SINK_PORT
    else
        if ! start_relay "$mode" "$SINK_PORT" "$RELAY_CPU" "$tag"; then
            RUN_ERR="relay did not start: $RELAY_ERR"
            return 1
        fi
        port=$RELAY_PORT
    fi
    local -a vflag=()
    ((verify)) && vflag=(--verify)

    local o0 o1 s0 s1 r0="" r1="" rc=0
    others_ticks; o0=$OTHER_TICKS
    [[ "$mode" == direct ]] || { proc_ticks "$RELAY_PID"; r0=$PROC_TICKS; }
    sys_busy_ticks; s0=$SYS_TICKS
    # Bounded twice: the client fails what is left at its --timeout, `timeout` backs it up.
    RUN_LINE=$(timeout $((TRANSFER_TIMEOUT + 10)) taskset -c "$LOAD_CPU" "$BUILD/bench/transfer" \
        client --connect "127.0.0.1:$port" --conns "$conns" --size-mib "$size" \
        --rounds "$rounds" --timeout "$TRANSFER_TIMEOUT" "${vflag[@]}" \
        2>"$WORK/client.err") || rc=$?
    sys_busy_ticks; s1=$SYS_TICKS
    [[ "$mode" == direct ]] || { proc_ticks "$RELAY_PID"; r1=$PROC_TICKS; }
    others_ticks; o1=$OTHER_TICKS

    local errs=()
    if ((rc != 0)); then
        errs+=("client exit $rc: $(tr '\n' ' ' <"$WORK/client.err" | cut -c1-300)")
    fi
    [[ -n "$RUN_LINE" ]] || errs+=("no client output")
    if [[ "$mode" != direct ]]; then
        stop_relay
        [[ -z "$STOP_ERR" ]] || errs+=("$STOP_ERR")
    fi
    D_SYS=$((s1 - s0))
    D_OTHER=$((o1 - o0))
    [[ -z "$r0" || -z "$r1" ]] || D_RELAY=$((r1 - r0))
    RUN_ERR="${errs[*]:-}"
    [[ -z "$RUN_ERR" ]]
}

# per_gib TICKS BYTES -> CPU seconds per GiB
per_gib() {
    awk -v t="$1" -v b="$2" -v hz="$CLK_TCK" 'BEGIN { printf "%.3f", t / hz / (b / 1073741824) }'
}

cell_label() {
    local conns=${1%%:*} size=${1##*:}
    echo "$conns × $size MiB"
}

# verify_pass: each runnable mode sends every cell once (one round) with --verify. Untimed.
verify_pass() {
    local m cell conns size
    for m in "${MODES[@]}"; do
        [[ "$m" == direct ]] || runnable "$m" || continue
        for cell in "${CELLS[@]}"; do
            runnable "$m" || break
            conns=${cell%%:*} size=${cell##*:}
            if transfer_once "$m" "$conns" "$size" 1 1 "verify-$m-$conns-$size"; then
                local v
                v=$(json_field "$RUN_LINE" verified)
                if [[ "$v" == "$conns" ]]; then
                    T_VERIFY[$m/$cell]="ok"
                else
                    T_VERIFY[$m/$cell]="FAILED"
                    log "verify $m $(cell_label "$cell"): only $v of $conns connections verified"
                    note_failure "$m"
                fi
            else
                T_VERIFY[$m/$cell]="FAILED"
                log "verify $m $(cell_label "$cell"): FAILED ($RUN_ERR)"
                note_failure "$m"
            fi
        done
        log "verify pass $m: $(for c in "${CELLS[@]}"; do printf '%s=%s ' "$(cell_label "$c" | tr -d ' ')" "${T_VERIFY[$m/$c]:-skipped}"; done)"
    done
}

run_transfer() {
    local run cell m conns size rounds
    for cell in "${CELLS[@]}"; do
        for m in "${MODES[@]}"; do
            T_MBPS[$m/$cell]="" T_RELAY[$m/$cell]="" T_SYS[$m/$cell]="" T_OTHER[$m/$cell]=""
            T_OK[$m/$cell]=0 T_RUNS[$m/$cell]=0
        done
        T_ROUNDS[$cell]=$(rounds_for "${cell%%:*}" "${cell##*:}")
    done
    log "(a) transfer: verify pass (one round per cell, every byte checked)"
    verify_pass
    for ((run = 1; run <= RUNS; run++)); do
        log "(a) transfer: run $run of $RUNS"
        for cell in "${CELLS[@]}"; do
            conns=${cell%%:*} size=${cell##*:} rounds=${T_ROUNDS[$cell]}
            for m in "${MODES[@]}"; do
                runnable "$m" || continue
                T_RUNS[$m/$cell]=$((T_RUNS[$m/$cell] + 1))
                local tag="t$run-$m-$conns-$size" what
                what="run $run $m $(cell_label "$cell") x$rounds"
                if transfer_once "$m" "$conns" "$size" "$rounds" "$VERIFY_ALL" "$tag"; then
                    local bytes mbps relay="" sys other
                    bytes=$(json_field "$RUN_LINE" bytes)
                    mbps=$(json_field "$RUN_LINE" mb_per_s)
                    [[ -z "$D_RELAY" ]] || relay=$(per_gib "$D_RELAY" "$bytes")
                    sys=$(per_gib "$D_SYS" "$bytes")
                    other=$(per_gib "$D_OTHER" "$bytes")
                    T_OK[$m/$cell]=$((T_OK[$m/$cell] + 1))
                    T_MBPS[$m/$cell]+=" $mbps"
                    [[ -z "$relay" ]] || T_RELAY[$m/$cell]+=" $relay"
                    T_SYS[$m/$cell]+=" $sys"
                    T_OTHER[$m/$cell]+=" $other"
                    log "$what: $mbps MB/s, relay ${relay:--} s/GiB, system $sys s/GiB (other processes $other)"
                else
                    log "$what: FAILED ($RUN_ERR) [not counted]"
                    note_failure "$m"
                fi
            done
        done
    done
}

print_transfer_table() {
    local title=$1
    shift
    local cells=("$@") cell m
    echo
    echo "#### $title"
    echo
    echo "| conns × MiB/conn | mode | ok/runs | MB/s median (min–max) | vs direct | relay CPU s/GiB | system CPU s/GiB | other processes s/GiB | verified |"
    echo "|---|---|---|---|---|---|---|---|---|"
    for cell in "${cells[@]}"; do
        local dmed
        dmed=$(median_of "${T_MBPS[direct/$cell]:-}")
        for m in "${MODES[@]}"; do
            local label
            label="$(cell_label "$cell") (x${T_ROUNDS[$cell]})"
            if [[ -n "${UNAVAILABLE[$m]:-}" ]]; then
                echo "| $label | $m | unavailable | | | | | | |"
                continue
            fi
            local med ratio="-" relay="-"
            med=$(median_of "${T_MBPS[$m/$cell]}")
            if [[ -n "$med" && -n "$dmed" ]]; then
                ratio=$(awk -v a="$med" -v b="$dmed" 'BEGIN { printf "%.2f", a / b }')
            fi
            [[ "$m" == direct ]] || relay=$(cell_fmt "${T_RELAY[$m/$cell]}" 2)
            echo "| $label | $m | ${T_OK[$m/$cell]}/${T_RUNS[$m/$cell]} | $(cell_fmt "${T_MBPS[$m/$cell]}" 0) | $ratio | $relay | $(cell_fmt "${T_SYS[$m/$cell]}" 2) | $(cell_fmt "${T_OTHER[$m/$cell]}" 2) | ${T_VERIFY[$m/$cell]:-not run} |"
        done
    done
}

write_transfer_json() {
    local cell m stamp
    stamp=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    for cell in "${CELLS[@]}"; do
        for m in "${MODES[@]}"; do
            [[ -z "${UNAVAILABLE[$m]:-}" ]] || continue
            printf '{"bench":"datapath","time":"%s","workload":"transfer","mode":"%s","conns":%s,"size_mib":%s,"rounds":%s,"unit":"MB/s",%s,"runs":%s,"failures":%s,%s,%s,%s,"verified":"%s","verify_all":%s,"quick":%s}\n' \
                "$stamp" "$m" "${cell%%:*}" "${cell##*:}" "${T_ROUNDS[$cell]}" \
                "$(json_stats "${T_MBPS[$m/$cell]}" mb_per_s)" "${T_RUNS[$m/$cell]}" \
                "$((T_RUNS[$m/$cell] - T_OK[$m/$cell]))" \
                "$(json_stats "${T_RELAY[$m/$cell]}" relay_cpu_s_per_gib)" \
                "$(json_stats "${T_SYS[$m/$cell]}" system_cpu_s_per_gib)" \
                "$(json_stats "${T_OTHER[$m/$cell]}" other_cpu_s_per_gib)" \
                "${T_VERIFY[$m/$cell]:-not run}" "$VERIFY_ALL" "$QUICK" >>"$RESULTS"
        done
    done
}

# ---------------------------------------------------------------- (b) latency

declare -a PLACEMENTS=()
declare -A L_P50=() L_P99=() L_P999=() L_MAX=() L_OTHER=() L_OK=() L_RUNS=()

# placement_cpu PLACEMENT -> the CPU of the relay (or, for direct, of the echo server)
placement_cpu() { [[ "$1" == same ]] && echo "$LOAD_CPU" || echo "$RELAY_CPU"; }

# wanted MODE PLACEMENT: relays run "same" only with DO_SAME; direct runs both placements
# always, as they are cheap: "same" is the baseline, "xcpu" (echo server on the other CPU) shows
# what a cross-CPU wake-up costs here, a relay in "xcpu" paying it on every hop.
wanted() { [[ "$1" == direct || "$2" == xcpu ]] || ((DO_SAME)); }

# latency_once MODE PLACEMENT ECHO_PORT TAG -> RUN_LINE, RUN_ERR, OTHER_PCT (CPU of processes
# outside this benchmark during the run, in % of one CPU: a tail here may be theirs).
latency_once() {
    local mode=$1 pl=$2 echo_port=$3 tag=$4 port rc=0 o0 t0
    RUN_LINE="" RUN_ERR="" OTHER_PCT=""
    if [[ "$mode" == direct ]]; then
        port=$echo_port
    else
        if ! start_relay "$mode" "$echo_port" "$(placement_cpu "$pl")" "$tag"; then
            RUN_ERR="relay did not start: $RELAY_ERR"
            return 1
        fi
        port=$RELAY_PORT
    fi
    others_ticks; o0=$OTHER_TICKS
    t0=$EPOCHREALTIME
    # pingpong bounds every socket call (5 s); timeout bounds the whole run.
    RUN_LINE=$(timeout 120 taskset -c "$LOAD_CPU" "$BUILD/bench/pingpong" client \
        --connect "127.0.0.1:$port" --size "$MSG_SIZE" --iters "$ITERS" --warmup "$WARMUP" \
        2>"$WORK/pp.err") || rc=$?
    others_ticks
    OTHER_PCT=$(awk -v d=$((OTHER_TICKS - o0)) -v hz="$CLK_TCK" -v a="$t0" -v z="$EPOCHREALTIME" \
        'BEGIN { printf "%.1f", d / hz / (z - a) * 100 }')
    local errs=()
    ((rc == 0)) || errs+=("client exit $rc: $(tr '\n' ' ' <"$WORK/pp.err" | cut -c1-300)")
    if [[ "$mode" != direct ]]; then
        stop_relay
        [[ -z "$STOP_ERR" ]] || errs+=("$STOP_ERR")
    fi
    RUN_ERR="${errs[*]:-}"
    [[ -z "$RUN_ERR" ]]
}

run_latency() {
    PLACEMENTS=(xcpu same)
    local pl m run key
    for pl in "${PLACEMENTS[@]}"; do
        for m in "${MODES[@]}"; do
            key="$pl/$m"
            L_P50[$key]="" L_P99[$key]="" L_P999[$key]="" L_MAX[$key]="" L_OTHER[$key]=""
            L_OK[$key]=0 L_RUNS[$key]=0
        done
    done
    # Echo server on CPU 0 for everything; a second one on CPU 1 for direct's xcpu reference.
    declare -A echo_pid=() echo_port=()
    start_tool echo0 "$LOAD_CPU" "$BUILD/bench/pingpong" server --listen 127.0.0.1:0 \
        --size "$MSG_SIZE" --seconds "$TOOL_LIFETIME"
    echo_pid[same]=$TOOL_PID echo_port[same]=$TOOL_PORT
    echo_pid[xcpu]=$TOOL_PID echo_port[xcpu]=$TOOL_PORT
    if [[ " ${MODES[*]} " == *" direct "* ]]; then
        start_tool echo1 "$RELAY_CPU" "$BUILD/bench/pingpong" server --listen 127.0.0.1:0 \
            --size "$MSG_SIZE" --seconds "$TOOL_LIFETIME"
        echo_pid[direct-xcpu]=$TOOL_PID echo_port[direct-xcpu]=$TOOL_PORT
    fi
    for ((run = 1; run <= RUNS; run++)); do
        log "(b) latency: run $run of $RUNS"
        for pl in "${PLACEMENTS[@]}"; do
            for m in "${MODES[@]}"; do
                runnable "$m" && wanted "$m" "$pl" || continue
                local which=$pl
                [[ "$m/$pl" == direct/xcpu ]] && which=direct-xcpu
                is_alive "${echo_pid[$which]}" || die "pingpong server ($which) died"
                key="$pl/$m"
                L_RUNS[$key]=$((L_RUNS[$key] + 1))
                local what="run $run $m $pl"
                if latency_once "$m" "$pl" "${echo_port[$which]}" "l$run-$pl-$m"; then
                    L_OK[$key]=$((L_OK[$key] + 1))
                    L_P50[$key]+=" $(json_field "$RUN_LINE" p50_us)"
                    L_P99[$key]+=" $(json_field "$RUN_LINE" p99_us)"
                    L_P999[$key]+=" $(json_field "$RUN_LINE" p999_us)"
                    L_MAX[$key]+=" $(json_field "$RUN_LINE" max_us)"
                    L_OTHER[$key]+=" $OTHER_PCT"
                    log "$what: $RUN_LINE other processes ${OTHER_PCT}% of a CPU"
                else
                    log "$what: FAILED ($RUN_ERR) [not counted]"
                    note_failure "$m"
                fi
            done
        done
    done
    local p
    for p in $(printf '%s\n' "${echo_pid[@]}" | sort -u); do stop_pid "$p" || true; done
}

# placement_label MODE PLACEMENT
placement_label() {
    case "$1/$2" in
        direct/xcpu) echo "xcpu reference: no relay, server on CPU $RELAY_CPU" ;;
        direct/same) echo "baseline: no relay, client+server on CPU $LOAD_CPU" ;;
        */xcpu) echo "xcpu: relay on CPU $RELAY_CPU" ;;
        */same) echo "same: relay on CPU $LOAD_CPU too" ;;
    esac
}

print_latency_table() {
    local pl m key
    echo
    echo "#### Latency: ${MSG_SIZE} B ping-pong, $ITERS round trips after $WARMUP warm-up, µs, median (min–max) over runs"
    echo
    echo "Client and echo server on CPU $LOAD_CPU unless the placement says otherwise."
    echo
    echo "| placement | mode | ok/runs | p50 | p99 | p99.9 | max | other processes, % of a CPU |"
    echo "|---|---|---|---|---|---|---|---|"
    # Rows: the no-relay baseline and cross-CPU reference first, then the relays by placement.
    local rows=() row
    for pl in same xcpu; do [[ " ${MODES[*]} " != *" direct "* ]] || rows+=("direct/$pl"); done
    for pl in "${PLACEMENTS[@]}"; do
        for m in "${MODES[@]}"; do [[ "$m" == direct ]] || rows+=("$m/$pl"); done
    done
    for row in "${rows[@]}"; do
        m=${row%/*} pl=${row#*/}
        wanted "$m" "$pl" || continue
        key="$pl/$m"
        if [[ -n "${UNAVAILABLE[$m]:-}" ]]; then
            echo "| $(placement_label "$m" "$pl") | $m | unavailable | | | | | |"
            continue
        fi
        echo "| $(placement_label "$m" "$pl") | $m | ${L_OK[$key]}/${L_RUNS[$key]} | $(cell_fmt "${L_P50[$key]}" 1) | $(cell_fmt "${L_P99[$key]}" 1) | $(cell_fmt "${L_P999[$key]}" 1) | $(cell_fmt "${L_MAX[$key]}" 0) | $(cell_fmt "${L_OTHER[$key]}" 1) |"
    done
}

write_latency_json() {
    local pl m key stamp
    stamp=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    for pl in "${PLACEMENTS[@]}"; do
        for m in "${MODES[@]}"; do
            [[ -z "${UNAVAILABLE[$m]:-}" ]] && wanted "$m" "$pl" || continue
            key="$pl/$m"
            printf '{"bench":"datapath","time":"%s","workload":"pingpong","mode":"%s","placement":"%s","size":%s,"iters":%s,"warmup":%s,"unit":"us",%s,%s,%s,%s,%s,"runs":%s,"failures":%s,"quick":%s}\n' \
                "$stamp" "$m" "$pl" "$MSG_SIZE" \
                "$ITERS" "$WARMUP" \
                "$(json_stats "${L_P50[$key]}" p50_us)" "$(json_stats "${L_P99[$key]}" p99_us)" \
                "$(json_stats "${L_P999[$key]}" p999_us)" "$(json_stats "${L_MAX[$key]}" max_us)" \
                "$(json_stats "${L_OTHER[$key]}" other_cpu_pct)" \
                "${L_RUNS[$key]}" "$((L_RUNS[$key] - L_OK[$key]))" "$QUICK" >>"$RESULTS"
        done
    done
}

# ---------------------------------------------------------------- main

main() {
    parse_args "$@"
    MODES=(${ONLY//,/ })
    local t
    for t in taskset timeout ss stdbuf; do command -v "$t" >/dev/null || die "missing tool: $t"; done
    for t in "$BUILD/zcrelay" "$BUILD/bench/transfer" "$BUILD/bench/pingpong"; do
        [[ -x "$t" ]] || die "missing $t (build: cmake --build $BUILD --target zcrelay transfer pingpong; or set ZCRELAY_BUILD)"
    done
    (($(nproc) >= 2)) || die "needs 2 CPUs (relay on CPU $RELAY_CPU, load on CPU $LOAD_CPU)"

    WORK=$(mktemp -d /tmp/datapath.XXXXXX)
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM

    local started=$SECONDS load_before bg0 bg1 bg
    load_before=$(cut -d' ' -f1-3 /proc/loadavg)
    # How busy the machine is without us (another user's build, say): 2 s of /proc/stat.
    sys_busy_ticks; bg0=$SYS_TICKS
    sleep 2
    sys_busy_ticks; bg1=$SYS_TICKS
    bg=$(awk -v d=$((bg1 - bg0)) -v hz="$CLK_TCK" -v n="$(nproc)" \
        'BEGIN { printf "%.0f%%", d / hz / 2 / n * 100 }')
    log "background busy CPU before the run: $bg of $(nproc) CPUs; load average $load_before"
    # Which binary this is: the tree may be rebuilt while we run, and the numbers belong to one.
    local head dirty=""
    head=$(git -C "$SCRIPT_DIR" rev-parse --short HEAD 2>/dev/null || echo '?')
    [[ -z "$(git -C "$SCRIPT_DIR/.." status --porcelain -- proxy bpf 2>/dev/null)" ]] || dirty="+uncommitted"
    ZCRELAY_ID="$BUILD/zcrelay (sha256 $(sha256sum "$BUILD/zcrelay" | cut -c1-12), built $(date -r "$BUILD/zcrelay" +%H:%M), tree $head$dirty)"
    log "modes ${MODES[*]}, runs $RUNS; $ZCRELAY_ID; tools from $BUILD/bench"

    ensure_sink
    probe_modes
    if ((DO_TRANSFER)); then
        build_cells
        log "(a) cells (conns:MiB): ${CELLS[*]}; at least $MIN_MIB MiB per measurement"
        run_transfer
    fi
    ((DO_LATENCY)) && run_latency

    local sink_totals=""
    if [[ -n "$SINK_PID" ]]; then
        stop_pid "$SINK_PID" || true
        sink_totals=$(tail -n1 "$WORK/sink$SINK_STARTS.out")
        log "sink totals: $sink_totals"
        # The client already failed any run with a bad stream; this is a second witness.
        [[ "$(json_field "$sink_totals" bad)" == 0 ]] || log "sink saw bad streams: $(cat "$WORK/sink$SINK_STARTS.err")"
    fi

    mkdir -p "$(dirname "$RESULTS")"
    local m
    for m in "${MODES[@]}"; do
        [[ -n "${UNAVAILABLE[$m]:-}" ]] || continue
        printf '{"bench":"datapath","time":"%s","mode":"%s","available":false,"reason":"%s"}\n' \
            "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$m" "$(tr -d '"\\' <<<"${UNAVAILABLE[$m]}")" >>"$RESULTS"
    done

    echo
    echo "### Data paths: relay vs no relay ($HOST, kernel $(uname -r), $(date +%Y-%m-%d), $((SECONDS - started)) s)"
    echo
    echo "Background busy CPU before the run: $bg; load average before $load_before, after $(cut -d' ' -f1-3 /proc/loadavg)."
    echo "Relay: $ZCRELAY_ID, --workers 1 --metrics off. Client and sink/echo server on CPU $LOAD_CPU."
    for m in "${MODES[@]}"; do
        [[ -z "${UNAVAILABLE[$m]:-}" ]] || echo "**$m: unavailable** (zcrelay said: ${UNAVAILABLE[$m]})"
        [[ -z "${DROPPED[$m]:-}" ]] || echo "**$m: dropped after $MAX_FAILS failures**; its cells show what ran before that."
    done
    if ((DO_TRANSFER)); then
        local size_cells=() conc_cells=() s c
        for s in $SIZES; do size_cells+=("1:$s"); done
        for c in $CLIENTS; do conc_cells+=("$c:$PER_CLIENT_MIB"); done
        print_transfer_table "Transfer by size, one client (relay on CPU $RELAY_CPU)" "${size_cells[@]}"
        print_transfer_table "Transfer by concurrency, $PER_CLIENT_MIB MiB per client (relay on CPU $RELAY_CPU)" "${conc_cells[@]}"
        echo
        echo "MB/s = 10^6 B/s from the first connect to the last receipt; (xK) = rounds per measurement."
        echo "CPU columns are CPU-seconds per GiB moved: relay = the zcrelay process (all threads);"
        echo "system = all CPUs' busy time (/proc/stat), which includes the client and sink; other"
        echo "processes = the part of it spent by processes outside this benchmark (subtract it)."
        echo "sockmap: relay CPU is expected near zero, as the bytes move in softirq/kworker context;"
        echo "the system column is the comparable one. direct runs client and sink on one CPU."
        write_transfer_json
    fi
    if ((DO_LATENCY)); then
        print_latency_table
        write_latency_json
    fi
    echo
    echo "Failed measurements are reported on stderr and not counted. JSON lines: bench/results/$(basename "$RESULTS")"

    ((TOTAL_FAILS == 0)) || { log "$TOTAL_FAILS failed measurement(s)"; return 1; }
}

main "$@"
