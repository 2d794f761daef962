// What an io_uring poll asked only for errors (POLLERR | POLLHUP) reports on a TCP socket whose
// peer sent a FIN: the fact the cluster queue's watch is built on (proxy/connections.cpp,
// Op::QueueWatch; proxy/kernel.md, "A poll always reports a FIN").
//
// io_uring adds EPOLLRDHUP (with EPOLLERR, EPOLLHUP, EPOLLNVAL) to every poll's events, so a
// one-shot poll that asks only for errors completes at once on a socket that has read a FIN, and
// armed again it completes at once again: it can never wait for a later RST there. A multishot
// poll reports the FIN once and stays armed; data arriving does not wake it (the wake-up's key
// holds none of its events), and an RST then completes it with POLLERR | POLLHUP.
#include <gtest/gtest.h>
#include <liburing.h>
#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <optional>
#include <vector>

#include "support/loopback.hpp"

namespace zcrelay {
namespace {

constexpr uint64_t kWatch = 0x9A7C4;

struct Completion {
    int res = 0;
    bool more = false;
};

// Every CQE of `ring` until none came for `quiet`, at most 8 (a poll that fires in a loop).
std::vector<Completion> completions(io_uring* ring, std::chrono::milliseconds quiet) {
    std::vector<Completion> out;
    while (out.size() < 8) {
        io_uring_cqe* cqe = nullptr;
        __kernel_timespec ts{0, std::chrono::nanoseconds(quiet).count()};
        if (io_uring_wait_cqe_timeout(ring, &cqe, &ts) != 0) break;
        if (cqe->user_data == kWatch)
            out.push_back({cqe->res, (cqe->flags & IORING_CQE_F_MORE) != 0});
        io_uring_cqe_seen(ring, cqe);
    }
    return out;
}

class PollFin : public ::testing::Test {
  protected:
    void SetUp() override {
        ASSERT_EQ(io_uring_queue_init(8, &ring_, 0), 0);
        test::Listening l = test::listenLoopback(AF_INET, 8);
        ASSERT_TRUE(l.fd) << l.error;
        test::Connected c = test::connectTo("127.0.0.1", l.port);
        ASSERT_TRUE(c.fd) << c.error;
        client_ = std::move(c.fd);
        server_ = test::Fd(::accept4(l.fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
        ASSERT_TRUE(server_);
    }
    void TearDown() override { io_uring_queue_exit(&ring_); }

    // The client sends a byte and its FIN; the server's socket has both before it returns.
    void clientFin() {
        ASSERT_EQ(::send(client_.get(), "x", 1, MSG_NOSIGNAL), 1);
        ASSERT_EQ(::shutdown(client_.get(), SHUT_WR), 0);
        pollfd p{server_.get(), POLLRDHUP, 0};
        ASSERT_EQ(::poll(&p, 1, 5000), 1);
    }
    void arm(bool multishot) {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (multishot)
            io_uring_prep_poll_multishot(sqe, server_.get(), POLLERR | POLLHUP);
        else
            io_uring_prep_poll_add(sqe, server_.get(), POLLERR | POLLHUP);
        io_uring_sqe_set_data64(sqe, kWatch);
        ASSERT_EQ(io_uring_submit(&ring_), 1);
    }

    io_uring ring_{};
    test::Fd client_, server_;
};

TEST_F(PollFin, AOneShotPollForErrorsCompletesAtOnceOnAFin) {
    ASSERT_NO_FATAL_FAILURE(clientFin());
    for (int round = 0; round < 2; ++round) {
        ASSERT_NO_FATAL_FAILURE(arm(false));
        auto got = completions(&ring_, std::chrono::milliseconds(200));
        ASSERT_EQ(got.size(), 1u) << "round " << round;
        EXPECT_EQ(got[0].res & (POLLRDHUP | POLLERR | POLLHUP), POLLRDHUP) << "round " << round;
    }
}

TEST_F(PollFin, AMultishotPollReportsTheFinOnceThenWaitsForTheReset) {
    ASSERT_NO_FATAL_FAILURE(clientFin());
    ASSERT_NO_FATAL_FAILURE(arm(true));
    auto got = completions(&ring_, std::chrono::milliseconds(200));
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].res & (POLLRDHUP | POLLERR | POLLHUP), POLLRDHUP);
    EXPECT_TRUE(got[0].more) << "still armed";
    // Nothing more happens on the socket, and nothing more completes.
    EXPECT_TRUE(completions(&ring_, std::chrono::milliseconds(200)).empty());
    test::closeWithReset(client_);
    got = completions(&ring_, std::chrono::milliseconds(500));
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].res & (POLLERR | POLLHUP), POLLERR | POLLHUP);
}

TEST_F(PollFin, AMultishotPollIsNotWokenByData) {
    ASSERT_NO_FATAL_FAILURE(arm(true));
    for (int i = 0; i < 4; ++i) ASSERT_EQ(::send(client_.get(), "data", 4, MSG_NOSIGNAL), 4);
    EXPECT_TRUE(completions(&ring_, std::chrono::milliseconds(200)).empty());
    test::closeWithReset(client_);
    auto got = completions(&ring_, std::chrono::milliseconds(500));
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].res & (POLLERR | POLLHUP), POLLERR | POLLHUP);
}

}  // namespace
}  // namespace zcrelay
