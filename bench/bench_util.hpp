#pragma once
// What the bench tools share: a monotonic clock and "127.0.0.1:PORT" parsing. Header-only and
// free of any relay code, so each tool stays a plain-sockets program.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <time.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

namespace bench {

inline int64_t nowNs() {
    timespec ts{};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

// "A.B.C.D:PORT" (IPv4, numeric); false if it is not that.
inline bool parseAddr(std::string_view s, sockaddr_in& out) {
    size_t colon = s.rfind(':');
    if (colon == std::string_view::npos) return false;
    std::string host(s.substr(0, colon));
    std::string port(s.substr(colon + 1));
    char* end = nullptr;
    long p = std::strtol(port.c_str(), &end, 10);
    if (port.empty() || *end != '\0' || p < 0 || p > 65535) return false;
    out = sockaddr_in{};
    out.sin_family = AF_INET;
    out.sin_port = htons(static_cast<uint16_t>(p));
    return ::inet_pton(AF_INET, host.c_str(), &out.sin_addr) == 1;
}

}  // namespace bench
