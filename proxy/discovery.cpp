#include "discovery.hpp"

#include <ares.h>
#include <ares_nameser.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <span>
#include <utility>

#include "clock.hpp"
#include "log.hpp"

namespace zcrelay {

std::string_view label(DiscoveryOutcome o) { return kDiscoveryOutcomeLabels[idx(o)]; }

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

const char* kindOf(const DiscoveryConfig& d) { return d.dns.empty() ? "SRV" : "A/AAAA"; }

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

int64_t msOf(Duration d) { return d.count(); }

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

std::string listOf(const std::vector<BackendConfig>& from, const std::vector<BackendConfig>& to,
                   char sign) {
    std::string out;
    size_t shown = 0, hidden = 0;
    for (const BackendConfig& b : from) {
        if (std::find(to.begin(), to.end(), b) != to.end()) continue;
        if (shown++ < 8)
            out += std::string(" ") + sign + b.address.toString();
        else
            ++hidden;
    }
    if (hidden) out += " (and " + std::to_string(hidden) + " more)";
    return out;
}

bool byAddress(const BackendConfig& a, const BackendConfig& b) {
    if (a.address.family() != b.address.family()) return a.address.family() < b.address.family();
    return std::memcmp(&a.address.storage, &b.address.storage, sizeof a.address.storage) < 0;
}

}  // namespace

// One c-ares channel: its options from ResolversConfig. c-ares reads resolv.conf at init
// (search, ndots, nameservers); the channel is rebuilt on reload, so an edited resolv.conf is
// read again then.
class Discovery::Channel {
  public:
    static tl::expected<std::unique_ptr<Channel>, std::string> make(const ResolversConfig& r) {
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
            for (const SocketAddress& a : r.nameservers)
                csv += (csv.empty() ? "" : ",") + a.toString();
            const int set = ares_set_servers_ports_csv(c->channel_, csv.c_str());
            if (set != ARES_SUCCESS)
                return tl::unexpected("resolvers.nameservers " + csv + ": " + ares_strerror(set));
        }
        return c;
    }
    ~Channel() {
        // Every query still in flight completes now with ARES_EDESTRUCTION.
        if (live_) ares_destroy(channel_);
    }
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
};

Duration Discovery::firstAnswerBound(const ResolversConfig& r) {
    // Every nameserver, every attempt, then an SRV answer's targets as many times again.
    const size_t servers = std::max<size_t>(1, r.nameservers.size());
    return Duration(2 * r.timeout.count() * r.attempts * servers + 500);
}

Discovery::Discovery(std::function<void()> changed) : changed_(std::move(changed)) {}

tl::expected<std::unique_ptr<Discovery>, std::string> Discovery::start(
    const Config& config, OwnEndpoints own, std::function<void()> changed) {
    static const int library = ares_library_init(ARES_LIB_INIT_ALL);
    if (library != ARES_SUCCESS)
        return tl::unexpected(std::string("c-ares: ") + ares_strerror(library));
    if (config.resolvers.nameservers.empty() &&
        access(config.resolvers.resolv_conf.c_str(), R_OK) != 0) {
        return tl::unexpected("resolvers.resolv_conf " + config.resolvers.resolv_conf + ": " +
                              std::strerror(errno) + " (or list resolvers.nameservers)");
    }
    auto channel = Channel::make(config.resolvers);
    if (!channel) return tl::unexpected(channel.error());
    std::unique_ptr<Discovery> d(new Discovery(std::move(changed)));
    d->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (d->wake_fd_ < 0) return tl::unexpected(std::string("eventfd: ") + std::strerror(errno));
    d->channel_ = std::move(*channel);
    d->reconfigure(config, std::move(own));
    d->thread_ = std::thread([p = d.get()] { p->run(); });
    return d;
}

Discovery::~Discovery() {
    {
        std::lock_guard lock(mutex_);
        stop_ = true;
    }
    const uint64_t one = 1;
    if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof one);
    if (thread_.joinable()) thread_.join();
    channel_.reset();  // its callbacks still see the entries
    entries_.clear();
    if (wake_fd_ >= 0) close(wake_fd_);
}

void Discovery::reconfigure(const Config& config, OwnEndpoints own) {
    {
        std::lock_guard lock(mutex_);
        if (own != own_) {
            own_ = std::move(own);
            ++own_version_;
        }
        std::map<std::string, DiscoveryView> next;
        for (const ClusterConfig& c : config.clusters) {
            if (!c.discovery.enabled()) continue;
            auto old = views_.find(c.name);
            if (old != views_.end() && old->second.spec == c.discovery) {
                next[c.name] = std::move(old->second);
            } else {
                DiscoveryView v;
                v.spec = c.discovery;
                next[c.name] = std::move(v);
                ++version_;
            }
        }
        if (next.size() != views_.size()) ++version_;
        views_ = std::move(next);
        // A listener the reload adds may be what a kept set names: out before the reload's
        // generation is built from sets().
        dropOwnLocked();
        pending_ = std::make_unique<Config>(config);
    }
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof one);
}

void Discovery::setOwnEndpoints(OwnEndpoints own) {
    bool dropped = false;
    {
        std::lock_guard lock(mutex_);
        if (own == own_) return;
        own_ = std::move(own);
        ++own_version_;
        dropped = dropOwnLocked();
        reask_ = true;
    }
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof one);
    if (dropped && changed_) changed_();
}

namespace {

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

std::string Discovery::awaitFirstAnswers(Duration bound) {
    std::unique_lock lock(mutex_);
    answered_cv_.wait_for(lock, bound, [&] {
        return std::all_of(views_.begin(), views_.end(),
                           [](const auto& v) { return v.second.answered; });
    });
    std::string errors;
    for (const auto& [name, v] : views_) {
        if (v.spec.startup != StartupPolicy::Fail || !v.backends.empty()) continue;
        errors += (errors.empty() ? "" : "\n") +
                  ("cluster " + name + ": discovery of " + v.spec.name() + " (" + kindOf(v.spec) +
                   ") failed: " + std::string(v.answered ? label(v.last) : "no answer yet") +
                   " (startup: fail)");
    }
    return errors;
}

DiscoveredSets Discovery::sets() const {
    std::lock_guard lock(mutex_);
    DiscoveredSets out;
    for (const auto& [name, v] : views_) out[name] = v.backends;
    return out;
}

uint64_t Discovery::version() const {
    std::lock_guard lock(mutex_);
    return version_;
}

std::map<std::string, DiscoveryView> Discovery::views() const {
    std::lock_guard lock(mutex_);
    return views_;
}

// ---- the thread -------------------------------------------------------------------------------

void Discovery::apply(const Config& config) {
    // The channel goes first: its in-flight queries complete (ARES_EDESTRUCTION) while every
    // entry they name is still alive, and are dropped.
    channel_.reset();
    auto channel = Channel::make(config.resolvers);
    if (channel) {
        channel_ = std::move(*channel);
    } else {
        LOG_ERROR("discovery: %s; every name fails until the next reload", channel.error().c_str());
    }
    std::vector<std::unique_ptr<Entry>> next;
    for (const ClusterConfig& c : config.clusters) {
        if (!c.discovery.enabled()) continue;
        std::unique_ptr<Entry> e;
        for (auto& old : entries_) {
            if (old && old->cluster == c.name && old->spec == c.discovery) e = std::move(old);
        }
        if (!e) {
            e = std::make_unique<Entry>();
            e->cluster = c.name;
            e->spec = c.discovery;
        }
        e->in_flight = false;
        e->next_ms = 0;  // asked at once, through the new channel
        next.push_back(std::move(e));
    }
    entries_ = std::move(next);
}

void Discovery::run() {
    pthread_setname_np(pthread_self(), "zcrelay-dns");
    setLogThreadName("dns");
    for (;;) {
        std::unique_ptr<Config> pending;
        bool reask = false;
        {
            std::lock_guard lock(mutex_);
            if (stop_) return;
            pending = std::move(pending_);
            reask = std::exchange(reask_, false);
        }
        if (pending) apply(*pending);
        if (reask)
            for (auto& e : entries_) e->next_ms = 0;
        const int64_t now = monotonicMs();
        for (auto& e : entries_)
            if (!e->in_flight && now >= e->next_ms) ask(*e);
        expireHolds(now);

        pollfd fds[1 + ARES_GETSOCK_MAXNUM];
        fds[0] = {wake_fd_, POLLIN, 0};
        nfds_t n = 1;
        int timeout_ms = static_cast<int>(std::clamp<int64_t>(nextWakeMs() - now, 0, 1000));
        if (channel_) {
            ares_socket_t socks[ARES_GETSOCK_MAXNUM];
            const int mask = ares_getsock(channel_->get(), socks, ARES_GETSOCK_MAXNUM);
            for (int i = 0; i < ARES_GETSOCK_MAXNUM; ++i) {
                short events = 0;
                if (ARES_GETSOCK_READABLE(mask, i)) events |= POLLIN;
                if (ARES_GETSOCK_WRITABLE(mask, i)) events |= POLLOUT;
                if (events) fds[n++] = {socks[i], events, 0};
            }
            timeval max{timeout_ms / 1000, (timeout_ms % 1000) * 1000}, tv{};
            const timeval* t = ares_timeout(channel_->get(), &max, &tv);
            timeout_ms = static_cast<int>(t->tv_sec * 1000 + (t->tv_usec + 999) / 1000);
        }
        const int ready = poll(fds, n, timeout_ms);
        if (ready < 0 && errno != EINTR) {
            LOG_ERROR("discovery: poll: %s", std::strerror(errno));
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        if (fds[0].revents & POLLIN) {
            uint64_t v;
            (void)!read(wake_fd_, &v, sizeof v);
        }
        if (!channel_) continue;
        for (nfds_t i = 1; i < n; ++i) {
            if (fds[i].revents == 0) continue;
            const bool in = fds[i].revents & (POLLIN | POLLERR | POLLHUP);
            const bool out = fds[i].revents & POLLOUT;
            ares_process_fd(channel_->get(), in ? fds[i].fd : ARES_SOCKET_BAD,
                            out ? fds[i].fd : ARES_SOCKET_BAD);
        }
        // Timeouts: c-ares retries or fails the queries whose time ran out.
        ares_process_fd(channel_->get(), ARES_SOCKET_BAD, ARES_SOCKET_BAD);
    }
}

int64_t Discovery::nextWakeMs() const {
    int64_t next = monotonicMs() + 1000;
    for (const auto& e : entries_) {
        if (!e->in_flight) next = std::min(next, e->next_ms);
        if (e->failing && !e->expired)
            next = std::min(next, e->failing_since_ms + msOf(e->spec.hold));
    }
    return next;
}

namespace {

// The addresses of a getaddrinfo answer at `port`, and its smallest TTL.
void collect(const ares_addrinfo* ai, uint16_t port, uint32_t weight,
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
        out.push_back(b);
    }
}

}  // namespace

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
        // RFC 6724; the set is sorted by address here anyway.
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
                if (status == ARES_SUCCESS && ai) collect(ai, q->port, q->weight, found, ttl);
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
            // target. A target "." says the service is not offered there.
            int lowest = INT32_MAX;
            for (const ares_srv_reply* r = reply; r; r = r->next)
                if (std::strcmp(r->host, ".") != 0 && r->host[0] != '\0')
                    lowest = std::min<int>(lowest, r->priority);
            std::vector<SrvTarget> targets;
            for (const ares_srv_reply* r = reply; r; r = r->next) {
                if (r->priority != lowest || std::strcmp(r->host, ".") == 0 || r->host[0] == '\0')
                    continue;
                targets.push_back(
                    {r->host, r->port, std::clamp<uint32_t>(r->weight, kMinWeight, kMaxWeight)});
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
        auto* q = new Query{this, &e, e.round, t.port, t.weight, true};
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
                    collect(ai, q->port, q->weight, e.gathered, ttl);
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

void Discovery::answered(Entry& e, DiscoveryOutcome outcome, std::vector<BackendConfig> found,
                         uint32_t ttl) {
    e.in_flight = false;
    const int64_t now = monotonicMs();
    if (outcome == DiscoveryOutcome::Success && found.empty()) outcome = DiscoveryOutcome::NoData;
    std::vector<BackendConfig> set;
    uint64_t judged_own = 0;
    if (outcome == DiscoveryOutcome::Success) {
        std::sort(found.begin(), found.end(), byAddress);
        // One address may come from two SRV records (two ports are two backends; the same
        // port twice is one).
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
                LOG_WARN("cluster %s: %s has %zu addresses; max_backends keeps the lowest %u",
                         e.cluster.c_str(), e.spec.name().c_str(), found.size(),
                         e.spec.max_backends);
            e.warned_cap = true;
            found.resize(e.spec.max_backends);
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
        if (!e->failing || e->expired || now_ms < e->failing_since_ms + msOf(e->spec.hold)) continue;
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

void Discovery::publish(Entry& e, std::vector<BackendConfig> set, const char* why) {
    {
        std::lock_guard lock(mutex_);
        record(e, std::move(set), why);
    }
    if (changed_) changed_();
}

void Discovery::record(Entry& e, std::vector<BackendConfig> set, const char* why) {
    LOG_INFO("cluster %s: %zu -> %zu backends from %s (%s)%s%s%s%s", e.cluster.c_str(),
             e.good.size(), set.size(), e.spec.name().c_str(), kindOf(e.spec),
             listOf(set, e.good, '+').c_str(), listOf(e.good, set, '-').c_str(), *why ? ": " : "",
             why);
    e.good = std::move(set);
    auto v = views_.find(e.cluster);
    if (v != views_.end()) {
        v->second.backends = e.good;
        v->second.changes++;
    }
    ++version_;
}

}  // namespace zcrelay
