#include "server.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <cstring>

#include "listener.hpp"
#include "log.hpp"

namespace zcrelay {
namespace {
constexpr uint64_t kReservedFds = 64;
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
    for (unsigned w = 0; w < cfg.workers; ++w)
        server->workers_.push_back(
            std::make_unique<Worker>(w, cfg, std::move(listen_fds[w]), per_worker));

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
