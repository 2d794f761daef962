#pragma once
// Internal to discovery (discovery.cpp, discovery_resolve.cpp, discovery_answers.cpp); callers
// include discovery.hpp. What the thread keeps per name and per query, the c-ares channel, and
// the small helpers the three files share.
#include <ares.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tl/expected.hpp>
#include <vector>

#include "discovery.hpp"

namespace zcrelay {

// One c-ares channel: its options from ResolversConfig. c-ares reads resolv.conf at init
// (search, ndots, nameservers); the channel is rebuilt on reload, so an edited resolv.conf is
// read again then.
class Discovery::Channel {
  public:
    static tl::expected<std::unique_ptr<Channel>, std::string> make(const ResolversConfig& r);
    ~Channel();
    ares_channel get() const { return channel_; }

  private:
    Channel() = default;
    ares_channel channel_{};
    bool live_ = false;
};

struct SrvTarget {
    std::string host;
    uint16_t port;
    uint32_t weight;
    uint32_t tier;  // its priority's rank among the answer's: 0 for the lowest
};

// One cluster's name, as the thread follows it.
struct Discovery::Entry {
    std::string cluster;
    DiscoveryConfig spec;
    uint64_t round = 0;  // bumped per ask: answers of an older round are dropped
    bool in_flight = false;
    int64_t next_ms = 0;              // when to ask again (monotonic)
    std::vector<BackendConfig> good;  // the set in use
    bool failing = false;
    bool expired = false;
    int64_t failing_since_ms = 0;
    bool warned_cap = false;
    std::string refused_note;  // what the last answer had refused, as logged
    // An SRV round: what its targets' lookups found so far.
    size_t targets_left = 0;
    std::vector<BackendConfig> gathered;
    uint32_t ttl = 0;
    DiscoveryOutcome target_failure = DiscoveryOutcome::NoData;
};

// What a c-ares callback needs to find its entry: freed by the callback.
struct Discovery::Query {
    Discovery* self;
    Entry* entry;
    uint64_t round;
    uint16_t port;
    uint32_t weight;
    bool srv_target;
    uint32_t tier = 0;  // an SRV target's (SrvTarget::tier)
};

// What a cluster asks for, as log lines and startup errors name it.
inline const char* kindOf(const DiscoveryConfig& d) { return d.dns.empty() ? "SRV" : "A/AAAA"; }

inline int64_t msOf(Duration d) { return d.count(); }

}  // namespace zcrelay
