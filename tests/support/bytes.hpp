#pragma once
// Bytes on the wire, for tests that build protocol headers and report what arrived.
#include <cstdint>
#include <cstdio>
#include <string>

namespace zcrelay::test {

// Appends v as 2 bytes, network order.
inline void putBe16(std::string& out, uint16_t v) {
    out.push_back(static_cast<char>((v >> 8) & 0xff));
    out.push_back(static_cast<char>(v & 0xff));
}

// "16 03 01 ... (517 bytes)": the first `max` bytes in hex and the length, for failure messages.
inline std::string hex(const std::string& s, size_t max = 160) {
    std::string out;
    char buf[4];
    for (size_t i = 0; i < s.size() && i < max; ++i) {
        std::snprintf(buf, sizeof buf, "%02x ", static_cast<uint8_t>(s[i]));
        out += buf;
    }
    if (s.size() > max) out += "...";
    return out + "(" + std::to_string(s.size()) + " bytes)";
}

}  // namespace zcrelay::test
