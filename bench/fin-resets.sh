#!/usr/bin/env bash
# bench/fin-resets.sh: how many clean PostgreSQL sessions through the relay end in an RST, and
# how many FINs are sent twice (tail loss probes), with `pgbench -C` (a connection per
# transaction), per data path and per relay binary, interleaved.
#
# Usage: bench/fin-resets.sh [--binary LABEL=PATH]... [--modes splice,copy,sockmap]
#                            [--runs N] [--clients C] [--transactions T]
#   --binary        a zcrelay binary to measure, as LABEL=PATH (repeat to compare binaries;
#                   default: this tree's build/zcrelay as "this")
#   --modes         data paths (default splice,copy,sockmap)
#   --runs          runs per mode and binary (default 2); round r runs every binary once
#   --clients       pgbench -c (default 4); --transactions: pgbench -t per client (default 500)
#
# Why: a peer's FIN waits for its ACK while the relay waits for the other peer's FIN, and a
# peer with its last message and FIN unacknowledged sends the FIN again after about 9 ms; if
# that copy meets a socket already closed, it gets an RST (proxy/kernel.md, "A FIN is
# acknowledged late"). Counted from the kernel's own counters (TcpOutRsts, TCPLossProbes)
# inside a network namespace this script makes for itself, so nothing else on the host
# counts: the namespace holds PostgreSQL, the relay and pgbench, on its loopback only.
#
# Needs root (the namespace, PostgreSQL run as the postgres user), postgresql and pgbench
# (Debian's postgresql, installed by deploy/install-deps.sh). Bounded: pgbench runs C x T
# sessions under a 300 s timeout per run. Everything it starts is stopped by PID at exit, and
# its PostgreSQL data directory is removed.
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
die() { echo "bench/fin-resets.sh: $*" >&2; exit 1; }

BINARIES=() MODES="splice,copy,sockmap" RUNS=2 CLIENTS=4 TRANSACTIONS=500
while (($#)); do
    case "$1" in
        --binary) BINARIES+=("${2:?}"); shift 2 ;;
        --modes) MODES=${2:?}; shift 2 ;;
        --runs) RUNS=${2:?}; shift 2 ;;
        --clients) CLIENTS=${2:?}; shift 2 ;;
        --transactions) TRANSACTIONS=${2:?}; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
((${#BINARIES[@]})) || BINARIES=("this=$SCRIPT_DIR/../build/zcrelay")
for b in "${BINARIES[@]}"; do
    [[ "$b" == *=* && -x "${b#*=}" ]] || die "--binary '$b': not LABEL=PATH to an executable"
done
[[ "$RUNS" =~ ^[1-9][0-9]?$ && "$CLIENTS" =~ ^[1-9][0-9]?$ && "$TRANSACTIONS" =~ ^[1-9][0-9]{0,4}$ ]] ||
    die "--runs 1-99, --clients 1-99, --transactions 1-99999"
((EUID == 0)) || die "needs root (a network namespace, PostgreSQL as the postgres user)"
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
[[ -n "$PG_BIN" && -x "$PG_BIN/postgres" ]] || die "PostgreSQL is not installed (apt install postgresql)"
command -v pgbench >/dev/null || die "pgbench is not installed (postgresql-client)"
id postgres >/dev/null 2>&1 || die "no postgres user (apt install postgresql)"

# Everything else runs in a network namespace of its own: its counters are this run's alone.
if [[ "${FIN_RESETS_IN_NS:-}" != 1 ]]; then
    exec unshare -n env FIN_RESETS_IN_NS=1 "$0" \
        $(for b in "${BINARIES[@]}"; do printf -- '--binary %q ' "$b"; done) \
        --modes "$MODES" --runs "$RUNS" --clients "$CLIENTS" --transactions "$TRANSACTIONS"
fi
ip link set lo up

WORK=$(mktemp -d /tmp/zcrelay-fin-resets.XXXXXX)
chown postgres "$WORK"
PG_PORT=25432 RELAY_PORT=25433
RELAY_PID=""
cleanup() {
    [[ -n "$RELAY_PID" ]] && kill "$RELAY_PID" 2>/dev/null && wait "$RELAY_PID" 2>/dev/null
    [[ -f "$WORK/data/postmaster.pid" ]] &&
        runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$WORK/data" -m immediate stop >/dev/null 2>&1
    rm -rf "$WORK"
}
trap cleanup EXIT

runuser -u postgres -- "$PG_BIN/initdb" -D "$WORK/data" -A trust -U postgres >"$WORK/initdb.log" 2>&1 ||
    die "initdb failed: $(tail -n3 "$WORK/initdb.log")"
runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$WORK/data" -w -t 30 -l "$WORK/pg.log" \
    -o "-p $PG_PORT -k $WORK -c listen_addresses=127.0.0.1" start >/dev/null ||
    die "PostgreSQL did not start: $(tail -n3 "$WORK/pg.log")"
pgbench -h 127.0.0.1 -p "$PG_PORT" -U postgres -i -s 1 postgres >"$WORK/init.log" 2>&1 ||
    die "pgbench -i failed: $(tail -n3 "$WORK/init.log")"

counter() { nstat -az "$1" 2>/dev/null | awk -v n="$1" '$1 == n {print $2}'; }

echo "| round | mode | binary | sessions | failed | RSTs sent | FINs and segments sent again (loss probes) |"
echo "|---|---|---|---|---|---|---|"
IFS=, read -ra modes <<<"$MODES"
for ((r = 1; r <= RUNS; r++)); do
    for mode in "${modes[@]}"; do
        for b in "${BINARIES[@]}"; do
            label=${b%%=*} bin=${b#*=}
            "$bin" --listen "127.0.0.1:$RELAY_PORT" --upstream "127.0.0.1:$PG_PORT" --mode "$mode" \
                --workers 1 --metrics off >"$WORK/relay.log" 2>&1 &
            RELAY_PID=$!
            for _ in $(seq 100); do grep -q 'zcrelay: ready' "$WORK/relay.log" && break; sleep 0.05; done
            grep -q 'zcrelay: ready' "$WORK/relay.log" || die "$label did not start: $(tail -n3 "$WORK/relay.log")"
            rst0=$(counter TcpOutRsts) tlp0=$(counter TcpExtTCPLossProbes)
            out=$(timeout 300 pgbench -h 127.0.0.1 -p "$RELAY_PORT" -U postgres -C -S \
                -c "$CLIENTS" -j 2 -t "$TRANSACTIONS" postgres 2>&1) || true
            rst1=$(counter TcpOutRsts) tlp1=$(counter TcpExtTCPLossProbes)
            kill "$RELAY_PID"; wait "$RELAY_PID" 2>/dev/null || true
            RELAY_PID=""
            failed=$(sed -nE 's/^number of failed transactions: ([0-9]+).*/\1/p' <<<"$out")
            done_n=$(sed -nE 's/^number of transactions actually processed: ([0-9]+).*/\1/p' <<<"$out")
            echo "| $r | $mode | $label | ${done_n:-?} | ${failed:-?} | $((rst1 - rst0)) | $((tlp1 - tlp0)) |"
        done
    done
done
