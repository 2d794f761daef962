// Clusters of backends over real loopback sockets: how each balance algorithm spreads clients,
// health checks taking a backend down and up, passive ejection and retries, unix-socket
// backends, the source address. Each backend tags its connections with one byte, so a client
// knows which backend serves it; the relay's per-backend metrics are the other oracle.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::cluster_test {
namespace {

// A backend that says who it is: every connection it accepts first gets its one-byte tag, then
// whatever the client sends is echoed until EOF. It records the address each client came from
// and can stop listening and listen again on the same port (or unix path).
class TaggedBackend {
  public:
    explicit TaggedBackend(char tag, std::string unix_path = "", uint16_t port = 0)
        : tag_(tag), path_(unix_path), port_(port) {
        listenAgain();
    }
    ~TaggedBackend() {
        stop_ = true;
        stopListening();
        std::lock_guard lock(mu_);
        for (auto& t : threads_) t.join();
    }

    char tag() const { return tag_; }
    uint16_t port() const { return port_; }
    std::string address() const {
        return path_.empty() ? "127.0.0.1:" + std::to_string(port_) : "unix:" + path_;
    }
    size_t accepted() const { return accepted_.load(); }
    std::vector<std::string> peers() const {
        std::lock_guard lock(mu_);
        return peers_;
    }

    void stopListening() {
        listening_ = false;
        if (acceptor_.joinable()) acceptor_.join();
        listen_fd_.reset();
    }

    bool listenAgain() {
        int family = path_.empty() ? AF_INET : AF_UNIX;
        Fd fd(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
        int one = 1;
        ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        sockaddr_storage ss{};
        socklen_t len;
        if (path_.empty()) {
            auto& sin = reinterpret_cast<sockaddr_in&>(ss);
            sin.sin_family = AF_INET;
            sin.sin_port = htons(port_);
            sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            len = sizeof sin;
        } else {
            ::unlink(path_.c_str());
            auto& sun = reinterpret_cast<sockaddr_un&>(ss);
            sun.sun_family = AF_UNIX;
            std::strncpy(sun.sun_path, path_.c_str(), sizeof sun.sun_path - 1);
            len = sizeof sun;
        }
        if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0 ||
            ::listen(fd.get(), 128) != 0)
            return false;
        if (path_.empty()) {
            len = sizeof ss;
            ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
            port_ = ntohs(reinterpret_cast<sockaddr_in&>(ss).sin_port);
        }
        listen_fd_ = std::move(fd);
        listening_ = true;
        acceptor_ = std::thread([this] { acceptLoop(); });
        return true;
    }

  private:
    void acceptLoop() {
        while (listening_ && !stop_) {
            pollfd p{listen_fd_.get(), POLLIN, 0};
            if (::poll(&p, 1, 20) <= 0) continue;
            sockaddr_storage ss{};
            socklen_t len = sizeof ss;
            int c =
                ::accept4(listen_fd_.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC);
            if (c < 0) continue;
            char host[INET6_ADDRSTRLEN] = "unix";
            if (ss.ss_family == AF_INET)
                ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in&>(ss).sin_addr, host,
                            sizeof host);
            ++accepted_;
            std::lock_guard lock(mu_);
            peers_.push_back(host);
            threads_.emplace_back([this, c] { serve(Fd(c)); });
        }
    }

    void serve(Fd fd) {
        if (::send(fd.get(), &tag_, 1, MSG_NOSIGNAL) != 1) return;
        char buf[65536];
        // Bounded: the test's clients close within their own deadlines; stop_ ends it anyway.
        for (int idle_ms = 0; !stop_ && idle_ms < 60'000;) {
            pollfd p{fd.get(), POLLIN, 0};
            if (::poll(&p, 1, 20) <= 0) {
                idle_ms += 20;
                continue;
            }
            ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
            if (n <= 0) return;
            if (writeAll(fd.get(), buf, static_cast<size_t>(n), Millis{10'000}).status !=
                IoStatus::Ok)
                return;
        }
    }

    char tag_;
    std::string path_;
    uint16_t port_ = 0;
    Fd listen_fd_;
    std::atomic<bool> listening_{false};
    std::atomic<bool> stop_{false};
    std::thread acceptor_;
    std::atomic<size_t> accepted_{0};
    mutable std::mutex mu_;
    std::vector<std::thread> threads_;
    std::vector<std::string> peers_;
};

// A client connection from `source` (an address in 127.0.0.0/8) to the relay.
Fd connectFrom(const std::string& source, uint16_t port) {
    Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in src{};
    src.sin_family = AF_INET;
    ::inet_pton(AF_INET, source.c_str(), &src.sin_addr);
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&src), sizeof src) != 0) return Fd();
    sockaddr_in dst{};
    dst.sin_family = AF_INET;
    dst.sin_port = htons(port);
    dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval tv{5, 0};
    ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&dst), sizeof dst) != 0) return Fd();
    return fd;
}

struct BackendLine {
    std::string address;
    int weight = 1;
};

std::string clusterYaml(const std::string& name, const std::string& settings,
                        const std::vector<BackendLine>& backends) {
    std::string y = "clusters:\n  - name: " + name + "\n";
    y += settings;
    y += "    backends:\n";
    for (const auto& b : backends)
        y += "      - {address: \"" + b.address + "\", weight: " + std::to_string(b.weight) + "}\n";
    return y;
}

class ClusterTest : public ::testing::Test {
  protected:
    // One listener "t" (splice unless `mode`) routed to cluster "app".
    void start(const std::string& clusters_yaml, int workers = 1,
               const std::string& mode = "splice") {
        RelayConfig config;
        config.workers = workers;
        ListenerSpec l;
        l.cluster = "app";
        l.mode = mode;
        config.listeners.push_back(l);
        config.extra_yaml = clusters_yaml;
        ASSERT_TRUE(relay_.start(config)) << relay_.diagnostics();
    }
    Fd client() {
        Connected c = connectTo("127.0.0.1", relay_.port());
        EXPECT_TRUE(c.fd) << c.error;
        return std::move(c.fd);
    }
    double backendMetric(const char* name, const TaggedBackend& b) {
        return relay_.metric(name, metric::backend("app", b.address())).value_or(-1);
    }

    RelayProcess relay_;
};

TEST_F(ClusterTest, RoundRobinFollowsWeightsSmoothly) {
    TaggedBackend a('a'), b('b'), c('c');
    ASSERT_NO_FATAL_FAILURE(
        start(clusterYaml("app", "    balance: round_robin\n",
                          {{a.address(), 3}, {b.address(), 2}, {c.address(), 1}})));
    // One worker: its smooth weighted round robin is the whole story, so the sequence is exact:
    // 3:2:1 interleaved (a b a c b a), never a burst of three a's.
    std::string sequence;
    for (int i = 0; i < 60; ++i) {
        Fd fd = client();
        sequence += servedBy(fd);
    }
    EXPECT_EQ(std::count(sequence.begin(), sequence.end(), 'a'), 30) << sequence;
    EXPECT_EQ(std::count(sequence.begin(), sequence.end(), 'b'), 20) << sequence;
    EXPECT_EQ(std::count(sequence.begin(), sequence.end(), 'c'), 10) << sequence;
    EXPECT_EQ(sequence.find("aaa"), std::string::npos) << "not smooth: " << sequence;
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsTotal,
                                     metric::backend("app", a.address()), 30));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsTotal,
                                     metric::backend("app", c.address()), 10));
}

TEST_F(ClusterTest, LeastConnFillsTheBackendThatLostItsLongConnections) {
    TaggedBackend a('a'), b('b');
    ASSERT_NO_FATAL_FAILURE(
        start(clusterYaml("app", "    balance: least_conn\n", {{a.address()}, {b.address()}})));
    std::map<char, std::vector<Fd>> held;
    for (int i = 0; i < 4; ++i) {
        Fd fd = client();
        char tag = servedBy(fd);
        held[tag].push_back(std::move(fd));
    }
    ASSERT_EQ(held['a'].size(), 2u);
    ASSERT_EQ(held['b'].size(), 2u);
    held['a'].clear();  // a's connections end; b's live on
    ASSERT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive,
                                     metric::backend("app", a.address()), 0));
    // Round robin would split the next two; least_conn sends both to the idle backend.
    for (int i = 0; i < 2; ++i) {
        Fd fd = client();
        EXPECT_EQ(servedBy(fd), 'a');
        held['a'].push_back(std::move(fd));
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive,
                                     metric::backend("app", b.address()), 2));
}

TEST_F(ClusterTest, RandomSpreadsOverEveryBackend) {
    TaggedBackend a('a'), b('b'), c('c');
    ASSERT_NO_FATAL_FAILURE(start(
        clusterYaml("app", "    balance: random\n", {{a.address()}, {b.address()}, {c.address()}}),
        2));
    std::map<char, int> count;
    for (int i = 0; i < 90; ++i) {
        Fd fd = client();
        ++count[servedBy(fd)];
    }
    // Each expects 30; the chance of fewer than 10 for one is below 1e-5.
    for (char t : {'a', 'b', 'c'}) EXPECT_GE(count[t], 10) << t;
    EXPECT_EQ(count[0], 0) << "every client was served";
}

// source_hash: clients from 200 addresses of 127.0.0.0/8. Adding a fifth backend (a reload)
// moves about a fifth of them, all to the new one; removing it again brings every one back.
TEST_F(ClusterTest, SourceHashMovesOnlyTheAddedBackendsShare) {
    TaggedBackend a('a'), b('b'), c('c'), d('d'), e('e');
    const std::string settings = "    balance: source_hash\n";
    std::vector<BackendLine> four = {{a.address()}, {b.address()}, {c.address()}, {d.address()}};
    std::vector<BackendLine> five = four;
    five.push_back({e.address()});
    ASSERT_NO_FATAL_FAILURE(start(clusterYaml("app", settings, four), 2));
    auto placement = [&] {
        std::map<std::string, char> where;
        for (int i = 1; i <= 200; ++i) {
            std::string source =
                "127.0." + std::to_string(i / 100 + 1) + "." + std::to_string(i % 100 + 1);
            Fd fd = connectFrom(source, relay_.port());
            where[source] = fd ? servedBy(fd) : 0;
        }
        return where;
    };
    auto before = placement();
    EXPECT_EQ(placement(), before) << "the same client must land on the same backend";
    auto configWith = [&](const std::vector<BackendLine>& backends) {
        RelayConfig config;
        config.workers = 2;
        ListenerSpec l;
        l.cluster = "app";
        config.listeners.push_back(l);
        config.extra_yaml = clusterYaml("app", settings, backends);
        // The listener keeps its socket across the reload: same address, same port.
        config.listeners[0].listen = "127.0.0.1:" + std::to_string(relay_.port());
        return config.yaml();
    };
    ASSERT_TRUE(relay_.reload(configWith(five)));
    auto after = placement();
    int moved = 0;
    for (const auto& [source, tag] : before) {
        if (after[source] == tag) continue;
        ++moved;
        EXPECT_EQ(after[source], 'e') << source << " moved from " << tag << " to a kept backend";
    }
    double share = moved / 200.0;
    std::printf("source_hash: adding a 5th backend moved %d of 200 clients (%.3f; ideal 0.2)\n",
                moved, share);
    RecordProperty("moved_share_on_add", std::to_string(share));
    EXPECT_GT(share, 0.08);
    EXPECT_LT(share, 0.35);
    ASSERT_TRUE(relay_.reload(configWith(four)));
    EXPECT_EQ(placement(), before) << "removing the 5th must bring every client back";
}

TEST_F(ClusterTest, HealthChecksTakeABackendDownAndBringItBack) {
    TaggedBackend a('a'), b('b');
    ASSERT_NO_FATAL_FAILURE(start(clusterYaml(
        "app", "    health_check: {interval: 100ms, timeout: 200ms, rise: 2, fall: 2}\n",
        {{a.address()}, {b.address()}})));
    const Labels lb = metric::backend("app", b.address());
    ASSERT_TRUE(relay_.waitForMetric(
        metric::kBackendChecksTotal,
        [&] {
            auto l = lb;
            l["result"] = "passed";
            return l;
        }(),
        [](double v) { return v >= 2; }, ">= 2"));
    EXPECT_EQ(relay_.metric(metric::kBackendUp, lb), 1.0);

    b.stopListening();  // its checks are refused from now on
    auto t0 = Clock::now();
    ASSERT_TRUE(relay_.waitForMetric(metric::kBackendUp, lb, 0, Millis{15'000}));
    double down_after = secondsSince(t0);
    // fall 2 at 100 ms: two failed checks, ~0.1-0.3 s. 10 s is what a loaded 2-core machine
    // guarantees, and still tells checks that work from checks that never take it down.
    EXPECT_LT(down_after, 10.0);
    std::printf("health check: down %.3f s after the backend stopped (fall 2, interval 100ms)\n",
                down_after);
    for (int i = 0; i < 6; ++i) {
        Fd fd = client();
        EXPECT_EQ(servedBy(fd), 'a') << "a down backend takes no clients";
    }
    EXPECT_EQ(relay_.metric(metric::kBackendTransitionsTotal,
                            [&] {
                                auto l = lb;
                                l["to"] = "down";
                                return l;
                            }()),
              1.0);

    ASSERT_TRUE(b.listenAgain());
    t0 = Clock::now();
    ASSERT_TRUE(relay_.waitForMetric(metric::kBackendUp, lb, 1, Millis{15'000}));
    EXPECT_LT(secondsSince(t0), 10.0);  // rise 2 at 100 ms: ~0.2 s; 10 s as above
    std::set<char> seen;
    for (int i = 0; i < 6; ++i) {
        Fd fd = client();
        seen.insert(servedBy(fd));
    }
    EXPECT_TRUE(seen.count('b')) << "back up, it takes clients again";
}

TEST_F(ClusterTest, HealthCheckSendsAndExpectsAReplyPrefix) {
    // The tagged backends answer every connection with their tag byte: expecting "a" passes
    // for a, fails for b.
    TaggedBackend a('a'), b('b');
    ASSERT_NO_FATAL_FAILURE(start(clusterYaml("app",
                                              "    health_check: {interval: 100ms, timeout: 300ms, "
                                              "rise: 1, fall: 1, send: \"ping\\r\\n\", "
                                              "expect: \"a\"}\n",
                                              {{a.address()}, {b.address()}})));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendUp, metric::backend("app", b.address()), 0));
    EXPECT_EQ(relay_.metric(metric::kBackendUp, metric::backend("app", a.address())), 1.0);
}

TEST_F(ClusterTest, NoBackendUpClosesClientsAtOnceAndCountsThem) {
    TaggedBackend a('a');
    a.stopListening();
    Bound b = bindLoopbackNoListen(AF_INET);
    ASSERT_NO_FATAL_FAILURE(start(clusterYaml(
        "app", "    health_check: {interval: 100ms, timeout: 200ms, rise: 1, fall: 1}\n",
        {{a.address()}, {"127.0.0.1:" + std::to_string(b.port)}})));
    ASSERT_TRUE(relay_.waitForMetric(metric::kBackendUp, metric::backend("app", a.address()), 0));
    ASSERT_TRUE(relay_.waitForMetric(
        metric::kBackendUp, metric::backend("app", "127.0.0.1:" + std::to_string(b.port)), 0));
    auto t0 = Clock::now();
    Fd fd = client();
    IoResult end = waitForPeerClose(fd.get(), Millis{5'000});
    EXPECT_TRUE(end.status == IoStatus::Eof || end.status == IoStatus::Reset) << end.describe();
    // At once: the other way would be a connect_timeout (5 s, the default) later; 4 s is room
    // for a loaded 2-core machine.
    EXPECT_LT(secondsSince(t0), 4.0) << "closed at once, not after a connect timeout";
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("no_backend"), 1));
}

// Passive ejection and retries: b refuses every connect. Each client still gets a (a retry,
// within the one connect budget); after max_fails refusals b is down and no longer tried, until
// fail_timeout brings it back.
TEST_F(ClusterTest, ConnectFailuresRetryElsewhereAndEjectTheBackend) {
    TaggedBackend a('a');
    Bound refusing = bindLoopbackNoListen(AF_INET);
    std::string b = "127.0.0.1:" + std::to_string(refusing.port);
    ASSERT_NO_FATAL_FAILURE(start(clusterYaml(
        "app", "    retries: 1\n    max_fails: 2\n    fail_timeout: 1s\n", {{a.address()}, {b}})));
    for (int i = 0; i < 10; ++i) {
        Fd fd = client();
        EXPECT_EQ(servedBy(fd), 'a') << "client " << i << " must be served by a retry";
    }
    EXPECT_EQ(relay_.metric(metric::kBackendUp, metric::backend("app", b)), 0.0);
    double attempts =
        relay_.metric(metric::kBackendAttemptsTotal, metric::backend("app", b)).value_or(-1);
    EXPECT_EQ(attempts, 2.0) << "ejected after max_fails: 2, then never tried";
    EXPECT_EQ(relay_.metric(metric::kBackendFailuresTotal,
                            {{"cluster", "app"}, {"backend", b}, {"reason", "refused"}}),
              2.0);
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("connect_failed")), 0.0);
    // fail_timeout 1s: b is tried again (and ejected again).
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendTransitionsTotal,
                                     {{"cluster", "app"}, {"backend", b}, {"to", "up"}}, 1,
                                     Millis{15'000}));
}

class UnixBackendTest : public ClusterTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(UnixBackendTest, RelaysToAUnixSocketByteExact) {
    TempDir dir;
    TaggedBackend u('u', dir.file("backend.sock"));
    ASSERT_NO_FATAL_FAILURE(start(clusterYaml("app", "", {{u.address()}}), 1, GetParam()));
    Fd fd = client();
    ASSERT_EQ(servedBy(fd), 'u');
    ReceiveCheck echoed = echoRoundTrip(fd.get(), 7, 4 << 20, Millis{30'000});
    EXPECT_EQ(echoed.io.status, IoStatus::Eof) << echoed.describe();
    EXPECT_EQ(echoed.bytes, uint64_t{4} << 20) << echoed.describe();
    EXPECT_EQ(echoed.first_mismatch, -1) << echoed.describe();
    EXPECT_TRUE(relay_.waitForMetric(
        metric::kBackendBytesTotal,
        {{"cluster", "app"}, {"backend", u.address()}, {"direction", "upstream"}}, 4 << 20));
}

INSTANTIATE_TEST_SUITE_P(Modes, UnixBackendTest, ::testing::Values("splice", "copy", "sockmap"),
                         [](const auto& info) { return std::string(info.param); });

TEST_F(ClusterTest, SourceAddressBindsUpstreamSockets) {
    TaggedBackend a('a');
    ASSERT_NO_FATAL_FAILURE(
        start(clusterYaml("app", "    source: 127.0.0.7:0\n", {{a.address()}})));
    for (int i = 0; i < 3; ++i) {
        Fd fd = client();
        EXPECT_EQ(servedBy(fd), 'a');
    }
    for (const std::string& peer : a.peers()) EXPECT_EQ(peer, "127.0.0.7");
}

// Two listeners naming one cluster share it: on one worker, one balancer serves both, so their
// clients alternate over the backends as one stream would.
TEST_F(ClusterTest, ListenersShareACluster) {
    TaggedBackend a('a'), b('b');
    RelayConfig config;
    config.workers = 1;
    for (const char* name : {"one", "two"}) {
        ListenerSpec l;
        l.name = name;
        l.cluster = "app";
        config.listeners.push_back(l);
    }
    config.extra_yaml = clusterYaml("app", "", {{a.address()}, {b.address()}});
    ASSERT_TRUE(relay_.start(config)) << relay_.diagnostics();
    std::string sequence;
    for (int i = 0; i < 8; ++i) {
        Connected c = connectTo("127.0.0.1", relay_.port(i % 2 ? "two" : "one"));
        ASSERT_TRUE(c.fd) << c.error;
        sequence += servedBy(c.fd);
    }
    // Where the rotation starts is seeded per worker; that it alternates across listeners is
    // the point.
    EXPECT_TRUE(sequence == "abababab" || sequence == "babababa") << sequence;
}

// With accept_proxy, the client a PROXY header names is the client: source_hash places it by
// that address (not by the proxy in front, 127.0.0.1 for all), and the access log shows it.
TEST_F(ClusterTest, AcceptedProxyAddressFeedsSourceHashAndTheAccessLog) {
    TaggedBackend a('a'), b('b'), c('c');
    TempDir dir;
    const std::string log = dir.file("access.log");
    RelayConfig config;
    config.workers = 2;
    ListenerSpec l;
    l.cluster = "app";
    l.extra_yaml = "    accept_proxy: true\n";
    config.listeners.push_back(l);
    config.extra_yaml = clusterYaml("app", "    balance: source_hash\n",
                                    {{a.address()}, {b.address()}, {c.address()}}) +
                        "access_log: {path: \"" + log + "\", format: text}\n";
    ASSERT_TRUE(relay_.start(config)) << relay_.diagnostics();
    auto via = [&](const std::string& source) {
        Fd fd = client();
        std::string header = "PROXY TCP4 " + source + " 127.0.0.1 40000 80\r\n";
        EXPECT_TRUE(writeAll(fd.get(), header.data(), header.size()).ok());
        return servedBy(fd);
    };
    std::map<std::string, char> first;
    std::set<char> used;
    for (int i = 1; i <= 30; ++i) {
        std::string source = "198.51.100." + std::to_string(i);
        first[source] = via(source);
        used.insert(first[source]);
    }
    for (const auto& [source, tag] : first) EXPECT_EQ(via(source), tag) << source;
    EXPECT_EQ(used.size(), 3u) << "30 clients behind one proxy spread by their own address";
    ASSERT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), 60));
    std::string text;
    waitUntil(
        [&] {
            text = readFileText(log);
            return std::count(text.begin(), text.end(), '\n') >= 60;
        },
        Millis{15'000});
    EXPECT_NE(text.find(" 198.51.100.7:40000 app/"), std::string::npos) << text.substr(0, 400);
    EXPECT_EQ(text.find(" 127.0.0.1:"), std::string::npos)
        << "the proxy's address, not the client's";
}

// Runs `body` in a child process, in a network namespace of its own with only lo up, and
// returns what it returned ("" = passed), or why it could not run. The namespace confines what
// the body changes (here: the ephemeral port range) to itself.
std::string inOwnNetns(const std::function<std::string()>& body, Millis timeout) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) return "pipe2 failed";
    pid_t pid = ::fork();
    if (pid == 0) {
        ::close(p[0]);
        std::string result;
        if (::unshare(CLONE_NEWNET) != 0) {
            result = std::string("unshare(CLONE_NEWNET): ") + std::strerror(errno);
        } else {
            Fd s(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
            ifreq ifr{};
            std::strcpy(ifr.ifr_name, "lo");
            ::ioctl(s.get(), SIOCGIFFLAGS, &ifr);
            ifr.ifr_flags |= IFF_UP;
            result = ::ioctl(s.get(), SIOCSIFFLAGS, &ifr) == 0 ? body() : "cannot bring lo up";
        }
        (void)!::write(p[1], result.data(), result.size());
        ::_exit(result.empty() ? 0 : 1);
    }
    ::close(p[1]);
    Fd from_child(p[0]);
    std::string out;
    bool eof = false;
    for (auto deadline = Clock::now() + timeout; !eof && Clock::now() < deadline;) {
        pollfd pfd{from_child.get(), POLLIN, 0};
        if (::poll(&pfd, 1, 100) <= 0) continue;
        char buf[4096];
        ssize_t n = ::read(from_child.get(), buf, sizeof buf);
        if (n > 0) out.append(buf, static_cast<size_t>(n));
        eof = n == 0 || (n < 0 && errno != EINTR);
    }
    if (!eof) ::kill(pid, SIGKILL);  // our own child, by its pid
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!eof) return "the namespace child did not finish in time";
    return out;
}

// `source` with port 0 sets IP_BIND_ADDRESS_NO_PORT, so an upstream socket's port is chosen at
// connect() per destination. In a namespace whose ephemeral range is 8 ports, 14 connections
// from one source address to 2 backends all connect (7 to each); bind() choosing the port
// alone would have stopped at 8 (EADDRINUSE). The nearest real thing to the 50k+ connections
// it is for, which this machine's 20,000 fd limit does not allow.
TEST(SourcePortsTest, UpstreamPortsAreSharedAcrossBackends) {
    if (::geteuid() != 0) GTEST_SKIP() << "a network namespace of its own needs root";
    std::string result = inOwnNetns(
        [] {
            std::ofstream("/proc/sys/net/ipv4/ip_local_port_range") << "40000 40007";
            // Fixed ports outside that range for everything that listens, and the clients
            // bind theirs: the 8 ephemeral ports are the upstream sockets' alone.
            TaggedBackend a('a', "", 9001), b('b', "", 9002);
            RelayProcess relay;
            RelayConfig config;
            config.workers = 1;
            config.metrics_listen = "127.0.0.1:9100";
            ListenerSpec l;
            l.listen = "127.0.0.1:10000";
            l.cluster = "app";
            config.listeners.push_back(l);
            config.extra_yaml =
                clusterYaml("app", "    source: 127.0.0.1:0\n", {{a.address()}, {b.address()}});
            if (!relay.start(config)) return "relay did not start\n" + relay.diagnostics();
            std::vector<Fd> held;
            std::string tags;
            for (int i = 0; i < 14; ++i) {
                Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
                sockaddr_in addr{};
                addr.sin_family = AF_INET;
                addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
                addr.sin_port = htons(static_cast<uint16_t>(50000 + i));
                if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
                    return std::string("client bind: ") + std::strerror(errno);
                addr.sin_port = htons(10000);
                if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
                    return std::string("client connect: ") + std::strerror(errno);
                tags += servedBy(fd);
                held.push_back(std::move(fd));
            }
            if (std::count(tags.begin(), tags.end(), 'a') != 7 ||
                std::count(tags.begin(), tags.end(), 'b') != 7)
                return "served by: \"" + tags + "\" (want 7 a and 7 b)\n" + relay.diagnostics();
            return std::string();
        },
        Millis{60'000});
    if (result.rfind("unshare", 0) == 0) GTEST_SKIP() << result;
    EXPECT_EQ(result, "");
}

// A fixed source port fits one upstream connection at a time. The second client's attempts
// find it taken (bind: EADDRINUSE): counted as addr_not_avail connect failures, retried, and
// the client closed as connect_failed; the backend is not ejected for it.
TEST_F(ClusterTest, SourcePortInUseIsAConnectFailureNotAnError) {
    TaggedBackend a('a'), b('b');
    Bound spare = bindLoopbackNoListen(AF_INET);
    uint16_t port = spare.port;
    spare.fd.reset();  // free again, for the relay's source
    ASSERT_NO_FATAL_FAILURE(start(
        clusterYaml("app", "    source: 127.0.0.1:" + std::to_string(port) + "\n    max_fails: 1\n",
                    {{a.address()}, {b.address()}})));
    Fd first = client();
    char served = servedBy(first);
    ASSERT_TRUE(served == 'a' || served == 'b');
    Fd second = client();
    IoResult end = waitForPeerClose(second.get(), Millis{5'000});
    EXPECT_TRUE(end.status == IoStatus::Eof || end.status == IoStatus::Reset) << end.describe();
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("connect_failed"), 1));
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("error")), 0.0);
    EXPECT_EQ(relay_.metric(metric::kConnectFailuresTotal, metric::reason("addr_not_avail")), 3.0)
        << "retries: 2, so three attempts";
    EXPECT_EQ(relay_.metric(metric::kBackendUp, metric::backend("app", a.address())), 1.0);
    EXPECT_EQ(relay_.metric(metric::kBackendUp, metric::backend("app", b.address())), 1.0);
}

// /readyz says whether a client would be served: 503 while a listener's cluster has no backend
// up (with the reason), 200 once one is, 503 "draining" after SIGTERM. /healthz stays 200.
TEST_F(ClusterTest, ReadyzFollowsBackendsAndDrainHealthzStaysUp) {
    TaggedBackend a('a');
    a.stopListening();
    ASSERT_NO_FATAL_FAILURE(start(clusterYaml(
        "app", "    health_check: {interval: 100ms, timeout: 200ms, rise: 1, fall: 1}\n",
        {{a.address()}})));
    auto status = [&](const char* path) {
        auto r = relay_.get(path);
        return r ? r->status : -1;
    };
    ASSERT_TRUE(waitUntil([&] { return status("/readyz") == 503; }, Millis{15'000}));
    EXPECT_EQ(relay_.get("/readyz")->body, "listener t: no backend of cluster app is up\n");
    EXPECT_EQ(status("/healthz"), 200);
    ASSERT_TRUE(a.listenAgain());
    EXPECT_TRUE(waitUntil([&] { return status("/readyz") == 200; }, Millis{15'000}));
    EXPECT_EQ(relay_.get("/readyz")->body, "ready\n");

    Fd held = client();  // keeps the drain going while we look
    ASSERT_EQ(servedBy(held), 'a');
    ASSERT_TRUE(relay_.sendSignal(SIGTERM));
    EXPECT_TRUE(waitUntil([&] { return status("/readyz") == 503; }, Millis{15'000}));
    EXPECT_EQ(relay_.get("/readyz")->body, "draining\n");
    EXPECT_EQ(status("/healthz"), 200);
    EXPECT_EQ(relay_.metric("zcrelay_draining"), 1.0);
}

// tcp_keepalive reaches the relay's sockets: the cluster's on the upstream side, the listener's
// on the client side (read off the relay's own sockets with pidfd_getfd).
TEST_F(ClusterTest, KeepaliveIsSetOnEachSideAsConfigured) {
    TaggedBackend a('a');
    RelayConfig config;
    config.workers = 1;
    ListenerSpec l;
    l.cluster = "app";
    l.extra_yaml = "    tcp_keepalive: {idle: 30s, interval: 5s, count: 4, user_timeout: 45s}\n";
    config.listeners.push_back(l);
    config.extra_yaml = clusterYaml(
        "app", "    tcp_keepalive: {idle: 60s, interval: 10s, count: 3}\n", {{a.address()}});
    ASSERT_TRUE(relay_.start(config)) << relay_.diagnostics();
    Fd fd = client();
    ASSERT_EQ(servedBy(fd), 'a');
    sockaddr_in local{};
    socklen_t len = sizeof local;
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len);
    auto options = [](const Fd& s) {
        int on = 0, idle = 0, interval = 0, count = 0, user_timeout_ms = 0;
        socklen_t n = sizeof(int);
        ::getsockopt(s.get(), SOL_SOCKET, SO_KEEPALIVE, &on, &n);
        ::getsockopt(s.get(), IPPROTO_TCP, TCP_KEEPIDLE, &idle, &n);
        ::getsockopt(s.get(), IPPROTO_TCP, TCP_KEEPINTVL, &interval, &n);
        ::getsockopt(s.get(), IPPROTO_TCP, TCP_KEEPCNT, &count, &n);
        ::getsockopt(s.get(), IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, &n);
        return std::vector<int>{on, idle, interval, count, user_timeout_ms};
    };
    std::vector<Fd> upstream = relaySocketsTo(relay_.pid(), {a.port()});
    std::vector<Fd> downstream = relaySocketsTo(relay_.pid(), {ntohs(local.sin_port)});
    ASSERT_EQ(upstream.size(), 1u);
    ASSERT_EQ(downstream.size(), 1u);
    EXPECT_EQ(options(upstream[0]), (std::vector<int>{1, 60, 10, 3, 0})) << "user_timeout unset";
    EXPECT_EQ(options(downstream[0]), (std::vector<int>{1, 30, 5, 4, 45'000}));
}

}  // namespace
}  // namespace zcrelay::test::cluster_test
