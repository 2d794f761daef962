#!/usr/bin/env bash
# The cases that raced before, run again and again while both CPUs are busy:
#
#   tests/stress.sh [BUILD_DIR] [COUNT] [REGEX]
#
# Every case matching REGEX (default: the historically flaky ones below) runs COUNT times
# (default 20) through ctest, several at a time (-j STRESS_JOBS, default 6; each in a network
# namespace of its own), leaving out the cpu-bound cases unless STRESS_CPU_BOUND=1 (one at a
# time, a minute each: run them with a smaller COUNT),
# beside `stress-ng --cpu 2` that this script starts and stops by its PID. A case that fails
# once stops repeating (`--repeat until-fail`) and fails the script, with its output.
#
# The default set, and why each is in it:
#   SendProxyOverrideTest         the backend's accept thread trailed the relay's count (245034b)
#   AReaderPastTheDeadline        the stop hit the reader's vfork window, 1 run in 4 (39e91d3)
#   FullDuplexEchoes              io_uring's poll retried passed-byte recvs, 1 in 10 (8c12dd5)
#   AdminApi.*Ready|AdminDrain    'ready' counted a connection of the running load (44c3b04)
#   DiscoveryScaleTest            the backends' accepts trail the relay's count (6deb047);
#                                 12 tries missed one of 4 backends (3% a run, ASan CI);
#                                 /sockmap: all long-lived ping-pongs of a relay stall at once,
#                                 in every one of 8 parallel copies at the same moment (a
#                                 machine-wide trigger; the kernel logs sockmap WARNs), not
#                                 fixed: see docs/testing.md, "Known sockmap stall"
#   LifetimeTest                  fin timeouts and max_connection_duration: deadlines
#   ControlPlane|Reload           reloads under deadlines, signals during reloads
#   UpstreamResetMidStream        the RST arrived before the client's connect returned (dce4e51)
#   LargeHelloTest                a sockmap answer stalled once under ASan
#   UpgradeUnderLoad|AcceptQueue  a cancelled accept kept the wakeup of its client (bb65e46);
#                                 the old relay's share of a queue varies with timing
#   Handover                      a scrape after the ready line reached the old relay (4885ffa);
#                                 'taken' read before the workers counted it (9998d31)
#   FailoverTest|Checks|SlowStart checks at 100 ms against closes and ramps; none seen racing
#                                 (176 runs 8-wide under ASan), here because they are timing
set -euo pipefail
build=${1:-build}
count=${2:-20}
regex=${3:-'SendProxyOverrideTest|AReaderPastTheDeadline|FullDuplexEchoes|AdminApiTest.*Ready|AdminDrainTest|DiscoveryScaleTest|LifetimeTest|ControlPlane|ReloadTest|UpstreamResetMidStream|LargeHelloTest|UpgradeUnderLoad|AcceptQueue|Handover|FailoverTest|FailoverChecks|FailoverSlowStart'}
command -v stress-ng >/dev/null || { echo "stress.sh: stress-ng is not installed (deploy/install-deps.sh installs it)" >&2; exit 2; }

stress-ng --cpu 2 --timeout 7200 --quiet &
load=$!
trap 'kill "$load" 2>/dev/null; wait "$load" 2>/dev/null || true' EXIT

jobs=${STRESS_JOBS:-6}
leave_out='sanitize|cpu-bound'
[[ ${STRESS_CPU_BOUND:-0} == 1 ]] && leave_out='sanitize'
n=$(ctest --test-dir "$build" -N -R "$regex" -LE "$leave_out" | awk '/^Total Tests:/ {print $3}')
echo "stress.sh: $n cases matching /$regex/, $count runs each, beside stress-ng --cpu 2 (pid $load)"
start=$(date +%s)
status=0
ctest --test-dir "$build" -R "$regex" -LE "$leave_out" -j "$jobs" --repeat "until-fail:$count" \
    --output-on-failure || status=$?
echo "stress.sh: $n cases x $count runs under load: $([[ $status -eq 0 ]] && echo 'no failure' || echo FAILED) in $(( $(date +%s) - start )) s"
exit $status
