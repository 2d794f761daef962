#pragma once
// The PROXY protocol (HAProxy's proxy-protocol.txt, versions 1 and 2): the header a relay puts in
// front of the bytes it forwards, so the backend learns who the client was, and the parser for
// the same header when a load balancer in front of zcrelay sends one. No I/O here: the worker
// owns the sockets, this file only turns addresses into bytes and bytes into addresses.
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "address.hpp"
#include "reasons.hpp"

namespace zcrelay::proxy_protocol {

enum class Version : uint8_t { V1, V2 };

// v1 is one text line of at most 107 bytes, CRLF included (the spec's own bound, for TCP6 with
// two 39-character addresses); a line that has not ended by then is refused.
inline constexpr size_t kV1MaxLength = 107;
// The shortest header of either version, "PROXY UNKNOWN\r\n": what a reader waits for first.
inline constexpr size_t kMinLength = 15;
// v2: 12-byte signature, version/command, family/protocol, 16-bit big-endian block length.
inline constexpr size_t kV2FixedLength = 16;
inline constexpr std::array<uint8_t, 12> kV2Signature{0x0D, 0x0A, 0x0D, 0x0A, 0x00, 0x0D,
                                                      0x0A, 0x51, 0x55, 0x49, 0x54, 0x0A};

// Room for any header writeHeader() produces: v2 with AF_INET6 is 52 bytes, v1 at most 104 (TCP6,
// two 39-character addresses), within the spec's 107.
inline constexpr size_t kMaxWrite = 108;

// Writes the header announcing a connection from `src` (the client) to `dst` (the address it
// reached) into `out`; returns its length.
//   - both AF_INET: v1 "PROXY TCP4 ...", v2 PROXY + TCP over INET;
//   - both AF_INET6: TCP6 / INET6, except when both are v4-mapped (::ffff:a.b.c.d, what a
//     dual-stack [::] listener reports for an IPv4 client): those are written as TCP4 / INET,
//     because the client really was an IPv4 host and a backend's IPv4 ACLs, real-IP ranges and
//     logs should see it as one. Parsing such a header gives AF_INET addresses back;
//   - anything else (unset, AF_UNIX, mixed families, which one accepted socket never has):
//     v1 "PROXY UNKNOWN\r\n", v2 command LOCAL with family UNSPEC and no addresses, what HAProxy
//     sends when it has no IP pair. The backend then uses the relay's own address.
// Ports and addresses go out as the kernel gave them; an IPv6 scope id is not carried.
size_t writeHeader(Version v, const SocketAddress& src, const SocketAddress& dst,
                   std::span<uint8_t, kMaxWrite> out);

// Why a received header is refused. A small set on purpose: the label is a metric label, and an
// operator needs to tell "the peer speaks no PROXY at all" from "its header is broken" from "it
// is too long for us", not every grammar rule.
#define ZCRELAY_PROXY_ERRORS(X)                                                                  \
    X(NotProxy, "not_proxy")          /* starts like neither the v1 text nor the v2 signature */ \
    X(BadV1, "bad_v1")                /* v1 line syntax: spaces, protocol, ports, CRLF */        \
    X(BadAddress, "bad_address")      /* v1 address not valid for TCP4/TCP6 */                   \
    X(TooLong, "too_long")            /* v1 past 107 bytes, or v2 past max_size */               \
    X(BadV2Version, "bad_v2_version") /* v2 signature with a version nibble other than 2 */      \
    X(BadCommand, "bad_command")      /* v2 command neither LOCAL nor PROXY */                   \
    X(BadFamily, "bad_family")        /* v2 PROXY with a family/protocol we do not relay */      \
    X(BadLength, "bad_length")        /* v2 address block shorter than its family needs */       \
    X(BadTlv, "bad_tlv")              /* v2 TLV chain that does not fill the block exactly */

enum class ProxyError : uint8_t { ZCRELAY_PROXY_ERRORS(ZCRELAY_ENUM_ITEM) kCount };

inline constexpr std::array<std::string_view, static_cast<size_t>(ProxyError::kCount)>
    kProxyErrorLabels{ZCRELAY_PROXY_ERRORS(ZCRELAY_LABEL_ITEM)};

inline std::string_view label(ProxyError e) { return kProxyErrorLabels[idx(e)]; }


struct ParseResult {
    enum Kind : uint8_t { Incomplete, Done, Malformed } kind = Incomplete;
    // Incomplete: the total number of bytes (from the start of the header) that must be present
    // before parse() can say more (>= data.size() + 1, and never more than the shortest header
    // that could still follow, so it is safe as SO_RCVLOWAT: the kernel wakes the reader only
    // then, and a client that sends its header and waits for an answer is not stranded).
    uint32_t need = 0;
    uint32_t length = 0;         // Done: bytes the header occupies (TLVs included); payload follows
    bool has_addresses = false;  // Done: false for v1 UNKNOWN, v2 LOCAL, v2 UNSPEC/AF_UNIX
    SocketAddress src, dst;      // Done with has_addresses: AF_INET or AF_INET6, with ports
    ProxyError error{};          // Malformed
};

// A strict parser over the bytes received so far (data always starts at the header's first
// byte). Never reads past data.size() and keeps no state: call it again with more bytes.
//
// `max_size` bounds a v2 header (16 + length); a longer one is Malformed(too_long) as soon as
// the length field is seen. v1 is bounded by the spec's 107 bytes.
//
// v1: "PROXY TCP4 a.b.c.d a.b.c.d sport dport\r\n" (TCP6 alike) with exactly single spaces,
// decimal ports 0..65535 without leading zeros ("0" alone is fine), addresses valid for the
// protocol (inet_pton). "PROXY UNKNOWN\r\n" and "PROXY UNKNOWN <anything>\r\n" are accepted
// without addresses (the rest may hold no CR or LF before the final CRLF).
// Incomplete as long as the bytes are a valid prefix ("PRO" -> Incomplete); a wrong byte is
// Malformed at once ("GET " -> not_proxy).
//
// v2: the 12-byte signature, version 2, command LOCAL (0) or PROXY (1).
//   - LOCAL (health checks, connections the sender made itself): the whole block, family
//     included, is skipped unread, as the spec says ("the receiver must accept this connection
//     as valid ... and discard the protocol block including the family").
//   - PROXY: family/protocol UNSPEC (0x00), TCP over INET (0x11) or INET6 (0x21), UNIX STREAM
//     (0x31); UDP and anything else is bad_family (a TCP relay has no use for them). The block
//     is at least the family's address size (0 / 12 / 36 / 216); TLVs after the addresses are
//     skipped, but they must chain exactly to the end of the block (bad_tlv otherwise).
//     Addresses are returned for INET and INET6 only.
// Checksums (PP2_TYPE_CRC32C) are not verified: the header travels inside TCP already.
ParseResult parse(std::span<const uint8_t> data, size_t max_size);

}  // namespace zcrelay::proxy_protocol

namespace zcrelay {

// Why a client's PROXY header was refused: the parser's reasons (proxy_protocol::ProxyError,
// the same values first), then the worker's own.
enum class ProxyFailure : uint8_t { ZCRELAY_PROXY_ERRORS(ZCRELAY_ENUM_ITEM) Timeout, Eof, kCount };
inline constexpr std::array<std::string_view, idx(ProxyFailure::kCount)> kProxyFailureLabels{
    ZCRELAY_PROXY_ERRORS(ZCRELAY_LABEL_ITEM) "timeout", "eof"};
inline std::string_view label(ProxyFailure f) { return kProxyFailureLabels[idx(f)]; }

}  // namespace zcrelay
