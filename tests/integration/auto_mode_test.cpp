// mode auto through the real binary: a connection that talks request/response moves from splice
// to sockmap without losing, doubling or reordering a byte, bulk stays on splice, and a worker
// promotes only while it relays at most the listener's auto_sockmap_max connections.
//
// The upstream echoes; the client sends payload kSeed and checks the echo against the same
// payload at every offset, so any byte lost, repeated or moved across the switch shows as the
// first mismatch.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "integration/auto_mode_fixture.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::auto_mode_test {
namespace {

constexpr uint64_t kSeed = 0xA070;
constexpr Millis kDeadline{20'000};

// One side of an echoed stream: what was sent, and the echo checked as it comes back.
class EchoClient {
  public:
    explicit EchoClient(Fd fd) : fd_(std::move(fd)), back_(kSeed) {}

    int fd() const { return fd_.get(); }

    // Sends `size` bytes and waits for their echo: one request, one response.
    ::testing::AssertionResult exchange(size_t size) {
        if (auto r = send(size); !r) return r;
        return receive(size);
    }
    ::testing::AssertionResult send(size_t size) {
        IoResult w = sendPayloadAt(fd_.get(), kSeed, sent_, size, kDeadline);
        if (!w.ok()) return ::testing::AssertionFailure() << "send at " << sent_ << ": " << w.describe();
        sent_ += size;
        return ::testing::AssertionSuccess();
    }
    ::testing::AssertionResult receive(size_t size) {
        std::vector<uint8_t> buf(std::min<size_t>(size, 256 * 1024));
        for (size_t left = size; left > 0;) {
            IoResult r = readSome(fd_.get(), buf.data(), std::min(left, buf.size()), kDeadline);
            if (!r.ok())
                return ::testing::AssertionFailure()
                       << "echo after " << back_.bytes() << " bytes: " << r.describe();
            back_.update(std::span<const uint8_t>(buf.data(), r.bytes));
            left -= r.bytes;
        }
        if (!back_.intact())
            return ::testing::AssertionFailure()
                   << "the echo differs from what was sent at byte " << back_.firstMismatch();
        return ::testing::AssertionSuccess();
    }
    uint64_t sent() const { return sent_; }
    uint64_t received() const { return back_.bytes(); }

  private:
    Fd fd_;
    uint64_t sent_ = 0;
    PayloadVerifier back_;
};

// Request sizes that cycle through one byte, a typical query, one MTU, and more than a turn
// (the switch, once made, is for good: a large message after it rides the kernel path too).
constexpr size_t kSizes[] = {1, 64, 1460, 9000, 40'000, 300};

class AutoModeTest : public ::testing::Test {
  protected:
    void startRelay(const ScriptedUpstream& up, const std::string& listener_yaml = "",
                    int workers = 2) {
        ASSERT_TRUE(up.ok()) << up.error();
        RelayConfig config = singleListenerConfig(up.hostPort(), "auto");
        config.workers = workers;
        config.listeners[0].extra_yaml = listener_yaml;
        config.extra_yaml = "access_log:\n  path: \"" + relay_.dir() + "/access.log\"\n";
        ASSERT_TRUE(relay_.start(config));
        ASSERT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath("auto")), 1.0)
            << relay_.diagnostics();
    }
    EchoClient connectClient() {
        Connected c = connectTo(relay_.host(), relay_.port());
        EXPECT_TRUE(c.fd) << c.error;
        return EchoClient(std::move(c.fd));
    }

    RelayProcess relay_;
};

// Lockstep exchanges: after a few the connection is promoted (both directions counted), and
// every later one, small or larger than a turn, comes back exact over the kernel path. Then a
// pipelined burst of 8 MiB on the promoted connection (the in-flight bound makes the program
// pass bytes to user space, which moves them in order), and a clean close. The access log names
// both paths.
TEST_F(AutoModeTest, AnInteractiveConnectionMovesToSockmapAndKeepsEveryByteInOrder) {
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up));
    EchoClient client = connectClient();
    for (int i = 0; i < 12; ++i) ASSERT_TRUE(client.exchange(kSizes[i % 3])) << "exchange " << i;
    ASSERT_TRUE(relay_.waitForMetric(metricName(Metric::DatapathSwitches), promoted(), 2.0))
        << "12 small exchanges must promote both directions";
    for (int i = 0; i < 300; ++i)
        ASSERT_TRUE(client.exchange(kSizes[i % std::size(kSizes)])) << "exchange " << i;

    constexpr uint64_t kBurst = 8 * kMiB;
    std::atomic<bool> sent_ok{false};
    std::thread sender([&] { sent_ok = static_cast<bool>(client.send(kBurst)); });
    ::testing::AssertionResult echoed = client.receive(kBurst);
    sender.join();
    ASSERT_TRUE(sent_ok);
    ASSERT_TRUE(echoed);
    ::shutdown(client.fd(), SHUT_WR);
    char extra = 0;
    IoResult end = readSome(client.fd(), &extra, 1, kDeadline);
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();

    const double total = static_cast<double>(client.sent() + client.received());
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1.0));
    PathBytes b = pathBytes(relay_);
    EXPECT_EQ(b.total(), total) << b.describe();
    EXPECT_GT(b.splice, 0) << "the first exchanges ran splice: " << b.describe();
    EXPECT_GT(b.sockmap, 0.5 * total) << "the rest ran the kernel path: " << b.describe();
    EXPECT_EQ(b.copy, 0) << b.describe();
    EXPECT_EQ(relay_.metric(metricName(Metric::DatapathSwitches), promoted("copy")), 0.0);
    EXPECT_TRUE(relay_.waitForMetric(metric::kSockmapSockets, {}, 0))
        << "the promoted sockets leave the SOCKHASH at close";
    std::string log;
    EXPECT_TRUE(waitUntil(
        [&] {
            log = readFileText(relay_.dir() + "/access.log");
            return log.find('\n') != std::string::npos;
        },
        kDeadline));
    EXPECT_NE(log.find("\"path\":\"splice>sockmap\""), std::string::npos) << log;
}

// Requests pipelined from the start, at most four in flight: the promotion comes while bytes
// move both ways, some of them in the client's socket when it enters the map (passed to user
// space and moved first). Every echo is exact.
TEST_F(AutoModeTest, APromotionInTheMiddleOfPipelinedRequestsLosesNothing) {
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up));
    EchoClient client = connectClient();
    constexpr int kRequests = 4000;
    constexpr int kWindow = 4;
    auto size = [](int i) { return static_cast<size_t>(1 + (i * 37) % 200); };
    std::atomic<int> answered{0};
    std::atomic<bool> stop{false};
    std::string send_error;
    std::thread sender([&] {
        for (int i = 0; i < kRequests && !stop; ++i) {
            while (i - answered.load() >= kWindow && !stop) std::this_thread::yield();
            if (auto r = client.send(size(i)); !r) {
                send_error = r.message();
                return;
            }
        }
    });
    ::testing::AssertionResult echoed = ::testing::AssertionSuccess();
    for (int i = 0; i < kRequests && echoed; ++i) {
        echoed = client.receive(size(i));
        answered = i + 1;
    }
    stop = true;
    sender.join();
    ASSERT_TRUE(send_error.empty()) << send_error;
    ASSERT_TRUE(echoed) << "after " << answered.load() << " answers";
    EXPECT_TRUE(relay_.waitForMetric(metricName(Metric::DatapathSwitches), promoted(), 2.0))
        << "small pipelined requests are request/response too";
    ::shutdown(client.fd(), SHUT_WR);
    char extra = 0;
    EXPECT_EQ(readSome(client.fd(), &extra, 1, kDeadline).status, IoStatus::Eof);
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1.0));
    EXPECT_EQ(pathBytes(relay_).total(), static_cast<double>(client.sent() + client.received()));
}

// A 64 MiB upload answered by 32 MiB: each way one long turn, never request/response. Nothing
// enters the map, nothing is copied.
TEST_F(AutoModeTest, BulkStaysOnSplice) {
    constexpr uint64_t kUp = 64 * kMiB;
    constexpr uint64_t kDown = 32 * kMiB;
    constexpr uint64_t kReplySeed = 0xB01C;
    ScriptedUpstream up(AF_INET, sinkScript(kReplySeed, kDown));
    ASSERT_NO_FATAL_FAILURE(startRelay(up));
    Connected c = connectTo(relay_.host(), relay_.port());
    ASSERT_TRUE(c.fd) << c.error;
    IoResult sent = sendPayload(c.fd.get(), kSeed, kUp, Millis{60'000});
    ASSERT_TRUE(sent.ok()) << sent.describe();
    ::shutdown(c.fd.get(), SHUT_WR);
    ReceiveCheck reply = receivePayloadUntilEof(c.fd.get(), kReplySeed, Millis{60'000});
    EXPECT_EQ(reply.bytes, kDown) << reply.describe();
    EXPECT_EQ(reply.first_mismatch, -1) << reply.describe();
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1.0));
    PathBytes b = pathBytes(relay_);
    EXPECT_EQ(b.splice, static_cast<double>(kUp + kDown)) << b.describe();
    EXPECT_EQ(relay_.metric(metricName(Metric::DatapathSwitches), promoted()), 0.0);
    EXPECT_EQ(relay_.metric(metricName(Metric::SockmapConnections), metric::listener()), 0.0);
}

// auto_sockmap_max: 1 on one worker: a connection alone is promoted; a second one, while the
// first is open, is not (two live connections); once the first closes, the second is, at its
// next turns.
TEST_F(AutoModeTest, AWorkerPromotesOnlyWhileItRelaysFewConnections) {
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, "    auto_sockmap_max: 1\n", 1));
    EchoClient first = connectClient();
    for (int i = 0; i < 12; ++i) ASSERT_TRUE(first.exchange(64));
    ASSERT_TRUE(relay_.waitForMetric(metricName(Metric::DatapathSwitches), promoted(), 2.0));
    EchoClient second = connectClient();
    for (int i = 0; i < 40; ++i) ASSERT_TRUE(second.exchange(64));
    EXPECT_EQ(relay_.metric(metricName(Metric::DatapathSwitches), promoted()), 2.0)
        << "two connections open: past auto_sockmap_max";
    ::shutdown(first.fd(), SHUT_WR);
    char extra = 0;
    EXPECT_EQ(readSome(first.fd(), &extra, 1, kDeadline).status, IoStatus::Eof);
    ASSERT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1.0));
    for (int i = 0; i < 12; ++i) ASSERT_TRUE(second.exchange(64));
    EXPECT_TRUE(relay_.waitForMetric(metricName(Metric::DatapathSwitches), promoted(), 4.0))
        << "alone again, the second connection is promoted";
}

}  // namespace
}  // namespace zcrelay::test::auto_mode_test
