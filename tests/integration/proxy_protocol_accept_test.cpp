// accept_proxy: the client's header is consumed (whole or in 1-byte writes), the payload goes
// on byte-exact and the header's source becomes the client; a v2 LOCAL or addressless header
// keeps the real peer.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <ostream>
#include <string>
#include <vector>

#include "integration/proxy_protocol_fixture.hpp"

namespace zcrelay::test::proxy_protocol_test {
namespace {

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
