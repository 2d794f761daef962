// SNI routing with real TLS clients and servers: each name lands on its backend and the
// handshake completes end to end; the matching rules one s_client each; and the premise that
// the clients send the names and protocols as the cases give them.
#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "integration/sni_fixture.hpp"

namespace zcrelay::test::sni_routing_test {
namespace {

// =============================================================================================
// 1. Real clients, real servers: each name lands on its backend, the handshake completes end
// to end.

class TlsRoutingTest : public SniFixture, public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        SKIP_WITHOUT_TOOLS(tools_, true, true);
        ASSERT_NO_FATAL_FAILURE(startTlsBackends("-www"));
        ASSERT_NO_FATAL_FAILURE(
            startRelay(routedConfig(tlsAddrs(), {routedListener("t", GetParam())})));
    }
};

TEST_P(TlsRoutingTest, RealClientsLandOnTheirBackend) {
    uint16_t port = relay_.port("t");
    struct Step {
        std::function<ClientRun()> run;
        std::string backend, route, failure;
    };
    const Offer api{"api.example.test", ""};
    std::vector<Step> steps = {
        {[&] { return sClient(tools_, port, api, cafile_, get_); }, "api", "api", ""},
        {[&] {
             return sClient(tools_, port, {"a.apps.example.test", "h2,http/1.1"}, cafile_, get_);
         },
         "apps", "apps", ""},
        {[&] { return curlGet(tools_, port, "api.example.test"); }, "api", "api", ""},
        // curl offers h2 and http/1.1 itself: the wildcard route's ALPN condition holds.
        {[&] { return curlGet(tools_, port, "x.apps.example.test"); }, "apps", "apps", ""},
        {[&] { return curlGet(tools_, port, "www.example.test"); }, "fallback", "fallback",
         "no_route"},
        {[&] { return python(tools_, script_, port, api, cafile_); }, "api", "api", ""},
        {[&] {
             return python(tools_, script_, port, {"y.apps.example.test", "http/1.1"}, cafile_);
         },
         "apps", "apps", ""},
        {[&] {
             return python(tools_, script_, port, {"y.apps.example.test", ""}, cafile_);
         },
         "fallback", "fallback", "no_route"},
        {[&] {
             return python(tools_, script_, port, {std::nullopt, "h2"}, cafile_);
         },
         "fallback", "fallback", "no_sni"},
    };
    for (size_t i = 0; i < steps.size(); ++i) {
        ClientRun run = steps[i].run();
        SCOPED_TRACE(run.what);
        expectLanded(run, tlsBackend(steps[i].backend));
        count(steps[i].route, steps[i].failure);
    }
    // Every connection was inspected once: the histogram has one observation each.
    double n = static_cast<double>(steps.size());
    EXPECT_TRUE(
        relay_.waitForMetric(std::string(kInspectSeconds) + "_count", metric::listener(), n));
    EXPECT_TRUE(relay_.waitForMetric(std::string(kInspectSeconds) + "_bucket",
                                     {{"listener", "t"}, {"le", "+Inf"}}, n));
    EXPECT_TRUE(relay_.metric(std::string(kInspectSeconds) + "_sum", metric::listener()))
        << "no " << kInspectSeconds << "_sum";
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), n))
        << relay_.diagnostics();
}

struct NameCase {
    Offer offer;
    std::string backend, route, failure;
};

// The matching rules, one s_client each, against the routes of kRoutes.
std::vector<NameCase> nameCases() {
    return {
        {{"api.example.test", ""}, "api", "api", ""},
        {{"API.Example.Test", ""}, "api", "api", ""},     // names compare case-insensitively
        {{"api.example.test.", ""}, "api", "api", ""},    // the client's trailing dot is ignored
        {{"Api.EXAMPLE.test.", "h2"}, "api", "api", ""},  // both at once
        {{"api.example.test.evil", ""}, "fallback", "fallback", "no_route"},
        {{"evilapi.example.test", ""}, "fallback", "fallback", "no_route"},
        {{"a.apps.example.test", "h2"}, "apps", "apps", ""},
        {{"A.APPS.Example.Test", "http/1.1"}, "apps", "apps", ""},
        {{"a.apps.example.test.", "h2"}, "apps", "apps", ""},
        {{"a.apps.example.test", "http/1.0,h2"}, "apps", "apps", ""},  // any offered one
        {{"a.apps.example.test", "http/1.0"}, "fallback", "fallback", "no_route"},
        {{"a.apps.example.test", ""}, "fallback", "fallback", "no_route"},
        {{"a.b.apps.example.test", "h2"}, "fallback", "fallback", "no_route"},  // one label only
        {{"apps.example.test", "h2"}, "fallback", "fallback", "no_route"},      // ... not zero
        {{"xapps.example.test", "h2"}, "fallback", "fallback", "no_route"},
        // ALPN alone: any name, or none.
        {{"whatever.example.test", "acme-tls/1"}, "apps", "acme", ""},
        {{std::nullopt, "acme-tls/1"}, "apps", "acme", ""},
        // First match wins: the wildcard route's ALPN does not hold, ALPN alone does; the exact
        // route comes before ALPN alone.
        {{"a.apps.example.test", "acme-tls/1"}, "apps", "acme", ""},
        {{"api.example.test", "acme-tls/1"}, "api", "api", ""},
        {{std::nullopt, ""}, "fallback", "fallback", "no_sni"},
        {{std::nullopt, "h2"}, "fallback", "fallback", "no_sni"},
    };
}

TEST_P(TlsRoutingTest, NameMatchingRules) {
    for (const NameCase& c : nameCases()) {
        ClientRun run = sClient(tools_, relay_.port("t"), c.offer, cafile_, get_);
        SCOPED_TRACE(run.what);
        expectLanded(run, tlsBackend(c.backend));
        count(c.route, c.failure);
    }
}

INSTANTIATE_TEST_SUITE_P(Modes, TlsRoutingTest, ::testing::ValuesIn(kHandOffModes), modeName);

// The clients really sent what the cases say: the names byte for byte as given (case, trailing
// dot), the protocols in order. Otherwise a case above could pass for the wrong reason.
TEST(SniClientPremiseTest, ClientsSendTheNamesAsGiven) {
    Tools tools;
    SKIP_WITHOUT_TOOLS(tools, true, true);
    struct Want {
        HelloSpec spec;
        std::vector<std::string> alpn;
    };
    std::vector<Want> wants = {
        {{"premise_upper_dot", "s_client", {"Api.EXAMPLE.test.", "h2"}}, {"h2"}},
        {{"premise_alpn_order", "s_client", {"a.apps.example.test", "http/1.0,h2"}},
         {"http/1.0", "h2"}},
        {{"premise_python", "python", {"y.apps.example.test", "http/1.1"}}, {"http/1.1"}},
        {{"premise_curl", "curl", {"x.apps.example.test", ""}}, {"h2", "http/1.1"}},
        {{"premise_nosni", "s_client", {std::nullopt, "h2"}}, {"h2"}},
    };
    for (const Want& w : wants) {
        SCOPED_TRACE(w.spec.key);
        std::string error;
        std::optional<std::string> hello = HelloBank::get(tools, w.spec, error);
        ASSERT_TRUE(hello) << error;
        HelloFields f = parseHello(handshakeMessage(*hello));
        ASSERT_TRUE(f.parsed) << hex(*hello);
        EXPECT_EQ(f.sni, w.spec.offer.sni);
        EXPECT_EQ(f.alpn, w.alpn);
    }
}

}  // namespace
}  // namespace zcrelay::test::sni_routing_test
