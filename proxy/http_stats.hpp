#pragma once
// What the control plane's HTTP servers (http_server.hpp) count: plain atomics that the server
// thread writes and the metrics collector reads, with no HTTP or Prometheus header in sight.
#include <array>
#include <atomic>
#include <cstdint>
#include <string_view>

#include "reasons.hpp"

namespace zcrelay {

// Why the endpoint closed a connection or refused a request, as the label of
// zcrelay_metrics_endpoint_rejected_total.
// bad_request: closed before a complete request: malformed (libmicrohttpd's 400, or ours for
// ambiguous lengths or a NUL or control byte), over max_request_size (431, 414), or cut off by
// the client.
#define ZCRELAY_HTTP_REJECTS(X)                                                              \
    X(Timeout, "timeout") /* no complete request (or no response sent) in request_timeout */ \
    X(Evicted, "evicted") /* the oldest idle one, closed for a new connection at the cap */  \
    X(BadRequest, "bad_request") /* malformed, too large or cut off: see above */            \
    X(Method, "method")          /* not GET or HEAD: 405 */                                  \
    X(Body, "body")              /* a request with a body: 413, then closed */               \
    X(NotFound, "not_found")     /* a path the server does not serve: 404 */

enum class HttpReject : uint8_t { ZCRELAY_HTTP_REJECTS(ZCRELAY_ENUM_ITEM) kCount };
inline constexpr std::array<std::string_view, idx(HttpReject::kCount)> kHttpRejectLabels{
    ZCRELAY_HTTP_REJECTS(ZCRELAY_LABEL_ITEM)};
inline std::string_view label(HttpReject r) { return kHttpRejectLabels[idx(r)]; }

struct HttpStats {
    std::array<std::atomic<uint64_t>, idx(HttpReject::kCount)> rejected{};
    std::atomic<uint64_t> requests{0};    // answered by a handler (any status but the above)
    std::atomic<int64_t> connections{0};  // gauge: open now, over every server sharing this
};

}  // namespace zcrelay
