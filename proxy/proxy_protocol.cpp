#include "proxy_protocol.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <optional>

namespace zcrelay::proxy_protocol {
namespace {

// Where the v2 fixed part keeps its fields, after the signature.
constexpr size_t kVerCmdAt = 12;
constexpr size_t kFamilyAt = 13;
constexpr size_t kLengthAt = 14;
// v2 byte 12: the high nibble is the version, the low one the command.
constexpr uint8_t kV2Version = 0x2;
constexpr uint8_t kCommandLocal = 0x0;
constexpr uint8_t kCommandProxy = 0x1;
// v2 byte 13: address family in the high nibble, transport in the low one.
constexpr uint8_t kFamilyUnspec = 0x00;
constexpr uint8_t kFamilyTcp4 = 0x11;
constexpr uint8_t kFamilyTcp6 = 0x21;
constexpr uint8_t kFamilyUnixStream = 0x31;
// Address block sizes: two addresses then, for INET/INET6, two ports; UNIX: two 108-byte paths.
constexpr size_t kV2AddrLenInet = 12;
constexpr size_t kV2AddrLenInet6 = 36;
constexpr size_t kV2AddrLenUnix = 216;
// A TLV: type, 16-bit big-endian length, value.
constexpr size_t kTlvHeaderLength = 3;

constexpr std::string_view kV1Prefix = "PROXY ";
constexpr std::string_view kV1Unknown = "UNKNOWN";

// One v1 protocol that carries addresses. The shortest address is what inet_pton accepts
// ("0.0.0.0", "::"); the longest is INET*_ADDRSTRLEN less its NUL (IPv6 with a dotted IPv4 tail
// "ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255" is 45).
struct V1Protocol {
    std::string_view token;
    int family;
    size_t min_address;
    size_t max_address;
};
constexpr V1Protocol kTcp4{"TCP4", AF_INET, 7, INET_ADDRSTRLEN - 1};
constexpr V1Protocol kTcp6{"TCP6", AF_INET6, 2, INET6_ADDRSTRLEN - 1};

// The four fields after "PROXY TCPx ": source, destination, source port, destination port.
constexpr size_t kV1Fields = 4;

size_t fieldMin(const V1Protocol& p, size_t field) { return field < 2 ? p.min_address : 1; }
// Each field ends with a space but the last, which ends the line with CRLF.
size_t fieldSeparator(size_t field) { return field + 1 < kV1Fields ? 1 : 2; }

// The shortest complete line for a protocol: "PROXY TCP4 0.0.0.0 0.0.0.0 0 0\r\n" is 32 bytes,
// "PROXY TCP6 :: :: 0 0\r\n" 22.
size_t v1MinLength(const V1Protocol& p) {
    size_t n = kV1Prefix.size() + p.token.size() + 1;
    for (size_t f = 0; f < kV1Fields; ++f) n += fieldMin(p, f) + fieldSeparator(f);
    return n;
}

ParseResult malformed(ProxyError e) {
    ParseResult r;
    r.kind = ParseResult::Malformed;
    r.error = e;
    return r;
}

// `need` is the shortest header this prefix can still become. A v1 line that cannot end within
// 107 bytes any more is refused now rather than after the reader waited for bytes in vain.
ParseResult incomplete(size_t need, size_t bound) {
    if (need > bound) return malformed(ProxyError::TooLong);
    ParseResult r;
    r.kind = ParseResult::Incomplete;
    r.need = static_cast<uint32_t>(need);
    return r;
}

ParseResult done(size_t length) {
    ParseResult r;
    r.kind = ParseResult::Done;
    r.length = static_cast<uint32_t>(length);
    return r;
}

bool isDigit(uint8_t c) { return c >= '0' && c <= '9'; }
bool isHexDigit(uint8_t c) {
    return isDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

bool addressChar(const V1Protocol& p, uint8_t c) {
    if (p.family == AF_INET) return isDigit(c) || c == '.';
    return isHexDigit(c) || c == ':' || c == '.';
}

SocketAddress makeAddress(int family, const uint8_t* addr, uint16_t port_host) {
    SocketAddress a;
    if (family == AF_INET) {
        auto& sin = *reinterpret_cast<sockaddr_in*>(&a.storage);
        sin.sin_family = AF_INET;
        std::memcpy(&sin.sin_addr, addr, sizeof(in_addr));
        a.length = sizeof(sockaddr_in);
    } else {
        auto& sin6 = *reinterpret_cast<sockaddr_in6*>(&a.storage);
        sin6.sin6_family = AF_INET6;
        std::memcpy(&sin6.sin6_addr, addr, sizeof(in6_addr));
        a.length = sizeof(sockaddr_in6);
    }
    a.setPort(port_host);
    return a;
}

// "PROXY UNKNOWN" has been seen at data[0..13): a CRLF ends it, or a space and anything
// without CR or LF, then CRLF.
ParseResult parseV1Unknown(std::span<const uint8_t> data) {
    size_t pos = kV1Prefix.size() + kV1Unknown.size();
    if (pos == data.size()) return incomplete(kMinLength, kV1MaxLength);
    if (data[pos] == ' ') {
        ++pos;
        const size_t end = std::min(data.size(), kV1MaxLength);
        while (pos < end && data[pos] != '\r') {
            if (data[pos] == '\n') return malformed(ProxyError::BadV1);
            ++pos;
        }
        if (pos == data.size() || pos == end) return incomplete(pos + 2, kV1MaxLength);
    }
    if (data[pos] != '\r') return malformed(ProxyError::BadV1);
    if (pos + 2 > kV1MaxLength) return malformed(ProxyError::TooLong);
    if (pos + 1 == data.size()) return incomplete(pos + 2, kV1MaxLength);
    if (data[pos + 1] != '\n') return malformed(ProxyError::BadV1);
    return done(pos + 2);
}

ParseResult parseV1(std::span<const uint8_t> data) {
    // "PROXY ": anything else in the first six bytes ("POST /", "PUT ") is another protocol.
    for (size_t i = 0; i < kV1Prefix.size(); ++i) {
        if (i == data.size()) return incomplete(kMinLength, kV1MaxLength);
        if (data[i] != static_cast<uint8_t>(kV1Prefix[i])) return malformed(ProxyError::NotProxy);
    }

    // The protocol token, matched against the three names while it may still be a prefix of one.
    size_t pos = kV1Prefix.size();
    size_t end = pos;
    while (end < data.size() && end - pos <= kV1Unknown.size() && data[end] != ' ' &&
           data[end] != '\r' && data[end] != '\n') {
        ++end;
    }
    const std::string_view token(reinterpret_cast<const char*>(data.data()) + pos, end - pos);
    if (token == kV1Unknown) return parseV1Unknown(data);
    const V1Protocol* proto = token == kTcp4.token   ? &kTcp4
                              : token == kTcp6.token ? &kTcp6
                                                     : nullptr;
    if (end == data.size() && proto == nullptr) {
        size_t need = SIZE_MAX;
        if (kV1Unknown.starts_with(token)) need = std::min(need, kMinLength);
        if (kTcp4.token.starts_with(token)) need = std::min(need, v1MinLength(kTcp4));
        if (kTcp6.token.starts_with(token)) need = std::min(need, v1MinLength(kTcp6));
        if (need == SIZE_MAX) return malformed(ProxyError::BadV1);
        return incomplete(need, kV1MaxLength);
    }
    if (proto == nullptr) return malformed(ProxyError::BadV1);
    pos = end;
    if (pos == data.size()) return incomplete(v1MinLength(*proto), kV1MaxLength);
    if (data[pos] != ' ') return malformed(ProxyError::BadV1);
    ++pos;

    // Source, destination, source port, destination port: every byte is checked as it comes,
    // so a wrong one is refused without waiting for the line to end.
    std::array<std::array<uint8_t, sizeof(in6_addr)>, 2> addresses{};
    std::array<uint16_t, 2> ports{};
    for (size_t field = 0; field < kV1Fields; ++field) {
        const bool is_address = field < 2;
        const size_t start = pos;
        uint32_t port = 0;
        const size_t limit = std::min(data.size(), kV1MaxLength);
        while (pos < limit && data[pos] != ' ' && data[pos] != '\r' && data[pos] != '\n') {
            const uint8_t c = data[pos];
            if (is_address) {
                if (!addressChar(*proto, c) || pos - start >= proto->max_address) {
                    return malformed(ProxyError::BadAddress);
                }
            } else {
                // A leading zero would make "080" and "80" two spellings of one port.
                if (!isDigit(c) || (pos > start && data[start] == '0')) {
                    return malformed(ProxyError::BadV1);
                }
                port = port * 10 + (c - '0');
                if (port > 65535) return malformed(ProxyError::BadV1);
            }
            ++pos;
        }
        if (pos == limit) {
            size_t need =
                start + std::max(fieldMin(*proto, field), pos - start) + fieldSeparator(field);
            for (size_t f = field + 1; f < kV1Fields; ++f) {
                need += fieldMin(*proto, f) + fieldSeparator(f);
            }
            return incomplete(need, kV1MaxLength);
        }
        if (pos == start) return malformed(ProxyError::BadV1);  // two spaces, or " \r"
        const bool last_field = field + 1 == kV1Fields;
        if (data[pos] != (last_field ? '\r' : ' ')) return malformed(ProxyError::BadV1);
        if (is_address) {
            char host[INET6_ADDRSTRLEN] = {};
            std::memcpy(host, data.data() + start, pos - start);
            if (inet_pton(proto->family, host, addresses[field].data()) != 1) {
                return malformed(ProxyError::BadAddress);
            }
        } else {
            ports[field - 2] = static_cast<uint16_t>(port);
        }
        ++pos;
    }
    // pos is just past the CR.
    if (pos + 1 > kV1MaxLength) return malformed(ProxyError::TooLong);
    if (pos == data.size()) return incomplete(pos + 1, kV1MaxLength);
    if (data[pos] != '\n') return malformed(ProxyError::BadV1);

    ParseResult r = done(pos + 1);
    r.has_addresses = true;
    r.src = makeAddress(proto->family, addresses[0].data(), ports[0]);
    r.dst = makeAddress(proto->family, addresses[1].data(), ports[1]);
    return r;
}

// The address block a PROXY command's family needs; nullopt for the ones a TCP relay refuses
// (UDP, UNIX DGRAM, anything unassigned).
std::optional<size_t> v2AddressLength(uint8_t family) {
    if (family == kFamilyUnspec) return 0;
    if (family == kFamilyTcp4) return kV2AddrLenInet;
    if (family == kFamilyTcp6) return kV2AddrLenInet6;
    if (family == kFamilyUnixStream) return kV2AddrLenUnix;
    return std::nullopt;
}

uint16_t readBe16(const uint8_t* p) { return static_cast<uint16_t>((p[0] << 8) | p[1]); }

ParseResult parseV2(std::span<const uint8_t> data, size_t max_size) {
    const size_t have = std::min(data.size(), kV2Signature.size());
    if (std::memcmp(data.data(), kV2Signature.data(), have) != 0) {
        return malformed(ProxyError::NotProxy);
    }
    if (data.size() > kVerCmdAt) {
        if ((data[kVerCmdAt] >> 4) != kV2Version) return malformed(ProxyError::BadV2Version);
        const uint8_t command = data[kVerCmdAt] & 0x0F;
        if (command != kCommandLocal && command != kCommandProxy) {
            return malformed(ProxyError::BadCommand);
        }
    }
    const bool is_proxy = data.size() > kVerCmdAt && (data[kVerCmdAt] & 0x0F) == kCommandProxy;
    size_t address_length = 0;
    if (data.size() > kFamilyAt && is_proxy) {
        const std::optional<size_t> n = v2AddressLength(data[kFamilyAt]);
        if (!n) return malformed(ProxyError::BadFamily);
        address_length = *n;
    }
    if (data.size() < kV2FixedLength) return incomplete(kV2FixedLength, SIZE_MAX);

    const size_t block = readBe16(&data[kLengthAt]);
    const size_t total = kV2FixedLength + block;
    if (total > max_size) return malformed(ProxyError::TooLong);
    if (block < address_length) return malformed(ProxyError::BadLength);
    if (data.size() < total) return incomplete(total, SIZE_MAX);
    if (!is_proxy) return done(total);  // LOCAL: the block is not ours to read

    // TLVs fill the rest of the block exactly; one that claims more than is left means the
    // sender and we disagree on the layout, and nothing after it can be trusted.
    size_t pos = kV2FixedLength + address_length;
    while (pos < total) {
        if (total - pos < kTlvHeaderLength) return malformed(ProxyError::BadTlv);
        const size_t value_length = readBe16(&data[pos + 1]);
        if (total - pos - kTlvHeaderLength < value_length) return malformed(ProxyError::BadTlv);
        pos += kTlvHeaderLength + value_length;
    }

    ParseResult r = done(total);
    const uint8_t* a = &data[kV2FixedLength];
    if (data[kFamilyAt] == kFamilyTcp4) {
        r.has_addresses = true;
        r.src = makeAddress(AF_INET, a, readBe16(a + 8));
        r.dst = makeAddress(AF_INET, a + 4, readBe16(a + 10));
    } else if (data[kFamilyAt] == kFamilyTcp6) {
        r.has_addresses = true;
        r.src = makeAddress(AF_INET6, a, readBe16(a + 32));
        r.dst = makeAddress(AF_INET6, a + 16, readBe16(a + 34));
    }
    return r;
}

// Appends to the fixed-size output; every header fits (kMaxWrite), so no bound checks.
struct Writer {
    std::span<uint8_t, kMaxWrite> out;
    size_t pos = 0;

    void bytes(const void* p, size_t n) {
        std::memcpy(out.data() + pos, p, n);
        pos += n;
    }
    void text(std::string_view s) { bytes(s.data(), s.size()); }
    void byte(uint8_t b) { out[pos++] = b; }
    void be16(uint16_t v) {
        byte(static_cast<uint8_t>(v >> 8));
        byte(static_cast<uint8_t>(v));
    }
    void decimal(uint16_t v) {
        char buf[8];
        const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
        (void)ec;
        bytes(buf, static_cast<size_t>(end - buf));
    }
    void host(const SocketAddress& a) {
        char buf[INET6_ADDRSTRLEN] = {};
        inet_ntop(a.family(), rawAddress(a), buf, sizeof(buf));
        text(buf);
    }
    static const void* rawAddress(const SocketAddress& a) {
        if (a.family() == AF_INET) {
            return &reinterpret_cast<const sockaddr_in*>(&a.storage)->sin_addr;
        }
        return &reinterpret_cast<const sockaddr_in6*>(&a.storage)->sin6_addr;
    }
};

const in6_addr& in6(const SocketAddress& a) {
    return reinterpret_cast<const sockaddr_in6*>(&a.storage)->sin6_addr;
}

SocketAddress unmapped(const SocketAddress& a) {
    return makeAddress(AF_INET, &in6(a).s6_addr[12], a.port());
}

}  // namespace

size_t writeHeader(Version v, const SocketAddress& src_in, const SocketAddress& dst_in,
                   std::span<uint8_t, kMaxWrite> out) {
    SocketAddress src = src_in;
    SocketAddress dst = dst_in;
    if (src.family() == AF_INET6 && dst.family() == AF_INET6 && IN6_IS_ADDR_V4MAPPED(&in6(src)) &&
        IN6_IS_ADDR_V4MAPPED(&in6(dst))) {
        src = unmapped(src);
        dst = unmapped(dst);
    }
    const bool inet =
        src.family() == dst.family() && (src.family() == AF_INET || src.family() == AF_INET6);

    Writer w{out};
    if (v == Version::V1) {
        w.text(kV1Prefix);
        if (!inet) {
            w.text(kV1Unknown);
        } else {
            w.text(src.family() == AF_INET ? kTcp4.token : kTcp6.token);
            w.byte(' ');
            w.host(src);
            w.byte(' ');
            w.host(dst);
            w.byte(' ');
            w.decimal(src.port());
            w.byte(' ');
            w.decimal(dst.port());
        }
        w.text("\r\n");
        return w.pos;
    }

    w.bytes(kV2Signature.data(), kV2Signature.size());
    if (!inet) {
        w.byte(kV2Version << 4 | kCommandLocal);
        w.byte(kFamilyUnspec);
        w.be16(0);
        return w.pos;
    }
    const bool v4 = src.family() == AF_INET;
    const size_t address_size = v4 ? sizeof(in_addr) : sizeof(in6_addr);
    w.byte(kV2Version << 4 | kCommandProxy);
    w.byte(v4 ? kFamilyTcp4 : kFamilyTcp6);
    w.be16(static_cast<uint16_t>(v4 ? kV2AddrLenInet : kV2AddrLenInet6));
    w.bytes(Writer::rawAddress(src), address_size);
    w.bytes(Writer::rawAddress(dst), address_size);
    w.be16(src.port());
    w.be16(dst.port());
    return w.pos;
}

ParseResult parse(std::span<const uint8_t> data, size_t max_size) {
    if (data.empty()) return incomplete(kMinLength, SIZE_MAX);
    if (data[0] == static_cast<uint8_t>(kV1Prefix[0])) return parseV1(data);
    if (data[0] == kV2Signature[0]) return parseV2(data, max_size);
    return malformed(ProxyError::NotProxy);
}

}  // namespace zcrelay::proxy_protocol
