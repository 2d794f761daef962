#pragma once
// The runtime API: what HAProxy's `show servers state` / `set server ... state|weight` and
// Envoy's admin endpoint let an operator do, as JSON over HTTP on admin.listen, served by the
// same hardened server as /metrics (http_server.hpp: deadlines, a connection cap, bounded
// requests) on a thread of its own.
//
//   GET  /api/v1/clusters                           every cluster and its backends
//   GET  /api/v1/clusters/<cluster>                 one cluster
//   GET  /api/v1/clusters/<cluster>/backends/<addr> one backend (addr as listed; %-escapes ok)
//   POST /api/v1/clusters/<cluster>/backends/<addr> change it (PUT too), a JSON object of:
//        "state":    "ready" | "drain" | "maint"   (runtime.hpp says what each does)
//        "weight":   0..256; 0 takes no new connections, like drain
//        "shutdown": true ends the backend's live connections now (close reason admin_shutdown)
//
// A backend's state is what it takes new connections by: `health` (checks, passive ejection)
// and the operator's `state` and `weight` together. Changes are logged, counted
// (zcrelay_admin_changes_total), and kept in the backend's shared state, so a SIGHUP reload that
// keeps the backend (same cluster, same address) keeps them; a restart, or a discovered backend
// that leaves DNS and comes back, starts from ready and the configured weight. A weight change
// builds a new generation (the balancers weigh at build time); a state change is one atomic
// store the next pick reads.
//
// Every error the API itself finds is a JSON object {"error": "..."} naming what was wrong:
// 400 (not JSON, unknown member, bad state or weight), 401 (token), 404 (unknown cluster or
// backend), 405 (a write to a cluster), counted in zcrelay_admin_requests_total. What the HTTP
// layer refuses before the API sees it (a path outside /api/v1/clusters, a method it does not
// take, a body over 4 KiB) gets the metrics endpoint's plain-text answer and is counted in
// zcrelay_admin_endpoint_rejected_total.
#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tl/expected.hpp>

#include "config.hpp"
#include "discovery.hpp"
#include "http_server.hpp"
#include "runtime.hpp"

namespace zcrelay {

// What the API changed: the `change` label.
#define ZCRELAY_ADMIN_CHANGES(X) \
    X(StateReady, "state_ready") \
    X(StateDrain, "state_drain") \
    X(StateMaint, "state_maint") \
    X(Weight, "weight")          \
    X(Shutdown, "shutdown")

// How a request ended: the `result` label.
#define ZCRELAY_ADMIN_RESULTS(X)    \
    X(Ok, "ok")                     \
    X(BadRequest, "bad_request")    \
    X(Unauthorized, "unauthorized") \
    X(NotFound, "not_found")

enum class AdminChange : uint8_t { ZCRELAY_ADMIN_CHANGES(ZCRELAY_ENUM_ITEM) kCount };
enum class AdminResult : uint8_t { ZCRELAY_ADMIN_RESULTS(ZCRELAY_ENUM_ITEM) kCount };
inline constexpr std::array<std::string_view, idx(AdminChange::kCount)> kAdminChangeLabels{
    ZCRELAY_ADMIN_CHANGES(ZCRELAY_LABEL_ITEM)};
inline constexpr std::array<std::string_view, idx(AdminResult::kCount)> kAdminResultLabels{
    ZCRELAY_ADMIN_RESULTS(ZCRELAY_LABEL_ITEM)};

struct AdminStats {
    std::array<std::atomic<uint64_t>, idx(AdminChange::kCount)> changes{};
    std::array<std::atomic<uint64_t>, idx(AdminResult::kCount)> results{};
    HttpStats http;  // the API's HTTP server
};

class AdminApi {
  public:
    // What the API reads and changes, all callable from its thread.
    struct Hooks {
        std::function<std::shared_ptr<const Runtime>()> current;
        std::function<std::map<std::string, DiscoveryView>()> discovery;  // may be empty
        std::function<void()> rebuild;  // a weight changed: build the next generation
        std::function<void(std::shared_ptr<BackendState>, const std::string& who)> end_connections;
    };

    // Reads the token file (its first line without the spaces and tabs around it; one empty
    // after that, or holding a control byte, is refused) and starts the server.
    static tl::expected<std::unique_ptr<AdminApi>, std::string> start(
        const AdminConfig& config, Hooks hooks, AdminStats& stats, UniqueFd adopted = UniqueFd());
    // Answers one request as the server would: the tests call it directly too.
    HttpReply handle(const HttpRequest& request);
    // Where it listens (port 0 resolved, or the unix path).
    const SocketAddress& address() const { return server_->address(); }
    // For the next relay (takeover.hpp): its listening socket, and the end of serving on it.
    int listenFd() const { return server_->listenFd(); }
    void handOver() { server_->handOver(); }

  private:
    AdminApi(Hooks hooks, std::string token, AdminStats& stats)
        : hooks_(std::move(hooks)), token_(std::move(token)), stats_(stats) {}

    HttpReply answer(const HttpRequest& request);
    HttpReply change(const ClusterRt& cluster, const BackendRt& backend, std::string_view body);
    std::string clusterJson(const ClusterRt& cluster,
                            const std::map<std::string, DiscoveryView>& views) const;
    HttpReply fail(AdminResult result, int status, const std::string& why);

    Hooks hooks_;
    std::string token_;
    AdminStats& stats_;
    std::unique_ptr<HttpServer> server_;
};

}  // namespace zcrelay
