#pragma once
// The control plane's HTTP server: a few fixed routes (/metrics, /healthz, /readyz; the runtime
// API's JSON paths), built so that no client, however slow, idle or hostile, keeps a probe
// waiting or makes the relay hold more than it chose to.
//
// libmicrohttpd parses HTTP/1.0 and 1.1 (request line, headers, Content-Length bodies, keep-alive,
// pipelining, HEAD, 100-continue); nothing here parses HTTP. What this file adds is the bounds
// libmicrohttpd lacks, enforced on the one thread that also runs its event loop (so a
// connection's socket cannot be closed and reused under us):
//   - a deadline per connection: a complete request (request line, headers and body) within
//     request_timeout of the connect (or of the previous response, on keep-alive), and the
//     response sent within request_timeout of the request. Past it the connection is shut down:
//     `timeout`. libmicrohttpd's own timeout counts idle seconds, so a client trickling a byte a
//     second would never meet it.
//   - at most max_connections at once. A new connection past the cap closes the oldest idle one
//     (no request being answered; failing that, the oldest): `evicted`. A probe is the newest
//     connection, so thousands of idle sockets can delay it by one eviction, never refuse it.
//     (libmicrohttpd's own limit refuses the newest instead: the probe.)
//   - request line and headers held in at most about max_request_size (libmicrohttpd answers
//     431/414 past it); a body only where the route takes one (max_body), held in one buffer of
//     at most max_body bytes, and refused before a byte of it is read otherwise: 413 when its
//     Content-Length is over max_body (or the route takes none), 411 when it has no length
//     (Transfer-Encoding: chunked is not taken), then the connection is closed. Methods a route
//     does not take: 405.
//   - 400, then closed, for what RFC 9112 has a server refuse and libmicrohttpd lets through
//     (it hands values over as C strings, so a NUL hid the rest of a line): two Content-Lengths
//     or Content-Length with Transfer-Encoding (§6.3, the request-smuggling shape), a NUL or
//     other control byte in the target, a header name or value (a tab in a value is fine), a
//     space in the target, a folded header line. Counted as `bad_request`.
//
// Routing is by the path as sent (percent-escapes are not decoded, the query string is not part
// of it): exact routes first, then the longest prefix route. A path no route serves is 404,
// unless no route takes the method at all (405, as for a server of GET/HEAD routes only).
//
// One thread per server runs everything, the handlers included: a scrape is built in well
// under a millisecond, and a probe never waits for more than that. A handler must not block.
#include <sys/types.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <tl/expected.hpp>
#include <vector>

#include "address.hpp"
#include "http_stats.hpp"
#include "unique_fd.hpp"
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

// What a handler is given. Every view points into the server's buffers and is valid only while
// the handler runs: copy what outlives it.
struct HttpRequest {
    std::string_view method;         // "GET", "HEAD", "POST", "PUT", ... (as sent: case matters)
    std::string_view path;           // the path as sent (no query string), not decoded
    std::string_view body;           // the whole body ("" for none)
    std::string_view authorization;  // the Authorization header value without the blanks
                                     // around it, "" if absent (the first, if a client sent
                                     // several)
};

// An aggregate, so routes read as designated initializers:
//   {.path = "/v1/backends/", .handler = h, .prefix = true, .methods = {"PUT"}, .max_body = 65536}
struct HttpRoute {
    std::string path;  // "/metrics"; with `prefix`, the start of the paths it serves
    std::function<HttpReply(const HttpRequest&)> handler;  // runs on the server's thread
    bool prefix = false;  // match every path that starts with `path` (exact routes win)
    // What it takes; any other method is 405 with an Allow header listing these. HEAD is
    // answered like GET without the body (libmicrohttpd drops it), when listed.
    std::vector<std::string> methods = {"GET", "HEAD"};
    // The largest body taken, by its Content-Length; past it 413 before a byte of it is read,
    // and the connection closed. A chunked body (no length to check first) gets 411 Length
    // Required. 0: no body at all (any body 413, chunked included, as for /metrics).
    uint64_t max_body = 0;
};

class HttpServer {
  public:
    // Binds `listen` and starts the thread. TCP, IPv4 or IPv6 (port 0 picks one), or a unix
    // socket (unix:/path): a socket file already at the path is removed if nothing listens on it
    // (a stale one); anything else there (a regular file, a directory, a symlink, a socket in
    // use) is refused, untouched. The socket file is made 0660 before it listens, and removed
    // when the server stops (if it is still ours). `name` prefixes its log lines ("metrics
    // endpoint"). The error names the step that failed and the path or address.
    // `adopted`: a socket already listening on `listen`, handed over by the relay this one took
    // over from (takeover.hpp): served as it is, nothing bound; its unix socket file, if any, is
    // this server's to remove from then on.
    static tl::expected<std::unique_ptr<HttpServer>, std::string> start(
        const std::string& name, const SocketAddress& listen, const HttpLimits& limits,
        std::vector<HttpRoute> routes, HttpStats& stats, UniqueFd adopted = UniqueFd());
    ~HttpServer();  // stops the thread and closes every connection
    HttpServer(const HttpServer&) = delete;
    HttpServer& operator=(const HttpServer&) = delete;

    // Where it listens (port 0 resolved).
    const SocketAddress& address() const { return address_; }
    // The listening socket, to pass to the next relay (a dup of it): valid until handOver().
    int listenFd() const { return listen_fd_; }
    // The next relay listens on the socket now: this one stops accepting (libmicrohttpd's
    // quiesce, on the server's thread), answers the connections it has, and leaves the socket
    // file to its new owner. Any thread; returns once the server's thread has stopped accepting
    // (at most kHandOverWaitMs), so that a client that connects after it reaches the next relay.
    void handOver();

  private:
    struct Client;     // one connection's deadline and phase (http_server_internal.hpp)
    struct Callbacks;  // libmicrohttpd's callbacks, all run on the server's thread

    HttpServer(std::string name, SocketAddress address, const HttpLimits& limits,
               std::vector<HttpRoute> routes, HttpStats& stats);
    // The route that serves `path`: exact first, then the longest prefix; null for none.
    const HttpRoute* findRoute(std::string_view path) const;
    // Whether any route takes `method` (a path no route serves is 404 then, else 405).
    bool anyRouteTakes(std::string_view method) const;
    void run();
    // handOver()'s work, on the server's thread (libmicrohttpd is not thread-safe).
    void quiesce();
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
    // Built once at start, so refusing a method costs no formatting: per route (same index),
    // its Allow header value ("GET, HEAD") and 405 text ("only GET and HEAD\n"); then the same
    // for the union of every route's methods (for paths no route serves).
    std::vector<std::string> allow_;
    std::vector<std::string> not_allowed_;
    std::string all_allow_;
    std::string all_not_allowed_;
    std::vector<size_t> prefix_order_;  // indices of the prefix routes, longest path first
    HttpStats& stats_;
    // Open connections, oldest deadline first: every phase change moves a connection to the
    // back with a deadline request_timeout away, so the order is the deadlines' order.
    std::list<Client> clients_;
    uint32_t open_ = 0;  // clients_ not yet shut down by us
    MHD_Daemon* daemon_ = nullptr;
    int wake_fd_ = -1;  // eventfd: a stop (the destructor's) or a handOver() request
    std::atomic<bool> stopping_{false};
    std::atomic<bool> handing_over_{false};
    std::atomic<bool> quiesced_{false};  // quiesce() is done: handOver() may return
    int listen_fd_ = -1;  // owned by libmicrohttpd until the hand-over
    // What the rate-limited log line has reported so far.
    std::array<uint64_t, idx(HttpReject::kCount)> reported_{};
    int64_t last_report_ms_ = 0;
    // A unix socket's file, removed when the server stops if it is still the one bound here
    // (same device and inode): another server may have replaced it meanwhile.
    std::string unix_path_;
    dev_t unix_dev_ = 0;
    ino_t unix_ino_ = 0;
    std::thread thread_;
};

}  // namespace zcrelay
