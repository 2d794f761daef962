// libFuzzer target for the PROXY protocol parser: bytes from a client are the least trusted input
// the relay reads. The sanitizers catch reads past data.size(); the checks below catch a parser
// that answers wrongly without crashing. A broken invariant traps, so libFuzzer keeps the input.
#include <netinet/in.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "proxy_protocol.hpp"

namespace {

using namespace zcrelay;
using namespace zcrelay::proxy_protocol;

void check(bool ok) {
    if (!ok) __builtin_trap();
}

// max_size values around the interesting edges: below the v2 fixed part, exactly one INET or
// INET6 header, the v1 bound, a UNIX header, and the largest a 16-bit length allows.
constexpr std::array<size_t, 8> kMaxSizes{0, 16, 28, 52, 107, 232, 4096, 16 + 65535};

bool sameDone(const ParseResult& a, const ParseResult& b) {
    return a.kind == ParseResult::Done && b.kind == ParseResult::Done && a.length == b.length &&
           a.has_addresses == b.has_addresses &&
           (!a.has_addresses || (a.src == b.src && a.dst == b.dst));
}

void checkParse(std::span<const uint8_t> data, size_t max_size) {
    const ParseResult r = parse(data, max_size);
    const size_t bound = std::max({kV1MaxLength, max_size, kV2FixedLength});
    switch (r.kind) {
        case ParseResult::Incomplete:
            check(r.need > data.size());
            check(r.need <= bound);
            break;
        case ParseResult::Malformed:
            check(static_cast<size_t>(r.error) < static_cast<size_t>(ProxyError::kCount));
            break;
        case ParseResult::Done: {
            check(r.length <= data.size());
            check(r.length >= kMinLength);
            check(r.length <= std::max(kV1MaxLength, max_size));
            if (r.has_addresses) {
                check(r.src.family() == AF_INET || r.src.family() == AF_INET6);
                check(r.src.family() == r.dst.family());
            }
            // The header alone says the same: what follows it cannot change it.
            check(sameDone(r, parse(data.first(r.length), max_size)));
            // Never Done early, and a waiting reader is never asked for more than the header.
            // Prefixes are checked sparsely on long headers to keep executions fast.
            const size_t step = std::max<size_t>(1, r.length / 64);
            for (size_t k = 0; k < r.length; k += step) {
                const ParseResult p = parse(data.first(k), max_size);
                check(p.kind == ParseResult::Incomplete);
                check(p.need > k && p.need <= r.length);
            }
            break;
        }
        default:
            check(false);
    }
}

// An address of the family `selector` picks, its bytes and port taken from the input.
SocketAddress addressFrom(uint8_t selector, std::span<const uint8_t> raw) {
    SocketAddress a;
    const uint16_t port = static_cast<uint16_t>(raw[0] << 8 | raw[1]);
    switch (selector % 4) {
        case 0: {
            auto& sin = *reinterpret_cast<sockaddr_in*>(&a.storage);
            sin.sin_family = AF_INET;
            std::memcpy(&sin.sin_addr, raw.data() + 2, sizeof(in_addr));
            a.length = sizeof(sockaddr_in);
            break;
        }
        case 1:
        case 2: {
            auto& sin6 = *reinterpret_cast<sockaddr_in6*>(&a.storage);
            sin6.sin6_family = AF_INET6;
            std::memcpy(&sin6.sin6_addr, raw.data() + 2, sizeof(in6_addr));
            if (selector % 4 == 2) {  // v4-mapped, which the writer turns into TCP4
                std::memset(&sin6.sin6_addr, 0, 10);
                sin6.sin6_addr.s6_addr[10] = sin6.sin6_addr.s6_addr[11] = 0xff;
            }
            a.length = sizeof(sockaddr_in6);
            break;
        }
        default:
            a.storage.ss_family = AF_UNIX;
            a.length = sizeof(sa_family_t);
    }
    a.setPort(port);
    return a;
}

// Whatever the writer produces, the parser takes back whole.
void checkWrite(std::span<const uint8_t> data) {
    constexpr size_t kRaw = 2 + sizeof(in6_addr);
    if (data.size() < 1 + 2 * kRaw) return;
    const SocketAddress src = addressFrom(data[0], data.subspan(1, kRaw));
    const SocketAddress dst = addressFrom(data[0] >> 2, data.subspan(1 + kRaw, kRaw));
    for (const Version v : {Version::V1, Version::V2}) {
        std::array<uint8_t, kMaxWrite> out{};
        const size_t n = writeHeader(v, src, dst, out);
        check(n >= kMinLength && n <= kMaxWrite);
        if (v == Version::V1) check(n <= kV1MaxLength);
        const ParseResult r = parse(std::span<const uint8_t>(out.data(), n), kMaxWrite);
        check(r.kind == ParseResult::Done && r.length == n);
        const bool ip_pair = src.family() == dst.family() && src.family() != AF_UNIX;
        check(r.has_addresses == ip_pair);
        if (ip_pair) check(r.src.port() == src.port() && r.dst.port() == dst.port());
        // Same family back means nothing was translated (only a v4-mapped pair is): equal.
        if (ip_pair && r.src.family() == src.family()) check(r.src == src && r.dst == dst);
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::span<const uint8_t> input(data, size);
    for (const size_t max_size : kMaxSizes) checkParse(input, max_size);
    checkWrite(input);
    return 0;
}
