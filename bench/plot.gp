# bench/plot.gp: one grouped bar chart with error bars, drawn by bench/plot.sh.
#
# Variables (set by the .vars.gp file `stats.py plotdata` writes, loaded before this script):
#   datafile   rows: "cluster label" then per series: value low high (NaN: no bar); the first
#              row is a header whose series columns hold the series names
#   outfile    the PNG to write
#   nseries    series (bars) per cluster
#   colors     space-separated colours, one per series
#   charttitle, xlab, ylab
#   logy       1 for a logarithmic y axis
#   width      PNG width in pixels
# and, from plot.sh: term ("pngcairo" or "png").

if (!exists("term")) term = "pngcairo"
if (term eq "pngcairo") {
    set terminal pngcairo size width, 620 font "DejaVu Sans,10" noenhanced
} else {
    set terminal png size width, 620 noenhanced
}
set encoding utf8
set output outfile

set title charttitle noenhanced
set xlabel xlab noenhanced
set ylabel ylab noenhanced
set key outside right top vertical noenhanced samplen 1.5
set grid ytics
set border 3
set xtics nomirror rotate by 25 right noenhanced
set ytics nomirror
set datafile missing "NaN"

set style data histograms
set style histogram errorbars gap 1.5 lw 1
set style fill solid 0.85 border rgb "#333333"
set boxwidth 0.9
set bars front

if (logy) {
    set logscale y
    set yrange [*:*]
} else {
    set yrange [0:*]
}

plot for [i=0:nseries-1] datafile using (column(2+3*i)):(column(3+3*i)):(column(4+3*i)):xtic(1) \
    title columnheader(2+3*i) lc rgb word(colors, i+1)
