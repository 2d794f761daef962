#include "tls_hello.hpp"

#include <algorithm>
#include <array>
#include <cstring>

namespace zcrelay::tls_hello {
namespace {

// RFC 8446 5.1: ContentType handshake(22); legacy_record_version is {3, x}: 3.0 (SSL 3) to 3.4.
// A first ClientHello is often sent in a 3.1 record "for compatibility" (RFC 8446 5.1), and the
// field "MUST be ignored for all purposes", so any minor from 0 to 4 goes.
constexpr uint8_t kContentHandshake = 22;
constexpr uint8_t kRecordMajor = 3;
constexpr uint8_t kMaxRecordMinor = 4;
constexpr size_t kRecordLengthAt = 3;

// RFC 8446 4: a handshake message is msg_type(1) and a 24-bit length, then the body.
constexpr uint8_t kClientHello = 1;
constexpr size_t kHandshakeHeaderLength = 4;
constexpr size_t kMinHandshake = kMinHelloLength - kRecordHeaderLength;

// RFC 8446 4.1.2: Random is 32 bytes; legacy_session_id is opaque<0..32>.
constexpr size_t kRandomLength = 32;
constexpr size_t kMaxSessionId = 32;

// Extension types (IANA TLS ExtensionType registry).
constexpr uint16_t kServerName = 0;       // RFC 6066 3
constexpr uint16_t kAlpn = 16;            // RFC 7301 3.1
constexpr uint16_t kPadding = 21;         // RFC 7685
constexpr uint16_t kEch = 0xfe0d;         // encrypted_client_hello, draft-ietf-tls-esni
constexpr uint8_t kNameTypeHostName = 0;  // RFC 6066 3: NameType host_name(0)

Parse status(Status s) {
    Parse p;
    p.status = s;
    return p;
}

Parse incomplete(size_t need, size_t wake) {
    Parse p;
    p.need = need;
    p.wake = std::max(need, wake);
    return p;
}

uint16_t be16(const uint8_t* p) { return static_cast<uint16_t>(p[0] << 8 | p[1]); }
size_t be24(const uint8_t* p) { return size_t{p[0]} << 16 | size_t{p[1]} << 8 | p[2]; }

// RFC 8701 2: the GREASE values are 0x0a0a, 0x1a1a, ... 0xfafa. A client sends them to keep
// servers from choking on values they do not know, and a server treats them as any value it
// does not know: they are skipped, and two of them are not a duplicate (a real type twice is).
bool isGrease(uint16_t v) { return (v & 0x0f0f) == 0x0a0a && (v >> 8) == (v & 0xff); }

// The least number of input bytes the ClientHello can still take, when its next byte would be at
// input offset `at`, the current record has `left` bytes after it, and `remaining` bytes of the
// handshake message are still to come: what does not fit in this record needs more records, each
// with its header and at most 2^14 bytes (RFC 8446 5.1). A lower bound that depends only on the
// lengths read, not on how many bytes arrived, so TooLarge is the same answer for every prefix
// that shows those lengths, and a reader is never asked to wait for bytes it will refuse.
size_t helloEndAtLeast(size_t at, size_t left, size_t remaining) {
    if (remaining <= left) return at + remaining;
    const size_t beyond = remaining - left;
    const size_t records = (beyond + kMaxRecordLength - 1) / kMaxRecordLength;
    return at + remaining + records * kRecordHeaderLength;
}

// A cursor over one TLS vector that never reads past its end: each read either takes its bytes
// or fails and leaves the cursor where it was. Failure always means Malformed: every length in a
// ClientHello must fit inside its parent (RFC 8446 3.4, vectors).
class Reader {
  public:
    explicit Reader(std::span<const uint8_t> bytes) : rest_(bytes) {}

    bool empty() const { return rest_.empty(); }

    bool u8(uint8_t& out) {
        if (rest_.empty()) return false;
        out = rest_[0];
        rest_ = rest_.subspan(1);
        return true;
    }
    bool u16(uint16_t& out) {
        if (rest_.size() < 2) return false;
        out = be16(rest_.data());
        rest_ = rest_.subspan(2);
        return true;
    }
    bool bytes(size_t n, std::span<const uint8_t>& out) {
        if (rest_.size() < n) return false;
        out = rest_.first(n);
        rest_ = rest_.subspan(n);
        return true;
    }
    // A vector with a 1-byte or a 2-byte length in front (RFC 8446 3.4).
    bool vector8(std::span<const uint8_t>& out) {
        uint8_t n = 0;
        std::span<const uint8_t> saved = rest_;
        if (u8(n) && bytes(n, out)) return true;
        rest_ = saved;
        return false;
    }
    bool vector16(std::span<const uint8_t>& out) {
        uint16_t n = 0;
        std::span<const uint8_t> saved = rest_;
        if (u16(n) && bytes(n, out)) return true;
        rest_ = saved;
        return false;
    }

  private:
    std::span<const uint8_t> rest_;
};

std::string_view text(std::span<const uint8_t> b) {
    return {reinterpret_cast<const char*>(b.data()), b.size()};
}

// RFC 6066 3: extension_data is a ServerNameList, ServerName server_name_list<1..2^16-1>, each a
// NameType byte and, for host_name, HostName<1..2^16-1>. RFC 6066 defines no other NameType;
// RFC 3546 gave every name the same 16-bit length, and Go's crypto/tls reads unknown types that
// way, so an entry of another type is skipped by its length and the first host_name is taken.
// A host_name longer than a DNS name (RFC 1035 2.3.4: 255 octets) matches no route and is
// refused rather than cut. Later host_name entries (RFC 6066 forbids a second) are not used.
bool parseServerName(std::span<const uint8_t> data, ClientHello& hello) {
    Reader ext(data);
    std::span<const uint8_t> list;
    if (!ext.vector16(list) || !ext.empty() || list.empty()) return false;
    Reader entries(list);
    while (!entries.empty()) {
        uint8_t type = 0;
        std::span<const uint8_t> name;
        if (!entries.u8(type) || !entries.vector16(name)) return false;
        if (type != kNameTypeHostName || !hello.sni.empty()) continue;
        if (name.empty() || name.size() > kMaxServerName) return false;
        hello.sni = text(name);
    }
    return true;
}

// RFC 7301 3.1: extension_data is ProtocolNameList, ProtocolName protocol_name_list<2..2^16-1>,
// each ProtocolName<1..2^8-1>, the list filling the extension exactly. Validated here whole, so
// forEachProtocol() and joinProtocols() can walk it without checks of their own.
bool parseAlpn(std::span<const uint8_t> data, ClientHello& hello) {
    Reader ext(data);
    std::span<const uint8_t> list;
    if (!ext.vector16(list) || !ext.empty() || list.empty()) return false;
    Reader names(list);
    while (!names.empty()) {
        std::span<const uint8_t> name;
        if (!names.vector8(name) || name.empty()) return false;
    }
    hello.alpn = text(list);
    return true;
}

// RFC 8446 4.1.2: Extension extensions<8..2^16-1> (RFC 5246 7.4.1.2: <0..2^16-1>, so an empty
// block is taken), each extension_type(2) and extension_data<0..2^16-1> (RFC 8446 4.2), filling
// the block exactly. 4.2: "There MUST NOT be more than one extension of the same type in a
// given extension block": a hello with a type twice is one that two readers could take
// differently (the first server_name or the last?), so it is refused rather than routed by a
// guess.
bool parseExtensions(std::span<const uint8_t> block, ClientHello& hello) {
    // Every type seen, one bit each: 8 KiB on the stack, cleared once per complete hello. A
    // block of 64 KiB holds up to 16383 extensions, and comparing each with the ones before
    // would be quadratic in what an attacker sends.
    std::array<uint64_t, 65536 / 64> seen{};
    Reader exts(block);
    while (!exts.empty()) {
        uint16_t type = 0;
        std::span<const uint8_t> data;
        if (!exts.u16(type) || !exts.vector16(data)) return false;
        if (isGrease(type)) continue;
        uint64_t& word = seen[type / 64];
        const uint64_t bit = uint64_t{1} << (type % 64);
        if (word & bit) return false;
        word |= bit;
        switch (type) {
            case kServerName:
                if (!parseServerName(data, hello)) return false;
                break;
            case kAlpn:
                if (!parseAlpn(data, hello)) return false;
                break;
            case kEch:
                // The payload (ECHClientHello) is for the backend to decrypt; its presence is
                // all a router can use: the server_name beside it is the public name.
                hello.ech = true;
                break;
            case kPadding:  // RFC 7685: zeros to move the hello out of a size some servers hang on
            default:        // anything else is the backend's business
                break;
        }
    }
    return true;
}

// RFC 8446 4.1.2 (and RFC 5246 7.4.1.2 for 1.0 to 1.2): `msg` is the whole handshake message,
// its 4-byte header included.
Parse parseClientHello(std::span<const uint8_t> msg) {
    Reader body(msg.subspan(kHandshakeHeaderLength));
    uint16_t version = 0;
    std::span<const uint8_t> random, session_id, suites, compression;
    if (!body.u16(version) || !body.bytes(kRandomLength, random) || !body.vector8(session_id) ||
        !body.vector16(suites) || !body.vector8(compression)) {
        return status(Status::Malformed);
    }
    // legacy_session_id<0..32>; cipher_suites<2..2^16-2>, two bytes each (GREASE values among
    // them are just suites the backend will not pick); legacy_compression_methods<1..2^8-1>.
    if (session_id.size() > kMaxSessionId || suites.size() < 2 || suites.size() % 2 != 0 ||
        compression.empty()) {
        return status(Status::Malformed);
    }
    Parse p = status(Status::Complete);
    p.hello.version = version;
    // RFC 5246 7.4.1.2: "the presence of extensions can be detected by determining whether
    // there are bytes following the compression_methods at the end of the ClientHello". A TLS
    // 1.3 hello always has some (supported_versions), but that is for the backend to refuse.
    if (body.empty()) return p;
    std::span<const uint8_t> extensions;
    // The extensions end the message: bytes after them mean a length somewhere is wrong.
    if (!body.vector16(extensions) || !body.empty() || !parseExtensions(extensions, p.hello)) {
        return status(Status::Malformed);
    }
    return p;
}

}  // namespace

Parse parse(std::span<const uint8_t> input, size_t max_size, std::span<uint8_t> work) {
    // A handshake reassembled in `work` must fit there; a caller that gave less room than it
    // allowed gets the smaller bound rather than an overrun.
    max_size = std::min(max_size, work.size());
    if (max_size < kMinHelloLength) return status(Status::TooLarge);

    size_t pos = 0;       // where the current record's header starts in `input`
    size_t got = 0;       // handshake message bytes gathered so far (header included)
    size_t total = 0;     // the handshake message's length, header included; 0 until known
    bool direct = false;  // the message lies whole in the first record: parsed in place
    // Each pass reads one record. RFC 8446 5.1: "Handshake messages MAY be coalesced into a
    // single TLSPlaintext record or fragmented across several records", so the ClientHello's
    // header and body may be cut anywhere, down to one byte per record; a large one (post-
    // quantum key shares, a long ALPN or cipher list) is cut at 2^14 by the client itself.
    for (bool first = true;; first = false) {
        const size_t avail = input.size() - pos;
        // The header, a byte at a time so that the answer comes with the first byte that
        // decides it. On the first record a wrong type or major version means the client speaks
        // something else (HTTP's "G", SSH's "S", an SSLv2-compatible hello's high bit: RFC 8446
        // Appendix D.5 says not to accept those), which a router may want to send elsewhere.
        // After it, RFC 8446 5.1: "Handshake messages MUST NOT be interleaved with other record
        // types": a client that began a handshake and sends anything else is broken.
        const Status wrong = first ? Status::NotTls : Status::Malformed;
        if (avail >= 1 && input[pos] != kContentHandshake) return status(wrong);
        if (avail >= 2 && input[pos + 1] != kRecordMajor) return status(wrong);
        if (avail >= 3 && input[pos + 2] > kMaxRecordMinor) return status(Status::Malformed);
        if (avail < kRecordHeaderLength) {
            const size_t remaining = (total != 0 ? total : kMinHandshake) - got;
            return incomplete(first && avail < 2 ? input.size() + 1 : pos + kRecordHeaderLength,
                              std::min(helloEndAtLeast(pos, 0, remaining), max_size));
        }
        // RFC 8446 5.1: "The length MUST NOT exceed 2^14 bytes", and "Implementations MUST NOT
        // send zero-length fragments of Handshake types".
        const size_t length = be16(&input[pos + kRecordLengthAt]);
        if (length == 0 || length > kMaxRecordLength) return status(Status::Malformed);
        const size_t body = pos + kRecordHeaderLength;
        const size_t end = body + length;
        const size_t remaining = (total != 0 ? total : kMinHandshake) - got;
        if (helloEndAtLeast(body, length, remaining) > max_size) return status(Status::TooLarge);

        size_t at = body;
        const size_t stop = std::min(end, input.size());
        // The handshake header, also a byte at a time: it may be split over records too. Its
        // bytes go to `work` even when the message turns out to lie whole in the first record;
        // 4 bytes, and it keeps one path for both.
        while (total == 0 && at < stop) {
            work[got++] = input[at++];
            if (got == 1 && work[0] != kClientHello) return status(Status::Malformed);
            if (got == kHandshakeHeaderLength) {
                total = kHandshakeHeaderLength + be24(&work[1]);
                if (total < kMinHandshake) return status(Status::Malformed);
                // Refused on the length alone: the bytes need not arrive first.
                if (helloEndAtLeast(at, end - at, total - got) > max_size) {
                    return status(Status::TooLarge);
                }
                direct = first && total <= length;
            }
        }
        if (total != 0) {
            const size_t take = std::min(stop - at, total - got);
            if (!direct) std::memcpy(work.data() + got, input.data() + at, take);
            got += take;
            at += take;
            if (got == total) {
                // Whatever follows (the rest of this record, early data, a ChangeCipherSpec) is
                // not looked at: the verdict must not depend on how much of it has arrived. RFC
                // 8446 5.1 wants a ClientHello to end its record; the backend checks that.
                return parseClientHello({direct ? input.data() + body : work.data(), total});
            }
        }
        if (at < end) {
            // The input ended inside this record. The client sends whole records, so its end is
            // a safe wait; the message's end, if known and earlier, is where the answer comes.
            // Before the message length is known the record may run past max_size while a
            // message inside it still fits: then the wait is for max_size bytes, which a client
            // sending that record reaches anyway.
            const size_t need = total != 0 ? std::min(end, at + (total - got)) : end;
            const size_t remaining = (total != 0 ? total : kMinHandshake) - got;
            return incomplete(std::min(need, max_size),
                              std::min(helloEndAtLeast(at, end - at, remaining), max_size));
        }
        pos = end;
    }
}

size_t joinProtocols(std::string_view alpn, std::span<char> out) {
    size_t n = 0;
    forEachProtocol(alpn, [&](std::string_view protocol) {
        const size_t comma = n == 0 ? 0 : 1;
        if (comma + protocol.size() > out.size() - n) return false;
        if (comma != 0) out[n++] = ',';
        std::memcpy(out.data() + n, protocol.data(), protocol.size());
        n += protocol.size();
        return true;
    });
    return n;
}

}  // namespace zcrelay::tls_hello
