// How a sockmap connection ends: a FIN that must wait for the kernel's backlog, resets from
// either side mid-stream, and half-close with the other direction still flowing.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "integration/sockmap_fixture.hpp"

namespace zcrelay::test::sockmap_test {
namespace {

// =============================================================================================
// FIN after a burst, into a slow reader: the FIN must wait for the kernel's backlog.

TEST_F(SockmapTest, BurstThenFinIntoSlowReader) {
    constexpr uint64_t kTotal = 100 * kMiB;
    constexpr Millis kSlowStart{500};
    constexpr size_t kChunk = 64 * kKiB;
    std::atomic<bool> eof_early{false};
    ScriptedUpstream up(AF_INET, [&](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                     ScriptedUpstream& self) {
        // Deliberate pacing, the point of the test: a reader far slower than the burst.
        std::this_thread::sleep_for(kSlowStart);
        PayloadVerifier v(kSeedA);
        StreamHash h;
        std::vector<uint8_t> buf(kChunk);
        auto deadline = Clock::now() + kBulkDeadline;
        for (;;) {
            auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
            IoResult r =
                readSome(fd.get(), buf.data(), buf.size(), std::max(left, Millis{0}), &stop);
            if (!r.ok()) {
                rec.read_end = r;
                rec.read_end.bytes = h.bytes();
                break;
            }
            std::span<const uint8_t> d(buf.data(), r.bytes);
            h.update(d);
            v.update(d);
            self.addLiveBytes(r.bytes);
            std::this_thread::sleep_for(Millis{1});
        }
        rec.bytes_received = h.bytes();
        rec.received_hash = h.value();
        if (!v.intact()) rec.note = "first mismatch at byte " + std::to_string(v.firstMismatch());
        if (rec.read_end.status == IoStatus::Eof && h.bytes() < kTotal) eof_early.store(true);
        if (rec.read_end.status == IoStatus::Eof) ::shutdown(fd.get(), SHUT_WR);
    });
    ASSERT_NO_FATAL_FAILURE(startRelay(up));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    IoResult sent = sendPayload(client.fd.get(), kSeedA, kTotal, kBulkDeadline);
    ASSERT_TRUE(sent.ok()) << sent.describe();
    ASSERT_EQ(::shutdown(client.fd.get(), SHUT_WR), 0);  // at once after the last write
    uint64_t read_at_fin = up.liveBytesReceived();
    std::cout << "[ sockmap  ] client FIN with " << (kTotal - read_at_fin) / kMiB
              << " MiB not yet read by the upstream\n";
    EXPECT_LT(read_at_fin, kTotal)
        << "the upstream had read everything before the client's FIN: the FIN raced nothing";

    std::string reply;
    IoResult end = readUntilEof(client.fd.get(), reply, kBulkDeadline);
    EXPECT_EQ(end.status, IoStatus::Eof)
        << "the client waits for the upstream's FIN: " << end.describe();
    ASSERT_TRUE(up.waitForFinished(1, Millis{15'000}));
    ConnRecord rec = up.records().at(0);
    EXPECT_FALSE(eof_early.load()) << "the upstream saw EOF before the last byte: the relay "
                                      "shut down its write side while the kernel still held "
                                      "bytes for it; "
                                   << rec.describe();
    EXPECT_EQ(rec.read_end.status, IoStatus::Eof) << rec.describe();
    EXPECT_EQ(rec.bytes_received, kTotal) << rec.describe();
    EXPECT_EQ(rec.received_hash, payloadHash(kSeedA, kTotal))
        << "the upstream received other bytes than the client sent: " << rec.describe();
    client.fd.reset();
    expectClosed(kTotal, 0, 1);
    expectNoFallbacks();
}

// =============================================================================================
// Resets mid-stream, both sides.

// The client streams up while the upstream answers; then the upstream resets. Nothing reads the
// sockets in user space, so only the relay's error watch notices.
TEST_F(SockmapTest, UpstreamResetMidStreamResetsClientPromptly) {
    constexpr uint64_t kBeforeReset = 256 * kKiB;
    constexpr uint64_t kEndless = 1024 * kMiB;
    ScriptedUpstream up(
        AF_INET, [](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream&) {
            std::vector<uint8_t> buf(kBeforeReset);
            rec.read_end = readExactly(fd.get(), buf.data(), buf.size(), kBulkDeadline, &stop);
            rec.bytes_received = rec.read_end.bytes;
            if (!rec.read_end.ok()) return;
            rec.write_end = sendPayload(fd.get(), kSeedB, kBeforeReset, kBulkDeadline, &stop);
            rec.bytes_sent = rec.write_end.bytes;
            closeWithReset(fd);
            rec.ended_at = Clock::now();
            rec.note = "sent RST";
        });
    ASSERT_NO_FATAL_FAILURE(startRelay(up));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    std::atomic<bool> cancel{false};
    IoResult sent;
    std::thread writer(
        [&] { sent = sendPayload(client.fd.get(), kSeedA, kEndless, kBulkDeadline, &cancel); });
    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeedB, Millis{10'000});
    auto client_end = Clock::now();
    cancel.store(true);
    writer.join();

    EXPECT_TRUE(got.io.status == IoStatus::Reset || got.io.status == IoStatus::Eof)
        << got.describe();
    EXPECT_TRUE(got.io.err == ECONNRESET || sent.err == ECONNRESET)
        << "the client must learn of the upstream's reset as a reset; reader: " << got.describe()
        << ", writer: " << sent.describe();
    EXPECT_LT(got.first_mismatch, 0) << "what arrived must be an intact prefix: " << got.describe();
    EXPECT_LE(got.bytes, kBeforeReset) << got.describe();
    EXPECT_LT(sent.bytes, kEndless) << sent.describe();
    ASSERT_TRUE(up.waitForFinished(1, Millis{15'000}));
    ConnRecord rec = up.records().at(0);
    ASSERT_EQ(rec.note, "sent RST") << rec.describe();
    double elapsed = std::chrono::duration<double>(client_end - rec.ended_at).count();
    EXPECT_LT(elapsed, std::chrono::duration<double>(kPrompt).count())
        << "the client must see the reset promptly after the upstream's RST";

    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("upstream_reset"), 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    EXPECT_TRUE(relay_.waitForMetric(metric::kSockmapSockets, {}, 0));
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("error")), 0.0);
    expectNoFallbacks();
}

// The client resets while the upstream's endless stream flows to it through the kernel: the
// upstream must see the reset promptly, counted as client_reset. Half-closed first, the client's
// socket is a finished source, which the relay no longer reads, and a poll on it reports the FIN
// it already read at once (proxy/kernel.md, "A poll always reports a FIN"): the reset must still
// get through.
class ClientReset : public SockmapTest {
  protected:
    void resetsUpstreamPromptly(bool half_closed_first) {
        constexpr uint64_t kEndless = 1024 * kMiB;
        ScriptedUpstream up(
            AF_INET, [](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream&) {
                if (!answerPing(fd, rec, stop)) return;
                rec.write_end = sendPayload(fd.get(), kSeedB, kEndless, kBulkDeadline, &stop);
                rec.bytes_sent = rec.write_end.bytes;
                rec.ended_at = Clock::now();
            });
        ASSERT_NO_FATAL_FAILURE(startRelay(up));
        Connected client = connectClient();
        ASSERT_TRUE(client.fd) << client.error;
        ASSERT_TRUE(pingPong(client.fd.get()));
        if (half_closed_first) {
            ASSERT_EQ(::shutdown(client.fd.get(), SHUT_WR), 0);
        }

        std::vector<uint8_t> buf(kMiB);
        IoResult r = readExactly(client.fd.get(), buf.data(), buf.size(), Millis{10'000});
        ASSERT_TRUE(r.ok()) << "the first MiB of the upstream's stream: " << r.describe();
        PayloadVerifier v(kSeedB);
        v.update(buf);
        EXPECT_TRUE(v.intact()) << "first mismatch at " << v.firstMismatch();

        auto t0 = Clock::now();
        closeWithReset(client.fd);
        ASSERT_TRUE(up.waitForFinished(1, kPrompt + Millis{5'000}))
            << "the upstream was still sending 15 s after the client's RST";
        ConnRecord rec = up.records().at(0);
        EXPECT_EQ(rec.write_end.status, IoStatus::Reset)
            << "the upstream's send must fail with a reset: " << rec.describe();
        EXPECT_LT(std::chrono::duration<double>(rec.ended_at - t0).count(),
                  std::chrono::duration<double>(kPrompt).count())
            << "the upstream must see the reset promptly after the client's RST";

        EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("client_reset"), 1))
            << relay_.scrape().value_or("");
        EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
        EXPECT_TRUE(relay_.waitForMetric(metric::kSockmapSockets, {}, 0));
        EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("error")), 0.0);
        expectNoFallbacks();
    }
};

TEST_F(ClientReset, MidStreamResetsUpstreamPromptly) { resetsUpstreamPromptly(false); }

TEST_F(ClientReset, HalfClosedThenMidStreamResetsUpstreamPromptly) { resetsUpstreamPromptly(true); }

// =============================================================================================
// Half-close both ways: one direction's FIN, the other keeps flowing through the kernel. The FIN
// comes after a ping-pong: a client FIN before the upstream connect completed would keep the
// connection out of the map (not_established: NotEstablishedFallsBackToSplice, in
// sockmap_fallback_test.cpp).

TEST_F(SockmapTest, HalfCloseClientFinFirstThenUpstreamSends10MiB) {
    constexpr uint64_t kRequest = 64 * kKiB;
    constexpr uint64_t kResponse = 10 * kMiB;
    ScriptedUpstream up(AF_INET, [](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                    ScriptedUpstream& self) {
        if (!answerPing(fd, rec, stop)) return;
        readToEof(fd, rec, stop, self, kBulkDeadline);
        if (rec.read_end.status != IoStatus::Eof) return;
        rec.write_end = sendPayload(fd.get(), kSeedB, kResponse, kBulkDeadline, &stop);
        rec.bytes_sent = rec.write_end.bytes;
        ::shutdown(fd.get(), SHUT_WR);
    });
    ASSERT_NO_FATAL_FAILURE(startRelay(up));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    ASSERT_TRUE(pingPong(client.fd.get()));

    IoResult sent = sendPayload(client.fd.get(), kSeedA, kRequest, kBulkDeadline);
    ASSERT_TRUE(sent.ok()) << sent.describe();
    ASSERT_EQ(::shutdown(client.fd.get(), SHUT_WR), 0);
    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeedB, kBulkDeadline);
    EXPECT_EQ(got.io.status, IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, kResponse)
        << "the whole response sent after the client's FIN: " << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();

    ASSERT_TRUE(up.waitForFinished(1, Millis{15'000}));
    ConnRecord rec = up.records().at(0);
    EXPECT_EQ(rec.read_end.status, IoStatus::Eof) << rec.describe();
    EXPECT_EQ(rec.bytes_received, kRequest) << rec.describe();
    EXPECT_EQ(rec.received_hash, payloadHash(kSeedA, kRequest)) << rec.describe();
    EXPECT_TRUE(rec.write_end.ok()) << rec.describe();
    client.fd.reset();
    expectClosed(1 + kRequest, 1 + kResponse, 1);
    expectNoFallbacks();
}

TEST_F(SockmapTest, HalfCloseUpstreamFinFirstThenClientSends10MiB) {
    constexpr uint64_t kResponse = 64 * kKiB;
    constexpr uint64_t kUpload = 10 * kMiB;
    ScriptedUpstream up(AF_INET, [](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                    ScriptedUpstream& self) {
        if (!answerPing(fd, rec, stop)) return;
        rec.write_end = sendPayload(fd.get(), kSeedB, kResponse, kBulkDeadline, &stop);
        rec.bytes_sent = rec.write_end.bytes;
        if (!rec.write_end.ok()) return;
        ::shutdown(fd.get(), SHUT_WR);
        readToEof(fd, rec, stop, self, kBulkDeadline);
    });
    ASSERT_NO_FATAL_FAILURE(startRelay(up));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    ASSERT_TRUE(pingPong(client.fd.get()));

    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeedB, kBulkDeadline);
    ASSERT_EQ(got.io.status, IoStatus::Eof)
        << "the upstream's FIN must reach the client: " << got.describe();
    EXPECT_EQ(got.bytes, kResponse) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();
    IoResult sent = sendPayload(client.fd.get(), kSeedA, kUpload, kBulkDeadline);
    EXPECT_TRUE(sent.ok()) << "the client keeps sending after the upstream's FIN: "
                           << sent.describe();
    ::shutdown(client.fd.get(), SHUT_WR);

    ASSERT_TRUE(up.waitForFinished(1, kBulkDeadline));
    ConnRecord rec = up.records().at(0);
    EXPECT_EQ(rec.read_end.status, IoStatus::Eof) << rec.describe();
    EXPECT_EQ(rec.bytes_received, kUpload) << rec.describe();
    EXPECT_EQ(rec.received_hash, payloadHash(kSeedA, kUpload)) << rec.describe();
    IoResult end = waitForPeerClose(client.fd.get(), kPrompt);
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
    client.fd.reset();
    expectClosed(1 + kUpload, 1 + kResponse, 1);
    expectNoFallbacks();
}

}  // namespace
}  // namespace zcrelay::test::sockmap_test
