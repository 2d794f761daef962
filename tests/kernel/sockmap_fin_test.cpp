// A FIN through the sockmap: never redirected itself, and held back by the FIN barrier until the
// peer's send queue has taken every byte before it.
#include <gtest/gtest.h>
#include <poll.h>

#include <cstring>
#include <string>

#include "kernel/sockmap_fixture.hpp"

namespace zcrelay::sockmap_test {
namespace {

// What `fd` has taken into its send queue, by its own TCP_INFO: the dst half of the barrier's
// formula, read without going through checkQueued().
uint64_t queuedOn(int fd) {
    tcp_info i = tcpInfo(fd);
    return i.tcpi_bytes_sent - i.tcpi_bytes_retrans + i.tcpi_notsent_bytes;
}

// A FIN is not data: after C's SHUT_WR the program sees a FIN-only skb (len 0) and must drop it,
// not redirect it. Redirected, the psock worker's zero-length send to B reports EPIPE on B
// (sk_psock_backlog() treats a 0 return as a broken pipe). User space propagates the FIN:
// POLLRDHUP, checkEof() == Eof, checkFinBarrier() == Done, shutdown(B). Then the same the other
// way round, to the end of both directions: no socket may be left with an error.
TEST_P(SockmapTest, FinOnlySkbIsNotRedirected) {
    constexpr uint64_t kRequest = 1 * kMiB;
    constexpr uint64_t kReply = 4 * kKiB;
    constexpr uint32_t kBase = 6;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, kBase, kLimit);
    ASSERT_FALSE(s.fell_back) << label(s.reason);

    // C -> U.
    test::ReceiveCheck at_u;
    {
        Background reader(u, [&] { at_u = test::receivePayloadUntilEof(u, kSeedUp, 30s); });
        IoResult sent = test::sendPayload(c, kSeedUp, kRequest, 30s);
        ASSERT_TRUE(sent.ok()) << sent.describe();
        // Every byte through the verdict before the FIN leaves C: A's receive queue is empty
        // when it arrives, and C had nothing unsent to hang it on (tcp_send_fin() then builds a
        // skb of its own), so the FIN reaches the program as its own zero-length skb.
        ASSERT_TRUE(test::waitUntil([&] { return counters(kBase).redirected == kRequest; }, 10s))
            << counters(kBase);
        ASSERT_EQ(::shutdown(c, SHUT_WR), 0);
        ASSERT_TRUE(waitForEvents(a, POLLRDHUP, 5s)) << "A never saw C's FIN";
        SockmapEof eof = awaitEof(a, false, 5s);
        ASSERT_EQ(eof.kind, SockmapEof::Eof)
            << "kind " << int(eof.kind) << " " << std::strerror(eof.error);
        SockmapBarrier bar = awaitFinBarrier(a, b, 10s);
        ASSERT_EQ(bar.kind, SockmapBarrier::Done)
            << "kind " << int(bar.kind) << ", remaining " << bar.remaining << ", "
            << std::strerror(bar.error);
        ASSERT_EQ(::shutdown(b, SHUT_WR), 0);
        reader.join();
    }
    EXPECT_EQ(at_u.io.status, IoStatus::Eof) << at_u.describe();
    EXPECT_EQ(at_u.bytes, kRequest) << at_u.describe();
    EXPECT_EQ(at_u.first_mismatch, -1) << at_u.describe();
    Counters up = counters(kBase);
    EXPECT_EQ(up.flags & ZCR_BROKEN, 0u) << up;
    EXPECT_EQ(up.redirected, kRequest) << up;
    EXPECT_EQ(up.passed, 0u) << up;
    EXPECT_EQ(socketError(b), 0) << "B, written to by the psock and then shut down";

    // U -> C, with B's write side already shut: the case the EPIPE was seen in.
    test::ReceiveCheck at_c;
    {
        Background reader(c, [&] { at_c = test::receivePayloadUntilEof(c, kSeedDown, 30s); });
        IoResult sent = test::sendPayload(u, kSeedDown, kReply, 30s);
        ASSERT_TRUE(sent.ok()) << sent.describe();
        ASSERT_TRUE(test::waitUntil([&] { return counters(kBase + 1).redirected == kReply; }, 10s))
            << counters(kBase + 1);
        ASSERT_EQ(::shutdown(u, SHUT_WR), 0);
        ASSERT_TRUE(waitForEvents(b, POLLRDHUP, 5s)) << "B never saw U's FIN";
        SockmapEof eof = awaitEof(b, true, 5s);
        ASSERT_EQ(eof.kind, SockmapEof::Eof)
            << "kind " << int(eof.kind) << " " << std::strerror(eof.error);
        SockmapBarrier bar = awaitFinBarrier(b, a, 10s);
        ASSERT_EQ(bar.kind, SockmapBarrier::Done) << "remaining " << bar.remaining;
        ASSERT_EQ(::shutdown(a, SHUT_WR), 0);
        reader.join();
    }
    EXPECT_EQ(at_c.io.status, IoStatus::Eof) << at_c.describe();
    EXPECT_EQ(at_c.bytes, kReply) << at_c.describe();
    EXPECT_EQ(at_c.first_mismatch, -1) << at_c.describe();
    Counters down = counters(kBase + 1);
    EXPECT_EQ(down.flags & ZCR_BROKEN, 0u) << down;
    EXPECT_EQ(down.redirected, kReply) << down;

    // Both directions are done. With FINs dropped, no psock send failed: a peek on either
    // socket says end of stream, not EPIPE, even when its own write side does not excuse one.
    for (int fd : {a, b}) {
        SockmapEof end = checkEof(fd, false);
        EXPECT_EQ(end.kind, SockmapEof::Eof) << (fd == a ? "A" : "B") << ": kind " << int(end.kind)
                                             << " " << std::strerror(end.error);
        EXPECT_EQ(socketError(fd), 0) << (fd == a ? "A" : "B");
    }
}

// The FIN barrier in front of a deep backlog, with a reader that does not read. Unbounded, the
// program takes every skb off A's receive queue and the kernel uncharges it from A (tcp_read_skb()
// re-owns it with skb_set_owner_sk_safe()), so A's window stays open: C's 32 MiB and its FIN all
// reach A while most of the bytes wait in B's psock backlog. The barrier must say Wait until B's
// send queue has taken all of them; a shutdown(B) at Done must then lose nothing. (The worker's
// limit keeps that backlog small: InFlightLimitPassesTheRestToUserSpace, in
// sockmap_passed_bytes_test.cpp.)
TEST_P(SockmapTest, BarrierWaitsForASlowReader) {
    constexpr uint64_t kTotal = 32 * kMiB;
    constexpr uint32_t kBase = 100;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, kBase, kUnbounded);
    ASSERT_FALSE(s.fell_back) << label(s.reason);

    IoResult sent;
    Background sender(c, [&] {
        sent = test::sendPayload(c, kSeedUp, kTotal, 30s);
        if (sent.ok()) ::shutdown(c, SHUT_WR);
    });
    ASSERT_TRUE(waitForEvents(a, POLLRDHUP, 30s))
        << "C's FIN never reached A while U was not reading: A received "
        << tcpInfo(a).tcpi_bytes_received << " bytes, B queued " << queuedOn(b) << ", "
        << counters(kBase);
    SockmapEof eof = awaitEof(a, false, 5s);
    ASSERT_EQ(eof.kind, SockmapEof::Eof)
        << "kind " << int(eof.kind) << " " << std::strerror(eof.error);
    sender.join();
    ASSERT_TRUE(sent.ok()) << sent.describe();
    EXPECT_EQ(tcpInfo(a).tcpi_bytes_received, kTotal + 1) << "bytes_received counts the FIN";

    // U has read nothing: B holds at most its send buffer plus U's receive window.
    SockmapBarrier first = checkFinBarrier(a, b);
    ASSERT_EQ(first.kind, SockmapBarrier::Wait)
        << "Done with U having read nothing: B queued " << queuedOn(b) << " of " << kTotal;
    EXPECT_GT(first.remaining, 0u);
    EXPECT_LE(first.remaining, kTotal);
    EXPECT_FALSE(
        test::waitUntil([&] { return checkFinBarrier(a, b).kind != SockmapBarrier::Wait; }, 200ms))
        << "the barrier must keep waiting while U does not read";

    // U reads 64 KiB at a time and the barrier is asked after every read. At the first Done, B
    // must hold every byte by its own accounting: the send queue counters, and the bytes not
    // yet acked (SIOCOUTQ, read first) plus those waiting at U (SIOCINQ) plus those U read.
    PayloadVerifier at_u(kSeedUp);
    std::vector<uint8_t> buf(64 * kKiB);
    uint64_t waits = 0;
    bool done = false;
    auto deadline = Clock::now() + 60s;
    while (!done && Clock::now() < deadline) {
        IoResult r = test::readSome(u, buf.data(), buf.size(), 10s);
        ASSERT_TRUE(r.ok()) << "U: " << describe(r, at_u);
        at_u.update(std::span<const uint8_t>(buf.data(), r.bytes));
        SockmapBarrier bar = checkFinBarrier(a, b);
        ASSERT_NE(bar.kind, SockmapBarrier::Failed) << std::strerror(bar.error);
        if (bar.kind == SockmapBarrier::Wait) {
            EXPECT_GT(bar.remaining, 0u);
            ++waits;
            continue;
        }
        uint64_t unacked = outq(b);
        uint64_t waiting = inq(u);
        EXPECT_GE(queuedOn(b), kTotal) << "Done with U at " << at_u.bytes();
        EXPECT_GE(unacked + waiting + at_u.bytes(), kTotal)
            << "Done with bytes missing: unacked " << unacked << ", at U " << waiting << ", read "
            << at_u.bytes();
        done = true;
    }
    ASSERT_TRUE(done) << "the barrier never said Done; U read " << at_u.bytes();
    EXPECT_GT(waits, 0u);
    RecordProperty("first_remaining", std::to_string(first.remaining));
    RecordProperty("waits_while_reading", std::to_string(waits));
    ASSERT_EQ(::shutdown(b, SHUT_WR), 0);
    IoResult rest = test::readStreamUntilEof(
        u, [&](std::span<const uint8_t> d) { at_u.update(d); }, 30s);
    EXPECT_EQ(rest.status, IoStatus::Eof) << describe(rest, at_u);
    EXPECT_EQ(at_u.bytes(), kTotal) << "U after shutdown(B) at Done";
    EXPECT_TRUE(at_u.intact()) << describe(rest, at_u);
    Counters k = counters(kBase);
    EXPECT_EQ(k.redirected, kTotal) << k;
    EXPECT_EQ(k.passed, 0u) << k;
    EXPECT_EQ(socketError(b), 0);
    EXPECT_EQ(k.flags & ZCR_BROKEN, 0u) << k;
}

}  // namespace
}  // namespace zcrelay::sockmap_test
