// Discovered addresses that are no backend: unspecified, broadcast, multicast, an SRV port 0,
// and the relay's own listeners and metrics port (a connection storm to itself), at start,
// later, and after a reload adds a listener.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "integration/discovery_fixture.hpp"

namespace zcrelay::test::discovery_test {
namespace {

// =============================================================================================
// 12. Addresses that are no backend: 0.0.0.0 and :: (a connect reaches the local host),
// broadcast, multicast, an SRV record's port 0. Each kind alone is an answer with nothing usable
// (no_records: nothing joins); mixed with a good backend, the good one serves and the bad ones
// never become backends. Counted by reason, logged once (not per refresh), naming the address.

Labels reason(const std::string& cluster_name, const std::string& why) {
    return {{"cluster", cluster_name}, {"reason", why}};
}

struct RefusalCase {
    std::string reason;
    std::vector<std::string> bad;  // A/AAAA records; empty: an SRV record with port 0
};

class DiscoveryRefusalTest : public DiscoveryTest,
                             public ::testing::WithParamInterface<RefusalCase> {};

TEST_P(DiscoveryRefusalTest, RefusedAloneIsNoRecordsAndMixedTheGoodOneServes) {
    const RefusalCase& c = GetParam();
    Backend good('g', "127.0.0.2", 0);
    ASSERT_TRUE(good.ok()) << good.error();
    const std::string port = std::to_string(good.port());
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ClusterSpec web;
    std::vector<std::string> bad;  // as the relay names them
    const std::string srv = "_app._tcp.refuse.test";
    if (c.bad.empty()) {
        ASSERT_TRUE(dns_.setAddresses("good.refuse.test", {"127.0.0.2"}));
        ASSERT_TRUE(dns_.setSrv(srv, {{0, 1, 0, "good.refuse.test"}}));
        web.srv = srv;
        bad = {"127.0.0.2:0"};
    } else {
        ASSERT_TRUE(dns_.setAddresses("web.test", c.bad));
        web = dnsCluster("web.test", good.port());
        for (const std::string& a : c.bad)
            bad.push_back(a.find(':') != std::string::npos ? "[" + a + "]:" + port
                                                           : a + ":" + port);
    }
    web.keys = {"refresh_min: 200ms", "refresh_max: 1s", "startup: empty"};
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(dns_, writeResolvConf()), {web})));

    // Alone: nothing usable, a failure like an empty answer.
    ASSERT_TRUE(
        relay_.waitForMetric(kRefusedNow, reason("web", c.reason), static_cast<double>(bad.size())))
        << scrape();
    ASSERT_TRUE(relay_.waitForMetric(
        kResolutions, outcome("web", "no_records"), [](double v) { return v >= 2; }, ">= 2"));
    std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("web")), 0.0);
    EXPECT_EQ(valueIn(text, kResolutions, outcome("web", "success")), 0.0);
    for (const char* why : {"unspecified", "broadcast", "multicast", "port_zero", "self"}) {
        if (why == c.reason) continue;
        EXPECT_EQ(valueIn(text, kRefusedNow, reason("web", why)), 0.0) << why;
    }
    for (const std::string& a : bad) EXPECT_FALSE(hasBackendIn(text, "web", a)) << a;

    // Mixed with a good backend: it serves, the bad ones stay out.
    if (c.bad.empty()) {
        ASSERT_TRUE(dns_.setSrv(
            srv, {{0, 1, 0, "good.refuse.test"}, {0, 1, good.port(), "good.refuse.test"}}));
    } else {
        std::vector<std::string> mixed = c.bad;
        mixed.push_back("127.0.0.2");
        ASSERT_TRUE(dns_.setAddresses("web.test", mixed));
    }
    ASSERT_TRUE(waitDiscovered("web", 1)) << scrape();
    ASSERT_TRUE(waitRunning("web", "127.0.0.2:" + port));
    for (int i = 0; i < 20; ++i) {
        Visit v = shortVisit(relay_.host(), relay_.port(), 0x7100 + i);
        EXPECT_EQ(v.error, "") << "connection " << i;
        EXPECT_EQ(v.tag, 'g');
    }
    // A few more refreshes, each refusing the same addresses again.
    const double before = value(kRefused, reason("web", c.reason));
    ASSERT_TRUE(relay_.waitForMetric(
        kRefused, reason("web", c.reason),
        [&](double v) { return v >= before + 3.0 * static_cast<double>(bad.size()); },
        "three more answers refused"));
    text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("web")), 1.0);
    EXPECT_TRUE(hasBackendIn(text, "web", good.address())) << text;
    EXPECT_EQ(valueIn(text, kRefusedNow, reason("web", c.reason)), static_cast<double>(bad.size()));
    for (const std::string& a : bad) {
        EXPECT_FALSE(hasBackendIn(text, "web", a)) << a << "\n" << text;
        // Named with its reason, once: the same refusal on every refresh is not logged again.
        EXPECT_EQ(logLines(a + " (" + c.reason + ":"), 1u) << relay_.stderrText();
        EXPECT_EQ(logLines("+" + a), 0u) << "never joins: " << relay_.stderrText();
    }
    expectOnlyCleanCloses();
}

INSTANTIATE_TEST_SUITE_P(Kinds, DiscoveryRefusalTest,
                         ::testing::Values(RefusalCase{"unspecified", {"0.0.0.0", "::"}},
                                           RefusalCase{"broadcast", {"255.255.255.255"}},
                                           RefusalCase{"multicast", {"224.0.0.1", "ff02::1"}},
                                           RefusalCase{"port_zero", {}}),
                         [](const ::testing::TestParamInfo<RefusalCase>& info) {
                             return info.param.reason;
                         });

// =============================================================================================
// 13. A name that resolves to the relay itself (a Service selecting the relay's own pods). Were
// it a backend, each client connection would be relayed to the relay, which relays it to itself
// again: ~9,800 connections within 2 s, until the fds run out. Refused as `self`, through A at
// start and through SRV later (also the metrics port, bound at port 0 after discovery began),
// in every data path: clients keep connecting and all are served by the good backend, and the
// relay's fd count stays within a few dozen of its count before them.

class DiscoverySelfTest : public DiscoveryTest, public ::testing::WithParamInterface<std::string> {
  protected:
    // Clients for 1.5 s and 20 visits at least (30 s at most) on 2 threads, the relay's fds
    // sampled meanwhile: the most seen above `baseline`. Every visit must reach the good
    // backend ('g').
    void loadWithoutStorm(int baseline) {
        std::atomic<bool> stop{false};
        std::atomic<int> visits{0};
        std::mutex m;
        std::vector<std::string> errors;
        std::vector<std::thread> clients;
        for (int t = 0; t < 2; ++t) {
            clients.emplace_back([&, t] {
                for (int i = 0; i < 400 && !stop.load(); ++i) {
                    Visit v = shortVisit(relay_.host(), relay_.port(), 0x7200 + 1000 * t + i);
                    visits.fetch_add(1);
                    if (v.error.empty() && v.tag == 'g') continue;
                    std::lock_guard lock(m);
                    errors.push_back(v.error.empty() ? std::string("tag ") + v.tag : v.error);
                }
            });
        }
        int most = baseline;
        const auto start = Clock::now();
        while ((secondsSince(start) < 1.5 || visits.load() <= 20) && secondsSince(start) < 30) {
            most = std::max(most, relay_.openFdCount().value_or(baseline));
            std::this_thread::sleep_for(Millis{5});  // the sampling pace
        }
        stop.store(true);
        for (auto& c : clients) c.join();
        most = std::max(most, relay_.openFdCount().value_or(baseline));
        std::cout << "[ self ] " << visits.load() << " visits, fds " << baseline << " -> at most "
                  << most << "\n";
        EXPECT_GT(visits.load(), 20);
        EXPECT_TRUE(errors.empty()) << errors.size() << " failed, first: " << errors.front();
        EXPECT_LE(most, baseline + 48) << "the relay connects to itself";
    }
};

TEST_P(DiscoverySelfTest, AnARecordNamingTheListenerIsRefusedAtStart) {
    const std::string mode = GetParam();
    // The good backend on 127.0.0.2:P and the relay's listener on 127.0.0.1:P: the name's
    // addresses at the cluster's one port are the backend and the relay. P is one the kernel
    // finds free on 127.0.0.1 (earlier tests' clients leave TIME_WAITs there, which a port free
    // on 127.0.0.2 may collide with), held by a bound SO_REUSEPORT socket until the relay, which
    // sets SO_REUSEPORT too, has bound it as well; a few tries in case another process takes it.
    std::unique_ptr<Backend> good;
    bool started = false;
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("web.test", {"127.0.0.1", "127.0.0.2"}));
    for (int attempt = 0; attempt < 5 && !started; ++attempt) {
        Fd hold(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        ASSERT_TRUE(hold) << std::strerror(errno);
        int one = 1;
        ::setsockopt(hold.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        ::setsockopt(hold.get(), SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
        sockaddr_in sin{};
        sin.sin_family = AF_INET;
        sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof sin;
        ASSERT_EQ(::bind(hold.get(), reinterpret_cast<sockaddr*>(&sin), sizeof sin), 0)
            << std::strerror(errno);
        ASSERT_EQ(::getsockname(hold.get(), reinterpret_cast<sockaddr*>(&sin), &len), 0);
        const uint16_t port = ntohs(sin.sin_port);
        good = std::make_unique<Backend>('g', "127.0.0.2", port);
        if (!good->ok()) continue;
        ClusterSpec web = dnsCluster("web.test", port);
        RelayConfig config = relayConfig(resolversYaml(dns_, writeResolvConf()), {web}, mode);
        config.listeners[0].listen = "127.0.0.1:" + std::to_string(port);
        relay_.setNofileLimit(4096);  // bounds the storm should the check fail
        started = relay_.start(config);
        if (!started) relay_.terminate();
    }
    ASSERT_TRUE(started) << relay_.diagnostics();
    const std::string self = "127.0.0.1:" + std::to_string(good->port());
    std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("web")), 1.0) << text;
    EXPECT_TRUE(hasBackendIn(text, "web", good->address()));
    EXPECT_FALSE(hasBackendIn(text, "web", self)) << text;
    EXPECT_EQ(valueIn(text, kRefusedNow, reason("web", "self")), 1.0);
    EXPECT_EQ(logLines(self + " (self: the relay's own listeners[0].listen: a loop)"), 1u)
        << relay_.stderrText();

    const auto baseline = relay_.openFdCount();
    ASSERT_TRUE(baseline);
    loadWithoutStorm(*baseline);
    text = scrape();
    EXPECT_FALSE(hasBackendIn(text, "web", self));
    EXPECT_GE(valueIn(text, kRefused, reason("web", "self")), 1.0);
    expectOnlyCleanCloses();
}

TEST_P(DiscoverySelfTest, SrvTargetsAtTheListenerAndTheMetricsPortAreRefused) {
    const std::string mode = GetParam();
    Backend good('g', "127.0.0.2", 0);
    ASSERT_TRUE(good.ok()) << good.error();
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("good.loop.test", {"127.0.0.2"}));
    ASSERT_TRUE(dns_.setAddresses("self.loop.test", {"127.0.0.1"}));
    const std::string srv = "_app._tcp.loop.test";
    ASSERT_TRUE(dns_.setSrv(srv, {{0, 1, good.port(), "good.loop.test"}}));
    ClusterSpec web;
    web.srv = srv;
    relay_.setNofileLimit(4096);
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(dns_, writeResolvConf()), {web}, mode)));
    const auto baseline = relay_.openFdCount();
    ASSERT_TRUE(baseline);

    // The orchestrator now lists the relay's own pod at the service's port, and its metrics.
    const std::string self = "127.0.0.1:" + std::to_string(relay_.port());
    const std::string metrics = "127.0.0.1:" + std::to_string(relay_.metricsPort());
    ASSERT_TRUE(dns_.setSrv(srv, {{0, 1, good.port(), "good.loop.test"},
                                  {0, 1, relay_.port(), "self.loop.test"},
                                  {0, 1, relay_.metricsPort(), "self.loop.test"}}));
    ASSERT_TRUE(relay_.waitForMetric(kRefusedNow, reason("web", "self"), 2.0)) << scrape();
    loadWithoutStorm(*baseline);
    const std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("web")), 1.0) << text;
    EXPECT_TRUE(hasBackendIn(text, "web", good.address()));
    EXPECT_FALSE(hasBackendIn(text, "web", self)) << text;
    EXPECT_FALSE(hasBackendIn(text, "web", metrics)) << text;
    EXPECT_EQ(logLines(self + " (self: the relay's own listeners[0].listen: a loop)"), 1u)
        << relay_.stderrText();
    EXPECT_EQ(logLines(metrics + " (self: the relay's own metrics.listen: a loop)"), 1u)
        << relay_.stderrText();
    expectOnlyCleanCloses();
}

// A name that leads back to the relay is refused while the backend set is built, before any
// data path: splice only.
INSTANTIATE_TEST_SUITE_P(Modes, DiscoverySelfTest, ::testing::Values("splice"), modeName);

// A reload that adds a listener on an address the running set has: the relay would now connect
// to itself there. The backend leaves the set with the reload (its series go), is refused as
// `self` from then on, and both listeners serve from the good backend.
TEST_F(DiscoveryTest, AReloadedListenerOnADiscoveredAddressTakesItOutOfTheSet) {
    Backend good('g', "127.0.0.2", 0);
    ASSERT_TRUE(good.ok()) << good.error();
    const std::string port = std::to_string(good.port());
    const std::string soon_self = "127.0.0.3:" + port;  // nothing listens there yet
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("web.test", {"127.0.0.2", "127.0.0.3"}));
    ClusterSpec web = dnsCluster("web.test", good.port());
    // Health checks keep the address that has no listener yet out of rotation.
    web.health_check = "{interval: 100ms, timeout: 100ms, rise: 1, fall: 1}";
    RelayConfig config = relayConfig(resolversYaml(dns_, writeResolvConf()), {web});
    ASSERT_TRUE(relay_.start(config));
    ASSERT_TRUE(waitDiscovered("web", 2)) << scrape();
    EXPECT_TRUE(waitRunning("web", soon_self));

    ListenerSpec second = config.listeners[0];
    second.name = "u";
    second.listen = soon_self;
    config.listeners.push_back(second);
    ASSERT_TRUE(relay_.reload(config.yaml()));
    ASSERT_TRUE(waitDiscovered("web", 1)) << scrape();
    ASSERT_TRUE(relay_.waitForMetric(kRefusedNow, reason("web", "self"), 1.0)) << scrape();
    EXPECT_TRUE(waitRunning("web", soon_self, false));
    const std::string text = scrape();
    EXPECT_FALSE(hasBackendIn(text, "web", soon_self)) << text;
    EXPECT_TRUE(hasBackendIn(text, "web", good.address())) << text;
    EXPECT_EQ(logLines(soon_self + " (self: the relay's own listeners[1].listen: a loop)"), 1u)
        << relay_.stderrText();
    for (int i = 0; i < 20; ++i) {
        for (const char* l : {"t", "u"}) {
            Visit v = shortVisit(relay_.host(l), relay_.port(l), 0x7300 + i);
            EXPECT_EQ(v.error, "") << l << " " << i;
            EXPECT_EQ(v.tag, 'g') << l;
        }
    }
}

}  // namespace
}  // namespace zcrelay::test::discovery_test
