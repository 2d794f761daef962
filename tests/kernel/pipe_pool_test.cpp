// PipePool and the splice pump on real pipes and real loopback TCP sockets: the kernel behaviours
// other relays got wrong (EAGAIN that means "pipe full", pipes that leak or never shrink),
// each reproduced and checked.
#include "pipe_pool.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pump/splice_pump.hpp"
#include "support/labels.hpp"
#include "support/loopback.hpp"

namespace zcrelay {
namespace {

using namespace std::chrono_literals;

constexpr int kNoCeiling = INT32_MAX;

struct TcpPair {
    int client = -1;  // connected socket, our side writes here
    int server = -1;  // accepted peer, nonblocking
    ~TcpPair() {
        if (client >= 0) ::close(client);
        if (server >= 0) ::close(server);
    }
};

// A connected loopback TCP pair: `server` is nonblocking as the relay's sockets are.
TcpPair makePair() {
    TcpPair p;
    int l = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    EXPECT_EQ(::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(l, 4), 0);
    ::getsockname(l, reinterpret_cast<sockaddr*>(&a), &len);
    p.client = ::socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_EQ(::connect(p.client, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    p.server = ::accept4(l, nullptr, nullptr, SOCK_NONBLOCK);
    ::close(l);
    int one = 1;
    ::setsockopt(p.client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return p;
}

// Drives one direction the way a worker does, with poll(2) standing in for the ring, until the
// direction finishes or `deadline` passes.
SpliceStep::Kind driveUntilDone(SplicePump& d, int src, int dst, PipePool& pool, uint64_t& total,
                                std::chrono::steady_clock::time_point deadline) {
    for (;;) {
        uint64_t moved = 0;
        SpliceStep step = d.move(src, dst, pool, 1 << 20, moved);
        total += moved;
        if (step.kind != SpliceStep::WaitRead && step.kind != SpliceStep::WaitWrite)
            return step.kind;
        if (std::chrono::steady_clock::now() > deadline) return step.kind;
        pollfd pfd{step.kind == SpliceStep::WaitRead ? src : dst,
                   static_cast<short>(step.kind == SpliceStep::WaitRead ? POLLIN : POLLOUT), 0};
        ::poll(&pfd, 1, 100);
    }
}

TEST(PipePool, ReusesReleasedPipesAndCountsThem) {
    WorkerStats stats;
    PipePool pool(4, kNoCeiling, stats);
    auto a = pool.acquire();
    ASSERT_TRUE(a.has_value());
    EXPECT_GE(a->capacity, PipePool::kStartSize);
    int fd = a->read_fd;
    EXPECT_EQ(stats.pipes_in_use.get(), 1u);
    pool.release(*a);
    EXPECT_EQ(stats.pipes_in_use.get(), 0u);
    EXPECT_EQ(stats.pipes_cached.get(), 1u);
    auto b = pool.acquire();
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(b->read_fd, fd) << "a cached pipe is reused before a new one is made";
    pool.release(*b);
}

TEST(PipePool, ExhaustedPoolSaysSo) {
    WorkerStats stats;
    PipePool pool(2, kNoCeiling, stats);
    auto a = pool.acquire();
    auto b = pool.acquire();
    ASSERT_TRUE(a && b);
    auto c = pool.acquire();
    ASSERT_FALSE(c.has_value());
    EXPECT_EQ(c.error(), PipeFallback::PoolExhausted);
    pool.release(*a);
    EXPECT_TRUE(pool.acquire().has_value()) << "released pipe makes room again";
    pool.release(*b);
}

TEST(PipePool, GrowsToPipeSizeAndShrinksWhenCached) {
    WorkerStats stats;
    PipePool pool(4, kNoCeiling, stats);
    auto p = pool.acquire();
    ASSERT_TRUE(p);
    pool.grow(*p, 1 << 20);
    EXPECT_EQ(p->capacity, 1u << 20) << "F_SETPIPE_SZ's return is the capacity we account with";
    EXPECT_EQ(fcntl(p->write_fd, F_GETPIPE_SZ), 1 << 20);
    int fd = p->write_fd;
    pool.release(*p);
    EXPECT_EQ(fcntl(fd, F_GETPIPE_SZ), static_cast<int>(PipePool::kStartSize))
        << "a cached pipe gives its grown pages back";
}

TEST(PipePool, OutOfFdsIsEmfileNotACrash) {
    WorkerStats stats;
    PipePool pool(16, kNoCeiling, stats);
    rlimit old{};
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
    // Lower the soft limit to the lowest fd number free now: pipe2() then has no room.
    int probe = ::dup(0);
    ASSERT_GE(probe, 0);
    ::close(probe);
    rlimit low = old;
    low.rlim_cur = static_cast<rlim_t>(probe);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
    auto p = pool.acquire();
    setrlimit(RLIMIT_NOFILE, &old);
    ASSERT_FALSE(p.has_value());
    EXPECT_EQ(p.error(), PipeFallback::Emfile);
}

// Pipes must leave the top of the fd table to the process's own needs (metrics sockets, the
// spare fd): a pipe landing at or above the ceiling is refused like EMFILE and leaks nothing.
TEST(PipePool, PipeAboveTheFdCeilingIsRefusedAsEmfile) {
    WorkerStats stats;
    int probe = ::dup(0);
    ASSERT_GE(probe, 0);
    ::close(probe);
    PipePool pool(16, probe, stats);  // the next fd handed out is `probe`: at the ceiling
    auto p = pool.acquire();
    ASSERT_FALSE(p.has_value());
    EXPECT_EQ(p.error(), PipeFallback::Emfile);
    int after = ::dup(0);
    EXPECT_EQ(after, probe) << "the refused pipe's fds were closed again";
    ::close(after);
    EXPECT_EQ(stats.pipes_in_use.get(), 0u);
}

// Over pipe-user-pages-soft (64 MiB by default) an unprivileged user's new pipes get two pages
// (8 KiB on this kernel), too few for a pipe the pool would use.
// A child drops root (and with it CAP_SYS_ADMIN/CAP_SYS_RESOURCE, which exempt it), fills its
// user's budget with 1 MiB pipes, and then asks the pool for one.
TEST(PipePool, PipeUserPagesSoftLimitIsReportedAsPipeLimit) {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to switch to an unprivileged uid";
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        if (setgid(65534) != 0 || setuid(65534) != 0) _exit(10);
        std::vector<int> held;
        for (int i = 0; i < 200; ++i) {  // 200 MiB asked: far past the 64 MiB soft limit
            int fds[2];
            if (pipe(fds) != 0) _exit(11);
            held.push_back(fds[0]);
            held.push_back(fds[1]);
            if (fcntl(fds[1], F_SETPIPE_SZ, 1 << 20) < 0) break;  // the budget is spent
        }
        WorkerStats stats;
        PipePool pool(16, kNoCeiling, stats);
        auto p = pool.acquire();
        if (p.has_value()) _exit(12);
        _exit(p.error() == PipeFallback::PipeLimit ? 0 : 13);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0)
        << "child exit code: 12 = got a pipe, 13 = wrong reason, 1x = setup";
}
ZCRELAY_LABEL(PipePool, PipeUserPagesSoftLimitIsReportedAsPipeLimit, "", test::kHostPipePages,
              "fills the pipe pages of nobody, which are host-wide, not per namespace");

// A 64 KiB pipe has 16 slots and every skb takes one however small: with tiny segments it is
// "full" at a few KiB, and splice(sock -> pipe) says EAGAIN although the socket has data
// (sozu#1323 read that as "drained" and hung). The pump must keep going.
TEST(SplicePump, PipeFullOfSmallSegmentsIsNotEndOfData) {
    TcpPair in = makePair();
    TcpPair out = makePair();
    WorkerStats stats;
    PipePool pool(4, kNoCeiling, stats);
    constexpr size_t kSegments = 4000, kSegment = 100;
    std::thread writer([&] {
        std::vector<char> seg(kSegment);
        for (size_t i = 0; i < kSegments; ++i) {
            std::fill(seg.begin(), seg.end(), static_cast<char>(i));
            ASSERT_EQ(::send(in.client, seg.data(), seg.size(), 0), static_cast<ssize_t>(kSegment));
        }
        ::shutdown(in.client, SHUT_WR);
    });
    std::string got;
    std::thread reader([&] { test::readUntilEof(out.client, got, 30s); });
    SplicePump d;
    uint64_t total = 0;
    auto kind = driveUntilDone(d, in.server, out.server, pool, total,
                               std::chrono::steady_clock::now() + 20s);
    writer.join();
    reader.join();
    EXPECT_EQ(kind, SpliceStep::Finished);
    EXPECT_EQ(total, kSegments * kSegment);
    ASSERT_EQ(got.size(), kSegments * kSegment);
    for (size_t i = 0; i < kSegments; ++i)
        ASSERT_EQ(got[i * kSegment], static_cast<char>(i)) << "segment " << i << " out of order";
    EXPECT_EQ(stats.pipes_in_use.get(), 0u) << "a finished direction holds no pipe";
}

// A dst that stops reading: the pump must stop with bytes parked in the pipe (bounded by its
// capacity, nothing buffered in user space), and resume without loss when dst drains.
TEST(SplicePump, SlowReaderParksBytesInThePipeThenResumes) {
    TcpPair in = makePair();
    TcpPair out = makePair();
    WorkerStats stats;
    PipePool pool(4, kNoCeiling, stats);
    constexpr size_t kTotal = 32 << 20;
    std::thread writer([&] {
        std::vector<char> buf(1 << 16, 'x');
        for (size_t sent = 0; sent < kTotal; sent += buf.size())
            if (::send(in.client, buf.data(), buf.size(), 0) <= 0) break;
        ::shutdown(in.client, SHUT_WR);
    });
    SplicePump d;
    uint64_t total = 0;
    SpliceStep::Kind kind = SpliceStep::WaitRead;
    auto deadline = std::chrono::steady_clock::now() + 10s;
    // Nobody reads out.client yet: the pump must end up waiting to write.
    while (kind != SpliceStep::WaitWrite && std::chrono::steady_clock::now() < deadline) {
        uint64_t moved = 0;
        kind = d.move(in.server, out.server, pool, 1 << 20, moved).kind;
        total += moved;
        if (kind == SpliceStep::WaitRead) {
            pollfd pfd{in.server, POLLIN, 0};
            ::poll(&pfd, 1, 100);
        }
    }
    ASSERT_EQ(kind, SpliceStep::WaitWrite);
    EXPECT_GT(d.inPipe(), 0u);
    EXPECT_LE(d.inPipe(), d.pipe().capacity);
    EXPECT_LT(total, kTotal) << "the receiver read nothing, so the socket buffers must have filled";
    size_t got = 0;
    std::thread reader([&] {
        test::readStreamUntilEof(
            out.client, [&](std::span<const uint8_t> d) { got += d.size(); }, 30s);
    });
    kind = driveUntilDone(d, in.server, out.server, pool, total,
                          std::chrono::steady_clock::now() + 20s);
    writer.join();
    reader.join();
    EXPECT_EQ(kind, SpliceStep::Finished);
    EXPECT_EQ(got, kTotal);
    EXPECT_EQ(total, kTotal);
}

// An RST on the source is an error on the source side, never EOF.
TEST(SplicePump, ResetOnSourceIsAFailureOnSrc) {
    TcpPair in = makePair();
    TcpPair out = makePair();
    WorkerStats stats;
    PipePool pool(4, kNoCeiling, stats);
    linger lg{1, 0};
    ::setsockopt(in.client, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    ::close(in.client);
    in.client = -1;
    pollfd pfd{in.server, POLLIN, 0};
    ::poll(&pfd, 1, 2000);
    SplicePump d;
    uint64_t moved = 0;
    SpliceStep step = d.move(in.server, out.server, pool, 1 << 20, moved);
    EXPECT_EQ(step.kind, SpliceStep::Failed);
    EXPECT_TRUE(step.on_src);
    EXPECT_EQ(step.error, ECONNRESET);
}

}  // namespace
}  // namespace zcrelay
