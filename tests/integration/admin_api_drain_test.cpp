// drain and maint through the runtime API, under a continuous client load: from the moment
// the change is answered no new connection reaches the backend, a connection opened before
// keeps relaying byte-exact until its client ends it, and `ready` brings the backend back.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "integration/admin_api_fixture.hpp"
#include "support/short_connection_load.hpp"

namespace zcrelay::test::admin_api_test {
namespace {

// Clients opening short connections continuously (connect, read the tag, close), on two
// threads, each started connection recorded with the moment it started. Bounded: at most
// kMaxPerThread connections and 60 s per thread, about 200 a second per thread.
class ClientLoad : public ShortConnectionLoad {
  public:
    static constexpr int kThreads = 2;

    ClientLoad(std::string host, uint16_t port)
        : ShortConnectionLoad(
              [host = std::move(host), port](int, int, const std::atomic<bool>& stop) {
                  ShortVisit v;
                  v.started = Clock::now();
                  Connected c = connectTo(host, port, Millis{2'000});
                  if (c.fd) {
                      IoResult r = readExactly(c.fd.get(), &v.tag, 1, Millis{2'000}, &stop);
                      if (!r.ok()) v.tag = 0;
                  }
                  return v;
              },
              kThreads, kMaxPerThread) {}

  private:
    static constexpr int kMaxPerThread = 12000;
};

// =============================================================================================
// 2 and 3. drain and maint under load, and with health checks
// (maint): from the moment the change is answered no new connection reaches A, A's connection
// opened before keeps relaying byte-exact until its client ends it, and `ready` brings A back.

class AdminLoadTest : public AdminApiTest {
  protected:
    void drainUnderLoad(const std::string& state, const std::string& mode, bool checks) {
        TaggedBackend a('a'), b('b');
        ASSERT_TRUE(a.ok()) << a.error();
        ASSERT_TRUE(b.ok()) << b.error();
        std::string settings = "    balance: round_robin\n";
        if (checks)
            settings += "    health_check: {interval: 100ms, timeout: 500ms, rise: 1, fall: 3}\n";
        ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}, {b.address()}}, mode, settings));
        EXPECT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath(mode)), 1.0)
            << "listener t should run the " << mode << " data path";
        const Labels la = backendOf(a.address()), lb = backendOf(b.address());
        auto checksOf = [&](const Labels& l) { return metricOr(metric::kBackendChecksTotal, l); };
        if (checks) {
            ASSERT_TRUE(relay_.waitForMetric(metric::kBackendChecksTotal,
                                             withLabel(la, "result", "passed"),
                                             [](double v) { return v >= 2; }, ">= 2"));
        }

        // The long-lived connection to A, opened before the change.
        Fd live = clientOf('a');
        ASSERT_TRUE(live);
        uint64_t seed = 1;
        ASSERT_TRUE(exchange(live.get(), seed++));

        ClientLoad load(relay_.host(), relay_.port());
        ASSERT_TRUE(load.waitForTotal(40, Millis{10'000})) << "the load did not get going";
        ASSERT_GT(load.tagsSince({})['a'], 0) << "A took none of the load before the change";

        const ApiReply changed = post(backendPath(a.address()), "{\"state\": \"" + state + "\"}");
        const auto changed_at = Clock::now();  // the answer is in: A is out from here on
        // active: the live connection, and any of the load's in flight to A.
        EXPECT_TRUE(backendReply(changed, {.address = a.address(),
                                           .state = state,
                                           .active = -1,
                                           .takes_new_connections = false}));

        // Connections picked before the answer may still be connecting to A: they are over once
        // each load thread finished one it started after the answer.
        ASSERT_TRUE(load.waitEachThreadPast(changed_at, Millis{20'000})) << "the load stalled";
        if (checks) {
            // A check of A that started before the answer ends within its timeout (500 ms);
            // counted or not, it is over before the snapshot below.
            std::this_thread::sleep_until(changed_at + Millis{600});
        }
        ASSERT_TRUE(exchange(live.get(), seed++)) << "the live connection to A stopped relaying";
        const double a_conns = metricOr(metric::kBackendConnectionsTotal, la);
        const double b_conns = metricOr(metric::kBackendConnectionsTotal, lb);
        const size_t a_accepted = a.accepted();
        const double a_checks = checksOf(la), b_checks = checksOf(lb);
        const size_t total_before = load.total();

        // Load, and the live connection relaying, with A out: at least a second, five exchanges
        // and 40 more connections, however long a loaded machine takes for them.
        const auto out_since = Clock::now();
        for (int i = 0; i < 5 || load.total() <= total_before + 40 || secondsSince(out_since) < 1;
             ++i) {
            ASSERT_LT(secondsSince(out_since), 30.0) << "the load stalled at " << load.total();
            ASSERT_TRUE(exchange(live.get(), seed++)) << "exchange " << i << " during " << state;
            std::this_thread::sleep_for(Millis{200});  // pacing: the load runs meanwhile
        }
        const auto since = load.tagsSince(changed_at);
        EXPECT_EQ(since.count('a') ? since.at('a') : 0, 0)
            << "connections started after the " << state << " answer reached A";
        EXPECT_EQ(since.count(0) ? since.at(0) : 0, 0) << "clients no backend answered";
        EXPECT_GT(since.count('b') ? since.at('b') : 0, 40);
        std::printf("%s (%s): of %d connections started after the answer, A took %d; A's "
                    "connections_total held at %.0f while B's went %.0f -> %.0f\n",
                    state.c_str(), mode.c_str(),
                    (since.count('a') ? since.at('a') : 0) + (since.count('b') ? since.at('b') : 0),
                    since.count('a') ? since.at('a') : 0, a_conns, b_conns,
                    metricOr(metric::kBackendConnectionsTotal, lb));
        EXPECT_EQ(metricOr(metric::kBackendConnectionsTotal, la), a_conns)
            << "A's connections_total moved in " << state;
        EXPECT_GE(metricOr(metric::kBackendConnectionsTotal, lb), b_conns + 40)
            << "B's connections_total should grow with the load";
        EXPECT_EQ(a.accepted(), a_accepted) << "A accepted connections in " << state;
        EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", state)), 1.0);
        EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", "ready")), 0.0);
        EXPECT_EQ(relay_.metric(kAdminChanges, {{"change", "state_" + state}}), 1.0);
        EXPECT_EQ(relay_.metric(metric::kBackendConnectionsActive, la), 1.0)
            << "the live connection is still A's";
        EXPECT_TRUE(backendReply(get(backendPath(a.address())),
                                 {.address = a.address(),
                                  .state = state,
                                  .active = 1,
                                  .takes_new_connections = false}));
        if (checks) {
            // maint: A is not checked (B is, every 100 ms); drain would go on checking.
            EXPECT_TRUE(relay_.waitForMetric(
                metric::kBackendChecksTotal, lb, [&](double v) { return v >= b_checks + 4; },
                ">= " + std::to_string(b_checks + 4)))
                << "B's health checks should go on";
            if (state != "maint") {
                EXPECT_TRUE(relay_.waitForMetric(
                    metric::kBackendChecksTotal, la, [&](double v) { return v > a_checks; },
                    "> " + std::to_string(a_checks)))
                    << "health checks of A stopped in " << state;
            } else {
                // A second at least has passed since the snapshot: ten of B's intervals.
                EXPECT_EQ(checksOf(la), a_checks) << "health checks of A went on in " << state;
            }
        }

        // The live connection to A ends when its client ends it, every byte echoed.
        ReceiveCheck last = echoRoundTrip(live.get(), seed++, 256 * kKiB, Millis{20'000});
        EXPECT_EQ(last.io.status, IoStatus::Eof) << last.describe();
        EXPECT_EQ(last.bytes, 256 * kKiB) << last.describe();
        EXPECT_LT(last.first_mismatch, 0) << last.describe();
        live.reset();
        EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, la, 0));

        // Back to ready: A takes new connections again.
        const ApiReply ready = post(backendPath(a.address()), "{\"state\":\"ready\"}");
        const auto ready_at = Clock::now();
        // The reply is built after the change took effect: the load's next connection may
        // already be A's (seen once in a clean-clone run: active 1).
        EXPECT_TRUE(backendReply(ready, {.address = a.address(), .active = -1}));
        ASSERT_TRUE(waitUntil([&] { return load.tagsSince(ready_at)['a'] >= 10; },
                              Millis{10'000}))
            << "A took no connection after ready";
        EXPECT_GT(metricOr(metric::kBackendConnectionsTotal, la), a_conns);
        EXPECT_GT(a.accepted(), a_accepted);
        if (checks) {
            const double at_ready = checksOf(la);
            EXPECT_TRUE(relay_.waitForMetric(metric::kBackendChecksTotal, la,
                                             [&](double v) { return v >= at_ready + 2; },
                                             ">= " + std::to_string(at_ready + 2)))
                << "health checks of A should resume after ready";
        }
        load.stop();
        EXPECT_EQ(relay_.metric(kAdminChanges, {{"change", "state_ready"}}), 1.0);
        EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", "ready")), 1.0);
    }
};

class AdminDrainTest : public AdminLoadTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(AdminDrainTest, DrainStopsNewConnectionsWhileALiveOneFinishes) {
    drainUnderLoad("drain", GetParam(), /*checks=*/false);
}

// drain decides where new connections go; the live connection's data path is untouched by it
// (the relay suites cover each path): splice only.
INSTANTIATE_TEST_SUITE_P(Modes, AdminDrainTest, ::testing::Values("splice"), modeName);

// maint as drain, and A's health checks stop (B's go on) until it is ready again.
TEST_F(AdminLoadTest, MaintStopsNewConnectionsAndHealthChecks) {
    drainUnderLoad("maint", "splice", /*checks=*/true);
}

}  // namespace
}  // namespace zcrelay::test::admin_api_test
