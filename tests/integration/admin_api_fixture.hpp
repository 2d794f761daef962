#pragma once
// The runtime API (proxy/admin_api.hpp) on the real binary, over real loopback sockets. What
// the admin_api_*_test.cpp files share: tagged echo backends, the API's answers read strictly,
// the configs and the fixture that starts the relay and talks to its API. Each file is one part
// of the contract:
//   - admin_api_backends_test: listing clusters and backends, weights (0, and 3:1 under round
//     robin), shutdown of a backend's live connections, what a SIGHUP keeps;
//   - admin_api_drain_test: drain and maint under a continuous client load (no new connection
//     reaches the backend from the moment the change is answered, while one opened before keeps
//     relaying byte-exact);
//   - admin_api_refusals_test: every refusal with its status and JSON error, smuggled lengths
//     and NUL bytes, and the hostile-client bounds of its HTTP server;
//   - admin_api_access_test: the bearer token, the addresses refused without one, the unix
//     socket.
//
// Each backend tags its connections with one byte, then echoes: a client knows which backend
// serves it. The other oracle is the relay's metrics. Every answer of the API is parsed with the
// strict JSON reader. Loopback only; every loop is bounded in count and time; only the
// processes and threads these files start are stopped.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <cctype>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "support/json.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::admin_api_test {

inline constexpr const char* kAdminChanges = "zcrelay_admin_changes_total";     // {change}
inline constexpr const char* kAdminRequests = "zcrelay_admin_requests_total";   // {result}
inline constexpr const char* kAdminRejected = "zcrelay_admin_endpoint_rejected_total";  // {reason}
// kAdminState: {cluster,backend,state}
inline constexpr const char* kAdminState = "zcrelay_backend_admin_state";
inline constexpr const char* kBackendWeight = "zcrelay_backend_weight";  // {cluster,backend}
inline constexpr const char* kCluster = "app";

inline Labels withLabel(Labels l, const std::string& key, const std::string& value) {
    l[key] = value;
    return l;
}
inline Labels backendOf(const std::string& address) { return metric::backend(kCluster, address); }

// "[::1]:8080" -> "%5B%3A%3A1%5D%3A8080": every byte but [A-Za-z0-9._-] escaped.
inline std::string percentEncode(const std::string& s, bool lower = false) {
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

inline std::string backendPath(const std::string& address, const std::string& cluster = kCluster) {
    return "/api/v1/clusters/" + cluster + "/backends/" + percentEncode(address);
}

// ---------------------------------------------------------------------------------------------
// A backend that says who it is: one tag byte on every connection it accepts (health checks
// included), then an echo of whatever the client sends until EOF.

inline ConnScript taggedEchoScript(char tag) {
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
inline std::map<char, int> spread(const std::string& host, uint16_t port, int n) {
    std::map<char, int> count;
    for (int i = 0; i < n; ++i) {
        Connected c = connectTo(host, port);
        ++count[c.fd ? servedBy(c.fd) : 0];
    }
    return count;
}

// One `bytes` message there and back through the echo, the connection left open.
inline ::testing::AssertionResult exchange(int fd, uint64_t seed, uint64_t bytes = 64 * kKiB) {
    IoResult sent = sendPayload(fd, seed, bytes, Millis{10'000});
    if (!sent.ok()) return ::testing::AssertionFailure() << "send: " << sent.describe();
    std::vector<uint8_t> echoed(bytes), expected(bytes);
    IoResult got = readExactly(fd, echoed.data(), echoed.size(), Millis{10'000});
    if (!got.ok()) return ::testing::AssertionFailure() << "echo: " << got.describe();
    fillPayload(seed, 0, expected);
    if (echoed != expected) return ::testing::AssertionFailure() << "the echo differs";
    return ::testing::AssertionSuccess();
}

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

inline ApiReply toReply(std::optional<HttpResponse> r, const std::string& transport_error) {
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
inline ::testing::AssertionResult isError(const ApiReply& r, int status,
                                          const std::string& mention) {
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
    bool backup = false;
    int tier = 0;
    // In the tier that serves and taking connections; expected: -1 for "as
    // takes_new_connections" (a cluster without backups).
    int serving = -1;
    int slow_start_permille = 1000;  // at full weight: no slow_start, or past it

    bool matches(const BackendView& e) const {
        return address == e.address && state == e.state && health == e.health &&
               weight == e.weight && config_weight == e.config_weight &&
               (e.active < 0 || active == e.active) &&
               takes_new_connections == e.takes_new_connections && backup == e.backup &&
               tier == e.tier && slow_start_permille == e.slow_start_permille &&
               serving == (e.serving < 0 ? static_cast<int>(e.takes_new_connections) : e.serving);
    }
    std::string describe() const {
        return "{address " + address + ", state " + state + ", health " + health + ", weight " +
               std::to_string(weight) + ", config_weight " + std::to_string(config_weight) +
               ", active " + (active < 0 ? std::string("any") : std::to_string(active)) +
               ", takes_new_connections " + (takes_new_connections ? "true" : "false") +
               ", backup " + (backup ? "true" : "false") + ", tier " + std::to_string(tier) +
               ", serving " + std::to_string(serving) + "}";
    }
};

inline std::optional<BackendView> viewOf(const Json& b, std::string& why) {
    static const std::set<std::string> kMembers = {"address",
                                                   "state",
                                                   "health",
                                                   "weight",
                                                   "config_weight",
                                                   "active",
                                                   "takes_new_connections",
                                                   "backup",
                                                   "tier",
                                                   "serving",
                                                   "slow_start_permille"};
    if (b.type != Json::Type::Object) {
        why = "a backend is not an object";
        return std::nullopt;
    }
    std::set<std::string> seen;
    for (const auto& [k, v] : b.object) seen.insert(k);
    if (seen != kMembers) {
        why =
            "a backend's members are not exactly address, state, health, weight, "
            "config_weight, active, takes_new_connections, backup, tier, serving, "
            "slow_start_permille";
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
    for (const char* key : {"backup", "serving"}) {
        if (b.get(key)->type != Json::Type::Bool) {
            why = std::string(key) + " is not a boolean";
            return std::nullopt;
        }
    }
    out.backup = b.get("backup")->boolean;
    out.serving = b.get("serving")->boolean ? 1 : 0;
    if (!whole("tier", out.tier) || !whole("slow_start_permille", out.slow_start_permille))
        return std::nullopt;
    return out;
}

inline ::testing::AssertionResult backendIs(const Json& b, const BackendView& expected) {
    std::string why;
    auto view = viewOf(b, why);
    if (!view) return ::testing::AssertionFailure() << why;
    if (!view->matches(expected))
        return ::testing::AssertionFailure()
               << "backend is " << view->describe() << ", expected " << expected.describe();
    return ::testing::AssertionSuccess();
}

// A 200 answer describing one backend as `expected`.
inline ::testing::AssertionResult backendReply(const ApiReply& r, const BackendView& expected) {
    if (r.status != 200 || !r.json)
        return ::testing::AssertionFailure() << "expected 200 and JSON; " << r.describe();
    return backendIs(*r.json, expected);
}

// The backend named `address` in a cluster object, or nullptr.
inline const Json* findBackend(const Json& cluster, const std::string& address) {
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
inline std::string clusterYaml(const std::vector<BackendLine>& backends,
                               const std::string& settings = "    balance: round_robin\n") {
    std::string y = "clusters:\n  - name: app\n" + settings + "    backends:\n";
    for (const auto& b : backends)
        y += "      - {address: \"" + b.address + "\", weight: " + std::to_string(b.weight) + "}\n";
    return y;
}

inline std::string adminYaml(const std::string& listen, const std::string& extra = "") {
    return "admin:\n  listen: \"" + listen + "\"\n" + extra;
}

inline RelayConfig clusterConfig(const std::string& admin, const std::string& clusters,
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

}  // namespace zcrelay::test::admin_api_test
