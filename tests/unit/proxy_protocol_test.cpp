#include "proxy_protocol.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/un.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "unit/config_values.hpp"

namespace zcrelay {

namespace proxy_protocol {
namespace {

using Bytes = std::vector<uint8_t>;
using namespace std::string_view_literals;

constexpr size_t kMaxSize = 4096;  // a generous v2 bound for the tests that are not about it

Bytes bytes(std::string_view s) { return Bytes(s.begin(), s.end()); }

Bytes cat(std::initializer_list<Bytes> parts) {
    Bytes out;
    for (const Bytes& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
}

const Bytes kSignature(kV2Signature.begin(), kV2Signature.end());

// The spec's signature, written out rather than taken from the code under test.
const Bytes kSpecSignature{0x0D, 0x0A, 0x0D, 0x0A, 0x00, 0x0D, 0x0A, 0x51, 0x55, 0x49, 0x54, 0x0A};

using unit::addr;

SocketAddress unixAddress(const char* path) {
    sockaddr_un sun{};
    sun.sun_family = AF_UNIX;
    std::strncpy(sun.sun_path, path, sizeof(sun.sun_path) - 1);
    return addressFromSockaddr(reinterpret_cast<const sockaddr*>(&sun), sizeof(sun));
}

Bytes written(Version v, const SocketAddress& src, const SocketAddress& dst) {
    std::array<uint8_t, kMaxWrite> out{};
    const size_t n = writeHeader(v, src, dst, out);
    EXPECT_LE(n, kMaxWrite);
    return Bytes(out.begin(), out.begin() + n);
}

Bytes head(const Bytes& b, size_t n) { return Bytes(b.begin(), b.begin() + n); }

std::string asText(const Bytes& b) { return std::string(b.begin(), b.end()); }

ParseResult parsed(const Bytes& b, size_t max_size = kMaxSize) { return parse(b, max_size); }

// A v2 header: signature, version/command, family, then `block` with its length in front.
Bytes v2(uint8_t ver_cmd, uint8_t family, const Bytes& block) {
    return cat({kSpecSignature,
                {ver_cmd, family, static_cast<uint8_t>(block.size() >> 8),
                 static_cast<uint8_t>(block.size())},
                block});
}

// 192.168.0.1:56324 -> 192.168.0.11:443, the spec's own example, as a v2 INET block.
const Bytes kInetBlock{192, 168, 0, 1, 192, 168, 0, 11, 0xDC, 0x04, 0x01, 0xBB};

Bytes inet6Block() {
    Bytes b(36, 0);
    b[0] = 0x20, b[1] = 0x01, b[2] = 0x0d, b[3] = 0xb8, b[15] = 1;      // 2001:db8::1
    b[16] = 0x20, b[17] = 0x01, b[18] = 0x0d, b[19] = 0xb8, b[31] = 2;  // 2001:db8::2
    b[32] = 0xDC, b[33] = 0x04, b[34] = 0x01, b[35] = 0xBB;
    return b;
}

// --- writeHeader, byte for byte -------------------------------------------------------------

TEST(ProxyProtocolWrite, V1Tcp4) {
    EXPECT_EQ(asText(written(Version::V1, addr("192.168.0.1:56324"), addr("192.168.0.11:443"))),
              "PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n");
    EXPECT_EQ(asText(written(Version::V1, addr("0.0.0.0:0"), addr("255.255.255.255:65535"))),
              "PROXY TCP4 0.0.0.0 255.255.255.255 0 65535\r\n");
}

TEST(ProxyProtocolWrite, V1Tcp6) {
    EXPECT_EQ(asText(written(Version::V1, addr("[2001:db8::1]:56324"), addr("[2001:db8::2]:443"))),
              "PROXY TCP6 2001:db8::1 2001:db8::2 56324 443\r\n");
}

TEST(ProxyProtocolWrite, V1LongestLineFits) {
    const SocketAddress a = addr("[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535");
    const Bytes line = written(Version::V1, a, a);
    EXPECT_EQ(line.size(), 104u);
    EXPECT_LE(line.size(), kV1MaxLength);
}

TEST(ProxyProtocolWrite, V1UnknownForAnythingButAnIpPair) {
    const std::string unknown = "PROXY UNKNOWN\r\n";
    EXPECT_EQ(asText(written(Version::V1, unixAddress("/a"), unixAddress("/b"))), unknown);
    EXPECT_EQ(asText(written(Version::V1, SocketAddress{}, SocketAddress{})), unknown);
    EXPECT_EQ(asText(written(Version::V1, addr("1.2.3.4:1"), addr("[::1]:2"))), unknown);
}

TEST(ProxyProtocolWrite, V4MappedPairIsWrittenAsTcp4) {
    EXPECT_EQ(
        asText(written(Version::V1, addr("[::ffff:10.0.0.1]:1000"), addr("[::ffff:10.0.0.2]:80"))),
        "PROXY TCP4 10.0.0.1 10.0.0.2 1000 80\r\n");
    EXPECT_EQ(written(Version::V2, addr("[::ffff:10.0.0.1]:1000"), addr("[::ffff:10.0.0.2]:80")),
              v2(0x21, 0x11, {10, 0, 0, 1, 10, 0, 0, 2, 0x03, 0xE8, 0x00, 0x50}));
    // Only one side mapped (no accepted socket looks like that): left as IPv6.
    EXPECT_EQ(asText(written(Version::V1, addr("[::ffff:10.0.0.1]:1000"), addr("[::1]:80"))),
              "PROXY TCP6 ::ffff:10.0.0.1 ::1 1000 80\r\n");
}

TEST(ProxyProtocolWrite, V2Inet) {
    const Bytes expected = cat({kSpecSignature, {0x21, 0x11, 0x00, 0x0C}, kInetBlock});
    EXPECT_EQ(written(Version::V2, addr("192.168.0.1:56324"), addr("192.168.0.11:443")), expected);
    EXPECT_EQ(expected.size(), 28u);
}

TEST(ProxyProtocolWrite, V2Inet6) {
    const Bytes expected = cat({kSpecSignature, {0x21, 0x21, 0x00, 0x24}, inet6Block()});
    EXPECT_EQ(written(Version::V2, addr("[2001:db8::1]:56324"), addr("[2001:db8::2]:443")),
              expected);
    EXPECT_EQ(expected.size(), 52u);
}

TEST(ProxyProtocolWrite, V2LocalForAnythingButAnIpPair) {
    const Bytes local = cat({kSpecSignature, {0x20, 0x00, 0x00, 0x00}});
    EXPECT_EQ(written(Version::V2, unixAddress("/a"), unixAddress("/b")), local);
    EXPECT_EQ(written(Version::V2, SocketAddress{}, SocketAddress{}), local);
    EXPECT_EQ(written(Version::V2, addr("[::1]:1"), addr("1.2.3.4:2")), local);
}

// --- round trip ------------------------------------------------------------------------------

TEST(ProxyProtocolRoundTrip, ParseGivesBackWhatWasWritten) {
    const std::vector<std::pair<std::string, std::string>> pairs{
        {"192.168.0.1:56324", "192.168.0.11:443"},
        {"0.0.0.0:0", "255.255.255.255:65535"},
        {"[2001:db8::1]:56324", "[2001:db8::2]:443"},
        {"[::]:0", "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535"},
        {"[fe80::1:2:3:4]:1", "[::1]:10000"},
    };
    for (const Version v : {Version::V1, Version::V2}) {
        for (const auto& [s, d] : pairs) {
            const Bytes header = written(v, addr(s), addr(d));
            const ParseResult r = parsed(header);
            ASSERT_EQ(r.kind, ParseResult::Done) << s << " " << d;
            EXPECT_EQ(r.length, header.size());
            EXPECT_TRUE(r.has_addresses);
            EXPECT_EQ(r.src, addr(s));
            EXPECT_EQ(r.dst, addr(d));
            EXPECT_EQ(r.src.length, addr(s).length);
        }
    }
}

TEST(ProxyProtocolRoundTrip, MappedComesBackAsIpv4) {
    for (const Version v : {Version::V1, Version::V2}) {
        const ParseResult r =
            parsed(written(v, addr("[::ffff:10.0.0.1]:1000"), addr("[::ffff:10.0.0.2]:80")));
        ASSERT_EQ(r.kind, ParseResult::Done);
        EXPECT_EQ(r.src, addr("10.0.0.1:1000"));
        EXPECT_EQ(r.dst, addr("10.0.0.2:80"));
    }
}

TEST(ProxyProtocolRoundTrip, UnknownAndLocalCarryNoAddresses) {
    for (const Version v : {Version::V1, Version::V2}) {
        const Bytes header = written(v, unixAddress("/a"), unixAddress("/b"));
        const ParseResult r = parsed(header);
        ASSERT_EQ(r.kind, ParseResult::Done);
        EXPECT_EQ(r.length, header.size());
        EXPECT_FALSE(r.has_addresses);
    }
}

// --- valid headers: prefixes, payload, need --------------------------------------------------

std::vector<Bytes> validHeaders() {
    Bytes unix_block(216, 'u');
    Bytes tlvs = cat({kInetBlock,
                      {0x01, 0x00, 0x02, 'h', '2'},   // ALPN "h2"
                      {0x04, 0x00, 0x00},             // NOOP, empty
                      {0x05, 0x00, 0x03, 1, 2, 3}});  // UNIQUE_ID
    return {
        bytes("PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n"),
        bytes("PROXY TCP4 0.0.0.0 0.0.0.0 0 0\r\n"),
        bytes("PROXY TCP6 2001:db8::1 2001:db8::2 56324 443\r\n"),
        bytes("PROXY TCP6 :: :: 0 0\r\n"),
        bytes("PROXY TCP6 ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff "
              "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff 65535 65535\r\n"),
        bytes("PROXY TCP6 ::ffff:1.2.3.4 ::ffff:5.6.7.8 1 2\r\n"),
        bytes("PROXY UNKNOWN\r\n"),
        bytes("PROXY UNKNOWN \r\n"),
        bytes("PROXY UNKNOWN ffff:f...f:ffff ffff:f...f:ffff 65535 65535\r\n"),
        bytes("PROXY UNKNOWN " + std::string(kV1MaxLength - 16, 'x') + "\r\n"),  // 107 exactly
        v2(0x21, 0x11, kInetBlock),
        v2(0x21, 0x21, inet6Block()),
        v2(0x20, 0x00, {}),
        v2(0x21, 0x00, {}),
        v2(0x21, 0x31, unix_block),
        v2(0x21, 0x11, tlvs),
        v2(0x20, 0x12, {1, 2, 3}),  // LOCAL: family and block are ignored
    };
}

TEST(ProxyProtocolParse, EveryPrefixIsIncompleteWithAReachableNeed) {
    for (const Bytes& header : validHeaders()) {
        SCOPED_TRACE(testing::PrintToString(asText(header)));
        for (size_t k = 0; k < header.size(); ++k) {
            const ParseResult r = parsed(head(header, k));
            ASSERT_EQ(r.kind, ParseResult::Incomplete) << "prefix of " << k << " bytes";
            // More than what is there, and no more than the header: waiting for `need` bytes
            // (SO_RCVLOWAT) can never outlast the header itself.
            EXPECT_GT(r.need, k);
            EXPECT_LE(r.need, header.size()) << "prefix of " << k << " bytes";
        }
        const ParseResult r = parsed(header);
        ASSERT_EQ(r.kind, ParseResult::Done);
        EXPECT_EQ(r.length, header.size());
    }
}

TEST(ProxyProtocolParse, PayloadAfterTheHeaderIsNotPartOfIt) {
    // Payload bytes that would be wrong inside any header: CR, LF, spaces, a second signature.
    const Bytes payload = cat({bytes("\r\nGET / HTTP/1.1\r\n\r\n"), kSignature});
    for (const Bytes& header : validHeaders()) {
        const ParseResult r = parsed(cat({header, payload}));
        ASSERT_EQ(r.kind, ParseResult::Done) << asText(header);
        EXPECT_EQ(r.length, header.size());
    }
}

TEST(ProxyProtocolParse, NeedIsTheShortestHeaderStillPossible) {
    EXPECT_EQ(parsed({}).need, 15u);  // "PROXY UNKNOWN\r\n"
    EXPECT_EQ(parsed(bytes("PRO")).need, 15u);
    EXPECT_EQ(parsed(bytes("\r")).need, 16u);          // v2's fixed part
    EXPECT_EQ(parsed(bytes("PROXY T")).need, 22u);     // "PROXY TCP6 :: :: 0 0\r\n"
    EXPECT_EQ(parsed(bytes("PROXY TCP4")).need, 32u);  // "PROXY TCP4 0.0.0.0 0.0.0.0 0 0\r\n"
    EXPECT_EQ(parsed(bytes("PROXY TCP4 192.168.100.100")).need, 40u);
    EXPECT_EQ(parsed(bytes("PROXY TCP4 1.2.3.4 5.6.7.8 80 443\r")).need, 35u);
    const Bytes inet = v2(0x21, 0x11, kInetBlock);
    EXPECT_EQ(parsed(head(inet, 16)).need, 28u);
}

TEST(ProxyProtocolParse, AddressesAndPorts) {
    ParseResult r = parsed(bytes("PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n"));
    ASSERT_EQ(r.kind, ParseResult::Done);
    EXPECT_TRUE(r.has_addresses);
    EXPECT_EQ(r.src, addr("192.168.0.1:56324"));
    EXPECT_EQ(r.dst, addr("192.168.0.11:443"));

    r = parsed(v2(0x21, 0x21, inet6Block()));
    ASSERT_EQ(r.kind, ParseResult::Done);
    EXPECT_EQ(r.src, addr("[2001:db8::1]:56324"));
    EXPECT_EQ(r.dst, addr("[2001:db8::2]:443"));

    // LOCAL with an INET block (what some senders put there anyway): the addresses are not used.
    r = parsed(v2(0x20, 0x11, kInetBlock));
    ASSERT_EQ(r.kind, ParseResult::Done);
    EXPECT_FALSE(r.has_addresses);

    for (const Bytes& h : {v2(0x21, 0x00, {}), v2(0x21, 0x31, Bytes(216, 0)),
                           bytes("PROXY UNKNOWN 1.2.3.4 5.6.7.8 1 2\r\n")}) {
        r = parsed(h);
        ASSERT_EQ(r.kind, ParseResult::Done);
        EXPECT_FALSE(r.has_addresses);
    }
}

TEST(ProxyProtocolParse, MaxSizeBoundsV2Exactly) {
    const Bytes inet = v2(0x21, 0x11, kInetBlock);  // 28 bytes
    EXPECT_EQ(parsed(inet, 28).kind, ParseResult::Done);
    const ParseResult r = parsed(head(inet, 16), 27);
    ASSERT_EQ(r.kind, ParseResult::Malformed);  // refused on the length field, not the block
    EXPECT_EQ(r.error, ProxyError::TooLong);
    // v1 is bounded by the spec, whatever max_size says.
    EXPECT_EQ(parsed(bytes("PROXY UNKNOWN\r\n"), 0).kind, ParseResult::Done);
}

// --- malformed -------------------------------------------------------------------------------

struct BadCase {
    const char* name;
    Bytes data;
    ProxyError error;
    size_t max_size = kMaxSize;
};

std::vector<BadCase> badCases() {
    Bytes tlv_overrun = cat({kInetBlock, {0x01, 0x00, 0x06, 'a', 'b', 'c', 'd', 'e'}});
    Bytes tlv_cut = cat({kInetBlock, {0x01, 0x00}});
    Bytes tlv_second_overruns = cat({kInetBlock, {0x04, 0x00, 0x00, 0x01, 0x00, 0x02, 'a'}});
    const std::string v6max = "ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255";  // 45 chars
    return {
        {"http", bytes("GET / HTTP/1.1\r\n"), ProxyError::NotProxy},
        {"one byte", bytes("G"), ProxyError::NotProxy},
        {"post", bytes("POST"), ProxyError::NotProxy},
        {"lowercase", bytes("proxy tcp4"), ProxyError::NotProxy},
        {"no space", bytes("PROXYTCP4"), ProxyError::NotProxy},
        {"tls", Bytes{0x16, 0x03, 0x01}, ProxyError::NotProxy},
        {"v2 bad signature", bytes("\r\n\r\n\0\r\nQUIX"sv), ProxyError::NotProxy},
        {"v2 signature cut short by data", bytes("\r\n\r\nX"), ProxyError::NotProxy},
        {"v2 version 1", v2(0x11, 0x11, kInetBlock), ProxyError::BadV2Version},
        {"v2 version 3", v2(0x31, 0x11, kInetBlock), ProxyError::BadV2Version},
        {"v2 version alone", cat({kSpecSignature, {0x01}}), ProxyError::BadV2Version},
        {"v2 command 2", v2(0x22, 0x11, kInetBlock), ProxyError::BadCommand},
        {"v2 command 15", v2(0x2F, 0x00, {}), ProxyError::BadCommand},
        {"v2 udp4", v2(0x21, 0x12, kInetBlock), ProxyError::BadFamily},
        {"v2 unix dgram", v2(0x21, 0x32, Bytes(216, 0)), ProxyError::BadFamily},
        {"v2 family 4", v2(0x21, 0x41, kInetBlock), ProxyError::BadFamily},
        {"v2 inet length 11", v2(0x21, 0x11, Bytes(11, 0)), ProxyError::BadLength},
        {"v2 inet length 11, block not yet there", head(v2(0x21, 0x11, Bytes(11, 0)), 16),
         ProxyError::BadLength},
        {"v2 inet6 length 35", v2(0x21, 0x21, Bytes(35, 0)), ProxyError::BadLength},
        {"v2 unix length 215", v2(0x21, 0x31, Bytes(215, 0)), ProxyError::BadLength},
        {"v2 length > max_size", v2(0x21, 0x11, kInetBlock), ProxyError::TooLong, 27},
        {"v2 max_size below 16", v2(0x20, 0x00, {}), ProxyError::TooLong, 15},
        {"v2 tlv overruns the block", v2(0x21, 0x11, tlv_overrun), ProxyError::BadTlv},
        {"v2 tlv header cut", v2(0x21, 0x11, tlv_cut), ProxyError::BadTlv},
        {"v2 second tlv overruns", v2(0x21, 0x11, tlv_second_overruns), ProxyError::BadTlv},
        {"v2 unspec tlv overruns", v2(0x21, 0x00, {0x01, 0x00, 0x09}), ProxyError::BadTlv},
        {"v1 no crlf in 107 bytes", bytes("PROXY UNKNOWN " + std::string(kV1MaxLength - 14, 'x')),
         ProxyError::TooLong},
        {"v1 crlf at 108", bytes("PROXY UNKNOWN " + std::string(kV1MaxLength - 15, 'x') + "\r\n"),
         ProxyError::TooLong},
        {"v1 too long with 45-char addresses",
         bytes("PROXY TCP6 " + v6max + " " + v6max + " 65535 65535\r\n"), ProxyError::TooLong},
        {"v1 cannot end in 107 any more", bytes("PROXY TCP6 " + v6max + " " + v6max),
         ProxyError::TooLong},
        {"v1 port 65536", bytes("PROXY TCP4 1.2.3.4 5.6.7.8 80 65536\r\n"), ProxyError::BadV1},
        {"v1 port 99999", bytes("PROXY TCP4 1.2.3.4 5.6.7.8 99999 80\r\n"), ProxyError::BadV1},
        {"v1 leading zero", bytes("PROXY TCP4 1.2.3.4 5.6.7.8 080 443\r\n"), ProxyError::BadV1},
        {"v1 port 00", bytes("PROXY TCP4 1.2.3.4 5.6.7.8 00 443\r\n"), ProxyError::BadV1},
        {"v1 negative port", bytes("PROXY TCP4 1.2.3.4 5.6.7.8 -1 443\r\n"), ProxyError::BadV1},
        {"v1 port with sign", bytes("PROXY TCP4 1.2.3.4 5.6.7.8 +1 443\r\n"), ProxyError::BadV1},
        {"v1 double space after PROXY", bytes("PROXY  TCP4 1.2.3.4 5.6.7.8 1 2\r\n"),
         ProxyError::BadV1},
        {"v1 double space", bytes("PROXY TCP4 1.2.3.4  5.6.7.8 1 2\r\n"), ProxyError::BadV1},
        {"v1 double space before ports", bytes("PROXY TCP4 1.2.3.4 5.6.7.8  1 2\r\n"),
         ProxyError::BadV1},
        {"v1 trailing space", bytes("PROXY TCP4 1.2.3.4 5.6.7.8 1 2 \r\n"), ProxyError::BadV1},
        {"v1 tab", bytes("PROXY TCP4\t1.2.3.4 5.6.7.8 1 2\r\n"), ProxyError::BadV1},
        {"v1 lf only", bytes("PROXY TCP4 1.2.3.4 5.6.7.8 1 2\n"), ProxyError::BadV1},
        {"v1 cr without lf", bytes("PROXY TCP4 1.2.3.4 5.6.7.8 1 2\rX"), ProxyError::BadV1},
        {"v1 missing port", bytes("PROXY TCP4 1.2.3.4 5.6.7.8 1\r\n"), ProxyError::BadV1},
        {"v1 extra field", bytes("PROXY TCP4 1.2.3.4 5.6.7.8 1 2 3\r\n"), ProxyError::BadV1},
        {"v1 protocol lowercase", bytes("PROXY tcp4 1.2.3.4 5.6.7.8 1 2\r\n"), ProxyError::BadV1},
        {"v1 udp", bytes("PROXY UDP4 1.2.3.4 5.6.7.8 1 2\r\n"), ProxyError::BadV1},
        {"v1 TCP46", bytes("PROXY TCP46 1.2.3.4 5.6.7.8 1 2\r\n"), ProxyError::BadV1},
        {"v1 unknownx", bytes("PROXY UNKNOWNX\r\n"), ProxyError::BadV1},
        {"v1 unknown lf inside", bytes("PROXY UNKNOWN a\nb\r\n"), ProxyError::BadV1},
        {"v1 unknown cr without lf", bytes("PROXY UNKNOWN\rX"), ProxyError::BadV1},
        {"v1 ipv6 in tcp4", bytes("PROXY TCP4 ::1 ::1 80 443\r\n"), ProxyError::BadAddress},
        {"v1 ipv4 in tcp6", bytes("PROXY TCP6 1.2.3.4 5.6.7.8 80 443\r\n"), ProxyError::BadAddress},
        {"v1 octet 256", bytes("PROXY TCP4 1.2.3.256 5.6.7.8 80 443\r\n"), ProxyError::BadAddress},
        {"v1 three octets", bytes("PROXY TCP4 1.2.3 5.6.7.8 80 443\r\n"), ProxyError::BadAddress},
        {"v1 octet leading zero", bytes("PROXY TCP4 01.2.3.4 5.6.7.8 80 443\r\n"),
         ProxyError::BadAddress},
        {"v1 name", bytes("PROXY TCP4 localhost 5.6.7.8 80 443\r\n"), ProxyError::BadAddress},
        {"v1 bracketed v6", bytes("PROXY TCP6 [::1] ::1 80 443\r\n"), ProxyError::BadAddress},
        {"v1 v6 triple colon", bytes("PROXY TCP6 1:::2 ::1 80 443\r\n"), ProxyError::BadAddress},
        {"v1 v4 address too long", bytes("PROXY TCP4 1.2.3.4.5.6.7.8.9 "), ProxyError::BadAddress},
    };
}

TEST(ProxyProtocolParse, MalformedWithTheReason) {
    for (const BadCase& c : badCases()) {
        const ParseResult r = parsed(c.data, c.max_size);
        ASSERT_EQ(r.kind, ParseResult::Malformed) << c.name;
        EXPECT_EQ(label(r.error), label(c.error)) << c.name;
    }
}

TEST(ProxyProtocolParse, MalformedStaysMalformedWithMoreBytes) {
    // A reader that got a Malformed answer may have had more bytes queued; the verdict must not
    // depend on how much arrived (the reason may: a TCP6 line that can no longer fit in 107
    // bytes is too_long, the same line ended early by a CR is bad_v1).
    for (const BadCase& c : badCases()) {
        const ParseResult r = parsed(cat({c.data, bytes("\r\n\r\nmore")}), c.max_size);
        EXPECT_EQ(r.kind, ParseResult::Malformed) << c.name;
    }
}

TEST(ProxyProtocolParse, RefusesAtTheFirstWrongByte) {
    // No waiting for the rest of a line that is already wrong.
    EXPECT_EQ(parsed(bytes("GET ")).kind, ParseResult::Malformed);
    EXPECT_EQ(parsed(bytes("PROXY X")).kind, ParseResult::Malformed);
    EXPECT_EQ(parsed(bytes("PROXY TCP4 1.2.3.4  ")).kind, ParseResult::Malformed);
    EXPECT_EQ(parsed(bytes("PROXY TCP4 ::")).kind, ParseResult::Malformed);
    EXPECT_EQ(parsed(bytes("PROXY TCP4 1.2.3.4 5.6.7.8 0")).kind, ParseResult::Incomplete);
    EXPECT_EQ(parsed(bytes("PROXY TCP4 1.2.3.4 5.6.7.8 01")).kind, ParseResult::Malformed);
    EXPECT_EQ(parsed(bytes("PROXY TCP4 1.2.3.4 5.6.7.8 65536")).kind, ParseResult::Malformed);
    EXPECT_EQ(parsed(cat({kSpecSignature, {0x21, 0x13}})).kind, ParseResult::Malformed);
}

TEST(ProxyProtocolErrors, LabelsAreDistinctSnakeCase) {
    std::set<std::string_view> seen;
    for (size_t i = 0; i < static_cast<size_t>(ProxyError::kCount); ++i) {
        const std::string_view l = label(static_cast<ProxyError>(i));
        EXPECT_FALSE(l.empty());
        EXPECT_EQ(l.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_"), l.npos) << l;
        EXPECT_TRUE(seen.insert(l).second) << l;
    }
    EXPECT_EQ(label(ProxyError::NotProxy), "not_proxy");
    EXPECT_EQ(label(ProxyError::BadTlv), "bad_tlv");
}

}  // namespace
}  // namespace proxy_protocol
}  // namespace zcrelay
