#pragma once
// One generation of the running configuration, as the workers use it: the Config, its clusters
// with their backends, its listeners, and the shared state that outlives a reload.
//
// A Runtime is immutable once built and shared (shared_ptr) by every worker; SIGHUP builds the
// next one and hands it to each worker, which keeps the old one alive for as long as one of its
// connections still refers to it. What must survive a reload lives in objects the new Runtime
// takes over from the old by name:
//   ListenerShared  a listener's counters and live-connection count (by listener name)
//   BackendState    a backend's health, load and counters (by cluster name + backend address)
// so a reload that keeps a backend keeps its health state and its metrics continue.
//
// Counters are sharded per worker (Sharded<>): each shard has one writer, so an increment on
// the data path is a relaxed load + store, never a locked instruction. The few values all
// workers write (a backend's live connections, its failure streak, a listener's live count)
// are atomics touched once per connection, not per I/O.
#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "balance.hpp"
#include "clock.hpp"
#include "config.hpp"
#include "stats.hpp"

namespace zcrelay {

// One S per worker, each on its own cache lines so workers never share one.
template <class S>
class Sharded {
  public:
    explicit Sharded(unsigned shards) : shards_(std::make_unique<Slot[]>(shards)), n_(shards) {}
    S& operator[](unsigned w) { return shards_[w].value; }
    const S& operator[](unsigned w) const { return shards_[w].value; }
    unsigned size() const { return n_; }
    template <class F>
    uint64_t sum(F get) const {
        uint64_t total = 0;
        for (unsigned w = 0; w < n_; ++w) total += get(shards_[w].value);
        return total;
    }

  private:
    struct alignas(64) Slot {
        S value;
    };
    std::unique_ptr<Slot[]> shards_;
    unsigned n_;
};

// Upper bounds (seconds) of the connect time histogram: 100 us to 5 s, the span from a
// loopback backend to one behind a lossy link.
inline constexpr std::array<double, 15> kConnectBuckets = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5};

struct BackendStats {
    StatCounter attempts;     // connects started
    StatCounter connections;  // connects that succeeded
    std::array<StatCounter, idx(ConnectFailure::kCount)> connect_failures;
    StatCounter bytes_upstream;
    StatCounter bytes_downstream;
    UsHistogram<kConnectBuckets.size()> connect_time;
};

// What an operator set through the runtime API (admin_api.hpp), HAProxy's `set server state`:
//   ready  takes new connections while healthy (the default)
//   drain  takes no new connections; health checks go on; live connections finish
//   maint  takes no new connections and is not checked; live connections finish
enum class AdminState : uint8_t { Ready, Drain, Maint };
std::string_view adminStateName(AdminState s);
std::optional<AdminState> parseAdminState(std::string_view s);

struct BackendState {
    explicit BackendState(unsigned workers) : stats(workers) {}
    // Whether new connections may go here: health checks and passive ejection set it.
    std::atomic<bool> up{true};
    std::atomic<int32_t> active{0};            // live connections, all workers (least_conn)
    // Places taken under BackendConfig::max_connections, all workers: from the pick to the
    // close, connecting included, so that a burst of connects cannot overshoot the limit.
    std::atomic<int32_t> held{0};
    std::atomic<uint32_t> failure_streak{0};   // connect failures in a row (passive ejection)
    std::atomic<int64_t> ejected_until_ms{0};  // without checks: back up at this monotonic ms
    // The health check's streaks (its worker alone writes them, relaxed).
    std::atomic<uint32_t> check_passes{0};
    std::atomic<uint32_t> check_fails{0};
    std::atomic<uint64_t> checks_passed{0};
    std::atomic<uint64_t> checks_failed{0};
    std::atomic<uint64_t> went_up{0};
    std::atomic<uint64_t> went_down{0};
    // The runtime API's: kept by a reload that keeps the backend (by cluster and address).
    std::atomic<AdminState> admin{AdminState::Ready};
    std::atomic<int32_t> weight_override{-1};  // -1: the config's (or the SRV record's)
    // When it last came up (monotonic ms; 0: up since the start): slow_start ramps from here.
    std::atomic<int64_t> up_since_ms{0};
    Sharded<BackendStats> stats;

    // slow_start's share of its weight now, of Balancer::kFullRamp: linear from the moment it
    // came up (HAProxy's `slowstart`), full once `slow_start` has passed.
    uint64_t ramp(Duration slow_start, int64_t now_ms) const {
        const int64_t since = up_since_ms.load(std::memory_order_relaxed);
        if (slow_start.count() <= 0 || since == 0 || now_ms - since >= slow_start.count())
            return Balancer::kFullRamp;
        return std::max<uint64_t>(1, static_cast<uint64_t>(now_ms - since) * Balancer::kFullRamp /
                                         static_cast<uint64_t>(slow_start.count()));
    }

    // Whether a new connection may be sent here: up, ready, and a weight above 0.
    bool takesNew() const {
        return up.load(std::memory_order_relaxed) &&
               admin.load(std::memory_order_relaxed) == AdminState::Ready &&
               weight_override.load(std::memory_order_relaxed) != 0;
    }

    // A place under `max` (0: no limit, always true); false at the limit. Any worker.
    bool take(unsigned max) {
        if (max == 0) return true;
        int32_t now = held.load(std::memory_order_relaxed);
        while (now < static_cast<int32_t>(max))
            if (held.compare_exchange_weak(now, now + 1, std::memory_order_relaxed)) return true;
        return false;
    }
    bool full(unsigned max) const {
        return max != 0 && held.load(std::memory_order_relaxed) >= static_cast<int32_t>(max);
    }

    // It takes connections again from now (up, back to ready, added while running):
    // slow_start ramps it from here.
    void cameUp() { up_since_ms.store(monotonicMs(), std::memory_order_relaxed); }

    // Health checks, passive ejection and its timeout all switch `up` through this; any
    // worker may, so the switch is a compare-and-swap. True if this call changed it (and
    // counted the transition); false if it already was so.
    bool markUp(bool to) {
        bool from = !to;
        if (!up.compare_exchange_strong(from, to)) return false;
        (to ? went_up : went_down).fetch_add(1, std::memory_order_relaxed);
        if (to) cameUp();
        return true;
    }
};

// Live connections per client address (the port ignored; IPv4 and its v4-mapped IPv6 form
// are one client), for max_connections_per_source. Touched once per connection, and only when
// that limit is set: a mutex there is cheaper than anything lock-free would be to get right.
class SourceCounts {
  public:
    // One more for `a` unless it holds `limit` already; true if counted.
    bool take(const SocketAddress& a, uint64_t limit);
    void give(const SocketAddress& a);

  private:
    using Key = std::array<uint8_t, 16>;  // mappedIp(): the port ignored, IPv4 as v4-mapped
    struct KeyHash {
        size_t operator()(const Key& k) const;
    };

    std::mutex mutex_;
    std::unordered_map<Key, uint32_t, KeyHash> counts_;
};

struct ListenerShared {
    explicit ListenerShared(unsigned workers) : stats(workers) {}
    Sharded<ListenerStats> stats;
    std::atomic<uint32_t> live{0};  // connections of this listener now, all workers
    SourceCounts sources;
};

struct BackendRt {
    BackendConfig config;  // weight: the runtime API's, when it set one above 0
    unsigned spec_weight = 1;  // the config's, or the SRV record's
    std::string key;  // the address text: the metric label, the source_hash ring position
    std::shared_ptr<BackendState> state;
};

// Which backends a new connection may go to now, by tier (HAProxy's `backup`, SRV priorities):
// only the lowest tier with a backend that takes new connections serves; in a tier of
// `backup: true` backends without all_backups, only the first of them that does. Read once per
// pick from atomics other workers write, so a flap between two reads costs one pick's choice,
// never a pick of a backend that is down.
struct Serving {
    unsigned tier = 0;
    int only = -1;  // >= 0: the one backend that serves (first backup), else the whole tier
    bool any = false;
    template <class Backends>
    bool admits(const Backends& backends, size_t i) const {
        return any && backends[i].config.tier == tier &&
               (only < 0 || static_cast<int>(i) == only) && backends[i].state->takesNew();
    }
};

struct ClusterRt {
    ClusterConfig config;
    std::vector<BackendRt> backends;
    std::vector<BackendSpec> specs;  // for each worker's Balancer
    bool tiered = false;             // a backend has tier > 0: serving() scans

    // The tier (and backup) taking new connections now; `any` false when none can. Without
    // tiers every backend is tier 0 and admits() is takesNew(): no scan.
    Serving serving() const {
        if (!tiered) return {0, -1, true};
        Serving s;
        for (size_t i = 0; i < backends.size(); ++i) {
            const BackendRt& b = backends[i];
            if (!b.state->takesNew()) continue;
            if (s.any && b.config.tier >= s.tier) continue;
            s = {b.config.tier, -1, true};
            if (b.config.backup && !config.all_backups) s.only = static_cast<int>(i);
        }
        return s;
    }
};

// A route's counters, taken over by a reload that keeps a route of that name in its listener.
struct RouteState {
    explicit RouteState(unsigned workers) : selections(workers) {}
    Sharded<StatCounter> selections;  // connections the route took
};

struct RouteRt {
    RouteConfig config;
    uint32_t cluster = 0;  // index into Runtime::clusters
    std::shared_ptr<RouteState> state;
};

struct ListenerRt {
    ListenerConfig config;
    // Index into Runtime::clusters: the listener's cluster, or kNoRoute (routes only, none
    // without a condition).
    uint32_t cluster = 0;
    // config.routes in order, and the default route: the first without a condition, or the
    // listener's cluster appended as one (named after it); kNoRoute when there is none.
    std::vector<RouteRt> routes;
    uint32_t default_route = kNoRoute;
    std::shared_ptr<ListenerShared> shared;

    static constexpr uint32_t kNoRoute = UINT32_MAX;
    bool inspects() const { return !config.routes.empty(); }
};

struct Runtime {
    Config config;
    std::vector<ClusterRt> clusters;
    std::vector<ListenerRt> listeners;
    uint64_t generation = 0;

    // Takes over the shared state of `previous` (may be null) for every listener and backend
    // that is still there. A cluster with `discovery` takes its backends from `discovered`
    // (none when it has no entry); a backend new to such a cluster starts down when the
    // cluster has health checks, so it is checked before it takes a connection.
    static std::shared_ptr<const Runtime> build(Config config, const Runtime* previous,
                                                unsigned workers,
                                                const std::map<std::string,
                                                               std::vector<BackendConfig>>&
                                                    discovered = {});
};

}  // namespace zcrelay
