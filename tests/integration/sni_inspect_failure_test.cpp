// ClientHello inspections that fail (not TLS, too large, malformed, no SNI, no route, a silent
// client's timeout): the default route takes them with the client's bytes unchanged; without
// one they are closed, as no_route.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <functional>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "integration/sni_fixture.hpp"

namespace zcrelay::test::sni_routing_test {
namespace {

// =============================================================================================
// 2. Inspections that fail: the default route takes them with the bytes unchanged; without one
// they are closed, as no_route.

struct RawCase {
    std::string name;
    std::function<std::optional<std::string>(const Tools&, std::string&)> bytes;
    std::string reason;  // zcrelay_inspect_failures_total{reason}
};

std::optional<std::string> bankHello(const Tools& tools, const HelloSpec& spec,
                                     std::string& error) {
    return HelloBank::get(tools, spec, error);
}

std::vector<RawCase> rawCases() {
    auto fixed = [](std::string s) {
        return [s](const Tools&, std::string&) -> std::optional<std::string> { return s; };
    };
    // A record announcing 16 KiB of a ClientHello of 16380 bytes, and 1200 bytes of it: more than
    // inspect_max_size (1 KiB here) before the hello could be complete.
    std::string too_large =
        std::string("\x16\x03\x01\x40\x00\x01\x00\x3f\xfc\x03\x03", 11) + std::string(1200, '\x5a');
    // A valid record header, then bytes that are no handshake message at all.
    std::string garbage = std::string("\x16\x03\x01\x00\x20", 5) + std::string(32, '\xee');
    // A complete ClientHello record whose session id claims 255 bytes of the 7 that follow.
    std::string bad_session = std::string("\x16\x03\x01\x00\x2e\x01\x00\x00\x2a\x03\x03", 11) +
                              std::string(32, '\x11') + std::string("\xff", 1) +
                              std::string(7, '\x22');
    return {
        {"plain_http", fixed("GET / HTTP/1.0\r\n\r\n"), "not_tls"},
        {"ssh_banner", fixed("SSH-2.0-OpenSSH_9.2\r\n"), "not_tls"},
        {"too_large", fixed(too_large), "too_large"},
        {"garbage_after_header", fixed(garbage), "malformed"},
        {"session_id_overrun", fixed(bad_session), "malformed"},
        {"no_sni",
         [](const Tools& t, std::string& e) {
             return bankHello(t, {"nosni", "s_client", {std::nullopt, ""}}, e);
         },
         "no_sni"},
        {"no_route",
         [](const Tools& t, std::string& e) {
             return bankHello(t, {"other", "s_client", {"other.example.test", "h2"}}, e);
         },
         "no_route"},
    };
}

class InspectFailureTest : public SniFixture, public ::testing::TestWithParam<std::string> {
  protected:
    // Listener t has the default route, listener n has none; both take at most 1 KiB of hello
    // and wait for it at most 1 s.
    void SetUp() override {
        SKIP_WITHOUT_TOOLS(tools_, false, false);
        std::string error;
        ASSERT_TRUE(caps_.ok(error)) << error;
        const std::string limits = "    inspect_timeout: 1s\n    inspect_max_size: 1KiB\n";
        ASSERT_NO_FATAL_FAILURE(startRelay(routedConfig(
            caps_.addrs(), {routedListener("t", GetParam(), kRoutes, limits),
                            routedListener("n", GetParam(), kConditionalRoutes, limits)})));
    }
    CaptureSet caps_;
};

TEST_P(InspectFailureTest, FailedInspectionsTakeTheDefaultRoute) {
    for (const RawCase& c : rawCases()) {
        SCOPED_TRACE(c.name);
        std::string error;
        std::optional<std::string> bytes = c.bytes(tools_, error);
        ASSERT_TRUE(bytes) << error;
        Landing l = caps_.through(relay_.port("t"), {*bytes}, kSecondFlight);
        EXPECT_EQ(l.note, "");
        EXPECT_EQ(l.backend, "fallback") << l.note;
        ASSERT_TRUE(l.bytes) << l.note;
        const std::string sent = *bytes + kSecondFlight;
        EXPECT_EQ(*l.bytes, sent) << "the default backend must get the client's bytes unchanged; "
                                  << firstDifference(*l.bytes, sent);
        count("fallback", c.reason);
    }
    EXPECT_EQ(caps_.api.accepted() + caps_.apps.accepted(), 0u);
    EXPECT_TRUE(relay_.waitForMetric(std::string(kInspectSeconds) + "_count", metric::listener(),
                                     routed()));
}

TEST_P(InspectFailureTest, FailedInspectionsWithoutDefaultAreClosed) {
    double closed = 0;
    for (const RawCase& c : rawCases()) {
        SCOPED_TRACE(c.name);
        std::string error;
        std::optional<std::string> bytes = c.bytes(tools_, error);
        ASSERT_TRUE(bytes) << error;
        expectClosedWithoutBackend(relay_.port("n"), *bytes);
        count("", c.reason, "n");
        EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason(kNoRouteClose, "n"),
                                         ++closed))
            << relay_.diagnostics();
    }
    EXPECT_EQ(caps_.total(), 0u) << "a connection without a route never reaches a backend";
    EXPECT_EQ(relay_.metric(kRouteSelections, metric::listener("n")).value_or(0), 0);
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener("n"), 0));
}

// inspect_timeout 1s: a client that sends nothing, or half a hello, is inspected for that long
// and no less; then the default route takes it (and the bytes it sends from then on, or had sent
// already), or, on n, it is closed.
TEST_P(InspectFailureTest, SilentClientsTimeOut) {
    std::string error;
    std::optional<std::string> hello =
        HelloBank::get(tools_, {"api_h2", "s_client", {"api.example.test", "h2,http/1.1"}}, error);
    ASSERT_TRUE(hello) << error;
    const std::string half = hello->substr(0, 100);

    Connected silent = connectTo("127.0.0.1", relay_.port("t"));
    Connected partial = connectTo("127.0.0.1", relay_.port("t"));
    Connected unrouted = connectTo("127.0.0.1", relay_.port("n"));
    ASSERT_TRUE(silent.fd && partial.fd && unrouted.fd);
    ASSERT_TRUE(writeAll(partial.fd.get(), half.data(), half.size(), kIo).ok());

    std::this_thread::sleep_for(kNotYet);
    EXPECT_EQ(relay_.metric(kInspectFailures, metric::reason("timeout")).value_or(0), 0)
        << "timed out before inspect_timeout";
    EXPECT_EQ(caps_.total(), 0u) << "routed before the inspection ended";

    failures_[{"t", "timeout"}] = 2;
    failures_[{"n", "timeout"}] = 1;
    routes_[{"t", "fallback"}] = 2;
    expectCounters();

    // Both t clients are on the default backend now: the greeting comes, then their bytes go.
    for (Connected* c : {&silent, &partial}) {
        char g = 0;
        IoResult r = readExactly(c->fd.get(), &g, 1, kIo);
        EXPECT_TRUE(r.ok() && g == kGreeting) << r.describe();
    }
    const std::string late = "late bytes\n";
    const std::string rest = hello->substr(half.size());
    ASSERT_TRUE(writeAll(silent.fd.get(), late.data(), late.size(), kIo).ok());
    ASSERT_TRUE(writeAll(partial.fd.get(), rest.data(), rest.size(), kIo).ok());
    ::shutdown(silent.fd.get(), SHUT_WR);
    ::shutdown(partial.fd.get(), SHUT_WR);
    ASSERT_EQ(caps_.fallback.accepted(), 2u);
    std::optional<std::string> a = caps_.fallback.bytes(0), b = caps_.fallback.bytes(1);
    ASSERT_TRUE(a && b);
    std::multiset<std::string> got = {*a, *b}, want = {late, *hello};
    EXPECT_EQ(got, want) << "the default backend gets what each client sent, unchanged";
    EXPECT_EQ(caps_.api.accepted(), 0u) << "a hello completed after the timeout is not inspected";

    IoResult end = waitForPeerClose(unrouted.fd.get(), kIo);
    EXPECT_TRUE(endedByPeer(end)) << end.describe();
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason(kNoRouteClose, "n"), 1));
    // Each timed-out inspection lasted at least the timeout: a floor, never a ceiling.
    std::optional<double> sum =
        relay_.metric(std::string(kInspectSeconds) + "_sum", metric::listener());
    EXPECT_GE(sum.value_or(0), 2 * 0.9) << "two inspections of at least inspect_timeout (1s) each";
}

INSTANTIATE_TEST_SUITE_P(Modes, InspectFailureTest, ::testing::ValuesIn(kHandOffModes), modeName);

}  // namespace
}  // namespace zcrelay::test::sni_routing_test
