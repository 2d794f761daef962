#!/usr/bin/env bash
# bench/profile.sh: where the CPU goes while one relay carries one bench/run workload, so that
# a ratio in bench/run's report can be explained rather than only quoted.
#
# Usage: bench/profile.sh [--relay NAME (zcrelay-splice)] [--workload bulk|pingpong|conn (bulk)]
#                         [--seconds N (6)] [--out FILE (perf.data in the scratch dir)]
#
# The same placement as bench/run: the relay on RELAY_CPU (1), the load and its upstream on
# LOAD_CPU (0). bulk is `transfer` with 100 clients x 10 MiB, pingpong 100 connections x 64 B,
# conn bench/run's connrate (`conn_rate`, 50 in flight: connect, 64 B echoed, close, against
# `echo_server`); all are sized to outlast the sampling window. `perf record -a -e cpu-clock` samples both CPUs
# for --seconds while the load runs (cpu-clock, because a VM usually offers no hardware
# counters: `perf stat -e cycles true` says "not supported").
#
# Output (stdout): the load's own result line, the relay's CPU seconds and I/O system calls
# over the load (per MB moved, or per relayed message), the share of samples per CPU and
# command, and the relay's heaviest call chains (children included, so a syscall's share holds
# everything under it).
#
# Reading it in a VM: without a PMU the sampling timer cannot interrupt code that runs with
# interrupts off, so the time spent there lands on the instruction that turns them back on:
# `_raw_spin_unlock_irqrestore` under handle_softirqs is network softirq work, and under
# sock_def_readable / try_to_wake_up it is waking a task on the other CPU (an IPI, which
# exits to the hypervisor).
#
# Every process it starts is stopped by PID; all traffic is on 127.0.0.1; the load is bounded
# by its round count and a timeout.
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BENCH="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}/bench"
RELAY_CPU="${RELAY_CPU:-1}"
LOAD_CPU="${LOAD_CPU:-0}"
PORT_BASE="${PORT_BASE:-24000}"
NEXT_PORT=$PORT_BASE
RELAY=zcrelay-splice
WORKLOAD=bulk
SECONDS_SAMPLED=6
OUT=""
KEEP=0
WORK=""
OWN_PIDS=()

die() { echo "bench/profile.sh: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"
# shellcheck source=relays.sh
source "$SCRIPT_DIR/relays.sh"

while (($#)); do
    case "$1" in
        --relay) RELAY=${2:?--relay needs a name}; shift ;;
        --workload) WORKLOAD=${2:?--workload needs bulk, pingpong or conn}; shift ;;
        --seconds) SECONDS_SAMPLED=${2:?--seconds needs a number}; shift ;;
        --out) OUT=${2:?--out needs a file}; KEEP=1; shift ;;
        -h|--help) usage 0 ;;
        *) echo "bench/profile.sh: unknown argument '$1'" >&2; usage 2 ;;
    esac
    shift
done
relay_names | grep -qx "$RELAY" || die "unknown relay '$RELAY' (bench/run --list)"
[[ "$RELAY" != direct ]] || die "direct has no relay process to profile"
[[ "$WORKLOAD" =~ ^(bulk|pingpong|conn)$ ]] || die "unknown workload '$WORKLOAD'"
[[ "$SECONDS_SAMPLED" =~ ^[0-9]+$ ]] && ((SECONDS_SAMPLED >= 1 && SECONDS_SAMPLED <= 60)) ||
    die "--seconds must be 1..60"
command -v perf >/dev/null || die "perf missing (deploy/install-deps.sh installs linux-perf)"

stop_all() { stop_relay; cleanup; }
trap stop_all EXIT
WORK=$(mktemp -d /dev/shm/zcprofile.XXXXXX)
OUT=${OUT:-$WORK/perf.data}

# The upstream: the bench tool prints its port on its first line.
if [[ "$WORKLOAD" == bulk ]]; then
    server=("$BENCH/transfer" sink --listen 127.0.0.1:0)
    # 100 x 10 MiB a round at ~1.3 GB/s is ~0.8 s: enough rounds to outlast the window.
    load=("$BENCH/transfer" client --conns 100 --size-mib 10 --rounds $((SECONDS_SAMPLED * 2 + 4)) --verify)
elif [[ "$WORKLOAD" == conn ]]; then
    server=("$BENCH/echo_server" --port 0 --seconds 600)
    load=("$BENCH/conn_rate" --conns 50 --seconds $((SECONDS_SAMPLED + 3)))
else
    server=("$BENCH/pingpong" server --listen 127.0.0.1:0)
    # 100 connections at ~70,000 round trips/s in all: ~700 per connection per second.
    load=("$BENCH/pingpong" client --conns 100 --warmup 200 --iters $((SECONDS_SAMPLED * 1000 + 2000)))
fi
taskset -c "$LOAD_CPU" "${server[@]}" >"$WORK/server.out" 2>"$WORK/server.err" </dev/null &
OWN_PIDS+=($!)
deadline=$((SECONDS + 10))
until port=$(head -n1 "$WORK/server.out" 2>/dev/null | grep -E '^[0-9]+$'); do
    ((SECONDS < deadline)) || die "upstream did not start: $(cat "$WORK/server.err")"
    sleep 0.05
done
start_relay "$RELAY" "$port" "$RELAY_CPU" "$WORK" || die "$RELAY did not start: $RELAY_ERR"

echo "# $RELAY, $WORKLOAD; relay on CPU $RELAY_CPU, load on CPU $LOAD_CPU; $(uname -r)"
# The relay's I/O system calls over the whole load (tracepoints, which a VM does have), to set
# against what the load moved: how much each call carries.
syscalls=splice,io_uring_enter,epoll_wait,recvfrom,sendto,read,write,readv,writev,socket,setsockopt,shutdown,accept4,close
perf stat -x, -e "$(sed -E 's/([a-z_]+)/syscalls:sys_enter_\1/g' <<<"$syscalls")" \
    -p "$(relay_pids | paste -sd, -)" -o "$WORK/syscalls.csv" 2>"$WORK/stat.err" &
stat_pid=$!
OWN_PIDS+=("$stat_pid")
relay_cpu_ticks >/dev/null
t0=$RELAY_CPU_TICKS
if [[ "$WORKLOAD" == conn ]]; then load+=(--port "$RELAY_PORT"); else load+=(--connect "127.0.0.1:$RELAY_PORT"); fi
taskset -c "$LOAD_CPU" timeout 120 "${load[@]}" \
    >"$WORK/load.out" 2>"$WORK/load.err" &
load_pid=$!
OWN_PIDS+=("$load_pid")
sleep 1   # past connection set-up and warm-up
perf record -a -g -e cpu-clock -F 999 -o "$OUT" -- sleep "$SECONDS_SAMPLED" >/dev/null 2>"$WORK/perf.err" ||
    die "perf record failed: $(tail -n2 "$WORK/perf.err")"
wait "$load_pid" || die "the load failed: $(tail -n2 "$WORK/load.err")"
relay_cpu_ticks >/dev/null
kill -INT "$stat_pid" 2>/dev/null || true
wait "$stat_pid" 2>/dev/null || true
echo "load: $(cat "$WORK/load.out")"
awk -v a="$t0" -v b="$RELAY_CPU_TICKS" -v hz="$(getconf CLK_TCK)" \
    'BEGIN {printf "relay CPU over the whole load: %.2f s\n", (b - a) / hz}'
# Per unit of work: bulk per MB moved, ping-pong per relayed message (a request or a reply),
# conn per connection.
if [[ "$WORKLOAD" == bulk ]]; then
    units=$(sed -nE 's/.*"bytes":([0-9]+).*/\1/p' "$WORK/load.out" | awk '{print $1 / 1e6}') unit=MB
elif [[ "$WORKLOAD" == conn ]]; then
    units=$(sed -nE 's/.*"completed":([0-9]+).*/\1/p' "$WORK/load.out") unit=connection
else
    units=$(sed -nE 's/.*"conns":([0-9]+),"iters":([0-9]+).*/\1 \2/p' "$WORK/load.out" |
        awk -v w=200 '{print $1 * ($2 + w) * 2}') unit=message
fi
echo "relay system calls over the whole load, per $unit:"
awk -F, -v n="$units" -v unit="$unit" '$3 ~ /^syscalls:sys_enter_/ && $1 + 0 > 0 {
        sub(/^syscalls:sys_enter_/, "", $3)
        printf "  %-15s %10d  %.3f per %s\n", $3, $1, $1 / n, unit }' "$WORK/syscalls.csv"

comm=$(ps -o comm= -p "$RELAY_PID")
echo
echo "## samples per CPU and command (idle is not sampled)"
perf report -i "$OUT" --no-children --sort cpu,comm -g none --percent-limit 0.5 2>/dev/null |
    grep -v '^#' | sed '/^$/d'
echo
echo "## $comm: heaviest symbols, children included"
perf report -i "$OUT" --children --comm "$comm" --sort sym -g none --percent-limit 3 2>/dev/null |
    grep -v '^#' | sed '/^$/d' | head -n 30
((KEEP)) && echo && echo "perf data: $OUT (perf report -i $OUT)"
exit 0
