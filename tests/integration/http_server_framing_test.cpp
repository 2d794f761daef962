// Framing RFC 9112 has a server refuse and libmicrohttpd lets through (two lengths, a length
// with chunked, NUL and control bytes, a folded line): 400 and closed; well-formed requests
// still pass the checks.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "integration/http_server_fixture.hpp"

namespace zcrelay::test::http_server_test {
namespace {

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

}  // namespace
}  // namespace zcrelay::test::http_server_test
