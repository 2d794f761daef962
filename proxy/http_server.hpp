#pragma once
// The control plane's HTTP server: GET and HEAD of a few fixed paths (/metrics, /healthz,
// /readyz), built so that no client, however slow, idle or hostile, keeps a probe waiting.
//
// libmicrohttpd parses HTTP/1.0 and 1.1 (request line, headers, keep-alive, pipelining, HEAD);
// nothing here parses HTTP. What this file adds is the bounds libmicrohttpd lacks, enforced on
// the one thread that also runs its event loop (so a connection's socket cannot be closed and
// reused under us):
//   - a deadline per connection: a complete request within request_timeout of the connect (or
//     of the previous response, on keep-alive), and the response sent within request_timeout of
//     the request. Past it the connection is shut down: `timeout`. libmicrohttpd's own timeout
//     counts idle seconds, so a client trickling a byte a second would never meet it.
//   - at most max_connections at once. A new connection past the cap closes the oldest idle one
//     (no request being answered; failing that, the oldest): `evicted`. A probe is the newest
//     connection, so thousands of idle sockets can delay it by one eviction, never refuse it.
//     (libmicrohttpd's own limit refuses the newest instead: the probe.)
//   - request line and headers held in at most about max_request_size (libmicrohttpd answers
//     431/414 past it), any request body refused with 413, methods other than GET/HEAD with 405.
//
// One thread per server runs everything, the handlers included: a scrape is built in well
// under a millisecond, and a probe never waits for more than that.
#include <array>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <tl/expected.hpp>
#include <vector>

#include "address.hpp"
#include "http_stats.hpp"
#include "units.hpp"

struct MHD_Daemon;

namespace zcrelay {

struct HttpLimits {
    Duration request_timeout = std::chrono::seconds(5);
    uint32_t max_connections = 64;
    uint64_t max_request_size = 8192;
};

struct HttpReply {
    int status = 200;
    std::string content_type = "text/plain; charset=utf-8";
    std::string body;

    // A plain-text reply (the default content type).
    static HttpReply text(int status, std::string body) {
        HttpReply r;
        r.status = status;
        r.body = std::move(body);
        return r;
    }
};

struct HttpRoute {
    std::string path;                    // exact match, e.g. "/metrics"
    std::function<HttpReply()> handler;  // runs on the server's thread
};

class HttpServer {
  public:
    // Binds `listen` (TCP, IPv4 or IPv6; port 0 picks one) and starts the thread. `name`
    // prefixes its log lines ("metrics endpoint"). The error names the step that failed.
    static tl::expected<std::unique_ptr<HttpServer>, std::string> start(
        const std::string& name, const SocketAddress& listen, const HttpLimits& limits,
        std::vector<HttpRoute> routes, HttpStats& stats);
    ~HttpServer();  // stops the thread and closes every connection
    HttpServer(const HttpServer&) = delete;
    HttpServer& operator=(const HttpServer&) = delete;

    // Where it listens (port 0 resolved).
    const SocketAddress& address() const { return address_; }

  private:
    struct Client;     // one connection's deadline and phase (http_server.cpp)
    struct Callbacks;  // libmicrohttpd's callbacks, all run on the server's thread

    HttpServer(std::string name, SocketAddress address, const HttpLimits& limits,
               std::vector<HttpRoute> routes, HttpStats& stats);
    void run();
    int nextWakeMs(int64_t now_ms) const;
    void sweep(int64_t now_ms);
    void evictFor(const Client& newcomer);
    void shutDown(Client& client, HttpReject why);
    void reject(HttpReject why);
    void reportRejects(int64_t now_ms);

    const std::string name_;
    const SocketAddress address_;
    const HttpLimits limits_;
    const std::vector<HttpRoute> routes_;
    HttpStats& stats_;
    // Open connections, oldest deadline first: every phase change moves a connection to the
    // back with a deadline request_timeout away, so the order is the deadlines' order.
    std::list<Client> clients_;
    uint32_t open_ = 0;  // clients_ not yet shut down by us
    MHD_Daemon* daemon_ = nullptr;
    int wake_fd_ = -1;  // eventfd: the destructor's stop request
    // What the rate-limited log line has reported so far.
    std::array<uint64_t, idx(HttpReject::kCount)> reported_{};
    int64_t last_report_ms_ = 0;
    std::thread thread_;
};

}  // namespace zcrelay
