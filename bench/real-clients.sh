#!/usr/bin/env bash
# bench/real-clients.sh: how much of a real client's traffic moves through user memory, per mode.
# For each mode (default: sockmap auto) a fresh zcrelay (2 workers, metrics on a loopback port)
# relays, one client at a time: iperf3 upload and download (-R) for RUN_SECONDS (5), curl fetching
# 256 MiB from nginx, and nc sending 64 MiB then receiving 32 MiB. After each client the relay's
# /metrics says how many bytes it relayed (zcrelay_bytes_total) and how many of them went
# through user memory: the copy path's, plus the bytes the sockmap program passed to user space
# (zcrelay_sockmap_copied_bytes_total). Prints one Markdown table. Loopback only; every client
# bounded by `timeout`; stops only the processes it started, by PID.
#
# Usage: bench/real-clients.sh [MODE...]
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}"
RUN_SECONDS="${RUN_SECONDS:-5}"
PORT_BASE="${PORT_BASE:-27500}"
NEXT_PORT=$PORT_BASE
MODES=("$@")
((${#MODES[@]})) || MODES=(sockmap auto)
OWN_PIDS=()
die() { echo "bench/real-clients.sh: $*" >&2; exit 1; }
# shellcheck source=lib.sh
source "$SCRIPT_DIR/lib.sh"
WORK=$(mktemp -d)
trap cleanup EXIT
for tool in iperf3 nginx curl nc; do
    command -v "$tool" >/dev/null || die "$tool is missing (deploy/install-deps.sh installs it)"
done

listening() { ss -Hltn "sport = :$1" | grep -q LISTEN; }
wait_listening() { local i; for i in $(seq 100); do listening "$1" && return 0; sleep 0.05; done; return 1; }


# Upstreams: an iperf3 server, nginx serving a 256 MiB sparse file, and nc started per run.
pick_port iperf_port
iperf3 -s -B 127.0.0.1 -p "$iperf_port" >"$WORK/iperf3.log" 2>&1 &
OWN_PIDS+=($!)
mkdir -p "$WORK/www"
truncate -s 256M "$WORK/www/big.bin"
pick_port nginx_port
cat >"$WORK/nginx.conf" <<CONF
daemon off; master_process off; user root; pid $WORK/nginx.pid; error_log $WORK/nginx.err;
events {}
http { access_log off; client_body_temp_path $WORK/body; proxy_temp_path $WORK/proxy;
  fastcgi_temp_path $WORK/fcgi; uwsgi_temp_path $WORK/uwsgi; scgi_temp_path $WORK/scgi;
  server { listen 127.0.0.1:$nginx_port; root $WORK/www; } }
CONF
nginx -c "$WORK/nginx.conf" -e "$WORK/nginx.err" &
OWN_PIDS+=($!)
wait_listening "$iperf_port" && wait_listening "$nginx_port" || die "iperf3 or nginx did not start"
head -c $((64 << 20)) /dev/urandom >"$WORK/up.bin"
head -c $((32 << 20)) /dev/urandom >"$WORK/down.bin"

echo "| mode | client | bytes relayed | through user memory | share | directions promoted |"
echo "|---|---|---|---|---|---|"
for mode in "${MODES[@]}"; do
    for client in "iperf3 upload" "iperf3 download" "curl 256 MiB" "nc 64 MiB up, 32 MiB back"; do
        case "$client" in
            iperf3*) up_port=$iperf_port ;;
            curl*) up_port=$nginx_port ;;
            nc*)
                pick_port up_port
                timeout 120 nc -N -l 127.0.0.1 "$up_port" <"$WORK/down.bin" >/dev/null &
                OWN_PIDS+=($!)
                wait_listening "$up_port" ;;
        esac
        pick_port relay_port
        pick_port metrics_port
        "$BUILD/zcrelay" --listen "127.0.0.1:$relay_port" --upstream "127.0.0.1:$up_port" \
            --mode "$mode" --workers 2 --metrics "127.0.0.1:$metrics_port" >"$WORK/relay.log" 2>&1 &
        relay=$!
        OWN_PIDS+=("$relay")
        for _ in $(seq 100); do grep -q 'zcrelay: ready' "$WORK/relay.log" && break; sleep 0.05; done
        case "$client" in
            "iperf3 upload") timeout 60 iperf3 -c 127.0.0.1 -p "$relay_port" -t "$RUN_SECONDS" >/dev/null ;;
            "iperf3 download") timeout 60 iperf3 -c 127.0.0.1 -p "$relay_port" -t "$RUN_SECONDS" -R >/dev/null ;;
            curl*) timeout 60 curl -sS -o /dev/null "http://127.0.0.1:$relay_port/big.bin" ;;
            nc*) timeout 120 nc -N 127.0.0.1 "$relay_port" <"$WORK/up.bin" >/dev/null ;;
        esac
        for _ in $(seq 100); do
            [[ $(scrape_sum "$metrics_port" zcrelay_connections_active) == 0 ]] && break; sleep 0.05
        done
        total=$(scrape_sum "$metrics_port" zcrelay_bytes_total)
        copy=$(scrape_sum "$metrics_port" zcrelay_bytes_total 'path="copy"')
        passed=$(scrape_sum "$metrics_port" zcrelay_sockmap_copied_bytes_total)
        promoted=$(scrape_sum "$metrics_port" zcrelay_datapath_switches_total)
        user=$((copy + passed))
        share=$(python3 -c "print(f'{100 * $user / max($total, 1):.1f} %')")
        echo "| $mode | $client | $total | $user | $share | $promoted |"
        kill "$relay"; wait_gone "$relay" 5 || kill -KILL "$relay"
    done
done
