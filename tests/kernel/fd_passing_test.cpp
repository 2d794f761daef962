// What a connection's handover stands on (proxy/handover.hpp; proxy/kernel.md, "A socket and a
// pipe cross processes whole"): an fd passed with SCM_RIGHTS names the same open file, so a TCP
// socket keeps its connection, its queues and its unread bytes, and a pipe keeps the bytes in
// it. Closing the sender's fd afterwards is closing one reference of two: no FIN, no RST, the
// bytes stay. Here the "other process" is the receiving end of a SOCK_SEQPACKET pair, which is
// what the kernel sees either way (the file moves through the socket's queue).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "clock.hpp"
#include "support/loopback.hpp"
#include "support/seqpacket_pair.hpp"
#include "takeover_wire.hpp"

namespace zcrelay {
namespace {

using namespace std::chrono_literals;

// `fds` sent over a fresh SOCK_SEQPACKET pair and received: the receiver's fds.
std::vector<UniqueFd> passed(std::initializer_list<int> fds) {
    test::SeqpacketPair pair;
    const std::vector<int> list(fds);
    EXPECT_TRUE(
        takeover::send(pair.a.get(), takeover::Message("CONN"), monotonicMs() + 2000, list));
    auto m = takeover::receive(pair.b.get(), monotonicMs() + 2000);
    EXPECT_TRUE(m) << m.error();
    return m ? std::move(m->fds) : std::vector<UniqueFd>{};
}

TEST(FdPassing, ATcpSocketCrossesWithItsUnreadBytesAndTheSendersCloseSendsNothing) {
    test::Listening l = test::listenLoopback(AF_INET);
    ASSERT_TRUE(l.fd) << l.error;
    test::Connected peer = test::connectTo("127.0.0.1", l.port);
    ASSERT_TRUE(peer.fd) << peer.error;
    UniqueFd mine(::accept4(l.fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
    ASSERT_TRUE(mine);
    ASSERT_TRUE(test::writeAll(peer.fd.get(), "unread", 6).ok());  // queued, not read here

    std::vector<UniqueFd> theirs = passed({mine.get()});
    ASSERT_EQ(theirs.size(), 1u);
    mine.reset();  // the old relay's close: one reference of two

    char c;
    EXPECT_EQ(::recv(peer.fd.get(), &c, 1, MSG_DONTWAIT), -1) << "the peer saw a FIN";
    EXPECT_EQ(errno, EAGAIN) << "the peer saw " << strerror(errno);
    char got[6] = {};
    ASSERT_TRUE(test::readExactly(theirs[0].get(), got, 6, 2s).ok());
    EXPECT_EQ(std::string(got, 6), "unread");
    ASSERT_TRUE(test::writeAll(theirs[0].get(), "back", 4).ok());
    ASSERT_TRUE(test::readExactly(peer.fd.get(), got, 4, 2s).ok());
    EXPECT_EQ(std::string(got, 4), "back");
}

TEST(FdPassing, APipeCrossesWithTheBytesInIt) {
    int p[2];
    ASSERT_EQ(::pipe2(p, O_CLOEXEC | O_NONBLOCK), 0);
    UniqueFd r(p[0]), w(p[1]);
    std::string bytes(60'000, '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7);
    ASSERT_EQ(::write(w.get(), bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));

    std::vector<UniqueFd> theirs = passed({r.get(), w.get()});
    ASSERT_EQ(theirs.size(), 2u);
    r.reset();
    w.reset();
    std::string got(bytes.size(), '\0');
    EXPECT_EQ(::read(theirs[0].get(), got.data(), got.size()), static_cast<ssize_t>(got.size()));
    EXPECT_EQ(got, bytes);
    EXPECT_EQ(::write(theirs[1].get(), "x", 1), 1) << "the write end crossed writable";
}

}  // namespace
}  // namespace zcrelay
