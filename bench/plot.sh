#!/bin/sh
# bench/plot.sh RESULTS.jsonl OUTDIR: PNG charts of a bench/run results file, drawn with gnuplot
# (Debian package gnuplot-nox; pngcairo terminal, else the libgd png terminal).
#
#   OUTDIR/throughput.png   MB/s per relay, grouped by workload and parameter: bar = median,
#                           error bar = min to max over the runs (records with unit "MB/s";
#                           another byte rate, e.g. "MiB/s", gets throughput-<unit>.png)
#   OUTDIR/rate-<unit>.png  the same for other rates: conn/s, req/s
#   OUTDIR/cpu-per-gb.png   relay CPU seconds per GB (10^9 B) moved, per relay, for byte-rate
#                           records: field relay_cpu_s_per_gb, else relay_cpu_s_per_gib
#                           converted, else relay_cpu_s / (bytes / 1e9); error bars from
#                           relay_cpu_s_per_gb_min/_max when present
#   OUTDIR/latency-<workload>_<param>.png
#                           p50 / p99 / p99.9 per relay, log scale, one chart per workload and
#                           parameter whose records carry latency percentiles
#
# Latency fields expected (in microseconds): p50_us, p99_us, p999_us (as bench/run writes them
# into its ping-pong records, whatever their unit), or p50, p99, p999 in a record whose unit is
# "us". Optional error bars: <field>_min and <field>_max (e.g. p99_us_min). A percentile that
# is absent is left out (no bar); a chart with no data is skipped with a note on stderr.
#
# Titles name the machine: host, kernel, cpu and time (or the date in the file name) from a
# header line ({"type":"header", ...}, or any line without "relay") or from the records. A file
# marked "synthetic": true is titled as SYNTHETIC DEMO DATA; "quick": 1 as a smoke run.
#
# Environment: PLOT_KEEP_DATA=1 keeps the gnuplot data files in OUTDIR/plotdata/.
set -eu

usage() { sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
case "${1:-}" in -h|--help) usage 0 ;; esac
[ $# -eq 2 ] || usage 2
results=$1
outdir=$2
here=$(cd "$(dirname "$0")" && pwd)

command -v gnuplot >/dev/null || { echo "plot.sh: gnuplot missing (apt-get install gnuplot-nox)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "plot.sh: python3 missing" >&2; exit 1; }
[ -r "$results" ] || { echo "plot.sh: cannot read $results" >&2; exit 1; }

if gnuplot -e 'set terminal pngcairo' </dev/null >/dev/null 2>&1; then
    term=pngcairo
elif gnuplot -e 'set terminal png' </dev/null >/dev/null 2>&1; then
    term=png
else
    echo "plot.sh: this gnuplot has neither the pngcairo nor the png terminal" >&2
    exit 1
fi

mkdir -p "$outdir"
if [ "${PLOT_KEEP_DATA:-0}" = 1 ]; then
    work="$outdir/plotdata"
    mkdir -p "$work"
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/zcrelay-plot.XXXXXX")
    trap 'rm -rf -- "$work"' EXIT
fi

python3 "$here/stats.py" plotdata --pngdir "$outdir" "$results" "$work" >"$work/charts"
n=0
tab=$(printf '\t')
while IFS="$tab" read -r vars png; do
    gnuplot -e "term='$term'" "$vars" "$here/plot.gp"
    echo "$png"
    n=$((n + 1))
done <"$work/charts"
[ "$n" -gt 0 ] || { echo "plot.sh: no chart could be drawn from $results" >&2; exit 1; }
echo "plot.sh: charts drawn: $n ($term terminal), in $outdir" >&2
