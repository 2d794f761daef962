// The HTTP health check's request and its verdict on replies, piece by piece, as a check reads
// them from the socket: a status is judged once its line is in, garbage at its first bytes,
// and nothing ever waits for more than kMaxReply bytes.
#include "http_check.hpp"

#include <gtest/gtest.h>

#include "unit/config_values.hpp"

namespace zcrelay {
namespace {

using Is = HttpVerdict::Is;

HttpCheckConfig http(std::string expect_status = "200-399", std::string body = "") {
    HttpCheckConfig h;
    h.enabled = true;
    h.expect_status = expect_status;
    h.expect_body = std::move(body);
    h.statuses.clear();
    // The tests give simple lists; the config's parser (config_test) covers the syntax.
    for (size_t at = 0; at < expect_status.size();) {
        size_t end = expect_status.find(',', at);
        if (end == std::string::npos) end = expect_status.size();
        const std::string item = expect_status.substr(at, end - at);
        const size_t dash = item.find('-');
        const auto lo = static_cast<uint16_t>(std::stoi(item.substr(0, dash)));
        const auto hi = dash == std::string::npos
                            ? lo
                            : static_cast<uint16_t>(std::stoi(item.substr(dash + 1)));
        h.statuses.emplace_back(lo, hi);
        at = end + 1;
    }
    return h;
}

TEST(HttpCheck, TheRequestNamesMethodPathAndHostAndClosesTheConnection) {
    HttpCheckConfig h = http();
    h.method = "OPTIONS";
    h.path = "/primary";
    EXPECT_EQ(httpCheckRequest(h, unit::addr("127.0.0.1:8008")),
              "OPTIONS /primary HTTP/1.1\r\nHost: 127.0.0.1:8008\r\nUser-Agent: zcrelay-check\r\n"
              "Accept: */*\r\nConnection: close\r\n\r\n");
    h.host = "db.example";
    EXPECT_NE(httpCheckRequest(h, unit::addr("127.0.0.1:8008")).find("\r\nHost: db.example\r\n"),
              std::string::npos);
}

TEST(HttpCheck, AStatusIsJudgedAsSoonAsItsLineIsIn) {
    const HttpCheckConfig h = http("200");
    EXPECT_EQ(judgeHttpReply(h, "", false).is, Is::More);
    EXPECT_EQ(judgeHttpReply(h, "HTTP/1.1 20", false).is, Is::More);
    EXPECT_EQ(judgeHttpReply(h, "HTTP/1.1 200 OK\r\n", false).is, Is::Pass);
    EXPECT_EQ(judgeHttpReply(h, "HTTP/1.0 200\r\n", false).is, Is::Pass);
    const HttpVerdict down = judgeHttpReply(h, "HTTP/1.1 503 Service Unavailable\r\n", false);
    EXPECT_EQ(down.is, Is::Fail);
    EXPECT_EQ(down.why, "status 503, expected 200");
}

TEST(HttpCheck, StatusListsAndRangesPass) {
    const HttpCheckConfig h = http("200,204-206");
    EXPECT_EQ(judgeHttpReply(h, "HTTP/1.1 204 No Content\r\n", false).is, Is::Pass);
    EXPECT_EQ(judgeHttpReply(h, "HTTP/1.1 206 Partial\r\n", false).is, Is::Pass);
    EXPECT_EQ(judgeHttpReply(h, "HTTP/1.1 201 Created\r\n", false).is, Is::Fail);
}

TEST(HttpCheck, GarbageFailsAtItsFirstBytes) {
    const HttpCheckConfig h = http();
    const HttpVerdict v = judgeHttpReply(h, "SSH-2.0-OpenSSH", false);
    EXPECT_EQ(v.is, Is::Fail);
    EXPECT_EQ(v.why, "not an HTTP reply: \"SSH-2.0-OpenSSH\"");
    EXPECT_EQ(judgeHttpReply(h, "H\x01", false).is, Is::Fail);
    EXPECT_EQ(judgeHttpReply(h, "HTTP/1.1 2x0 OK\r\n", false).why,
              "malformed status line: \"HTTP/1.1 2x0 OK.\"");
    EXPECT_EQ(judgeHttpReply(h, "HTTP/1.1 2000 OK\r\n", false).is, Is::Fail);
}

TEST(HttpCheck, AReplyThatEndsEarlyFails) {
    const HttpCheckConfig h = http();
    EXPECT_EQ(judgeHttpReply(h, "", true).why, "closed without a reply");
    EXPECT_EQ(judgeHttpReply(h, "HTTP/1.1 200", true).why, "no complete status line");
}

TEST(HttpCheck, TheBodyIsSearchedAfterTheHeadersWithinTheBound) {
    const HttpCheckConfig h = http("200", "\"role\": \"master\"");
    const std::string head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n";
    EXPECT_EQ(judgeHttpReply(h, head, false).is, Is::More);
    EXPECT_EQ(judgeHttpReply(h, head + "{\"state\": \"running\", \"role\": \"master\"}", false).is,
              Is::Pass);
    const HttpVerdict replica = judgeHttpReply(h, head + "{\"role\": \"replica\"}", true);
    EXPECT_EQ(replica.is, Is::Fail);
    EXPECT_EQ(replica.why, "the body has no \"\"role\": \"master\"\"");
    // In the headers is not in the body.
    EXPECT_EQ(judgeHttpReply(h, "HTTP/1.1 200 OK\r\nX: \"role\": \"master\"\r\n\r\n{}", true).is,
              Is::Fail);
    // 16 KiB of headers that never end: the check stops there.
    std::string endless = "HTTP/1.1 200 OK\r\n";
    endless.resize(HttpCheckConfig::kMaxReply, 'x');
    EXPECT_EQ(judgeHttpReply(h, endless, true).why, "the headers did not end within 16 KiB");
    std::string big = head;
    big.resize(HttpCheckConfig::kMaxReply, 'y');
    EXPECT_EQ(judgeHttpReply(h, big, true).why,
              "the body has no \"\"role\": \"master\"\" within the reply's first 16 KiB");
}

}  // namespace
}  // namespace zcrelay
