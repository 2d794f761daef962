#pragma once
// The real zcrelay binary between real loopback sockets, over every data path (splice, copy,
// sockmap). What the relay_*_test.cpp files share: the seeds, the promptness bound and the
// fixture that starts one relay per case and waits on its counters. The files: byte-exact
// transfers (relay_transfer_test), the relay's socket options (relay_socket_options_test), how
// a connection ends (relay_close_test), many and slow connections against the relay's
// resources (relay_load_test), and the metrics a connection feeds (relay_metrics_test).
// The oracle is what the peers see (byte-exact payloads, EOF/RST, timing) and the relay's own
// Prometheus counters, waited on with deadlines; nothing sleeps and hopes.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>

#include "support/labels.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::relay_test {

inline constexpr uint64_t kSeedA = 0xA11CE;
inline constexpr uint64_t kSeedB = 0xB0B;
// "promptly": the bound for closes and bytes the relay must pass on. Loopback takes microseconds;
// 10 s is room for a loaded 2-core machine, and what it catches (a FIN or bytes left waiting for
// an event that never comes, or for idle_timeout's 300 s) waits far longer.
inline constexpr Millis kPrompt{10'000};

// Base fixture: one relay per test, listener "t" in mode GetParam() (or the given mode).
class RelayFixture {
  protected:
    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void startRelay(const ScriptedUpstream& up, const std::string& mode,
                    const std::function<void(RelayConfig&)>& tweak = {}) {
        ASSERT_TRUE(up.ok()) << "upstream listener: " << up.error();
        RelayConfig config = singleListenerConfig(up.hostPort(), mode, up.family());
        if (tweak) tweak(config);
        ASSERT_TRUE(relay_.start(config));
        expectDatapath(mode);
    }
    // This machine can load BPF: a sockmap listener that quietly ran splice would make every
    // sockmap case a second splice case.
    void expectDatapath(const std::string& mode) {
        EXPECT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath(mode)), 1.0)
            << "listener t should run the " << mode << " data path";
    }
    void startRelayTo(const std::string& upstream_host_port, const std::string& mode,
                      const std::function<void(RelayConfig&)>& tweak = {}) {
        RelayConfig config = singleListenerConfig(upstream_host_port, mode);
        if (tweak) tweak(config);
        ASSERT_TRUE(relay_.start(config));
        expectDatapath(mode);
    }
    Connected connectClient() { return connectTo(relay_.host(), relay_.port()); }

    // Waits for the counters of `connections` finished connections that moved exactly these bytes.
    void expectCountersAfterDone(uint64_t upstream_bytes, uint64_t downstream_bytes,
                                 double connections = 1) {
        EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"),
                                         static_cast<double>(upstream_bytes)))
            << "bytes relayed client -> upstream must equal what the client sent";
        EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("downstream"),
                                         static_cast<double>(downstream_bytes)))
            << "bytes relayed upstream -> client must equal what the upstream sent";
        EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), connections))
            << "every connection finished normally on both sides: reason=done";
        EXPECT_TRUE(
            relay_.waitForMetric(metric::kConnectionsTotal, metric::listener(), connections))
            << "accepted downstream connections";
        EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0))
            << "no connection may stay active after both sides closed";
    }

    RelayProcess relay_;
};

// The fixture for a plain TEST: its helpers, public.
class RelayFixtureAccess : public RelayFixture {
  public:
    using RelayFixture::connectClient;
    using RelayFixture::startRelay;
    RelayProcess& relay() { return relay_; }
};

class RelayModeTest : public RelayFixture, public ::testing::TestWithParam<std::string> {
  protected:
    const std::string& mode() const { return GetParam(); }
};

}  // namespace zcrelay::test::relay_test
