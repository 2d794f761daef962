// The same ClientHellos through HAProxy's req.ssl_sni content switching and through zcrelay
// with the same routes: what HAProxy sends to a named backend, zcrelay sends to the same one.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "integration/sni_fixture.hpp"
#include "support/haproxy.hpp"

namespace zcrelay::test::sni_routing_test {
namespace {

// =============================================================================================
// 6. HAProxy cross-check: the same hellos through HAProxy 2.6 (req.ssl_sni content switching)
// and through zcrelay with the same routes, each to capture backends of its own.

// haproxy with one tcp frontend on a loopback port routing like kRoutes
// (tests/support/haproxy.hpp).
class HaproxyRouter {
  public:
    explicit HaproxyRouter(std::string binary) : process_(std::move(binary)) {}

    ::testing::AssertionResult start(const ClusterAddrs& to) {
        // The frontend waits for a whole ClientHello, as zcrelay does; its buffer, like
        // zcrelay's inspect_max_size here, holds 64 KiB. The ACLs say what kRoutes says:
        // -i for case; a regex for "exactly one label"; ALPN alone.
        return process_.start(AF_INET, [&](const std::string& bind) {
            return haproxyTcpPreamble("    tune.bufsize 65536\n") +
                   "frontend fe\n"
                   "    bind " +
                   bind +
                   "\n"
                   "    tcp-request inspect-delay 5s\n"
                   "    tcp-request content accept if { req.ssl_hello_type 1 }\n"
                   "    use_backend api if { req.ssl_sni -i api.example.test }\n"
                   "    use_backend apps if { req.ssl_sni -m reg -i "
                   "^[^.]+\\.apps\\.example\\.test$ } { req.ssl_alpn h2 http/1.1 }\n"
                   "    use_backend apps if { req.ssl_alpn acme-tls/1 }\n"
                   "    default_backend fallback\n"
                   "backend api\n    server s1 " +
                   to.api +
                   "\n"
                   "backend apps\n    server s1 " +
                   to.apps +
                   "\n"
                   "backend fallback\n    server s1 " +
                   to.fallback + "\n";
        });
    }
    void stop() { process_.stop(); }
    uint16_t port() const { return process_.port(); }

  private:
    HaproxyProcess process_;
};

struct CrossHello {
    std::string name;
    std::vector<std::string> parts;  // the client's writes
    std::string expected;            // zcrelay's backend by the contract
};

// The captured real hellos, the same in pieces, and two that are not TLS.
std::vector<CrossHello> crossHellos(const Tools& tools, std::string& error) {
    struct Captured {
        HelloSpec spec;
        std::string expected;
    };
    std::vector<Captured> captured = {
        {{"api_h2", "s_client", {"api.example.test", "h2,http/1.1"}}, "api"},
        {{"api", "s_client", {"api.example.test", ""}}, "api"},
        {{"api_upper", "s_client", {"API.Example.Test", ""}}, "api"},
        {{"api_dot", "s_client", {"api.example.test.", ""}}, "api"},
        {{"apps_h2", "s_client", {"a.apps.example.test", "h2"}}, "apps"},
        {{"apps_h10_h2", "s_client", {"a.apps.example.test", "http/1.0,h2"}}, "apps"},
        {{"apps_h10", "s_client", {"a.apps.example.test", "http/1.0"}}, "fallback"},
        {{"apps_noalpn", "s_client", {"a.apps.example.test", ""}}, "fallback"},
        {{"apps_two_labels", "s_client", {"a.b.apps.example.test", "h2"}}, "fallback"},
        {{"apps_bare", "s_client", {"apps.example.test", "h2"}}, "fallback"},
        {{"acme_nosni", "s_client", {std::nullopt, "acme-tls/1"}}, "apps"},
        {{"acme_named", "s_client", {"a.apps.example.test", "acme-tls/1"}}, "apps"},
        {{"nosni", "s_client", {std::nullopt, ""}}, "fallback"},
        {{"other", "s_client", {"other.example.test", "h2"}}, "fallback"},
        {{"py_api", "python", {"api.example.test", "h2,http/1.1"}}, "api"},
        {{"py_apps", "python", {"b.apps.example.test", "http/1.1"}}, "apps"},
        {{"py_big_apps", "python", {"q.apps.example.test", "http/1.1"}, 100}, "apps"},
        {{"curl_apps", "curl", {"c.apps.example.test", ""}}, "apps"},
        {{"curl_api", "curl", {"api.example.test", ""}}, "api"},
    };
    std::vector<CrossHello> out;
    std::map<std::string, std::string> by_key;
    for (const Captured& c : captured) {
        std::optional<std::string> h = HelloBank::get(tools, c.spec, error);
        if (!h) return {};
        by_key[c.spec.key] = *h;
        out.push_back({c.spec.key, {*h}, c.expected});
    }
    const std::string& api = by_key["api_h2"];
    for (size_t k : {size_t{1}, size_t{5}, size_t{6}, size_t{60}, api.size() / 2, api.size() - 1})
        out.push_back(
            {"api_h2 split at " + std::to_string(k), {api.substr(0, k), api.substr(k)}, "api"});
    const std::string m = handshakeMessage(api);
    HelloFields f = parseHello(m);
    out.push_back({"api_h2 in 1+rest records", {frame(m, {1})}, "api"});
    out.push_back({"api_h2 in 4+rest records", {frame(m, {4})}, "api"});
    out.push_back({"api_h2 cut in the name", {frame(m, {f.sni_at + 2})}, "api"});
    out.push_back({"api_h2 in 64-byte records", {frameEvery(m, 64)}, "api"});
    out.push_back(
        {"api_h2 in 64-byte records, a segment each", recordsOf(frameEvery(m, 64)), "api"});
    out.push_back({"apps_h2 in 100-byte records",
                   {frameEvery(handshakeMessage(by_key["apps_h2"]), 100)},
                   "apps"});
    out.push_back({"plain http", {"GET / HTTP/1.0\r\n\r\n"}, "fallback"});
    out.push_back({"garbage after a record header",
                   {std::string("\x16\x03\x01\x00\x20", 5) + std::string(32, '\xee')},
                   "fallback"});
    return out;
}

TEST(SniHaproxyCrossCheckTest, SameHellosSameNamedBackends) {
    Tools tools;
    SKIP_WITHOUT_TOOLS(tools, true, true);
    std::optional<std::string> binary = findExecutable("haproxy");
    if (!binary) GTEST_SKIP() << "haproxy is not installed (Debian package haproxy)";
    std::string error;
    std::vector<CrossHello> hellos = crossHellos(tools, error);
    ASSERT_FALSE(hellos.empty()) << error;

    // HAProxy once: its routing does not depend on zcrelay's data path.
    std::vector<std::string> by_haproxy;
    {
        CaptureSet caps;
        ASSERT_TRUE(caps.ok(error)) << error;
        HaproxyRouter haproxy(*binary);
        ASSERT_TRUE(haproxy.start(caps.addrs()));
        for (const CrossHello& h : hellos) {
            Landing l = caps.through(haproxy.port(), h.parts);
            EXPECT_EQ(l.note, "") << "haproxy: " << h.name;
            EXPECT_FALSE(l.backend.empty()) << "haproxy: " << h.name << ": " << l.note;
            by_haproxy.push_back(l.backend);
        }
    }

    for (const std::string& mode : kHandOffModes) {
        SCOPED_TRACE(mode);
        CaptureSet caps;
        ASSERT_TRUE(caps.ok(error)) << error;
        RelayProcess relay;
        ASSERT_TRUE(relay.start(routedConfig(
            caps.addrs(), {routedListener("t", mode, kRoutes, "    inspect_max_size: 64KiB\n")})))
            << relay.diagnostics();
        size_t haproxy_named = 0, zcrelay_named = 0, agree = 0;
        std::string more;
        for (size_t i = 0; i < hellos.size(); ++i) {
            const CrossHello& h = hellos[i];
            std::string sent;
            for (const auto& p : h.parts) sent += p;
            sent += kSecondFlight;
            Landing l = caps.through(relay.port(), h.parts, kSecondFlight);
            EXPECT_EQ(l.note, "") << "zcrelay: " << h.name;
            EXPECT_EQ(l.backend, h.expected) << "zcrelay: " << h.name << ": " << l.note;
            if (l.bytes) {
                EXPECT_EQ(*l.bytes, sent) << h.name << ": " << firstDifference(*l.bytes, sent);
            }
            bool h_named = by_haproxy[i] == "api" || by_haproxy[i] == "apps";
            bool z_named = l.backend == "api" || l.backend == "apps";
            haproxy_named += h_named;
            zcrelay_named += z_named;
            agree += by_haproxy[i] == l.backend;
            if (h_named) {
                EXPECT_EQ(l.backend, by_haproxy[i])
                    << h.name << ": HAProxy routed it to " << by_haproxy[i] << ", zcrelay did not";
            } else if (z_named) {
                more += "\n    " + h.name + " -> " + l.backend;
            }
        }
        std::printf(
            "[ INFO     ] %s: %zu hellos; HAProxy routed %zu to a named backend, zcrelay "
            "%zu; same backend for %zu; zcrelay routed where HAProxy did not:%s\n",
            mode.c_str(), hellos.size(), haproxy_named, zcrelay_named, agree,
            more.empty() ? " none" : more.c_str());
        EXPECT_GE(haproxy_named, 10u) << "premise: HAProxy routes the plain cases by name";
    }
}
ZCRELAY_LABEL(SniHaproxyCrossCheckTest, SameHellosSameNamedBackends, "", kSanitizeSkip,
              "its time is HAProxy's; the hellos are those the other cases send");

}  // namespace
}  // namespace zcrelay::test::sni_routing_test
