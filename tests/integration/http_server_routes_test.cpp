// The HTTP server's routes: a method a route does not take (405 with Allow), exact routes
// before the longest prefix, the Authorization header passed through, HEAD without a body; and
// the routes without a body, the metrics endpoint's among them, refusing one as before.
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <memory>
#include <string>
#include <vector>

#include "integration/http_server_fixture.hpp"
#include "metrics_endpoint.hpp"

namespace zcrelay::test::http_server_test {
namespace {

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

}  // namespace
}  // namespace zcrelay::test::http_server_test
