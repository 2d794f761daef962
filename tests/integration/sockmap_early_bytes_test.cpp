// Bytes that reach the relay's sockets before or while they enter the SOCKHASH: a request or a
// banner waiting for the set-up's peek, and bursts both ways racing the insertion.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iostream>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "integration/sockmap_fixture.hpp"

namespace zcrelay::test::sockmap_test {
namespace {

// A stream that should be payload `base + k` for one k < count, which the receiver learns from
// its first 8 bytes: each connection's bytes must come from its own peer, in order.
class AnyOfPayloads {
  public:
    AnyOfPayloads(uint64_t base, uint64_t count) : base_(base), count_(count) {}

    void update(std::span<const uint8_t> data) {
        if (!verifier_ && !unknown_) {
            size_t take = std::min(kHead - head_.size(), data.size());
            head_.insert(head_.end(), data.begin(), data.begin() + static_cast<ptrdiff_t>(take));
            data = data.subspan(take);
            if (head_.size() < kHead) return;
            uint8_t expect[kHead];
            for (uint64_t k = 0; k < count_ && !verifier_; ++k) {
                fillPayload(base_ + k, 0, expect);
                if (std::memcmp(expect, head_.data(), kHead) == 0) {
                    seed_ = base_ + k;
                    verifier_.emplace(base_ + k);
                }
            }
            if (verifier_)
                verifier_->update(head_);
            else
                unknown_ = true;
        }
        if (verifier_)
            verifier_->update(data);
        else
            unknown_bytes_ += data.size();
    }
    uint64_t bytes() const {
        return verifier_ ? verifier_->bytes() : head_.size() + unknown_bytes_;
    }
    bool intact() const { return verifier_ && verifier_->intact(); }
    std::optional<uint64_t> seed() const { return seed_; }
    std::string describe() const {
        std::ostringstream os;
        os << bytes() << " bytes";
        if (unknown_) os << " whose first 8 match no sender's payload";
        if (seed_) os << " of seed " << *seed_;
        if (verifier_ && !verifier_->intact())
            os << ", FIRST MISMATCH at byte " << verifier_->firstMismatch();
        return os.str();
    }

  private:
    static constexpr size_t kHead = 8;
    uint64_t base_;
    uint64_t count_;
    std::vector<uint8_t> head_;
    std::optional<uint64_t> seed_;
    std::optional<PayloadVerifier> verifier_;
    bool unknown_ = false;
    uint64_t unknown_bytes_ = 0;
};

// =============================================================================================
// Bytes that arrive before the sockets are in the map.

// The request reaches the relay's client socket before it enters the map: it sits in the
// receive queue, where no verdict runs until another segment arrives, and the client sends none
// until it has the answer. The relay's MSG_PEEK at set-up must push it through. Two hundred
// times, so the request sometimes lands before, sometimes during the set-up.
TEST_F(SockmapTest, ClientSpeaksFirstAndWaitsForTheAnswer) {
    constexpr size_t kRounds = 200;
    constexpr size_t kRequest = 200;
    constexpr size_t kAnswer = 300;
    ScriptedUpstream up(AF_INET, [](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                    ScriptedUpstream&) {
        std::vector<uint8_t> req(kRequest);
        rec.read_end = readExactly(fd.get(), req.data(), req.size(), kAnswerDeadline, &stop);
        rec.bytes_received = rec.read_end.bytes;
        if (!rec.read_end.ok()) {
            rec.note = "the request never arrived whole";
            return;
        }
        StreamHash h;
        h.update(req);
        rec.received_hash = h.value();
        std::vector<uint8_t> answer(kAnswer);
        fillPayload(kSeedB + rec.index, 0, answer);
        rec.write_end = writeAll(fd.get(), answer.data(), answer.size(), kAnswerDeadline, &stop);
        rec.bytes_sent = rec.write_end.bytes;
        if (!rec.write_end.ok()) return;
        rec.read_end = waitForPeerClose(fd.get(), kAnswerDeadline);
        ::shutdown(fd.get(), SHUT_WR);
    });
    ASSERT_NO_FATAL_FAILURE(startRelay(up));

    double slowest = 0;
    std::vector<uint8_t> req(kRequest);
    std::vector<uint8_t> answer(kAnswer);
    std::vector<uint8_t> expected(kAnswer);
    for (size_t i = 0; i < kRounds; ++i) {
        Connected c = connectClient();
        ASSERT_TRUE(c.fd) << "round " << i << ": " << c.error;
        fillPayload(kSeedA + i, 0, req);
        auto t0 = Clock::now();
        IoResult w = writeAll(c.fd.get(), req.data(), req.size(), kAnswerDeadline);
        ASSERT_TRUE(w.ok()) << "round " << i << " request: " << w.describe();
        IoResult r = readExactly(c.fd.get(), answer.data(), answer.size(), kAnswerDeadline);
        if (!r.ok()) {
            auto rec = up.waitForRecord(i, Millis{5'000});
            FAIL() << "round " << i << ": the client sent its request and got no answer within "
                   << kAnswerDeadline.count() << " ms: " << r.describe() << "\nupstream: "
                   << (rec ? rec->describe() : "no record (its script is still running)")
                   << "\nfallbacks: " << describe(fallbacks()) << "\n"
                   << relay_.diagnostics();
        }
        slowest = std::max(slowest, secondsSince(t0));
        fillPayload(kSeedB + i, 0, expected);
        ASSERT_EQ(answer, expected) << "round " << i << ": the answer is not the upstream's";
        ::shutdown(c.fd.get(), SHUT_WR);
        IoResult end = waitForPeerClose(c.fd.get(), kAnswerDeadline);
        ASSERT_EQ(end.status, IoStatus::Eof) << "round " << i << ": " << end.describe();
        auto rec = up.waitForRecord(i, kAnswerDeadline);
        ASSERT_TRUE(rec) << "round " << i << ": the upstream script did not finish";
        EXPECT_EQ(rec->received_hash, payloadHash(kSeedA + i, kRequest)) << rec->describe();
        EXPECT_EQ(rec->read_end.status, IoStatus::Eof) << rec->describe();
    }
    std::cout << "[ sockmap  ] slowest answer: " << slowest * 1000 << " ms\n";
    expectClosed(kRounds * kRequest, kRounds * kAnswer, kRounds);
    // The client socket goes into the map first and its peer right after: a request that
    // arrives in between is passed and caught up by copy, which is no fallback. The upstream
    // speaks only after the request arrived, when both sockets are in the map.
    expectNoFallbacks();
}

// The mirror image: the upstream's banner may arrive before the upstream socket enters the
// map. It waits in the receive queue for the set-up's peek, and the verdict it then runs finds
// the client's socket already in the map (it goes in first): redirected, like any later byte.
// The client writes nothing until it has the banner.
TEST_F(SockmapTest, ServerFirstBanner) {
    constexpr size_t kRounds = 200;
    constexpr size_t kBanner = 64;
    constexpr size_t kReply = 100;
    ScriptedUpstream up(AF_INET, [](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                    ScriptedUpstream&) {
        std::vector<uint8_t> banner(kBanner);
        fillPayload(kSeedB + rec.index, 0, banner);
        rec.write_end = writeAll(fd.get(), banner.data(), banner.size(), kAnswerDeadline, &stop);
        rec.bytes_sent = rec.write_end.bytes;
        if (!rec.write_end.ok()) return;
        std::vector<uint8_t> reply(kReply);
        rec.read_end = readExactly(fd.get(), reply.data(), reply.size(), kAnswerDeadline, &stop);
        rec.bytes_received = rec.read_end.bytes;
        if (!rec.read_end.ok()) {
            rec.note = "the client's reply never arrived whole";
            return;
        }
        StreamHash h;
        h.update(reply);
        rec.received_hash = h.value();
        ::shutdown(fd.get(), SHUT_WR);
        rec.read_end = waitForPeerClose(fd.get(), kAnswerDeadline);
    });
    ASSERT_NO_FATAL_FAILURE(startRelay(up));

    std::vector<uint8_t> banner(kBanner);
    std::vector<uint8_t> expected(kBanner);
    std::vector<uint8_t> reply(kReply);
    for (size_t i = 0; i < kRounds; ++i) {
        Connected c = connectClient();
        ASSERT_TRUE(c.fd) << "round " << i << ": " << c.error;
        IoResult r = readExactly(c.fd.get(), banner.data(), banner.size(), kAnswerDeadline);
        if (!r.ok()) {
            auto rec = up.waitForRecord(i, Millis{5'000});
            FAIL() << "round " << i << ": no banner within " << kAnswerDeadline.count()
                   << " ms: " << r.describe() << "\nupstream: "
                   << (rec ? rec->describe() : "no record (its script is still running)")
                   << "\nfallbacks: " << describe(fallbacks()) << "\n"
                   << relay_.diagnostics();
        }
        fillPayload(kSeedB + i, 0, expected);
        ASSERT_EQ(banner, expected) << "round " << i << ": the banner is not the upstream's";
        fillPayload(kSeedA + i, 0, reply);
        IoResult w = writeAll(c.fd.get(), reply.data(), reply.size(), kAnswerDeadline);
        ASSERT_TRUE(w.ok()) << "round " << i << " reply: " << w.describe();
        ::shutdown(c.fd.get(), SHUT_WR);
        IoResult end = waitForPeerClose(c.fd.get(), kAnswerDeadline);
        ASSERT_EQ(end.status, IoStatus::Eof)
            << "round " << i << ": after the exchange the upstream's FIN must arrive; "
            << end.describe();
        auto rec = up.waitForRecord(i, kAnswerDeadline);
        ASSERT_TRUE(rec) << "round " << i << ": the upstream script did not finish";
        EXPECT_EQ(rec->received_hash, payloadHash(kSeedA + i, kReply)) << rec->describe();
        EXPECT_EQ(rec->read_end.status, IoStatus::Eof) << rec->describe();
    }
    expectClosed(kRounds * kReply, kRounds * kBanner, kRounds);
    // No connection falls back whole. Bytes handed to the relay instead of redirected
    // (catch-ups: backpressure past the in-flight bound) are legitimate but must stay rare, or
    // this test mostly measured copy.
    expectNoFallbacks();
    const double catchups =
        relay_.metric(metric::kSockmapCatchupsTotal, metric::listener()).value_or(-1);
    EXPECT_GE(catchups, 0) << metric::kSockmapCatchupsTotal << " is not exported";
    EXPECT_LE(catchups, kRounds / 10.0) << "most banners bypassed the kernel path";
}

// =============================================================================================
// Bursts in both directions while the relay sets the pairs up.

// Twenty clients connect and blast 4 MiB at once; each upstream blasts 4 MiB back the moment it
// accepts. A client's first segments can arrive before its peer is in the map: passed, and
// moved by the catch-up copy until the redirect takes over. Either way every stream arrives
// whole, in order, from its own peer.
TEST_F(SockmapTest, BurstRacingInsertion) {
    constexpr size_t kClients = 20;
    constexpr uint64_t kBytes = 4 * kMiB;
    struct UpstreamSaw {
        std::string what;
        std::optional<uint64_t> seed;
        bool intact = false;
        uint64_t bytes = 0;
        IoResult end;
    };
    std::mutex mu;
    std::vector<UpstreamSaw> upstream_saw;
    ScriptedUpstream up(AF_INET, [&](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                     ScriptedUpstream& self) {
        std::thread writer([&] {
            rec.write_end = sendPayload(fd.get(), kSeedB + rec.index, kBytes, kBulkDeadline, &stop);
            rec.bytes_sent = rec.write_end.bytes;
            if (rec.write_end.ok()) ::shutdown(fd.get(), SHUT_WR);
        });
        AnyOfPayloads v(kSeedA, kClients);
        rec.read_end = readStreamUntilEof(
            fd.get(),
            [&](std::span<const uint8_t> d) {
                v.update(d);
                self.addLiveBytes(d.size());
            },
            kBulkDeadline, &stop);
        if (rec.read_end.status != IoStatus::Eof) ::shutdown(fd.get(), SHUT_RDWR);
        writer.join();
        std::lock_guard lock(mu);
        upstream_saw.push_back({v.describe(), v.seed(), v.intact(), v.bytes(), rec.read_end});
    });
    ASSERT_NO_FATAL_FAILURE(startRelay(up));

    struct ClientSaw {
        std::string error;
        IoResult sent;
        IoResult end;
        std::string what;
        std::optional<uint64_t> seed;
        bool intact = false;
        uint64_t bytes = 0;
    };
    std::vector<ClientSaw> clients(kClients);
    std::vector<std::thread> threads;
    for (size_t i = 0; i < kClients; ++i) {
        threads.emplace_back([&, i] {
            ClientSaw& me = clients[i];
            Connected c = connectClient();
            if (!c.fd) {
                me.error = c.error;
                return;
            }
            std::thread writer([&] {
                me.sent = sendPayload(c.fd.get(), kSeedA + i, kBytes, kBulkDeadline);
                if (me.sent.ok()) ::shutdown(c.fd.get(), SHUT_WR);
            });
            AnyOfPayloads v(kSeedB, kClients);
            me.end = readStreamUntilEof(
                c.fd.get(), [&](std::span<const uint8_t> d) { v.update(d); }, kBulkDeadline);
            if (me.end.status != IoStatus::Eof) ::shutdown(c.fd.get(), SHUT_RDWR);
            writer.join();
            me.what = v.describe();
            me.seed = v.seed();
            me.intact = v.intact();
            me.bytes = v.bytes();
        });
    }
    for (auto& t : threads) t.join();

    std::set<uint64_t> client_seeds;
    for (size_t i = 0; i < kClients; ++i) {
        const ClientSaw& c = clients[i];
        EXPECT_EQ(c.error, "") << "client " << i;
        EXPECT_TRUE(c.sent.ok()) << "client " << i << " send: " << c.sent.describe();
        EXPECT_EQ(c.end.status, IoStatus::Eof) << "client " << i << ": " << c.end.describe();
        EXPECT_TRUE(c.intact && c.bytes == kBytes) << "client " << i << " received " << c.what;
        if (c.seed) client_seeds.insert(*c.seed);
    }
    EXPECT_EQ(client_seeds.size(), kClients)
        << "each client must receive the stream of its own upstream connection";
    if (!up.waitForFinished(kClients, Millis{10'000})) {
        auto body = relay_.scrape();
        std::string relay_counts;
        for (const Sample& x : parseMetrics(body.value_or(""))) {
            if (x.name == metric::kBytesTotal || x.name == metric::kConnectionsActive ||
                x.name == metric::kSockmapSockets || x.name.rfind("zcrelay_sockmap_", 0) == 0)
                relay_counts += "\n  " + formatSeries(x.name, x.labels) + " " +
                                std::to_string(static_cast<long long>(x.value));
        }
        FAIL() << "every client got its stream and EOF, but only " << up.finished() << " of "
               << kClients << " upstream connections ended within 10 s; the upstreams received "
               << up.liveBytesReceived() << " of " << kClients * kBytes << " bytes in all"
               << "\nrelay:" << relay_counts << "\n"
               << relay_.diagnostics();
    }
    std::set<uint64_t> upstream_seeds;
    {
        std::lock_guard lock(mu);
        for (const UpstreamSaw& u : upstream_saw) {
            EXPECT_EQ(u.end.status, IoStatus::Eof) << u.end.describe();
            EXPECT_TRUE(u.intact && u.bytes == kBytes) << "an upstream received " << u.what;
            if (u.seed) upstream_seeds.insert(*u.seed);
        }
    }
    EXPECT_EQ(upstream_seeds.size(), kClients)
        << "each upstream connection must receive the stream of its own client";
    expectClosed(kClients * kBytes, kClients * kBytes, kClients);
    // Both sockets are established and in the map before any FIN: no fallback.
    expectNoFallbacks();
}

}  // namespace
}  // namespace zcrelay::test::sockmap_test
