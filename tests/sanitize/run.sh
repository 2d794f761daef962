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
#     (README, "Sanitizers") still builds and runs them all sanitized.
#
# A report fails the run: a sanitized test binary exits non-zero with one (UBSan aborts: the
# tree builds with -fno-sanitize-recover), and RelayProcess fails any test whose relay printed
# one on stderr, however that relay ended. The soak tests are left out: they measure RSS, which
# a sanitizer's shadow memory and quarantine would swamp.
#
# Profiles (ZCRELAY_SANITIZE_PROFILE):
#   ci (default)  leaves out the cases that add volume or wall time but no relay code the others
#                 do not run: the 100 MiB transfers and the 60 x 10 MiB sockmap streams (the
#                 same code as their 1-10 MiB siblings, a third of the TSan run), and the real
#                 Prometheus scraping and evaluating (the relay serves the same /metrics to the
#                 harness, which scrapes every 20 ms while bytes flow). Of the SNI and
#                 lifetime tests, the cases that repeat a path the others run, or mostly wait:
#                 the HAProxy cross-check (its time is HAProxy's; the hellos are the split and
#                 real ones the other cases send), the hello split at every byte (344
#                 connections of the wait the record-split cases run), 3 s of a half-closed
#                 connection left alone, and the duration cases that wait for a spread or a
#                 second deadline (the same ending as the download and upload cases). And the
#                 clients that vanish behind an iptables rule: 5 s a case of the kernel's
#                 keepalive and retransmission timers, ending in the idle timeout and the reset
#                 close that other cases run. Of the discovery and runtime API tests, the
#                 scale-under-load and drain cases in copy and sockmap mode (the publish and
#                 drain paths are the splice case's; those data paths run elsewhere), and the
#                 refresh case, which waits for the DNS server's query counts. And the
#                 metrics endpoint's siege (15 s a run, most of it waiting for probes' deadlines
#                 while idle connections hold the endpoint): its HTTP server runs sanitized in
#                 this tree's own HttpServerTest cases, deadlines and eviction included, and every
#                 relay case scrapes the endpoint.
#   full          every unit, kernel and integration case.
set -euo pipefail
kind=$1 src=$2 tree=$3 main=$4
profile=${ZCRELAY_SANITIZE_PROFILE:-ci}
case $profile in
    ci) exclude='100MiB|SequentialBulkUnderTightBound|PrometheusScrape|PrometheusEvaluates'
        exclude+='|SniHaproxyCrossCheck|EverySplitPointLandsByteExact'
        exclude+='|WithoutFinTimeoutsHalfClosed|MaxDurationJitter|MaxDurationCountsFromEach'
        exclude+='|ClientVanishesWithoutFin'
        exclude+='|DiscoveryScaleTest.*/(copy|sockmap)|RefreshFollowsTheTtl|AdminDrainTest.*/(copy|sockmap)'
        exclude+='|EndpointSiege' ;;
    full) exclude='^$' ;;
    *) echo "ZCRELAY_SANITIZE_PROFILE=$profile: expected ci or full" >&2; exit 2 ;;
esac

# -O1 -g1: line tables are all a report's stack needs, and the tree builds in less time than
# RelWithDebInfo's -O2 -g. Asserts stay on. No bench/ tools: no test runs them.
cmake -S "$src" -B "$tree" -DZCRELAY_SANITIZE="$kind" -DZCRELAY_BUILD_BENCH=OFF \
    -DZCRELAY_RELAY_TESTS=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1" \
    >"$tree.configure.log" 2>&1 ||
    { cat "$tree.configure.log"; exit 1; }
cmake --build "$tree" -j"$(nproc)" >"$tree.build.log" 2>&1 ||
    { tail -n 100 "$tree.build.log"; exit 1; }
# second_deadlock_stack: a lock-order report shows where both locks were taken.
export TSAN_OPTIONS="${TSAN_OPTIONS:-second_deadlock_stack=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
echo "sanitize.$kind: profile $profile, leaving out /$exclude/"
status=0
echo "sanitize.$kind: the in-process cases, built with the sanitizer"
ctest --test-dir "$tree" -L 'unit|kernel|integration' -E "$exclude" --output-on-failure || status=1
# The main tree's cases, from a directory of their own: ctest writes its Testing/ logs beside
# the test file it reads, and the main tree's are the ctest this script runs under.
echo "sanitize.$kind: the main tree's relay cases against $tree/zcrelay"
cases=$tree/relay-cases
mkdir -p "$cases"
printf 'subdirs("%s")\n' "$main/tests" >"$cases/CTestTestfile.cmake"
ZCRELAY_TEST_RELAY="$tree/zcrelay" ZCRELAY_TEST_RELAY_SANITIZED=1 \
    ctest --test-dir "$cases" -L integration -LE 'soak|inprocess' -E "$exclude" \
    --output-on-failure || status=1
exit $status
