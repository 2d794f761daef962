// The discovery thread and its hand-over: start, reload and stop; the loop that asks each name
// when due (discovery_resolve.cpp) and feeds c-ares its sockets; and a changed set logged,
// published to readers and announced to the callback. What an answer makes of the set is
// discovery_answers.cpp.
#include "discovery.hpp"

#include <ares.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "clock.hpp"
#include "discovery_internal.hpp"
#include "log.hpp"

namespace zcrelay {

std::string_view label(DiscoveryOutcome o) { return kDiscoveryOutcomeLabels[idx(o)]; }

namespace {

// The backends of `from` that `to` lacks, for the change's log line: " +10.0.0.1:80" each, the
// first eight and a count of the rest.
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

}  // namespace

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
