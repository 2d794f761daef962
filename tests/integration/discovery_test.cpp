// DNS service discovery (proxy/discovery.hpp) on the real binary, against a real DNS server
// (dnsmasq, tests/support/dns_server.hpp) on a loopback port, over real sockets: a cluster
// following a name scales up and down under a continuous client load (in every data path), SRV
// ports, weights and priorities, a DNS server that stops answering (hold, after_hold), NXDOMAIN
// and SERVFAIL, answers too large for UDP, the refresh rate between refresh_min and refresh_max,
// startup: fail / empty, health checks of new addresses, SIGHUP, search domains and ndots, the
// address family, and the addresses refused as backends: unspecified, broadcast, multicast, port
// 0, and the relay's own listeners (a connection storm to itself), in every data path.
//
// The backends listen on distinct loopback addresses (127.0.0.2, 127.0.0.3, ...: all of 127/8
// is local) at one port, as the pods of a headless Service do. Each says who it is with one tag
// byte on every connection it accepts, then echoes. The oracles are what the clients see (the
// tag, byte-exact echoes, a clean EOF) and the relay's own metrics: zcrelay_discovery_* and the
// per-backend series, which come and go with the discovered set.
//
// Loopback only; every loop is bounded in count and time; only the processes and threads this
// file starts are stopped (by the fixtures that started them, by PID).
#include <ares.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/labels.hpp"
#include "support/dns_server.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::discovery_test {
namespace {

// The discovery metrics (proxy/metrics.cpp), all labelled {cluster} (+ outcome).
constexpr const char* kResolutions = "zcrelay_discovery_resolutions_total";
constexpr const char* kLastSuccess = "zcrelay_discovery_last_success_timestamp_seconds";
constexpr const char* kDiscovered = "zcrelay_discovery_backends";
constexpr const char* kChanges = "zcrelay_discovery_changes_total";
constexpr const char* kFailing = "zcrelay_discovery_failing";
constexpr const char* kBackendWeight = "zcrelay_backend_weight";  // {cluster, backend}
// {cluster, reason}: addresses answers named that were refused, summed over answers / in the last.
constexpr const char* kRefused = "zcrelay_discovery_refused_total";
constexpr const char* kRefusedNow = "zcrelay_discovery_refused_addresses";
const std::vector<std::string> kOutcomes = {"success", "nxdomain", "no_records",  "servfail",
                                            "refused", "timeout",  "unreachable", "error"};

Labels cluster(const std::string& name) { return {{"cluster", name}}; }
Labels outcome(const std::string& cluster_name, const std::string& what) {
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
std::vector<BackendPtr> backendsOnOnePort(const std::vector<std::string>& ips,
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
struct Visit {
    Clock::time_point started;
    char tag = 0;
    std::string error;  // empty: every step succeeded
    int thread = 0;     // Load's thread that made it
};

Visit shortVisit(const std::string& host, uint16_t port, uint64_t seed) {
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

// A continuous, bounded load of short connections on `threads` threads: at most 60 s and
// kMaxPerThread connections per thread, a few ms apart.
class Load {
  public:
    Load(std::string host, uint16_t port, int threads = 2) : host_(std::move(host)), port_(port) {
        for (int i = 0; i < threads; ++i) threads_.emplace_back([this, i] { run(i); });
    }
    ~Load() { stop(); }
    void stop() {
        stop_.store(true);
        for (auto& t : threads_)
            if (t.joinable()) t.join();
    }
    size_t total() const {
        std::lock_guard lock(mu_);
        return visits_.size();
    }
    bool waitForTotal(size_t n, Millis timeout) const {
        return waitUntil([&] { return total() >= n; }, timeout);
    }
    // Each thread finished a connection it started at or after `since`: every connection any
    // thread started before `since` is over (a thread runs one at a time).
    bool waitEachThreadPast(Clock::time_point since, Millis timeout) const {
        return waitUntil(
            [&] {
                std::lock_guard lock(mu_);
                for (int t = 0; t < static_cast<int>(threads_.size()); ++t) {
                    if (std::none_of(visits_.begin(), visits_.end(), [&](const Visit& v) {
                            return v.thread == t && v.started >= since;
                        }))
                        return false;
                }
                return true;
            },
            timeout);
    }
    // Per tag, the connections that started at or after `since` (tag 0: failed).
    std::map<char, int> tagsSince(Clock::time_point since) const {
        std::lock_guard lock(mu_);
        std::map<char, int> out;
        for (const Visit& v : visits_)
            if (v.started >= since) ++out[v.tag];
        return out;
    }
    std::vector<std::string> failures() const {
        std::lock_guard lock(mu_);
        std::vector<std::string> out;
        for (const Visit& v : visits_)
            if (!v.error.empty()) out.push_back(v.error);
        return out;
    }
    std::string describeFailures() const {
        auto f = failures();
        std::string out =
            std::to_string(f.size()) + " of " + std::to_string(total()) + " connections failed";
        for (size_t i = 0; i < f.size() && i < 5; ++i) out += "\n  " + f[i];
        return out;
    }

  private:
    static constexpr int kMaxPerThread = 20'000;

    void run(int index) {
        const auto begin = Clock::now();
        for (int i = 0; i < kMaxPerThread && !stop_.load() && secondsSince(begin) < 60; ++i) {
            Visit v = shortVisit(host_, port_, (uint64_t{0x10ad} << 32) | (index << 24) | i);
            v.thread = index;
            {
                std::lock_guard lock(mu_);
                visits_.push_back(v);
            }
            std::this_thread::sleep_for(Millis{4});
        }
    }

    std::string host_;
    uint16_t port_;
    std::atomic<bool> stop_{false};
    mutable std::mutex mu_;
    std::vector<Visit> visits_;
    std::vector<std::thread> threads_;  // last: started once the rest is built
};

// A long-lived connection: 4 KiB there and back every ~50 ms, each echo checked byte-exact,
// until finish(), which sends our FIN and expects the relay's.
class LongLived {
  public:
    LongLived(const std::string& host, uint16_t port, uint64_t seed) : seed_(seed) {
        Connected c = connectTo(host, port, Millis{10'000});
        if (!c.fd) {
            error_ = "connect: " + c.error;
            return;
        }
        IoResult r = readExactly(c.fd.get(), &tag_, 1, Millis{10'000});
        if (!r.ok()) {
            error_ = "no tag: " + r.describe();
            return;
        }
        fd_ = std::move(c.fd);
        thread_ = std::thread([this] { run(); });
    }
    ~LongLived() {
        stop_.store(true);
        if (thread_.joinable()) thread_.join();
    }
    char tag() const { return tag_; }
    uint64_t exchanged() const { return exchanged_.load(); }
    // Stops the exchanges, sends FIN, waits for the relay's FIN. The first failure, or "".
    std::string finish() {
        stop_.store(true);
        if (thread_.joinable()) thread_.join();
        if (error_.empty() && fd_) {
            ::shutdown(fd_.get(), SHUT_WR);
            char extra = 0;
            IoResult r = readSome(fd_.get(), &extra, 1, Millis{5'000});
            if (r.status != IoStatus::Eof) error_ = "close: expected EOF, got " + r.describe();
        }
        fd_.reset();
        return error_;
    }

  private:
    void run() {
        std::vector<uint8_t> want(4 * kKiB), got(4 * kKiB);
        const auto begin = Clock::now();
        while (!stop_.load() && secondsSince(begin) < 60) {
            const uint64_t at = exchanged_.load();
            IoResult r = sendPayloadAt(fd_.get(), seed_, at, want.size(), Millis{5'000});
            if (!r.ok()) {
                error_ = "send at " + std::to_string(at) + ": " + r.describe();
                return;
            }
            r = readExactly(fd_.get(), got.data(), got.size(), Millis{5'000});
            if (!r.ok()) {
                error_ = "echo at " + std::to_string(at) + ": " + r.describe();
                return;
            }
            fillPayload(seed_, at, want);
            if (got != want) {
                error_ = "the echo at " + std::to_string(at) + " differs";
                return;
            }
            exchanged_.fetch_add(got.size());
            for (int i = 0; i < 5 && !stop_.load(); ++i) std::this_thread::sleep_for(Millis{10});
        }
    }

    uint64_t seed_;
    Fd fd_;
    char tag_ = 0;
    std::string error_;
    std::atomic<bool> stop_{false};
    std::atomic<uint64_t> exchanged_{0};
    std::thread thread_;
};

// One long transfer through an echo: a writer paces 128 KiB every ~10 ms until finish(), then
// sends FIN; a reader checks every echoed byte against the payload until the relay's FIN.
class LongTransfer {
  public:
    LongTransfer(const std::string& host, uint16_t port, uint64_t seed)
        : seed_(seed), verifier_(seed) {
        Connected c = connectTo(host, port, Millis{10'000});
        if (!c.fd) {
            error_ = "connect: " + c.error;
            return;
        }
        IoResult r = readExactly(c.fd.get(), &tag_, 1, Millis{10'000});
        if (!r.ok()) {
            error_ = "no tag: " + r.describe();
            return;
        }
        fd_ = std::move(c.fd);
        reader_ = std::thread([this] {
            read_ = readStreamUntilEof(
                fd_.get(), [this](std::span<const uint8_t> d) { verifier_.update(d); },
                Millis{90'000}, &abort_);
        });
        writer_ = std::thread([this] { write(); });
    }
    ~LongTransfer() {
        stop_.store(true);
        if (writer_.joinable()) writer_.join();
        abort_.store(true);
        if (reader_.joinable()) reader_.join();
    }
    bool ok() const { return fd_.valid(); }
    const std::string& error() const { return error_; }
    char tag() const { return tag_; }
    uint64_t sent() const { return sent_.load(); }
    // Ends the stream: what the writer sent must come back, byte-exact, then EOF.
    ::testing::AssertionResult finish() {
        stop_.store(true);
        if (writer_.joinable()) writer_.join();
        if (reader_.joinable()) reader_.join();
        if (!write_.ok()) return ::testing::AssertionFailure() << "send: " << write_.describe();
        if (read_.status != IoStatus::Eof)
            return ::testing::AssertionFailure()
                   << "the echo did not end with EOF: " << read_.describe();
        if (verifier_.bytes() != sent_.load() || !verifier_.intact())
            return ::testing::AssertionFailure()
                   << "sent " << sent_.load() << " bytes, " << verifier_.bytes()
                   << " came back, first mismatch at " << verifier_.firstMismatch();
        return ::testing::AssertionSuccess();
    }

  private:
    void write() {
        const auto begin = Clock::now();
        while (!stop_.load() && secondsSince(begin) < 60) {
            write_ = sendPayloadAt(fd_.get(), seed_, sent_.load(), 128 * kKiB, Millis{10'000});
            if (!write_.ok()) return;
            sent_.fetch_add(128 * kKiB);
            std::this_thread::sleep_for(Millis{10});
        }
        ::shutdown(fd_.get(), SHUT_WR);
    }

    uint64_t seed_;
    Fd fd_;
    char tag_ = 0;
    std::string error_;
    PayloadVerifier verifier_;
    IoResult write_, read_;
    std::atomic<bool> stop_{false}, abort_{false};
    std::atomic<uint64_t> sent_{0};
    std::thread reader_, writer_;
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
ClusterSpec dnsCluster(const std::string& dns, uint16_t port, const std::string& name = "web",
                       const std::string& listener = "t") {
    ClusterSpec c;
    c.name = name;
    c.listener = listener;
    c.dns = dns;
    c.port = port;
    return c;
}
ClusterSpec withKeys(ClusterSpec c, const std::vector<std::string>& keys) {
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

// =============================================================================================
// 1. Scale up and down under load, in every data path. The name web.test goes from 2 addresses
// to 4 and then to 1 while short connections run continuously, a paced long transfer runs from
// start to end, and a few long-lived connections exchange every 50 ms. Nothing may fail.

class DiscoveryScaleTest : public DiscoveryTest,
                           public ::testing::WithParamInterface<std::string> {};

TEST_P(DiscoveryScaleTest, FollowsScaleUpAndDownUnderLoadWithoutFailingAConnection) {
    const std::string mode = GetParam();
    std::string why;
    auto backends =
        backendsOnOnePort({"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"}, "2345", why);
    ASSERT_EQ(backends.size(), 4u) << why;
    Backend &b2 = *backends[0], &b3 = *backends[1], &b4 = *backends[2], &b5 = *backends[3];
    const uint16_t port = b2.port();

    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("web.test", {"127.0.0.2", "127.0.0.3"}));
    ClusterSpec web = dnsCluster("web.test", port);
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(dns_, writeResolvConf()), {web}, mode)));
    EXPECT_EQ(value(metric::kDatapathInfo, metric::datapath(mode)), 1.0)
        << "listener t should run the " << mode << " data path";
    EXPECT_EQ(value(kDiscovered, cluster("web")), 2.0);
    const std::string host = relay_.host();
    const uint16_t relay_port = relay_.port();

    // Long-lived connections on both first backends (round robin: within a few tries each).
    std::vector<std::unique_ptr<LongLived>> lived;
    auto openOn = [&](char tag, int wanted) {
        for (int tries = 0; tries < 12; ++tries) {
            int have = 0;
            for (auto& l : lived) have += l->tag() == tag;
            if (have >= wanted) return true;
            lived.push_back(std::make_unique<LongLived>(host, relay_port, 0x1000 + lived.size()));
            if (lived.back()->tag() == 0) {
                ADD_FAILURE() << "a long-lived connection failed: " << lived.back()->finish();
                return false;
            }
        }
        return false;
    };
    ASSERT_TRUE(openOn('2', 2));
    ASSERT_TRUE(openOn('3', 2));

    LongTransfer transfer(host, relay_port, 0x7a4f);
    ASSERT_TRUE(transfer.ok()) << transfer.error();
    Load load(host, relay_port);
    ASSERT_TRUE(load.waitForTotal(100, Millis{10'000})) << load.describeFailures();

    // ---- 2 -> 4: the new backends take connections within one refresh (TTL 1 s).
    std::string text = scrape();
    const double kept2 =
        valueIn(text, metric::kBackendConnectionsTotal, metric::backend("web", b2.address()));
    const double kept3 =
        valueIn(text, metric::kBackendConnectionsTotal, metric::backend("web", b3.address()));
    ASSERT_GT(kept2, 0);
    ASSERT_GT(kept3, 0);
    EXPECT_FALSE(hasBackendIn(text, "web", b4.address()));
    const double changes_before = valueIn(text, kChanges, cluster("web"));
    const auto up_at = Clock::now();
    ASSERT_TRUE(
        dns_.setAddresses("web.test", {"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"}));
    const bool reached = waitUntil(
        [&] {
            const std::string t = scrape();
            return valueIn(t, metric::kBackendConnectionsTotal,
                           metric::backend("web", b4.address())) > 0 &&
                   valueIn(t, metric::kBackendConnectionsTotal,
                           metric::backend("web", b5.address())) > 0;
        },
        Millis{10'000}, Millis{10});  // one refresh (TTL 1 s) and then some: a loaded machine
    const double up_seconds = secondsSince(up_at);
    ASSERT_TRUE(reached) << "the 2 new backends took no connection within 10 s of the DNS change\n"
                         << scrape() << relay_.diagnostics();
    std::cout << "[ scale 2->4 ] new backends served after " << up_seconds << " s\n";
    // The relay counts a backend's connection once its connect completed; the backend's own
    // accept() can come a moment later (a clean-clone run saw b5's count still at 0 here).
    EXPECT_TRUE(waitUntil([&] { return b4.accepted() > 0 && b5.accepted() > 0; }, Millis{10'000},
                          Millis{10}))
        << "accepted: 127.0.0.4 " << b4.accepted() << ", 127.0.0.5 " << b5.accepted();
    text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("web")), 4.0);
    for (const Backend* b : {&b4, &b5})
        EXPECT_GE(
            valueIn(text, metric::kBackendConnectionsActive, metric::backend("web", b->address())),
            0)
            << "the per-backend series appear with the backend " << b->address();
    EXPECT_EQ(valueIn(text, kChanges, cluster("web")), changes_before + 1);
    // Kept backends kept their state: their counters went on from where they were.
    EXPECT_GE(valueIn(text, metric::kBackendConnectionsTotal, metric::backend("web", b2.address())),
              kept2);
    EXPECT_GE(valueIn(text, metric::kBackendConnectionsTotal, metric::backend("web", b3.address())),
              kept3);

    ASSERT_TRUE(openOn('4', 1));
    ASSERT_TRUE(openOn('5', 1));

    // ---- 4 -> 1: once the change is applied, the removed backends get no new connection.
    std::map<const LongLived*, uint64_t> before_removal;
    for (auto& l : lived) before_removal[l.get()] = l->exchanged();
    ASSERT_TRUE(dns_.setAddresses("web.test", {"127.0.0.2"}));
    ASSERT_TRUE(waitDiscovered("web", 1, Millis{10'000})) << relay_.diagnostics();
    // Applied: the running generation (what the metrics show, published once every worker runs
    // it) has no series of the removed ones any more.
    ASSERT_TRUE(waitUntil(
        [&] {
            const std::string t = scrape();
            return !hasBackendIn(t, "web", b3.address()) && !hasBackendIn(t, "web", b4.address()) &&
                   !hasBackendIn(t, "web", b5.address()) && hasBackendIn(t, "web", b2.address());
        },
        Millis{10'000}))
        << scrape();
    const auto applied_at = Clock::now();
    text = scrape();
    for (const Backend* b : {&b3, &b4, &b5})
        EXPECT_FALSE(findSample(text, metric::kBackendConnectionsActive,
                                metric::backend("web", b->address())))
            << "the per-backend series go with the backend " << b->address();
    EXPECT_TRUE(
        findSample(text, metric::kBackendConnectionsActive, metric::backend("web", b2.address())));
    // A connect a worker started just before it switched may still reach the kernel's accept
    // queue of a removed backend: those are over once each load thread finished a connection
    // it started after the switch; then nothing more.
    ASSERT_TRUE(load.waitEachThreadPast(applied_at, Millis{20'000})) << load.describeFailures();
    const auto frozen_at = Clock::now();
    const size_t frozen3 = b3.accepted(), frozen4 = b4.accepted(), frozen5 = b5.accepted();
    const size_t total_at_freeze = load.total();
    ASSERT_TRUE(load.waitForTotal(total_at_freeze + 100, Millis{20'000}));
    // "Nothing more" watched a second longer: load can only hide a late accept, not make one.
    std::this_thread::sleep_for(Millis{1'000});
    EXPECT_EQ(b3.accepted(), frozen3) << "127.0.0.3 accepted after it left DNS";
    EXPECT_EQ(b4.accepted(), frozen4) << "127.0.0.4 accepted after it left DNS";
    EXPECT_EQ(b5.accepted(), frozen5) << "127.0.0.5 accepted after it left DNS";
    const auto since = load.tagsSince(frozen_at);
    int others = 0;
    for (auto [tag, n] : since)
        if (tag != '2') others += n;
    EXPECT_EQ(others, 0) << "connections after the change reached another backend than 127.0.0.2";
    EXPECT_GT(since.count('2') ? since.at('2') : 0, 50);

    // The removed backends' long-lived connections kept relaying, byte-exact, until we closed.
    int on_removed = 0;
    for (auto& l : lived) {
        if (l->tag() != '2') {
            ++on_removed;
            EXPECT_GT(l->exchanged(), before_removal[l.get()])
                << "a long-lived connection to backend " << l->tag() << " stalled after removal";
        }
    }
    EXPECT_GE(on_removed, 4);
    for (auto& l : lived) EXPECT_EQ(l->finish(), "") << "long-lived connection to " << l->tag();

    load.stop();
    ASSERT_TRUE(transfer.finish());
    std::cout << "[ transfer ] " << transfer.sent() / kMiB << " MiB through backend "
              << transfer.tag() << ", " << load.total() << " short connections\n";
    EXPECT_GE(transfer.sent(), 20 * kMiB) << "the long transfer should be tens of MiB";
    EXPECT_TRUE(load.failures().empty()) << load.describeFailures();

    ASSERT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    expectOnlyCleanCloses();
    EXPECT_EQ(value(kFailing, cluster("web")), 0.0);
    EXPECT_GE(value(kResolutions, outcome("web", "success")), 3.0);
}
ZCRELAY_LABEL(DiscoveryScaleTest, FollowsScaleUpAndDownUnderLoadWithoutFailingAConnection, "sockmap", kSanitizeSkip,
              "the publish path is the splice case's; sockmap's path runs elsewhere");

// Discovery decides which backend a new connection gets. The connections kept on removed
// backends run on, which in sockmap mode means map entries outliving their backend: splice and
// sockmap; copy adds nothing here the relay suites do not cover.
INSTANTIATE_TEST_SUITE_P(Modes, DiscoveryScaleTest, ::testing::Values("splice", "sockmap"),
                         modeName);

// =============================================================================================
// 2. SRV: each record's port and weight; only the lowest priority; a changed set is followed.

TEST_F(DiscoveryTest, SrvRecordsGivePortsWeightsAndOnlyTheLowestPriority) {
    Backend a('a', "127.0.0.2", 0), b('b', "127.0.0.3", 0), c('c', "127.0.0.4", 0);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok()) << a.error() << b.error() << c.error();
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("a.srv.test", {"127.0.0.2"}));
    ASSERT_TRUE(dns_.setAddresses("b.srv.test", {"127.0.0.3"}));
    ASSERT_TRUE(dns_.setAddresses("c.srv.test", {"127.0.0.4"}));
    const std::string name = "_app._tcp.srv.test";
    ASSERT_TRUE(dns_.setSrv(name, {{0, 3, a.port(), "a.srv.test"},
                                   {0, 1, b.port(), "b.srv.test"},
                                   {10, 1, c.port(), "c.srv.test"}}));
    ClusterSpec app;
    app.name = "app";
    app.srv = name;
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(dns_, writeResolvConf()), {app})));

    std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("app")), 2.0) << text;
    EXPECT_TRUE(hasBackendIn(text, "app", a.address())) << "at the SRV record's port";
    EXPECT_TRUE(hasBackendIn(text, "app", b.address()));
    EXPECT_FALSE(hasBackendIn(text, "app", c.address())) << "priority 10 while 0 has targets";
    EXPECT_EQ(valueIn(text, kBackendWeight, metric::backend("app", a.address())), 3.0);
    EXPECT_EQ(valueIn(text, kBackendWeight, metric::backend("app", b.address())), 1.0);

    std::map<char, int> tags;
    for (int i = 0; i < 400; ++i) {
        Visit v = shortVisit(relay_.host(), relay_.port(), 0x5e00 + i);
        EXPECT_EQ(v.error, "") << "connection " << i;
        ++tags[v.tag];
    }
    const double share = tags['a'] / 400.0;
    std::cout << "[ srv ] a " << tags['a'] << ", b " << tags['b'] << ", c " << tags['c'] << "\n";
    EXPECT_NEAR(share, 0.75, 0.07) << "weights 3:1 under round robin";
    EXPECT_EQ(tags['a'] + tags['b'], 400);
    EXPECT_EQ(tags['c'], 0);
    EXPECT_EQ(c.accepted(), 0u);

    // The priority-0 records go: the priority-10 target is all there is, and takes everything.
    ASSERT_TRUE(dns_.setSrv(name, {{10, 1, c.port(), "c.srv.test"}}));
    ASSERT_TRUE(relay_.waitForMetric(
        metric::kBackendConnectionsTotal, metric::backend("app", c.address()),
        [](double v) { return v >= 0; }, "present", Millis{10'000}))
        << scrape();
    // The running generation (published once every worker runs it) is the new one.
    EXPECT_TRUE(waitUntil(
        [&] {
            const std::string t = scrape();
            return !hasBackendIn(t, "app", a.address()) && !hasBackendIn(t, "app", b.address());
        },
        Millis{10'000}));
    text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("app")), 1.0);
    EXPECT_FALSE(hasBackendIn(text, "app", a.address()));
    for (int i = 0; i < 20; ++i) {
        Visit v = shortVisit(relay_.host(), relay_.port(), 0x5f00 + i);
        EXPECT_EQ(v.error, "");
        EXPECT_EQ(v.tag, 'c');
    }
}

// =============================================================================================
// 3. The DNS server stops: the last good set serves for hold; then after_hold decides; when the
// server is back the set comes back.

TEST_F(DiscoveryTest, DnsServerDownHoldsTheLastSetThenAfterHoldDecides) {
    std::string why;
    auto backends = backendsOnOnePort({"127.0.0.2", "127.0.0.3"}, "23", why);
    ASSERT_EQ(backends.size(), 2u) << why;
    const uint16_t port = backends[0]->port();
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("drop.test", {"127.0.0.2"}));
    ASSERT_TRUE(dns_.setAddresses("keep.test", {"127.0.0.3"}));
    const std::vector<std::string> hold = {"refresh_min: 200ms", "refresh_max: 1s", "hold: 2s"};
    ClusterSpec drop = withKeys(dnsCluster("drop.test", port, "drop", "e"), hold);
    ClusterSpec keep = withKeys(dnsCluster("keep.test", port, "keep", "k"), hold);
    keep.keys.push_back("after_hold: keep");
    ASSERT_TRUE(relay_.start(
        relayConfig(resolversYaml(dns_, writeResolvConf(), "200ms", 1), {drop, keep})));
    ASSERT_EQ(shortVisit(relay_.host("e"), relay_.port("e"), 1).tag, '2');
    ASSERT_EQ(shortVisit(relay_.host("k"), relay_.port("k"), 2).tag, '3');
    const double last_good = value(kLastSuccess, cluster("drop"));
    const double now_unix =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    EXPECT_NEAR(last_good, now_unix, 5.0) << "last success should be about now";

    const auto stopped_at = Clock::now();
    dns_.stop();
    // Until the drop cluster's set goes, every connection to either listener is served.
    std::optional<double> dropped_after;
    bool saw_failing = false;
    int probes = 0;
    // Served while in hold: up to 1.2 s after the stop, when the set must still be there (the
    // first failure comes after the stop, and the set goes 2 s after it), which leaves 0.8 s
    // for a loaded machine to accept the last probe. Dropped within 15 s: one refresh (1 s)
    // and the hold (2 s), with room for load.
    for (int i = 0; i < 1000 && secondsSince(stopped_at) < 15; ++i) {
        const std::string t = scrape();
        if (valueIn(t, kFailing, cluster("drop")) == 1 &&
            valueIn(t, kFailing, cluster("keep")) == 1)
            saw_failing = true;
        if (valueIn(t, kDiscovered, cluster("drop")) == 0) {
            dropped_after = secondsSince(stopped_at);
            break;
        }
        if (secondsSince(stopped_at) < 1.2) {
            Visit e = shortVisit(relay_.host("e"), relay_.port("e"), 100 + i);
            EXPECT_EQ(e.error, "") << "during hold, " << secondsSince(stopped_at) << " s";
            EXPECT_EQ(e.tag, '2');
            ++probes;
        }
        Visit k = shortVisit(relay_.host("k"), relay_.port("k"), 300 + i);
        EXPECT_EQ(k.error, "");
        EXPECT_EQ(k.tag, '3');
        std::this_thread::sleep_for(Millis{30});  // pacing
    }
    EXPECT_TRUE(saw_failing) << "zcrelay_discovery_failing should be 1 while DNS is down";
    // How many fit in the window is the machine's speed (2 on a loaded one, 20 idle): one will do.
    EXPECT_GE(probes, 1) << "no probe during the hold";
    ASSERT_TRUE(dropped_after) << "after_hold: empty did not drop the set within 15 s\n"
                               << scrape();
    std::cout << "[ hold ] the set went " << *dropped_after << " s after the server stopped\n";
    EXPECT_GE(*dropped_after, 1.95) << "hold is 2 s, counted from the first failure";

    std::string text = scrape();
    for (const char* c : {"drop", "keep"}) {
        const double failures = valueIn(text, kResolutions, outcome(c, "timeout")) +
                                valueIn(text, kResolutions, outcome(c, "unreachable"));
        EXPECT_GE(failures, 2.0) << c << ": a stopped server is a timeout or unreachable";
        for (const char* other : {"nxdomain", "no_records", "servfail", "refused", "error"})
            EXPECT_EQ(valueIn(text, kResolutions, outcome(c, other)), 0.0) << c << " " << other;
        EXPECT_EQ(valueIn(text, kFailing, cluster(c)), 1.0) << c;
    }
    EXPECT_EQ(valueIn(text, kLastSuccess, cluster("drop")), last_good);
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("keep")), 1.0) << "after_hold: keep";
    EXPECT_FALSE(hasBackendIn(text, "drop", backends[0]->address()));

    // after_hold: empty: no backend; the relay closes new clients (no_backend), not ready.
    const double no_backend =
        valueIn(text, metric::kClosedTotal, metric::reason("no_backend", "e"));
    {
        Connected c = connectTo(relay_.host("e"), relay_.port("e"));
        ASSERT_TRUE(c.fd) << c.error;
        char tag = 0;
        IoResult r = readExactly(c.fd.get(), &tag, 1, Millis{3'000});
        EXPECT_TRUE(endedByPeer(r)) << "expected the relay to close it: " << r.describe();
    }
    EXPECT_TRUE(relay_.waitForMetric(
        metric::kClosedTotal, metric::reason("no_backend", "e"),
        [&](double v) { return v > no_backend; }, "moved"));
    auto ready = relay_.get("/readyz");
    ASSERT_TRUE(ready);
    EXPECT_EQ(ready->status, 503);
    EXPECT_NE(ready->body.find("drop"), std::string::npos) << ready->body;
    // after_hold: keep: serving on.
    Visit k = shortVisit(relay_.host("k"), relay_.port("k"), 999);
    EXPECT_EQ(k.error, "");
    EXPECT_EQ(k.tag, '3');

    // The server is back: the set comes back (asked every refresh_min) and serves.
    ASSERT_TRUE(dns_.restart());
    ASSERT_TRUE(waitDiscovered("drop", 1, Millis{10'000})) << scrape();
    EXPECT_TRUE(relay_.waitForMetric(kFailing, cluster("drop"), 0, Millis{10'000}));
    EXPECT_TRUE(relay_.waitForMetric(kFailing, cluster("keep"), 0, Millis{10'000}));
    EXPECT_GT(value(kLastSuccess, cluster("drop")), last_good);
    EXPECT_TRUE(
        waitUntil([&] { return shortVisit(relay_.host("e"), relay_.port("e"), 7).tag == '2'; },
                  Millis{10'000}));
    EXPECT_TRUE(waitUntil(
        [&] {
            auto r = relay_.get("/readyz");
            return r && r->status == 200;
        },
        Millis{10'000}));
}

// =============================================================================================
// 4. NXDOMAIN and SERVFAIL (and REFUSED, for a name outside the zone): each counted under its
// outcome; the last good set is held for hold.

TEST_F(DiscoveryTest, NxdomainAndServfailAreCountedAndTheLastSetIsHeld) {
    std::string why;
    auto backends = backendsOnOnePort({"127.0.0.2", "127.0.0.3"}, "23", why);
    ASSERT_EQ(backends.size(), 2u) << why;
    const uint16_t port = backends[0]->port();
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("nx.test", {"127.0.0.2"}));
    ASSERT_TRUE(dns_.setAddresses("svc.fail.test", {"127.0.0.3"}));
    const std::vector<std::string> hold = {"refresh_min: 200ms", "refresh_max: 1s", "hold: 2s"};
    ClusterSpec nx = withKeys(dnsCluster("nx.test", port, "nx", "n"), hold);
    ClusterSpec sf = withKeys(dnsCluster("svc.fail.test", port, "sf", "s"), hold);
    // And a name outside the zone dnsmasq serves: it answers REFUSED (never forwarded).
    ClusterSpec rf = withKeys(dnsCluster("web.example.", port, "rf", "r"),
                              {"refresh_min: 200ms", "refresh_max: 1s", "startup: empty"});
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(dns_, writeResolvConf()), {nx, sf, rf})));
    ASSERT_EQ(shortVisit(relay_.host("n"), relay_.port("n"), 1).tag, '2');
    ASSERT_EQ(shortVisit(relay_.host("s"), relay_.port("s"), 2).tag, '3');

    // The name is removed: NXDOMAIN. The other domain's server fails: SERVFAIL (its name must
    // have no local records first, or dnsmasq would answer from them).
    const auto changed_at = Clock::now();
    ASSERT_TRUE(dns_.setAddresses("nx.test", {}));
    ASSERT_TRUE(dns_.setAddresses("svc.fail.test", {}));
    ASSERT_TRUE(dns_.failWithServfail("fail.test"));
    ASSERT_TRUE(relay_.waitForMetric(kFailing, cluster("nx"), 1, Millis{10'000}));
    ASSERT_TRUE(relay_.waitForMetric(kFailing, cluster("sf"), 1, Millis{10'000}));
    // Just failed, so held: the sets go 2 s after the first failure, long after this scrape.
    std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("nx")), 1.0);
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("sf")), 1.0);
    EXPECT_EQ(valueIn(text, kFailing, cluster("nx")), 1.0);
    EXPECT_EQ(valueIn(text, kFailing, cluster("sf")), 1.0);

    // Held: both still serve until about hold after their first failure, which came after
    // `changed_at`. Probes up to 1.2 s after it leave 0.8 s for a loaded machine to accept.
    int probes = 0;
    while (secondsSince(changed_at) < 1.2 && probes < 100) {
        Visit n = shortVisit(relay_.host("n"), relay_.port("n"), 100 + probes);
        Visit s = shortVisit(relay_.host("s"), relay_.port("s"), 200 + probes);
        EXPECT_EQ(n.tag, '2') << n.error << " at " << secondsSince(changed_at) << " s";
        EXPECT_EQ(s.tag, '3') << s.error << " at " << secondsSince(changed_at) << " s";
        ++probes;
        std::this_thread::sleep_for(Millis{50});  // pacing
    }
    // Then (after_hold: empty by default) the sets go.
    EXPECT_TRUE(waitDiscovered("nx", 0, Millis{10'000}));
    EXPECT_TRUE(waitDiscovered("sf", 0, Millis{10'000}));
    EXPECT_GE(secondsSince(changed_at), 1.95);

    // Each failure under its own outcome. (dig sees these very answers: NXDOMAIN, SERVFAIL,
    // REFUSED; tests/integration/dns_server_test.cpp.)
    text = scrape();
    auto outcomes = [&](const std::string& c) {
        std::string out;
        for (const std::string& o : kOutcomes)
            out += " " + o + "=" +
                   std::to_string(static_cast<long>(valueIn(text, kResolutions, outcome(c, o))));
        return out;
    };
    EXPECT_GE(valueIn(text, kResolutions, outcome("nx", "nxdomain")), 2.0) << outcomes("nx");
    for (const char* other :
         {"no_records", "servfail", "refused", "timeout", "unreachable", "error"})
        EXPECT_EQ(valueIn(text, kResolutions, outcome("nx", other)), 0.0) << "nx " << other;
    // sf may see one NXDOMAIN between its records' removal and the SERVFAIL taking over; every
    // other failure of it is a SERVFAIL from a server that answered. c-ares before 1.20 (Debian
    // 12 ships 1.18.1) drops a SERVFAIL or REFUSED answer to try the next nameserver and ends
    // the query as "connection refused" once none is left: the relay can only say
    // `unreachable` then (discovery.hpp). From 1.20 on it reports the answer's code.
    const bool rcodes = ARES_VERSION >= 0x011400;
    const char* servfail = rcodes ? "servfail" : "unreachable";
    const char* refused = rcodes ? "refused" : "unreachable";
    EXPECT_GE(valueIn(text, kResolutions, outcome("sf", servfail)), 2.0)
        << "SERVFAIL answers count as outcome=\"" << servfail << "\":" << outcomes("sf");
    for (const char* other :
         {"no_records", "servfail", "refused", "timeout", "unreachable", "error"}) {
        if (std::string(other) != servfail) {
            EXPECT_EQ(valueIn(text, kResolutions, outcome("sf", other)), 0.0) << "sf " << other;
        }
    }
    EXPECT_LE(valueIn(text, kResolutions, outcome("sf", "nxdomain")), 1.0);
    EXPECT_GE(valueIn(text, kResolutions, outcome("rf", refused)), 2.0)
        << "REFUSED answers count as outcome=\"" << refused << "\":" << outcomes("rf");
}

// =============================================================================================
// 5. An answer too large for UDP comes whole over TCP; max_backends keeps the lowest addresses.

// The queries for `name` of `type` from the relay (127.0.0.1) that came over TCP: dnsmasq serves
// each TCP connection in a child it forks, whose PID its log lines carry, while UDP is answered by
// the main process (the PID of the log's first line).
size_t tcpQueries(const DnsServer& dns, const std::string& name, const std::string& type) {
    std::ifstream log(dns.logPath());
    static const std::regex kLine(R"(dnsmasq\[(\d+)\]: (.*))");
    std::string main_pid;
    size_t n = 0;
    const std::string want = "query[" + type + "] " + name + " from 127.0.0.1";
    for (std::string line; std::getline(log, line);) {
        std::smatch m;
        if (!std::regex_search(line, m, kLine)) continue;
        if (main_pid.empty()) main_pid = m[1];
        if (m[2] == want && m[1] != main_pid) ++n;
    }
    return n;
}

TEST_F(DiscoveryTest, FortyAddressesComeOverTcpAndMaxBackendsKeepsTheLowest) {
    // c-ares (1.18 here) sends no EDNS OPT record, so a UDP answer is limited to 512 bytes: 30
    // A records of one name fit, and dnsmasq sets TC with those 30. c-ares then asks again over
    // TCP, which carries all 40. A relay that accepted the truncated answer would see 30.
    std::vector<std::string> forty;
    for (int i = 10; i < 50; ++i) forty.push_back("127.0.0." + std::to_string(i));
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("big.test", forty));
    ClusterSpec all = dnsCluster("big.test", 9, "all", "a");
    ClusterSpec capped = dnsCluster("big.test", 9, "capped", "c");
    capped.keys.push_back("max_backends: 8");
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(dns_, writeResolvConf()), {all, capped})));

    const std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("all")), 40.0) << text;
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("capped")), 8.0);
    for (int i = 10; i < 50; ++i) {
        const std::string address = "127.0.0." + std::to_string(i) + ":9";
        EXPECT_TRUE(hasBackendIn(text, "all", address)) << address;
        EXPECT_EQ(hasBackendIn(text, "capped", address), i < 18) << address << " (the lowest 8)";
    }
    EXPECT_GE(tcpQueries(dns_, "big.test", "A"), 1u) << "no A query for big.test came over TCP\n"
                                                     << dns_.diagnostics();
    EXPECT_NE(logLines("max_backends keeps the lowest 8"), 0u) << relay_.stderrText();
}

// =============================================================================================
// 6. Refresh: TTL 0 is asked again every refresh_min, a TTL of a day every refresh_max.

TEST_F(DiscoveryTest, RefreshFollowsTheTtlClampedToRefreshMinAndMax) {
    DnsServer zero, day;
    ASSERT_TRUE(zero.start({.ttl = 0}));
    ASSERT_TRUE(day.start({.ttl = 86400}));
    ASSERT_TRUE(zero.setAddresses("ttl.test", {"127.0.0.2"}));
    ASSERT_TRUE(day.setAddresses("ttl.test", {"127.0.0.2"}));
    ClusterSpec fast = withKeys(dnsCluster("ttl.test", 9), {"refresh_min: 300ms"});
    ClusterSpec slow =
        withKeys(dnsCluster("ttl.test", 9), {"refresh_min: 200ms", "refresh_max: 1s"});
    RelayProcess relay_day;
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(zero, writeResolvConf()), {fast})));
    ASSERT_TRUE(relay_day.start(relayConfig(resolversYaml(day, writeResolvConf()), {slow})));

    const size_t zero0 = zero.queriesFor("ttl.test", "A");
    const size_t day0 = day.queriesFor("ttl.test", "A");
    const auto t0 = Clock::now();
    // Asked again, and again: 3 more queries at refresh_min (300 ms) and 2 at refresh_max (1 s)
    // take about 1 s and 2 s; 15 s is room for a loaded machine, and a TTL that were not
    // clamped would ask again after a day, never.
    EXPECT_TRUE(waitUntil([&] { return zero.queriesFor("ttl.test", "A") - zero0 >= 3; },
                          Millis{15'000}, Millis{50}))
        << "TTL 0, refresh_min 300ms: asked again " << zero.queriesFor("ttl.test", "A") - zero0
        << " times";
    EXPECT_TRUE(waitUntil([&] { return day.queriesFor("ttl.test", "A") - day0 >= 2; },
                          Millis{15'000}, Millis{50}))
        << "TTL 86400, refresh_max 1s: asked again " << day.queriesFor("ttl.test", "A") - day0
        << " times";
    const double waited = secondsSince(t0);
    const size_t zero_n = zero.queriesFor("ttl.test", "A") - zero0;
    const size_t day_n = day.queriesFor("ttl.test", "A") - day0;
    std::cout << "[ refresh ] TTL 0: " << zero_n << " queries, TTL 86400: " << day_n << " in "
              << waited << " s\n";
    // Upper bounds per second that really passed (the rates the fixed bounds allowed before:
    // 20 in 2 s, 5 in 3 s), so load cannot break them: a query loop asks hundreds of times a
    // second, refresh_min (200 ms) instead of refresh_max five times.
    EXPECT_LE(zero_n, static_cast<size_t>(waited * 10) + 2) << "TTL 0 must not become a query loop";
    EXPECT_LE(day_n, static_cast<size_t>(waited * 5 / 3) + 2) << "refresh_max 1s, not refresh_min";
    EXPECT_EQ(value(kChanges, cluster("web")), 1.0) << "the same answer is no change";
}
ZCRELAY_LABEL(DiscoveryTest, RefreshFollowsTheTtlClampedToRefreshMinAndMax, "", kSanitizeSkip,
              "waits for the DNS server's query counts");

// =============================================================================================
// 7. Startup: fail stops the relay naming the cluster and the name; empty starts unready.

TEST_F(DiscoveryTest, StartupFailExitsAndStartupEmptyStartsUnready) {
    Backend b('2', "127.0.0.2", 0);
    ASSERT_TRUE(b.ok()) << b.error();
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    const std::string resolvers = resolversYaml(dns_, writeResolvConf());
    {
        RelayProcess failing;
        ClusterSpec web = dnsCluster("missing.test", b.port());
        web.keys.push_back("startup: fail");
        EXPECT_FALSE(failing.start(relayConfig(resolvers, {web})));
        auto status = failing.waitExit(Millis{5'000});
        ASSERT_TRUE(status) << "the relay should have exited\n" << failing.diagnostics();
        EXPECT_TRUE(status->exited && status->code != 0) << status->describe();
        const std::string out = failing.stderrText() + failing.stdoutText();
        EXPECT_NE(out.find("cluster web"), std::string::npos) << out;
        EXPECT_NE(out.find("missing.test"), std::string::npos) << out;
        EXPECT_NE(out.find("nxdomain"), std::string::npos) << out;
    }

    ClusterSpec web = dnsCluster("late.test", b.port());
    web.keys.push_back("startup: empty");
    ASSERT_TRUE(relay_.start(relayConfig(resolvers, {web})));
    EXPECT_EQ(value(kDiscovered, cluster("web")), 0.0);
    auto ready = relay_.get("/readyz");
    ASSERT_TRUE(ready);
    EXPECT_EQ(ready->status, 503);
    EXPECT_NE(ready->body.find("web"), std::string::npos) << ready->body;
    Visit none = shortVisit(relay_.host(), relay_.port(), 1);
    EXPECT_EQ(none.tag, 0) << "no backend yet";

    ASSERT_TRUE(dns_.setAddresses("late.test", {"127.0.0.2"}));
    ASSERT_TRUE(waitDiscovered("web", 1, Millis{10'000})) << scrape();
    EXPECT_TRUE(waitUntil([&] { return shortVisit(relay_.host(), relay_.port(), 2).tag == '2'; },
                          Millis{10'000}));
    EXPECT_TRUE(waitUntil(
        [&] {
            auto r = relay_.get("/readyz");
            return r && r->status == 200;
        },
        Millis{10'000}));
}

// =============================================================================================
// 8. Health checks: a new address takes nothing before its checks pass; a dead one never does.

TEST_F(DiscoveryTest, NewAddressesTakeConnectionsOnlyOnceHealthChecksPass) {
    std::string why;
    // 127.0.0.4 at the same port: nothing listens there.
    auto backends = backendsOnOnePort({"127.0.0.2", "127.0.0.3"}, "23", why);
    ASSERT_EQ(backends.size(), 2u) << why;
    const uint16_t port = backends[0]->port();
    const std::string a2 = backends[0]->address(), a3 = backends[1]->address();
    const std::string dead = "127.0.0.4:" + std::to_string(port);
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("hc.test", {"127.0.0.2"}));
    ClusterSpec web = dnsCluster("hc.test", port);
    web.health_check = "{interval: 100ms, timeout: 100ms, rise: 2, fall: 2}";
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(dns_, writeResolvConf()), {web})));
    ASSERT_TRUE(
        relay_.waitForMetric(metric::kBackendUp, metric::backend("web", a2), 1, Millis{10'000}));
    Load load(relay_.host(), relay_.port());
    ASSERT_TRUE(load.waitForTotal(30, Millis{10'000})) << load.describeFailures();

    ASSERT_TRUE(dns_.setAddresses("hc.test", {"127.0.0.2", "127.0.0.3", "127.0.0.4"}));
    // Scrape as fast as we can: every sample of a new backend while down shows no connection.
    struct Seen {
        double up, conns;
    };
    std::vector<Seen> seen3, seen4;
    const auto begin = Clock::now();
    bool served3 = false;
    // Until 127.0.0.3 served (a refresh, then two passed checks: about 1.2 s) and 2 s have passed;
    // 15 s at most, room for a loaded machine.
    while (secondsSince(begin) < 15 && !(served3 && secondsSince(begin) > 2)) {
        const std::string t = scrape();
        const double up3 = valueIn(t, metric::kBackendUp, metric::backend("web", a3));
        if (up3 >= 0)
            seen3.push_back(
                {up3, valueIn(t, metric::kBackendConnectionsTotal, metric::backend("web", a3))});
        const double up4 = valueIn(t, metric::kBackendUp, metric::backend("web", dead));
        if (up4 >= 0)
            seen4.push_back(
                {up4, valueIn(t, metric::kBackendConnectionsTotal, metric::backend("web", dead))});
        served3 = !seen3.empty() && seen3.back().up == 1 && seen3.back().conns > 0;
        std::this_thread::sleep_for(Millis{5});  // pacing
    }
    ASSERT_FALSE(seen3.empty()) << "127.0.0.3 never appeared\n" << scrape();
    EXPECT_EQ(seen3.front().up, 0) << "a new address must start down";
    size_t down_samples = 0;
    for (const Seen& s : seen3) {
        if (s.up == 0) {
            ++down_samples;
            EXPECT_EQ(s.conns, 0) << "127.0.0.3 took a connection while down";
        }
    }
    std::cout << "[ health ] 127.0.0.3: " << down_samples << " samples down of " << seen3.size()
              << "\n";
    EXPECT_TRUE(served3) << "127.0.0.3 never came up and took connections\n" << scrape();
    ASSERT_FALSE(seen4.empty()) << "127.0.0.4 never appeared";
    for (const Seen& s : seen4) {
        EXPECT_EQ(s.up, 0) << "nothing listens on 127.0.0.4";
        EXPECT_EQ(s.conns, 0) << "127.0.0.4 took a connection";
    }
    load.stop();
    EXPECT_TRUE(load.failures().empty()) << load.describeFailures();
    const auto tags = load.tagsSince(begin);
    EXPECT_GT(tags.count('3') ? tags.at('3') : 0, 0);
}

// =============================================================================================
// 9. SIGHUP: unchanged discovery keeps its set; a new name is followed.

TEST_F(DiscoveryTest, ReloadKeepsAnUnchangedSetAndFollowsANewName) {
    std::string why;
    auto backends =
        backendsOnOnePort({"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"}, "2345", why);
    ASSERT_EQ(backends.size(), 4u) << why;
    const uint16_t port = backends[0]->port();
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("one.test", {"127.0.0.2", "127.0.0.3"}));
    ASSERT_TRUE(dns_.setAddresses("two.test", {"127.0.0.4", "127.0.0.5"}));
    const std::string resolvers = resolversYaml(dns_, writeResolvConf());
    ClusterSpec web = dnsCluster("one.test", port);
    const RelayConfig first = relayConfig(resolvers, {web});
    ASSERT_TRUE(relay_.start(first));
    Load load(relay_.host(), relay_.port());
    ASSERT_TRUE(load.waitForTotal(50, Millis{10'000})) << load.describeFailures();

    const size_t logged = logLines("backends from one.test");
    EXPECT_EQ(logged, 1u) << relay_.stderrText();
    const double changes = value(kChanges, cluster("web"));
    const double conns2 =
        value(metric::kBackendConnectionsTotal, metric::backend("web", backends[0]->address()));
    ASSERT_TRUE(relay_.reload(first.yaml()));
    const size_t at_reload = load.total();
    ASSERT_TRUE(load.waitForTotal(at_reload + 100, Millis{20'000}));
    // Past one more refresh, watching for a change that must not come: load can only hide one.
    std::this_thread::sleep_for(Millis{1'200});
    EXPECT_EQ(logLines("backends from one.test"), logged) << "an unchanged name logged a change\n"
                                                          << relay_.stderrText();
    EXPECT_EQ(value(kChanges, cluster("web")), changes);
    EXPECT_EQ(value(kDiscovered, cluster("web")), 2.0);
    EXPECT_GE(
        value(metric::kBackendConnectionsTotal, metric::backend("web", backends[0]->address())),
        conns2)
        << "the kept backend's counters start over";
    EXPECT_TRUE(load.failures().empty()) << load.describeFailures();

    // Another name: its answer is waited for, so the reloaded generation has its backends.
    web.dns = "two.test";
    ASSERT_TRUE(relay_.reload(relayConfig(resolvers, {web}).yaml()));
    const auto reloaded_at = Clock::now();
    std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("web")), 2.0);
    EXPECT_TRUE(hasBackendIn(text, "web", backends[2]->address())) << text;
    EXPECT_TRUE(hasBackendIn(text, "web", backends[3]->address())) << text;
    EXPECT_FALSE(hasBackendIn(text, "web", backends[0]->address())) << text;
    // Connections accepted before the reload may still reach the old backends: they are over
    // once each load thread finished one it started after it.
    ASSERT_TRUE(load.waitEachThreadPast(reloaded_at, Millis{20'000})) << load.describeFailures();
    const auto switched = Clock::now();
    const size_t frozen2 = backends[0]->accepted(), frozen3 = backends[1]->accepted();
    const size_t at_switch = load.total();
    ASSERT_TRUE(load.waitForTotal(at_switch + 100, Millis{20'000}));
    load.stop();
    EXPECT_EQ(backends[0]->accepted(), frozen2);
    EXPECT_EQ(backends[1]->accepted(), frozen3);
    const auto tags = load.tagsSince(switched);
    EXPECT_EQ(tags.count('2') + tags.count('3'), 0u);
    EXPECT_GT((tags.count('4') ? tags.at('4') : 0), 0);
    EXPECT_GT((tags.count('5') ? tags.at('5') : 0), 0);
    EXPECT_TRUE(load.failures().empty()) << load.describeFailures();
}

// =============================================================================================
// 10. Search domains and ndots from resolv_conf: `web` (0 dots < ndots 2) is web.test.

TEST_F(DiscoveryTest, ShortNameResolvesThroughSearchDomains) {
    Backend b('2', "127.0.0.2", 0);
    ASSERT_TRUE(b.ok()) << b.error();
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("web.test", {"127.0.0.2"}));
    // No nameserver line: it comes from resolvers.nameservers (resolv.conf cannot name a port).
    const std::string conf = writeResolvConf("search test\noptions ndots:2\n", "search.conf");
    ClusterSpec web = dnsCluster("web", b.port());
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(dns_, conf), {web})));
    EXPECT_EQ(value(kDiscovered, cluster("web")), 1.0);
    EXPECT_TRUE(hasBackendIn(scrape(), "web", b.address()));
    Visit v = shortVisit(relay_.host(), relay_.port(), 1);
    EXPECT_EQ(v.error, "");
    EXPECT_EQ(v.tag, '2');
    EXPECT_GE(dns_.queriesFor("web.test", "A"), 1u);
}

// =============================================================================================
// 11. family: ipv6 takes the AAAA records only, ipv4 the A records only, any both.

TEST_F(DiscoveryTest, FamilySelectsAddressRecords) {
    std::string why;
    auto backends = backendsOnOnePort({"::1", "127.0.0.2"}, "64", why);
    ASSERT_EQ(backends.size(), 2u) << why;
    const uint16_t port = backends[0]->port();
    ASSERT_EQ(backends[0]->address(), "[::1]:" + std::to_string(port));
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("dual.test", {"127.0.0.2", "::1"}));
    ClusterSpec v6 = dnsCluster("dual.test", port, "v6", "l6");
    v6.keys.push_back("family: ipv6");
    ClusterSpec v4 = dnsCluster("dual.test", port, "v4", "l4");
    v4.keys.push_back("family: ipv4");
    ClusterSpec any = dnsCluster("dual.test", port, "any", "la");
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(dns_, writeResolvConf()), {v6, v4, any})));
    const std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("v6")), 1.0);
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("v4")), 1.0);
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("any")), 2.0);
    EXPECT_TRUE(hasBackendIn(text, "v6", backends[0]->address())) << text;
    EXPECT_TRUE(hasBackendIn(text, "v4", backends[1]->address())) << text;
    std::map<std::string, std::map<char, int>> tags;
    for (int i = 0; i < 10; ++i) {
        for (const char* l : {"l6", "l4", "la"}) {
            Visit v = shortVisit(relay_.host(l), relay_.port(l), 10 * i);
            EXPECT_EQ(v.error, "") << l;
            ++tags[l][v.tag];
        }
    }
    EXPECT_EQ(tags["l6"]['6'], 10);
    EXPECT_EQ(tags["l4"]['4'], 10);
    EXPECT_GT(tags["la"]['6'], 0);
    EXPECT_GT(tags["la"]['4'], 0);
}

// =============================================================================================
// 12. Addresses that are no backend: 0.0.0.0 and :: (a connect reaches the local host),
// broadcast, multicast, an SRV record's port 0. Each kind alone is an answer with nothing usable
// (no_records: nothing joins); mixed with a good backend, the good one serves and the bad ones
// never become backends. Counted by reason, logged once (not per refresh), naming the address.

Labels reason(const std::string& cluster_name, const std::string& why) {
    return {{"cluster", cluster_name}, {"reason", why}};
}

struct RefusalCase {
    std::string reason;
    std::vector<std::string> bad;  // A/AAAA records; empty: an SRV record with port 0
};

class DiscoveryRefusalTest : public DiscoveryTest,
                             public ::testing::WithParamInterface<RefusalCase> {};

TEST_P(DiscoveryRefusalTest, RefusedAloneIsNoRecordsAndMixedTheGoodOneServes) {
    const RefusalCase& c = GetParam();
    Backend good('g', "127.0.0.2", 0);
    ASSERT_TRUE(good.ok()) << good.error();
    const std::string port = std::to_string(good.port());
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ClusterSpec web;
    std::vector<std::string> bad;  // as the relay names them
    const std::string srv = "_app._tcp.refuse.test";
    if (c.bad.empty()) {
        ASSERT_TRUE(dns_.setAddresses("good.refuse.test", {"127.0.0.2"}));
        ASSERT_TRUE(dns_.setSrv(srv, {{0, 1, 0, "good.refuse.test"}}));
        web.srv = srv;
        bad = {"127.0.0.2:0"};
    } else {
        ASSERT_TRUE(dns_.setAddresses("web.test", c.bad));
        web = dnsCluster("web.test", good.port());
        for (const std::string& a : c.bad)
            bad.push_back(a.find(':') != std::string::npos ? "[" + a + "]:" + port
                                                           : a + ":" + port);
    }
    web.keys = {"refresh_min: 200ms", "refresh_max: 1s", "startup: empty"};
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(dns_, writeResolvConf()), {web})));

    // Alone: nothing usable, a failure like an empty answer.
    ASSERT_TRUE(
        relay_.waitForMetric(kRefusedNow, reason("web", c.reason), static_cast<double>(bad.size())))
        << scrape();
    ASSERT_TRUE(relay_.waitForMetric(
        kResolutions, outcome("web", "no_records"), [](double v) { return v >= 2; }, ">= 2"));
    std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("web")), 0.0);
    EXPECT_EQ(valueIn(text, kResolutions, outcome("web", "success")), 0.0);
    for (const char* why : {"unspecified", "broadcast", "multicast", "port_zero", "self"}) {
        if (why == c.reason) continue;
        EXPECT_EQ(valueIn(text, kRefusedNow, reason("web", why)), 0.0) << why;
    }
    for (const std::string& a : bad) EXPECT_FALSE(hasBackendIn(text, "web", a)) << a;

    // Mixed with a good backend: it serves, the bad ones stay out.
    if (c.bad.empty()) {
        ASSERT_TRUE(dns_.setSrv(
            srv, {{0, 1, 0, "good.refuse.test"}, {0, 1, good.port(), "good.refuse.test"}}));
    } else {
        std::vector<std::string> mixed = c.bad;
        mixed.push_back("127.0.0.2");
        ASSERT_TRUE(dns_.setAddresses("web.test", mixed));
    }
    ASSERT_TRUE(waitDiscovered("web", 1)) << scrape();
    for (int i = 0; i < 20; ++i) {
        Visit v = shortVisit(relay_.host(), relay_.port(), 0x7100 + i);
        EXPECT_EQ(v.error, "") << "connection " << i;
        EXPECT_EQ(v.tag, 'g');
    }
    // A few more refreshes, each refusing the same addresses again.
    const double before = value(kRefused, reason("web", c.reason));
    ASSERT_TRUE(relay_.waitForMetric(
        kRefused, reason("web", c.reason),
        [&](double v) { return v >= before + 3.0 * static_cast<double>(bad.size()); },
        "three more answers refused"));
    text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("web")), 1.0);
    EXPECT_TRUE(hasBackendIn(text, "web", good.address())) << text;
    EXPECT_EQ(valueIn(text, kRefusedNow, reason("web", c.reason)), static_cast<double>(bad.size()));
    for (const std::string& a : bad) {
        EXPECT_FALSE(hasBackendIn(text, "web", a)) << a << "\n" << text;
        // Named with its reason, once: the same refusal on every refresh is not logged again.
        EXPECT_EQ(logLines(a + " (" + c.reason + ":"), 1u) << relay_.stderrText();
        EXPECT_EQ(logLines("+" + a), 0u) << "never joins: " << relay_.stderrText();
    }
    expectOnlyCleanCloses();
}

INSTANTIATE_TEST_SUITE_P(Kinds, DiscoveryRefusalTest,
                         ::testing::Values(RefusalCase{"unspecified", {"0.0.0.0", "::"}},
                                           RefusalCase{"broadcast", {"255.255.255.255"}},
                                           RefusalCase{"multicast", {"224.0.0.1", "ff02::1"}},
                                           RefusalCase{"port_zero", {}}),
                         [](const ::testing::TestParamInfo<RefusalCase>& info) {
                             return info.param.reason;
                         });

// =============================================================================================
// 13. A name that resolves to the relay itself (a Service selecting the relay's own pods). Were
// it a backend, each client connection would be relayed to the relay, which relays it to itself
// again: ~9,800 connections within 2 s, until the fds run out. Refused as `self`, through A at
// start and through SRV later (also the metrics port, bound at port 0 after discovery began),
// in every data path: clients keep connecting and all are served by the good backend, and the
// relay's fd count stays within a few dozen of its count before them.

class DiscoverySelfTest : public DiscoveryTest, public ::testing::WithParamInterface<std::string> {
  protected:
    // Clients for 1.5 s and 20 visits at least (30 s at most) on 2 threads, the relay's fds
    // sampled meanwhile: the most seen above `baseline`. Every visit must reach the good
    // backend ('g').
    void loadWithoutStorm(int baseline) {
        std::atomic<bool> stop{false};
        std::atomic<int> visits{0};
        std::mutex m;
        std::vector<std::string> errors;
        std::vector<std::thread> clients;
        for (int t = 0; t < 2; ++t) {
            clients.emplace_back([&, t] {
                for (int i = 0; i < 400 && !stop.load(); ++i) {
                    Visit v = shortVisit(relay_.host(), relay_.port(), 0x7200 + 1000 * t + i);
                    visits.fetch_add(1);
                    if (v.error.empty() && v.tag == 'g') continue;
                    std::lock_guard lock(m);
                    errors.push_back(v.error.empty() ? std::string("tag ") + v.tag : v.error);
                }
            });
        }
        int most = baseline;
        const auto start = Clock::now();
        while ((secondsSince(start) < 1.5 || visits.load() <= 20) && secondsSince(start) < 30) {
            most = std::max(most, relay_.openFdCount().value_or(baseline));
            std::this_thread::sleep_for(Millis{5});  // the sampling pace
        }
        stop.store(true);
        for (auto& c : clients) c.join();
        most = std::max(most, relay_.openFdCount().value_or(baseline));
        std::cout << "[ self ] " << visits.load() << " visits, fds " << baseline << " -> at most "
                  << most << "\n";
        EXPECT_GT(visits.load(), 20);
        EXPECT_TRUE(errors.empty()) << errors.size() << " failed, first: " << errors.front();
        EXPECT_LE(most, baseline + 48) << "the relay connects to itself";
    }
};

TEST_P(DiscoverySelfTest, AnARecordNamingTheListenerIsRefusedAtStart) {
    const std::string mode = GetParam();
    // The good backend on 127.0.0.2:P and the relay's listener on 127.0.0.1:P: the name's
    // addresses at the cluster's one port are the backend and the relay. P is one the kernel
    // finds free on 127.0.0.1 (earlier tests' clients leave TIME_WAITs there, which a port free
    // on 127.0.0.2 may collide with), held by a bound SO_REUSEPORT socket until the relay, which
    // sets SO_REUSEPORT too, has bound it as well; a few tries in case another process takes it.
    std::unique_ptr<Backend> good;
    bool started = false;
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("web.test", {"127.0.0.1", "127.0.0.2"}));
    for (int attempt = 0; attempt < 5 && !started; ++attempt) {
        Fd hold(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        ASSERT_TRUE(hold) << std::strerror(errno);
        int one = 1;
        ::setsockopt(hold.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        ::setsockopt(hold.get(), SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
        sockaddr_in sin{};
        sin.sin_family = AF_INET;
        sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof sin;
        ASSERT_EQ(::bind(hold.get(), reinterpret_cast<sockaddr*>(&sin), sizeof sin), 0)
            << std::strerror(errno);
        ASSERT_EQ(::getsockname(hold.get(), reinterpret_cast<sockaddr*>(&sin), &len), 0);
        const uint16_t port = ntohs(sin.sin_port);
        good = std::make_unique<Backend>('g', "127.0.0.2", port);
        if (!good->ok()) continue;
        ClusterSpec web = dnsCluster("web.test", port);
        RelayConfig config = relayConfig(resolversYaml(dns_, writeResolvConf()), {web}, mode);
        config.listeners[0].listen = "127.0.0.1:" + std::to_string(port);
        relay_.setNofileLimit(4096);  // bounds the storm should the check fail
        started = relay_.start(config);
        if (!started) relay_.terminate();
    }
    ASSERT_TRUE(started) << relay_.diagnostics();
    const std::string self = "127.0.0.1:" + std::to_string(good->port());
    std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("web")), 1.0) << text;
    EXPECT_TRUE(hasBackendIn(text, "web", good->address()));
    EXPECT_FALSE(hasBackendIn(text, "web", self)) << text;
    EXPECT_EQ(valueIn(text, kRefusedNow, reason("web", "self")), 1.0);
    EXPECT_EQ(logLines(self + " (self: the relay's own listeners[0].listen: a loop)"), 1u)
        << relay_.stderrText();

    const auto baseline = relay_.openFdCount();
    ASSERT_TRUE(baseline);
    loadWithoutStorm(*baseline);
    text = scrape();
    EXPECT_FALSE(hasBackendIn(text, "web", self));
    EXPECT_GE(valueIn(text, kRefused, reason("web", "self")), 1.0);
    expectOnlyCleanCloses();
}

TEST_P(DiscoverySelfTest, SrvTargetsAtTheListenerAndTheMetricsPortAreRefused) {
    const std::string mode = GetParam();
    Backend good('g', "127.0.0.2", 0);
    ASSERT_TRUE(good.ok()) << good.error();
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("good.loop.test", {"127.0.0.2"}));
    ASSERT_TRUE(dns_.setAddresses("self.loop.test", {"127.0.0.1"}));
    const std::string srv = "_app._tcp.loop.test";
    ASSERT_TRUE(dns_.setSrv(srv, {{0, 1, good.port(), "good.loop.test"}}));
    ClusterSpec web;
    web.srv = srv;
    relay_.setNofileLimit(4096);
    ASSERT_TRUE(relay_.start(relayConfig(resolversYaml(dns_, writeResolvConf()), {web}, mode)));
    const auto baseline = relay_.openFdCount();
    ASSERT_TRUE(baseline);

    // The orchestrator now lists the relay's own pod at the service's port, and its metrics.
    const std::string self = "127.0.0.1:" + std::to_string(relay_.port());
    const std::string metrics = "127.0.0.1:" + std::to_string(relay_.metricsPort());
    ASSERT_TRUE(dns_.setSrv(srv, {{0, 1, good.port(), "good.loop.test"},
                                  {0, 1, relay_.port(), "self.loop.test"},
                                  {0, 1, relay_.metricsPort(), "self.loop.test"}}));
    ASSERT_TRUE(relay_.waitForMetric(kRefusedNow, reason("web", "self"), 2.0)) << scrape();
    loadWithoutStorm(*baseline);
    const std::string text = scrape();
    EXPECT_EQ(valueIn(text, kDiscovered, cluster("web")), 1.0) << text;
    EXPECT_TRUE(hasBackendIn(text, "web", good.address()));
    EXPECT_FALSE(hasBackendIn(text, "web", self)) << text;
    EXPECT_FALSE(hasBackendIn(text, "web", metrics)) << text;
    EXPECT_EQ(logLines(self + " (self: the relay's own listeners[0].listen: a loop)"), 1u)
        << relay_.stderrText();
    EXPECT_EQ(logLines(metrics + " (self: the relay's own metrics.listen: a loop)"), 1u)
        << relay_.stderrText();
    expectOnlyCleanCloses();
}

// A name that leads back to the relay is refused while the backend set is built, before any
// data path: splice only.
INSTANTIATE_TEST_SUITE_P(Modes, DiscoverySelfTest, ::testing::Values("splice"), modeName);

// A reload that adds a listener on an address the running set has: the relay would now connect
// to itself there. The backend leaves the set with the reload (its series go), is refused as
// `self` from then on, and both listeners serve from the good backend.
TEST_F(DiscoveryTest, AReloadedListenerOnADiscoveredAddressTakesItOutOfTheSet) {
    Backend good('g', "127.0.0.2", 0);
    ASSERT_TRUE(good.ok()) << good.error();
    const std::string port = std::to_string(good.port());
    const std::string soon_self = "127.0.0.3:" + port;  // nothing listens there yet
    ASSERT_TRUE(dns_.start({.ttl = 1}));
    ASSERT_TRUE(dns_.setAddresses("web.test", {"127.0.0.2", "127.0.0.3"}));
    ClusterSpec web = dnsCluster("web.test", good.port());
    // Health checks keep the address that has no listener yet out of rotation.
    web.health_check = "{interval: 100ms, timeout: 100ms, rise: 1, fall: 1}";
    RelayConfig config = relayConfig(resolversYaml(dns_, writeResolvConf()), {web});
    ASSERT_TRUE(relay_.start(config));
    ASSERT_TRUE(waitDiscovered("web", 2)) << scrape();
    EXPECT_TRUE(hasBackendIn(scrape(), "web", soon_self));

    ListenerSpec second = config.listeners[0];
    second.name = "u";
    second.listen = soon_self;
    config.listeners.push_back(second);
    ASSERT_TRUE(relay_.reload(config.yaml()));
    ASSERT_TRUE(waitDiscovered("web", 1)) << scrape();
    ASSERT_TRUE(relay_.waitForMetric(kRefusedNow, reason("web", "self"), 1.0)) << scrape();
    const std::string text = scrape();
    EXPECT_FALSE(hasBackendIn(text, "web", soon_self)) << text;
    EXPECT_TRUE(hasBackendIn(text, "web", good.address())) << text;
    EXPECT_EQ(logLines(soon_self + " (self: the relay's own listeners[1].listen: a loop)"), 1u)
        << relay_.stderrText();
    for (int i = 0; i < 20; ++i) {
        for (const char* l : {"t", "u"}) {
            Visit v = shortVisit(relay_.host(l), relay_.port(l), 0x7300 + i);
            EXPECT_EQ(v.error, "") << l << " " << i;
            EXPECT_EQ(v.tag, 'g') << l;
        }
    }
}

}  // namespace
}  // namespace zcrelay::test::discovery_test
