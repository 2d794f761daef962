// From an answer to a set: the addresses refused as backends (address.hpp's reasons, and the
// relay's own endpoints), the set ordered by address and capped at max_backends, the refresh
// from the TTL, and the hold that keeps the last good set through failures.
#include <algorithm>
#include <cstring>
#include <optional>
#include <span>
#include <utility>

#include "clock.hpp"
#include "discovery_internal.hpp"
#include "log.hpp"

namespace zcrelay {

namespace {

bool byAddress(const BackendConfig& a, const BackendConfig& b) {
    if (a.address.family() != b.address.family()) return a.address.family() < b.address.family();
    return std::memcmp(&a.address.storage, &b.address.storage, sizeof a.address.storage) < 0;
}

// What refuses `a` as a backend given where the relay listens; `which` gets the own endpoint
// it is, for `self`.
std::optional<BackendRefusal> judge(const SocketAddress& a, const OwnEndpoints& own,
                                    std::span<const SocketAddress> local, std::string& which) {
    if (const auto r = refusalOf(a)) return r;
    for (const OwnEndpoint& o : own) {
        if (reaches(a, o.address, local)) {
            which = o.what;
            return BackendRefusal::Self;
        }
    }
    return std::nullopt;
}

// The host's addresses, when an own endpoint is a wildcard and so listens on all of them.
std::vector<SocketAddress> localIfWildcard(const OwnEndpoints& own) {
    const bool wildcard = std::any_of(own.begin(), own.end(), [](const OwnEndpoint& o) {
        return refusalOf(o.address) == BackendRefusal::Unspecified;
    });
    return wildcard ? localAddresses() : std::vector<SocketAddress>{};
}

}  // namespace

bool Discovery::dropOwnLocked() {
    if (own_.empty()) return false;
    const std::vector<SocketAddress> local = localIfWildcard(own_);
    bool dropped = false;
    for (auto& [name, v] : views_) {
        std::erase_if(v.backends, [&](const BackendConfig& b) {
            std::string which;
            if (judge(b.address, own_, local, which) != BackendRefusal::Self) return false;
            LOG_WARN("cluster %s: %s is now the relay's own %s: left out (a loop)", name.c_str(),
                     b.address.toString().c_str(), which.c_str());
            dropped = true;
            return true;
        });
    }
    if (dropped) ++version_;
    return dropped;
}

void Discovery::refuse(Entry& e, std::vector<BackendConfig>& found) {
    OwnEndpoints own;
    {
        std::lock_guard lock(mutex_);
        own = own_;
    }
    const std::vector<SocketAddress> local = localIfWildcard(own);
    std::array<uint64_t, static_cast<size_t>(BackendRefusal::kCount)> counts{};
    std::string note;
    size_t shown = 0;
    std::erase_if(found, [&](const BackendConfig& b) {
        std::string which;
        const auto r = judge(b.address, own, local, which);
        if (!r) return false;
        counts[static_cast<size_t>(*r)]++;
        if (shown++ < 8) {
            note += (note.empty() ? " " : ", ") + b.address.toString() + " (" +
                    std::string(label(*r)) + ": " +
                    (*r == BackendRefusal::Self ? "the relay's own " + which + ": a loop"
                                                : std::string(whyRefused(*r))) +
                    ")";
        }
        return true;
    });
    if (shown > 8) note += " (and " + std::to_string(shown - 8) + " more)";
    {
        std::lock_guard lock(mutex_);
        if (auto v = views_.find(e.cluster); v != views_.end()) {
            for (size_t r = 0; r < counts.size(); ++r) v->second.refused[r] += counts[r];
            v->second.refused_now = counts;
        }
    }
    // Once per change of what is refused: a refresh every second must not log every second.
    if (note == e.refused_note) return;
    if (note.empty()) {
        LOG_INFO("cluster %s: %s (%s) names no refused address any more", e.cluster.c_str(),
                 e.spec.name().c_str(), kindOf(e.spec));
    } else {
        LOG_WARN("cluster %s: refused as backends, from %s (%s):%s%s", e.cluster.c_str(),
                 e.spec.name().c_str(), kindOf(e.spec), note.c_str(),
                 found.empty() ? "; nothing else is left: the answer counts as no_records" : "");
    }
    e.refused_note = std::move(note);
}

void Discovery::answered(Entry& e, DiscoveryOutcome outcome, std::vector<BackendConfig> found,
                         uint32_t ttl) {
    e.in_flight = false;
    const int64_t now = monotonicMs();
    if (outcome == DiscoveryOutcome::Success && found.empty()) outcome = DiscoveryOutcome::NoData;
    std::vector<BackendConfig> set;
    uint64_t judged_own = 0;
    if (outcome == DiscoveryOutcome::Success) {
        std::sort(found.begin(), found.end(), [](const BackendConfig& a, const BackendConfig& b) {
            return byAddress(a, b) || (!byAddress(b, a) && a.tier < b.tier);
        });
        // One address may come from two SRV records (two ports are two backends; the same
        // port twice is one, in the lower of their priorities' tiers).
        found.erase(std::unique(found.begin(), found.end(),
                                [](const BackendConfig& a, const BackendConfig& b) {
                                    return a.address == b.address;
                                }),
                    found.end());
        {
            std::lock_guard lock(mutex_);
            judged_own = own_version_;
        }
        refuse(e, found);
        // Nothing usable is a failure like an empty answer: the last good set serves on.
        if (found.empty()) outcome = DiscoveryOutcome::NoData;
    }
    if (outcome == DiscoveryOutcome::Success) {
        if (found.size() > e.spec.max_backends) {
            if (!e.warned_cap)
                LOG_WARN(
                    "cluster %s: %s has %zu addresses; max_backends keeps %u, the lowest "
                    "priorities first, then the lowest addresses",
                    e.cluster.c_str(), e.spec.name().c_str(), found.size(), e.spec.max_backends);
            e.warned_cap = true;
            // The lowest tiers first: a cap keeps the backends that serve.
            std::stable_sort(
                found.begin(), found.end(),
                [](const BackendConfig& a, const BackendConfig& b) { return a.tier < b.tier; });
            found.resize(e.spec.max_backends);
            std::sort(found.begin(), found.end(), byAddress);
        }
        set = std::move(found);
        const int64_t refresh = std::clamp<int64_t>(int64_t{ttl} * 1000, msOf(e.spec.refresh_min),
                                                    msOf(e.spec.refresh_max));
        e.next_ms = now + refresh;
        if (e.failing)
            LOG_INFO("cluster %s: %s resolves again", e.cluster.c_str(), e.spec.name().c_str());
        e.failing = false;
        e.expired = false;
    } else {
        e.next_ms = now + msOf(e.spec.refresh_min);
        if (!e.failing) {
            e.failing = true;
            e.failing_since_ms = now;
            LOG_WARN("cluster %s: discovery of %s (%s) failed: %s; %s", e.cluster.c_str(),
                     e.spec.name().c_str(), kindOf(e.spec), std::string(label(outcome)).c_str(),
                     e.good.empty() ? "no backends yet, asking again"
                                    : ("the last good set (" + std::to_string(e.good.size()) +
                                       " backends) serves on for " + formatDuration(e.spec.hold))
                                          .c_str());
        }
    }
    bool publish_set = false;
    {
        std::lock_guard lock(mutex_);
        auto v = views_.find(e.cluster);
        if (v != views_.end()) {
            v->second.results[idx(outcome)]++;
            v->second.last = outcome;
            v->second.answered = true;
            if (outcome == DiscoveryOutcome::Success) {
                v->second.last_success_unix_ms = wallClockUs() / 1000;
                v->second.state = "ok";
            } else if (!e.expired) {
                v->second.state = e.good.empty() ? "expired" : "holding";
            }
        }
        publish_set = outcome == DiscoveryOutcome::Success && set != e.good;
        // The new set is in the view before a waiter (awaitFirstAnswers) can look.
        if (publish_set) record(e, std::move(set), "");
        // Where the relay listens changed while this answer was judged.
        if (publish_set && judged_own != own_version_) dropOwnLocked();
    }
    answered_cv_.notify_all();
    if (publish_set && changed_) changed_();
}

void Discovery::expireHolds(int64_t now_ms) {
    for (auto& e : entries_) {
        if (!e->failing || e->expired || now_ms < e->failing_since_ms + msOf(e->spec.hold))
            continue;
        e->expired = true;
        {
            std::lock_guard lock(mutex_);
            if (auto v = views_.find(e->cluster); v != views_.end()) v->second.state = "expired";
        }
        if (e->good.empty()) continue;
        if (e->spec.after_hold == AfterHold::Keep) {
            LOG_WARN(
                "cluster %s: %s has failed for %s (hold); after_hold: keep, so its %zu "
                "backends serve on",
                e->cluster.c_str(), e->spec.name().c_str(), formatDuration(e->spec.hold).c_str(),
                e->good.size());
            continue;
        }
        publish(*e, {}, "hold expired");
    }
}

}  // namespace zcrelay
