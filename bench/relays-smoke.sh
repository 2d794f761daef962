#!/usr/bin/env bash
# relays-smoke.sh: every relay bench/relays.sh knows starts, relays a half-closed exchange, and
# stops. It proves the relay set before a benchmark relies on it, and shows the half-close row.
#
# Per relay: a fresh `halfclose server` upstream (build/bench/halfclose), the relay in front of
# it, one `halfclose client` through it (send 1 MiB, shutdown(SHUT_WR), the upstream replies
# 1 MiB after EOF, the client checks count and pattern), then the relay and the server are
# stopped by PID. The table gives pass/FAIL with the client's reason, what the upstream saw, how
# the relay ended on SIGTERM, the CPU its processes were pinned to, and its peak RSS.
#
# Expected: nginx (defaults, proxy_half_close off) FAILs the half-close, which is nginx's known
# behaviour and reported as such; every other relay passes. The script exits 0 when every row is
# as expected, 1 otherwise (a relay that would not start, stop or relay, or an nginx that
# suddenly passes).
#
# Placement: relay on CPU 1, client on CPU 0, upstream on CPU 0; for direct the upstream sits on
# CPU 1, where a relay would be. Loopback only. Every wait is bounded and the whole run stays
# under 2 minutes: after TIME_BUDGET seconds the remaining relays are skipped and reported so.
#
# Usage: bench/relays-smoke.sh [--only NAME,...]
# Environment: ZCRELAY_BUILD (<repo>/build; halfclose in $ZCRELAY_BUILD/bench), PORT_BASE (21000).

set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}"
PORT_BASE="${PORT_BASE:-21000}"
NEXT_PORT="$PORT_BASE"

readonly LOAD_CPU=0
readonly RELAY_CPU=1
readonly STEP_TIMEOUT=5    # s: the client's whole exchange, a server's start
readonly TIME_BUDGET=75    # s: no relay is started after this (worst case per relay ~40 s)
# relays.sh's own bounds, shorter than its defaults: a relay that needs more is broken here.
export RELAY_READY_TIMEOUT=5 RELAY_STOP_TIMEOUT=5

WORK=""
declare -a OWN_PIDS=()

die() { echo "relays-smoke: $*" >&2; exit 1; }
log() { echo "relays-smoke: $*" >&2; }
# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"
# shellcheck source=relays.sh
source "$SCRIPT_DIR/relays.sh"

usage() {
    sed -n '2,/^$/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
    exit "${1:-0}"
}

ONLY="$(relay_names | paste -sd,)"
while (($#)); do
    case "$1" in
        --only) ONLY="${2:?--only needs a list}"; shift 2 ;;
        --only=*) ONLY="${1#*=}"; shift ;;
        -h|--help) usage 0 ;;
        *) echo "unknown argument: $1" >&2; usage 2 ;;
    esac
done
for r in ${ONLY//,/ }; do
    relay_names | grep -qx -- "$r" || die "unknown relay '$r' (known: $(relay_names | paste -sd' '))"
done

json_str() { sed -nE "s/.*\"$2\":\"([^\"]*)\".*/\1/p" <<<"$1"; }
json_val() { sed -nE "s/.*\"$2\":([^,}\"]*).*/\1/p" <<<"$1"; }

# stop_pid PID: SIGTERM, bounded wait, SIGKILL; for the upstream servers.
stop_pid() {
    local pid=$1
    is_alive "$pid" && kill -TERM "$pid" 2>/dev/null || true
    wait_gone "$pid" 3 || kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

# start_server CPU TAG -> SERVER_PID, SERVER_PORT, SERVER_OUT; 1 if it did not come up.
start_server() {
    local cpu=$1 tag=$2
    SERVER_OUT="$WORK/server-$tag.out"
    # --seconds: a server we somehow lose track of exits on its own.
    taskset -c "$cpu" "$BUILD/bench/halfclose" server --listen 127.0.0.1:0 \
        --timeout "$STEP_TIMEOUT" --seconds 120 >"$SERVER_OUT" 2>"$WORK/server-$tag.err" </dev/null &
    SERVER_PID=$!
    OWN_PIDS+=("$SERVER_PID")
    SERVER_PORT=""
    local deadline=$((SECONDS + STEP_TIMEOUT))
    until [[ -n "$SERVER_PORT" ]]; do
        SERVER_PORT=$(head -n1 "$SERVER_OUT" 2>/dev/null | grep -E '^[0-9]+$' || true)
        [[ -n "$SERVER_PORT" ]] && break
        is_alive "$SERVER_PID" && ((SECONDS < deadline)) || return 1
        sleep 0.02
    done
}

# tree_cpus: the distinct CPU lists the relay's processes are allowed on, e.g. "1".
tree_cpus() {
    local p out=()
    for p in $(relay_pids); do
        out+=("$(taskset -pc "$p" 2>/dev/null | sed -E 's/.*: //')")
    done
    printf '%s\n' "${out[@]}" | sort -u | paste -sd' '
}

declare -A RESULT=() REASON=() UPSTREAM=() STOPPED=() CPUS=() RSS=() VERDICT=() MS=()
BAD=0

# smoke_one NAME: fills the row for NAME.
smoke_one() {
    local name=$1 expect=pass
    [[ "$name" == nginx ]] && expect=FAIL
    RESULT[$name]="-" REASON[$name]="" UPSTREAM[$name]="-" STOPPED[$name]="-" CPUS[$name]="-"
    RSS[$name]="-" MS[$name]="-"

    local server_cpu=$LOAD_CPU stop_err=""
    [[ "$name" == direct ]] && server_cpu=$RELAY_CPU
    if ! start_server "$server_cpu" "$name"; then
        RESULT[$name]=error REASON[$name]="halfclose server did not start: $(tr '\n' ' ' <"$WORK/server-$name.err")"
        VERDICT[$name]=UNEXPECTED
        stop_pid "$SERVER_PID"
        return
    fi

    if ! start_relay "$name" "$SERVER_PORT" "$RELAY_CPU" "$WORK"; then
        RESULT[$name]="no start" REASON[$name]=$RELAY_ERR VERDICT[$name]=UNEXPECTED
        stop_pid "$SERVER_PID"
        return
    fi
    [[ -z "$RELAY_PID" ]] || CPUS[$name]=$(tree_cpus)
    log "$name: ${RELAY_CMD}${RELAY_PID:+ (pid $RELAY_PID)}"

    local line rc=0
    line=$(timeout $((STEP_TIMEOUT + 10)) taskset -c "$LOAD_CPU" "$BUILD/bench/halfclose" client \
        --connect "127.0.0.1:$RELAY_PORT" --size-mib 1 --timeout "$STEP_TIMEOUT" \
        2>"$WORK/client-$name.err") || rc=$?
    if [[ -n "$RELAY_PID" ]]; then
        RSS[$name]=$(relay_peak_rss_kib)
        stop_relay
        STOPPED[$name]="status $RELAY_RC"
        [[ -z "$RELAY_STOP_NOTE" ]] || STOPPED[$name]+=" ($RELAY_STOP_NOTE)"
        stop_err=$RELAY_STOP_ERR
        [[ -z "$stop_err" ]] || STOPPED[$name]+=" **$stop_err**"
    fi
    stop_pid "$SERVER_PID"
    log "$name: client: ${line:-no output, exit $rc: $(tr '\n' ' ' <"$WORK/client-$name.err")}"

    # What the upstream saw tells "request never arrived" from "reply dropped".
    local conn
    conn=$(sed -n 2p "$SERVER_OUT")
    if [[ -n "$conn" ]]; then
        UPSTREAM[$name]="got $(json_val "$conn" received) B, replied $(json_val "$conn" replied) B"
        local err
        err=$(json_str "$conn" error)
        [[ -z "$err" ]] || UPSTREAM[$name]+=" ($err)"
        (($(wc -l <"$SERVER_OUT") <= 2)) || UPSTREAM[$name]+="; $(($(wc -l <"$SERVER_OUT") - 1)) connections"
    else
        UPSTREAM[$name]="no connection finished"
    fi

    if [[ "$(json_val "$line" pass)" == true && $rc == 0 ]]; then
        RESULT[$name]=pass
    elif [[ "$(json_val "$line" pass)" == false ]]; then
        RESULT[$name]=FAIL
        REASON[$name]="$(json_str "$line" reason) (received $(json_val "$line" received) B)"
    else
        RESULT[$name]=error
        REASON[$name]="client exit $rc, no verdict: $(tr '\n' ' ' <"$WORK/client-$name.err" | cut -c1-200)"
    fi
    MS[$name]=$(json_val "$line" ms)
    [[ -n "${MS[$name]}" ]] || MS[$name]="-"

    VERDICT[$name]="as expected"
    [[ "${RESULT[$name]}" == "$expect" ]] || VERDICT[$name]=UNEXPECTED
    [[ -z "$stop_err" ]] || VERDICT[$name]=UNEXPECTED
    if [[ "$name" == nginx && "${RESULT[$name]}" == FAIL ]]; then
        VERDICT[$name]+=" (proxy_half_close off: nginx's known behaviour)"
    fi
}

main() {
    local t
    for t in taskset ss timeout; do command -v "$t" >/dev/null || die "missing tool: $t"; done
    [[ -x "$BUILD/bench/halfclose" ]] ||
        die "missing $BUILD/bench/halfclose (cmake --build $BUILD --target halfclose; or set ZCRELAY_BUILD)"
    (($(nproc) >= 2)) || die "needs 2 CPUs (relay on CPU $RELAY_CPU, load on CPU $LOAD_CPU)"

    WORK=$(mktemp -d /tmp/relays-smoke.XXXXXX)
    # stop_relay first: it also stops what the relay forked, which OWN_PIDS does not list.
    trap 'stop_relay >/dev/null 2>&1 || true; cleanup' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM

    local relays=(${ONLY//,/ }) name started=$SECONDS
    log "relay on CPU $RELAY_CPU, client and upstream on CPU $LOAD_CPU (direct: upstream on CPU $RELAY_CPU)"
    for name in "${relays[@]}"; do
        if ((SECONDS - started > TIME_BUDGET)); then
            RESULT[$name]=skipped REASON[$name]="time budget (${TIME_BUDGET}s) used up"
            UPSTREAM[$name]="-" STOPPED[$name]="-" CPUS[$name]="-" RSS[$name]="-" MS[$name]="-"
            VERDICT[$name]=UNEXPECTED
            continue
        fi
        smoke_one "$name"
    done

    echo
    echo "### Relays smoke: half-close through every relay ($(hostname -s), kernel $(uname -r), $(date '+%Y-%m-%d %H:%M'), $((SECONDS - started)) s)"
    echo
    echo "Client sends 1 MiB, shutdown(SHUT_WR), the upstream replies 1 MiB after EOF. Relay on CPU $RELAY_CPU; client and upstream on CPU $LOAD_CPU."
    echo
    echo "| relay | version | half-close | client's reason | ms | upstream saw | relay CPUs | peak RSS KiB | on SIGTERM | verdict |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    for name in "${relays[@]}"; do
        [[ "${VERDICT[$name]}" == "as expected"* ]] || BAD=$((BAD + 1))
        echo "| $name | $(relay_version "$name" 2>/dev/null || echo '?') | ${RESULT[$name]} | ${REASON[$name]//|/\\|} | ${MS[$name]} | ${UPSTREAM[$name]} | ${CPUS[$name]} | ${RSS[$name]} | ${STOPPED[$name]} | ${VERDICT[$name]} |"
    done
    echo
    ((BAD == 0)) || { log "$BAD relay(s) not as expected"; return 1; }
}

main
