// Faults injected over real loopback sockets, in every data path (splice, copy, sockmap): an
// upstream that accepts and never reads, a client that vanishes without a FIN (its packets
// dropped by an iptables rule on `lo`), an upstream that is down and then comes up.
// The resets, the SYN-drop blackhole, SIGTERM and EMFILE are in relay_close_test.cpp,
// lifecycle_test.cpp and limits_test.cpp. The oracle is what the peers see and the relay's own
// counters, waited on with deadlines.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "support/labels.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::faults_test {
namespace {

constexpr uint64_t kSeedA = 0xFA17;
constexpr uint64_t kSeedB = 0xD0D0;
// "promptly": the bound for closes the relay must propagate; 10 s is room for a loaded 2-core
// machine and far short of the timeouts a missed close would wait for.
constexpr Millis kPrompt{10'000};

uint16_t localPort(int fd) {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
    return addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

// One relay per test, listener "t" in mode GetParam().
class FaultFixture : public ::testing::TestWithParam<std::string> {
  protected:
    const std::string& mode() const { return GetParam(); }

    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void startRelay(const ScriptedUpstream& up,
                    const std::function<void(RelayConfig&)>& tweak = {}) {
        ASSERT_TRUE(up.ok()) << "upstream listener: " << up.error();
        ASSERT_NO_FATAL_FAILURE(startRelayTo(up.hostPort(), tweak));
    }
    void startRelayTo(const std::string& upstream_host_port,
                      const std::function<void(RelayConfig&)>& tweak = {}) {
        RelayConfig config = singleListenerConfig(upstream_host_port, mode());
        if (tweak) tweak(config);
        ASSERT_TRUE(relay_.start(config));
        // A sockmap listener that quietly ran splice would make every sockmap case a second
        // splice case.
        EXPECT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath(mode())), 1.0)
            << "listener t should run the " << mode() << " data path";
    }
    Connected connectClient() { return connectTo(relay_.host(), relay_.port()); }

    RelayProcess relay_;
};

// =============================================================================================
// An upstream that accepts and never reads. The relay must hold the client back (its sends
// stall) with its own memory bounded, rather than buffer what the upstream will not take, and
// idle_timeout must then end the stuck connection on both sides.

class UpstreamAcceptsAndNeverReads : public FaultFixture {};

TEST_P(UpstreamAcceptsAndNeverReads, ClientIsHeldBackMemoryStaysBoundedAndIdleTimeoutClosesBoth) {
    constexpr uint64_t kMaxOffered = 256 * kMiB;  // what the client tries to push at most
    constexpr Millis kStall{1'000};               // no progress this long: the client is held
    // The relay's RSS may grow by its fixed buffers for one connection: a 1 MiB pipe (kernel
    // memory, not RSS) or the copy buffers it touches (a worker's ring is 256 x 64 KiB, and a
    // few MiB pass before the stall), never by what the client offers.
    constexpr long kMaxGrowthKiB = 16 * 1024;
    // The stall is seen 1 s after the client's last progress, the relay's idle close comes at
    // least 3 s after its own last byte: room for the checks in between.
    constexpr const char* kIdle = "3s";

    // Holds its connection without reading until released, then reads it to the end.
    std::atomic<bool> release{false};
    std::atomic<int64_t> first_mismatch{-1};
    ScriptedUpstream up(
        AF_INET, [&](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream&) {
            for (int i = 0; i < 6'000 && !release.load() && !stop.load(); ++i)
                std::this_thread::sleep_for(Millis{10});
            PayloadVerifier v(kSeedA);
            rec.read_end = readStreamUntilEof(
                fd.get(), [&](std::span<const uint8_t> d) { v.update(d); }, Millis{20'000}, &stop);
            rec.bytes_received = v.bytes();
            first_mismatch = v.firstMismatch();
        });
    ASSERT_NO_FATAL_FAILURE(
        startRelay(up, [&](RelayConfig& c) { c.listeners.at(0).idle_timeout = kIdle; }));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    ASSERT_TRUE(up.waitForAccepted(1, Millis{5'000})) << "the relay never connected upstream";
    ASSERT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 1));
    auto rss0 = relay_.rssKiB();
    ASSERT_TRUE(rss0) << "cannot read VmRSS of pid " << relay_.pid();

    // Push until the client is held back (or the bound): sends that find no room wait in poll.
    setNonBlocking(client.fd.get(), true);
    std::vector<uint8_t> chunk(256 * kKiB);
    uint64_t offered = 0;
    long max_rss = *rss0;
    double max_pipes = 0;
    int send_errno = 0;
    auto last_progress = Clock::now();
    auto next_rss = Clock::now();
    auto next_scrape = Clock::now();
    auto deadline = Clock::now() + Millis{60'000};
    while (offered < kMaxOffered && Clock::now() - last_progress < kStall &&
           Clock::now() < deadline) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), kMaxOffered - offered));
        fillPayload(kSeedA, offered, std::span<uint8_t>(chunk.data(), n));
        ssize_t w = ::send(client.fd.get(), chunk.data(), n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            offered += static_cast<uint64_t>(w);
            last_progress = Clock::now();
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            pollfd p{client.fd.get(), POLLOUT, 0};
            ::poll(&p, 1, 50);
        } else if (!(w < 0 && errno == EINTR)) {
            send_errno = errno;
            break;
        }
        if (Clock::now() >= next_rss) {
            if (auto rss = relay_.rssKiB()) max_rss = std::max(max_rss, *rss);
            next_rss = Clock::now() + Millis{20};
        }
        if (Clock::now() >= next_scrape) {
            max_pipes = std::max(max_pipes, relay_.metric(metric::kPipesInUse).value_or(0));
            next_scrape = Clock::now() + Millis{200};
        }
    }
    if (auto rss = relay_.rssKiB()) max_rss = std::max(max_rss, *rss);
    max_pipes = std::max(max_pipes, relay_.metric(metric::kPipesInUse).value_or(0));
    auto relayed = relay_.metric(metric::kBytesTotal, metric::bytes("upstream"));

    ASSERT_EQ(send_errno, 0) << "the client's send failed after " << offered
                             << " bytes, before the idle timeout: " << std::strerror(send_errno);
    ASSERT_LT(offered, kMaxOffered)
        << "the client pushed all " << kMaxOffered << " bytes into an upstream that reads "
        << "nothing: the relay did not hold it back";
    EXPECT_GE(Clock::now() - last_progress, kStall) << "loop bound (60 s) hit while still sending";
    EXPECT_LT(max_rss - *rss0, kMaxGrowthKiB)
        << "relay RSS grew from " << *rss0 << " KiB to " << max_rss << " KiB while the client "
        << "offered " << offered << " bytes to an upstream that reads nothing";
    EXPECT_LE(max_pipes, 2.0) << "one connection holds at most one pipe per direction";
    ASSERT_TRUE(relayed);
    EXPECT_LE(*relayed, static_cast<double>(offered));
    std::printf(
        "[ info     ] %s: client held back after %.1f MiB (relay moved %.1f MiB); relay "
        "RSS +%ld KiB; pipes in use <= %.0f\n",
        mode().c_str(), static_cast<double>(offered) / kMiB, *relayed / kMiB, max_rss - *rss0,
        max_pipes);

    // idle_timeout: no byte moved for 3 s. The relay closes both sockets.
    IoResult end = waitForPeerClose(client.fd.get(), Millis{15'000});
    EXPECT_TRUE(endedByPeer(end)) << "the stuck client must be closed by idle_timeout; got "
                                  << end.describe();
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("idle_timeout"), 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    EXPECT_TRUE(relay_.waitForMetric(metric::kPipesInUse, {}, 0));
    EXPECT_TRUE(
        waitUntil([&] { return relaySocketsTo(relay_.pid(), {up.port()}).empty(); }, Millis{5'000}))
        << "the relay still holds a socket to the upstream after the idle close";

    // The upstream, reading at last, gets an intact prefix of the client's stream and then the
    // relay's FIN, which waited behind those bytes for its window.
    release = true;
    std::optional<ConnRecord> rec = up.waitForRecord(0, Millis{25'000});
    ASSERT_TRUE(rec) << "the upstream did not reach the end of its stream";
    EXPECT_EQ(rec->read_end.status, IoStatus::Eof) << rec->describe();
    EXPECT_LT(first_mismatch.load(), 0) << "the upstream got altered bytes: " << rec->describe();
    EXPECT_GT(rec->bytes_received, 0u) << rec->describe();
    EXPECT_LE(rec->bytes_received, offered) << rec->describe();
    auto counted = relay_.metric(metric::kBytesTotal, metric::bytes("upstream"));
    ASSERT_TRUE(counted);
    // Splice and copy count a byte once it is written to the upstream socket, which delivers
    // it even after the close. Sockmap counts it at the redirect: one still queued for the
    // socket when the connection closed is counted and never sent (~1 KiB here).
    if (mode() == "sockmap") {
        EXPECT_LE(static_cast<double>(rec->bytes_received), *counted)
            << "the upstream got more than the relay counted";
    } else {
        EXPECT_EQ(static_cast<double>(rec->bytes_received), *counted)
            << "every byte counted was written to the upstream socket before the close";
    }
    std::printf(
        "[ info     ] %s: the upstream read %llu bytes after the close; the relay counted "
        "%.0f\n",
        mode().c_str(), static_cast<unsigned long long>(rec->bytes_received), *counted);
}

INSTANTIATE_TEST_SUITE_P(Modes, UpstreamAcceptsAndNeverReads, ::testing::ValuesIn(kModes),
                         modeName);

// =============================================================================================
// A client that vanishes without a FIN: after some bytes, every packet between it and the
// relay is dropped (FlowDropRule), both ways, so neither end learns anything. Then the relay
// alone must end the connection, by idle_timeout or by TCP keepalive on the client socket.

class ClientVanishesWithoutFin : public FaultFixture {
  protected:
    static constexpr uint64_t kGreeting = 64 * kKiB;  // relayed before the client vanishes
    static constexpr Millis kCloseBound{30'000};
    // Probes after 1 s of silence, 1 s apart, 2 unanswered end it: about 3 s.
    static constexpr const char* kFastKeepalive =
        "    tcp_keepalive:\n      idle: 1s\n      interval: 1s\n      count: 2\n";

    // The upstream: sends kGreeting bytes of kSeedB, waits for `go_`, sends `after` more bytes
    // of the same stream (towards the vanished client), then waits for the relay to close its
    // side. ended_at is when it saw that close.
    ConnScript vanishScript(uint64_t after) {
        return [this, after](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                             ScriptedUpstream&) {
            rec.write_end = sendPayload(fd.get(), kSeedB, kGreeting, Millis{10'000}, &stop);
            rec.bytes_sent = rec.write_end.bytes;
            if (!rec.write_end.ok()) return;
            for (int i = 0; i < 3'000 && !go_.load() && !stop.load(); ++i)
                std::this_thread::sleep_for(Millis{10});
            if (!go_.load()) {
                rec.note = "never told to go on";
                return;
            }
            auto deadline = Clock::now() + kCloseBound;
            if (after > 0) {
                rec.write_end =
                    sendPayloadAt(fd.get(), kSeedB, kGreeting, after, kCloseBound, &stop);
                rec.bytes_sent += rec.write_end.bytes;
            }
            auto left =
                std::max(Millis{0}, std::chrono::duration_cast<Millis>(deadline - Clock::now()));
            rec.read_end = waitForPeerClose(fd.get(), left);
            rec.ended_at = Clock::now();
        };
    }

    // Connects, reads the greeting, waits until the relay's socket to the client has every byte
    // acknowledged (so the vanishing starts from an idle connection: nothing to retransmit),
    // then drops the flow and lets the upstream go on. Returns the moment the client vanished.
    // ASSERTs and GTEST_SKIPs inside: call through ASSERT_NO_FATAL_FAILURE and check IsSkipped().
    void connectThenVanish(Connected& client, std::unique_ptr<FlowDropRule>& rule,
                           Clock::time_point& vanished_at) {
        if (::geteuid() != 0) GTEST_SKIP() << "adding an iptables rule needs root";
        auto iptables = findExecutable("iptables");
        if (!iptables) GTEST_SKIP() << "iptables is not installed";

        client = connectClient();
        ASSERT_TRUE(client.fd) << client.error;
        std::vector<uint8_t> buf(kGreeting);
        IoResult r = readExactly(client.fd.get(), buf.data(), buf.size(), Millis{10'000});
        ASSERT_TRUE(r.ok()) << "the greeting: " << r.describe();
        PayloadVerifier v(kSeedB);
        v.update(buf);
        ASSERT_TRUE(v.intact()) << "greeting corrupted at byte " << v.firstMismatch();

        uint16_t client_port = localPort(client.fd.get());
        ASSERT_NE(client_port, 0);
        uint32_t unacked = 0;
        bool idle = waitUntil(
            [&] {
                std::vector<Fd> socks = relaySocketsTo(relay_.pid(), {client_port});
                if (socks.size() != 1) return false;
                tcp_info info{};
                socklen_t len = sizeof info;
                if (::getsockopt(socks[0].get(), IPPROTO_TCP, TCP_INFO, &info, &len) != 0)
                    return false;
                unacked = info.tcpi_unacked;
                return unacked == 0;
            },
            Millis{5'000});
        ASSERT_TRUE(idle) << "the relay's socket to the client still has " << unacked
                          << " unacknowledged segments";

        rule = std::make_unique<FlowDropRule>(*iptables, client_port, relay_.port());
        if (!rule->added())
            GTEST_SKIP() << "could not add the iptables drop rule: " << rule->error();
        vanished_at = Clock::now();
        go_ = true;
    }

    // Nothing the relay sent after the vanishing reached the client: the rule really dropped
    // the flow (a client that merely did not read would find the upstream's bytes queued).
    // Starts the relay (idle_timeout, plus `extra_yaml` for the listener), connects, makes the
    // client vanish, and expects the relay to end the upstream side within kCloseBound, for
    // the reason `what` names. ASSERTs inside: the caller returns when one failed or skipped.
    void vanishAndExpectUpstreamClosed(ScriptedUpstream& up, const std::string& idle_timeout,
                                       const std::string& extra_yaml, const std::string& what,
                                       Connected& client, std::unique_ptr<FlowDropRule>& rule) {
        ASSERT_NO_FATAL_FAILURE(startRelay(up, [&](RelayConfig& c) {
            c.listeners.at(0).idle_timeout = idle_timeout;
            c.listeners.at(0).extra_yaml = extra_yaml;
        }));
        Clock::time_point vanished_at;
        ASSERT_NO_FATAL_FAILURE(connectThenVanish(client, rule, vanished_at));
        if (IsSkipped()) return;
        std::optional<ConnRecord> rec = up.waitForRecord(0, kCloseBound + Millis{5'000});
        ASSERT_TRUE(rec) << "the upstream never finished";
        EXPECT_TRUE(endedByPeer(rec->read_end))
            << what << " must end the connection: " << rec->describe() << "\n"
            << relay_.diagnostics();
        double elapsed = std::chrono::duration<double>(rec->ended_at - vanished_at).count();
        // kCloseBound: the limits under test are seconds; 30 s is room for a loaded machine.
        EXPECT_LT(elapsed, 30.0) << rec->describe();
    }

    static void expectNothingArrived(const Connected& client) {
        uint8_t byte = 0;
        ssize_t r = ::recv(client.fd.get(), &byte, 1, MSG_DONTWAIT);
        int err = errno;
        EXPECT_TRUE(r < 0 && (err == EAGAIN || err == EWOULDBLOCK))
            << "the vanished client should have received nothing more; recv returned " << r
            << (r < 0 ? std::string(" (") + std::strerror(err) + ")" : std::string());
    }

    std::atomic<bool> go_{false};
};

// idle_timeout 1 s, and the upstream sends 1 MiB towards the vanished client: the relay writes
// what fits into the client socket, nothing is acknowledged, no byte moves, idle_timeout fires.
TEST_P(ClientVanishesWithoutFin, IdleTimeoutEndsItWhileUpstreamBytesAreStuck) {
    ScriptedUpstream up(AF_INET, vanishScript(kMiB));
    Connected client;
    std::unique_ptr<FlowDropRule> rule;
    ASSERT_NO_FATAL_FAILURE(
        vanishAndExpectUpstreamClosed(up, "1s", "", "idle_timeout (1s)", client, rule));
    if (IsSkipped()) return;
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("idle_timeout"), 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    EXPECT_TRUE(relay_.waitForMetric(metric::kPipesInUse, {}, 0));
    expectNothingArrived(client);
}
ZCRELAY_LABEL(ClientVanishesWithoutFin, IdleTimeoutEndsItWhileUpstreamBytesAreStuck, "", kSanitizeSkip,
              "5 s of the kernel's keepalive and retransmission timers, ending in closes other cases run");

// idle_timeout 300 s, keepalive on the client socket (idle 1 s, interval 1 s, count 2), and no
// byte in flight: after ~3 s of unanswered probes the kernel fails the client socket with
// ETIMEDOUT. The relay takes that as an error on the client side: client_reset, and the
// upstream is reset.
TEST_P(ClientVanishesWithoutFin, KeepaliveEndsAnIdleConnectionAsClientReset) {
    ScriptedUpstream up(AF_INET, vanishScript(0));
    Connected client;
    std::unique_ptr<FlowDropRule> rule;
    ASSERT_NO_FATAL_FAILURE(vanishAndExpectUpstreamClosed(up, "300s", kFastKeepalive,
                                                          "keepalive (1s + 2 x 1s)", client, rule));
    if (IsSkipped()) return;
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("client_reset"), 1))
        << "the kernel's keepalive timeout is an error on the client socket";
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("idle_timeout")), 0.0);
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    expectNothingArrived(client);
}
ZCRELAY_LABEL(ClientVanishesWithoutFin, KeepaliveEndsAnIdleConnectionAsClientReset, "", kSanitizeSkip,
              "5 s of the kernel's keepalive and retransmission timers, ending in closes other cases run");

// The same keepalive, but the upstream sends 1 MiB after the client vanished: the relay's client
// socket then holds unacknowledged bytes, and the kernel sends no keepalive probe while it
// retransmits (tcp_keepalive_timer waits while packets are out). Retransmission gives up only
// after tcp_retries2 (15: about 15 minutes from loopback's 200 ms RTO), so idle_timeout, here
// 5 s, is what ends the connection.
TEST_P(ClientVanishesWithoutFin, WithBytesInFlightKeepaliveIsSilentAndIdleTimeoutEndsIt) {
    ScriptedUpstream up(AF_INET, vanishScript(kMiB));
    Connected client;
    std::unique_ptr<FlowDropRule> rule;
    ASSERT_NO_FATAL_FAILURE(
        vanishAndExpectUpstreamClosed(up, "5s", kFastKeepalive, "idle_timeout (5s)", client, rule));
    if (IsSkipped()) return;
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("idle_timeout"), 1));
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("client_reset")), 0.0)
        << "keepalive cannot fire while bytes are in flight";
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    expectNothingArrived(client);
}
ZCRELAY_LABEL(ClientVanishesWithoutFin, WithBytesInFlightKeepaliveIsSilentAndIdleTimeoutEndsIt, "", kSanitizeSkip,
              "5 s of the kernel's keepalive and retransmission timers, ending in closes other cases run");

// What bounds that case short of idle_timeout: tcp_keepalive.user_timeout (TCP_USER_TIMEOUT,
// HAProxy's tcp-ut). Bytes unacknowledged for 3 s make the kernel fail the client socket with
// ETIMEDOUT, keepalive off and idle_timeout 300 s: counted as client_reset, like the probes.
TEST_P(ClientVanishesWithoutFin, WithBytesInFlightUserTimeoutEndsItAsClientReset) {
    ScriptedUpstream up(AF_INET, vanishScript(kMiB));
    Connected client;
    std::unique_ptr<FlowDropRule> rule;
    ASSERT_NO_FATAL_FAILURE(vanishAndExpectUpstreamClosed(
        up, "300s", "    tcp_keepalive:\n      user_timeout: 3s\n", "user_timeout (3s)", client,
        rule));
    if (IsSkipped()) return;
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("client_reset"), 1))
        << "the kernel's user timeout is an error on the client socket";
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("idle_timeout")), 0.0);
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    expectNothingArrived(client);
}
ZCRELAY_LABEL(ClientVanishesWithoutFin, WithBytesInFlightUserTimeoutEndsItAsClientReset, "", kSanitizeSkip,
              "5 s of the kernel's keepalive and retransmission timers, ending in closes other cases run");

INSTANTIATE_TEST_SUITE_P(Modes, ClientVanishesWithoutFin, ::testing::ValuesIn(kModes), modeName);

// =============================================================================================
// The upstream's port is reserved but nobody listens (connect: RST), then it listens on the
// same socket: the first client is closed at once and counted as refused, the next one is
// relayed byte-exact.

class UpstreamDownThenUp : public FaultFixture {};

TEST_P(UpstreamDownThenUp, RefusedWhileDownThenRelaysByteExactOnceListening) {
    constexpr uint64_t kBytes = kMiB;
    Bound reserved = bindLoopbackNoListen(AF_INET);
    ASSERT_TRUE(reserved.fd) << reserved.error;
    ASSERT_NO_FATAL_FAILURE(startRelayTo(loopbackHostPort(AF_INET, reserved.port)));

    // Down.
    auto t0 = Clock::now();
    Connected first = connectClient();
    ASSERT_TRUE(first.fd) << "the relay's listener itself must accept: " << first.error;
    IoResult end = waitForPeerClose(first.fd.get(), Millis{5'000});
    double elapsed = secondsSince(t0);
    EXPECT_TRUE(endedByPeer(end)) << "the client must be closed while the upstream refuses; got "
                                  << end.describe();
    // At once: the other way would be connect_timeout (5 s) per attempt; 4 s is room for a
    // loaded 2-core machine.
    EXPECT_LT(elapsed, 4.0) << "a refusal closes the client at once";
    // A cluster of one backend with the default retries: 2: three refusals.
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectFailuresTotal, metric::reason("refused"), 3));
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("connect_failed"), 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    first.fd.reset();

    // Up: the same socket listens and echoes one connection.
    ASSERT_EQ(::listen(reserved.fd.get(), 16), 0) << std::strerror(errno);
    setNonBlocking(reserved.fd.get(), true);  // an accept with nobody there returns EAGAIN
    std::atomic<uint64_t> echoed{0};
    std::atomic<uint64_t> echo_hash{0};
    std::string echo_error;
    // Joined by its destructor on every path; a stop request cancels its reads within ~100 ms.
    std::jthread echo([&](std::stop_token stop) {
        std::atomic<bool> cancel{false};
        std::stop_callback on_stop(stop, [&] { cancel = true; });
        pollfd p{reserved.fd.get(), POLLIN, 0};
        for (int i = 0; i < 200 && !cancel.load() && ::poll(&p, 1, 50) == 0; ++i) {
        }
        Fd conn(::accept4(reserved.fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (!conn) {
            echo_error = std::string("accept: ") + std::strerror(errno);
            return;
        }
        StreamHash hash;
        std::vector<uint8_t> buf(64 * kKiB);
        for (int i = 0; i < 100'000; ++i) {
            IoResult r = readSome(conn.get(), buf.data(), buf.size(), Millis{10'000}, &cancel);
            if (r.status == IoStatus::Eof) break;
            if (!r.ok()) {
                echo_error = "read: " + r.describe();
                return;
            }
            std::span<const uint8_t> got(buf.data(), r.bytes);
            hash.update(got);
            IoResult w = writeAll(conn.get(), got.data(), got.size(), Millis{10'000}, &cancel);
            if (!w.ok()) {
                echo_error = "write: " + w.describe();
                return;
            }
        }
        echoed = hash.bytes();
        echo_hash = hash.value();
        ::shutdown(conn.get(), SHUT_WR);
    });

    Connected second = connectClient();
    ASSERT_TRUE(second.fd) << second.error;
    IoResult sent;
    ReceiveCheck got = echoRoundTrip(second.fd.get(), kSeedA, kBytes, Millis{30'000}, &sent);
    EXPECT_TRUE(sent.ok()) << sent.describe();
    EXPECT_EQ(got.io.status, IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, kBytes) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();
    second.fd.reset();
    echo.join();
    EXPECT_EQ(echo_error, "");
    EXPECT_EQ(echoed.load(), kBytes);
    EXPECT_EQ(echo_hash.load(), payloadHash(kSeedA, kBytes))
        << "the upstream received other bytes than the client sent";

    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"),
                                     static_cast<double>(kBytes)));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("downstream"),
                                     static_cast<double>(kBytes)));
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsTotal, metric::listener(), 2));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    EXPECT_EQ(relay_.metric(metric::kConnectFailuresTotal, metric::reason("refused")), 3.0)
        << "no refusal once the upstream listens";
}

// Refusals come before any data path, and what is relayed once the upstream listens is the
// relay suites' subject in every path: splice only.
INSTANTIATE_TEST_SUITE_P(Modes, UpstreamDownThenUp, ::testing::Values("splice"), modeName);

}  // namespace
}  // namespace zcrelay::test::faults_test
