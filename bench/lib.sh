# Shell helpers the bench scripts share. Sourced, not run; the caller defines die() and the
# NEXT_PORT / PORT_BASE variables pick_port() walks.

# is_alive PID: kill -0 also succeeds on a zombie (and a relay run under time(1) is not our
# child), so look at the state in /proc as well.
is_alive() {
    local pid=$1 state
    kill -0 "$pid" 2>/dev/null || return 1
    state=$(sed -E 's/^.*\) (.).*$/\1/' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ "$state" != Z ]]
}

# wait_gone PID SECONDS: poll until PID is gone; 1 if it is still there.
wait_gone() {
    local pid=$1 deadline=$((SECONDS + $2))
    while is_alive "$pid"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.05
    done
}

# port_in_use PORT: any socket with this local port, in any state (TIME_WAIT included).
port_in_use() { [[ -n "$(ss -Htan "sport = :$1" 2>/dev/null)" ]]; }

# pick_port VAR: the next free port at or after NEXT_PORT, never the same twice in one
# invocation, so no run inherits the previous run's TIME_WAIT.
pick_port() {
    local -n _out=$1
    while ((NEXT_PORT < PORT_BASE + 2000)); do
        local p=$NEXT_PORT
        NEXT_PORT=$((NEXT_PORT + 1))
        if ! port_in_use "$p"; then _out=$p; return 0; fi
    done
    die "no free port in $PORT_BASE..$((PORT_BASE + 1999))"
}

# start_port_server PORT_VAR NAME ARGV...: runs ARGV on LOAD_CPU in the background (its PID in
# OWN_PIDS and in SERVER_PID), stdout/stderr in $WORK/NAME.out/.err, and waits (bounded, 10 s)
# for its first line: the port it listens on, as bench/'s echo_server, transfer and pingpong
# print it. The caller defines LOAD_CPU, WORK and die().
start_port_server() {
    local -n _port=$1
    local name=$2 out="$WORK/$2.out" deadline line=""
    shift 2
    taskset -c "$LOAD_CPU" "$@" >"$out" 2>"$WORK/$name.err" </dev/null &
    SERVER_PID=$!
    OWN_PIDS+=("$SERVER_PID")
    deadline=$((SECONDS + 10))
    until [[ -n "$line" ]]; do
        line=$(head -n1 "$out" 2>/dev/null | grep -E '^[0-9]+$' || true)
        [[ -n "$line" ]] && break
        is_alive "$SERVER_PID" && ((SECONDS < deadline)) ||
            die "$name did not start: $(cat "$WORK/$name.err")"
        sleep 0.02
    done
    _port=$line
}

# cleanup: stops every process the script started (the PIDs in OWN_PIDS, and only those),
# politely first, then removes the scratch directory $WORK. Meant for `trap cleanup EXIT`.
cleanup() {
    local pid
    for pid in "${OWN_PIDS[@]}"; do
        is_alive "$pid" && kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${OWN_PIDS[@]}"; do
        wait_gone "$pid" 3 || kill -KILL "$pid" 2>/dev/null || true
    done
    [[ -n "$WORK" && -d "$WORK" ]] && rm -rf -- "$WORK"
    return 0
}

# scrape_sum PORT NAME [FILTER]: the sum of NAME's samples on 127.0.0.1:PORT/metrics whose series
# matches FILTER (a regex such as 'path="copy"'; all when empty), as a whole number.
scrape_sum() {
    local port=$1 name=$2 filter=${3:-}
    curl -s "http://127.0.0.1:$port/metrics" | awk -v n="$name" -v f="$filter" '
        $1 ~ "^"n"[{ ]" || $1 == n { if (f == "" || $1 ~ f) s += $2 } END { printf "%.0f\n", s }'
}

# others_ticks -> OTHER_TICKS: how busy the rest of the machine was (bench/datapath.sh and
# bench/discovery.sh report it beside their numbers): utime+stime+cutime+cstime summed over the user-space processes
# that are not this script or its descendants. A process that exits inside the window moves its
# time into its parent's cutime, so the difference of two sums still counts it. Kernel threads
# (PF_KTHREAD) are left out on purpose: ksoftirqd and kworkers doing our bytes belong to us.
others_ticks() {
    # cat skips processes that vanish between the glob and the read.
    OTHER_TICKS=$(cat /proc/[0-9]*/stat 2>/dev/null | awk -v root=$$ '
        {
            pid = $1; rest = $0
            sub(/^.*\) /, "", rest)
            n = split(rest, f, " ")
            if (n < 15) next
            ppid[pid] = f[2]
            kthread[pid] = int(f[7] / 2097152) % 2   # PF_KTHREAD = 0x00200000
            t[pid] = f[12] + f[13] + f[14] + f[15]
        }
        END {
            mine[root] = 1
            do {
                grew = 0
                for (p in ppid) if (!(p in mine) && (ppid[p] in mine)) { mine[p] = 1; grew = 1 }
            } while (grew)
            s = 0
            for (p in t) if (!(p in mine) && !kthread[p]) s += t[p]
            print s
        }')
}
