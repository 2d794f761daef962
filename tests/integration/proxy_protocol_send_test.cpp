// send_proxy v1/v2 in every hand-off mode: the backend reads exactly the header, built here
// from the client socket's own names, then the client's bytes; a backend's setting overrides
// its cluster's; and the same headers as HAProxy's send-proxy / send-proxy-v2 write them.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "integration/proxy_protocol_fixture.hpp"
#include "support/haproxy.hpp"

namespace zcrelay::test::proxy_protocol_test {
namespace {

// =============================================================================================
// 1. send_proxy v1 / v2: exact header bytes, then 1 MiB byte-exact, every mode, IPv4 and IPv6.

struct SendCase {
    std::string mode;
    int family;
    std::string version;  // "v1" | "v2"
};

void PrintTo(const SendCase& c, std::ostream* os) {
    *os << c.mode << "/" << familyName(c.family) << "/" << c.version;
}

std::vector<SendCase> sendCases(const std::vector<std::string>& modes) {
    std::vector<SendCase> cases;
    for (const auto& m : modes)
        for (int f : {AF_INET, AF_INET6})
            for (const char* v : {"v1", "v2"}) cases.push_back({m, f, v});
    return cases;
}

std::string sendCaseName(const ::testing::TestParamInfo<SendCase>& info) {
    return info.param.mode + "_" + familyName(info.param.family) + "_" + info.param.version;
}

class SendProxyTest : public ProxyFixture, public ::testing::TestWithParam<SendCase> {};

TEST_P(SendProxyTest, BackendReadsExactHeaderThenPayload) {
    const SendCase& c = GetParam();
    Capture cap;
    ScriptedUpstream up(c.family, cap.script());
    ASSERT_TRUE(up.ok()) << up.error();
    ASSERT_NO_FATAL_FAILURE(startRelay(
        clusterConfig(c.mode, c.family, clusterYaml(c.version, {up.hostPort()})), c.mode));

    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    std::optional<Endpoint> src = socketEndpoint(client.fd.get(), false);
    std::optional<Endpoint> dst = socketEndpoint(client.fd.get(), true);
    ASSERT_TRUE(src && dst);
    ASSERT_EQ(src->family, c.family);
    std::string header = c.version == "v1" ? v1Header(*src, *dst) : v2Header(*src, *dst);

    ASSERT_NO_FATAL_FAILURE(sendThenFinish(client.fd.get(), "", kMiB));
    std::optional<std::string> got = cap.wait(up, 0);
    ASSERT_TRUE(got);
    expectHeaderThenPayload(*got, header, kMiB);
    client.fd.reset();
    expectDone(kMiB);
}

INSTANTIATE_TEST_SUITE_P(Modes, SendProxyTest, ::testing::ValuesIn(sendCases(kHandOffModes)),
                         sendCaseName);

// A backend's own send_proxy wins over the cluster's: cluster v2, backend a says v1, backend b
// says off, backend c inherits v2. Round robin gives each one of three connections.
class SendProxyOverrideTest : public ProxyFixture, public ::testing::TestWithParam<std::string> {};

TEST_P(SendProxyOverrideTest, BackendSettingOverridesCluster) {
    const std::string& mode = GetParam();
    Capture cap_a, cap_b, cap_c;
    ScriptedUpstream a(AF_INET, cap_a.script()), b(AF_INET, cap_b.script()),
        c(AF_INET, cap_c.script());
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    std::string yaml =
        clusterYaml("v2", {a.hostPort(), b.hostPort(), c.hostPort()}, {"v1", "off", ""});
    RelayConfig config = clusterConfig(mode, AF_INET, yaml);
    config.workers = 1;  // one balancer: round robin over three backends is then exact
    ASSERT_NO_FATAL_FAILURE(startRelay(config, mode));

    ScriptedUpstream* backends[] = {&a, &b, &c};
    std::map<ScriptedUpstream*, std::string> expected;  // backend -> the header it must read
    for (int i = 0; i < 3; ++i) {
        // Counted before the client connects: the relay may reach its backend at once.
        size_t before[3] = {a.accepted(), b.accepted(), c.accepted()};
        Connected client = connectClient();
        ASSERT_TRUE(client.fd) << client.error;
        std::optional<Endpoint> src = socketEndpoint(client.fd.get(), false);
        std::optional<Endpoint> dst = socketEndpoint(client.fd.get(), true);
        ASSERT_TRUE(src && dst);
        ASSERT_NO_FATAL_FAILURE(sendThenFinish(client.fd.get(), "", 64 * kKiB));
        // The relay has connected, but a backend's accept thread may not have counted it yet.
        ScriptedUpstream* which = nullptr;
        waitUntil(
            [&] {
                for (int k = 0; k < 3; ++k)
                    if (backends[k]->accepted() == before[k] + 1) which = backends[k];
                return which != nullptr;
            },
            Millis{5'000});
        ASSERT_NE(which, nullptr) << "connection " << i << " reached no backend";
        expected[which] = which == &a   ? v1Header(*src, *dst)
                          : which == &b ? std::string()
                                        : v2Header(*src, *dst);
    }
    ASSERT_EQ(a.accepted(), 1u) << "round robin over three backends, three connections";
    ASSERT_EQ(b.accepted(), 1u);
    ASSERT_EQ(c.accepted(), 1u);
    std::optional<std::string> got_a = cap_a.wait(a, 0), got_b = cap_b.wait(b, 0),
                               got_c = cap_c.wait(c, 0);
    ASSERT_TRUE(got_a && got_b && got_c);
    {
        SCOPED_TRACE("backend a: send_proxy v1 overrides the cluster's v2");
        expectHeaderThenPayload(*got_a, expected[&a], 64 * kKiB);
    }
    {
        SCOPED_TRACE("backend b: send_proxy off overrides the cluster's v2");
        expectHeaderThenPayload(*got_b, expected[&b], 64 * kKiB);
    }
    {
        SCOPED_TRACE("backend c: inherits the cluster's v2");
        expectHeaderThenPayload(*got_c, expected[&c], 64 * kKiB);
    }
}

// Which header a backend gets is decided before the data path: splice only.
INSTANTIATE_TEST_SUITE_P(Modes, SendProxyOverrideTest, ::testing::ValuesIn(kSpliceOnly),
                         [](const auto& info) { return info.param; });

// =============================================================================================
// 2. Cross-check with HAProxy: the same backend settings must produce the same header.

// haproxy with one tcp frontend on a loopback port and one server (tests/support/haproxy.hpp).
class Haproxy {
  public:
    explicit Haproxy(std::string binary) : process_(std::move(binary)) {}

    ::testing::AssertionResult start(int family, const std::string& server_line) {
        return process_.start(family, [&](const std::string& bind) {
            return haproxyTcpPreamble() +
                   "frontend fe\n"
                   "    bind " +
                   bind +
                   "\n"
                   "    default_backend be\n"
                   "backend be\n"
                   "    " +
                   server_line + "\n";
        });
    }
    void stop() { process_.stop(); }
    uint16_t port() const { return process_.port(); }

  private:
    HaproxyProcess process_;
};

// Where a header names the ports: [src_port, dst_port] as byte offsets (v2) or token indexes (v1).
struct PortFields {
    std::string header;  // the header alone
    uint16_t src_port = 0, dst_port = 0;
};

// Splits off the header at the start of `got` (v1: through CRLF; v2: 16 + its length) and
// reads its ports; nullopt if `got` does not start with one.
std::optional<PortFields> headerPorts(const std::string& got, const std::string& version) {
    PortFields p;
    if (version == "v1") {
        size_t end = got.find("\r\n");
        if (end == std::string::npos || end > 107) return std::nullopt;
        p.header = got.substr(0, end + 2);
        std::istringstream words(got.substr(0, end));
        std::vector<std::string> w;
        for (std::string s; w.size() < 8 && words >> s;) w.push_back(s);
        if (w.size() != 6) return std::nullopt;
        p.src_port = static_cast<uint16_t>(std::stoul(w[4]));
        p.dst_port = static_cast<uint16_t>(std::stoul(w[5]));
        return p;
    }
    if (got.size() < 16 || got.compare(0, 12, kV2Signature) != 0) return std::nullopt;
    size_t len = 16 + (static_cast<uint8_t>(got[14]) << 8 | static_cast<uint8_t>(got[15]));
    if (got.size() < len) return std::nullopt;
    p.header = got.substr(0, len);
    size_t alen = got[13] == 0x11 ? 4 : got[13] == 0x21 ? 16 : 0;
    if (alen == 0 || len < 16 + 2 * alen + 4) return std::nullopt;
    auto be16 = [&](size_t at) {
        return static_cast<uint16_t>(static_cast<uint8_t>(got[at]) << 8 |
                                     static_cast<uint8_t>(got[at + 1]));
    };
    p.src_port = be16(16 + 2 * alen);
    p.dst_port = be16(16 + 2 * alen + 2);
    return p;
}

// `h` with its ports replaced: the form two headers of different connections are compared in.
std::string withPorts(const std::string& h, const std::string& version, uint16_t src,
                      uint16_t dst) {
    if (version == "v1") {
        size_t third = 0;
        for (int i = 0; i < 4; ++i) third = h.find(' ', third) + 1;  // after the 4th space
        return h.substr(0, third) + std::to_string(src) + " " + std::to_string(dst) + "\r\n";
    }
    std::string out = h;
    size_t alen = h[13] == 0x11 ? 4 : 16;
    out[16 + 2 * alen] = static_cast<char>(src >> 8);
    out[16 + 2 * alen + 1] = static_cast<char>(src & 0xff);
    out[16 + 2 * alen + 2] = static_cast<char>(dst >> 8);
    out[16 + 2 * alen + 3] = static_cast<char>(dst & 0xff);
    return out;
}

class HaproxyCrossCheckTest : public ProxyFixture, public ::testing::TestWithParam<SendCase> {};

TEST_P(HaproxyCrossCheckTest, HeaderMatchesHaproxySendProxy) {
    const SendCase& c = GetParam();
    std::optional<std::string> binary = findExecutable("haproxy");
    if (!binary) GTEST_SKIP() << "haproxy is not installed (Debian package haproxy)";
    constexpr uint64_t kBytes = 64 * kKiB;

    // HAProxy first, to its own capture backend.
    Capture hcap;
    ScriptedUpstream hup(AF_INET, hcap.script());
    ASSERT_TRUE(hup.ok()) << hup.error();
    Haproxy haproxy(*binary);
    ASSERT_TRUE(haproxy.start(
        c.family,
        "server s1 " + hup.hostPort() + (c.version == "v1" ? " send-proxy" : " send-proxy-v2")));
    Connected hclient = connectTo(loopbackHost(c.family), haproxy.port());
    ASSERT_TRUE(hclient.fd) << hclient.error;
    std::optional<Endpoint> hsrc = socketEndpoint(hclient.fd.get(), false);
    std::optional<Endpoint> hdst = socketEndpoint(hclient.fd.get(), true);
    ASSERT_TRUE(hsrc && hdst);
    ASSERT_NO_FATAL_FAILURE(sendThenFinish(hclient.fd.get(), "", kBytes));
    std::optional<std::string> hgot = hcap.wait(hup, 0);
    ASSERT_TRUE(hgot);
    haproxy.stop();

    // zcrelay with the same settings.
    Capture zcap;
    ScriptedUpstream zup(AF_INET, zcap.script());
    ASSERT_TRUE(zup.ok()) << zup.error();
    ASSERT_NO_FATAL_FAILURE(startRelay(
        clusterConfig(c.mode, c.family, clusterYaml(c.version, {zup.hostPort()})), c.mode));
    Connected zclient = connectClient();
    ASSERT_TRUE(zclient.fd) << zclient.error;
    std::optional<Endpoint> zsrc = socketEndpoint(zclient.fd.get(), false);
    ASSERT_TRUE(zsrc);
    ASSERT_NO_FATAL_FAILURE(sendThenFinish(zclient.fd.get(), "", kBytes));
    std::optional<std::string> zgot = zcap.wait(zup, 0);
    ASSERT_TRUE(zgot);

    std::optional<PortFields> h = headerPorts(*hgot, c.version);
    std::optional<PortFields> z = headerPorts(*zgot, c.version);
    ASSERT_TRUE(h) << "haproxy's backend did not start with a " << c.version
                   << " header: " << hex(*hgot, 120);
    ASSERT_TRUE(z) << "zcrelay's backend did not start with a " << c.version
                   << " header: " << hex(*zgot, 120);
    // Each header names its own client's port, and its own frontend's port as the destination
    // (the two frontends cannot share a port): everything else must be the same bytes.
    EXPECT_EQ(h->src_port, hsrc->port) << "haproxy: source port = its client's port";
    EXPECT_EQ(z->src_port, zsrc->port) << "zcrelay: source port = its client's port";
    EXPECT_EQ(h->dst_port, haproxy.port()) << "haproxy: destination port = its frontend";
    EXPECT_EQ(z->dst_port, relay_.port()) << "zcrelay: destination port = its listener";
    EXPECT_EQ(hex(withPorts(h->header, c.version, z->src_port, z->dst_port)), hex(z->header))
        << "zcrelay's header must equal HAProxy's (" << c.version << ") except for the ports";
    // And the reference itself reads as the spec says (the hand-built header of section 1).
    EXPECT_EQ(hex(h->header),
              hex(c.version == "v1" ? v1Header(*hsrc, *hdst) : v2Header(*hsrc, *hdst)))
        << "haproxy's header is not the one built here from its client's addresses";
    expectHeaderThenPayload(*hgot, h->header, kBytes);
    expectHeaderThenPayload(*zgot, z->header, kBytes);
}

// The header's bytes against HAProxy's: written before the data path starts, splice only.
INSTANTIATE_TEST_SUITE_P(Modes, HaproxyCrossCheckTest, ::testing::ValuesIn(sendCases(kSpliceOnly)),
                         sendCaseName);

}  // namespace
}  // namespace zcrelay::test::proxy_protocol_test
