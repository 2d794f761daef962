// Failover for stateful backends, without Patroni (patroni_test.cpp runs the real cluster): an
// HTTP check on an address of its own (as Patroni's REST API is checked), the check's hostile
// answers, on_marked_down closing a demoted backend's sessions, backups taking over while every
// primary is down and giving the traffic back (closing their sessions with on_marked_up). Every
// data path where sessions are closed. Each backend tags its connections with one byte; its
// check endpoint is a separate loopback server whose answer the case switches; the relay's
// metrics and log lines are the oracle.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "integration/admin_api_fixture.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::failover_test {
namespace {

using admin_api_test::exchange;
using admin_api_test::TaggedBackend;

// What a check endpoint does with the next request.
enum class Answer { Ok, Unavailable, Stall, Garbage, Huge, Reset };

// An HTTP endpoint for health checks: reads a request, answers as told. Records the last
// request, and how many bytes of its 10 MB answer (Huge) it got out before the relay closed.
class CheckEndpoint {
  public:
    static constexpr size_t kHuge = 10 * kMiB;

    CheckEndpoint()
        : up_(AF_INET, [this](Fd& fd, ConnRecord&, const std::atomic<bool>& stop,
                              ScriptedUpstream&) { serve(fd, stop); }) {}
    bool ok() const { return up_.ok(); }
    std::string address() const { return up_.hostPort(); }
    void answer(Answer a) { answer_.store(a); }
    std::string lastRequest() const {
        std::lock_guard lock(mu_);
        return last_request_;
    }
    size_t requests() const { return requests_.load(); }
    uint64_t hugeSent() const { return huge_sent_.load(); }

  private:
    void serve(Fd& fd, const std::atomic<bool>& stop) {
        std::string request;
        char buf[1024];
        while (request.find("\r\n\r\n") == std::string::npos && request.size() < 8192) {
            IoResult r = readSome(fd.get(), buf, sizeof buf, Millis{2'000}, &stop);
            if (!r.ok() || r.bytes == 0) return;
            request.append(buf, r.bytes);
        }
        {
            std::lock_guard lock(mu_);
            last_request_ = request;
        }
        ++requests_;
        auto say = [&](const std::string& text) {
            writeAll(fd.get(), text.data(), text.size(), Millis{2'000}, &stop);
            ::shutdown(fd.get(), SHUT_WR);
        };
        switch (answer_.load()) {
            case Answer::Ok:
                return say("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
            case Answer::Unavailable:
                return say("HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n");
            case Answer::Stall:
                // Never answers: the relay's check timeout ends it (bounded here too).
                for (int i = 0; i < 100 && !stop.load(); ++i)
                    std::this_thread::sleep_for(Millis{50});
                return;
            case Answer::Garbage:
                return say("\x16\x03\x01\x02\x00 not http at all");
            case Answer::Huge: {
                // Status line and headers pass; the body must contain what expect_body names,
                // and 10 MB of 'y' never does. The relay stops reading at 16 KiB and closes.
                std::string head =
                    "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(kHuge) + "\r\n\r\n";
                writeAll(fd.get(), head.data(), head.size(), Millis{2'000}, &stop);
                std::vector<char> chunk(64 * kKiB, 'y');
                uint64_t sent = 0;
                while (sent < kHuge) {
                    IoResult w =
                        writeAll(fd.get(), chunk.data(), chunk.size(), Millis{2'000}, &stop);
                    sent += w.bytes;
                    if (!w.ok()) break;
                }
                huge_sent_.store(sent);
                return;
            }
            case Answer::Reset:
                closeWithReset(fd);
                return;
        }
    }

    std::atomic<Answer> answer_{Answer::Ok};
    mutable std::mutex mu_;
    std::string last_request_;
    std::atomic<size_t> requests_{0};
    std::atomic<uint64_t> huge_sent_{0};
    ScriptedUpstream up_;  // last: its threads use the members above
};

// A backend and the endpoint its checks go to.
struct Node {
    explicit Node(char tag) : backend(tag) {}
    TaggedBackend backend;
    CheckEndpoint check;
    std::string yaml(bool backup = false) const {
        return "      - {address: \"" + backend.address() + "\", check_address: \"" +
               check.address() + "\"" + (backup ? ", backup: true" : "") + "}\n";
    }
};

// interval 100 ms, fall 2: a backend goes down 0.1-0.3 s after its endpoint says so, plus a
// check timeout when the endpoint stalls. The bounds below allow for a loaded 2-core machine.
constexpr const char* kFastChecks =
    "    health_check:\n"
    "      interval: 100ms\n"
    "      timeout: 300ms\n"
    "      rise: 1\n"
    "      fall: 2\n"
    "      http: {method: OPTIONS, path: /primary, expect_status: \"200\", "
    "expect_body: \"\"}\n";

class FailoverTest : public ::testing::TestWithParam<std::string> {
  protected:
    void start(const std::string& cluster_yaml) {
        RelayConfig config;
        config.workers = 2;
        ListenerSpec l;
        l.cluster = "db";
        l.mode = GetParam();
        config.listeners.push_back(l);
        config.extra_yaml = cluster_yaml;
        ASSERT_TRUE(relay_.start(config)) << relay_.diagnostics();
    }
    Labels of(const Node& n) const { return metric::backend("db", n.backend.address()); }
    ::testing::AssertionResult waitUp(const Node& n, double up, Millis timeout = Millis{10'000}) {
        return relay_.waitForMetric(metric::kBackendUp, of(n), up, timeout);
    }
    double serving(const Node& n) {
        return relay_.metric(metricName(Metric::BackendServing), of(n)).value_or(-1);
    }
    // A connection through the relay with one exchange done: the backend's tag, or 0.
    char open(std::vector<Fd>& into) {
        Connected c = connectTo(relay_.host(), relay_.port());
        if (!c.fd) return 0;
        const char tag = servedBy(c.fd);
        if (tag == 0 || !exchange(c.fd.get(), 0x5eed + into.size(), 4 * kKiB)) return 0;
        into.push_back(std::move(c.fd));
        return tag;
    }

    RelayProcess relay_;
};

// Each session ends (EOF or reset) within `within`, counted from now.
::testing::AssertionResult allCut(std::vector<Fd>& fds, Millis within) {
    const auto until = Clock::now() + within;
    for (size_t i = 0; i < fds.size(); ++i) {
        const auto left = std::chrono::duration_cast<Millis>(until - Clock::now());
        IoResult end = waitForPeerClose(fds[i].get(), std::max(left, Millis{1}));
        if (end.status != IoStatus::Eof && end.status != IoStatus::Reset)
            return ::testing::AssertionFailure() << "session " << i << " was not cut within "
                                                 << within.count() << " ms: " << end.describe();
    }
    return ::testing::AssertionSuccess();
}

// The check goes to its own address with the configured request, and the backend follows
// what that endpoint says, not whether its traffic port answers.
TEST_P(FailoverTest, AnHttpCheckOnItsOwnAddressDecidesAndShutdownSessionsCutsTheDemoted) {
    Node a('a'), b('b');
    ASSERT_TRUE(a.check.ok() && b.check.ok());
    b.check.answer(Answer::Unavailable);
    ASSERT_NO_FATAL_FAILURE(
        start("clusters:\n  - name: db\n    on_marked_down: shutdown_sessions\n" +
              std::string(kFastChecks) + "    backends:\n" + a.yaml() + b.yaml()));
    ASSERT_TRUE(waitUp(b, 0));
    ASSERT_TRUE(waitUp(a, 1));
    const std::string request = a.check.lastRequest();
    EXPECT_EQ(request.substr(0, request.find("\r\n")), "OPTIONS /primary HTTP/1.1");
    EXPECT_NE(request.find("\r\nHost: " + a.check.address() + "\r\n"), std::string::npos)
        << request;

    // Every session goes to the primary, a.
    std::vector<Fd> on_a;
    for (int i = 0; i < 4; ++i) ASSERT_EQ(open(on_a), 'a');
    EXPECT_EQ(serving(a), 1.0);
    EXPECT_EQ(serving(b), 0.0);

    // A switchover: a says it is no longer primary, b that it is. a's sessions are cut within
    // fall * interval (+ a check's time), not when their clients give up.
    a.check.answer(Answer::Unavailable);
    b.check.answer(Answer::Ok);
    const auto t0 = Clock::now();
    ASSERT_TRUE(allCut(on_a, Millis{5'000})) << relay_.diagnostics();
    const double cut_after = secondsSince(t0);
    std::printf(
        "on_marked_down: 4 sessions cut %.3f s after the endpoint turned (fall 2 x 100 ms)\n",
        cut_after);
    ASSERT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("backend_down"), 4));
    ASSERT_TRUE(waitUp(b, 1));
    std::vector<Fd> on_b;
    for (int i = 0; i < 3; ++i) EXPECT_EQ(open(on_b), 'b') << "new sessions reach the new primary";
    EXPECT_TRUE(relay_.waitForLog("backend " + a.backend.address() +
                                  " down (2 checks failed, last: status 503, expected 200)"));
    EXPECT_TRUE(
        relay_.waitForLog("closing its live connections (on_marked_down: shutdown_sessions)"));
    // b's sessions were not touched.
    for (Fd& fd : on_b) EXPECT_TRUE(exchange(fd.get(), 0xb0b, 4 * kKiB));
}

// With every primary down the first backup serves; the primary's return takes new sessions
// back, and with on_marked_up: shutdown_backup_sessions the backup's sessions are cut.
TEST_P(FailoverTest, BackupsServeWhilePrimariesAreDownAndGiveTheirSessionsBack) {
    Node p('p'), b1('1'), b2('2');
    ASSERT_NO_FATAL_FAILURE(start(
        "clusters:\n  - name: db\n"
        "    on_marked_up: shutdown_backup_sessions\n" +
        std::string(kFastChecks) + "    backends:\n" + p.yaml() + b1.yaml(true) + b2.yaml(true)));
    ASSERT_TRUE(waitUp(p, 1));
    ASSERT_TRUE(waitUp(b1, 1));
    ASSERT_TRUE(waitUp(b2, 1));
    std::vector<Fd> sessions;
    for (int i = 0; i < 4; ++i)
        ASSERT_EQ(open(sessions), 'p') << "backups wait while the primary is up";
    EXPECT_EQ(relay_.metric(metricName(Metric::BackendTier), of(b1)), 1.0);
    EXPECT_EQ(relay_.metric(metricName(Metric::BackendTier), of(p)), 0.0);

    p.check.answer(Answer::Unavailable);
    ASSERT_TRUE(waitUp(p, 0));
    std::vector<Fd> on_backup;
    for (int i = 0; i < 4; ++i)
        ASSERT_EQ(open(on_backup), '1') << "without all_backups, only the first backup serves";
    EXPECT_EQ(serving(b1), 1.0);
    EXPECT_EQ(serving(b2), 0.0);
    // Ready, on its backups, and /readyz says so under its status.
    EXPECT_EQ(relay_.get("/readyz")->body,
              "ready\ncluster db: every primary is down; backup tier 1 serves\n");
    // The primary's own sessions were left alone (no on_marked_down here).
    for (Fd& fd : sessions) EXPECT_TRUE(exchange(fd.get(), 0x1, 4 * kKiB));

    b1.check.answer(Answer::Unavailable);
    ASSERT_TRUE(waitUp(b1, 0));
    std::vector<Fd> on_second;
    EXPECT_EQ(open(on_second), '2') << "the next backup when the first is down";

    p.check.answer(Answer::Ok);
    const auto t0 = Clock::now();
    ASSERT_TRUE(waitUp(p, 1));
    ASSERT_TRUE(allCut(on_second, Millis{5'000}));
    std::printf(
        "on_marked_up: the backup's session cut %.3f s after the primary's endpoint "
        "recovered\n",
        secondsSince(t0));
    // Every session on a backup: the first's four and the second's.
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("backup_shutdown"), 5));
    ASSERT_TRUE(allCut(on_backup, Millis{5'000}));
    std::vector<Fd> again;
    EXPECT_EQ(open(again), 'p') << "the primary takes new sessions back";
    for (Fd& fd : sessions) EXPECT_TRUE(exchange(fd.get(), 0x2, 4 * kKiB));
}

INSTANTIATE_TEST_SUITE_P(Modes, FailoverTest, ::testing::ValuesIn(kModes), modeName);

// A check endpoint that stalls, answers garbage, answers 10 MB, or resets takes its backend
// down with the reason in the log, costs the relay a bounded read, and the relay serves on
// through the other backend. One data path: the checks run beside the data path, not in it.
TEST(FailoverChecks, HostileCheckEndpointsFailTheirChecksAndCostABoundedRead) {
    Node a('a'), b('b');
    RelayProcess relay;
    RelayConfig config;
    ListenerSpec l;
    l.cluster = "db";
    config.listeners.push_back(l);
    config.extra_yaml = "clusters:\n  - name: db\n" +
                        std::string(
                            "    health_check:\n"
                            "      interval: 100ms\n"
                            "      timeout: 300ms\n"
                            "      rise: 1\n"
                            "      fall: 1\n"
                            "      http: {path: /health, expect_body: \"ok\"}\n") +
                        "    backends:\n" + a.yaml() + b.yaml();
    ASSERT_TRUE(relay.start(config)) << relay.diagnostics();
    const Labels lb = metric::backend("db", b.backend.address());
    struct Hostile {
        Answer answer;
        const char* log;
    };
    // b's endpoint plays each hostile part in turn, answering well in between so that each
    // failure is a transition with its own log line; a's answers well throughout.
    for (const Hostile& h : {Hostile{Answer::Stall, "last: timeout"},
                             Hostile{Answer::Garbage, "last: not an HTTP reply"},
                             Hostile{Answer::Huge, "within the reply's first 16 KiB"},
                             Hostile{Answer::Reset, "last: Connection reset by peer"}}) {
        SCOPED_TRACE(h.log);
        b.check.answer(Answer::Ok);
        ASSERT_TRUE(relay.waitForMetric(metric::kBackendUp, lb, 1));
        b.check.answer(h.answer);
        EXPECT_TRUE(relay.waitForLog(h.log, Millis{10'000})) << relay.stderrText();
        ASSERT_TRUE(relay.waitForMetric(metric::kBackendUp, lb, 0));
        Connected c = connectTo(relay.host(), relay.port());
        ASSERT_TRUE(c.fd) << c.error;
        EXPECT_EQ(servedBy(c.fd), 'a') << "the relay serves on through a";
    }
    // 16 KiB read, then closed: the endpoint's 10 MB did not all go out (the socket buffers
    // take a few MB at most).
    EXPECT_LT(b.check.hugeSent(), CheckEndpoint::kHuge);
    EXPECT_GE(relay
                  .metric(metric::kBackendChecksTotal,
                          [&] {
                              auto l2 = lb;
                              l2["result"] = "failed";
                              return l2;
                          }())
                  .value_or(0),
              4.0);
}

}  // namespace
}  // namespace zcrelay::test::failover_test

namespace zcrelay::test::failover_test {
namespace {

// slow_start: a backend that comes back takes a share of new connections that grows over the
// ramp instead of all its share at once. Round robin over a and b (weight 1 each), one worker,
// slow_start 2 s: b's share of the connections opened in each half second after it came back
// is r/(1+r) with r = t/2 s: ~11 % in the first, ~47 % in the fourth, 50 % after.
TEST(FailoverSlowStart, ABackendThatComesBackRampsItsShareOverSlowStart) {
    Node a('a'), b('b');
    RelayProcess relay;
    RelayConfig config;
    config.workers = 1;
    ListenerSpec l;
    l.cluster = "db";
    config.listeners.push_back(l);
    config.extra_yaml = "clusters:\n  - name: db\n    slow_start: 2s\n" + std::string(kFastChecks) +
                        "    backends:\n" + a.yaml() + b.yaml();
    ASSERT_TRUE(relay.start(config)) << relay.diagnostics();
    const Labels lb = metric::backend("db", b.backend.address());
    ASSERT_TRUE(relay.waitForMetric(metric::kBackendUp, lb, 1));
    b.check.answer(Answer::Unavailable);
    ASSERT_TRUE(relay.waitForMetric(metric::kBackendUp, lb, 0));
    b.check.answer(Answer::Ok);
    ASSERT_TRUE(relay.waitForMetric(metric::kBackendUp, lb, 1, Millis{10'000}));
    const auto up_at = Clock::now();
    const double ramp_early = relay.metric(metricName(Metric::BackendSlowStart), lb).value_or(-1);
    const std::string ready_early = relay.get("/readyz")->body;
    // Short connections, one after another, for 3 s: each window's count per backend.
    constexpr int kWindows = 6;
    std::array<int, kWindows> on_a{}, on_b{};
    for (int i = 0; i < 20'000; ++i) {
        const double t = secondsSince(up_at);
        if (t >= 3.0) break;
        Connected c = connectTo(relay.host(), relay.port());
        ASSERT_TRUE(c.fd) << c.error;
        const char tag = servedBy(c.fd);
        const int w = std::min(kWindows - 1, static_cast<int>(t / 0.5));
        (tag == 'b' ? on_b : on_a)[w]++;
    }
    std::string shares;
    for (int w = 0; w < kWindows; ++w) {
        const int n = on_a[w] + on_b[w];
        shares += " " + std::to_string(n ? 100 * on_b[w] / n : -1) + "%";
        ASSERT_GE(n, 4) << "window " << w << " had too few connections to judge";
    }
    std::printf("slow_start 2s: b's share per 0.5 s window after it came back:%s\n",
                shares.c_str());
    auto share = [&](int w) { return static_cast<double>(on_b[w]) / (on_a[w] + on_b[w]); };
    // The first half second is far below an equal share; the last, past the ramp, is about it.
    EXPECT_LT(share(0), 0.30) << shares;
    EXPECT_GT(share(kWindows - 1), 0.38) << shares;
    EXPECT_LT(share(0), share(3)) << shares;
    // The ramp as the metrics show it: part of the weight just after, all of it past 2 s.
    EXPECT_GE(ramp_early, 0.0);
    EXPECT_LT(ramp_early, 0.7) << "read within a moment of the backend coming up";
    EXPECT_EQ(relay.metric(metricName(Metric::BackendSlowStart), lb), 1.0);
    EXPECT_NE(ready_early.find("ready\ncluster db: backend " + b.backend.address() +
                               " in slow_start, at "),
              std::string::npos)
        << ready_early;
    EXPECT_EQ(relay.get("/readyz")->body, "ready\n") << "past the ramp";
}

}  // namespace
}  // namespace zcrelay::test::failover_test

namespace zcrelay::test::failover_test {
namespace {

// A backend's own count of its open connections, and the most it ever had: one more when its
// script starts on an accepted connection, one less as soon as it reads the relay's FIN (then
// it echoes its own and closes). The relay frees a place only after that FIN went out and the
// backend's came back, so this count can trail the relay's but never lead it. (Sampling the
// kernel's socket table instead counted sockets twice, and mixed moments: /proc/net/tcp is
// read in pieces while connections come and go.)
struct OpenCount {
    std::atomic<int> open{0};
    std::atomic<int> most{0};
};

ConnScript countingEcho(OpenCount& count) {
    return [&count](Fd& fd, ConnRecord&, const std::atomic<bool>& stop, ScriptedUpstream&) {
        const int now = count.open.fetch_add(1) + 1;
        for (int most = count.most.load();
             now > most && !count.most.compare_exchange_weak(most, now);) {
        }
        char buf[4096];
        for (;;) {
            IoResult r = readSome(fd.get(), buf, sizeof buf, Millis{10'000}, &stop);
            if (!r.ok() || r.bytes == 0) break;
            if (!writeAll(fd.get(), buf, r.bytes, Millis{5'000}, &stop).ok()) break;
        }
        count.open.fetch_sub(1);
        ::shutdown(fd.get(), SHUT_WR);
    };
}

struct Visit {
    bool served = false;     // its byte came back through the relay
    double ended_after = 0;  // seconds from connect to the relay's close, when not served
    std::string error;
};

// `n` clients at once: each connects, sends a byte and waits for its echo; served, it holds
// the connection `hold` and closes.
std::vector<Visit> crowd(const RelayProcess& relay, int n, Millis hold) {
    std::vector<Visit> visits(n);
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i)
        threads.emplace_back([&, i] {
            Visit& v = visits[i];
            const auto t0 = Clock::now();
            Connected c = connectTo(relay.host(), relay.port(), Millis{5'000});
            if (!c.fd) {
                v.error = "connect: " + c.error;
                return;
            }
            const char byte = 'q';
            char echo = 0;
            if (!writeAll(c.fd.get(), &byte, 1, Millis{5'000}).ok()) {
                v.error = "send failed";
                return;
            }
            IoResult r = readExactly(c.fd.get(), &echo, 1, Millis{8'000});
            if (!r.ok()) {
                v.ended_after = secondsSince(t0);
                if (!endedByPeer(r)) v.error = "neither served nor closed: " + r.describe();
                return;
            }
            v.served = echo == byte;
            std::this_thread::sleep_for(hold);
        });
    for (auto& t : threads) t.join();
    return visits;
}

// max_connections with a queue: two backends limited to 10 each. 30 clients at once that
// hold 300 ms are all served, the 10 over the limit after a wait in the queue; 200 that hold
// 2 s: 20 served, the rest closed after queue_timeout (1 s), or at once past queue_size (50
// per worker). Neither backend ever has more than 10.
TEST_P(FailoverTest, MaxConnectionsQueuesTheExcessAndRefusesPastTheQueue) {
    OpenCount count_a, count_b;
    ScriptedUpstream a(AF_INET, countingEcho(count_a)), b(AF_INET, countingEcho(count_b));
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_NO_FATAL_FAILURE(
        start("clusters:\n  - name: db\n"
              "    balance: least_conn\n"
              "    queue_timeout: 1s\n"
              "    queue_size: 50\n"
              "    backends:\n"
              "      - {address: \"" +
              a.hostPort() +
              "\", max_connections: 10}\n"
              "      - {address: \"" +
              b.hostPort() + "\", max_connections: 10}\n"));

    const std::vector<Visit> first = crowd(relay_, 30, Millis{300});
    int served = 0;
    for (const Visit& v : first) {
        EXPECT_EQ(v.error, "");
        served += v.served;
    }
    EXPECT_EQ(served, 30) << "30 clients, 20 places freed every 300 ms, a queue of 1 s";
    ASSERT_TRUE(waitUntil([&] { return a.finished() + b.finished() == 30; }, Millis{5'000}));

    const std::vector<Visit> second = crowd(relay_, 200, Millis{2'000});
    const int most[2] = {count_a.most.load(), count_b.most.load()};
    int served2 = 0, timed_out = 0, at_once = 0;
    for (const Visit& v : second) {
        EXPECT_EQ(v.error, "");
        if (v.served)
            ++served2;
        else if (v.ended_after >= 0.9)
            ++timed_out;
        else
            ++at_once;
    }
    std::printf(
        "max_connections 10 x 2, queue 50 per worker, 1 s: 200 clients: %d served, %d "
        "closed after the queue timeout, %d at once; the backends had at most %d and %d\n",
        served2, timed_out, at_once, most[0], most[1]);
    EXPECT_LE(most[0], 10);
    EXPECT_LE(most[1], 10);
    EXPECT_EQ(most[0] + most[1], 20) << "both backends were full";
    EXPECT_EQ(served2, 20);
    ASSERT_TRUE(relay_.waitForMetric(
        metric::kClosedTotal, metric::reason("queue_timeout"),
        [&](double v) { return v == timed_out; }, "== the clients closed after ~1 s"));
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("queue_full")), at_once);
    EXPECT_GE(at_once, 80) << "at most 50 wait on each of the 2 workers";
    EXPECT_EQ(timed_out + at_once, 180);
}

// A client that resets while it waits in the queue leaves it at once (closed as client_reset),
// and never reaches a backend. One backend with max_connections 1 and a 10 s queue: A holds the
// place, B waits and resets, C waits half-closed; when A leaves, C is served. Unwatched, B would sit in the
// queue until A left, then take the place and open a backend connection only to close it (for
// PostgreSQL, a forked backend).
TEST(FailoverQueue, AClientThatResetsWhileQueuedLeavesTheQueueAndNeverReachesTheBackend) {
    OpenCount count;
    ScriptedUpstream up(AF_INET, countingEcho(count));
    ASSERT_TRUE(up.ok()) << up.error();
    RelayProcess relay;
    RelayConfig config;
    config.workers = 1;  // one worker: one queue
    ListenerSpec l;
    l.cluster = "db";
    config.listeners.push_back(l);
    config.extra_yaml =
        "clusters:\n  - name: db\n    queue_timeout: 10s\n    queue_size: 1\n    backends:\n"
        "      - {address: \"" +
        up.hostPort() + "\", max_connections: 1}\n";
    ASSERT_TRUE(relay.start(config)) << relay.diagnostics();
    // One byte each way: served (echoed), or not yet.
    auto send = [](Connected& c, char byte) {
        return writeAll(c.fd.get(), &byte, 1, Millis{2'000}).ok();
    };
    auto echoed = [](Connected& c, char byte, Millis wait) {
        char got = 0;
        return readExactly(c.fd.get(), &got, 1, wait).ok() && got == byte;
    };
    Connected a = connectTo(relay.host(), relay.port());
    ASSERT_TRUE(a.fd && send(a, 'a') && echoed(a, 'a', Millis{5'000})) << "A is served";
    Connected b = connectTo(relay.host(), relay.port());
    ASSERT_TRUE(b.fd && send(b, 'b'));
    // Accepted is queued: the backend's one place is A's.
    ASSERT_TRUE(relay.waitForMetric(metric::kConnectionsTotal, metric::listener(), 2));
    EXPECT_FALSE(echoed(b, 'b', Millis{200})) << "B waits in the queue";
    closeWithReset(b.fd);
    EXPECT_TRUE(
        relay.waitForMetric(metric::kClosedTotal, metric::reason("client_reset"), 1, Millis{5'000}))
        << "B left the queue while A still held the place";
    // The queue (of 1) has room again: C waits in it, half-closed after its byte (a FIN is no
    // abort: it waits for its answer), and is served once A leaves.
    Connected c = connectTo(relay.host(), relay.port());
    ASSERT_TRUE(c.fd && send(c, 'c'));
    ASSERT_EQ(::shutdown(c.fd.get(), SHUT_WR), 0);
    ASSERT_TRUE(relay.waitForMetric(metric::kConnectionsTotal, metric::listener(), 3));
    a.fd.reset();
    EXPECT_TRUE(echoed(c, 'c', Millis{5'000})) << "C is served after A\n"
                                               << relay.scrape().value_or("");
    EXPECT_EQ(up.accepted(), 2u) << "the backend saw A and C, never B";
    EXPECT_EQ(relay.metric(metric::kClosedTotal, metric::reason("queue_full")).value_or(0), 0);
}

}  // namespace
}  // namespace zcrelay::test::failover_test
