// systemd socket activation through the real binary: the relay listens on the sockets a service
// manager passes (LISTEN_FDS, LISTEN_PID), matched to its listeners by address, and a restart
// under a manager that keeps the socket refuses nothing (that last under load, in every data path,
// from one binary to the next: takeover_test.cpp, UpgradeUnderLoad's restart cases).
//
// The manager here is systemd's own systemd-socket-activate: it binds, waits for the first
// connection, then execs the relay with the socket as fd 3.
#include <gtest/gtest.h>
#include <sys/socket.h>

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
