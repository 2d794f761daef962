#pragma once
// Every test process runs in a network namespace of its own (test_main.cpp calls isolate()
// before any thread exists). ctest starts each case as its own process, so each case gets its
// own loopback, port space, TIME_WAIT table, conntrack, iptables and net.* sysctls: cases
// running side by side (ctest -j) cannot see each other's sockets or exhaust each other's
// ports, and a case's rules and TIME_WAITs vanish with its namespace. What is not per namespace
// (fs.pipe-user-pages-*, a runner's rlimits) is set on a case's own child (prlimit) or guarded
// by a ctest RESOURCE_LOCK (tests/CMakeLists.txt).
//
// ZCRELAY_TEST_HOST_NET=1 runs on the host's network instead, for debugging with tcpdump or ss
// from another shell. Without it, a process that could not get a namespace of its own (not
// root) refuses to start a relay (RelayProcess says why) rather than share the host's.
#include <string>

namespace zcrelay::test {

enum class NetScope {
    Private,      // a namespace of its own, lo up, sysctls set
    Host,         // asked for: ZCRELAY_TEST_HOST_NET=1
    Unavailable,  // could not unshare: why() says
};

struct Isolation {
    NetScope scope = NetScope::Unavailable;
    std::string why;  // Unavailable: what failed
};

// Unshares the network namespace, brings lo up and widens the ephemeral port range. Call once,
// before any thread is started: unshare(CLONE_NEWNET) moves only the calling thread.
const Isolation& isolate();
// What isolate() came to (Unavailable with "not called" before it ran).
const Isolation& isolation();
// An empty string when a relay may start here, else the error to fail the case with.
std::string relayRefusal();

}  // namespace zcrelay::test
