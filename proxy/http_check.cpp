#include "http_check.hpp"

#include <algorithm>
#include <cctype>

namespace zcrelay {

std::string httpCheckRequest(const HttpCheckConfig& http, const SocketAddress& target) {
    std::string host = http.host;
    if (host.empty()) host = target.toString();
    return http.method + " " + http.path + " HTTP/1.1\r\nHost: " + host +
           "\r\nUser-Agent: zcrelay-check\r\nAccept: */*\r\nConnection: close\r\n\r\n";
}

namespace {

HttpVerdict fail(std::string why) { return {HttpVerdict::Is::Fail, std::move(why)}; }

// A reason quotes at most this much of what the peer sent.
std::string excerpt(std::string_view bytes) {
    std::string out;
    for (char c : bytes.substr(0, 32)) out += (c >= 0x20 && c < 0x7f) ? c : '.';
    return out;
}

}  // namespace

HttpVerdict judgeHttpReply(const HttpCheckConfig& http, std::string_view reply, bool ended) {
    constexpr std::string_view kVersion = "HTTP/1.";
    const HttpVerdict more{};
    // Garbage fails at its first bytes, not after 16 KiB or the timeout.
    const size_t prefix = std::min(reply.size(), kVersion.size());
    if (reply.substr(0, prefix) != kVersion.substr(0, prefix))
        return fail("not an HTTP reply: \"" + excerpt(reply) + "\"");
    const size_t eol = reply.find('\n');
    if (eol == std::string_view::npos) {
        if (!ended) return more;
        return fail(reply.empty() ? "closed without a reply" : "no complete status line");
    }
    // "HTTP/1.1 200 OK": the code is the three digits after the first space.
    const std::string_view line = reply.substr(0, eol);
    if (line.size() < 12 || line[8] != ' ' || !std::isdigit(static_cast<unsigned char>(line[9])) ||
        !std::isdigit(static_cast<unsigned char>(line[10])) ||
        !std::isdigit(static_cast<unsigned char>(line[11])) ||
        (line.size() > 12 && line[12] != ' ' && line[12] != '\r'))
        return fail("malformed status line: \"" + excerpt(line) + "\"");
    const unsigned code =
        static_cast<unsigned>((line[9] - '0') * 100 + (line[10] - '0') * 10 + (line[11] - '0'));
    if (!http.statusPasses(code))
        return fail("status " + std::to_string(code) + ", expected " + http.expect_status);
    if (http.expect_body.empty()) return {HttpVerdict::Is::Pass, {}};
    const size_t end = reply.find("\r\n\r\n");
    if (end == std::string_view::npos) {
        if (!ended) return more;
        return fail("the headers did not end within " +
                    std::to_string(HttpCheckConfig::kMaxReply / 1024) + " KiB");
    }
    if (reply.substr(end + 4).find(http.expect_body) != std::string_view::npos)
        return {HttpVerdict::Is::Pass, {}};
    if (!ended) return more;
    return fail("the body has no \"" + excerpt(http.expect_body) + "\"" +
                (reply.size() >= HttpCheckConfig::kMaxReply
                     ? " within the reply's first " +
                           std::to_string(HttpCheckConfig::kMaxReply / 1024) + " KiB"
                     : ""));
}

}  // namespace zcrelay
