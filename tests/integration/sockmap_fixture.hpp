#pragma once
// What the `mode: sockmap` tests of the real binary (sockmap_*_test.cpp) share: the peers'
// scripts and a relay fixture that checks the sockmap path really runs.
//
// The hazards of `mode: sockmap` (proxy/pump/sockmap_kernel.hpp, sockmap_pump.hpp), through the
// real binary: bytes that reach a socket before it enters the SOCKHASH, a FIN that must wait for the kernel's
// backlog, resets, half-close, what the maps hold after a thousand connections, the byte
// counters against splice and copy, and the two ways a connection or a listener runs splice
// instead.
//
// This machine can load BPF, so nothing here skips for want of it. Every test checks that
// listener t really runs the sockmap path (zcrelay_datapath_info{mode="sockmap"} == 1) and,
// where the scenario leaves the kernel no other way, that no connection or direction fell back
// (zcrelay_sockmap_fallbacks_total == 0 for every reason): otherwise a test could pass through
// splice or copy and prove nothing about the kernel path.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <span>
#include <string>

#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::sockmap_test {

inline constexpr uint64_t kSeedA = 0x50C4A;  // client -> upstream
inline constexpr uint64_t kSeedB = 0x50C4B;  // upstream -> client
// A reset or close must reach the other side within kPrompt, a small request's answer must
// arrive within kAnswerDeadline. Loopback takes microseconds; 10 s is room for a loaded 2-core
// machine, and what they catch (bytes or a FIN left in a queue nobody looks at again, a close
// left to idle_timeout's 300 s) waits far longer.
inline constexpr Millis kPrompt{10'000};
inline constexpr Millis kAnswerDeadline{10'000};
inline constexpr Millis kBulkDeadline{30'000};
inline constexpr uint8_t kPing = 'p';
inline constexpr uint8_t kPong = 'P';

// ---------------------------------------------------------------------------------------------
// Peers.

// The client's half of a one-byte exchange. Once it returns, the relay has connected upstream
// and set the pair up: the pong went through it.
inline ::testing::AssertionResult pingPong(int fd) {
    uint8_t b = kPing;
    IoResult w = writeAll(fd, &b, 1, kAnswerDeadline);
    if (!w.ok()) return ::testing::AssertionFailure() << "ping: " << w.describe();
    IoResult r = readExactly(fd, &b, 1, kAnswerDeadline);
    if (!r.ok()) return ::testing::AssertionFailure() << "pong: " << r.describe();
    if (b != kPong) return ::testing::AssertionFailure() << "pong byte was " << int{b};
    return ::testing::AssertionSuccess();
}

// The upstream's half. The pong is written only after the ping came through the relay, so it
// can never race the insertion of the client's socket (an upstream that speaks first can).
inline bool answerPing(Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop) {
    uint8_t b = 0;
    IoResult r = readExactly(fd.get(), &b, 1, kAnswerDeadline, &stop);
    if (!r.ok() || b != kPing) {
        rec.read_end = r;
        rec.note = "no ping";
        return false;
    }
    b = kPong;
    rec.write_end = writeAll(fd.get(), &b, 1, kAnswerDeadline, &stop);
    if (!rec.write_end.ok()) {
        rec.note = "pong failed";
        return false;
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// Fixture.

using Counts = std::map<std::string, double>;

inline std::string describe(const Counts& counts) {
    std::string out;
    for (const auto& [k, v] : counts)
        out += (out.empty() ? "" : " ") + k + "=" + std::to_string(static_cast<long long>(v));
    return out;
}

class SockmapTest : public ::testing::Test {
  protected:
    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void startRelay(const ScriptedUpstream& up,
                    const std::function<void(RelayConfig&)>& tweak = {}) {
        ASSERT_TRUE(up.ok()) << "upstream listener: " << up.error();
        RelayConfig config = singleListenerConfig(up.hostPort(), "sockmap");
        if (tweak) tweak(config);
        ASSERT_TRUE(relay_.start(config));
        ASSERT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath("sockmap")), 1.0)
            << "listener t must run the sockmap data path on this machine (root, CAP_BPF)\n"
            << relay_.diagnostics();
    }
    Connected connectClient() const { return connectTo(relay_.host(), relay_.port()); }

    // Every zcrelay_sockmap_fallbacks_total{listener="t"} sample, by reason, from one scrape.
    // Whatever reasons the relay exports: each must be 0 where the kernel path is guaranteed.
    Counts fallbacks() const {
        Counts out;
        auto body = relay_.scrape();
        if (!body) return out;
        for (const Sample& s : parseMetrics(*body)) {
            if (s.name != metric::kSockmapFallbacksTotal || s.labels.size() != 2 ||
                s.labels.count("listener") == 0 || s.labels.at("listener") != "t" ||
                s.labels.count("reason") == 0)
                continue;
            out[s.labels.at("reason")] = s.value;
        }
        return out;
    }
    // Call after the connections are counted closed: every fallback is counted by then.
    void expectNoFallbacks(const Counts& counts) const {
        EXPECT_FALSE(counts.empty())
            << metric::kSockmapFallbacksTotal << "{listener=\"t\"} is not exported";
        for (const auto& [why, n] : counts) {
            EXPECT_EQ(n, 0.0) << metric::kSockmapFallbacksTotal << "{reason=\"" << why
                              << "\"}: nothing in this scenario lets a connection or direction "
                                 "leave the kernel path; all: "
                              << describe(counts);
        }
    }
    void expectNoFallbacks() const {
        const Counts counts = fallbacks();
        reportFallbacks(counts);
        expectNoFallbacks(counts);
    }
    // The counts, printed and recorded as test properties, with the catch-ups beside them.
    void reportFallbacks(const Counts& counts) const {
        std::cout << "[ sockmap  ] fallbacks: " << describe(counts);
        for (const auto& [why, n] : counts)
            RecordProperty("fallback_" + why, std::to_string(static_cast<long long>(n)));
        // Not in the contract; printed when the relay exports them.
        auto body = relay_.scrape();
        for (const char* name :
             {"zcrelay_sockmap_catchups_total", "zcrelay_sockmap_copied_bytes_total"}) {
            auto v = body ? findSample(*body, name, metric::listener()) : std::nullopt;
            if (v) std::cout << ", " << name << "=" << static_cast<long long>(*v);
        }
        std::cout << "\n";
    }

    // Waits for `connections` closed with `reason` that moved exactly these bytes in all, and for
    // nothing to be left: no active connection, no socket in the SOCKHASH.
    void expectClosed(uint64_t upstream_bytes, uint64_t downstream_bytes, double connections,
                      const std::string& reason = "done") {
        EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason(reason), connections))
            << "connections closed with reason " << reason;
        EXPECT_TRUE(
            relay_.waitForMetric(metric::kConnectionsTotal, metric::listener(), connections));
        EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
        EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"),
                                         static_cast<double>(upstream_bytes)))
            << "bytes relayed client -> upstream";
        EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("downstream"),
                                         static_cast<double>(downstream_bytes)))
            << "bytes relayed upstream -> client";
        EXPECT_TRUE(relay_.waitForMetric(metric::kSockmapSockets, {}, 0))
            << "every socket must have left the SOCKHASH once its connection closed";
    }

    RelayProcess relay_;
};

}  // namespace zcrelay::test::sockmap_test
