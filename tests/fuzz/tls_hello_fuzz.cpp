// libFuzzer target for the TLS ClientHello parser: a client's first bytes, read before any route
// is chosen, from a client nobody has authenticated. The sanitizers catch reads past the input
// and writes past `work` (each work buffer is a heap block of exactly its size, so ASan's redzone
// sits right behind it); the checks below catch a parser that answers wrongly without crashing.
// A broken invariant traps, so libFuzzer keeps the input.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "tls_hello.hpp"

namespace {

using namespace zcrelay::tls_hello;

void check(bool ok) {
    if (!ok) __builtin_trap();
}

// max_size values around the edges: none at all, one below and exactly the smallest hello, a
// small hello, a padded 512-byte one, one full record, two records, the relay's 64 KiB.
constexpr std::array<size_t, 8> kMaxSizes{0,
                                          kMinHelloLength - 1,
                                          kMinHelloLength,
                                          300,
                                          517,
                                          5 + kMaxRecordLength,
                                          2 * (5 + kMaxRecordLength),
                                          64 * 1024};

// One work buffer per max_size, allocated once, each exactly that size.
std::span<uint8_t> workFor(size_t index) {
    static std::array<std::unique_ptr<uint8_t[]>, kMaxSizes.size()> buffers;
    if (!buffers[index]) buffers[index] = std::make_unique<uint8_t[]>(kMaxSizes[index]);
    return {buffers[index].get(), kMaxSizes[index]};
}

bool inside(std::string_view v, const void* base, size_t size) {
    const auto* b = static_cast<const char*>(base);
    return v.data() >= b && v.data() + v.size() <= b + size;
}

bool same(const Parse& a, const Parse& b) {
    if (a.status != b.status) return false;
    if (a.status == Status::Incomplete) return a.need == b.need;
    if (a.status != Status::Complete) return true;
    return a.hello.sni == b.hello.sni && a.hello.alpn == b.hello.alpn &&
           a.hello.ech == b.hello.ech && a.hello.version == b.hello.version;
}

void checkAnswer(const Parse& p, std::span<const uint8_t> input, size_t max_size,
                 std::span<const uint8_t> work) {
    const size_t bound = std::min(max_size, work.size());
    switch (p.status) {
        case Status::Incomplete:
            check(p.need > input.size());
            check(p.need <= bound);
            // Where the hello can end at the earliest: never before the next step, never past
            // the cap (a reader waiting there with SO_RCVLOWAT would wait for nothing).
            check(p.wake >= p.need);
            check(p.wake <= bound);
            break;
        case Status::Complete: {
            check(input.size() >= kMinHelloLength && bound >= kMinHelloLength);
            check(p.hello.sni.size() <= kMaxServerName);
            for (const std::string_view v : {p.hello.sni, p.hello.alpn}) {
                if (v.empty()) continue;
                check(inside(v, input.data(), input.size()) || inside(v, work.data(), work.size()));
            }
            // A validated ALPN list is whole names end to end, none empty.
            size_t walked = 0;
            forEachProtocol(p.hello.alpn, [&](std::string_view name) {
                check(!name.empty() && name.size() <= 255);
                walked += 1 + name.size();
            });
            check(walked == p.hello.alpn.size());
            std::array<char, 40> out;
            const size_t n = joinProtocols(p.hello.alpn, out);
            check(n <= out.size());
            break;
        }
        case Status::NotTls:
            // Decided on the first two bytes alone.
            check(!input.empty() && (input[0] != 22 || (input.size() > 1 && input[1] != 3)));
            break;
        case Status::Malformed:
        case Status::TooLarge:
            break;
        default:
            check(false);
    }
}

void checkParse(std::span<const uint8_t> input, size_t index) {
    const size_t max_size = kMaxSizes[index];
    const std::span<uint8_t> work = workFor(index);
    const Parse r = parse(input, max_size, work);
    checkAnswer(r, input, max_size, work);
    // Same bytes, same answer (the parser keeps no state).
    check(same(r, parse(input, max_size, work)));

    // A prefix never answers differently from the whole, only Incomplete: a reader that saw
    // fewer bytes could not have been told something the full input contradicts. Checked
    // sparsely on long inputs, to keep executions fast.
    const size_t step = std::max<size_t>(1, input.size() / 64);
    for (size_t k = 0; k < input.size(); k += step) {
        const Parse p = parse(input.first(k), max_size, work);
        checkAnswer(p, input.first(k), max_size, work);
        check(p.status == Status::Incomplete || p.status == r.status);
    }

    // A reader that waits for `need` bytes each time: every wait asks for more than the last,
    // and what it ends on agrees with the whole input.
    size_t have = 0;
    for (;;) {
        const Parse p = parse(input.first(have), max_size, work);
        if (p.status != Status::Incomplete) {
            check(p.status == r.status);
            break;
        }
        check(p.need > have);
        if (p.need > input.size()) break;
        have = p.need;
    }

    // A work buffer smaller than max_size lowers the bound; it is never overrun (ASan).
    if (work.size() >= 2) {
        const std::span<uint8_t> half = work.first(work.size() / 2);
        checkAnswer(parse(input, max_size, half), input, max_size, half);
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::span<const uint8_t> input(data, size);
    for (size_t i = 0; i < kMaxSizes.size(); ++i) checkParse(input, i);
    return 0;
}
