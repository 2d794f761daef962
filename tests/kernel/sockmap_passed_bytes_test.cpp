// Bytes the program passes to user space, moved on by the relay's sockmap pump: early bytes
// from before the pair was complete, and the rest once the in-flight limit is reached.
#include <bpf/libbpf.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <liburing.h>
#include <poll.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernel/sockmap_fixture.hpp"
#include "pipe_pool.hpp"
#include "pump/sockmap_pump.hpp"
#include "uring/buf_ring.hpp"
#include "uring/ring.hpp"
#include "uring/user_data.hpp"

namespace zcrelay::sockmap_test {
namespace {

// One direction of a pair, driven by the relay's own SockmapPump the way a worker drives it:
// on a ring of its own, every completion handed back to the pump, the records scanned every
// 10 ms, a starved copy resumed. The pump does the worker's part when the program passes bytes
// (pump/sockmap_pump.hpp): wait until dst has queued every byte redirected or copied before the
// passed ones, copy them (dropping what the program reports as replayed), publish `consumed`,
// hand the direction back to the kernel, and pass the FIN on after the kernel's backlog.
class PumpDriver {
  public:
    PumpDriver(Sockmap& map, uint32_t pair_record, int src, int dst)
        : map_(map),
          pump_(map, pair_record, 0, 0, 0, 0),
          record_(map.record(pair_record)),
          src_(src),
          dst_(dst) {}

    // Empty, or what could not be set up.
    std::string start() {
        auto ring = Ring::create(256);
        if (!ring) return "ring: " + ring.error().message();
        ring_ = std::move(*ring);
        auto bufs = BufRing::create(ring_->raw(), 0, 64, 64 * 1024, 64);
        if (!bufs) return "buffer ring: " + bufs.error().message();
        bufs_ = std::move(*bufs);
        pipes_ = std::make_unique<PipePool>(0, 1024, stats_);
        env_ = std::make_unique<PumpEnv>(PumpEnv{*bufs_, *pipes_, stats_, {}, holds_});
        return take(pump_.start(port(), *env_));
    }

    // Drives the pump until `done()` holds, it fails, or `timeout` passes. Empty, or what went
    // wrong.
    template <class Done>
    std::string runUntil(Millis timeout, Done&& done) {
        auto deadline = Clock::now() + timeout;
        auto next_scan = Clock::now();
        while (!done()) {
            if (Clock::now() >= deadline) return "not done in time";
            __kernel_timespec wait{0, 2'000'000};
            io_uring_cqe* cqe = nullptr;
            int r = io_uring_submit_and_wait_timeout(ring_->raw(), &cqe, 1, &wait, nullptr);
            if (r < 0 && r != -ETIME && r != -EINTR)
                return std::string("io_uring_submit_and_wait_timeout: ") + std::strerror(-r);
            unsigned head, count = 0;
            std::string err;
            io_uring_for_each_cqe(ring_->raw(), head, cqe) {
                ++count;
                UserData ud = UserData::unpack(cqe->user_data);
                if (ud.op == Op::Ignore) continue;
                --inflight_;
                if (err.empty())
                    err = take(
                        pump_.onCompletion(port(), *env_, ud.op, cqe->res, cqe->flags, ud.aux));
            }
            io_uring_cq_advance(ring_->raw(), count);
            if (!err.empty()) return err;
            if (bufs_->replenished() && starved_) {
                starved_ = false;
                if (err = take(pump_.resume(port(), *env_)); !err.empty()) return err;
            }
            if (Clock::now() >= next_scan) {
                next_scan = Clock::now() + 10ms;
                if (err = take(pump_.scan(port(), *env_)); !err.empty()) return err;
            }
        }
        return {};
    }

    // Every byte passed so far was sent on or skipped.
    bool caughtUp() const { return loadRelaxed(record_.passed) == loadRelaxed(record_.consumed); }
    // src's FIN went on to dst, after everything before it.
    bool finished() const { return finished_; }
    uint64_t rounds() const { return counts_.sockmap_catchups.get(); }
    uint64_t skipped() const { return counts_.sockmap_skipped.get(); }
    uint64_t copied() const { return counts_.sockmap_copied.get(); }

  private:
    PumpPort port() {
        return PumpPort{*ring_,    UserData{Op::Ignore, 0, 1, 1}.pack(),
                        inflight_, 0,
                        src_,      dst_,
                        false,     64 * 1024,
                        counts_};
    }
    std::string take(const Step& step) {
        starved_ = starved_ || step.starved;
        switch (step.kind) {
            case Step::Wait:
                return {};
            case Step::Finished:
                finished_ = true;
                return {};
            case Step::Failed:
                return std::string(step.on_src ? "src: " : "dst: ") + std::strerror(step.error);
            case Step::ToCopy:
                return "a sockmap pump asked for copy";
            case Step::Broken:
                return "the program marked the stream broken";
        }
        return "unknown step";
    }

    Sockmap& map_;
    SockmapPump pump_;
    zcr_sock_stats& record_;
    int src_;
    int dst_;
    WorkerStats stats_;
    ListenerStats counts_;
    uint32_t inflight_ = 0;
    bool starved_ = false;
    bool finished_ = false;
    std::unique_ptr<Ring> ring_;
    std::unique_ptr<BufRing> bufs_;
    std::unique_ptr<PipePool> pipes_;
    ZerocopyHolds holds_{0};  // no zero-copy sends here
    std::unique_ptr<PumpEnv> env_;
};

// The situation of BytesSentBeforeInsertionWaitWithoutTheKick (sockmap_setup_test.cpp) through
// setUpPair(), which peeks both sockets: a request C sent and a banner U sent before the pair
// entered the map both arrive with no further byte from anyone (without the kick a request waiting
// for its answer waits forever), ahead of later bytes. The request is passed (A goes in and is
// kicked before B) and moved as the worker would.
TEST_P(SockmapTest, BytesSentBeforeInsertionAreDeliveredAfterTheKick) {
    constexpr uint64_t kRequest = 64 * kKiB;
    constexpr uint64_t kBanner = 100;
    constexpr uint32_t kBase = 2;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    ASSERT_TRUE(test::sendPayload(c, kSeedUp, kRequest, 5s).ok());
    ASSERT_TRUE(test::sendPayload(u, kSeedDown, kBanner, 5s).ok());
    ASSERT_TRUE(test::waitUntil([&] { return inq(a) == kRequest && inq(b) == kBanner; }, 5s))
        << "before set-up: inq(A) " << inq(a) << ", inq(B) " << inq(b);

    PairSetUp s = setUpPair(*map_, p->conn, p->fds, kBase, kLimit);
    ASSERT_FALSE(s.fell_back) << label(s.reason);
    ASSERT_EQ(s.path[0], DataPath::Sockmap);
    ASSERT_EQ(s.path[1], DataPath::Sockmap);

    // The client's socket went in and was kicked first, with its peer not in yet: its early
    // bytes were passed, for the worker to move (so that its recvmsg() reopens the window the
    // client saw). The upstream's banner, kicked with both in, was redirected.
    Counters up = counters(kBase), down = counters(kBase + 1);
    EXPECT_EQ(up.passed, kRequest) << up;
    EXPECT_EQ(up.redirected, 0u) << up;
    PayloadVerifier at_u(kSeedUp), at_c(kSeedDown);
    IoResult got_c = readInto(c, at_c, kBanner, 5s);
    EXPECT_TRUE(got_c.ok() && at_c.intact()) << "banner at C: " << describe(got_c, at_c);
    PumpDriver copy(*map_, kBase, a, b);
    std::string err = copy.start();
    ASSERT_TRUE(err.empty()) << err;
    err = copy.runUntil(10s, [&] { return copy.caughtUp() && copy.copied() == kRequest; });
    ASSERT_TRUE(err.empty()) << err << ", " << counters(kBase);
    IoResult got_u = readInto(u, at_u, kRequest, 5s);
    EXPECT_TRUE(got_u.ok() && at_u.intact()) << "request at U: " << describe(got_u, at_u);

    // Later bytes come after them, redirected now that user space has caught up.
    ASSERT_TRUE(test::sendPayloadAt(c, kSeedUp, kRequest, kRequest, 5s).ok());
    ASSERT_TRUE(test::sendPayloadAt(u, kSeedDown, kBanner, kBanner, 5s).ok());
    got_u = readInto(u, at_u, 2 * kRequest, 5s);
    got_c = readInto(c, at_c, 2 * kBanner, 5s);
    EXPECT_TRUE(got_u.ok() && at_u.intact()) << "at U: " << describe(got_u, at_u);
    EXPECT_TRUE(got_c.ok() && at_c.intact()) << "at C: " << describe(got_c, at_c);
    up = counters(kBase);
    down = counters(kBase + 1);
    EXPECT_EQ(up.redirected, kRequest) << up;
    EXPECT_EQ(up.passed, kRequest) << up;
    EXPECT_EQ(down.redirected, 2 * kBanner) << down;
    EXPECT_EQ(down.passed, 0u) << down;
}

// With the worker's limit, a reader that does not read stops the redirect once the bytes in flight
// towards it (psock backlog + B's unacked send queue) pass the limit: the program passes the rest,
// which stays on A, charged to A's receive buffer, so A's window closes and C stalls. Kernel memory
// stays bounded where the unbounded BarrierWaitsForASlowReader (sockmap_fin_test.cpp) parked
// 32 MiB. When U reads again, the relay's sockmap pump does the worker's part (checkQueued,
// copy, consumed) whenever passed bytes wait, then the FIN barrier: U must get the 32 MiB
// byte-exact and in order, the copied pieces between the redirected ones.
TEST_P(SockmapTest, InFlightLimitPassesTheRestToUserSpace) {
    constexpr uint64_t kTotal = 32 * kMiB;
    constexpr uint32_t kBase = 200;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, kBase, kLimit);
    ASSERT_FALSE(s.fell_back) << label(s.reason);

    IoResult sent;
    Background sender(c, [&] {
        sent = test::sendPayload(c, kSeedUp, kTotal, 60s);
        if (sent.ok()) ::shutdown(c, SHUT_WR);
    });
    // The stall: passed bytes appear and A stops receiving (checked as no progress over 200 ms).
    uint64_t last = 0;
    bool stalled = test::waitUntil(
        [&] {
            uint64_t now = tcpInfo(a).tcpi_bytes_received;
            bool same = now == last;
            last = now;
            return counters(kBase).passed > 0 && same;
        },
        20s, 200ms);
    Counters k = counters(kBase);
    uint64_t received = tcpInfo(a).tcpi_bytes_received;
    uint64_t acked = tcpInfo(b).tcpi_bytes_acked;
    int rcvbuf = 0;
    socklen_t len = sizeof rcvbuf;
    ::getsockopt(a, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &len);
    ASSERT_TRUE(stalled) << "no stall with U not reading: A received " << received << ", " << k;
    // Passed bytes are charged to A (skb_set_owner_r() on the psock's ingress queue), so they
    // stop at A's receive buffer, plus the skb that crossed it. That buffer is not small for
    // long: every redirected skb runs tcp_rcv_space_adjust() (tcp_eat_skb()) as if user space
    // had read it, so autotuning may have grown it towards net.ipv4.tcp_rmem[2] (32 MiB here)
    // before the stall: this bound, not the initial 128 KiB, is what a stalled reader costs.
    EXPECT_LE(k.passed, static_cast<uint64_t>(rcvbuf) + 256 * kKiB)
        << k << ", A's SO_RCVBUF " << rcvbuf;
    EXPECT_LE(received, acked + kLimit + static_cast<uint64_t>(rcvbuf) + 1 * kMiB)
        << "what C got into the kernel while U did not read: " << k << ", A's SO_RCVBUF " << rcvbuf;
    // The program redirected until the count passed the limit, and not past it.
    EXPECT_GT(k.redirected, kLimit) << k;
    // The bound, as the program checks it before each redirect: in flight <= limit, plus the
    // skb that crossed it (loopback skbs are at most 64 KiB; a coalesced one a few times that).
    EXPECT_LE(k.redirected, acked + kLimit + 1 * kMiB) << k << ", B's bytes_acked " << acked;
    EXPECT_EQ(k.consumed, 0u) << k;
    RecordProperty("stalled_at_received", std::to_string(received));
    RecordProperty("stalled_redirected", std::to_string(k.redirected));
    RecordProperty("stalled_passed", std::to_string(k.passed));
    RecordProperty("stalled_rcvbuf", std::to_string(rcvbuf));

    test::ReceiveCheck at_u;
    Background reader(u, [&] { at_u = test::receivePayloadUntilEof(u, kSeedUp, 60s); });
    PumpDriver copy(*map_, kBase, a, b);
    std::string err = copy.start();
    ASSERT_TRUE(err.empty()) << err;
    // The pump catches up whenever passed bytes wait, and passes the FIN on after the barrier.
    err = copy.runUntil(60s, [&] { return copy.finished(); });
    ASSERT_TRUE(err.empty()) << err << ", " << counters(kBase);
    reader.join();
    sender.join();
    ASSERT_TRUE(sent.ok()) << sent.describe();
    EXPECT_EQ(at_u.io.status, IoStatus::Eof) << at_u.describe();
    EXPECT_EQ(at_u.bytes, kTotal) << at_u.describe();
    EXPECT_EQ(at_u.first_mismatch, -1) << at_u.describe();
    k = counters(kBase);
    // A replayed stretch is counted in passed twice and skipped once.
    EXPECT_EQ(k.redirected + k.passed - copy.skipped(), kTotal) << k;
    EXPECT_EQ(k.consumed, k.passed) << k;
    EXPECT_EQ(k.flags & ZCR_BROKEN, 0u) << k;
    EXPECT_GE(copy.rounds(), 1u);
    EXPECT_EQ(socketError(b), 0);
    RecordProperty("passed", std::to_string(k.passed));
    RecordProperty("catch_up_rounds", std::to_string(copy.rounds()));
    RecordProperty("replayed", std::to_string(k.replayed));
    RecordProperty("skipped", std::to_string(copy.skipped()));
}

// Passed bytes wait on the psock's own queue (ingress_msg), not on the socket's receive queue,
// and splice() reads only the latter (tcp_splice_read -> tcp_read_sock): with half a megabyte
// passed and shown by SIOCINQ, a nonblocking splice from A finds nothing, while recv() returns
// them, the first one at the offset where redirecting stopped. So the sockmap pump moves passed
// bytes by copy, and mode auto never demotes a sockmap direction to splice (proxy/kernel.md).
TEST_P(SockmapTest, PassedBytesAreInvisibleToSplice) {
    constexpr uint64_t kTotal = 32 * kMiB;
    constexpr uint32_t kBase = 300;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), c = p->client.get();
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, kBase, 256 * kKiB);
    ASSERT_FALSE(s.fell_back) << label(s.reason);
    IoResult sent;
    Background sender(c, [&] { sent = test::sendPayload(c, kSeedUp, kTotal, 20s); });
    // U never reads: past the bound the program passes, until A's receive buffer is full.
    ASSERT_TRUE(passingStopped(kBase)) << counters(kBase);
    Counters k = counters(kBase);
    ASSERT_GT(k.passed, 0u) << k;
    EXPECT_EQ(inq(a), k.passed) << "SIOCINQ shows the psock's queue: " << k;

    int pipefd[2];
    ASSERT_EQ(::pipe2(pipefd, O_NONBLOCK | O_CLOEXEC), 0);
    Fd pipe_r(pipefd[0]), pipe_w(pipefd[1]);
    ssize_t spliced =
        ::splice(a, nullptr, pipe_w.get(), nullptr, 1 << 20, SPLICE_F_NONBLOCK | SPLICE_F_MOVE);
    int splice_errno = spliced < 0 ? errno : 0;
    EXPECT_EQ(spliced, -1) << "splice took bytes the program passed: " << k;
    EXPECT_EQ(splice_errno, EAGAIN) << std::strerror(splice_errno);

    std::vector<uint8_t> got(64 * kKiB), want(got.size());
    ssize_t n = ::recv(a, got.data(), got.size(), MSG_DONTWAIT);
    ASSERT_GT(n, 0) << "recv finds the passed bytes: " << std::strerror(errno);
    test::fillPayload(kSeedUp, k.redirected, std::span<uint8_t>(want.data(), n));
    EXPECT_TRUE(std::equal(got.begin(), got.begin() + n, want.begin()))
        << "the first passed byte is byte " << k.redirected << " of the stream";
    RecordProperty("passed", std::to_string(k.passed));
    ::shutdown(c, SHUT_RDWR);
}

// The program's signal: when a socket starts passing bytes, the program writes its record index
// into the worker's wake-up ring, once for the whole run of passed skbs (the ones after it find
// consumed != passed), so a worker sleeps until there is something to move. Here every record
// belongs to worker 0 (Sockmap::load with one worker).
TEST_P(SockmapTest, PassingWakesTheWorkerOncePerRun) {
    constexpr uint64_t kTotal = 32 * kMiB;
    constexpr uint32_t kBase = 400;
    std::vector<uint32_t> woken;
    auto collect = [](void* ctx, void* data, size_t size) {
        uint32_t index = 0;
        if (size >= sizeof index) std::memcpy(&index, data, sizeof index);
        static_cast<std::vector<uint32_t>*>(ctx)->push_back(index);
        return 0;
    };
    ring_buffer* ring = ring_buffer__new(map_->wakeRingFd(0), collect, &woken, nullptr);
    ASSERT_NE(ring, nullptr) << std::strerror(errno);
    std::unique_ptr<ring_buffer, void (*)(ring_buffer*)> own(ring, ring_buffer__free);
    ring_buffer__consume(ring);  // what earlier cases of this fixture left
    woken.clear();

    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int c = p->client.get();
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, kBase, 256 * kKiB);
    ASSERT_FALSE(s.fell_back) << label(s.reason);
    ring_buffer__consume(ring);
    EXPECT_TRUE(woken.empty()) << "nothing passed yet, nothing to wake for: " << woken.size();
    IoResult sent;
    Background sender(c, [&] { sent = test::sendPayload(c, kSeedUp, kTotal, 20s); });
    // U never reads: past the bound the program passes skb after skb, until A's buffer is full.
    ASSERT_TRUE(passingStopped(kBase)) << counters(kBase);
    ring_buffer__consume(ring);
    Counters k = counters(kBase);
    EXPECT_EQ(woken, std::vector<uint32_t>{kBase}) << k;
    EXPECT_GT(k.passed, 4 * 64 * kKiB) << "several skbs passed, one wake-up: " << k;
    EXPECT_EQ(map_->wakeLost(0), 0u);
    ::shutdown(c, SHUT_RDWR);
}

}  // namespace
}  // namespace zcrelay::sockmap_test
