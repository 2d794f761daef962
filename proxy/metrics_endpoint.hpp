#pragma once
// The HTTP endpoint on metrics.listen, one civetweb server with three paths:
//   /metrics  the Prometheus text format of the Collectable (metrics.hpp), built per scrape;
//   /healthz  200 "ok" while the relay is alive (no worker died), 500 with the reason otherwise;
//   /readyz   200 "ready" when the relay can serve: not draining, and every listener's cluster
//             has a backend up; 503 with the first reason otherwise. For load balancers and
//             Kubernetes readiness probes.
// It runs on civetweb's own threads (two: a probe is answered during a slow scrape) and only
// reads what the workers publish; it never touches a ring.
#include <functional>
#include <memory>
#include <string>

#include "address.hpp"

class CivetServer;
namespace prometheus {
class Collectable;
}

namespace zcrelay {

class MetricsEndpoint {
  public:
    // Each check returns "" when fine, or the reason it is not. Throws std::exception if the
    // address cannot be bound (start-up only).
    MetricsEndpoint(const SocketAddress& listen, std::shared_ptr<prometheus::Collectable> metrics,
                    std::function<std::string()> unhealthy, std::function<std::string()> unready);
    ~MetricsEndpoint();
    MetricsEndpoint(const MetricsEndpoint&) = delete;
    MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

    uint16_t port() const;

  private:
    class Handler;

    SocketAddress address_;
    std::unique_ptr<Handler> metrics_, healthz_, readyz_;
    std::unique_ptr<CivetServer> server_;
};

}  // namespace zcrelay
