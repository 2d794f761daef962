#!/usr/bin/env bash
# bench/costs.sh: what one relayed connection and one relayed message cost the relay, counted
# rather than timed: system calls, io_uring submissions (SQEs, by opcode) and completions (CQEs),
# polls io_uring armed for itself, task-work runs, socket receive and send calls (whether a
# system call or io_uring made them) and context switches of the relay's threads.
# Counts do not drift with a busy machine, so they show what a change saves where a timed A/B on
# a shared 2-CPU machine is lost in noise.
#
# Usage: bench/costs.sh [--relay NAME (zcrelay-copy)] [--workload conn|pingpong (conn)]
#                       [--count N]
#   --relay   any relay of bench/run but direct and socat (a process per connection); for
#             HAProxy and nginx the system calls, socket calls and context switches compare,
#             the io_uring rows are zcrelay's alone
#   conn      conn_rate --conns 50 --max-count N (default 20000): connect, 64 B, echo, close
#   pingpong  pingpong --conns 100, N round trips each (default 3000), no warm-up: per relayed
#             message (a request or a reply, so two per round trip)
#
# Placement as bench/run: the relay on RELAY_CPU (1), the load and its upstream on LOAD_CPU (0);
# unpinned as bench/run too (RELAY_CPU=0,1 LOAD_CPU=0,1 RELAY_THREADS=2).
# The counters are the kernel's tracepoints (syscalls:sys_enter_*, io_uring:*, sched:sched_switch)
# on the relay's process only, from just before the load starts to just after it ends; the
# relay's start-up and the per-connection set-up of pingpong's 100 connections are a few hundred
# events among hundreds of thousands. Output: a Markdown table on stdout, each count in total and
# per unit (connection or message). Every process it starts is stopped by PID; all traffic is on
# 127.0.0.1; the load is bounded by its count and a timeout.
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BENCH="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}/bench"
RELAY_CPU="${RELAY_CPU:-1}"
LOAD_CPU="${LOAD_CPU:-0}"
PORT_BASE="${PORT_BASE:-26000}"
NEXT_PORT=$PORT_BASE
RELAY=zcrelay-copy
WORKLOAD=conn
COUNT=""
WORK=""
OWN_PIDS=()

die() { echo "bench/costs.sh: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"
# shellcheck source=relays.sh
source "$SCRIPT_DIR/relays.sh"

while (($#)); do
    case "$1" in
        --relay) RELAY=${2:?--relay needs a name}; shift ;;
        --workload) WORKLOAD=${2:?--workload needs conn or pingpong}; shift ;;
        --count) COUNT=${2:?--count needs a number}; shift ;;
        -h|--help) usage 0 ;;
        *) echo "bench/costs.sh: unknown argument '$1'" >&2; usage 2 ;;
    esac
    shift
done
[[ "$RELAY" != direct && "$RELAY" != socat ]] ||
    die "$RELAY: no relay process to count, or one per connection"
relay_names | grep -qx "$RELAY" || die "unknown relay '$RELAY' (bench/run --list)"
case "$WORKLOAD" in
    conn) COUNT=${COUNT:-20000} ;;
    pingpong) COUNT=${COUNT:-3000} ;;
    *) die "unknown workload '$WORKLOAD'" ;;
esac
[[ "$COUNT" =~ ^[0-9]+$ ]] && ((COUNT >= 100 && COUNT <= 1000000)) || die "--count must be 100..1000000"
command -v perf >/dev/null || die "perf missing (deploy/install-deps.sh installs linux-perf)"

stop_all() { stop_relay; cleanup; }
trap stop_all EXIT
WORK=$(mktemp -d /dev/shm/zccosts.XXXXXX)

if [[ "$WORKLOAD" == conn ]]; then
    start_port_server port echo "$BENCH/echo_server" --port 0 --seconds 600
    load=("$BENCH/conn_rate" --conns 50 --seconds 120 --max-count "$COUNT")
    units=$COUNT unit=connection
else
    start_port_server port pingpong "$BENCH/pingpong" server --listen 127.0.0.1:0
    load=("$BENCH/pingpong" client --conns 100 --iters "$COUNT" --warmup 0)
    units=$((100 * COUNT * 2)) unit=message
fi
start_relay "$RELAY" "$port" "$RELAY_CPU" "$WORK" || die "$RELAY did not start: $RELAY_ERR"
if [[ "$WORKLOAD" == conn ]]; then
    load+=(--port "$RELAY_PORT")
else
    load+=(--connect "127.0.0.1:$RELAY_PORT")
fi

events=syscalls:sys_enter_*,io_uring:io_uring_complete,io_uring:io_uring_poll_arm
events+=,io_uring:io_uring_local_work_run,io_uring:io_uring_task_work_run
events+=,io_uring:io_uring_queue_async_work,sched:sched_switch,sock:sock_recv_length,sock:sock_send_length
pids=$(relay_pids | paste -sd, -)
perf stat -x, -e "$events" -p "$pids" -o "$WORK/stat.csv" 2>"$WORK/stat.err" &
stat_pid=$!
OWN_PIDS+=("$stat_pid")
perf record -q -e io_uring:io_uring_submit_req -p "$pids" -o "$WORK/sqe.data" \
    >/dev/null 2>"$WORK/record.err" &
record_pid=$!
OWN_PIDS+=("$record_pid")
sleep 0.5   # both attached
taskset -c "$LOAD_CPU" timeout 300 "${load[@]}" >"$WORK/load.out" 2>"$WORK/load.err" ||
    die "the load failed: $(tail -n2 "$WORK/load.err")"
sleep 0.2   # the last closes
kill -INT "$stat_pid" "$record_pid" 2>/dev/null || true
wait "$stat_pid" "$record_pid" 2>/dev/null || true

echo "### $RELAY, $WORKLOAD: per $unit ($units ${unit}s)"
echo
echo "$(uname -r); relay on CPU $RELAY_CPU, load on CPU $LOAD_CPU. Load: $(tail -n1 "$WORK/load.out")"
echo
echo "| what | total | per $unit |"
echo "|---|---|---|"
awk -F, -v n="$units" '$1 ~ /^[0-9]+$/ && $1 + 0 > 0 {
        name = $3
        sub(/^syscalls:sys_enter_/, "syscall ", name)
        sub(/^io_uring:io_uring_complete$/, "CQEs", name)
        sub(/^io_uring:io_uring_poll_arm$/, "polls io_uring armed itself", name)
        sub(/^io_uring:io_uring_local_work_run$/, "task-work runs (DEFER_TASKRUN)", name)
        sub(/^io_uring:io_uring_task_work_run$/, "task-work runs", name)
        sub(/^io_uring:io_uring_queue_async_work$/, "requests punted to io-wq", name)
        sub(/^sched:sched_switch$/, "context switches", name)
        sub(/^sock:sock_recv_length$/, "socket receive calls (recvmsg, any caller)", name)
        sub(/^sock:sock_send_length$/, "socket send calls (sendmsg, any caller)", name)
        printf "| %s | %d | %.3f |\n", name, $1, $1 / n }' "$WORK/stat.csv"
perf script -i "$WORK/sqe.data" -F trace 2>/dev/null | grep -o 'opcode [A-Z_]*' |
    sort | uniq -c | sort -rn |
    awk -v n="$units" '{ total += $1; printf "| SQE %s | %d | %.3f |\n", $3, $1, $1 / n }
        END { printf "| SQEs in all | %d | %.3f |\n", total, total / n }'
exit 0
