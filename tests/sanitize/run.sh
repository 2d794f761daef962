#!/usr/bin/env bash
# ctest's sanitize.KIND: build the relay again with a sanitizer (address = ASan+UBSan, thread =
# TSan) in a tree of its own, and run the unit, kernel and integration tests against it.
#
#   tests/sanitize/run.sh address|thread SOURCE_DIR BUILD_DIR MAIN_TREE
#
# Two parts:
#   - in BUILD_DIR, sanitized: the relay and the cases that run relay code in their own process
#     (unit, kernel, and the HTTP server's, label integration-inprocess);
#   - from MAIN_TREE, the integration cases that drive the relay through its sockets, run
#     against BUILD_DIR's relay (ZCRELAY_TEST_RELAY). Their harness is not sanitized, the relay
#     is. Compiling them again was half of this tree's build; a hand-made sanitizer tree
#     (docs/testing.md, "Sanitizers") still builds and runs them all sanitized.
#
# A report fails the run: a sanitized test binary exits non-zero with one (UBSan aborts: the
# tree builds with -fno-sanitize-recover), and RelayProcess fails any test whose relay printed
# one on stderr, however that relay ended. The soak tests are left out: they measure RSS, which
# a sanitizer's shadow memory and quarantine would swamp.
#
# What the run leaves out is a label on the case, declared beside its code with the reason
# (ZCRELAY_LABEL(..., kSanitizeSkip, "why"), tests/support/labels.hpp), so renaming a case cannot
# change it. `grep -rn kSanitizeSkip tests/` lists them: cases that add volume or wall time but
# no relay code the others do not run (100 MiB transfers, real Prometheus, waits for the
# kernel's timers, sieges that mostly wait for deadlines).
#
# Profiles (ZCRELAY_SANITIZE_PROFILE):
#   ci (default)  leaves out the cases labelled sanitize-skip;
#   full          every unit, kernel and integration case.
#
# The cases run side by side (ctest -j ZCRELAY_SANITIZE_JOBS, default 4 per CPU, as the main
# run): each is a process in a network namespace of its own (tests/support/netns.hpp), and most
# of their time is waiting. At 4 at a time the ASan relay cases took 105 s and 1.1 CPUs; at 8,
# 63 s and the same CPU time. The unit cases are the exception: one process, one ctest, since a
# sanitized process's start cost more than most of them (tests/CMakeLists.txt).
set -euo pipefail
kind=$1 src=$2 tree=$3 main=$4
profile=${ZCRELAY_SANITIZE_PROFILE:-ci}
jobs=${ZCRELAY_SANITIZE_JOBS:-$(( $(nproc) * 4 ))}
case $profile in
    ci) skip='|sanitize-skip' ;;
    full) skip='' ;;
    *) echo "ZCRELAY_SANITIZE_PROFILE=$profile: expected ci or full" >&2; exit 2 ;;
esac

# -g1: line tables are all a report's stack needs. TSan builds at -O1 (it is slow unoptimised,
# and quick to compile). ASan+UBSan builds at -O0: UBSan's checks make -O1 twice as slow to
# compile (config.cpp before its split by job: 67 s of CPU at -O1, 33 s at -O0), its tree was
# the suite's critical path, and what ASan and UBSan find does not need the optimiser (it can
# only hide an access). Asserts stay on. No bench/ tools and no fuzzers: no case here runs them.
case $kind in address) opt=-O0 ;; *) opt=-O1 ;; esac
cmake -S "$src" -B "$tree" -DZCRELAY_SANITIZE="$kind" -DZCRELAY_BUILD_BENCH=OFF \
    -DZCRELAY_RELAY_TESTS=OFF -DZCRELAY_FUZZ=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$opt -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="$opt -g1" \
    >"$tree.configure.log" 2>&1 ||
    { cat "$tree.configure.log"; exit 1; }
cmake --build "$tree" -j"$(nproc)" >"$tree.build.log" 2>&1 ||
    { tail -n 100 "$tree.build.log"; exit 1; }
# second_deadlock_stack: a lock-order report shows where both locks were taken.
export TSAN_OPTIONS="${TSAN_OPTIONS:-second_deadlock_stack=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
echo "sanitize.$kind: profile $profile, $jobs cases at a time"
status=0
# A failure log left by an earlier run would be digested again below.
rm -f "$tree/Testing/Temporary/LastTestsFailed.log" "$tree/relay-cases/Testing/Temporary/LastTestsFailed.log"
echo "sanitize.$kind: the in-process cases, built with the sanitizer"
# The unit cases run as one process here (tests/CMakeLists.txt): it leaves out what -LE would.
ZCRELAY_TEST_LEAVE_OUT=${skip#|} ctest --test-dir "$tree" -j "$jobs" -L 'unit|kernel|integration' ${skip:+-LE "${skip#|}"} \
    --output-on-failure || status=1
# The main tree's cases, from a directory of their own: ctest writes its Testing/ logs beside
# the test file it reads, and the main tree's are the ctest this script runs under.
echo "sanitize.$kind: the main tree's relay cases against $tree/zcrelay"
cases=$tree/relay-cases
mkdir -p "$cases"
printf 'subdirs("%s")\n' "$main/tests" >"$cases/CTestTestfile.cmake"
ZCRELAY_TEST_RELAY="$tree/zcrelay" ZCRELAY_TEST_RELAY_SANITIZED=1 \
    ctest --test-dir "$cases" -j "$jobs" -L integration -LE "soak|inprocess$skip" \
    --output-on-failure || status=1
# The failures once more, last: CI keeps the head and the tail of a long run's output, and
# ctest printed each failing case's output somewhere in the middle (a red run's record once
# showed only the failing case's name).
digest() {
    local dir=$1/Testing/Temporary name
    [[ -s $dir/LastTestsFailed.log ]] || return 0
    while IFS=: read -r _ name; do
        echo "sanitize.$kind: FAILED $name"
        awk -v name="$name" '
            index($0, "Testing: " name) && $0 ~ (name "$") { on = 1; next }
            on && /^<end of output>/ { exit }
            on && /Failure|Which is|Expected|Actual|Value of|ERROR: |SUMMARY: |Timeout|FAILED/ { print "    " $0; if (++n == 40) exit }
        ' "$dir/LastTest.log"
    done <"$dir/LastTestsFailed.log"
}
if [[ $status -ne 0 ]]; then
    digest "$tree"
    digest "$cases"
fi
exit $status
