#pragma once
// The process's one Server: listening sockets, workers and the metrics endpoint, started and
// stopped in a fixed order.
//   start: bind every listener (port 0 resolved once, shared by all workers' sockets) -> load
//          the sockmap program if a listener wants it (else it runs splice) -> with `user`,
//          drop root while this is the only thread (privileges.hpp) -> the access log -> the
//          metrics endpoint -> the workers, each accepting once its ring is up.
//   drain: every worker stops accepting and lets its connections finish (drain_timeout).
//   join:  workers exit once their connections are gone; the metrics endpoint goes last, so
//          the final counts can still be scraped during the drain.
//   reload (SIGHUP): the new config is checked and its new listeners bound first; any error
//          refuses the whole reload and the running config goes on serving. Otherwise every
//          worker switches to the new Runtime; live connections keep the one they started in.
#include <memory>
#include <mutex>
#include <string>
#include <tl/expected.hpp>
#include <vector>

#include "access_log.hpp"
#include "config.hpp"
#include "metrics.hpp"
#include "metrics_endpoint.hpp"
#include "runtime.hpp"
#include "sockmap.hpp"
#include "worker.hpp"

namespace zcrelay {

class Server {
  public:
    // The error names what failed, e.g. "listener web: bind 127.0.0.1:80: Permission denied".
    static tl::expected<std::unique_ptr<Server>, std::string> start(Config config);
    ~Server();

    // The current generation's config and where each of its listeners really listens (port 0
    // resolved), in config order. Main thread only (reload() changes them).
    const Config& config() const { return current_->config; }
    const std::vector<SocketAddress>& boundAddresses() const { return bound_; }
    // Switches to `config`, or returns why not (the running config stays).
    tl::expected<void, std::string> reload(Config config);
    // The current Runtime: any thread (the metrics scrape).
    std::shared_ptr<const Runtime> current() const;
    // SIGHUP also reopens the access log file (logrotate).
    void reopenAccessLog();
    ProcessShared& process() { return process_; }
    // "" when fine, else why: /healthz (a worker died) and /readyz (draining, or a listener
    // with no backend up). Any thread.
    std::string unhealthy() const;
    std::string unready() const;
    // 0 when metrics are disabled.
    uint16_t metricsPort() const { return metrics_ ? metrics_->port() : 0; }
    // 0 without metrics.health_listen.
    uint16_t healthPort() const { return metrics_ ? metrics_->healthPort() : 0; }

    void drain();
    void stop();
    bool finished() const;
    void join();

  private:
    Server() = default;

    mutable std::mutex current_mutex_;
    std::shared_ptr<const Runtime> current_;
    std::vector<SocketAddress> bound_;
    ProcessShared process_;
    std::unique_ptr<AccessLog> access_log_;  // outlives the workers (declared before them)
    std::unique_ptr<Sockmap> sockmap_;       // outlives the workers (declared before them)
    std::vector<std::unique_ptr<Worker>> workers_;
    std::unique_ptr<MetricsEndpoint> metrics_;
};

}  // namespace zcrelay
