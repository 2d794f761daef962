// The verdict's choice between redirecting and passing: bytes redirected both ways, the in-flight
// count at the first byte, and a missing peer that makes the program pass instead of drop.
#include <gtest/gtest.h>

#include <string>

#include "kernel/sockmap_fixture.hpp"

namespace zcrelay::sockmap_test {
namespace {

// Both directions at once, 8 MiB each: every byte is redirected by the program (none passed to
// user space) and arrives byte-exact and in order. Unbounded: with the worker's limit, a burst
// that outruns the psock's sending may legitimately be passed (the next tests cover that).
TEST_P(SockmapTest, RedirectsBothWaysByteExact) {
    constexpr uint64_t kBytes = 8 * kMiB;
    constexpr uint32_t kBase = 10;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, kBase, kUnbounded);
    ASSERT_FALSE(s.fell_back) << label(s.reason);
    ASSERT_EQ(s.path[0], DataPath::Sockmap);
    ASSERT_EQ(s.path[1], DataPath::Sockmap);
    EXPECT_TRUE(p->conn.in_map[0] && p->conn.in_map[1] && p->conn.linked[0] && p->conn.linked[1]);
    EXPECT_EQ(p->conn.record, kBase);
    EXPECT_EQ(countKeys(map_->socksMapId()), 2);
    EXPECT_EQ(countKeys(map_->linksMapId()), 2);
    EXPECT_EQ(counters(kBase).limit, kUnbounded);

    int c = p->client.get(), u = p->upstream.get();
    IoResult sent_up, sent_down, got_up, got_down;
    PayloadVerifier at_u(kSeedUp), at_c(kSeedDown);
    {
        Background send_up(c, [&] { sent_up = test::sendPayload(c, kSeedUp, kBytes, 30s); });
        Background send_down(u, [&] { sent_down = test::sendPayload(u, kSeedDown, kBytes, 30s); });
        Background recv_up(u, [&] { got_up = readInto(u, at_u, kBytes, 30s); });
        got_down = readInto(c, at_c, kBytes, 30s);
        send_up.join();
        send_down.join();
        recv_up.join();
    }
    EXPECT_TRUE(sent_up.ok()) << sent_up.describe();
    EXPECT_TRUE(sent_down.ok()) << sent_down.describe();
    EXPECT_TRUE(got_up.ok() && at_u.intact()) << "at U: " << describe(got_up, at_u);
    EXPECT_TRUE(got_down.ok() && at_c.intact()) << "at C: " << describe(got_down, at_c);

    // U read kBytes, so the program has counted them; the wait is for the last increment to
    // become visible, not for bytes still in flight.
    EXPECT_TRUE(test::waitUntil(
        [&] {
            return counters(kBase).redirected == kBytes && counters(kBase + 1).redirected == kBytes;
        },
        5s));
    for (uint32_t i : {kBase, kBase + 1}) {
        Counters k = counters(i);
        EXPECT_EQ(k.redirected, kBytes) << "record " << i << " " << k;
        EXPECT_EQ(k.passed, 0u) << "record " << i << " " << k;
    }
    EXPECT_EQ(inq(u), 0u) << "nothing extra at U";
    EXPECT_EQ(inq(c), 0u) << "nothing extra at C";
}

// The program counts the bytes in flight towards the peer as redirected + consumed - the peer's
// bytes_acked. A socket that connect()ed starts with bytes_acked == 1, not 0: the kernel counts
// the SYN that the SYN-ACK acknowledged (tcp_ack() advances snd_una past it); an accepted
// socket starts at 0. B, the relay's upstream socket, is the connecting kind, so for C -> U the
// count must allow for that one byte, both at the first byte and whenever B has everything
// acknowledged. Each direction here sends 1 KiB on an idle pair, twice: all of it must be
// redirected, none passed.
TEST_P(SockmapTest, InFlightCountAllowsForTheAckedSyn) {
    constexpr uint64_t kChunk = 1 * kKiB;
    constexpr uint32_t kBase = 20;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    EXPECT_EQ(tcpInfo(b).tcpi_bytes_acked, 1u) << "connect()ed: the acked SYN counts";
    EXPECT_EQ(tcpInfo(a).tcpi_bytes_acked, 0u) << "accepted: nothing acked yet";
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, kBase, kLimit);
    ASSERT_FALSE(s.fell_back) << label(s.reason);

    struct Way {
        const char* name;
        int from, to, peer;  // peer: the relay socket the program redirects to
        uint32_t record;
        uint64_t seed;
        uint64_t syn;  // the peer's bytes_acked before any byte
    };
    for (const Way& w : {Way{"C -> U", c, u, b, kBase, kSeedUp, 1},
                         Way{"U -> C", u, c, a, kBase + 1, kSeedDown, 0}}) {
        PayloadVerifier at(w.seed);
        for (uint64_t round = 1; round <= 2; ++round) {
            ASSERT_TRUE(test::sendPayloadAt(w.from, w.seed, (round - 1) * kChunk, kChunk, 5s).ok());
            IoResult got = readInto(w.to, at, round * kChunk, 2s);
            Counters k = counters(w.record);
            EXPECT_TRUE(got.ok() && at.intact())
                << w.name << " round " << round << ": " << describe(got, at) << ", " << k;
            EXPECT_EQ(k.redirected, round * kChunk) << w.name << " round " << round << ": " << k;
            EXPECT_EQ(k.passed, 0u)
                << w.name << " round " << round
                << ": passed, so the in-flight count (redirected + consumed - bytes_acked of the "
                   "peer, which is "
                << tcpInfo(w.peer).tcpi_bytes_acked << ") went below zero: " << k;
            if (k.passed != 0) break;  // the rest would only repeat it
            // Idle again: the peer has every byte acknowledged before the next round.
            ASSERT_TRUE(test::waitUntil(
                [&] { return tcpInfo(w.peer).tcpi_bytes_acked == round * kChunk + w.syn; }, 5s))
                << w.name << ": bytes_acked " << tcpInfo(w.peer).tcpi_bytes_acked;
        }
    }
}

// A in the map, its peer B not: the redirect fails, and the program must pass the bytes to A
// instead of returning the helper's SK_DROP (TCP has already acknowledged them). It keeps
// passing after B goes in too, for as long as user space has not moved every passed byte
// (consumed != passed), so A's bytes never overtake one another. Once the test, as the worker,
// has copied them to B and published consumed == passed, the program redirects again, behind
// them.
TEST_P(SockmapTest, PeerMissingPassesInsteadOfDropping) {
    constexpr uint64_t kFirst = 1 * kMiB;
    constexpr uint64_t kSecond = 256 * kKiB;
    constexpr uint64_t kThird = 512 * kKiB;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    SockmapPair& conn = p->conn;
    for (int i = 0; i < 2; ++i) {
        auto cookie = socketCookie(p->fds[i]);
        ASSERT_TRUE(cookie.has_value()) << cookie.error().message();
        conn.cookie[i] = *cookie;
    }
    for (int i = 0; i < 2; ++i) {
        auto linked = map_->link(conn.cookie[i], conn.cookie[1 - i], i, kLimit, 0);
        ASSERT_TRUE(linked.has_value()) << linked.error().message();
        conn.linked[i] = true;
    }
    auto inserted = map_->insert(a, conn.cookie[0]);
    ASSERT_TRUE(inserted.has_value()) << inserted.error().message();
    conn.in_map[0] = true;
    EXPECT_EQ(countKeys(map_->socksMapId()), 1);

    // A's passed bytes are charged to A's receive buffer: read while C sends.
    PayloadVerifier at_a(kSeedUp);
    IoResult sent, got;
    {
        Background sender(c, [&] { sent = test::sendPayload(c, kSeedUp, kFirst, 30s); });
        got = readInto(a, at_a, kFirst, 30s);
        sender.join();
    }
    ASSERT_TRUE(sent.ok()) << sent.describe();
    ASSERT_TRUE(got.ok() && at_a.intact()) << "plain recv on A: " << describe(got, at_a);
    Counters k = counters(0);
    EXPECT_EQ(k.passed, kFirst) << k;
    EXPECT_EQ(k.redirected, 0u) << k;

    inserted = map_->insert(b, conn.cookie[1]);
    ASSERT_TRUE(inserted.has_value()) << inserted.error().message();
    conn.in_map[1] = true;
    {
        Background sender(c, [&] { sent = test::sendPayloadAt(c, kSeedUp, kFirst, kSecond, 30s); });
        got = readInto(a, at_a, kFirst + kSecond, 30s);
        sender.join();
    }
    ASSERT_TRUE(sent.ok()) << sent.describe();
    EXPECT_TRUE(got.ok() && at_a.intact()) << "after B went in: " << describe(got, at_a);
    k = counters(0);
    EXPECT_EQ(k.passed, kFirst + kSecond) << "consumed != passed keeps it passing: " << k;
    EXPECT_EQ(k.redirected, 0u) << k;
    EXPECT_EQ(inq(u), 0u) << "no byte of C's may reach U while A passes";
    Counters other = counters(1);
    EXPECT_EQ(other.redirected + other.passed, 0u) << other;

    // The test read them, as the worker's copy path would: it sends them on to B and says so.
    IoResult copied = test::sendPayload(b, kSeedUp, kFirst + kSecond, 10s);
    ASSERT_TRUE(copied.ok()) << copied.describe();
    storeRelaxed(map_->record(0).consumed, __u64{kFirst + kSecond});
    PayloadVerifier at_u(kSeedUp);
    IoResult sent_third;
    {
        Background sender(c, [&] {
            sent_third = test::sendPayloadAt(c, kSeedUp, kFirst + kSecond, kThird, 30s);
        });
        got = readInto(u, at_u, kFirst + kSecond + kThird, 30s);
        sender.join();
    }
    ASSERT_TRUE(sent_third.ok()) << sent_third.describe();
    EXPECT_TRUE(got.ok() && at_u.intact())
        << "at U, copied then redirected: " << describe(got, at_u);
    k = counters(0);
    EXPECT_EQ(k.redirected, kThird) << "caught up, the program redirects again: " << k;
    EXPECT_EQ(k.passed, kFirst + kSecond) << k;
}

// Past max_connection_duration the pump sets a source's stop (stopRedirecting): what that
// socket receives afterwards is passed, in order, and never reaches the peer, and the
// redirected count stops moving, so the FIN can wait for exactly that many bytes. The other
// direction, not told, goes on redirecting.
TEST_P(SockmapTest, StopPassesWhatArrivesAfterItAndFreezesTheRedirectedCount) {
    constexpr uint64_t kBefore = 1 * kMiB;
    constexpr uint64_t kAfter = 256 * kKiB;
    constexpr uint64_t kBack = 64 * kKiB;
    constexpr uint32_t kBase = 20;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, kBase, kUnbounded);
    ASSERT_FALSE(s.fell_back) << label(s.reason);
    int a = p->a.get(), c = p->client.get(), u = p->upstream.get();

    IoResult sent, got;
    PayloadVerifier at_u(kSeedUp);
    {
        Background sender(c, [&] { sent = test::sendPayload(c, kSeedUp, kBefore, 30s); });
        got = readInto(u, at_u, kBefore, 30s);
        sender.join();
    }
    ASSERT_TRUE(sent.ok()) << sent.describe();
    ASSERT_TRUE(got.ok() && at_u.intact()) << "at U: " << describe(got, at_u);
    ASSERT_TRUE(test::waitUntil([&] { return counters(kBase).redirected == kBefore; }, 5s))
        << counters(kBase);

    stopRedirecting(*map_, kBase, a);
    EXPECT_EQ(loadRelaxed(map_->record(kBase).stop), 1u);
    // Another payload, so that any byte of it at U, or of the first at A, shows.
    PayloadVerifier at_a(kSeedDown);
    {
        Background sender(c, [&] { sent = test::sendPayload(c, kSeedDown, kAfter, 30s); });
        got = readInto(a, at_a, kAfter, 30s);
        sender.join();
    }
    ASSERT_TRUE(sent.ok()) << sent.describe();
    EXPECT_TRUE(got.ok() && at_a.intact()) << "passed, at A: " << describe(got, at_a);
    Counters k = counters(kBase);
    EXPECT_EQ(k.redirected, kBefore) << "redirected after stop: " << k;
    EXPECT_EQ(k.passed, kAfter) << k;
    EXPECT_EQ(inq(u), 0u) << "a byte sent after stop reached U";

    PayloadVerifier at_c(kSeedDown);
    {
        Background sender(u, [&] { sent = test::sendPayload(u, kSeedDown, kBack, 30s); });
        got = readInto(c, at_c, kBack, 30s);
        sender.join();
    }
    ASSERT_TRUE(sent.ok()) << sent.describe();
    EXPECT_TRUE(got.ok() && at_c.intact()) << "at C: " << describe(got, at_c);
    EXPECT_TRUE(test::waitUntil([&] { return counters(kBase + 1).redirected == kBack; }, 5s))
        << "U -> C still redirects: " << counters(kBase + 1);
    EXPECT_EQ(counters(kBase + 1).passed, 0u) << counters(kBase + 1);
}

}  // namespace
}  // namespace zcrelay::sockmap_test
