// The PROXY protocol end to end, through the real binary on loopback, over every data path:
//   - send_proxy v1/v2: the backend reads exactly the header (built here by hand from the client
//     socket's own names, never by the relay's writer) and then the client's bytes, byte-exact;
//   - the same headers cross-checked against HAProxy's send-proxy / send-proxy-v2;
//   - accept_proxy: the header is consumed (split into 1-byte writes too), its source becomes the
//     client, a v2 LOCAL header keeps the real peer; malformed, slow and truncated headers close
//     the client with the right reason and never reach a backend.
// The oracle is what the backend captures and the relay's counters, waited on with deadlines.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/bytes.hpp"
#include "support/haproxy.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::proxy_protocol_test {
namespace {

constexpr uint64_t kSeed = 0x50C0FFEE;
constexpr Millis kIo{30'000};
// "promptly": the relay's tick is at most 250 ms; the rest is room for a loaded 2-core machine,
// and still below the default proxy_timeout (5 s), the slow close "promptly" is told apart from.
constexpr Millis kPrompt{4'000};
constexpr size_t kCaptureLimit = 4 * kMiB;

// The data paths a suite runs in. The PROXY header is read, or written, before any data path
// starts, so a suite whose subject ends there runs in splice only. A suite that also checks the
// bytes after the header runs in splice and sockmap: in sockmap mode the relay sends on what
// followed the header itself before the sockets enter the map (Connections::startRelaying);
// splice and copy both just start their pumps on the client's socket.
const std::vector<std::string> kSpliceOnly = {"splice"};
const std::vector<std::string> kHandOffModes = {"splice", "sockmap"};

// ---------------------------------------------------------------------------------------------
// Addresses and headers, written out by hand from proxy-protocol.txt.

struct Endpoint {
    int family = AF_INET;
    std::array<uint8_t, 16> addr{};  // network order; the first 4 bytes for AF_INET
    uint16_t port = 0;

    size_t addrLen() const { return family == AF_INET ? 4 : 16; }
    std::string text() const {
        char buf[INET6_ADDRSTRLEN] = {};
        ::inet_ntop(family, addr.data(), buf, sizeof buf);
        return buf;
    }
};

Endpoint endpoint(const std::string& ip, uint16_t port) {
    Endpoint e;
    e.family = ip.find(':') == std::string::npos ? AF_INET : AF_INET6;
    EXPECT_EQ(::inet_pton(e.family, ip.c_str(), e.addr.data()), 1) << ip;
    e.port = port;
    return e;
}

// getsockname (peer = false) or getpeername of a connected socket.
std::optional<Endpoint> socketEndpoint(int fd, bool peer) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    auto* sa = reinterpret_cast<sockaddr*>(&ss);
    if ((peer ? ::getpeername(fd, sa, &len) : ::getsockname(fd, sa, &len)) != 0)
        return std::nullopt;
    Endpoint e;
    e.family = ss.ss_family;
    if (ss.ss_family == AF_INET) {
        auto* in = reinterpret_cast<sockaddr_in*>(&ss);
        std::memcpy(e.addr.data(), &in->sin_addr, 4);
        e.port = ntohs(in->sin_port);
    } else if (ss.ss_family == AF_INET6) {
        auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
        std::memcpy(e.addr.data(), &in6->sin6_addr, 16);
        e.port = ntohs(in6->sin6_port);
    } else {
        return std::nullopt;
    }
    return e;
}

std::string v1Header(const Endpoint& src, const Endpoint& dst) {
    return std::string("PROXY ") + (src.family == AF_INET ? "TCP4 " : "TCP6 ") + src.text() + " " +
           dst.text() + " " + std::to_string(src.port) + " " + std::to_string(dst.port) + "\r\n";
}

const std::string kV2Signature("\r\n\r\n\0\r\nQUIT\n", 12);

// The 16-byte fixed part: signature, version 2 | command, family | protocol, block length.
std::string v2Fixed(uint8_t version_command, uint8_t family_protocol, uint16_t length) {
    std::string h = kV2Signature;
    h.push_back(static_cast<char>(version_command));
    h.push_back(static_cast<char>(family_protocol));
    putBe16(h, length);
    return h;
}

// A v2 PROXY header over TCP (INET 0x11 or INET6 0x21), `tlvs` appended to the address block.
std::string v2Header(const Endpoint& src, const Endpoint& dst, const std::string& tlvs = "") {
    size_t alen = src.addrLen();
    std::string h = v2Fixed(0x21, src.family == AF_INET ? 0x11 : 0x21,
                            static_cast<uint16_t>(2 * alen + 4 + tlvs.size()));
    h.append(reinterpret_cast<const char*>(src.addr.data()), alen);
    h.append(reinterpret_cast<const char*>(dst.addr.data()), alen);
    putBe16(h, src.port);
    putBe16(h, dst.port);
    return h + tlvs;
}

std::string tlv(uint8_t type, const std::string& value) {
    std::string t(1, static_cast<char>(type));
    putBe16(t, static_cast<uint16_t>(value.size()));
    return t + value;
}

// ---------------------------------------------------------------------------------------------
// A capture backend: each connection's bytes, kept whole (header and payload), by accept index.

class Capture {
  public:
    ConnScript script() {
        return [state = state_](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                ScriptedUpstream&) {
            std::string got;
            rec.read_end = readUntilEof(fd.get(), got, kIo, kCaptureLimit, &stop);
            rec.bytes_received = rec.read_end.bytes;
            ::shutdown(fd.get(), SHUT_WR);
            std::lock_guard lock(state->mu);
            state->by_index[rec.index] = std::move(got);
        };
    }
    // The bytes of connection `index` once it ended, or nullopt (an ADD_FAILURE says why).
    std::optional<std::string> wait(ScriptedUpstream& up, size_t index) {
        std::optional<ConnRecord> rec = up.waitForRecord(index, kIo);
        if (!rec) {
            ADD_FAILURE() << "backend connection " << index << " never ended";
            return std::nullopt;
        }
        EXPECT_EQ(rec->read_end.status, IoStatus::Eof) << rec->describe();
        std::lock_guard lock(state_->mu);
        return state_->by_index[index];
    }

  private:
    struct State {
        std::mutex mu;
        std::map<size_t, std::string> by_index;
    };
    std::shared_ptr<State> state_ = std::make_shared<State>();
};

// `got` must be `header` and then exactly `payload_bytes` of payload kSeed.
void expectHeaderThenPayload(const std::string& got, const std::string& header,
                             uint64_t payload_bytes) {
    ASSERT_GE(got.size(), header.size()) << "backend got " << hex(got);
    EXPECT_EQ(hex(got.substr(0, header.size())), hex(header))
        << "the backend's first bytes must be exactly this PROXY header";
    EXPECT_EQ(got.size() - header.size(), payload_bytes)
        << "after the header, exactly the client's payload";
    PayloadVerifier verify(kSeed);
    verify.update(
        {reinterpret_cast<const uint8_t*>(got.data()) + header.size(), got.size() - header.size()});
    EXPECT_TRUE(verify.intact()) << "payload corrupted at offset " << verify.firstMismatch()
                                 << "; backend's first bytes " << hex(got, 64);
}

// Writes `prefix`, then `payload_bytes` of payload kSeed, half-closes, and reads the relay's EOF
// (the capture backend sends nothing back).
void sendThenFinish(int fd, const std::string& prefix, uint64_t payload_bytes) {
    if (!prefix.empty()) {
        IoResult w = writeAll(fd, prefix.data(), prefix.size(), kIo);
        ASSERT_TRUE(w.ok()) << "client header: " << w.describe();
    }
    IoResult sent = sendPayload(fd, kSeed, payload_bytes, kIo);
    ASSERT_TRUE(sent.ok()) << "client payload: " << sent.describe();
    ::shutdown(fd, SHUT_WR);
    std::string reply;
    IoResult end = readUntilEof(fd, reply, kIo);
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
    EXPECT_TRUE(reply.empty()) << "the backend sends nothing back";
}

// ---------------------------------------------------------------------------------------------
// Relay configs: listener "t" routing to cluster "app".

std::string clusterYaml(const std::string& send_proxy, const std::vector<std::string>& backends,
                        const std::vector<std::string>& backend_send_proxy = {}) {
    std::string y = "clusters:\n  - name: app\n    send_proxy: " + send_proxy + "\n";
    y += "    balance: round_robin\n    backends:\n";
    for (size_t i = 0; i < backends.size(); ++i) {
        y += "      - address: \"" + backends[i] + "\"\n";
        if (i < backend_send_proxy.size() && !backend_send_proxy[i].empty())
            y += "        send_proxy: " + backend_send_proxy[i] + "\n";
    }
    return y;
}

RelayConfig clusterConfig(const std::string& mode, int family, const std::string& cluster_yaml,
                          const std::string& listener_yaml = "") {
    RelayConfig c;
    c.extra_yaml = cluster_yaml;
    ListenerSpec l;
    l.listen = family == AF_INET6 ? "[::1]:0" : "127.0.0.1:0";
    l.cluster = "app";
    l.mode = mode;
    l.extra_yaml = listener_yaml;
    c.listeners.push_back(l);
    return c;
}

const std::string kAcceptProxy = "    accept_proxy: true\n";

class ProxyFixture {
  protected:
    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void startRelay(const RelayConfig& config, const std::string& mode) {
        ASSERT_TRUE(relay_.start(config));
        EXPECT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath(mode)), 1.0)
            << "listener t should run the " << mode << " data path";
    }
    Connected connectClient() { return connectTo(relay_.host(), relay_.port()); }

    // Listener t in `mode` accepting PROXY headers, in front of `up` (its cluster sends
    // `send_proxy`).
    void startAcceptingRelay(const ScriptedUpstream& up, const std::string& mode,
                             const std::string& send_proxy) {
        ASSERT_TRUE(up.ok()) << up.error();
        ASSERT_NO_FATAL_FAILURE(startRelay(
            clusterConfig(mode, AF_INET, clusterYaml(send_proxy, {up.hostPort()}), kAcceptProxy),
            mode));
    }

    // What `up` received (recorded by `cap`) is `header` then the client's `payload` bytes; the
    // client then closes and the connection is counted done.
    void expectRelayed(Capture& cap, ScriptedUpstream& up, Connected& client,
                       const std::string& header, uint64_t payload) {
        std::optional<std::string> got = cap.wait(up, 0);
        ASSERT_TRUE(got);
        expectHeaderThenPayload(*got, header, payload);
        client.fd.reset();
        expectDone(payload);
    }

    // One finished connection that moved `upstream_bytes` (the client's, no header) and closed
    // normally.
    void expectDone(uint64_t upstream_bytes) {
        EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"),
                                         static_cast<double>(upstream_bytes)));
        EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1))
            << relay_.diagnostics();
        EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    }

    RelayProcess relay_;
};

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

// =============================================================================================
// 3/4. accept_proxy: the header is consumed and its source is the client from then on.

struct ClientHeader {
    std::string name;
    std::string bytes;
    Endpoint src, dst;  // what the header announces
};

std::vector<ClientHeader> clientHeaders() {
    std::vector<ClientHeader> h;
    Endpoint s4 = endpoint("192.0.2.10", 40000), d4 = endpoint("198.51.100.20", 8443);
    Endpoint s6 = endpoint("2001:db8::10", 40001), d6 = endpoint("2001:db8::20", 443);
    h.push_back({"v1_tcp4", v1Header(s4, d4), s4, d4});
    h.push_back({"v1_tcp6", v1Header(s6, d6), s6, d6});
    // PP2_TYPE_AUTHORITY and a PP2_TYPE_NOOP: skipped by the relay, never forwarded.
    std::string tlvs = tlv(0x02, "example.com") + tlv(0x04, std::string("\0\0\0", 3));
    Endpoint t4 = endpoint("203.0.113.7", 51000);
    h.push_back({"v2_inet_tlv", v2Header(t4, d4, tlvs), t4, d4});
    Endpoint t6 = endpoint("2001:db8::7", 51001);
    h.push_back({"v2_inet6", v2Header(t6, d6), t6, d6});
    return h;
}

struct AcceptCase {
    std::string mode;
    ClientHeader header;
    std::string send_proxy;  // the cluster's: "off" or "v2"
};

void PrintTo(const AcceptCase& c, std::ostream* os) {
    *os << c.mode << "/" << c.header.name << "/send_proxy " << c.send_proxy;
}

std::vector<AcceptCase> acceptCases() {
    std::vector<AcceptCase> cases;
    for (const auto& m : kHandOffModes)
        for (const auto& h : clientHeaders())
            for (const char* s : {"off", "v2"}) cases.push_back({m, h, s});
    return cases;
}

std::string acceptCaseName(const ::testing::TestParamInfo<AcceptCase>& info) {
    return info.param.mode + "_" + info.param.header.name + "_send_" + info.param.send_proxy;
}

class AcceptProxyTest : public ProxyFixture, public ::testing::TestWithParam<AcceptCase> {};

TEST_P(AcceptProxyTest, HeaderConsumedPayloadExactSourceFromHeader) {
    const AcceptCase& c = GetParam();
    Capture cap;
    ScriptedUpstream up(AF_INET, cap.script());
    ASSERT_NO_FATAL_FAILURE(startAcceptingRelay(up, c.mode, c.send_proxy));

    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    ASSERT_NO_FATAL_FAILURE(sendThenFinish(client.fd.get(), c.header.bytes, kMiB));
    std::optional<std::string> got = cap.wait(up, 0);
    ASSERT_TRUE(got);
    // Sent on: the announced addresses (TLVs are not forwarded), not 127.0.0.1:<real port>.
    std::string expected = c.send_proxy == "v2" ? v2Header(c.header.src, c.header.dst) : "";
    EXPECT_EQ(got->find(c.header.bytes, expected.size()), std::string::npos)
        << "the client's own PROXY header reached the backend: " << hex(*got, 120);
    expectHeaderThenPayload(*got, expected, kMiB);
    client.fd.reset();
    expectDone(kMiB);
}

INSTANTIATE_TEST_SUITE_P(Modes, AcceptProxyTest, ::testing::ValuesIn(acceptCases()),
                         acceptCaseName);

// The header one byte per write (TCP_NODELAY: one segment each), 10 ms apart, well inside the
// default proxy_timeout of 5 s; the payload follows.
struct SplitCase {
    std::string mode;
    ClientHeader header;
};

void PrintTo(const SplitCase& c, std::ostream* os) { *os << c.mode << "/" << c.header.name; }

std::vector<SplitCase> splitCases() {
    std::vector<SplitCase> cases;
    std::vector<ClientHeader> all = clientHeaders();
    for (const auto& m : kHandOffModes) {
        cases.push_back({m, all[0]});  // v1_tcp4
        cases.push_back({m, all[2]});  // v2_inet_tlv
    }
    return cases;
}

class SplitHeaderTest : public ProxyFixture, public ::testing::TestWithParam<SplitCase> {};

TEST_P(SplitHeaderTest, OneByteWritesStillParse) {
    const SplitCase& c = GetParam();
    Capture cap;
    ScriptedUpstream up(AF_INET, cap.script());
    ASSERT_NO_FATAL_FAILURE(startAcceptingRelay(up, c.mode, "v2"));

    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    const std::string& h = c.header.bytes;
    ASSERT_LT(h.size(), 100u);  // 100 x 10 ms stays far below proxy_timeout
    for (size_t i = 0; i < h.size(); ++i) {
        if (i + 1 == h.size()) {
            EXPECT_EQ(up.accepted(), 0u) << "no backend before the header is complete";
        }
        IoResult w = writeAll(client.fd.get(), &h[i], 1, Millis{5'000});
        ASSERT_TRUE(w.ok()) << "header byte " << i << ": " << w.describe();
        std::this_thread::sleep_for(Millis{10});
    }
    ASSERT_NO_FATAL_FAILURE(sendThenFinish(client.fd.get(), "", 256 * kKiB));
    expectRelayed(cap, up, client, v2Header(c.header.src, c.header.dst), 256 * kKiB);
}

INSTANTIATE_TEST_SUITE_P(Modes, SplitHeaderTest, ::testing::ValuesIn(splitCases()),
                         [](const auto& info) {
                             return info.param.mode + "_" + info.param.header.name;
                         });

// =============================================================================================
// 5. Refused headers: closed promptly, counted by reason, never connected to a backend.

struct BadCase {
    std::string name;
    std::string bytes;   // what the client sends (then it waits)
    std::string reason;  // zcrelay_proxy_protocol_errors_total{reason}
};

std::vector<BadCase> badCases() {
    const std::string a4(8, '\x7f');  // two IPv4 addresses, whatever they are
    const std::string ports("\x01\x02\x03\x04", 4);
    return {
        {"http_request", "GET / HTTP/1.0\r\n\r\n", "not_proxy"},
        {"v1_bad_port", "PROXY TCP4 192.0.2.10 198.51.100.20 99999 80\r\n", "bad_v1"},
        {"v1_bad_address", "PROXY TCP4 192.0.2.300 198.51.100.20 1000 80\r\n", "bad_address"},
        {"v2_bad_version", v2Fixed(0x11, 0x11, 12) + a4 + ports, "bad_v2_version"},
        {"v2_bad_command", v2Fixed(0x22, 0x11, 12) + a4 + ports, "bad_command"},
        {"v2_udp", v2Fixed(0x21, 0x12, 12) + a4 + ports, "bad_family"},
        {"v2_short_block", v2Fixed(0x21, 0x11, 8) + a4, "bad_length"},
        {"v2_bad_tlv", v2Fixed(0x21, 0x11, 12 + 3) + a4 + ports + tlv(0x04, "xy").substr(0, 3),
         "bad_tlv"},
        // 16 + 2000 > proxy_max_size (1 KiB): refused as soon as the length field is in.
        {"v2_over_max_size", v2Fixed(0x21, 0x11, 2000) + a4 + ports + std::string(100, 'x'),
         "too_long"},
    };
}

struct RefuseCase {
    std::string mode;
    BadCase bad;
};

void PrintTo(const RefuseCase& c, std::ostream* os) { *os << c.mode << "/" << c.bad.name; }

// Every case in each of `modes`: {mode, case} for each.
template <class Case, class Item>
std::vector<Case> inModes(const std::vector<std::string>& modes, const std::vector<Item>& items) {
    std::vector<Case> cases;
    for (const auto& m : modes)
        for (const auto& item : items) cases.push_back({m, item});
    return cases;
}

// A refused header never reaches a data path: splice only.
std::vector<RefuseCase> refuseCases() { return inModes<RefuseCase>(kSpliceOnly, badCases()); }

class RefusedHeaderFixture : public ProxyFixture {
  protected:
    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void startAcceptRelay(const std::string& mode, const std::string& more_listener_yaml = "") {
        ASSERT_TRUE(up_.ok()) << up_.error();
        ASSERT_NO_FATAL_FAILURE(
            startRelay(clusterConfig(mode, AF_INET, clusterYaml("v2", {up_.hostPort()}),
                                     kAcceptProxy + more_listener_yaml),
                       mode));
    }
    // The relay closed the client within kPrompt (FIN or RST: unread bytes make it a RST).
    void expectClosedPromptly(int fd, Clock::time_point since) {
        IoResult end = waitForPeerClose(fd, kPrompt);
        EXPECT_TRUE(end.status == IoStatus::Eof || end.status == IoStatus::Reset)
            << "the relay must close a client whose header it refuses, promptly; got "
            << end.describe() << " after " << secondsSince(since) << " s";
        EXPECT_EQ(end.bytes, 0u) << "nothing is sent to a refused client";
    }
    void expectCounted(const std::string& reason) {
        EXPECT_TRUE(relay_.waitForMetric(metric::kProxyErrorsTotal, metric::reason(reason), 1))
            << relay_.diagnostics();
        EXPECT_TRUE(
            relay_.waitForMetric(metric::kClosedTotal, metric::reason("proxy_protocol"), 1));
        EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
        EXPECT_EQ(up_.accepted(), 0u) << "a refused client never reaches a backend";
        EXPECT_EQ(relay_.metric(metric::kBytesTotal, metric::bytes("upstream")).value_or(0), 0.0);
    }

    ScriptedUpstream up_{AF_INET, sinkScript()};
};

class RefusedHeaderTest : public RefusedHeaderFixture,
                          public ::testing::TestWithParam<RefuseCase> {};

TEST_P(RefusedHeaderTest, ClosedPromptlyAndCountedByReason) {
    const RefuseCase& c = GetParam();
    ASSERT_NO_FATAL_FAILURE(startAcceptRelay(c.mode));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    Clock::time_point t0 = Clock::now();
    IoResult w = writeAll(client.fd.get(), c.bad.bytes.data(), c.bad.bytes.size(), Millis{5'000});
    ASSERT_TRUE(w.ok()) << w.describe();
    expectClosedPromptly(client.fd.get(), t0);
    expectCounted(c.bad.reason);
}

INSTANTIATE_TEST_SUITE_P(Modes, RefusedHeaderTest, ::testing::ValuesIn(refuseCases()),
                         [](const auto& info) {
                             return info.param.mode + "_" + info.param.bad.name;
                         });

class SlowHeaderTest : public RefusedHeaderFixture, public ::testing::TestWithParam<std::string> {};

// proxy_timeout: 300ms and nothing arrives: closed within ~1 s, counted as timeout.
TEST_P(SlowHeaderTest, NothingSentTimesOut) {
    ASSERT_NO_FATAL_FAILURE(startAcceptRelay(GetParam(), "    proxy_timeout: 300ms\n"));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    Clock::time_point t0 = Clock::now();
    expectClosedPromptly(client.fd.get(), t0);
    expectCounted("timeout");
}

// Half a header and then silence: the same timeout (not a wait for bytes that never come).
TEST_P(SlowHeaderTest, PartialHeaderTimesOut) {
    ASSERT_NO_FATAL_FAILURE(startAcceptRelay(GetParam(), "    proxy_timeout: 300ms\n"));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    Clock::time_point t0 = Clock::now();
    std::string part = "PROXY TCP4 192.0";
    ASSERT_TRUE(writeAll(client.fd.get(), part.data(), part.size(), Millis{5'000}).ok());
    expectClosedPromptly(client.fd.get(), t0);
    expectCounted("timeout");
}

// The client half-closes before its header is complete: eof, promptly (the default 5 s
// proxy_timeout must not be what ends it).
TEST_P(SlowHeaderTest, FinBeforeHeaderCompleteIsEof) {
    ASSERT_NO_FATAL_FAILURE(startAcceptRelay(GetParam()));
    for (const std::string& part : {std::string("PROXY TCP4 192.0"), v2Fixed(0x21, 0x11, 12)}) {
        SCOPED_TRACE(hex(part));
        Connected client = connectClient();
        ASSERT_TRUE(client.fd) << client.error;
        Clock::time_point t0 = Clock::now();
        ASSERT_TRUE(writeAll(client.fd.get(), part.data(), part.size(), Millis{5'000}).ok());
        ::shutdown(client.fd.get(), SHUT_WR);
        expectClosedPromptly(client.fd.get(), t0);
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kProxyErrorsTotal, metric::reason("eof"), 2))
        << relay_.diagnostics();
    EXPECT_EQ(relay_.metric(metric::kProxyErrorsTotal, metric::reason("timeout")).value_or(0), 0);
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("proxy_protocol"), 2));
    EXPECT_EQ(up_.accepted(), 0u);
}

// The client connects and closes without a byte: eof.
TEST_P(SlowHeaderTest, CloseWithoutHeaderIsEof) {
    ASSERT_NO_FATAL_FAILURE(startAcceptRelay(GetParam()));
    {
        Connected client = connectClient();
        ASSERT_TRUE(client.fd) << client.error;
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kProxyErrorsTotal, metric::reason("eof"), 1, kPrompt))
        << "counted promptly, not after proxy_timeout; " << relay_.diagnostics();
    expectCounted("eof");
}

// Timeouts and ends before the header is complete: no data path has started, splice only.
INSTANTIATE_TEST_SUITE_P(Modes, SlowHeaderTest, ::testing::ValuesIn(kSpliceOnly),
                         [](const auto& info) { return info.param; });

// =============================================================================================
// 6. Headers without addresses: the relay keeps the real peer as the client.

struct LocalCase {
    std::string name;
    std::string bytes;
};

std::vector<LocalCase> localHeaders() {
    std::string ignored = v2Header(endpoint("192.0.2.99", 1), endpoint("192.0.2.98", 2));
    return {
        {"v2_local", v2Fixed(0x20, 0x00, 0)},
        // LOCAL with an INET block: the block (family included) is skipped unread.
        {"v2_local_inet", v2Fixed(0x20, 0x11, 12) + ignored.substr(16)},
        {"v1_unknown", "PROXY UNKNOWN\r\n"},
    };
}

struct AddresslessCase {
    std::string mode;
    LocalCase header;
};

void PrintTo(const AddresslessCase& c, std::ostream* os) { *os << c.mode << "/" << c.header.name; }

// Which address the relay keeps is settled while it reads the header: splice only (the bytes
// after a header, in each hand-off, are AcceptProxyTest's).
std::vector<AddresslessCase> addresslessCases() {
    return inModes<AddresslessCase>(kSpliceOnly, localHeaders());
}

class AddresslessHeaderTest : public ProxyFixture,
                              public ::testing::TestWithParam<AddresslessCase> {};

TEST_P(AddresslessHeaderTest, RealPeerIsTheClient) {
    const AddresslessCase& c = GetParam();
    Capture cap;
    ScriptedUpstream up(AF_INET, cap.script());
    ASSERT_NO_FATAL_FAILURE(startAcceptingRelay(up, c.mode, "v2"));

    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    std::optional<Endpoint> src = socketEndpoint(client.fd.get(), false);
    std::optional<Endpoint> dst = socketEndpoint(client.fd.get(), true);
    ASSERT_TRUE(src && dst);
    ASSERT_NO_FATAL_FAILURE(sendThenFinish(client.fd.get(), c.header.bytes, 256 * kKiB));
    expectRelayed(cap, up, client, v2Header(*src, *dst), 256 * kKiB);
}

INSTANTIATE_TEST_SUITE_P(Modes, AddresslessHeaderTest, ::testing::ValuesIn(addresslessCases()),
                         [](const auto& info) {
                             return info.param.mode + "_" + info.param.header.name;
                         });

}  // namespace
}  // namespace zcrelay::test::proxy_protocol_test
