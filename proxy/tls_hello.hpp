#pragma once
// The TLS ClientHello, read for routing: the relay peeks at a client's first bytes (without
// consuming them: the backend terminates TLS and must see the same bytes) and picks the backend
// cluster by the server name (SNI, RFC 6066 section 3) and the offered application protocols
// (ALPN, RFC 7301). Nothing here decrypts, answers or verifies anything; a hello this parser
// takes may still be refused by the backend, which is the one speaking TLS.
//
// The bytes come from an unauthenticated client, so the parser is strict about structure (every
// length must fit its parent exactly), never reads past the input, allocates nothing, keeps no
// state between calls (call it again with more bytes) and runs in O(input) time.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>

namespace zcrelay::tls_hello {

// RFC 8446 5.1: a TLSPlaintext record is a 5-byte header (type, legacy_record_version,
// length) and at most 2^14 bytes of fragment.
inline constexpr size_t kRecordHeaderLength = 5;
inline constexpr size_t kMaxRecordLength = 16384;
// The smallest ClientHello there can be: a record header, the handshake header (type and a
// 24-bit length, RFC 8446 4), legacy_version, random, an empty session id, one cipher suite and
// one compression method (RFC 8446 4.1.2, RFC 5246 7.4.1.2), no extensions. A max_size below this
// refuses every input as TooLarge.
inline constexpr size_t kMinHelloLength = kRecordHeaderLength + 4 + 2 + 32 + 1 + 2 + 2 + 1 + 1;
// RFC 1035 2.3.4: a DNS name is at most 255 octets; RFC 6066 allows a longer HostName on the
// wire, but no server name a route can match is longer.
inline constexpr size_t kMaxServerName = 255;

enum class Status : uint8_t {
    Incomplete,  // a valid prefix: call again once `need` bytes are there
    Complete,    // the whole ClientHello is there and parsed
    NotTls,      // the first bytes are not a TLS handshake record: another protocol (or SSLv2)
    Malformed,   // a TLS handshake record, but not one a conforming client sends
    TooLarge,    // the ClientHello cannot end within max_size bytes
};

struct ClientHello {
    // The host_name of server_name, as sent (case kept, not checked to be a DNS name: compare
    // it, do not trust it, e.g. in a log line); empty if absent. 1..255 bytes when present.
    std::string_view sni;
    // The raw ProtocolNameList body of application_layer_protocol_negotiation (the bytes after
    // its 2-byte length): one length byte then 1..255 name bytes per protocol, validated, so
    // forEachProtocol() and joinProtocols() read it as is; empty if absent.
    std::string_view alpn;
    // encrypted_client_hello (0xfe0d) present: `sni` is the outer (public) name, the real one
    // is encrypted for the backend (or is GREASE ECH, which looks the same from here).
    bool ech = false;
    // legacy_version of the ClientHello (0x0303 for TLS 1.2 and 1.3; 1.3 is offered in the
    // supported_versions extension, RFC 8446 4.1.2). Reported, not checked.
    uint16_t version = 0;
};

struct Parse {
    Status status = Status::Incomplete;
    // Incomplete: the total number of input bytes to have before parsing again: at least
    // input.size() + 1, never more than max_size, and exact when known: the end of the record
    // being read, or the end of the ClientHello if that comes first within it, or the end of
    // the next record header. Waiting for it (SO_RCVLOWAT) never strands a client that sent its
    // whole hello: the client always sends whole records. The first two bytes can each settle
    // NotTls on their own, so before them `need` is one more byte.
    size_t need = 0;
    // Incomplete: the least input length at which the ClientHello can be complete (>= need),
    // from the lengths read so far: its handshake length, and a header for every further record
    // the rest needs. The ClientHello cannot end sooner, so a reader that waits only for the
    // verdict waits for this (SO_RCVLOWAT): a hello cut into 1-byte records then wakes it a few
    // dozen times, not twice per record.
    size_t wake = 0;
    // Complete: views into `work` (the handshake came in several records) or into `input` (it
    // came in one), valid while both live unchanged.
    ClientHello hello;
};

// Parses the ClientHello at the start of a client's stream.
//
// `input`: the bytes the client has sent so far (peeked; starts at the first byte of its stream).
// `max_size`: the most input bytes the whole ClientHello (all its records, headers included) may
// take; beyond it: TooLarge, as soon as a length seen says so, not after waiting for the bytes.
// `work`: scratch of at least max_size bytes where a handshake split over several records is
// reassembled (a smaller one lowers max_size to its size, so it is never overrun).
//
// Record layer (RFC 8446 5.1): content type 22 (handshake), legacy_record_version 3.0..3.4,
// length 1..16384. A first byte other than 22 (an SSLv2-compatible hello has its high bit set)
// or a second byte other than 3 is NotTls, decided on the byte itself. The ClientHello may be
// fragmented over consecutive handshake records; any other record before its end is Malformed.
// Bytes after its end (the rest of its record, more records: early data) are not looked at.
//
// ClientHello (RFC 8446 4.1.2): every vector within its parent exactly, session id <= 32 bytes,
// cipher suites an even number >= 2, compression methods >= 1, extensions optional (a TLS 1.0
// to 1.2 hello may have none), nothing after them. Extensions (RFC 8446 4.2): no type twice,
// GREASE (RFC 8701) ignored, server_name and ALPN validated and returned, ECH noted, the rest
// skipped by its length.
Parse parse(std::span<const uint8_t> input, size_t max_size, std::span<uint8_t> work);

// Calls f(std::string_view protocol) for each protocol name in a validated `alpn`
// (ClientHello::alpn), in the client's order of preference; stops early if f returns false (f
// may also return nothing). On a list that was not validated it stops at the first entry that
// does not fit rather than read past the end.
template <class F>
void forEachProtocol(std::string_view alpn, F f) {
    size_t pos = 0;
    while (pos < alpn.size()) {
        const size_t n = static_cast<uint8_t>(alpn[pos]);
        if (n == 0 || n > alpn.size() - pos - 1) return;
        const std::string_view name = alpn.substr(pos + 1, n);
        if constexpr (std::is_void_v<std::invoke_result_t<F&, std::string_view>>) {
            f(name);
        } else if (!f(name)) {
            return;
        }
        pos += 1 + n;
    }
}

// The protocols comma-joined ("h2,http/1.1") into `out`, for a log line or a label; returns the
// length written. A list that does not fit is cut after the last whole protocol that does, so a
// reader never sees half a name. No allocation. Protocol names are opaque bytes (RFC 7301 3.1)
// and may themselves hold a comma: the text is for people, not to be split again.
size_t joinProtocols(std::string_view alpn, std::span<char> out);

}  // namespace zcrelay::tls_hello
