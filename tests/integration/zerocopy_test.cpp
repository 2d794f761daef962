// send_zerocopy: bytes moved by copy go out with IORING_OP_SEND_ZC, and each buffer stays lent
// to the kernel until the send's notification (pump/copy_pump.hpp). What can go wrong is a
// buffer given back too early (a recv refills pages the kernel still sends from: corrupted
// bytes) or never (the pool drains and every copy connection of the worker starves). So the
// oracle is byte-exact payloads, the relay's zcrelay_zerocopy_sends_total (the sends did go
// zero-copy) and zcrelay_copy_buffers_busy, which must come back to 0 once every connection
// is gone, however they ended.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::zerocopy_test {
namespace {

constexpr uint64_t kSeed = 0x2EC0;
constexpr const char* kZerocopySends = "zcrelay_zerocopy_sends_total";
constexpr const char* kBuffersBusy = "zcrelay_copy_buffers_busy";

// The two ways a listener moves its bytes by copy: copy mode, and a splice listener that gets
// no pipe (max_pipes: 0).
struct Case {
    std::string name;
    std::string mode;
    bool no_pipes;
};

std::string caseName(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class ZerocopyTest : public ::testing::TestWithParam<Case> {
  protected:
    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void startRelay(const ScriptedUpstream& up, const std::string& listener_yaml = "") {
        ASSERT_TRUE(up.ok()) << "upstream listener: " << up.error();
        RelayConfig config = singleListenerConfig(up.hostPort(), GetParam().mode, up.family());
        config.listeners[0].extra_yaml = "    send_zerocopy: true\n" + listener_yaml;
        if (GetParam().no_pipes) config.extra_yaml = "max_pipes: 0\n";
        ASSERT_TRUE(relay_.start(config));
    }
    // Sends that went zero-copy, whatever the kernel then did with the pages.
    double lent() const {
        double n = 0;
        for (const char* r : {"zerocopy", "copied", "unreported"})
            n += relay_.metric(kZerocopySends, {{"result", r}}).value_or(0);
        return n;
    }
    void expectEveryBufferBack() {
        EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
        EXPECT_TRUE(relay_.waitForMetric(kBuffersBusy, {}, 0))
            << "a buffer lent to the kernel (or queued) was never given back to the pool";
        // A notification after its slot was freed would name a reused slot, and its buffer
        // would have gone back while the kernel still had it.
        EXPECT_EQ(relay_.stderrText().find("stale completion"), std::string::npos)
            << relay_.stderrText();
    }

    RelayProcess relay_;
};

TEST_P(ZerocopyTest, BothDirectionsArriveByteExactWithSendsLentToTheKernel) {
    constexpr uint64_t kTotal = 64 * kMiB;
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up));
    Connected client = connectTo(relay_.host(), relay_.port());
    ASSERT_TRUE(client.fd) << client.error;

    IoResult sent;
    ReceiveCheck got = echoRoundTrip(client.fd.get(), kSeed, kTotal, kDefaultIoTimeout, &sent);
    EXPECT_TRUE(sent.ok()) << "client writer: " << sent.describe();
    EXPECT_EQ(got.io.status, IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, kTotal) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << "echoed bytes corrupted: " << got.describe();
    client.fd.reset();
    ASSERT_TRUE(up.waitForFinished(1, Millis{10'000}));
    ConnRecord rec = up.records().at(0);
    EXPECT_EQ(rec.received_hash, payloadHash(kSeed, kTotal)) << rec.describe();

    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"), kTotal));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("downstream"), kTotal));
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1));
    // 128 MiB in sends of up to 64 KiB: most of them are large enough.
    EXPECT_GT(lent(), 100) << "send_zerocopy is on, yet hardly a send went out zero-copy";
    expectEveryBufferBack();
}

// Clients that reset mid-stream: the relay closes while its zero-copy sends to them are not
// acknowledged, and their notifications come after the connection stopped relaying. The
// buffers still come back, and the pool serves the next transfer.
TEST_P(ZerocopyTest, ResetsWithBuffersLentGiveEveryBufferBack) {
    constexpr int kClients = 16;
    constexpr uint64_t kTotal = 64 * kMiB;
    ScriptedUpstream up(AF_INET, sourceScript(kSeed, kTotal));
    ASSERT_NO_FATAL_FAILURE(startRelay(up));
    for (int i = 0; i < kClients; ++i) {
        Connected client = connectTo(relay_.host(), relay_.port());
        ASSERT_TRUE(client.fd) << client.error;
        std::vector<uint8_t> buf(kMiB);
        IoResult r = readExactly(client.fd.get(), buf.data(), buf.size());
        ASSERT_TRUE(r.ok()) << "client " << i << ": " << r.describe();
        closeWithReset(client.fd);
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("client_reset"),
                                     kClients));
    EXPECT_GT(lent(), 0) << "the resets should have found zero-copy sends";
    expectEveryBufferBack();

    Connected client = connectTo(relay_.host(), relay_.port());
    ASSERT_TRUE(client.fd) << client.error;
    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeed);
    EXPECT_EQ(got.bytes, kTotal) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();
    client.fd.reset();
    expectEveryBufferBack();
}

// Readers that stop reading, with notsent_lowat unset: each relay socket to them takes skbs
// until its send buffer is full, and every one of those holds its zero-copy buffer until the
// reader acknowledges it, which it does not. Half a worker's pool is all such holds may take
// (then sends go plain), so a client that does read still gets its bytes meanwhile.
TEST_P(ZerocopyTest, StalledReadersLeaveThePoolToOthers) {
    constexpr int kStalled = 40;  // 20 per worker, 16 holds each: past the budget of 128
    constexpr uint64_t kStreamBytes = 64 * kMiB;
    constexpr uint64_t kRead = 32 * kMiB;
    ScriptedUpstream up(AF_INET, sourceScript(kSeed, kStreamBytes));
    ASSERT_NO_FATAL_FAILURE(startRelay(up, "    notsent_lowat: 0\n"));
    std::vector<Fd> stalled;
    for (int i = 0; i < kStalled; ++i) {
        Connected c = connectTo(relay_.host(), relay_.port());
        ASSERT_TRUE(c.fd) << c.error;
        stalled.push_back(std::move(c.fd));
    }
    EXPECT_TRUE(relay_.waitForMetric(kZerocopySends, {{"result", "plain"}},
                                     [](double v) { return v > 0; },
                                     "sends past the zero-copy budget went plain"));
    ASSERT_TRUE(relay_.waitForMetric(kBuffersBusy, {}, [](double v) { return v > 0; },
                                     "buffers held for the stalled readers"));

    // One more client, on whichever worker takes it: it shares that worker's pool with 20
    // stalled ones, and reads its stream while they hold what they may.
    Connected client = connectTo(relay_.host(), relay_.port());
    ASSERT_TRUE(client.fd) << client.error;
    PayloadVerifier v(kSeed);
    std::vector<uint8_t> buf(kMiB);
    while (v.bytes() < kRead) {
        IoResult r = readSome(client.fd.get(), buf.data(), buf.size(), Millis{20'000});
        ASSERT_TRUE(r.ok()) << "the reading client starved after " << v.bytes()
                            << " bytes: " << r.describe();
        v.update(std::span<const uint8_t>(buf.data(), r.bytes));
    }
    EXPECT_TRUE(v.intact()) << "first mismatch at byte " << v.firstMismatch();
    closeWithReset(client.fd);
    for (Fd& fd : stalled) closeWithReset(fd);
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("client_reset"),
                                     kStalled + 1));
    expectEveryBufferBack();
}

INSTANTIATE_TEST_SUITE_P(Paths, ZerocopyTest,
                         ::testing::Values(Case{"copy", "copy", false},
                                           Case{"splice_without_pipes", "splice", true}),
                         caseName);

}  // namespace
}  // namespace zcrelay::test::zerocopy_test
