#include "balance.hpp"

#include <netinet/in.h>

#include <array>
#include <cstring>

namespace zcrelay {
namespace {

struct BalanceNameEntry {
    Balance kind;
    std::string_view name;
};

constexpr std::array<BalanceNameEntry, 4> kBalanceNames{{
    {Balance::RoundRobin, "round_robin"},
    {Balance::LeastConn, "least_conn"},
    {Balance::Random, "random"},
    {Balance::SourceHash, "source_hash"},
}};

// splitmix64's finalizer: a bijection that spreads every input bit over the output, so clients in
// one /24 or backends named 10.0.0.1:80, 10.0.0.2:80 land far apart on the ring.
constexpr uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// FNV-1a: fixed constants, no per-process seed (unlike std::hash), so ring positions are the same
// in every worker, every restart and every build.
constexpr uint64_t fnv1a(std::string_view text) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (const char c : text) {
        h ^= static_cast<uint8_t>(c);
        h *= 0x100000001b3ULL;
    }
    return h;
}

// Replica r of a backend sits at a position fixed by its key and r alone: adding a backend, or
// shrinking the points per weight, leaves every other point where it was.
constexpr uint64_t ringPosition(uint64_t key_hash, uint32_t replica) {
    return mix64(key_hash + (uint64_t{replica} + 1) * 0x9e3779b97f4a7c15ULL);
}

uint64_t loadBigEndian(const uint8_t* p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
    return v;
}

}  // namespace

std::string_view balanceName(Balance b) {
    for (const auto& entry : kBalanceNames) {
        if (entry.kind == b) return entry.name;
    }
    return "unknown";
}

std::optional<Balance> parseBalance(std::string_view s) {
    for (const auto& entry : kBalanceNames) {
        if (entry.name == s) return entry.kind;
    }
    return std::nullopt;
}

uint64_t hashAddress(const SocketAddress& a) {
    // Both families reduce to the 16 bytes of an IPv6 address, IPv4 as ::ffff:a.b.c.d, which is
    // how a dual-stack socket reports the same client.
    uint8_t bytes[16] = {};
    if (a.family() == AF_INET) {
        const auto& sin = *reinterpret_cast<const sockaddr_in*>(a.sockaddrPtr());
        bytes[10] = 0xff;
        bytes[11] = 0xff;
        std::memcpy(bytes + 12, &sin.sin_addr, 4);
    } else if (a.family() == AF_INET6) {
        const auto& sin6 = *reinterpret_cast<const sockaddr_in6*>(a.sockaddrPtr());
        std::memcpy(bytes, &sin6.sin6_addr, 16);
    } else {
        return 0;
    }
    // Read as big-endian so the value does not depend on the host's byte order.
    return mix64(loadBigEndian(bytes) ^ mix64(loadBigEndian(bytes + 8)));
}

Balancer::Balancer(Balance kind, std::span<const BackendSpec> backends, uint64_t seed)
    : kind_(kind),
      current_(backends.size(), 0),
      scratch_(backends.size(), 0),
      effective_(backends.size(), 0),
      rng_(seed),
      start_(backends.empty() ? 0 : static_cast<size_t>(mix64(seed) % backends.size())) {
    weights_.reserve(backends.size());
    uint64_t total_weight = 0;
    for (const auto& backend : backends) {
        weights_.push_back(std::clamp(backend.weight, kMinWeight, kMaxWeight));
        total_weight += weights_.back();
    }
    if (kind_ != Balance::SourceHash || backends.empty()) return;

    const uint64_t per_weight =
        std::clamp<uint64_t>(kMaxRingPoints / total_weight, 1, kRingPointsPerWeight);
    ring_.reserve(per_weight * total_weight);
    for (size_t i = 0; i < backends.size(); ++i) {
        const uint64_t key_hash = fnv1a(backends[i].key);
        const uint64_t points = per_weight * weights_[i];
        for (uint32_t r = 0; r < points; ++r) {
            ring_.push_back({ringPosition(key_hash, r), static_cast<uint32_t>(i)});
        }
    }
    // Equal positions are as rare as 64-bit collisions; the index breaks them only so the sort is
    // deterministic.
    std::sort(ring_.begin(), ring_.end(), [](const RingPoint& a, const RingPoint& b) {
        return a.position != b.position ? a.position < b.position : a.backend < b.backend;
    });
}

}  // namespace zcrelay
