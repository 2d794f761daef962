// Loops the config and discovery cannot see, caught at run time (proxy/loop_guard.hpp): two
// listeners of one relay whose backends lead to each other through DNAT rules, in every data
// path. And the other side of the same check: clients and the relay's upstream sockets made to
// share local ports (a ten-port ephemeral range) are never taken for a loop.
//
// Each case runs in a network namespace of its own (made on the first case of the process, as
// ctest runs one case per process), so its NAT rules and port range touch nothing else.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::loop_test {
namespace {

// "" once this process runs in a namespace of its own with lo up, else why not.
const std::string& ownNetns() {
    static const std::string why = [] () -> std::string {
        if (::unshare(CLONE_NEWNET) != 0)
            return std::string("unshare(CLONE_NEWNET): ") + std::strerror(errno);
        Fd s(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
        ifreq ifr{};
        std::strcpy(ifr.ifr_name, "lo");
        if (::ioctl(s.get(), SIOCGIFFLAGS, &ifr) != 0) return "SIOCGIFFLAGS lo failed";
        ifr.ifr_flags |= IFF_UP;
        if (::ioctl(s.get(), SIOCSIFFLAGS, &ifr) != 0) return "cannot bring lo up";
        return "";
    }();
    return why;
}

bool writeSysctl(const std::string& path, const std::string& value) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const bool ok = ::write(fd, value.data(), value.size()) == static_cast<ssize_t>(value.size());
    ::close(fd);
    return ok;
}

class LoopTest : public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "a network namespace and NAT rules need root";
        if (!ownNetns().empty()) GTEST_SKIP() << ownNetns();
        // An earlier case of this process (the binary run by hand) may have left its rules.
        if (auto iptables = findExecutable("iptables"))
            runCommand({*iptables, "-w", "-t", "nat", "-F", "OUTPUT"});
    }
    const std::string& mode() const { return GetParam(); }

    // `iptables -t nat -A OUTPUT ...` in this case's namespace: gone with it.
    ::testing::AssertionResult dnat(const std::string& from_ip, uint16_t from_port,
                                    uint16_t to_port) {
        auto iptables = findExecutable("iptables");
        if (!iptables) return ::testing::AssertionFailure() << "iptables is not installed";
        CommandResult r = runCommand({*iptables, "-w", "-t", "nat", "-A", "OUTPUT", "-p", "tcp",
                                      "-d", from_ip, "--dport", std::to_string(from_port), "-j",
                                      "DNAT", "--to-destination",
                                      "127.0.0.1:" + std::to_string(to_port)});
        if (!r.status.cleanExit()) return ::testing::AssertionFailure() << r.describe();
        return ::testing::AssertionSuccess();
    }

    RelayProcess relay_;
};

// Listener a's backend is 127.0.0.9:7001 and b's is 127.0.0.10:7002, neither an address of the
// relay's own as far as its config can tell; DNAT sends the first to b and the second to a. A
// client of a starts the loop a -> b -> a -> ...; the relay must end it within a few hops: the
// connection it accepts from its own upstream socket is closed as `loop`, the backend that led
// there goes down and says so, the client's connection ends, and the relay's fds stay near
// where they were, while clients keep coming.
TEST_P(LoopTest, LoopThroughDnatEndsWithinOneClientConnection) {
    RelayConfig config;
    ListenerSpec a;
    a.name = "a";
    a.upstream = "127.0.0.9:7001";
    a.mode = mode();
    ListenerSpec b = a;
    b.name = "b";
    b.upstream = "127.0.0.10:7002";
    config.listeners = {a, b};
    ASSERT_TRUE(relay_.start(config)) << relay_.diagnostics();
    ASSERT_TRUE(dnat("127.0.0.9", 7001, relay_.port("b")));
    ASSERT_TRUE(dnat("127.0.0.10", 7002, relay_.port("a")));
    const auto baseline = relay_.openFdCount();
    ASSERT_TRUE(baseline.has_value());

    auto loops = [&] {
        return relay_.metric(metric::kClosedTotal, metric::reason("loop", "a")).value_or(0) +
               relay_.metric(metric::kClosedTotal, metric::reason("loop", "b")).value_or(0);
    };
    {
        Connected c = connectTo("127.0.0.1", relay_.port("a"));
        ASSERT_TRUE(c.fd.valid()) << c.error;
        const std::string hello = "hello";
        ASSERT_EQ(writeAll(c.fd.get(), hello.data(), hello.size()).status, IoStatus::Ok);
        // The loop is ended somewhere along it: what is left of it closes back to the client.
        char buf[64];
        IoResult r = readSome(c.fd.get(), buf, sizeof buf, Millis{10'000});
        EXPECT_TRUE(endedByPeer(r)) << ioStatusName(r.status);
    }
    EXPECT_TRUE(waitUntil([&] { return loops() >= 1; }, Millis{10'000}))
        << "no connection closed as a loop\n"
        << relay_.diagnostics();
    // The backend the loop went through is down: a's, b's, or both (a loop caught on either
    // side names the backend of the upstream socket it came from).
    auto down = [&](const std::string& cluster, const std::string& backend) {
        return relay_.metric(metric::kBackendUp, metric::backend(cluster, backend)) == 0.0;
    };
    EXPECT_TRUE(down("a", "127.0.0.9:7001") || down("b", "127.0.0.10:7002"))
        << relay_.scrape().value_or("");
    EXPECT_NE(relay_.stderrText().find("leads back to this relay"), std::string::npos)
        << relay_.diagnostics();

    // More clients while the backends are down or come back (fail_timeout): each is refused
    // or caught again, never a storm. Sampled after each one.
    int peak = *baseline;
    for (int i = 0; i < 20; ++i) {
        Connected c = connectTo("127.0.0.1", relay_.port(i % 2 ? "b" : "a"));
        ASSERT_TRUE(c.fd.valid()) << c.error;
        (void)writeAll(c.fd.get(), "x", 1);
        char buf[16];
        IoResult r = readSome(c.fd.get(), buf, sizeof buf, Millis{10'000});
        EXPECT_TRUE(endedByPeer(r)) << "client " << i << ": " << ioStatusName(r.status);
        peak = std::max(peak, relay_.openFdCount().value_or(0));
    }
    EXPECT_LE(peak, *baseline + 40) << "fds: baseline " << *baseline << ", peak " << peak;
    // Every connection of the loop is gone (idle pipes may stay cached: fds are no measure).
    for (const char* l : {"a", "b"})
        EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(l), 0));
    EXPECT_EQ(relay_.terminate().code, 0);
}

// The kernel lets a client's socket and one of the relay's upstream sockets share a local
// port when they connect to different places. With ten ephemeral ports for both, they share
// all the time; none of those clients is a loop, and every one is served byte for byte.
TEST_P(LoopTest, SharedLocalPortsAreNoLoop) {
    ScriptedUpstream up(AF_INET, echoScript());
    ASSERT_TRUE(up.ok()) << up.error();
    ASSERT_TRUE(relay_.start(singleListenerConfig(up.hostPort(), mode()))) << relay_.diagnostics();
    // Narrowed once the relay listens: its port-0 binds come from the whole range.
    const std::string range = "/proc/sys/net/ipv4/ip_local_port_range";
    const std::string saved = readFileText(range);
    ASSERT_TRUE(writeSysctl(range, "40000 40009"));
    // The namespace outlives the case when the binary runs every case in one process.
    struct Restore {
        const std::string& path;
        const std::string& value;
        ~Restore() { writeSysctl(path, value); }
    } restore{range, saved};
    // Five clients at a time, each with its own upstream socket: ten local ports in use at
    // once at most, from a range of ten. TIME_WAIT is not in the way: each side's closes are
    // reused for the same destination only after a second (tcp_tw_reuse on loopback), and each
    // round waits for its five to finish.
    constexpr int kRounds = 3, kAtOnce = 5;
    int served = 0;
    for (int round = 0; round < kRounds; ++round) {
        std::vector<std::thread> clients;
        std::atomic<int> ok{0};
        for (int i = 0; i < kAtOnce; ++i) {
            clients.emplace_back([&, i] {
                Connected c = connectTo("127.0.0.1", relay_.port());
                if (!c.fd.valid()) return;
                ReceiveCheck got = echoRoundTrip(c.fd.get(), 0x100 + round * kAtOnce + i, 4096);
                if (got.io.status == IoStatus::Eof && got.bytes == 4096 && got.first_mismatch < 0)
                    ++ok;
            });
        }
        for (auto& t : clients) t.join();
        served += ok.load();
        // Not a wait for the relay: the closed ports' TIME_WAIT entries can be reused for the
        // same destination once they are a second old (tcp_tw_reuse), never sooner.
        if (round + 1 < kRounds) std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    }
    EXPECT_EQ(served, kRounds * kAtOnce);
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("loop")).value_or(-1), 0.0);
    EXPECT_EQ(relay_.metric(metric::kBackendUp, metric::backend("t", up.hostPort())), 1.0);
    EXPECT_EQ(relay_.terminate().code, 0);
}

INSTANTIATE_TEST_SUITE_P(AllModes, LoopTest, ::testing::ValuesIn(kModes), modeName);

}  // namespace
}  // namespace zcrelay::test::loop_test
