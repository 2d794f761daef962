#pragma once
// The HTTP health check's two ends, apart from the ring that moves them: the request a check
// sends, and the verdict on what came back so far. HAProxy's `option httpchk` and `http-check
// expect status`, which is how Patroni's REST API is checked (/primary answers 200 on the
// leader, 503 elsewhere). Bounded: the verdict never wants more than HttpCheckConfig::kMaxReply
// bytes, so an endpoint that answers 10 MB costs a check 16 KiB.
#include <string>
#include <string_view>

#include "address.hpp"
#include "config.hpp"

namespace zcrelay {

// `METHOD PATH HTTP/1.1`, Host (the config's, or `target` as text), `Connection: close`.
std::string httpCheckRequest(const HttpCheckConfig& http, const SocketAddress& target);

struct HttpVerdict {
    enum class Is : uint8_t { Pass, Fail, More };
    Is is = Is::More;
    std::string why;  // a failure's reason, for the log line
};

// What `reply` (every byte read so far) says. `ended`: the peer closed, or kMaxReply bytes are
// in, so no more will come; More is then a Fail. A status is judged as soon as its line is in;
// expect_body is looked for in what follows the headers.
HttpVerdict judgeHttpReply(const HttpCheckConfig& http, std::string_view reply, bool ended);

}  // namespace zcrelay
