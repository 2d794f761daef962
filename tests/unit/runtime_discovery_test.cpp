// Runtime::build with discovered backends: which backends a discovery cluster gets, what a
// rebuild keeps, how new discovered backends start, and the runtime API's per-backend state
// (admin state, weight override) as the balancers see it.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "balance.hpp"
#include "config.hpp"
#include "runtime.hpp"
#include "unit/config_values.hpp"

namespace zcrelay {
namespace {

using Discovered = std::map<std::string, std::vector<BackendConfig>>;

using unit::addr;

BackendConfig backend(std::string_view address, unsigned weight = 1,
                      ProxyVersion send_proxy = ProxyVersion::Off) {
    BackendConfig b;
    b.address = addr(address);
    b.weight = weight;
    b.send_proxy = send_proxy;
    return b;
}

// web:     discovered, send_proxy v1, no health checks
// checked: discovered, health checks
// hashed:  discovered, source_hash
// static:  two configured backends, health checks
const char* const kConfig =
    "clusters:\n"
    "  - name: web\n"
    "    send_proxy: v1\n"
    "    discovery: {dns: web.internal, port: 8080}\n"
    "  - name: checked\n"
    "    health_check: {interval: 1s}\n"
    "    discovery: {dns: checked.internal, port: 8080}\n"
    "  - name: hashed\n"
    "    balance: source_hash\n"
    "    discovery: {srv: _app._tcp.hashed.internal}\n"
    "  - name: static\n"
    "    health_check: {}\n"
    "    backends: [{address: 127.0.0.1:2, weight: 3}, {address: 127.0.0.1:3}]\n"
    "listeners:\n"
    "  - {name: a, listen: 127.0.0.1:1, cluster: web}\n"
    "  - {name: b, listen: 127.0.0.1:4, cluster: checked}\n"
    "  - {name: c, listen: 127.0.0.1:5, cluster: hashed}\n"
    "  - {name: d, listen: 127.0.0.1:6, cluster: static}\n";

Config config() { return loadConfigString(kConfig, "t.yaml"); }

const ClusterRt& cluster(const Runtime& rt, std::string_view name) {
    for (const ClusterRt& c : rt.clusters)
        if (c.config.name == name) return c;
    ADD_FAILURE() << "no cluster " << name;
    static const ClusterRt kNone;
    return kNone;
}

const BackendRt* find(const ClusterRt& c, std::string_view key) {
    for (const BackendRt& b : c.backends)
        if (b.key == key) return &b;
    return nullptr;
}

std::vector<std::string> keys(const ClusterRt& c) {
    std::vector<std::string> out;
    for (const BackendRt& b : c.backends) out.push_back(b.key);
    return out;
}

// Backends and specs agree: same order, same keys, the spec's weight is the backend's.
void expectSpecsMatchBackends(const ClusterRt& c) {
    ASSERT_EQ(c.specs.size(), c.backends.size()) << c.config.name;
    for (size_t i = 0; i < c.backends.size(); ++i) {
        EXPECT_EQ(c.specs[i].key, c.backends[i].key);
        EXPECT_EQ(c.specs[i].key, c.backends[i].config.address.toString());
        EXPECT_EQ(c.specs[i].weight, c.backends[i].config.weight) << c.backends[i].key;
    }
}

TEST(RuntimeDiscovery, ADiscoveryClusterTakesTheDiscoveredBackends) {
    const Discovered found = {
        {"web",
         {backend("10.0.0.1:8080", 2, ProxyVersion::V2), backend("[fd00::1]:8080", 5),
          backend("10.0.0.2:8080")}},
    };
    const auto rt = Runtime::build(config(), nullptr, 2, found);
    const ClusterRt& web = cluster(*rt, "web");
    EXPECT_EQ(keys(web),
              (std::vector<std::string>{"10.0.0.1:8080", "[fd00::1]:8080", "10.0.0.2:8080"}));
    expectSpecsMatchBackends(web);
    EXPECT_EQ(web.backends[0].config.weight, 2u);
    EXPECT_EQ(web.backends[0].spec_weight, 2u);
    EXPECT_EQ(web.backends[1].config.weight, 5u);
    EXPECT_EQ(web.backends[1].spec_weight, 5u);
    EXPECT_EQ(web.backends[2].config.weight, 1u);
    for (const BackendRt& b : web.backends) {
        // send_proxy is the cluster's, whatever the discovered entry carried.
        EXPECT_EQ(b.config.send_proxy, ProxyVersion::V1) << b.key;
        ASSERT_NE(b.state, nullptr);
        EXPECT_TRUE(b.state->up.load());  // no health checks: up from the start
        EXPECT_TRUE(b.state->takesNew());
        EXPECT_EQ(b.state->admin.load(), AdminState::Ready);
        EXPECT_EQ(b.state->weight_override.load(), -1);
        EXPECT_EQ(b.state->stats.size(), 2u);
    }
    // The config still holds no backends for it: they are the Runtime's alone.
    EXPECT_TRUE(web.config.backends.empty());
    EXPECT_TRUE(web.config.discovery.enabled());
}

TEST(RuntimeDiscovery, NoEntryMeansNoBackends) {
    const auto rt = Runtime::build(config(), nullptr, 1);
    for (const char* name : {"web", "checked", "hashed"}) {
        EXPECT_TRUE(cluster(*rt, name).backends.empty()) << name;
        EXPECT_TRUE(cluster(*rt, name).specs.empty()) << name;
    }
    // An entry for another cluster does not leak into this one; an empty entry is empty.
    const auto other = Runtime::build(config(), nullptr, 1,
                                      {{"checked", {backend("10.0.0.9:8080")}}, {"hashed", {}}});
    EXPECT_TRUE(cluster(*other, "web").backends.empty());
    EXPECT_TRUE(cluster(*other, "hashed").backends.empty());
    EXPECT_EQ(keys(cluster(*other, "checked")), std::vector<std::string>{"10.0.0.9:8080"});
    // And a Balancer over no backends picks nothing.
    Balancer none(Balance::RoundRobin, cluster(*rt, "web").specs, 1);
    EXPECT_EQ(none.pick(0, [](size_t) { return true; }, [](size_t) { return 0; }), -1);
}

TEST(RuntimeDiscovery, ARebuildKeepsTheStateOfAddressesThatStay) {
    const auto first = Runtime::build(
        config(), nullptr, 1,
        {{"web", {backend("10.0.0.1:8080"), backend("10.0.0.2:8080"), backend("10.0.0.3:8080")}}});
    const ClusterRt& web1 = cluster(*first, "web");
    const auto kept1 = find(web1, "10.0.0.2:8080")->state;
    const auto kept3 = find(web1, "10.0.0.3:8080")->state;
    const auto gone = find(web1, "10.0.0.1:8080")->state;
    kept1->active.store(4);
    kept1->stats[0].attempts.add(7);

    // .1 goes, .4 comes, the order changes.
    const auto second = Runtime::build(
        config(), first.get(), 1,
        {{"web", {backend("10.0.0.4:8080"), backend("10.0.0.3:8080"), backend("10.0.0.2:8080")}}});
    EXPECT_EQ(second->generation, first->generation + 1);
    const ClusterRt& web2 = cluster(*second, "web");
    EXPECT_EQ(keys(web2),
              (std::vector<std::string>{"10.0.0.4:8080", "10.0.0.3:8080", "10.0.0.2:8080"}));
    expectSpecsMatchBackends(web2);
    EXPECT_EQ(find(web2, "10.0.0.2:8080")->state, kept1);  // the same object, not a copy
    EXPECT_EQ(find(web2, "10.0.0.3:8080")->state, kept3);
    EXPECT_EQ(find(web2, "10.0.0.2:8080")->state->active.load(), 4);
    EXPECT_EQ(find(web2, "10.0.0.2:8080")->state->stats[0].attempts.get(), 7u);
    const auto fresh = find(web2, "10.0.0.4:8080")->state;
    ASSERT_NE(fresh, nullptr);
    EXPECT_NE(fresh, gone);
    EXPECT_NE(fresh, kept1);
    EXPECT_EQ(fresh->active.load(), 0);
    EXPECT_EQ(find(web2, "10.0.0.1:8080"), nullptr);
    // The old generation still holds what it had (live connections may refer to it).
    EXPECT_EQ(find(cluster(*first, "web"), "10.0.0.1:8080")->state, gone);

    // A backend that leaves and comes back later is new again: its old state is not revived.
    const auto third = Runtime::build(
        config(), second.get(), 1,
        {{"web", {backend("10.0.0.1:8080"), backend("10.0.0.2:8080")}}});
    EXPECT_NE(find(cluster(*third, "web"), "10.0.0.1:8080")->state, gone);
    EXPECT_EQ(find(cluster(*third, "web"), "10.0.0.2:8080")->state, kept1);

    // Same address in another cluster: another state (state is by cluster and address).
    const auto both = Runtime::build(config(), third.get(), 1,
                                     {{"web", {backend("10.0.0.2:8080")}},
                                      {"checked", {backend("10.0.0.2:8080")}}});
    EXPECT_EQ(find(cluster(*both, "web"), "10.0.0.2:8080")->state, kept1);
    EXPECT_NE(find(cluster(*both, "checked"), "10.0.0.2:8080")->state, kept1);
}

TEST(RuntimeDiscovery, WithHealthChecksNewDiscoveredBackendsStartDown) {
    const auto first = Runtime::build(
        config(), nullptr, 1, {{"checked", {backend("10.0.0.1:8080"), backend("10.0.0.2:8080")}}});
    const ClusterRt& checked1 = cluster(*first, "checked");
    for (const BackendRt& b : checked1.backends) {
        EXPECT_FALSE(b.state->up.load()) << b.key;
        EXPECT_FALSE(b.state->takesNew()) << b.key;
        // Starting down is not a transition: nothing is counted.
        EXPECT_EQ(b.state->went_down.load(), 0u);
    }
    // The checks pass for .1 only.
    EXPECT_TRUE(find(checked1, "10.0.0.1:8080")->state->markUp(true));

    const auto second = Runtime::build(
        config(), first.get(), 1,
        {{"checked", {backend("10.0.0.1:8080"), backend("10.0.0.2:8080"), backend("10.0.0.3:8080")}}});
    const ClusterRt& checked2 = cluster(*second, "checked");
    EXPECT_TRUE(find(checked2, "10.0.0.1:8080")->state->up.load());   // kept, up
    EXPECT_FALSE(find(checked2, "10.0.0.2:8080")->state->up.load());  // kept, still down
    EXPECT_FALSE(find(checked2, "10.0.0.3:8080")->state->up.load());  // new: down
    EXPECT_TRUE(find(checked2, "10.0.0.1:8080")->state->takesNew());

    // Without health checks a new discovered backend is up at once (nothing would bring it up).
    const auto web = Runtime::build(config(), second.get(), 1, {{"web", {backend("10.0.0.5:8080")}}});
    EXPECT_TRUE(find(cluster(*web, "web"), "10.0.0.5:8080")->state->up.load());
}

TEST(RuntimeDiscovery, StaticClustersAreUnaffected) {
    // An entry named after a static cluster is ignored: its backends are the config's.
    const auto first = Runtime::build(config(), nullptr, 1,
                                      {{"static", {backend("10.9.9.9:1")}},
                                       {"web", {backend("10.0.0.1:8080")}}});
    const ClusterRt& s1 = cluster(*first, "static");
    EXPECT_EQ(keys(s1), (std::vector<std::string>{"127.0.0.1:2", "127.0.0.1:3"}));
    expectSpecsMatchBackends(s1);
    EXPECT_EQ(s1.backends[0].config.weight, 3u);
    EXPECT_EQ(s1.backends[0].spec_weight, 3u);
    // Health-checked static backends start up, as before discovery existed.
    for (const BackendRt& b : s1.backends) {
        EXPECT_TRUE(b.state->up.load()) << b.key;
        EXPECT_EQ(b.config.send_proxy, ProxyVersion::Off);
    }
    // The listener-made cluster of an `upstream:` listener is there too, and static.
    Config with_upstream = config();
    ListenerConfig extra;
    extra.name = "up";
    extra.listen = addr("127.0.0.1:7");
    extra.upstream = addr("127.0.0.1:8");
    with_upstream.listeners.push_back(extra);
    const auto second = Runtime::build(with_upstream, first.get(), 1, {{"up", {backend("10.9.9.9:1")}}});
    EXPECT_EQ(keys(cluster(*second, "up")), std::vector<std::string>{"127.0.0.1:8"});
    // A rebuild keeps static state exactly as before.
    EXPECT_EQ(cluster(*second, "static").backends[0].state, s1.backends[0].state);
    EXPECT_EQ(cluster(*second, "static").backends[1].state, s1.backends[1].state);
}

TEST(RuntimeDiscovery, AWeightOverrideReplacesTheBalancerWeightOnly) {
    const Discovered found = {{"web", {backend("10.0.0.1:8080", 2), backend("10.0.0.2:8080", 2)}}};
    const auto first = Runtime::build(config(), nullptr, 1, found);
    find(cluster(*first, "web"), "10.0.0.1:8080")->state->weight_override.store(7);
    cluster(*first, "static").backends[1].state->weight_override.store(9);

    const auto second = Runtime::build(config(), first.get(), 1, found);
    const ClusterRt& web = cluster(*second, "web");
    expectSpecsMatchBackends(web);
    const BackendRt& set = *find(web, "10.0.0.1:8080");
    EXPECT_EQ(set.config.weight, 7u);
    EXPECT_EQ(set.spec_weight, 2u);  // the record's, for when the override is cleared
    EXPECT_EQ(web.specs[0].weight, 7u);
    const BackendRt& other = *find(web, "10.0.0.2:8080");
    EXPECT_EQ(other.config.weight, 2u);
    EXPECT_EQ(other.spec_weight, 2u);
    EXPECT_TRUE(set.state->takesNew());

    const ClusterRt& s = cluster(*second, "static");
    expectSpecsMatchBackends(s);
    EXPECT_EQ(s.backends[1].config.weight, 9u);
    EXPECT_EQ(s.backends[1].spec_weight, 1u);
    EXPECT_EQ(s.backends[0].config.weight, 3u);

    // Cleared (-1): the next build is back to the record's weight.
    set.state->weight_override.store(-1);
    const auto third = Runtime::build(config(), second.get(), 1, found);
    EXPECT_EQ(find(cluster(*third, "web"), "10.0.0.1:8080")->config.weight, 2u);
    EXPECT_EQ(cluster(*third, "web").specs[0].weight, 2u);

    // The round-robin share follows the override: 7 against 2.
    set.state->weight_override.store(7);
    const auto fourth = Runtime::build(config(), third.get(), 1, found);
    Balancer rr(Balance::RoundRobin, cluster(*fourth, "web").specs, 1);
    int to_first = 0;
    for (int i = 0; i < 900; ++i)
        to_first += rr.pick(0, [](size_t) { return true; }, [](size_t) { return 0; }) == 0;
    EXPECT_EQ(to_first, 700);
}

TEST(RuntimeDiscovery, WeightZeroAndAdminStatesTakeNoNewConnections) {
    const auto rt = Runtime::build(config(), nullptr, 1, {{"web", {backend("10.0.0.1:8080", 4)}}});
    BackendState& state = *cluster(*rt, "web").backends[0].state;
    ASSERT_TRUE(state.takesNew());

    state.weight_override.store(0);
    EXPECT_FALSE(state.takesNew());
    EXPECT_TRUE(state.up.load());  // weight 0 is not "down": health and metrics say up
    // Rebuilt with weight 0: no spec of weight 0 (the Balancer's range starts at 1); the
    // backend is kept out by takesNew(), not by its weight.
    const auto again = Runtime::build(config(), rt.get(), 1, {{"web", {backend("10.0.0.1:8080", 4)}}});
    EXPECT_EQ(cluster(*again, "web").backends[0].config.weight, 4u);
    EXPECT_EQ(cluster(*again, "web").specs[0].weight, 4u);
    EXPECT_FALSE(cluster(*again, "web").backends[0].state->takesNew());
    state.weight_override.store(-1);
    EXPECT_TRUE(state.takesNew());

    state.admin.store(AdminState::Drain);
    EXPECT_FALSE(state.takesNew());
    state.admin.store(AdminState::Maint);
    EXPECT_FALSE(state.takesNew());
    state.admin.store(AdminState::Ready);
    EXPECT_TRUE(state.takesNew());
    // Down wins over ready.
    state.markUp(false);
    EXPECT_FALSE(state.takesNew());
    state.markUp(true);
    EXPECT_TRUE(state.takesNew());

    // The admin state survives a rebuild that keeps the address.
    state.admin.store(AdminState::Drain);
    const auto kept = Runtime::build(config(), again.get(), 1, {{"web", {backend("10.0.0.1:8080", 4)}}});
    EXPECT_EQ(cluster(*kept, "web").backends[0].state->admin.load(), AdminState::Drain);
    EXPECT_FALSE(cluster(*kept, "web").backends[0].state->takesNew());
}

TEST(AdminState, NamesRoundTrip) {
    for (AdminState s : {AdminState::Ready, AdminState::Drain, AdminState::Maint})
        EXPECT_EQ(parseAdminState(adminStateName(s)), s);
    EXPECT_EQ(adminStateName(AdminState::Ready), "ready");
    EXPECT_EQ(adminStateName(AdminState::Drain), "drain");
    EXPECT_EQ(adminStateName(AdminState::Maint), "maint");
    for (const char* bad : {"", "Ready", "DRAIN", "maintenance", "up", "ready "})
        EXPECT_EQ(parseAdminState(bad), std::nullopt) << bad;
}

// ---- source_hash over a discovered set that grows by one ----

// Client n: 100.64.0.0/10 plus n, a port that varies (hashAddress ignores it).
SocketAddress client(uint32_t n) {
    sockaddr_in sin{};
    sin.sin_family = AF_INET;
    sin.sin_port = htons(static_cast<uint16_t>(1024 + n % 60000));
    sin.sin_addr.s_addr = htonl((100u << 24) | (64u << 16) | n);
    return addressFromSockaddr(reinterpret_cast<const sockaddr*>(&sin), sizeof sin);
}

TEST(RuntimeDiscovery, SourceHashMovesOnlyClientsToTheAddedBackend) {
    const std::vector<BackendConfig> four = {backend("10.0.0.1:80"), backend("10.0.0.2:80"),
                                             backend("10.0.0.3:80"), backend("10.0.0.4:80")};
    // The new backend arrives in the middle of the answer (DNS order is not stable).
    std::vector<BackendConfig> five = four;
    five.insert(five.begin() + 2, backend("10.0.0.5:80"));

    const auto before = Runtime::build(config(), nullptr, 2, {{"hashed", four}});
    const auto after = Runtime::build(config(), before.get(), 2, {{"hashed", five}});
    const ClusterRt& c4 = cluster(*before, "hashed");
    const ClusterRt& c5 = cluster(*after, "hashed");
    ASSERT_EQ(c4.config.balance, Balance::SourceHash);
    ASSERT_EQ(c4.specs.size(), 4u);
    ASSERT_EQ(c5.specs.size(), 5u);

    // As generation.cpp builds them, for two different workers (seeds differ per worker and
    // generation; source_hash must not depend on them).
    Balancer b4(Balance::SourceHash, c4.specs, 0x9e3779b97f4a7c15ull * 1 + before->generation);
    Balancer b5(Balance::SourceHash, c5.specs, 0x9e3779b97f4a7c15ull * 2 + after->generation);
    const auto all = [](size_t) { return true; };
    const auto idle = [](size_t) { return 0; };

    constexpr int kClients = 20000;
    int moved = 0;
    int between_old = 0;
    std::map<std::string, int> per_backend;
    for (uint32_t n = 0; n < kClients; ++n) {
        const uint64_t key = hashAddress(client(n));
        const int i4 = b4.pick(key, all, idle);
        const int i5 = b5.pick(key, all, idle);
        ASSERT_GE(i4, 0);
        ASSERT_GE(i5, 0);
        const std::string& from = c4.specs[static_cast<size_t>(i4)].key;
        const std::string& to = c5.specs[static_cast<size_t>(i5)].key;
        ++per_backend[to];
        if (from == to) continue;
        ++moved;
        if (to != "10.0.0.5:80") ++between_old;
    }
    const double share = static_cast<double>(moved) / kClients;
    std::printf("[ discover ] 4 -> 5 discovered backends: %.4f of %d clients moved (ideal 0.2000),"
                " %d between old backends\n",
                share, kClients, between_old);
    EXPECT_EQ(between_old, 0) << "clients moved between backends that stayed";
    EXPECT_EQ(per_backend["10.0.0.5:80"], moved);
    EXPECT_GE(share, 0.13);
    EXPECT_LE(share, 0.27);
}

}  // namespace
}  // namespace zcrelay
