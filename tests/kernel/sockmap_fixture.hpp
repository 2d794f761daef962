#pragma once
// What the kernel sockmap tests (sockmap_*_test.cpp) share: looking at sockets and maps from
// outside, bounded waits, and the fixture that builds the relay's view of one connection.
//
// Sockmap and the sockmap_kernel functions on real loopback TCP sockets, with no relay process:
// each kernel behaviour the sockmap data path relies on (pump/sockmap_kernel.hpp lists them, as
// measured on this kernel) reproduced and checked, with byte-exact payloads and the program's
// own counters (zcr_sock_stats) as the oracle.
//
// Every test builds the relay's view of one connection:
//
//   C (client) ──TCP── A (conn.fd[0])   [relay]   B (conn.fd[1]) ──TCP── U (upstream)
//
// A and B are nonblocking, as the relay's sockets are; C and U are the two peers. Direction 0
// (C -> U) uses record index_base, direction 1 (U -> C) index_base + 1. Where user space has a
// part in the data path (moving passed bytes, the FIN barrier), the test does what the worker
// does, with the same sockmap_pump functions.
//
// Needs CAP_BPF + CAP_NET_ADMIN: skipped (with the reason) unless root, and a load that fails as
// root is a failure, not a skip. Every case runs with both attach points; with no stream parser
// they reach the same kernel path (sockmap.hpp), and these tests are where that is checked.
#include <bpf/bpf.h>
#include <gtest/gtest.h>
#include <linux/sockios.h>
#include <linux/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "pump/sockmap_kernel.hpp"
#include "sockmap.hpp"
#include "support/loopback.hpp"
#include "units.hpp"

namespace zcrelay {

// Test names and failure messages show the attach point, not "1-byte object <00>". Outside the
// sockmap_test namespace: gtest finds it by argument-dependent lookup in Sockmap's namespace.
inline void PrintTo(Sockmap::Attach a, std::ostream* os) {
    *os << (a == Sockmap::Attach::StreamVerdict ? "StreamVerdict" : "SkbVerdict");
}

namespace sockmap_test {

using namespace std::chrono_literals;
using test::Clock;
using test::Fd;
using test::IoResult;
using test::IoStatus;
using test::Millis;
using test::PayloadVerifier;

inline constexpr uint32_t kCapacity = 4096;  // records, i.e. sockets: two per pair
// The in-flight bound the worker gives each direction with the default pipe_size (1 MiB):
// 4 x pipe_size. Tests whose point is elsewhere, and that must not meet the bound, use
// kUnbounded.
inline constexpr uint64_t kLimit = 4 * kMiB;
inline constexpr uint64_t kUnbounded = uint64_t{1} << 40;
inline constexpr uint64_t kSeedUp = 0xC11E;    // C -> U
inline constexpr uint64_t kSeedDown = 0x0B57;  // U -> C

// ---------------------------------------------------------------------------------------------
// Looking at the kernel from outside.

inline tcp_info tcpInfo(int fd) {
    tcp_info info{};
    socklen_t len = sizeof info;
    ::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len);
    return info;
}

// SIOCINQ: bytes in the receive queue not yet read (for a socket in a sockmap, only those in
// the psock's queue: see procRxQueue() in sockmap_setup_test.cpp). SIOCOUTQ: bytes written and
// not yet acked.
inline uint64_t inq(int fd) {
    int n = 0;
    return ::ioctl(fd, SIOCINQ, &n) == 0 ? static_cast<uint64_t>(n) : 0;
}
inline uint64_t outq(int fd) {
    int n = 0;
    return ::ioctl(fd, SIOCOUTQ, &n) == 0 ? static_cast<uint64_t>(n) : 0;
}

// SO_ERROR reads and clears the pending error: where the psock's failed sends leave their EPIPE.
inline int socketError(int fd) {
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    return err;
}

// The keys of a map, counted by id as bpftool would: the kernel's view, not what Sockmap or
// Conn believe was inserted. -1 if the map cannot be opened or walked.
inline long countKeys(uint32_t map_id) {
    Fd fd(bpf_map_get_fd_by_id(map_id));
    if (!fd) return -1;
    uint64_t key = 0, next = 0;
    long n = 0;
    int r = bpf_map_get_next_key(fd.get(), nullptr, &next);
    while (r == 0) {
        ++n;
        key = next;
        r = bpf_map_get_next_key(fd.get(), &key, &next);
    }
    return r == -ENOENT ? n : -1;
}

// One record, loaded once: the program keeps writing it from softirq on any CPU.
struct Counters {
    uint64_t redirected = 0;
    uint64_t passed = 0;
    uint64_t consumed = 0;
    uint64_t limit = 0;
    uint64_t replayed = 0;
    uint32_t flags = 0;
};

inline std::ostream& operator<<(std::ostream& os, const Counters& c) {
    return os << "{redirected " << c.redirected << ", passed " << c.passed << ", consumed "
              << c.consumed << ", limit " << c.limit << ", replayed " << c.replayed << ", flags "
              << c.flags << "}";
}

// ---------------------------------------------------------------------------------------------
// Waiting, always with a deadline.

// Polls fd until one of `events` is reported. POLLERR/POLLHUP do not count: the caller asks for
// the event it means (POLLRDHUP: the peer's FIN was received).
inline bool waitForEvents(int fd, short events, Millis timeout) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
        auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
        if (left < 0) return false;
        pollfd p{fd, events, 0};
        int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left + 1, 100)));
        if (r > 0 && (p.revents & events) != 0) return true;
        if (r > 0 && (p.revents & (POLLERR | POLLNVAL)) != 0) return false;
    }
}

// checkEof() until it stops saying Again: the receive queue could not be run yet.
inline SockmapEof awaitEof(int src, bool src_write_shut, Millis timeout) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
        SockmapEof e = checkEof(src, src_write_shut);
        if (e.kind != SockmapEof::Again || Clock::now() >= deadline) return e;
        std::this_thread::sleep_for(1ms);
    }
}

// checkFinBarrier() until Done or Failed, as the worker's back-off timer would.
inline SockmapBarrier awaitFinBarrier(int src, int dst, Millis timeout) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
        SockmapBarrier b = checkFinBarrier(src, dst);
        if (b.kind != SockmapBarrier::Wait || Clock::now() >= deadline) return b;
        std::this_thread::sleep_for(1ms);
    }
}

// Reads fd into `v` until `v` has seen `until` bytes in all, never more: what follows stays in
// the socket for the test's next step.
inline IoResult readInto(int fd, PayloadVerifier& v, uint64_t until, Millis timeout) {
    auto deadline = Clock::now() + timeout;
    std::vector<uint8_t> buf(256 * kKiB);
    uint64_t start = v.bytes();
    while (v.bytes() < until) {
        size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), until - v.bytes()));
        auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
        IoResult r = test::readSome(fd, buf.data(), want, std::max(left, Millis{0}));
        if (!r.ok()) {
            r.bytes = v.bytes() - start;
            return r;
        }
        v.update(std::span<const uint8_t>(buf.data(), r.bytes));
    }
    return IoResult{IoStatus::Ok, v.bytes() - start, 0};
}

inline std::string describe(const IoResult& r, const PayloadVerifier& v) {
    std::string s = r.describe() + ", " + std::to_string(v.bytes()) + " bytes verified";
    if (!v.intact()) s += ", FIRST MISMATCH at byte " + std::to_string(v.firstMismatch());
    return s;
}

using test::Background;

// ---------------------------------------------------------------------------------------------
// The fixture: one loaded Sockmap, two listeners, and the pairs a test built.

struct Relayed {
    Fd client;              // C
    Fd a;                   // relay side of C, conn.fd[0]
    Fd b;                   // relay side of U, conn.fd[1]
    Fd upstream;            // U
    int fds[2] = {-1, -1};  // A and B, as the relay's connection holds them
    SockmapPair conn;       // their entries in the maps
};

inline Fd acceptOne(int listener, bool nonblocking) {
    pollfd p{listener, POLLIN, 0};
    if (::poll(&p, 1, 5000) != 1) return Fd{};
    return Fd(
        ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0)));
}

class SockmapTest : public ::testing::TestWithParam<Sockmap::Attach> {
  protected:
    void SetUp() override {
        if (geteuid() != 0)
            GTEST_SKIP() << "loading BPF needs CAP_BPF and CAP_NET_ADMIN: run as root";
        auto loaded = Sockmap::load(kCapacity, GetParam());
        ASSERT_TRUE(loaded.has_value()) << "Sockmap::load as root: " << loaded.error();
        map_ = std::move(*loaded);
        front_ = test::listenLoopback(AF_INET);
        ASSERT_TRUE(front_.fd) << front_.error;
        back_ = test::listenLoopback(AF_INET);
        ASSERT_TRUE(back_.fd) << back_.error;
    }

    void TearDown() override { closePairs(); }

    // Every socket leaves the maps before it is closed, as the relay does.
    void closePairs() {
        for (auto& p : pairs_)
            if (map_) tearDownPair(*map_, p->conn);
        pairs_.clear();
    }

    // C connects to the front listener (A accepted nonblocking); B connects to the back
    // listener (U accepted). nullptr, with the failure recorded, if any step fails.
    Relayed* connectPair() {
        auto p = std::make_unique<Relayed>();
        test::Connected c = test::connectTo("127.0.0.1", front_.port);
        if (!c.fd) {
            ADD_FAILURE() << "client connect: " << c.error;
            return nullptr;
        }
        p->client = std::move(c.fd);
        p->a = acceptOne(front_.fd.get(), true);
        test::Connected b = test::connectTo("127.0.0.1", back_.port);
        if (!p->a || !b.fd) {
            ADD_FAILURE() << "accept of A or connect of B failed: " << b.error;
            return nullptr;
        }
        p->b = std::move(b.fd);
        test::setNonBlocking(p->b.get(), true);
        p->upstream = acceptOne(back_.fd.get(), false);
        if (!p->upstream) {
            ADD_FAILURE() << "accept of U failed";
            return nullptr;
        }
        p->fds[0] = p->a.get();
        p->fds[1] = p->b.get();
        pairs_.push_back(std::move(p));
        return pairs_.back().get();
    }

    // Whether the program passed bytes for record `index` and then no more for 100 ms (within
    // 10 s): the stall of a direction whose reader stopped, once its socket's buffer is full.
    bool passingStopped(uint32_t index) {
        uint64_t last = 0;
        return test::waitUntil(
            [&] {
                uint64_t now = counters(index).passed;
                bool same = now > 0 && now == last;
                last = now;
                return same;
            },
            10s, 100ms);
    }

    Counters counters(uint32_t index) {
        zcr_sock_stats& r = map_->record(index);
        return {loadRelaxed(r.redirected), loadRelaxed(r.passed),   loadRelaxed(r.consumed),
                loadRelaxed(r.limit),      loadRelaxed(r.replayed), loadRelaxed(r.flags)};
    }

    std::unique_ptr<Sockmap> map_;
    test::Listening front_;
    test::Listening back_;
    std::vector<std::unique_ptr<Relayed>> pairs_;
};

}  // namespace sockmap_test
}  // namespace zcrelay
