// SNI routing behind PROXY headers: the client's header (accept_proxy) before the hello, and
// the relay's own (send_proxy) before the client's unchanged bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "integration/sni_fixture.hpp"

namespace zcrelay::test::sni_routing_test {
namespace {

// =============================================================================================
// 5. PROXY headers: accept_proxy (the header first, then the hello) and send_proxy (the relay's
// header, then the client's bytes unchanged).

struct ProxyCase {
    std::string mode;
    std::string version;  // the client's header and the cluster's send_proxy: "v1" | "v2"
};

void PrintTo(const ProxyCase& c, std::ostream* os) { *os << c.mode << "/" << c.version; }

std::vector<ProxyCase> proxyCases() {
    std::vector<ProxyCase> cases;
    for (const auto& m : kHandOffModes)
        for (const char* v : {"v1", "v2"}) cases.push_back({m, v});
    return cases;
}

class ProxyHeaderTest : public SniFixture, public ::testing::TestWithParam<ProxyCase> {};

TEST_P(ProxyHeaderTest, HeaderThenHelloRoutedUnchanged) {
    const ProxyCase& c = GetParam();
    SKIP_WITHOUT_TOOLS(tools_, false, false);
    CaptureSet caps;
    std::string error;
    ASSERT_TRUE(caps.ok(error)) << error;
    ASSERT_NO_FATAL_FAILURE(startRelay(routedConfig(
        caps.addrs(), {routedListener("t", c.mode, kRoutes, "    accept_proxy: true\n")},
        c.version)));
    std::optional<std::string> api =
        HelloBank::get(tools_, {"api_h2", "s_client", {"api.example.test", "h2,http/1.1"}}, error);
    ASSERT_TRUE(api) << error;
    std::optional<std::string> apps =
        HelloBank::get(tools_, {"apps_h2", "s_client", {"a.apps.example.test", "h2"}}, error);
    ASSERT_TRUE(apps) << error;
    std::optional<std::string> nosni =
        HelloBank::get(tools_, {"nosni", "s_client", {std::nullopt, ""}}, error);
    ASSERT_TRUE(nosni) << error;

    // The client's header and the one the relay must send for it: the same addresses (the
    // relay's is its own, built from what it read; for v2 without TLVs, as the client's).
    const std::string header = c.version == "v1" ? kProxyV1 : proxyV2();
    struct Step {
        std::string what;
        std::vector<std::string> parts;  // after the header
        bool header_apart;               // the header in a segment of its own
        std::string backend, failure;
    };
    std::vector<Step> steps = {
        {"header and hello in one write", {*api}, false, "api", ""},
        {"header, then the hello in two segments",
         {apps->substr(0, 50), apps->substr(50)},
         true,
         "apps",
         ""},
        {"header, then a hello without a name", {*nosni}, true, "fallback", "no_sni"},
    };
    for (const Step& s : steps) {
        SCOPED_TRACE(s.what);
        std::vector<std::string> parts = s.parts;
        std::string hello;
        for (const auto& p : s.parts) hello += p;
        if (s.header_apart)
            parts.insert(parts.begin(), header);
        else
            parts[0] = header + parts[0];
        hello += kSecondFlight;
        Landing l = caps.through(relay_.port("t"), parts, kSecondFlight);
        EXPECT_EQ(l.note, "") << "sockmap counters: " << sockmapCounters(relay_);
        EXPECT_EQ(l.backend, s.backend) << l.note;
        ASSERT_TRUE(l.bytes) << l.note;
        EXPECT_EQ(hex(l.bytes->substr(0, header.size())), hex(header))
            << "the backend's first bytes must be the relay's " << c.version << " header";
        EXPECT_EQ(l.bytes->substr(std::min(header.size(), l.bytes->size())), hello)
            << "after the header, the client's hello and what followed, unchanged; "
            << firstDifference(l.bytes->substr(std::min(header.size(), l.bytes->size())), hello);
        count(s.backend, s.failure);
    }
}

INSTANTIATE_TEST_SUITE_P(Modes, ProxyHeaderTest, ::testing::ValuesIn(proxyCases()),
                         [](const auto& info) {
                             return info.param.mode + "_" + info.param.version;
                         });

// A real TLS client behind a PROXY v1 line (Python writes it, then does its handshake on the same
// socket): routed by its hello, the handshake completes with the right server.
class ProxyTlsTest : public SniFixture, public ::testing::TestWithParam<std::string> {};

TEST_P(ProxyTlsTest, RealTlsClientBehindProxyHeader) {
    SKIP_WITHOUT_TOOLS(tools_, false, true);
    ASSERT_NO_FATAL_FAILURE(startTlsBackends("-www"));
    ASSERT_NO_FATAL_FAILURE(startRelay(routedConfig(
        tlsAddrs(), {routedListener("t", GetParam(), kRoutes, "    accept_proxy: true\n")})));
    const std::vector<std::string> header = {"--proxy-v1",
                                             "TCP4 192.0.2.10 198.51.100.20 40000 443"};
    expectLanded(python(tools_, script_, relay_.port(), {"api.example.test", ""}, cafile_, header),
                 api_);
    count("api", "");
    expectLanded(
        python(tools_, script_, relay_.port(), {"z.apps.example.test", "h2"}, cafile_, header),
        apps_);
    count("apps", "");
    expectLanded(python(tools_, script_, relay_.port(), {"nope.example.test", ""}, cafile_, header),
                 fallback_);
    count("fallback", "no_route");
    if (HasFailure())
        std::printf("[ INFO     ] sockmap counters: %s\n", sockmapCounters(relay_).c_str());
}

INSTANTIATE_TEST_SUITE_P(Modes, ProxyTlsTest, ::testing::ValuesIn(kHandOffModes), modeName);

}  // namespace
}  // namespace zcrelay::test::sni_routing_test
