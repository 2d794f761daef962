#include "metrics_endpoint.hpp"

#include <prometheus/collectable.h>
#include <prometheus/text_serializer.h>

namespace zcrelay {
namespace {

HttpReply check(const std::function<std::string()>& probe, int bad_status, const char* good) {
    std::string why = probe();
    if (why.empty()) return HttpReply::text(200, std::string(good) + "\n");
    return HttpReply::text(bad_status, why + "\n");
}

}  // namespace

tl::expected<std::unique_ptr<MetricsEndpoint>, std::string> MetricsEndpoint::start(
    const MetricsConfig& config, std::shared_ptr<prometheus::Collectable> metrics,
    std::function<std::string()> unhealthy, std::function<std::string()> unready, HttpStats& stats,
    UniqueFd adopted_metrics, UniqueFd adopted_health, std::function<std::string()> ready_notes) {
    const HttpLimits limits{config.request_timeout, config.max_connections,
                            config.max_request_size};
    std::vector<HttpRoute> probes = {
        {"/healthz", [unhealthy](const HttpRequest&) { return check(unhealthy, 500, "ok"); }},
        {"/readyz",
         [unready, ready_notes](const HttpRequest&) {
             HttpReply r = check(unready, 503, "ready");
             // Ready, but not as configured: backups serving, a backend ramping up. Lines an
             // operator reads; the status alone is what a probe reads.
             if (r.status == 200 && ready_notes) r.body += ready_notes();
             return r;
         }},
    };
    std::vector<HttpRoute> all = probes;
    all.push_back({"/metrics", [metrics](const HttpRequest&) {
                       return HttpReply{200, "text/plain; version=0.0.4; charset=utf-8",
                                        prometheus::TextSerializer().Serialize(metrics->Collect())};
                   }});
    std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
    auto served = HttpServer::start("metrics endpoint", config.listen, limits, std::move(all),
                                    stats, std::move(adopted_metrics));
    if (!served)
        return tl::unexpected("metrics " + config.listen.toString() + ": " + served.error());
    endpoint->metrics_ = std::move(*served);
    if (config.health_listen.length != 0) {
        auto health = HttpServer::start("health endpoint", config.health_listen, limits,
                                        std::move(probes), stats, std::move(adopted_health));
        if (!health)
            return tl::unexpected("metrics.health_listen " + config.health_listen.toString() +
                                  ": " + health.error());
        endpoint->health_ = std::move(*health);
    }
    return endpoint;
}

}  // namespace zcrelay
