#pragma once
// What the bench tools share: a monotonic clock, CPU time, pinning and "127.0.0.1:PORT"
// parsing. Header-only and free of any relay code, so each tool stays a plain-sockets program.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace bench {

inline int64_t nowNs() {
    timespec ts{};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

// User + system CPU time of the calling thread (RUSAGE_THREAD) or the process (RUSAGE_SELF).
inline int64_t cpuNs(int who) {
    rusage ru{};
    ::getrusage(who, &ru);
    auto ns = [](const timeval& tv) {
        return int64_t{tv.tv_sec} * 1'000'000'000 + int64_t{tv.tv_usec} * 1000;
    };
    return ns(ru.ru_utime) + ns(ru.ru_stime);
}

// Ends a probe that cannot go on: "TOOL: WHAT: strerror(err)" on stderr, exit status 1.
[[noreturn]] inline void failWith(const char* tool, const char* what, int err) {
    std::fprintf(stderr, "%s: %s: %s\n", tool, what, std::strerror(err));
    std::exit(1);
}

// Pins the calling thread to `cpu`, or ends the probe as failWith does.
inline void pinOrFail(const char* tool, int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (int rc = ::pthread_setaffinity_np(::pthread_self(), sizeof set, &set); rc != 0)
        failWith(tool, "pthread_setaffinity_np", rc);
}

// A pseudo-random pattern of `period` bytes (xorshift64 from `seed`, so both ends make the same
// bytes), stored twice over: v[(start + i) % period] for i < period is one contiguous window,
// so a sender sends straight from it and a receiver compares straight against it.
inline std::vector<unsigned char> doubledPattern(size_t period, uint64_t seed) {
    std::vector<unsigned char> v(2 * period);
    uint64_t x = seed;
    for (size_t i = 0; i < period; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v[i] = static_cast<unsigned char>(x >> 32);
    }
    std::memcpy(v.data() + period, v.data(), period);
    return v;
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

// A listening socket on `addr` (port 0 = the kernel picks) whose bound port is printed alone on
// the first stdout line (what the bench scripts wait for). -1 if it cannot be set up (reason on
// stderr). `type_flags` adds to SOCK_STREAM | SOCK_CLOEXEC, e.g. SOCK_NONBLOCK.
inline int listenAndAnnounce(const char* name, const sockaddr_in& addr, int type_flags = 0) {
    int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | type_flags, 0);
    int one = 1;
    if (lfd < 0 || ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
        ::bind(lfd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) < 0 ||
        ::listen(lfd, SOMAXCONN) < 0) {
        std::fprintf(stderr, "%s server: ", name);
        std::perror("socket/bind/listen");
        if (lfd >= 0) ::close(lfd);
        return -1;
    }
    sockaddr_in bound{};
    socklen_t len = sizeof bound;
    ::getsockname(lfd, reinterpret_cast<sockaddr*>(&bound), &len);
    std::printf("%u\n", ntohs(bound.sin_port));
    std::fflush(stdout);
    return lfd;
}

// The servers' loop: listenAndAnnounce, then hand every accepted connection to `serve(fd)` on a
// detached thread until `stop` is set or `seconds` pass; poll() first, so the lifetime and
// SIGTERM are noticed with no client. exit() takes unfinished connections down. Returns the
// exit code: 0, or 2 if the socket cannot be set up.
template <typename Serve>
int serveLoop(const char* name, const sockaddr_in& addr, long seconds,
              const volatile sig_atomic_t& stop, Serve serve) {
    int lfd = listenAndAnnounce(name, addr);
    if (lfd < 0) return 2;
    const int64_t end = nowNs() + int64_t{seconds} * 1'000'000'000;
    while (!stop && nowNs() < end) {
        pollfd p{lfd, POLLIN, 0};
        if (::poll(&p, 1, 200) <= 0) continue;
        int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) std::thread(serve, fd).detach();
    }
    ::close(lfd);
    return 0;
}

}  // namespace bench
