#include "config.hpp"

#include <algorithm>

namespace zcrelay {

std::string_view proxyVersionName(ProxyVersion v) {
    switch (v) {
        case ProxyVersion::Off:
            return "off";
        case ProxyVersion::V1:
            return "v1";
        case ProxyVersion::V2:
            return "v2";
    }
    return "?";
}

std::string_view familiesName(AddressFamilies f) {
    switch (f) {
        case AddressFamilies::Any:
            return "any";
        case AddressFamilies::Ipv4:
            return "ipv4";
        case AddressFamilies::Ipv6:
            return "ipv6";
    }
    return "?";
}

std::string_view logFormatName(AccessLogFormat f) {
    return f == AccessLogFormat::Json ? "json" : "text";
}

std::vector<ClusterConfig> clustersOf(const Config& config) {
    std::vector<ClusterConfig> clusters = config.clusters;
    for (const ListenerConfig& l : config.listeners) {
        if (l.cluster.empty() && l.upstream.length != 0) {
            ClusterConfig c;
            c.name = l.name;
            BackendConfig b;
            b.address = l.upstream;
            c.backends.push_back(b);
            clusters.push_back(std::move(c));
        }
    }
    return clusters;
}

std::string_view implicitDefaultRoute(const ListenerConfig& listener) {
    if (listener.routes.empty() ||
        std::any_of(listener.routes.begin(), listener.routes.end(),
                    [](const RouteConfig& r) { return !r.conditional(); }))
        return {};
    if (!listener.cluster.empty()) return listener.cluster;
    // `upstream:` makes a cluster named after the listener (clustersOf).
    return listener.upstream.length != 0 ? std::string_view(listener.name) : std::string_view();
}

size_t clusterNamed(const Config& config, std::string_view name) {
    for (size_t i = 0; i < config.clusters.size(); ++i)
        if (config.clusters[i].name == name) return i;
    return kNoCluster;
}

size_t clusterIndex(const Config& config, size_t listener) {
    const ListenerConfig& l = config.listeners[listener];
    if (!l.cluster.empty()) return clusterNamed(config, l.cluster);
    if (l.upstream.length == 0) return kNoCluster;
    size_t implicit = config.clusters.size();
    for (size_t i = 0; i < listener; ++i)
        if (config.listeners[i].cluster.empty() && config.listeners[i].upstream.length != 0)
            ++implicit;
    return implicit;
}

}  // namespace zcrelay
