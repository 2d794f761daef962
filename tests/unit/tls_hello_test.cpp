#include "tls_hello.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>
#include "support/labels.hpp"

namespace zcrelay::tls_hello {
namespace {

using Bytes = std::vector<uint8_t>;
using Names = std::vector<std::string>;

// Room for every hello here: the largest capture is 30 KB, and split into 1-byte records about
// six times that.
constexpr size_t kMaxSize = 256 * 1024;

Bytes bytes(std::string_view s) { return Bytes(s.begin(), s.end()); }

Bytes cat(std::initializer_list<Bytes> parts) {
    Bytes out;
    for (const Bytes& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
}

Bytes head(const Bytes& b, size_t n) { return Bytes(b.begin(), b.begin() + n); }

Bytes u16(size_t v) { return {static_cast<uint8_t>(v >> 8), static_cast<uint8_t>(v)}; }
Bytes u24(size_t v) {
    return {static_cast<uint8_t>(v >> 16), static_cast<uint8_t>(v >> 8), static_cast<uint8_t>(v)};
}
Bytes vec8(const Bytes& b) { return cat({{static_cast<uint8_t>(b.size())}, b}); }
Bytes vec16(const Bytes& b) { return cat({u16(b.size()), b}); }

// The parser with its input and scratch, which the views of a Complete answer point into: they
// stay valid until the next call.
struct Parser {
    Bytes input;
    Bytes work = Bytes(kMaxSize);
    Parse operator()(Bytes in, size_t max_size = kMaxSize) {
        input = std::move(in);
        return parse(input, max_size, work);
    }
    bool inWork(std::string_view v) const {
        return v.data() >= reinterpret_cast<const char*>(work.data()) &&
               v.data() + v.size() <= reinterpret_cast<const char*>(work.data() + work.size());
    }
};

// Only the status: the scratch is shared (and not zeroed) between calls, as a worker's is.
Status statusOf(const Bytes& input, size_t max_size = kMaxSize) {
    static Bytes work(kMaxSize);
    return parse(input, max_size, work).status;
}

Names protocols(std::string_view alpn) {
    Names out;
    forEachProtocol(alpn, [&](std::string_view p) {
        out.emplace_back(p);
        return true;
    });
    return out;
}

// --- building hellos by hand -----------------------------------------------------------------

Bytes ext(uint16_t type, const Bytes& data) { return cat({u16(type), vec16(data)}); }

// server_name with the given (name_type, name) entries, RFC 6066 3.
Bytes sniEntries(std::initializer_list<std::pair<uint8_t, std::string>> entries) {
    Bytes list;
    for (const auto& [type, name] : entries) list = cat({list, {type}, vec16(bytes(name))});
    return ext(0, vec16(list));
}
Bytes sni(const std::string& host) { return sniEntries({{0, host}}); }

Bytes alpnList(const Names& names) {
    Bytes list;
    for (const std::string& n : names) list = cat({list, vec8(bytes(n))});
    return list;
}
Bytes alpn(const Names& names) { return ext(16, vec16(alpnList(names))); }

// The usual TLS 1.3 companions, so a hand-built hello looks like one.
const Bytes kSupportedVersions = ext(43, {0x04, 0x03, 0x04, 0x03, 0x03});
const Bytes kSupportedGroups = ext(10, vec16({0x00, 0x1d, 0x00, 0x17}));

struct Body {
    uint16_t version = 0x0303;
    Bytes session_id = Bytes(32, 0x5e);
    Bytes suites{0x13, 0x01, 0x13, 0x02, 0xc0, 0x2f};
    Bytes compression{0x00};
    std::optional<Bytes> extensions;  // the block without its length; nullopt: no block at all
};

Bytes body(const Body& b) {
    Bytes out = cat({u16(b.version), Bytes(32, 0xab), vec8(b.session_id), vec16(b.suites),
                     vec8(b.compression)});
    if (b.extensions) out = cat({out, vec16(*b.extensions)});
    return out;
}

Bytes handshake(const Bytes& body, uint8_t type = 1) {
    return cat({{type}, u24(body.size()), body});
}

Bytes record(const Bytes& fragment, uint8_t type = 22, uint16_t version = 0x0301) {
    return cat({{type}, u16(version), u16(fragment.size()), fragment});
}

// A whole hello in one record, with this extension block.
Bytes helloWith(const Bytes& extensions) {
    Body b;
    b.extensions = extensions;
    return record(handshake(body(b)));
}

// The handshake message again in records of `size` bytes (the last one shorter).
Bytes split(const Bytes& message, size_t size, uint16_t version = 0x0301) {
    Bytes out;
    out.reserve(message.size() + (message.size() / size + 1) * 5);
    for (size_t at = 0; at < message.size(); at += size) {
        const size_t n = std::min(size, message.size() - at);
        const Bytes header = {22, static_cast<uint8_t>(version >> 8), static_cast<uint8_t>(version),
                              static_cast<uint8_t>(n >> 8), static_cast<uint8_t>(n)};
        out.insert(out.end(), header.begin(), header.end());
        out.insert(out.end(), message.begin() + at, message.begin() + at + n);
    }
    return out;
}

// The handshake messages carried by a run of handshake records, as the test sees them: the
// fragments end to end (each capture holds exactly one message).
Bytes handshakeOf(const Bytes& records) {
    Bytes out;
    for (size_t at = 0; at + 5 <= records.size();) {
        const size_t n = size_t{records[at + 3]} << 8 | records[at + 4];
        out.insert(out.end(), records.begin() + at + 5, records.begin() + at + 5 + n);
        at += 5 + n;
    }
    return out;
}

size_t recordCount(const Bytes& records) {
    size_t count = 0;
    for (size_t at = 0; at + 5 <= records.size(); ++count) {
        at += 5 + (size_t{records[at + 3]} << 8 | records[at + 4]);
    }
    return count;
}

// --- captured hellos -------------------------------------------------------------------------

// Real ClientHellos, sent to a loopback listener by tests/data/hellos/capture.py (README.md
// there says how each was made and what it holds). The size and the record count are checked
// first, so that a re-capture that changed them is noticed before the expectations below are.
struct Capture {
    const char* file;
    size_t size;
    size_t records;
    std::string sni;
    Names alpn;
};

const Names kH2 = {"h2", "http/1.1"};

std::vector<Capture> captures() {
    return {
        {"openssl_sni_alpn.bin", 339, 1, "api.example.com", kH2},
        {"openssl_tls12.bin", 230, 1, "api.example.com", kH2},
        {"openssl_no_sni.bin", 297, 1, "", {}},
        {"curl.bin", 517, 1, "api.example.com", kH2},
        {"python_sni_alpn.bin", 517, 1, "api.example.com", kH2},
        {"python_big_alpn.bin", 30602, 2, "api.example.com", {}},  // 300 names, checked apart
        {"python_many_ciphers.bin", 517, 1, "api.example.com", {}},
        {"wget_gnutls.bin", 517, 1, "localhost", {}},
        {"go.bin", 1525, 1, "api.example.com", kH2},
        {"java.bin", 482, 1, "api.example.com", kH2},
    };
}

Bytes load(const std::string& file) {
    const std::string path = std::string(ZCRELAY_SOURCE_DIR) + "/tests/data/hellos/" + file;
    std::ifstream in(path, std::ios::binary);
    EXPECT_TRUE(in) << path;
    return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// What python_big_alpn offered: capture.py's big_alpn().
Names bigAlpn() {
    Names out;
    for (int i = 0; i < 300; ++i) {
        const std::string number = std::to_string(i);
        std::string name = "proto-" + std::string(3 - number.size(), '0') + number + "-";
        name.resize(100, 'x');
        out.push_back(name);
    }
    return out;
}

Names expectedAlpn(const Capture& c) {
    return std::string(c.file) == "python_big_alpn.bin" ? bigAlpn() : c.alpn;
}

void expectNames(const Parse& p, const Capture& c) {
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_EQ(p.hello.sni, c.sni);
    EXPECT_EQ(protocols(p.hello.alpn), expectedAlpn(c));
    EXPECT_EQ(p.hello.version, 0x0303);
    EXPECT_FALSE(p.hello.ech);
}

TEST(TlsHelloCaptured, CompleteWithTheirNames) {
    for (const Capture& c : captures()) {
        SCOPED_TRACE(c.file);
        const Bytes hello = load(c.file);
        ASSERT_EQ(hello.size(), c.size);
        ASSERT_EQ(recordCount(hello), c.records);
        Parser parser;
        const Parse p = parser(hello);
        expectNames(p, c);
        // One record: read in place; several: reassembled in `work`.
        if (!p.hello.sni.empty()) {
            EXPECT_EQ(parser.inWork(p.hello.sni), c.records > 1);
        }
    }
}

TEST(TlsHelloCaptured, WhatFollowsTheHelloIsNotLookedAt) {
    // A ChangeCipherSpec and early data (RFC 8446 D.4, 2.3), then bytes of no protocol at all.
    const Bytes after = cat({record({0x01}, 20, 0x0303), record(Bytes(40, 0x99), 23, 0x0303),
                             bytes("GET / HTTP/1.1\r\n")});
    for (const Capture& c : captures()) {
        SCOPED_TRACE(c.file);
        Parser parser;
        expectNames(parser(cat({load(c.file), after})), c);
    }
}

size_t exactNeed(const Bytes& records, size_t k) {
    if (k < 2) return k + 1;
    for (size_t at = 0;;) {
        if (k < at + 5) return at + 5;
        const size_t end = at + 5 + (size_t{records[at + 3]} << 8 | records[at + 4]);
        if (k < end) return end;
        at = end;
    }
}

TEST(TlsHelloCaptured, EveryPrefixIsIncompleteWithAReachableNeed) {
    for (const Capture& c : captures()) {
        SCOPED_TRACE(c.file);
        const Bytes hello = load(c.file);
        Bytes work(kMaxSize);
        for (size_t k = 0; k < hello.size(); ++k) {
            const Parse p = parse({hello.data(), k}, kMaxSize, work);
            ASSERT_EQ(p.status, Status::Incomplete) << "prefix of " << k << " bytes";
            // More than there is, and no more than the hello: a reader that waits for `need`
            // bytes (SO_RCVLOWAT) is never stranded by a client that sent its hello and waits.
            ASSERT_GT(p.need, k);
            ASSERT_LE(p.need, hello.size()) << "prefix of " << k << " bytes";
            // And exactly: the next byte while the first two may still say NotTls, then the
            // end of the record header or of the record the prefix ends in (a capture's hello
            // ends with its last record).
            ASSERT_EQ(p.need, exactNeed(hello, k)) << "prefix of " << k << " bytes";
        }
    }
}

TEST(TlsHelloCaptured, FeedingNeedBytesConverges) {
    for (const Capture& c : captures()) {
        SCOPED_TRACE(c.file);
        const Bytes hello = load(c.file);
        Parser parser;
        size_t have = 0;
        std::vector<size_t> steps;
        Parse p;
        for (;;) {
            p = parse({hello.data(), have}, kMaxSize, parser.work);
            if (p.status != Status::Incomplete) break;
            ASSERT_GT(p.need, have);
            ASSERT_LE(p.need, hello.size());
            have = p.need;
            steps.push_back(have);
        }
        expectNames(p, c);
        // Byte 1, byte 2, the record header, then the end of each record: a reader woken at
        // `need` parses once per record, not once per segment.
        std::vector<size_t> expected{1, 2, 5};
        for (size_t at = 0; at < hello.size();) {
            const size_t end = at + 5 + (size_t{hello[at + 3]} << 8 | hello[at + 4]);
            if (at > 0) expected.push_back(at + 5);
            expected.push_back(end);
            at = end;
        }
        EXPECT_EQ(steps, expected);
    }
}

// `wake` is where the ClientHello can end at the earliest: a reader that waits for it (as the
// relay does with SO_RCVLOWAT) reaches the verdict in a few wake-ups even when a client cuts its
// hello into 1-byte records, where waiting for each record's end would take two per byte.
TEST(TlsHelloCaptured, FeedingWakeBytesConvergesInFewSteps) {
    for (const Capture& c : captures()) {
        SCOPED_TRACE(c.file);
        const Bytes message = handshakeOf(load(c.file));
        for (size_t size : {size_t{1}, size_t{7}, size_t{16384}}) {
            SCOPED_TRACE(size);
            const Bytes hello = split(message, size);
            if (hello.size() > kMaxSize) continue;
            Parser parser;
            size_t have = 0;
            size_t steps = 0;
            Parse p;
            for (;;) {
                p = parse({hello.data(), have}, kMaxSize, parser.work);
                if (p.status != Status::Incomplete) break;
                ASSERT_GE(p.wake, p.need);
                ASSERT_LE(p.wake, hello.size()) << "never past the hello's real end";
                have = p.wake;
                ++steps;
            }
            expectNames(p, c);
            // Each step gets at least a sixth closer to the end (a 1-byte record is 6 bytes):
            // logarithmic in the size, ~60 for 16 KiB, against ~2 per record without it.
            EXPECT_LE(steps, size == 1 ? 80u : 12u) << hello.size() << " bytes";
        }
    }
}

TEST(TlsHelloCaptured, AnyRecordSizeGivesTheSameHello) {
    for (const Capture& c : captures()) {
        SCOPED_TRACE(c.file);
        const Bytes message = handshakeOf(load(c.file));
        Parser parser;
        // The names as the captured records give them (checked above), as bytes: what every
        // other split must give too.
        const Parse whole = parser(load(c.file));
        expectNames(whole, c);
        const std::string sni(whole.hello.sni), alpn(whole.hello.alpn);
        for (size_t size = 1; size <= std::min(message.size(), kMaxRecordLength); ++size) {
            const Bytes records = split(message, size);
            const Parse p = parser(records, records.size());  // the bound is exact
            ASSERT_EQ(p.status, Status::Complete) << "records of " << size << " bytes";
            ASSERT_EQ(p.hello.sni, sni) << "records of " << size << " bytes";
            ASSERT_EQ(p.hello.alpn, alpn) << "records of " << size << " bytes";
            ASSERT_EQ(p.hello.version, whole.hello.version);
            // One byte less and the last record header cannot fit any more.
            ASSERT_EQ(parser(records, records.size() - 1).status, Status::TooLarge)
                << "records of " << size << " bytes";
        }
    }
}
ZCRELAY_LABEL(TlsHelloCaptured, AnyRecordSizeGivesTheSameHello, "", test::kSanitizeSkip,
              "the tls_hello fuzzer runs this parser under ASan+UBSan; it has no threads for TSan");

TEST(TlsHelloCaptured, EveryRecordVersionIsTaken) {
    // RFC 8446 5.1: legacy_record_version is 0x0301 or 0x0303 in practice, and to be ignored;
    // SSL 3.0 and a future 3.4 are taken too.
    for (const Capture& c : captures()) {
        SCOPED_TRACE(c.file);
        const Bytes message = handshakeOf(load(c.file));
        for (uint16_t version = 0x0300; version <= 0x0304; ++version) {
            Parser parser;
            expectNames(parser(split(message, kMaxRecordLength, version)), c);
        }
        EXPECT_EQ(statusOf(split(message, kMaxRecordLength, 0x0305)), Status::Malformed);
        EXPECT_EQ(statusOf(split(message, kMaxRecordLength, 0x0203)), Status::NotTls);
    }
}

TEST(TlsHelloCaptured, TooLargeOnTheLengthsAlone) {
    for (const Capture& c : captures()) {
        SCOPED_TRACE(c.file);
        const Bytes hello = load(c.file);
        EXPECT_EQ(statusOf(hello, hello.size()), Status::Complete);
        EXPECT_EQ(statusOf(hello, hello.size() - 1), Status::TooLarge);
        // Refused once the handshake header (bytes 5..8) says how long the hello is, without
        // waiting for the rest; before that a prefix is only Incomplete, with a need that fits.
        Bytes work(kMaxSize);
        for (size_t k = 0; k < hello.size(); ++k) {
            const Parse p = parse({hello.data(), k}, hello.size() - 1, work);
            if (k < 9) {
                ASSERT_EQ(p.status, Status::Incomplete) << k;
                ASSERT_LE(p.need, hello.size() - 1);
            } else {
                ASSERT_EQ(p.status, Status::TooLarge) << k;
            }
        }
    }
}

TEST(TlsHelloCaptured, WorkSmallerThanMaxSizeLowersTheBound) {
    const Bytes hello = load("python_big_alpn.bin");
    Bytes work(hello.size() - 1);
    EXPECT_EQ(parse(hello, kMaxSize, work).status, Status::TooLarge);
    work.resize(hello.size());
    EXPECT_EQ(parse(hello, kMaxSize, work).status, Status::Complete);
}

// --- hand-built hellos -----------------------------------------------------------------------

TEST(TlsHelloParse, MinimalHelloWithoutExtensions) {
    // RFC 5246 7.4.1.2: a TLS 1.0-1.2 hello may end after compression_methods.
    Body b;
    b.version = 0x0301;
    b.session_id = {};
    b.suites = {0x00, 0x2f};
    const Bytes hello = record(handshake(body(b)));
    EXPECT_EQ(hello.size(), kMinHelloLength);
    Parser parser;
    const Parse p = parser(hello);
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_EQ(p.hello.version, 0x0301);
    EXPECT_TRUE(p.hello.sni.empty());
    EXPECT_TRUE(p.hello.alpn.empty());
    EXPECT_FALSE(p.hello.ech);
    EXPECT_EQ(statusOf(hello, kMinHelloLength), Status::Complete);
    EXPECT_EQ(statusOf(hello, kMinHelloLength - 1), Status::TooLarge);
}

TEST(TlsHelloParse, EmptyExtensionBlock) {
    Parser parser;
    const Parse p = parser(helloWith({}));
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_TRUE(p.hello.sni.empty());
}

TEST(TlsHelloParse, SniAndAlpn) {
    Parser parser;
    const Parse p =
        parser(helloWith(cat({sni("API.Example.com"), kSupportedVersions, alpn({"h2"})})));
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_EQ(p.hello.sni, "API.Example.com");  // as sent: matching is the router's business
    EXPECT_EQ(p.hello.alpn, "\x02h2");
}

TEST(TlsHelloParse, GreaseIsIgnored) {
    // RFC 8701 as Chrome sends it: a GREASE cipher suite first, GREASE extensions first and
    // last (the last one with a byte of data), a GREASE group and a GREASE version.
    Body b;
    b.suites = {0x2a, 0x2a, 0x13, 0x01, 0x13, 0x02};
    b.extensions =
        cat({ext(0x0a0a, {}), sni("api.example.com"), ext(10, vec16({0x6a, 0x6a, 0x00, 0x1d})),
             ext(43, {0x06, 0xba, 0xba, 0x03, 0x04, 0x03, 0x03}), alpn(kH2), ext(0xfafa, {0x00})});
    Parser parser;
    const Parse p = parser(record(handshake(body(b))));
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_EQ(p.hello.sni, "api.example.com");
    EXPECT_EQ(protocols(p.hello.alpn), kH2);

    // Every GREASE value is one, and the same one twice is not a duplicate: they are ignored.
    Bytes all;
    for (int i = 0; i < 16; ++i) {
        const uint16_t g = static_cast<uint16_t>(i << 12 | 0x0a00 | i << 4 | 0x0a);
        all = cat({all, ext(g, {}), ext(g, {1, 2, 3})});
    }
    EXPECT_EQ(statusOf(helloWith(cat({all, sni("a")}))), Status::Complete);
    // Values that only look like GREASE are real types, which may not repeat.
    for (uint16_t v : {0x0a1a, 0x1a0a, 0x0a0b, 0x0b0a}) {
        EXPECT_EQ(statusOf(helloWith(cat({ext(v, {}), ext(v, {})}))), Status::Malformed) << v;
    }
}

TEST(TlsHelloParse, PaddingIsSkipped) {
    // RFC 7685: zeros, any length; up to a 512-byte hello, as OpenSSL and BoringSSL pad.
    for (size_t n : {0u, 1u, 200u, 1000u}) {
        Parser parser;
        const Parse p = parser(helloWith(cat({sni("api.example.com"), ext(21, Bytes(n, 0))})));
        ASSERT_EQ(p.status, Status::Complete) << n;
        EXPECT_EQ(p.hello.sni, "api.example.com");
    }
}

TEST(TlsHelloParse, AbsentSni) {
    Parser parser;
    const Parse p = parser(helloWith(cat({kSupportedVersions, alpn(kH2)})));
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_TRUE(p.hello.sni.empty());
    EXPECT_EQ(protocols(p.hello.alpn), kH2);
}

TEST(TlsHelloParse, EchMarksTheOuterName) {
    // ECHClientHello: outer(0), cipher suite, config id, enc, payload: opaque to us.
    const Bytes ech = cat(
        {{0x00, 0x00, 0x01, 0x00, 0x01, 0x42}, vec16(Bytes(32, 0xe1)), vec16(Bytes(200, 0xe2))});
    Parser parser;
    const Parse p = parser(helloWith(cat({sni("public.example.com"), ext(0xfe0d, ech)})));
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_TRUE(p.hello.ech);
    EXPECT_EQ(p.hello.sni, "public.example.com");
    // The inner hello's "ech_is_inner" form is one byte; presence is all that counts.
    EXPECT_TRUE(parser(helloWith(ext(0xfe0d, {0x01}))).hello.ech);
    EXPECT_FALSE(parser(helloWith(sni("a"))).hello.ech);
}

TEST(TlsHelloParse, ServerNameTakesTheFirstHostName) {
    Parser parser;
    Parse p = parser(helloWith(sniEntries({{1, "not-a-host-name"}, {0, "api.example.com"}})));
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_EQ(p.hello.sni, "api.example.com");

    p = parser(helloWith(sniEntries({{0, "first.example"}, {0, "second.example"}})));
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_EQ(p.hello.sni, "first.example");

    // Only names of another type: no host name to route by.
    p = parser(helloWith(sniEntries({{7, "x"}})));
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_TRUE(p.hello.sni.empty());

    // 255 bytes is the longest DNS name (RFC 1035 2.3.4).
    const std::string longest(kMaxServerName, 'a');
    p = parser(helloWith(sni(longest)));
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_EQ(p.hello.sni, longest);
}

TEST(TlsHelloParse, NeedBeforeAndInsideTheFirstRecord) {
    Parser parser;
    EXPECT_EQ(parser({}).status, Status::Incomplete);
    EXPECT_EQ(parser({}).need, 1u);
    EXPECT_EQ(parser({22}).need, 2u);
    EXPECT_EQ(parser({22, 3}).need, 5u);
    EXPECT_EQ(parser({22, 3, 1, 0}).need, 5u);
    const Bytes hello = helloWith(sni("api.example.com"));
    EXPECT_EQ(parser(head(hello, 5)).need, hello.size());
    EXPECT_EQ(parser(head(hello, 7)).need, hello.size());
}

TEST(TlsHelloParse, NeedStopsAtTheHelloInsideALongerRecord) {
    // The record goes on after the handshake message (RFC 8446 5.1 lets messages be coalesced):
    // the answer comes at the message's end, and a record longer than max_size is waited for
    // only up to max_size.
    const Bytes message = handshake(body(Body{}));
    const Bytes hello = record(cat({message, Bytes(16000, 0)}));
    const size_t end = 5 + message.size();
    Parser parser;
    EXPECT_EQ(parser(head(hello, 7), 200).need, 200u);
    EXPECT_EQ(parser(head(hello, 9), 200).need, end);
    EXPECT_EQ(parser(head(hello, end - 1), 200).need, end);
    EXPECT_EQ(parser(head(hello, end), 200).status, Status::Complete);
    EXPECT_EQ(parser(hello, 200).status, Status::Complete);
    EXPECT_EQ(parser(head(hello, 9), end - 1).status, Status::TooLarge);
}

TEST(TlsHelloParse, NotTlsOnTheFirstByteThatSaysSo) {
    EXPECT_EQ(statusOf(bytes("G")), Status::NotTls);
    EXPECT_EQ(statusOf(bytes("GET / HTTP/1.1\r\nHost: a\r\n\r\n")), Status::NotTls);
    EXPECT_EQ(statusOf(bytes("SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n")), Status::NotTls);
    EXPECT_EQ(statusOf(bytes("PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n")), Status::NotTls);
    // An SSLv2-compatible hello (RFC 5246 E.2): a 2-byte length with the high bit set, then
    // msg_type 1 and version 3.1; RFC 8446 D.5 says not to take it.
    const Bytes sslv2{0x80, 0x2e, 0x01, 0x03, 0x01, 0x00, 0x15, 0x00, 0x00, 0x00, 0x10};
    EXPECT_EQ(statusOf(head(sslv2, 1)), Status::NotTls);
    EXPECT_EQ(statusOf(sslv2), Status::NotTls);
    EXPECT_EQ(statusOf({0x16, 0x02}), Status::NotTls);  // a handshake byte, then no SSL 3 / TLS
    EXPECT_EQ(statusOf({0x16, 0x03, 0x05}), Status::Malformed);  // TLS, but no version we know
    EXPECT_EQ(statusOf({0x17, 0x03, 0x03}), Status::NotTls);     // application data first
    // A max_size below the smallest hello refuses everything before a byte is looked at, the
    // empty input included: no `need` could be within it.
    EXPECT_EQ(statusOf({}, kMinHelloLength - 1), Status::TooLarge);
    EXPECT_EQ(statusOf(bytes("G"), 0), Status::TooLarge);
}

TEST(TlsHelloParse, HandshakeSplitOverRecords) {
    const Bytes message = handshake(body(Body{.extensions = cat({sni("api.example.com")})}));
    // The handshake header itself cut: 1 byte, then 3, then the rest.
    const Bytes records =
        cat({record(head(message, 1)), record(Bytes(message.begin() + 1, message.begin() + 4)),
             record(Bytes(message.begin() + 4, message.end()))});
    Parser parser;
    const Parse p = parser(records);
    ASSERT_EQ(p.status, Status::Complete);
    EXPECT_EQ(p.hello.sni, "api.example.com");
    EXPECT_TRUE(parser.inWork(p.hello.sni));
    // The records may carry different versions (the field is ignored).
    const Bytes mixed = cat({record(head(message, 10), 22, 0x0301),
                             record(Bytes(message.begin() + 10, message.end()), 22, 0x0303)});
    EXPECT_EQ(statusOf(mixed), Status::Complete);
}

struct BadCase {
    const char* name;
    Bytes data;
    Status status = Status::Malformed;
};

Bytes helloBody(Body b) { return record(handshake(body(b))); }

std::vector<BadCase> badCases() {
    const Bytes good_message = handshake(body(Body{.extensions = sni("api.example.com")}));
    const Bytes first = head(good_message, 20);
    const Bytes rest(good_message.begin() + 20, good_message.end());

    // An extension block whose length says one byte more or less than there is.
    Body b;
    const Bytes exts = sni("api.example.com");
    const Bytes fixed = cat({u16(b.version), Bytes(32, 0xab), vec8(b.session_id), vec16(b.suites),
                             vec8(b.compression)});
    auto withBlock = [&](const Bytes& block_with_length) {
        return record(handshake(cat({fixed, block_with_length})));
    };

    Body session33;
    session33.session_id = Bytes(33, 1);
    Body odd_suites;
    odd_suites.suites = {0x13, 0x01, 0x13};
    Body no_suites;
    no_suites.suites = {};
    Body no_compression;
    no_compression.compression = {};

    // The handshake length one more or less than the body (the record length follows it).
    const Bytes hs_body = body(Body{.extensions = exts});
    const Bytes hs_short = cat({{1}, u24(hs_body.size() - 1), hs_body});
    const Bytes hs_long = cat({{1}, u24(hs_body.size() + 1), hs_body});

    return {
        // record layer
        {"zero-length record", record({})},
        {"zero-length record after a fragment", cat({record(first), record({}), record(rest)})},
        {"record longer than 2^14",
         cat({{22, 3, 1}, u16(kMaxRecordLength + 1), Bytes(kMaxRecordLength + 1, 0)})},
        {"record version 3.5", record(good_message, 22, 0x0305)},
        {"alert between fragments", cat({record(first), record({2, 40}, 21), record(rest)})},
        {"change_cipher_spec between fragments",
         cat({record(first), record({1}, 20), record(rest)})},
        {"application data between fragments",
         cat({record(first), record({1, 2, 3}, 23), record(rest)})},
        {"SSLv2 header between fragments", cat({record(first), Bytes{0x80, 0x2e, 0x01}})},
        {"second record version 2", cat({record(first), record(rest, 22, 0x0203)})},
        // handshake header
        {"handshake type 2 (server_hello)", record(handshake(body(Body{}), 2))},
        {"handshake type 0", record(handshake(body(Body{}), 0))},
        {"handshake type alone", record({2})},
        {"handshake length below the smallest hello", record(cat({{1}, u24(40), Bytes(40, 0)}))},
        {"handshake length one short", record(hs_short)},
        {"handshake length one long, record ends", cat({record(hs_long), record({0})})},
        // ClientHello body
        {"session id of 33", helloBody(session33)},
        {"session id past the end",
         record(handshake(cat({u16(0x0303), Bytes(32, 0), {40}, Bytes(8, 0)})))},
        {"odd cipher suites", helloBody(odd_suites)},
        {"no cipher suites", helloBody(no_suites)},
        {"no compression methods", helloBody(no_compression)},
        {"compression past the end",
         record(handshake(cat({u16(0x0303), Bytes(32, 0), {0}, vec16({0, 0x2f}), {5, 0}})))},
        {"extension block one long", withBlock(cat({u16(exts.size() + 1), exts}))},
        {"extension block one short", withBlock(cat({u16(exts.size() - 1), exts}))},
        {"a byte after the extension block", withBlock(cat({vec16(exts), {0}}))},
        {"a lone byte for the block length", withBlock({0})},
        {"extension header cut", helloWith(cat({exts, {0x00, 0x0a, 0x00}}))},
        {"extension data past the block", helloWith(cat({exts, {0x00, 0x0a, 0x00, 0x05, 1}}))},
        // extensions
        {"duplicate server_name", helloWith(cat({sni("a.example"), sni("b.example")}))},
        {"duplicate supported_groups",
         helloWith(cat({kSupportedGroups, sni("a"), kSupportedGroups}))},
        {"duplicate unknown type", helloWith(cat({ext(0x1234, {}), ext(0x1234, {1})}))},
        {"duplicate padding", helloWith(cat({ext(21, {0}), ext(21, {0})}))},
        {"duplicate ech", helloWith(cat({ext(0xfe0d, {1}), ext(0xfe0d, {1})}))},
        {"server_name empty", helloWith(ext(0, {}))},
        {"server_name list empty", helloWith(ext(0, vec16({})))},
        {"server_name list one long", helloWith(ext(0, cat({u16(6), {0}, vec16(bytes("ab"))})))},
        {"server_name list one short", helloWith(ext(0, cat({u16(4), {0}, vec16(bytes("ab"))})))},
        {"server_name byte after the list",
         helloWith(ext(0, cat({vec16(cat({{0}, vec16(bytes("ab"))})), {0}})))},
        {"server_name entry cut", helloWith(ext(0, vec16({0, 0x00})))},
        {"server_name name past the list", helloWith(ext(0, vec16({0, 0x00, 0x05, 'a', 'b'})))},
        {"host_name empty", helloWith(sni(""))},
        {"host_name of 256", helloWith(sni(std::string(256, 'a')))},
        {"bad entry after the host_name",
         helloWith(ext(0, vec16(cat({{0}, vec16(bytes("a")), {1, 0x00}}))))},
        {"alpn empty", helloWith(ext(16, {}))},
        {"alpn list empty", helloWith(ext(16, vec16({})))},
        {"alpn empty name", helloWith(ext(16, vec16({2, 'h', '2', 0})))},
        {"alpn name past the list", helloWith(ext(16, vec16({3, 'h', '2'})))},
        {"alpn list one long", helloWith(ext(16, cat({u16(4), {2, 'h', '2'}})))},
        {"alpn list one short", helloWith(ext(16, cat({u16(2), {2, 'h', '2'}})))},
        {"alpn byte after the list", helloWith(ext(16, cat({vec16({2, 'h', '2'}), {0}})))},
    };
}

TEST(TlsHelloParse, MalformedAtEachLevel) {
    for (const BadCase& c : badCases()) {
        EXPECT_EQ(statusOf(c.data), c.status) << c.name;
    }
}

TEST(TlsHelloParse, MalformedStaysMalformedWithMoreBytes) {
    // The verdict must not depend on how much the peek happened to see.
    const Bytes more = cat({record(Bytes(100, 0x16)), bytes("trailing")});
    for (const BadCase& c : badCases()) {
        EXPECT_EQ(statusOf(cat({c.data, more})), c.status) << c.name;
    }
}

TEST(TlsHelloParse, NoPrefixOfABadHelloIsComplete) {
    // Each prefix is Incomplete (with a need within the bytes that follow, or past them) or
    // already the final verdict: never a different answer.
    for (const BadCase& c : badCases()) {
        for (size_t k = 0; k < c.data.size(); ++k) {
            const Status s = statusOf(head(c.data, k));
            ASSERT_TRUE(s == Status::Incomplete || s == c.status) << c.name << " at " << k;
        }
    }
}

TEST(TlsHelloParse, MalformedEarlyWhenTheBytesSaySo) {
    // No waiting for the rest of a record that is already wrong.
    EXPECT_EQ(statusOf({22, 3, 1, 0, 0}), Status::Malformed);               // zero-length record
    EXPECT_EQ(statusOf({22, 3, 1, 0x40, 0x01}), Status::Malformed);         // 2^14 + 1
    EXPECT_EQ(statusOf({22, 3, 1, 1, 0, 2}), Status::Malformed);            // server_hello
    EXPECT_EQ(statusOf({22, 3, 1, 1, 0, 1, 0, 0, 40}), Status::Malformed);  // too short a hello
    EXPECT_EQ(statusOf({22, 3, 1, 0, 1, 1, 21}), Status::Malformed);  // an alert after a fragment
}

TEST(TlsHelloParse, TooLargeOnTheHandshakeLength) {
    // 16 MB announced: refused on the header, whatever max_size short of it.
    const Bytes header{22, 3, 1, 0x40, 0x00, 1, 0xff, 0xff, 0xff};
    EXPECT_EQ(statusOf(header), Status::TooLarge);
    // 20000 bytes of hello need two records at least: 20004 + 2 * 5 bytes of input.
    const Bytes two{22, 3, 1, 0x40, 0x00, 1, 0x00, 0x4e, 0x20};
    EXPECT_EQ(statusOf(two, 20004 + 10 - 1), Status::TooLarge);
    EXPECT_EQ(statusOf(two, 20004 + 10), Status::Incomplete);
    // A chain of 1-byte records: each header counts. The bound cannot know that the client will
    // use so many; it counts the headers read and the one more that must come while the rest
    // does not fit the current record: TooLarge on the second-to-last header, not before.
    const Bytes message = handshake(body(Body{}));
    const Bytes tiny = split(message, 1);
    EXPECT_EQ(statusOf(tiny, tiny.size()), Status::Complete);
    EXPECT_EQ(statusOf(tiny, tiny.size() - 1), Status::TooLarge);
    EXPECT_EQ(statusOf(head(tiny, tiny.size() - 12), tiny.size() - 1), Status::Incomplete);
    EXPECT_EQ(statusOf(head(tiny, tiny.size() - 7), tiny.size() - 1), Status::TooLarge);
}

// --- ALPN helpers --------------------------------------------------------------------------

const std::string kH2Alpn = "\x02h2\x08http/1.1";

TEST(TlsHelloProtocols, ForEachInOrder) {
    EXPECT_EQ(protocols(kH2Alpn), kH2);
    EXPECT_EQ(protocols(""), Names{});
    std::vector<std::string> seen;
    forEachProtocol(kH2Alpn, [&](std::string_view p) { seen.emplace_back(p); });  // void f
    EXPECT_EQ(seen, kH2);
}

TEST(TlsHelloProtocols, StopsWhenToldTo) {
    int calls = 0;
    forEachProtocol(kH2Alpn, [&](std::string_view p) {
        ++calls;
        return p != "h2";
    });
    EXPECT_EQ(calls, 1);
}

TEST(TlsHelloProtocols, AnUnvalidatedListIsNotOverrun) {
    EXPECT_EQ(protocols(std::string_view("\x02h2\x09http/1.1")), Names{"h2"});
    EXPECT_EQ(protocols(std::string_view("\x02h2\x00\x02h3", 6)), Names{"h2"});
}

TEST(TlsHelloProtocols, JoinCutsAtAProtocolBoundary) {
    auto joined = [](std::string_view alpn, size_t room) {
        std::vector<char> out(room, '#');
        const size_t n = joinProtocols(alpn, out);
        EXPECT_LE(n, room);
        EXPECT_TRUE(std::all_of(out.begin() + n, out.end(), [](char c) { return c == '#'; }));
        return std::string(out.data(), n);
    };
    EXPECT_EQ(joined(kH2Alpn, 64), "h2,http/1.1");
    EXPECT_EQ(joined(kH2Alpn, 11), "h2,http/1.1");
    EXPECT_EQ(joined(kH2Alpn, 10), "h2");
    EXPECT_EQ(joined(kH2Alpn, 3), "h2");
    EXPECT_EQ(joined(kH2Alpn, 2), "h2");
    EXPECT_EQ(joined(kH2Alpn, 1), "");
    EXPECT_EQ(joined(kH2Alpn, 0), "");
    EXPECT_EQ(joined("", 8), "");
    // Cut, it stays cut: a shorter protocol after a long one that did not fit is not squeezed in.
    EXPECT_EQ(joined("\x02h2\x08http/1.1\x02h3", 8), "h2");
}

TEST(TlsHelloProtocols, JoinTheBigCapture) {
    Parser parser;
    const Parse p = parser(load("python_big_alpn.bin"));
    ASSERT_EQ(p.status, Status::Complete);
    std::vector<char> out(64 * 1024);
    const size_t n = joinProtocols(p.hello.alpn, out);
    EXPECT_EQ(n, 300u * 100 + 299);
    std::vector<char> small(250);
    EXPECT_EQ(joinProtocols(p.hello.alpn, small), 201u);  // two names and their comma
}

}  // namespace
}  // namespace zcrelay::tls_hello
