#!/usr/bin/env bash
# bench/ab.sh: A/B of two zcrelay binaries with bench/run, interleaved, to show that a change
# keeps performance "within noise" (or that it does not).
#
# Usage: bench/ab.sh --before DIR --after DIR [--rounds N] [--only RELAYS] [--workloads W,...]
#                    [--quick] [--out FILE.md] [--dir DIR] [--timeout S] [--tools DIR]
#                    [--pause S]
#        bench/ab.sh --report DIR [--out FILE.md]
#   --before, --after  build directories, each holding `zcrelay` (as ZCRELAY_BUILD for bench/run)
#   --rounds     rounds (default 5); round r runs bench/run once for each side, the side that
#                goes first alternating (odd rounds: before first; even rounds: after first)
#   --only       relays, passed to bench/run (default zcrelay-splice,zcrelay-copy,zcrelay-sockmap)
#   --workloads  passed to bench/run (default: all of them)
#   --quick      passed to bench/run (fewer runs per invocation: a smoke run)
#   --out        also write the Markdown report to FILE.md (it always goes to stdout and to
#                DIR/ab-report.md)
#   --dir        where everything goes (default: a new ${TMPDIR:-/tmp}/zcrelay-ab.XXXXXX); must be
#                absent or empty
#   --timeout    seconds one bench/run invocation may take before it is stopped (default 1800,
#                600 with --quick); its records so far are kept, the stop is reported
#   --tools      build directory whose bench/ load generators both sides use (default: --before's),
#                so that only the relay binary differs between the sides
#   --pause      seconds to sleep between invocations (default 0)
#   --report     re-render the report of an earlier (or interrupted) DIR, running nothing
#
# Isolation: bench/run writes into the results/ directory beside itself and deletes that day's
# file first. So ab.sh copies the repository's bench/ driver scripts (not results/) once into
# DIR/driver/, and gives every invocation its own copy of that snapshot (DIR/runs/rN-SIDE/bench/):
# the repository's bench/results/ is never written, and edits to bench/ during the A/B do not
# reach it. The two binaries and the load generators are copied too (DIR/build-before/,
# DIR/build-after/, DIR/tools/), so a rebuild during the A/B cannot change what is measured;
# their sha256 go into the report.
#
# Each invocation runs under timeout(1) in a process group of its own (timeout's); on expiry or
# when ab.sh is interrupted, that group gets SIGTERM (bench/run's EXIT trap stops its relays and
# servers and removes its /dev/shm scratch directory), then SIGKILL 60 s later. Nothing else is
# signalled. All traffic is bench/run's: 127.0.0.1 only. Environment passed through to
# bench/run: RELAY_CPU, LOAD_CPU; PORT_BASE (default here 24000, away from bench/run's 21000).
#
# Output: DIR/ab-report.md (and stdout, and --out): per cell (workload x parameter x relay x
# metric) before and after as median [min..max] over the rounds of each invocation's median,
# after/before (median over median, [min..max] of the per-round ratios), and "outside noise"
# where the two ranges do not overlap (bench/ab_report.py). Raw data: DIR/runs/rN-SIDE/ (the
# invocation's stdout.md, stderr.log with a time stamp per line, bench/results/*.jsonl and the
# samples), DIR/manifest.tsv, DIR/meta.tsv. Progress on stderr.
set -euo pipefail

readonly SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly TOOLS=(halfclose transfer conn_rate echo_server pingpong)

BEFORE="" AFTER="" ROUNDS=5 ONLY="zcrelay-splice,zcrelay-copy,zcrelay-sockmap" WORKLOADS=""
QUICK=0 OUT="" DIR="" TIMEOUT="" TOOLS_DIR="" PAUSE=0 REPORT_ONLY=""
RUN_PID=""   # the timeout(1) of the running invocation, leader of its process group

die() { echo "bench/ab.sh: $*" >&2; exit 1; }
log() { echo "bench/ab.sh: $*" >&2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

parse_args() {
    while (($#)); do
        case "$1" in
            --before) BEFORE=${2:?--before needs a directory}; shift ;;
            --after) AFTER=${2:?--after needs a directory}; shift ;;
            --rounds) ROUNDS=${2:?--rounds needs a number}; shift ;;
            --only) ONLY=${2:?--only needs relay names}; shift ;;
            --workloads) WORKLOADS=${2:?--workloads needs names}; shift ;;
            --quick) QUICK=1 ;;
            --out) OUT=${2:?--out needs a file}; shift ;;
            --dir) DIR=${2:?--dir needs a directory}; shift ;;
            --timeout) TIMEOUT=${2:?--timeout needs seconds}; shift ;;
            --tools) TOOLS_DIR=${2:?--tools needs a directory}; shift ;;
            --pause) PAUSE=${2:?--pause needs seconds}; shift ;;
            --report) REPORT_ONLY=${2:?--report needs a directory}; shift ;;
            -h|--help) usage 0 ;;
            *) echo "bench/ab.sh: unknown argument '$1'" >&2; usage 2 ;;
        esac
        shift
    done
    [[ -n "$REPORT_ONLY" ]] && return 0
    [[ -n "$BEFORE" && -n "$AFTER" ]] || { echo "bench/ab.sh: --before and --after are required" >&2; usage 2; }
    [[ "$ROUNDS" =~ ^[0-9]+$ ]] && ((ROUNDS >= 1 && ROUNDS <= 50)) || die "--rounds: 1..50"
    [[ "$PAUSE" =~ ^[0-9]+$ ]] && ((PAUSE <= 600)) || die "--pause: 0..600 seconds"
    [[ -z "$TIMEOUT" ]] && TIMEOUT=$( ((QUICK)) && echo 600 || echo 1800)
    [[ "$TIMEOUT" =~ ^[0-9]+$ ]] && ((TIMEOUT >= 10)) || die "--timeout: seconds, at least 10"
    TOOLS_DIR=${TOOLS_DIR:-$BEFORE}
    local d t
    for d in "$BEFORE" "$AFTER"; do
        [[ -x "$d/zcrelay" && -f "$d/zcrelay" ]] || die "$d/zcrelay missing or not executable"
    done
    for t in "${TOOLS[@]}"; do
        [[ -x "$TOOLS_DIR/bench/$t" ]] || die "$TOOLS_DIR/bench/$t missing (--tools DIR: a build with bench/ tools)"
    done
    # Names are checked here, not 2 x N invocations later.
    local all_w w r names
    all_w=$(sed -nE 's/^readonly ALL_WORKLOADS="([^"]*)".*/\1/p' "$SCRIPT_DIR/run")
    [[ -n "$all_w" ]] || die "cannot read ALL_WORKLOADS from $SCRIPT_DIR/run"
    for w in ${WORKLOADS//,/ }; do
        [[ ",$all_w," == *",$w,"* ]] || die "unknown workload '$w' (known: $all_w)"
    done
    names=$(bash -c 'source "$1/lib.sh"; source "$1/relays.sh"; relay_names' _ "$SCRIPT_DIR")
    for r in ${ONLY//,/ }; do
        grep -qx -- "$r" <<<"$names" || die "unknown relay '$r' (known: $(paste -sd' ' <<<"$names"))"
    done
}

# stop_run: the running invocation's process group, politely, then for good. Only that group:
# timeout(1) made it (setpgid) and everything bench/run started is in it.
stop_run() {
    local pid=$RUN_PID i
    [[ -n "$pid" ]] || return 0
    RUN_PID=""
    kill -TERM "$pid" 2>/dev/null || return 0   # timeout relays it to its group
    for ((i = 0; i < 300; i++)); do            # 30 s: bench/run's cleanup waits up to 3 s a PID
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null || true
}
on_signal() {
    log "interrupted: stopping the running invocation (its records are left out)"
    stop_run
    trap - INT TERM HUP
    if (($(wc -l <"$DIR/manifest.tsv") > 1)); then
        report "$DIR" || true
    fi
    exit 130
}

# stamp: stderr lines with the wall clock in front (EPOCHREALTIME), for the workload timings.
stamp() {
    local line
    while IFS= read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done
}

sha() { sha256sum "$1" | cut -d' ' -f1; }

prepare() {
    if [[ -z "$DIR" ]]; then
        DIR=$(mktemp -d "${TMPDIR:-/tmp}/zcrelay-ab.XXXXXX")
    else
        mkdir -p "$DIR"
        [[ -z "$(ls -A "$DIR")" ]] || die "--dir $DIR is not empty"
    fi
    DIR=$(cd "$DIR" && pwd)
    [[ "$DIR" =~ ^/[A-Za-z0-9._/+-]+$ ]] ||
        die "$DIR: keep the directory to [A-Za-z0-9._/+-] (bench/relays.sh fills it into configs)"
    # The driver: bench/'s scripts, configs and helpers as they are now, without results/.
    mkdir -p "$DIR/driver/bench" "$DIR/tools" "$DIR/runs"
    local f
    for f in "$SCRIPT_DIR"/*; do
        case "${f##*/}" in results|testdata) continue ;; esac
        cp -a "$f" "$DIR/driver/bench/"
    done
    local side src
    for side in before after; do
        src=$BEFORE
        [[ "$side" == after ]] && src=$AFTER
        mkdir -p "$DIR/build-$side"
        cp "$src/zcrelay" "$DIR/build-$side/zcrelay"
        ln -s ../tools "$DIR/build-$side/bench"
    done
    for f in "${TOOLS[@]}"; do cp "$TOOLS_DIR/bench/$f" "$DIR/tools/"; done
    {
        printf 'before\t%s\n' "$(cd "$BEFORE" && pwd)/zcrelay"
        printf 'after\t%s\n' "$(cd "$AFTER" && pwd)/zcrelay"
        printf 'before_sha256\t%s\n' "$(sha "$DIR/build-before/zcrelay")"
        printf 'after_sha256\t%s\n' "$(sha "$DIR/build-after/zcrelay")"
        printf 'before_version\t%s\n' "$("$DIR/build-before/zcrelay" --version 2>&1 | head -n1)"
        printf 'after_version\t%s\n' "$("$DIR/build-after/zcrelay" --version 2>&1 | head -n1)"
        printf 'tools\t%s\n' "$(cd "$TOOLS_DIR" && pwd)/bench"
        printf 'tools_sha256\t%s\n' "$(cd "$DIR/tools" && sha256sum "${TOOLS[@]}" | sha256sum | cut -c1-16)"
        printf 'driver_run_sha256\t%s\n' "$(sha "$DIR/driver/bench/run")"
        printf 'repo\t%s\n' "$(git -C "$SCRIPT_DIR" describe --always --dirty 2>/dev/null || echo '?')"
        printf 'rounds\t%s\n' "$ROUNDS"
        printf 'only\t%s\n' "$ONLY"
        printf 'workloads\t%s\n' "${WORKLOADS:-all}"
        printf 'quick\t%s\n' "$QUICK"
        printf 'timeout\t%s\n' "$TIMEOUT"
        printf 'host\t%s\n' "$(hostname -s)"
        printf 'kernel\t%s\n' "$(uname -r)"
        printf 'cpus\t%s\n' "$(nproc) ($(lscpu | sed -nE 's/^Model name: *//p' | head -n1))"
        printf 'relay_cpu\t%s\n' "${RELAY_CPU:-1}"
        printf 'load_cpu\t%s\n' "${LOAD_CPU:-0}"
    } >"$DIR/meta.tsv"
    printf 'round\tside\torder\tstart\tend\trc\tjsonl\n' >"$DIR/manifest.tsv"
}

# invoke ROUND SIDE ORDER: one bench/run, from its own copy of the driver.
invoke() {
    local round=$1 side=$2 order=$3 rd="$DIR/runs/r$1-$2"
    mkdir -p "$rd"
    cp -a "$DIR/driver/bench" "$rd/bench"
    local -a args=(--only "$ONLY")
    [[ -n "$WORKLOADS" ]] && args+=(--workloads "$WORKLOADS")
    ((QUICK)) && args+=(--quick)
    local start end rc=0
    start=$(date +%s)
    log "round $round/$ROUNDS, $side ($order): bench/run ${args[*]} (log $rd/stderr.log)"
    # timeout(1) puts itself and bench/run in a new process group; stdin from /dev/null.
    ZCRELAY_BUILD="$DIR/build-$side" PORT_BASE="${PORT_BASE:-24000}" \
        timeout -k 60 "$TIMEOUT" "$rd/bench/run" "${args[@]}" \
        >"$rd/stdout.md" 2> >(stamp >"$rd/stderr.log") </dev/null &
    RUN_PID=$!
    wait "$RUN_PID" || rc=$?
    RUN_PID=""
    wait   # the stamp process substitution: stderr.log complete
    end=$(date +%s)
    local jsonl
    jsonl=$(find "$rd/bench/results" -maxdepth 1 -name '*.jsonl' 2>/dev/null | head -n1)
    case "$rc" in
        0) log "  done in $((end - start)) s" ;;
        124|137) log "  STOPPED after the --timeout of $TIMEOUT s; records so far kept" ;;
        *) log "  bench/run exited $rc after $((end - start)) s: $(tail -n2 "$rd/stderr.log" 2>/dev/null | cut -d' ' -f2- | tr '\n' ' ')" ;;
    esac
    [[ -n "$jsonl" ]] || log "  no records from this invocation"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$side" "$order" "$start" "$end" "$rc" \
        "${jsonl#"$DIR/"}" >>"$DIR/manifest.tsv"
}

report() {
    local dir=$1 md="$1/ab-report.md"
    python3 "$SCRIPT_DIR/ab_report.py" "$dir" >"$md"
    cat "$md"
    if [[ -n "$OUT" ]]; then
        mkdir -p "$(dirname "$OUT")"
        cp "$md" "$OUT"
    fi
    log "report: $md${OUT:+ and $OUT}; raw data under $dir/runs/"
}

main() {
    parse_args "$@"
    if [[ -n "$REPORT_ONLY" ]]; then
        [[ -f "$REPORT_ONLY/manifest.tsv" ]] || die "$REPORT_ONLY/manifest.tsv missing"
        report "$(cd "$REPORT_ONLY" && pwd)"
        return 0
    fi
    command -v timeout >/dev/null || die "timeout (coreutils) missing"
    prepare
    trap on_signal INT TERM HUP
    log "A/B in $DIR: before $BEFORE, after $AFTER, $ROUNDS round(s), relays $ONLY, workloads ${WORKLOADS:-all}$( ((QUICK)) && echo ', --quick')"
    local r first second
    for ((r = 1; r <= ROUNDS; r++)); do
        if ((r % 2)); then first=before second=after; else first=after second=before; fi
        invoke "$r" "$first" first
        ((PAUSE)) && sleep "$PAUSE"
        invoke "$r" "$second" second
        ((PAUSE && r < ROUNDS)) && sleep "$PAUSE"
    done
    trap - INT TERM HUP
    report "$DIR"
}

main "$@"
