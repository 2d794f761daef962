// The runtime API (proxy/admin_api.hpp) on the real binary, over real loopback sockets: listing
// clusters and backends, drain and maint under a continuous client load (no new connection
// reaches the backend from the moment the change is answered, while one opened before keeps
// relaying byte-exact), weights (0, and 3:1 under round robin), shutdown of a backend's live
// connections, every refusal with its status and JSON error, the bearer token, the unix
// socket, what a SIGHUP keeps, and the hostile-client bounds of its HTTP server.
//
// Each backend tags its connections with one byte, then echoes: a client knows which backend
// serves it. The other oracle is the relay's metrics. Every answer of the API is parsed with the
// strict JSON reader. Loopback only; every loop is bounded in count and time; only the
// processes and threads this file starts are stopped.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/json.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::admin_api_test {
namespace {

constexpr const char* kAdminChanges = "zcrelay_admin_changes_total";     // {change}
constexpr const char* kAdminRequests = "zcrelay_admin_requests_total";   // {result}
constexpr const char* kAdminRejected = "zcrelay_admin_endpoint_rejected_total";  // {reason}
constexpr const char* kAdminState = "zcrelay_backend_admin_state";  // {cluster,backend,state}
constexpr const char* kBackendWeight = "zcrelay_backend_weight";    // {cluster,backend}
constexpr const char* kCluster = "app";

Labels withLabel(Labels l, const std::string& key, const std::string& value) {
    l[key] = value;
    return l;
}
Labels backendOf(const std::string& address) { return metric::backend(kCluster, address); }

// "[::1]:8080" -> "%5B%3A%3A1%5D%3A8080": every byte but [A-Za-z0-9._-] escaped.
std::string percentEncode(const std::string& s, bool lower = false) {
    static const char* kUpper = "0123456789ABCDEF";
    static const char* kLower = "0123456789abcdef";
    const char* hex = lower ? kLower : kUpper;
    std::string out;
    for (unsigned char c : s) {
        if (std::isalnum(c) || c == '.' || c == '-' || c == '_') {
            out += static_cast<char>(c);
        } else {
            out += '%';
            out += hex[c >> 4];
            out += hex[c & 15];
        }
    }
    return out;
}

std::string backendPath(const std::string& address, const std::string& cluster = kCluster) {
    return "/api/v1/clusters/" + cluster + "/backends/" + percentEncode(address);
}

// ---------------------------------------------------------------------------------------------
// A backend that says who it is: one tag byte on every connection it accepts (health checks
// included), then an echo of whatever the client sends until EOF.

ConnScript taggedEchoScript(char tag) {
    return [tag](Fd& fd, ConnRecord& record, const std::atomic<bool>& stop, ScriptedUpstream&) {
        record.write_end = writeAll(fd.get(), &tag, 1, Millis{5'000}, &stop);
        if (!record.write_end.ok()) return;
        char buf[65536];
        // Bounded: each read waits at most 30 s; stop ends it within ~100 ms.
        for (;;) {
            IoResult r = readSome(fd.get(), buf, sizeof buf, Millis{30'000}, &stop);
            if (!r.ok()) {
                record.read_end = r;
                break;
            }
            record.bytes_received += r.bytes;
            record.write_end = writeAll(fd.get(), buf, r.bytes, Millis{10'000}, &stop);
            if (!record.write_end.ok()) return;
        }
        ::shutdown(fd.get(), SHUT_WR);
    };
}

class TaggedBackend {
  public:
    explicit TaggedBackend(char tag, int family = AF_INET)
        : tag_(tag), up_(family, taggedEchoScript(tag)) {}
    bool ok() const { return up_.ok(); }
    const std::string& error() const { return up_.error(); }
    char tag() const { return tag_; }
    std::string address() const { return up_.hostPort(); }
    size_t accepted() const { return up_.accepted(); }

  private:
    char tag_;
    ScriptedUpstream up_;
};

// `n` short connections through the relay, one after the other: the tags that served them.
std::map<char, int> spread(const std::string& host, uint16_t port, int n) {
    std::map<char, int> count;
    for (int i = 0; i < n; ++i) {
        Connected c = connectTo(host, port);
        ++count[c.fd ? servedBy(c.fd) : 0];
    }
    return count;
}

// One `bytes` message there and back through the echo, the connection left open.
::testing::AssertionResult exchange(int fd, uint64_t seed, uint64_t bytes = 64 * kKiB) {
    IoResult sent = sendPayload(fd, seed, bytes, Millis{10'000});
    if (!sent.ok()) return ::testing::AssertionFailure() << "send: " << sent.describe();
    std::vector<uint8_t> echoed(bytes), expected(bytes);
    IoResult got = readExactly(fd, echoed.data(), echoed.size(), Millis{10'000});
    if (!got.ok()) return ::testing::AssertionFailure() << "echo: " << got.describe();
    fillPayload(seed, 0, expected);
    if (echoed != expected) return ::testing::AssertionFailure() << "the echo differs";
    return ::testing::AssertionSuccess();
}

// Clients opening short connections continuously (connect, read the tag, close), on two
// threads, each started connection recorded with the moment it started. Bounded: at most
// kMaxPerThread connections and 60 s per thread, about 200 a second per thread.
class ClientLoad {
  public:
    static constexpr int kThreads = 2;
    struct Visit {
        Clock::time_point started;
        char tag = 0;  // 0: no backend answered
        int thread = 0;
    };

    ClientLoad(std::string host, uint16_t port) : host_(std::move(host)), port_(port) {
        for (int i = 0; i < kThreads; ++i) threads_.emplace_back([this, i] { run(i); });
    }
    ~ClientLoad() { stop(); }
    void stop() {
        stop_.store(true);
        for (auto& t : threads_)
            if (t.joinable()) t.join();
    }
    size_t total() const {
        std::lock_guard lock(mu_);
        return visits_.size();
    }
    // Per tag, the connections that started at or after `since`.
    std::map<char, int> servedSince(Clock::time_point since) const {
        std::lock_guard lock(mu_);
        std::map<char, int> out;
        for (const Visit& v : visits_)
            if (v.started >= since) ++out[v.tag];
        return out;
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
                int past = 0;
                for (int t = 0; t < kThreads; ++t)
                    past += std::any_of(visits_.begin(), visits_.end(), [&](const Visit& v) {
                        return v.thread == t && v.started >= since;
                    });
                return past == kThreads;
            },
            timeout);
    }

  private:
    static constexpr int kMaxPerThread = 12000;

    void run(int thread) {
        const auto begin = Clock::now();
        for (int i = 0; i < kMaxPerThread && !stop_.load() && secondsSince(begin) < 60; ++i) {
            Visit v;
            v.thread = thread;
            v.started = Clock::now();
            Connected c = connectTo(host_, port_, Millis{2'000});
            if (c.fd) {
                IoResult r = readExactly(c.fd.get(), &v.tag, 1, Millis{2'000}, &stop_);
                if (!r.ok()) v.tag = 0;
            }
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

// ---------------------------------------------------------------------------------------------
// The API's answers.

struct ApiReply {
    int status = 0;
    std::string body;
    std::optional<Json> json;  // the body, if it parsed (strictly) as JSON
    std::string error;         // transport failure or the JSON parser's complaint

    std::string describe() const {
        return "status " + std::to_string(status) + ", body " + body.substr(0, 600) +
               (error.empty() ? "" : " (" + error + ")");
    }
};

ApiReply toReply(std::optional<HttpResponse> r, const std::string& transport_error) {
    ApiReply out;
    if (!r) {
        out.error = transport_error;
        return out;
    }
    out.status = r->status;
    out.body = r->body;
    std::string why;
    out.json = parseJson(out.body, why);
    if (!out.json) out.error = "not JSON: " + why;
    return out;
}

// An error answer: `status`, a JSON object whose only member is the string "error", which
// mentions `mention`.
::testing::AssertionResult isError(const ApiReply& r, int status, const std::string& mention) {
    if (r.status != status)
        return ::testing::AssertionFailure() << "expected status " << status << "; " << r.describe();
    if (!r.json || r.json->type != Json::Type::Object)
        return ::testing::AssertionFailure() << "expected a JSON object; " << r.describe();
    if (r.json->object.size() != 1 || r.json->get("error") == nullptr ||
        r.json->get("error")->type != Json::Type::String)
        return ::testing::AssertionFailure()
               << "expected exactly {\"error\": \"...\"}; " << r.describe();
    const std::string& why = r.json->get("error")->string;
    if (why.find(mention) == std::string::npos)
        return ::testing::AssertionFailure()
               << "the error should mention \"" << mention << "\": " << why;
    return ::testing::AssertionSuccess();
}

// What a backend's JSON says, every member checked for its type.
struct BackendView {
    std::string address;
    std::string state = "ready";
    std::string health = "up";
    int weight = 1;
    int config_weight = 1;
    int active = 0;  // expected: -1 for any (a load's short connections come and go)
    bool takes_new_connections = true;

    bool matches(const BackendView& e) const {
        return address == e.address && state == e.state && health == e.health &&
               weight == e.weight && config_weight == e.config_weight &&
               (e.active < 0 || active == e.active) &&
               takes_new_connections == e.takes_new_connections;
    }
    std::string describe() const {
        return "{address " + address + ", state " + state + ", health " + health + ", weight " +
               std::to_string(weight) + ", config_weight " + std::to_string(config_weight) +
               ", active " + (active < 0 ? std::string("any") : std::to_string(active)) + ", takes_new_connections " +
               (takes_new_connections ? "true" : "false") + "}";
    }
};

std::optional<BackendView> viewOf(const Json& b, std::string& why) {
    static const std::set<std::string> kMembers = {
        "address", "state", "health", "weight", "config_weight", "active",
        "takes_new_connections"};
    if (b.type != Json::Type::Object) {
        why = "a backend is not an object";
        return std::nullopt;
    }
    std::set<std::string> seen;
    for (const auto& [k, v] : b.object) seen.insert(k);
    if (seen != kMembers) {
        why = "a backend's members are not exactly address, state, health, weight, "
              "config_weight, active, takes_new_connections";
        return std::nullopt;
    }
    auto whole = [&](const char* key, int& out) {
        const Json* v = b.get(key);
        if (v->type != Json::Type::Number || v->raw.find_first_of(".eE") != std::string::npos) {
            why = std::string(key) + " is not a whole number";
            return false;
        }
        out = static_cast<int>(v->number);
        return true;
    };
    BackendView out;
    for (const char* key : {"address", "state", "health"}) {
        if (b.get(key)->type != Json::Type::String) {
            why = std::string(key) + " is not a string";
            return std::nullopt;
        }
    }
    out.address = b.str("address");
    out.state = b.str("state");
    out.health = b.str("health");
    if (!whole("weight", out.weight) || !whole("config_weight", out.config_weight) ||
        !whole("active", out.active))
        return std::nullopt;
    const Json* takes = b.get("takes_new_connections");
    if (takes->type != Json::Type::Bool) {
        why = "takes_new_connections is not a boolean";
        return std::nullopt;
    }
    out.takes_new_connections = takes->boolean;
    return out;
}

::testing::AssertionResult backendIs(const Json& b, const BackendView& expected) {
    std::string why;
    auto view = viewOf(b, why);
    if (!view) return ::testing::AssertionFailure() << why;
    if (!view->matches(expected))
        return ::testing::AssertionFailure()
               << "backend is " << view->describe() << ", expected " << expected.describe();
    return ::testing::AssertionSuccess();
}

// A 200 answer describing one backend as `expected`.
::testing::AssertionResult backendReply(const ApiReply& r, const BackendView& expected) {
    if (r.status != 200 || !r.json)
        return ::testing::AssertionFailure() << "expected 200 and JSON; " << r.describe();
    return backendIs(*r.json, expected);
}

// The backend named `address` in a cluster object, or nullptr.
const Json* findBackend(const Json& cluster, const std::string& address) {
    for (const Json& b : cluster.items("backends"))
        if (b.str("address") == address) return &b;
    return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Configs.

struct BackendLine {
    std::string address;
    int weight = 1;
};

// A top-level `clusters:` block with the one cluster "app".
std::string clusterYaml(const std::vector<BackendLine>& backends,
                        const std::string& settings = "    balance: round_robin\n") {
    std::string y = "clusters:\n  - name: app\n" + settings + "    backends:\n";
    for (const auto& b : backends)
        y += "      - {address: \"" + b.address + "\", weight: " + std::to_string(b.weight) + "}\n";
    return y;
}

std::string adminYaml(const std::string& listen, const std::string& extra = "") {
    return "admin:\n  listen: \"" + listen + "\"\n" + extra;
}

RelayConfig clusterConfig(const std::string& admin, const std::string& clusters,
                          const std::string& mode = "splice") {
    RelayConfig config;
    config.workers = 2;
    ListenerSpec l;
    l.cluster = kCluster;
    l.mode = mode;
    config.listeners.push_back(l);
    config.extra_yaml = admin + clusters;
    return config;
}

// ---------------------------------------------------------------------------------------------

class AdminApiTest : public ::testing::Test {
  protected:
    // Starts the relay and learns where the API listens: the line it logs at start,
    // "admin API on 127.0.0.1:PORT" (the port is not printed on stdout).
    void start(const RelayConfig& config) {
        ASSERT_TRUE(relay_.start(config));
        static const std::regex kLine(R"(admin API on (\S+))");
        std::smatch m;
        const std::string log = relay_.stderrText();
        ASSERT_TRUE(std::regex_search(log, m, kLine)) << "no \"admin API on\" line\n"
                                                      << relay_.diagnostics();
        const std::string where = m[1];
        if (where.rfind("unix:", 0) == 0) return;
        const size_t colon = where.rfind(':');
        ASSERT_NE(colon, std::string::npos) << where;
        admin_host_ = where.substr(0, colon);
        if (admin_host_.size() > 2 && admin_host_.front() == '[')
            admin_host_ = admin_host_.substr(1, admin_host_.size() - 2);
        admin_port_ = static_cast<uint16_t>(std::stoi(where.substr(colon + 1)));
    }
    void startWith(const std::vector<BackendLine>& backends, const std::string& mode = "splice",
                   const std::string& settings = "    balance: round_robin\n",
                   const std::string& admin_extra = "") {
        ASSERT_NO_FATAL_FAILURE(start(clusterConfig(adminYaml("127.0.0.1:0", admin_extra),
                                                    clusterYaml(backends, settings), mode)));
    }

    ApiReply api(const std::string& method, const std::string& path, const std::string& body = "",
                 const std::string& headers = "") const {
        std::string error;
        auto r = httpRequest(admin_host_, admin_port_, method, path, body, headers, &error);
        return toReply(std::move(r), error);
    }
    ApiReply get(const std::string& path) const { return api("GET", path); }
    ApiReply post(const std::string& path, const std::string& body) const {
        return api("POST", path, body, "Content-Type: application/json\r\n");
    }

    Fd client() {
        Connected c = connectTo(relay_.host(), relay_.port());
        EXPECT_TRUE(c.fd) << c.error;
        return std::move(c.fd);
    }
    // A client connection served by `tag`'s backend (round robin: within a few tries); the
    // others opened on the way are closed.
    Fd clientOf(char tag) {
        for (int i = 0; i < 12; ++i) {
            Fd fd = client();
            if (fd && servedBy(fd) == tag) return fd;
        }
        ADD_FAILURE() << "no connection reached backend " << tag << " in 12 tries";
        return Fd();
    }
    double metricOr(const char* name, const Labels& labels) const {
        return relay_.metric(name, labels).value_or(-1);
    }
    double requests(const char* result) const {
        return metricOr(kAdminRequests, {{"result", result}});
    }

    // The relay still relays: 256 KiB there and back, byte-exact, to whichever backend.
    void expectRelaying(uint64_t seed) {
        Fd fd = client();
        ASSERT_TRUE(fd);
        ASSERT_NE(servedBy(fd), 0) << "no backend answered";
        ReceiveCheck got = echoRoundTrip(fd.get(), seed, 256 * kKiB, Millis{20'000});
        EXPECT_EQ(got.bytes, 256 * kKiB) << got.describe();
        EXPECT_LT(got.first_mismatch, 0) << got.describe();
    }

    RelayProcess relay_;
    std::string admin_host_ = "127.0.0.1";
    uint16_t admin_port_ = 0;
};

// =============================================================================================
// 1. Reading: every cluster, one cluster, one backend (an IPv6 one by its escaped address).

TEST_F(AdminApiTest, ListsClustersAndBackends) {
    TaggedBackend a('a'), c('c', AF_INET6);
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_TRUE(c.ok()) << c.error();
    ASSERT_EQ(c.address().front(), '[') << c.address();
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address(), 2}, {c.address(), 1}}));

    // One live connection to A shows as active.
    Fd live = clientOf('a');
    ASSERT_TRUE(live);
    ASSERT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, backendOf(a.address()), 1));

    const BackendView view_a{.address = a.address(), .weight = 2, .config_weight = 2, .active = 1};
    const BackendView view_c{.address = c.address()};

    ApiReply all = get("/api/v1/clusters");
    ASSERT_EQ(all.status, 200) << all.describe();
    ASSERT_TRUE(all.json) << all.describe();
    ASSERT_EQ(all.json->type, Json::Type::Object) << all.describe();
    const Json* generation = all.json->get("generation");
    ASSERT_NE(generation, nullptr) << all.describe();
    EXPECT_EQ(generation->type, Json::Type::Number) << all.describe();
    EXPECT_GE(generation->number, 1) << all.describe();
    ASSERT_EQ(all.json->items("clusters").size(), 1u) << all.describe();
    const Json& app = all.json->items("clusters")[0];
    EXPECT_EQ(app.str("name"), "app") << all.describe();
    EXPECT_EQ(app.str("balance"), "round_robin") << all.describe();
    ASSERT_NE(app.get("health_checks"), nullptr) << all.describe();
    EXPECT_EQ(app.get("health_checks")->type, Json::Type::Bool);
    EXPECT_FALSE(app.get("health_checks")->boolean);
    ASSERT_EQ(app.items("backends").size(), 2u) << all.describe();
    EXPECT_TRUE(backendIs(app.items("backends")[0], view_a)) << all.describe();
    EXPECT_TRUE(backendIs(app.items("backends")[1], view_c)) << all.describe();
    // The trailing slash names the same list.
    ApiReply slash = get("/api/v1/clusters/");
    EXPECT_EQ(slash.status, 200) << slash.describe();
    EXPECT_TRUE(slash.json && slash.json->items("clusters").size() == 1) << slash.describe();

    ApiReply one = get("/api/v1/clusters/app");
    ASSERT_EQ(one.status, 200) << one.describe();
    ASSERT_TRUE(one.json) << one.describe();
    EXPECT_EQ(one.json->str("name"), "app") << one.describe();
    ASSERT_EQ(one.json->items("backends").size(), 2u) << one.describe();
    EXPECT_TRUE(backendIs(one.json->items("backends")[0], view_a)) << one.describe();
    EXPECT_TRUE(backendIs(one.json->items("backends")[1], view_c)) << one.describe();

    EXPECT_TRUE(backendReply(get(backendPath(a.address())), view_a));
    // The IPv6 backend, "[::1]:PORT", escaped as clients escape it, in upper and lower case.
    const std::string escaped = percentEncode(c.address());
    EXPECT_NE(escaped.find("%5B%3A%3A1%5D%3A"), std::string::npos) << escaped;
    EXPECT_TRUE(backendReply(get("/api/v1/clusters/app/backends/" + escaped), view_c));
    EXPECT_TRUE(backendReply(
        get("/api/v1/clusters/app/backends/" + percentEncode(c.address(), /*lower=*/true)),
        view_c));
    // And it takes connections: the relay reaches it over IPv6.
    EXPECT_TRUE(waitUntil([&] { return spread(relay_.host(), relay_.port(), 3)['c'] > 0; },
                          Millis{5'000}));

    live.reset();
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, backendOf(a.address()), 0));
    EXPECT_TRUE(backendReply(get(backendPath(a.address())),
                             {.address = a.address(), .weight = 2, .config_weight = 2}));
    // Reading changes nothing and counts as ok.
    EXPECT_EQ(relay_.metric(kAdminChanges, {}), 0.0);
    EXPECT_GE(requests("ok"), 7.0);
    EXPECT_EQ(requests("bad_request") + requests("not_found") + requests("unauthorized"), 0.0);
}

// =============================================================================================
// 2 and 3. drain and maint under load, and with health checks
// (maint): from the moment the change is answered no new connection reaches A, A's connection
// opened before keeps relaying byte-exact until its client ends it, and `ready` brings A back.

class AdminLoadTest : public AdminApiTest {
  protected:
    void drainUnderLoad(const std::string& state, const std::string& mode, bool checks) {
        TaggedBackend a('a'), b('b');
        ASSERT_TRUE(a.ok()) << a.error();
        ASSERT_TRUE(b.ok()) << b.error();
        std::string settings = "    balance: round_robin\n";
        if (checks)
            settings += "    health_check: {interval: 100ms, timeout: 500ms, rise: 1, fall: 3}\n";
        ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}, {b.address()}}, mode, settings));
        EXPECT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath(mode)), 1.0)
            << "listener t should run the " << mode << " data path";
        const Labels la = backendOf(a.address()), lb = backendOf(b.address());
        auto checksOf = [&](const Labels& l) { return metricOr(metric::kBackendChecksTotal, l); };
        if (checks) {
            ASSERT_TRUE(relay_.waitForMetric(metric::kBackendChecksTotal,
                                             withLabel(la, "result", "passed"),
                                             [](double v) { return v >= 2; }, ">= 2"));
        }

        // The long-lived connection to A, opened before the change.
        Fd live = clientOf('a');
        ASSERT_TRUE(live);
        uint64_t seed = 1;
        ASSERT_TRUE(exchange(live.get(), seed++));

        ClientLoad load(relay_.host(), relay_.port());
        ASSERT_TRUE(load.waitForTotal(40, Millis{10'000})) << "the load did not get going";
        ASSERT_GT(load.servedSince({})['a'], 0) << "A took none of the load before the change";

        const ApiReply changed = post(backendPath(a.address()), "{\"state\": \"" + state + "\"}");
        const auto changed_at = Clock::now();  // the answer is in: A is out from here on
        // active: the live connection, and any of the load's in flight to A.
        EXPECT_TRUE(backendReply(changed, {.address = a.address(),
                                           .state = state,
                                           .active = -1,
                                           .takes_new_connections = false}));

        // Connections picked before the answer may still be connecting to A: they are over once
        // each load thread finished one it started after the answer.
        ASSERT_TRUE(load.waitEachThreadPast(changed_at, Millis{20'000})) << "the load stalled";
        if (checks) {
            // A check of A that started before the answer ends within its timeout (500 ms);
            // counted or not, it is over before the snapshot below.
            std::this_thread::sleep_until(changed_at + Millis{600});
        }
        ASSERT_TRUE(exchange(live.get(), seed++)) << "the live connection to A stopped relaying";
        const double a_conns = metricOr(metric::kBackendConnectionsTotal, la);
        const double b_conns = metricOr(metric::kBackendConnectionsTotal, lb);
        const size_t a_accepted = a.accepted();
        const double a_checks = checksOf(la), b_checks = checksOf(lb);
        const size_t total_before = load.total();

        // Load, and the live connection relaying, with A out: at least a second, five exchanges
        // and 40 more connections, however long a loaded machine takes for them.
        const auto out_since = Clock::now();
        for (int i = 0; i < 5 || load.total() <= total_before + 40 || secondsSince(out_since) < 1;
             ++i) {
            ASSERT_LT(secondsSince(out_since), 30.0) << "the load stalled at " << load.total();
            ASSERT_TRUE(exchange(live.get(), seed++)) << "exchange " << i << " during " << state;
            std::this_thread::sleep_for(Millis{200});  // pacing: the load runs meanwhile
        }
        const auto since = load.servedSince(changed_at);
        EXPECT_EQ(since.count('a') ? since.at('a') : 0, 0)
            << "connections started after the " << state << " answer reached A";
        EXPECT_EQ(since.count(0) ? since.at(0) : 0, 0) << "clients no backend answered";
        EXPECT_GT(since.count('b') ? since.at('b') : 0, 40);
        std::printf("%s (%s): of %d connections started after the answer, A took %d; A's "
                    "connections_total held at %.0f while B's went %.0f -> %.0f\n",
                    state.c_str(), mode.c_str(),
                    (since.count('a') ? since.at('a') : 0) + (since.count('b') ? since.at('b') : 0),
                    since.count('a') ? since.at('a') : 0, a_conns, b_conns,
                    metricOr(metric::kBackendConnectionsTotal, lb));
        EXPECT_EQ(metricOr(metric::kBackendConnectionsTotal, la), a_conns)
            << "A's connections_total moved in " << state;
        EXPECT_GE(metricOr(metric::kBackendConnectionsTotal, lb), b_conns + 40)
            << "B's connections_total should grow with the load";
        EXPECT_EQ(a.accepted(), a_accepted) << "A accepted connections in " << state;
        EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", state)), 1.0);
        EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", "ready")), 0.0);
        EXPECT_EQ(relay_.metric(kAdminChanges, {{"change", "state_" + state}}), 1.0);
        EXPECT_EQ(relay_.metric(metric::kBackendConnectionsActive, la), 1.0)
            << "the live connection is still A's";
        EXPECT_TRUE(backendReply(get(backendPath(a.address())),
                                 {.address = a.address(),
                                  .state = state,
                                  .active = 1,
                                  .takes_new_connections = false}));
        if (checks) {
            // maint: A is not checked (B is, every 100 ms); drain would go on checking.
            EXPECT_TRUE(relay_.waitForMetric(
                metric::kBackendChecksTotal, lb, [&](double v) { return v >= b_checks + 4; },
                ">= " + std::to_string(b_checks + 4)))
                << "B's health checks should go on";
            if (state != "maint") {
                EXPECT_TRUE(relay_.waitForMetric(
                    metric::kBackendChecksTotal, la, [&](double v) { return v > a_checks; },
                    "> " + std::to_string(a_checks)))
                    << "health checks of A stopped in " << state;
            } else {
                // A second at least has passed since the snapshot: ten of B's intervals.
                EXPECT_EQ(checksOf(la), a_checks) << "health checks of A went on in " << state;
            }
        }

        // The live connection to A ends when its client ends it, every byte echoed.
        ReceiveCheck last = echoRoundTrip(live.get(), seed++, 256 * kKiB, Millis{20'000});
        EXPECT_EQ(last.io.status, IoStatus::Eof) << last.describe();
        EXPECT_EQ(last.bytes, 256 * kKiB) << last.describe();
        EXPECT_LT(last.first_mismatch, 0) << last.describe();
        live.reset();
        EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, la, 0));

        // Back to ready: A takes new connections again.
        const ApiReply ready = post(backendPath(a.address()), "{\"state\":\"ready\"}");
        const auto ready_at = Clock::now();
        // The reply is built after the change took effect: the load's next connection may
        // already be A's (seen once in a clean-clone run: active 1).
        EXPECT_TRUE(backendReply(ready, {.address = a.address(), .active = -1}));
        ASSERT_TRUE(waitUntil([&] { return load.servedSince(ready_at)['a'] >= 10; },
                              Millis{10'000}))
            << "A took no connection after ready";
        EXPECT_GT(metricOr(metric::kBackendConnectionsTotal, la), a_conns);
        EXPECT_GT(a.accepted(), a_accepted);
        if (checks) {
            const double at_ready = checksOf(la);
            EXPECT_TRUE(relay_.waitForMetric(metric::kBackendChecksTotal, la,
                                             [&](double v) { return v >= at_ready + 2; },
                                             ">= " + std::to_string(at_ready + 2)))
                << "health checks of A should resume after ready";
        }
        load.stop();
        EXPECT_EQ(relay_.metric(kAdminChanges, {{"change", "state_ready"}}), 1.0);
        EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", "ready")), 1.0);
    }
};

class AdminDrainTest : public AdminLoadTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(AdminDrainTest, DrainStopsNewConnectionsWhileALiveOneFinishes) {
    drainUnderLoad("drain", GetParam(), /*checks=*/false);
}

// drain decides where new connections go; the live connection's data path is untouched by it
// (the relay suites cover each path): splice only.
INSTANTIATE_TEST_SUITE_P(Modes, AdminDrainTest, ::testing::Values("splice"), modeName);

// maint as drain, and A's health checks stop (B's go on) until it is ready again.
TEST_F(AdminLoadTest, MaintStopsNewConnectionsAndHealthChecks) {
    drainUnderLoad("maint", "splice", /*checks=*/true);
}

// =============================================================================================
// 4. Weights: 0 takes no new connections (like drain); 3 against 1 under round robin gives A
// three quarters of the connections. The configured weight stays what the config says.

TEST_F(AdminApiTest, WeightZeroAndThreeToOne) {
    TaggedBackend a('a'), b('b');
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_TRUE(b.ok()) << b.error();
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}, {b.address()}}));
    const Labels la = backendOf(a.address()), lb = backendOf(b.address());
    EXPECT_EQ(relay_.metric(kBackendWeight, la), 1.0);

    EXPECT_TRUE(backendReply(post(backendPath(a.address()), "{\"weight\": 0}"),
                             {.address = a.address(),
                              .weight = 0,
                              .config_weight = 1,
                              .takes_new_connections = false}));
    EXPECT_EQ(relay_.metric(kBackendWeight, la), 0.0);
    const size_t a_accepted = a.accepted();
    const auto zero = spread(relay_.host(), relay_.port(), 40);
    EXPECT_EQ(zero.count('a') ? zero.at('a') : 0, 0) << "weight 0 took new connections";
    EXPECT_EQ(zero.count('b') ? zero.at('b') : 0, 40);
    EXPECT_EQ(a.accepted(), a_accepted);
    // The state is untouched: still ready, with weight 0.
    EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", "ready")), 1.0);

    EXPECT_TRUE(backendReply(post(backendPath(a.address()), "{\"weight\": 3}"),
                             {.address = a.address(), .weight = 3, .config_weight = 1}));
    EXPECT_EQ(relay_.metric(kBackendWeight, la), 3.0);
    EXPECT_EQ(relay_.metric(kBackendWeight, lb), 1.0);
    const double a_before = metricOr(metric::kBackendConnectionsTotal, la);
    const double b_before = metricOr(metric::kBackendConnectionsTotal, lb);
    constexpr int kClients = 400;
    const auto weighted = spread(relay_.host(), relay_.port(), kClients);
    const int to_a = weighted.count('a') ? weighted.at('a') : 0;
    const int to_b = weighted.count('b') ? weighted.at('b') : 0;
    const double share = to_a / static_cast<double>(kClients);
    std::printf("weights 3:1, round robin, 2 workers: A took %d of %d (%.3f; ideal 0.75)\n", to_a,
                kClients, share);
    EXPECT_EQ(to_a + to_b, kClients) << "every client served";
    EXPECT_NEAR(share, 0.75, 0.05);
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsTotal, la, a_before + to_a));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsTotal, lb, b_before + to_b));

    // Every client is gone: the backends' active counts say 0 once the relay saw the closes.
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, la, 0));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, lb, 0));
    ApiReply cluster = get("/api/v1/clusters/app");
    ASSERT_TRUE(cluster.json) << cluster.describe();
    const Json* ja = findBackend(*cluster.json, a.address());
    const Json* jb = findBackend(*cluster.json, b.address());
    ASSERT_TRUE(ja && jb) << cluster.describe();
    EXPECT_TRUE(backendIs(*ja, {.address = a.address(), .weight = 3, .config_weight = 1}));
    EXPECT_TRUE(backendIs(*jb, {.address = b.address()}));
    EXPECT_EQ(relay_.metric(kAdminChanges, {{"change", "weight"}}), 2.0);
}

// =============================================================================================
// 5. shutdown ends A's live connections now (admin_shutdown, one per connection) and leaves
// B's relaying; A stays ready and takes new connections.

TEST_F(AdminApiTest, ShutdownEndsOnlyThatBackendsConnections) {
    TaggedBackend a('a'), b('b');
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_TRUE(b.ok()) << b.error();
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}, {b.address()}}));
    const Labels la = backendOf(a.address()), lb = backendOf(b.address());

    std::vector<Fd> of_a, of_b;
    for (int i = 0; i < 20 && (of_a.size() < 3 || of_b.size() < 3); ++i) {
        Fd fd = client();
        const char tag = servedBy(fd);
        if (tag == 'a' && of_a.size() < 3) of_a.push_back(std::move(fd));
        if (tag == 'b' && of_b.size() < 3) of_b.push_back(std::move(fd));
    }
    ASSERT_EQ(of_a.size(), 3u);
    ASSERT_EQ(of_b.size(), 3u);
    uint64_t seed = 100;
    for (auto* group : {&of_a, &of_b})
        for (Fd& fd : *group) ASSERT_TRUE(exchange(fd.get(), seed++));
    ASSERT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, la, 3));
    ASSERT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, lb, 3));
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("admin_shutdown")), 0.0);

    // The workers end the connections after the answer (active may still count them): the
    // clients and the metrics below are the oracle.
    EXPECT_TRUE(backendReply(post(backendPath(a.address()), "{\"shutdown\": true}"),
                             {.address = a.address(), .active = -1}));
    for (size_t i = 0; i < of_a.size(); ++i) {
        IoResult end = waitForPeerClose(of_a[i].get(), Millis{15'000});
        EXPECT_TRUE(endedByPeer(end)) << "A's client " << i << ": " << end.describe();
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("admin_shutdown"), 3));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive, la, 0));
    EXPECT_EQ(relay_.metric(metric::kBackendConnectionsActive, lb), 3.0);
    EXPECT_EQ(relay_.metric(kAdminChanges, {{"change", "shutdown"}}), 1.0);

    // B's connections go on, byte-exact, and end as their clients end them.
    for (size_t i = 0; i < of_b.size(); ++i) {
        ReceiveCheck got = echoRoundTrip(of_b[i].get(), seed++, 128 * kKiB, Millis{20'000});
        EXPECT_EQ(got.io.status, IoStatus::Eof) << "B's client " << i << ": " << got.describe();
        EXPECT_EQ(got.bytes, 128 * kKiB) << got.describe();
        EXPECT_LT(got.first_mismatch, 0) << got.describe();
    }
    // shutdown alone leaves A ready.
    EXPECT_TRUE(backendReply(get(backendPath(a.address())), {.address = a.address()}));
    const auto after = spread(relay_.host(), relay_.port(), 8);
    EXPECT_GT(after.count('a') ? after.at('a') : 0, 0) << "A takes new connections after shutdown";
    EXPECT_EQ(relay_.metric(metric::kClosedTotal, metric::reason("admin_shutdown")), 3.0)
        << "only the three were ended";
}

// =============================================================================================
// 6. Refusals: each with its status and a JSON error naming the problem, each counted; the
// relay relays throughout.

TEST_F(AdminApiTest, BadRequestsAreRefusedWithJsonErrorsAndCounted) {
    TaggedBackend a('a');
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}}));
    const std::string path = backendPath(a.address());
    uint64_t seed = 200;
    ASSERT_NO_FATAL_FAILURE(expectRelaying(seed++));

    struct Case {
        std::string what, method, path, body;
        int status;
        std::string mention;  // in the error text
        const char* result;   // the zcrelay_admin_requests_total label it counts under
    };
    const std::vector<Case> cases = {
        {"unknown cluster", "GET", "/api/v1/clusters/nope", "", 404, "nope", "not_found"},
        {"unknown cluster (POST)", "POST", "/api/v1/clusters/nope/backends/1.2.3.4%3A5",
         "{\"state\":\"drain\"}", 404, "nope", "not_found"},
        {"unknown backend", "GET", "/api/v1/clusters/app/backends/127.0.0.1%3A1", "", 404,
         "127.0.0.1:1", "not_found"},
        {"bad JSON", "POST", path, "{\"state\" \"drain\"}", 400, "at byte 9", "bad_request"},
        {"not an object", "POST", path, "[1]", 400, "at byte 0", "bad_request"},
        {"trailing text", "POST", path, "{\"state\":\"drain\"} x", 400, "at byte 18",
         "bad_request"},
        {"unknown member", "POST", path, "{\"colour\": \"red\"}", 400, "colour", "bad_request"},
        {"state foo", "POST", path, "{\"state\": \"foo\"}", 400, "state", "bad_request"},
        {"weight -1", "POST", path, "{\"weight\": -1}", 400, "weight", "bad_request"},
        {"weight 257", "POST", path, "{\"weight\": 257}", 400, "weight", "bad_request"},
        {"weight \"3\"", "POST", path, "{\"weight\": \"3\"}", 400, "weight", "bad_request"},
        {"weight 1.5", "POST", path, "{\"weight\": 1.5}", 400, "weight", "bad_request"},
        {"shutdown \"yes\"", "POST", path, "{\"shutdown\": \"yes\"}", 400, "shutdown",
         "bad_request"},
        {"empty object", "POST", path, "{}", 400, "nothing to change", "bad_request"},
        {"no body", "POST", path, "", 400, "", "bad_request"},
        {"POST to a cluster", "POST", "/api/v1/clusters/app", "{\"state\":\"drain\"}", 405,
         "read-only", "bad_request"},
        {"not a backends path", "GET", "/api/v1/clusters/app/members/x", "", 404, "backends",
         "not_found"},
    };
    std::map<std::string, double> before;
    for (const char* r : {"ok", "bad_request", "not_found", "unauthorized"}) before[r] = requests(r);
    std::map<std::string, double> expected = before;
    for (const Case& c : cases) {
        const ApiReply r = api(c.method, c.path, c.body,
                               c.body.empty() ? "" : "Content-Type: application/json\r\n");
        EXPECT_TRUE(isError(r, c.status, c.mention)) << c.what << ": " << c.method << " " << c.path;
        expected[c.result] += 1;
        ASSERT_NO_FATAL_FAILURE(expectRelaying(seed++)) << "after " << c.what;
    }
    for (const auto& [result, count] : expected)
        EXPECT_TRUE(relay_.waitForMetric(kAdminRequests, {{"result", result}}, count))
            << "each refusal counts once under its result";
    // Nothing was changed by any of them.
    EXPECT_EQ(relay_.metric(kAdminChanges, {}), 0.0);
    EXPECT_TRUE(relay_.waitForMetric(metric::kBackendConnectionsActive,
                                     backendOf(a.address()), 0));
    EXPECT_TRUE(backendReply(get(path), {.address = a.address()}));
    ASSERT_NO_FATAL_FAILURE(expectRelaying(seed++));
}

// What the API's HTTP server refuses before the API sees the request: a body past 4096 bytes
// (413, the body never read) and a path under /api/v1 the API does not serve (404).
TEST_F(AdminApiTest, OversizedBodiesAndUnknownPathsAreRefused) {
    TaggedBackend a('a');
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}}));
    const std::string path = backendPath(a.address());
    const double ok_before = requests("ok");
    const double bad_before = requests("bad_request");
    const double not_found_before = requests("not_found");

    // 4096 bytes exactly is read (and refused as JSON only for what it holds: valid JSON
    // padded with spaces is taken).
    std::string fits = "{\"state\": \"drain\"}";
    fits += std::string(4096 - fits.size(), ' ');
    ASSERT_EQ(fits.size(), 4096u);
    EXPECT_TRUE(backendReply(post(path, fits), {.address = a.address(),
                                                .state = "drain",
                                                .takes_new_connections = false}));
    EXPECT_TRUE(backendReply(post(path, "{\"state\": \"ready\"}"), {.address = a.address()}));

    std::string big = "{\"state\": \"drain\"}";
    big += std::string(4097 - big.size(), ' ');
    const ApiReply too_big = post(path, big);
    EXPECT_EQ(too_big.status, 413) << too_big.describe();
    const ApiReply nope = get("/api/v1/nope");
    EXPECT_EQ(nope.status, 404) << nope.describe();
    EXPECT_TRUE(relay_.waitForMetric(kAdminRejected, {{"reason", "body"}}, 1));
    EXPECT_TRUE(relay_.waitForMetric(kAdminRejected, {{"reason", "not_found"}}, 1));
    // The 413 changed nothing.
    EXPECT_TRUE(backendReply(get(path), {.address = a.address()}));
    ASSERT_NO_FATAL_FAILURE(expectRelaying(300));
    EXPECT_EQ(requests("ok"), ok_before + 3) << "the three 200s";
    EXPECT_EQ(requests("bad_request"), bad_before);
    EXPECT_EQ(requests("not_found"), not_found_before);
}

// =============================================================================================
// 7. The bearer token; an address reachable from other hosts without one is refused; a unix
// socket, served to curl and removed at exit.

TEST_F(AdminApiTest, BearerTokenIsRequiredWhenConfigured) {
    TaggedBackend a('a');
    ASSERT_TRUE(a.ok()) << a.error();
    const std::string token_file = relay_.dir() + "/admin.token";
    FILE* f = std::fopen(token_file.c_str(), "w");
    ASSERT_NE(f, nullptr) << std::strerror(errno);
    std::fputs("s3cret-t0ken\nignored second line\n", f);
    std::fclose(f);
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}}, "splice", "    balance: round_robin\n",
                                      "  token_file: \"" + token_file + "\"\n"));
    const std::string path = backendPath(a.address());

    EXPECT_TRUE(isError(api("GET", "/api/v1/clusters"), 401, "token")) << "no Authorization";
    EXPECT_TRUE(isError(api("GET", "/api/v1/clusters", "", "Authorization: Bearer wrong\r\n"),
                        401, "token"))
        << "wrong token";
    EXPECT_TRUE(isError(api("GET", "/api/v1/clusters", "", "Authorization: Bearer s3cret-t0k\r\n"),
                        401, "token"))
        << "a prefix of the token";
    EXPECT_TRUE(isError(api("GET", "/api/v1/clusters", "",
                            "Authorization: Bearer s3cret-t0ken2\r\n"),
                        401, "token"))
        << "the token and more";
    EXPECT_TRUE(isError(api("GET", "/api/v1/clusters", "", "Authorization: s3cret-t0ken\r\n"),
                        401, "token"))
        << "no Bearer";
    // Unauthorized changes change nothing.
    EXPECT_TRUE(isError(api("POST", path, "{\"state\":\"drain\"}",
                            "Content-Type: application/json\r\nAuthorization: Bearer nope\r\n"),
                        401, "token"));
    EXPECT_EQ(relay_.metric(kAdminState, withLabel(backendOf(a.address()), "state", "ready")),
              1.0);

    const std::string auth = "Authorization: Bearer s3cret-t0ken\r\n";
    ApiReply ok = api("GET", "/api/v1/clusters", "", auth);
    EXPECT_EQ(ok.status, 200) << ok.describe();
    EXPECT_TRUE(ok.json && ok.json->items("clusters").size() == 1) << ok.describe();
    EXPECT_TRUE(backendReply(api("POST", path, "{\"state\":\"drain\"}", auth),
                             {.address = a.address(),
                              .state = "drain",
                              .takes_new_connections = false}));
    EXPECT_TRUE(relay_.waitForMetric(kAdminRequests, {{"result", "unauthorized"}}, 6));
    EXPECT_TRUE(relay_.waitForMetric(kAdminRequests, {{"result", "ok"}}, 2));
    EXPECT_EQ(relay_.metric(kAdminChanges, {{"change", "state_drain"}}), 1.0);
}

// A raw request on a fresh connection to the API (`request` sent as is, NULs and all), read
// until the server closes: the status, 0 if no complete response came.
struct RawReply {
    int status = 0;
    std::string text;  // everything read
    std::string error;
};
RawReply rawRequest(const std::string& host, uint16_t port, const std::string& request) {
    RawReply r;
    Connected c = connectTo(host, port);
    if (!c.fd) {
        r.error = "connect: " + c.error;
        return r;
    }
    IoResult w = writeAll(c.fd.get(), request.data(), request.size(), Millis{5'000});
    if (!w.ok() && w.status != IoStatus::Reset) r.error = "send: " + w.describe();
    IoResult end = readUntilEof(c.fd.get(), r.text, Millis{5'000});
    if (r.text.rfind("HTTP/1.", 0) == 0 && r.text.size() > 12)
        r.status = std::atoi(r.text.c_str() + 9);
    else
        r.error += " no response (" + end.describe() + ")";
    return r;
}

// RFC 9112 §6.3 and RFC 9110 §5.5, on the API: two Content-Lengths (libmicrohttpd took the first,
// so "12 then 5" applied a whole weight change another parser would read as 5 bytes), a NUL
// after a valid bearer token (libmicrohttpd's C string ended at it: accepted), a NUL in the
// target (answered as the path before it). Each is 400 and closed, and changes nothing; the
// same PUT with one Content-Length then works. The token file's first line is trimmed of its
// surrounding blanks.
TEST_F(AdminApiTest, SmuggledLengthsAndNulBytesAreRefused) {
    using namespace std::string_literals;
    TaggedBackend a('a');
    ASSERT_TRUE(a.ok()) << a.error();
    const std::string token_file = relay_.dir() + "/admin.token";
    FILE* f = std::fopen(token_file.c_str(), "w");
    ASSERT_NE(f, nullptr) << std::strerror(errno);
    std::fputs(" \ts3cret-t0ken \t\r\n", f);
    std::fclose(f);
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}}, "splice", "    balance: round_robin\n",
                                      "  token_file: \"" + token_file + "\"\n"));
    const std::string path = backendPath(a.address());
    const std::string auth = "Authorization: Bearer s3cret-t0ken\r\n";
    const std::string weight3 = "{\"weight\":3}";
    ASSERT_EQ(weight3.size(), 12u);
    const auto put = [&](const std::string& lengths) {
        return "PUT " + path + " HTTP/1.1\r\nHost: x\r\n" + auth +
               "Content-Type: application/json\r\n" + lengths + "\r\n" + weight3;
    };

    RawReply r =
        rawRequest(admin_host_, admin_port_, put("Content-Length: 12\r\nContent-Length: 5\r\n"));
    EXPECT_EQ(r.status, 400) << r.error << r.text;
    r = rawRequest(admin_host_, admin_port_, put("Content-Length: 12\r\nContent-Length: 12\r\n"));
    EXPECT_EQ(r.status, 400) << r.error << r.text;
    r = rawRequest(admin_host_, admin_port_,
                   put("Content-Length: 12\r\nTransfer-Encoding: chunked\r\n"));
    EXPECT_EQ(r.status, 400) << r.error << r.text;
    // Nothing applied: the weight as configured, no change counted.
    EXPECT_TRUE(backendReply(api("GET", path, "", auth), {.address = a.address()}));
    EXPECT_EQ(relay_.metric(kAdminChanges, {}).value_or(0), 0.0);

    // The token, then a NUL and more: not the token.
    r = rawRequest(admin_host_, admin_port_,
                   "GET /api/v1/clusters HTTP/1.1\r\nHost: x\r\n"
                   "Authorization: Bearer s3cret-t0ken\0junk\r\n\r\n"s);
    EXPECT_TRUE(r.status == 400 || r.status == 401) << r.status << " " << r.error << r.text;
    const int bearer_nul = r.status;
    // A NUL in the target: not the cluster before it.
    r = rawRequest(admin_host_, admin_port_,
                   "GET /api/v1/clusters/app\0x HTTP/1.1\r\nHost: x\r\n"s + auth + "\r\n");
    EXPECT_EQ(r.status, 400) << r.error << r.text;
    EXPECT_EQ(r.text.find("\"backends\""), std::string::npos) << "answered as the cluster";
    // "Bearer " and blanks never authenticate.
    EXPECT_TRUE(
        isError(api("GET", "/api/v1/clusters", "", "Authorization: Bearer    \r\n"), 401, "token"));
    EXPECT_TRUE(relay_.waitForMetric(kAdminRejected, {{"reason", "bad_request"}},
                                     bearer_nul == 400 ? 5 : 4));
    EXPECT_EQ(requests("ok"), 1.0) << "only the GET of the backend was answered";

    // The same PUT with one Content-Length is taken: the shape itself was fine.
    r = rawRequest(admin_host_, admin_port_, put("Content-Length: 12\r\nConnection: close\r\n"));
    EXPECT_EQ(r.status, 200) << r.error << r.text;
    EXPECT_TRUE(backendReply(api("GET", path, "", auth), {.address = a.address(), .weight = 3}));
    EXPECT_EQ(relay_.metric(kAdminChanges, {{"change", "weight"}}), 1.0);
    ASSERT_NO_FATAL_FAILURE(expectRelaying(500));
}

// The token file's first line, trimmed of spaces and tabs, is the token: one of blanks only is
// refused at start (before, the relay started and `Bearer ` plus those blanks authenticated),
// and so is one holding a control byte. Both name the file; the relay exits 1.
TEST(AdminApiConfig, ABlankOrControlByteTokenFileIsRefusedAtStart) {
    TempDir dir;
    const auto run = [&](const std::string& name, const std::string& content) {
        const std::string token = dir.writeFile(name, content);
        RelayConfig config =
            clusterConfig(adminYaml("127.0.0.1:0", "  token_file: \"" + token + "\"\n"),
                          clusterYaml({{"127.0.0.1:9"}}));
        const std::string path = dir.writeFile(name + ".yaml", config.yaml());
        return std::make_pair(token, runCommand({kRelayBinary, "-c", path}, Millis{15'000}));
    };
    for (const char* blank : {"    \n", " \t \r\nsecond-line-token\n", "   "}) {
        auto [token, r] = run("blank.token", blank);
        EXPECT_TRUE(r.status.exited && r.status.code == 1) << r.describe();
        EXPECT_NE(r.err.find("admin.token_file " + token + ": the first line is empty"),
                  std::string::npos)
            << r.describe();
    }
    auto [token, r] = run("ctl.token", std::string("s3cret\x01t0ken\n"));
    EXPECT_TRUE(r.status.exited && r.status.code == 1) << r.describe();
    EXPECT_NE(r.err.find("admin.token_file " + token + ": the token holds a control byte (0x01)"),
              std::string::npos)
        << r.describe();
}

TEST(AdminApiConfig, WildcardListenWithoutTokenIsRefused) {
    TempDir dir;
    auto check = [&](const std::string& admin) {
        RelayConfig config = clusterConfig(admin, clusterYaml({{"127.0.0.1:9"}}));
        const std::string path = dir.writeFile("zcrelay.yaml", config.yaml());
        return runCommand({kRelayBinary, "--check-config", path}, Millis{10'000});
    };
    // Only checked, never started: nothing here listens beyond loopback.
    for (const char* listen : {"0.0.0.0:9101", "[::]:9101"}) {
        CommandResult refused = check(adminYaml(listen));
        EXPECT_TRUE(refused.status.exited && refused.status.code == 1) << refused.describe();
        EXPECT_NE(refused.err.find("admin.listen"), std::string::npos) << refused.describe();
        EXPECT_NE(refused.err.find("token_file"), std::string::npos) << refused.describe();
    }
    // Loopback and unix sockets need no token; a wildcard address with a token file is taken.
    for (const std::string& admin :
         {adminYaml("127.0.0.1:9101"), adminYaml("[::1]:9101"), adminYaml("unix:/tmp/x.sock"),
          adminYaml("0.0.0.0:9101", "  token_file: /etc/zcrelay/admin.token\n")}) {
        CommandResult taken = check(admin);
        EXPECT_TRUE(taken.status.cleanExit()) << admin << "\n" << taken.describe();
    }
    // A token file without a listen address is a mistake too.
    CommandResult orphan = check("admin:\n  token_file: /etc/zcrelay/admin.token\n");
    EXPECT_TRUE(orphan.status.exited && orphan.status.code == 1) << orphan.describe();
    EXPECT_NE(orphan.err.find("admin.token_file"), std::string::npos) << orphan.describe();
}

TEST_F(AdminApiTest, UnixSocketServesCurlAndIsRemovedAtExit) {
    const auto curl = findExecutable("curl");
    if (!curl) GTEST_SKIP() << "curl is not installed";
    TaggedBackend a('a');
    ASSERT_TRUE(a.ok()) << a.error();
    const std::string sock = relay_.dir() + "/admin.sock";
    ASSERT_NO_FATAL_FAILURE(start(
        clusterConfig(adminYaml("unix:" + sock), clusterYaml({{a.address()}}))));
    struct stat st {};
    ASSERT_EQ(::lstat(sock.c_str(), &st), 0) << sock << ": " << std::strerror(errno);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0660u);

    auto curlApi = [&](const std::vector<std::string>& extra, const std::string& path) {
        std::vector<std::string> argv = {*curl, "-sS", "--max-time", "5", "--unix-socket", sock,
                                         "-w", "\n%{http_code}"};
        argv.insert(argv.end(), extra.begin(), extra.end());
        argv.push_back("http://localhost" + path);
        CommandResult r = runCommand(argv, Millis{10'000});
        ApiReply out;
        if (!r.status.cleanExit()) {
            out.error = r.describe();
            return out;
        }
        const size_t nl = r.out.rfind('\n');
        out.status = std::atoi(r.out.c_str() + nl + 1);
        out.body = r.out.substr(0, nl);
        std::string why;
        out.json = parseJson(out.body, why);
        if (!out.json) out.error = "not JSON: " + why;
        return out;
    };
    ApiReply list = curlApi({}, "/api/v1/clusters");
    EXPECT_EQ(list.status, 200) << list.describe();
    ASSERT_TRUE(list.json) << list.describe();
    ASSERT_EQ(list.json->items("clusters").size(), 1u) << list.describe();
    EXPECT_TRUE(backendIs(list.json->items("clusters")[0].items("backends").at(0),
                          {.address = a.address()}));
    EXPECT_TRUE(backendReply(curlApi({"-X", "POST", "-H", "Content-Type: application/json",
                                      "--data", "{\"weight\": 7}"},
                                     backendPath(a.address())),
                             {.address = a.address(), .weight = 7}));
    EXPECT_EQ(relay_.metric(kBackendWeight, backendOf(a.address())), 7.0);
    EXPECT_TRUE(isError(curlApi({}, "/api/v1/clusters/none"), 404, "none"));

    ExitStatus exit = relay_.terminate();
    EXPECT_TRUE(exit.cleanExit()) << exit.describe();
    const int gone = ::lstat(sock.c_str(), &st) == 0 ? 0 : errno;
    EXPECT_EQ(gone, ENOENT) << sock << " is still there after the relay exited";
}

// =============================================================================================
// 8. SIGHUP keeps what the API set on the backends it keeps; a backend removed and added back
// starts from ready and its configured weight.

TEST_F(AdminApiTest, ReloadKeepsChangesOfKeptBackendsOnly) {
    TaggedBackend a('a'), b('b');
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_TRUE(b.ok()) << b.error();
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address(), 2}, {b.address(), 1}}));
    const Labels la = backendOf(a.address());
    const std::string path = backendPath(a.address());
    auto generation = [&] {
        ApiReply r = get("/api/v1/clusters");
        const Json* g = r.json ? r.json->get("generation") : nullptr;
        return g != nullptr && g->type == Json::Type::Number ? g->number : -1.0;
    };
    auto configWith = [&](const std::vector<BackendLine>& backends, const std::string& settings,
                          const std::string& idle) {
        RelayConfig config = clusterConfig(adminYaml("127.0.0.1:0"), clusterYaml(backends, settings));
        config.listeners[0].listen = "127.0.0.1:" + std::to_string(relay_.port());
        config.listeners[0].idle_timeout = idle;
        return config.yaml();
    };

    EXPECT_TRUE(backendReply(post(path, "{\"state\": \"drain\", \"weight\": 5}"),
                             {.address = a.address(),
                              .state = "drain",
                              .weight = 5,
                              .config_weight = 2,
                              .takes_new_connections = false}));
    const double g0 = generation();

    // Something unrelated changes: the cluster's retries, the listener's idle_timeout.
    ASSERT_TRUE(relay_.reload(
        configWith({{a.address(), 2}, {b.address(), 1}},
                   "    balance: round_robin\n    retries: 1\n", "200s")));
    EXPECT_GT(generation(), g0) << "the reload built a new generation";
    EXPECT_TRUE(backendReply(get(path), {.address = a.address(),
                                         .state = "drain",
                                         .weight = 5,
                                         .config_weight = 2,
                                         .takes_new_connections = false}));
    EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", "drain")), 1.0);
    EXPECT_EQ(relay_.metric(kBackendWeight, la), 5.0);
    const auto drained = spread(relay_.host(), relay_.port(), 20);
    EXPECT_EQ(drained.count('a') ? drained.at('a') : 0, 0) << "still drained after the reload";

    // Ready again, it takes its kept weight: 5 to B's 1 (per worker's smooth round robin, each
    // within one of its share).
    EXPECT_TRUE(backendReply(post(path, "{\"state\": \"ready\"}"),
                             {.address = a.address(), .weight = 5, .config_weight = 2}));
    const auto weighted = spread(relay_.host(), relay_.port(), 60);
    const int to_a = weighted.count('a') ? weighted.at('a') : 0;
    EXPECT_GE(to_a, 46) << "weight 5:1 should give A about 50 of 60";
    EXPECT_LE(to_a, 54) << "weight 5:1 should give A about 50 of 60";
    EXPECT_TRUE(backendReply(post(path, "{\"state\": \"drain\"}"),
                             {.address = a.address(),
                              .state = "drain",
                              .weight = 5,
                              .config_weight = 2,
                              .active = -1,  // the last client's close may be under way
                              .takes_new_connections = false}));

    // A leaves the config, then comes back: a backend of its own again.
    ASSERT_TRUE(relay_.reload(configWith({{b.address(), 1}}, "    balance: round_robin\n", "300s")));
    EXPECT_TRUE(isError(get(path), 404, a.address()));
    EXPECT_FALSE(relay_.metric(kBackendWeight, la).has_value()) << "A's series are gone";
    ASSERT_TRUE(relay_.reload(configWith({{a.address(), 2}, {b.address(), 1}},
                                         "    balance: round_robin\n", "300s")));
    EXPECT_TRUE(backendReply(get(path), {.address = a.address(), .weight = 2, .config_weight = 2}));
    EXPECT_EQ(relay_.metric(kAdminState, withLabel(la, "state", "ready")), 1.0);
    EXPECT_EQ(relay_.metric(kBackendWeight, la), 2.0);
    const auto back = spread(relay_.host(), relay_.port(), 30);
    const int back_a = back.count('a') ? back.at('a') : 0;
    EXPECT_GE(back_a, 17) << "weight 2:1 should give A about 20 of 30";
    EXPECT_LE(back_a, 23) << "weight 2:1 should give A about 20 of 30";
}

// =============================================================================================
// 9. The API's HTTP server under a hostile client, as /metrics': idle connections past
// max_connections cannot keep a request from being answered; a trickled request is closed at
// request_timeout (3 s: far enough above what a loaded machine takes to answer a request that
// "answered at once" and "answered once an idle connection timed out" are told apart).

TEST_F(AdminApiTest, HostileClientsAreBoundedLikeTheMetricsEndpoints) {
    TaggedBackend a('a');
    ASSERT_TRUE(a.ok()) << a.error();
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}}, "splice", "    balance: round_robin\n",
                                      "  request_timeout: 3s\n  max_connections: 4\n"));
    const Labels evicted = {{"reason", "evicted"}}, timed_out = {{"reason", "timeout"}};

    // 60 idle connections against a cap of 4: every request meanwhile is answered at once.
    constexpr size_t kIdle = 60;
    std::vector<Fd> idle = openIdle(admin_port_, kIdle);
    ASSERT_EQ(idle.size(), kIdle);
    for (int i = 0; i < 5; ++i) {
        const auto t0 = Clock::now();
        ApiReply r = get("/api/v1/clusters");
        EXPECT_EQ(r.status, 200) << "request " << i << " with " << kIdle << " idle connections: "
                                 << r.describe();
        // A loopback request takes milliseconds; 2 s is room for a loaded 2-core machine and
        // still short of the 3 s a request queued behind the idle connections would wait.
        EXPECT_LT(secondsSince(t0), 2.0) << "request " << i;
    }
    EXPECT_TRUE(relay_.waitForMetric(kAdminRejected, evicted,
                                     [](double v) { return v >= kIdle - 4; },
                                     ">= " + std::to_string(kIdle - 4)));
    EXPECT_EQ(closedByPeer(idle, Millis{15'000}), kIdle)
        << "every idle connection is closed (evicted, or at request_timeout)";
    idle.clear();
    // Each idle connection is counted once, evicted or timed out, just after the close its
    // client saw: wait for all of them before taking the timeouts' count.
    EXPECT_TRUE(waitUntil(
        [&] {
            return metricOr(kAdminRejected, evicted) + metricOr(kAdminRejected, timed_out) >= kIdle;
        },
        Millis{10'000}))
        << "evicted " << metricOr(kAdminRejected, evicted) << ", timed out "
        << metricOr(kAdminRejected, timed_out) << " of " << kIdle;
    const double timeouts = metricOr(kAdminRejected, timed_out);

    // Two requests trickled a byte every 100 ms: one in its headers, one in its body. Each is
    // closed about request_timeout (3 s) after it connected.
    const std::string head = "GET /api/v1/clusters HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    const std::string body_head = "POST " + backendPath(a.address()) +
                                  " HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n{\"state\":";
    std::vector<Fd> slow;
    for (const std::string* start : {&head, &body_head}) {
        Connected c = connectTo(admin_host_, admin_port_);
        ASSERT_TRUE(c.fd) << c.error;
        ASSERT_TRUE(writeAll(c.fd.get(), start->data(), start->size()).ok());
        slow.push_back(std::move(c.fd));
    }
    const auto t0 = Clock::now();
    std::vector<double> closed_after(slow.size(), -1);
    while (secondsSince(t0) < 15.0 &&
           std::count(closed_after.begin(), closed_after.end(), -1.0) > 0) {
        for (size_t i = 0; i < slow.size(); ++i) {
            if (closed_after[i] >= 0) continue;
            char buf[512];
            const ssize_t n = ::recv(slow[i].get(), buf, sizeof buf, MSG_DONTWAIT);
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) ||
                ::send(slow[i].get(), " ", 1, MSG_NOSIGNAL) < 0) {
                closed_after[i] = secondsSince(t0);
            }
        }
        std::this_thread::sleep_for(Millis{100});
    }
    for (size_t i = 0; i < slow.size(); ++i) {
        EXPECT_GE(closed_after[i], 2.7) << "trickled request " << i << " closed too early";
        // Trickled for ever unless the deadline holds; 10 s bounds a timer of 3 s on any load.
        EXPECT_LE(closed_after[i], 10.0)
            << "trickled request " << i << " not closed at request_timeout 3s (-1: never)";
    }
    EXPECT_TRUE(relay_.waitForMetric(kAdminRejected, timed_out, timeouts + 2));
    // Nothing the trickled POST held was applied.
    EXPECT_TRUE(backendReply(get(backendPath(a.address())), {.address = a.address()}));
    ASSERT_NO_FATAL_FAILURE(expectRelaying(400));
}

}  // namespace
}  // namespace zcrelay::test::admin_api_test
