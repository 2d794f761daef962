// When a sockmap listener or connection runs splice instead: a program that cannot load, and a
// client whose FIN came before the upstream connect.
#include <gtest/gtest.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "integration/sockmap_fixture.hpp"

namespace zcrelay::test::sockmap_test {
namespace {

// =============================================================================================
// The two fallbacks to splice: a listener whose program cannot load, a connection the
// kernel would not take.

// Bit `cap` of the hex capability mask on the "CapEff:" line of /proc/PID/status.
std::optional<bool> hasEffectiveCap(pid_t pid, int cap) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("CapEff:", 0) != 0) continue;
        uint64_t mask = std::strtoull(line.c_str() + 7, nullptr, 16);
        return ((mask >> cap) & 1) != 0;
    }
    return std::nullopt;
}

TEST_F(SockmapTest, FallsBackToSpliceWhenBpfCannotLoad) {
    constexpr int kCapBpf = 39;
    if (::geteuid() != 0) GTEST_SKIP() << "dropping capabilities from a bounding set needs root";
    auto setpriv = findExecutable("setpriv");
    if (!setpriv) GTEST_SKIP() << "util-linux setpriv is not installed";
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_TRUE(up.ok()) << up.error();
    // Without these the bpf() syscall answers EPERM: the relay must run splice instead.
    relay_.setLaunchPrefix({*setpriv, "--bounding-set", "-bpf,-sys_admin,-perfmon,-net_admin",
                            "--inh-caps=-all", "--"});
    ASSERT_TRUE(relay_.start(singleListenerConfig(up.hostPort(), "sockmap")));
    EXPECT_EQ(hasEffectiveCap(relay_.pid(), kCapBpf), std::optional<bool>(false))
        << "setpriv should have left the relay without CAP_BPF";

    std::vector<std::string> unavailable;
    std::istringstream log(relay_.stderrText());
    for (std::string line; std::getline(log, line);) {
        if (line.find("unavailable") != std::string::npos) unavailable.push_back(line);
    }
    ASSERT_EQ(unavailable.size(), 1u) << "exactly one line must say sockmap is unavailable\n"
                                      << relay_.diagnostics();
    const std::string& line = unavailable[0];
    std::cout << "[ sockmap  ] " << line << "\n";
    EXPECT_NE(line.find("listener t"), std::string::npos) << line;
    EXPECT_NE(line.find("sockmap"), std::string::npos) << line;
    EXPECT_NE(line.find("splice"), std::string::npos) << line;
    EXPECT_NE(line.find("not permitted"), std::string::npos)
        << "the line should say why (EPERM without the capabilities): " << line;
    ASSERT_NE(relay_.listener("t"), nullptr);
    EXPECT_EQ(relay_.listener("t")->mode, "splice") << "the startup line shows the running mode";

    auto body = relay_.scrape();
    ASSERT_TRUE(body);
    EXPECT_EQ(findSample(*body, metric::kDatapathInfo, metric::datapath("splice")), 1.0);
    EXPECT_EQ(findSample(*body, metric::kDatapathInfo, metric::datapath("sockmap")), std::nullopt)
        << "a listener runs one data path";

    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    IoResult sent;
    ReceiveCheck got = echoRoundTrip(client.fd.get(), kSeedA, 4 * kMiB, kBulkDeadline, &sent);
    EXPECT_TRUE(sent.ok()) << sent.describe();
    EXPECT_EQ(got.io.status, IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, 4 * kMiB) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();
    client.fd.reset();
    expectClosed(4 * kMiB, 4 * kMiB, 1);
    expectNoFallbacks();  // a splice listener has no sockmap connections to fall back
}

TEST_F(SockmapTest, NotEstablishedFallsBackToSplice) {
    constexpr uint64_t kRequest = 16 * kKiB;  // fits the relay's receive window unread
    constexpr uint64_t kResponse = kMiB;
    if (::geteuid() != 0) GTEST_SKIP() << "adding an iptables rule needs root";
    auto iptables = findExecutable("iptables");
    if (!iptables) GTEST_SKIP() << "iptables is not installed";
    ScriptedUpstream up(AF_INET, sinkScript(kSeedB, kResponse));
    ASSERT_NO_FATAL_FAILURE(startRelay(up));

    // The relay's SYNs to the upstream vanish until the rule goes; the first retransmission
    // (about 1 s after the SYN) then connects.
    std::optional<SynDropRule> rule;
    rule.emplace(*iptables, up.port());
    ASSERT_TRUE(rule->added()) << rule->error();
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    IoResult sent = sendPayload(client.fd.get(), kSeedA, kRequest, kPrompt);
    ASSERT_TRUE(sent.ok()) << sent.describe();
    ASSERT_EQ(::shutdown(client.fd.get(), SHUT_WR), 0);
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsTotal, metric::listener(), 1));
    // The FIN is acknowledged (FIN_WAIT2): it is in the relay's socket before the connect ends.
    tcp_info info{};
    bool fin_acked = waitUntil(
        [&] {
            socklen_t len = sizeof info;
            return ::getsockopt(client.fd.get(), IPPROTO_TCP, TCP_INFO, &info, &len) == 0 &&
                   info.tcpi_state == TCP_FIN_WAIT2;
        },
        kPrompt, Millis{5});
    ASSERT_TRUE(fin_acked) << "client tcpi_state " << int{info.tcpi_state};
    EXPECT_EQ(up.accepted(), 0u) << "the upstream connect must still be pending";
    rule.reset();

    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeedB, Millis{10'000});
    EXPECT_EQ(got.io.status, IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, kResponse) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();
    ASSERT_TRUE(up.waitForFinished(1, Millis{15'000}));
    ConnRecord rec = up.records().at(0);
    EXPECT_EQ(rec.read_end.status, IoStatus::Eof) << rec.describe();
    EXPECT_EQ(rec.bytes_received, kRequest) << rec.describe();
    EXPECT_EQ(rec.received_hash, payloadHash(kSeedA, kRequest)) << rec.describe();
    client.fd.reset();
    expectClosed(kRequest, kResponse, 1);
    Counts counts = fallbacks();
    EXPECT_EQ(counts.count("not_established") != 0 ? counts["not_established"] : -1, 1.0)
        << "the one connection whose client FIN came before the upstream connect: "
        << describe(counts);
    counts.erase("not_established");
    expectNoFallbacks(counts);
}

}  // namespace
}  // namespace zcrelay::test::sockmap_test
