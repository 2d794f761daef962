#pragma once
// DNS service discovery (proxy/discovery.hpp) on the real binary, against a real DNS server
// (dnsmasq, tests/support/dns_server.hpp) on a loopback port, over real sockets. What the
// discovery_*_test.cpp files share: the backends, the clients, the configs and the fixture.
// Each file is one part of the contract:
//   - discovery_scale_test: a cluster following a name scales up and down under a continuous
//     client load (in every data path); new addresses take connections only once healthy;
//   - discovery_answers_test: SRV ports, weights and priorities, answers too large for UDP, the
//     refresh rate between refresh_min and refresh_max, search domains and ndots, the family;
//   - discovery_failures_test: a DNS server that stops answering (hold, after_hold), NXDOMAIN
//     and SERVFAIL, startup: fail / empty;
//   - discovery_reload_test: what SIGHUP keeps and what it follows;
//   - discovery_refused_addresses_test: the addresses refused as backends: unspecified,
//     broadcast, multicast, port 0, and the relay's own listeners (a connection storm to
//     itself).
//
// The backends listen on distinct loopback addresses (127.0.0.2, 127.0.0.3, ...: all of 127/8
// is local) at one port, as the pods of a headless Service do. Each says who it is with one tag
// byte on every connection it accepts, then echoes. The oracles are what the clients see (the
// tag, byte-exact echoes, a clean EOF) and the relay's own metrics: zcrelay_discovery_* and the
// per-backend series, which come and go with the discovered set.
//
// Loopback only; every loop is bounded in count and time; only the processes and threads these
// files start are stopped (by the fixtures that started them, by PID).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/dns_server.hpp"
#include "support/labels.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "support/short_connection_load.hpp"
#include "units.hpp"

namespace zcrelay::test::discovery_test {

// The discovery metrics (proxy/metrics.cpp), all labelled {cluster} (+ outcome).
inline constexpr const char* kResolutions = "zcrelay_discovery_resolutions_total";
inline constexpr const char* kLastSuccess = "zcrelay_discovery_last_success_timestamp_seconds";
inline constexpr const char* kDiscovered = "zcrelay_discovery_backends";
inline constexpr const char* kChanges = "zcrelay_discovery_changes_total";
inline constexpr const char* kFailing = "zcrelay_discovery_failing";
inline constexpr const char* kBackendWeight = "zcrelay_backend_weight";  // {cluster, backend}
// {cluster, reason}: addresses answers named that were refused, summed over answers / in the last.
inline constexpr const char* kRefused = "zcrelay_discovery_refused_total";
inline constexpr const char* kRefusedNow = "zcrelay_discovery_refused_addresses";
inline const std::vector<std::string> kOutcomes = {"success", "nxdomain", "no_records",  "servfail",
                                                   "refused", "timeout",  "unreachable", "error"};

inline Labels cluster(const std::string& name) { return {{"cluster", name}}; }
inline Labels outcome(const std::string& cluster_name, const std::string& what) {
    return {{"cluster", cluster_name}, {"outcome", what}};
}

// ---------------------------------------------------------------------------------------------
// A backend on one address and port: its tag byte to every connection it accepts (health checks
// included), then an echo of everything until the client's EOF, then its own FIN. One thread,
// poll, non-blocking sockets, at most 256 KiB buffered per connection.

class Backend {
  public:
    Backend(char tag, std::string ip, uint16_t port) : tag_(tag), ip_(std::move(ip)) {
        family_ = ip_.find(':') != std::string::npos ? AF_INET6 : AF_INET;
        Fd fd(::socket(family_, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
        if (!fd) {
            error_ = std::string("socket: ") + std::strerror(errno);
            return;
        }
        int one = 1;
        ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        sockaddr_storage ss{};
        socklen_t len = 0;
        if (family_ == AF_INET) {
            auto& sin = reinterpret_cast<sockaddr_in&>(ss);
            sin.sin_family = AF_INET;
            sin.sin_port = htons(port);
            ::inet_pton(AF_INET, ip_.c_str(), &sin.sin_addr);
            len = sizeof sin;
        } else {
            auto& sin6 = reinterpret_cast<sockaddr_in6&>(ss);
            sin6.sin6_family = AF_INET6;
            sin6.sin6_port = htons(port);
            ::inet_pton(AF_INET6, ip_.c_str(), &sin6.sin6_addr);
            ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
            len = sizeof sin6;
        }
        if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0 ||
            ::listen(fd.get(), 4096) != 0) {
            error_ = "bind/listen " + ip_ + " port " + std::to_string(port) + ": " +
                     std::strerror(errno);
            return;
        }
        len = sizeof ss;
        ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
        port_ = ntohs(family_ == AF_INET ? reinterpret_cast<sockaddr_in&>(ss).sin_port
                                         : reinterpret_cast<sockaddr_in6&>(ss).sin6_port);
        listen_ = std::move(fd);
        thread_ = std::thread([this] { loop(); });
    }
    ~Backend() { stop(); }
    Backend(const Backend&) = delete;
    Backend& operator=(const Backend&) = delete;

    bool ok() const { return listen_.valid(); }
    const std::string& error() const { return error_; }
    char tag() const { return tag_; }
    const std::string& ip() const { return ip_; }
    uint16_t port() const { return port_; }
    // As the relay names it in the `backend` label: "127.0.0.2:PORT", "[::1]:PORT".
    std::string address() const {
        return (family_ == AF_INET6 ? "[" + ip_ + "]" : ip_) + ":" + std::to_string(port_);
    }
    size_t accepted() const { return accepted_.load(); }

    void stop() {
        stop_.store(true);
        if (thread_.joinable()) thread_.join();
        listen_.reset();
    }

  private:
    struct Conn {
        Fd fd;
        std::string out;
        size_t off = 0;
        bool eof = false;
    };

    void loop() {
        std::vector<std::unique_ptr<Conn>> conns;
        std::vector<pollfd> fds;
        std::vector<char> buf(64 * kKiB);
        while (!stop_.load()) {
            fds.clear();
            fds.push_back({listen_.get(), POLLIN, 0});
            for (auto& c : conns) {
                short events = 0;
                if (!c->eof && c->out.size() - c->off < 256 * kKiB) events |= POLLIN;
                if (c->off < c->out.size()) events |= POLLOUT;
                fds.push_back({c->fd.get(), events, 0});
            }
            if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
            for (size_t i = 0; i < conns.size(); ++i) {
                Conn& c = *conns[i];
                const short re = fds[i + 1].revents;
                bool dead = false;
                if (!c.eof && (re & (POLLIN | POLLHUP | POLLERR))) {
                    ssize_t n = ::recv(c.fd.get(), buf.data(), buf.size(), MSG_DONTWAIT);
                    if (n > 0)
                        c.out.append(buf.data(), static_cast<size_t>(n));
                    else if (n == 0)
                        c.eof = true;
                    else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                        dead = true;
                }
                if (!dead && c.off < c.out.size() && (re & (POLLOUT | POLLHUP | POLLERR))) {
                    ssize_t n = ::send(c.fd.get(), c.out.data() + c.off, c.out.size() - c.off,
                                       MSG_DONTWAIT | MSG_NOSIGNAL);
                    if (n > 0)
                        c.off += static_cast<size_t>(n);
                    else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                        dead = true;
                }
                if (c.off == c.out.size()) {
                    c.out.clear();
                    c.off = 0;
                }
                if (dead || (c.eof && c.out.empty())) conns[i].reset();  // close: our FIN
            }
            conns.erase(std::remove(conns.begin(), conns.end(), nullptr), conns.end());
            if (fds[0].revents & POLLIN) {
                for (int k = 0; k < 256; ++k) {
                    int c =
                        ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
                    if (c < 0) break;
                    auto conn = std::make_unique<Conn>();
                    conn->fd = Fd(c);
                    conn->out.assign(1, tag_);
                    conns.push_back(std::move(conn));
                    ++accepted_;
                }
            }
        }
    }

    char tag_;
    std::string ip_;
    int family_ = AF_INET;
    uint16_t port_ = 0;
    std::string error_;
    Fd listen_;
    std::atomic<bool> stop_{false};
    std::atomic<size_t> accepted_{0};
    std::thread thread_;
};

using BackendPtr = std::unique_ptr<Backend>;

// Backends on each of `ips` (tagged `tags[i]`), all at one port: the kernel picks it for the
// first, the others bind it too (retried on a new port if one of them is taken meanwhile).
inline std::vector<BackendPtr> backendsOnOnePort(const std::vector<std::string>& ips,
                                                 const std::string& tags, std::string& error) {
    for (int attempt = 0; attempt < 8; ++attempt) {
        std::vector<BackendPtr> out;
        uint16_t port = 0;
        for (size_t i = 0; i < ips.size(); ++i) {
            out.push_back(std::make_unique<Backend>(tags.at(i), ips[i], port));
            if (!out.back()->ok()) {
                error = out.back()->error();
                break;
            }
            port = out.back()->port();
        }
        if (out.size() == ips.size() && out.back()->ok()) return out;
    }
    return {};
}

// ---------------------------------------------------------------------------------------------
// Clients.

// One short connection: connect, the tag, 32 bytes there and back, our FIN, the relay's FIN.
using Visit = ShortVisit;

inline Visit shortVisit(const std::string& host, uint16_t port, uint64_t seed) {
    Visit v;
    v.started = Clock::now();
    Connected c = connectTo(host, port, Millis{10'000});
    if (!c.fd) {
        v.error = "connect: " + c.error;
        return v;
    }
    char tag = 0;
    IoResult r = readExactly(c.fd.get(), &tag, 1, Millis{10'000});
    if (!r.ok()) {
        v.error = "no tag: " + r.describe();
        return v;
    }
    v.tag = tag;
    uint8_t out[32], in[32];
    fillPayload(seed, 0, out);
    r = writeAll(c.fd.get(), out, sizeof out, Millis{10'000});
    if (!r.ok()) {
        v.error = "send: " + r.describe();
        return v;
    }
    r = readExactly(c.fd.get(), in, sizeof in, Millis{10'000});
    if (!r.ok()) {
        v.error = "echo: " + r.describe();
        return v;
    }
    if (std::memcmp(in, out, sizeof in) != 0) {
        v.error = "the echo differs";
        return v;
    }
    ::shutdown(c.fd.get(), SHUT_WR);
    char extra = 0;
    r = readSome(c.fd.get(), &extra, 1, Millis{10'000});
    if (r.status != IoStatus::Eof) v.error = "close: expected EOF, got " + r.describe();
    return v;
}

// A continuous, bounded load of short connections (shortVisit) on `threads` threads: at most
// 60 s and kMaxPerThread connections per thread, a few ms apart.
class Load : public ShortConnectionLoad {
  public:
    Load(std::string host, uint16_t port, int threads = 2)
        : ShortConnectionLoad(
              [host = std::move(host), port](int index, int i, const std::atomic<bool>&) {
                  return shortVisit(host, port, (uint64_t{0x10ad} << 32) | (index << 24) | i);
              },
              threads, kMaxPerThread) {}

  private:
    static constexpr int kMaxPerThread = 20'000;
};

// ---------------------------------------------------------------------------------------------
// Configs.

// One cluster following a name, with its own listener.
struct ClusterSpec {
    std::string name = "web";
    std::string listener = "t";
    std::string dns;  // or srv
    std::string srv;
    uint16_t port = 0;
    std::vector<std::string> keys = {"refresh_min: 200ms", "refresh_max: 1s"};
    std::string health_check;  // flow map, "" = none
};

// Cluster `name` following the A/AAAA name `dns` at `port`, its listener `listener`.
inline ClusterSpec dnsCluster(const std::string& dns, uint16_t port,
                              const std::string& name = "web", const std::string& listener = "t") {
    ClusterSpec c;
    c.name = name;
    c.listener = listener;
    c.dns = dns;
    c.port = port;
    return c;
}
inline ClusterSpec withKeys(ClusterSpec c, const std::vector<std::string>& keys) {
    c.keys = keys;
    return c;
}

class DiscoveryTest : public ::testing::Test {
  protected:
    void SetUp() override {
        if (!findExecutable("dnsmasq")) GTEST_SKIP() << "dnsmasq is not installed";
    }

    // resolv.conf for c-ares: the host's own could add search domains whose answers (REFUSED
    // from our dnsmasq) would change the outcome of a failing name. Nameservers come from
    // resolvers.nameservers: resolv.conf cannot carry a port.
    std::string writeResolvConf(const std::string& text = "options ndots:1\n",
                                const std::string& file = "resolv.conf") {
        return dir_.writeFile(file, text);
    }
    std::string resolversYaml(const DnsServer& dns, const std::string& resolv_conf,
                              const std::string& timeout = "300ms", int attempts = 2) {
        return "resolvers:\n  nameservers: [\"" + dns.address() + "\"]\n  resolv_conf: \"" +
               resolv_conf + "\"\n  timeout: " + timeout +
               "\n  attempts: " + std::to_string(attempts) + "\n";
    }
    RelayConfig relayConfig(const std::string& resolvers, const std::vector<ClusterSpec>& clusters,
                            const std::string& mode = "splice") {
        RelayConfig config;
        config.workers = 2;
        config.drain_timeout = "2s";
        std::string y = resolvers + "clusters:\n";
        for (const ClusterSpec& c : clusters) {
            y += "  - name: " + c.name + "\n    balance: round_robin\n    discovery:\n";
            if (!c.dns.empty())
                y += "      dns: " + c.dns + "\n      port: " + std::to_string(c.port) + "\n";
            else
                y += "      srv: " + c.srv + "\n";
            for (const std::string& k : c.keys) y += "      " + k + "\n";
            if (!c.health_check.empty()) y += "    health_check: " + c.health_check + "\n";
            ListenerSpec l;
            l.name = c.listener;
            l.cluster = c.name;
            l.mode = mode;
            l.connect_timeout = "2s";
            config.listeners.push_back(l);
        }
        config.extra_yaml = y;
        return config;
    }

    // A value from one scrape; -1 when the series is absent.
    static double valueIn(const std::string& text, const std::string& name, const Labels& labels) {
        return findSample(text, name, labels).value_or(-1);
    }
    double value(const std::string& name, const Labels& labels) const {
        return relay_.metric(name, labels).value_or(-1);
    }
    std::string scrape() const {
        std::string error;
        auto text = relay_.scrape(&error);
        EXPECT_TRUE(text) << error;
        return text.value_or("");
    }
    // Whether the per-backend series of `address` in `cluster_name` exist (the backend is in
    // the running generation).
    static bool hasBackendIn(const std::string& text, const std::string& cluster_name,
                             const std::string& address) {
        return findSample(text, metric::kBackendConnectionsTotal,
                          metric::backend(cluster_name, address))
            .has_value();
    }
    ::testing::AssertionResult waitDiscovered(const std::string& cluster_name, double n,
                                              Millis timeout = Millis{10'000}) const {
        return relay_.waitForMetric(kDiscovered, cluster(cluster_name), n, timeout);
    }
    // Until `address` is in the running generation of `cluster_name` (or, present false, no
    // longer is). Discovery counts a change (waitDiscovered) before the workers run the
    // generation that has it; the per-backend series come with that generation, published once
    // every worker runs it (Server::switchTo), so a connection made after this meets it.
    ::testing::AssertionResult waitRunning(const std::string& cluster_name,
                                           const std::string& address, bool present = true,
                                           Millis timeout = Millis{10'000}) const {
        if (waitUntil([&] { return hasBackendIn(scrape(), cluster_name, address) == present; },
                      timeout))
            return ::testing::AssertionSuccess();
        return ::testing::AssertionFailure() << address << (present ? " never ran" : " still runs")
                                             << " in cluster " << cluster_name << "\n"
                                             << scrape();
    }
    // Every close reason of listener `l` but "done" is 0, and no upstream connect failed.
    void expectOnlyCleanCloses(const std::string& l = "t") const {
        const std::string text = scrape();
        for (std::string_view label : metric::kClosedReasons) {
            if (label == "done") continue;
            const Labels labels = metric::reason(std::string(label), l);
            EXPECT_EQ(valueIn(text, metric::kClosedTotal, labels), 0.0)
                << formatSeries(metric::kClosedTotal, labels);
        }
        for (std::string_view label : metric::kConnectFailureReasons) {
            const Labels labels = metric::reason(std::string(label), l);
            const double v = valueIn(text, metric::kConnectFailuresTotal, labels);
            EXPECT_TRUE(v == 0.0 || v == -1.0)
                << formatSeries(metric::kConnectFailuresTotal, labels) << " = " << v;
        }
    }
    // How many log lines of the relay contain `what`.
    size_t logLines(const std::string& what) const {
        std::istringstream log(relay_.stderrText() + relay_.stdoutText());
        size_t n = 0;
        for (std::string line; std::getline(log, line);)
            if (line.find(what) != std::string::npos) ++n;
        return n;
    }

    TempDir dir_;
    DnsServer dns_;
    RelayProcess relay_;  // after dns_: stopped first
};

}  // namespace zcrelay::test::discovery_test
