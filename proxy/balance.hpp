#pragma once
// How a cluster chooses the backend for a new connection: smooth weighted round robin, least
// connections, power of two random choices, and consistent hashing of the client's address.
//
// Each worker owns one Balancer per cluster, so the Balancer's own state (round-robin weights, the
// PRNG) is plain memory with no atomics. Whether a backend is up and how many connections it has
// are shared by all workers, so pick() asks the caller about them through callables instead of
// holding that state. pick() runs once per connection attempt (again after a failed connect, with
// the tried backends reported unusable) and never allocates: every buffer it needs is sized in the
// constructor, which runs at start-up and on reload.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "address.hpp"

namespace zcrelay {

enum class Balance : uint8_t { RoundRobin, LeastConn, Random, SourceHash };

// "round_robin", "least_conn", "random", "source_hash": the names the config accepts.
std::string_view balanceName(Balance b);
// Parses those names; std::nullopt otherwise.
std::optional<Balance> parseBalance(std::string_view s);

// The config rejects weights outside this range; the Balancer clamps to it anyway so that its
// overflow reasoning (active * weight in 64 bits) holds whatever it is handed.
inline constexpr uint32_t kMinWeight = 1;
inline constexpr uint32_t kMaxWeight = 256;

struct BackendSpec {
    // The backend's address text. source_hash places the backend on the ring by this, not by its
    // position in the list, so reordering the list or adding a backend on reload keeps clients
    // where they were.
    std::string key;
    uint32_t weight = 1;
};

// A 64-bit hash of the client's IP address for source_hash. The port is ignored (a client's next
// connection comes from another port) and a v4-mapped IPv6 address hashes like the IPv4 address
// (a dual-stack listener sees IPv4 clients in that form). The value depends only on the address
// bytes, never on a per-process seed, so every worker and every restart sends a client to the
// same backend.
uint64_t hashAddress(const SocketAddress& a);

class Balancer {
  public:
    // nginx's `hash ... consistent` uses 160 points per unit of weight: enough that four equal
    // backends each take 25% +- 7% of 100k clients (balance_test measures it).
    static constexpr uint32_t kRingPointsPerWeight = 160;
    // 300 backends of weight 256 would want 12M points (190 MB) per worker. Past this total the
    // points per unit of weight shrink; a backend keeps its first replicas (positions depend on
    // the replica index), so the shrink itself moves few clients.
    static constexpr size_t kMaxRingPoints = size_t{1} << 18;

    // Builds the round-robin state and, for source_hash, the ring. `seed` makes workers differ:
    // it seeds the PRNG (random) and the backend each worker's scans start from, so that N
    // workers with one new connection each do not all send it to backend 0.
    Balancer(Balance kind, std::span<const BackendSpec> backends, uint64_t seed);

    Balance kind() const { return kind_; }
    size_t size() const { return weights_.size(); }
    size_t ringPoints() const { return ring_.size(); }

    // The backend to try: an index into the constructor's `backends`, or -1 when `usable(i)` is
    // false for all of them.
    //   usable(i) -> bool:     the backend is up and not already tried for this connection.
    //   active(i) -> integer:  its current connection count (least_conn and random only).
    //   source_key:            hashAddress() of the client (source_hash only).
    // The callables read state other workers change concurrently, so round_robin, least_conn
    // and random ask about each backend once per call and decide from that snapshot; a backend
    // flapping mid-pick cannot make them pick an unusable one or lose a candidate.
    template <class Usable, class Active>
    int pick(uint64_t source_key, Usable&& usable, Active&& active) {
        return pick(source_key, usable, active, [](size_t) { return kFullRamp; });
    }
    // With slow start: ramp(i) -> [1, kFullRamp], the share of its weight backend i has now
    // (a backend that just came up starts low and ramps to full). Round robin, least_conn and
    // random weigh by weight * ramp; source_hash places clients by the ring and ignores it.
    static constexpr uint64_t kFullRamp = 1000;
    template <class Usable, class Active, class Ramp>
    int pick(uint64_t source_key, Usable&& usable, Active&& active, Ramp&& ramp) {
        // source_hash never reads them: its fast path stays O(log points).
        if (kind_ != Balance::SourceHash)
            for (size_t i = 0; i < weights_.size(); ++i)
                effective_[i] = weights_[i] * std::clamp<uint64_t>(ramp(i), 1, kFullRamp);
        switch (kind_) {
            case Balance::RoundRobin:
                return pickRoundRobin(usable);
            case Balance::LeastConn:
                return pickLeastConn(usable, active);
            case Balance::Random:
                return pickRandom(usable, active);
            case Balance::SourceHash:
                return pickSourceHash(source_key, usable);
        }
        return -1;
    }

  private:
    struct RingPoint {
        uint64_t position;
        uint32_t backend;
    };

    // In scratch_: the backend was unusable when this pick looked.
    static constexpr uint64_t kUnusable = UINT64_MAX;
    // Connection counts are clamped to this so that count * weight cannot overflow 64 bits.
    static constexpr uint64_t kMaxActive = UINT32_MAX;
    // source_hash asks usable() point by point this many times before it snapshots all backends:
    // the common case (the first point's backend is up) stays O(log points).
    static constexpr int kRingFastSteps = 8;

    // nginx's smooth weighted round robin over the backends `eligible(i)` admits: each gains its
    // weight, the largest is chosen and gives back the total. Weights 5,1,1 give a,a,b,a,c,a,a
    // rather than a burst of five a's, and a skipped backend's current weight stays where it was,
    // so the others keep their proportions.
    template <class Eligible>
    int smoothStep(Eligible&& eligible) {
        const size_t n = weights_.size();
        int64_t total = 0;
        int best = -1;
        for (size_t k = 0, i = start_; k < n; ++k, i = (i + 1 == n) ? 0 : i + 1) {
            if (!eligible(i)) continue;
            current_[i] += static_cast<int64_t>(effective_[i]);
            total += static_cast<int64_t>(effective_[i]);
            if (best < 0 || current_[i] > current_[best]) best = static_cast<int>(i);
        }
        if (best >= 0) current_[best] -= total;
        return best;
    }

    template <class Usable>
    int pickRoundRobin(Usable& usable) {
        return smoothStep([&](size_t i) { return static_cast<bool>(usable(i)); });
    }

    // a / wa < b / wb without division: effective weights are below 2^18 and counts clamped
    // to 2^32, so no overflow.
    bool lessLoaded(uint64_t a, size_t ia, uint64_t b, size_t ib) const {
        return a * effective_[ib] < b * effective_[ia];
    }

    uint64_t loadOf(auto& active, size_t i) {
        return std::min<uint64_t>(static_cast<uint64_t>(active(i)), kMaxActive);
    }

    // Fewest connections per unit of weight. Ties go through smooth round robin like nginx's
    // least_conn: with short connections every backend is idle at each pick, and a plain
    // "lowest index wins" would send everything to backend 0 and ignore the weights.
    template <class Usable, class Active>
    int pickLeastConn(Usable& usable, Active& active) {
        const size_t n = weights_.size();
        int best = -1;
        for (size_t i = 0; i < n; ++i) {
            scratch_[i] = usable(i) ? loadOf(active, i) : kUnusable;
            if (scratch_[i] == kUnusable) continue;
            if (best < 0 || lessLoaded(scratch_[i], i, scratch_[best], best)) {
                best = static_cast<int>(i);
            }
        }
        if (best < 0) return -1;
        const uint64_t least = scratch_[best];
        const size_t at = static_cast<size_t>(best);
        return smoothStep([&](size_t i) {
            return scratch_[i] != kUnusable && !lessLoaded(least, at, scratch_[i], i);
        });
    }

    // Power of two choices: two distinct weighted-random candidates, the less loaded wins. It
    // avoids both herding (every worker choosing the one least-loaded backend from the same
    // slightly stale counts) and blind random's long queues.
    template <class Usable, class Active>
    int pickRandom(Usable& usable, Active& active) {
        const size_t n = weights_.size();
        uint64_t total = 0;
        for (size_t i = 0; i < n; ++i) {
            scratch_[i] = usable(i) ? effective_[i] : 0;
            total += scratch_[i];
        }
        if (total == 0) return -1;
        const int first = weightedAt(randomBelow(total), -1);
        const uint64_t rest = total - effective_[first];
        if (rest == 0) return first;  // the only usable backend
        const int second = weightedAt(randomBelow(rest), first);
        const uint64_t a = loadOf(active, first);
        const uint64_t b = loadOf(active, second);
        // Equal loads keep the first candidate, itself a weighted draw, so idle backends share
        // connections in proportion to their weights.
        return lessLoaded(b, second, a, first) ? second : first;
    }

    // The backend whose slice of the usable weights (scratch_) holds r, skipping `skip`.
    int weightedAt(uint64_t r, int skip) const {
        const size_t n = weights_.size();
        int last = -1;
        for (size_t i = 0; i < n; ++i) {
            if (scratch_[i] == 0 || static_cast<int>(i) == skip) continue;
            if (r < scratch_[i]) return static_cast<int>(i);
            r -= scratch_[i];
            last = static_cast<int>(i);
        }
        return last;  // unreachable while r < the sum of the weights it was drawn from
    }

    // The first point clockwise from source_key whose backend is usable. A down backend's clients
    // continue to the following points, which belong to many backends, so they spread out, and
    // nobody else's clients move.
    template <class Usable>
    int pickSourceHash(uint64_t source_key, Usable& usable) {
        if (ring_.empty()) return -1;
        const auto it =
            std::lower_bound(ring_.begin(), ring_.end(), source_key,
                             [](const RingPoint& p, uint64_t key) { return p.position < key; });
        size_t at = (it == ring_.end()) ? 0 : static_cast<size_t>(it - ring_.begin());
        const auto advance = [&] { at = (at + 1 == ring_.size()) ? 0 : at + 1; };

        for (int step = 0; step < kRingFastSteps; ++step, advance()) {
            if (usable(ring_[at].backend)) return static_cast<int>(ring_[at].backend);
        }
        // Many points in a row are unusable (several backends down, or all of them): look at
        // each backend once instead of once per point, then walk on from where we stopped.
        bool any = false;
        for (size_t i = 0; i < weights_.size(); ++i) {
            scratch_[i] = usable(i) ? 1 : 0;
            any = any || scratch_[i] != 0;
        }
        if (!any) return -1;
        // Terminates: every backend owns at least one point.
        for (;; advance()) {
            if (scratch_[ring_[at].backend] != 0) return static_cast<int>(ring_[at].backend);
        }
    }

    // splitmix64: one add and a mix per draw, eight bytes of state, and statistically fine for
    // choosing backends; <random> engines are larger than the whole Balancer.
    uint64_t nextRandom() {
        uint64_t z = (rng_ += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }

    // Lemire's multiply-shift: uniform enough in [0, bound) for bounds far below 2^64, no division.
    uint64_t randomBelow(uint64_t bound) {
        __extension__ using Wide = unsigned __int128;  // GCC and Clang on every 64-bit target
        return static_cast<uint64_t>((static_cast<Wide>(nextRandom()) * bound) >> 64);
    }

    Balance kind_;
    std::vector<uint32_t> weights_;
    // Smooth round-robin state: round_robin, and least_conn's tie-breaks.
    std::vector<int64_t> current_;
    // One slot per backend, rewritten by every pick: what this pick saw of usable/active, so
    // each callable runs once per backend and pick() needs no allocation.
    std::vector<uint64_t> scratch_;
    // weights_ times each backend's ramp, set at the start of every pick: what round robin,
    // least_conn and random weigh by.
    std::vector<uint64_t> effective_;
    // source_hash only: points sorted by position.
    std::vector<RingPoint> ring_;
    uint64_t rng_;
    // Where smooth round robin's scan begins, so its ties (all backends at the start, equal
    // weights) go to a different backend on each worker.
    size_t start_ = 0;
};

}  // namespace zcrelay
