#include "server.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

#include "listener.hpp"
#include "log.hpp"
#include "privileges.hpp"
#include "process_stats.hpp"
#include "server_sockets.hpp"
#include "signals.hpp"
#include "socket_activation.hpp"
#include "unix_path.hpp"

namespace zcrelay {
namespace {
constexpr uint64_t kReservedFds = 64;
// Sockets the sockmap can hold (24 B of mmap()ed counters and a hash entry each): past
// RLIMIT_NOFILE 1M the surplus connections run splice (counted as no_record).
constexpr uint64_t kMaxSockmapRecords = 1u << 21;

// Without CAP_SYS_RESOURCE, F_SETPIPE_SZ past fs.pipe-max-size fails with EPERM: such a
// listener's pipes never grow and splice 64 KiB at a time. Said once, at start, not per pipe.
void warnPipeSizesPastMax(const Config& config) {
    uint64_t pipe_max = 0;
    if (FILE* f = std::fopen("/proc/sys/fs/pipe-max-size", "re")) {
        unsigned long long v = 0;
        if (std::fscanf(f, "%llu", &v) == 1) pipe_max = v;
        std::fclose(f);
    }
    for (const ListenerConfig& l : config.listeners) {
        if (pipe_max == 0 || l.pipe_size <= pipe_max) continue;
        LOG_WARN(
            "listener %s: pipe_size %s is above fs.pipe-max-size (%s), which only "
            "CAP_SYS_RESOURCE may pass: its pipes stay at 64KiB",
            l.name.c_str(), formatSize(l.pipe_size).c_str(), formatSize(pipe_max).c_str());
    }
}

}  // namespace

tl::expected<std::unique_ptr<Server>, std::string> Server::start(Config config, StartWith with) {
    std::unique_ptr<Server> server(new Server());
    std::vector<size_t> all(config.listeners.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    auto inherited = takeInheritedSockets();
    if (!inherited) return tl::unexpected(inherited.error());
    std::vector<takeover::HandedSocket>& handed = with.handed;
    auto bound = bindListeners(config, all, server->bound_, *inherited, handed,
                               server->process_.passed_listeners);
    if (!bound) return tl::unexpected(bound.error());
    for (const InheritedSocket& s : *inherited) {
        if (!s.fd) continue;
        // Closed here: a socket no listener names would queue connections nobody accepts.
        LOG_WARN("socket activation: no listener listens on %s (fd %d%s%s); closing it",
                 s.address.toString().c_str(), s.fd.get(), s.name.empty() ? "" : ", name ",
                 s.name.c_str());
    }
    std::vector<std::vector<ListenSocket>> listen_fds = std::move(bound->per_worker);
    server->listening_ = std::move(bound->handable);
    Config& cfg = config;

    // The fd budget: every relayed connection costs two fds (client and upstream socket), and
    // kReservedFds stay free for what is not a connection (rings, listeners, eventfds, the
    // metrics endpoint's epoll sets, each worker's spare), and so do the metrics endpoint's
    // sockets (max_connections per address it serves), so that a flood of scrapes and probes
    // never costs a client its fd. Pipes take what is left and fall back to copy when nothing
    // is. So RLIMIT_NOFILE 20000 with 2 workers and the defaults admits 4968 per worker.
    const uint64_t endpoint_fds =
        cfg.metrics.enabled
            ? uint64_t{cfg.metrics.max_connections} * (cfg.metrics.health_listen.length ? 2 : 1)
            : 0;
    const uint64_t reserved = kReservedFds + endpoint_fds;
    rlimit nofile{};
    getrlimit(RLIMIT_NOFILE, &nofile);
    uint64_t usable = nofile.rlim_cur > reserved ? nofile.rlim_cur - reserved : 2;
    uint32_t per_worker = static_cast<uint32_t>(std::max<uint64_t>(1, usable / 2 / cfg.workers));
    server->per_worker_ = per_worker;
    server->reserved_fds_ = reserved;
    LOG_INFO("RLIMIT_NOFILE %llu: up to %u connections per worker, %u in all",
             static_cast<unsigned long long>(nofile.rlim_cur), per_worker,
             per_worker * cfg.workers);

    // One copy of the BPF program for the process; each worker owns two records per slot.
    bool want_sockmap = std::any_of(cfg.listeners.begin(), cfg.listeners.end(),
                                    [](const ListenerConfig& l) { return usesSockmap(l.mode); });
    if (want_sockmap) {
        uint64_t records =
            std::min<uint64_t>(uint64_t{2} * per_worker * cfg.workers, kMaxSockmapRecords);
        auto loaded = Sockmap::load(static_cast<uint32_t>(records), Sockmap::Attach::StreamVerdict,
                                    cfg.workers, 2 * per_worker);
        if (loaded) {
            server->sockmap_ = std::move(*loaded);
            server->process_.sockmap_loaded = true;
            LOG_INFO("sockmap: verdict attached, room for %llu sockets",
                     static_cast<unsigned long long>(records));
        } else if (with.taking_over) {
            // An upgrade must not change the data path behind the operator's back: the running
            // relay serves on, and this one says what it lacks (privileges.hpp: a relay that
            // dropped root cannot load it again; the unit's capabilities can).
            return tl::unexpected("sockmap: " + loaded.error() +
                                  "; a takeover keeps every listener's mode, so this process "
                                  "stops and the running relay serves on (run it with CAP_BPF, "
                                  "CAP_NET_ADMIN and CAP_PERFMON, or set mode splice)");
        } else {
            // The same bytes still get relayed, by the default path; the metric
            // zcrelay_datapath_info says which path runs.
            for (ListenerConfig& l : cfg.listeners) {
                if (!usesSockmap(l.mode)) continue;
                LOG_WARN("listener %s: mode %s unavailable (%s); running splice", l.name.c_str(),
                         std::string(modeName(l.mode)).c_str(), loaded.error().c_str());
                l.mode = Mode::Splice;
            }
        }
    }
    // The takeover socket: the previous relay's, handed over, or bound here, as root if the
    // relay started so (its directory may be root's), before the drop below. One bound here is
    // published at its path only once the relay runs (takeover::bindTakeover), or just before
    // the drop, when its directory may be writable by root alone.
    UniqueFd takeover_socket;
    UnixFile takeover_file;  // read while the process may still reach it (before the drop)
    std::optional<UnpublishedUnixSocket> unpublished;
    if (!cfg.takeover_socket.empty()) {
        auto at = parseAddress("unix:" + cfg.takeover_socket);
        if (at) takeover_socket = takeHandedOf(handed, "takeover", *at);
        if (takeover_socket) takeover_file = UnixFile::at(cfg.takeover_socket);
        if (!takeover_socket) {
            auto bound = takeover::bindTakeover(cfg.takeover_socket, with.replace_takeover_socket);
            if (!bound) return tl::unexpected(bound.error());
            unpublished.emplace(std::move(*bound));
        }
    }
    auto publishTakeover = [&]() -> tl::expected<void, std::string> {
        if (!unpublished) return {};
        auto published = unpublished->publish();
        unpublished.reset();
        if (!published) return tl::unexpected("takeover_socket: " + published.error());
        takeover_socket = std::move(*published);
        takeover_file = UnixFile::at(cfg.takeover_socket);
        return {};
    };
    // Everything that needs root is open now: the listeners (ports below 1024), the sockmap
    // program and maps (CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON). Drop it before the first thread
    // starts, because capabilities and the bounding set are per thread (privileges.hpp): the
    // access log writer, the metrics endpoint's thread and the workers all start below, as the user.
    // So the access log file is opened as the user, as its SIGHUP reopen will be; the metrics
    // address binds with CAP_NET_BIND_SERVICE, which stays.
    if (!cfg.user.empty()) {
        if (auto published = publishTakeover(); !published)
            return tl::unexpected(published.error());
        const std::string who =
            "user " + cfg.user + (cfg.group.empty() ? "" : ", group " + cfg.group);
        auto dropped = dropPrivileges(cfg.uid, cfg.gid, who);
        if (!dropped) return tl::unexpected("user: " + dropped.error());
        LOG_INFO("%s", dropped->c_str());
        if (geteuid() != 0) warnPipeSizesPastMax(cfg);
    }
    if (!cfg.access_log.path.empty()) {
        auto log = AccessLog::open(cfg.access_log.path, cfg.access_log.format, cfg.workers);
        if (!log) {
            return tl::unexpected("access_log " + cfg.access_log.path + ": " +
                                  log.error().message() +
                                  (cfg.user.empty() ? "" : " (opened as user " + cfg.user + ")"));
        }
        server->access_log_ = std::move(*log);
        server->process_.access_log = server->access_log_.get();
    }
    const unsigned workers = cfg.workers;
    Server* const self = server.get();
    // Started as the user (after the drop above): it only reads resolv.conf and talks DNS.
    auto discovered = server->followDiscovery(cfg, server->bound_);
    if (!discovered) return tl::unexpected(discovered.error());
    if (!discovered->unresolved.empty()) return tl::unexpected(discovered->unresolved);
    server->current_ = Runtime::build(std::move(config), nullptr, workers, discovered->sets);
    const Config& running = server->current_->config;
    for (unsigned w = 0; w < running.workers; ++w)
        server->workers_.push_back(
            std::make_unique<Worker>(w, server->current_, std::move(listen_fds[w]), per_worker,
                                     server->sockmap_.get(), 2 * per_worker * w, server->process_));

    server->process_.end_connections = [self](std::shared_ptr<BackendState> backend,
                                              CloseReason reason, const std::string& name) {
        for (auto& w : self->workers_) w->endConnectionsOf(backend, reason, name);
    };
    server->process_.admin = &server->admin_stats_;
    if (running.metrics.enabled) {
        std::vector<const WorkerStats*> stats;
        for (const auto& w : server->workers_) stats.push_back(&w->stats());
        auto endpoint = MetricsEndpoint::start(
            running.metrics,
            makeCollector([self] { return self->current(); }, std::move(stats), &self->process_),
            [self] { return self->unhealthy(); }, [self] { return self->unready(); },
            self->process_.endpoint, takeHandedOf(handed, "metrics", running.metrics.listen),
            takeHandedOf(handed, "health", running.metrics.health_listen),
            [self] { return self->readyNotes(); });
        if (!endpoint) return tl::unexpected(endpoint.error());
        server->metrics_ = std::move(*endpoint);
    }

    std::vector<std::future<Result<void>>> ready;
    for (auto& w : server->workers_) ready.push_back(w->start());
    std::string error;
    for (size_t w = 0; w < ready.size(); ++w) {
        Result<void> r = ready[w].get();
        if (!r && error.empty()) error = "worker " + std::to_string(w) + ": " + r.error().message();
    }
    if (!error.empty()) {
        server->stop();
        server->join();
        return tl::unexpected(error);
    }
    if (running.admin.enabled()) {
        AdminApi::Hooks hooks;
        hooks.current = [self] { return self->current(); };
        hooks.discovery = [self]() -> std::map<std::string, DiscoveryView> {
            const Discovery* d = self->process_.discovery.load();
            return d ? d->views() : std::map<std::string, DiscoveryView>{};
        };
        hooks.rebuild = [self] { self->republish(true); };
        hooks.end_connections = [self](std::shared_ptr<BackendState> backend,
                                       const std::string& who) {
            self->process_.end_connections(std::move(backend), CloseReason::AdminShutdown, who);
        };
        auto admin = AdminApi::start(running.admin, std::move(hooks), server->admin_stats_,
                                     takeHandedOf(handed, "admin", running.admin.listen));
        if (!admin) {
            server->stop();
            server->join();
            return tl::unexpected(admin.error());
        }
        server->admin_ = std::move(*admin);
    }
    // The next relay's way in: the config's takeover socket (handed over too, when this one
    // took over), and SIGUSR2's channels.
    takeover::Giver::Hooks giving;
    giving.offer = [self] { return self->offer(); };
    giving.refusal = [self]() -> std::string {
        return self->process_.draining.load()
                   ? "draining: its listening sockets are closed; bind your own"
                   : "";
    };
    giving.hand_over = [self](std::shared_ptr<handover::Outbound> out) {
        return self->handOver(std::move(out));
    };
    giving.workers = static_cast<unsigned>(server->workers_.size());
    giving.withdraw = [self] { self->process_.listeners_offered.store(false); };
    giving.count = [self](const char* result) {
        self->process_.takeovers[takeoverResult(result)].fetch_add(1);
    };
    if (auto published = publishTakeover(); !published) {
        server->stop();
        server->join();
        return tl::unexpected(published.error());
    }
    auto giver = takeover::Giver::start(std::move(takeover_file), std::move(takeover_socket),
                                        std::move(giving));
    if (!giver) {
        server->stop();
        server->join();
        return tl::unexpected(giver.error());
    }
    server->giver_ = std::move(*giver);
    for (const takeover::HandedSocket& s : handed) {
        if (!s.fd) continue;
        // Its queue is reset when the previous relay closes its copy too: what a reload that
        // removes a listener does.
        LOG_WARN("takeover: nothing in this config listens on %s (%s %s); closing it",
                 s.bound.toString().c_str(), s.kind.c_str(), s.name.c_str());
    }
    // The metrics, health and admin ports that were 0 in the config are known now.
    if (server->discovery_)
        server->discovery_->setOwnEndpoints(server->ownEndpoints(running, server->bound_));
    // A set that changed between the first answers and now is published from here on.
    server->started_.store(true);
    server->republish();
    return server;
}

Server::~Server() {
    stop();
    join();
}

std::shared_ptr<const Runtime> Server::current() const {
    std::lock_guard lock(current_mutex_);
    return current_;
}

void Server::reopenAccessLog() {
    if (access_log_) access_log_->reopen();
}

tl::expected<void, std::string> Server::reload(Config config) {
    auto result = [&] {
        std::lock_guard publishing(publish_mutex_);
        return reloadLocked(std::move(config));
    }();
    publishPending();
    return result;
}

tl::expected<void, std::string> Server::reloadLocked(Config config) {
    const Config& old = current_->config;
    // What the workers were built with cannot change under them: kept, and said so.
    auto keep = [&](bool changed, const char* what) {
        if (changed)
            LOG_WARN("reload: %s changes only with a restart; keeping the running one", what);
    };
    keep(config.workers != old.workers, "workers");
    keep(config.max_pipes != old.max_pipes, "max_pipes");
    keep(!(config.metrics == old.metrics), "metrics");
    keep(!(config.access_log == old.access_log), "access_log");
    keep(!(config.admin == old.admin), "admin");
    config.admin = old.admin;
    keep(config.user != old.user || config.group != old.group || config.uid != old.uid ||
             config.gid != old.gid,
         "user/group");
    config.user = old.user;
    config.group = old.group;
    config.uid = old.uid;
    config.gid = old.gid;
    config.workers = old.workers;
    config.max_pipes = old.max_pipes;
    config.metrics = old.metrics;
    config.access_log = old.access_log;
    for (ListenerConfig& l : config.listeners) {
        if (usesSockmap(l.mode) && !sockmap_) {
            // The program is loaded at start only (workers own record ranges in its maps).
            LOG_WARN(
                "reload: listener %s: mode %s needs the sockmap program at start; running "
                "splice",
                l.name.c_str(), std::string(modeName(l.mode)).c_str());
            l.mode = Mode::Splice;
        }
    }
    // Listeners whose address the running config already listens on keep their sockets (a
    // port-0 one matches by name too): only the others are bound, and a failure there (the
    // port is taken) refuses the reload before any worker sees it.
    std::vector<size_t> fresh;
    std::vector<SocketAddress> bound(config.listeners.size());
    for (size_t i = 0; i < config.listeners.size(); ++i) {
        const ListenerConfig& l = config.listeners[i];
        bool found = false;
        for (size_t j = 0; j < old.listeners.size() && !found; ++j) {
            if (old.listeners[j].listen == l.listen &&
                (l.listen.port() != 0 || old.listeners[j].name == l.name)) {
                bound[i] = bound_[j];
                found = true;
            }
        }
        if (!found) fresh.push_back(i);
    }
    std::vector<SocketAddress> fresh_bound;
    // systemd's sockets and a takeover's were all taken (or closed) at start.
    std::vector<InheritedSocket> no_inherited;
    std::vector<takeover::HandedSocket> none_handed;
    std::vector<SocketAddress> none_passed;
    auto fds = bindListeners(config, fresh, fresh_bound, no_inherited, none_handed, none_passed);
    if (!fds) return tl::unexpected(fds.error());
    for (size_t k = 0; k < fresh.size(); ++k) bound[fresh[k]] = fresh_bound[k];

    // New or changed names are asked at once; the reload waits for their first answers
    // (bounded), so its generation starts with their backends. One that fails starts empty and
    // keeps being asked: startup: fail applies at start only.
    auto discovered = followDiscovery(config, bound);
    if (!discovered) return tl::unexpected(discovered.error());
    if (!discovered->unresolved.empty()) LOG_WARN("reload: %s", discovered->unresolved.c_str());
    {
        // What the next relay would be handed: the listeners of this config, no other.
        std::lock_guard lock(listening_mutex_);
        std::erase_if(listening_, [&](const takeover::HandedSocket& s) {
            return std::none_of(
                config.listeners.begin(), config.listeners.end(), [&](const ListenerConfig& l) {
                    return s.listen == l.listen && (l.listen.port() != 0 || s.name == l.name);
                });
        });
        for (takeover::HandedSocket& s : fds->handable) listening_.push_back(std::move(s));
    }
    auto next = Runtime::build(std::move(config), current_.get(), old.workers, discovered->sets);
    switchTo(std::move(next), std::move(fds->per_worker));
    bound_ = std::move(bound);
    return {};
}

OwnEndpoints Server::ownEndpoints(const Config& config,
                                  const std::vector<SocketAddress>& bound) const {
    OwnEndpoints own;
    for (size_t i = 0; i < bound.size() && i < config.listeners.size(); ++i)
        own.push_back({"listeners[" + std::to_string(i) + "].listen", bound[i]});
    if (config.metrics.enabled) {
        SocketAddress metrics = config.metrics.listen;
        if (metrics_) metrics.setPort(metrics_->port());
        own.push_back({"metrics.listen", metrics});
        if (config.metrics.health_listen.length != 0) {
            SocketAddress health = config.metrics.health_listen;
            if (metrics_) health.setPort(metrics_->healthPort());
            own.push_back({"metrics.health_listen", health});
        }
    }
    if (config.admin.enabled())
        own.push_back({"admin.listen", admin_ ? admin_->address() : config.admin.listen});
    return own;
}

tl::expected<Server::Followed, std::string> Server::followDiscovery(
    const Config& config, const std::vector<SocketAddress>& bound) {
    const bool discovers = std::any_of(config.clusters.begin(), config.clusters.end(),
                                       [](const ClusterConfig& c) { return c.discovery.enabled(); });
    if (discovers && !discovery_) {
        auto started =
            Discovery::start(config, ownEndpoints(config, bound), [this] { republish(); });
        if (!started) return tl::unexpected("discovery: " + started.error());
        discovery_ = std::move(*started);
        process_.discovery.store(discovery_.get());
    } else if (discovery_) {
        discovery_->reconfigure(config, ownEndpoints(config, bound));
    }
    if (!discovers) return Followed{};
    Followed followed;
    followed.unresolved =
        discovery_->awaitFirstAnswers(Discovery::firstAnswerBound(config.resolvers));
    built_version_ = discovery_->version();
    followed.sets = discovery_->sets();
    return followed;
}

void Server::switchTo(std::shared_ptr<const Runtime> next,
                      std::vector<std::vector<ListenSocket>> fds) {
    for (size_t w = 0; w < workers_.size(); ++w)
        workers_[w]->reload(next, w < fds.size() ? std::move(fds[w]) : std::vector<ListenSocket>{});
    // Done when every worker runs the new generation: from then on a new connection meets the
    // new config, and a removed listener's socket is closed. A worker answers within one ring
    // round trip; the bound only guards against one that is stuck.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (const auto& w : workers_) {
        while (w->appliedGeneration() < next->generation && !w->finished() &&
               std::chrono::steady_clock::now() < deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::lock_guard lock(current_mutex_);
    current_ = std::move(next);
}

void Server::republish(bool force) {
    if (force) force_.store(true);
    dirty_.store(true);
    for (;;) {
        std::unique_lock lock(publish_mutex_, std::try_to_lock);
        // Whoever holds it looks at dirty_ once it lets go (publishPending).
        if (!lock) return;
        if (!dirty_.exchange(false)) return;
        rebuildLocked();
        lock.unlock();
        if (!dirty_.load()) return;
    }
}

void Server::rebuildLocked() {
    if (!started_.load()) return;
    // A generation is built for a change only: a weight (force), or discovered sets that moved
    // since the current generation took them. Anything else would bump zcrelay_config_generation
    // and restart the health checks for nothing.
    const bool forced = force_.exchange(false);
    if (!forced && (!discovery_ || discovery_->version() == built_version_)) return;
    std::shared_ptr<const Runtime> rt = current();
    DiscoveredSets discovered;
    if (discovery_) {
        built_version_ = discovery_->version();
        discovered = discovery_->sets();
    }
    switchTo(Runtime::build(rt->config, rt.get(), rt->config.workers, discovered), {});
}

void Server::addTakeoverChannel(UniqueFd channel, pid_t child) {
    giver_->addChannel(std::move(channel), child);
}

std::vector<takeover::HandedSocket> Server::offer() {
    process_.listeners_offered.store(true);
    std::vector<takeover::HandedSocket> out;
    auto add = [&](const char* kind, const std::string& name, const SocketAddress& listen,
                   const SocketAddress& bound, int fd, bool systemd = false) {
        if (fd < 0) return;
        UniqueFd dup(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
        if (!dup) {
            LOG_WARN("takeover: dup of the %s socket %s: %s; not handed over", kind,
                     bound.toString().c_str(), std::strerror(errno));
            return;
        }
        out.push_back({kind, name, listen, bound, std::move(dup), systemd});
    };
    {
        std::lock_guard lock(listening_mutex_);
        for (const takeover::HandedSocket& s : listening_)
            add("listener", s.name, s.listen, s.bound, s.fd.get(), s.systemd);
    }
    const Config cfg = config();
    if (metrics_) {
        SocketAddress at = cfg.metrics.listen;
        at.setPort(metrics_->port());
        add("metrics", "", cfg.metrics.listen, at, metrics_->listenFd());
        at = cfg.metrics.health_listen;
        if (metrics_->healthListenFd() >= 0) {
            at.setPort(metrics_->healthPort());
            add("health", "", cfg.metrics.health_listen, at, metrics_->healthListenFd());
        }
    }
    if (admin_) add("admin", "", cfg.admin.listen, admin_->address(), admin_->listenFd());
    if (giver_ && giver_->listenFd() >= 0) {
        auto at = parseAddress("unix:" + cfg.takeover_socket);
        if (at) add("takeover", "", *at, *at, giver_->listenFd());
    }
    return out;
}

size_t Server::handOver(std::shared_ptr<handover::Outbound> out) {
    // Before the workers close them: no shutdown() of a socket the next relay listens on.
    process_.listeners_handed_over.store(true);
    if (metrics_) metrics_->handOver();
    if (admin_) admin_->handOver();
    if (out)
        for (auto& w : workers_) w->handOver(out);
    drain();
    wakeMainThread();  // to wait in short steps from now on, and exit soon after the workers
    std::lock_guard lock(listening_mutex_);
    return listening_.size();
}

handover::Acceptance Server::acceptance() const {
    handover::Acceptance a;
    // The fd budget's room, less what the accepts armed meanwhile may bring: holding what the
    // old relay held, this one is where the old one was, with the same budget.
    std::shared_ptr<const Runtime> rt = current();
    const uint64_t budget = uint64_t{per_worker_} * workers_.size();
    const uint64_t armed = uint64_t{Acceptor::kBatch} * workers_.size() * rt->listeners.size();
    const uint64_t held = process_.live.load() + armed;
    a.fds = budget > held ? 2 * (budget - held) : 0;
    // And no more than the open-file limit leaves now, past the fds kept for what is not a
    // connection: the budget counts 2 a connection, and a pipe that crosses costs 2 more.
    rlimit nofile{};
    ::getrlimit(RLIMIT_NOFILE, &nofile);
    const int open = readProcessStats().open_fds;
    const uint64_t used = static_cast<uint64_t>(std::max(open, 0)) + reserved_fds_;
    a.fds = std::min<uint64_t>(a.fds, nofile.rlim_cur > used ? nofile.rlim_cur - used : 0);
    for (const ListenerRt& l : rt->listeners) a.listeners.push_back(l.config.name);
    for (const ClusterRt& c : rt->clusters)
        for (const BackendRt& b : c.backends) a.backends.push_back(c.config.name + "/" + b.key);
    // Adopting sockmap maps needs no program of its own, nor privileges: their fds are enough.
    a.sockmap = Sockmap::layout();
    return a;
}

void Server::adopt(std::optional<handover::HandedConn> conn) {
    if (!conn || workers_.empty()) {
        process_.handovers[idx(handover::Outcome::Lost)].fetch_add(1);
        return;
    }
    if (conn->pair.map_id == 0) {
        workers_[next_adopter_++ % workers_.size()]->adopt(std::move(*conn));
        return;
    }
    // On sockmap: to the worker that reads its ring. A connection whose maps or ring did not
    // come goes to any worker, which finds it without them and counts it lost.
    size_t worker = next_adopter_ % workers_.size();
    if (auto m = adopted_maps_.find(conn->pair.map_id); m != adopted_maps_.end()) {
        conn->map = m->second.get();
        auto r = ring_readers_.find({conn->pair.map_id, conn->map->ringOf(conn->pair.record)});
        if (r != ring_readers_.end()) worker = r->second;
    }
    workers_[worker]->adopt(std::move(*conn));
}

void Server::adoptRing(handover::HandedRing ring) {
    if (workers_.empty()) return;
    auto m = adopted_maps_.find(ring.map_id);
    if (m == adopted_maps_.end()) {
        if (ring.layout != Sockmap::layout()) {
            LOG_ERROR(
                "takeover: sockmap maps %u have record layout %s, this build %s; their "
                "connections are lost",
                ring.map_id, ring.layout.c_str(), Sockmap::layout().c_str());
            return;
        }
        auto adopted = Sockmap::adopt({std::move(ring.fds[0]), std::move(ring.fds[1]),
                                       std::move(ring.fds[2]), std::move(ring.fds[3])},
                                      ring.rings, ring.records_per_worker);
        if (!adopted) {
            LOG_ERROR(
                "takeover: sockmap maps %u cannot be adopted: %s; their connections are "
                "lost",
                ring.map_id, adopted.error().c_str());
            return;
        }
        if ((*adopted)->socksMapId() != ring.map_id) {
            LOG_ERROR("takeover: sockmap maps said to be %u are %u; their connections are lost",
                      ring.map_id, (*adopted)->socksMapId());
            return;
        }
        m = adopted_maps_.emplace(ring.map_id, std::move(*adopted)).first;
        LOG_INFO("takeover: adopted sockmap maps %u (%u records, %u rings)", ring.map_id,
                 m->second->capacity(), m->second->rings());
    }
    if (auto taken = m->second->adoptRing(ring.ring, std::move(ring.fds[4])); !taken) {
        LOG_ERROR("takeover: sockmap maps %u: %s; its connections are lost", ring.map_id,
                  taken.error().c_str());
        return;
    }
    // Each ring to one worker, the rings spread over the workers in turn.
    const size_t worker = next_adopter_++ % workers_.size();
    ring_readers_[{ring.map_id, ring.ring}] = worker;
    workers_[worker]->adoptRing(*m->second, ring.ring);
}

void Server::drain() {
    process_.draining.store(true);
    for (auto& w : workers_) w->drain();
}

std::string Server::unhealthy() const {
    if (process_.draining.load()) return "";
    for (size_t i = 0; i < workers_.size(); ++i)
        if (workers_[i]->finished()) return "worker " + std::to_string(i) + " stopped";
    return "";
}

std::string Server::unready() const {
    if (process_.draining.load()) return "draining";
    if (std::string why = unhealthy(); !why.empty()) return why;
    // Every listener must have somewhere to send a client: a cluster with a backend up.
    std::shared_ptr<const Runtime> rt = current();
    auto anyUp = [&](uint32_t cluster) {
        const ClusterRt& c = rt->clusters[cluster];
        return std::any_of(c.backends.begin(), c.backends.end(),
                           [](const BackendRt& b) { return b.state->takesNew(); });
    };
    for (const ListenerRt& l : rt->listeners) {
        if (!l.inspects()) {
            if (!anyUp(l.cluster))
                return "listener " + l.config.name + ": no backend of cluster " +
                       rt->clusters[l.cluster].config.name + " is up";
            continue;
        }
        // With routes, a listener that can serve some clients is ready: one route's cluster up.
        if (std::none_of(l.routes.begin(), l.routes.end(),
                         [&](const RouteRt& r) { return anyUp(r.cluster); }))
            return "listener " + l.config.name + ": no backend of any route's cluster is up";
    }
    return "";
}

std::string Server::readyNotes() const {
    std::shared_ptr<const Runtime> rt = current();
    std::string out;
    const int64_t now_ms = monotonicMs();
    for (const ClusterRt& c : rt->clusters) {
        if (const Serving s = c.serving(); s.any && s.tier > 0)
            out += "cluster " + c.config.name + ": every primary is down; backup tier " +
                   std::to_string(s.tier) + " serves\n";
        if (c.config.slow_start.count() <= 0) continue;
        for (const BackendRt& b : c.backends) {
            const uint64_t ramp = b.state->ramp(c.config.slow_start, now_ms);
            if (ramp < Balancer::kFullRamp && b.state->takesNew())
                out += "cluster " + c.config.name + ": backend " + b.key + " in slow_start, at " +
                       std::to_string(ramp / 10) + "% of its weight\n";
        }
    }
    return out;
}

void Server::stop() {
    for (auto& w : workers_) w->stop();
}

bool Server::finished() const {
    for (const auto& w : workers_)
        if (!w->finished()) return false;
    return true;
}

void Server::join() {
    for (auto& w : workers_) w->join();
}

}  // namespace zcrelay
