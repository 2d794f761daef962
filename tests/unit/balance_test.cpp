#include "balance.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

// Counts global operator new while a test arms it: "pick() never allocates" is a claim about the
// hot path that a code review cannot keep true, a counter can. Forwarding to malloc keeps every
// other test in this binary unaffected.
namespace {
std::atomic<bool> gCountAllocations{false};
std::atomic<long> gAllocations{0};
}  // namespace

void* operator new(std::size_t size) {
    if (gCountAllocations.load(std::memory_order_relaxed)) {
        gAllocations.fetch_add(1, std::memory_order_relaxed);
    }
    if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
    throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return ::operator new(size); }
// GCC 12 sees `new T` (our malloc) and the matching delete (our free) inlined together and warns
// -Wmismatched-new-delete: a known false positive for replaced allocation functions.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace zcrelay {
namespace {

constexpr auto kAllUsable = [](size_t) { return true; };
constexpr auto kIdle = [](size_t) { return 0; };

// Backends "10.0.0.<first>:80", "10.0.0.<first+1>:80", ... with the given weights.
std::vector<BackendSpec> specs(std::vector<uint32_t> weights, int first = 1) {
    std::vector<BackendSpec> out;
    for (size_t i = 0; i < weights.size(); ++i) {
        out.push_back(
            {"10.0.0." + std::to_string(first + static_cast<int>(i)) + ":80", weights[i]});
    }
    return out;
}

std::vector<int> countPicks(Balancer& b, int picks, auto usable, auto active) {
    std::vector<int> counts(b.size(), 0);
    for (int k = 0; k < picks; ++k) {
        const int i = b.pick(0, usable, active);
        if (i >= 0) ++counts[i];
    }
    return counts;
}

SocketAddress ipv4(uint32_t host_order, uint16_t port) {
    sockaddr_in sin{};
    sin.sin_family = AF_INET;
    sin.sin_addr.s_addr = htonl(host_order);
    sin.sin_port = htons(port);
    return addressFromSockaddr(reinterpret_cast<const sockaddr*>(&sin), sizeof(sin));
}

// 100k distinct clients from 10.0.0.0/8, hashed the way the worker hashes them.
std::vector<uint64_t> clientKeys() {
    std::vector<uint64_t> keys;
    for (uint32_t k = 0; k < 100'000; ++k) {
        keys.push_back(hashAddress(ipv4(0x0a000000u + k * 7919u % 0x00ffffffu, 40000)));
    }
    return keys;
}

// The backend key (address text) each client lands on: indices differ between Balancers built
// from different lists, keys do not.
std::vector<std::string> assign(Balancer& b, const std::vector<BackendSpec>& backends,
                                const std::vector<uint64_t>& keys, auto usable) {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const uint64_t key : keys) {
        const int i = b.pick(key, usable, kIdle);
        out.push_back(i < 0 ? std::string() : backends[i].key);
    }
    return out;
}

TEST(BalanceName, RoundTripsEveryKind) {
    for (const Balance b :
         {Balance::RoundRobin, Balance::LeastConn, Balance::Random, Balance::SourceHash}) {
        EXPECT_EQ(parseBalance(balanceName(b)), b) << balanceName(b);
    }
    EXPECT_EQ(balanceName(Balance::RoundRobin), "round_robin");
    EXPECT_EQ(balanceName(Balance::LeastConn), "least_conn");
    EXPECT_EQ(balanceName(Balance::Random), "random");
    EXPECT_EQ(balanceName(Balance::SourceHash), "source_hash");
}

TEST(BalanceName, RejectsOtherSpellings) {
    for (const char* s : {"", "roundrobin", "leastconn", "Round_Robin", "source", "random "}) {
        EXPECT_EQ(parseBalance(s), std::nullopt) << '"' << s << '"';
    }
}

TEST(RoundRobin, SmoothSequenceForWeights511) {
    const auto backends = specs({5, 1, 1});
    Balancer b(Balance::RoundRobin, backends, 0);  // seed 0: scans start at backend 0, as nginx
    std::vector<int> seq;
    for (int k = 0; k < 14; ++k) seq.push_back(b.pick(0, kAllUsable, kIdle));
    // a,a,b,a,c,a,a twice: interleaved, never five a's in a row.
    EXPECT_EQ(seq, (std::vector<int>{0, 0, 1, 0, 2, 0, 0, 0, 0, 1, 0, 2, 0, 0}));
}

TEST(RoundRobin, ExactProportionsOver7000Picks) {
    const auto backends = specs({4, 2, 1});
    for (const uint64_t seed : {0, 1, 2, 12345}) {
        Balancer b(Balance::RoundRobin, backends, seed);
        EXPECT_EQ(countPicks(b, 7000, kAllUsable, kIdle), (std::vector<int>{4000, 2000, 1000}))
            << "seed " << seed;
    }
    const auto uneven = specs({3, 2, 1});
    Balancer b(Balance::RoundRobin, uneven, 7);
    EXPECT_EQ(countPicks(b, 6000, kAllUsable, kIdle), (std::vector<int>{3000, 2000, 1000}));
}

TEST(RoundRobin, SeedsSpreadWorkersFirstPicks) {
    // Eight workers, four equal backends, one connection each: not all to backend 0.
    const auto backends = specs({1, 1, 1, 1});
    std::vector<int> firsts(4, 0);
    for (uint64_t seed = 0; seed < 8; ++seed) {
        Balancer b(Balance::RoundRobin, backends, seed);
        ++firsts[b.pick(0, kAllUsable, kIdle)];
    }
    EXPECT_GE(std::count_if(firsts.begin(), firsts.end(), [](int c) { return c > 0; }), 3);
}

TEST(RoundRobin, SkippingDownBackendKeepsOthersRatio) {
    const auto backends = specs({3, 2, 1});
    Balancer b(Balance::RoundRobin, backends, 0);
    countPicks(b, 5, kAllUsable, kIdle);  // mid-cycle, to show the skip does not need a clean start
    const auto bDown = [](size_t i) { return i != 1; };
    const auto counts = countPicks(b, 4000, bDown, kIdle);
    EXPECT_EQ(counts[1], 0);
    EXPECT_NEAR(counts[0], 3000, 2);
    EXPECT_NEAR(counts[2], 1000, 2);
}

TEST(Balancer, AllUnusableReturnsMinusOne) {
    const auto backends = specs({1, 2, 3});
    const auto none = [](size_t) { return false; };
    for (const Balance kind :
         {Balance::RoundRobin, Balance::LeastConn, Balance::Random, Balance::SourceHash}) {
        Balancer b(kind, backends, 3);
        for (uint64_t key = 0; key < 50; ++key) {
            EXPECT_EQ(b.pick(key * 0x9e3779b97f4a7c15ULL, none, kIdle), -1) << balanceName(kind);
        }
        Balancer empty(kind, {}, 3);
        EXPECT_EQ(empty.pick(1, kAllUsable, kIdle), -1) << balanceName(kind);
    }
}

TEST(Balancer, RetryAfterFailedConnectPicksAnotherBackend) {
    // The worker's retry loop: mark each tried backend unusable until none is left.
    const auto backends = specs({1, 5, 2, 1});
    for (const Balance kind :
         {Balance::RoundRobin, Balance::LeastConn, Balance::Random, Balance::SourceHash}) {
        Balancer b(kind, backends, 9);
        std::vector<bool> tried(backends.size(), false);
        const auto untried = [&](size_t j) { return !tried[j]; };
        for (size_t attempt = 0; attempt < backends.size(); ++attempt) {
            const int i = b.pick(42, untried, kIdle);
            ASSERT_GE(i, 0) << balanceName(kind);
            EXPECT_FALSE(tried[i]) << balanceName(kind);
            tried[i] = true;
        }
        EXPECT_EQ(b.pick(42, untried, kIdle), -1);
    }
}

TEST(Balancer, PickDoesNotAllocate) {
    const auto backends = specs({3, 1, 4, 1, 5, 9, 2, 6});
    std::vector<int> active{5, 0, 3, 3, 0, 8, 1, 2};
    const auto load = [&](size_t i) { return active[i]; };
    const auto oddDown = [](size_t i) { return i % 2 == 0; };
    for (const Balance kind :
         {Balance::RoundRobin, Balance::LeastConn, Balance::Random, Balance::SourceHash}) {
        Balancer b(kind, backends, 1);
        gAllocations = 0;
        gCountAllocations = true;
        for (uint64_t k = 0; k < 1000; ++k) {
            b.pick(k * 0x9e3779b97f4a7c15ULL, kAllUsable, load);
            b.pick(k * 0x9e3779b97f4a7c15ULL, oddDown, load);
        }
        gCountAllocations = false;
        EXPECT_EQ(gAllocations.load(), 0) << balanceName(kind);
    }
}

TEST(LeastConn, PicksLeastLoadedRelativeToWeight) {
    const auto equal = specs({1, 1, 1});
    Balancer b(Balance::LeastConn, equal, 0);
    std::vector<int> active{5, 2, 7};
    EXPECT_EQ(b.pick(0, kAllUsable, [&](size_t i) { return active[i]; }), 1);

    // 6 connections on weight 4 (1.5 each) is lighter than 2 on weight 1.
    const auto weighted = specs({4, 1});
    Balancer w(Balance::LeastConn, weighted, 0);
    active = {6, 2};
    EXPECT_EQ(w.pick(0, kAllUsable, [&](size_t i) { return active[i]; }), 0);
    active = {9, 2};  // 2.25 vs 2
    EXPECT_EQ(w.pick(0, kAllUsable, [&](size_t i) { return active[i]; }), 1);

    // The least loaded one is down: the next least loaded.
    active = {5, 2, 7};
    const auto oneDown = [](size_t i) { return i != 1; };
    EXPECT_EQ(b.pick(0, oneDown, [&](size_t i) { return active[i]; }), 0);
}

TEST(LeastConn, LongConnectionsFillInWeightProportion) {
    // Every pick opens a connection that stays: the counts follow the weights.
    const auto backends = specs({3, 2, 1});
    Balancer b(Balance::LeastConn, backends, 5);
    std::vector<int> active(3, 0);
    const auto load = [&](size_t i) { return active[i]; };
    for (int k = 0; k < 600; ++k) ++active[b.pick(0, kAllUsable, load)];
    EXPECT_EQ(active, (std::vector<int>{300, 200, 100}));
}

TEST(LeastConn, SpreadsTies) {
    // Short connections: every backend is idle at every pick. Equal idle backends share the
    // connections instead of all going to the lowest index...
    const auto equal = specs({1, 1, 1, 1});
    Balancer b(Balance::LeastConn, equal, 0);
    std::vector<int> seq;
    for (int k = 0; k < 4; ++k) seq.push_back(b.pick(0, kAllUsable, kIdle));
    std::sort(seq.begin(), seq.end());
    EXPECT_EQ(seq, (std::vector<int>{0, 1, 2, 3}));
    EXPECT_EQ(countPicks(b, 400, kAllUsable, kIdle), (std::vector<int>{100, 100, 100, 100}));

    // ...and weighted idle backends share them by weight.
    const auto weighted = specs({3, 1});
    Balancer w(Balance::LeastConn, weighted, 0);
    EXPECT_EQ(countPicks(w, 4000, kAllUsable, kIdle), (std::vector<int>{3000, 1000}));

    // Only the tied-least backends take part: the busy one gets nothing.
    std::vector<int> active{0, 4, 0, 0};
    EXPECT_EQ(countPicks(b, 300, kAllUsable, [&](size_t i) { return active[i]; }),
              (std::vector<int>{100, 0, 100, 100}));
}

TEST(Random, FollowsWeightsWhenLoadIsEqual) {
    const auto backends = specs({3, 2, 1});
    Balancer b(Balance::Random, backends, 11);
    const auto counts = countPicks(b, 60'000, kAllUsable, kIdle);
    EXPECT_NEAR(counts[0], 30'000, 1'000);
    EXPECT_NEAR(counts[1], 20'000, 1'000);
    EXPECT_NEAR(counts[2], 10'000, 1'000);
}

TEST(Random, PowerOfTwoChoicesFavoursIdleBackend) {
    // Three busy backends and one idle: blind random would give the idle one 25%. With two
    // distinct candidates it wins whenever it is one of them: 1 - 3/4 * 2/3 = 50%.
    const auto backends = specs({1, 1, 1, 1});
    Balancer b(Balance::Random, backends, 12);
    const std::vector<int> active{100, 100, 100, 0};
    const auto counts = countPicks(b, 100'000, kAllUsable, [&](size_t i) { return active[i]; });
    std::printf("[ P2C      ] picks per backend with load {100,100,100,0}: %d %d %d %d\n",
                counts[0], counts[1], counts[2], counts[3]);
    EXPECT_GT(counts[3], 45'000);
    for (int i = 0; i < 3; ++i) EXPECT_LT(counts[i], 20'000);
}

TEST(Random, CandidatesAreDistinct) {
    // With two usable backends the candidates are both of them, so the busy one never wins.
    const auto backends = specs({1, 1, 1});
    Balancer b(Balance::Random, backends, 13);
    const std::vector<int> active{0, 50, 7};
    const auto counts = countPicks(
        b, 10'000, [](size_t i) { return i != 2; }, [&](size_t i) { return active[i]; });
    EXPECT_EQ(counts, (std::vector<int>{10'000, 0, 0}));

    const auto only = countPicks(
        b, 100, [](size_t i) { return i == 1; }, kIdle);
    EXPECT_EQ(only, (std::vector<int>{0, 100, 0}));
}

TEST(SourceHash, SameKeySameBackend) {
    const auto backends = specs({1, 1, 1, 1});
    Balancer a(Balance::SourceHash, backends, 1);
    Balancer other_worker(Balance::SourceHash, backends, 2);
    for (const uint64_t key : clientKeys()) {
        const int first = a.pick(key, kAllUsable, kIdle);
        EXPECT_EQ(a.pick(key, kAllUsable, kIdle), first);
        EXPECT_EQ(other_worker.pick(key, kAllUsable, kIdle), first);
    }
}

TEST(SourceHash, SpreadsEvenlyOverEqualBackends) {
    const auto backends = specs({1, 1, 1, 1});
    Balancer b(Balance::SourceHash, backends, 0);
    std::vector<int> counts(4, 0);
    for (const uint64_t key : clientKeys()) ++counts[b.pick(key, kAllUsable, kIdle)];
    std::printf("[ ring     ] 100k clients over 4 equal backends: %d %d %d %d\n", counts[0],
                counts[1], counts[2], counts[3]);
    for (const int c : counts) EXPECT_NEAR(c, 25'000, 25'000 * 0.15);
}

TEST(SourceHash, SharesFollowWeights) {
    const auto backends = specs({3, 1});
    Balancer b(Balance::SourceHash, backends, 0);
    EXPECT_EQ(b.ringPoints(), 4u * Balancer::kRingPointsPerWeight);
    std::vector<int> counts(2, 0);
    for (const uint64_t key : clientKeys()) ++counts[b.pick(key, kAllUsable, kIdle)];
    EXPECT_NEAR(counts[0], 75'000, 75'000 * 0.1);
}

TEST(SourceHash, AddingBackendMovesOnlyKeysToIt) {
    const auto four = specs({1, 1, 1, 1});
    const auto five = specs({1, 1, 1, 1, 1});
    Balancer before(Balance::SourceHash, four, 0);
    Balancer after(Balance::SourceHash, five, 0);
    const auto keys = clientKeys();
    const auto was = assign(before, four, keys, kAllUsable);
    const auto now = assign(after, five, keys, kAllUsable);
    int moved = 0;
    for (size_t k = 0; k < keys.size(); ++k) {
        if (was[k] == now[k]) continue;
        ++moved;
        EXPECT_EQ(now[k], five[4].key) << "client " << k << " moved from " << was[k];
    }
    const double share = static_cast<double>(moved) / static_cast<double>(keys.size());
    std::printf("[ ring     ] add 1 backend to 4: %.4f of clients moved (ideal 0.2000)\n", share);
    RecordProperty("moved_share_add", std::to_string(share));
    EXPECT_GE(share, 0.15);
    EXPECT_LE(share, 0.25);
}

TEST(SourceHash, RemovingBackendMovesOnlyItsKeys) {
    const auto five = specs({1, 1, 1, 1, 1});
    // Remove the middle one, so the survivors' indices shift: the ring must not care.
    std::vector<BackendSpec> four = five;
    four.erase(four.begin() + 2);
    Balancer before(Balance::SourceHash, five, 0);
    Balancer after(Balance::SourceHash, four, 0);
    const auto keys = clientKeys();
    const auto was = assign(before, five, keys, kAllUsable);
    const auto now = assign(after, four, keys, kAllUsable);
    int moved = 0;
    for (size_t k = 0; k < keys.size(); ++k) {
        if (was[k] == now[k]) continue;
        ++moved;
        EXPECT_EQ(was[k], five[2].key) << "client " << k << " moved to " << now[k];
    }
    const double share = static_cast<double>(moved) / static_cast<double>(keys.size());
    const auto on_removed = std::count(was.begin(), was.end(), five[2].key);
    std::printf("[ ring     ] remove 1 backend of 5: %.4f of clients moved (ideal 0.2000)\n",
                share);
    RecordProperty("moved_share_remove", std::to_string(share));
    EXPECT_EQ(moved, on_removed);  // all of its clients, and only those
    EXPECT_GE(share, 0.15);
    EXPECT_LE(share, 0.25);
}

TEST(SourceHash, DownBackendKeysMoveAndComeBack) {
    const auto five = specs({1, 1, 1, 1, 1});
    Balancer b(Balance::SourceHash, five, 0);
    const auto keys = clientKeys();
    const auto up = assign(b, five, keys, kAllUsable);
    const auto down = assign(b, five, keys, [](size_t i) { return i != 3; });
    int moved = 0;
    std::vector<int> moved_to(5, 0);
    for (size_t k = 0; k < keys.size(); ++k) {
        if (up[k] == down[k]) continue;
        ++moved;
        EXPECT_EQ(up[k], five[3].key) << "client " << k;
        for (size_t i = 0; i < five.size(); ++i) moved_to[i] += down[k] == five[i].key;
    }
    const double share = static_cast<double>(moved) / static_cast<double>(keys.size());
    std::printf(
        "[ ring     ] mark 1 of 5 down: %.4f of clients moved (ideal 0.2000), to %d %d %d "
        "- %d\n",
        share, moved_to[0], moved_to[1], moved_to[2], moved_to[4]);
    RecordProperty("moved_share_down", std::to_string(share));
    EXPECT_EQ(moved, std::count(up.begin(), up.end(), five[3].key));
    EXPECT_GE(share, 0.15);
    EXPECT_LE(share, 0.25);
    // Its clients spread over the survivors rather than all landing on one neighbour.
    for (const size_t i : {0, 1, 2, 4}) EXPECT_GT(moved_to[i], moved / 10) << i;

    EXPECT_EQ(assign(b, five, keys, kAllUsable), up);
}

TEST(SourceHash, PlacementDependsOnKeysNotOrder) {
    const auto backends = specs({1, 2, 1, 3});
    std::vector<BackendSpec> reversed(backends.rbegin(), backends.rend());
    Balancer a(Balance::SourceHash, backends, 0);
    Balancer r(Balance::SourceHash, reversed, 0);
    const auto keys = clientKeys();
    EXPECT_EQ(assign(a, backends, keys, kAllUsable), assign(r, reversed, keys, kAllUsable));
}

TEST(SourceHash, RingIsCappedForManyHeavyBackends) {
    std::vector<BackendSpec> backends;
    for (int i = 0; i < 300; ++i) backends.push_back({"[fd00::" + std::to_string(i) + "]:80", 256});
    Balancer b(Balance::SourceHash, backends, 0);
    EXPECT_LE(b.ringPoints(), Balancer::kMaxRingPoints);
    EXPECT_GE(b.ringPoints(), 300u * 256u);  // still at least one point per unit of weight
    EXPECT_GE(b.pick(12345, kAllUsable, kIdle), 0);
}

TEST(HashAddress, V4MappedEqualsV4AndPortIsIgnored) {
    const auto v4 = parseAddress("192.0.2.7:1000");
    const auto mapped = parseAddress("[::ffff:192.0.2.7]:2000");
    const auto v4_other_port = parseAddress("192.0.2.7:65535");
    ASSERT_TRUE(v4 && mapped && v4_other_port);
    EXPECT_EQ(hashAddress(*v4), hashAddress(*mapped));
    EXPECT_EQ(hashAddress(*v4), hashAddress(*v4_other_port));

    const auto neighbour = parseAddress("192.0.2.8:1000");
    const auto v6 = parseAddress("[2001:db8::7]:1000");
    const auto compat = parseAddress("[::192.0.2.7]:1000");  // not v4-mapped: a different client
    ASSERT_TRUE(neighbour && v6 && compat);
    EXPECT_NE(hashAddress(*v4), hashAddress(*neighbour));
    EXPECT_NE(hashAddress(*v4), hashAddress(*v6));
    EXPECT_NE(hashAddress(*v4), hashAddress(*compat));
}

TEST(HashAddress, IsStableAcrossProcesses) {
    // The value is part of the contract (every worker and every restart must agree), so pin it:
    // a change here reshuffles every source_hash client.
    const auto a = parseAddress("198.51.100.1:80");
    ASSERT_TRUE(a);
    EXPECT_EQ(hashAddress(*a), 0x2cddb4614b5af07cULL);
    EXPECT_EQ(hashAddress(ipv4(0xc6336401u, 9)), 0x2cddb4614b5af07cULL);
}

}  // namespace
}  // namespace zcrelay
