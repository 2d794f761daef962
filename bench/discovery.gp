# bench/discovery.gp: the chart of one scale run of bench/discovery.sh, drawn from the data files
# `discovery.py plotdata` writes. Three panels over the run's time (s since the load started):
#   top     active connections per backend: solid = the relay's zcrelay_backend_connections_active
#           (250 ms scrapes; no line while the backend is not in the relay's set: its series go
#           when it leaves DNS), dashed = the backend's own count (accepts - closes), grey = the
#           listener's zcrelay_connections_active (every live connection, removed backends' too)
#   middle  new connections per second at each backend (its accepts over the last 0.5 s)
#   bottom  per 100 ms, log scale: the slowest short connection (connect to echo) and ping that
#           completed, and the longest gap between two turns of the client's own event loop (a
#           gap as long as a latency spike: the load's CPU did not run the client)
# Dotted vertical lines: the moments DNS changed (dnsmasq got SIGHUP with the new records).
#
# Variables (from the .vars.gp file, loaded before this script): datafile, tlfile, outfile,
# charttitle, nb, names, colors, nmarks, markx, marklabel1..N, xmax.

set terminal svg size 1100,1050 dynamic font "DejaVu Sans,11" background "white"
set encoding utf8
set output outfile
set datafile missing "NaN"

set multiplot layout 3,1 title charttitle noenhanced
set lmargin at screen 0.08
set rmargin at screen 0.76
set grid ytics
set border 3
set xtics nomirror
set ytics nomirror
set xrange [0:xmax]
set key outside right top vertical noenhanced samplen 2

do for [k=1:nmarks] {
    x = real(word(markx, k))
    set arrow k from x, graph 0 to x, graph 1 nohead dt 3 lw 1.5 lc rgb "#333333" front
    set label k value(sprintf("marklabel%d", k)) at x, graph 1 left offset 0.5,-0.8 front noenhanced
}

set ylabel "active connections" noenhanced
set yrange [0:*]
plot for [i=1:nb] datafile using 1:(column(3+3*(i-1))) with lines lw 2 lc rgb word(colors, i) \
        title word(names, i).": relay", \
     for [i=1:nb] datafile using 1:(column(4+3*(i-1))) with lines lw 1.2 dt 2 lc rgb word(colors, i) \
        title word(names, i).": backend's count", \
     datafile using 1:2 with lines lw 1 lc rgb "#999999" title "listener (relay)"

unset label
set ylabel "new connections/s at the backend" noenhanced
plot for [i=1:nb] datafile using 1:(column(5+3*(i-1))) with lines lw 1.5 lc rgb word(colors, i) \
        title word(names, i)

set xlabel "seconds since the load started" noenhanced
set ylabel "slowest per 100 ms (ms)" noenhanced
set logscale y
set yrange [0.05:*]
plot tlfile using 1:2 with lines lw 1.2 lc rgb "#1f77b4" title "short connection", \
     tlfile using 1:3 with lines lw 1.2 lc rgb "#ff7f0e" title "ping", \
     tlfile using 1:4 with lines lw 1 lc rgb "#999999" title "client loop gap"
unset multiplot
