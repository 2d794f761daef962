// The published method: netcat-openbsd on both ends of zcrelay, a 64 MiB file through it, and the
// client nc must finish on its own (FIN propagated end to end). Every mode.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "integration/auto_mode_fixture.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::nc_test {
namespace {

constexpr uint64_t kFileBytes = 64ull << 20;
constexpr uint64_t kSeed = 0x64F11E;
constexpr Millis kClientLimit{60'000};

struct FileDigest {
    uint64_t bytes = 0;
    uint64_t hash = 0;
    bool operator==(const FileDigest&) const = default;
};

std::ostream& operator<<(std::ostream& os, const FileDigest& d) {
    return os << d.bytes << " bytes, fnv1a64 0x" << std::hex << d.hash << std::dec;
}

FileDigest digestFile(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    StreamHash h;
    std::vector<char> buf(1 << 20);
    while (in) {
        in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
        auto n = static_cast<size_t>(in.gcount());
        if (n == 0) break;
        h.update(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(buf.data()), n));
    }
    return {h.bytes(), h.value()};
}

// Writes `bytes` of payload `seed` (pseudo-random, reproducible) to `path`.
bool writePayloadFile(const std::string& path, uint64_t seed, uint64_t bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    std::vector<uint8_t> buf(1 << 20);
    for (uint64_t off = 0; off < bytes;) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), bytes - off));
        fillPayload(seed, off, std::span<uint8_t>(buf.data(), n));
        out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(n));
        off += n;
    }
    return static_cast<bool>(out.flush());
}

// A loopback port that is free right now (bound to port 0, then released for nc to take).
uint16_t freeLoopbackPort() {
    Listening l = listenLoopback(AF_INET, 1);
    return l.port;
}

class NcTest : public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        auto nc = findExecutable("nc");
        if (!nc) GTEST_SKIP() << "nc is not installed (the method needs netcat-openbsd)";
        CommandResult help = runCommand({*nc, "-h"}, Millis{5'000});
        if ((help.out + help.err).find("OpenBSD") == std::string::npos)
            GTEST_SKIP() << *nc << " is not netcat-openbsd (needs -N and -d semantics)";
        nc_ = *nc;
        ASSERT_FALSE(dir_.path().empty()) << "mkdtemp failed";
        src_ = dir_.file("src.bin");
        ASSERT_TRUE(writePayloadFile(src_, kSeed, kFileBytes)) << "cannot write " << src_;
        src_digest_ = digestFile(src_);
        ASSERT_EQ(src_digest_.bytes, kFileBytes);
    }

    // Spawns an nc that listens on a free loopback port and waits until it does.
    void startUpstreamNc(ChildProcess& nc, std::vector<std::string> flags,
                         const std::string& stdin_path, const std::string& stdout_path,
                         uint16_t& port) {
        port = freeLoopbackPort();
        ASSERT_NE(port, 0);
        ChildProcess::Options o;
        o.argv = {nc_};
        o.argv.insert(o.argv.end(), flags.begin(), flags.end());
        o.argv.insert(o.argv.end(), {"-l", "127.0.0.1", std::to_string(port)});
        o.stdin_path = stdin_path;
        o.stdout_path = stdout_path;
        o.stderr_path = dir_.file("upstream-nc.err");
        std::string error;
        ASSERT_TRUE(nc.spawn(o, error)) << error;
        ASSERT_TRUE(waitUntil([&] { return listensOnLoopback4(port); }, Millis{5'000}))
            << "upstream nc never listened on 127.0.0.1:" << port
            << "; stderr: " << readFileText(o.stderr_path);
    }

    void startRelay(uint16_t upstream_port) {
        ASSERT_TRUE(relay_.start(
            singleListenerConfig(loopbackHostPort(AF_INET, upstream_port), GetParam())));
    }

    // Waits (bounded) for the client nc to exit by itself; kills it and fails otherwise.
    void expectClientFinishes(ChildProcess& client, const std::string& what) {
        auto status = client.waitExit(kClientLimit);
        if (!status) {
            ExitStatus killed = client.killAndWait();
            FAIL() << what << ": client nc did not terminate on its own within "
                   << kClientLimit.count() / 1000 << " s (" << killed.describe()
                   << "): the FIN was not propagated\nclient stderr: "
                   << readFileText(dir_.file("client-nc.err")) << "\n"
                   << relay_.diagnostics();
        }
        EXPECT_TRUE(status->cleanExit())
            << what << ": client nc " << status->describe()
            << "; stderr: " << readFileText(dir_.file("client-nc.err"));
    }

    // mode auto: the file is one long turn, never promoted, so at most 5 % of it (in fact
    // nothing) moves through user memory.
    void expectAutoKeepsItInTheKernel() {
        if (GetParam() != "auto") return;
        auto_mode_test::PathBytes b = auto_mode_test::pathBytes(relay_);
        EXPECT_TRUE(auto_mode_test::mostlyInTheKernel(b, static_cast<double>(kFileBytes)));
    }

    std::string nc_;
    TempDir dir_;
    std::string src_;
    FileDigest src_digest_;
    RelayProcess relay_;
};

TEST_P(NcTest, FileSentByNcClientArrivesWholeAndClientExits) {
    ChildProcess upstream;
    uint16_t upstream_port = 0;
    std::string sink = dir_.file("sink.bin");
    // nc -l 127.0.0.1 PORT > sink   (explicit port, no -p)
    ASSERT_NO_FATAL_FAILURE(startUpstreamNc(upstream, {}, "/dev/null", sink, upstream_port));
    ASSERT_NO_FATAL_FAILURE(startRelay(upstream_port));

    // nc -N 127.0.0.1 RELAYPORT < src
    ChildProcess client;
    ChildProcess::Options o;
    o.argv = {nc_, "-N", "127.0.0.1", std::to_string(relay_.port())};
    o.stdin_path = src_;
    o.stdout_path = dir_.file("client.out");
    o.stderr_path = dir_.file("client-nc.err");
    std::string error;
    ASSERT_TRUE(client.spawn(o, error)) << error;
    ASSERT_NO_FATAL_FAILURE(expectClientFinishes(client, "nc -N client sending 64 MiB"));

    auto up_status = upstream.waitExit(Millis{10'000});
    ASSERT_TRUE(up_status) << "upstream nc -l still running after the client finished";
    EXPECT_TRUE(up_status->cleanExit()) << up_status->describe();
    EXPECT_EQ(digestFile(sink), src_digest_) << "the sink file must equal the source file";
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"),
                                     static_cast<double>(kFileBytes)));
    expectAutoKeepsItInTheKernel();
}

TEST_P(NcTest, FileServedByNcUpstreamArrivesWholeAndClientExits) {
    ChildProcess upstream;
    uint16_t upstream_port = 0;
    // nc -N -l 127.0.0.1 PORT < src
    ASSERT_NO_FATAL_FAILURE(
        startUpstreamNc(upstream, {"-N"}, src_, dir_.file("upstream.out"), upstream_port));
    ASSERT_NO_FATAL_FAILURE(startRelay(upstream_port));

    // nc -d 127.0.0.1 RELAYPORT > out
    std::string out = dir_.file("out.bin");
    ChildProcess client;
    ChildProcess::Options o;
    o.argv = {nc_, "-d", "127.0.0.1", std::to_string(relay_.port())};
    o.stdout_path = out;
    o.stderr_path = dir_.file("client-nc.err");
    std::string error;
    ASSERT_TRUE(client.spawn(o, error)) << error;
    ASSERT_NO_FATAL_FAILURE(expectClientFinishes(client, "nc -d client receiving 64 MiB"));

    auto up_status = upstream.waitExit(Millis{10'000});
    ASSERT_TRUE(up_status) << "upstream nc -N -l still running after the client finished";
    EXPECT_TRUE(up_status->cleanExit()) << up_status->describe();
    EXPECT_EQ(digestFile(out), src_digest_) << "the received file must equal the served file";
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("downstream"),
                                     static_cast<double>(kFileBytes)));
    expectAutoKeepsItInTheKernel();
}

INSTANTIATE_TEST_SUITE_P(Modes, NcTest, ::testing::Values("splice", "copy", "sockmap", "auto"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace zcrelay::test::nc_test
