#include "server.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "listener.hpp"
#include "log.hpp"

namespace zcrelay {
namespace {
constexpr uint64_t kReservedFds = 64;
// Sockets the sockmap can hold (24 B of mmap()ed counters and a hash entry each): past
// RLIMIT_NOFILE 1M the surplus connections run splice (counted as no_record).
constexpr uint64_t kMaxSockmapRecords = 1u << 21;
}  // namespace

tl::expected<std::unique_ptr<Server>, std::string> Server::start(Config config) {
    std::unique_ptr<Server> server(new Server(std::move(config)));
    const Config& cfg = server->config_;

    // listen_fds[w][i]: worker w's socket for listener i.
    std::vector<std::vector<UniqueFd>> listen_fds(cfg.workers);
    for (const ListenerConfig& l : cfg.listeners) {
        SocketAddress addr = l.listen;
        for (unsigned w = 0; w < cfg.workers; ++w) {
            auto fd = openListener(addr);
            if (!fd) {
                return tl::unexpected("listener " + l.name + ": " + fd.error().what + " " +
                                      addr.toString() + ": " + std::strerror(fd.error().code));
            }
            if (w == 0) {
                // With port 0 the first bind picks the port; the other workers join it.
                auto bound = boundAddress(fd->get());
                if (!bound)
                    return tl::unexpected("listener " + l.name + ": " + bound.error().message());
                addr = *bound;
                server->bound_.push_back(addr);
            }
            listen_fds[w].push_back(std::move(*fd));
        }
    }

    // The fd budget: every relayed connection costs two fds (client and upstream socket), and
    // kReservedFds stay free for what is not a connection (rings, listeners, eventfds, the
    // metrics server's sockets, each worker's spare). Pipes take what is left and fall back to
    // copy when nothing is. So RLIMIT_NOFILE 20000 with 2 workers admits ~4984 per worker.
    rlimit nofile{};
    getrlimit(RLIMIT_NOFILE, &nofile);
    uint64_t usable = nofile.rlim_cur > kReservedFds ? nofile.rlim_cur - kReservedFds : 2;
    uint32_t per_worker = static_cast<uint32_t>(std::max<uint64_t>(1, usable / 2 / cfg.workers));
    LOG_INFO("RLIMIT_NOFILE %llu: up to %u connections per worker, %u in all",
             static_cast<unsigned long long>(nofile.rlim_cur), per_worker,
             per_worker * cfg.workers);

    // One copy of the BPF program for the process; each worker owns two records per slot.
    bool want_sockmap =
        std::any_of(cfg.listeners.begin(), cfg.listeners.end(),
                    [](const ListenerConfig& l) { return l.mode == Mode::Sockmap; });
    if (want_sockmap) {
        uint64_t records =
            std::min<uint64_t>(uint64_t{2} * per_worker * cfg.workers, kMaxSockmapRecords);
        auto loaded = Sockmap::load(static_cast<uint32_t>(records), Sockmap::Attach::StreamVerdict);
        if (loaded) {
            server->sockmap_ = std::move(*loaded);
            LOG_INFO("sockmap: verdict attached, room for %llu sockets",
                     static_cast<unsigned long long>(records));
        } else {
            // The same bytes still get relayed, by the default path; the metric
            // zcrelay_datapath_info says which path runs.
            for (ListenerConfig& l : server->config_.listeners) {
                if (l.mode != Mode::Sockmap) continue;
                LOG_WARN("listener %s: mode sockmap unavailable (%s); running splice",
                         l.name.c_str(), loaded.error().c_str());
                l.mode = Mode::Splice;
            }
        }
    }
    for (unsigned w = 0; w < cfg.workers; ++w)
        server->workers_.push_back(std::make_unique<Worker>(w, cfg, std::move(listen_fds[w]),
                                                            per_worker, server->sockmap_.get(),
                                                            2 * per_worker * w));

    if (cfg.metrics.enabled) {
        std::vector<const WorkerStats*> stats;
        for (const auto& w : server->workers_) stats.push_back(&w->stats());
        try {
            server->metrics_ = std::make_unique<MetricsEndpoint>(cfg, std::move(stats));
        } catch (const std::exception& e) {
            return tl::unexpected("metrics " + cfg.metrics.listen.toString() + ": " + e.what());
        }
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
    return server;
}

Server::~Server() {
    stop();
    join();
}

void Server::drain() {
    for (auto& w : workers_) w->drain();
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
