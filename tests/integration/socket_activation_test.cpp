// systemd socket activation through the real binary: the relay listens on the sockets a service
// manager passes (LISTEN_FDS, LISTEN_PID), matched to its listeners by address, and a restart
// under a manager that keeps the socket refuses nothing.
//
// Two managers: systemd's own systemd-socket-activate (it binds, waits for the first connection,
// then execs the relay with the socket as fd 3), and this test process playing systemd's part
// across a restart: it holds the listening socket, and each relay it starts gets it as fd 3
// through bash, which sets LISTEN_PID to its own pid and execs the relay in place.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::socket_activation_test {
namespace {

constexpr Millis kDeadline{10'000};

// One short exchange through the relay: 8 bytes echoed. Empty, or what went wrong.
std::string exchange(uint16_t port) {
    return echoExchange("127.0.0.1", port, Millis{5'000}, kDeadline);
}

RelayConfig configOn(uint16_t port, const ScriptedUpstream& up) {
    RelayConfig config = singleListenerConfig(up.hostPort(), "splice");
    config.listeners[0].listen = "127.0.0.1:" + std::to_string(port);
    return config;
}

// systemd-socket-activate binds the port, waits for a connection, then execs the relay with the
// socket as fd 3: the relay takes it for its listener instead of binding its own, and the
// connection that woke it, queued while it started, is served.
TEST(SocketActivationTest, TheRelayListensOnTheSocketSystemdPasses) {
    auto activate = findExecutable("systemd-socket-activate");
    ASSERT_TRUE(activate) << "systemd-socket-activate comes with Debian's systemd package";
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_TRUE(up.ok()) << up.error();
    RelayProcess relay;
    std::string first;
    ASSERT_TRUE(startOnFreeLoopbackPort(AF_INET, [&](uint16_t port, std::string& why) {
        relay.setLaunchPrefix({*activate, "-l", "127.0.0.1:" + std::to_string(port)});
        // The first connection is what makes systemd-socket-activate exec the relay.
        std::thread waker([&] {
            if (waitUntil([&] { return listensOnLoopback4(port); }, kDeadline))
                first = exchange(port);
            else
                first = "systemd-socket-activate never listened";
        });
        ::testing::AssertionResult started = relay.start(configOn(port, up));
        waker.join();
        if (started) return PortLaunch::Up;
        why = started.message();
        return PortLaunch::Failed;
    }));
    EXPECT_EQ(first, "") << "the connection queued before the relay started";
    EXPECT_NE(relay.stderrText().find("listening on the socket systemd passed"), std::string::npos)
        << relay.stderrText();
    EXPECT_EQ(loopbackListeners4(relay.port()), 1) << "the relay bound no socket of its own";
    for (int i = 0; i < 20; ++i) EXPECT_EQ(exchange(relay.port()), "") << "exchange " << i;
}

// The test keeps the listening socket, as systemd does with a .socket unit, and restarts the
// relay under a client that keeps connecting: the first relay drains on SIGTERM, the next takes
// the same socket, and every connection that arrived in between waited in its queue. None is
// refused or reset, and both relays served some.
TEST(SocketActivationTest, ARestartUnderAKeptSocketRefusesNothing) {
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_TRUE(up.ok()) << up.error();
    Listening kept = listenLoopback(AF_INET, 1024);
    ASSERT_TRUE(kept.fd) << kept.error;
    // Inherited by the shells below, as a service manager's socket is by the service.
    int flags = ::fcntl(kept.fd.get(), F_GETFD);
    ASSERT_EQ(::fcntl(kept.fd.get(), F_SETFD, flags & ~FD_CLOEXEC), 0);
    const std::string n = std::to_string(kept.fd.get());
    const std::vector<std::string> as_systemd = {
        "/bin/bash", "-c", "exec 3<&" + n + " " + n + "<&-; LISTEN_FDS=1 LISTEN_PID=$$ exec \"$@\"",
        "sh"};
    const RelayConfig config = configOn(kept.port, up);

    RelayProcess first;
    first.setLaunchPrefix(as_systemd);
    ASSERT_TRUE(first.start(config));
    constexpr int kConnections = 300;
    std::atomic<int> done{0};
    std::atomic<bool> stop{false};
    std::vector<std::string> failures;
    std::thread client([&] {
        for (int i = 0; i < kConnections && !stop; ++i, ++done) {
            std::string e = exchange(kept.port);
            if (!e.empty()) failures.push_back("connection " + std::to_string(i) + ": " + e);
        }
    });
    // Joined however the case ends (a failed ASSERT returns early).
    struct Join {
        std::thread& t;
        std::atomic<bool>& stop;
        ~Join() {
            stop = true;
            if (t.joinable()) t.join();
        }
    } join{client, stop};
    ASSERT_TRUE(waitUntil([&] { return done.load() >= 50; }, Millis{30'000}));
    ExitStatus stopped = first.terminate();
    EXPECT_TRUE(stopped.cleanExit()) << stopped.describe();
    RelayProcess second;
    second.setLaunchPrefix(as_systemd);
    ASSERT_TRUE(second.start(config));
    client.join();
    ::fcntl(kept.fd.get(), F_SETFD, flags);
    EXPECT_EQ(done.load(), kConnections);
    EXPECT_TRUE(failures.empty()) << failures.size() << " failed, the first: " << failures[0];
    EXPECT_TRUE(second.waitForMetric(
        metric::kConnectionsTotal, metric::listener(), [](double v) { return v > 0; },
        "the second relay served connections"));
    EXPECT_EQ(loopbackListeners4(kept.port), 1);
}

// Bad input from the manager: a passed fd that is no listening socket stops the start with an
// error naming it; variables meant for another process (LISTEN_PID not the relay's) are ignored.
TEST(SocketActivationTest, WhatWasPassedIsCheckedBeforeItIsUsed) {
    const std::string relay =
        std::string(kRelayBinary) + " --listen 127.0.0.1:0 --upstream 127.0.0.1:9 --metrics off";
    CommandResult file = runCommand(
        {"/bin/bash", "-c", "exec 3</dev/null; LISTEN_FDS=1 LISTEN_PID=$$ exec " + relay},
        kDeadline);
    EXPECT_FALSE(file.status.cleanExit()) << file.describe();
    EXPECT_NE(file.err.find("LISTEN_FDS: fd 3 is not a TCP socket over IPv4 or IPv6"),
              std::string::npos)
        << file.describe();
    CommandResult count =
        runCommand({"/bin/bash", "-c", "LISTEN_FDS=two LISTEN_PID=$$ exec " + relay}, kDeadline);
    EXPECT_NE(count.err.find("LISTEN_FDS: \"two\" is not a count"), std::string::npos)
        << count.describe();
    // Meant for someone else: the relay starts on its own socket (and is stopped at once).
    CommandResult other =
        runCommand({"/bin/bash", "-c",
                    "exec 3</dev/null; LISTEN_FDS=1 LISTEN_PID=1 timeout -s TERM 2 " + relay},
                   kDeadline);
    EXPECT_NE(other.out.find("zcrelay: ready"), std::string::npos) << other.describe();
}

}  // namespace
}  // namespace zcrelay::test::socket_activation_test
