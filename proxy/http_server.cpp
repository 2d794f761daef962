#include "http_server.hpp"

#include <microhttpd.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "clock.hpp"
#include "listener.hpp"
#include "log.hpp"
#include "unique_fd.hpp"

namespace zcrelay {

// One connection. Phases, each with its own deadline request_timeout away:
//
//   connected ──request line──▶ reading ──headers done──▶ answering ──response sent──▶ idle
//       ▲                                                                                │
//       └──────────────────────────────── keep-alive ◀──────────────────────────────────┘
//
// `connected` and `idle` wait for a request, `reading` for the rest of it, `answering` for the
// client to take the response. Any phase past its deadline is shut down (`timeout`); any phase
// but `answering` is idle for eviction. shut_down marks one we closed, until libmicrohttpd sees
// the FIN and reports the close.
struct HttpServer::Client {
    std::list<Client>::iterator self;
    int fd = -1;
    int64_t deadline_ms = 0;
    bool reading = false;    // a request line arrived; the handler has not run for it yet
    bool answering = false;  // the handler ran; the response is not all sent yet
    bool shut_down = false;
};

namespace {

constexpr int64_t kReportEveryMs = 10'000;

// What the handler queues: libmicrohttpd copies the body, sends Content-Length, and leaves the
// body out for HEAD.
MHD_Result queue(MHD_Connection* conn, const HttpReply& reply, const char* allow = nullptr) {
    MHD_Response* response = MHD_create_response_from_buffer(
        reply.body.size(), const_cast<char*>(reply.body.data()), MHD_RESPMEM_MUST_COPY);
    if (response == nullptr) return MHD_NO;  // out of memory: libmicrohttpd closes it
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, reply.content_type.c_str());
    if (allow != nullptr) MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, allow);
    const MHD_Result queued =
        MHD_queue_response(conn, static_cast<unsigned>(reply.status), response);
    MHD_destroy_response(response);
    return queued;
}

bool hasBody(MHD_Connection* conn) {
    const char* length =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    const char* chunked =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
    return chunked != nullptr || (length != nullptr && std::strcmp(length, "0") != 0);
}

}  // namespace

struct HttpServer::Callbacks {
    static HttpServer& server(void* cls) { return *static_cast<HttpServer*>(cls); }
    static Client* client(MHD_Connection* conn) {
        const MHD_ConnectionInfo* info =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        return info != nullptr ? static_cast<Client*>(info->socket_context) : nullptr;
    }
    // Moves `c` to the back of the list with a fresh deadline: a phase change.
    static void touch(HttpServer& s, Client& c) {
        c.deadline_ms = monotonicMs() + s.limits_.request_timeout.count();
        s.clients_.splice(s.clients_.end(), s.clients_, c.self);
    }

    static void onConnection(void* cls, MHD_Connection* conn, void** socket_context,
                             MHD_ConnectionNotificationCode code) {
        HttpServer& s = server(cls);
        if (code == MHD_CONNECTION_NOTIFY_STARTED) {
            Client& c = s.clients_.emplace_back();
            c.self = std::prev(s.clients_.end());
            const MHD_ConnectionInfo* info =
                MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
            c.fd = info != nullptr ? info->connect_fd : -1;
            c.deadline_ms = monotonicMs() + s.limits_.request_timeout.count();
            *socket_context = &c;
            ++s.open_;
            s.stats_.connections.fetch_add(1, std::memory_order_relaxed);
            if (s.open_ > s.limits_.max_connections) s.evictFor(c);
            return;
        }
        auto* c = static_cast<Client*>(*socket_context);
        if (c == nullptr) return;
        // Closed in the middle of a request onCompleted() was not told about.
        if (!c->shut_down && c->reading) s.reject(HttpReject::BadRequest);
        if (!c->shut_down) --s.open_;
        s.stats_.connections.fetch_sub(1, std::memory_order_relaxed);
        s.clients_.erase(c->self);
        *socket_context = nullptr;
    }

    static void* onRequestLine(void* cls, const char*, MHD_Connection* conn) {
        if (Client* c = client(conn)) c->reading = true;
        (void)cls;
        return nullptr;  // the request's state: null until the handler runs
    }

    // Called once when the request line and headers are in (`*request` still null), then once
    // more when its body is (none, for what is accepted here). libmicrohttpd 0.9.75 closes the
    // connection after a response queued on the first call ("early": it will not read what
    // follows), so refusals go there and answers wait for the second call, keeping keep-alive.
    static MHD_Result onRequest(void* cls, MHD_Connection* conn, const char* url,
                                const char* method, const char*, const char*, size_t* upload_size,
                                void** request) {
        HttpServer& s = server(cls);
        if (*request == nullptr) {
            *request = &s;  // the handler has seen this request
            if (Client* c = client(conn)) {
                c->reading = false;
                c->answering = true;
                touch(s, *c);
            }
            const bool head = std::strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
            if (!head && std::strcmp(method, MHD_HTTP_METHOD_GET) != 0) {
                s.reject(HttpReject::Method);
                return queue(conn, HttpReply::text(405, "only GET and HEAD\n"), "GET, HEAD");
            }
            if (hasBody(conn)) {
                // Refused before the body: whatever Content-Length promised is never read.
                s.reject(HttpReject::Body);
                return queue(conn, HttpReply::text(413, "no request body is accepted\n"));
            }
            return MHD_YES;
        }
        *upload_size = 0;  // a body cannot get here: hasBody() refused it
        const auto route = std::find_if(s.routes_.begin(), s.routes_.end(),
                                        [&](const HttpRoute& r) { return r.path == url; });
        if (route == s.routes_.end()) {
            s.reject(HttpReject::NotFound);
            return queue(conn, HttpReply::text(404, "not found\n"));
        }
        s.stats_.requests.fetch_add(1, std::memory_order_relaxed);
        return queue(conn, route->handler());
    }

    // The end of a request libmicrohttpd told us the start of (its request line): answered, or
    // refused by libmicrohttpd itself before our handler saw it (400, 414, 431), or cut off.
    static void onCompleted(void* cls, MHD_Connection* conn, void** request,
                            MHD_RequestTerminationCode) {
        HttpServer& s = server(cls);
        Client* c = client(conn);
        if (c == nullptr) return;
        if (*request == nullptr && !c->shut_down) s.reject(HttpReject::BadRequest);
        c->answering = false;
        c->reading = false;
        if (!c->shut_down) touch(s, *c);
    }

    static void onLibraryLog(void* cls, const char* fmt, va_list ap) {
        // libmicrohttpd's own complaints (a failed accept, a reset peer): useful when debugging,
        // noise under attack; what it refused is counted and reported by reportRejects().
        if (!logEnabled(LogLevel::Debug)) return;
        char line[512];
        std::vsnprintf(line, sizeof line, fmt, ap);
        line[std::strcspn(line, "\n")] = '\0';
        LOG_DEBUG("%s: libmicrohttpd: %s", server(cls).name_.c_str(), line);
    }
};

HttpServer::HttpServer(std::string name, SocketAddress address, const HttpLimits& limits,
                       std::vector<HttpRoute> routes, HttpStats& stats)
    : name_(std::move(name)),
      address_(address),
      limits_(limits),
      routes_(std::move(routes)),
      stats_(stats) {}

tl::expected<std::unique_ptr<HttpServer>, std::string> HttpServer::start(
    const std::string& name, const SocketAddress& listen, const HttpLimits& limits,
    std::vector<HttpRoute> routes, HttpStats& stats) {
    if (listen.family() != AF_INET && listen.family() != AF_INET6)
        return tl::unexpected(listen.toString() + ": only TCP addresses are served");
    UniqueFd fd(::socket(listen.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) return tl::unexpected(std::string("socket: ") + std::strerror(errno));
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (listen.family() == AF_INET6)
        ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    if (::bind(fd.get(), listen.sockaddrPtr(), listen.length) < 0)
        return tl::unexpected("bind " + listen.toString() + ": " + std::strerror(errno));
    // A deep backlog: under a connection flood the probe waits in it for one accept round, not
    // for a SYN retransmit (1 s) after an overflow. The kernel caps it at net.core.somaxconn.
    if (::listen(fd.get(), SOMAXCONN) < 0)
        return tl::unexpected("listen " + listen.toString() + ": " + std::strerror(errno));
    auto bound = boundAddress(fd.get());
    if (!bound) return tl::unexpected(bound.error().message());

    std::unique_ptr<HttpServer> server(
        new HttpServer(name, *bound, limits, std::move(routes), stats));
    server->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (server->wake_fd_ < 0)
        return tl::unexpected(std::string("eventfd: ") + std::strerror(errno));

    // The memory pool of one connection holds its read buffer and the parsed headers, then the
    // response's headers: the request may fill all but what the response needs (1 KiB is
    // several times what ours take), past which libmicrohttpd answers 431 (or 414).
    const size_t pool = limits.max_request_size + 1024;
    // Its hard connection limit sits above ours: past it libmicrohttpd refuses the newest
    // connection (the probe), where evictFor() closes the oldest idle one. The headroom covers
    // the connections shut down but not yet reaped in the same round.
    const unsigned hard_limit = limits.max_connections * 2 + 16;
    // MHD_USE_EPOLL without an internal thread: run() owns the loop, so the deadlines and the
    // evictions happen on the thread that owns every connection. No MHD timeout: sweep() keeps
    // the deadlines, to the millisecond.
    server->daemon_ = MHD_start_daemon(
        MHD_USE_EPOLL | MHD_USE_ERROR_LOG, 0, nullptr, nullptr, &Callbacks::onRequest, server.get(),
        MHD_OPTION_LISTEN_SOCKET, fd.get(), MHD_OPTION_CONNECTION_LIMIT, hard_limit,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, pool, MHD_OPTION_CONNECTION_TIMEOUT, 0u,
        MHD_OPTION_NOTIFY_CONNECTION, &Callbacks::onConnection, server.get(),
        MHD_OPTION_NOTIFY_COMPLETED, &Callbacks::onCompleted, server.get(),
        MHD_OPTION_URI_LOG_CALLBACK, &Callbacks::onRequestLine, server.get(),
        MHD_OPTION_EXTERNAL_LOGGER, &Callbacks::onLibraryLog, server.get(),
        MHD_OPTION_SIGPIPE_HANDLED_BY_APP, 1,  // main() ignores SIGPIPE for the process
        MHD_OPTION_END);
    if (server->daemon_ == nullptr)
        return tl::unexpected(std::string("libmicrohttpd did not start"));
    fd.release();  // the daemon closes it
    server->thread_ = std::thread([s = server.get()] { s->run(); });
    return server;
}

HttpServer::~HttpServer() {
    if (thread_.joinable()) {
        const uint64_t one = 1;
        ssize_t ignored = ::write(wake_fd_, &one, sizeof one);
        (void)ignored;
        thread_.join();
    }
    // Closes every connection (the CLOSED callbacks run here, the thread being gone).
    if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
}

void HttpServer::run() {
    setLogThreadName("http");
    // One epoll set over libmicrohttpd's (listening socket and connections) and the stop
    // eventfd: the thread sleeps until either has something, or the next deadline.
    UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
    const MHD_DaemonInfo* info = MHD_get_daemon_info(daemon_, MHD_DAEMON_INFO_EPOLL_FD);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = info->epoll_fd;
    ::epoll_ctl(ep.get(), EPOLL_CTL_ADD, info->epoll_fd, &ev);
    ev.data.fd = wake_fd_;
    ::epoll_ctl(ep.get(), EPOLL_CTL_ADD, wake_fd_, &ev);
    for (;;) {
        epoll_event ready[2];
        const int n = ::epoll_wait(ep.get(), ready, 2, nextWakeMs(monotonicMs()));
        for (int i = 0; i < n; ++i)
            if (ready[i].data.fd == wake_fd_) return;
        MHD_run(daemon_);
        const int64_t now = monotonicMs();
        sweep(now);
        reportRejects(now);
    }
}

int HttpServer::nextWakeMs(int64_t now_ms) const {
    int64_t wake = kReportEveryMs;
    MHD_UNSIGNED_LONG_LONG mhd = 0;
    if (MHD_get_timeout(daemon_, &mhd) == MHD_YES) wake = std::min<int64_t>(wake, mhd);
    for (const Client& c : clients_) {
        if (c.shut_down) continue;
        wake = std::min(wake, std::max<int64_t>(0, c.deadline_ms - now_ms));
        break;  // the first one not shut down has the earliest deadline
    }
    return static_cast<int>(wake);
}

void HttpServer::sweep(int64_t now_ms) {
    for (Client& c : clients_) {
        if (c.deadline_ms > now_ms) break;
        if (!c.shut_down) shutDown(c, HttpReject::Timeout);
    }
}

void HttpServer::evictFor(const Client& newcomer) {
    Client* victim = nullptr;
    for (Client& c : clients_) {
        if (c.shut_down || &c == &newcomer) continue;
        if (!c.answering) {
            victim = &c;
            break;
        }
        if (victim == nullptr) victim = &c;  // the oldest being answered, if none is idle
    }
    if (victim != nullptr) shutDown(*victim, HttpReject::Evicted);
}

void HttpServer::shutDown(Client& client, HttpReject why) {
    // shutdown(), not close(): the fd stays libmicrohttpd's, which sees the FIN it causes on its
    // epoll set, closes the socket itself and reports it. Both directions, so a client still
    // sending gets an RST rather than a window that never opens.
    ::shutdown(client.fd, SHUT_RDWR);
    client.shut_down = true;
    --open_;
    reject(why);
}

void HttpServer::reject(HttpReject why) {
    stats_.rejected[idx(why)].fetch_add(1, std::memory_order_relaxed);
}

void HttpServer::reportRejects(int64_t now_ms) {
    // One line at most every kReportEveryMs, naming what was refused since the last one: a
    // flood of thousands of connections costs the log a line, not thousands.
    if (now_ms - last_report_ms_ < kReportEveryMs) return;
    std::string what;
    for (size_t r = 0; r < reported_.size(); ++r) {
        const uint64_t total = stats_.rejected[r].load(std::memory_order_relaxed);
        if (total == reported_[r]) continue;
        what += (what.empty() ? "" : ", ") + std::string(kHttpRejectLabels[r]) + " " +
                std::to_string(total - reported_[r]);
        reported_[r] = total;
    }
    if (what.empty()) return;
    last_report_ms_ = now_ms;
    LOG_WARN("%s %s: refused since the last report: %s (%u connections open, limit %u)",
             name_.c_str(), address_.toString().c_str(), what.c_str(), open_,
             limits_.max_connections);
}

}  // namespace zcrelay
