// SNI routes in the config: route names unique within a listener, and the listener's own
// target (`cluster:` or `upstream:`) as the default route.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "integration/sni_fixture.hpp"

namespace zcrelay::test::sni_routing_test {
namespace {

// =============================================================================================
// 8. Configuration: the default route from `cluster:` or `upstream:`, names unique.

class SniConfigTest : public SniFixture, public ::testing::Test {
  protected:
    // `zcrelay --check-config` on `yaml`.
    CommandResult check(const std::string& yaml) {
        return runCommand({kRelayBinary, "--check-config", dir_.writeFile("check.yaml", yaml)},
                          kTool);
    }
};

TEST_F(SniConfigTest, RouteNamesMustBeUnique) {
    ClusterAddrs to{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
    CommandResult good = check(routedConfig(to, {routedListener("t", "splice")}).yaml());
    EXPECT_TRUE(good.status.cleanExit()) << "the usual routes are a valid config\n"
                                         << good.describe();
    // Both named after cluster api.
    CommandResult same_default =
        check(routedConfig(to, {routedListener("t", "splice",
                                               "    routes:\n"
                                               "      - {sni: [a.example.test], cluster: api}\n"
                                               "      - {sni: [b.example.test], cluster: api}\n")})
                  .yaml());
    EXPECT_FALSE(same_default.status.cleanExit()) << same_default.describe();
    CommandResult same_given =
        check(routedConfig(
                  to, {routedListener("t", "splice",
                                      "    routes:\n"
                                      "      - {name: x, sni: [a.example.test], cluster: api}\n"
                                      "      - {name: x, sni: [b.example.test], cluster: apps}\n")})
                  .yaml());
    EXPECT_FALSE(same_given.status.cleanExit()) << same_given.describe();
    // The same name on two listeners is fine: unique within a listener.
    CommandResult two = check(
        routedConfig(to, {routedListener("t", "splice"), routedListener("u", "splice")}).yaml());
    EXPECT_TRUE(two.status.cleanExit()) << two.describe();
}

// Listener `c` has conditional routes and `cluster: fallback`; listener `u` the same with
// `upstream:` (a cluster of its own, named after the listener). Each is the default route.
TEST_F(SniConfigTest, ListenerTargetIsTheDefaultRoute) {
    SKIP_WITHOUT_TOOLS(tools_, false, false);
    ASSERT_NO_FATAL_FAILURE(startTlsBackends("-www"));
    ListenerSpec c = routedListener("c", "splice", kConditionalRoutes);
    c.omit_target = false;
    c.cluster = "fallback";
    ListenerSpec u = routedListener("u", "copy", kConditionalRoutes);
    u.omit_target = false;
    u.upstream = fallback_.hostPort();
    ASSERT_NO_FATAL_FAILURE(startRelay(routedConfig(tlsAddrs(), {c, u})));
    for (const std::string l : {"c", "u"}) {
        SCOPED_TRACE(l);
        expectLanded(sClient(tools_, relay_.port(l), {"api.example.test", ""}, cafile_, get_),
                     api_);
        count("api", "", l);
        expectLanded(sClient(tools_, relay_.port(l), {std::nullopt, ""}, cafile_, get_), fallback_);
        count(l == "c" ? "fallback" : "u", "no_sni", l);
    }
}

}  // namespace
}  // namespace zcrelay::test::sni_routing_test
