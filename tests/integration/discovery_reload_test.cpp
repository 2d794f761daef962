// A reload (SIGHUP) of a discovered cluster: an unchanged set is kept as it is, a new name is
// followed.
#include <gtest/gtest.h>

#include <iostream>
#include <string>
#include <vector>

#include "integration/discovery_fixture.hpp"

namespace zcrelay::test::discovery_test {
namespace {

// =============================================================================================
// 9. SIGHUP: unchanged discovery keeps its set; a new name is followed.

TEST_F(DiscoveryTest, ReloadKeepsAnUnchangedSetAndFollowsANewName) {
    std::string why;
    auto backends =
        backendsOnOnePort({"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"}, "2345", why);
    ASSERT_EQ(backends.size(), 4u) << why;
    const uint16_t port = backends[0]->port();
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("one.test", {"127.0.0.2", "127.0.0.3"}));
    ASSERT_TRUE(dns_.setAddresses("two.test", {"127.0.0.4", "127.0.0.5"}));
    const std::string resolvers = resolversYaml(dns_, writeResolvConf());
    ClusterSpec web = dnsCluster("one.test", port);
    const RelayConfig first = relayConfig(resolvers, {web});
    ASSERT_TRUE(relay_.start(first));
    Load load(relay_.host(), relay_.port());
    ASSERT_TRUE(load.waitForTotal(50, Millis{10'000})) << load.describeFailures();

    const size_t logged = logLines("backends from one.test");
    EXPECT_EQ(logged, 1u) << relay_.stderrText();
    const double changes = value(kChanges, cluster("web"));
    const double conns2 =
        value(metric::kBackendConnectionsTotal, metric::backend("web", backends[0]->address()));
    ASSERT_TRUE(relay_.reload(first.yaml()));
    const size_t at_reload = load.total();
    ASSERT_TRUE(load.waitForTotal(at_reload + 100, Millis{20'000}));
    // Past one more refresh, watching for a change that must not come: load can only hide one.
    std::this_thread::sleep_for(Millis{1'200});
    EXPECT_EQ(logLines("backends from one.test"), logged) << "an unchanged name logged a change\n"
                                                          << relay_.stderrText();
    EXPECT_EQ(value(kChanges, cluster("web")), changes);
    EXPECT_EQ(value(kDiscovered, cluster("web")), 2.0);
    EXPECT_GE(
        value(metric::kBackendConnectionsTotal, metric::backend("web", backends[0]->address())),
        conns2)
        << "the kept backend's counters start over";
    EXPECT_TRUE(load.failures().empty()) << load.describeFailures();

    // Another name: its answer is waited for, so the reloaded generation has its backends.
    web.dns = "two.test";
    ASSERT_TRUE(relay_.reload(relayConfig(resolvers, {web}).yaml()));
    const auto reloaded_at = Clock::now();
    std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("web")), 2.0);
    EXPECT_TRUE(hasBackendIn(text, "web", backends[2]->address())) << text;
    EXPECT_TRUE(hasBackendIn(text, "web", backends[3]->address())) << text;
    EXPECT_FALSE(hasBackendIn(text, "web", backends[0]->address())) << text;
    // Connections accepted before the reload may still reach the old backends: they are over
    // once each load thread finished one it started after it.
    ASSERT_TRUE(load.waitEachThreadPast(reloaded_at, Millis{20'000})) << load.describeFailures();
    const auto switched = Clock::now();
    const size_t frozen2 = backends[0]->accepted(), frozen3 = backends[1]->accepted();
    const size_t at_switch = load.total();
    ASSERT_TRUE(load.waitForTotal(at_switch + 100, Millis{20'000}));
    load.stop();
    EXPECT_EQ(backends[0]->accepted(), frozen2);
    EXPECT_EQ(backends[1]->accepted(), frozen3);
    const auto tags = load.tagsSince(switched);
    EXPECT_EQ(tags.count('2') + tags.count('3'), 0u);
    EXPECT_GT((tags.count('4') ? tags.at('4') : 0), 0);
    EXPECT_GT((tags.count('5') ? tags.at('5') : 0), 0);
    EXPECT_TRUE(load.failures().empty()) << load.describeFailures();
}

}  // namespace
}  // namespace zcrelay::test::discovery_test
