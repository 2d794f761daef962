// Asking c-ares: the channel, one name's query (A/AAAA through getaddrinfo, or SRV and then
// each target's addresses), and its answer turned into candidate backends, an outcome and a
// TTL. What is made of them is discovery_answers.cpp.
#include <ares.h>
#include <ares_nameser.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "discovery_internal.hpp"

namespace zcrelay {

namespace {

DiscoveryOutcome outcomeOf(int status) {
    switch (status) {
        case ARES_SUCCESS:
            return DiscoveryOutcome::Success;
        case ARES_ENOTFOUND:
            return DiscoveryOutcome::NxDomain;
        case ARES_ENODATA:
            return DiscoveryOutcome::NoData;
        case ARES_ESERVFAIL:
            return DiscoveryOutcome::ServFail;
        case ARES_EREFUSED:
            return DiscoveryOutcome::Refused;
        case ARES_ETIMEOUT:
            return DiscoveryOutcome::Timeout;
        case ARES_ECONNREFUSED:
            return DiscoveryOutcome::Unreachable;
        default:
            return DiscoveryOutcome::Error;
    }
}

int familyOf(AddressFamilies f) {
    switch (f) {
        case AddressFamilies::Ipv4:
            return AF_INET;
        case AddressFamilies::Ipv6:
            return AF_INET6;
        case AddressFamilies::Any:
            break;
    }
    return AF_UNSPEC;
}

// The smallest TTL in the answer section of a DNS message: c-ares parses SRV records without
// theirs. Walks the header, the questions and the answers, bounds-checked; 0 when malformed
// (the caller clamps to refresh_min).
uint32_t minAnswerTtl(const unsigned char* m, int len) {
    const auto n = static_cast<size_t>(len);
    if (n < 12) return 0;
    size_t at = 12;
    const auto skipName = [&]() -> bool {
        while (at < n) {
            const unsigned char l = m[at];
            if ((l & 0xc0) == 0xc0) {  // a pointer ends the name
                at += 2;
                return at <= n;
            }
            if (l == 0) {
                ++at;
                return true;
            }
            at += 1 + l;
        }
        return false;
    };
    const unsigned questions = (m[4] << 8) | m[5];
    const unsigned answers = (m[6] << 8) | m[7];
    for (unsigned q = 0; q < questions; ++q) {
        if (!skipName() || at + 4 > n) return 0;
        at += 4;
    }
    uint32_t ttl = UINT32_MAX;
    for (unsigned a = 0; a < answers; ++a) {
        if (!skipName() || at + 10 > n) return 0;
        const uint32_t t = (uint32_t{m[at + 4]} << 24) | (uint32_t{m[at + 5]} << 16) |
                           (uint32_t{m[at + 6]} << 8) | m[at + 7];
        ttl = std::min(ttl, t);
        at += 10 + ((m[at + 8] << 8) | m[at + 9]);
        if (at > n) return 0;
    }
    return ttl == UINT32_MAX ? 0 : ttl;
}

// The addresses of a getaddrinfo answer at `port`, and its smallest TTL.
void collect(const ares_addrinfo* ai, uint16_t port, uint32_t weight, uint32_t tier,
             std::vector<BackendConfig>& out, uint32_t& ttl) {
    for (const ares_addrinfo_cname* c = ai->cnames; c; c = c->next)
        ttl = std::min(ttl, static_cast<uint32_t>(std::max(0, c->ttl)));
    for (const ares_addrinfo_node* n = ai->nodes; n; n = n->ai_next) {
        if (n->ai_family != AF_INET && n->ai_family != AF_INET6) continue;
        SocketAddress a = addressFromSockaddr(n->ai_addr, n->ai_addrlen);
        a.setPort(port);
        ttl = std::min(ttl, static_cast<uint32_t>(std::max(0, n->ai_ttl)));
        BackendConfig b;
        b.address = a;
        b.weight = weight;
        b.tier = tier;
        out.push_back(b);
    }
}

}  // namespace

tl::expected<std::unique_ptr<Discovery::Channel>, std::string> Discovery::Channel::make(
    const ResolversConfig& r) {
    auto c = std::unique_ptr<Channel>(new Channel());
    ares_options opts{};
    int mask = ARES_OPT_TIMEOUTMS | ARES_OPT_TRIES | ARES_OPT_LOOKUPS | ARES_OPT_RESOLVCONF;
    opts.timeout = static_cast<int>(r.timeout.count());
    opts.tries = static_cast<int>(r.attempts);
    // DNS only: never /etc/hosts, whose entries are not the orchestrator's.
    char lookups[] = "b";
    opts.lookups = lookups;
    std::string resolv_conf = r.resolv_conf;
    opts.resolvconf_path = resolv_conf.data();
    const int status = ares_init_options(&c->channel_, &opts, mask);
    if (status != ARES_SUCCESS)
        return tl::unexpected(std::string("c-ares init: ") + ares_strerror(status));
    c->live_ = true;
    if (!r.nameservers.empty()) {
        std::string csv;
        for (const SocketAddress& a : r.nameservers) csv += (csv.empty() ? "" : ",") + a.toString();
        const int set = ares_set_servers_ports_csv(c->channel_, csv.c_str());
        if (set != ARES_SUCCESS)
            return tl::unexpected("resolvers.nameservers " + csv + ": " + ares_strerror(set));
    }
    return c;
}

Discovery::Channel::~Channel() {
    // Every query still in flight completes now with ARES_EDESTRUCTION.
    if (live_) ares_destroy(channel_);
}

void Discovery::ask(Entry& e) {
    e.in_flight = true;
    ++e.round;
    if (!channel_) {
        answered(e, DiscoveryOutcome::Error, {}, 0);
        return;
    }
    if (!e.spec.dns.empty()) {
        auto* q =
            new Query{this, &e, e.round, static_cast<uint16_t>(e.spec.port), e.spec.weight, false};
        ares_addrinfo_hints hints{};
        hints.ai_family = familyOf(e.spec.family);
        hints.ai_socktype = SOCK_STREAM;
        // No sorting: c-ares would connect() a UDP socket to every address to order them by
        // RFC 6724; answered() sorts the set by address anyway.
        hints.ai_flags = ARES_AI_NOSORT;
        ares_getaddrinfo(
            channel_->get(), e.spec.dns.c_str(), nullptr, &hints,
            [](void* arg, int status, int, ares_addrinfo* ai) {
                std::unique_ptr<Query> q(static_cast<Query*>(arg));
                if (status == ARES_EDESTRUCTION || q->round != q->entry->round) {
                    if (ai) ares_freeaddrinfo(ai);
                    return;
                }
                std::vector<BackendConfig> found;
                uint32_t ttl = UINT32_MAX;
                if (status == ARES_SUCCESS && ai) collect(ai, q->port, q->weight, 0, found, ttl);
                if (ai) ares_freeaddrinfo(ai);
                q->self->answered(*q->entry, outcomeOf(status), std::move(found),
                                  ttl == UINT32_MAX ? 0 : ttl);
            },
            q);
        return;
    }
    auto* q = new Query{this, &e, e.round, 0, 0, false};
    ares_search(
        channel_->get(), e.spec.srv.c_str(), C_IN, T_SRV,
        [](void* arg, int status, int, unsigned char* abuf, int alen) {
            std::unique_ptr<Query> q(static_cast<Query*>(arg));
            if (status == ARES_EDESTRUCTION || q->round != q->entry->round) return;
            Entry& e = *q->entry;
            if (status != ARES_SUCCESS) {
                q->self->answered(e, outcomeOf(status), {}, 0);
                return;
            }
            ares_srv_reply* reply = nullptr;
            const int parsed = ares_parse_srv_reply(abuf, alen, &reply);
            if (parsed != ARES_SUCCESS) {
                q->self->answered(e, outcomeOf(parsed), {}, 0);
                return;
            }
            // RFC 2782: the lowest priority is tried first; the others stand by while it has a
            // target. Each priority is a tier (ClusterRt::serving): the lowest serves while one
            // of its backends is up, the next when none is. A target "." says the service is
            // not offered there.
            std::vector<uint16_t> priorities;
            for (const ares_srv_reply* r = reply; r; r = r->next)
                if (std::strcmp(r->host, ".") != 0 && r->host[0] != '\0')
                    priorities.push_back(r->priority);
            std::sort(priorities.begin(), priorities.end());
            priorities.erase(std::unique(priorities.begin(), priorities.end()), priorities.end());
            std::vector<SrvTarget> targets;
            for (const ares_srv_reply* r = reply; r; r = r->next) {
                if (std::strcmp(r->host, ".") == 0 || r->host[0] == '\0') continue;
                const auto rank =
                    std::lower_bound(priorities.begin(), priorities.end(), r->priority) -
                    priorities.begin();
                targets.push_back({r->host, r->port,
                                   std::clamp<uint32_t>(r->weight, kMinWeight, kMaxWeight),
                                   static_cast<uint32_t>(rank)});
            }
            ares_free_data(reply);
            q->self->askTargets(e, std::move(targets), minAnswerTtl(abuf, alen));
        },
        q);
}

void Discovery::askTargets(Entry& e, std::vector<SrvTarget> targets, uint32_t ttl) {
    if (targets.empty()) {
        answered(e, DiscoveryOutcome::NoData, {}, ttl);
        return;
    }
    e.targets_left = targets.size();
    e.gathered.clear();
    e.ttl = ttl;
    e.target_failure = DiscoveryOutcome::NoData;
    for (const SrvTarget& t : targets) {
        auto* q = new Query{this, &e, e.round, t.port, t.weight, true, t.tier};
        ares_addrinfo_hints hints{};
        hints.ai_family = familyOf(e.spec.family);
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = ARES_AI_NOSORT;
        // Targets are absolute names (RFC 2782): the trailing dot keeps search domains off.
        const std::string name = t.host.back() == '.' ? t.host : t.host + ".";
        ares_getaddrinfo(
            channel_->get(), name.c_str(), nullptr, &hints,
            [](void* arg, int status, int, ares_addrinfo* ai) {
                std::unique_ptr<Query> q(static_cast<Query*>(arg));
                if (status == ARES_EDESTRUCTION || q->round != q->entry->round) {
                    if (ai) ares_freeaddrinfo(ai);
                    return;
                }
                Entry& e = *q->entry;
                uint32_t ttl = e.ttl;
                if (status == ARES_SUCCESS && ai) {
                    collect(ai, q->port, q->weight, q->tier, e.gathered, ttl);
                    e.ttl = ttl;
                } else {
                    e.target_failure = outcomeOf(status);
                }
                if (ai) ares_freeaddrinfo(ai);
                if (--e.targets_left > 0) return;
                // Targets that fail are left out; the round fails only if none resolved.
                const DiscoveryOutcome outcome =
                    e.gathered.empty() ? e.target_failure : DiscoveryOutcome::Success;
                q->self->answered(e, outcome, std::move(e.gathered), e.ttl);
            },
            q);
    }
}

}  // namespace zcrelay
