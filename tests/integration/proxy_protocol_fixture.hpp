#pragma once
// The PROXY protocol end to end, through the real binary on loopback, over every data path.
// What the proxy_protocol_*_test.cpp files share: headers built here by hand from the spec and
// from a socket's own names (never by the relay's writer), a capturing backend, and the fixture.
// The files:
//   - proxy_protocol_send_test: send_proxy v1/v2: the backend reads exactly the header and then
//     the client's bytes, byte-exact; the same headers cross-checked against HAProxy's
//     send-proxy / send-proxy-v2;
//   - proxy_protocol_accept_test: accept_proxy: the header is consumed (split into 1-byte writes
//     too), its source becomes the client, a v2 LOCAL header keeps the real peer;
//   - proxy_protocol_refused_test: malformed, slow and truncated headers close the client with
//     the right reason and never reach a backend.
// The oracle is what the backend captures and the relay's counters, waited on with deadlines.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "support/bytes.hpp"
#include "support/captured_streams.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::proxy_protocol_test {

inline constexpr uint64_t kSeed = 0x50C0FFEE;
inline constexpr Millis kIo{30'000};
// "promptly": the relay's tick is at most 250 ms; the rest is room for a loaded 2-core machine,
// and still below the default proxy_timeout (5 s), the slow close "promptly" is told apart from.
inline constexpr Millis kPrompt{4'000};
inline constexpr size_t kCaptureLimit = 4 * kMiB;

// The data paths a suite runs in. The PROXY header is read, or written, before any data path
// starts, so a suite whose subject ends there runs in splice only. A suite that also checks the
// bytes after the header runs in splice and sockmap: in sockmap mode the relay sends on what
// followed the header itself before the sockets enter the map (Connections::startRelaying);
// splice and copy both just start their pumps on the client's socket.
inline const std::vector<std::string> kSpliceOnly = {"splice"};
inline const std::vector<std::string> kHandOffModes = {"splice", "sockmap"};

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

inline Endpoint endpoint(const std::string& ip, uint16_t port) {
    Endpoint e;
    e.family = ip.find(':') == std::string::npos ? AF_INET : AF_INET6;
    EXPECT_EQ(::inet_pton(e.family, ip.c_str(), e.addr.data()), 1) << ip;
    e.port = port;
    return e;
}

// getsockname (peer = false) or getpeername of a connected socket.
inline std::optional<Endpoint> socketEndpoint(int fd, bool peer) {
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

inline std::string v1Header(const Endpoint& src, const Endpoint& dst) {
    return std::string("PROXY ") + (src.family == AF_INET ? "TCP4 " : "TCP6 ") + src.text() + " " +
           dst.text() + " " + std::to_string(src.port) + " " + std::to_string(dst.port) + "\r\n";
}

inline const std::string kV2Signature("\r\n\r\n\0\r\nQUIT\n", 12);

// The 16-byte fixed part: signature, version 2 | command, family | protocol, block length.
inline std::string v2Fixed(uint8_t version_command, uint8_t family_protocol, uint16_t length) {
    std::string h = kV2Signature;
    h.push_back(static_cast<char>(version_command));
    h.push_back(static_cast<char>(family_protocol));
    putBe16(h, length);
    return h;
}

// A v2 PROXY header over TCP (INET 0x11 or INET6 0x21), `tlvs` appended to the address block.
inline std::string v2Header(const Endpoint& src, const Endpoint& dst,
                            const std::string& tlvs = "") {
    size_t alen = src.addrLen();
    std::string h = v2Fixed(0x21, src.family == AF_INET ? 0x11 : 0x21,
                            static_cast<uint16_t>(2 * alen + 4 + tlvs.size()));
    h.append(reinterpret_cast<const char*>(src.addr.data()), alen);
    h.append(reinterpret_cast<const char*>(dst.addr.data()), alen);
    putBe16(h, src.port);
    putBe16(h, dst.port);
    return h + tlvs;
}

inline std::string tlv(uint8_t type, const std::string& value) {
    std::string t(1, static_cast<char>(type));
    putBe16(t, static_cast<uint16_t>(value.size()));
    return t + value;
}

// ---------------------------------------------------------------------------------------------
// A capture backend: each connection's bytes, kept whole (header and payload), by accept index.

class Capture {
  public:
    ConnScript script() {
        return [streams = streams_](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                    ScriptedUpstream&) {
            std::string got;
            rec.read_end = readUntilEof(fd.get(), got, kIo, kCaptureLimit, &stop);
            rec.bytes_received = rec.read_end.bytes;
            ::shutdown(fd.get(), SHUT_WR);
            streams->keep(rec.index, std::move(got));
        };
    }
    // The bytes of connection `index` once it ended, or nullopt (an ADD_FAILURE says why).
    std::optional<std::string> wait(ScriptedUpstream& up, size_t index) {
        return streams_->wait(up, index, kIo);
    }

  private:
    std::shared_ptr<CapturedStreams> streams_ = std::make_shared<CapturedStreams>();
};

// `got` must be `header` and then exactly `payload_bytes` of payload kSeed.
inline void expectHeaderThenPayload(const std::string& got, const std::string& header,
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
inline void sendThenFinish(int fd, const std::string& prefix, uint64_t payload_bytes) {
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

inline std::string clusterYaml(const std::string& send_proxy,
                               const std::vector<std::string>& backends,
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

inline RelayConfig clusterConfig(const std::string& mode, int family,
                                 const std::string& cluster_yaml,
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

inline const std::string kAcceptProxy = "    accept_proxy: true\n";

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

// Every case in each of `modes`: {mode, case} for each.
template <class Case, class Item>
std::vector<Case> inModes(const std::vector<std::string>& modes, const std::vector<Item>& items) {
    std::vector<Case> cases;
    for (const auto& m : modes)
        for (const auto& item : items) cases.push_back({m, item});
    return cases;
}

}  // namespace zcrelay::test::proxy_protocol_test
