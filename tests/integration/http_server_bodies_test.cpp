// Request bodies through the HTTP server: exactly what was sent reaches the handler, up to
// max_body and not a byte more (refused before it is read), within the connection's one
// deadline; pipelined keep-alive POSTs each get their answer.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <string>
#include <thread>
#include <vector>

#include "integration/http_server_fixture.hpp"

namespace zcrelay::test::http_server_test {
namespace {

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

}  // namespace
}  // namespace zcrelay::test::http_server_test
