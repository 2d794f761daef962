// The control plane's HTTP server (proxy/http_server.hpp) in-process, with routes of the tests'
// own, over real loopback TCP and unix sockets: request bodies (exactly what was sent, up to
// max_body and not a byte more, within the connection's one deadline), per-route methods,
// prefix routes, the Authorization header, HEAD, pipelining, unix socket files (stale ones
// replaced, anything else refused, removed at shutdown), and the routes without a body
// (/metrics and the probes) refusing one as before. Every wait is bounded.
#include "http_server.hpp"

#include <gtest/gtest.h>
#include <poll.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "metrics_endpoint.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test {
namespace {

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

Response failed(std::string why) {
    Response r;
    r.error = std::move(why);
    return r;
}

// One response off `fd`. `pending` holds what was read past the previous response (pipelining)
// and keeps what is read past this one. After HEAD no body follows, whatever Content-Length says.
Response readResponse(int fd, std::string& pending, bool head_request = false,
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
Response exchange(int fd, const std::string& request, bool head_request = false) {
    IoResult w = writeAll(fd, request.data(), request.size(), Millis{10'000});
    if (!w.ok() && w.status != IoStatus::Reset) return failed("send: " + w.describe());
    std::string pending;
    return readResponse(fd, pending, head_request);
}

std::string post(const std::string& path, const std::string& body,
                 const std::string& extra_headers = "") {
    return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
           extra_headers + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

std::string get(const std::string& path, const std::string& method = "GET") {
    return method + " " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
}

// Whether the server closed `fd` (EOF or reset) within `timeout`.
// The default wait is short of request_timeout's default (5 s): a close it sees is the one the
// case is about, not the deadline's; 4 s is room for a loaded 2-core machine.
bool closedByServer(int fd, Millis timeout = Millis{4'000}) {
    IoResult r = waitForPeerClose(fd, timeout);
    return r.status == IoStatus::Eof || r.status == IoStatus::Reset;
}

Fd connectUnix(const std::string& path) {
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
double trickleUntilClosed(int fd, const std::string& bytes, Millis interval,
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
HttpRoute postRoute(const std::string& path, std::function<HttpReply(const HttpRequest&)> h,
                    uint64_t max_body) {
    return {.path = path, .handler = std::move(h), .methods = {"POST"}, .max_body = max_body};
}

// ---------------------------------------------------------------------------------------------
// Bodies.

// The handler gets the body byte for byte (including what looks like HTTP), the method, and the
// path as sent without its query string; the connection stays open for the next request.
TEST_F(HttpServerTest, APostedJsonBodyReachesTheHandlerExactly) {
    ASSERT_NO_FATAL_FAILURE(start({postRoute("/v1/config", recorder("config"), 4096)}));
    const std::string body =
        "{\"name\":\"web\",\"weight\":3,\"note\":\"a\\r\\n\r\n\r\nGET /x HTTP/1.1\r\n\","
        "\"utf8\":\"\xc3\xa9\xe2\x9c\x93\",\"nul\":\"" +
        std::string(1, '\0') + "\"}";
    Fd fd = connect();
    ASSERT_TRUE(fd);
    Response r = exchange(fd.get(), post("/v1/config?dry_run=1", body));
    ASSERT_EQ(r.status, 200) << r.describe();
    EXPECT_EQ(r.header("Content-Type"), "application/json");
    EXPECT_EQ(r.body, "config:" + body);
    std::vector<Seen> s = seen();
    ASSERT_EQ(s.size(), 1u);
    EXPECT_EQ(s[0].method, "POST");
    EXPECT_EQ(s[0].path, "/v1/config");
    EXPECT_EQ(s[0].body, body);
    EXPECT_EQ(s[0].authorization, "");
    // Kept alive: a POST without a body (Content-Length: 0) on the same connection.
    r = exchange(fd.get(), post("/v1/config", ""));
    EXPECT_EQ(r.status, 200) << r.describe();
    EXPECT_EQ(r.body, "config:");
    EXPECT_EQ(stats_.requests.load(), 2u);
}

// A body of exactly max_body is taken, also when it is far larger than libmicrohttpd's read
// buffer (it arrives in many pieces) and when the client waits for 100 Continue first.
TEST_F(HttpServerTest, ABodyOfExactlyMaxBodyIsTaken) {
    constexpr uint64_t kMax = 64 * 1024;
    ASSERT_NO_FATAL_FAILURE(start({postRoute("/v1/bulk", recorder("bulk"), kMax)}));
    std::string body(kMax, '\0');
    for (size_t i = 0; i < body.size(); ++i) body[i] = static_cast<char>(i * 7 + i / 256);

    Response r = once(post("/v1/bulk", body));
    ASSERT_EQ(r.status, 200) << r.describe();
    EXPECT_TRUE(r.body == "bulk:" + body) << "the echoed body differs";

    // Expect: 100-continue: headers first, the body only after the interim answer.
    Fd fd = connect();
    ASSERT_TRUE(fd);
    const std::string full = post("/v1/bulk", body, "Expect: 100-continue\r\n");
    const std::string headers = full.substr(0, full.size() - body.size());
    ASSERT_TRUE(writeAll(fd.get(), headers.data(), headers.size()).ok());
    std::string pending;
    Response interim = readResponse(fd.get(), pending);
    EXPECT_EQ(interim.status, 100) << interim.describe();
    ASSERT_TRUE(writeAll(fd.get(), body.data(), body.size()).ok());
    r = readResponse(fd.get(), pending);
    ASSERT_EQ(r.status, 200) << r.describe();
    EXPECT_TRUE(r.body == "bulk:" + body) << "the echoed body differs";

    std::vector<Seen> s = seen();
    ASSERT_EQ(s.size(), 2u);
    EXPECT_TRUE(s[0].body == body && s[1].body == body);
    EXPECT_EQ(rejected(HttpReject::Body), 0u);
}

// One byte over max_body: 413 on the headers alone, before any of the body is read (the client
// here has not sent it), and the connection closed; the handler never runs. The same for a
// Content-Length of 2^63-1; a chunked body (no length to check first) gets 411.
TEST_F(HttpServerTest, ABodyOverMaxBodyIsRefusedBeforeItIsRead) {
    constexpr uint64_t kMax = 1024;
    ASSERT_NO_FATAL_FAILURE(start({postRoute("/v1/config", recorder("config"), kMax)}));

    Fd fd = connect();
    ASSERT_TRUE(fd);
    const std::string over(kMax + 1, 'x');
    const std::string request = post("/v1/config", over);
    const std::string headers = request.substr(0, request.size() - over.size());
    Response r = exchange(fd.get(), headers);
    EXPECT_EQ(r.status, 413) << r.describe();
    EXPECT_EQ(r.body, "the request body is larger than 1024 bytes\n");
    EXPECT_EQ(r.header("Connection"), "close");
    EXPECT_TRUE(closedByServer(fd.get())) << "a refused body closes the connection";

    // Headers and body in one write: the same.
    r = once(request);
    EXPECT_EQ(r.status, 413) << r.describe();

    const auto start = Clock::now();
    r = once("POST /v1/config HTTP/1.1\r\nHost: x\r\nContent-Length: 9223372036854775807\r\n\r\n{");
    EXPECT_EQ(r.status, 413) << r.describe();
    // At once: the other way is request_timeout (5 s) later; 4 s is room for a loaded machine.
    EXPECT_LT(secondsSince(start), 4.0);

    fd = connect();
    ASSERT_TRUE(fd);
    r = exchange(fd.get(),
                 "POST /v1/config HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 "2\r\n{}\r\n0\r\n\r\n");
    EXPECT_EQ(r.status, 411) << r.describe();
    EXPECT_TRUE(closedByServer(fd.get()));

    // A Content-Length that is not a number: libmicrohttpd's own 400, before the handler.
    r = once("POST /v1/config HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n{");
    EXPECT_EQ(r.status, 400) << r.describe();

    EXPECT_TRUE(seen().empty()) << "the handler ran for a refused body";
    EXPECT_EQ(rejected(HttpReject::Body), 4u);
    EXPECT_TRUE(waitUntil([&] { return rejected(HttpReject::BadRequest) == 1; }, Millis{10'000}));
    EXPECT_EQ(stats_.requests.load(), 0u);
}

// The body shares the headers' deadline: a client trickling it a byte every 100 ms is shut down
// at request_timeout after it connected (counted as a timeout), whether the headers came at once
// or were themselves trickled for most of it. Its handler never runs. request_timeout is 2 s so
// that a close at it and one a deadline of the body's own would bring (3.5 s) are told apart
// with a second to spare for a loaded machine.
TEST_F(HttpServerTest, ABodyTrickledPastTheDeadlineIsShutDown) {
    HttpLimits limits;
    limits.request_timeout = Millis{2'000};
    ASSERT_NO_FATAL_FAILURE(start({postRoute("/v1/config", recorder("config"), 4096)}, limits));
    const std::string body(200, 'b');

    // Headers at once, then the body a byte at a time.
    Fd fd = connect();
    ASSERT_TRUE(fd);
    auto start = Clock::now();
    const std::string request = post("/v1/config", body);
    const std::string headers = request.substr(0, request.size() - body.size());
    ASSERT_TRUE(writeAll(fd.get(), headers.data(), headers.size()).ok());
    std::string answered;
    // The trickle lasts 20 s: only the deadline ends it within the 10 s watched.
    double closed = trickleUntilClosed(fd.get(), body, Millis{100}, start, 10.0, answered);
    EXPECT_GT(closed, 1.8) << "closed before request_timeout";
    EXPECT_GT(closed, 0) << "still open after 10 s with request_timeout 2s";
    EXPECT_EQ(answered, "") << "a timed-out request gets no answer";

    // Headers trickled a line per 250 ms for 1.75 s, then the body: still closed at about 2 s
    // from the connect, not 2 s from the end of the headers (3.5 s).
    fd = connect();
    ASSERT_TRUE(fd);
    start = Clock::now();
    const char* lines[] = {"POST /v1/config HTTP/1.1\r\n",
                           "Host: x\r\n",
                           "Content-Type: application/json\r\n",
                           "X-One: 1\r\n",
                           "X-Two: 2\r\n",
                           "Content-Length: 200\r\n",
                           "\r\n"};
    for (const char* line : lines) {
        ASSERT_TRUE(writeAll(fd.get(), line, std::strlen(line)).ok());
        std::this_thread::sleep_for(Millis{250});  // the trickle's pace
    }
    closed = trickleUntilClosed(fd.get(), body, Millis{100}, start, 10.0, answered);
    EXPECT_GT(closed, 1.8);
    EXPECT_GT(closed, 0) << "still open after 10 s with request_timeout 2s";
    EXPECT_LT(closed, 3.2) << "the body got a deadline of its own after the headers";
    EXPECT_EQ(answered, "");

    EXPECT_TRUE(waitUntil([&] { return rejected(HttpReject::Timeout) == 2; }, Millis{10'000}))
        << rejected(HttpReject::Timeout);
    EXPECT_EQ(rejected(HttpReject::BadRequest), 0u) << "a shut-down request is a timeout only";
    EXPECT_TRUE(seen().empty());
    // And the server still answers.
    Response r = once(post("/v1/config", "{}"));
    EXPECT_EQ(r.status, 200) << r.describe();
}

// Pipelined requests on one keep-alive connection, all in one write: each body goes to its own
// request (none leaks into the next), and each gets its answer, in order.
TEST_F(HttpServerTest, PipelinedKeepAlivePostsEachGetTheirAnswer) {
    constexpr uint64_t kMax = 64;
    ASSERT_NO_FATAL_FAILURE(
        start({postRoute("/v1/echo", recorder("echo"), kMax), {"/healthz", recorder("healthz")}}));
    const std::vector<std::string> bodies = {"one", "{\"n\":2}", std::string(kMax, 'z'), ""};
    std::string all;
    for (const std::string& b : bodies) all += post("/v1/echo", b);
    all += get("/healthz");
    Fd fd = connect();
    ASSERT_TRUE(fd);
    ASSERT_TRUE(writeAll(fd.get(), all.data(), all.size()).ok());
    std::string pending;
    for (const std::string& b : bodies) {
        Response r = readResponse(fd.get(), pending);
        ASSERT_EQ(r.status, 200) << r.describe();
        EXPECT_EQ(r.body, "echo:" + b);
    }
    Response r = readResponse(fd.get(), pending);
    EXPECT_EQ(r.status, 200) << r.describe();
    EXPECT_EQ(r.body, "healthz:");
    EXPECT_EQ(pending, "");
    std::vector<Seen> s = seen();
    ASSERT_EQ(s.size(), bodies.size() + 1);
    for (size_t i = 0; i < bodies.size(); ++i) EXPECT_EQ(s[i].body, bodies[i]) << i;
    // Still open for more.
    r = exchange(fd.get(), post("/v1/echo", "again"));
    EXPECT_EQ(r.body, "echo:again") << r.describe();
}

// ---------------------------------------------------------------------------------------------
// Methods, paths, headers.

// A method the route does not list: 405 with Allow naming what it takes (HEAD too, when the
// route lists only POST and PUT). A path no route serves is 404 for a method some route takes,
// 405 for one none does.
TEST_F(HttpServerTest, AMethodTheRouteDoesNotTakeIs405WithAllow) {
    ASSERT_NO_FATAL_FAILURE(start({{.path = "/v1/backends",
                                    .handler = recorder("backends"),
                                    .methods = {"POST", "PUT"},
                                    .max_body = 1024},
                                   {"/healthz", recorder("healthz")}}));
    for (const char* method : {"GET", "DELETE", "post"}) {
        Response r = once(get("/v1/backends", method));
        EXPECT_EQ(r.status, 405) << method << ": " << r.describe();
        EXPECT_EQ(r.header("Allow"), "POST, PUT") << method;
        EXPECT_EQ(r.body, "only POST and PUT\n") << method;
    }
    Response head = once(get("/v1/backends", "HEAD"), true);
    EXPECT_EQ(head.status, 405) << head.describe();
    EXPECT_EQ(head.header("Allow"), "POST, PUT");

    Response put = once("PUT /v1/backends HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}");
    EXPECT_EQ(put.status, 200) << put.describe();
    EXPECT_EQ(put.body, "backends:{}");

    Response r = once(post("/healthz", ""));
    EXPECT_EQ(r.status, 405) << r.describe();
    EXPECT_EQ(r.header("Allow"), "GET, HEAD");
    r = once(post("/nope", ""));
    EXPECT_EQ(r.status, 404) << r.describe();
    r = once(get("/nope", "DELETE"));
    EXPECT_EQ(r.status, 405) << r.describe();
    EXPECT_EQ(r.header("Allow"), "POST, PUT, GET, HEAD");
    EXPECT_EQ(rejected(HttpReject::Method), 6u);
    EXPECT_EQ(rejected(HttpReject::NotFound), 1u);
}

// Exact routes before prefix routes, whatever their order in the list; among prefix routes the
// longest. The handler gets the path as sent: percent-escapes kept, no query string. 404 keeps
// the connection open.
TEST_F(HttpServerTest, ExactRoutesComeBeforeTheLongestPrefixRoute) {
    ASSERT_NO_FATAL_FAILURE(start({
        {.path = "/v1/", .handler = recorder("v1/*"), .prefix = true},
        {.path = "/v1/backends/", .handler = recorder("backends/*"), .prefix = true},
        {.path = "/v1/backends/special", .handler = recorder("special")},
        {.path = "/v1/backends", .handler = recorder("backends")},
    }));
    const struct {
        const char* sent;
        const char* route;  // "" for 404
        const char* path;
    } cases[] = {
        {"/v1/backends/special", "special", "/v1/backends/special"},
        {"/v1/backends/special/x", "backends/*", "/v1/backends/special/x"},
        {"/v1/backends/a%2Fb?x=1&y=%20", "backends/*", "/v1/backends/a%2Fb"},
        {"/v1/backends", "backends", "/v1/backends"},
        {"/v1/backend%73", "v1/*", "/v1/backend%73"},
        {"/v1/other", "v1/*", "/v1/other"},
        {"/v1", "", ""},
        {"/v2/backends/x", "", ""},
    };
    Fd fd = connect();
    ASSERT_TRUE(fd);
    size_t answered = 0;
    for (const auto& c : cases) {
        Response r = exchange(fd.get(), get(c.sent));
        if (*c.route == '\0') {
            EXPECT_EQ(r.status, 404) << c.sent << ": " << r.describe();
            continue;
        }
        ASSERT_EQ(r.status, 200) << c.sent << ": " << r.describe();
        EXPECT_EQ(r.body, std::string(c.route) + ":") << c.sent;
        std::vector<Seen> s = seen();
        ASSERT_EQ(s.size(), ++answered);
        EXPECT_EQ(s.back().path, c.path) << c.sent;
    }
}

// The Authorization header's value, byte for byte, whatever the case of its name; "" without.
TEST_F(HttpServerTest, TheAuthorizationHeaderIsPassedThrough) {
    ASSERT_NO_FATAL_FAILURE(start({postRoute("/v1/config", recorder("config"), 64)}));
    Fd fd = connect();
    ASSERT_TRUE(fd);
    EXPECT_EQ(
        exchange(fd.get(), post("/v1/config", "{}", "Authorization: Bearer s3cr3t.t0k-en_==\r\n"))
            .status,
        200);
    EXPECT_EQ(exchange(fd.get(), post("/v1/config", "{}", "authorization: Basic dTpw\r\n")).status,
              200);
    EXPECT_EQ(exchange(fd.get(), post("/v1/config", "{}")).status, 200);
    std::vector<Seen> s = seen();
    ASSERT_EQ(s.size(), 3u);
    EXPECT_EQ(s[0].authorization, "Bearer s3cr3t.t0k-en_==");
    EXPECT_EQ(s[1].authorization, "Basic dTpw");
    EXPECT_EQ(s[2].authorization, "");
}

// HEAD: the headers GET would get (Content-Length included), no body: pipelined behind it, the
// next response starts right after its blank line.
TEST_F(HttpServerTest, HeadGetsNoBody) {
    ASSERT_NO_FATAL_FAILURE(start(
        {{"/status", [](const HttpRequest&) { return HttpReply::text(200, "hello world\n"); }}}));
    Fd fd = connect();
    ASSERT_TRUE(fd);
    const std::string both = get("/status", "HEAD") + get("/status");
    ASSERT_TRUE(writeAll(fd.get(), both.data(), both.size()).ok());
    std::string pending;
    Response head = readResponse(fd.get(), pending, /*head_request=*/true);
    ASSERT_EQ(head.status, 200) << head.describe();
    EXPECT_EQ(head.header("Content-Length"), "12");
    Response getr = readResponse(fd.get(), pending);
    ASSERT_EQ(getr.status, 200) << getr.describe() << " (a HEAD body in front of it?)";
    EXPECT_EQ(getr.body, "hello world\n");
    EXPECT_EQ(pending, "");
}

// ---------------------------------------------------------------------------------------------
// What RFC 9112 says a server must refuse and libmicrohttpd 0.9.75 lets through: 400, the
// connection closed, the handler never run.

struct Malformed {
    const char* what;
    std::string request;
};

// Each on a fresh connection of the same server, which goes on answering well-formed requests.
std::vector<Malformed> malformedRequests() {
    using namespace std::string_literals;
    const std::string host = "Host: x\r\n";
    return {
        // RFC 9112 §6.3: where the body ends depends on which length a parser believes.
        {"two different Content-Lengths",
         "POST /v1/config HTTP/1.1\r\n" + host +
             "Content-Length: 12\r\nContent-Length: 5\r\n\r\n{\"weight\":1}"},
        {"two equal Content-Lengths", "POST /v1/config HTTP/1.1\r\n" + host +
                                          "Content-Length: 2\r\ncontent-length: 2\r\n\r\n{}"},
        {"Content-Length and Transfer-Encoding",
         "POST /v1/config HTTP/1.1\r\n" + host +
             "Content-Length: 7\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"},
        {"Transfer-Encoding and Content-Length on a route without bodies",
         "GET /healthz HTTP/1.1\r\n" + host +
             "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n"},
        // RFC 9112 §3.2 / RFC 9110 §5.5: no NUL or other CTL in the target, names or values.
        {"NUL in the target", "GET /healthz\0x HTTP/1.1\r\n"s + host + "\r\n"},
        {"NUL in the query", "GET /healthz?a\0b HTTP/1.1\r\n"s + host + "\r\n"},
        {"control byte in the target", "GET /health\x01z HTTP/1.1\r\n" + host + "\r\n"},
        {"space in the target", "GET /healthz x HTTP/1.1\r\n" + host + "\r\n"},
        {"NUL in the method", "GE\0T /healthz HTTP/1.1\r\n"s + host + "\r\n"},
        {"NUL in a header value after a token",
         "POST /v1/config HTTP/1.1\r\n"s + host +
             "Authorization: Bearer s3cr3t\0junk\r\nContent-Length: 2\r\n\r\n{}"s},
        {"NUL ending a header value", "GET /healthz HTTP/1.1\r\nX-Note: a\0\r\n"s + host + "\r\n"},
        {"NUL starting a header line (taken for the blank line)",
         "POST /v1/config HTTP/1.1\r\n"s + host + "\0junk\r\nContent-Length: 2\r\n\r\n{}"s},
        {"NUL in a header name", "GET /healthz HTTP/1.1\r\nX-A\0b: v\r\n"s + host + "\r\n"},
        {"control byte in a header name",
         "GET /healthz HTTP/1.1\r\nX-\x01-A: v\r\n" + host + "\r\n"},
        {"tab in a header name", "GET /healthz HTTP/1.1\r\nX-A\t: v\r\n" + host + "\r\n"},
        {"space before the colon", "GET /healthz HTTP/1.1\r\nX-A : v\r\n" + host + "\r\n"},
        {"control byte in a header value",
         "GET /healthz HTTP/1.1\r\nX-Note: a\x01z\r\n" + host + "\r\n"},
        {"DEL in a header value", "GET /healthz HTTP/1.1\r\nX-Note: a\x7fz\r\n" + host + "\r\n"},
        {"bare CR in a header value", "GET /healthz HTTP/1.1\r\nX-Note: a\rb\r\n" + host + "\r\n"},
        {"folded header line (obs-fold)",
         "GET /healthz HTTP/1.1\r\nX-Note: a\r\n b\r\n" + host + "\r\n"},
    };
}

TEST_F(HttpServerTest, MalformedFramingIsRefusedWith400AndClosed) {
    ASSERT_NO_FATAL_FAILURE(start(
        {postRoute("/v1/config", recorder("config"), 64), {"/healthz", recorder("healthz")}}));
    const std::vector<Malformed> cases = malformedRequests();
    for (const Malformed& m : cases) {
        SCOPED_TRACE(m.what);
        Fd fd = connect();
        ASSERT_TRUE(fd);
        Response r = exchange(fd.get(), m.request);
        EXPECT_EQ(r.status, 400) << r.describe();
        EXPECT_TRUE(closedByServer(fd.get())) << "left open after a malformed request";
    }
    EXPECT_TRUE(seen().empty()) << "a handler ran for a malformed request: " << seen()[0].path;
    EXPECT_EQ(stats_.requests.load(), 0u);
    // Counted once each (ours, or libmicrohttpd's own 400 for a NUL before a colon).
    EXPECT_TRUE(
        waitUntil([&] { return rejected(HttpReject::BadRequest) == cases.size(); }, Millis{10'000}))
        << rejected(HttpReject::BadRequest) << " of " << cases.size();
    EXPECT_EQ(rejected(HttpReject::Body), 0u);
}

// What is allowed stays allowed, on the server that refused all of the above: a tab inside a
// value (RFC 9110 §5.5), obs-text bytes, bare LF line ends (RFC 9112 §2.2), blanks around a
// value, a percent-escaped NUL in the query (escaped, it is not a NUL), one Content-Length, a
// NUL inside a body. Keep-alive holds across them.
TEST_F(HttpServerTest, WellFormedRequestsStillPassTheFramingChecks) {
    using namespace std::string_literals;
    ASSERT_NO_FATAL_FAILURE(start(
        {postRoute("/v1/config", recorder("config"), 64), {"/healthz", recorder("healthz")}}));
    {
        Fd fd = connect();
        ASSERT_TRUE(fd);
        EXPECT_EQ(exchange(fd.get(), malformedRequests()[0].request).status, 400);
    }
    Fd fd = connect();
    ASSERT_TRUE(fd);
    const std::vector<std::string> fine = {
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Note: a\tb\t\r\n\r\n",
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Note: caf\xc3\xa9\r\nCookie: a=1; b=2\r\n\r\n",
        "GET /healthz HTTP/1.1\nHost: x\nX-Note:  spaced  \n\n",
        "GET /healthz?a=%00&b HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        // Past libmicrohttpd's first read buffer: it grows the buffer, the block stays one.
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(6000, 'b') + "\r\n\r\n",
        "POST /v1/config HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0k \r\nContent-Length: 3\r\n\r\n{\0}"s,
        get("/healthz"),
    };
    for (const std::string& request : fine) {
        SCOPED_TRACE(request);
        Response r = exchange(fd.get(), request);
        EXPECT_EQ(r.status, 200) << r.describe();
    }
    std::vector<Seen> s = seen();
    ASSERT_EQ(s.size(), fine.size());
    EXPECT_EQ(s[6].authorization, "Bearer t0k") << "trailing blanks are not part of a value";
    EXPECT_EQ(s[6].body, "{\0}"s);
    EXPECT_EQ(rejected(HttpReject::BadRequest), 1u);
}

// ---------------------------------------------------------------------------------------------
// The routes without a body, as the metrics endpoint declares them: as before, any body 413
// (then closed), a method other than GET/HEAD 405, Content-Length: 0 fine.

TEST_F(HttpServerTest, RoutesWithoutMaxBodyStillRefuseAnyBody) {
    ASSERT_NO_FATAL_FAILURE(start({{"/healthz", recorder("healthz")}}));
    Fd fd = connect();
    ASSERT_TRUE(fd);
    Response r =
        exchange(fd.get(), "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
    EXPECT_EQ(r.status, 413) << r.describe();
    EXPECT_EQ(r.body, "no request body is accepted\n");
    EXPECT_TRUE(closedByServer(fd.get()));
    r = once("GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 9223372036854775807\r\n\r\nabc");
    EXPECT_EQ(r.status, 413) << r.describe();
    r = once("GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
    EXPECT_EQ(r.status, 413) << r.describe();
    r = once("GET /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n{");
    EXPECT_EQ(r.status, 413) << r.describe();
    r = once(post("/healthz", "{}"));
    EXPECT_EQ(r.status, 405) << r.describe();
    EXPECT_EQ(r.header("Allow"), "GET, HEAD");
    EXPECT_EQ(r.body, "only GET and HEAD\n");
    r = once(post("/nope", ""));
    EXPECT_EQ(r.status, 405) << r.describe();
    r = once("GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
    EXPECT_EQ(r.status, 200) << r.describe();
    EXPECT_EQ(seen().size(), 1u);
    EXPECT_EQ(rejected(HttpReject::Body), 4u);
    EXPECT_EQ(rejected(HttpReject::Method), 2u);
}

// The real metrics endpoint, in-process: its routes as before.
TEST(MetricsEndpointRoutes, StillGetAndHeadOnlyWithoutBodies) {
    MetricsConfig config;
    auto listen = parseAddress("127.0.0.1:0");
    ASSERT_TRUE(listen);
    config.listen = *listen;
    HttpStats stats;
    auto endpoint = MetricsEndpoint::start(
        config, std::make_shared<prometheus::Registry>(), [] { return std::string(); },
        [] { return std::string("draining"); }, stats);
    ASSERT_TRUE(endpoint) << endpoint.error();
    const uint16_t port = (*endpoint)->port();
    const auto ask = [&](const std::string& request, bool head = false) {
        Connected c = connectTo("127.0.0.1", port);
        return c.fd ? exchange(c.fd.get(), request, head) : failed(c.error);
    };
    Response r = ask(get("/metrics"));
    EXPECT_EQ(r.status, 200) << r.describe();
    EXPECT_EQ(r.header("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
    r = ask(get("/healthz", "HEAD"), true);
    EXPECT_EQ(r.status, 200) << r.describe();
    EXPECT_EQ(r.header("Content-Length"), "3");
    EXPECT_EQ(ask(get("/readyz")).status, 503);
    r = ask(post("/metrics", "{}"));
    EXPECT_EQ(r.status, 405) << r.describe();
    EXPECT_EQ(r.header("Allow"), "GET, HEAD");
    r = ask("GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}");
    EXPECT_EQ(r.status, 413) << r.describe();
    EXPECT_EQ(ask(get("/metrics/")).status, 404);
    EXPECT_EQ(stats.rejected[idx(HttpReject::Method)].load(), 1u);
    EXPECT_EQ(stats.rejected[idx(HttpReject::Body)].load(), 1u);
}

// ---------------------------------------------------------------------------------------------
// Unix sockets.

class UnixSocketTest : public HttpServerTest {
  protected:
    ~UnixSocketTest() override { server_.reset(); }  // before dir_ goes
    std::string socketPath() const { return dir_.file("admin.sock"); }
    std::string address() const { return "unix:" + socketPath(); }
    // Starts on the socket, expecting a refusal: the error.
    std::string refusal() {
        auto listen = parseAddress(address());
        EXPECT_TRUE(listen) << listen.error();
        auto started = HttpServer::start("test server", *listen, HttpLimits{},
                                         {{"/healthz", recorder("healthz")}}, stats_);
        EXPECT_FALSE(started) << "started over what is at " << socketPath();
        return started ? "" : started.error();
    }

    TempDir dir_;
};

// Requests over the socket, bodies included; the file is a socket of mode 0660, and gone once
// the server stops.
TEST_F(UnixSocketTest, ServesRequestsAndRemovesItsFileAtShutdown) {
    ASSERT_NO_FATAL_FAILURE(start(
        {postRoute("/v1/config", recorder("config"), 4096), {"/healthz", recorder("healthz")}},
        HttpLimits{}, address()));
    EXPECT_EQ(server_->address().toString(), address());
    struct stat st {};
    ASSERT_EQ(::lstat(socketPath().c_str(), &st), 0) << std::strerror(errno);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 07777, 0660u);

    Fd fd = connectUnix(socketPath());
    ASSERT_TRUE(fd) << std::strerror(errno);
    const std::string body = "{\"backend\":\"10.0.0.1:80\",\"weight\":5}";
    Response r = exchange(fd.get(), post("/v1/config", body, "Authorization: Bearer t\r\n"));
    ASSERT_EQ(r.status, 200) << r.describe();
    EXPECT_EQ(r.body, "config:" + body);
    r = exchange(fd.get(), get("/healthz", "HEAD"), true);
    EXPECT_EQ(r.status, 200) << r.describe();
    r = exchange(fd.get(), get("/healthz"));
    EXPECT_EQ(r.body, "healthz:") << r.describe();
    r = exchange(fd.get(), post("/v1/config", std::string(4097, 'x')));
    EXPECT_EQ(r.status, 413) << r.describe();
    std::vector<Seen> s = seen();
    ASSERT_EQ(s.size(), 3u);
    EXPECT_EQ(s[0].body, body);
    EXPECT_EQ(s[0].authorization, "Bearer t");

    server_.reset();
    EXPECT_NE(::lstat(socketPath().c_str(), &st), 0) << "the socket file outlived the server";
    EXPECT_EQ(errno, ENOENT);
}

// A socket file nobody listens on (a crashed relay's) is replaced.
TEST_F(UnixSocketTest, AStaleSocketFileIsReplaced) {
    {
        Fd old(::socket(AF_UNIX, SOCK_STREAM, 0));
        sockaddr_un at{};
        at.sun_family = AF_UNIX;
        std::strncpy(at.sun_path, socketPath().c_str(), sizeof at.sun_path - 1);
        ASSERT_EQ(::bind(old.get(), reinterpret_cast<sockaddr*>(&at), sizeof at), 0)
            << std::strerror(errno);
    }  // closed: the file stays, nothing listens
    ASSERT_NO_FATAL_FAILURE(start({{"/healthz", recorder("healthz")}}, HttpLimits{}, address()));
    Fd fd = connectUnix(socketPath());
    ASSERT_TRUE(fd) << std::strerror(errno);
    EXPECT_EQ(exchange(fd.get(), get("/healthz")).status, 200);
}

// Anything else at the path is refused by name and left as it was: a regular file, a
// directory, a symlink (even to a socket: never followed), a socket another server listens on.
TEST_F(UnixSocketTest, RefusesWhatIsNotAStaleSocket) {
    const std::string path = socketPath();
    dir_.writeFile("admin.sock", "precious\n");
    std::string error = refusal();
    EXPECT_NE(error.find(path), std::string::npos) << error;
    EXPECT_NE(error.find("a regular file"), std::string::npos) << error;
    EXPECT_EQ(readFileText(path), "precious\n") << "the file was touched";

    ASSERT_EQ(::unlink(path.c_str()), 0);
    ASSERT_EQ(::mkdir(path.c_str(), 0700), 0);
    error = refusal();
    EXPECT_NE(error.find("a directory"), std::string::npos) << error;
    ASSERT_EQ(::rmdir(path.c_str()), 0);

    const std::string stale = dir_.file("stale.sock");
    {
        Fd old(::socket(AF_UNIX, SOCK_STREAM, 0));
        sockaddr_un at{};
        at.sun_family = AF_UNIX;
        std::strncpy(at.sun_path, stale.c_str(), sizeof at.sun_path - 1);
        ASSERT_EQ(::bind(old.get(), reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
    }
    ASSERT_EQ(::symlink(stale.c_str(), path.c_str()), 0);
    error = refusal();
    EXPECT_NE(error.find("a symlink"), std::string::npos) << error;
    struct stat st {};
    EXPECT_EQ(::lstat(stale.c_str(), &st), 0) << "the symlink's target was removed";
    ASSERT_EQ(::unlink(path.c_str()), 0);

    // A live server's socket.
    Fd live(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un at{};
    at.sun_family = AF_UNIX;
    std::strncpy(at.sun_path, path.c_str(), sizeof at.sun_path - 1);
    ASSERT_EQ(::bind(live.get(), reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
    ASSERT_EQ(::listen(live.get(), 16), 0);
    error = refusal();
    EXPECT_NE(error.find("another server is listening"), std::string::npos) << error;
    Fd still = connectUnix(path);
    EXPECT_TRUE(still) << "the live server's socket was taken away";
}

// At shutdown the file is removed only if it is still the one the server bound: one put there
// meanwhile (another server's, or a file) stays.
TEST_F(UnixSocketTest, AReplacedFileIsNotRemovedAtShutdown) {
    ASSERT_NO_FATAL_FAILURE(start({{"/healthz", recorder("healthz")}}, HttpLimits{}, address()));
    ASSERT_EQ(::unlink(socketPath().c_str()), 0);
    dir_.writeFile("admin.sock", "someone else's\n");
    server_.reset();
    EXPECT_EQ(readFileText(socketPath()), "someone else's\n");
}

// The deadline and the eviction go by connection, not by client address (a unix client has
// none): over the socket, past max_connections the oldest idle one is closed at once, the rest
// at request_timeout, and a request still gets through.
TEST_F(UnixSocketTest, DeadlinesAndEvictionWorkWithoutClientAddresses) {
    // request_timeout 3 s: an eviction (at once) and a timeout are told apart with room for a
    // loaded 2-core machine.
    HttpLimits limits;
    limits.request_timeout = Millis{3'000};
    limits.max_connections = 2;
    ASSERT_NO_FATAL_FAILURE(start({{"/healthz", recorder("healthz")}}, limits, address()));
    const auto start = Clock::now();
    std::vector<Fd> idle;
    for (int i = 0; i < 3; ++i) {
        idle.push_back(connectUnix(socketPath()));
        ASSERT_TRUE(idle.back()) << std::strerror(errno);
        std::this_thread::sleep_for(Millis{50});  // accepted one by one, oldest first
    }
    EXPECT_TRUE(closedByServer(idle[0].get(), Millis{2'000})) << "the oldest was not evicted";
    EXPECT_LT(secondsSince(start), 2.5) << "evicted, not timed out";
    // Counted just after the shutdown() the client saw.
    EXPECT_TRUE(waitUntil([&] { return rejected(HttpReject::Evicted) == 1; }, Millis{10'000}));
    EXPECT_TRUE(closedByServer(idle[1].get(), Millis{10'000}));
    EXPECT_GT(secondsSince(start), 2.9) << "closed before request_timeout";
    EXPECT_TRUE(closedByServer(idle[2].get(), Millis{10'000}));
    EXPECT_TRUE(waitUntil([&] { return rejected(HttpReject::Timeout) == 2; }, Millis{10'000}))
        << rejected(HttpReject::Timeout);
    EXPECT_EQ(rejected(HttpReject::Evicted), 1u);
    Fd fd = connectUnix(socketPath());
    ASSERT_TRUE(fd);
    EXPECT_EQ(exchange(fd.get(), get("/healthz")).status, 200);
}

}  // namespace
}  // namespace zcrelay::test
