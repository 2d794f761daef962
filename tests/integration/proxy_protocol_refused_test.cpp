// accept_proxy refusing: malformed headers, a client that sends nothing or half a header, a FIN
// or a close before the header is complete; each closed promptly with its reason, none reaching
// a backend.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "integration/proxy_protocol_fixture.hpp"

namespace zcrelay::test::proxy_protocol_test {
namespace {

// =============================================================================================
// 5. Refused headers: closed promptly, counted by reason, never connected to a backend.

struct BadCase {
    std::string name;
    std::string bytes;   // what the client sends (then it waits)
    std::string reason;  // zcrelay_proxy_protocol_errors_total{reason}
};

std::vector<BadCase> badCases() {
    const std::string a4(8, '\x7f');  // two IPv4 addresses, whatever they are
    const std::string ports("\x01\x02\x03\x04", 4);
    return {
        {"http_request", "GET / HTTP/1.0\r\n\r\n", "not_proxy"},
        {"v1_bad_port", "PROXY TCP4 192.0.2.10 198.51.100.20 99999 80\r\n", "bad_v1"},
        {"v1_bad_address", "PROXY TCP4 192.0.2.300 198.51.100.20 1000 80\r\n", "bad_address"},
        {"v2_bad_version", v2Fixed(0x11, 0x11, 12) + a4 + ports, "bad_v2_version"},
        {"v2_bad_command", v2Fixed(0x22, 0x11, 12) + a4 + ports, "bad_command"},
        {"v2_udp", v2Fixed(0x21, 0x12, 12) + a4 + ports, "bad_family"},
        {"v2_short_block", v2Fixed(0x21, 0x11, 8) + a4, "bad_length"},
        {"v2_bad_tlv", v2Fixed(0x21, 0x11, 12 + 3) + a4 + ports + tlv(0x04, "xy").substr(0, 3),
         "bad_tlv"},
        // 16 + 2000 > proxy_max_size (1 KiB): refused as soon as the length field is in.
        {"v2_over_max_size", v2Fixed(0x21, 0x11, 2000) + a4 + ports + std::string(100, 'x'),
         "too_long"},
    };
}

struct RefuseCase {
    std::string mode;
    BadCase bad;
};

void PrintTo(const RefuseCase& c, std::ostream* os) { *os << c.mode << "/" << c.bad.name; }


// A refused header never reaches a data path: splice only.
std::vector<RefuseCase> refuseCases() { return inModes<RefuseCase>(kSpliceOnly, badCases()); }

class RefusedHeaderFixture : public ProxyFixture {
  protected:
    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void startAcceptRelay(const std::string& mode, const std::string& more_listener_yaml = "") {
        ASSERT_TRUE(up_.ok()) << up_.error();
        ASSERT_NO_FATAL_FAILURE(
            startRelay(clusterConfig(mode, AF_INET, clusterYaml("v2", {up_.hostPort()}),
                                     kAcceptProxy + more_listener_yaml),
                       mode));
    }
    // The relay closed the client within kPrompt (FIN or RST: unread bytes make it a RST).
    void expectClosedPromptly(int fd, Clock::time_point since) {
        IoResult end = waitForPeerClose(fd, kPrompt);
        EXPECT_TRUE(end.status == IoStatus::Eof || end.status == IoStatus::Reset)
            << "the relay must close a client whose header it refuses, promptly; got "
            << end.describe() << " after " << secondsSince(since) << " s";
        EXPECT_EQ(end.bytes, 0u) << "nothing is sent to a refused client";
    }
    void expectCounted(const std::string& reason) {
        EXPECT_TRUE(relay_.waitForMetric(metric::kProxyErrorsTotal, metric::reason(reason), 1))
            << relay_.diagnostics();
        EXPECT_TRUE(
            relay_.waitForMetric(metric::kClosedTotal, metric::reason("proxy_protocol"), 1));
        EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
        EXPECT_EQ(up_.accepted(), 0u) << "a refused client never reaches a backend";
        EXPECT_EQ(relay_.metric(metric::kBytesTotal, metric::bytes("upstream")).value_or(0), 0.0);
    }

    ScriptedUpstream up_{AF_INET, sinkScript()};
};

class RefusedHeaderTest : public RefusedHeaderFixture,
                          public ::testing::TestWithParam<RefuseCase> {};

TEST_P(RefusedHeaderTest, ClosedPromptlyAndCountedByReason) {
    const RefuseCase& c = GetParam();
    ASSERT_NO_FATAL_FAILURE(startAcceptRelay(c.mode));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    Clock::time_point t0 = Clock::now();
    IoResult w = writeAll(client.fd.get(), c.bad.bytes.data(), c.bad.bytes.size(), Millis{5'000});
    ASSERT_TRUE(w.ok()) << w.describe();
    expectClosedPromptly(client.fd.get(), t0);
    expectCounted(c.bad.reason);
}

INSTANTIATE_TEST_SUITE_P(Modes, RefusedHeaderTest, ::testing::ValuesIn(refuseCases()),
                         [](const auto& info) {
                             return info.param.mode + "_" + info.param.bad.name;
                         });

class SlowHeaderTest : public RefusedHeaderFixture, public ::testing::TestWithParam<std::string> {};

// proxy_timeout: 300ms and nothing arrives: closed within ~1 s, counted as timeout.
TEST_P(SlowHeaderTest, NothingSentTimesOut) {
    ASSERT_NO_FATAL_FAILURE(startAcceptRelay(GetParam(), "    proxy_timeout: 300ms\n"));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    Clock::time_point t0 = Clock::now();
    expectClosedPromptly(client.fd.get(), t0);
    expectCounted("timeout");
}

// Half a header and then silence: the same timeout (not a wait for bytes that never come).
TEST_P(SlowHeaderTest, PartialHeaderTimesOut) {
    ASSERT_NO_FATAL_FAILURE(startAcceptRelay(GetParam(), "    proxy_timeout: 300ms\n"));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    Clock::time_point t0 = Clock::now();
    std::string part = "PROXY TCP4 192.0";
    ASSERT_TRUE(writeAll(client.fd.get(), part.data(), part.size(), Millis{5'000}).ok());
    expectClosedPromptly(client.fd.get(), t0);
    expectCounted("timeout");
}

// The client half-closes before its header is complete: eof, promptly (the default 5 s
// proxy_timeout must not be what ends it).
TEST_P(SlowHeaderTest, FinBeforeHeaderCompleteIsEof) {
    ASSERT_NO_FATAL_FAILURE(startAcceptRelay(GetParam()));
    for (const std::string& part : {std::string("PROXY TCP4 192.0"), v2Fixed(0x21, 0x11, 12)}) {
        SCOPED_TRACE(hex(part));
        Connected client = connectClient();
        ASSERT_TRUE(client.fd) << client.error;
        Clock::time_point t0 = Clock::now();
        ASSERT_TRUE(writeAll(client.fd.get(), part.data(), part.size(), Millis{5'000}).ok());
        ::shutdown(client.fd.get(), SHUT_WR);
        expectClosedPromptly(client.fd.get(), t0);
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kProxyErrorsTotal, metric::reason("eof"), 2))
        << relay_.diagnostics();
    EXPECT_EQ(relay_.metric(metric::kProxyErrorsTotal, metric::reason("timeout")).value_or(0), 0);
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("proxy_protocol"), 2));
    EXPECT_EQ(up_.accepted(), 0u);
}

// The client connects and closes without a byte: eof.
TEST_P(SlowHeaderTest, CloseWithoutHeaderIsEof) {
    ASSERT_NO_FATAL_FAILURE(startAcceptRelay(GetParam()));
    {
        Connected client = connectClient();
        ASSERT_TRUE(client.fd) << client.error;
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kProxyErrorsTotal, metric::reason("eof"), 1, kPrompt))
        << "counted promptly, not after proxy_timeout; " << relay_.diagnostics();
    expectCounted("eof");
}

// Timeouts and ends before the header is complete: no data path has started, splice only.
INSTANTIATE_TEST_SUITE_P(Modes, SlowHeaderTest, ::testing::ValuesIn(kSpliceOnly),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace zcrelay::test::proxy_protocol_test
