// zcrelay's process lifecycle: SIGTERM/SIGINT drain, config errors, --check-config, and the
// command-line shorthand. The real binary, real loopback sockets, bounded waits.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::lifecycle_test {
namespace {

constexpr uint64_t kSeed = 0x5EED;

// The stderr line that contains `needle`, or "".
std::string lineContaining(const std::string& text, const std::string& needle) {
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
        if (line.find(needle) != std::string::npos) return line;
    }
    return "";
}

// True if `text` has "PATH:<digits>:" somewhere (the FILE:LINE: prefix of a config error).
bool hasFileLinePrefix(const std::string& text, const std::string& path) {
    std::string prefix = path + ":";
    for (size_t pos = text.find(prefix); pos != std::string::npos;
         pos = text.find(prefix, pos + 1)) {
        size_t i = pos + prefix.size();
        size_t digits = 0;
        while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i, ++digits;
        if (digits > 0 && i < text.size() && text[i] == ':') return true;
    }
    return false;
}

// =============================================================================================
// 10. Drain on SIGTERM.

class DrainTest : public ::testing::TestWithParam<std::string> {
  protected:
    const std::string& mode() const { return GetParam(); }
    RelayProcess relay_;
};

TEST_P(DrainTest, SigtermRefusesNewConnectionsAndLetsInFlightTransferFinish) {
    constexpr uint64_t kTotal = 10 * kMiB;
    constexpr uint64_t kChunk = 512 * kKiB;
    constexpr Millis kPace{25};  // 20 chunks x 25 ms: the transfer lasts about half a second
    ScriptedUpstream up(AF_INET, sinkScript());
    ASSERT_TRUE(up.ok()) << up.error();
    RelayConfig config = singleListenerConfig(up.hostPort(), mode());
    config.drain_timeout = "10s";
    ASSERT_TRUE(relay_.start(config));
    Connected client = connectTo(relay_.host(), relay_.port());
    ASSERT_TRUE(client.fd) << client.error;

    uint64_t sent = 0;
    auto sendChunk = [&] {
        IoResult r = sendPayloadAt(client.fd.get(), kSeed, sent, kChunk);
        sent += r.bytes;
        return r;
    };
    // The first 2 MiB, then make sure the relay has really moved bytes: mid-flight.
    while (sent < 2 * kMiB) {
        IoResult r = sendChunk();
        ASSERT_TRUE(r.ok()) << r.describe();
        std::this_thread::sleep_for(kPace);
    }
    ASSERT_TRUE(relay_.waitForMetric(
        metric::kBytesTotal, metric::bytes("upstream"), [](double v) { return v >= kMiB; },
        ">= 1 MiB (transfer in flight)"));

    auto t_signal = Clock::now();
    ASSERT_TRUE(relay_.sendSignal(SIGTERM));

    // New connections must be refused once the relay stops accepting. Attempts that still get in
    // during the moment before the listener closes are dropped right away.
    int last_err = 0;
    bool refused = waitUntil(
        [&] {
            Connected probe = connectTo(relay_.host(), relay_.port(), Millis{500});
            last_err = probe.err;
            return !probe.fd && probe.err == ECONNREFUSED;
        },
        Millis{5'000});
    EXPECT_TRUE(refused) << "connections to the listener should be refused after SIGTERM; last "
                         << "connect errno " << last_err << " (" << std::strerror(last_err) << ")";

    // The rest of the transfer, paced, while the relay drains.
    while (sent < kTotal) {
        IoResult r = sendChunk();
        ASSERT_TRUE(r.ok()) << "in-flight transfer broken during drain after " << sent
                            << " bytes: " << r.describe() << "\n"
                            << relay_.diagnostics();
        std::this_thread::sleep_for(kPace);
    }
    ::shutdown(client.fd.get(), SHUT_WR);
    std::string rest;
    IoResult end = readUntilEof(client.fd.get(), rest, Millis{10'000});
    EXPECT_EQ(end.status, IoStatus::Eof) << "client expects a clean EOF: " << end.describe();
    client.fd.reset();

    // The transfer is connection #0 at the upstream; a probe that slipped in before the listener
    // closed would be #1 or later and may well finish first.
    std::optional<ConnRecord> rec = up.waitForRecord(0, Millis{10'000});
    if (rec) {
        EXPECT_EQ(rec->read_end.status, IoStatus::Eof) << rec->describe();
        EXPECT_EQ(rec->bytes_received, kTotal)
            << "in-flight transfer truncated by the drain: " << rec->describe();
        EXPECT_EQ(rec->received_hash, payloadHash(kSeed, kTotal)) << rec->describe();
    } else {
        std::string seen;
        for (const ConnRecord& r : up.records()) seen += "\n  " + r.describe();
        ADD_FAILURE() << "the upstream never finished the transfer's connection (accept #0); "
                      << up.accepted() << " accepted, finished:" << seen << "\n"
                      << relay_.diagnostics();
    }

    auto status = relay_.waitExit(Millis{8'000});
    ASSERT_TRUE(status) << "zcrelay should exit once its last connection finished (drain_timeout "
                        << "10s), " << secondsSince(t_signal) << " s after SIGTERM\n"
                        << relay_.diagnostics();
    EXPECT_TRUE(status->cleanExit()) << status->describe() << "\n" << relay_.diagnostics();
    // The paced transfer takes about half a second: 10 s (drain_timeout) is 20 times that, room
    // for a loaded 2-core machine.
    EXPECT_LT(secondsSince(t_signal), 10.0)
        << "the relay must exit because its last transfer finished, within drain_timeout (10s)";
}

TEST_P(DrainTest, IdleConnectionIsClosedWhenDrainTimeoutExpires) {
    ScriptedUpstream up(AF_INET, nullptr);  // holds the upstream side open, silent
    ASSERT_TRUE(up.ok()) << up.error();
    RelayConfig config = singleListenerConfig(up.hostPort(), mode());
    config.drain_timeout = "500ms";
    ASSERT_TRUE(relay_.start(config));
    Connected client = connectTo(relay_.host(), relay_.port());
    ASSERT_TRUE(client.fd) << client.error;
    ASSERT_TRUE(up.waitForAccepted(1, Millis{5'000})) << "relay never connected upstream";
    ASSERT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 1));

    auto t0 = Clock::now();
    ASSERT_TRUE(relay_.sendSignal(SIGTERM));
    auto status = relay_.waitExit(Millis{15'000});
    double elapsed = secondsSince(t0);
    ASSERT_TRUE(status) << "zcrelay still running 15 s after SIGTERM with drain_timeout 500ms\n"
                        << relay_.diagnostics();
    EXPECT_TRUE(status->cleanExit()) << status->describe() << "\n" << relay_.diagnostics();
    // 10 s: room for a loaded 2-core machine (the relay then exits too), and still far short of
    // the held connection's idle_timeout (300 s), what ends it without the drain deadline.
    EXPECT_LT(elapsed, 10.0) << "drain_timeout is 500ms";
    EXPECT_GE(elapsed, 0.4) << "a live connection should get up to drain_timeout (500ms) before "
                               "being closed";

    IoResult end = waitForPeerClose(client.fd.get(), Millis{10'000});
    EXPECT_TRUE(endedByPeer(end)) << "the client's connection must be closed by the drain; got "
                                  << end.describe();
}

INSTANTIATE_TEST_SUITE_P(Modes, DrainTest, ::testing::ValuesIn(kModes), modeName);

TEST(SignalTest, SigintWithNoConnectionsExitsZeroPromptly) {
    Listening upstream = listenLoopback(AF_INET, 16);
    ASSERT_TRUE(upstream.fd) << upstream.error;
    RelayProcess relay;
    ASSERT_TRUE(
        relay.start(singleListenerConfig(loopbackHostPort(AF_INET, upstream.port), "splice")));
    ASSERT_TRUE(relay.sendSignal(SIGINT));
    // Promptly: 10 s is room for a loaded 2-core machine, and still short of drain_timeout (30 s).
    auto status = relay.waitExit(Millis{10'000});
    ASSERT_TRUE(status) << "zcrelay with no connections still running 10 s after SIGINT\n"
                        << relay.diagnostics();
    EXPECT_TRUE(status->cleanExit()) << status->describe() << "\n" << relay.diagnostics();
}

TEST(SignalTest, SigtermWithNoConnectionsExitsZeroPromptly) {
    Listening upstream = listenLoopback(AF_INET, 16);
    ASSERT_TRUE(upstream.fd) << upstream.error;
    RelayProcess relay;
    ASSERT_TRUE(
        relay.start(singleListenerConfig(loopbackHostPort(AF_INET, upstream.port), "copy")));
    ExitStatus status = relay.terminate(Millis{10'000});  // as above: short of drain_timeout 30 s
    EXPECT_TRUE(status.cleanExit()) << status.describe() << "\n" << relay.diagnostics();
}

// =============================================================================================
// 13. Config errors, --check-config, shorthand.

// A good config, line by line, so tests know where each key sits.
std::string goodConfigYaml(const std::string& mode_value = "splice") {
    return "workers: 2\n"                     // 1
           "drain_timeout: 30s\n"             // 2
           "metrics:\n"                       // 3
           "  listen: \"127.0.0.1:0\"\n"      // 4
           "listeners:\n"                     // 5
           "  - name: t\n"                    // 6
           "    listen: \"127.0.0.1:0\"\n"    // 7
           "    upstream: \"127.0.0.1:9\"\n"  // 8
           "    mode: " +
           mode_value +
           "\n"                         // 9
           "    pipe_size: 1MiB\n"      // 10
           "    connect_timeout: 5s\n"  // 11
           "    idle_timeout: 300s\n";  // 12
}

TEST(ConfigErrorTest, BadValueExitsNonZeroWithFileLineAndKeyPath) {
    TempDir dir;
    std::string path = dir.writeFile("bad.yaml", goodConfigYaml("sideways"));
    CommandResult r = runCommand({kRelayBinary, "-c", path}, Millis{10'000});
    EXPECT_TRUE(r.status.exited && r.status.code != 0)
        << "an invalid mode must make zcrelay exit non-zero\n"
        << r.describe();
    std::string line = lineContaining(r.err, path + ":9:");
    EXPECT_FALSE(line.empty()) << "stderr should point at " << path << ":9: (the mode line)\n"
                               << r.describe();
    EXPECT_NE(line.find("listeners[0].mode"), std::string::npos)
        << "the error line should name the key path listeners[0].mode; got: " << line;
    EXPECT_EQ(r.out.find("zcrelay: ready"), std::string::npos) << "must not start";
}

TEST(ConfigErrorTest, OutOfRangeValueNamesItsKeyPath) {
    TempDir dir;
    std::string yaml = goodConfigYaml();
    yaml.replace(yaml.find("pipe_size: 1MiB"), std::string("pipe_size: 1MiB").size(),
                 "pipe_size: 9GiB");
    std::string path = dir.writeFile("range.yaml", yaml);
    CommandResult r = runCommand({kRelayBinary, "-c", path}, Millis{10'000});
    EXPECT_TRUE(r.status.exited && r.status.code != 0) << r.describe();
    std::string line = lineContaining(r.err, path + ":10:");
    EXPECT_NE(line.find("listeners[0].pipe_size"), std::string::npos)
        << "expected \"" << path << ":10:COL: listeners[0].pipe_size: ...\" on stderr\n"
        << r.describe();
}

TEST(ConfigErrorTest, MalformedYamlExitsNonZeroWithFileAndLine) {
    TempDir dir;
    std::string path = dir.writeFile("broken.yaml",
                                     "workers: 2\n"
                                     "listeners:\n"
                                     "  - name: t\n"
                                     "    listen: [127.0.0.1:0\n"
                                     "    upstream: \"127.0.0.1:9\"\n");
    CommandResult r = runCommand({kRelayBinary, "-c", path}, Millis{10'000});
    EXPECT_TRUE(r.status.exited && r.status.code != 0)
        << "malformed YAML must make zcrelay exit non-zero\n"
        << r.describe();
    EXPECT_TRUE(hasFileLinePrefix(r.err, path))
        << "stderr should start the error with " << path << ":LINE:\n"
        << r.describe();
}

TEST(ConfigErrorTest, MissingFileExitsNonZeroNamingIt) {
    TempDir dir;
    std::string path = dir.file("does-not-exist.yaml");
    CommandResult r = runCommand({kRelayBinary, "-c", path}, Millis{10'000});
    EXPECT_TRUE(r.status.exited && r.status.code != 0) << r.describe();
    EXPECT_NE(r.err.find(path), std::string::npos) << "stderr should name the file\n"
                                                   << r.describe();
}

TEST(CheckConfigTest, GoodFileExitsZeroAndBadFileExitsOne) {
    TempDir dir;
    std::string good = dir.writeFile("good.yaml", goodConfigYaml());
    std::string bad = dir.writeFile("bad.yaml", goodConfigYaml("sideways"));
    CommandResult ok = runCommand({kRelayBinary, "--check-config", good}, Millis{10'000});
    EXPECT_TRUE(ok.status.cleanExit()) << "--check-config on a valid file\n" << ok.describe();
    EXPECT_EQ(ok.out.find("zcrelay: ready"), std::string::npos)
        << "--check-config must not start the relay";
    CommandResult ko = runCommand({kRelayBinary, "--check-config", bad}, Millis{10'000});
    EXPECT_TRUE(ko.status.exited && ko.status.code == 1)
        << "--check-config on an invalid file must exit 1\n"
        << ko.describe();
    EXPECT_NE(lineContaining(ko.err, bad + ":9:").find("listeners[0].mode"), std::string::npos)
        << ko.describe();
}

TEST(ShorthandTest, ListenUpstreamModeMetricsFlagsRelayBytes) {
    constexpr uint64_t kBytes = 64 * kKiB;
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_TRUE(up.ok()) << up.error();
    RelayProcess relay;
    ASSERT_TRUE(relay.startWithArgs({"--listen", "127.0.0.1:0", "--upstream", up.hostPort(),
                                     "--mode", "copy", "--metrics", "127.0.0.1:0"}));
    const ListenerInfo* l = relay.listener();
    ASSERT_NE(l, nullptr);
    EXPECT_EQ(l->mode, "copy") << "--mode copy should show in the listener line";
    EXPECT_EQ(l->upstream, up.hostPort());
    EXPECT_NE(relay.metricsPort(), 0) << "--metrics 127.0.0.1:0 should print the metrics line";

    Connected client = connectTo(l->host, l->port);
    ASSERT_TRUE(client.fd) << client.error;
    ReceiveCheck got = echoRoundTrip(client.fd.get(), kSeed, kBytes, Millis{10'000});
    EXPECT_EQ(got.io.status, IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, kBytes) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();
    client.fd.reset();
    EXPECT_TRUE(relay.waitForMetric(metric::kBytesTotal, metric::bytes("upstream", l->name),
                                    static_cast<double>(kBytes)));
    EXPECT_TRUE(relay.waitForMetric(metric::kBytesTotal, metric::bytes("downstream", l->name),
                                    static_cast<double>(kBytes)));
    ExitStatus status = relay.terminate(Millis{5'000});
    EXPECT_TRUE(status.cleanExit()) << status.describe() << "\n" << relay.diagnostics();
}

}  // namespace
}  // namespace zcrelay::test::lifecycle_test
