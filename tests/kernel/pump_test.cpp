// The pumps (pump/) driven through their interface, in-process, on a real io_uring and real
// loopback TCP: start(), the ring, onCompletion(), and the Step each one answers, checked
// against what the peers receive and what the pool and the buffer ring hold afterwards.
//
// These are the data paths' logic without a relay process: the verdicts the lifecycle acts on
// (bytes, Finished, Failed with the side and the errno, ToCopy, starved), half-close, and that
// abort/reclaim/quiet leave no pipe and no buffer behind. What the lifecycle then does with a
// verdict is connections_test.cpp's.
#include <gtest/gtest.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "kernel/pump_fixture.hpp"
#include "pump/sockmap_kernel.hpp"
#include "pump/sockmap_pump.hpp"
#include "sockmap.hpp"

namespace zcrelay::pump_test {
namespace {

constexpr uint64_t kSeed = 0x5EED;

bool finWentOut(int fd) {
    int s = tcpState(fd);
    return s == TCP_FIN_WAIT1 || s == TCP_FIN_WAIT2 || s == TCP_CLOSING || s == TCP_TIME_WAIT;
}

bool isPeerGone(int err) { return err == ECONNRESET || err == EPIPE; }

std::string readN(int fd, size_t n) {
    std::string out(n, '\0');
    test::IoResult r = test::readExactly(fd, out.data(), n, kDeadline);
    if (!r.ok()) return "<" + r.describe() + ">";
    return out;
}

// ---------------------------------------------------------------------------------------------
// What every pump answers alike, on splice and on copy.

class PumpPath : public ::testing::TestWithParam<DataPath> {
  protected:
    void SetUp() override {
        rig_ = std::make_unique<Rig>();
        ASSERT_TRUE(rig_->ok());
        pump_ = makePump(GetParam());
    }
    // A direction on fresh links; `small` makes every socket buffer tiny so dst fills fast.
    void connect(bool small = false) {
        if (small) {
            d_.in = makeLink(4096, 0, 4096);
            d_.out = makeLink(0, 4096, 4096);
        } else {
            d_.in = makeLink();
            d_.out = makeLink();
        }
        ASSERT_TRUE(d_.in.relay && d_.out.relay);
    }
    // Closed as the lifecycle closes it; then nothing may be left: no pipe in use, no buffer
    // held, nothing in flight.
    // What Connections::endGracefully does at max_connection_duration, once `queued` has
    // reached src: its reading side shut, what it holds counted.
    void endWithQueued(const std::string& queued) {
        ASSERT_TRUE(test::writeAll(d_.writer(), queued.data(), queued.size()).ok());
        ASSERT_TRUE(waitFd(d_.src(), POLLIN));
        d_.ending = true;
        d_.end_left = endForDuration(d_.src());
        ASSERT_EQ(d_.end_left, queued.size());
    }
    void closeAndExpectNothingLeft() {
        ASSERT_TRUE(rig_->close(d_, pump_)) << "an SQE of the direction never completed";
        EXPECT_EQ(d_.inflight, 0u);
        EXPECT_EQ(rig_->pipes().inUse(), 0u);
        EXPECT_EQ(rig_->stats.pipes_in_use.get(), 0u);
        EXPECT_EQ(rig_->bufs().busy(), 0u);
    }

    std::unique_ptr<Rig> rig_;
    Dir d_;
    Pump pump_;
};

TEST_P(PumpPath, MovesEveryByteInOrderThenPassesTheFin) {
    connect();
    constexpr uint64_t kBytes = 3 * 1024 * 1024 + 123;  // not a multiple of any buffer or pipe
    test::ReceiveCheck got;
    Background reader(d_.reader(), [&] { got = test::receivePayloadUntilEof(d_.reader(), kSeed); });
    Background writer(d_.writer(), [&] {
        test::sendPayload(d_.writer(), kSeed, kBytes);
        ::shutdown(d_.writer(), SHUT_WR);
    });
    ASSERT_EQ(rig_->start(d_, pump_).kind, Step::Wait);
    Seen s = rig_->drive(d_, pump_);
    ASSERT_EQ(s.last.kind, Step::Finished) << describe(s);
    // Every byte counted once, by the steps that wrote it to dst.
    EXPECT_EQ(s.moved, kBytes);
    // Finished means dst was shut down for writing: its FIN is out.
    EXPECT_TRUE(finWentOut(d_.dst())) << "tcp state " << tcpState(d_.dst());
    writer.join();
    reader.join();
    EXPECT_EQ(got.io.status, test::IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, kBytes);
    EXPECT_EQ(got.first_mismatch, -1) << got.describe();
    closeAndExpectNothingLeft();
}

TEST_P(PumpPath, AFinAloneFinishesTheDirectionAndLeavesTheOtherWayOpen) {
    connect();
    ::shutdown(d_.writer(), SHUT_WR);
    rig_->start(d_, pump_);
    Seen s = rig_->drive(d_, pump_);
    ASSERT_EQ(s.last.kind, Step::Finished) << describe(s);
    EXPECT_EQ(s.moved, 0u);
    std::string rest;
    EXPECT_EQ(test::readUntilEof(d_.reader(), rest, kDeadline).status, test::IoStatus::Eof);
    EXPECT_EQ(rest, "");
    // Half-close: only this direction ended. dst still reads what its peer sends, src still
    // writes to its peer (both belong to the other direction).
    ASSERT_TRUE(test::writeAll(d_.reader(), "pong", 4).ok());
    ASSERT_TRUE(waitFd(d_.dst(), POLLIN));
    char buf[8] = {};
    EXPECT_EQ(::recv(d_.dst(), buf, sizeof buf, 0), 4);
    EXPECT_EQ(std::string(buf, 4), "pong");
    EXPECT_EQ(::send(d_.src(), "ping", 4, MSG_NOSIGNAL), 4);
    EXPECT_EQ(readN(d_.writer(), 4), "ping");
    closeAndExpectNothingLeft();
}

TEST_P(PumpPath, ASourceResetFailsOnSrcWithTheErrno) {
    connect();
    rig_->start(d_, pump_);
    test::closeWithReset(d_.in.peer);
    Seen s = rig_->drive(d_, pump_);
    ASSERT_EQ(s.last.kind, Step::Failed) << describe(s);
    EXPECT_TRUE(s.last.on_src);
    EXPECT_EQ(s.last.error, ECONNRESET);
    closeAndExpectNothingLeft();
}

TEST_P(PumpPath, ADestinationResetFailsOnDstAndItsBytesAreDropped) {
    connect();
    rig_->start(d_, pump_);
    test::closeWithReset(d_.out.peer);
    ASSERT_TRUE(waitFd(d_.dst(), POLLERR | POLLHUP)) << "the RST never reached dst";
    ASSERT_TRUE(test::writeAll(d_.writer(), "hello", 5).ok());
    Seen s = rig_->drive(d_, pump_);
    ASSERT_EQ(s.last.kind, Step::Failed) << describe(s);
    EXPECT_FALSE(s.last.on_src);
    EXPECT_TRUE(isPeerGone(s.last.error)) << strerror(s.last.error);
    EXPECT_EQ(s.moved, 0u);
    closeAndExpectNothingLeft();
    // The bytes read for the dead dst went with their pipe: never cached for reuse.
    EXPECT_EQ(rig_->pipes().cached(), 0u);
}

TEST_P(PumpPath, ASourceResetIsSeenWhileDstIsFull) {
    connect(/*small=*/true);
    test::setNonBlocking(d_.writer(), true);
    rig_->start(d_, pump_);
    // Fill everything up: C writes until its own buffer is full while the pump moves what dst
    // takes, and U reads nothing. Then nothing moves: the pump waits for dst and does not read
    // src, C's writes find no room.
    std::vector<char> chunk(16 * 1024, 'x');
    int quiet = 0;
    auto deadline = Clock::now() + kDeadline;
    while (quiet < 3) {
        ASSERT_LT(Clock::now(), deadline) << "dst never filled up";
        bool wrote = ::send(d_.writer(), chunk.data(), chunk.size(), MSG_DONTWAIT) > 0;
        Seen s = rig_->drive(
            d_, pump_, [](const Seen& s) { return s.cqes >= 1; }, 20ms);
        ASSERT_EQ(s.last.kind, Step::Wait) << describe(s);
        quiet = wrote || s.cqes > 0 ? 0 : quiet + 1;
    }
    if (GetParam() == DataPath::Splice) {
        EXPECT_GT(rig_->stats.splice_eagain[0][1].get(), 0u) << "never waited for dst";
    } else {
        EXPECT_GT(rig_->bufs().busy(), 0u) << "no buffer queued for dst";
    }
    test::closeWithReset(d_.in.peer);
    Seen s = rig_->drive(d_, pump_);
    ASSERT_EQ(s.last.kind, Step::Failed) << describe(s);
    EXPECT_TRUE(s.last.on_src);
    EXPECT_EQ(s.last.error, ECONNRESET);
    // Splice reads src only once dst drained the pipe: the watch alone can see the RST.
    if (GetParam() == DataPath::Splice) {
        EXPECT_EQ(s.last_op, Op::Watch);
    }
    closeAndExpectNothingLeft();
    EXPECT_EQ(rig_->pipes().cached(), 0u);  // the pipe held bytes: discarded, not cached
}

TEST_P(PumpPath, WhileEndingTheFinIsKept) {
    connect();
    ASSERT_NO_FATAL_FAILURE(endWithQueued("abc"));
    rig_->start(d_, pump_);
    Seen s = rig_->drive(d_, pump_);
    ASSERT_EQ(s.last.kind, Step::Finished) << describe(s);
    EXPECT_EQ(s.moved, 3u);
    EXPECT_EQ(readN(d_.reader(), 3), "abc");
    // The lifecycle sends both FINs once both directions are done: not the pump.
    EXPECT_EQ(tcpState(d_.dst()), TCP_ESTABLISHED);
    closeAndExpectNothingLeft();
}

TEST_P(PumpPath, WhileEndingASourceResetEndsTheDirectionLikeAFin) {
    connect();
    test::closeWithReset(d_.in.peer);
    ASSERT_TRUE(waitFd(d_.src(), POLLERR | POLLHUP));
    d_.ending = true;
    d_.end_left = endForDuration(d_.src());
    rig_->start(d_, pump_);
    Seen s = rig_->drive(d_, pump_);
    ASSERT_EQ(s.last.kind, Step::Finished) << describe(s);
    EXPECT_EQ(tcpState(d_.dst()), TCP_ESTABLISHED);
    closeAndExpectNothingLeft();
}

// TCP goes on queueing what the peer sends after shutdown(SHUT_RD), and a read returns it: a
// direction that read until src was empty chased a client that kept uploading until the grace
// reset the connection (LifetimeTest.MaxDurationEndsAnUploadWithAnExactPrefixAndEofAtTheBackend
// under the ASan relay). It reads what src held when the end began, at most one recv more.
TEST_P(PumpPath, WhileEndingWhatThePeerSendsAfterTheEndIsNotRead) {
    connect();
    ASSERT_NO_FATAL_FAILURE(endWithQueued("abc"));
    // 256 KiB more, queued behind the three bytes before the pump reads any of them.
    std::string after(256 * 1024, 'z');
    test::setNonBlocking(d_.writer(), true);
    size_t sent = 0;
    while (sent < after.size()) {
        ssize_t n = ::send(d_.writer(), after.data() + sent, after.size() - sent, MSG_DONTWAIT);
        if (n <= 0) break;  // src's receive queue is full: enough is queued
        sent += static_cast<size_t>(n);
    }
    ASSERT_GT(sent, RigOptions{}.buffer_size) << "the peer could not queue more than one recv";
    rig_->start(d_, pump_);
    Seen s = rig_->drive(d_, pump_);
    ASSERT_EQ(s.last.kind, Step::Finished) << describe(s);
    EXPECT_EQ(tcpState(d_.dst()), TCP_ESTABLISHED);
    // Splice asks for exactly what is left; a copy recv is armed for a whole buffer.
    uint64_t most = GetParam() == DataPath::Splice ? 3 : RigOptions{}.buffer_size;
    EXPECT_GE(s.moved, 3u);
    EXPECT_LE(s.moved, most);
    EXPECT_EQ(readN(d_.reader(), s.moved), "abc" + after.substr(0, s.moved - 3));
    closeAndExpectNothingLeft();
}

INSTANTIATE_TEST_SUITE_P(, PumpPath, ::testing::Values(DataPath::Splice, DataPath::Copy),
                         [](const auto& info) { return std::string(label(info.param)); });

// ---------------------------------------------------------------------------------------------
// Splice: the pipe, and falling back to copy.

RigOptions noPipes() {
    RigOptions o;
    o.pipes = 0;
    return o;
}
RigOptions fdCeilingZero() {
    RigOptions o;
    o.pipe_fd_ceiling = 0;
    return o;
}

struct NoPipe {
    const char* name;
    RigOptions options;
    PipeFallback why;
};

class PumpSpliceNoPipe : public ::testing::TestWithParam<NoPipe> {};

TEST_P(PumpSpliceNoPipe, FallsBackToCopyAndCopyTakesOver) {
    Rig rig(GetParam().options);
    ASSERT_TRUE(rig.ok());
    Dir d;
    d.in = makeLink();
    d.out = makeLink();
    Pump pump;  // splice
    rig.start(d, pump);
    ASSERT_TRUE(test::writeAll(d.writer(), "hello", 5).ok());
    Seen s = rig.drive(d, pump);
    ASSERT_EQ(s.last.kind, Step::ToCopy) << describe(s);
    EXPECT_EQ(s.last.fallback, GetParam().why);
    EXPECT_EQ(s.moved, 0u);
    EXPECT_EQ(d.inflight, 0u) << "a direction falling back has nothing armed";
    EXPECT_EQ(rig.pipes().inUse(), 0u);
    // What Connections::apply does with ToCopy: a copy pump takes the watch and starts.
    SourceWatch watch = std::get<SplicePump>(pump).watch();
    pump.emplace<CopyPump>(watch);
    ASSERT_EQ(rig.start(d, pump).kind, Step::Wait);
    ::shutdown(d.writer(), SHUT_WR);
    s = rig.drive(d, pump);
    ASSERT_EQ(s.last.kind, Step::Finished) << describe(s);
    EXPECT_EQ(s.moved, 5u);
    std::string got;
    EXPECT_EQ(test::readUntilEof(d.reader(), got, kDeadline).status, test::IoStatus::Eof);
    EXPECT_EQ(got, "hello");
    ASSERT_TRUE(rig.close(d, pump));
    EXPECT_EQ(rig.bufs().busy(), 0u);
}

INSTANTIATE_TEST_SUITE_P(, PumpSpliceNoPipe,
                         ::testing::Values(NoPipe{"pool_exhausted", noPipes(),
                                                  PipeFallback::PoolExhausted},
                                           NoPipe{"emfile", fdCeilingZero(), PipeFallback::Emfile}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(PumpSplice, AQuietDirectionGivesItsEmptyPipeBack) {
    Rig rig;
    ASSERT_TRUE(rig.ok());
    Dir d;
    d.in = makeLink();
    d.out = makeLink();
    Pump pump;
    rig.start(d, pump);
    ASSERT_TRUE(test::writeAll(d.writer(), "0123456789", 10).ok());
    Seen s = rig.drive(d, pump, [](const Seen& s) { return s.moved >= 10; });
    ASSERT_EQ(s.moved, 10u) << describe(s);
    EXPECT_EQ(readN(d.reader(), 10), "0123456789");
    // The empty pipe stays with the direction through a pause (no shrink and regrow per
    // burst)...
    EXPECT_EQ(rig.pipes().inUse(), 1u);
    EXPECT_EQ(rig.stats.splice_eagain[0][0].get(), 1u) << "the direction waits to read";
    // ...until the sweep finds it quiet through a tick.
    std::get<SplicePump>(pump).quiet(rig.env());
    EXPECT_EQ(rig.pipes().inUse(), 0u);
    EXPECT_EQ(rig.pipes().cached(), 1u);
    EXPECT_EQ(rig.stats.pipes_cached.get(), 1u);
    // The next burst takes it from the cache.
    ASSERT_TRUE(test::writeAll(d.writer(), "abc", 3).ok());
    s = rig.drive(d, pump, [](const Seen& s) { return s.moved >= 3; });
    ASSERT_EQ(s.moved, 3u) << describe(s);
    EXPECT_EQ(rig.pipes().inUse(), 1u);
    EXPECT_EQ(rig.pipes().cached(), 0u);
    EXPECT_EQ(readN(d.reader(), 3), "abc");
    ASSERT_TRUE(rig.close(d, pump));
    EXPECT_EQ(rig.pipes().inUse(), 0u);
    EXPECT_EQ(rig.pipes().cached(), 1u) << "an empty pipe goes back to the cache on abort";
}

TEST(PumpSplice, ABulkFlowGrowsItsPipeAndShrinksItWhenCached) {
    Rig rig;
    ASSERT_TRUE(rig.ok());
    Dir d;
    d.in = makeLink();
    d.out = makeLink();
    d.pipe_size = 1 << 20;
    Pump pump;
    rig.start(d, pump);
    constexpr uint64_t kBytes = 8 * 1024 * 1024;
    test::ReceiveCheck got;
    Background reader(d.reader(), [&] { got = test::receivePayloadUntilEof(d.reader(), kSeed); });
    Background writer(d.writer(), [&] {
        test::sendPayload(d.writer(), kSeed, kBytes);
        ::shutdown(d.writer(), SHUT_WR);
    });
    uint32_t largest = 0;
    Seen s = rig.drive(d, pump, [&](const Seen&) {
        largest = std::max(largest, std::get<SplicePump>(pump).pipe().capacity);
        return false;
    });
    ASSERT_EQ(s.last.kind, Step::Finished) << describe(s);
    EXPECT_EQ(s.moved, kBytes);
    writer.join();
    reader.join();
    EXPECT_EQ(got.bytes, kBytes);
    EXPECT_EQ(got.first_mismatch, -1);
    // A full pipe means bulk: it grew to the listener's pipe_size (1 MiB, fs.pipe-max-size)...
    EXPECT_EQ(largest, 1u << 20);
    // ...and went back shrunk to the start size when the FIN ended the direction.
    EXPECT_EQ(rig.pipes().inUse(), 0u);
    ASSERT_EQ(rig.pipes().cached(), 1u);
    auto again = rig.pipes().acquire();
    ASSERT_TRUE(again.has_value());
    EXPECT_EQ(again->capacity, PipePool::kStartSize);
    rig.pipes().release(*again);
    ASSERT_TRUE(rig.close(d, pump));
}

// ---------------------------------------------------------------------------------------------
// Copy: buffers.

// Takes every buffer of the ring the way a recv of another direction would, and holds them:
// pieces taken from real recv CQEs (BufRing::take), recycled when the test says so.
class BufferHog {
  public:
    BufferHog(Rig& rig, uint32_t buffers, uint32_t buffer_size) : rig_(rig) {
        link_ = makeLink();
        std::string data(buffers * buffer_size, 'h');
        EXPECT_TRUE(test::writeAll(link_.peer.get(), data.data(), data.size()).ok());
        for (uint32_t i = 0; i < buffers; ++i) {
            io_uring_sqe* sqe = rig.ring().sqe();
            prepCopyRecv(sqe, link_.relay.get(), rig.bufs(), RecvWait::Kernel);
            io_uring_sqe_set_data64(sqe, UserData{Op::Recv, 0, kSlot, 1}.pack());
            std::optional<Cqe> c = rig.next(kSlot);
            if (!c || !(c->flags & IORING_CQE_F_BUFFER)) {
                ADD_FAILURE() << "the hog's recv got no buffer: " << (c ? c->res : 0);
                return;
            }
            EXPECT_EQ(c->res, static_cast<int>(buffer_size)) << "a recv that took part of one";
            pieces_.push_back(rig.bufs().take(c->flags, c->res).bid);
        }
    }
    ~BufferHog() { giveBack(); }
    void giveBack() {
        for (uint16_t bid : pieces_) rig_.bufs().recycle(bid);
        pieces_.clear();
    }

  private:
    static constexpr uint32_t kSlot = 99;
    Rig& rig_;
    Link link_;
    std::vector<uint16_t> pieces_;
};

// Two small buffers, both in the kernel's ring from the start.
RigOptions twoBuffers() {
    RigOptions o;
    o.buffers = 2;
    o.buffer_size = 4096;
    o.provided = 2;
    return o;
}

TEST(PumpCopy, AStarvedDirectionWaitsForResume) {
    Rig rig(twoBuffers());
    ASSERT_TRUE(rig.ok());
    BufferHog hog(rig, 2, 4096);
    ASSERT_EQ(rig.bufs().inRing(), 0u);
    Dir d;
    d.in = makeLink();
    d.out = makeLink();
    Pump pump = makePump(DataPath::Copy);
    ASSERT_TRUE(test::writeAll(d.writer(), "hello", 5).ok());
    rig.start(d, pump);
    Seen s = rig.drive(d, pump);
    ASSERT_TRUE(s.starved) << describe(s);
    EXPECT_EQ(s.last.kind, Step::Wait);
    EXPECT_EQ(s.moved, 0u);
    // Nothing is armed but the watch on src: only resume() reads again.
    EXPECT_EQ(d.inflight, 1u);
    EXPECT_FALSE(rig.bufs().replenished());
    hog.giveBack();
    // What the worker's loop looks at before Connections::retryStarved.
    ASSERT_TRUE(rig.bufs().replenished());
    ASSERT_EQ(rig.resume(d, pump).kind, Step::Wait);
    s = rig.drive(d, pump, [](const Seen& s) { return s.moved >= 5; });
    ASSERT_EQ(s.moved, 5u) << describe(s);
    EXPECT_EQ(readN(d.reader(), 5), "hello");
    ::shutdown(d.writer(), SHUT_WR);
    s = rig.drive(d, pump);
    ASSERT_EQ(s.last.kind, Step::Finished) << describe(s);
    ASSERT_TRUE(rig.close(d, pump));
    EXPECT_EQ(rig.bufs().busy(), 0u);
}

TEST(PumpCopy, AStarvedDirectionStillSeesASourceReset) {
    Rig rig(twoBuffers());
    ASSERT_TRUE(rig.ok());
    BufferHog hog(rig, 2, 4096);
    Dir d;
    d.in = makeLink();
    d.out = makeLink();
    Pump pump = makePump(DataPath::Copy);
    ASSERT_TRUE(test::writeAll(d.writer(), "hello", 5).ok());
    rig.start(d, pump);
    Seen s = rig.drive(d, pump);
    ASSERT_TRUE(s.starved) << describe(s);
    test::closeWithReset(d.in.peer);
    s = rig.drive(d, pump);
    ASSERT_EQ(s.last.kind, Step::Failed) << describe(s);
    EXPECT_EQ(s.last_op, Op::Watch);
    EXPECT_TRUE(s.last.on_src);
    EXPECT_EQ(s.last.error, ECONNRESET);
    ASSERT_TRUE(rig.close(d, pump));
    hog.giveBack();
    EXPECT_EQ(rig.bufs().busy(), 0u);
}

TEST(PumpCopy, ZeroCopySendsGiveEveryBufferBack) {
    RigOptions o;
    o.buffer_size = 64 * 1024;
    Rig rig(o);
    ASSERT_TRUE(rig.ok());
    if (!rig.env().send_zc.op) GTEST_SKIP() << "this kernel has no IORING_OP_SEND_ZC (Linux 6.0)";
    Dir d;
    d.in = makeLink();
    d.out = makeLink();
    d.zerocopy = true;
    Pump pump = makePump(DataPath::Copy);
    constexpr uint64_t kBytes = 4 * 1024 * 1024;
    test::ReceiveCheck got;
    Background reader(d.reader(), [&] { got = test::receivePayloadUntilEof(d.reader(), kSeed); });
    Background writer(d.writer(), [&] {
        test::sendPayload(d.writer(), kSeed, kBytes);
        ::shutdown(d.writer(), SHUT_WR);
    });
    rig.start(d, pump);
    Seen s = rig.drive(d, pump);
    ASSERT_EQ(s.last.kind, Step::Finished) << describe(s);
    EXPECT_EQ(s.moved, kBytes);
    writer.join();
    reader.join();
    EXPECT_EQ(got.bytes, kBytes);
    EXPECT_EQ(got.first_mismatch, -1);
    // Notifications still due arrive after the direction finished: the lifecycle gives their
    // buffers back (returnHold), and then none is held.
    ASSERT_TRUE(rig.close(d, pump));
    EXPECT_EQ(rig.bufs().busy(), 0u);
    auto& z = rig.stats.zerocopy_sends;
    uint64_t notified = z[idx(ZerocopySend::Zerocopy)].get() + z[idx(ZerocopySend::Copied)].get() +
                        z[idx(ZerocopySend::Unreported)].get();
    EXPECT_GT(notified, 0u) << "no send went zero-copy";
}

// ---------------------------------------------------------------------------------------------
// Sockmap: the kernel moves the bytes; the pump counts them and passes the FIN once dst has
// queued every one (the kernel pieces themselves are sockmap_*_test.cpp's).

TEST(PumpSockmap, TheKernelMovesTheBytesAndThePumpPassesTheFinAfterThem) {
    if (geteuid() != 0) GTEST_SKIP() << "loading BPF needs CAP_BPF and CAP_NET_ADMIN: run as root";
    auto loaded = Sockmap::load(64, Sockmap::Attach::SkbVerdict);
    ASSERT_TRUE(loaded.has_value()) << "Sockmap::load as root: " << loaded.error();
    std::unique_ptr<Sockmap> map = std::move(*loaded);
    Rig rig;
    ASSERT_TRUE(rig.ok());
    Dir d;
    d.in = makeLink();
    d.out = makeLink();
    SockmapPair pair;
    const int fds[2] = {d.src(), d.dst()};
    PairSetUp set = setUpPair(*map, pair, fds, 0, 4 * 1024 * 1024);
    ASSERT_FALSE(set.fell_back) << label(set.reason);
    Pump pump(std::in_place_type<SockmapPump>, *map, pair.record, 0, 0, 0, 0);
    ASSERT_EQ(rig.start(d, pump).kind, Step::Wait);
    constexpr uint64_t kBytes = 2 * 1024 * 1024 + 7;
    test::ReceiveCheck got;
    Background reader(d.reader(), [&] { got = test::receivePayloadUntilEof(d.reader(), kSeed); });
    Background writer(d.writer(), [&] {
        test::sendPayload(d.writer(), kSeed, kBytes);
        ::shutdown(d.writer(), SHUT_WR);
    });
    Seen s = rig.drive(d, pump);
    ASSERT_EQ(s.last.kind, Step::Finished) << describe(s);
    EXPECT_TRUE(finWentOut(d.dst())) << "tcp state " << tcpState(d.dst());
    writer.join();
    reader.join();
    EXPECT_EQ(got.io.status, test::IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, kBytes);
    EXPECT_EQ(got.first_mismatch, -1);
    // Every byte counted once: by the steps (passed bytes it copied) or as the kernel's.
    uint64_t kernel = std::get<SockmapPump>(pump).kernelBytes(rig.env());
    EXPECT_EQ(s.moved + kernel, kBytes) << "steps " << s.moved << ", kernel " << kernel;
    // Out of the maps before the sockets close, as Paths::tearDown does.
    tearDownPair(*map, pair);
    ASSERT_TRUE(rig.close(d, pump));
    EXPECT_EQ(rig.bufs().busy(), 0u);
}

TEST(PumpSockmap, ASourceResetWhileTheKernelRedirectsFailsOnSrc) {
    if (geteuid() != 0) GTEST_SKIP() << "loading BPF needs CAP_BPF and CAP_NET_ADMIN: run as root";
    auto loaded = Sockmap::load(64, Sockmap::Attach::SkbVerdict);
    ASSERT_TRUE(loaded.has_value()) << "Sockmap::load as root: " << loaded.error();
    std::unique_ptr<Sockmap> map = std::move(*loaded);
    Rig rig;
    ASSERT_TRUE(rig.ok());
    Dir d;
    d.in = makeLink();
    d.out = makeLink();
    SockmapPair pair;
    const int fds[2] = {d.src(), d.dst()};
    ASSERT_FALSE(setUpPair(*map, pair, fds, 0, 4 * 1024 * 1024).fell_back);
    Pump pump(std::in_place_type<SockmapPump>, *map, pair.record, 0, 0, 0, 0);
    rig.start(d, pump);
    ASSERT_TRUE(test::writeAll(d.writer(), "abc", 3).ok());
    EXPECT_EQ(readN(d.reader(), 3), "abc") << "redirected by the kernel, no CQE needed";
    // The only SQE while redirecting: the watch on src, which sees the RST.
    EXPECT_EQ(d.inflight, 1u);
    test::closeWithReset(d.in.peer);
    Seen s = rig.drive(d, pump);
    ASSERT_EQ(s.last.kind, Step::Failed) << describe(s);
    EXPECT_EQ(s.last_op, Op::Watch);
    EXPECT_TRUE(s.last.on_src);
    EXPECT_EQ(s.last.error, ECONNRESET);
    tearDownPair(*map, pair);
    ASSERT_TRUE(rig.close(d, pump));
}

}  // namespace
}  // namespace zcrelay::pump_test
