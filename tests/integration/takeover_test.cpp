// Takeover through the real binary: a new relay takes the running one's listening sockets over
// (`--takeover` on the config's takeover_socket, or SIGUSR2), starts on them, and only then does
// the old one stop accepting and drain; or, under systemd's socket activation, a restart finds
// the socket systemd holds. Each upgrade goes from binary A to binary B, which reports another
// --version. The oracle is the client's and the kernel's: under a continuous connection load,
// long byte-checked transfers and idle connections, no connection is refused or reset, and this case's own network namespace counts no listen drop, overflow or
// RST (/proc/net/netstat and /proc/net/snmp are per namespace: nothing else runs in it).
//
// Accept queues: connections queued on the old relay's sockets at the moment of the hand-over
// are accepted by the new one; the same set-up with a plain restart (SIGTERM, then a start on
// sockets of its own) resets them, so the case can fail.
//
// Failure paths: a new relay that fails to start after it was handed the sockets (the old one
// serves on), a second taker while one is under way (refused), a taker of a protocol version the
// old one does not speak and an old one of a version the new one does not speak (the new one
// binds its own, loudly), a takeover while the old one drains (nothing to take: it binds its
// own), and the old one killed -9 between the hand-over and the new one's READY (the new one
// serves on the sockets it has).
#include "takeover.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "clock.hpp"
#include "listener.hpp"
#include "support/labels.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "support/short_connection_load.hpp"
#include "support/tcp_counters.hpp"
#include "takeover_wire.hpp"
#include "unix_path.hpp"

namespace zcrelay::test::takeover_test {
namespace {

constexpr Millis kIo{10'000};
const std::string kTakeoversTotal = metricName(Metric::Takeovers);

// ---- what the cases share --------------------------------------------------------------------

// One short exchange: 8 bytes through the relay to the echo and back. "" or what failed.
std::string exchange(const std::string& host, uint16_t port) {
    return echoExchange(host, port, Millis{2'000}, kIo);
}

// Connections opened one after another, as fast as two threads can, each an exchange.
// A failure says when its connection started, in ms from the moment markTrigger() was called
// (before it: negative), so that a failure can be placed against the hand-over.
class ExchangeLoad : public ShortConnectionLoad {
    using Moment = std::shared_ptr<std::atomic<Clock::rep>>;

  public:
    ExchangeLoad(std::string host, uint16_t port)
        : ExchangeLoad(std::move(host), port, std::make_shared<std::atomic<Clock::rep>>(0)) {}
    void markTrigger() { *trigger_ = Clock::now().time_since_epoch().count(); }

  private:
    // The base starts its threads in its constructor: the moment they read is made first.
    ExchangeLoad(std::string host, uint16_t port, Moment trigger)
        : ShortConnectionLoad(
              [host = std::move(host), port, trigger](int, int, const std::atomic<bool>&) {
                  ShortVisit v;
                  v.started = Clock::now();
                  v.error = exchange(host, port);
                  if (!v.error.empty()) {
                      const auto since = v.started - Clock::time_point(Clock::duration(*trigger));
                      v.error += " (started at " +
                                 std::to_string(std::chrono::duration_cast<Millis>(since).count()) +
                                 " ms from the trigger)";
                  }
                  return v;
              },
              2, 20'000),
          trigger_(std::move(trigger)) {}

    Moment trigger_;
};

// A stream that lasts across the upgrade: 64 KiB pieces echoed back and checked, 20 ms apart.
class PacedStream {
  public:
    PacedStream(const std::string& host, uint16_t port, uint64_t seed, int pieces)
        : thread_([this, host, port, seed, pieces] { run(host, port, seed, pieces); }) {}
    ~PacedStream() {
        stop_ = true;
        if (thread_.joinable()) thread_.join();
    }
    std::string join() {
        if (thread_.joinable()) thread_.join();
        return error_;
    }
    int piecesDone() const { return done_.load(); }

  private:
    static constexpr uint64_t kPiece = 64 * 1024;
    void run(const std::string& host, uint16_t port, uint64_t seed, int pieces) {
        Connected c = connectTo(host, port, Millis{5'000});
        if (!c.fd) {
            error_ = "connect: " + c.error;
            return;
        }
        PayloadVerifier check(seed);
        std::vector<uint8_t> buf(kPiece);
        for (int i = 0; i < pieces && !stop_; ++i) {
            IoResult w = sendPayloadAt(c.fd.get(), seed, i * kPiece, kPiece, kIo);
            if (!w.ok()) {
                error_ = "piece " + std::to_string(i) + ": send: " + w.describe();
                return;
            }
            IoResult r = readExactly(c.fd.get(), buf.data(), buf.size(), kIo);
            if (!r.ok()) {
                error_ = "piece " + std::to_string(i) + ": echo: " + r.describe();
                return;
            }
            check.update(buf);
            if (!check.intact()) {
                error_ = "bytes differ at " + std::to_string(check.firstMismatch());
                return;
            }
            ++done_;
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        error_ = endStream(c.fd.get(), kIo);
    }

    std::atomic<bool> stop_{false};
    std::atomic<int> done_{0};
    std::string error_;
    std::thread thread_;
};

RelayConfig takeoverConfig(const std::string& upstream, const std::string& mode,
                           const std::string& socket_path) {
    RelayConfig config = singleListenerConfig(upstream, mode);
    config.drain_timeout = "120s";
    config.extra_yaml = "takeover_socket: " + socket_path + "\n";
    return config;
}

// The pid a SIGUSR2 parent logged for its new process, or 0.
pid_t successorPid(const std::string& log) {
    const std::string marker = "to take the listening sockets over";
    const size_t at = log.rfind(marker);
    if (at == std::string::npos) return 0;
    const size_t pid_at = log.rfind(" as pid ", at);
    return pid_at == std::string::npos ? 0 : std::atoi(log.c_str() + pid_at + 8);
}

// A SIGUSR2 child outlives its parent; as the subreaper of this case's processes, the test
// reaps it once stopped. Only the pid its own relay named is signalled.
void stopSuccessor(pid_t pid) {
    if (pid <= 0) return;
    ::kill(pid, SIGTERM);
    for (int i = 0; i < 300; ++i) {
        int status = 0;
        if (::waitpid(pid, &status, WNOHANG) == pid) return;
        if (::kill(pid, 0) != 0) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    ADD_FAILURE() << "the SIGUSR2 child " << pid << " did not drain within 15 s";
}

// This test as a taker speaking `versions`: what the relay at `path` answers its HELLO, or
// what went wrong ("nobody at the path: ...").
tl::expected<takeover::Message, std::string> answerToHello(const std::string& path,
                                                           const char* versions) {
    auto channel = takeover::connectTo(path);
    if (!channel) return tl::unexpected("nobody at the path: " + channel.error().why);
    takeover::Message hello("HELLO");
    hello.set("versions", versions).set("pid", "1").set("release", "test");
    if (auto sent = takeover::send(channel->get(), hello, monotonicMs() + 5000); !sent)
        return tl::unexpected(sent.error());
    return takeover::receive(channel->get(), monotonicMs() + 5000);
}

// This test as a giver of its own (a future version, one that dies): the taker that connects
// to `listening` within 10 s, once its HELLO has come; none if none did.
Fd takerSaidHello(int listening) {
    for (int i = 0; i < 500; ++i) {
        Fd peer(::accept4(listening, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!peer) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            continue;
        }
        if (takeover::receive(peer.get(), monotonicMs() + 5000)) return peer;
        return Fd();
    }
    return Fd();
}

class TakeoverTest : public ::testing::Test {
  protected:
    void SetUp() override {
        // Orphans of this case's relays (a SIGUSR2 child whose parent exited) come here.
        ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
        ASSERT_TRUE(up_.ok()) << up_.error();
        socket_ = scratch_.file("takeover.sock");
    }

    ScriptedUpstream up_{AF_INET, echoScript()};
    TempDir scratch_;
    std::string socket_;
};

// =============================================================================================
// An upgrade under load, every data path, from binary A to binary B (zcrelay-next: the same code
// reporting another --version), by each trigger: --takeover, SIGUSR2, and a restart on a
// listening socket the test holds as systemd holds a .socket unit's.

enum class Trigger { Flag, Sigusr2, HeldRestart };
struct UpgradeCase {
    std::string mode;
    Trigger trigger;
};
std::string upgradeName(const ::testing::TestParamInfo<UpgradeCase>& info) {
    switch (info.param.trigger) {
        case Trigger::Flag:
            return info.param.mode + "_takeover";
        case Trigger::Sigusr2:
            return info.param.mode + "_sigusr2";
        case Trigger::HeldRestart:
            return info.param.mode + "_restart";
    }
    return info.param.mode;
}

// Binary A (a copy of the relay under test) and binary B (a copy of its next release), at paths
// of the case's own: SIGUSR2 runs the file now at the path A was started from, so a case renames
// B over it, as a package upgrade does.
struct Releases {
    std::string a, b;
    std::string a_version, b_version;  // what each says to --version
};

::testing::AssertionResult copyReleases(const TempDir& scratch, Releases* out) {
    out->a = scratch.file("zcrelay");
    out->b = scratch.file("zcrelay.next");
    for (const auto& [from, to, version] :
         {std::tuple{std::string(kRelayBinary), out->a, &out->a_version},
          std::tuple{nextRelayBinary(), out->b, &out->b_version}}) {
        CommandResult cp = runCommand({"/bin/cp", from, to});
        if (!cp.status.cleanExit()) return ::testing::AssertionFailure() << cp.describe();
        CommandResult said = runCommand({to, "--version"});
        constexpr std::string_view kPrefix = "zcrelay ";
        if (!said.status.cleanExit() || said.out.rfind(kPrefix, 0) != 0)
            return ::testing::AssertionFailure() << to << " --version: " << said.describe();
        *version = said.out.substr(kPrefix.size(), said.out.find('\n') - kPrefix.size());
    }
    if (out->a_version == out->b_version)
        return ::testing::AssertionFailure() << "both binaries say " << out->a_version;
    return ::testing::AssertionSuccess();
}

// `binary ARGS...` in place of the relay under test (bash execs it in place: the same pid). With
// a `held` listening socket, as systemd starts a service of a .socket unit: the socket as fd 3,
// LISTEN_FDS=1 and LISTEN_PID the relay's own pid.
std::vector<std::string> launchAs(const std::string& binary, int held = -1) {
    std::string script = "exec " + binary + " \"${@:2}\"";
    if (held >= 0) {
        const std::string n = std::to_string(held);
        script = (held == 3 ? "" : "exec 3<&" + n + " " + n + "<&-; ") +
                 "LISTEN_FDS=1 LISTEN_PID=$$ " + script;
    }
    return {"/bin/bash", "-c", script, "sh"};
}

class UpgradeUnderLoad : public TakeoverTest, public ::testing::WithParamInterface<UpgradeCase> {};

TEST_P(UpgradeUnderLoad, RefusesAndResetsNothing) {
    const UpgradeCase& param = GetParam();
    const bool restart = param.trigger == Trigger::HeldRestart;
    const int kIdle = kSanitized ? 200 : 1000;
    const int kStreams = kSanitized ? 20 : 100;
    // A restart drains the old relay before the next one starts (systemd stops, then starts):
    // shorter streams, so that what arrives meanwhile waits in the queue a second or two.
    const int kPieces = restart ? 60 : 150;
    Releases bins;
    ASSERT_TRUE(copyReleases(scratch_, &bins));
    const std::string kBuildInfo = metricName(Metric::BuildInfo);

    RelayConfig config = takeoverConfig(up_.hostPort(), param.mode, socket_);
    Listening held;
    if (restart) {
        held = listenLoopback(AF_INET, 1024);
        ASSERT_TRUE(held.fd) << held.error;
        config.listeners[0].listen = "127.0.0.1:" + std::to_string(held.port);
        // Inherited by the relays this case starts (and closed with the case).
        ASSERT_EQ(::fcntl(held.fd.get(), F_SETFD, 0), 0);
    }
    RelayProcess old;
    old.setLaunchPrefix(launchAs(bins.a, restart ? held.fd.get() : -1));
    ASSERT_TRUE(old.start(config));
    EXPECT_EQ(old.metric(kBuildInfo, {{"version", bins.a_version}}), 1.0);
    const std::string host = old.host();
    const uint16_t port = old.port();

    std::vector<Fd> idle;
    for (int i = 0; i < kIdle; ++i) {
        Connected c = connectTo(host, port);
        ASSERT_TRUE(c.fd) << "idle " << i << ": " << c.error;
        idle.push_back(std::move(c.fd));
    }
    // Each idle connection: an exchange. How many failed, and the first failure.
    auto useIdle = [&] {
        int failed = 0;
        std::string first;
        for (Fd& fd : idle) {
            IoResult r = echoBack(fd.get(), "ping", kIo);
            if (!r.ok() && failed++ == 0) first = r.describe();
        }
        return failed == 0 ? std::string()
                           : std::to_string(failed) + " failed, the first: " + first;
    };
    std::vector<std::unique_ptr<PacedStream>> streams;
    for (int i = 0; i < kStreams; ++i)
        streams.push_back(std::make_unique<PacedStream>(host, port, 0x7A0 + i, kPieces));
    ExchangeLoad load(host, port);
    ASSERT_TRUE(load.waitForTotal(200, Millis{30'000})) << load.describeFailures();
    ASSERT_TRUE(waitUntil(
        [&] {
            for (const auto& s : streams)
                if (s->piecesDone() < 5) return false;
            return true;
        },
        Millis{30'000}))
        << "the streams did not get going";
    const auto counters = tcpCounters();
    const size_t before = load.total();

    RelayProcess next;
    pid_t child = 0;
    load.markTrigger();
    switch (param.trigger) {
        case Trigger::Flag:
            next.setLaunchPrefix(launchAs(bins.b));
            ASSERT_TRUE(next.startWithArgs({"-c", old.configPath(), "--takeover"}));
            EXPECT_EQ(next.metric(kTakeoversTotal, {{"result", "taken_over"}}), 1.0);
            break;
        case Trigger::Sigusr2:
            ASSERT_EQ(::rename(bins.b.c_str(), bins.a.c_str()), 0);  // the package upgrade
            ASSERT_TRUE(old.sendSignal(SIGUSR2));
            ASSERT_TRUE(
                waitUntil([&] { return successorPid(old.stderrText()) > 0; }, Millis{10'000}))
                << old.stderrText();
            child = successorPid(old.stderrText());
            // The metrics port is the new process's once it took over.
            EXPECT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "taken_over"}}, 1.0))
                << old.stderrText();
            break;
        case Trigger::HeldRestart:
            // `systemctl restart`: SIGTERM, and the old relay drains. It closes its copy of the
            // socket without shutdown(), so what arrives meanwhile waits in the queue; its own
            // connections work on until they end (the idle ones are used, then closed here).
            // Only once it has exited does the next relay start, on the same socket.
            ASSERT_TRUE(old.sendSignal(SIGTERM));
            EXPECT_TRUE(old.waitForLog("no longer accepting"));
            EXPECT_EQ(useIdle(), "") << "the idle connections, while the old relay drains";
            idle.clear();
            for (auto& s : streams) EXPECT_EQ(s->join(), "");
            if (std::optional<ExitStatus> gone = old.waitExit(Millis{30'000}); gone) {
                EXPECT_TRUE(gone->cleanExit()) << gone->describe();
            } else {
                FAIL() << "the old relay still drains: " << old.stderrText();
            }
            next.setLaunchPrefix(launchAs(bins.b, held.fd.get()));
            ASSERT_TRUE(next.start(config));
            break;
    }
    // After a takeover the metrics port is the new relay's, whichever way it was started.
    const RelayProcess& serving = restart ? next : old;
    if (!restart) {
        EXPECT_TRUE(old.waitForLog("no longer accepting, draining"));
    }
    // The load goes on: within a second the new relay has served some of it.
    const size_t at_ready = load.total();
    EXPECT_TRUE(serving.waitForMetric(
        metric::kConnectionsTotal, metric::listener(), [](double v) { return v > 0; },
        "the new relay served the load", Millis{1'000}));
    EXPECT_TRUE(serving.waitForMetric(kBuildInfo, {{"version", bins.b_version}}, 1.0))
        << "the new relay is binary B";
    EXPECT_TRUE(load.waitForTotal(at_ready + 100, Millis{10'000}));
    load.stop();
    for (auto& s : streams) EXPECT_EQ(s->join(), "");
    EXPECT_TRUE(load.failures().empty())
        << load.describeFailures() << "\nthe old relay's log:\n"
        << old.stderrText().substr(old.stderrText().size() > 6000 ? old.stderrText().size() - 6000
                                                                  : 0)
        << "\nthe new relay's log:\n"
        << (param.trigger == Trigger::Sigusr2 ? std::string("(in the old one's)")
                                              : next.stderrText());
    // The old relay served until the new one was ready (a restart's stop serves nothing new).
    if (!restart) {
        EXPECT_GT(at_ready, before);
    }

    // The idle connections work on, handed over to the new relay on every path.
    if (!restart) {
        EXPECT_EQ(useIdle(), "");
    }
    EXPECT_EQ(refusalsSince(counters), "") << "the kernel refused or reset connections";
    idle.clear();
    if (!restart) {
        // With its last connection gone, the old relay's drain ends and it exits 0.
        std::optional<ExitStatus> gone = old.waitExit(Millis{30'000});
        ASSERT_TRUE(gone) << "the old relay still runs: " << old.stderrText();
        EXPECT_TRUE(gone->cleanExit()) << gone->describe();
        const std::string log = old.stderrText();
        EXPECT_NE(log.find("handed over 2 listening sockets"), std::string::npos) << log;
        // The old relay names the release that took over.
        EXPECT_NE(log.find("(zcrelay " + bins.b_version + ")"), std::string::npos) << log;
    }
    // The new relay serves on.
    EXPECT_EQ(exchange(host, port), "");
    if (param.trigger == Trigger::Sigusr2) {
        stopSuccessor(child);
    } else {
        EXPECT_TRUE(next.metric(metric::kConnectionsTotal, metric::listener()).value_or(0) > 0);
        ExitStatus stopped = next.terminate();
        EXPECT_TRUE(stopped.cleanExit()) << stopped.describe();
    }
}

ZCRELAY_LABEL(UpgradeUnderLoad, RefusesAndResetsNothing, "", kCpuBound,
              "1000 idle connections, 100 streams and a connection load through two relays");

INSTANTIATE_TEST_SUITE_P(
    Paths, UpgradeUnderLoad,
    ::testing::Values(
        UpgradeCase{"splice", Trigger::Flag}, UpgradeCase{"copy", Trigger::Flag},
        UpgradeCase{"sockmap", Trigger::Flag}, UpgradeCase{"auto", Trigger::Flag},
        UpgradeCase{"splice", Trigger::Sigusr2}, UpgradeCase{"copy", Trigger::Sigusr2},
        UpgradeCase{"sockmap", Trigger::Sigusr2}, UpgradeCase{"auto", Trigger::Sigusr2},
        UpgradeCase{"splice", Trigger::HeldRestart}, UpgradeCase{"copy", Trigger::HeldRestart},
        UpgradeCase{"sockmap", Trigger::HeldRestart}, UpgradeCase{"auto", Trigger::HeldRestart}),
    upgradeName);

// =============================================================================================
// Accept queues: 200 connections queued at the hand-over.

class AcceptQueue : public TakeoverTest {
  protected:
    // The old relay runs with 200 open files: its fd budget (RLIMIT_NOFILE less what it keeps
    // in reserve) admits a few dozen connections, and past them it arms no accept, so the rest
    // of 200 clients wait in its sockets' accept queues: connected, as the kernel completes the
    // handshake, not yet accepted. Returns all 200.
    std::vector<Fd> queueBehindTheFdBudget(RelayProcess& old) {
        old.setNofileLimit(200);
        EXPECT_TRUE(old.start(takeoverConfig(up_.hostPort(), "splice", socket_)));
        std::vector<Fd> queued;
        for (int i = 0; i < 200; ++i) {
            Connected c = connectTo(old.host(), old.port());
            EXPECT_TRUE(c.fd) << "queued " << i << ": " << c.error;
            if (c.fd) queued.push_back(std::move(c.fd));
        }
        EXPECT_TRUE(old.waitForMetric(
            metric::kConnectionsActive, metric::listener(), [](double v) { return v > 0; },
            "some accepted"));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        accepted_by_old_ = old.metric(metric::kConnectionsActive, metric::listener()).value_or(0);
        EXPECT_LE(accepted_by_old_, 50.0) << "the old relay should hold few, the kernel the rest";
        return queued;
    }

    double accepted_by_old_ = 0;

    // Each queued connection: an exchange. How many failed, and the first failure.
    static std::pair<int, std::string> exchangeEach(std::vector<Fd>& queued) {
        int failed = 0;
        std::string first;
        for (Fd& fd : queued) {
            IoResult r = echoBack(fd.get(), "que", kIo);
            if (!r.ok() && failed++ == 0) first = r.describe();
        }
        return {failed, first};
    }
};

TEST_F(AcceptQueue, ConnectionsQueuedAtTheHandOverAreAcceptedByTheNewRelay) {
    RelayProcess old;
    std::vector<Fd> queued = queueBehindTheFdBudget(old);
    ASSERT_EQ(queued.size(), 200u);
    if (HasFatalFailure()) return;
    const auto counters = tcpCounters();
    // The new relay has the usual fd budget: it accepts the whole queue.
    RelayProcess next;
    ASSERT_TRUE(next.startWithArgs({"-c", old.configPath(), "--takeover"}));
    auto [failed, first] = exchangeEach(queued);
    EXPECT_EQ(failed, 0) << "the first: " << first;
    EXPECT_EQ(refusalsSince(counters), "");
    // Every queued client was served (above), and the new relay accepted most of them from the
    // very queues. Not an exact count: as it stops, the old relay may accept some itself (its
    // sweep, Acceptor::sweep), and serves the clients that waited in it for an fd, which it
    // keeps (not relaying yet); the split varies with timing, the sum does not.
    const double taken =
        next.metric(metricName(Metric::HandoverConnections), {{"result", "taken"}}).value_or(0);
    EXPECT_TRUE(next.waitForMetric(
        metric::kConnectionsTotal, metric::listener(), [](double v) { return v >= 100; },
        "most of the queue accepted", kIo))
        << "taken over: " << taken;
    EXPECT_EQ(up_.accepted(), 200u) << "every client reached the upstream";
    queued.clear();
    std::optional<ExitStatus> gone = old.waitExit(Millis{30'000});
    ASSERT_TRUE(gone);
    EXPECT_TRUE(gone->cleanExit()) << gone->describe();
}

// The same queue under a plain restart: the old relay's listening sockets leave their group at
// SIGTERM, and the kernel resets what waits in them. What the takeover is for.
TEST_F(AcceptQueue, APlainRestartResetsThem) {
    RelayProcess old;
    std::vector<Fd> queued = queueBehindTheFdBudget(old);
    ASSERT_EQ(queued.size(), 200u);
    if (HasFatalFailure()) return;
    ASSERT_TRUE(old.sendSignal(SIGTERM));
    ASSERT_TRUE(old.waitForMetric(metricName(Metric::Draining), {}, 1.0));
    RelayProcess next;
    ASSERT_TRUE(next.start(takeoverConfig(up_.hostPort(), "splice", scratch_.file("next.sock"))));
    auto [failed, first] = exchangeEach(queued);
    EXPECT_EQ(failed, 200 - static_cast<int>(accepted_by_old_))
        << "what waited in the old relay's queues should be reset; first failure: " << first;
    queued.clear();
    EXPECT_TRUE(old.waitExit(Millis{30'000}));
}

// =============================================================================================
// Failure paths.

// The new relay is handed the sockets, then fails to start (a listener of its config cannot
// bind): it says ABORT, exits 1, and the old one serves on with nothing closed.
TEST_F(TakeoverTest, ANewRelayThatFailsToStartLeavesTheOldOneServing) {
    RelayProcess old;
    ASSERT_TRUE(old.start(takeoverConfig(up_.hostPort(), "splice", socket_)));
    Listening taken = listenLoopback(AF_INET, 16);  // no SO_REUSEPORT: a bind beside it fails
    ASSERT_TRUE(taken.fd) << taken.error;
    RelayConfig broken = takeoverConfig(up_.hostPort(), "splice", socket_);
    broken.listeners.push_back(broken.listeners[0]);
    broken.listeners[1].name = "taken";
    broken.listeners[1].listen = "127.0.0.1:" + std::to_string(taken.port);
    const std::string path = scratch_.writeFile("broken.yaml", broken.yaml());
    ExchangeLoad load(old.host(), old.port());
    ASSERT_TRUE(load.waitForTotal(50, Millis{30'000}));
    CommandResult next = runCommand({kRelayBinary, "-c", path, "--takeover"}, Millis{30'000});
    EXPECT_EQ(next.status.code, 1) << next.describe();
    EXPECT_NE(next.err.find("listener taken"), std::string::npos) << next.describe();
    EXPECT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "failed"}}, 1.0));
    const size_t after = load.total();
    EXPECT_TRUE(load.waitForTotal(after + 50, Millis{10'000}));
    load.stop();
    EXPECT_TRUE(load.failures().empty()) << load.describeFailures();
    EXPECT_NE(old.stderrText().find("this relay serves on"), std::string::npos);
    // And a good takeover still works afterwards.
    RelayProcess good;
    ASSERT_TRUE(good.startWithArgs({"-c", old.configPath(), "--takeover"}));
    EXPECT_TRUE(old.waitExit(Millis{30'000}));
    EXPECT_EQ(exchange(good.host(), good.port()), "");
}

// This test plays a first taker that was handed the sockets and is not ready yet: a second
// taker meanwhile is refused (busy) and does not start. When the first one goes away without
// READY, the old relay serves on.
TEST_F(TakeoverTest, ASecondTakerIsRefusedWhileOneIsUnderWay) {
    RelayProcess old;
    ASSERT_TRUE(old.start(takeoverConfig(up_.hostPort(), "splice", socket_)));
    auto channel = takeover::connectTo(socket_);
    ASSERT_TRUE(channel) << channel.error().why;
    auto first = takeover::take(std::move(*channel));
    ASSERT_TRUE(first) << first.error().why;
    EXPECT_GE(first->sockets.size(), 3u) << "2 listener sockets, metrics, the takeover socket";

    CommandResult second =
        runCommand({kRelayBinary, "-c", old.configPath(), "--takeover"}, Millis{30'000});
    EXPECT_EQ(second.status.code, 1) << second.describe();
    EXPECT_NE(second.err.find("is under way (busy)"), std::string::npos) << second.describe();
    EXPECT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "refused"}}, 1.0));

    takeover::sayAborted(*first, "this test's taker gives up");
    EXPECT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "failed"}}, 1.0));
    EXPECT_NE(old.stderrText().find("this test's taker gives up"), std::string::npos);
    EXPECT_EQ(exchange(old.host(), old.port()), "");
    EXPECT_TRUE(old.running());
}

// Versions: a taker that speaks only version 3 is refused by this one (versions 1 and 2), which
// serves on; a giver that offers version 3 makes this one bind its own sockets, loudly, and
// count it.
TEST_F(TakeoverTest, AVersionMismatchIsSaidAndFallsBackToBinding) {
    RelayProcess old;
    ASSERT_TRUE(old.start(takeoverConfig(up_.hostPort(), "splice", socket_)));
    {
        auto answer = answerToHello(socket_, "3");
        ASSERT_TRUE(answer) << answer.error();
        EXPECT_EQ(answer->verb, "REFUSE");
        EXPECT_EQ(answer->get("code"), "version");
        EXPECT_EQ(answer->get("versions"), "1,2");
    }
    EXPECT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "refused"}}, 1.0));
    EXPECT_EQ(exchange(old.host(), old.port()), "");
    old.terminate();

    // A giver of version 3 at the socket path: the new relay binds its own.
    const std::string future = scratch_.file("future.sock");
    auto listening = listenUnix(future, SOCK_SEQPACKET, 0600, false);
    ASSERT_TRUE(listening) << listening.error();
    std::thread giver([&] {
        Fd peer = takerSaidHello(listening->get());
        if (!peer) return;
        const int fd = peer.get();
        takeover::Message offer("OFFER");
        offer.set("version", "3").set("pid", "1").set("release", "future").set("sockets", "0");
        (void)takeover::send(fd, offer, monotonicMs() + 5000);
    });
    RelayProcess next;
    const bool started = next.startWithArgs(
        {"-c",
         scratch_.writeFile("future.yaml", takeoverConfig(up_.hostPort(), "splice", future).yaml()),
         "--takeover"});
    giver.join();
    ASSERT_TRUE(started);
    EXPECT_NE(next.stderrText().find("offered protocol version 3, this binary speaks 1,2"),
              std::string::npos)
        << next.stderrText();
    EXPECT_NE(next.stderrText().find("BINDING LISTENERS OF ITS OWN"), std::string::npos);
    EXPECT_EQ(next.metric(kTakeoversTotal, {{"result", "fallback"}}), 1.0);
    EXPECT_EQ(exchange(next.host(), next.port()), "");
}

// The old relay drains (SIGTERM, a live connection keeps it): it has nothing left to give, and
// the new relay starts on sockets of its own, serving at once.
TEST_F(TakeoverTest, ATakeoverWhileTheOldRelayDrainsBindsItsOwn) {
    RelayConfig config = takeoverConfig(up_.hostPort(), "splice", socket_);
    RelayProcess old;
    ASSERT_TRUE(old.start(config));
    Connected live = connectTo(old.host(), old.port());
    ASSERT_TRUE(live.fd) << live.error;
    ASSERT_TRUE(old.waitForMetric(metric::kConnectionsActive, metric::listener(), 1.0));
    ASSERT_TRUE(old.sendSignal(SIGTERM));
    ASSERT_TRUE(old.waitForMetric(metricName(Metric::Draining), {}, 1.0));
    RelayProcess next;
    ASSERT_TRUE(next.startWithArgs({"-c", old.configPath(), "--takeover"}));
    EXPECT_NE(next.stderrText().find("draining: its listening sockets are closed"),
              std::string::npos)
        << next.stderrText();
    EXPECT_EQ(exchange(next.host(), next.port()), "");
    live.fd.reset();
    EXPECT_TRUE(old.waitExit(Millis{30'000}));
}

// The old relay dies (kill -9) in the middle of the hand-over: played by this test, which hands
// over one of its two listening sockets and goes away before END. The new relay starts on the
// socket it got and binds the rest: the connections queued on the socket it got are served, not
// reset, though their old owner is gone.
TEST_F(TakeoverTest, AGiverThatDiesInTheMiddleLeavesTheNewRelayServing) {
    auto first = openListener(parseAddress("127.0.0.1:0").value());
    ASSERT_TRUE(first) << first.error().message();
    const SocketAddress bound = boundAddress(first->get()).value();
    auto second = openListener(bound);  // the group's second socket, as a second worker's
    ASSERT_TRUE(second) << second.error().message();
    // Queued before any relay runs: the handshakes are the kernel's.
    std::vector<Fd> queued;
    for (int i = 0; i < 20; ++i) {
        Connected c = connectTo("127.0.0.1", bound.port());
        ASSERT_TRUE(c.fd) << c.error;
        queued.push_back(std::move(c.fd));
    }
    const std::string dying = scratch_.file("dying.sock");
    auto listening = listenUnix(dying, SOCK_SEQPACKET, 0600, false);
    ASSERT_TRUE(listening) << listening.error();
    RelayConfig config = takeoverConfig(up_.hostPort(), "splice", dying);
    config.listeners[0].listen = bound.toString();
    std::thread giver([&] {
        Fd peer = takerSaidHello(listening->get());
        if (!peer) return;
        const int fd = peer.get();
        takeover::Message offer("OFFER");
        offer.set("version", "1").set("pid", "1").set("release", "dying").set("sockets", "2");
        (void)takeover::send(fd, offer, monotonicMs() + 5000);
        takeover::Message socket("SOCKET");
        socket.set("kind", "listener").set("name", "t").set("listen", bound.toString());
        socket.set("bound", bound.toString());
        const int listening_fd = first->get();
        (void)takeover::send(fd, socket, monotonicMs() + 5000, {&listening_fd, 1});
        // Gone here, as a process killed -9 is: its end of the channel and its sockets close.
    });
    RelayProcess next;
    const bool started =
        next.startWithArgs({"-c", scratch_.writeFile("next.yaml", config.yaml()), "--takeover"});
    giver.join();
    ASSERT_TRUE(started);
    EXPECT_NE(next.stderrText().find("broke off"), std::string::npos) << next.stderrText();
    first->reset();
    second->reset();  // the dead giver's: what was queued on it alone is lost with it
    int served = 0;
    for (Fd& fd : queued) {
        const char out[2] = {'o', 'k'};
        char in[2] = {};
        if (!writeAll(fd.get(), out, 2, kIo).ok()) continue;
        if (readExactly(fd.get(), in, 2, Millis{3'000}).ok()) ++served;
    }
    // The kernel hashed each connection to one of the two sockets; those of the one handed
    // over are served.
    EXPECT_GT(served, 0) << "none of the queue on the handed-over socket was served";
    EXPECT_EQ(exchange("127.0.0.1", bound.port()), "");
    EXPECT_EQ(next.metric(kTakeoversTotal, {{"result", "fallback"}}), 1.0);
}

// A taker of another user is refused before anything is passed (the socket file is 0600 as
// well: this checks the relay's own test, with a peer that got past the mode).
TEST_F(TakeoverTest, OnlyTheRelaysUserMayTakeOver) {
    RelayProcess old;
    ASSERT_TRUE(old.start(takeoverConfig(up_.hostPort(), "splice", socket_)));
    struct stat st {};
    ASSERT_EQ(::stat(socket_.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    ASSERT_EQ(::chmod(socket_.c_str(), 0666), 0);
    // Readable by nobody: the config, and the way to it and to the socket.
    ASSERT_EQ(::chmod(scratch_.path().c_str(), 0755), 0);
    const std::string config = scratch_.writeFile("nobody.yaml", readFileText(old.configPath()));
    ASSERT_EQ(::chmod(config.c_str(), 0644), 0);
    CommandResult nobody = runCommand({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534",
                                       "--clear-groups", kRelayBinary, "-c", config, "--takeover"},
                                      Millis{30'000});
    EXPECT_EQ(nobody.status.code, 1) << nobody.describe();
    EXPECT_NE(nobody.err.find("not the relay's user"), std::string::npos) << nobody.describe();
    EXPECT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "refused"}}, 1.0));
    EXPECT_EQ(exchange(old.host(), old.port()), "");
}

// sd_notify: the relay tells a service manager (here this test, on the datagram socket it names
// in NOTIFY_SOCKET) READY=1 once it listens, RELOADING=1 then READY=1 around a SIGHUP, and after
// a SIGUSR2 upgrade the new process's MAINPID= with READY=1, so that systemd (Type=notify,
// NotifyAccess=all) follows the new process when the old one exits.
TEST_F(TakeoverTest, TheServiceManagerIsToldReadyReloadingAndTheNewMainPid) {
    const std::string path = scratch_.file("notify.sock");
    UniqueFd manager(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_un sun{};
    sun.sun_family = AF_UNIX;
    std::memcpy(sun.sun_path, path.c_str(), path.size());
    ASSERT_EQ(::bind(manager.get(), reinterpret_cast<sockaddr*>(&sun), sizeof sun), 0);
    auto next = [&]() -> std::string {
        pollfd p{manager.get(), POLLIN, 0};
        if (::poll(&p, 1, 10'000) != 1) return "(nothing within 10 s)";
        char buf[512];
        const ssize_t n = ::recv(manager.get(), buf, sizeof buf, 0);
        return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "(recv failed)";
    };
    RelayProcess old;
    old.setLaunchPrefix({"/usr/bin/env", "NOTIFY_SOCKET=" + path});
    ASSERT_TRUE(old.start(takeoverConfig(up_.hostPort(), "splice", socket_)));
    EXPECT_EQ(next(), "READY=1");
    ASSERT_TRUE(old.reload(readFileText(old.configPath())));
    EXPECT_EQ(next(), "RELOADING=1");
    EXPECT_EQ(next(), "READY=1");
    ASSERT_TRUE(old.sendSignal(SIGUSR2));
    const std::string upgraded = next();
    ASSERT_TRUE(waitUntil([&] { return successorPid(old.stderrText()) > 0; }, Millis{10'000}));
    const pid_t child = successorPid(old.stderrText());
    EXPECT_EQ(upgraded, "MAINPID=" + std::to_string(child) + "\nREADY=1");
    // The old relay drains without a word: STOPPING=1 would tell systemd the service stops.
    EXPECT_TRUE(old.waitExit(Millis{30'000}));
    pollfd p{manager.get(), POLLIN, 0};
    EXPECT_EQ(::poll(&p, 1, 200), 0) << "the old relay said: " << next();
    stopSuccessor(child);
}

// A relay that started as root and dropped to `user: nobody` executes its binary as nobody on
// SIGUSR2: in splice mode the child needs nothing it lacks (the sockets are passed) and takes
// over; in sockmap mode it cannot load the BPF program without its capabilities, so it refuses
// to start, saying why, and the old relay serves on.
class PrivilegedTakeover : public TakeoverTest,
                           public ::testing::WithParamInterface<std::string> {};

TEST_P(PrivilegedTakeover, ANobodyRelayUpgradesWhatItCan) {
    if (::getpwnam("nobody") == nullptr) GTEST_SKIP() << "this system has no user nobody";
    RelayProcess old;
    // Readable by nobody: the config, which the child re-reads as nobody.
    ASSERT_EQ(::chmod(old.dir().c_str(), 0755), 0);
    RelayConfig config = takeoverConfig(up_.hostPort(), GetParam(), socket_);
    config.extra_yaml += "user: nobody\n";
    ASSERT_TRUE(old.start(config));
    ASSERT_TRUE(old.sendSignal(SIGUSR2));
    if (GetParam() == "splice") {
        EXPECT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "taken_over"}}, 1.0))
            << old.stderrText();
        EXPECT_TRUE(old.waitExit(Millis{30'000}));
        EXPECT_EQ(exchange(old.host(), old.port()), "");
        stopSuccessor(successorPid(old.stderrText()));
        return;
    }
    EXPECT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "failed"}}, 1.0))
        << old.stderrText();
    EXPECT_NE(old.stderrText().find("a takeover keeps every listener's mode"), std::string::npos)
        << old.stderrText();
    EXPECT_TRUE(old.waitForLog("exited with status 1"));
    EXPECT_EQ(old.metric(metric::kDatapathInfo, metric::datapath("sockmap")), 1.0);
    EXPECT_EQ(exchange(old.host(), old.port()), "");
    EXPECT_TRUE(old.running());
}

ZCRELAY_LABEL(PrivilegedTakeover, ANobodyRelayUpgradesWhatItCan, "", kHostPipePages,
              "runs as nobody, whose pipe pages (fs.pipe-user-pages-*) are host-wide");

INSTANTIATE_TEST_SUITE_P(Modes, PrivilegedTakeover, ::testing::Values("splice", "sockmap"),
                         [](const auto& info) { return info.param; });

// SIGUSR2 runs the binary on disk now, not the one the process was started from: a package
// upgrade replaces the file (a new inode renamed over the path), and the relay's new process
// must be the new file. The test starts the relay from a copy, renames a second copy over it,
// and compares the new process's /proc/PID/exe with the file now at the path.
TEST_F(TakeoverTest, Sigusr2RunsTheBinaryNowOnDisk) {
    Releases bins;
    ASSERT_TRUE(copyReleases(scratch_, &bins));
    const std::string& bin = bins.a;
    const std::string& upgrade = bins.b;
    RelayProcess old;
    old.setLaunchPrefix(launchAs(bin));
    ASSERT_TRUE(old.start(takeoverConfig(up_.hostPort(), "splice", socket_)));
    struct stat first {};
    ASSERT_EQ(::stat(bin.c_str(), &first), 0);
    ASSERT_EQ(::rename(upgrade.c_str(), bin.c_str()), 0);
    struct stat now {};
    ASSERT_EQ(::stat(bin.c_str(), &now), 0);
    ASSERT_NE(now.st_ino, first.st_ino);
    ASSERT_TRUE(old.sendSignal(SIGUSR2));
    ASSERT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "taken_over"}}, 1.0))
        << old.stderrText();
    const pid_t child = successorPid(old.stderrText());
    ASSERT_GT(child, 0);
    struct stat exe {};
    ASSERT_EQ(::stat(("/proc/" + std::to_string(child) + "/exe").c_str(), &exe), 0);
    EXPECT_EQ(exe.st_ino, now.st_ino) << "the new process runs the file now at " << bin;
    EXPECT_TRUE(old.waitExit(Millis{30'000}));
    EXPECT_EQ(exchange(old.host(), old.port()), "");
    stopSuccessor(child);
}

// SIGUSR2 with a config file that no longer loads: the new process says why and exits 1 before
// it asks for a socket, and the old relay counts the takeover failed and serves on. Then the
// same with a new process that dies after it was handed the sockets (this test's taker closes
// its channel without a word, as a crash would).
TEST_F(TakeoverTest, ANewProcessThatDiesOrCannotLoadItsConfigChangesNothing) {
    RelayProcess old;
    ASSERT_TRUE(old.start(takeoverConfig(up_.hostPort(), "splice", socket_)));
    const std::string good = readFileText(old.configPath());
    std::ofstream(old.configPath(), std::ios::trunc) << "listeners: [\n";
    ASSERT_TRUE(old.sendSignal(SIGUSR2));
    EXPECT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "failed"}}, 1.0));
    EXPECT_TRUE(old.waitForLog("exited with status 1"));
    EXPECT_NE(old.stderrText().find("zcrelay.yaml"), std::string::npos)
        << "the child's error names the file";
    EXPECT_EQ(exchange(old.host(), old.port()), "");
    std::ofstream(old.configPath(), std::ios::trunc) << good;

    auto channel = takeover::connectTo(socket_);
    ASSERT_TRUE(channel) << channel.error().why;
    auto taken = takeover::take(std::move(*channel));
    ASSERT_TRUE(taken) << taken.error().why;
    taken->channel.reset();  // gone without READY or ABORT
    EXPECT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "failed"}}, 2.0));
    EXPECT_NE(old.stderrText().find("it exited before it was ready"), std::string::npos);
    EXPECT_EQ(exchange(old.host(), old.port()), "");
    // And an upgrade still works afterwards.
    ASSERT_TRUE(old.sendSignal(SIGUSR2));
    EXPECT_TRUE(old.waitExit(Millis{30'000})) << old.stderrText();
    EXPECT_EQ(exchange(old.host(), old.port()), "");
    stopSuccessor(successorPid(old.stderrText()));
}

// While a taker holds the sockets and is not ready yet, the old relay is told to stop (SIGTERM)
// and a SIGUSR2 asks for a second new process. The drain must not shut the sockets down (the
// taker is about to listen on them), and the SIGUSR2 child is refused (busy) and exits: it must
// not bind sockets beside the two. This test plays the first taker.
TEST_F(TakeoverTest, ADrainOrASecondUpgradeDuringATakeoverLeavesTheTakersSockets) {
    RelayProcess old;
    ASSERT_TRUE(old.start(takeoverConfig(up_.hostPort(), "splice", socket_)));
    const uint16_t port = old.port();
    auto channel = takeover::connectTo(socket_);
    ASSERT_TRUE(channel) << channel.error().why;
    auto taken = takeover::take(std::move(*channel));
    ASSERT_TRUE(taken) << taken.error().why;

    ASSERT_TRUE(old.sendSignal(SIGUSR2));
    EXPECT_TRUE(old.waitForMetric(kTakeoversTotal, {{"result", "refused"}}, 1.0))
        << old.stderrText();
    EXPECT_TRUE(old.waitForLog("exited with status 1"));
    EXPECT_EQ(loopbackListeners4(port), 2) << "the SIGUSR2 child bound sockets of its own";

    ASSERT_TRUE(old.sendSignal(SIGTERM));
    ASSERT_TRUE(old.waitForLog("draining 0 connections"));
    // Still listening: a connection is queued on the taker's sockets, not refused.
    for (const takeover::HandedSocket& s : taken->sockets) {
        if (s.kind != "listener") continue;
        int listening = -1;
        socklen_t len = sizeof listening;
        ASSERT_EQ(::getsockopt(s.fd.get(), SOL_SOCKET, SO_ACCEPTCONN, &listening, &len), 0);
        EXPECT_EQ(listening, 1) << "the drain shut a socket the taker holds down";
    }
    Connected queued = connectTo("127.0.0.1", port);
    EXPECT_TRUE(queued.fd) << queued.error;
    takeover::sayAborted(*taken, "this test's taker gives up");
    // The relay serves on and may accept it as its drain begins: it drains until the client
    // leaves (an ASan run waited out the 30 s below with it open).
    queued.fd.reset();
    EXPECT_TRUE(old.waitExit(Millis{30'000})) << old.stderrText();
}

// A giver that goes away after its OFFER, before any socket: the new relay cannot tell a dead
// giver from a slow one, so it does not start (two relays would serve beside each other); the
// next start finds nothing at the path and binds its own.
TEST_F(TakeoverTest, AGiverThatDiesBeforeAnySocketCameStopsTheStart) {
    const std::string dying = scratch_.file("dying.sock");
    auto listening = listenUnix(dying, SOCK_SEQPACKET, 0600, false);
    ASSERT_TRUE(listening) << listening.error();
    const std::string config =
        scratch_.writeFile("next.yaml", takeoverConfig(up_.hostPort(), "splice", dying).yaml());
    std::thread giver([&] {
        Fd peer = takerSaidHello(listening->get());
        if (!peer) return;
        takeover::Message offer("OFFER");
        offer.set("version", "1").set("pid", "1").set("release", "dying").set("sockets", "2");
        (void)takeover::send(peer.get(), offer, monotonicMs() + 5000);
    });
    CommandResult first = runCommand({kRelayBinary, "-c", config, "--takeover"}, Millis{30'000});
    giver.join();
    EXPECT_EQ(first.status.code, 1) << first.describe();
    EXPECT_NE(first.err.find("broke off before any socket came"), std::string::npos)
        << first.describe();
    listening->reset();  // the giver's socket gone with it: the path now answers nobody
    RelayProcess next;
    ASSERT_TRUE(next.startWithArgs({"-c", config, "--takeover"}));
    EXPECT_EQ(next.metric(kTakeoversTotal, {{"result", "fallback"}}), 1.0);
    EXPECT_EQ(exchange(next.host(), next.port()), "");
}

// A new relay that takes nothing over (the old one drains) and then fails to start leaves the
// takeover socket's path to the old relay: its own socket is published there only once it runs.
TEST_F(TakeoverTest, ANewRelayThatFailsToStartLeavesThePathToTheOldOne) {
    RelayProcess old;
    ASSERT_TRUE(old.start(takeoverConfig(up_.hostPort(), "splice", socket_)));
    Connected live = connectTo(old.host(), old.port());
    ASSERT_TRUE(live.fd) << live.error;
    ASSERT_TRUE(old.waitForMetric(metric::kConnectionsActive, metric::listener(), 1.0));
    ASSERT_TRUE(old.sendSignal(SIGTERM));
    ASSERT_TRUE(old.waitForMetric(metricName(Metric::Draining), {}, 1.0));

    Listening taken = listenLoopback(AF_INET, 16);  // no SO_REUSEPORT: a bind beside it fails
    ASSERT_TRUE(taken.fd) << taken.error;
    RelayConfig broken = takeoverConfig(up_.hostPort(), "splice", socket_);
    broken.listeners[0].listen = "127.0.0.1:" + std::to_string(taken.port);
    CommandResult next = runCommand(
        {kRelayBinary, "-c", scratch_.writeFile("broken.yaml", broken.yaml()), "--takeover"},
        Millis{30'000});
    EXPECT_EQ(next.status.code, 1) << next.describe();

    auto answer = answerToHello(socket_, "1");
    ASSERT_TRUE(answer) << answer.error();
    EXPECT_EQ(answer->verb, "REFUSE");
    EXPECT_EQ(answer->get("code"), "draining");
    EXPECT_EQ(answer->get("pid"), std::to_string(old.pid())) << "the path is the old relay's";
    live.fd.reset();
    EXPECT_TRUE(old.waitExit(Millis{30'000}));
}

}  // namespace
}  // namespace zcrelay::test::takeover_test
