#!/usr/bin/env bash
# bench/switch-ab.sh: A/B of a setting inside one zcrelay binary: two relays of bench/relays.sh
# that differ by that setting (zcrelay-copy and zcrelay-copy-zc: send_zerocopy), run by the same
# bench/run invocations, interleaved, with peers beside them for reference.
#
# Usage: bench/switch-ab.sh --a RELAY --b RELAY [--also RELAYS] [--workloads W,...]
#                           [--rounds N] [--quick] [--dir DIR] [--timeout S]
#   --a, --b     the two relays; round r runs bench/run once with A first (odd r) or B first
#   --also       more relays for each invocation, after A and B (e.g. zcrelay-splice,haproxy-splice)
#   --workloads  passed to bench/run (default upload,bulk)
#   --rounds     invocations (default 5)
#   --quick      passed to bench/run
#   --dir        where everything goes (default a new ${TMPDIR:-/tmp}/zcrelay-switch-ab.XXXXXX)
#   --timeout    seconds one invocation may take before it is stopped (default 1800)
#
# As bench/ab.sh: the binary and the load generators are copied once into DIR/build (a rebuild
# meanwhile changes nothing measured), every invocation runs a copy of bench/ (bench/run deletes
# that day's results file), under timeout(1), and only 127.0.0.1 is used. The report
# (bench/switch_ab.py: B/A per cell, median [min..max] over the rounds, "outside noise" where
# the ranges do not overlap) goes to stdout and DIR/report.md.
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly TOOLS=(halfclose transfer conn_rate echo_server pingpong)

A="" B="" ALSO="" WORKLOADS="upload,bulk" ROUNDS=5 QUICK=() DIR="" TIMEOUT=1800
die() { echo "bench/switch-ab.sh: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

while (($#)); do
    case "$1" in
        --a) A=${2:?}; shift ;;
        --b) B=${2:?}; shift ;;
        --also) ALSO=${2:?}; shift ;;
        --workloads) WORKLOADS=${2:?}; shift ;;
        --rounds) ROUNDS=${2:?}; shift ;;
        --quick) QUICK=(--quick) ;;
        --dir) DIR=${2:?}; shift ;;
        --timeout) TIMEOUT=${2:?}; shift ;;
        -h|--help) usage ;;
        *) die "unknown argument '$1' (--help)" ;;
    esac
    shift
done
[[ -n "$A" && -n "$B" ]] || die "--a and --b are required"
[[ "$ROUNDS" =~ ^[1-9][0-9]?$ ]] || die "--rounds '$ROUNDS' is not 1-99"
BUILD="${ZCRELAY_BUILD:-$SCRIPT_DIR/../build}"
[[ -x "$BUILD/zcrelay" ]] || die "no $BUILD/zcrelay: build first"
if [[ -z "$DIR" ]]; then
    DIR=$(mktemp -d "${TMPDIR:-/tmp}/zcrelay-switch-ab.XXXXXX")
else
    mkdir -p "$DIR"
    [[ -z "$(ls -A "$DIR")" ]] || die "--dir $DIR is not empty"
fi
mkdir -p "$DIR/build/bench"
cp "$BUILD/zcrelay" "$DIR/build/"
for t in "${TOOLS[@]}"; do cp "$BUILD/bench/$t" "$DIR/build/bench/"; done

results=()
for ((r = 1; r <= ROUNDS; r++)); do
    run="$DIR/r$r"
    mkdir -p "$run"
    cp -r "$SCRIPT_DIR" "$run/bench"
    rm -rf "$run/bench/results"/*
    if ((r % 2)); then only="$A,$B"; else only="$B,$A"; fi
    [[ -n "$ALSO" ]] && only+=",$ALSO"
    echo "bench/switch-ab.sh: round $r of $ROUNDS: $only ($(date -u +%T))" >&2
    if ! ZCRELAY_BUILD="$DIR/build" timeout "$TIMEOUT" "$run/bench/run" "${QUICK[@]}" \
        --only "$only" --workloads "$WORKLOADS" >"$run/stdout.md" 2>"$run/stderr.log"; then
        echo "bench/switch-ab.sh: round $r failed or timed out: $run/stderr.log" >&2
    fi
    for f in "$run"/bench/results/*.jsonl; do [[ -e "$f" ]] && results+=("$f"); done
done
((${#results[@]})) || die "no round left results"
python3 "$SCRIPT_DIR/switch_ab.py" "$A" "$B" "${results[@]}" | tee "$DIR/report.md"
echo "bench/switch-ab.sh: $DIR" >&2
