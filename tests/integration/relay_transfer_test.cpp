// Byte-exact transfers through the relay in every data path: sizes x directions, IPv4 and
// IPv6; Nagle left on; bursts of small writes echoed back whole every time.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "integration/relay_fixture.hpp"

namespace zcrelay::test::relay_test {
namespace {

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

}  // namespace
}  // namespace zcrelay::test::relay_test
