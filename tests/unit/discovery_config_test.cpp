// The config keys of DNS discovery (clusters[].discovery), `resolvers` and `admin`: defaults,
// ranges, the cross-key rules, and that renderConfig() writes them back loadably.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "config.hpp"
#include "unit/config_values.hpp"

namespace zcrelay {
namespace {

using namespace std::chrono_literals;

using unit::addr;
using unit::errorOf;
using unit::errorOfYaml;
using unit::expectSameConfig;

constexpr const char* kListener =
    "listeners:\n"
    "  - listen: 127.0.0.1:1\n"
    "    cluster: app\n";

// A cluster `app` whose discovery map is `lines` (each "key: value"), one per line from line 4,
// each at column 7, so a value starts at column 7 + strlen(key) + 2:
//   1 clusters:
//   2   - name: app
//   3     discovery:
//   4       <lines[0]>
std::string discoveryYaml(const std::vector<std::string>& lines) {
    std::string yaml = "clusters:\n  - name: app\n    discovery:\n";
    for (const std::string& l : lines) yaml += "      " + l + "\n";
    return yaml + kListener;
}

Config loadDiscovery(const std::vector<std::string>& lines) {
    return loadConfigString(discoveryYaml(lines), "t.yaml");
}

std::string discoveryError(const std::vector<std::string>& lines) {
    return errorOfYaml(discoveryYaml(lines));
}

// ---- discovery: defaults and the two ways of naming backends ----

TEST(DiscoveryConfig, DnsWithPortTakesEveryDefault) {
    const Config c = loadDiscovery({"dns: web.internal", "port: 8080"});
    ASSERT_EQ(c.clusters.size(), 1u);
    const ClusterConfig& cluster = c.clusters[0];
    EXPECT_TRUE(cluster.backends.empty());
    const DiscoveryConfig& d = cluster.discovery;
    EXPECT_TRUE(d.enabled());
    EXPECT_EQ(d.name(), "web.internal");
    EXPECT_EQ(d.dns, "web.internal");
    EXPECT_EQ(d.srv, "");
    EXPECT_EQ(d.port, 8080u);
    EXPECT_EQ(d.family, AddressFamilies::Any);
    EXPECT_EQ(d.weight, 1u);
    EXPECT_EQ(d.refresh_min, 1s);
    EXPECT_EQ(d.refresh_max, 30s);
    EXPECT_EQ(d.hold, 30s);
    EXPECT_EQ(d.after_hold, AfterHold::Empty);
    EXPECT_EQ(d.startup, StartupPolicy::Fail);
    EXPECT_EQ(d.max_backends, 64u);

    // The struct's own defaults are the loaded ones (what a cluster without discovery holds).
    DiscoveryConfig plain;
    plain.dns = "web.internal";
    plain.port = 8080;
    EXPECT_TRUE(d == plain);
}

TEST(DiscoveryConfig, SrvWithoutPortAndEveryKeySet) {
    const Config c = loadDiscovery({"srv: _http._tcp.web.default.svc.cluster.local.",
                                    "family: ipv6", "refresh_min: 250ms", "refresh_max: 2m",
                                    "hold: 0s", "after_hold: keep", "startup: empty",
                                    "max_backends: 1024"});
    const DiscoveryConfig& d = c.clusters.at(0).discovery;
    EXPECT_EQ(d.srv, "_http._tcp.web.default.svc.cluster.local.");
    EXPECT_EQ(d.name(), d.srv);
    EXPECT_EQ(d.dns, "");
    EXPECT_EQ(d.port, 0u);
    EXPECT_EQ(d.family, AddressFamilies::Ipv6);
    EXPECT_EQ(d.weight, 1u);
    EXPECT_EQ(d.refresh_min, 250ms);
    EXPECT_EQ(d.refresh_max, 2min);
    EXPECT_EQ(d.hold, 0s);
    EXPECT_EQ(d.after_hold, AfterHold::Keep);
    EXPECT_EQ(d.startup, StartupPolicy::Empty);
    EXPECT_EQ(d.max_backends, 1024u);
}

TEST(DiscoveryConfig, FamilyNames) {
    EXPECT_EQ(familiesName(AddressFamilies::Any), "any");
    EXPECT_EQ(familiesName(AddressFamilies::Ipv4), "ipv4");
    EXPECT_EQ(familiesName(AddressFamilies::Ipv6), "ipv6");
    EXPECT_EQ(loadDiscovery({"dns: a.b", "port: 1", "family: ipv4"}).clusters[0].discovery.family,
              AddressFamilies::Ipv4);
    EXPECT_EQ(loadDiscovery({"dns: a.b", "port: 1", "family: any"}).clusters[0].discovery.family,
              AddressFamilies::Any);
}

TEST(DiscoveryConfig, EqualRefreshBoundsAreFine) {
    const DiscoveryConfig d =
        loadDiscovery({"dns: a.b", "port: 1", "refresh_min: 5s", "refresh_max: 5s"})
            .clusters[0]
            .discovery;
    EXPECT_EQ(d.refresh_min, 5s);
    EXPECT_EQ(d.refresh_max, 5s);
}

// ---- discovery: every key's range, both ends accepted, one past each refused ----

struct RangeCase {
    const char* key;
    const char* lowest;    // accepted
    const char* highest;   // accepted
    const char* below;     // refused (nullptr: nothing below the lowest)
    const char* above;     // refused
    const char* range;     // as the message shows it
};

class DiscoveryRange : public testing::TestWithParam<RangeCase> {};

TEST_P(DiscoveryRange, BothEndsLoadAndOnePastIsRefusedWithTheRange) {
    const RangeCase& r = GetParam();
    const std::string key = r.key;
    // refresh_min above the default refresh_max would be refused for another reason.
    const std::vector<std::string> base = {"dns: a.b", "port: 1", "refresh_max: 24h"};
    const auto with = [&](const char* value) {
        std::vector<std::string> lines = base;
        if (key == "port") lines.erase(lines.begin() + 1);
        if (key == "refresh_max") lines.pop_back();
        lines.push_back(key + ": " + value);
        return lines;
    };
    EXPECT_EQ(discoveryError(with(r.lowest)), "(no error)");
    EXPECT_EQ(discoveryError(with(r.highest)), "(no error)");
    // The line of the key is the last one of the discovery map.
    const auto at = [&](const char* value) {
        const std::vector<std::string> lines = with(value);
        return "t.yaml:" + std::to_string(3 + lines.size()) + ":" +
               std::to_string(7 + key.size() + 2) + ": clusters[0].discovery." + key + ": \"" +
               value + "\" is out of range (" + r.range + ")";
    };
    if (r.below != nullptr) {
        EXPECT_EQ(discoveryError(with(r.below)), at(r.below));
    }
    EXPECT_EQ(discoveryError(with(r.above)), at(r.above));
}

INSTANTIATE_TEST_SUITE_P(
    Keys, DiscoveryRange,
    testing::Values(
        // port 0 with dns is "missing", tested below; 1 is the lowest a dns cluster takes.
        RangeCase{"port", "1", "65535", nullptr, "65536", "0..65535"},
        RangeCase{"weight", "1", "256", "0", "257", "1..256"},
        RangeCase{"refresh_min", "100ms", "1h", "99ms", "61m", "100ms..1h"},
        RangeCase{"refresh_max", "1s", "24h", "99ms", "1441m", "100ms..24h"},
        RangeCase{"hold", "0s", "168h", nullptr, "169h", "0s..168h"},
        RangeCase{"max_backends", "1", "1024", "0", "1025", "1..1024"}),
    [](const testing::TestParamInfo<RangeCase>& info) {
        std::string name = info.param.key;
        name.erase(std::remove(name.begin(), name.end(), '_'), name.end());
        return name;
    });

TEST(DiscoveryConfig, ChoicesListWhatTheyTake) {
    EXPECT_EQ(discoveryError({"dns: a.b", "port: 1", "family: ipv5"}),
              "t.yaml:6:15: clusters[0].discovery.family: \"ipv5\" is not a family; "
              "expected one of: any, ipv4, ipv6");
    EXPECT_EQ(discoveryError({"dns: a.b", "port: 1", "after_hold: drop"}),
              "t.yaml:6:19: clusters[0].discovery.after_hold: \"drop\" is not a choice of "
              "after_hold; expected one of: empty, keep");
    EXPECT_EQ(discoveryError({"dns: a.b", "port: 1", "startup: wait"}),
              "t.yaml:6:16: clusters[0].discovery.startup: \"wait\" is not a choice of startup; "
              "expected one of: fail, empty");
    EXPECT_EQ(discoveryError({"dns: a.b", "port: 1", "ttl: 5s"}),
              "t.yaml:6:7: clusters[0].discovery.ttl: unknown key; expected one of: dns, srv, "
              "port, family, weight, refresh_min, refresh_max, hold, after_hold, startup, "
              "max_backends");
}

// ---- discovery: the rules between keys ----

TEST(DiscoveryConfig, DnsNeedsAPort) {
    EXPECT_EQ(discoveryError({"dns: web.internal"}),
              "t.yaml:4:7: clusters[0].discovery.port: missing: dns names addresses, `port` says "
              "where on them to connect");
    EXPECT_EQ(discoveryError({"dns: web.internal", "port: 0"}),
              "t.yaml:5:13: clusters[0].discovery.port: missing: dns names addresses, `port` "
              "says where on them to connect");
}

TEST(DiscoveryConfig, SrvTakesNeitherPortNorWeight) {
    EXPECT_EQ(discoveryError({"srv: _http._tcp.web", "port: 80"}),
              "t.yaml:5:13: clusters[0].discovery.port: is set with srv, whose records carry "
              "their own ports; remove it");
    EXPECT_EQ(discoveryError({"srv: _http._tcp.web", "weight: 2"}),
              "t.yaml:5:15: clusters[0].discovery.weight: is set with srv, whose records carry "
              "their own weights; remove it");
    // Even a weight equal to the default: the record's weight wins, so setting one is a mistake.
    EXPECT_EQ(discoveryError({"srv: _http._tcp.web", "weight: 1"}),
              "t.yaml:5:15: clusters[0].discovery.weight: is set with srv, whose records carry "
              "their own weights; remove it");
}

TEST(DiscoveryConfig, ExactlyOneOfDnsAndSrv) {
    EXPECT_EQ(discoveryError({"dns: web.internal", "srv: _http._tcp.web", "port: 80"}),
              "t.yaml:4:7: clusters[0].discovery: has both `dns` and `srv`; a cluster follows "
              "one name");
    EXPECT_EQ(discoveryError({"port: 80"}),
              "t.yaml:4:7: clusters[0].discovery: needs `dns` (a name with `port`) or `srv` (an "
              "SRV name)");
    EXPECT_EQ(errorOfYaml(std::string("clusters:\n  - name: app\n    discovery: {}\n") + kListener),
              "t.yaml:3:16: clusters[0].discovery: needs `dns` (a name with `port`) or `srv` (an "
              "SRV name)");
    // An empty string names nothing.
    EXPECT_EQ(discoveryError({"dns: \"\"", "port: 80"}),
              "t.yaml:4:7: clusters[0].discovery: needs `dns` (a name with `port`) or `srv` (an "
              "SRV name)");
    EXPECT_EQ(errorOfYaml(std::string("clusters:\n  - name: app\n    discovery: web\n") + kListener),
              "t.yaml:3:16: clusters[0].discovery: expected a map, got a scalar");
}

std::string badNameMessage(int line, int column, const char* key, const std::string& name) {
    return "t.yaml:" + std::to_string(line) + ":" + std::to_string(column) +
           ": clusters[0].discovery." + key + ": \"" + name +
           "\" is not a DNS name (labels of [A-Za-z0-9_-], 1 to 63 bytes; 253 in all)";
}

TEST(DiscoveryConfig, BadDnsNamesAreRefusedNamingTheKey) {
    const std::string label63(63, 'a');
    const std::string label64(64, 'a');
    for (const std::string& bad :
         {std::string("a..b"), std::string(".a.b"), std::string("."), std::string("a.b.."),
          label64 + ".example", std::string("a b.example"), std::string("web*.example"),
          std::string("caf\xc3\xa9.example"), std::string("a/b")}) {
        SCOPED_TRACE(bad);
        EXPECT_EQ(discoveryError({"dns: \"" + bad + "\"", "port: 80"}),
                  badNameMessage(4, 12, "dns", bad));
    }
    const std::string srv_bad = "_http._tcp." + label64;
    EXPECT_EQ(discoveryError({"srv: \"" + srv_bad + "\""}), badNameMessage(4, 12, "srv", srv_bad));
    // A 63-byte label is fine, a trailing dot (absolute) too.
    EXPECT_EQ(discoveryError({"dns: " + label63 + ".example.", "port: 80"}), "(no error)");
}

TEST(DiscoveryConfig, NamesLongerThan253BytesAreRefused) {
    const std::string l63(63, 'a');
    const std::string name253 = l63 + "." + l63 + "." + l63 + "." + std::string(61, 'b');
    ASSERT_EQ(name253.size(), 253u);
    EXPECT_EQ(discoveryError({"dns: " + name253, "port: 80"}), "(no error)");
    const std::string name254 = l63 + "." + l63 + "." + l63 + "." + std::string(62, 'b');
    // 254 bytes without the trailing dot: the name check refuses it (the key takes 254 bytes
    // for a 253-byte name with its dot).
    EXPECT_NE(discoveryError({"dns: " + name254, "port: 80"})
                  .find("clusters[0].discovery.dns: \"aaaa"),
              std::string::npos);
    EXPECT_NE(discoveryError({"dns: " + name254, "port: 80"}).find("253 in all"),
              std::string::npos);
    EXPECT_EQ(discoveryError({"srv: " + name254 + "x"}),
              "t.yaml:4:12: clusters[0].discovery.srv: longer than 254 bytes");
}

// validDnsName() takes a 253-byte name with a trailing dot (254 bytes: "absolute, no search
// domain"), as its comment says. The key's own 253-byte bound must not refuse it first.
TEST(DiscoveryConfig, A253ByteAbsoluteNameWithItsTrailingDotLoads) {
    const std::string l63(63, 'a');
    const std::string absolute = l63 + "." + l63 + "." + l63 + "." + std::string(61, 'b') + ".";
    ASSERT_EQ(absolute.size(), 254u);
    EXPECT_EQ(discoveryError({"dns: " + absolute, "port: 80"}), "(no error)");
}

TEST(DiscoveryConfig, RefreshMinAboveRefreshMaxIsRefused) {
    EXPECT_EQ(discoveryError({"dns: a.b", "port: 1", "refresh_min: 5s", "refresh_max: 2s"}),
              "t.yaml:7:20: clusters[0].discovery.refresh_max: 2s is below refresh_min 5s");
    // Against the default refresh_max (30s), pointing at the map that leaves it out.
    EXPECT_EQ(discoveryError({"dns: a.b", "port: 1", "refresh_min: 1m"}),
              "t.yaml:4:7: clusters[0].discovery.refresh_max: 30s is below refresh_min 1m");
}

TEST(DiscoveryConfig, BackendsOrDiscoveryNotBoth) {
    EXPECT_EQ(errorOfYaml("clusters:\n"
                          "  - name: app\n"
                          "    backends: [{address: 127.0.0.1:2}]\n"
                          "    discovery: {dns: a.b, port: 1}\n" +
                          std::string(kListener)),
              "t.yaml:3:15: clusters[0].backends: a cluster takes its backends from `backends` "
              "or from `discovery`, not both");
    EXPECT_EQ(errorOfYaml("clusters:\n  - name: app\n" + std::string(kListener)),
              "t.yaml:2:5: clusters[0].backends: missing required key (or `discovery` to take "
              "them from DNS)");
}

TEST(DiscoveryConfig, StaticClustersHaveDiscoveryOff) {
    const Config c = loadConfigString(
        "clusters: [{name: app, backends: [{address: 127.0.0.1:2}]}]\n" + std::string(kListener),
        "t.yaml");
    EXPECT_FALSE(c.clusters.at(0).discovery.enabled());
    EXPECT_TRUE(c.clusters.at(0).discovery == DiscoveryConfig{});
}

// ---- resolvers ----

std::string resolversYaml(const std::string& body) {
    return "resolvers:\n" + body +
           "listeners:\n  - listen: 127.0.0.1:1\n    upstream: 127.0.0.1:2\n";
}

TEST(ResolversConfig, DefaultsAndEveryKeySet) {
    const Config plain = loadConfigString(
        "listeners:\n  - listen: 127.0.0.1:1\n    upstream: 127.0.0.1:2\n", "t.yaml");
    EXPECT_TRUE(plain.resolvers.nameservers.empty());
    EXPECT_EQ(plain.resolvers.resolv_conf, "/etc/resolv.conf");
    EXPECT_EQ(plain.resolvers.timeout, 1s);
    EXPECT_EQ(plain.resolvers.attempts, 3u);
    EXPECT_TRUE(plain.resolvers == ResolversConfig{});

    const Config c = loadConfigString(resolversYaml("  nameservers: [127.0.0.1:53, \"[::1]:5353\", "
                                                    "10.0.0.1:53]\n"
                                                    "  resolv_conf: /run/resolv.conf\n"
                                                    "  timeout: 10ms\n"
                                                    "  attempts: 10\n"),
                                      "t.yaml");
    ASSERT_EQ(c.resolvers.nameservers.size(), 3u);
    EXPECT_EQ(c.resolvers.nameservers[0], addr("127.0.0.1:53"));
    EXPECT_EQ(c.resolvers.nameservers[1], addr("[::1]:5353"));
    EXPECT_EQ(c.resolvers.nameservers[2], addr("10.0.0.1:53"));
    EXPECT_EQ(c.resolvers.resolv_conf, "/run/resolv.conf");
    EXPECT_EQ(c.resolvers.timeout, 10ms);
    EXPECT_EQ(c.resolvers.attempts, 10u);
}

TEST(ResolversConfig, Ranges) {
    EXPECT_EQ(errorOfYaml(resolversYaml("  timeout: 9ms\n")),
              "t.yaml:2:12: resolvers.timeout: \"9ms\" is out of range (10ms..1m)");
    EXPECT_EQ(errorOfYaml(resolversYaml("  timeout: 61s\n")),
              "t.yaml:2:12: resolvers.timeout: \"61s\" is out of range (10ms..1m)");
    EXPECT_EQ(errorOfYaml(resolversYaml("  timeout: 60s\n")), "(no error)");
    EXPECT_EQ(errorOfYaml(resolversYaml("  attempts: 0\n")),
              "t.yaml:2:13: resolvers.attempts: \"0\" is out of range (1..10)");
    EXPECT_EQ(errorOfYaml(resolversYaml("  attempts: 11\n")),
              "t.yaml:2:13: resolvers.attempts: \"11\" is out of range (1..10)");
    EXPECT_EQ(errorOfYaml(resolversYaml("  attempts: 1\n")), "(no error)");
    EXPECT_EQ(errorOfYaml(resolversYaml("  resolv_conf: " + std::string(4097, 'r') + "\n")),
              "t.yaml:2:16: resolvers.resolv_conf: longer than 4096 bytes");
    EXPECT_EQ(errorOfYaml(resolversYaml("  resolv_conf: /" + std::string(4095, 'r') + "\n")),
              "(no error)");
    EXPECT_EQ(errorOfYaml("resolvers: 1.1.1.1\n"
                          "listeners:\n  - listen: 127.0.0.1:1\n    upstream: 127.0.0.1:2\n"),
              "t.yaml:1:12: resolvers: expected a map, got a scalar");
}

TEST(ResolversConfig, NameserversMustBeOneToThreeAddresses) {
    const std::string list_error =
        ": resolvers.nameservers: expected a sequence of 1 to 3 addresses such as 127.0.0.1:53, "
        "got ";
    EXPECT_EQ(errorOfYaml(resolversYaml("  nameservers: 127.0.0.1:53\n")),
              "t.yaml:2:16" + list_error + "a scalar");
    EXPECT_EQ(errorOfYaml(resolversYaml("  nameservers: {a: 127.0.0.1:53}\n")),
              "t.yaml:2:16" + list_error + "a map");
    EXPECT_EQ(errorOfYaml(resolversYaml("  nameservers: []\n")),
              "t.yaml:2:16" + list_error + "a sequence");
    EXPECT_EQ(errorOfYaml(resolversYaml(
                  "  nameservers: [127.0.0.1:53, 127.0.0.2:53, 127.0.0.3:53, 127.0.0.4:53]\n")),
              "t.yaml:2:16" + list_error + "a sequence");
    EXPECT_EQ(errorOfYaml(resolversYaml("  nameservers: [127.0.0.1:53, \"unix:/run/dns.sock\"]\n")),
              "t.yaml:2:31: resolvers.nameservers[1]: a nameserver is reached over UDP/TCP, not "
              "unix");
    EXPECT_EQ(errorOfYaml(resolversYaml("  nameservers: [localhost:53]\n")),
              "t.yaml:2:17: resolvers.nameservers[0]: \"localhost\" is not a numeric IP address; "
              "names are not resolved");
    EXPECT_EQ(errorOfYaml(resolversYaml("  nameservers: [127.0.0.1]\n")),
              "t.yaml:2:17: resolvers.nameservers[0]: missing port in \"127.0.0.1\"; expected "
              "host:port, e.g. 127.0.0.1:10000 or [::1]:10000");
    EXPECT_EQ(errorOfYaml(resolversYaml("  nameservers: [[127.0.0.1:53]]\n")),
              "t.yaml:2:17: resolvers.nameservers[0]: expected an address, got a sequence");
}

// ---- admin ----

std::string adminYaml(const std::string& body, const std::string& more = "") {
    return "admin:\n" + body + more +
           "listeners:\n  - listen: 127.0.0.1:1\n    upstream: 127.0.0.1:2\n";
}

TEST(AdminConfig, OffByDefaultWithItsDefaults) {
    const Config c = loadConfigString(
        "listeners:\n  - listen: 127.0.0.1:1\n    upstream: 127.0.0.1:2\n", "t.yaml");
    EXPECT_FALSE(c.admin.enabled());
    EXPECT_EQ(c.admin.listen.length, 0u);
    EXPECT_EQ(c.admin.token_file, "");
    EXPECT_EQ(c.admin.request_timeout, 5s);
    EXPECT_EQ(c.admin.max_connections, 16u);
    EXPECT_TRUE(c.admin == AdminConfig{});
    EXPECT_FALSE(loadConfigString(adminYaml("  listen: \"\"\n"), "t").admin.enabled());
}

TEST(AdminConfig, Ranges) {
    EXPECT_EQ(errorOfYaml(adminYaml("  request_timeout: 9ms\n")),
              "t.yaml:2:20: admin.request_timeout: \"9ms\" is out of range (10ms..10m)");
    EXPECT_EQ(errorOfYaml(adminYaml("  request_timeout: 601s\n")),
              "t.yaml:2:20: admin.request_timeout: \"601s\" is out of range (10ms..10m)");
    EXPECT_EQ(errorOfYaml(adminYaml("  request_timeout: 10m\n")), "(no error)");
    EXPECT_EQ(errorOfYaml(adminYaml("  request_timeout: 10ms\n")), "(no error)");
    EXPECT_EQ(errorOfYaml(adminYaml("  max_connections: 0\n")),
              "t.yaml:2:20: admin.max_connections: \"0\" is out of range (1..1024)");
    EXPECT_EQ(errorOfYaml(adminYaml("  max_connections: 1025\n")),
              "t.yaml:2:20: admin.max_connections: \"1025\" is out of range (1..1024)");
    EXPECT_EQ(errorOfYaml(adminYaml("  max_connections: 1\n")), "(no error)");
    EXPECT_EQ(errorOfYaml(adminYaml("  max_connections: 1024\n")), "(no error)");
    EXPECT_EQ(errorOfYaml(adminYaml("  listen: 127.0.0.1:9101\n  token_file: /" +
                                    std::string(4096, 't') + "\n")),
              "t.yaml:3:15: admin.token_file: longer than 4096 bytes");
    EXPECT_EQ(errorOfYaml(adminYaml("  listen: localhost:9101\n")),
              "t.yaml:2:11: admin.listen: \"localhost\" is not a numeric IP address; names are "
              "not resolved");
}

TEST(AdminConfig, WithoutATokenOnlyLoopbackOrUnix) {
    EXPECT_EQ(errorOfYaml(adminYaml("  listen: 0.0.0.0:9101\n")),
              "t.yaml:2:11: admin.listen: 0.0.0.0:9101 is reachable from other hosts: set "
              "admin.token_file, or listen on loopback or a unix socket");
    EXPECT_EQ(errorOfYaml(adminYaml("  listen: 10.1.2.3:9101\n")),
              "t.yaml:2:11: admin.listen: 10.1.2.3:9101 is reachable from other hosts: set "
              "admin.token_file, or listen on loopback or a unix socket");
    EXPECT_EQ(errorOfYaml(adminYaml("  listen: \"[::]:9101\"\n")),
              "t.yaml:2:11: admin.listen: [::]:9101 is reachable from other hosts: set "
              "admin.token_file, or listen on loopback or a unix socket");

    for (const char* ok : {"127.0.0.1:9101", "127.1.2.3:9101", "\"[::1]:9101\"",
                           "\"unix:/run/zcrelay/admin.sock\""}) {
        SCOPED_TRACE(ok);
        const Config c = loadConfigString(adminYaml(std::string("  listen: ") + ok + "\n"), "t");
        EXPECT_TRUE(c.admin.enabled());
        EXPECT_EQ(c.admin.token_file, "");
    }
    EXPECT_EQ(loadConfigString(adminYaml("  listen: \"unix:/run/zcrelay/admin.sock\"\n"), "t")
                  .admin.listen,
              addr("unix:/run/zcrelay/admin.sock"));
    EXPECT_EQ(loadConfigString(adminYaml("  listen: \"[::1]:9101\"\n"), "t").admin.listen,
              addr("[::1]:9101"));

    // With a token any address will do.
    const Config open = loadConfigString(
        adminYaml("  listen: 0.0.0.0:9101\n  token_file: /etc/zcrelay/admin.token\n"), "t");
    EXPECT_EQ(open.admin.listen, addr("0.0.0.0:9101"));
    EXPECT_EQ(open.admin.token_file, "/etc/zcrelay/admin.token");
}

TEST(AdminConfig, TokenFileNeedsListen) {
    EXPECT_EQ(errorOfYaml(adminYaml("  token_file: /etc/zcrelay/admin.token\n")),
              "t.yaml:2:15: admin.token_file: is set while admin.listen is off");
    EXPECT_EQ(errorOfYaml(adminYaml("  listen: \"\"\n  token_file: /etc/zcrelay/admin.token\n")),
              "t.yaml:3:15: admin.token_file: is set while admin.listen is off");
}

TEST(AdminConfig, NeedsAnAddressOfItsOwnNotTheMetricsOne) {
    // metrics.listen given explicitly, before or after admin.
    EXPECT_EQ(errorOfYaml("metrics:\n  listen: 127.0.0.1:9200\n" +
                          adminYaml("  listen: 127.0.0.1:9200\n")),
              "t.yaml:4:11: admin.listen: is the same address as metrics.listen; the runtime API "
              "needs its own");
    EXPECT_EQ(errorOfYaml(adminYaml("  listen: 127.0.0.1:9200\n",
                                    "metrics:\n  listen: 127.0.0.1:9200\n")),
              "t.yaml:2:11: admin.listen: is the same address as metrics.listen; the runtime API "
              "needs its own");
    // metrics.listen left at its default, 127.0.0.1:9100.
    EXPECT_EQ(errorOfYaml(adminYaml("  listen: 127.0.0.1:9100\n")),
              "t.yaml:2:11: admin.listen: is the same address as metrics.listen; the runtime API "
              "needs its own");
    // Another port, or metrics off: fine.
    EXPECT_EQ(errorOfYaml(adminYaml("  listen: 127.0.0.1:9101\n")), "(no error)");
    EXPECT_EQ(errorOfYaml("metrics:\n  enabled: false\n" + adminYaml("  listen: 127.0.0.1:9100\n")),
              "(no error)");
    EXPECT_EQ(errorOfYaml("metrics:\n  listen: \"\"\n" + adminYaml("  listen: 127.0.0.1:9100\n")),
              "(no error)");
}

// ---- rendering and the example ----

constexpr const char* kEverything =
    "resolvers:\n"
    "  nameservers: [127.0.0.1:53, \"[::1]:5353\"]\n"
    "  resolv_conf: /run/zcrelay/resolv.conf\n"
    "  timeout: 250ms\n"
    "  attempts: 2\n"
    "admin:\n"
    "  listen: 0.0.0.0:9101\n"
    "  token_file: /etc/zcrelay/admin.token\n"
    "  request_timeout: 2s\n"
    "  max_connections: 4\n"
    "clusters:\n"
    "  - name: web\n"
    "    send_proxy: v2\n"
    "    health_check: {interval: 1s}\n"
    "    discovery:\n"
    "      dns: web.default.svc.cluster.local.\n"
    "      port: 8080\n"
    "      family: ipv4\n"
    "      weight: 3\n"
    "      refresh_min: 500ms\n"
    "      refresh_max: 1m\n"
    "      hold: 0s\n"
    "      after_hold: keep\n"
    "      startup: empty\n"
    "      max_backends: 8\n"
    "  - name: api\n"
    "    balance: source_hash\n"
    "    discovery:\n"
    "      srv: _grpc._tcp.api.internal\n"
    "      family: ipv6\n"
    "  - name: static\n"
    "    backends: [{address: 127.0.0.1:2}]\n"
    "listeners:\n"
    "  - {name: a, listen: 127.0.0.1:1, cluster: web}\n"
    "  - {name: b, listen: 127.0.0.1:3, cluster: api}\n"
    "  - {name: c, listen: 127.0.0.1:4, cluster: static}\n";

TEST(DiscoveryConfig, RendersBackToAnEqualConfig) {
    const Config c = loadConfigString(kEverything, "t.yaml");
    ASSERT_EQ(c.clusters.size(), 3u);
    EXPECT_EQ(c.clusters[0].discovery.dns, "web.default.svc.cluster.local.");
    EXPECT_EQ(c.clusters[1].discovery.srv, "_grpc._tcp.api.internal");
    EXPECT_EQ(c.resolvers.nameservers.size(), 2u);
    EXPECT_TRUE(c.admin.enabled());
    const std::string text = renderConfig(c);
    Config again;
    ASSERT_EQ(errorOf([&] { again = loadConfigString(text, "<rendered>"); }), "(no error)")
        << text;
    expectSameConfig(again, c);

    // Each alone too: dns with defaults, srv with defaults, admin on a unix socket.
    for (const std::string& yaml :
         {discoveryYaml({"dns: a.b", "port: 1"}), discoveryYaml({"srv: _x._tcp.a.b"}),
          adminYaml("  listen: \"unix:/run/a.sock\"\n"),
          adminYaml("  listen: \"[::1]:9101\"\n"),
          resolversYaml("  nameservers: [\"[fe80::1]:53\"]\n")}) {
        SCOPED_TRACE(yaml);
        const Config one = loadConfigString(yaml, "t.yaml");
        const std::string rendered = renderConfig(one);
        Config back;
        ASSERT_EQ(errorOf([&] { back = loadConfigString(rendered, "<rendered>"); }), "(no error)")
            << rendered;
        expectSameConfig(back, one);
    }
}

TEST(DiscoveryConfig, RenderLeavesOutTheKeysTheOtherKindRefuses) {
    const Config c = loadConfigString(kEverything, "t.yaml");
    const std::string text = renderConfig(c);
    // The srv cluster is rendered without dns and without weight (which srv refuses).
    const size_t api = text.find("_grpc._tcp.api.internal");
    ASSERT_NE(api, std::string::npos) << text;
    const size_t api_block = text.rfind("discovery:", api);
    const size_t next = text.find("\n  - ", api);
    const std::string block = text.substr(api_block, next - api_block);
    EXPECT_EQ(block.find("weight:"), std::string::npos) << block;
    EXPECT_EQ(block.find("dns:"), std::string::npos) << block;
    // No backends either: the discovered set is the Runtime's, not the config's.
    EXPECT_EQ(block.find("\n    backends:"), std::string::npos) << block;
    EXPECT_NE(block.find("\n      max_backends: 64"), std::string::npos) << block;
}

TEST(DiscoveryConfig, TheExampleConfigStillLoads) {
    Config c;
    ASSERT_EQ(errorOf([&] { c = loadConfigString(defaultConfigYaml(), "<default>"); }),
              "(no error)");
    EXPECT_TRUE(c.resolvers == ResolversConfig{});
    EXPECT_TRUE(c.admin == AdminConfig{});
    for (const ClusterConfig& cluster : clustersOf(c)) EXPECT_FALSE(cluster.discovery.enabled());
    // It documents the new sections.
    const std::string_view example = defaultConfigYaml();
    EXPECT_NE(example.find("\nresolvers:\n"), std::string_view::npos);
    EXPECT_NE(example.find("\nadmin:\n"), std::string_view::npos);
    EXPECT_NE(example.find("token_file"), std::string_view::npos);
    // And renders back to itself.
    expectSameConfig(loadConfigString(renderConfig(c), "<rendered>"), c);
}

}  // namespace
}  // namespace zcrelay
