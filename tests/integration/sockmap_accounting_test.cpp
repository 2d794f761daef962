// What is counted and held after sockmap connections: the kernel's maps empty after a thousand
// pairs, and the byte counters equal to those of splice and copy.
#include <bpf/bpf.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "integration/sockmap_fixture.hpp"

namespace zcrelay::test::sockmap_test {
namespace {

// ---------------------------------------------------------------------------------------------
// The relay's BPF maps, seen from outside through the kernel's ids.

struct RelayMaps {
    std::vector<uint32_t> sockhash;  // BPF_MAP_TYPE_SOCKHASH (18): the sockets
    std::vector<uint32_t> hash;      // BPF_MAP_TYPE_HASH (1): the links
    std::string error;
};

// The ids of the BPF maps whose fds `pid` holds, from /proc/PID/fdinfo/N ("map_type:" and
// "map_id:" lines, present only for BPF map fds).
RelayMaps findRelayMaps(pid_t pid) {
    RelayMaps out;
    std::string dir = "/proc/" + std::to_string(pid) + "/fdinfo";
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) {
        out.error = "opendir " + dir + ": " + std::strerror(errno);
        return out;
    }
    while (dirent* e = ::readdir(d)) {
        if (e->d_name[0] == '.') continue;
        std::ifstream in(dir + "/" + e->d_name);
        std::string line;
        std::optional<long> type;
        std::optional<long> id;
        while (std::getline(in, line)) {
            if (line.rfind("map_type:", 0) == 0) type = std::strtol(line.c_str() + 9, nullptr, 10);
            if (line.rfind("map_id:", 0) == 0) id = std::strtol(line.c_str() + 7, nullptr, 10);
        }
        if (!type || !id) continue;
        if (*type == BPF_MAP_TYPE_SOCKHASH) out.sockhash.push_back(static_cast<uint32_t>(*id));
        if (*type == BPF_MAP_TYPE_HASH) out.hash.push_back(static_cast<uint32_t>(*id));
    }
    ::closedir(d);
    return out;
}

// Keys in map `id`, walked with BPF_MAP_GET_NEXT_KEY; nullopt with `error` on failure.
std::optional<uint64_t> countKeys(uint32_t id, std::string& error) {
    Fd fd(bpf_map_get_fd_by_id(id));
    if (!fd) {
        error = "bpf_map_get_fd_by_id(" + std::to_string(id) + "): " + std::strerror(errno);
        return std::nullopt;
    }
    bpf_map_info info{};
    uint32_t len = sizeof info;
    if (bpf_obj_get_info_by_fd(fd.get(), &info, &len) != 0) {
        error = "bpf_obj_get_info_by_fd: " + std::string(std::strerror(errno));
        return std::nullopt;
    }
    std::vector<uint8_t> key(info.key_size);
    std::vector<uint8_t> next(info.key_size);
    uint64_t n = 0;
    const void* prev = nullptr;
    // Bounded by the map's size: a walk that does not end is an error, not a hang.
    while (n <= info.max_entries) {
        if (bpf_map_get_next_key(fd.get(), prev, next.data()) != 0) {
            if (errno == ENOENT) return n;
            error = "bpf_map_get_next_key: " + std::string(std::strerror(errno));
            return std::nullopt;
        }
        ++n;
        key.swap(next);
        prev = key.data();
    }
    error = "map " + std::to_string(id) + " walk did not end";
    return std::nullopt;
}

struct MapCounts {
    uint64_t sockets = 0;
    uint64_t links = 0;
    std::string error;
    std::string describe() const {
        return error.empty() ? "SOCKHASH " + std::to_string(sockets) + " keys, HASH (links) " +
                                   std::to_string(links) + " keys"
                             : error;
    }
};

MapCounts countRelayMapKeys(pid_t pid) {
    MapCounts out;
    RelayMaps maps = findRelayMaps(pid);
    if (!maps.error.empty()) {
        out.error = maps.error;
        return out;
    }
    if (maps.sockhash.size() != 1 || maps.hash.size() != 1) {
        out.error = "expected one SOCKHASH and one HASH map fd in /proc/" + std::to_string(pid) +
                    "/fdinfo, found " + std::to_string(maps.sockhash.size()) + " and " +
                    std::to_string(maps.hash.size());
        return out;
    }
    auto s = countKeys(maps.sockhash[0], out.error);
    if (!s) return out;
    auto l = countKeys(maps.hash[0], out.error);
    if (!l) return out;
    out.sockets = *s;
    out.links = *l;
    return out;
}

// =============================================================================================
// A thousand pairs in and out: the maps end empty, as the kernel sees them.

TEST_F(SockmapTest, ThousandPairsLeaveTheMapsEmpty) {
    constexpr size_t kHeld = 10;
    constexpr size_t kThreads = 50;
    constexpr size_t kPerThread = 20;
    constexpr size_t kTotal = kHeld + kThreads * kPerThread;
    constexpr size_t kMessage = 100;
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_NO_FATAL_FAILURE(startRelay(up));

    // First, that the inspection sees what the relay holds: ten live pairs are twenty sockets
    // and twenty links.
    std::vector<Fd> held;
    for (size_t i = 0; i < kHeld; ++i) {
        Connected c = connectClient();
        ASSERT_TRUE(c.fd) << c.error;
        uint8_t b = static_cast<uint8_t>(i);
        ASSERT_TRUE(writeAll(c.fd.get(), &b, 1, kAnswerDeadline).ok());
        ASSERT_TRUE(readExactly(c.fd.get(), &b, 1, kAnswerDeadline).ok()) << "held " << i;
        held.push_back(std::move(c.fd));
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kSockmapSockets, {}, 2.0 * kHeld));
    MapCounts live = countRelayMapKeys(relay_.pid());
    ASSERT_EQ(live.error, "") << live.describe();
    EXPECT_EQ(live.sockets, 2 * kHeld) << live.describe();
    EXPECT_EQ(live.links, 2 * kHeld) << live.describe();
    held.clear();

    std::atomic<size_t> failures{0};
    std::mutex mu;
    std::string first_failure;
    std::vector<std::thread> threads;
    for (size_t t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            std::vector<uint8_t> msg(kMessage);
            std::vector<uint8_t> echo(kMessage);
            for (size_t k = 0; k < kPerThread; ++k) {
                std::string error;
                Connected c = connectClient();
                if (!c.fd) {
                    error = c.error;
                } else {
                    fillPayload(t * kPerThread + k, 0, msg);
                    IoResult w = writeAll(c.fd.get(), msg.data(), msg.size(), kAnswerDeadline);
                    IoResult r =
                        w.ok() ? readExactly(c.fd.get(), echo.data(), echo.size(), kAnswerDeadline)
                               : w;
                    if (!r.ok()) {
                        error = "echo: " + r.describe();
                    } else if (echo != msg) {
                        error = "echo differs";
                    } else {
                        ::shutdown(c.fd.get(), SHUT_WR);
                        IoResult end = waitForPeerClose(c.fd.get(), kAnswerDeadline);
                        if (end.status != IoStatus::Eof) error = "close: " + end.describe();
                    }
                }
                if (!error.empty()) {
                    std::lock_guard lock(mu);
                    if (failures.fetch_add(1) == 0)
                        first_failure = "thread " + std::to_string(t) + " connection " +
                                        std::to_string(k) + ": " + error;
                }
            }
        });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(failures.load(), 0u) << "first: " << first_failure;

    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsTotal, metric::listener(),
                                     static_cast<double>(kTotal), Millis{20'000}));
    EXPECT_TRUE(
        relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0, Millis{20'000}));
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), double{kTotal}));
    EXPECT_TRUE(relay_.waitForMetric(metric::kSockmapSockets, {}, 0));
    // A scrape may see a connection counted closed a moment before its worker took it out of
    // the maps: poll briefly.
    MapCounts after;
    bool empty = waitUntil(
        [&] {
            after = countRelayMapKeys(relay_.pid());
            return after.error.empty() && after.sockets == 0 && after.links == 0;
        },
        kPrompt);
    EXPECT_TRUE(empty) << "after " << kTotal
                       << " connections closed the kernel's maps hold: " << after.describe();
    expectNoFallbacks();
}

// =============================================================================================
// The byte counters: the kernel's count and the user-space paths' agree.

TEST_F(SockmapTest, SameBytesCountedInAllModes) {
    constexpr uint64_t kUp = 3 * kMiB;
    constexpr uint64_t kDown = 5 * kMiB;
    // Replies from its first read on, while it keeps reading to EOF.
    ScriptedUpstream up(
        AF_INET, [](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream&) {
            StreamHash h;
            std::vector<uint8_t> buf(64 * kKiB);
            IoResult first = readSome(fd.get(), buf.data(), buf.size(), kBulkDeadline, &stop);
            if (!first.ok()) {
                rec.read_end = first;
                return;
            }
            h.update(std::span<const uint8_t>(buf.data(), first.bytes));
            std::thread writer([&] {
                rec.write_end = sendPayload(fd.get(), kSeedB, kDown, kBulkDeadline, &stop);
                rec.bytes_sent = rec.write_end.bytes;
                ::shutdown(fd.get(), SHUT_WR);
            });
            rec.read_end = readStreamUntilEof(
                fd.get(), [&](std::span<const uint8_t> d) { h.update(d); }, kBulkDeadline, &stop);
            writer.join();
            rec.bytes_received = h.bytes();
            rec.received_hash = h.value();
        });
    ASSERT_TRUE(up.ok()) << up.error();

    struct Counted {
        double upstream = -1;
        double downstream = -1;
    };
    std::map<std::string, Counted> counted;
    for (const std::string mode : {"splice", "copy", "sockmap"}) {
        SCOPED_TRACE("mode " + mode);
        RelayProcess relay;
        ASSERT_TRUE(relay.start(singleListenerConfig(up.hostPort(), mode)));
        ASSERT_EQ(relay.metric(metric::kDatapathInfo, metric::datapath(mode)), 1.0);
        Connected client = connectTo(relay.host(), relay.port());
        ASSERT_TRUE(client.fd) << client.error;

        // The client's FIN waits for the upstream's first byte: the pair is set up by then.
        std::atomic<bool> answered{false};
        IoResult sent;
        std::thread writer([&] {
            sent = sendPayload(client.fd.get(), kSeedA, kUp, kBulkDeadline);
            if (sent.ok() && waitUntil([&] { return answered.load(); }, kBulkDeadline, Millis{1}))
                ::shutdown(client.fd.get(), SHUT_WR);
        });
        PayloadVerifier v(kSeedB);
        IoResult end = readStreamUntilEof(
            client.fd.get(),
            [&](std::span<const uint8_t> d) {
                v.update(d);
                answered.store(true);
            },
            kBulkDeadline);
        if (end.status != IoStatus::Eof) ::shutdown(client.fd.get(), SHUT_RDWR);
        writer.join();
        EXPECT_TRUE(sent.ok()) << sent.describe();
        EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
        EXPECT_EQ(v.bytes(), kDown);
        EXPECT_TRUE(v.intact()) << "first mismatch at " << v.firstMismatch();
        client.fd.reset();

        EXPECT_TRUE(relay.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1));
        EXPECT_TRUE(relay.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
        EXPECT_TRUE(relay.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"),
                                        static_cast<double>(kUp)));
        EXPECT_TRUE(relay.waitForMetric(metric::kBytesTotal, metric::bytes("downstream"),
                                        static_cast<double>(kDown)));
        auto body = relay.scrape();
        ASSERT_TRUE(body);
        counted[mode] = {
            findSample(*body, metric::kBytesTotal, metric::bytes("upstream")).value_or(-1),
            findSample(*body, metric::kBytesTotal, metric::bytes("downstream")).value_or(-1)};
        if (mode == "sockmap") {
            // The client's FIN came after the pair was set up; the upstream spoke only after
            // the client's bytes came through: every fallback is 0, whatever reasons exist.
            bool any = false;
            for (const Sample& x : parseMetrics(*body)) {
                if (x.name != metric::kSockmapFallbacksTotal) continue;
                any = true;
                EXPECT_EQ(x.value, 0.0) << formatSeries(x.name, x.labels);
            }
            EXPECT_TRUE(any) << metric::kSockmapFallbacksTotal << " is not exported";
        }
        EXPECT_EQ(relay.terminate().code, 0);
    }
    ASSERT_TRUE(up.waitForFinished(3, Millis{5'000}));
    for (const ConnRecord& rec : up.records()) {
        EXPECT_EQ(rec.bytes_received, kUp) << rec.describe();
        EXPECT_EQ(rec.received_hash, payloadHash(kSeedA, kUp)) << rec.describe();
    }
    for (const auto& [mode, c] : counted) {
        EXPECT_EQ(c.upstream, static_cast<double>(kUp)) << mode;
        EXPECT_EQ(c.downstream, static_cast<double>(kDown)) << mode;
        EXPECT_EQ(c.upstream, counted["splice"].upstream) << mode << " vs splice";
        EXPECT_EQ(c.downstream, counted["splice"].downstream) << mode << " vs splice";
    }
}

}  // namespace
}  // namespace zcrelay::test::sockmap_test
