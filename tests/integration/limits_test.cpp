// The relay at its limits: out of pipes, out of file descriptors. It must keep every byte of
// the connections it has, move them by copy when it cannot splice, and stop accepting (not
// accept-and-drop, not spin) when it cannot take another connection.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::limits_test {
namespace {

// utime + stime of `pid`, in seconds (/proc/PID/stat fields 14 and 15).
double cpuSeconds(pid_t pid) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::istringstream rest(text.substr(text.rfind(')') + 2));  // after "pid (comm) "
    std::string field;
    unsigned long utime = 0, stime = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i) {
        if (i == 14) utime = std::stoul(field);
        if (i == 15) stime = std::stoul(field);
    }
    return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Every test here relays to an echo upstream through a splice listener (or the data path
// mode_ names); the limits differ.
class LimitsFixture : public ::testing::Test {
protected:
    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void startRelay(int workers, const std::string& extra_yaml = "",
                    std::optional<rlim_t> nofile = std::nullopt) {
        ASSERT_TRUE(up_.ok()) << up_.error();
        RelayConfig config = singleListenerConfig(up_.hostPort(), mode_);
        config.workers = workers;
        config.extra_yaml = extra_yaml;
        if (nofile) relay_.setNofileLimit(*nofile);
        ASSERT_TRUE(relay_.start(config));
    }

    std::string mode_ = "splice";
    ScriptedUpstream up_{AF_INET, echoScript()};
    RelayProcess relay_;
};

class PipeLimits : public LimitsFixture {};
class FdLimits : public LimitsFixture {};
// The fd-limit cases that run in every data path.
class FdLimitsByMode : public LimitsFixture, public ::testing::WithParamInterface<std::string> {
  protected:
    FdLimitsByMode() { mode_ = GetParam(); }
};

// `steps` echoes of 64 KiB, each written then read back whole, continuing payload `seed` from
// byte `offset`: a live transfer that can be paused and resumed. Returns the bytes echoed
// byte-exact before the first failure (and describes it in `error`).
uint64_t echoSteps(int fd, uint64_t seed, uint64_t offset, int steps, std::string& error) {
    constexpr size_t kStep = 64 * 1024;
    std::vector<uint8_t> out(kStep), back(kStep);
    uint64_t done = 0;
    for (int i = 0; i < steps; ++i) {
        fillPayload(seed, offset + done, out);
        IoResult w = writeAll(fd, out.data(), out.size(), Millis{10'000});
        IoResult r = w.ok() ? readExactly(fd, back.data(), back.size(), Millis{10'000}) : w;
        if (!r.ok() || back != out) {
            error = "step " + std::to_string(i) + " at byte " + std::to_string(offset + done) +
                    ": " + (r.ok() ? std::string("echo differs") : r.describe());
            return done;
        }
        done += kStep;
    }
    return done;
}

// Four clients echo 8 MiB each at once through a splice listener whose process may hold one
// pipe: most directions cannot get one and must move their bytes by copy, every byte intact.
TEST_F(PipeLimits, ExhaustedPipePoolFallsBackToCopyByteExact) {
    constexpr int kClients = 4;
    constexpr uint64_t kBytes = 8 * kMiB;
    ASSERT_NO_FATAL_FAILURE(startRelay(1, "max_pipes: 1\n"));

    std::vector<std::thread> clients;
    std::vector<ReceiveCheck> results(kClients);
    std::vector<IoResult> sends(kClients);
    std::vector<std::string> connect_errors(kClients);
    for (int i = 0; i < kClients; ++i) {
        clients.emplace_back([&, i] {
            Connected c = connectTo(relay_.host(), relay_.port());
            if (!c.fd) {
                connect_errors[i] = c.error;
                return;
            }
            results[i] = echoRoundTrip(c.fd.get(), 1000 + i, kBytes, kDefaultIoTimeout, &sends[i]);
        });
    }
    for (auto& t : clients) t.join();
    for (int i = 0; i < kClients; ++i) {
        EXPECT_EQ(connect_errors[i], "") << "client " << i << " could not connect";
        EXPECT_TRUE(sends[i].ok()) << "client " << i << " send: " << sends[i].describe();
        EXPECT_EQ(results[i].bytes, kBytes) << "client " << i << ": " << results[i].describe();
        EXPECT_LT(results[i].first_mismatch, 0) << "client " << i << ": " << results[i].describe();
    }
    EXPECT_TRUE(relay_.waitForMetric(
        metric::kPipeFallbacksTotal, {{"reason", "pool_exhausted"}},
        [](double v) { return v >= 1; }, ">= 1"))
        << "with max_pipes 1 and 8 busy directions, some must have fallen back to copy";
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"),
                                    static_cast<double>(kClients * kBytes)));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("downstream"),
                                    static_cast<double>(kClients * kBytes)));
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), kClients));
    EXPECT_TRUE(relay_.waitForMetric(metric::kPipesInUse, {}, 0));
}

// max_pipes: 0 is "never splice": a splice listener then runs entirely on the copy path.
TEST_F(PipeLimits, MaxPipesZeroRelaysEverythingByCopy) {
    ASSERT_NO_FATAL_FAILURE(startRelay(2, "max_pipes: 0\n"));
    Connected c = connectTo(relay_.host(), relay_.port());
    ASSERT_TRUE(c.fd) << c.error;
    ReceiveCheck got = echoRoundTrip(c.fd.get(), 7, 4 * kMiB);
    EXPECT_EQ(got.bytes, 4 * kMiB) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();
    EXPECT_TRUE(relay_.waitForMetric(metric::kPipeFallbacksTotal, {{"reason", "pool_exhausted"}}, 2))
        << "both directions of the one connection fell back";
    auto cached = relay_.metric(metric::kPipesCached);
    EXPECT_EQ(cached.value_or(-1), 0) << "no pipe was ever made";
}

// With the fd limit lowered, the relay's fd budget admits only a few connections. It must
// pause accepting (connections wait in the kernel's queue) instead of running into EMFILE,
// keep serving what it has without burning CPU, and accept the rest as connections close.
TEST_F(FdLimits, AcceptPausesAtTheFdBudgetServesLiveConnectionsAndResumes) {
    constexpr int kClients = 40;
    // (160 - 64 reserved - 64 for the metrics endpoint's connections) / 2 = 16 connections
    // admitted at once
    ASSERT_NO_FATAL_FAILURE(startRelay(1, "", 160));

    std::vector<Connected> clients;
    for (int i = 0; i < kClients; ++i) {
        clients.push_back(connectTo(relay_.host(), relay_.port()));
        ASSERT_TRUE(clients.back().fd) << "client " << i << ": " << clients.back().error
                                       << " (the kernel's accept queue should take it)";
    }
    ASSERT_TRUE(relay_.waitForMetric(
        metric::kAcceptPausedTotal, {}, [](double v) { return v >= 1; },
        ">= 1 (the relay ran out of fds)"));
    auto accepted = relay_.metric(metric::kConnectionsTotal, metric::listener());
    ASSERT_TRUE(accepted);
    EXPECT_LT(*accepted, kClients) << "160 fds cannot hold 40 relayed connections";

    // Paused, not spinning: a retry loop on EMFILE would burn a whole CPU.
    double cpu0 = cpuSeconds(relay_.pid());
    // The sleep is the measurement window: load can only lower the relay's CPU time in it.
    std::this_thread::sleep_for(Millis{1'000});
    double cpu = cpuSeconds(relay_.pid()) - cpu0;
    EXPECT_LT(cpu, 0.3) << "relay used " << cpu << " s of CPU in 1 s while paused";

    // A connection the relay already holds still relays, byte-exact, with no fd to spare for
    // a pipe (it moves by copy if it must).
    ReceiveCheck first = echoRoundTrip(clients[0].fd.get(), 42, 2 * kMiB);
    EXPECT_EQ(first.bytes, 2 * kMiB) << first.describe();
    EXPECT_LT(first.first_mismatch, 0) << first.describe();
    clients[0].fd.reset();

    // Freeing connections lets the waiting ones in; in the end every client was served.
    for (int i = 1; i < kClients; ++i) {
        ReceiveCheck got = echoRoundTrip(clients[i].fd.get(), 100 + i, 64 * 1024, Millis{20'000});
        EXPECT_EQ(got.bytes, 64u * 1024) << "client " << i << ": " << got.describe();
        EXPECT_LT(got.first_mismatch, 0) << "client " << i << ": " << got.describe();
        clients[i].fd.reset();
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsTotal, metric::listener(), kClients));
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), kClients))
        << "no accepted connection may be dropped for lack of an upstream fd";
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
}

// EMFILE despite the budget: the fd limit is lowered under the running relay (prlimit), so
// accept() and socket() fail before the budget says stop. Accepting must pause without
// spinning, a client accepted without an fd for its upstream must get one later (spare fd or
// waiting), a transfer that was live before keeps going byte-exact (a splice direction that
// cannot get a pipe moves by copy), and every client must be served once others close.
TEST_P(FdLimitsByMode, EmfileUnderARunningRelayPausesAndLosesNoClient) {
    constexpr int kClients = 40;
    constexpr uint64_t kLiveSeed = 0x11FE;
    ASSERT_NO_FATAL_FAILURE(startRelay(1));
    EXPECT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath(mode_)), 1.0)
        << "listener t should run the " << mode_ << " data path";
    // The live transfer: 1 MiB echoed before the limit, 4 MiB more while the relay has no fd.
    Connected live = connectTo(relay_.host(), relay_.port());
    ASSERT_TRUE(live.fd) << live.error;
    std::string live_error;
    uint64_t live_bytes = echoSteps(live.fd.get(), kLiveSeed, 0, 16, live_error);
    ASSERT_EQ(live_bytes, kMiB) << live_error;
    ASSERT_TRUE(waitUntil([&] { return up_.accepted() == 1; }, Millis{5'000}));
    auto base = relay_.openFdCount();
    ASSERT_TRUE(base);
    // Room for ~15 connections' sockets past what the relay holds now; the budget computed at
    // start-up (from 20,000) no longer protects it.
    rlimit low{static_cast<rlim_t>(*base + 30), static_cast<rlim_t>(*base + 30)};
    ASSERT_EQ(::prlimit(relay_.pid(), RLIMIT_NOFILE, &low, nullptr), 0) << std::strerror(errno);

    std::vector<Connected> clients;
    for (int i = 0; i < kClients; ++i) {
        clients.push_back(connectTo(relay_.host(), relay_.port()));
        ASSERT_TRUE(clients.back().fd) << "client " << i << ": " << clients.back().error;
    }
    // No scrape while the relay is out of fds: the metrics server cannot accept either (that is
    // what the budget's reserve is for). Watch the upstream side instead.
    ASSERT_TRUE(waitUntil([&] { return up_.accepted() >= 6; }, Millis{10'000}))
        << "the relay forwarded only " << up_.accepted() << " connections";
    double cpu0 = cpuSeconds(relay_.pid());
    // The sleep is the measurement window: load can only lower the relay's CPU time in it.
    std::this_thread::sleep_for(Millis{1'000});
    double cpu = cpuSeconds(relay_.pid()) - cpu0;
    EXPECT_LT(cpu, 0.3) << "relay used " << cpu << " s of CPU in 1 s while out of fds";
    EXPECT_LT(up_.accepted(), static_cast<size_t>(kClients))
        << "30 spare fds cannot hold " << kClients << " relayed connections";

    // Out of fds, the live transfer goes on, byte-exact.
    uint64_t more = echoSteps(live.fd.get(), kLiveSeed, live_bytes, 64, live_error);
    EXPECT_EQ(more, 4 * kMiB) << "the live transfer broke while the relay was out of fds: "
                              << live_error;
    live_bytes += more;
    ::shutdown(live.fd.get(), SHUT_WR);
    std::string rest;
    IoResult live_end = readUntilEof(live.fd.get(), rest, Millis{10'000});
    EXPECT_EQ(live_end.status, IoStatus::Eof) << live_end.describe();
    EXPECT_TRUE(rest.empty()) << rest.size() << " bytes more than were sent";
    live.fd.reset();

    for (int i = 0; i < kClients; ++i) {
        ReceiveCheck got = echoRoundTrip(clients[i].fd.get(), 900 + i, 64 * 1024, Millis{20'000});
        EXPECT_EQ(got.bytes, 64u * 1024) << "client " << i << ": " << got.describe();
        EXPECT_LT(got.first_mismatch, 0) << "client " << i << ": " << got.describe();
        clients[i].fd.reset();
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), kClients + 1))
        << "every client served, and the live transfer; none closed for want of an fd";
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("error")).value_or(-1), 0);
    EXPECT_GE(relay_.metric(metric::kAcceptPausedTotal).value_or(0), 1)
        << "accept or socket() hit EMFILE";
    // Each echo's bytes both ways: the live transfer's 5 MiB and 64 KiB per client.
    const double total = static_cast<double>(live_bytes + kClients * 64 * 1024);
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"), total));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("downstream"), total));
}

INSTANTIATE_TEST_SUITE_P(Modes, FdLimitsByMode, ::testing::ValuesIn(kModes), modeName);

}  // namespace
}  // namespace zcrelay::test::limits_test
