// The socket options the relay sets on the sockets of a relayed connection, read off its own
// sockets: notsent_lowat (and its reload), and the upstream socket's per-socket port range.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "integration/relay_fixture.hpp"

namespace zcrelay::test::relay_test {
namespace {

// notsent_lowat reaches both sockets of a relayed connection in splice and copy mode, and stays
// off in sockmap mode (where the kernel's psock worker sends). Read off the relay's own sockets:
// pidfd_getfd duplicates each into this process, where getsockopt can ask.
class NotsentLowatTest : public RelayModeTest {
  protected:
    // TCP_NOTSENT_LOWAT of every relay socket whose peer is on one of `peer_ports`.
    std::vector<int> lowatsOfSocketsTo(const std::vector<uint16_t>& peer_ports) {
        std::vector<int> found;
        for (const Fd& fd : relaySocketsTo(relay_.pid(), peer_ports)) {
            int lowat = -1;
            socklen_t olen = sizeof lowat;
            ::getsockopt(fd.get(), IPPROTO_TCP, TCP_NOTSENT_LOWAT, &lowat, &olen);
            found.push_back(lowat);
        }
        return found;
    }

    void expectLowat(const std::string& extra_yaml, int want) {
        ScriptedUpstream up(AF_INET, echoScript());
        ASSERT_NO_FATAL_FAILURE(startRelay(
            up, mode(), [&](RelayConfig& c) { c.listeners.at(0).extra_yaml = extra_yaml; }));
        ASSERT_NO_FATAL_FAILURE(expectLowatOfNextConnection(up, want));
    }

    // One more connection through the running relay: both its sockets have `want`.
    void expectLowatOfNextConnection(const ScriptedUpstream& up, int want) {
        Connected client = connectClient();
        ASSERT_TRUE(client.fd) << client.error;
        // One echo: the upstream connection exists once the bytes came back.
        std::vector<uint8_t> msg(64, 'x'), back(64);
        ASSERT_TRUE(writeAll(client.fd.get(), msg.data(), msg.size()).ok());
        ASSERT_TRUE(readExactly(client.fd.get(), back.data(), back.size()).ok());
        sockaddr_in local{};
        socklen_t len = sizeof local;
        ::getsockname(client.fd.get(), reinterpret_cast<sockaddr*>(&local), &len);
        std::vector<int> lowats = lowatsOfSocketsTo({ntohs(local.sin_port), up.port()});
        ASSERT_EQ(lowats.size(), 2u) << "the relay's client-side and upstream-side sockets";
        EXPECT_EQ(lowats[0], want);
        EXPECT_EQ(lowats[1], want);
    }

    int expectedDefault() const { return mode() == "sockmap" ? 0 : 128 * 1024; }
};

TEST_P(NotsentLowatTest, DefaultIsSetOnBothSocketsOutsideSockmap) {
    ASSERT_NO_FATAL_FAILURE(expectLowat("", expectedDefault()));
}

TEST_P(NotsentLowatTest, ConfiguredValueIsSetOutsideSockmap) {
    ASSERT_NO_FATAL_FAILURE(
        expectLowat("    notsent_lowat: 256KiB\n", mode() == "sockmap" ? 0 : 256 * 1024));
}

TEST_P(NotsentLowatTest, ZeroLeavesItUnset) {
    ASSERT_NO_FATAL_FAILURE(expectLowat("    notsent_lowat: 0\n", 0));
}

// The client socket gets its options from the listening socket it was accepted on (the kernel
// copies the listener), and a reload keeps that socket: the reload must set them on it anew.
TEST_P(NotsentLowatTest, AReloadReachesTheClientSocketsAcceptedAfterIt) {
    ScriptedUpstream up(AF_INET, echoScript());
    RelayConfig config = singleListenerConfig(up.hostPort(), mode(), up.family());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    ASSERT_NO_FATAL_FAILURE(expectLowatOfNextConnection(up, expectedDefault()));
    config.listeners.at(0).extra_yaml = "    notsent_lowat: 256KiB\n";
    ASSERT_TRUE(relay_.reload(config.yaml()));
    ASSERT_NO_FATAL_FAILURE(expectLowatOfNextConnection(up, mode() == "sockmap" ? 0 : 256 * 1024));
}

INSTANTIATE_TEST_SUITE_P(Modes, NotsentLowatTest, ::testing::ValuesIn(kModes), modeName);

// Every upstream socket carries a per-socket local port range (the system's whole range), which
// makes connect() search the ephemeral ports in order rather than even ports first: at high
// connection rates toward one backend, where the relay's own TIME_WAIT ports pile up, that
// search was 17 % of its CPU (proxy/upstream.cpp). Read off the relay's own socket.
class UpstreamPortSearchTest : public RelayModeTest {};

TEST_P(UpstreamPortSearchTest, TheUpstreamSocketHasAPerSocketPortRange) {
    constexpr int kIpLocalPortRange = 51;  // linux/in.h
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    std::vector<uint8_t> msg(64, 'x'), back(64);
    ASSERT_TRUE(writeAll(client.fd.get(), msg.data(), msg.size()).ok());
    ASSERT_TRUE(readExactly(client.fd.get(), back.data(), back.size()).ok());
    std::vector<Fd> sockets = relaySocketsTo(relay_.pid(), {up.port()});
    ASSERT_EQ(sockets.size(), 1u) << "the relay's upstream-side socket";
    uint32_t range = 0;
    socklen_t len = sizeof range;
    ASSERT_EQ(::getsockopt(sockets[0].get(), IPPROTO_IP, kIpLocalPortRange, &range, &len), 0)
        << strerror(errno);
    EXPECT_EQ(range, 0xffff0000u) << "low 0 and high 65535: the sysctl's own bounds";
}

// Set on the socket before its connect, before any data path: splice only.
INSTANTIATE_TEST_SUITE_P(Modes, UpstreamPortSearchTest, ::testing::Values("splice"), modeName);

}  // namespace
}  // namespace zcrelay::test::relay_test
