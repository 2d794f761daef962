# relays.sh: start and stop, by name, every relay the benchmarks compare. Sourced, not run.
#
#   direct               no relay: the client talks to the upstream (RELAY_PORT = upstream port)
#   zcrelay-splice       build/zcrelay --mode splice  --workers N --metrics off
#   zcrelay-copy         build/zcrelay --mode copy    --workers N --metrics off
#   zcrelay-sockmap      build/zcrelay --mode sockmap --workers N --metrics off
#   zcrelay-auto         build/zcrelay --mode auto    --workers N --metrics off
#   zcrelay-copy-zc      build/zcrelay -c RUN_DIR/zcrelay.yaml: copy mode with send_zerocopy: true
#                        (a listener key, which has no flag), workers N, metrics off
#   haproxy-splice       haproxy -db, peers/haproxy-splice.cfg (forced splice)
#   haproxy-splice-auto  haproxy -db, peers/haproxy-splice-auto.cfg
#   haproxy-nosplice     haproxy -db, peers/haproxy-nosplice.cfg
#   nginx                nginx stream, peers/nginx-stream.conf (proxy_half_close off, the default)
#   nginx-halfclose      nginx stream, peers/nginx-stream-halfclose.conf (proxy_half_close on)
#   socat                socat TCP-LISTEN:P,bind=127.0.0.1,reuseaddr,fork,backlog=1024 TCP:...
#
# Every relay listens on 127.0.0.1 and relays to 127.0.0.1; nothing else is ever used.
#
# Needs lib.sh sourced first (is_alive, wait_gone, pick_port) and what lib.sh asks of its caller:
# die(), NEXT_PORT and PORT_BASE. One relay runs at a time (the state below is global).
#
#   relay_names                         all names, one per line
#   relay_version NAME                  one line: program and version, e.g. "haproxy 2.6.12-1+deb12u4"
#   start_relay NAME UPSTREAM_PORT CPU WORKDIR
#       starts NAME pinned to CPU (taskset; a list such as 0,1 leaves it free among those) with
#       RELAY_THREADS threads (zcrelay workers, HAProxy nbthread, nginx worker_processes) on a
#       free port (pick_port) relaying to UPSTREAM_PORT,
#       and waits, bounded, until it listens. Sets RELAY_NAME, RELAY_PID, RELAY_PORT, RELAY_DIR (a
#       new directory under WORKDIR with the filled config and logs), RELAY_LOG and RELAY_CMD.
#       For direct: RELAY_PID is empty and RELAY_PORT = UPSTREAM_PORT (placing the upstream on
#       CPU, to make direct the ceiling, is the caller's job). On failure: returns 1, RELAY_ERR
#       and stderr say which relay and which log, and nothing of it is left running.
#       Call it in the script's own shell, not in $(...): only that shell can collect the exit
#       status. The PID is also appended to OWN_PIDS when the caller has that array.
#   stop_relay                          SIGTERM to RELAY_PID, bounded wait, SIGKILL fallback
#       (zcrelay, which drains open connections for up to 30 s, gets a second SIGTERM, its "close
#       now", half-way); then the processes of its tree that outlived it (socat's children do).
#       Sets RELAY_RC (exit status: 143 = ended by SIGTERM), RELAY_STOP_NOTE (why a non-zero
#       status is the relay's normal answer to SIGTERM) and RELAY_STOP_ERR ("" or what went
#       wrong: exit status not the relay's usual one, SIGKILL needed, relay already gone); a
#       wrong status or a kill is also reported on stderr. Safe to call with nothing running,
#       e.g. from an EXIT trap before lib.sh's cleanup.
#   relay_pids                          the PIDs of the relay's process tree, one per line
#   relay_cpu_ticks                     utime+stime+cutime+cstime summed over that tree, in
#                                       clock ticks (getconf CLK_TCK); take a difference
#   relay_peak_rss_kib                  VmHWM summed over the tree, KiB
#   Both print the number and set RELAY_CPU_TICKS / RELAY_PEAK_RSS_KIB: `relay_cpu_ticks
#   >/dev/null` reads it without forking a subshell (inside a measured window, every process
#   started is CPU that system-wide counters see). Both give "" for direct: no relay process.
#
# Placeholders in bench/peers/ templates, filled by sed (not envsubst, which would also eat
# nginx's own $variables): @LISTEN_PORT@, @UPSTREAM_PORT@, @RUN_DIR@ (absolute, no spaces),
# @THREADS@ (RELAY_THREADS).
#
# Environment: ZCRELAY_BUILD (directory holding zcrelay; default <repo>/build), RELAY_THREADS
# (threads or worker processes per relay, default 1: one per CPU it is pinned to),
# RELAY_READY_TIMEOUT (10 s), RELAY_STOP_TIMEOUT (10 s).

RELAYS_SH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The environment settings are read when used, not here: `VAR=x source relays.sh` would only
# set them while this file is read.

RELAY_NAME="" RELAY_PID="" RELAY_PORT="" RELAY_DIR="" RELAY_LOG="" RELAY_CMD="" RELAY_ERR=""
RELAY_RC="" RELAY_STOP_NOTE="" RELAY_STOP_ERR="" RELAY_CPU_TICKS="" RELAY_PEAK_RSS_KIB=""
_RELAY_SHELL=""   # $BASHPID of the shell that started the relay: the only one that can wait()
_RELAY_SEQ=0      # per-start directory counter

relay_names() {
    printf '%s\n' direct zcrelay-splice zcrelay-copy zcrelay-sockmap zcrelay-auto zcrelay-copy-zc \
        haproxy-splice haproxy-splice-auto haproxy-nosplice nginx nginx-halfclose socat
}

_relay_log() { echo "relays: $*" >&2; }

_relay_known() { [[ $'\n'"$(relay_names)"$'\n' == *$'\n'"$1"$'\n'* ]]; }

# _relay_binary NAME: the program the relay runs.
_relay_binary() {
    case "$1" in
        zcrelay-*) echo "${ZCRELAY_BUILD:-$RELAYS_SH_DIR/../build}/zcrelay" ;;
        haproxy-*) echo haproxy ;;
        nginx*) echo nginx ;;
        socat) echo socat ;;
    esac
}

relay_version() {
    local bin
    bin=$(_relay_binary "$1")
    case "$1" in
        direct) echo "no relay" ;;
        zcrelay-*) "$bin" --version 2>&1 | head -n1 ;;
        haproxy-*) haproxy -v 2>&1 | awk 'NR == 1 { print "haproxy", $3 }' ;;
        nginx*) nginx -v 2>&1 | sed -n 's|^nginx version: nginx/|nginx |p' ;;
        socat) socat -V 2>&1 | awk '/socat version/ { print "socat", $3; exit }' ;;
        *) return 1 ;;
    esac
}

# _relay_fill TEMPLATE OUT LISTEN_PORT UPSTREAM_PORT RUN_DIR; 1 (RELAY_ERR) if it cannot.
_relay_fill() {
    local tpl=$1 out=$2 lport=$3 uport=$4 dir=$5
    [[ -r "$tpl" ]] || { RELAY_ERR="template $tpl not found"; return 1; }
    # The directory goes into sed and into quoted nginx paths: keep it to safe characters.
    [[ "$dir" =~ ^/[A-Za-z0-9._/+-]+$ ]] ||
        { RELAY_ERR="run directory '$dir' must be absolute, without spaces or quotes"; return 1; }
    local threads=${RELAY_THREADS:-1}
    [[ "$threads" =~ ^[1-9][0-9]?$ ]] || { RELAY_ERR="RELAY_THREADS '$threads' is not 1-99"; return 1; }
    sed -e "s|@LISTEN_PORT@|$lport|g" -e "s|@UPSTREAM_PORT@|$uport|g" -e "s|@RUN_DIR@|$dir|g" \
        -e "s|@THREADS@|$threads|g" \
        "$tpl" >"$out" || { RELAY_ERR="cannot write $out"; return 1; }
    if grep -q '@[A-Z_]*@' "$out"; then
        RELAY_ERR="$out: unfilled placeholder $(grep -o -m1 '@[A-Z_]*@' "$out")"
        return 1
    fi
}

# ---------------------------------------------------------------- process tree

# Builtins only (no ps, no awk): relay_cpu_ticks may run at the edges of a measured window.
declare -A _RELAY_STAT=()   # pid -> /proc/PID/stat after "comm) " (field 3 onwards)
declare -a _RELAY_TREE=()   # RELAY_PID and its descendants (zombies included)

# _relay_scan ROOT: fill _RELAY_TREE and _RELAY_STAT. Zombies stay in: until their parent reaps
# them, their CPU time is only in their own stat, afterwards in the parent's cutime/cstime.
_relay_scan() {
    local root=$1 f line pid rest
    local -a a
    local -A kids=()
    _RELAY_TREE=()
    _RELAY_STAT=()
    [[ -n "$root" ]] || return 0
    for f in /proc/[0-9]*/stat; do
        { read -r line <"$f"; } 2>/dev/null || continue
        pid=${line%% *}
        rest=${line##*) }   # comm may hold spaces and parentheses; the last ") " ends it
        read -ra a <<<"$rest"
        kids[${a[1]}]+=" $pid"
        _RELAY_STAT[$pid]=$rest
    done
    [[ -n "${_RELAY_STAT[$root]:-}" ]] || return 0
    local -a queue=("$root")
    while ((${#queue[@]})); do
        pid=${queue[0]}
        queue=("${queue[@]:1}")
        _RELAY_TREE+=("$pid")
        for f in ${kids[$pid]:-}; do queue+=("$f"); done
    done
}

relay_pids() {
    _relay_scan "$RELAY_PID"
    ((${#_RELAY_TREE[@]} == 0)) || printf '%s\n' "${_RELAY_TREE[@]}"
}

# utime, stime, cutime, cstime are fields 14-17: indexes 11-14 of the stat after "comm) ".
# cutime/cstime hold the children the process has reaped: socat's per-connection children and
# an nginx worker that exited still count.
relay_cpu_ticks() {
    RELAY_CPU_TICKS=""
    _relay_scan "$RELAY_PID"
    ((${#_RELAY_TREE[@]})) || return 0
    local pid sum=0
    local -a a
    for pid in "${_RELAY_TREE[@]}"; do
        read -ra a <<<"${_RELAY_STAT[$pid]}"
        sum=$((sum + a[11] + a[12] + a[13] + a[14]))
    done
    RELAY_CPU_TICKS=$sum
    echo "$sum"
}

# The sum of each process's own peak: it counts pages shared between the processes (nginx's
# master and worker, socat's forks) more than once, and leaves out children that have already
# exited, so for a forking relay sample it while the load is on.
relay_peak_rss_kib() {
    RELAY_PEAK_RSS_KIB=""
    _relay_scan "$RELAY_PID"
    ((${#_RELAY_TREE[@]})) || return 0
    local pid key val _unit sum=0
    for pid in "${_RELAY_TREE[@]}"; do
        while read -r key val _unit; do
            [[ "$key" == VmHWM: ]] && { sum=$((sum + val)); break; }
        done 2>/dev/null <"/proc/$pid/status" || true
    done
    RELAY_PEAK_RSS_KIB=$sum
    echo "$sum"
}

# _relay_starttime PID: field 22, to tell a process from a later one with the same PID.
_relay_starttime() {
    local line
    { read -r line <"/proc/$1/stat"; } 2>/dev/null || return 1
    local -a a
    read -ra a <<<"${line##*) }"
    echo "${a[19]}"
}

# _relay_listening PORT: a listening socket on 127.0.0.1:PORT that belongs to the relay's tree
# (not to whoever else might have taken the port). Checked with ss, not by connecting: a test
# connection would be relayed, and the upstream would count a stray empty connection.
_relay_listening() {
    local port=$1 out pid
    out=$(ss -Hltnp "sport = :$port" 2>/dev/null) || return 1
    [[ "$out" == *"127.0.0.1:$port "* ]] || return 1
    _relay_scan "$RELAY_PID"
    for pid in "${_RELAY_TREE[@]}"; do
        [[ "$out" == *"pid=$pid,"* ]] && return 0
    done
    return 1
}

# _relay_ready NAME: the relay is up. zcrelay says so on stdout once every listener accepts;
# the others are up when they listen (nginx: and its worker exists, or the port would queue
# connections nobody serves yet and the CPU accounting would miss the worker).
_relay_ready() {
    case "$1" in
        zcrelay-*) grep -q '^zcrelay: ready' "$RELAY_DIR/output.log" 2>/dev/null ;;
        nginx*) _relay_listening "$RELAY_PORT" && ((${#_RELAY_TREE[@]} >= 2)) ;;
        *) _relay_listening "$RELAY_PORT" ;;
    esac
}

# _relay_tail FILE: its last lines on one line, for a message.
_relay_tail() {
    [[ -s "$1" ]] || return 0
    grep -v '^$' "$1" | tail -n4 | tr '\n' ' ' | sed 's/ *$//' | cut -c1-400
}

# ---------------------------------------------------------------- start / stop

start_relay() {
    local name=${1:-} up=${2:-} cpu=${3:-} workdir=${4:-}
    if [[ -n "${RELAY_PID:-}" ]] && is_alive "$RELAY_PID"; then
        # Its PID would be lost, and it would run on unaccounted.
        RELAY_ERR="$RELAY_NAME (pid $RELAY_PID) still runs: stop_relay before starting $name"
        _relay_log "$RELAY_ERR"
        return 1
    fi
    RELAY_ERR="" RELAY_CMD="" RELAY_LOG="" RELAY_DIR="" RELAY_PORT="" RELAY_PID=""
    RELAY_NAME=$name
    _relay_known "$name" || { RELAY_ERR="unknown relay '$name'"; _relay_log "$RELAY_ERR"; return 1; }
    if [[ ! "$up" =~ ^[0-9]+$ ]] || ((up < 1 || up > 65535)); then
        RELAY_ERR="$name: bad upstream port '$up'"; _relay_log "$RELAY_ERR"; return 1
    fi
    [[ "$cpu" =~ ^[0-9]+([,-][0-9]+)*$ ]] ||
        { RELAY_ERR="$name: bad CPU list '$cpu'"; _relay_log "$RELAY_ERR"; return 1; }
    local threads=${RELAY_THREADS:-1}
    [[ "$threads" =~ ^[1-9][0-9]?$ ]] ||
        { RELAY_ERR="$name: RELAY_THREADS '$threads' is not 1-99"; _relay_log "$RELAY_ERR"; return 1; }
    [[ -d "$workdir" ]] || { RELAY_ERR="$name: no directory '$workdir'"; _relay_log "$RELAY_ERR"; return 1; }

    if [[ "$name" == direct ]]; then
        RELAY_PORT=$up
        RELAY_CMD="(no relay: clients connect to 127.0.0.1:$up)"
        return 0
    fi

    local bin
    bin=$(_relay_binary "$name")
    if ! command -v "$bin" >/dev/null; then
        RELAY_ERR="$name: $bin not found"
        [[ "$name" == zcrelay-* ]] && RELAY_ERR+=" (build it, or set ZCRELAY_BUILD)"
        _relay_log "$RELAY_ERR"
        return 1
    fi

    pick_port RELAY_PORT
    _RELAY_SEQ=$((_RELAY_SEQ + 1))
    RELAY_DIR="$(cd "$workdir" && pwd)/relay-$_RELAY_SEQ-$name"
    mkdir -p "$RELAY_DIR" || { RELAY_ERR="$name: cannot create $RELAY_DIR"; _relay_log "$RELAY_ERR"; return 1; }
    RELAY_LOG="$RELAY_DIR/output.log"   # the relay's stdout and stderr

    local -a argv
    case "$name" in
        zcrelay-copy-zc)
            printf '%s\n' "workers: $threads" "metrics: {enabled: false}" "listeners:" \
                "  - listen: \"127.0.0.1:$RELAY_PORT\"" "    upstream: \"127.0.0.1:$up\"" \
                "    mode: copy" "    send_zerocopy: true" >"$RELAY_DIR/zcrelay.yaml" ||
                { RELAY_ERR="$name: cannot write $RELAY_DIR/zcrelay.yaml"; _relay_log "$RELAY_ERR"; return 1; }
            argv=(stdbuf -oL "$bin" -c "$RELAY_DIR/zcrelay.yaml") ;;
        zcrelay-*)
            # stdbuf: "zcrelay: ready" must reach the file at once though stdout is no tty.
            argv=(stdbuf -oL "$bin" --listen "127.0.0.1:$RELAY_PORT" --upstream "127.0.0.1:$up"
                --mode "${name#zcrelay-}" --workers "$threads" --metrics off) ;;
        haproxy-*)
            _relay_fill "$RELAYS_SH_DIR/peers/$name.cfg" "$RELAY_DIR/haproxy.cfg" \
                "$RELAY_PORT" "$up" "$RELAY_DIR" || { _relay_log "$name: $RELAY_ERR"; return 1; }
            # -db: foreground and one process, so $! is HAProxy itself.
            argv=(haproxy -db -f "$RELAY_DIR/haproxy.cfg") ;;
        nginx|nginx-halfclose)
            local tpl=nginx-stream
            [[ "$name" == nginx-halfclose ]] && tpl=nginx-stream-halfclose
            _relay_fill "$RELAYS_SH_DIR/peers/$tpl.conf" "$RELAY_DIR/nginx.conf" \
                "$RELAY_PORT" "$up" "$RELAY_DIR" || { _relay_log "$name: $RELAY_ERR"; return 1; }
            RELAY_LOG="$RELAY_DIR/error.log"
            # -e: the error log nginx opens before it reads the config (default /var/log/...).
            argv=(nginx -p "$RELAY_DIR/" -c "$RELAY_DIR/nginx.conf" -e "$RELAY_DIR/error.log") ;;
        socat)
            # backlog=1024: socat's default of 5 resets connections at 50 simultaneous
            # connects. fork: one child per connection, so it serves more than one.
            argv=(socat "TCP-LISTEN:$RELAY_PORT,bind=127.0.0.1,reuseaddr,fork,backlog=1024"
                "TCP:127.0.0.1:$up") ;;
    esac
    RELAY_CMD="taskset -c $cpu ${argv[*]}"

    # taskset and stdbuf exec, so $! is the relay itself; its threads and children inherit
    # the CPU.
    taskset -c "$cpu" "${argv[@]}" >"$RELAY_DIR/output.log" 2>&1 </dev/null &
    RELAY_PID=$!
    _RELAY_SHELL=$BASHPID
    if declare -p OWN_PIDS >/dev/null 2>&1; then OWN_PIDS+=("$RELAY_PID"); fi

    local ready_timeout=${RELAY_READY_TIMEOUT:-10}
    local deadline=$((SECONDS + ready_timeout))
    until _relay_ready "$name"; do
        if ! is_alive "$RELAY_PID" || ((SECONDS >= deadline)); then
            local why="" rc
            if is_alive "$RELAY_PID"; then
                why="not listening on 127.0.0.1:$RELAY_PORT within ${ready_timeout}s"
                [[ "$name" == zcrelay-* ]] && why="no 'zcrelay: ready' within ${ready_timeout}s"
            else
                rc=0
                wait "$RELAY_PID" 2>/dev/null || rc=$?
                why="exited with status $rc"
            fi
            local logs="log $RELAY_LOG: $(_relay_tail "$RELAY_LOG")"
            [[ "$RELAY_LOG" == "$RELAY_DIR/output.log" ]] ||
                logs+="; output $RELAY_DIR/output.log: $(_relay_tail "$RELAY_DIR/output.log")"
            RELAY_ERR="$name did not start ($why); $logs"
            _relay_log "$RELAY_ERR"
            stop_relay >/dev/null 2>&1 || true
            RELAY_PORT=""
            return 1
        fi
        sleep 0.05
    done
}

# _relay_expected_rc NAME: the exit status NAME has after a SIGTERM when all is well, and why.
_relay_expected_rc() {
    case "$1" in
        haproxy-*) echo "143 SIGTERM is HAProxy's hard stop: the process ends by the signal" ;;
        socat) echo "143 socat exits with 128 + 15 on SIGTERM" ;;
        *) echo "0 " ;;   # zcrelay drains and exits 0; nginx's master stops its worker, exits 0
    esac
}

stop_relay() {
    RELAY_RC="" RELAY_STOP_NOTE="" RELAY_STOP_ERR=""
    local pid=${RELAY_PID:-} name=${RELAY_NAME:-}
    [[ -n "$pid" ]] || return 0

    # Who was in the tree before the signal: children may outlive their parent (socat's
    # per-connection forks are re-parented to init and run on), and they are ours to stop.
    local -a snap=()
    local p st
    _relay_scan "$pid"
    for p in "${_RELAY_TREE[@]}"; do
        [[ "$p" == "$pid" ]] && continue
        st=$(_relay_starttime "$p") && snap+=("$p:$st")
    done

    local killed=0 stop_timeout=${RELAY_STOP_TIMEOUT:-10}
    if ! is_alive "$pid"; then
        RELAY_STOP_ERR="$name had exited before stop_relay"
    else
        kill -TERM "$pid" 2>/dev/null || true
        local left_s=$stop_timeout half=$(((stop_timeout + 1) / 2))
        # zcrelay drains live connections for up to its drain_timeout (30 s) on SIGTERM, where
        # HAProxy and nginx close them at once; a second SIGTERM is its "close everything now".
        if [[ "$name" == zcrelay-* ]] && ! wait_gone "$pid" "$half"; then
            kill -TERM "$pid" 2>/dev/null || true
            RELAY_STOP_NOTE="still draining connections after ~$half s: second SIGTERM"
            left_s=$((stop_timeout - half > 0 ? stop_timeout - half : 1))
        fi
        if ! wait_gone "$pid" "$left_s"; then
            kill -KILL "$pid" 2>/dev/null || true
            wait_gone "$pid" 5 || true
            killed=1
            RELAY_STOP_ERR="$name did not exit within ${stop_timeout}s of SIGTERM: SIGKILLed"
        fi
    fi
    if [[ "${_RELAY_SHELL:-}" == "$BASHPID" ]]; then
        RELAY_RC=0
        wait "$pid" 2>/dev/null || RELAY_RC=$?
    else
        RELAY_RC="unknown"   # not our child: started from another (sub)shell
    fi
    if [[ -n "$RELAY_STOP_ERR" && "$RELAY_STOP_ERR" == *"before stop_relay" ]]; then
        RELAY_STOP_ERR+=" (status $RELAY_RC)"
    elif ((!killed)) && [[ "$RELAY_RC" != unknown ]]; then
        local expect note
        read -r expect note <<<"$(_relay_expected_rc "$name")"
        if [[ "$RELAY_RC" != "$expect" ]]; then
            RELAY_STOP_ERR="$name exited with status $RELAY_RC after SIGTERM (expected $expect)"
        elif ((RELAY_RC != 0)); then
            RELAY_STOP_NOTE+="${RELAY_STOP_NOTE:+; }$note"
        fi
    fi

    # What outlived the relay: a grace period to finish on its own, then SIGTERM, SIGKILL.
    local -a left=()
    local entry tries=0
    while :; do
        left=()
        for entry in "${snap[@]}"; do
            p=${entry%%:*}
            [[ "$(_relay_starttime "$p" 2>/dev/null)" == "${entry#*:}" ]] && is_alive "$p" &&
                left+=("$p")
        done
        ((${#left[@]} && tries < 40)) || break   # 40 x 0.05 s
        tries=$((tries + 1))
        sleep 0.05
    done
    if ((${#left[@]})); then
        kill -TERM "${left[@]}" 2>/dev/null || true
        local n_killed=0
        for p in "${left[@]}"; do
            wait_gone "$p" 3 || { kill -KILL "$p" 2>/dev/null || true; n_killed=$((n_killed + 1)); }
        done
        local what="${#left[@]} process(es) of its tree still ran 2 s after it: SIGTERMed"
        if ((n_killed)); then
            RELAY_STOP_ERR+="${RELAY_STOP_ERR:+; }$what, $n_killed SIGKILLed"
        else
            RELAY_STOP_NOTE+="${RELAY_STOP_NOTE:+; }$what"
        fi
    fi

    [[ -z "$RELAY_STOP_ERR" ]] || _relay_log "$RELAY_STOP_ERR"
    if declare -p OWN_PIDS >/dev/null 2>&1; then
        local -a keep=()
        for p in "${OWN_PIDS[@]}"; do [[ "$p" == "$pid" ]] || keep+=("$p"); done
        OWN_PIDS=("${keep[@]}")
    fi
    RELAY_PID=""
    return 0
}
