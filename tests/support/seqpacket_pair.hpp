#pragma once
// A connected SOCK_SEQPACKET pair, nonblocking: the takeover channel's kind of socket
// (proxy/takeover_wire.hpp), for the cases that put records and fds through one.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include "unique_fd.hpp"

namespace zcrelay::test {

struct SeqpacketPair {
    UniqueFd a, b;
    SeqpacketPair() {
        int fds[2];
        EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds), 0);
        a.reset(fds[0]);
        b.reset(fds[1]);
    }
};

}  // namespace zcrelay::test
