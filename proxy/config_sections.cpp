// Each map of the config, parsed against its key table, with what its keys must agree on among
// themselves: clusters with their backends or discovery, listeners with their routes.
#include <algorithm>
#include <cctype>
#include <cstring>
#include <optional>

#include "accounts.hpp"
#include "config_yaml.hpp"

namespace zcrelay::config_detail {

void parseResolvers(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                    ResolversConfig& resolvers) {
    const auto inner = parseNestedMap<ResolversConfig>(source, nested, "resolvers", "resolvers",
                                                       kResolversKeys, resolvers, {"nameservers"});
    const auto list = inner.find("nameservers");
    if (list == inner.end()) return;
    const YAML::Node& node = list->second;
    if (!node.IsSequence() || node.size() == 0 || node.size() > 3) {
        fail(whereOf(source, node, "resolvers.nameservers"),
             "expected a sequence of 1 to 3 addresses such as 127.0.0.1:53, got " + typeName(node));
    }
    for (size_t i = 0; i < node.size(); ++i) {
        const Where at =
            whereOf(source, node[i], "resolvers.nameservers[" + std::to_string(i) + "]");
        if (!node[i].IsScalar()) fail(at, "expected an address, got " + typeName(node[i]));
        const auto address = parseAddress(node[i].Scalar());
        if (!address) fail(at, address.error());
        if (address->family() == AF_UNIX)
            fail(at, "a nameserver is reached over UDP/TCP, not unix");
        resolvers.nameservers.push_back(*address);
    }
}

void parseAdmin(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                AdminConfig& admin) {
    parseNestedMap<AdminConfig>(source, nested, "admin", "admin", kAdminKeys, admin);
    const auto it = nested.find("admin");
    if (it == nested.end()) return;
    if (admin.enabled() && admin.token_file.empty() && !loopbackOrUnix(admin.listen)) {
        fail(whereOfKey(source, it->second, "listen", "admin.listen"),
             admin.listen.toString() +
                 " is reachable from other hosts: set admin.token_file, or listen on loopback "
                 "or a unix socket");
    }
    if (!admin.enabled() && !admin.token_file.empty()) {
        fail(whereOfKey(source, it->second, "token_file", "admin.token_file"),
             "is set while admin.listen is off");
    }
}

void parseMetrics(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                  MetricsConfig& metrics) {
    parseNestedMap<MetricsConfig>(source, nested, "metrics", "metrics", kMetricsKeys, metrics);
    metrics.enabled = metrics.enabled && metrics.listen.length != 0;
    const auto it = nested.find("metrics");
    if (it == nested.end()) return;
    checkTcpAddress(source, it->second, "listen", "metrics", metrics.listen);
    checkTcpAddress(source, it->second, "health_listen", "metrics", metrics.health_listen);
    if (metrics.health_listen.length != 0 && metrics.health_listen == metrics.listen &&
        metrics.listen.port() != 0) {
        fail(whereOfKey(source, it->second, "health_listen", "metrics.health_listen"),
             "is the same address as metrics.listen; leave it unset to serve probes there");
    }
    // Probes are served by the metrics endpoint: with it off, health_listen would be a port the
    // operator expects to answer and nothing listens on.
    if (metrics.health_listen.length != 0 && !metrics.enabled) {
        fail(whereOfKey(source, it->second, "health_listen", "metrics.health_listen"),
             "is set while metrics are off (listen \"\" or enabled: false); probes are served "
             "only with the endpoint on");
    }
}

// `user` and `group` name accounts of this machine. They are resolved here, so that an unknown
// one is refused with its line like any other error and --check-config catches it; the switch
// itself happens in Server::start (privileges.cpp).
void resolveRunAs(std::string_view source, const YAML::Node& root, Config& config) {
    if (config.user.empty()) {
        if (!config.group.empty())
            fail(whereOfKey(source, root, "group", "group"),
                 "needs `user`: the relay switches user and group together");
        return;
    }
    const Where user_at = whereOfKey(source, root, "user", "user");
    const auto user = lookUpUser(config.user);
    if (!user) fail(user_at, user.error());
    config.uid = user->uid;
    if (config.group.empty()) {
        if (!user->gid) {
            fail(user_at,
                 "uid " + config.user + " has no passwd entry to take a group from: set `group`");
        }
        config.gid = *user->gid;
        return;
    }
    const auto gid = lookUpGroup(config.group);
    if (!gid) fail(whereOfKey(source, root, "group", "group"), gid.error());
    config.gid = *gid;
}

void checkTakeoverSocket(std::string_view source, const YAML::Node& root, const Config& config) {
    const std::string& path = config.takeover_socket;
    if (path.empty()) return;
    // sun_path holds 108 bytes with its NUL; the bind renames from path + ".new.<pid>".
    if (path.front() != '/' || path.size() > 80)
        fail(whereOfKey(source, root, "takeover_socket", "takeover_socket"),
             "must be an absolute path of at most 80 bytes, e.g. /run/zcrelay/takeover.sock");
}

namespace {

void parseDiscovery(std::string_view source, const YAML::Node& node, const std::string& path,
                    ClusterConfig& cluster) {
    if (!node.IsMap()) fail(whereOf(source, node, path), "expected a map, got " + typeName(node));
    DiscoveryConfig& d = cluster.discovery;
    parseMap<DiscoveryConfig>(source, node, path + ".", kDiscoveryKeys, d);
    if (d.dns.empty() == d.srv.empty()) {
        fail(whereOf(source, node, path),
             d.dns.empty() ? "needs `dns` (a name with `port`) or `srv` (an SRV name)"
                           : "has both `dns` and `srv`; a cluster follows one name");
    }
    const char* key = d.dns.empty() ? "srv" : "dns";
    if (!validDnsName(d.name())) {
        fail(whereOfKey(source, node, key, path + "." + key),
             quoted(d.name()) +
                 " is not a DNS name (labels of [A-Za-z0-9_-], 1 to 63 bytes; 253 in all)");
    }
    if (!d.dns.empty() && d.port == 0)
        fail(whereOfKey(source, node, "port", path + ".port"),
             "missing: dns names addresses, `port` says where on them to connect");
    if (!d.srv.empty() && d.port != 0)
        fail(whereOfKey(source, node, "port", path + ".port"),
             "is set with srv, whose records carry their own ports; remove it");
    if (d.refresh_min > d.refresh_max)
        fail(whereOfKey(source, node, "refresh_max", path + ".refresh_max"),
             formatDuration(d.refresh_max) + " is below refresh_min " +
                 formatDuration(d.refresh_min));
    if (!d.srv.empty() && node["weight"].IsDefined())
        fail(whereOfKey(source, node, "weight", path + ".weight"),
             "is set with srv, whose records carry their own weights; remove it");
}

// expect_status's text to ranges: "200", "200,204", "200-299", " 200 - 299 , 302 ".
std::optional<std::vector<std::pair<uint16_t, uint16_t>>> parseStatuses(std::string_view text) {
    std::vector<std::pair<uint16_t, uint16_t>> out;
    auto code = [](std::string_view t) -> std::optional<uint16_t> {
        while (!t.empty() && t.front() == ' ') t.remove_prefix(1);
        while (!t.empty() && t.back() == ' ') t.remove_suffix(1);
        if (t.size() != 3 || !std::all_of(t.begin(), t.end(), ::isdigit)) return std::nullopt;
        const unsigned v = static_cast<unsigned>(std::stoul(std::string(t)));
        if (v < 100 || v > 599) return std::nullopt;
        return static_cast<uint16_t>(v);
    };
    for (size_t at = 0; at <= text.size();) {
        const size_t end = std::min(text.find(',', at), text.size());
        const std::string_view item = text.substr(at, end - at);
        const size_t dash = item.find('-');
        const auto lo = code(item.substr(0, dash));
        const auto hi = dash == std::string_view::npos ? lo : code(item.substr(dash + 1));
        if (!lo || !hi || *hi < *lo) return std::nullopt;
        out.emplace_back(*lo, *hi);
        at = end + 1;
    }
    return out;
}

// A request line's token: what RFC 9110 allows in a method, nothing that could split a request.
bool validMethod(std::string_view m) {
    return !m.empty() && std::all_of(m.begin(), m.end(), [](unsigned char c) {
        return std::isalnum(c) || std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
    });
}

bool printableNoSpace(std::string_view t) {
    return std::all_of(t.begin(), t.end(), [](unsigned char c) { return c > 0x20 && c < 0x7f; });
}

void parseHttpCheck(std::string_view source, const std::map<std::string, YAML::Node>& cluster,
                    const std::map<std::string, YAML::Node>& nested, const std::string& path,
                    HealthCheckConfig& hc) {
    const auto it = nested.find("http");
    if (it == nested.end()) return;
    const std::string hpath = path + ".http";
    HttpCheckConfig& http = hc.http;
    http.enabled = true;
    parseNestedMap<HttpCheckConfig>(source, nested, "http", hpath, kHttpCheckKeys, http);
    const YAML::Node& node = it->second;
    if (!hc.send.empty() || !hc.expect.empty()) {
        fail(whereOf(source, cluster.at("health_check"), path),
             "has both `http` and send/expect; a check is one or the other");
    }
    if (!validMethod(http.method))
        fail(whereOfKey(source, node, "method", hpath + ".method"),
             quoted(http.method) + " is not an HTTP method (a token such as GET or OPTIONS)");
    if (http.path.empty() || http.path.front() != '/' || !printableNoSpace(http.path))
        fail(whereOfKey(source, node, "path", hpath + ".path"),
             quoted(http.path) +
                 " is not a path: it starts with / and has no spaces or "
                 "control characters");
    if (!printableNoSpace(http.host))
        fail(whereOfKey(source, node, "host", hpath + ".host"),
             quoted(http.host) + " is not a host name: no spaces or control characters");
    const auto statuses = parseStatuses(http.expect_status);
    if (!statuses)
        fail(whereOfKey(source, node, "expect_status", hpath + ".expect_status"),
             quoted(http.expect_status) +
                 " is not a status list: codes 100 to 599 and ranges, such as 200, \"200,204\" "
                 "or \"200-299\"");
    http.statuses = *statuses;
}

void checkBackendCheck(std::string_view source, const YAML::Node& node, const std::string& path,
                       const ClusterConfig& cluster, const BackendConfig& backend) {
    if (backend.check_address.length != 0 && backend.check_address.family() == AF_UNIX)
        fail(whereOfKey(source, node, "check_address", path + ".check_address"),
             "is a unix socket; a check address is TCP (an IP and a port)");
    if (backend.check_address.length != 0 && !cluster.health_check.enabled)
        fail(whereOfKey(source, node, "check_address", path + ".check_address"),
             "is set while cluster " + quoted(cluster.name) + " has no health_check");
    if (backend.address.family() == AF_UNIX && cluster.health_check.port != 0 &&
        backend.check_address.length == 0)
        fail(whereOfKey(source, node, "address", path + ".address"),
             "is a unix socket, which has no port for health_check.port to replace; set "
             "check_address");
}

}  // namespace

void parseClusters(std::string_view source, const YAML::Node& list, Config& config) {
    const auto items = sequenceOfMaps(source, list, "clusters", "cluster");
    for (size_t i = 0; i < items.size(); ++i) {
        const YAML::Node& node = items[i];
        const std::string path = "clusters[" + std::to_string(i) + "]";
        ClusterConfig cluster;
        const auto nested =
            parseMap<ClusterConfig>(source, node, path + ".", kClusterKeys, cluster,
                                    {"health_check", "tcp_keepalive", "backends", "discovery"});
        checkTcpAddress(source, node, "source", path, cluster.source);
        cluster.health_check.enabled = nested.count("health_check") > 0;
        const auto check_nested = parseNestedMap<HealthCheckConfig>(
            source, nested, "health_check", path + ".health_check", kHealthCheckKeys,
            cluster.health_check, {"http"});
        parseHttpCheck(source, nested, check_nested, path + ".health_check", cluster.health_check);
        parseNestedMap<KeepaliveConfig>(source, nested, "tcp_keepalive", path + ".tcp_keepalive",
                                        kKeepaliveKeys, cluster.tcp_keepalive);
        const auto backends = nested.find("backends");
        if (const auto discovery = nested.find("discovery"); discovery != nested.end()) {
            if (backends != nested.end()) {
                fail(whereOf(source, backends->second, path + ".backends"),
                     "a cluster takes its backends from `backends` or from `discovery`, not both");
            }
            parseDiscovery(source, discovery->second, path + ".discovery", cluster);
        } else if (backends == nested.end()) {
            fail(whereOf(source, node, path + ".backends"),
                 "missing required key (or `discovery` to take them from DNS)");
        }
        const auto backend_nodes =
            backends == nested.end()
                ? std::vector<YAML::Node>{}
                : sequenceOfMaps(source, backends->second, path + ".backends", "backend");
        for (size_t b = 0; b < backend_nodes.size(); ++b) {
            const std::string bpath = path + ".backends[" + std::to_string(b) + "]";
            BackendConfig backend;
            backend.send_proxy = cluster.send_proxy;  // unless the backend sets its own
            parseMap<BackendConfig>(source, backend_nodes[b], bpath + ".", kBackendKeys, backend);
            backend.tier = backend.backup ? 1 : 0;
            checkBackendCheck(source, backend_nodes[b], bpath, cluster, backend);
            for (size_t e = 0; e < cluster.backends.size(); ++e) {
                if (cluster.backends[e].address == backend.address) {
                    fail(whereOfKey(source, backend_nodes[b], "address", bpath + ".address"),
                         backend.address.toString() + " is already " + path + ".backends[" +
                             std::to_string(e) + "]");
                }
            }
            if (cluster.source.length != 0 && backend.address.family() != AF_UNIX &&
                backend.address.family() != cluster.source.family()) {
                fail(whereOfKey(source, backend_nodes[b], "address", bpath + ".address"),
                     backend.address.toString() + " is not in the family of source " +
                         cluster.source.toString());
            }
            cluster.backends.push_back(std::move(backend));
        }
        for (size_t j = 0; j < i; ++j) {
            if (config.clusters[j].name == cluster.name) {
                fail(whereOfKey(source, node, "name", path + ".name"),
                     quoted(cluster.name) + " is already the name of clusters[" +
                         std::to_string(j) + "]");
            }
        }
        config.clusters.push_back(std::move(cluster));
    }
}

namespace {

// A listener has at most this many routes: each has a counter per worker.
constexpr size_t kMaxRoutes = 64;
constexpr size_t kMaxRouteNames = 1024;  // sni or alpn entries of one route

// A server name as a route matches it: lowercase, without the trailing dot of a fully
// qualified name; "*." may stand for the first label. Anything else is refused here, where the
// operator sees it, rather than never matching.
std::string serverNamePattern(const Where& at, std::string_view text) {
    std::string name(text);
    if (!name.empty() && name.back() == '.') name.pop_back();
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    std::string_view rest = name;
    if (rest.starts_with("*.")) rest.remove_prefix(2);
    bool valid = !rest.empty() && name.size() <= 253;
    for (size_t start = 0; valid && start <= rest.size();) {
        size_t end = std::min(rest.find('.', start), rest.size());
        std::string_view label = rest.substr(start, end - start);
        valid = !label.empty() && label.size() <= 63 &&
                std::all_of(label.begin(), label.end(), [](char c) {
                    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
                });
        start = end + 1;
    }
    if (!valid) {
        fail(at, quoted(text) +
                     " is not a server name; expected DNS labels such as api.example.com, or "
                     "*.example.com for any one label in front");
    }
    return name;
}

// `sni` or `alpn`: one string or a sequence of them.
std::vector<std::string> parseNames(std::string_view source, const YAML::Node& node,
                                    const std::string& path, bool server_names) {
    std::vector<YAML::Node> items;
    if (node.IsScalar()) {
        items.push_back(node);
    } else if (node.IsSequence() && node.size() > 0) {
        for (size_t i = 0; i < node.size(); ++i) items.push_back(node[i]);
    } else {
        fail(whereOf(source, node, path),
             "expected a name or a non-empty sequence of names, got " + typeName(node));
    }
    if (items.size() > kMaxRouteNames)
        fail(whereOf(source, node, path),
             "more than " + std::to_string(kMaxRouteNames) + " names in one route");
    std::vector<std::string> names;
    for (size_t i = 0; i < items.size(); ++i) {
        const Where at = whereOf(source, items[i], path + "[" + std::to_string(i) + "]");
        if (!items[i].IsScalar()) fail(at, "expected a name, got " + typeName(items[i]));
        const std::string& text = items[i].Scalar();
        std::string name;
        if (server_names) {
            name = serverNamePattern(at, text);
        } else {
            // RFC 7301 3.1: a protocol name is 1 to 255 bytes, compared exactly.
            if (text.empty() || text.size() > 255)
                fail(at, quoted(text) + " is not an ALPN protocol name (1 to 255 bytes)");
            name = text;
        }
        if (std::find(names.begin(), names.end(), name) != names.end())
            fail(at, quoted(text) + " is listed twice");
        names.push_back(std::move(name));
    }
    return names;
}

void parseRoutes(std::string_view source, const YAML::Node& list, const std::string& path,
                 const Config& config, ListenerConfig& listener) {
    const auto items = sequenceOfMaps(source, list, path, "route");
    if (items.size() > kMaxRoutes)
        fail(whereOf(source, list, path),
             "more than " + std::to_string(kMaxRoutes) + " routes in one listener");
    for (size_t i = 0; i < items.size(); ++i) {
        const YAML::Node& node = items[i];
        const std::string rpath = path + "[" + std::to_string(i) + "]";
        RouteConfig route;
        const auto nested =
            parseMap<RouteConfig>(source, node, rpath + ".", kRouteKeys, route, {"sni", "alpn"});
        if (const auto sni = nested.find("sni"); sni != nested.end())
            route.sni = parseNames(source, sni->second, rpath + ".sni", true);
        if (const auto alpn = nested.find("alpn"); alpn != nested.end())
            route.alpn = parseNames(source, alpn->second, rpath + ".alpn", false);
        if (std::none_of(config.clusters.begin(), config.clusters.end(),
                         [&](const ClusterConfig& c) { return c.name == route.cluster; })) {
            fail(whereOfKey(source, node, "cluster", rpath + ".cluster"),
                 "no cluster named " + quoted(route.cluster));
        }
        if (route.name.empty()) route.name = route.cluster;
        for (size_t j = 0; j < listener.routes.size(); ++j) {
            if (listener.routes[j].name == route.name) {
                fail(whereOfKey(source, node, node["name"] ? "name" : "cluster", rpath + ".name"),
                     "route name " + quoted(route.name) + " is already " + path + "[" +
                         std::to_string(j) + "]'s; routes to one cluster need a `name` each");
            }
            // A route after an unconditional one could never be taken.
            if (!listener.routes[j].conditional()) {
                fail(whereOf(source, node, rpath),
                     "unreachable: " + path + "[" + std::to_string(j) +
                         "] has no condition and takes every client first");
            }
        }
        listener.routes.push_back(std::move(route));
    }
}

}  // namespace

void parseListeners(std::string_view source, const YAML::Node& list, Config& config) {
    const auto items = sequenceOfMaps(source, list, "listeners", "listener");
    for (size_t i = 0; i < items.size(); ++i) {
        const YAML::Node& node = items[i];
        const std::string path = "listeners[" + std::to_string(i) + "]";
        ListenerConfig listener;
        const auto nested = parseMap<ListenerConfig>(source, node, path + ".", kListenerKeys,
                                                     listener, {"tcp_keepalive", "routes"});
        parseNestedMap<KeepaliveConfig>(source, nested, "tcp_keepalive", path + ".tcp_keepalive",
                                        kKeepaliveKeys, listener.tcp_keepalive);
        if (listener.name.empty()) listener.name = "listener" + std::to_string(i);
        checkTcpAddress(source, node, "listen", path, listener.listen);
        const bool has_upstream = listener.upstream.length != 0;
        if (const auto routes = nested.find("routes"); routes != nested.end())
            parseRoutes(source, routes->second, path + ".routes", config, listener);
        if (has_upstream && !listener.cluster.empty())
            fail(whereOf(source, node, path), "set `cluster` or `upstream`, not both");
        if (!has_upstream && listener.cluster.empty() && listener.routes.empty()) {
            fail(whereOf(source, node, path),
                 "missing `cluster` (or `upstream`, a one-backend cluster, or `routes`)");
        }
        if (!listener.cluster.empty()) {
            const auto it =
                std::find_if(config.clusters.begin(), config.clusters.end(),
                             [&](const ClusterConfig& c) { return c.name == listener.cluster; });
            if (it == config.clusters.end()) {
                fail(whereOfKey(source, node, "cluster", path + ".cluster"),
                     "no cluster named " + quoted(listener.cluster));
            }
        } else if (has_upstream) {
            // The shorthand's cluster carries the listener's name: it must not shadow one.
            for (size_t j = 0; j < config.clusters.size(); ++j) {
                if (config.clusters[j].name == listener.name) {
                    fail(whereOfKey(source, node, "upstream", path + ".upstream"),
                         "the cluster this makes, named after the listener, clashes with "
                         "clusters[" +
                             std::to_string(j) + "] " + quoted(listener.name) +
                             "; name the listener otherwise or use `cluster`");
                }
            }
        }
        if (const std::string_view default_cluster = implicitDefaultRoute(listener);
            !default_cluster.empty()) {
            for (size_t r = 0; r < listener.routes.size(); ++r) {
                if (listener.routes[r].name == default_cluster) {
                    fail(whereOf(source, node, path + ".routes[" + std::to_string(r) + "]"),
                         "route name " + quoted(default_cluster) +
                             " is also the name of the default route (the listener's cluster); "
                             "give this route a `name`");
                }
            }
        }
        for (size_t j = 0; j < i; ++j) {
            const ListenerConfig& earlier = config.listeners[j];
            const std::string earlier_path = "listeners[" + std::to_string(j) + "]";
            if (earlier.name == listener.name) {
                fail(whereOfKey(source, node, "name", path + ".name"),
                     quoted(listener.name) + " is already the name of " + earlier_path);
            }
            // Port 0 asks the kernel for a fresh port, so two such listeners never collide.
            if (listener.listen.port() != 0 && earlier.listen == listener.listen) {
                fail(whereOfKey(source, node, "listen", path + ".listen"),
                     listener.listen.toString() + " is already the listen address of " +
                         earlier_path);
            }
        }
        config.listeners.push_back(std::move(listener));
    }
}

}  // namespace zcrelay::config_detail
