// Handover through the real binary (proxy/handover.hpp): at a takeover the old relay passes its
// relaying connections to the new one, on every data path: their sockets and the bytes in
// their pipes (splice), after what it holds is sent (copy), or with the maps their sockets are
// in and the wake-up ring that names them (sockmap). It exits as soon as none is left. The
// oracle is the peers': every byte arrives once and in order, nothing is reset (this case's
// network namespace counts no RST), the old pid is gone within a second of the new relay's
// ready line, and the new relay counts each connection it took
// (zcrelay_handover_connections_total, zcrelay_connections_active).
//
// What cannot cross (a connection still reading its PROXY header or its ClientHello, or
// connecting; a copy direction whose peer does not read; the sockmap connections that share a
// ring with one the new relay cannot take) stays with the old relay, which finishes it as it
// drains: its bytes arrive intact too, and the old relay lives until it ends.
#include <gtest/gtest.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "clock.hpp"
#include "support/json.hpp"
#include "support/labels.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "support/tcp_counters.hpp"
#include "takeover.hpp"
#include "takeover_wire.hpp"

namespace zcrelay::test::handover_test {
namespace {

constexpr Millis kIo{30'000};
const std::string kHandover = metricName(Metric::HandoverConnections);
const std::string kActive = metricName(Metric::ConnectionsActive);

constexpr uint64_t kBulkBytes = uint64_t{1} << 30;
constexpr uint64_t kSeedBulk = 0xB01C;
constexpr uint64_t kSeedHalf = 0x4A1F;
constexpr uint64_t kHalfPiece = 16 * 1024;
constexpr int kHalfPieces = 400;  // 6.4 MiB over 4 s or more: it spans the upgrade
constexpr uint64_t kSeedSource = 0x5005;
constexpr uint64_t kSourceBytes = 32u << 20;  // far more than the sockets and the relay hold

// The upstream, by the first byte a client sends:
//   'E' echo: everything after it comes back, and its FIN;
//   'S' source: sends kSourceBytes of payload kSeedSource at once, and its FIN;
//   'H' half-close: reads until the client's FIN, then sends kHalfPieces pieces of payload
//       kSeedHalf, 10 ms apart, and its own FIN.
ConnScript dispatchScript() {
    return [](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream& up) {
        char kind = 0;
        IoResult first = readExactly(fd.get(), &kind, 1, kIo);
        if (!first.ok()) return;
        if (kind == 'E') return echoScript()(fd, rec, stop, up);
        if (kind == 'S') {
            rec.write_end = sendPayload(fd.get(), kSeedSource, kSourceBytes, kIo, &stop);
            ::shutdown(fd.get(), SHUT_WR);
            return;
        }
        std::string ignored;
        rec.read_end = readUntilEof(fd.get(), ignored, kIo);
        for (int i = 0; i < kHalfPieces && !stop; ++i) {
            rec.write_end = sendPayloadAt(fd.get(), kSeedHalf, i * kHalfPiece, kHalfPiece, kIo);
            if (!rec.write_end.ok()) return;
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        ::shutdown(fd.get(), SHUT_WR);
    };
}

RelayConfig handoverConfig(const std::string& upstream, const std::string& mode,
                           const std::string& socket_path) {
    RelayConfig config = singleListenerConfig(upstream, mode);
    config.drain_timeout = "120s";
    config.extra_yaml = "takeover_socket: " + socket_path + "\n";
    return config;
}

// Echoed messages, one at a time, each checked for its sequence number: order and loss show.
// The longest wait for a reply is the pause the connection saw.
class PingPong {
  public:
    // `prefix` goes first (a PROXY header).
    PingPong(const std::string& host, uint16_t port, std::string prefix = "")
        : prefix_(std::move(prefix)), thread_([this, host, port] { run(host, port); }) {}
    ~PingPong() {
        stop_ = true;
        if (thread_.joinable()) thread_.join();
    }
    // Stops after the reply in flight, ends the stream with a FIN, and says what went wrong.
    std::string finish() {
        stop_ = true;
        if (thread_.joinable()) thread_.join();
        return error_;
    }
    int replies() const { return replies_.load(); }
    int64_t longestWaitUs() const { return longest_us_; }

  private:
    void run(const std::string& host, uint16_t port) {
        Connected c = connectTo(host, port, Millis{5'000});
        const std::string first = prefix_ + "E";
        if (!c.fd || !writeAll(c.fd.get(), first.data(), first.size(), kIo).ok()) {
            error_ = "connect: " + c.error;
            return;
        }
        char out[16], back[16];
        for (uint32_t seq = 0; !stop_; ++seq) {
            std::snprintf(out, sizeof out, "seq %010u\n", seq);
            const auto sent = Clock::now();
            IoResult w = writeAll(c.fd.get(), out, sizeof out, kIo);
            IoResult r = w.ok() ? readExactly(c.fd.get(), back, sizeof back, kIo) : w;
            if (!r.ok()) {
                error_ = "message " + std::to_string(seq) + ": " + r.describe();
                return;
            }
            if (std::memcmp(out, back, sizeof out) != 0) {
                error_ = "message " + std::to_string(seq) + " came back as \"" +
                         std::string(back, sizeof back - 1) + "\"";
                return;
            }
            const int64_t us =
                std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - sent).count();
            longest_us_ = std::max(longest_us_, us);
            ++replies_;
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        error_ = endStream(c.fd.get(), kIo);
    }

    const std::string prefix_;
    std::atomic<bool> stop_{false};
    std::atomic<int> replies_{0};
    int64_t longest_us_ = 0;
    std::string error_;
    std::thread thread_;
};

// A client that half-closes at once and then reads what the upstream keeps sending.
class HalfClosed {
  public:
    HalfClosed(const std::string& host, uint16_t port)
        : thread_([this, host, port] { run(host, port); }) {}
    ~HalfClosed() {
        if (thread_.joinable()) thread_.join();
    }
    ReceiveCheck join() {
        if (thread_.joinable()) thread_.join();
        return check_;
    }

  private:
    void run(const std::string& host, uint16_t port) {
        Connected c = connectTo(host, port, Millis{5'000});
        if (!c.fd || !writeAll(c.fd.get(), "H", 1, kIo).ok()) {
            check_.io.status = IoStatus::Error;
            return;
        }
        ::shutdown(c.fd.get(), SHUT_WR);
        check_ = receivePayloadUntilEof(c.fd.get(), kSeedHalf, kIo);
    }

    ReceiveCheck check_;
    std::thread thread_;
};

// A 1 GiB byte-checked echo: the payload goes up and comes back down.
class Bulk {
  public:
    Bulk(const std::string& host, uint16_t port)
        : thread_([this, host, port] {
              Connected c = connectTo(host, port, Millis{5'000});
              if (!c.fd || !writeAll(c.fd.get(), "E", 1, kIo).ok()) {
                  check_.io.status = IoStatus::Error;
                  return;
              }
              check_ = echoRoundTrip(c.fd.get(), kSeedBulk, kBulkBytes, kIo, &sent_);
          }) {}
    ~Bulk() {
        if (thread_.joinable()) thread_.join();
    }
    ReceiveCheck join(IoResult& sent) {
        if (thread_.joinable()) thread_.join();
        sent = sent_;
        return check_;
    }

  private:
    ReceiveCheck check_;
    IoResult sent_;
    std::thread thread_;
};

// One short exchange through `relay`'s listener: "" or what failed.
std::string exchangeThrough(RelayProcess& relay) {
    Connected c = connectTo(relay.host(), relay.port());
    if (!c.fd) return "connect: " + c.error;
    char back[5] = {};
    IoResult w = writeAll(c.fd.get(), "Ehello", 6, kIo);
    IoResult r = w.ok() ? readExactly(c.fd.get(), back, 5, kIo) : w;
    if (!r.ok()) return r.describe();
    return std::string(back, 5) == "hello" ? "" : "the echo differs";
}

// `n` connections through `relay` to the echo, left idle; fewer if one failed (recorded).
std::vector<Fd> idleEchoes(RelayProcess& relay, int n) {
    std::vector<Fd> idle;
    for (int i = 0; i < n; ++i) {
        Connected c = connectTo(relay.host(), relay.port());
        if (!c.fd || !writeAll(c.fd.get(), "E", 1, kIo).ok()) {
            ADD_FAILURE() << "idle " << i << ": " << c.error;
            break;
        }
        idle.push_back(std::move(c.fd));
    }
    return idle;
}

class HandoverTest : public ::testing::Test {
  protected:
    void SetUp() override {
        ASSERT_TRUE(up_.ok()) << up_.error();
        socket_ = scratch_.file("takeover.sock");
    }

    // Starts the next relay on the old one's config with --takeover: once it says ready, every
    // connection has crossed or been kept. Then waits for the old relay's exit and returns how
    // long that took after the ready line, in ms (-1: it still runs after `wait`).
    int64_t upgrade(RelayProcess& old, RelayProcess& next, Millis wait,
                    const std::string& config = "") {
        if (!next.startWithArgs({"-c", config.empty() ? old.configPath() : config, "--takeover"})) {
            ADD_FAILURE() << "the new relay did not start: " << next.stderrText();
            return -1;
        }
        const auto ready = Clock::now();
        if (!old.waitExit(wait)) return -1;
        return std::chrono::duration_cast<Millis>(Clock::now() - ready).count();
    }

    ScriptedUpstream up_{AF_INET, dispatchScript()};
    TempDir scratch_;
    std::string socket_;
};

// ---------------------------------------------------------------------------------------------
// Splice and copy: everything crosses, mid-stream.

class HandoverPaths : public HandoverTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(HandoverPaths, BulkPingPongAndAHalfCloseCrossMidStreamAndTheOldPidGoesAtOnce) {
    RelayProcess old;
    ASSERT_TRUE(old.start(handoverConfig(up_.hostPort(), GetParam(), socket_)));
    const auto counters = tcpCounters();
    Bulk bulk(old.host(), old.port());
    PingPong ping(old.host(), old.port());
    HalfClosed half(old.host(), old.port());
    // All three under way: the bulk some way in, the ping-pong answering, the half-closed one
    // receiving (the upstream sends only after the client's FIN).
    ASSERT_TRUE(waitUntil(
        [&] { return up_.liveBytesReceived() > (16u << 20) && ping.replies() > 20; }, kIo));
    ASSERT_TRUE(old.waitForMetric(metricName(Metric::HalfClosed), metric::listener(), 1.0));
    const int pings_before = ping.replies();

    RelayProcess next;
    const int64_t exit_ms = upgrade(old, next, Millis{kSanitized ? 5'000 : 1'000});
    EXPECT_GE(exit_ms, 0) << "the old relay still runs:\n" << old.stderrText();

    IoResult sent;
    ReceiveCheck echoed = bulk.join(sent);
    EXPECT_TRUE(sent.ok()) << sent.describe();
    EXPECT_EQ(echoed.io.status, IoStatus::Eof) << echoed.describe();
    // (An ASan run under load once stalled here on sockmap, cause not found: what both relays
    // said, and the new one's counts, are the evidence to look at.)
    EXPECT_EQ(echoed.bytes, kBulkBytes) << "the old relay's log:\n"
                                        << old.stderrText() << "\nthe new relay's log:\n"
                                        << next.stderrText() << next.scrape().value_or("");
    EXPECT_EQ(echoed.first_mismatch, -1) << echoed.describe();
    // The ping-pong goes on through the new relay, every reply in order.
    ASSERT_TRUE(waitUntil([&] { return ping.replies() > pings_before + 50; }, kIo));
    EXPECT_EQ(ping.finish(), "");
    ReceiveCheck halved = half.join();
    EXPECT_EQ(halved.io.status, IoStatus::Eof) << halved.describe();
    EXPECT_EQ(halved.bytes, kHalfPiece * kHalfPieces);
    EXPECT_EQ(halved.first_mismatch, -1) << halved.describe();

    // All three crossed: the bulk transfer too, mid-way (1 GiB takes longer than an upgrade).
    EXPECT_TRUE(next.waitForMetric(kHandover, {{"result", "taken"}}, 3.0)) << next.stderrText();
    EXPECT_EQ(next.metric(kHandover, {{"result", "lost"}}), 0.0);
    EXPECT_EQ(refusalsSince(counters), "") << "the kernel reset connections";
    if (GetParam() == "sockmap") {
        // The bulk echo and the ping-pong went on in the kernel, on the maps the new relay
        // adopted, which counted what the kernel moved for them.
        EXPECT_NE(next.stderrText().find("adopted sockmap maps"), std::string::npos)
            << next.stderrText();
        EXPECT_GT(next.metric(metricName(Metric::Bytes),
                              {{"listener", "t"}, {"path", "sockmap"}, {"direction", "upstream"}})
                      .value_or(0),
                  0.0);
    }
    const std::string log = old.stderrText();
    EXPECT_NE(log.find("handed over"), std::string::npos) << log;
    std::cout << "old relay gone " << exit_ms << " ms after the new one's ready line; the "
              << "ping-pong's longest reply took " << ping.longestWaitUs() << " us\n";
    ExitStatus stopped = next.terminate();
    EXPECT_TRUE(stopped.cleanExit()) << stopped.describe();
}

// Copy: each direction first sends what it holds in user-space buffers (reading nothing
// more), then crosses with none. Sockmap: the new relay adopts the old one's maps, and the
// kernel redirects on throughout (in sockmap mode the half-closed client's FIN is in before its
// sockets could enter the map, so that one runs splice: sockmap_fallbacks not_established).
INSTANTIATE_TEST_SUITE_P(Paths, HandoverPaths, ::testing::ValuesIn(kModes), modeName);

// Idle connections cross by the thousand; each works afterwards, and the new relay counts every
// one of them as active, none twice (the old one is gone, its count with it).
class HandoverIdle : public HandoverTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(HandoverIdle, IdleConnectionsCrossEachStillWorksAndIsCountedOnce) {
    const int kIdle = kSanitized ? 200 : 1000;
    RelayProcess old;
    ASSERT_TRUE(old.start(handoverConfig(up_.hostPort(), GetParam(), socket_)));
    std::vector<Fd> idle = idleEchoes(old, kIdle);
    ASSERT_EQ(idle.size(), static_cast<size_t>(kIdle));
    ASSERT_TRUE(up_.waitForAccepted(static_cast<size_t>(kIdle), kIo));
    ASSERT_TRUE(old.waitForMetric(kActive, metric::listener(), static_cast<double>(kIdle)));

    RelayProcess next;
    const int64_t exit_ms = upgrade(old, next, Millis{kSanitized ? 10'000 : 2'000});
    EXPECT_GE(exit_ms, 0) << "the old relay still runs:\n" << old.stderrText();
    EXPECT_TRUE(next.waitForMetric(kHandover, {{"result", "taken"}}, static_cast<double>(kIdle)));
    EXPECT_EQ(next.metric(kActive, metric::listener()), static_cast<double>(kIdle));
    int failed = 0;
    std::string first;
    for (Fd& fd : idle) {
        IoResult r = echoBack(fd.get(), "ping", kIo);
        if (!r.ok() && failed++ == 0) first = r.describe();
    }
    EXPECT_EQ(failed, 0) << "the first: " << first;
    idle.clear();
    EXPECT_TRUE(next.waitForMetric(kActive, metric::listener(), 0.0));
    if (GetParam() == "sockmap") {
        EXPECT_TRUE(next.waitForMetric(metric::kSockmapSockets, {}, 0.0))
            << "every socket out of the adopted maps as its connection closed";
    }
    std::cout << kIdle << " idle connections: the old relay was gone " << exit_ms
              << " ms after the new one's ready line\n";
}

INSTANTIATE_TEST_SUITE_P(Paths, HandoverIdle, ::testing::ValuesIn(kModes), modeName);

// The old relay killed -9 while its workers hand over: what crossed relays on in the new one,
// what had not crossed closes with the old process, and no connection is left hanging: each
// one either works or is closed (EOF or RST). The new relay serves on.
class HandoverKilled : public HandoverTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(HandoverKilled, TheOldRelayKilledMidwayLeavesEveryConnectionWorkingOrClosed) {
    const int kIdle = kSanitized ? 300 : 2000;
    RelayProcess old;
    ASSERT_TRUE(old.start(handoverConfig(up_.hostPort(), GetParam(), socket_)));
    std::vector<Fd> idle = idleEchoes(old, kIdle);
    ASSERT_EQ(idle.size(), static_cast<size_t>(kIdle));
    ASSERT_TRUE(up_.waitForAccepted(static_cast<size_t>(kIdle), kIo));
    // The kill lands when the first worker said it is done handing over, while the other may
    // still be sending; it may also land later: the case holds either way.
    std::thread killer([&] {
        (void)old.waitForLog("handover: ", Millis{20'000});
        old.sendSignal(SIGKILL);
    });
    RelayProcess next;
    const bool started = next.startWithArgs({"-c", old.configPath(), "--takeover"});
    killer.join();
    ASSERT_TRUE(started) << next.stderrText();
    ASSERT_TRUE(old.waitExit(kIo));
    int works = 0, closed = 0, hung = 0;
    std::string first_hung;
    for (Fd& fd : idle) {
        IoResult r = echoBack(fd.get(), "ping", Millis{5'000});
        if (r.ok()) {
            ++works;
        } else if (r.status == IoStatus::Eof || r.status == IoStatus::Reset) {
            ++closed;
        } else if (hung++ == 0) {
            first_hung = r.describe();
        }
    }
    EXPECT_EQ(hung, 0) << "neither working nor closed; the first: " << first_hung;
    EXPECT_EQ(works + closed, kIdle);
    EXPECT_TRUE(next.waitForMetric(kHandover, {{"result", "taken"}}, static_cast<double>(works)))
        << "every connection the new relay took works, and only those";
    EXPECT_EQ(exchangeThrough(next), "");
    std::cout << kIdle << " idle connections, the old relay killed midway: " << works
              << " crossed and work, " << closed << " closed with it\n";
}

// Sockmap: a ring crosses whole, so the kill lands between rings, or between a RING and its
// connections; what crossed runs on the adopted maps, which the new relay holds open.
INSTANTIATE_TEST_SUITE_P(Paths, HandoverKilled, ::testing::Values("splice", "sockmap"), modeName);

// A taker that speaks only protocol version 1 (a relay from before the handover) gets the
// listening sockets and no connection: the old relay drains them, as before.
TEST_F(HandoverTest, AVersion1TakerGetsNoConnectionAndTheOldRelayDrainsThem) {
    RelayProcess old;
    ASSERT_TRUE(old.start(handoverConfig(up_.hostPort(), "splice", socket_)));
    PingPong ping(old.host(), old.port());
    ASSERT_TRUE(waitUntil([&] { return ping.replies() > 20; }, kIo));
    auto channel = takeover::connectTo(socket_);
    ASSERT_TRUE(channel) << channel.error().why;
    takeover::Message hello("HELLO");
    hello.set("versions", "1").set("pid", "1").set("release", "before-handover");
    ASSERT_TRUE(takeover::send(channel->get(), hello, monotonicMs() + 5000));
    std::vector<takeover::Message> came;
    for (;;) {
        auto m = takeover::receive(channel->get(), monotonicMs() + 5000);
        ASSERT_TRUE(m) << m.error();
        if (m->verb == "END") break;
        came.push_back(std::move(*m));
    }
    ASSERT_FALSE(came.empty());
    EXPECT_EQ(came[0].get("version"), "1");
    takeover::Message ready("READY");
    ready.set("pid", "1");
    ASSERT_TRUE(takeover::send(channel->get(), ready, monotonicMs() + 5000));
    auto done = takeover::receive(channel->get(), monotonicMs() + 10'000);
    ASSERT_TRUE(done) << done.error();
    EXPECT_EQ(done->verb, "DONE") << "a connection came to a version 1 taker: " << done->line();
    const int pings = ping.replies();
    ASSERT_TRUE(waitUntil([&] { return ping.replies() > pings + 20; }, kIo))
        << "the kept connection stopped";
    EXPECT_TRUE(old.running());
    EXPECT_EQ(ping.finish(), "");
    std::optional<ExitStatus> gone = old.waitExit(kIo);
    ASSERT_TRUE(gone) << old.stderrText();
    EXPECT_TRUE(gone->cleanExit()) << gone->describe();
}

// A real client: iperf3 streams for 4 s through the relay, upgraded 1.5 s in; its control and
// data connections both cross, and it finishes as if nothing happened.
class HandoverIperf3 : public HandoverTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(HandoverIperf3, AnIperf3StreamKeepsGoingAcrossTheUpgrade) {
    auto iperf3 = findExecutable("iperf3");
    ASSERT_TRUE(iperf3) << "iperf3 is not installed (deploy/install-deps.sh installs it)";
    ChildProcess server;
    const uint16_t server_port = startIperf3Server(server, scratch_);
    ASSERT_NE(server_port, 0);
    RelayProcess old;
    ASSERT_TRUE(
        old.start(handoverConfig(loopbackHostPort(AF_INET, server_port), GetParam(), socket_)));
    CommandResult client;
    std::thread run([&] {
        client = runCommand(
            {*iperf3, "-c", "127.0.0.1", "-p", std::to_string(old.port()), "-t", "4", "-J"},
            Millis{60'000});
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(1'500));
    RelayProcess next;
    const int64_t exit_ms = upgrade(old, next, Millis{kSanitized ? 5'000 : 1'000});
    run.join();
    EXPECT_GE(exit_ms, 0) << "the old relay still runs:\n" << old.stderrText();
    EXPECT_TRUE(client.status.cleanExit()) << client.describe();
    EXPECT_NE(client.out.find("\"sum_received\""), std::string::npos) << client.out.substr(0, 2000);
    EXPECT_TRUE(next.waitForMetric(kHandover, {{"result", "taken"}}, 2.0)) << next.stderrText();
    server.sendSignal(SIGTERM);
    EXPECT_TRUE(server.waitExit(Millis{5'000})) << readFileText(scratch_.file("iperf3-server.err"));
}

INSTANTIATE_TEST_SUITE_P(Paths, HandoverIperf3, ::testing::Values("splice", "sockmap"), modeName);

// The new relay takes no more than its fd budget has room for: with 400 open files (136
// connections over 2 workers, less the 32 accepts they may have armed: 104; fewer if its open
// fds leave less) it takes some of 150, and the old relay keeps the rest. None is lost to an
// fd that did not fit, and every one of the 150 works, wherever it is.
TEST_F(HandoverTest, TheNewRelayTakesWhatItsFdBudgetHasRoomForAndTheRestStay) {
    constexpr int kIdle = 150;
    RelayProcess old;
    ASSERT_TRUE(old.start(handoverConfig(up_.hostPort(), "splice", socket_)));
    std::vector<Fd> idle = idleEchoes(old, kIdle);
    ASSERT_EQ(idle.size(), static_cast<size_t>(kIdle));
    ASSERT_TRUE(up_.waitForAccepted(static_cast<size_t>(kIdle), kIo));
    RelayProcess next;
    next.setNofileLimit(400);
    ASSERT_TRUE(next.startWithArgs({"-c", old.configPath(), "--takeover"}));
    // Counted by the workers as they adopt, after the ready line: waited for, then read.
    EXPECT_TRUE(next.waitForMetric(
        kHandover, {{"result", "taken"}}, [](double v) { return v > 50; }, "> 50"))
        << next.stderrText();
    const double taken = next.metric(kHandover, {{"result", "taken"}}).value_or(-1);
    EXPECT_LE(taken, 104.0) << next.stderrText();
    EXPECT_EQ(next.metric(kHandover, {{"result", "lost"}}), 0.0) << next.stderrText();
    EXPECT_TRUE(old.running()) << "the old relay left the connections it kept";
    int failed = 0;
    for (Fd& fd : idle)
        if (!echoBack(fd.get(), "ping", kIo).ok()) ++failed;
    EXPECT_EQ(failed, 0);
    idle.clear();
    std::optional<ExitStatus> gone = old.waitExit(kIo);
    ASSERT_TRUE(gone) << old.stderrText();
    EXPECT_TRUE(gone->cleanExit()) << gone->describe();
    next.terminate();
}

// A connection's identity crosses with it: the new relay's access log line for it names the
// client its PROXY header named, its start before the upgrade, its whole duration and every
// byte, both sides; the old relay's line says it was handed over, with the bytes until then.
class HandoverIdentity : public HandoverTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(HandoverIdentity, AConnectionsIdentityAndBytesCrossToTheAccessLog) {
    const std::string log_path = scratch_.file("access.log");
    RelayConfig config = handoverConfig(up_.hostPort(), GetParam(), socket_);
    config.extra_yaml += "access_log:\n  path: \"" + log_path + "\"\n";
    config.listeners[0].extra_yaml = "    accept_proxy: true\n";
    RelayProcess old;
    ASSERT_TRUE(old.start(config));
    Connected c = connectTo(old.host(), old.port());
    ASSERT_TRUE(c.fd) << c.error;
    const std::string first =
        "PROXY TCP4 192.0.2.1 198.51.100.2 40000 443\r\nE" + std::string(999, 'a');
    ASSERT_TRUE(writeAll(c.fd.get(), first.data(), first.size(), kIo).ok());
    std::string back(999, '\0');
    ASSERT_TRUE(readExactly(c.fd.get(), back.data(), back.size(), kIo).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));

    RelayProcess next;
    ASSERT_GE(upgrade(old, next, Millis{kSanitized ? 5'000 : 1'000}), 0) << old.stderrText();
    EXPECT_TRUE(next.waitForMetric(kHandover, {{"result", "taken"}}, 1.0));
    const std::string more(1000, 'b');
    ASSERT_TRUE(writeAll(c.fd.get(), more.data(), more.size(), kIo).ok());
    back.assign(1000, '\0');
    ASSERT_TRUE(readExactly(c.fd.get(), back.data(), back.size(), kIo).ok());
    EXPECT_EQ(back, more);
    EXPECT_EQ(endStream(c.fd.get(), kIo), "");
    ASSERT_TRUE(next.waitForMetric(kActive, metric::listener(), 0.0));
    ExitStatus stopped = next.terminate();  // its access log is flushed as it exits
    EXPECT_TRUE(stopped.cleanExit()) << stopped.describe();

    std::string text = readFileText(log_path);
    std::map<std::string, std::string> by_reason;  // termination -> its line
    for (size_t at = 0, end; (end = text.find('\n', at)) != std::string::npos; at = end + 1) {
        std::string error;
        auto doc = parseJson(text.substr(at, end - at), error);
        ASSERT_TRUE(doc) << error << ": " << text;
        const Json* why = doc->get("termination");
        ASSERT_NE(why, nullptr) << text;
        by_reason[why->string] = text.substr(at, end - at);
    }
    ASSERT_EQ(by_reason.count("handed_over"), 1u) << text;
    ASSERT_EQ(by_reason.count("done"), 1u) << text;
    std::string error;
    const Json done = *parseJson(by_reason["done"], error);
    const Json handed = *parseJson(by_reason["handed_over"], error);
    EXPECT_EQ(done.get("client")->string, "192.0.2.1:40000");
    // Up: 'E', 999 and 1000 bytes (the PROXY header is not data); down: the echo of 1999.
    EXPECT_EQ(done.get("bytes_up")->raw, "2000");
    EXPECT_EQ(done.get("bytes_down")->raw, "1999");
    EXPECT_EQ(handed.get("bytes_up")->raw, "1000");
    EXPECT_EQ(handed.get("bytes_down")->raw, "999");
    EXPECT_EQ(done.get("time")->string, handed.get("time")->string) << "the same start";
    EXPECT_GE(std::strtod(done.get("duration_ms")->raw.c_str(), nullptr), 300.0);
    // On the path it had. On sockmap the PROXY header it took crosses in the direction's
    // counts (the FIN barrier's sums), so the end came after every byte above.
    EXPECT_EQ(done.get("path")->string, GetParam());
    EXPECT_EQ(handed.get("path")->string, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Paths, HandoverIdentity, ::testing::ValuesIn(kModes), modeName);

// A real client in an open transaction: psql begins, inserts, sleeps in the server while the
// relay is upgraded, inserts again and commits. The session never notices; both rows are there.
TEST_F(HandoverTest, APsqlSessionInAnOpenTransactionCommitsAcrossTheUpgrade) {
    auto psql = findExecutable("psql");
    ASSERT_TRUE(psql) << "psql is not installed (deploy/install-deps.sh installs postgresql)";
    std::string bin;
    for (const char* v : {"17", "16", "15"})
        if (::access(("/usr/lib/postgresql/" + std::string(v) + "/bin/initdb").c_str(), X_OK) == 0)
            bin = "/usr/lib/postgresql/" + std::string(v) + "/bin/";
    ASSERT_FALSE(bin.empty()) << "no PostgreSQL server binaries under /usr/lib/postgresql";
    passwd* pg = ::getpwnam("postgres");
    ASSERT_NE(pg, nullptr) << "no postgres user";
    // PostgreSQL refuses to run as root: its directory is the postgres user's.
    const std::string dir = scratch_.file("pg");
    ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
    ASSERT_EQ(::chown(dir.c_str(), pg->pw_uid, pg->pw_gid), 0) << std::strerror(errno);
    ASSERT_EQ(::chmod(scratch_.path().c_str(), 0755), 0);
    auto runuser = findExecutable("runuser");
    ASSERT_TRUE(runuser) << "no runuser (util-linux)";
    const auto as_postgres = [&](std::vector<std::string> argv) {
        argv.insert(argv.begin(), {*runuser, "-u", "postgres", "--"});
        return runCommand(argv, Millis{60'000});
    };
    CommandResult init =
        as_postgres({bin + "initdb", "-D", dir + "/data", "-A", "trust", "-U", "postgres"});
    ASSERT_TRUE(init.status.cleanExit()) << init.describe();
    uint16_t pg_port = 0;
    ASSERT_TRUE(startOnFreeLoopbackPort(AF_INET, [&](uint16_t port, std::string& why) {
        CommandResult started = as_postgres(
            {bin + "pg_ctl", "-D", dir + "/data", "-w", "-t", "30", "-l", dir + "/pg.log", "-o",
             "-p " + std::to_string(port) + " -k " + dir + " -c listen_addresses=127.0.0.1",
             "start"});
        if (started.status.cleanExit()) {
            pg_port = port;
            return PortLaunch::Up;
        }
        why = started.describe() + readFileText(dir + "/pg.log");
        return PortLaunch::Retry;
    }));
    struct Stop {
        std::function<void()> f;
        ~Stop() { f(); }
    } stop{[&] { as_postgres({bin + "pg_ctl", "-D", dir + "/data", "-m", "fast", "stop"}); }};

    RelayProcess old;
    ASSERT_TRUE(old.start(handoverConfig(loopbackHostPort(AF_INET, pg_port), "splice", socket_)));
    const std::string script = scratch_.writeFile(
        "tx.sql",
        "BEGIN;\nCREATE TABLE crossed (x int);\nINSERT INTO crossed VALUES (1);\n"
        "SELECT pg_sleep(2);\nINSERT INTO crossed VALUES (2);\nCOMMIT;\n"
        "SELECT 'rows=' || count(*) FROM crossed;\n");
    CommandResult session;
    std::thread run([&] {
        session = runCommand({*psql, "-h", "127.0.0.1", "-p", std::to_string(old.port()), "-U",
                              "postgres", "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-f", script},
                             Millis{60'000});
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(1'000));  // inside pg_sleep
    RelayProcess next;
    const int64_t exit_ms = upgrade(old, next, Millis{kSanitized ? 5'000 : 1'000});
    run.join();
    EXPECT_GE(exit_ms, 0) << "the old relay still runs:\n" << old.stderrText();
    EXPECT_TRUE(next.waitForMetric(kHandover, {{"result", "taken"}}, 1.0)) << next.stderrText();
    EXPECT_TRUE(session.status.cleanExit()) << session.describe();
    EXPECT_NE(session.out.find("rows=2"), std::string::npos) << session.describe();
}

// A real client on a long transfer: scp of 96 MiB, paced to about 3 s, over ssh through the
// relay to an sshd of this case's own, upgraded 1 s in. The copy arrives whole.
TEST_F(HandoverTest, AnScpOverSshKeepsGoingAcrossTheUpgrade) {
    auto sshd = findExecutable("sshd");
    auto scp = findExecutable("scp");
    auto keygen = findExecutable("ssh-keygen");
    ASSERT_TRUE(sshd && scp && keygen)
        << "sshd, scp or ssh-keygen is missing (deploy/install-deps.sh installs openssh)";
    const std::string d = scratch_.path();
    for (const char* key : {"host", "client"}) {
        CommandResult made =
            runCommand({*keygen, "-q", "-t", "ed25519", "-N", "", "-f", d + "/" + key});
        ASSERT_TRUE(made.status.cleanExit()) << made.describe();
    }
    scratch_.writeFile("authorized_keys", readFileText(d + "/client.pub"));
    ::mkdir("/run/sshd", 0755);  // sshd's privilege separation directory, if the host has none
    ChildProcess server;
    uint16_t ssh_port = 0;
    ASSERT_TRUE(startOnFreeLoopbackPort(AF_INET, [&](uint16_t port, std::string& why) {
        const std::string config = scratch_.writeFile(
            "sshd_config", "Port " + std::to_string(port) + "\nListenAddress 127.0.0.1\nHostKey " +
                               d + "/host\nAuthorizedKeysFile " + d + "/authorized_keys\nPidFile " +
                               d +
                               "/sshd.pid\nStrictModes no\nUsePAM no\n"
                               "PermitRootLogin prohibit-password\nSubsystem sftp internal-sftp\n");
        ChildProcess::Options o;
        o.argv = {*sshd, "-D", "-e", "-f", config};
        o.stderr_path = d + "/sshd.err";
        if (!server.spawn(o, why)) return PortLaunch::Failed;
        if (waitUntil([&] { return listensOnLoopback4(port); }, Millis{5'000})) {
            ssh_port = port;
            return PortLaunch::Up;
        }
        why = "sshd never listened: " + readFileText(d + "/sshd.err");
        server.killAndWait();
        return PortLaunch::Retry;
    }));
    const std::string source = d + "/source.bin";
    {
        std::string block(1 << 20, '\0');
        std::FILE* f = std::fopen(source.c_str(), "wb");
        ASSERT_NE(f, nullptr);
        for (int i = 0; i < 96; ++i) {
            for (size_t j = 0; j < block.size(); ++j)
                block[j] = static_cast<char>((j * 31 + i * 7) ^ (j >> 9));
            ASSERT_EQ(std::fwrite(block.data(), 1, block.size(), f), block.size());
        }
        std::fclose(f);
    }
    RelayProcess old;
    ASSERT_TRUE(old.start(handoverConfig(loopbackHostPort(AF_INET, ssh_port), "splice", socket_)));
    CommandResult copied;
    std::thread run([&] {
        copied = runCommand(
            {*scp, "-q", "-P", std::to_string(old.port()), "-i", d + "/client", "-l", "256000",
             "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o",
             "BatchMode=yes", source, "root@127.0.0.1:" + d + "/copy.bin"},
            Millis{60'000});
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(1'000));
    RelayProcess next;
    const int64_t exit_ms = upgrade(old, next, Millis{kSanitized ? 5'000 : 1'000});
    run.join();
    EXPECT_GE(exit_ms, 0) << "the old relay still runs:\n" << old.stderrText();
    EXPECT_TRUE(copied.status.cleanExit()) << copied.describe() << readFileText(d + "/sshd.err");
    EXPECT_TRUE(next.waitForMetric(kHandover, {{"result", "taken"}}, 1.0))
        << "the scp ended before?";
    EXPECT_TRUE(readFileText(d + "/copy.bin", 200 << 20) == readFileText(source, 200 << 20))
        << "the copy differs";
}

// The fd table is grown at start, before any thread: adopting thousands of connections (or
// any climb in connections) then never grows it, and no thread waits out the RCU grace period
// each growth costs a process with threads (proxy/fd_table.hpp).
TEST_F(HandoverTest, TheFdTableIsGrownAtStartToTheOpenFileLimit) {
    RelayProcess relay;
    ASSERT_TRUE(relay.start(handoverConfig(up_.hostPort(), "splice", socket_)));
    const std::string status = readFileText("/proc/" + std::to_string(relay.pid()) + "/status");
    const std::string limits = readFileText("/proc/" + std::to_string(relay.pid()) + "/limits");
    const size_t at = status.find("FDSize:");
    ASSERT_NE(at, std::string::npos) << status;
    const long fd_size = std::strtol(status.c_str() + at + 7, nullptr, 10);
    const size_t limit_at = limits.find("Max open files");
    ASSERT_NE(limit_at, std::string::npos) << limits;
    const long limit = std::strtol(limits.c_str() + limit_at + 14, nullptr, 10);
    EXPECT_GE(fd_size, std::min<long>(limit, 256 * 1024)) << status;
}

// ---------------------------------------------------------------------------------------------
// Sockmap: the states the kernel path can be in at the upgrade, and what keeps a ring here.

// Passed bytes in flight: the upstream sends 32 MiB to a client that reads slowly (64 KiB every
// 8 ms, about 8 MiB/s, after a first pause), so the program passes what its in-flight bound
// refuses, again and again. Handing over, the direction sends what its copy holds, reads no
// more, and crosses with passed bytes waiting on the socket; the new relay moves them, and every
// byte arrives once and in order.
TEST_F(HandoverTest, ASockmapDirectionWithPassedBytesWaitingCrossesAndDeliversThemInOrder) {
    RelayProcess old;
    ASSERT_TRUE(old.start(handoverConfig(up_.hostPort(), "sockmap", socket_)));
    Connected c = connectTo(old.host(), old.port());
    ASSERT_TRUE(c.fd) << c.error;
    ASSERT_TRUE(writeAll(c.fd.get(), "S", 1, kIo).ok());
    const std::string catchups = metricName(Metric::SockmapCatchups);
    // The client's own first byte may have been passed too (sent before its socket was in).
    ASSERT_TRUE(old.waitForMetric(
        catchups, metric::listener(), [](double v) { return v >= 1; }, ">= 1"));
    PayloadVerifier verifier(kSeedSource);
    IoResult end;
    std::thread reader([&] {
        std::vector<uint8_t> chunk(64 * 1024);
        for (;;) {
            IoResult r = readSome(c.fd.get(), chunk.data(), chunk.size(), kIo);
            if (!r.ok()) {
                end = r;
                return;
            }
            verifier.update({chunk.data(), r.bytes});
            std::this_thread::sleep_for(std::chrono::milliseconds(8));
        }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(500));

    RelayProcess next;
    const int64_t exit_ms = upgrade(old, next, Millis{kSanitized ? 5'000 : 1'000});
    reader.join();
    EXPECT_GE(exit_ms, 0) << "the old relay still runs:\n" << old.stderrText();
    EXPECT_TRUE(next.waitForMetric(kHandover, {{"result", "taken"}}, 1.0)) << next.stderrText();
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
    EXPECT_EQ(verifier.bytes(), kSourceBytes);
    EXPECT_EQ(verifier.firstMismatch(), -1);
    EXPECT_GT(next.metric(metricName(Metric::SockmapCopiedBytes), metric::listener()).value_or(0),
              0.0)
        << "the new relay moved passed bytes";
    c.fd.reset();
    EXPECT_TRUE(next.waitForMetric(kActive, metric::listener(), 0.0));
    ExitStatus stopped = next.terminate();
    EXPECT_TRUE(stopped.cleanExit()) << stopped.describe();
}

// Across two upgrades: the second relay hands on the maps it adopted, and the third relays the
// same ping-pong on them, every reply in order.
TEST_F(HandoverTest, ASockmapConnectionCrossesTwiceOnTheMapsItStartedIn) {
    RelayProcess first;
    ASSERT_TRUE(first.start(handoverConfig(up_.hostPort(), "sockmap", socket_)));
    PingPong ping(first.host(), first.port());
    ASSERT_TRUE(waitUntil([&] { return ping.replies() > 20; }, kIo));
    RelayProcess second;
    EXPECT_GE(upgrade(first, second, Millis{kSanitized ? 5'000 : 1'000}), 0) << first.stderrText();
    int pings = ping.replies();
    ASSERT_TRUE(waitUntil([&] { return ping.replies() > pings + 20; }, kIo));
    RelayProcess third;
    EXPECT_GE(upgrade(second, third, Millis{kSanitized ? 5'000 : 1'000}, first.configPath()), 0)
        << second.stderrText();
    EXPECT_TRUE(third.waitForMetric(kHandover, {{"result", "taken"}}, 1.0)) << third.stderrText();
    EXPECT_EQ(third.metric(metric::kSockmapSockets), 2.0);
    pings = ping.replies();
    ASSERT_TRUE(waitUntil([&] { return ping.replies() > pings + 20; }, kIo));
    EXPECT_EQ(ping.finish(), "");
    EXPECT_TRUE(third.waitForMetric(metric::kSockmapSockets, {}, 0.0));
    third.terminate();
}

// mode auto: a connection promoted from splice to sockmap crosses on sockmap, and its access log
// line still says both paths.
TEST_F(HandoverTest, APromotedConnectionCrossesOnSockmap) {
    const std::string log_path = scratch_.file("access.log");
    RelayConfig config = handoverConfig(up_.hostPort(), "auto", socket_);
    config.extra_yaml += "access_log:\n  path: \"" + log_path + "\"\n";
    RelayProcess old;
    ASSERT_TRUE(old.start(config));
    PingPong ping(old.host(), old.port());
    ASSERT_TRUE(waitUntil([&] { return ping.replies() > 20; }, kIo));
    ASSERT_TRUE(old.waitForMetric(metric::kSockmapSockets, {}, 2.0)) << "promoted";
    RelayProcess next;
    EXPECT_GE(upgrade(old, next, Millis{kSanitized ? 5'000 : 1'000}), 0) << old.stderrText();
    EXPECT_TRUE(next.waitForMetric(kHandover, {{"result", "taken"}}, 1.0)) << next.stderrText();
    EXPECT_EQ(next.metric(metric::kSockmapSockets), 2.0);
    const int pings = ping.replies();
    ASSERT_TRUE(waitUntil([&] { return ping.replies() > pings + 20; }, kIo));
    EXPECT_EQ(ping.finish(), "");
    ASSERT_TRUE(next.waitForMetric(kActive, metric::listener(), 0.0));
    ExitStatus stopped = next.terminate();
    EXPECT_TRUE(stopped.cleanExit()) << stopped.describe();
    const std::string text = readFileText(log_path);
    EXPECT_NE(text.find("\"splice>sockmap\""), std::string::npos) << text;
    EXPECT_NE(text.find("\"done\""), std::string::npos) << text;
}

// mode auto: a connection still on splice when it crosses (one exchange, not yet interactive)
// is watched in the new relay as it was in the old, promoted there after a few more, and its end
// waits for every byte, its PROXY header counted out of the barrier's sums as the old relay
// would have.
TEST_F(HandoverTest, AConnectionOnSpliceInModeAutoIsPromotedByTheNewRelay) {
    RelayConfig config = handoverConfig(up_.hostPort(), "auto", socket_);
    config.listeners[0].extra_yaml = "    accept_proxy: true\n";
    RelayProcess old;
    ASSERT_TRUE(old.start(config));
    Connected c = connectTo(old.host(), old.port());
    ASSERT_TRUE(c.fd) << c.error;
    const std::string header = "PROXY TCP4 192.0.2.1 198.51.100.2 40000 443\r\nE";
    ASSERT_TRUE(writeAll(c.fd.get(), header.data(), header.size(), kIo).ok());
    ASSERT_TRUE(echoBack(c.fd.get(), "first", kIo).ok());
    EXPECT_EQ(old.metric(metric::kSockmapSockets), 0.0) << "still on splice";

    RelayProcess next;
    ASSERT_GE(upgrade(old, next, Millis{kSanitized ? 5'000 : 1'000}), 0) << old.stderrText();
    EXPECT_TRUE(next.waitForMetric(kHandover, {{"result", "taken"}}, 1.0));
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(echoBack(c.fd.get(), "again", kIo).ok()) << i;
    EXPECT_TRUE(next.waitForMetric(metric::kSockmapSockets, {}, 2.0)) << "promoted here";
    EXPECT_EQ(next.metric(metricName(Metric::DatapathSwitches),
                          {{"listener", "t"}, {"from", "splice"}, {"to", "sockmap"}}),
              2.0)
        << "both directions";
    EXPECT_TRUE(echoBack(c.fd.get(), "on sockmap", kIo).ok());
    EXPECT_EQ(endStream(c.fd.get(), kIo), "") << "the FIN came back after every byte";
    EXPECT_TRUE(next.waitForMetric(kActive, metric::listener(), 0.0));
    next.terminate();
}

// A ring has one reader, so its connections cross together or not at all: with one worker, a
// sockmap connection on a listener the new relay does not have keeps the other (whose listener
// it has) in the old relay too. Both relay on there, whole, until they end.
TEST_F(HandoverTest, ASockmapRingStaysWholeWhenOneOfItsConnectionsCannotCross) {
    RelayConfig config = handoverConfig(up_.hostPort(), "sockmap", socket_);
    config.workers = 1;
    ListenerSpec second = config.listeners[0];
    second.name = "u";
    config.listeners.push_back(second);
    RelayProcess old;
    ASSERT_TRUE(old.start(config));
    PingPong kept(old.host(), old.port("u"));
    PingPong also(old.host(), old.port("t"));
    ASSERT_TRUE(waitUntil([&] { return kept.replies() > 20 && also.replies() > 20; }, kIo));
    ASSERT_TRUE(old.waitForMetric(metric::kSockmapSockets, {}, 4.0));

    config.listeners.pop_back();  // the new relay has no listener u
    const std::string next_config = scratch_.file("next.yaml");
    std::ofstream(next_config) << config.yaml();
    RelayProcess next;
    ASSERT_TRUE(next.startWithArgs({"-c", next_config, "--takeover"}));
    EXPECT_EQ(next.metric(kHandover, {{"result", "taken"}}), 0.0) << next.stderrText();
    EXPECT_TRUE(old.running());
    const int pings[2] = {kept.replies(), also.replies()};
    ASSERT_TRUE(waitUntil(
        [&] { return kept.replies() > pings[0] + 20 && also.replies() > pings[1] + 20; }, kIo));
    EXPECT_EQ(kept.finish(), "");
    EXPECT_EQ(also.finish(), "");
    std::optional<ExitStatus> gone = old.waitExit(kIo);
    ASSERT_TRUE(gone) << old.stderrText();
    EXPECT_TRUE(gone->cleanExit()) << gone->describe();
    EXPECT_NE(old.stderrText().find("0 connections handed over, 2 kept"), std::string::npos)
        << old.stderrText();
    next.terminate();
}

// A copy direction whose client does not read: what the relay holds for it cannot be sent, so
// it cannot cross. Past the handover's second it relays on in the old relay (counted kept),
// and once the client reads, every byte arrives.
TEST_F(HandoverTest, ACopyDirectionThatCannotSendWhatItHoldsStaysWhole) {
    RelayProcess old;
    ASSERT_TRUE(old.start(handoverConfig(up_.hostPort(), "copy", socket_)));
    Connected c = connectTo(old.host(), old.port());
    ASSERT_TRUE(c.fd) << c.error;
    ASSERT_TRUE(writeAll(c.fd.get(), "S", 1, kIo).ok());
    // The relay's buffers and both sockets' full: the upstream is blocked in its send.
    ASSERT_TRUE(waitUntil(
        [&] {
            auto v = old.metric(metricName(Metric::CopyBuffersBusy));
            return v && *v >= 1;
        },
        kIo));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));

    RelayProcess next;
    ASSERT_TRUE(next.startWithArgs({"-c", old.configPath(), "--takeover"}));
    EXPECT_EQ(next.metric(kHandover, {{"result", "taken"}}), 0.0);
    EXPECT_TRUE(old.running());
    ReceiveCheck got = receivePayloadUntilEof(c.fd.get(), kSeedSource, kIo);
    EXPECT_EQ(got.io.status, IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, kSourceBytes);
    EXPECT_EQ(got.first_mismatch, -1) << got.describe();
    c.fd.reset();
    std::optional<ExitStatus> gone = old.waitExit(kIo);
    ASSERT_TRUE(gone) << old.stderrText();
    EXPECT_TRUE(gone->cleanExit()) << gone->describe();
    EXPECT_NE(old.stderrText().find("0 connections handed over, 1 kept"), std::string::npos)
        << old.stderrText();
    next.terminate();
}

// A connection whose connect to the backend is still in flight (its SYN dropped) stays with
// the old relay, which completes it once the SYN goes through, and relays it whole.
TEST_F(HandoverTest, AConnectionMidConnectStaysAndIsServedWhole) {
    auto iptables = findExecutable("iptables");
    ASSERT_TRUE(iptables) << "iptables is not installed (deploy/install-deps.sh installs it)";
    RelayProcess old;
    ASSERT_TRUE(old.start(handoverConfig(up_.hostPort(), "splice", socket_)));
    Connected c;
    {
        SynDropRule rule(*iptables, up_.port());
        ASSERT_TRUE(rule.added()) << rule.error();
        c = connectTo(old.host(), old.port());
        ASSERT_TRUE(c.fd) << c.error;
        ASSERT_TRUE(writeAll(c.fd.get(), "Ehello", 6, kIo).ok());
        ASSERT_TRUE(
            old.waitForMetric(metricName(Metric::ConnectionsActive), metric::listener(), 1.0));
        RelayProcess next;
        ASSERT_TRUE(next.startWithArgs({"-c", old.configPath(), "--takeover"}));
        EXPECT_EQ(next.metric(kHandover, {{"result", "taken"}}), 0.0);
        EXPECT_TRUE(old.running());
        EXPECT_EQ(up_.accepted(), 0u) << "the SYN went through before the upgrade";
        next.terminate();
    }  // the rule goes: the next SYN retransmission connects
    char back[5] = {};
    IoResult r = readExactly(c.fd.get(), back, 5, kIo);
    EXPECT_TRUE(r.ok()) << r.describe();
    EXPECT_EQ(std::string(back, 5), "hello");
    EXPECT_EQ(endStream(c.fd.get(), kIo), "");
    std::optional<ExitStatus> gone = old.waitExit(kIo);
    ASSERT_TRUE(gone) << old.stderrText();
    EXPECT_TRUE(gone->cleanExit()) << gone->describe();
}

// A TLS ClientHello naming `name` (server_name alone), in one record: RFC 8446 4.1.2 and
// RFC 6066 3, written out by hand.
std::string clientHello(const std::string& name) {
    auto be16 = [](size_t v) {
        return std::string{static_cast<char>(v >> 8), static_cast<char>(v)};
    };
    const std::string sni = std::string("\x00", 1) + be16(name.size()) + name;  // host_name
    const std::string server_name = be16(0) + be16(sni.size() + 2) + be16(sni.size()) + sni;
    std::string body = std::string("\x03\x03", 2) + std::string(32, '\x5a') +
                       std::string("\x00", 1) +                // no session id
                       be16(2) + std::string("\x13\x01", 2) +  // TLS_AES_128_GCM_SHA256
                       std::string("\x01\x00", 2) +            // no compression
                       be16(server_name.size()) + server_name;
    const std::string handshake =
        std::string("\x01", 1) + std::string(1, '\0') + be16(body.size()) + body;
    return std::string("\x16\x03\x01", 3) + be16(handshake.size()) + handshake;
}

// A connection whose ClientHello is half in when the upgrade comes is still being inspected:
// it stays with the old relay, which routes it once the rest comes, and relays it whole.
TEST_F(HandoverTest, AConnectionMidClientHelloStaysAndIsRoutedWhole) {
    ScriptedUpstream echo(AF_INET, echoScript());
    ASSERT_TRUE(echo.ok()) << echo.error();
    RelayConfig config = handoverConfig(up_.hostPort(), "splice", socket_);
    config.extra_yaml +=
        "clusters:\n  - name: app\n    backends:\n      - {address: " + echo.hostPort() + "}\n";
    config.listeners[0].omit_target = true;
    config.listeners[0].extra_yaml =
        "    routes:\n      - {name: hand, sni: [hand.example.test], cluster: app}\n"
        "      - {cluster: app}\n";
    RelayProcess old;
    ASSERT_TRUE(old.start(config));
    Connected c = connectTo(old.host(), old.port());
    ASSERT_TRUE(c.fd) << c.error;
    const std::string hello = clientHello("hand.example.test");
    const size_t half = hello.size() / 2;
    ASSERT_TRUE(writeAll(c.fd.get(), hello.data(), half, kIo).ok());

    RelayProcess next;
    ASSERT_TRUE(next.startWithArgs({"-c", old.configPath(), "--takeover"}));
    EXPECT_EQ(next.metric(kHandover, {{"result", "taken"}}), 0.0);
    EXPECT_TRUE(old.running());
    const std::string rest = hello.substr(half) + "and then some bytes";
    ASSERT_TRUE(writeAll(c.fd.get(), rest.data(), rest.size(), kIo).ok());
    std::string back(hello.size() + 19, '\0');
    IoResult r = readExactly(c.fd.get(), back.data(), back.size(), kIo);
    EXPECT_TRUE(r.ok()) << r.describe();
    EXPECT_TRUE(back == hello + "and then some bytes") << "the echo differs";
    EXPECT_EQ(endStream(c.fd.get(), kIo), "");
    std::optional<ExitStatus> gone = old.waitExit(kIo);
    ASSERT_TRUE(gone) << old.stderrText();
    EXPECT_TRUE(gone->cleanExit()) << gone->describe();
    next.terminate();
}

// In sockmap mode a ping-pong on the same worker crosses meanwhile, its ring with it: the old
// relay then puts nothing more on its maps, and the connection it finishes runs splice.
class HandoverMidProxy : public HandoverTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(HandoverMidProxy, AConnectionMidProxyHeaderStaysAndIsServedWhole) {
    RelayConfig config = handoverConfig(up_.hostPort(), GetParam(), socket_);
    config.workers = 1;
    config.listeners[0].extra_yaml = "    accept_proxy: true\n";
    RelayProcess old;
    ASSERT_TRUE(old.start(config));
    std::unique_ptr<PingPong> ping;
    if (GetParam() == "sockmap") {
        // A PROXY header of its own first, then the ping-pong.
        ping = std::make_unique<PingPong>(old.host(), old.port(),
                                          "PROXY TCP4 192.0.2.9 198.51.100.2 40009 443\r\n");
        ASSERT_TRUE(waitUntil([&] { return ping->replies() > 20; }, kIo))
            << old.stderrText() << old.scrape().value_or("");
    }
    Connected c = connectTo(old.host(), old.port());
    ASSERT_TRUE(c.fd) << c.error;
    const std::string header = "PROXY TCP4 192.0.2.1 198.51.100.2 40000 443\r\n";
    ASSERT_TRUE(writeAll(c.fd.get(), header.data(), 12, kIo).ok());  // "PROXY TCP4 1"

    RelayProcess next;
    ASSERT_TRUE(next.startWithArgs({"-c", old.configPath(), "--takeover"}));
    // The new relay's worker counts what it adopted after the ready line.
    EXPECT_TRUE(next.waitForMetric(kHandover, {{"result", "taken"}}, ping ? 1.0 : 0.0));
    EXPECT_TRUE(old.running());
    const std::string rest = header.substr(12) + "Ehello";
    ASSERT_TRUE(writeAll(c.fd.get(), rest.data(), rest.size(), kIo).ok());
    char back[5] = {};
    IoResult r = readExactly(c.fd.get(), back, 5, kIo);
    EXPECT_TRUE(r.ok()) << r.describe();
    EXPECT_EQ(std::string(back, 5), "hello");
    c.fd.reset();
    std::optional<ExitStatus> gone = old.waitExit(kIo);
    ASSERT_TRUE(gone) << old.stderrText();
    EXPECT_TRUE(gone->cleanExit()) << gone->describe();
    if (ping) {
        const int pings = ping->replies();
        ASSERT_TRUE(waitUntil([&] { return ping->replies() > pings + 20; }, kIo));
        EXPECT_EQ(ping->finish(), "");
    }
    next.terminate();
}

INSTANTIATE_TEST_SUITE_P(Paths, HandoverMidProxy, ::testing::Values("splice", "sockmap"), modeName);

}  // namespace
}  // namespace zcrelay::test::handover_test
