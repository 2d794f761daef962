// Connections and their limits: each connection's phases and deadline, the sweep that shuts
// down those past it, eviction at max_connections, and the counted, rate-limited report of
// what was refused.
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "http_server_internal.hpp"
#include "log.hpp"

namespace zcrelay {

namespace {

constexpr int64_t kReportEveryMs = 10'000;

}  // namespace

void HttpServer::Callbacks::onConnection(void* cls, MHD_Connection* conn, void** socket_context,
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

// The request is in (or refused): its response has request_timeout to be taken.
void HttpServer::Callbacks::answering(HttpServer& s, Client& c) {
    c.reading = false;
    c.answering = true;
    touch(s, c);
}

// The end of a request libmicrohttpd told us the start of (its request line): answered, or
// refused by libmicrohttpd itself before our handler saw it (400, 414, 431), or cut off
// (before the end of its headers or of its body).
void HttpServer::Callbacks::onCompleted(void* cls, MHD_Connection* conn, void** request,
                                        MHD_RequestTerminationCode) {
    HttpServer& s = server(cls);
    Client* c = client(conn);
    if (c == nullptr) return;
    if ((*request == nullptr || c->reading) && !c->shut_down) s.reject(HttpReject::BadRequest);
    c->answering = false;
    c->reading = false;
    std::string().swap(c->body);  // freed, not kept for the next request
    c->body_left = 0;
    if (!c->shut_down) touch(s, *c);
}

void HttpServer::Callbacks::onLibraryLog(void* cls, const char* fmt, va_list ap) {
    // libmicrohttpd's own complaints (a failed accept, a reset peer): useful when debugging,
    // noise under attack; what it refused is counted and reported by reportRejects().
    if (!logEnabled(LogLevel::Debug)) return;
    char line[512];
    std::vsnprintf(line, sizeof line, fmt, ap);
    line[std::strcspn(line, "\n")] = '\0';
    LOG_DEBUG("%s: libmicrohttpd: %s", server(cls).name_.c_str(), line);
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
