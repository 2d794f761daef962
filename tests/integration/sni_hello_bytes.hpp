#pragma once
// The bytes of a client's first flight, as the SNI cases (sni_*_test.cpp) build and check them:
// the TLS record layer and a ClientHello's server_name and ALPN read by hand, and the PROXY
// headers a client puts in front. Written out here from the RFCs, so the relay's own parser
// (proxy/tls_hello.hpp) never checks itself.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "support/bytes.hpp"

namespace zcrelay::test::sni_routing_test {

// =============================================================================================
// Bytes and the TLS record layer, written out here from RFC 8446 (5.1, 4.1.2) and RFC 6066 /
// RFC 7301 for the two extensions: the relay's own parser is never used to check itself.

inline uint16_t be16(const std::string& s, size_t at) {
    return static_cast<uint16_t>(static_cast<uint8_t>(s[at]) << 8 |
                                 static_cast<uint8_t>(s[at + 1]));
}
inline uint32_t be24(const std::string& s, size_t at) {
    return static_cast<uint32_t>(static_cast<uint8_t>(s[at])) << 16 | be16(s, at + 1);
}

// Where two byte strings first differ, for failure messages.
inline std::string firstDifference(const std::string& got, const std::string& want) {
    size_t i = 0;
    while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
    std::ostringstream os;
    os << "got " << got.size() << " bytes, sent " << want.size() << "; first difference at byte "
       << i << ": got " << hex(got.substr(i, 16)) << " instead of " << hex(want.substr(i, 16));
    return os.str();
}

inline constexpr size_t kNotHandshake = std::string::npos;

// How many bytes of `stream` carry its first handshake message: the handshake records up to the
// one that completes it. 0 while it is incomplete, kNotHandshake if the stream starts otherwise.
inline size_t helloExtent(const std::string& stream) {
    size_t at = 0;
    size_t message = 0;  // handshake bytes seen so far
    uint32_t need = 0;   // the message's length once its 4-byte header is in
    for (int record = 0; record < 100'000 && at + 5 <= stream.size(); ++record) {
        if (stream[at] != 0x16) return kNotHandshake;
        size_t len = be16(stream, at + 3);
        if (at + 5 + len > stream.size()) return 0;
        for (size_t i = 0; i < len; ++i, ++message) {
            if (message >= 1 && message <= 3)
                need = need << 8 | static_cast<uint8_t>(stream[at + 5 + i]);
        }
        at += 5 + len;
        if (message >= 4 && message >= 4 + need) return at;
    }
    return 0;
}

// The first handshake message of `records` (their fragments put back together).
inline std::string handshakeMessage(const std::string& records) {
    std::string message;
    for (size_t at = 0; at + 5 <= records.size();) {
        size_t len = be16(records, at + 3);
        message.append(records, at + 5, len);
        at += 5 + len;
    }
    if (message.size() >= 4) message.resize(std::min(message.size(), 4 + size_t{be24(message, 1)}));
    return message;
}

// `message` in handshake records of these fragment sizes in turn, the last taking what is left
// (a zero size is skipped). The record header is 0x16 0x03 0x01 and the fragment's length, as
// clients write their first records.
inline std::string frame(const std::string& message, const std::vector<size_t>& sizes) {
    std::string out;
    size_t at = 0;
    auto record = [&](size_t n) {
        out += std::string("\x16\x03\x01", 3);
        putBe16(out, static_cast<uint16_t>(n));
        out.append(message, at, n);
        at += n;
    };
    for (size_t s : sizes) {
        if (s == 0 || at + s >= message.size()) continue;
        record(s);
    }
    if (at < message.size()) record(message.size() - at);
    return out;
}

inline std::string frameEvery(const std::string& message, size_t fragment) {
    return frame(message, std::vector<size_t>(message.size() / fragment + 1, fragment));
}

// The records of `framed`, each on its own.
inline std::vector<std::string> recordsOf(const std::string& framed) {
    std::vector<std::string> out;
    for (size_t at = 0; at + 5 <= framed.size() && out.size() < 100'000;) {
        size_t len = 5 + be16(framed, at + 3);
        out.push_back(framed.substr(at, len));
        at += len;
    }
    return out;
}

// What a ClientHello says, read by hand (RFC 8446 4.1.2): its server name (the host_name entry
// of server_name) and the protocols of its ALPN extension.
struct HelloFields {
    bool parsed = false;
    std::optional<std::string> sni;
    size_t sni_at = 0;  // offset of the host name in the handshake message
    std::vector<std::string> alpn;
};

inline HelloFields parseHello(const std::string& m) {
    HelloFields f;
    if (m.size() < 4 || m[0] != 0x01) return f;
    size_t end = 4 + be24(m, 1);
    if (end > m.size()) return f;
    size_t p = 4 + 2 + 32;  // legacy_version, random
    auto need = [&](size_t n) { return p + n <= end; };
    if (!need(1)) return f;
    p += 1 + static_cast<uint8_t>(m[p]);  // legacy_session_id
    if (!need(2)) return f;
    p += 2 + be16(m, p);  // cipher_suites
    if (!need(1)) return f;
    p += 1 + static_cast<uint8_t>(m[p]);  // legacy_compression_methods
    if (p == end) {
        f.parsed = true;  // no extensions at all
        return f;
    }
    if (!need(2)) return f;
    size_t ext_end = p + 2 + be16(m, p);
    p += 2;
    if (ext_end > end) return f;
    for (int n = 0; n < 1000 && p + 4 <= ext_end; ++n) {
        uint16_t type = be16(m, p);
        size_t len = be16(m, p + 2);
        size_t data = p + 4;
        if (data + len > ext_end) return f;
        if (type == 0 && len >= 5) {  // server_name: list length, name type, name length, name
            size_t name_len = be16(m, data + 3);
            if (data + 5 + name_len > data + len) return f;
            f.sni = m.substr(data + 5, name_len);
            f.sni_at = data + 5;
        } else if (type == 16 && len >= 2) {  // ALPN: list length, then length-prefixed names
            size_t q = data + 2;
            for (int k = 0; k < 10'000 && q < data + len; ++k) {
                size_t l = static_cast<uint8_t>(m[q]);
                if (q + 1 + l > data + len) return f;
                f.alpn.push_back(m.substr(q + 1, l));
                q += 1 + l;
            }
        }
        p = data + len;
    }
    f.parsed = true;
    return f;
}

// PROXY headers as a client puts them in front (proxy_protocol_fixture.hpp builds the same by hand
// from the spec): 192.0.2.10:40000 -> 198.51.100.20:443.
inline const std::string kProxyV1 = "PROXY TCP4 192.0.2.10 198.51.100.20 40000 443\r\n";
inline std::string proxyV2() {
    std::string h("\r\n\r\n\0\r\nQUIT\n", 12);
    h += std::string("\x21\x11\x00\x0c", 4);                  // v2 PROXY, TCP over IPv4, 12 bytes
    h += std::string("\xc0\x00\x02\x0a\xc6\x33\x64\x14", 8);  // 192.0.2.10, 198.51.100.20
    h += std::string("\x9c\x40\x01\xbb", 4);                  // 40000, 443
    return h;
}

}  // namespace zcrelay::test::sni_routing_test
