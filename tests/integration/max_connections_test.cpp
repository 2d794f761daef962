// Connection limits of the real binary. max_connections (per listener and for the process) is
// backpressure: at the limit the relay stops accepting and a new client waits in the kernel's
// accept queue, handshake done, no byte relayed and no backend connection, until a connection
// closes; it is never accepted and closed. max_connections_per_source closes a client past its
// address's share at once and counts it as source_limit.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::max_connections_test {
namespace {

constexpr size_t kPing = 1024;
// How long a waiting client is watched for relayed bytes that must not come. A lower bound of
// silence, not a timing assertion: a relay that served it would answer in microseconds.
constexpr Millis kQuiet{800};

// A client that proved it is relayed (1 KiB echoed) and stays open.
struct Held {
    Connected conn;
    uint64_t seed = 0;
};

// One echo exchange of kPing bytes of payload `seed` on an open connection.
::testing::AssertionResult ping(int fd, uint64_t seed, Millis timeout = Millis{10'000}) {
    IoResult w = sendPayload(fd, seed, kPing, timeout);
    if (!w.ok()) return ::testing::AssertionFailure() << "send: " << w.describe();
    std::vector<uint8_t> back(kPing);
    IoResult r = readExactly(fd, back.data(), back.size(), timeout);
    if (!r.ok()) return ::testing::AssertionFailure() << "echo: " << r.describe();
    PayloadVerifier v(seed);
    v.update(back);
    if (!v.intact()) return ::testing::AssertionFailure() << "mismatch at " << v.firstMismatch();
    return ::testing::AssertionSuccess();
}

// Nothing arrives on `fd` for kQuiet: Timeout is what we want.
::testing::AssertionResult staysSilent(int fd) {
    uint8_t b[64];
    IoResult r = readSome(fd, b, sizeof b, kQuiet);
    if (r.status == IoStatus::Timeout) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "a client past the limit got " << r.describe() << " (expected silence)";
}

// Ends an echo connection cleanly: FIN, then the echo's FIN back.
void finish(Connected& c) {
    ::shutdown(c.fd.get(), SHUT_WR);
    std::string rest;
    IoResult end = readUntilEof(c.fd.get(), rest, Millis{10'000});
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
    c.fd.reset();
}

// connectTo, with the client socket bound to `source` (e.g. 127.0.0.2) first.
Connected connectFrom(const std::string& source, uint16_t port, Millis timeout = Millis{5'000}) {
    Connected out;
    Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) {
        out.err = errno;
        out.error = std::string("socket: ") + std::strerror(errno);
        return out;
    }
    sockaddr_in local{};
    local.sin_family = AF_INET;
    ::inet_pton(AF_INET, source.c_str(), &local.sin_addr);
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&local), sizeof local) != 0) {
        out.err = errno;
        out.error = "bind " + source + ": " + std::strerror(errno);
        return out;
    }
    sockaddr_in peer{};
    peer.sin_family = AF_INET;
    peer.sin_port = htons(port);
    ::inet_pton(AF_INET, "127.0.0.1", &peer.sin_addr);
    int r = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&peer), sizeof peer);
    if (r != 0 && errno != EINPROGRESS) {
        out.err = errno;
        out.error = std::string("connect: ") + std::strerror(errno);
        return out;
    }
    pollfd p{fd.get(), POLLOUT, 0};
    if (r != 0 && ::poll(&p, 1, static_cast<int>(timeout.count())) != 1) {
        out.err = ETIMEDOUT;
        out.error = "connect: timed out";
        return out;
    }
    int soerr = 0;
    socklen_t len = sizeof soerr;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &soerr, &len);
    if (soerr != 0) {
        out.err = soerr;
        out.error = std::string("connect: ") + std::strerror(soerr);
        return out;
    }
    setNonBlocking(fd.get(), false);
    int one = 1;
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    out.fd = std::move(fd);
    return out;
}

// No connection of `listener` was turned away, whatever the reason.
void expectNoRejects(const RelayProcess& relay, const std::string& listener) {
    for (const char* why : {"source_limit", "error", "connect_failed", "no_backend", "drain"})
        EXPECT_EQ(relay.metric(metric::kClosedTotal, metric::reason(why, listener)), 0.0)
            << listener << ": " << why;
}

class MaxConnectionsTest : public ::testing::Test {
  protected:
    void SetUp() override { ASSERT_TRUE(echo_.ok()) << echo_.error(); }

    ListenerSpec listener(const std::string& name, const std::string& extra = "") {
        ListenerSpec l;
        l.name = name;
        l.upstream = echo_.hostPort();
        l.extra_yaml = extra;
        return l;
    }

    // Connects and pings: the relay serves it. ASSERTs inside.
    void hold(const std::string& name, uint64_t seed) {
        Held h;
        h.seed = seed;
        h.conn = connectTo("127.0.0.1", relay_.port(name));
        ASSERT_TRUE(h.conn.fd) << h.conn.error;
        ASSERT_TRUE(ping(h.conn.fd.get(), seed)) << "client " << seed << " on " << name;
        held_.push_back(std::move(h));
    }

    // A client past the limit: the kernel completes its handshake and takes its bytes, the relay
    // neither answers nor opens a backend connection for it.
    Connected waitingClient(const std::string& name, uint64_t seed) {
        size_t backends_before = echo_.accepted();
        Connected c = connectTo("127.0.0.1", relay_.port(name));
        EXPECT_TRUE(c.fd) << "the kernel's accept queue should complete the handshake: " << c.error;
        if (!c.fd) return c;
        EXPECT_TRUE(sendPayload(c.fd.get(), seed, kPing).ok());
        EXPECT_TRUE(staysSilent(c.fd.get()));
        EXPECT_EQ(echo_.accepted(), backends_before) << "a backend connection for a waiting client";
        return c;
    }

    // The waiting client gets its echo once there is room.
    void expectServedNow(Connected& c, uint64_t seed) {
        std::vector<uint8_t> back(kPing);
        IoResult r = readExactly(c.fd.get(), back.data(), back.size(), Millis{10'000});
        ASSERT_TRUE(r.ok()) << "the waiting client was not served after a slot freed: "
                            << r.describe() << "\n"
                            << relay_.diagnostics();
        PayloadVerifier v(seed);
        v.update(back);
        EXPECT_TRUE(v.intact());
    }

    ScriptedUpstream echo_{AF_INET, echoScript()};
    RelayProcess relay_;
    std::vector<Held> held_;
};

// Listener max_connections: 3 over two workers: three long-lived clients are served, the fourth
// waits in the backlog until one of them closes, then is served. Nobody is turned away.
TEST_F(MaxConnectionsTest, ListenerLimitQueuesTheFourthClientUntilOneCloses) {
    RelayConfig config;
    config.listeners = {listener("t", "    max_connections: 3")};
    ASSERT_TRUE(relay_.start(config));
    for (uint64_t i = 0; i < 3; ++i) ASSERT_NO_FATAL_FAILURE(hold("t", 10 + i));
    ASSERT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener("t"), 3));

    Connected fourth = waitingClient("t", 99);
    ASSERT_TRUE(fourth.fd);
    // It may wait in the kernel's queue or, taken by an accept armed before the limit, in the
    // relay's: either way unserved, with no backend connection.
    EXPECT_EQ(echo_.accepted(), 3u);
    EXPECT_EQ(
        relay_.metric(metric::kBackendConnectionsTotal, metric::backend("t", echo_.hostPort())),
        3.0);

    finish(held_[0].conn);
    ASSERT_NO_FATAL_FAILURE(expectServedNow(fourth, 99));
    EXPECT_TRUE(ping(fourth.fd.get(), 100)) << "and relays from then on";
    EXPECT_EQ(echo_.accepted(), 4u);
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsTotal, metric::listener("t"), 4));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener("t"), 3));

    finish(fourth);
    for (size_t i = 1; i < held_.size(); ++i) finish(held_[i].conn);
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done", "t"), 4));
    expectNoRejects(relay_, "t");
}

// The process-wide max_connections: 3 counts both listeners' connections together: with two
// on `a` and one on `b`, a client of `a` waits until `b`'s client closes.
TEST_F(MaxConnectionsTest, GlobalLimitIsSharedAcrossListeners) {
    RelayConfig config;
    config.extra_yaml = "max_connections: 3\n";
    config.listeners = {listener("a"), listener("b")};
    ASSERT_TRUE(relay_.start(config));
    ASSERT_NO_FATAL_FAILURE(hold("a", 1));
    ASSERT_NO_FATAL_FAILURE(hold("b", 2));
    ASSERT_NO_FATAL_FAILURE(hold("a", 3));

    Connected waiting_a = waitingClient("a", 97);
    ASSERT_TRUE(waiting_a.fd);
    Connected waiting_b = waitingClient("b", 98);
    ASSERT_TRUE(waiting_b.fd);
    EXPECT_EQ(echo_.accepted(), 3u);

    finish(held_[1].conn);  // b's client: room for exactly one of the two waiting
    std::vector<uint8_t> back(kPing);
    bool a_first = false;
    ASSERT_TRUE(waitUntil(
        [&] {
            pollfd p[2] = {{waiting_a.fd.get(), POLLIN, 0}, {waiting_b.fd.get(), POLLIN, 0}};
            if (::poll(p, 2, 0) <= 0) return false;
            a_first = (p[0].revents & POLLIN) != 0;
            return true;
        },
        Millis{10'000}))
        << "neither waiting client was served after a slot freed\n"
        << relay_.diagnostics();
    Connected& served = a_first ? waiting_a : waiting_b;
    Connected& still = a_first ? waiting_b : waiting_a;
    ASSERT_NO_FATAL_FAILURE(expectServedNow(served, a_first ? 97 : 98));
    EXPECT_TRUE(staysSilent(still.fd.get())) << "one slot, one client";
    EXPECT_EQ(echo_.accepted(), 4u);

    finish(served);
    ASSERT_NO_FATAL_FAILURE(expectServedNow(still, a_first ? 98 : 97));
    finish(still);
    finish(held_[0].conn);
    finish(held_[2].conn);
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done", "a"), 3));
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done", "b"), 2));
    expectNoRejects(relay_, "a");
    expectNoRejects(relay_, "b");
}

// max_connections_per_source: 2: the third client from 127.0.0.1 is closed at once and counted,
// while 127.0.0.2 is another source and is served; a closed connection frees its source's slot.
TEST_F(MaxConnectionsTest, PerSourceLimitClosesTheThirdFromOneAddressOnly) {
    RelayConfig config;
    config.listeners = {listener("t", "    max_connections_per_source: 2")};
    ASSERT_TRUE(relay_.start(config));
    ASSERT_NO_FATAL_FAILURE(hold("t", 1));
    ASSERT_NO_FATAL_FAILURE(hold("t", 2));

    Connected third = connectTo("127.0.0.1", relay_.port("t"));
    ASSERT_TRUE(third.fd) << third.error;
    IoResult end = waitForPeerClose(third.fd.get(), Millis{5'000});
    EXPECT_TRUE(end.status == IoStatus::Eof || end.status == IoStatus::Reset)
        << "the third client from 127.0.0.1 should be closed at once; got " << end.describe();
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("source_limit", "t"), 1));
    EXPECT_EQ(echo_.accepted(), 2u) << "no backend connection for a client over its limit";

    Connected other = connectFrom("127.0.0.2", relay_.port("t"));
    ASSERT_TRUE(other.fd) << other.error;
    EXPECT_TRUE(ping(other.fd.get(), 3)) << "127.0.0.2 is another source";

    finish(held_[0].conn);
    ASSERT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener("t"), 2));
    Connected again = connectTo("127.0.0.1", relay_.port("t"));
    ASSERT_TRUE(again.fd) << again.error;
    EXPECT_TRUE(ping(again.fd.get(), 4)) << "a closed connection gives its source's slot back";

    finish(again);
    finish(other);
    finish(held_[1].conn);
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done", "t"), 4));
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("source_limit", "t")), 1.0);
}

}  // namespace
}  // namespace zcrelay::test::max_connections_test
