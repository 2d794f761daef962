// Reading and changing backends through the runtime API: the listing, weights, shutdown of a
// backend's live connections, and what a reload keeps of the API's changes.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "integration/admin_api_fixture.hpp"

namespace zcrelay::test::admin_api_test {
namespace {

// =============================================================================================
// 1. Reading: every cluster, one cluster, one backend (an IPv6 one by its escaped address).

TEST_F(AdminApiTest, ListsClustersAndBackends) {
    TaggedBackend a('a'), c('c', AF_INET6);
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_TRUE(c.ok()) << c.error();
    ASSERT_EQ(c.address().front(), '[') << c.address();
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address(), 2}, {c.address(), 1}}));

    // One live connection to A shows as active.
    Fd live = clientOf('a');
    ASSERT_TRUE(live);
    ASSERT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, backendOf(a.address()), 1));

    const BackendView view_a{.address = a.address(), .weight = 2, .config_weight = 2, .active = 1};
    const BackendView view_c{.address = c.address()};

    ApiReply all = get("/api/v1/clusters");
    ASSERT_EQ(all.status, 200) << all.describe();
    ASSERT_TRUE(all.json) << all.describe();
    ASSERT_EQ(all.json->type, Json::Type::Object) << all.describe();
    const Json* generation = all.json->get("generation");
    ASSERT_NE(generation, nullptr) << all.describe();
    EXPECT_EQ(generation->type, Json::Type::Number) << all.describe();
    EXPECT_GE(generation->number, 1) << all.describe();
    ASSERT_EQ(all.json->items("clusters").size(), 1u) << all.describe();
    const Json& app = all.json->items("clusters")[0];
    EXPECT_EQ(app.str("name"), "app") << all.describe();
    EXPECT_EQ(app.str("balance"), "round_robin") << all.describe();
    ASSERT_NE(app.get("health_checks"), nullptr) << all.describe();
    EXPECT_EQ(app.get("health_checks")->type, Json::Type::Bool);
    EXPECT_FALSE(app.get("health_checks")->boolean);
    ASSERT_EQ(app.items("backends").size(), 2u) << all.describe();
    EXPECT_TRUE(backendIs(app.items("backends")[0], view_a)) << all.describe();
    EXPECT_TRUE(backendIs(app.items("backends")[1], view_c)) << all.describe();
    // The trailing slash names the same list.
    ApiReply slash = get("/api/v1/clusters/");
    EXPECT_EQ(slash.status, 200) << slash.describe();
    EXPECT_TRUE(slash.json && slash.json->items("clusters").size() == 1) << slash.describe();

    ApiReply one = get("/api/v1/clusters/app");
    ASSERT_EQ(one.status, 200) << one.describe();
    ASSERT_TRUE(one.json) << one.describe();
    EXPECT_EQ(one.json->str("name"), "app") << one.describe();
    ASSERT_EQ(one.json->items("backends").size(), 2u) << one.describe();
    EXPECT_TRUE(backendIs(one.json->items("backends")[0], view_a)) << one.describe();
    EXPECT_TRUE(backendIs(one.json->items("backends")[1], view_c)) << one.describe();

    EXPECT_TRUE(backendReply(get(backendPath(a.address())), view_a));
    // The IPv6 backend, "[::1]:PORT", escaped as clients escape it, in upper and lower case.
    const std::string escaped = percentEncode(c.address());
    EXPECT_NE(escaped.find("%5B%3A%3A1%5D%3A"), std::string::npos) << escaped;
    EXPECT_TRUE(backendReply(get("/api/v1/clusters/app/backends/" + escaped), view_c));
    EXPECT_TRUE(backendReply(
        get("/api/v1/clusters/app/backends/" + percentEncode(c.address(), /*lower=*/true)),
        view_c));
    // And it takes connections: the relay reaches it over IPv6.
    EXPECT_TRUE(waitUntil([&] { return spread(relay_.host(), relay_.port(), 3)['c'] > 0; },
                          Millis{5'000}));

    live.reset();
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, backendOf(a.address()), 0));
    EXPECT_TRUE(backendReply(get(backendPath(a.address())),
                             {.address = a.address(), .weight = 2, .config_weight = 2}));
    // Reading changes nothing and counts as ok.
    EXPECT_EQ(relay_.metric(kAdminChanges, {}), 0.0);
    EXPECT_GE(requests("ok"), 7.0);
    EXPECT_EQ(requests("bad_request") + requests("not_found") + requests("unauthorized"), 0.0);
}

// =============================================================================================
// 4. Weights: 0 takes no new connections (like drain); 3 against 1 under round robin gives A
// three quarters of the connections. The configured weight stays what the config says.

TEST_F(AdminApiTest, WeightZeroAndThreeToOne) {
    TaggedBackend a('a'), b('b');
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_TRUE(b.ok()) << b.error();
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}, {b.address()}}));
    const Labels la = backendOf(a.address()), lb = backendOf(b.address());
    EXPECT_EQ(relay_.metric(kBackendWeight, la), 1.0);

    EXPECT_TRUE(backendReply(post(backendPath(a.address()), "{\"weight\": 0}"),
                             {.address = a.address(),
                              .weight = 0,
                              .config_weight = 1,
                              .takes_new_connections = false}));
    EXPECT_EQ(relay_.metric(kBackendWeight, la), 0.0);
    const size_t a_accepted = a.accepted();
    const auto zero = spread(relay_.host(), relay_.port(), 40);
    EXPECT_EQ(zero.count('a') ? zero.at('a') : 0, 0) << "weight 0 took new connections";
    EXPECT_EQ(zero.count('b') ? zero.at('b') : 0, 40);
    EXPECT_EQ(a.accepted(), a_accepted);
    // The state is untouched: still ready, with weight 0.
    EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", "ready")), 1.0);

    EXPECT_TRUE(backendReply(post(backendPath(a.address()), "{\"weight\": 3}"),
                             {.address = a.address(), .weight = 3, .config_weight = 1}));
    EXPECT_EQ(relay_.metric(kBackendWeight, la), 3.0);
    EXPECT_EQ(relay_.metric(kBackendWeight, lb), 1.0);
    const double a_before = metricOr(metric::kBackendConnectionsTotal, la);
    const double b_before = metricOr(metric::kBackendConnectionsTotal, lb);
    constexpr int kClients = 400;
    const auto weighted = spread(relay_.host(), relay_.port(), kClients);
    const int to_a = weighted.count('a') ? weighted.at('a') : 0;
    const int to_b = weighted.count('b') ? weighted.at('b') : 0;
    const double share = to_a / static_cast<double>(kClients);
    std::printf("weights 3:1, round robin, 2 workers: A took %d of %d (%.3f; ideal 0.75)\n", to_a,
                kClients, share);
    EXPECT_EQ(to_a + to_b, kClients) << "every client served";
    EXPECT_NEAR(share, 0.75, 0.05);
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsTotal, la, a_before + to_a));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsTotal, lb, b_before + to_b));

    // Every client is gone: the backends' active counts say 0 once the relay saw the closes.
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, la, 0));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, lb, 0));
    ApiReply cluster = get("/api/v1/clusters/app");
    ASSERT_TRUE(cluster.json) << cluster.describe();
    const Json* ja = findBackend(*cluster.json, a.address());
    const Json* jb = findBackend(*cluster.json, b.address());
    ASSERT_TRUE(ja && jb) << cluster.describe();
    EXPECT_TRUE(backendIs(*ja, {.address = a.address(), .weight = 3, .config_weight = 1}));
    EXPECT_TRUE(backendIs(*jb, {.address = b.address()}));
    EXPECT_EQ(relay_.metric(kAdminChanges, {{"change", "weight"}}), 2.0);
}

// =============================================================================================
// 5. shutdown ends A's live connections now (admin_shutdown, one per connection) and leaves
// B's relaying; A stays ready and takes new connections.

TEST_F(AdminApiTest, ShutdownEndsOnlyThatBackendsConnections) {
    TaggedBackend a('a'), b('b');
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_TRUE(b.ok()) << b.error();
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}, {b.address()}}));
    const Labels la = backendOf(a.address()), lb = backendOf(b.address());

    std::vector<Fd> of_a, of_b;
    for (int i = 0; i < 20 && (of_a.size() < 3 || of_b.size() < 3); ++i) {
        Fd fd = client();
        const char tag = servedBy(fd);
        if (tag == 'a' && of_a.size() < 3) of_a.push_back(std::move(fd));
        if (tag == 'b' && of_b.size() < 3) of_b.push_back(std::move(fd));
    }
    ASSERT_EQ(of_a.size(), 3u);
    ASSERT_EQ(of_b.size(), 3u);
    uint64_t seed = 100;
    for (auto* group : {&of_a, &of_b})
        for (Fd& fd : *group) ASSERT_TRUE(exchange(fd.get(), seed++));
    ASSERT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, la, 3));
    ASSERT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, lb, 3));
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("admin_shutdown")), 0.0);

    // The workers end the connections after the answer (active may still count them): the
    // clients and the metrics below are the oracle.
    EXPECT_TRUE(backendReply(post(backendPath(a.address()), "{\"shutdown\": true}"),
                             {.address = a.address(), .active = -1}));
    for (size_t i = 0; i < of_a.size(); ++i) {
        IoResult end = waitForPeerClose(of_a[i].get(), Millis{15'000});
        EXPECT_TRUE(endedByPeer(end)) << "A's client " << i << ": " << end.describe();
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("admin_shutdown"), 3));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, la, 0));
    EXPECT_EQ(relay_.metric(metric::kBackendConnectionsActive, lb), 3.0);
    EXPECT_EQ(relay_.metric(kAdminChanges, {{"change", "shutdown"}}), 1.0);

    // B's connections go on, byte-exact, and end as their clients end them.
    for (size_t i = 0; i < of_b.size(); ++i) {
        ReceiveCheck got = echoRoundTrip(of_b[i].get(), seed++, 128 * kKiB, Millis{20'000});
        EXPECT_EQ(got.io.status, IoStatus::Eof) << "B's client " << i << ": " << got.describe();
        EXPECT_EQ(got.bytes, 128 * kKiB) << got.describe();
        EXPECT_LT(got.first_mismatch, 0) << got.describe();
    }
    // shutdown alone leaves A ready.
    EXPECT_TRUE(backendReply(get(backendPath(a.address())), {.address = a.address()}));
    const auto after = spread(relay_.host(), relay_.port(), 8);
    EXPECT_GT(after.count('a') ? after.at('a') : 0, 0) << "A takes new connections after shutdown";
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("admin_shutdown")), 3.0)
        << "only the three were ended";
}

// =============================================================================================
// 8. SIGHUP keeps what the API set on the backends it keeps; a backend removed and added back
// starts from ready and its configured weight.

TEST_F(AdminApiTest, ReloadKeepsChangesOfKeptBackendsOnly) {
    TaggedBackend a('a'), b('b');
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_TRUE(b.ok()) << b.error();
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address(), 2}, {b.address(), 1}}));
    const Labels la = backendOf(a.address());
    const std::string path = backendPath(a.address());
    auto generation = [&] {
        ApiReply r = get("/api/v1/clusters");
        const Json* g = r.json ? r.json->get("generation") : nullptr;
        return g != nullptr && g->type == Json::Type::Number ? g->number : -1.0;
    };
    auto configWith = [&](const std::vector<BackendLine>& backends, const std::string& settings,
                          const std::string& idle) {
        RelayConfig config = clusterConfig(adminYaml("127.0.0.1:0"), clusterYaml(backends, settings));
        config.listeners[0].listen = "127.0.0.1:" + std::to_string(relay_.port());
        config.listeners[0].idle_timeout = idle;
        return config.yaml();
    };

    EXPECT_TRUE(backendReply(post(path, "{\"state\": \"drain\", \"weight\": 5}"),
                             {.address = a.address(),
                              .state = "drain",
                              .weight = 5,
                              .config_weight = 2,
                              .takes_new_connections = false}));
    const double g0 = generation();

    // Something unrelated changes: the cluster's retries, the listener's idle_timeout.
    ASSERT_TRUE(relay_.reload(
        configWith({{a.address(), 2}, {b.address(), 1}},
                   "    balance: round_robin\n    retries: 1\n", "200s")));
    EXPECT_GT(generation(), g0) << "the reload built a new generation";
    EXPECT_TRUE(backendReply(get(path), {.address = a.address(),
                                         .state = "drain",
                                         .weight = 5,
                                         .config_weight = 2,
                                         .takes_new_connections = false}));
    EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", "drain")), 1.0);
    EXPECT_EQ(relay_.metric(kBackendWeight, la), 5.0);
    const auto drained = spread(relay_.host(), relay_.port(), 20);
    EXPECT_EQ(drained.count('a') ? drained.at('a') : 0, 0) << "still drained after the reload";

    // Ready again, it takes its kept weight: 5 to B's 1 (per worker's smooth round robin, each
    // within one of its share).
    EXPECT_TRUE(backendReply(post(path, "{\"state\": \"ready\"}"),
                             {.address = a.address(), .weight = 5, .config_weight = 2}));
    const auto weighted = spread(relay_.host(), relay_.port(), 60);
    const int to_a = weighted.count('a') ? weighted.at('a') : 0;
    EXPECT_GE(to_a, 46) << "weight 5:1 should give A about 50 of 60";
    EXPECT_LE(to_a, 54) << "weight 5:1 should give A about 50 of 60";
    EXPECT_TRUE(backendReply(post(path, "{\"state\": \"drain\"}"),
                             {.address = a.address(),
                              .state = "drain",
                              .weight = 5,
                              .config_weight = 2,
                              .active = -1,  // the last client's close may be under way
                              .takes_new_connections = false}));

    // A leaves the config, then comes back: a backend of its own again.
    ASSERT_TRUE(relay_.reload(configWith({{b.address(), 1}}, "    balance: round_robin\n", "300s")));
    EXPECT_TRUE(isError(get(path), 404, a.address()));
    EXPECT_FALSE(relay_.metric(kBackendWeight, la).has_value()) << "A's series are gone";
    ASSERT_TRUE(relay_.reload(configWith({{a.address(), 2}, {b.address(), 1}},
                                         "    balance: round_robin\n", "300s")));
    EXPECT_TRUE(backendReply(get(path), {.address = a.address(), .weight = 2, .config_weight = 2}));
    EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", "ready")), 1.0);
    EXPECT_EQ(relay_.metric(kBackendWeight, la), 2.0);
    const auto back = spread(relay_.host(), relay_.port(), 30);
    const int back_a = back.count('a') ? back.at('a') : 0;
    EXPECT_GE(back_a, 17) << "weight 2:1 should give A about 20 of 30";
    EXPECT_LE(back_a, 23) << "weight 2:1 should give A about 20 of 30";
}

}  // namespace
}  // namespace zcrelay::test::admin_api_test
