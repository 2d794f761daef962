// What a cancelled io_uring accept does to the other processes accepting on the same socket:
// the fact the takeover's old relay sweeps its queues for (proxy/acceptor.cpp, Acceptor::close
// and sweep; proxy/kernel.md, "A cancelled accept keeps its wakeup").
//
// io_uring arms an accept that finds the queue empty as a poll with EPOLLEXCLUSIVE, so a new
// connection wakes one armed accept, the first in the socket's wait queue, and no other. The
// woken request retries the accept in its task work, which on a DEFER_TASKRUN ring (the
// relay's) runs only when that ring next waits. Cancelled before that, the request ends with
// -ECANCELED and the connection stays in the accept queue, and the wakeup is spent: every other
// accept armed on the socket sleeps on until the next connection arrives. After the hand-over
// of a takeover that is the old relay's accepts (armed first) cancelled at its drain, with the
// new relay's armed behind them: under a load that then pauses, a client waits for nothing.
#include <gtest/gtest.h>
#include <liburing.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "support/loopback.hpp"
#include "uring/ring.hpp"
#include "uring/user_data.hpp"

namespace zcrelay {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kAccept = 0xACCE97;  // no UserData the Ring packs (its cancel's is 0)

void armAccept(io_uring* ring, int listening) {
    io_uring_sqe* sqe = io_uring_get_sqe(ring);
    io_uring_prep_accept(sqe, listening, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    io_uring_sqe_set_data64(sqe, kAccept);
    ASSERT_EQ(io_uring_submit(ring), 1);
}

// The next CQE of `ring` within `wait` whose user_data is `ud`; its res, or nullopt.
std::optional<int> completion(io_uring* ring, uint64_t ud, std::chrono::milliseconds wait) {
    auto deadline = std::chrono::steady_clock::now() + wait;
    while (std::chrono::steady_clock::now() < deadline) {
        io_uring_cqe* cqe = nullptr;
        __kernel_timespec ts{0, 10'000'000};
        if (io_uring_wait_cqe_timeout(ring, &cqe, &ts) != 0) continue;
        const uint64_t got = cqe->user_data;
        const int res = cqe->res;
        io_uring_cqe_seen(ring, cqe);
        if (got == ud) return res;
    }
    return std::nullopt;
}

// A client whose handshake the listener completed: it waits in the accept queue.
test::Fd queuedClient(int listening, uint16_t port) {
    test::Connected c = test::connectTo("127.0.0.1", port);
    EXPECT_TRUE(c.fd) << c.error;
    pollfd p{listening, POLLIN, 0};  // a plain poll is not exclusive: it takes no wakeup
    EXPECT_EQ(::poll(&p, 1, 5000), 1) << "the connection never reached the accept queue";
    return std::move(c.fd);
}

class AcceptWakeup : public ::testing::Test {
  protected:
    void SetUp() override {
        ASSERT_TRUE(listening_.fd) << listening_.error;
        auto relay = Ring::create(16);  // the relay's flags: DEFER_TASKRUN where there is one
        ASSERT_TRUE(relay) << relay.error().message();
        old_ = std::move(*relay);
        ASSERT_TRUE(old_->flags() & IORING_SETUP_DEFER_TASKRUN) << "this kernel has none";
        ASSERT_EQ(io_uring_queue_init(16, &next_, 0), 0);
    }
    void TearDown() override { io_uring_queue_exit(&next_); }

    test::Listening listening_ = test::listenLoopback(AF_INET);
    std::unique_ptr<Ring> old_;  // the relay that hands over
    io_uring next_{};            // the relay that took over, accepting on the same socket
};

TEST_F(AcceptWakeup, ACancelledAcceptTakesItsConnectionsWakeupWithIt) {
    const int l = listening_.fd.get();
    armAccept(old_->raw(), l);  // first in the wait queue: the one woken
    armAccept(&next_, l);
    test::Fd client = queuedClient(l, listening_.port);

    old_->cancel(l);  // submitted without waiting: the woken accept's task work has not run
    ASSERT_EQ(old_->submit(), 1);
    EXPECT_EQ(completion(old_->raw(), kAccept, 2s), -ECANCELED);

    // The next relay's accept was never woken, though the connection waits.
    EXPECT_EQ(completion(&next_, kAccept, 300ms), std::nullopt);
    pollfd p{l, POLLIN, 0};
    EXPECT_EQ(::poll(&p, 1, 0), 1) << "the connection left the queue";
    // A plain accept takes it: what the old relay's sweep does.
    test::Fd swept(::accept4(l, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    EXPECT_TRUE(swept) << "accept4: " << strerror(errno);
}

TEST_F(AcceptWakeup, AWokenAcceptWhoseRingWaitsTakesTheConnection) {
    // The same two accepts, and no cancel: the woken one completes once its ring waits, and
    // the connection is accepted. The lost wakeup is the cancel's doing alone.
    const int l = listening_.fd.get();
    armAccept(old_->raw(), l);
    armAccept(&next_, l);
    test::Fd client = queuedClient(l, listening_.port);
    std::optional<int> res = completion(old_->raw(), kAccept, 2s);
    ASSERT_TRUE(res);
    EXPECT_GE(*res, 0) << strerror(-*res);
    if (res && *res >= 0) ::close(*res);
    EXPECT_EQ(completion(&next_, kAccept, 100ms), std::nullopt) << "one connection, one wakeup";
    old_->cancel(l);
    old_->submit();
}

}  // namespace
}  // namespace zcrelay
