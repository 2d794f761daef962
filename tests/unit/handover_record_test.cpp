// A live connection as it crosses (proxy/handover.hpp): a CONN record and its fds cross a real
// socketpair and come back as sent, pipes in order; a record that lies about its fds, or lacks
// what a connection needs, is an error naming it, and the fds that came are closed. A sockmap
// connection's state, and the RING that brings its maps. What a taker takes (Acceptance) and
// the fds the old side may send it.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.hpp"
#include "handover.hpp"
#include "support/seqpacket_pair.hpp"

namespace zcrelay::handover {
namespace {

using Pair = test::SeqpacketPair;

HandedConn sample() {
    HandedConn h;
    h.listener = "web front";
    h.cluster = "app";
    h.backend = "127.0.0.1:8080";
    h.route = "api";
    h.client = *parseAddress("192.0.2.7:40000");
    h.local = *parseAddress("[::1]:443");
    h.start_unix_us = 1'700'000'000'000'000;
    h.age_us = 3'600'000'000;
    h.quiet_ms = 1'234;
    h.connect_us = 210;
    h.attempts = 2;
    h.bytes[0] = 1ull << 40;
    h.bytes[1] = 17;
    h.proxy_in = 107;
    h.proxy_out = 52;
    h.dir[0] = {true, true, false, 0, false, false, {}};
    h.dir[1] = {false, true, true, 65'536, false, false, {}};
    return h;
}

TEST(HandoverRecordTest, AConnectionAndItsFdsCrossAsSent) {
    Pair p;
    int sockets[2], pipe_fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets), 0);
    ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
    UniqueFd s0(sockets[0]), s1(sockets[1]), r(pipe_fds[0]), w(pipe_fds[1]);
    ASSERT_EQ(::write(w.get(), "inflight", 8), 8);
    const HandedConn sent = sample();
    const int fds[4] = {s0.get(), s1.get(), r.get(), w.get()};
    ASSERT_TRUE(takeover::send(p.a.get(), toMessage(sent), monotonicMs() + 2000, fds));

    auto m = takeover::receive(p.b.get(), monotonicMs() + 2000);
    ASSERT_TRUE(m) << m.error();
    auto got = fromMessage(*m);
    ASSERT_TRUE(got) << got.error();
    EXPECT_EQ(got->listener, sent.listener);
    EXPECT_EQ(got->cluster, sent.cluster);
    EXPECT_EQ(got->backend, sent.backend);
    EXPECT_EQ(got->route, sent.route);
    EXPECT_EQ(got->client.toString(), sent.client.toString());
    EXPECT_EQ(got->local.toString(), sent.local.toString());
    EXPECT_EQ(got->start_unix_us, sent.start_unix_us);
    EXPECT_EQ(got->age_us, sent.age_us);
    EXPECT_EQ(got->quiet_ms, sent.quiet_ms);
    EXPECT_EQ(got->connect_us, sent.connect_us);
    EXPECT_EQ(got->attempts, sent.attempts);
    EXPECT_EQ(got->bytes[0], sent.bytes[0]);
    EXPECT_EQ(got->bytes[1], sent.bytes[1]);
    EXPECT_EQ(got->proxy_in, 107u);
    EXPECT_EQ(got->proxy_out, 52u);
    for (int d = 0; d < 2; ++d) {
        EXPECT_EQ(got->dir[d].finished, sent.dir[d].finished) << d;
        EXPECT_EQ(got->dir[d].eof, sent.dir[d].eof) << d;
        EXPECT_EQ(got->dir[d].hup, sent.dir[d].hup) << d;
        EXPECT_EQ(got->dir[d].in_pipe, sent.dir[d].in_pipe) << d;
    }
    ASSERT_TRUE(got->client_fd && got->upstream_fd);
    EXPECT_FALSE(got->pipe_read[0]) << "direction 0 had no bytes in a pipe";
    ASSERT_TRUE(got->pipe_read[1] && got->pipe_write[1]);
    // The pipe that crossed holds the bytes put in before, and the sockets are the same pair.
    char back[8] = {};
    EXPECT_EQ(::read(got->pipe_read[1].get(), back, 8), 8);
    EXPECT_EQ(std::string(back, 8), "inflight");
    ASSERT_EQ(::write(got->client_fd.get(), "x", 1), 1);
    EXPECT_EQ(::read(s1.get(), back, 1), 1);
}

TEST(HandoverRecordTest, ARecordThatLiesAboutItsFdsOrLacksWhatAConnectionNeedsIsRefused) {
    Pair p;
    int sockets[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets), 0);
    UniqueFd s0(sockets[0]), s1(sockets[1]);
    const int two[2] = {s0.get(), s1.get()};

    // It says a pipe holds bytes, and no pipe came.
    ASSERT_TRUE(takeover::send(p.a.get(), toMessage(sample()), monotonicMs() + 2000, two));
    auto m = takeover::receive(p.b.get(), monotonicMs() + 2000);
    ASSERT_TRUE(m) << m.error();
    auto bad = fromMessage(*m);
    ASSERT_FALSE(bad);
    EXPECT_EQ(bad.error(), "CONN listener=web front: 2 fds came, 4 expected");
    m.value().fds.clear();  // closed here: none of them leaks

    HandedConn nameless = sample();
    nameless.dir[1].in_pipe = 0;
    nameless.backend.clear();
    ASSERT_TRUE(takeover::send(p.a.get(), toMessage(nameless), monotonicMs() + 2000, two));
    m = takeover::receive(p.b.get(), monotonicMs() + 2000);
    ASSERT_TRUE(m) << m.error();
    bad = fromMessage(*m);
    ASSERT_FALSE(bad);
    EXPECT_EQ(bad.error(), "CONN listener=web front: no listener, cluster or backend");

    takeover::Message garbled = toMessage(sample());
    garbled.fields.erase(garbled.fields.begin() + 6);  // "start"
    bad = fromMessage(garbled);
    ASSERT_FALSE(bad);
    EXPECT_EQ(bad.error(), "CONN listener=web front: a missing or bad number");
    takeover::Message done = *takeover::parse("DONE listeners=2");
    EXPECT_FALSE(fromMessage(done));
}

// `m` as received with two sockets (stand-ins: the record's checks count them only).
takeover::Message withTwoFds(const takeover::Message& sent) {
    takeover::Message m = *takeover::parse(sent.line());
    for (int i = 0; i < 2; ++i) m.fds.emplace_back(::eventfd(0, EFD_CLOEXEC));
    return m;
}

// A sockmap connection: each direction's phase and counts, and the pair's place in the maps,
// come back as sent; a direction on sockmap without its pair is refused.
TEST(HandoverRecordTest, ASockmapConnectionsStateCrossesAsSent) {
    HandedConn sent = sample();
    sent.dir[1].in_pipe = 0;
    sent.dir[0].sockmap = true;
    sent.dir[0].kernel = {2, true, 107, 107, 4'000'000'123, 1ull << 41, 99, UINT64_MAX, 98, 97};
    sent.dir[1].sockmap = true;
    sent.dir[1].kernel.phase = 4;
    sent.pair = {149'290, 4'968, {true, true}, {true, false}, true};
    takeover::Message m = withTwoFds(toMessage(sent));
    auto got = fromMessage(m);
    ASSERT_TRUE(got) << got.error();
    for (int d = 0; d < 2; ++d) {
        const SockmapResting &a = got->dir[d].kernel, &b = sent.dir[d].kernel;
        EXPECT_TRUE(got->dir[d].sockmap);
        EXPECT_EQ(a.phase, b.phase);
        EXPECT_EQ(a.stopped, b.stopped);
        EXPECT_EQ(a.src_skipped, b.src_skipped);
        EXPECT_EQ(a.dst_extra, b.dst_extra);
        EXPECT_EQ(a.dst_before, b.dst_before);
        EXPECT_EQ(a.seen, b.seen);
        EXPECT_EQ(a.taken, b.taken);
        EXPECT_EQ(a.end_passed, b.end_passed);
        EXPECT_EQ(a.consumed, b.consumed);
        EXPECT_EQ(a.copied, b.copied);
    }
    EXPECT_EQ(got->pair.map_id, 149'290u);
    EXPECT_EQ(got->pair.record, 4'968u);
    EXPECT_TRUE(got->pair.linked[0] && got->pair.linked[1]);
    EXPECT_TRUE(got->pair.in_map[0]);
    EXPECT_FALSE(got->pair.in_map[1]);
    EXPECT_TRUE(got->pair.promoted);

    sent.pair.map_id = 0;  // on sockmap, and in no maps
    m = withTwoFds(toMessage(sent));
    auto bad = fromMessage(m);
    ASSERT_FALSE(bad);
    EXPECT_EQ(bad.error(), "CONN listener=web front: a sockmap direction without its pair");
    sent.pair.map_id = 149'290;
    m = withTwoFds(toMessage(sent));
    for (auto& [key, value] : m.fields)
        if (key == "sm1") value = "4,0,0";
    bad = fromMessage(m);
    ASSERT_FALSE(bad);
    EXPECT_EQ(bad.error(), "CONN listener=web front: a bad sm1");
}

// A ring and its map set: five fds, in order; fewer is an error naming the map set.
TEST(HandoverRecordTest, ARingCrossesWithItsMapsFds) {
    Pair p;
    int fds[HandedRing::kFds];
    std::vector<UniqueFd> held;
    for (int& fd : fds) {
        fd = ::eventfd(0, EFD_CLOEXEC);
        held.emplace_back(fd);
    }
    HandedRing sent;
    sent.map_id = 7;
    sent.rings = 2;
    sent.records_per_worker = 9'936;
    sent.ring = 1;
    sent.layout = "1/120/16";
    ASSERT_TRUE(takeover::send(p.a.get(), toMessage(sent), monotonicMs() + 2000, fds));
    auto m = takeover::receive(p.b.get(), monotonicMs() + 2000);
    ASSERT_TRUE(m) << m.error();
    auto got = ringFromMessage(*m);
    ASSERT_TRUE(got) << got.error();
    EXPECT_EQ(got->map_id, 7u);
    EXPECT_EQ(got->rings, 2u);
    EXPECT_EQ(got->records_per_worker, 9'936u);
    EXPECT_EQ(got->ring, 1u);
    EXPECT_EQ(got->layout, "1/120/16");
    for (const UniqueFd& fd : got->fds) EXPECT_TRUE(fd);

    ASSERT_TRUE(takeover::send(p.a.get(), toMessage(sent), monotonicMs() + 2000, {fds, 4}));
    m = takeover::receive(p.b.get(), monotonicMs() + 2000);
    ASSERT_TRUE(m) << m.error();
    got = ringFromMessage(*m);
    ASSERT_FALSE(got);
    EXPECT_EQ(got.error(), "RING map=7: 4 fds came, 5 expected");
    sent.ring = 2;  // past the rings it says there are
    m = *takeover::parse(toMessage(sent).line());
    EXPECT_FALSE(ringFromMessage(*m));
}

TEST(HandoverRecordTest, ATakerSaysWhatItTakesAndTheGiverSpendsItsRoom) {
    Acceptance a;
    a.fds = 6;
    a.listeners = {"web"};
    a.backends = {"app/127.0.0.1:8080"};
    a.sockmap = "1/120/16";
    takeover::Message ready("READY");
    a.addTo(ready);
    const Acceptance said = Acceptance::from(*takeover::parse(ready.line()));
    EXPECT_EQ(said.fds, 6u);
    EXPECT_EQ(said.sockmap, "1/120/16");
    EXPECT_TRUE(said.takes("web", "app", "127.0.0.1:8080"));
    EXPECT_FALSE(said.takes("web", "app", "127.0.0.1:8081")) << "a backend it has not";
    EXPECT_FALSE(said.takes("other", "app", "127.0.0.1:8080")) << "a listener it has not";

    Outbound out(UniqueFd(), said, 1, monotonicMs() + 1000);
    EXPECT_TRUE(out.adoptsSockmap("1/120/16"));
    EXPECT_FALSE(out.adoptsSockmap("2/128/16")) << "another record layout";
    EXPECT_TRUE(out.admits("web", "app", "127.0.0.1:8080", 4));
    EXPECT_FALSE(out.admits("web", "app", "127.0.0.1:8080", 4)) << "past the fds it said";
    EXPECT_TRUE(out.admits("web", "app", "127.0.0.1:8080", 2));
    EXPECT_FALSE(out.admits("web", "app", "127.0.0.1:8080", 2));
    out.workerDone();
    EXPECT_TRUE(out.waitForWorkers(monotonicMs() + 1000));
}

}  // namespace
}  // namespace zcrelay::handover
