#pragma once
// The control plane's HTTP server (proxy/http_server.hpp) in-process, with routes of the tests'
// own, over real loopback TCP and unix sockets. What the http_server_*_test.cpp files share: a
// client that speaks just enough HTTP/1.1 to check every byte of the answers, and the fixture
// whose handlers record what they were given. The files: request bodies (exactly what was sent,
// up to max_body and not a byte more, within the connection's one deadline; pipelining), routes
// (per-route methods, prefix routes, the Authorization header, HEAD, and the routes without a
// body, /metrics and the probes, refusing one as before), framing RFC 9112 has a server refuse,
// and unix socket files (stale ones replaced, anything else refused, removed at shutdown).
// Every wait is bounded.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "http_server.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::http_server_test {

// ---------------------------------------------------------------------------------------------
// A client that speaks just enough HTTP/1.1 to check every byte of the answers.

struct Response {
    int status = 0;
    std::string head;  // status line and headers
    std::string body;
    std::string error;  // set when no complete response arrived

    // A header's value ("" if absent), its name matched without case.
    std::string header(std::string_view name) const {
        std::string lower_head = head, lower_name = "\r\n" + std::string(name) + ":";
        for (char& ch : lower_head) ch = static_cast<char>(std::tolower(ch));
        for (char& ch : lower_name) ch = static_cast<char>(std::tolower(ch));
        const size_t at = lower_head.find(lower_name);
        if (at == std::string::npos) return "";
        size_t from = at + lower_name.size();
        const size_t to = head.find("\r\n", from);
        while (from < head.size() && head[from] == ' ') ++from;
        return head.substr(from, to == std::string::npos ? std::string::npos : to - from);
    }
    std::string describe() const { return error.empty() ? head : "error: " + error; }
};

inline Response failed(std::string why) {
    Response r;
    r.error = std::move(why);
    return r;
}

// One response off `fd`. `pending` holds what was read past the previous response (pipelining)
// and keeps what is read past this one. After HEAD no body follows, whatever Content-Length says.
inline Response readResponse(int fd, std::string& pending, bool head_request = false,
                             Millis timeout = Millis{10'000}) {
    Response r;
    const auto deadline = Clock::now() + timeout;
    const auto fill = [&] {
        char buf[16384];
        const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
        IoResult io = readSome(fd, buf, sizeof buf, std::max(left, Millis{0}));
        if (!io.ok()) {
            r.error = io.describe() + " after \"" + pending.substr(0, 200) + "\"";
            return false;
        }
        pending.append(buf, io.bytes);
        return true;
    };
    size_t end;
    while ((end = pending.find("\r\n\r\n")) == std::string::npos)
        if (!fill()) return r;
    r.head = pending.substr(0, end);
    pending.erase(0, end + 4);
    r.status = std::atoi(r.head.c_str() + r.head.find(' ') + 1);
    const std::string length = r.header("Content-Length");
    const size_t size = head_request || r.status < 200 || length.empty() ? 0 : std::stoul(length);
    while (pending.size() < size)
        if (!fill()) return r;
    r.body = pending.substr(0, size);
    pending.erase(0, size);
    return r;
}

// Sends `request` as is and reads one response.
inline Response exchange(int fd, const std::string& request, bool head_request = false) {
    IoResult w = writeAll(fd, request.data(), request.size(), Millis{10'000});
    if (!w.ok() && w.status != IoStatus::Reset) return failed("send: " + w.describe());
    std::string pending;
    return readResponse(fd, pending, head_request);
}

inline std::string post(const std::string& path, const std::string& body,
                        const std::string& extra_headers = "") {
    return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
           extra_headers + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

inline std::string get(const std::string& path, const std::string& method = "GET") {
    return method + " " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
}

// Whether the server closed `fd` (EOF or reset) within `timeout`.
// The default wait is short of request_timeout's default (5 s): a close it sees is the one the
// case is about, not the deadline's; 4 s is room for a loaded 2-core machine.
inline bool closedByServer(int fd, Millis timeout = Millis{4'000}) {
    IoResult r = waitForPeerClose(fd, timeout);
    return r.status == IoStatus::Eof || r.status == IoStatus::Reset;
}

inline Fd connectUnix(const std::string& path) {
    Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un to{};
    to.sun_family = AF_UNIX;
    std::strncpy(to.sun_path, path.c_str(), sizeof to.sun_path - 1);
    if (!fd || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&to), sizeof to) < 0) return Fd();
    return fd;
}

// Sends `bytes` one at a time, `interval` apart, and goes on waiting after the last until
// `give_up` has passed since `start`: the seconds from `start` to the server's close, or -1 if
// it never closed. Anything the server answers instead is kept in `answered`.
inline double trickleUntilClosed(int fd, const std::string& bytes, Millis interval,
                                 Clock::time_point start, double give_up, std::string& answered) {
    size_t sent = 0;
    while (secondsSince(start) < give_up) {
        if (sent < bytes.size()) {
            if (::send(fd, bytes.data() + sent, 1, MSG_NOSIGNAL) < 0) return secondsSince(start);
            ++sent;
        }
        pollfd p{fd, POLLIN | POLLRDHUP, 0};
        if (::poll(&p, 1, static_cast<int>(interval.count())) <= 0) continue;
        char buf[512];
        const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN)) return secondsSince(start);
        if (n > 0) answered.append(buf, static_cast<size_t>(n));
    }
    return -1;
}

// ---------------------------------------------------------------------------------------------
// The server under test, with handlers that record what they were given.

struct Seen {
    std::string route;
    std::string method, path, body, authorization;
};

class HttpServerTest : public ::testing::Test {
  protected:
    // A handler that records the request (the test thread reads it under the mutex) and
    // answers "<name>:<body>" as JSON-ish text.
    std::function<HttpReply(const HttpRequest&)> recorder(const std::string& name) {
        return [this, name](const HttpRequest& req) {
            std::lock_guard lock(mu_);
            seen_.push_back({name, std::string(req.method), std::string(req.path),
                             std::string(req.body), std::string(req.authorization)});
            return HttpReply{200, "application/json", name + ":" + std::string(req.body)};
        };
    }
    std::vector<Seen> seen() {
        std::lock_guard lock(mu_);
        return seen_;
    }

    void start(std::vector<HttpRoute> routes, HttpLimits limits = {},
               const std::string& listen = "127.0.0.1:0") {
        auto address = parseAddress(listen);
        ASSERT_TRUE(address) << address.error();
        auto started =
            HttpServer::start("test server", *address, limits, std::move(routes), stats_);
        ASSERT_TRUE(started) << started.error();
        server_ = std::move(*started);
    }

    Fd connect() {
        Connected c = connectTo("127.0.0.1", server_->address().port());
        EXPECT_TRUE(c.fd) << c.error;
        return std::move(c.fd);
    }
    // One request on a fresh connection.
    Response once(const std::string& request, bool head_request = false) {
        Fd fd = connect();
        if (!fd) return failed("no connection");
        return exchange(fd.get(), request, head_request);
    }

    uint64_t rejected(HttpReject why) const {
        return stats_.rejected[idx(why)].load(std::memory_order_relaxed);
    }

    std::mutex mu_;
    std::vector<Seen> seen_;
    HttpStats stats_;
    std::unique_ptr<HttpServer> server_;  // last: stopped before what its handlers touch
};

// An admin-API-like route: POST JSON, up to `max_body` bytes.
inline HttpRoute postRoute(const std::string& path, std::function<HttpReply(const HttpRequest&)> h,
                           uint64_t max_body) {
    return {.path = path, .handler = std::move(h), .methods = {"POST"}, .max_body = max_body};
}

}  // namespace zcrelay::test::http_server_test
