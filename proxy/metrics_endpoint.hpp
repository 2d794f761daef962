#pragma once
// The paths the control plane serves over HTTP (http_server.hpp):
//   /metrics  the Prometheus text format of the Collectable (metrics.hpp), built per scrape;
//   /healthz  200 "ok" while the relay is alive (no worker died), 500 with the reason otherwise;
//   /readyz   200 "ready" when the relay can serve: not draining, and every listener's cluster
//             has a backend up; 503 with the first reason otherwise. For load balancers and
//             Kubernetes readiness probes.
// All three on metrics.listen; with metrics.health_listen, /healthz and /readyz also on a port
// of their own, with its own thread and connection cap, so probes never queue behind scrapes.
// Only reads what the workers publish; never touches a ring.
#include <functional>
#include <memory>
#include <string>
#include <tl/expected.hpp>

#include "config.hpp"
#include "http_server.hpp"

namespace prometheus {
class Collectable;
}

namespace zcrelay {

class MetricsEndpoint {
  public:
    // Each check returns "" when fine, or the reason it is not. The error names the address
    // that could not be served (start-up only).
    static tl::expected<std::unique_ptr<MetricsEndpoint>, std::string> start(
        const MetricsConfig& config, std::shared_ptr<prometheus::Collectable> metrics,
        std::function<std::string()> unhealthy, std::function<std::string()> unready,
        HttpStats& stats, UniqueFd adopted_metrics = UniqueFd(),
        UniqueFd adopted_health = UniqueFd(), std::function<std::string()> ready_notes = {});

    uint16_t port() const { return metrics_->address().port(); }
    // 0 without health_listen.
    uint16_t healthPort() const { return health_ ? health_->address().port() : 0; }
    // The listening sockets, for the next relay (takeover.hpp); -1 without health_listen.
    int listenFd() const { return metrics_->listenFd(); }
    int healthListenFd() const { return health_ ? health_->listenFd() : -1; }
    // The next relay serves both addresses now: this process stops accepting on them.
    void handOver() {
        metrics_->handOver();
        if (health_) health_->handOver();
    }

  private:
    MetricsEndpoint() = default;

    std::unique_ptr<HttpServer> metrics_;
    std::unique_ptr<HttpServer> health_;
};

}  // namespace zcrelay
