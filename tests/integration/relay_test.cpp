// The real zcrelay binary between real loopback sockets, over every data path (splice, copy,
// sockmap).
// The oracle is what the peers see (byte-exact payloads, EOF/RST, timing) and the relay's own
// Prometheus counters, waited on with deadlines; nothing sleeps and hopes.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "support/labels.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::relay_test {
namespace {

constexpr uint64_t kSeedA = 0xA11CE;
constexpr uint64_t kSeedB = 0xB0B;
// "promptly": the bound for closes and bytes the relay must pass on. Loopback takes microseconds;
// 10 s is room for a loaded 2-core machine, and what it catches (a FIN or bytes left waiting for
// an event that never comes, or for idle_timeout's 300 s) waits far longer.
constexpr Millis kPrompt{10'000};

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

// =============================================================================================
// 1. Byte-exact transfers: sizes x directions x modes, IPv4; IPv6 for 1 MiB.

struct TransferCase {
    std::string mode;
    int family;
    uint64_t bytes;
};

std::string sizeName(uint64_t b) {
    if (b >= kMiB) return std::to_string(b / kMiB) + "MiB";
    return std::to_string(b / kKiB) + "KiB";
}

std::string transferName(const ::testing::TestParamInfo<TransferCase>& info) {
    return info.param.mode + "_" + familyName(info.param.family) + "_" + sizeName(info.param.bytes);
}

std::vector<TransferCase> transferCases() {
    std::vector<TransferCase> cases;
    for (const auto& m : kModes) {
        for (uint64_t size : {kKiB, kMiB, 10 * kMiB, 100 * kMiB})
            cases.push_back({m, AF_INET, size});
        cases.push_back({m, AF_INET6, kMiB});
    }
    return cases;
}

class TransferTest : public RelayFixture, public ::testing::TestWithParam<TransferCase> {};

TEST_P(TransferTest, ClientToUpstreamArrivesByteExact) {
    const TransferCase& c = GetParam();
    ScriptedUpstream up(c.family, sinkScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, c.mode));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    IoResult sent = sendPayload(client.fd.get(), kSeedA, c.bytes);
    ASSERT_TRUE(sent.ok()) << "client could not send its payload through the relay: "
                           << sent.describe();
    ::shutdown(client.fd.get(), SHUT_WR);
    std::string reply;
    IoResult end = readUntilEof(client.fd.get(), reply, Millis{30'000});
    EXPECT_EQ(end.status, IoStatus::Eof)
        << "after the upstream closed, the client expects a clean EOF; got " << end.describe();
    EXPECT_EQ(reply.size(), 0u) << "the sink upstream sends nothing back";

    ASSERT_TRUE(up.waitForFinished(1, Millis{10'000})) << "upstream never saw the stream end";
    ConnRecord rec = up.records().at(0);
    EXPECT_EQ(rec.read_end.status, IoStatus::Eof) << "upstream should read EOF: " << rec.describe();
    EXPECT_EQ(rec.bytes_received, c.bytes) << rec.describe();
    EXPECT_EQ(rec.received_hash, payloadHash(kSeedA, c.bytes))
        << "upstream received different bytes than the client sent: " << rec.describe();
    client.fd.reset();
    expectCountersAfterDone(c.bytes, 0);
}
ZCRELAY_LABEL(TransferTest, ClientToUpstreamArrivesByteExact, "*100MiB*", kSanitizeSkip,
              "volume only: the same code as the 1 and 10 MiB cases");

TEST_P(TransferTest, UpstreamToClientArrivesByteExact) {
    const TransferCase& c = GetParam();
    ScriptedUpstream up(c.family, sourceScript(kSeedA, c.bytes));
    ASSERT_NO_FATAL_FAILURE(startRelay(up, c.mode));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeedA);
    EXPECT_EQ(got.io.status, IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, c.bytes) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << "client received corrupted bytes: " << got.describe();
    client.fd.reset();  // FIN: the relay passes it on and the source script finishes

    ASSERT_TRUE(up.waitForFinished(1, Millis{10'000}))
        << "upstream never saw the client's FIN after its own";
    ConnRecord rec = up.records().at(0);
    EXPECT_TRUE(rec.write_end.ok()) << rec.describe();
    EXPECT_EQ(rec.read_end.status, IoStatus::Eof) << rec.describe();
    expectCountersAfterDone(0, c.bytes);
}
ZCRELAY_LABEL(TransferTest, UpstreamToClientArrivesByteExact, "*100MiB*", kSanitizeSkip,
              "volume only: the same code as the 1 and 10 MiB cases");

TEST_P(TransferTest, BothDirectionsAtOnceArriveByteExact) {
    const TransferCase& c = GetParam();
    ScriptedUpstream up(c.family, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, c.mode));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    IoResult sent;
    ReceiveCheck got = echoRoundTrip(client.fd.get(), kSeedA, c.bytes, kDefaultIoTimeout, &sent);
    EXPECT_TRUE(sent.ok()) << "client writer: " << sent.describe();
    EXPECT_EQ(got.io.status, IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, c.bytes) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << "echoed bytes corrupted: " << got.describe();
    client.fd.reset();

    ASSERT_TRUE(up.waitForFinished(1, Millis{10'000}));
    ConnRecord rec = up.records().at(0);
    EXPECT_EQ(rec.bytes_received, c.bytes) << rec.describe();
    EXPECT_EQ(rec.received_hash, payloadHash(kSeedA, c.bytes)) << rec.describe();
    expectCountersAfterDone(c.bytes, c.bytes);
}
ZCRELAY_LABEL(TransferTest, BothDirectionsAtOnceArriveByteExact, "*100MiB*", kSanitizeSkip,
              "volume only: the same code as the 1 and 10 MiB cases");

INSTANTIATE_TEST_SUITE_P(Sizes, TransferTest, ::testing::ValuesIn(transferCases()), transferName);

// tcp_nodelay: false leaves Nagle on for bulk flows: still every byte, in order, both ways.
class NagleTest : public RelayModeTest {};

TEST_P(NagleTest, TcpNodelayOffStillRelaysBothWaysByteExact) {
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode(), [](RelayConfig& c) {
        c.listeners.at(0).extra_yaml = "    tcp_nodelay: false\n";
    }));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    IoResult sent;
    ReceiveCheck got = echoRoundTrip(client.fd.get(), kSeedB, 10 * kMiB, kDefaultIoTimeout, &sent);
    EXPECT_TRUE(sent.ok()) << sent.describe();
    EXPECT_EQ(got.bytes, 10 * kMiB) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();
    client.fd.reset();
    expectCountersAfterDone(10 * kMiB, 10 * kMiB);
}

INSTANTIATE_TEST_SUITE_P(Modes, NagleTest, ::testing::ValuesIn(kModes), modeName);

// Bursts of small writes, each burst echoed back whole before the next is sent. After a small
// read the splice path waits for POLLIN rather than reading again; if the socket still held
// bytes (a pipe runs out of slots before bytes when many small segments queue up), nothing new
// arrives to wake the relay, so a stall there would strand the end of a burst and time out.
class SmallBurstTest : public RelayModeTest {};

TEST_P(SmallBurstTest, BurstsOfSmallWritesComeBackWholeEveryTime) {
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    constexpr size_t kWrites = 300;
    constexpr size_t kWriteSize = 100;
    constexpr size_t kBursts = 20;
    constexpr uint64_t kBurstBytes = kWrites * kWriteSize;
    std::vector<uint8_t> burst(kBurstBytes), back(kBurstBytes);
    for (size_t b = 0; b < kBursts; ++b) {
        fillPayload(kSeedA, b * kBurstBytes, burst);
        // TCP_NODELAY (connectTo sets it): each write leaves as its own segment.
        for (size_t w = 0; w < kWrites; ++w) {
            IoResult sent = writeAll(client.fd.get(), burst.data() + w * kWriteSize, kWriteSize);
            ASSERT_TRUE(sent.ok()) << "burst " << b << " write " << w << ": " << sent.describe();
        }
        IoResult got = readExactly(client.fd.get(), back.data(), back.size(), kPrompt);
        ASSERT_TRUE(got.ok()) << "burst " << b << " came back short: " << got.describe();
        ASSERT_EQ(back, burst) << "burst " << b << " came back altered";
    }
    ASSERT_EQ(::shutdown(client.fd.get(), SHUT_WR), 0);
    std::string rest;
    IoResult end = readUntilEof(client.fd.get(), rest, kPrompt);
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
    EXPECT_TRUE(rest.empty()) << rest.size() << " bytes more than were sent";
    client.fd.reset();
    expectCountersAfterDone(kBursts * kBurstBytes, kBursts * kBurstBytes);
}

INSTANTIATE_TEST_SUITE_P(Modes, SmallBurstTest, ::testing::ValuesIn(kModes), modeName);

// notsent_lowat reaches both sockets of a relayed connection in splice and copy mode, and stays
// off in sockmap mode (where the kernel's psock worker sends). Read off the relay's own sockets:
// pidfd_getfd duplicates each into this process, where getsockopt can ask.
class NotsentLowatTest : public RelayModeTest {
  protected:
    // TCP_NOTSENT_LOWAT of every relay socket whose peer is on one of `peer_ports`.
    std::vector<int> lowatsOfSocketsTo(const std::vector<uint16_t>& peer_ports) {
        std::vector<int> found;
        for (const Fd& fd : relaySocketsTo(relay_.pid(), peer_ports)) {
            int lowat = -1;
            socklen_t olen = sizeof lowat;
            ::getsockopt(fd.get(), IPPROTO_TCP, TCP_NOTSENT_LOWAT, &lowat, &olen);
            found.push_back(lowat);
        }
        return found;
    }

    void expectLowat(const std::string& extra_yaml, int want) {
        ScriptedUpstream up(AF_INET, echoScript());
        ASSERT_NO_FATAL_FAILURE(startRelay(
            up, mode(), [&](RelayConfig& c) { c.listeners.at(0).extra_yaml = extra_yaml; }));
        ASSERT_NO_FATAL_FAILURE(expectLowatOfNextConnection(up, want));
    }

    // One more connection through the running relay: both its sockets have `want`.
    void expectLowatOfNextConnection(const ScriptedUpstream& up, int want) {
        Connected client = connectClient();
        ASSERT_TRUE(client.fd) << client.error;
        // One echo: the upstream connection exists once the bytes came back.
        std::vector<uint8_t> msg(64, 'x'), back(64);
        ASSERT_TRUE(writeAll(client.fd.get(), msg.data(), msg.size()).ok());
        ASSERT_TRUE(readExactly(client.fd.get(), back.data(), back.size()).ok());
        sockaddr_in local{};
        socklen_t len = sizeof local;
        ::getsockname(client.fd.get(), reinterpret_cast<sockaddr*>(&local), &len);
        std::vector<int> lowats = lowatsOfSocketsTo({ntohs(local.sin_port), up.port()});
        ASSERT_EQ(lowats.size(), 2u) << "the relay's client-side and upstream-side sockets";
        EXPECT_EQ(lowats[0], want);
        EXPECT_EQ(lowats[1], want);
    }

    int expectedDefault() const { return mode() == "sockmap" ? 0 : 128 * 1024; }
};

TEST_P(NotsentLowatTest, DefaultIsSetOnBothSocketsOutsideSockmap) {
    ASSERT_NO_FATAL_FAILURE(expectLowat("", expectedDefault()));
}

TEST_P(NotsentLowatTest, ConfiguredValueIsSetOutsideSockmap) {
    ASSERT_NO_FATAL_FAILURE(
        expectLowat("    notsent_lowat: 256KiB\n", mode() == "sockmap" ? 0 : 256 * 1024));
}

TEST_P(NotsentLowatTest, ZeroLeavesItUnset) {
    ASSERT_NO_FATAL_FAILURE(expectLowat("    notsent_lowat: 0\n", 0));
}

// The client socket gets its options from the listening socket it was accepted on (the kernel
// copies the listener), and a reload keeps that socket: the reload must set them on it anew.
TEST_P(NotsentLowatTest, AReloadReachesTheClientSocketsAcceptedAfterIt) {
    ScriptedUpstream up(AF_INET, echoScript());
    RelayConfig config = singleListenerConfig(up.hostPort(), mode(), up.family());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    ASSERT_NO_FATAL_FAILURE(expectLowatOfNextConnection(up, expectedDefault()));
    config.listeners.at(0).extra_yaml = "    notsent_lowat: 256KiB\n";
    ASSERT_TRUE(relay_.reload(config.yaml()));
    ASSERT_NO_FATAL_FAILURE(expectLowatOfNextConnection(up, mode() == "sockmap" ? 0 : 256 * 1024));
}

INSTANTIATE_TEST_SUITE_P(Modes, NotsentLowatTest, ::testing::ValuesIn(kModes), modeName);

// Every upstream socket carries a per-socket local port range (the system's whole range), which
// makes connect() search the ephemeral ports in order rather than even ports first: at high
// connection rates toward one backend, where the relay's own TIME_WAIT ports pile up, that
// search was 17 % of its CPU (proxy/upstream.cpp). Read off the relay's own socket.
class UpstreamPortSearchTest : public RelayModeTest {};

TEST_P(UpstreamPortSearchTest, TheUpstreamSocketHasAPerSocketPortRange) {
    constexpr int kIpLocalPortRange = 51;  // linux/in.h
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    std::vector<uint8_t> msg(64, 'x'), back(64);
    ASSERT_TRUE(writeAll(client.fd.get(), msg.data(), msg.size()).ok());
    ASSERT_TRUE(readExactly(client.fd.get(), back.data(), back.size()).ok());
    std::vector<Fd> sockets = relaySocketsTo(relay_.pid(), {up.port()});
    ASSERT_EQ(sockets.size(), 1u) << "the relay's upstream-side socket";
    uint32_t range = 0;
    socklen_t len = sizeof range;
    ASSERT_EQ(::getsockopt(sockets[0].get(), IPPROTO_IP, kIpLocalPortRange, &range, &len), 0)
        << strerror(errno);
    EXPECT_EQ(range, 0xffff0000u) << "low 0 and high 65535: the sysctl's own bounds";
}

// Set on the socket before its connect, before any data path: splice only.
INSTANTIATE_TEST_SUITE_P(Modes, UpstreamPortSearchTest, ::testing::Values("splice"), modeName);

// =============================================================================================
// 2. Half-close: a FIN is a SHUT_WR on the other side; the other direction keeps flowing.

class HalfCloseTest : public RelayModeTest {};

TEST_P(HalfCloseTest, UpstreamRepliesAfterClientFinAndClientGetsAllThenEof) {
    ScriptedUpstream up(AF_INET, sinkScript(kSeedB, kMiB));  // replies only after EOF
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    IoResult sent = sendPayload(client.fd.get(), kSeedA, kMiB);
    ASSERT_TRUE(sent.ok()) << sent.describe();
    ASSERT_EQ(::shutdown(client.fd.get(), SHUT_WR), 0);
    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeedB, Millis{30'000});
    EXPECT_EQ(got.bytes, kMiB) << "the reply sent after the client's FIN must arrive in full: "
                               << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();
    EXPECT_EQ(got.io.status, IoStatus::Eof) << "then a clean EOF: " << got.describe();

    ASSERT_TRUE(up.waitForFinished(1, Millis{10'000}));
    ConnRecord rec = up.records().at(0);
    EXPECT_EQ(rec.bytes_received, kMiB) << rec.describe();
    EXPECT_EQ(rec.received_hash, payloadHash(kSeedA, kMiB)) << rec.describe();
    EXPECT_TRUE(rec.write_end.ok()) << "the upstream's reply after EOF: " << rec.describe();
    client.fd.reset();
    expectCountersAfterDone(kMiB, kMiB);
}

TEST_P(HalfCloseTest, ClientRepliesAfterUpstreamFinAndUpstreamGetsAll) {
    ScriptedUpstream up(AF_INET, sourceScript(kSeedA, kMiB));  // sends, SHUT_WR, reads to EOF
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeedA, Millis{30'000});
    ASSERT_EQ(got.io.status, IoStatus::Eof)
        << "the upstream's FIN must reach the client as EOF: " << got.describe();
    EXPECT_EQ(got.bytes, kMiB) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();

    IoResult sent = sendPayload(client.fd.get(), kSeedB, kMiB, Millis{30'000});
    EXPECT_TRUE(sent.ok()) << "the client must still be able to send after reading EOF: "
                           << sent.describe();
    ::shutdown(client.fd.get(), SHUT_WR);

    ASSERT_TRUE(up.waitForFinished(1, Millis{30'000}))
        << "upstream never got EOF for the client's reply";
    ConnRecord rec = up.records().at(0);
    EXPECT_EQ(rec.read_end.status, IoStatus::Eof) << rec.describe();
    EXPECT_EQ(rec.bytes_received, kMiB) << "the reply after the upstream's FIN: " << rec.describe();
    EXPECT_EQ(rec.received_hash, payloadHash(kSeedB, kMiB)) << rec.describe();
    client.fd.reset();
    expectCountersAfterDone(kMiB, kMiB);
}

INSTANTIATE_TEST_SUITE_P(Modes, HalfCloseTest, ::testing::ValuesIn(kModes), modeName);

// The metrics a connection's life feeds, beyond bytes and closes: bytes under the data path
// that moved them, the half-closed gauge while one direction is done, the duration histogram
// at close, and the per-worker and process numbers.
class ConnectionMetricsTest : public RelayModeTest {};

TEST_P(ConnectionMetricsTest, PathHalfCloseDurationAndProcessNumbers) {
    // Reads to EOF, then holds its side open until told: the connection stays half closed.
    std::atomic<bool> release{false};
    ScriptedUpstream up(AF_INET, [&](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                     ScriptedUpstream&) {
        std::string got;
        rec.read_end = readUntilEof(fd.get(), got, Millis{30'000});
        rec.bytes_received = got.size();
        for (int i = 0; i < 3000 && !release.load() && !stop.load(); ++i)
            std::this_thread::sleep_for(Millis{10});
    });
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    ASSERT_TRUE(sendPayload(client.fd.get(), kSeedA, kMiB).ok());
    ASSERT_EQ(::shutdown(client.fd.get(), SHUT_WR), 0);
    EXPECT_TRUE(relay_.waitForMetric("zcrelay_half_closed_connections", metric::listener(), 1));
    EXPECT_EQ(relay_.metric(metric::kBytesTotal,
                            {{"listener", "t"}, {"direction", "upstream"}, {"path", mode()}}),
              static_cast<double>(kMiB))
        << "every byte under the data path that moved it";
    release = true;
    IoResult end = waitForPeerClose(client.fd.get(), Millis{10'000});
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
    EXPECT_TRUE(relay_.waitForMetric("zcrelay_half_closed_connections", metric::listener(), 0));
    EXPECT_TRUE(
        relay_.waitForMetric("zcrelay_connection_duration_seconds_count", metric::listener(), 1));
    EXPECT_GT(relay_.metric("zcrelay_connection_duration_seconds_sum", metric::listener())
                  .value_or(0),
              0.0);
    EXPECT_GT(relay_.metric("zcrelay_ring_sqes_submitted_total").value_or(0), 0.0);
    if (mode() == "splice") {
        EXPECT_GT(relay_.metric("zcrelay_splice_eagain_total").value_or(0), 0.0)
            << "a splice direction waits for its socket at least once";
    }
    auto fds = relay_.openFdCount();
    auto exported = relay_.metric("process_open_fds");
    ASSERT_TRUE(fds && exported);
    EXPECT_NEAR(*exported, *fds, 4) << "process_open_fds against /proc/PID/fd";
    EXPECT_EQ(relay_.metric("zcrelay_iowq_workers"), 0.0) << "the data path never blocks in io-wq";
}

// Full-duplex echoes keep both directions' sends waiting for room. io_uring hands a send that
// still finds no room after its own poll fired to an io-wq thread, which then blocks in
// sendmsg: before copy-path sends went MSG_DONTWAIT with their own POLLOUT wait, this left 1-3
// iou-wrk threads in copy mode (this test failed 4 runs of 5).
TEST_P(ConnectionMetricsTest, FullDuplexEchoesStartNoIoWqWorker) {
    // An echo that reads 1 KiB at a time, as `socat ... EXEC:cat` does through its pipes: slow
    // enough that the relay's sends towards it keep finding the socket full.
    ScriptedUpstream up(AF_INET, [](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                    ScriptedUpstream&) {
        char buf[1024];
        for (int i = 0; i < 1'000'000 && !stop.load(); ++i) {
            IoResult r = readSome(fd.get(), buf, sizeof buf, Millis{30'000});
            if (!r.ok() || r.bytes == 0) break;
            if (!writeAll(fd.get(), buf, r.bytes, Millis{30'000}).ok()) break;
            rec.bytes_received += r.bytes;
        }
        ::shutdown(fd.get(), SHUT_WR);
    });
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    std::atomic<int> exact{0};
    for (int round = 0; round < 4; ++round) {
        std::vector<std::thread> clients;
        for (int i = 0; i < 8; ++i) {
            clients.emplace_back([&, i] {
                Connected c = connectClient();
                if (!c.fd) return;
                ReceiveCheck r = echoRoundTrip(c.fd.get(), kSeedA + i, kMiB, Millis{30'000});
                if (r.io.status == IoStatus::Eof && r.bytes == kMiB && r.first_mismatch < 0)
                    ++exact;
            });
        }
        for (auto& t : clients) t.join();
    }
    EXPECT_EQ(exact.load(), 32) << "every echo byte-exact";
    EXPECT_EQ(relay_.metric("zcrelay_iowq_workers"), 0.0);
}
INSTANTIATE_TEST_SUITE_P(Modes, ConnectionMetricsTest, ::testing::ValuesIn(kModes), modeName);

// =============================================================================================
// 3, 4. Upstream connect failures.

class ConnectFailureTest : public RelayModeTest {};

TEST_P(ConnectFailureTest, RefusedUpstreamClosesClientPromptlyAndCountsRefused) {
    // Bound but not listening: the port stays ours and a SYN to it gets RST.
    Bound reserved = bindLoopbackNoListen(AF_INET);
    ASSERT_TRUE(reserved.fd) << reserved.error;
    ASSERT_NO_FATAL_FAILURE(startRelayTo(loopbackHostPort(AF_INET, reserved.port), mode()));

    auto t0 = Clock::now();
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << "the relay's listener itself must accept: " << client.error;
    IoResult end = waitForPeerClose(client.fd.get(), Millis{10'000});
    double elapsed = secondsSince(t0);
    EXPECT_TRUE(endedByPeer(end)) << "client should see EOF or RST when the upstream refuses; got "
                                  << end.describe();
    // At once: the other way would be connect_timeout (5 s) later; 4 s is room for a loaded
    // 2-core machine.
    EXPECT_LT(elapsed, 4.0) << "client must be closed at once when the upstream refuses";

    // `upstream:` is a cluster of one backend with the default retries: 2, so the refusal is
    // met three times, all within the one connect_timeout.
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectFailuresTotal, metric::reason("refused"), 3));
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("connect_failed"), 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    EXPECT_EQ(relay_.metric(metric::kConnectFailuresTotal, metric::reason("timeout")), 0.0)
        << "a refusal is not a timeout";
}

TEST_P(ConnectFailureTest, UpstreamThatDropsSynTimesOutClosesClientAndCountsTimeout) {
    if (::geteuid() != 0) GTEST_SKIP() << "adding an iptables rule needs root";
    auto iptables = findExecutable("iptables");
    if (!iptables) GTEST_SKIP() << "iptables is not installed";

    Listening blackhole = listenLoopback(AF_INET, 16);  // SYNs to it are dropped by the rule
    ASSERT_TRUE(blackhole.fd) << blackhole.error;
    SynDropRule rule(*iptables, blackhole.port);
    if (!rule.added()) GTEST_SKIP() << "could not add the iptables SYN-drop rule: " << rule.error();

    ASSERT_NO_FATAL_FAILURE(
        startRelayTo(loopbackHostPort(AF_INET, blackhole.port), mode(),
                     [](RelayConfig& c) { c.listeners[0].connect_timeout = "300ms"; }));

    auto t0 = Clock::now();
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    IoResult end = waitForPeerClose(client.fd.get(), Millis{10'000});
    double elapsed = secondsSince(t0);
    EXPECT_TRUE(endedByPeer(end)) << "client should see EOF or RST after connect_timeout; got "
                                  << end.describe();
    // 5 s: room for a loaded 2-core machine, and a connect that never times out still fails.
    EXPECT_LT(elapsed, 5.0) << "connect_timeout is 300ms; the client must be closed soon after";
    EXPECT_GE(elapsed, 0.25) << "closed before connect_timeout (300ms) could have expired";

    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectFailuresTotal, metric::reason("timeout"), 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("connect_failed"), 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
}

// A failed connect closes a client no data path has started for: splice only.
INSTANTIATE_TEST_SUITE_P(Modes, ConnectFailureTest, ::testing::Values("splice"), modeName);

// =============================================================================================
// 5. Resets mid-stream propagate promptly.

class ResetTest : public RelayModeTest {};

TEST_P(ResetTest, ClientResetMidStreamClosesUpstreamPromptlyAndCountsClientReset) {
    constexpr uint64_t kEndless = 1024 * kMiB;  // far more than the client will read
    ScriptedUpstream up(AF_INET, sourceScript(kSeedA, kEndless));
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    std::vector<uint8_t> buf(kMiB);
    IoResult r = readExactly(client.fd.get(), buf.data(), buf.size(), Millis{10'000});
    ASSERT_TRUE(r.ok()) << "client should get the first MiB while the upstream streams: "
                        << r.describe();
    PayloadVerifier v(kSeedA);
    v.update(buf);
    EXPECT_TRUE(v.intact()) << "first mismatch at " << v.firstMismatch();

    auto t0 = Clock::now();
    closeWithReset(client.fd);
    ASSERT_TRUE(up.waitForFinished(1, Millis{15'000}))
        << "the upstream was still sending 15 s after the client's RST: the relay did not close it";
    ConnRecord rec = up.records().at(0);
    double elapsed = std::chrono::duration<double>(rec.ended_at - t0).count();
    EXPECT_NE(rec.write_end.status, IoStatus::Ok)
        << "the upstream's send should fail (RST/EPIPE) once the relay closes it: "
        << rec.describe();
    EXPECT_LT(rec.bytes_sent, kEndless) << rec.describe();
    // Promptly: without it the connection would live to idle_timeout (300 s); 10 s is room for
    // a loaded 2-core machine.
    EXPECT_LT(elapsed, 10.0) << "upstream must see the close promptly after the client's RST; "
                             << rec.describe();

    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("client_reset"), 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
}

TEST_P(ResetTest, UpstreamResetMidStreamClosesClientPromptlyAndCountsUpstreamReset) {
    // 1 MiB, then RST, once the client's byte arrived: without the wait the relay can pass the
    // RST on before the client's own connect() has returned (its SO_ERROR then reads
    // ECONNRESET: a sanitizer run's sockmap case failed so at the connect).
    ScriptedUpstream up(AF_INET, resetScript(kSeedA, kMiB, /*wait_for_data=*/true));
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    ASSERT_EQ(writeAll(client.fd.get(), "x", 1).status, IoStatus::Ok);

    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeedA, Millis{10'000});
    auto client_end = Clock::now();
    EXPECT_TRUE(endedByPeer(got.io))
        << "client should see RST or EOF after the upstream's RST; " << got.describe();
    EXPECT_LT(got.first_mismatch, 0)
        << "what did arrive must be an intact prefix; " << got.describe();
    EXPECT_LE(got.bytes, kMiB) << got.describe();

    ASSERT_TRUE(up.waitForFinished(1, Millis{15'000}));
    ConnRecord rec = up.records().at(0);
    double elapsed = std::chrono::duration<double>(client_end - rec.ended_at).count();
    // As above: idle_timeout (300 s) is the other way; 10 s is room for a loaded machine.
    EXPECT_LT(elapsed, 10.0) << "client must see the close promptly after the upstream's RST";

    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("upstream_reset"), 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
}

INSTANTIATE_TEST_SUITE_P(Modes, ResetTest, ::testing::ValuesIn(kModes), modeName);

// =============================================================================================
// 6. A slow reader: the relay applies backpressure instead of buffering.

class SlowReaderTest : public RelayModeTest {};

TEST_P(SlowReaderTest, SlowClientGetsEveryByteWhileRelayMemoryStaysBounded) {
    constexpr uint64_t kTotal = 100 * kMiB;
    constexpr long kMaxGrowthKiB = 64 * 1024;
    ScriptedUpstream up(AF_INET, sourceScript(kSeedA, kTotal));
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    auto rss0 = relay_.rssKiB();
    ASSERT_TRUE(rss0) << "cannot read VmRSS of pid " << relay_.pid();
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    PayloadVerifier v(kSeedA);
    std::vector<uint8_t> buf(64 * kKiB);
    long max_rss = *rss0;
    IoResult last;
    // Slow phase: 64 KiB every 5 ms for a second (pacing the reader is the point of the test).
    auto slow_start = Clock::now();
    while (secondsSince(slow_start) < 1.0) {
        last = readSome(client.fd.get(), buf.data(), buf.size(), Millis{10'000});
        if (!last.ok()) break;
        v.update(std::span<const uint8_t>(buf.data(), last.bytes));
        if (auto rss = relay_.rssKiB()) max_rss = std::max(max_rss, *rss);
        std::this_thread::sleep_for(Millis{5});
    }
    ASSERT_TRUE(last.ok()) << "the stream ended during the slow phase: " << last.describe()
                           << " after " << v.bytes() << " bytes";
    EXPECT_LT(v.bytes(), kTotal) << "the slow phase should not have read everything";
    // Fast phase.
    IoResult end = readStreamUntilEof(
        client.fd.get(), [&](std::span<const uint8_t> d) { v.update(d); }, Millis{60'000});
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
    EXPECT_EQ(v.bytes(), kTotal);
    EXPECT_TRUE(v.intact()) << "first mismatch at byte " << v.firstMismatch();
    EXPECT_LT(max_rss - *rss0, kMaxGrowthKiB)
        << "relay RSS grew from " << *rss0 << " KiB to " << max_rss
        << " KiB while the client read slowly: it must apply backpressure, not buffer";
    client.fd.reset();
    expectCountersAfterDone(0, kTotal);
}

INSTANTIATE_TEST_SUITE_P(Modes, SlowReaderTest, ::testing::ValuesIn(kModes), modeName);

// Copy mode's buffers are a pool per worker (256 x 64 KiB). The kernel takes provided buffers
// in the order they were given; were the whole pool in its ring, one long transfer would touch
// every buffer in turn and the relay would keep 16 MiB resident for one connection. Only a few
// sit in the ring, topped up with the last recycled one (uring/buf_ring.hpp), so one
// connection touches its queue's worth plus those few: about 2.5 MiB.
TEST(CopyMemoryTest, OneLongTransferKeepsAFewBuffersResidentNotThePool) {
    constexpr uint64_t kTotal = 200 * kMiB;
    constexpr long kMaxGrowthKiB = 6 * 1024;
    RelayFixtureAccess f;
    ScriptedUpstream up(AF_INET, sourceScript(kSeedA, kTotal));
    ASSERT_NO_FATAL_FAILURE(f.startRelay(up, "copy"));
    auto rss0 = f.relay().rssKiB();
    ASSERT_TRUE(rss0) << "cannot read VmRSS of pid " << f.relay().pid();
    Connected client = f.connectClient();
    ASSERT_TRUE(client.fd) << client.error;
    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeedA, Millis{60'000});
    ASSERT_EQ(got.bytes, kTotal) << got.describe();
    ASSERT_LT(got.first_mismatch, 0) << got.describe();
    auto rss1 = f.relay().rssKiB();
    ASSERT_TRUE(rss1);
    EXPECT_LT(*rss1 - *rss0, kMaxGrowthKiB)
        << "relay RSS grew from " << *rss0 << " KiB to " << *rss1
        << " KiB over one 200 MiB copy transfer: it should touch a few buffers, not the pool";
}

// =============================================================================================
// 7, 8, 9. Many connections.

class ManyConnectionsTest : public RelayModeTest {};

TEST_P(ManyConnectionsTest, TwoHundredConcurrentEchoesAreByteExact) {
    constexpr size_t kConns = 200;
    constexpr uint64_t kBytes = 256 * kKiB;
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));

    struct Conn {
        Fd fd;
        uint64_t seed = 0;
        uint64_t sent = 0;
        std::unique_ptr<PayloadVerifier> verifier;
        IoResult end{IoStatus::Timeout, 0, 0};
        bool done = false;
    };
    std::vector<Conn> conns(kConns);
    for (size_t i = 0; i < kConns; ++i) {
        Connected c = connectClient();
        ASSERT_TRUE(c.fd) << "connection " << i << ": " << c.error;
        setNonBlocking(c.fd.get(), true);
        conns[i].fd = std::move(c.fd);
        conns[i].seed = 1000 + i;
        conns[i].verifier = std::make_unique<PayloadVerifier>(conns[i].seed);
    }

    // One poll loop drives all of them: write the payload, SHUT_WR, read the echo to EOF.
    std::vector<uint8_t> out(64 * kKiB);
    std::vector<uint8_t> in(64 * kKiB);
    size_t open = kConns;
    auto deadline = Clock::now() + Millis{60'000};
    while (open > 0 && Clock::now() < deadline) {
        std::vector<pollfd> pfds;
        std::vector<size_t> idx;
        for (size_t i = 0; i < kConns; ++i) {
            if (conns[i].done) continue;
            short ev = POLLIN;
            if (conns[i].sent < kBytes) ev |= POLLOUT;
            pfds.push_back({conns[i].fd.get(), ev, 0});
            idx.push_back(i);
        }
        if (::poll(pfds.data(), pfds.size(), 100) <= 0) continue;
        for (size_t k = 0; k < pfds.size(); ++k) {
            Conn& c = conns[idx[k]];
            if ((pfds[k].revents & POLLOUT) && c.sent < kBytes) {
                size_t n = static_cast<size_t>(std::min<uint64_t>(out.size(), kBytes - c.sent));
                fillPayload(c.seed, c.sent, std::span<uint8_t>(out.data(), n));
                ssize_t w = ::send(c.fd.get(), out.data(), n, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (w > 0) c.sent += static_cast<uint64_t>(w);
                if (c.sent == kBytes) ::shutdown(c.fd.get(), SHUT_WR);
            }
            if (pfds[k].revents & (POLLIN | POLLERR | POLLHUP)) {
                for (;;) {
                    ssize_t r = ::recv(c.fd.get(), in.data(), in.size(), MSG_DONTWAIT);
                    if (r > 0) {
                        c.verifier->update(std::span<const uint8_t>(in.data(), r));
                        continue;
                    }
                    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
                    if (r < 0 && errno == EINTR) continue;
                    c.end = r == 0 ? IoResult{IoStatus::Eof, c.verifier->bytes(), 0}
                                   : IoResult{IoStatus::Reset, c.verifier->bytes(), errno};
                    c.done = true;
                    --open;
                    break;
                }
            }
        }
    }

    size_t bad = 0;
    std::string first_bad;
    for (size_t i = 0; i < kConns; ++i) {
        const Conn& c = conns[i];
        bool ok = c.end.status == IoStatus::Eof && c.sent == kBytes &&
                  c.verifier->bytes() == kBytes && c.verifier->intact();
        if (!ok && bad++ < 5) {
            first_bad += "\n  conn " + std::to_string(i) + ": sent " + std::to_string(c.sent) +
                         ", echoed " + std::to_string(c.verifier->bytes()) + ", mismatch at " +
                         std::to_string(c.verifier->firstMismatch()) + ", end " + c.end.describe();
        }
    }
    EXPECT_EQ(bad, 0u) << "connections whose echo was not byte-exact then EOF:" << first_bad;
    conns.clear();
    EXPECT_TRUE(up.waitForFinished(kConns, Millis{10'000}))
        << "upstream saw " << up.finished() << " of " << kConns << " connections end";
    expectCountersAfterDone(kConns * kBytes, kConns * kBytes, kConns);
}

TEST_P(ManyConnectionsTest, ThousandIdleConnectionsUseFewThreadsAndNoPipes) {
    constexpr size_t kConns = 1000;
    constexpr int kWorkers = 2;
    ScriptedUpstream up(AF_INET, nullptr);  // accept and hold, no thread per connection
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode(), [](RelayConfig& c) { c.workers = kWorkers; }));

    std::vector<Fd> clients;
    clients.reserve(kConns);
    for (size_t i = 0; i < kConns; ++i) {
        Connected c = connectClient();
        ASSERT_TRUE(c.fd) << "connection " << i << ": " << c.error;
        clients.push_back(std::move(c.fd));
    }
    EXPECT_TRUE(up.waitForAccepted(kConns, Millis{30'000}))
        << "the relay opened " << up.accepted() << " of " << kConns << " upstream connections";
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(),
                                     static_cast<double>(kConns), Millis{30'000}));

    auto threads = relay_.threadCount();
    ASSERT_TRUE(threads) << "cannot read Threads: of pid " << relay_.pid();
    EXPECT_LE(*threads, kWorkers + 8)
        << "idle connections must not cost threads: workers=" << kWorkers;
    EXPECT_TRUE(relay_.waitForMetric(metric::kPipesInUse, {}, 0))
        << "idle connections must hold no pipes";

    clients.clear();
    up.stop();  // the upstream ends too, so every connection finishes
    EXPECT_TRUE(
        relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0, Millis{30'000}));
}

TEST_P(ManyConnectionsTest, ThousandShortConnectionsLeakNoFileDescriptors) {
    constexpr size_t kConns = 1000;
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));

    auto baseline = relay_.openFdCount();  // before any scrape: no metrics socket is open
    ASSERT_TRUE(baseline) << "cannot list /proc/" << relay_.pid() << "/fd";
    auto cached0 = relay_.metric(metric::kPipesCached);

    auto deadline = Clock::now() + Millis{120'000};
    std::vector<uint8_t> msg(64);
    std::vector<uint8_t> echo(64);
    for (size_t i = 0; i < kConns; ++i) {
        ASSERT_LT(Clock::now(), deadline) << "only " << i << " short connections in 120 s";
        Connected c = connectClient();
        ASSERT_TRUE(c.fd) << "connection " << i << ": " << c.error;
        fillPayload(i, 0, msg);
        IoResult w = writeAll(c.fd.get(), msg.data(), msg.size(), Millis{5'000});
        ASSERT_TRUE(w.ok()) << "connection " << i << ": " << w.describe();
        IoResult r = readExactly(c.fd.get(), echo.data(), echo.size(), Millis{5'000});
        ASSERT_TRUE(r.ok()) << "connection " << i << " echo: " << r.describe();
        ASSERT_EQ(msg, echo) << "connection " << i << " echo differs";
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsTotal, metric::listener(),
                                     static_cast<double>(kConns)));
    EXPECT_TRUE(
        relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0, Millis{20'000}));
    EXPECT_TRUE(relay_.waitForMetric(metric::kPipesInUse, {}, 0))
        << "every pipe must be back in the pool once no connection is active";

    // Pipes kept in a per-worker cache legitimately outlive connections (2 fds each). If the relay
    // exports zcrelay_pipes_cached, the count must be exact. The contract does not list that
    // gauge, so otherwise allow one modest pool (64 fds = 32 pipes): a leak of even one fd per
    // connection would show up as ~1000 here.
    constexpr int kPoolAllowanceFds = 64;
    int expected = *baseline;
    int last = -1;
    bool exact = false;
    bool settled = waitUntil(
        [&] {
            auto cached = relay_.metric(metric::kPipesCached);
            exact = cached0.has_value() && cached.has_value();
            if (exact) expected = *baseline + 2 * static_cast<int>(*cached - *cached0);
            last = relay_.openFdCount().value_or(-1);
            // The scrape above opens one short-lived socket in the relay; +1 while it closes.
            return exact ? (last == expected || last == expected + 1)
                         : (last >= 0 && last <= *baseline + kPoolAllowanceFds);
        },
        Millis{20'000});
    if (exact) {
        EXPECT_TRUE(settled) << "open fds: baseline " << *baseline << ", now " << last
                             << ", expected " << expected << " (baseline + 2 x pipes cached)";
    } else {
        EXPECT_TRUE(settled) << "open fds: baseline " << *baseline << ", now " << last << " after "
                             << kConns << " connections (allowed up to baseline + "
                             << kPoolAllowanceFds << " for a pipe cache)";
    }
}

INSTANTIATE_TEST_SUITE_P(Modes, ManyConnectionsTest, ::testing::ValuesIn(kModes), modeName);

// =============================================================================================
// 11. Idle timeout.

class IdleTimeoutTest : public RelayModeTest {
  protected:
    // 1 s: a trickle every 100 ms stays far inside it even when a loaded machine holds the
    // client thread back for a few hundred ms.
    static void shortIdle(RelayConfig& c) { c.listeners[0].idle_timeout = "1s"; }
};

TEST_P(IdleTimeoutTest, SilentConnectionIsClosedAfterIdleTimeout) {
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode(), shortIdle));
    auto t0 = Clock::now();
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    IoResult end = waitForPeerClose(client.fd.get(), Millis{15'000});
    double elapsed = secondsSince(t0);
    EXPECT_TRUE(endedByPeer(end)) << "an idle connection must be closed; got " << end.describe();
    // 10 s: room for a loaded 2-core machine; a timer that never fires still fails.
    EXPECT_LT(elapsed, 10.0) << "idle_timeout is 1s";
    EXPECT_GE(elapsed, 0.9) << "closed before idle_timeout (1s) could have expired";
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("idle_timeout"), 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
}

TEST_P(IdleTimeoutTest, TricklingConnectionIsNotClosedByIdleTimeout) {
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode(), shortIdle));
    Connected client = connectClient();
    ASSERT_TRUE(client.fd) << client.error;

    // One byte every 100 ms for 2.5 s, more than twice idle_timeout: never 1 s without traffic.
    auto start = Clock::now();
    for (int i = 0; secondsSince(start) < 2.5; ++i) {
        ASSERT_LT(i, 100) << "loop bound";
        uint8_t b = static_cast<uint8_t>(i);
        uint8_t back = 0;
        IoResult w = writeAll(client.fd.get(), &b, 1, Millis{10'000});
        ASSERT_TRUE(w.ok()) << "byte " << i << " at " << secondsSince(start)
                            << " s: " << w.describe();
        IoResult r = readExactly(client.fd.get(), &back, 1, Millis{10'000});
        ASSERT_TRUE(r.ok()) << "echo of byte " << i << " at " << secondsSince(start)
                            << " s: a trickling connection was closed: " << r.describe();
        ASSERT_EQ(back, b);
        std::this_thread::sleep_for(Millis{100});  // the trickle's pace
    }
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("idle_timeout")), 0.0)
        << "no connection may have hit the idle timeout";
    client.fd.reset();
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1));
}

INSTANTIATE_TEST_SUITE_P(Modes, IdleTimeoutTest, ::testing::ValuesIn(kModes), modeName);

// =============================================================================================
// 12. Metrics.

class MetricsTest : public RelayModeTest {};
// The series a relay exports before any connection: naming, the same in every mode.
class MetricsAtStartTest : public RelayModeTest {};

TEST_P(MetricsAtStartTest, EveryLabelCombinationIsExportedAtZeroFromStart) {
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    std::string error;
    auto body = relay_.scrape(&error);
    ASSERT_TRUE(body) << error;
    auto expectZero = [&](const char* name, const Labels& labels) {
        auto v = findSample(*body, name, labels);
        EXPECT_TRUE(v.has_value()) << formatSeries(name, labels) << " must exist from the start";
        if (v) {
            EXPECT_EQ(*v, 0.0) << formatSeries(name, labels) << " must start at 0";
        }
    };
    expectZero(metric::kConnectionsTotal, metric::listener());
    expectZero(metric::kConnectionsActive, metric::listener());
    expectZero(metric::kBytesTotal, metric::bytes("upstream"));
    expectZero(metric::kBytesTotal, metric::bytes("downstream"));
    for (std::string_view r : metric::kConnectFailureReasons)
        expectZero(metric::kConnectFailuresTotal, metric::reason(std::string(r)));
    for (std::string_view r : metric::kClosedReasons)
        expectZero(metric::kClosedTotal, metric::reason(std::string(r)));
    for (std::string_view r : metric::kPipeFallbackReasons)
        expectZero(metric::kPipeFallbacksTotal, {{"reason", std::string(r)}});
    expectZero(metric::kPipesInUse, {});
    expectZero(metric::kAcceptPausedTotal, {});
    auto threads = findSample(*body, metric::kProcessThreads, {});
    EXPECT_TRUE(threads.has_value()) << metric::kProcessThreads << " must exist";
    if (threads) {
        EXPECT_GE(*threads, 1.0);
    }
}

TEST_P(MetricsTest, ThreeKnownTransfersAreCountedExactly) {
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up, mode()));
    const uint64_t sizes[] = {1000, 64 * kKiB + 7, 300'000};
    uint64_t total = 0;
    for (uint64_t size : sizes) {
        Connected client = connectClient();
        ASSERT_TRUE(client.fd) << client.error;
        ReceiveCheck got = echoRoundTrip(client.fd.get(), kSeedA + size, size, Millis{30'000});
        ASSERT_EQ(got.io.status, IoStatus::Eof) << got.describe();
        ASSERT_EQ(got.bytes, size) << got.describe();
        ASSERT_LT(got.first_mismatch, 0) << got.describe();
        total += size;
    }
    expectCountersAfterDone(total, total, 3);
}

INSTANTIATE_TEST_SUITE_P(Modes, MetricsTest, ::testing::ValuesIn(kModes), modeName);
INSTANTIATE_TEST_SUITE_P(Modes, MetricsAtStartTest, ::testing::Values("splice"), modeName);

}  // namespace
}  // namespace zcrelay::test::relay_test
