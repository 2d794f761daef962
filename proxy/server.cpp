#include "server.hpp"

#include <cstring>

#include "listener.hpp"
#include "log.hpp"

namespace zcrelay {

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
                return tl::unexpected("listener " + l.name + ": " + fd.error().what + " " + addr.toString() +
                                      ": " + std::strerror(fd.error().code));
            }
            if (w == 0) {
                // With port 0 the first bind picks the port; the other workers join it.
                auto bound = boundAddress(fd->get());
                if (!bound) return tl::unexpected("listener " + l.name + ": " + bound.error().message());
                addr = *bound;
                server->bound_.push_back(addr);
            }
            listen_fds[w].push_back(std::move(*fd));
        }
    }

    for (unsigned w = 0; w < cfg.workers; ++w)
        server->workers_.push_back(std::make_unique<Worker>(w, cfg, std::move(listen_fds[w])));

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
