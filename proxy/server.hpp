#pragma once
// The process's one Server: listening sockets, workers and the metrics endpoint, started and
// stopped in a fixed order.
//   start: bind every listener (port 0 resolved once, shared by all workers' sockets) -> load
//          the sockmap program if a listener wants it (else it runs splice) -> the metrics
//          endpoint -> the workers, each accepting once its ring is up.
//   drain: every worker stops accepting and lets its connections finish (drain_timeout).
//   join:  workers exit once their connections are gone; the metrics endpoint goes last, so
//          the final counts can still be scraped during the drain.
#include <memory>
#include <string>
#include <tl/expected.hpp>
#include <vector>

#include "config.hpp"
#include "metrics.hpp"
#include "sockmap.hpp"
#include "worker.hpp"

namespace zcrelay {

class Server {
  public:
    // The error names what failed, e.g. "listener web: bind 127.0.0.1:80: Permission denied".
    static tl::expected<std::unique_ptr<Server>, std::string> start(Config config);
    ~Server();

    const Config& config() const { return config_; }
    // Where each listener really listens (port 0 resolved), in config order.
    const std::vector<SocketAddress>& boundAddresses() const { return bound_; }
    // 0 when metrics are disabled.
    uint16_t metricsPort() const { return metrics_ ? metrics_->port() : 0; }

    void drain();
    void stop();
    bool finished() const;
    void join();

  private:
    explicit Server(Config config) : config_(std::move(config)) {}

    Config config_;
    std::vector<SocketAddress> bound_;
    std::unique_ptr<Sockmap> sockmap_;  // outlives the workers (declared before them)
    std::vector<std::unique_ptr<Worker>> workers_;
    std::unique_ptr<MetricsEndpoint> metrics_;
};

}  // namespace zcrelay
