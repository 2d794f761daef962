// The takeover's wire (proxy/takeover_wire.hpp): a message and its fds cross a real socketpair
// as one record; values with spaces, '=' and bytes outside printable ASCII come back as sent;
// and what is not a message is an error naming what came, with no fd left open.
#include "takeover_wire.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.hpp"
#include "support/seqpacket_pair.hpp"

namespace zcrelay::takeover {
namespace {

using Pair = test::SeqpacketPair;

int64_t soon() { return monotonicMs() + 2000; }

TEST(TakeoverWireTest, AMessageAndItsFdsCrossAsOneRecordInOrder) {
    Pair p;
    int first[2], second[2];
    ASSERT_EQ(::pipe2(first, O_CLOEXEC), 0);
    ASSERT_EQ(::pipe2(second, O_CLOEXEC), 0);
    UniqueFd r1(first[0]), w1(first[1]), r2(second[0]), w2(second[1]);
    Message m("CONN");
    m.set("name", "web one=%two\x01").set("listen", "unix:/run/a b");
    m.set("backend", "a").set("backend", "b");
    const int fds[2] = {r1.get(), r2.get()};
    ASSERT_TRUE(send(p.a.get(), m, soon(), fds));
    EXPECT_GE(::fcntl(r1.get(), F_GETFD), 0) << "the sender's fds stay open";
    auto got = receive(p.b.get(), soon());
    ASSERT_TRUE(got) << got.error();
    EXPECT_EQ(got->verb, "CONN");
    EXPECT_EQ(got->get("name"), "web one=%two\x01");
    EXPECT_EQ(got->get("listen"), "unix:/run/a b");
    EXPECT_EQ(got->get("absent"), "");
    EXPECT_EQ(got->all("backend"), (std::vector<std::string>{"a", "b"}));
    ASSERT_EQ(got->fds.size(), 2u);
    // The same pipes, in the order sent: what goes into each write end comes out of its fd.
    ASSERT_EQ(::write(w1.get(), "x", 1), 1);
    ASSERT_EQ(::write(w2.get(), "y", 1), 1);
    char c = 0;
    EXPECT_EQ(::read(got->fds[0].get(), &c, 1), 1);
    EXPECT_EQ(c, 'x');
    EXPECT_EQ(::read(got->fds[1].get(), &c, 1), 1);
    EXPECT_EQ(c, 'y');
    EXPECT_NE(::fcntl(got->fds[0].get(), F_GETFD) & FD_CLOEXEC, 0) << "received close-on-exec";
}

TEST(TakeoverWireTest, WhatIsNotAMessageIsNamed) {
    EXPECT_EQ(parse("").error(), "an empty message");
    EXPECT_EQ(parse("hello").error(), "a bad verb \"hello\"");
    EXPECT_EQ(parse("OFFER version").error(), "a field without key=value: \"version\"");
    EXPECT_EQ(parse("OFFER =1").error(), "a field without key=value: \"%3D1\"");
    EXPECT_EQ(parse("OFFER a=%4").error(), "a bad escape in \"a%3D%254\"");
    EXPECT_EQ(parse("OFFER a=%zz").error(), "a bad escape in \"a%3D%25zz\"");
    auto ok = parse("OFFER  version=1   pid=42 ");
    ASSERT_TRUE(ok) << ok.error();
    EXPECT_EQ(ok->get("version"), "1");
    EXPECT_EQ(ok->get("pid"), "42");
}

TEST(TakeoverWireTest, TooManyFdsOrARecordTooLongAreRefusedAndClosed) {
    Pair p;
    // One fd more than any message carries.
    int fds[kMaxFds + 1];
    for (int& fd : fds) fd = ::dup(0);
    const char text[] = "SOCKET kind=listener";
    iovec iov{const_cast<char*>(text), sizeof text - 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof fds)] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof fds);
    std::memcpy(CMSG_DATA(cm), fds, sizeof fds);
    ASSERT_EQ(::sendmsg(p.a.get(), &msg, 0), static_cast<ssize_t>(sizeof text - 1));
    for (int fd : fds) ::close(fd);
    auto many = receive(p.b.get(), soon());
    ASSERT_FALSE(many);
    EXPECT_EQ(many.error(), "more than 6 fds in a message");

    std::string longer(kMaxMessage + 10, 'A');
    ASSERT_EQ(::send(p.a.get(), longer.data(), longer.size(), 0),
              static_cast<ssize_t>(longer.size()));
    auto cut = receive(p.b.get(), soon());
    ASSERT_FALSE(cut);
    EXPECT_EQ(cut.error(), "a message too long");

    p.a.reset();
    auto closed = receive(p.b.get(), soon());
    ASSERT_FALSE(closed);
    EXPECT_EQ(closed.error(), "closed");
}

TEST(TakeoverWireTest, AReceiveWithNothingComingTimesOut) {
    Pair p;
    auto nothing = receive(p.b.get(), monotonicMs() + 50);
    ASSERT_FALSE(nothing);
    EXPECT_EQ(nothing.error(), "waiting for a message: timed out");
}

}  // namespace
}  // namespace zcrelay::takeover
