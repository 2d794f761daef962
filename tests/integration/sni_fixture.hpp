#pragma once
// TLS SNI routing end to end, through the real binary on loopback, over the data paths that hand
// the inspected bytes off differently (splice, sockmap). What the sni_*_test.cpp files share:
// capture backends, the relay's routes, and the fixture that starts the relay and checks its
// counters. Each file is one part of the contract:
//   - sni_real_clients_test: real TLS peers (`openssl s_server` backends with a certificate of
//     their own, CN api, apps, fallback; openssl s_client, curl, Python's ssl as clients): a
//     server name lands on its backend, the handshake completes end to end; the matching rules
//     (exact names in any case, a trailing dot, a wildcard of exactly one label, ALPN
//     conditions, ALPN alone, first match wins, the default route);
//   - sni_inspect_failure_test: every inspection that fails (no SNI, not TLS, too large,
//     malformed, timeout, no route) takes the default route, or is closed as no_route without;
//   - sni_hello_framing_test: the ClientHello is peeked, never consumed: capture backends get
//     the client's bytes unchanged for real hellos split at every byte, re-framed into several
//     TLS records, or too large for one record;
//   - sni_proxy_header_test: the same after a PROXY header, and behind the relay's own
//     send_proxy header;
//   - sni_haproxy_cross_check_test: what HAProxy's req.ssl_sni sends to a named backend,
//     zcrelay sends to the same one;
//   - sni_reload_test, sni_config_test, sni_access_log_test: new routes for new connections
//     while a live one keeps its backend; the default route and unique route names; the access
//     log's sni/alpn/route fields.
// The oracle is which backend got the connection and the relay's counters, waited on with
// deadlines; never a duration.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "integration/sni_tls_peers.hpp"
#include "support/bytes.hpp"
#include "support/captured_streams.hpp"
#include "support/labels.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::sni_routing_test {

// "Not yet": how long a case watches for something that must not have happened. Load only
// makes the relay later, so a short look cannot fail a correct relay.
inline constexpr Millis kNotYet{300};
inline constexpr Millis kPause{2};  // between two writes: separate segments under TCP_NODELAY

// The data paths a suite runs in. Routing is decided before any data path starts; what the
// cases check after it is the hand-off of the bytes read while inspecting: in sockmap mode the
// relay sends them on itself before the sockets enter the map (Connections::startRelaying),
// while splice and copy both just start their pumps on the client's socket. Splice and sockmap
// cover both hand-offs; copy's pumps are the relay suite's subject.
inline const std::vector<std::string> kHandOffModes = {"splice", "sockmap"};

// The contract's names; the first two are labelled {listener, route} and {listener, reason}.
inline constexpr const char* kRouteSelections = "zcrelay_route_selections_total";
inline constexpr const char* kInspectFailures = "zcrelay_inspect_failures_total";
inline constexpr const char* kInspectSeconds = "zcrelay_inspect_duration_seconds";  // histogram
inline const std::vector<std::string> kInspectReasons = {"timeout",   "not_tls", "too_large",
                                                         "malformed", "no_sni",  "no_route"};
inline const std::string kNoRouteClose = "no_route";  // zcrelay_connections_closed_total{reason}

inline Labels routeLabels(const std::string& route, const std::string& listener = "t") {
    return {{"listener", listener}, {"route", route}};
}

// The relay's sockmap counters that are not zero, for failure messages: a connection whose bytes
// stop on the sockmap path shows up in them (catch-ups, replays, skipped bytes).
inline std::string sockmapCounters(const RelayProcess& relay) {
    std::optional<std::string> text = relay.scrape();
    if (!text) return "(no scrape)";
    std::string out;
    for (const Sample& s : parseMetrics(*text))
        if (s.name.rfind("zcrelay_sockmap_", 0) == 0 && s.value != 0)
            out += "\n    " + formatSeries(s.name, s.labels) + " " + std::to_string(s.value);
    return out.empty() ? "(all zero)" : out;
}

// =============================================================================================
// Capture backends: plain TCP standing in for TLS servers where the bytes are the oracle.

inline constexpr char kGreeting = '*';
// What a client sends once its backend has answered: the stream goes on after the hello.
inline const std::string kSecondFlight = "the client's second flight\n";

// Greets with one byte, so the client knows the relay chose this backend and relays before it
// half-closes (a sockmap connection whose client is gone already would be moved by splice),
// then keeps every byte until the relay's EOF, by accept index, counting them as they come (so
// a client can tell its bytes arrived while the connection was open, not only with its FIN).
class CaptureBackend {
  public:
    explicit CaptureBackend(std::string name) : name_(std::move(name)) {}
    bool ok() const { return up_.ok(); }
    const std::string& error() const { return up_.error(); }
    const std::string& name() const { return name_; }
    std::string hostPort() const { return up_.hostPort(); }
    size_t accepted() const { return up_.accepted(); }
    uint64_t liveBytes() const { return up_.liveBytesReceived(); }
    // The bytes connection `index` brought, once it ended (nullopt with an ADD_FAILURE if not).
    std::optional<std::string> bytes(size_t index) {
        return streams_->wait(up_, index, kIo, name_);
    }

  private:
    ConnScript script() {
        return [streams = streams_](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                    ScriptedUpstream& up) {
            rec.write_end = writeAll(fd.get(), &kGreeting, 1, kIo, &stop);
            std::string got;
            rec.read_end = readStreamUntilEof(
                fd.get(),
                [&](std::span<const uint8_t> d) {
                    if (got.size() < (1 << 20))
                        got.append(reinterpret_cast<const char*>(d.data()), d.size());
                    up.addLiveBytes(d.size());
                },
                kIo, &stop);
            rec.bytes_received = got.size();
            ::shutdown(fd.get(), SHUT_WR);
            streams->keep(rec.index, std::move(got));
        };
    }

    std::string name_;
    std::shared_ptr<CapturedStreams> streams_ = std::make_shared<CapturedStreams>();
    ScriptedUpstream up_{AF_INET, script()};  // last: its threads use streams_
};

struct ClusterAddrs {
    std::string api, apps, fallback;
};

// Where one client landed: the backend's name ("" if none) and what that backend received.
struct Landing {
    std::string backend;
    std::optional<std::string> bytes;
    std::string note;  // what the client saw, for failure messages
};

class CaptureSet {
  public:
    bool ok(std::string& error) const {
        for (const CaptureBackend* b : all())
            if (!b->ok()) error = b->name() + ": " + b->error();
        return error.empty();
    }
    ClusterAddrs addrs() const { return {api.hostPort(), apps.hostPort(), fallback.hostPort()}; }
    std::array<size_t, 3> counts() const {
        return {api.accepted(), apps.accepted(), fallback.accepted()};
    }
    size_t total() const { return api.accepted() + apps.accepted() + fallback.accepted(); }

    // One client through `port`: `parts` written in turn (kPause apart), then it waits for the
    // backend's greeting, writes `after` (a second flight, once the backend has answered, as a
    // TLS client's Finished and request), waits until the backend has every byte, half-closes
    // and reads to EOF. Where it landed, with the bytes; `note` says what went wrong, if anything.
    Landing through(uint16_t port, const std::vector<std::string>& parts,
                    const std::string& after = "") {
        Landing l;
        std::array<CaptureBackend*, 3> backends = all();
        std::array<size_t, 3> before = counts();
        std::array<uint64_t, 3> live_before{};
        for (size_t i = 0; i < 3; ++i) live_before[i] = backends[i]->liveBytes();
        size_t total_bytes = after.size();
        for (const auto& p : parts) total_bytes += p.size();

        Connected c = connectTo("127.0.0.1", port);
        if (!c.fd) {
            l.note = "connect: " + c.error;
            return l;
        }
        for (size_t i = 0; i < parts.size(); ++i) {
            if (i > 0) std::this_thread::sleep_for(kPause);
            IoResult w = writeAll(c.fd.get(), parts[i].data(), parts[i].size(), kIo);
            if (!w.ok()) {
                l.note = "write of part " + std::to_string(i) + ": " + w.describe();
                return l;
            }
        }
        char greeting = 0;
        IoResult g = readExactly(c.fd.get(), &greeting, 1, kIo);
        if (!g.ok() || greeting != kGreeting) {
            l.note = "no greeting from a backend: " + g.describe();
            return l;
        }
        // The backend greeted, so it has accepted: the count is in or about to be.
        waitUntil([&] { return total() > before[0] + before[1] + before[2]; }, kIo);
        int at = -1;
        for (size_t i = 0; i < 3; ++i) {
            if (backends[i]->accepted() == before[i]) continue;
            if (at >= 0) l.note += "two backends got a connection; ";
            at = static_cast<int>(i);
        }
        if (at < 0) {
            l.note += "greeted, but no backend counts an accept; ";
            return l;
        }
        CaptureBackend& b = *backends[static_cast<size_t>(at)];
        l.backend = b.name();
        if (!after.empty()) {
            IoResult w = writeAll(c.fd.get(), after.data(), after.size(), kIo);
            if (!w.ok()) l.note += "write after the greeting: " + w.describe() + "; ";
        }
        // Every byte must reach the backend while the connection is open, not only once the
        // client's FIN pushes it. Loopback takes microseconds; the bound only ends a broken run.
        auto arrived = [&] { return b.liveBytes() - live_before[static_cast<size_t>(at)]; };
        if (!waitUntil([&] { return arrived() >= total_bytes; }, Millis{5'000}, Millis{5}))
            l.note += "only " + std::to_string(arrived()) + " of the client's " +
                      std::to_string(total_bytes) + " bytes reached " + b.name() +
                      " while the connection was open; ";
        ::shutdown(c.fd.get(), SHUT_WR);
        std::string rest;
        IoResult end = readUntilEof(c.fd.get(), rest, kIo);
        if (end.status != IoStatus::Eof || !rest.empty())
            l.note += "after the greeting: " + end.describe() + ", " + hex(rest) + "; ";
        l.bytes = b.bytes(before[static_cast<size_t>(at)]);
        return l;
    }

    CaptureBackend api{"api"}, apps{"apps"}, fallback{"fallback"};

  private:
    std::array<CaptureBackend*, 3> all() { return {&api, &apps, &fallback}; }
    std::array<const CaptureBackend*, 3> all() const { return {&api, &apps, &fallback}; }
};

// The client writes `bytes` and the relay closes it without a backend. Returns what it saw.
inline IoResult expectClosedWithoutBackend(uint16_t port, const std::string& bytes) {
    Connected c = connectTo("127.0.0.1", port);
    EXPECT_TRUE(c.fd) << c.error;
    if (!c.fd) return {};
    // The relay may close while a large write is still going: that write's error is expected.
    if (!bytes.empty()) writeAll(c.fd.get(), bytes.data(), bytes.size(), kIo);
    IoResult end = waitForPeerClose(c.fd.get(), kIo);
    EXPECT_TRUE(endedByPeer(end)) << "the relay must close a client it cannot route; "
                                  << end.describe();
    EXPECT_EQ(end.bytes, 0u) << "nothing is sent to a client without a route";
    return end;
}

// =============================================================================================
// Relay configuration.

inline std::string clustersYaml(const ClusterAddrs& a, const std::string& send_proxy = "") {
    std::string y = "clusters:\n";
    for (const auto& [name, addr] :
         {std::pair{"api", a.api}, std::pair{"apps", a.apps}, std::pair{"fallback", a.fallback}}) {
        y += std::string("  - name: ") + name + "\n";
        if (!send_proxy.empty()) y += "    send_proxy: " + send_proxy + "\n";
        y += "    backends: [{address: \"" + addr + "\"}]\n";
    }
    return y;
}

// The conditional routes every case uses, in this order: an exact name; a wildcard with an
// ALPN condition; ALPN alone. First match wins.
inline const std::string kConditionalRoutes =
    "    routes:\n"
    "      - {sni: [api.example.test], cluster: api}\n"
    "      - {name: apps, sni: [\"*.apps.example.test\"], alpn: [h2, http/1.1], cluster: apps}\n"
    "      - {name: acme, alpn: [acme-tls/1], cluster: apps}\n";
inline const std::string kRoutes = kConditionalRoutes + "      - {cluster: fallback}\n";

// Listener `name` routing by the ClientHello: `routes` then `more` (keys, 4 spaces in).
inline ListenerSpec routedListener(const std::string& name, const std::string& mode,
                                   const std::string& routes = kRoutes,
                                   const std::string& more = "") {
    ListenerSpec l;
    l.name = name;
    l.mode = mode;
    l.omit_target = true;
    l.extra_yaml = routes + more;
    return l;
}

inline RelayConfig routedConfig(const ClusterAddrs& to, std::vector<ListenerSpec> listeners,
                                const std::string& send_proxy = "") {
    RelayConfig c;
    c.extra_yaml = clustersYaml(to, send_proxy);
    c.listeners = std::move(listeners);
    return c;
}

// =============================================================================================
// The fixture: the relay, and what its counters must say.

class SniFixture {
  protected:
    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void startRelay(const RelayConfig& config) {
        ASSERT_TRUE(relay_.start(config)) << relay_.diagnostics();
        for (const ListenerSpec& l : config.listeners)
            EXPECT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath(l.mode, l.name)), 1.0)
                << "listener " << l.name << " should run the " << l.mode << " data path";
    }

    // Each TLS backend started with `style`, and the CA file that holds all their certificates.
    void startTlsBackends(const std::string& style) {
        ASSERT_TRUE(api_.start(tools_, dir_, "api", style));
        ASSERT_TRUE(apps_.start(tools_, dir_, "apps", style));
        ASSERT_TRUE(fallback_.start(tools_, dir_, "fallback", style));
        std::string all;
        for (const char* cn : {"api", "apps", "fallback"})
            all += readFileText(dir_.file(std::string(cn) + ".crt"));
        cafile_ = dir_.writeFile("backends.crt", all);
        script_ = dir_.writeFile("client.py", kPythonClient);
        get_ = dir_.writeFile("get.txt", "GET / HTTP/1.0\r\n\r\n");
    }
    ClusterAddrs tlsAddrs() const {
        return {api_.hostPort(), apps_.hostPort(), fallback_.hostPort()};
    }
    const TlsBackend& tlsBackend(const std::string& cn) const {
        return cn == "api" ? api_ : cn == "apps" ? apps_ : fallback_;
    }

    // One more connection on listener `l` routed by `route`, or failing inspection for
    // `failure`, or both ("" for none). Then waits until the relay's counters say so.
    void count(const std::string& route, const std::string& failure, const std::string& l = "t") {
        if (!route.empty()) routes_[{l, route}] += 1;
        if (!failure.empty()) failures_[{l, failure}] += 1;
        expectCounters();
    }
    // Every counted route and failure has its value; failure reasons never counted are absent
    // or zero.
    void expectCounters() {
        for (const auto& [key, n] : routes_)
            EXPECT_TRUE(
                relay_.waitForMetric(kRouteSelections, routeLabels(key.second, key.first), n))
                << relay_.diagnostics();
        std::set<std::string> listeners;
        for (const auto& [key, n] : routes_) listeners.insert(key.first);
        for (const auto& [key, n] : failures_) listeners.insert(key.first);
        for (const std::string& l : listeners) {
            for (const std::string& reason : kInspectReasons) {
                auto it = failures_.find({l, reason});
                if (it != failures_.end()) {
                    EXPECT_TRUE(relay_.waitForMetric(kInspectFailures, metric::reason(reason, l),
                                                     it->second))
                        << relay_.diagnostics();
                } else {
                    EXPECT_EQ(
                        relay_.metric(kInspectFailures, metric::reason(reason, l)).value_or(0), 0)
                        << "listener " << l << ": no inspection failed for " << reason;
                }
            }
        }
    }
    double routed(const std::string& l = "t") const {
        double n = 0;
        for (const auto& [key, v] : routes_)
            if (key.first == l) n += v;
        return n;
    }

    Tools tools_;
    TempDir dir_;
    TlsBackend api_, apps_, fallback_;
    std::string cafile_, script_, get_;
    RelayProcess relay_;
    std::map<std::pair<std::string, std::string>, double> routes_, failures_;
};

}  // namespace zcrelay::test::sni_routing_test
