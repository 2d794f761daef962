// The relay's resources under many and slow connections: a slow reader gets every byte while
// the relay's memory stays bounded; copy mode's buffers stay few for one long transfer; two
// hundred concurrent echoes, a thousand idle connections, a thousand short ones leaking no fd.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <string>
#include <thread>
#include <vector>

#include "integration/relay_fixture.hpp"

namespace zcrelay::test::relay_test {
namespace {

// =============================================================================================
// 6. A slow reader: the relay applies backpressure instead of buffering.

class SlowReaderTest : public RelayModeTest {};

TEST_P(SlowReaderTest, SlowClientGetsEveryByteWhileRelayMemoryStaysBounded) {
    constexpr uint64_t kTotal = 100 * kMiB;
    constexpr long kMaxGrowthKiB = 64 * 1024;
    ScriptedUpstream up(AF_INET, sourceScript(kSeedA, kTotal));
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    auto rss0 = relay_.rssKiB();
    ASSERT_TRUE(rss0) << "cannot read VmRSS of pid " << relay_.pid();
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    PayloadVerifier v(kSeedA);
    std::vector<uint8_t> buf(64 * kKiB);
    long max_rss = *rss0;
    IoResult last;
    // Slow phase: 64 KiB every 5 ms for a second (pacing the reader is the point of the test).
    auto slow_start = Clock::now();
    while (secondsSince(slow_start) < 1.0) {
        last = readSome(client.fd.get(), buf.data(), buf.size(), Millis{10'000});
        if (!last.ok()) break;
        v.update(std::span<const uint8_t>(buf.data(), last.bytes));
        if (auto rss = relay_.rssKiB()) max_rss = std::max(max_rss, *rss);
        std::this_thread::sleep_for(Millis{5});
    }
    ASSERT_TRUE(last.ok()) << "the stream ended during the slow phase: " << last.describe()
                           << " after " << v.bytes() << " bytes";
    EXPECT_LT(v.bytes(), kTotal) << "the slow phase should not have read everything";
    // Fast phase.
    IoResult end = readStreamUntilEof(
        client.fd.get(), [&](std::span<const uint8_t> d) { v.update(d); }, Millis{60'000});
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
    EXPECT_EQ(v.bytes(), kTotal);
    EXPECT_TRUE(v.intact()) << "first mismatch at byte " << v.firstMismatch();
    EXPECT_LT(max_rss - *rss0, kMaxGrowthKiB)
        << "relay RSS grew from " << *rss0 << " KiB to " << max_rss
        << " KiB while the client read slowly: it must apply backpressure, not buffer";
    client.fd.reset();
    expectCountersAfterDone(0, kTotal);
}

INSTANTIATE_TEST_SUITE_P(Modes, SlowReaderTest, ::testing::ValuesIn(kModes), modeName);

// Copy mode's buffers are a pool per worker (256 x 64 KiB). The kernel takes provided buffers
// in the order they were given; were the whole pool in its ring, one long transfer would touch
// every buffer in turn and the relay would keep 16 MiB resident for one connection. Only a few
// sit in the ring, topped up with the last recycled one (uring/buf_ring.hpp), so one
// connection touches its queue's worth plus those few: about 2.5 MiB.
TEST(CopyMemoryTest, OneLongTransferKeepsAFewBuffersResidentNotThePool) {
    constexpr uint64_t kTotal = 200 * kMiB;
    constexpr long kMaxGrowthKiB = 6 * 1024;
    RelayFixtureAccess f;
    ScriptedUpstream up(AF_INET, sourceScript(kSeedA, kTotal));
    ASSERT_NO_FATAL_FAILURE(f.startRelay(up, "copy"));
    auto rss0 = f.relay().rssKiB();
    ASSERT_TRUE(rss0) << "cannot read VmRSS of pid " << f.relay().pid();
    Connected client = f.connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeedA, Millis{60'000});
    ASSERT_EQ(got.bytes, kTotal) << got.describe();
    ASSERT_LT(got.first_mismatch, 0) << got.describe();
    auto rss1 = f.relay().rssKiB();
    ASSERT_TRUE(rss1);
    EXPECT_LT(*rss1 - *rss0, kMaxGrowthKiB)
        << "relay RSS grew from " << *rss0 << " KiB to " << *rss1
        << " KiB over one 200 MiB copy transfer: it should touch a few buffers, not the pool";
}

// =============================================================================================
// 7, 8, 9. Many connections.

class ManyConnectionsTest : public RelayModeTest {};

TEST_P(ManyConnectionsTest, TwoHundredConcurrentEchoesAreByteExact) {
    constexpr size_t kConns = 200;
    constexpr uint64_t kBytes = 256 * kKiB;
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));

    struct Conn {
        Fd fd;
        uint64_t seed = 0;
        uint64_t sent = 0;
        std::unique_ptr<PayloadVerifier> verifier;
        IoResult end{IoStatus::Timeout, 0, 0};
        bool done = false;
    };
    std::vector<Conn> conns(kConns);
    for (size_t i = 0; i < kConns; ++i) {
        Connected c = connectClient();
        ASSERT_TRUE(c.fd) << "connection " << i << ": " << c.error;
        setNonBlocking(c.fd.get(), true);
        conns[i].fd = std::move(c.fd);
        conns[i].seed = 1000 + i;
        conns[i].verifier = std::make_unique<PayloadVerifier>(conns[i].seed);
    }

    // One poll loop drives all of them: write the payload, SHUT_WR, read the echo to EOF.
    std::vector<uint8_t> out(64 * kKiB);
    std::vector<uint8_t> in(64 * kKiB);
    size_t open = kConns;
    auto deadline = Clock::now() + Millis{60'000};
    while (open > 0 && Clock::now() < deadline) {
        std::vector<pollfd> pfds;
        std::vector<size_t> idx;
        for (size_t i = 0; i < kConns; ++i) {
            if (conns[i].done) continue;
            short ev = POLLIN;
            if (conns[i].sent < kBytes) ev |= POLLOUT;
            pfds.push_back({conns[i].fd.get(), ev, 0});
            idx.push_back(i);
        }
        if (::poll(pfds.data(), pfds.size(), 100) <= 0) continue;
        for (size_t k = 0; k < pfds.size(); ++k) {
            Conn& c = conns[idx[k]];
            if ((pfds[k].revents & POLLOUT) && c.sent < kBytes) {
                size_t n = static_cast<size_t>(std::min<uint64_t>(out.size(), kBytes - c.sent));
                fillPayload(c.seed, c.sent, std::span<uint8_t>(out.data(), n));
                ssize_t w = ::send(c.fd.get(), out.data(), n, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (w > 0) c.sent += static_cast<uint64_t>(w);
                if (c.sent == kBytes) ::shutdown(c.fd.get(), SHUT_WR);
            }
            if (pfds[k].revents & (POLLIN | POLLERR | POLLHUP)) {
                for (;;) {
                    ssize_t r = ::recv(c.fd.get(), in.data(), in.size(), MSG_DONTWAIT);
                    if (r > 0) {
                        c.verifier->update(std::span<const uint8_t>(in.data(), r));
                        continue;
                    }
                    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
                    if (r < 0 && errno == EINTR) continue;
                    c.end = r == 0 ? IoResult{IoStatus::Eof, c.verifier->bytes(), 0}
                                   : IoResult{IoStatus::Reset, c.verifier->bytes(), errno};
                    c.done = true;
                    --open;
                    break;
                }
            }
        }
    }

    size_t bad = 0;
    std::string first_bad;
    for (size_t i = 0; i < kConns; ++i) {
        const Conn& c = conns[i];
        bool ok = c.end.status == IoStatus::Eof && c.sent == kBytes &&
                  c.verifier->bytes() == kBytes && c.verifier->intact();
        if (!ok && bad++ < 5) {
            first_bad += "\n  conn " + std::to_string(i) + ": sent " + std::to_string(c.sent) +
                         ", echoed " + std::to_string(c.verifier->bytes()) + ", mismatch at " +
                         std::to_string(c.verifier->firstMismatch()) + ", end " + c.end.describe();
        }
    }
    EXPECT_EQ(bad, 0u) << "connections whose echo was not byte-exact then EOF:" << first_bad;
    conns.clear();
    EXPECT_TRUE(up.waitForFinished(kConns, Millis{10'000}))
        << "upstream saw " << up.finished() << " of " << kConns << " connections end";
    expectCountersAfterDone(kConns * kBytes, kConns * kBytes, kConns);
}

TEST_P(ManyConnectionsTest, ThousandIdleConnectionsUseFewThreadsAndNoPipes) {
    constexpr size_t kConns = 1000;
    constexpr int kWorkers = 2;
    ScriptedUpstream up(AF_INET, nullptr);  // accept and hold, no thread per connection
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode(), [](RelayConfig& c) { c.workers = kWorkers; }));

    std::vector<Fd> clients;
    clients.reserve(kConns);
    for (size_t i = 0; i < kConns; ++i) {
        Connected c = connectClient();
        ASSERT_TRUE(c.fd) << "connection " << i << ": " << c.error;
        clients.push_back(std::move(c.fd));
    }
    EXPECT_TRUE(up.waitForAccepted(kConns, Millis{30'000}))
        << "the relay opened " << up.accepted() << " of " << kConns << " upstream connections";
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(),
                                     static_cast<double>(kConns), Millis{30'000}));

    auto threads = relay_.threadCount();
    ASSERT_TRUE(threads) << "cannot read Threads: of pid " << relay_.pid();
    EXPECT_LE(*threads, kWorkers + 8)
        << "idle connections must not cost threads: workers=" << kWorkers;
    EXPECT_TRUE(relay_.waitForMetric(metric::kPipesInUse, {}, 0))
        << "idle connections must hold no pipes";

    clients.clear();
    up.stop();  // the upstream ends too, so every connection finishes
    EXPECT_TRUE(
        relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0, Millis{30'000}));
}

TEST_P(ManyConnectionsTest, ThousandShortConnectionsLeakNoFileDescriptors) {
    constexpr size_t kConns = 1000;
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));

    auto baseline = relay_.openFdCount();  // before any scrape: no metrics socket is open
    ASSERT_TRUE(baseline) << "cannot list /proc/" << relay_.pid() << "/fd";
    auto cached0 = relay_.metric(metric::kPipesCached);

    auto deadline = Clock::now() + Millis{120'000};
    std::vector<uint8_t> msg(64);
    std::vector<uint8_t> echo(64);
    for (size_t i = 0; i < kConns; ++i) {
        ASSERT_LT(Clock::now(), deadline) << "only " << i << " short connections in 120 s";
        Connected c = connectClient();
        ASSERT_TRUE(c.fd) << "connection " << i << ": " << c.error;
        fillPayload(i, 0, msg);
        IoResult w = writeAll(c.fd.get(), msg.data(), msg.size(), Millis{5'000});
        ASSERT_TRUE(w.ok()) << "connection " << i << ": " << w.describe();
        IoResult r = readExactly(c.fd.get(), echo.data(), echo.size(), Millis{5'000});
        ASSERT_TRUE(r.ok()) << "connection " << i << " echo: " << r.describe();
        ASSERT_EQ(msg, echo) << "connection " << i << " echo differs";
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsTotal, metric::listener(),
                                     static_cast<double>(kConns)));
    EXPECT_TRUE(
        relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0, Millis{20'000}));
    EXPECT_TRUE(relay_.waitForMetric(metric::kPipesInUse, {}, 0))
        << "every pipe must be back in the pool once no connection is active";

    // Pipes kept in a per-worker cache legitimately outlive connections (2 fds each). If the relay
    // exports zcrelay_pipes_cached, the count must be exact. The contract does not list that
    // gauge, so otherwise allow one modest pool (64 fds = 32 pipes): a leak of even one fd per
    // connection would show up as ~1000 here.
    constexpr int kPoolAllowanceFds = 64;
    int expected = *baseline;
    int last = -1;
    bool exact = false;
    bool settled = waitUntil(
        [&] {
            auto cached = relay_.metric(metric::kPipesCached);
            exact = cached0.has_value() && cached.has_value();
            if (exact) expected = *baseline + 2 * static_cast<int>(*cached - *cached0);
            last = relay_.openFdCount().value_or(-1);
            // The scrape above opens one short-lived socket in the relay; +1 while it closes.
            return exact ? (last == expected || last == expected + 1)
                         : (last >= 0 && last <= *baseline + kPoolAllowanceFds);
        },
        Millis{20'000});
    if (exact) {
        EXPECT_TRUE(settled) << "open fds: baseline " << *baseline << ", now " << last
                             << ", expected " << expected << " (baseline + 2 x pipes cached)";
    } else {
        EXPECT_TRUE(settled) << "open fds: baseline " << *baseline << ", now " << last << " after "
                             << kConns << " connections (allowed up to baseline + "
                             << kPoolAllowanceFds << " for a pipe cache)";
    }
}

INSTANTIATE_TEST_SUITE_P(Modes, ManyConnectionsTest, ::testing::ValuesIn(kModes), modeName);

}  // namespace
}  // namespace zcrelay::test::relay_test
