// SIGHUP on a running relay: the new config takes over listeners and clusters while the
// connections that started under the old one finish undisturbed, and a bad config is refused
// whole with the message a start would print. The oracle is what the peers see (byte-exact
// payloads, refused connects) and the relay's counters; every wait is bounded.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::reload_test {
namespace {

constexpr const char* kGeneration = "zcrelay_config_generation";

// A top-level `clusters:` block: one cluster `name` with these backends.
std::string clusterYaml(const std::string& name, const std::vector<std::string>& backends,
                        const std::string& extra = "") {
    std::string y = "clusters:\n  - name: " + name + "\n";
    y += extra;
    y += "    backends:\n";
    for (const auto& b : backends) y += "      - address: \"" + b + "\"\n";
    return y;
}

ListenerSpec clusterListener(const std::string& name, const std::string& cluster,
                             const std::string& mode) {
    ListenerSpec l;
    l.name = name;
    l.cluster = cluster;
    l.mode = mode;
    return l;
}

double reloads(const RelayProcess& relay, const char* result) {
    return relay.metric(metric::kConfigReloadsTotal, {{"result", result}}).value_or(-1);
}

// One short transfer through `port`: `bytes` of payload `seed`, FIN, then EOF from the relay.
::testing::AssertionResult sendThrough(const std::string& host, uint16_t port, uint64_t seed,
                                       uint64_t bytes) {
    Connected c = connectTo(host, port);
    if (!c.fd) return ::testing::AssertionFailure() << "connect " << port << ": " << c.error;
    IoResult sent = sendPayload(c.fd.get(), seed, bytes, Millis{20'000});
    if (!sent.ok()) return ::testing::AssertionFailure() << "send: " << sent.describe();
    ::shutdown(c.fd.get(), SHUT_WR);
    std::string reply;
    IoResult end = readUntilEof(c.fd.get(), reply, Millis{20'000});
    if (end.status != IoStatus::Eof)
        return ::testing::AssertionFailure() << "expected EOF, got " << end.describe();
    return ::testing::AssertionSuccess();
}

// A sink record that got exactly `bytes` of payload `seed` and then a clean EOF.
::testing::AssertionResult receivedExactly(const std::optional<ConnRecord>& rec, uint64_t seed,
                                           uint64_t bytes) {
    if (!rec) return ::testing::AssertionFailure() << "the backend never finished a connection";
    if (rec->read_end.status != IoStatus::Eof || rec->bytes_received != bytes ||
        rec->received_hash != payloadHash(seed, bytes))
        return ::testing::AssertionFailure() << "expected " << bytes << " bytes of payload " << seed
                                             << " then EOF; " << rec->describe();
    return ::testing::AssertionSuccess();
}

// =============================================================================================
// 1. A reload in the middle of a 1 GiB transfer (256 MiB in a sanitizer build: the sender holds
// at half way until the reload is done, so less volume lands it mid-transfer all the same).

class ReloadDuringTransferTest : public ::testing::TestWithParam<std::string> {};

// The reload adds listener `added`, removes `removed` and replaces the cluster's backend A by B.
// The live connection keeps the generation it started in: all of its bytes reach A, byte-exact,
// and the client sees a clean end. Everything new follows the new config.
TEST_P(ReloadDuringTransferTest, LiveTransferFinishesOnTheOldBackendNewConnectionsUseTheNewConfig) {
    const std::string mode = GetParam();
    constexpr uint64_t kSeed = 0x5167;
    const uint64_t kTotal = kSanitized ? 256 * kMiB : kGiB;
    ScriptedUpstream a(AF_INET, sinkScript());
    ScriptedUpstream b(AF_INET, sinkScript());
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_TRUE(b.ok()) << b.error();

    RelayConfig before;
    before.extra_yaml = clusterYaml("app", {a.hostPort()});
    before.listeners = {clusterListener("t", "app", mode), clusterListener("removed", "app", mode)};
    RelayProcess relay;
    ASSERT_TRUE(relay.start(before));
    EXPECT_EQ(relay.metric(metric::kDatapathInfo, metric::datapath(mode)), 1.0)
        << "listener t should run the " << mode << " data path";
    const uint16_t t_port = relay.port("t");
    const uint16_t removed_port = relay.port("removed");
    ASSERT_NE(t_port, 0);
    ASSERT_NE(removed_port, 0);

    Connected client = connectTo(relay.host("t"), t_port);
    ASSERT_TRUE(client.fd) << client.error;
    GatedSender sender(client.fd.get(), kSeed, kTotal, kTotal / 2);
    // Bytes are flowing into A when the SIGHUP arrives.
    ASSERT_TRUE(waitUntil([&] { return a.liveBytesReceived() >= 64 * kMiB; }, Millis{30'000}))
        << "A got only " << a.liveBytesReceived() << " bytes";
    EXPECT_TRUE(relay.waitForMetric(metric::kBackendConnectionsActive,
                                    metric::backend("app", a.hostPort()), 1));

    RelayConfig after;
    after.extra_yaml = clusterYaml("app", {b.hostPort()});
    after.listeners = {clusterListener("t", "app", mode), clusterListener("added", "app", mode)};
    ASSERT_TRUE(relay.reload(after.yaml()));
    EXPECT_LT(a.liveBytesReceived(), kTotal) << "the reload must land mid-transfer";
    EXPECT_EQ(relay.metric(kGeneration), 2.0);
    EXPECT_EQ(relay.port("t"), t_port) << "an unchanged listener keeps its socket";
    ASSERT_NE(relay.port("added"), 0) << relay.diagnostics();
    EXPECT_EQ(relay.listener("removed"), nullptr);

    // The removed listener's sockets are closed: a SYN to its port is refused.
    Connected refused = connectTo("127.0.0.1", removed_port, Millis{2'000});
    EXPECT_FALSE(refused.fd) << "listener `removed` still accepts after the reload";
    EXPECT_EQ(refused.err, ECONNREFUSED) << refused.error;

    sender.release();
    IoResult sent = sender.join();
    EXPECT_TRUE(sent.ok()) << "the client's send failed: " << sent.describe();
    EXPECT_EQ(sent.bytes, kTotal);
    std::string reply;
    IoResult end = readUntilEof(client.fd.get(), reply, Millis{60'000});
    EXPECT_EQ(end.status, IoStatus::Eof) << "the client should see a clean end: " << end.describe();
    EXPECT_TRUE(receivedExactly(a.waitForRecord(0, Millis{60'000}), kSeed, kTotal))
        << "the live connection must finish on A, every byte";
    client.fd.reset();

    // New connections: both listeners route to B, none to A.
    EXPECT_TRUE(sendThrough("127.0.0.1", t_port, 11, kMiB));
    EXPECT_TRUE(sendThrough("127.0.0.1", relay.port("added"), 12, kMiB));
    EXPECT_TRUE(receivedExactly(b.waitForRecord(0, Millis{10'000}), 11, kMiB));
    EXPECT_TRUE(receivedExactly(b.waitForRecord(1, Millis{10'000}), 12, kMiB));
    EXPECT_EQ(a.accepted(), 1u) << "backend A left the cluster: no new connection may reach it";
    EXPECT_TRUE(relay.waitForMetric(metric::kBackendConnectionsTotal,
                                    metric::backend("app", b.hostPort()), 2));
    EXPECT_TRUE(relay.waitForMetric(metric::kClosedTotal, metric::reason("done", "t"), 2));
    EXPECT_TRUE(relay.waitForMetric(metric::kClosedTotal, metric::reason("done", "added"), 1));
    EXPECT_TRUE(relay.waitForMetric(metric::kConnectionsActive, metric::listener("t"), 0));
    EXPECT_EQ(relay.metric(metric::kDatapathInfo, metric::datapath(mode, "added")), 1.0);
    EXPECT_EQ(reloads(relay, "failure"), 0.0);
    for (const char* why : {"client_reset", "upstream_reset", "error", "drain"})
        EXPECT_EQ(relay.metric(metric::kClosedTotal, metric::reason(why, "t")), 0.0) << why;
}

INSTANTIATE_TEST_SUITE_P(Modes, ReloadDuringTransferTest, ::testing::ValuesIn(kModes), modeName);

// =============================================================================================
// 2. A bad config is refused whole; the running one goes on serving.

class BadReloadTest : public ::testing::Test {
  protected:
    void SetUp() override {
        ASSERT_TRUE(old_backend_.ok()) << old_backend_.error();
        ASSERT_TRUE(new_backend_.ok()) << new_backend_.error();
        config_.extra_yaml = clusterYaml("app", {old_backend_.hostPort()});
        config_.listeners = {clusterListener("t", "app", "splice"),
                             clusterListener("u", "app", "copy")};
        ASSERT_TRUE(relay_.start(config_));
        t_port_ = relay_.port("t");
        u_port_ = relay_.port("u");
    }

    // A config that would change everything: B instead of A, `u` gone, listener `v` added.
    RelayConfig changedConfig() const {
        RelayConfig c;
        c.extra_yaml = clusterYaml("app", {new_backend_.hostPort()});
        c.listeners = {clusterListener("t", "app", "splice"), clusterListener("v", "app", "copy")};
        return c;
    }

    // What a start with this config file prints: the message a refused reload must repeat.
    std::string startError() const {
        CommandResult r = runCommand({kRelayBinary, "-c", relay_.configPath()}, Millis{10'000});
        EXPECT_TRUE(r.status.exited && r.status.code == 1) << r.describe();
        // The last line (a failed bind comes after the effective config is logged).
        std::string err = r.err;
        while (!err.empty() && err.back() == '\n') err.pop_back();
        err = err.substr(err.rfind('\n') == std::string::npos ? 0 : err.rfind('\n') + 1);
        const std::string prefix = "zcrelay: ";
        return err.rfind(prefix, 0) == 0 ? err.substr(prefix.size()) : err;
    }

    // The bad reload changed nothing: counted as a failure, still generation 1, the same
    // listeners on the same ports, relaying to the old backend.
    void expectOldConfigServes() {
        EXPECT_EQ(reloads(relay_, "failure"), 1.0);
        EXPECT_EQ(reloads(relay_, "success"), 0.0);
        EXPECT_EQ(relay_.metric(kGeneration), 1.0);
        EXPECT_EQ(relay_.port("t"), t_port_);
        EXPECT_EQ(relay_.port("u"), u_port_);
        EXPECT_TRUE(relay_.running()) << relay_.diagnostics();
        EXPECT_TRUE(sendThrough("127.0.0.1", t_port_, 21, 4 * kMiB));
        EXPECT_TRUE(sendThrough("127.0.0.1", u_port_, 22, 4 * kMiB));
        EXPECT_TRUE(receivedExactly(old_backend_.waitForRecord(0, Millis{10'000}), 21, 4 * kMiB));
        EXPECT_TRUE(receivedExactly(old_backend_.waitForRecord(1, Millis{10'000}), 22, 4 * kMiB));
        EXPECT_EQ(new_backend_.accepted(), 0u) << "the refused config's backend got a connection";
        EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done", "t"), 1));
        EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done", "u"), 1));
    }

    ::testing::AssertionResult stderrHas(const std::string& text) const {
        std::string err = relay_.stderrText();
        if (err.find(text) != std::string::npos) return ::testing::AssertionSuccess();
        return ::testing::AssertionFailure() << "stderr lacks\n  " << text << "\n--- stderr ---\n"
                                             << err;
    }

    static constexpr const char* kRefused = "SIGHUP: reload refused, the running config stays: ";
    ScriptedUpstream old_backend_{AF_INET, sinkScript()};
    ScriptedUpstream new_backend_{AF_INET, sinkScript()};
    RelayConfig config_;
    RelayProcess relay_;
    uint16_t t_port_ = 0, u_port_ = 0;
};

// The line and column of the first occurrence of `needle` in `text` (1-based), as "L:C".
std::string positionOf(const std::string& text, const std::string& needle) {
    size_t at = text.find(needle);
    if (at == std::string::npos) return "?:?";
    size_t line = 1 + static_cast<size_t>(std::count(text.begin(), text.begin() + at, '\n'));
    size_t line_start = text.rfind('\n', at);
    size_t column = at - (line_start == std::string::npos ? 0 : line_start + 1) + 1;
    return std::to_string(line) + ":" + std::to_string(column);
}

TEST_F(BadReloadTest, YamlSyntaxErrorIsRefusedWithItsPosition) {
    // A key indented one space short of its listener's: yaml-cpp stops at that line.
    std::string yaml = changedConfig().yaml() + "   mode: copy\n";
    ASSERT_TRUE(relay_.reload(yaml, false));
    std::string line = std::to_string(std::count(yaml.begin(), yaml.end(), '\n'));
    EXPECT_TRUE(stderrHas(kRefused + relay_.configPath() + ":" + line + ":4: (yaml): "));
    EXPECT_TRUE(stderrHas(kRefused + startError())) << "the same words as at start";
    expectOldConfigServes();
}

TEST_F(BadReloadTest, UnknownKeyIsRefusedWithFileLineColumnAndKey) {
    RelayConfig bad = changedConfig();
    bad.listeners[1].extra_yaml = "    max_conections: 3";
    std::string yaml = bad.yaml();
    ASSERT_TRUE(relay_.reload(yaml, false));
    EXPECT_TRUE(stderrHas(kRefused + relay_.configPath() + ":" +
                          positionOf(yaml, "max_conections") +
                          ": listeners[1].max_conections: unknown key; expected one of: name, "))
        << "file:line:col: key: message";
    EXPECT_TRUE(stderrHas(kRefused + startError())) << "the same words as at start";
    expectOldConfigServes();
}

TEST_F(BadReloadTest, ListenerOnATakenPortRefusesTheWholeReload) {
    // A socket of the test's own (no SO_REUSEPORT) holds the port: the relay's bind fails.
    Listening taken = listenLoopback(AF_INET, 16);
    ASSERT_TRUE(taken.fd) << taken.error;
    RelayConfig bad = changedConfig();
    bad.listeners[1].listen = "127.0.0.1:" + std::to_string(taken.port);
    ASSERT_TRUE(relay_.reload(bad.yaml(), false));
    const std::string why =
        "listener v: bind 127.0.0.1:" + std::to_string(taken.port) + ": Address already in use";
    EXPECT_TRUE(stderrHas(kRefused + why));
    EXPECT_EQ(startError(), why) << "the same words as at start";
    expectOldConfigServes();
}

// =============================================================================================
// 3. What a reload keeps: a listener's counters, a backend's health.

// Backend `dead` refuses; with max_fails 1 the first refusal ejects it for fail_timeout (60 s,
// far past the test). A reload that keeps the cluster must keep it down and keep counting.
TEST(ReloadKeepsStateTest, ListenerCountersContinueAndAnEjectedBackendStaysDown) {
    ScriptedUpstream live(AF_INET, echoScript());
    ASSERT_TRUE(live.ok()) << live.error();
    Bound dead = bindLoopbackNoListen(AF_INET);
    ASSERT_TRUE(dead.fd) << dead.error;
    const std::string dead_addr = loopbackHostPort(AF_INET, dead.port);
    const std::string clusters = clusterYaml("app", {live.hostPort(), dead_addr},
                                             "    max_fails: 1\n    fail_timeout: 60s\n");

    RelayConfig config;
    config.workers = 1;  // one balancer: round robin reaches `dead` by the second connection
    config.extra_yaml = clusters;
    config.listeners = {clusterListener("t", "app", "splice")};
    RelayProcess relay;
    ASSERT_TRUE(relay.start(config));

    auto echoOnce = [&](uint16_t port, uint64_t seed) {
        Connected c = connectTo("127.0.0.1", port);
        if (!c.fd) return ::testing::AssertionFailure() << c.error;
        ReceiveCheck got = echoRoundTrip(c.fd.get(), seed, 64 * kKiB, Millis{20'000});
        if (got.bytes != 64 * kKiB || got.first_mismatch >= 0)
            return ::testing::AssertionFailure() << got.describe();
        return ::testing::AssertionSuccess();
    };
    // Until the refusal ejected `dead` (a retry serves each client from `live`).
    int before = 0;
    while (before < 4 &&
           relay.metric(metric::kBackendUp, metric::backend("app", dead_addr)) != 0.0) {
        ASSERT_TRUE(echoOnce(relay.port("t"), 100 + before));
        ++before;
    }
    ASSERT_EQ(relay.metric(metric::kBackendUp, metric::backend("app", dead_addr)), 0.0)
        << "backend " << dead_addr << " was not ejected\n"
        << relay.diagnostics();
    ASSERT_TRUE(relay.waitForMetric(metric::kConnectionsTotal, metric::listener("t"), before));
    auto dead_attempts =
        relay.metric(metric::kBackendAttemptsTotal, metric::backend("app", dead_addr));
    ASSERT_TRUE(dead_attempts);

    // Same cluster and listener `t` (one setting changed), one listener more.
    RelayConfig next = config;
    next.listeners[0].idle_timeout = "200s";
    next.listeners.push_back(clusterListener("extra", "app", "copy"));
    ASSERT_TRUE(relay.reload(next.yaml()));
    EXPECT_EQ(relay.metric(kGeneration), 2.0);
    EXPECT_EQ(relay.metric(metric::kBackendUp, metric::backend("app", dead_addr)), 0.0)
        << "the reload brought an ejected backend back up";
    EXPECT_EQ(relay.metric(metric::kConnectionsTotal, metric::listener("t")), before)
        << "listener t's counters restarted";
    EXPECT_EQ(relay.metric(metric::kClosedTotal, metric::reason("done", "t")), before);

    constexpr int kAfter = 4;
    for (int i = 0; i < kAfter; ++i) {
        EXPECT_TRUE(echoOnce(relay.port("t"), 200 + i));
        EXPECT_TRUE(echoOnce(relay.port("extra"), 300 + i));
    }
    EXPECT_TRUE(
        relay.waitForMetric(metric::kConnectionsTotal, metric::listener("t"), before + kAfter));
    EXPECT_TRUE(
        relay.waitForMetric(metric::kClosedTotal, metric::reason("done", "t"), before + kAfter));
    EXPECT_TRUE(relay.waitForMetric(metric::kConnectionsTotal, metric::listener("extra"), kAfter));
    EXPECT_TRUE(relay.waitForMetric(metric::kBackendConnectionsTotal,
                                    metric::backend("app", live.hostPort()), before + 2 * kAfter))
        << "the backend's counters continue";
    EXPECT_EQ(relay.metric(metric::kBackendAttemptsTotal, metric::backend("app", dead_addr)),
              dead_attempts)
        << "an ejected backend must not be tried";
    EXPECT_EQ(relay.metric(metric::kBackendUp, metric::backend("app", dead_addr)), 0.0);
}

}  // namespace
}  // namespace zcrelay::test::reload_test
