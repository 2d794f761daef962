// Routes: the config that declares them (errors name the key), the default route a listener's
// cluster adds, and the choice a ClientHello's server name and ALPN make.
#include "routes.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "config.hpp"
#include "runtime.hpp"
#include "unit/config_values.hpp"

namespace zcrelay {
namespace {

using unit::errorOfYaml;

const std::string kClusters =
    "clusters:\n"
    "  - {name: api, backends: [{address: 127.0.0.1:1}]}\n"
    "  - {name: apps, backends: [{address: 127.0.0.1:2}]}\n"
    "  - {name: fallback, backends: [{address: 127.0.0.1:3}]}\n";

std::shared_ptr<const Runtime> runtimeOf(const std::string& listener_yaml,
                                         const Runtime* previous = nullptr) {
    return Runtime::build(loadConfigString(kClusters + "listeners:\n" + listener_yaml, "t.yaml"),
                          previous, 1);
}

// ALPN's wire form: each protocol behind its length byte.
std::string alpnList(const std::vector<std::string>& protocols) {
    std::string out;
    for (const std::string& p : protocols) out += static_cast<char>(p.size()) + p;
    return out;
}

struct Hello {
    std::string sni;
    std::string alpn;
    tls_hello::ClientHello view() const { return {sni, alpn, false, 0x0303}; }
};

std::string routeName(const ListenerRt& l, const RouteChoice& c) {
    return c.route == ListenerRt::kNoRoute ? "(none)" : l.routes[c.route].config.name;
}

const std::string kRoutedListener =
    "  - name: tls\n"
    "    listen: 127.0.0.1:0\n"
    "    routes:\n"
    "      - {sni: [API.Example.com.], cluster: api}\n"
    "      - {name: apps-h2, sni: [\"*.apps.example.com\"], alpn: [h2, http/1.1], cluster: apps}\n"
    "      - {name: by-alpn, alpn: [imap], cluster: apps}\n"
    "    cluster: fallback\n";

TEST(RouteConfig, NamesAreNormalisedAndTheListenerClusterIsTheDefault) {
    auto rt = runtimeOf(kRoutedListener);
    const ListenerRt& l = rt->listeners.at(0);
    ASSERT_EQ(l.routes.size(), 4u);
    EXPECT_EQ(l.routes[0].config.name, "api") << "a route is named after its cluster";
    EXPECT_EQ(l.routes[0].config.sni, std::vector<std::string>{"api.example.com"})
        << "lowercase, without the trailing dot";
    EXPECT_EQ(l.routes[1].config.name, "apps-h2");
    EXPECT_EQ(l.routes[3].config.name, "fallback");
    EXPECT_FALSE(l.routes[3].config.conditional());
    EXPECT_EQ(l.default_route, 3u);
    EXPECT_EQ(rt->clusters[l.routes[3].cluster].config.name, "fallback");
    EXPECT_EQ(rt->clusters[l.routes[1].cluster].config.name, "apps");
}

TEST(RouteConfig, RendersBackToAnEqualConfig) {
    const Config c = loadConfigString(kClusters + "listeners:\n" + kRoutedListener, "t.yaml");
    const Config back = loadConfigString(renderConfig(c), "<rendered>");
    EXPECT_EQ(back.listeners, c.listeners) << renderConfig(c);
    // Routes alone: no `cluster`, no `upstream` rendered.
    const Config only = loadConfigString(
        kClusters + "listeners: [{listen: 127.0.0.1:0, routes: [{sni: a.b, cluster: api}]}]\n",
        "t.yaml");
    EXPECT_EQ(loadConfigString(renderConfig(only), "<rendered>").listeners, only.listeners)
        << renderConfig(only);
}

TEST(RouteConfig, ErrorsNameTheKey) {
    const std::string l = kClusters + "listeners: [{listen: 127.0.0.1:1, ";
    EXPECT_EQ(errorOfYaml(l + "routes: [{sni: a.com, cluster: nope}]}]\n"),
              "t.yaml:5:66: listeners[0].routes[0].cluster: no cluster named \"nope\"");
    EXPECT_EQ(errorOfYaml(l + "routes: [{sni: a.com}]}]\n"),
              "t.yaml:5:44: listeners[0].routes[0].cluster: missing required key");
    EXPECT_EQ(errorOfYaml(l + "routes: [{sni: \"a..com\", cluster: api}]}]\n"),
              "t.yaml:5:50: listeners[0].routes[0].sni[0]: \"a..com\" is not a server name; "
              "expected DNS labels such as api.example.com, or *.example.com for any one label "
              "in front");
    EXPECT_EQ(errorOfYaml(l + "routes: [{sni: \"a.*.com\", cluster: api}]}]\n"),
              "t.yaml:5:50: listeners[0].routes[0].sni[0]: \"a.*.com\" is not a server name; "
              "expected DNS labels such as api.example.com, or *.example.com for any one label "
              "in front");
    EXPECT_EQ(errorOfYaml(l + "routes: [{sni: [a.com, A.com], cluster: api}]}]\n"),
              "t.yaml:5:58: listeners[0].routes[0].sni[1]: \"A.com\" is listed twice");
    EXPECT_EQ(errorOfYaml(l + "routes: [{alpn: \"\", cluster: api}]}]\n"),
              "t.yaml:5:51: listeners[0].routes[0].alpn[0]: \"\" is not an ALPN protocol name "
              "(1 to 255 bytes)");
    EXPECT_EQ(errorOfYaml(l + "routes: [{sni: a.com, cluster: api}, {sni: b.com, cluster: "
                              "api}]}]\n"),
              "t.yaml:5:94: listeners[0].routes[1].name: route name \"api\" is already "
              "listeners[0].routes[0]'s; routes to one cluster need a `name` each");
    EXPECT_EQ(errorOfYaml(l + "routes: [{cluster: api}, {sni: b.com, cluster: apps}]}]\n"),
              "t.yaml:5:60: listeners[0].routes[1]: unreachable: listeners[0].routes[0] has no "
              "condition and takes every client first");
    EXPECT_EQ(errorOfYaml(l + "cluster: api, routes: [{sni: b.com, cluster: api}]}]\n"),
              "t.yaml:5:13: listeners[0].routes[0]: route name \"api\" is also the name of the "
              "default route (the listener's cluster); give this route a `name`");
    EXPECT_EQ(errorOfYaml(l + "routes: []}]\n"),
              "t.yaml:5:43: listeners[0].routes: empty; at least one route is needed");
    EXPECT_EQ(errorOfYaml(l + "routes: [{sni: a.com, cluster: api, port: 1}]}]\n"),
              "t.yaml:5:71: listeners[0].routes[0].port: unknown key; expected one of: name, "
              "cluster, sni, alpn");
    EXPECT_EQ(errorOfYaml(l + "inspect_max_size: 512}]\n"),
              "t.yaml:5:53: listeners[0].inspect_max_size: \"512\" is out of range "
              "(1KiB..64KiB)");
}

TEST(ServerName, ExactWildcardCaseAndTrailingDot) {
    EXPECT_TRUE(serverNameMatches("api.example.com", "api.example.com"));
    EXPECT_TRUE(serverNameMatches("api.example.com", "API.Example.COM"));
    EXPECT_TRUE(serverNameMatches("api.example.com", "api.example.com."));
    EXPECT_FALSE(serverNameMatches("api.example.com", "api.example.co"));
    EXPECT_FALSE(serverNameMatches("api.example.com", "xapi.example.com"));
    EXPECT_TRUE(serverNameMatches("*.example.com", "a.example.com"));
    EXPECT_TRUE(serverNameMatches("*.example.com", "A.EXAMPLE.com."));
    EXPECT_FALSE(serverNameMatches("*.example.com", "example.com")) << "one label, not none";
    EXPECT_FALSE(serverNameMatches("*.example.com", ".example.com")) << "an empty label";
    EXPECT_FALSE(serverNameMatches("*.example.com", "a.b.example.com")) << "one label, not two";
    EXPECT_FALSE(serverNameMatches("*.example.com", "aexample.com"));
}

TEST(ChooseRoute, FirstMatchWinsAndEverythingElseIsTheDefaultCountedByReason) {
    auto rt = runtimeOf(kRoutedListener);
    const ListenerRt& l = rt->listeners.at(0);
    struct Case {
        Hello hello;
        std::string route;
        bool failed;
        InspectFailure why;
    };
    const std::vector<Case> cases = {
        {{"api.example.com", ""}, "api", false, {}},
        {{"Api.Example.Com.", alpnList({"h2"})}, "api", false, {}},
        {{"x.apps.example.com", alpnList({"http/1.1"})}, "apps-h2", false, {}},
        {{"x.apps.example.com", alpnList({"spdy/3", "h2"})}, "apps-h2", false, {}},
        // The name matches but the protocol does not: on to the next routes.
        {{"x.apps.example.com", alpnList({"http/1.0"})}, "fallback", true, InspectFailure::NoRoute},
        {{"x.apps.example.com", ""}, "fallback", true, InspectFailure::NoRoute},
        {{"", alpnList({"imap"})}, "by-alpn", false, {}},
        {{"", alpnList({"h2"})}, "fallback", true, InspectFailure::NoSni},
        {{"other.example.com", ""}, "fallback", true, InspectFailure::NoRoute},
    };
    for (const Case& c : cases) {
        tls_hello::ClientHello h = c.hello.view();
        RouteChoice choice = chooseRoute(l, &h);
        EXPECT_EQ(routeName(l, choice), c.route) << c.hello.sni;
        EXPECT_EQ(choice.failed, c.failed) << c.hello.sni;
        if (c.failed) {
            EXPECT_EQ(choice.why, c.why) << c.hello.sni;
        }
    }
    RouteChoice none = chooseRoute(l, nullptr, InspectFailure::NotTls);
    EXPECT_EQ(routeName(l, none), "fallback");
    EXPECT_TRUE(none.failed);
    EXPECT_EQ(none.why, InspectFailure::NotTls);
}

TEST(ChooseRoute, WithoutADefaultNothingTakesWhatMatchesNoRoute) {
    auto rt = runtimeOf(
        "  - {listen: 127.0.0.1:0, routes: [{sni: [api.example.com], cluster: api}]}\n");
    const ListenerRt& l = rt->listeners.at(0);
    EXPECT_EQ(l.default_route, ListenerRt::kNoRoute);
    Hello other{"other.example.com", ""};
    tls_hello::ClientHello h = other.view();
    EXPECT_EQ(chooseRoute(l, &h).route, ListenerRt::kNoRoute);
    EXPECT_EQ(chooseRoute(l, nullptr, InspectFailure::Timeout).route, ListenerRt::kNoRoute);
}

TEST(RouteState, AReloadKeepsTheCountersOfRoutesThatKeepTheirName) {
    auto first = runtimeOf(kRoutedListener);
    first->listeners[0].routes[1].state->selections[0].add(7);
    // apps-h2 moves to second-last and points elsewhere; api is gone.
    auto second = runtimeOf(
        "  - name: tls\n"
        "    listen: 127.0.0.1:0\n"
        "    routes:\n"
        "      - {sni: [new.example.com], cluster: api, name: new}\n"
        "      - {name: apps-h2, sni: [\"*.apps.example.com\"], cluster: fallback}\n"
        "      - {cluster: apps}\n",
        first.get());
    const ListenerRt& l = second->listeners[0];
    EXPECT_EQ(l.routes[1].state->selections[0].get(), 7u) << "same name: same counters";
    EXPECT_EQ(l.routes[0].state->selections[0].get(), 0u);
    EXPECT_EQ(l.routes[2].config.name, "apps");
    EXPECT_EQ(l.default_route, 2u);
}

}  // namespace
}  // namespace zcrelay

namespace zcrelay {
namespace {

// config/sni_routing.yaml says what its comments say.
TEST(ConfigExamples, SniRouting) {
    const Config c =
        loadConfigFile(std::string(ZCRELAY_SOURCE_DIR) + "/config/sni_routing.yaml");
    auto rt = Runtime::build(c, nullptr, 1);
    const ListenerRt& l = rt->listeners.at(0);
    ASSERT_EQ(l.routes.size(), 3u);
    EXPECT_EQ(l.routes[0].config.name, "api");
    EXPECT_EQ(l.routes[0].config.sni,
              (std::vector<std::string>{"api.example.com", "api.example.net"}));
    EXPECT_EQ(l.routes[1].config.name, "apps-http");
    EXPECT_EQ(l.routes[1].config.alpn, (std::vector<std::string>{"h2", "http/1.1"}));
    EXPECT_EQ(l.routes[2].config.name, "legacy") << "`cluster` besides routes: the default";
    EXPECT_EQ(l.default_route, 2u);
    const ListenerConfig& lc = c.listeners.at(0);
    EXPECT_EQ(lc.inspect_timeout, std::chrono::seconds(5));
    EXPECT_EQ(lc.inspect_max_size, 16u * 1024);
    EXPECT_EQ(lc.server_fin_timeout, std::chrono::seconds(30));
    EXPECT_EQ(lc.client_fin_timeout, std::chrono::seconds(30));
    EXPECT_EQ(lc.max_connection_duration, std::chrono::hours(1));
    EXPECT_EQ(lc.max_connection_duration_jitter, std::chrono::minutes(5));
}

}  // namespace
}  // namespace zcrelay
