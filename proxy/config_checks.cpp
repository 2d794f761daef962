// The rules a value must follow beyond its key's range (a TCP address, a DNS name, who may
// reach the runtime API), and the checks across sections: the addresses the relay listens on,
// and backends that reach no service or the relay itself.
#include <arpa/inet.h>
#include <netinet/in.h>

#include "config_yaml.hpp"

namespace zcrelay::config_detail {

void checkTcpAddress(std::string_view source, const YAML::Node& map, const char* key,
                     const std::string& path, const SocketAddress& a) {
    if (a.family() == AF_UNIX) {
        fail(whereOfKey(source, map, key, path + "." + key),
             "unix sockets are only supported as backend addresses");
    }
}

// A DNS name as a resolver takes it: labels of letters, digits, '-' and '_' (SRV's
// _service._proto), 1 to 63 bytes each, 253 in all, an optional trailing dot (absolute: no
// search domain is tried).
bool validDnsName(std::string_view name) {
    if (name.empty() || name.size() > 254 || (name.size() == 254 && name.back() != '.'))
        return false;
    if (name.back() == '.') name.remove_suffix(1);
    size_t label = 0;
    for (const char c : name) {
        if (c == '.') {
            if (label == 0) return false;
            label = 0;
            continue;
        }
        const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                        (c >= '0' && c <= '9') || c == '-' || c == '_';
        if (!ok || ++label > 63) return false;
    }
    return label > 0;
}

// The runtime API changes what the relay does: without a token only this host may reach it.
bool loopbackOrUnix(const SocketAddress& a) {
    if (a.family() == AF_UNIX) return true;
    if (a.family() == AF_INET)
        return (ntohl(reinterpret_cast<const sockaddr_in*>(a.sockaddrPtr())->sin_addr.s_addr) >>
                24) == 127;
    const auto& sin6 = *reinterpret_cast<const sockaddr_in6*>(a.sockaddrPtr());
    return IN6_IS_ADDR_LOOPBACK(&sin6.sin6_addr);
}

// The runtime API and the metrics endpoint are two servers: one address cannot be both.
void checkAdminOwnAddress(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                          const Config& config) {
    if (config.admin.enabled() && config.metrics.enabled && config.admin.listen.port() != 0 &&
        (config.admin.listen == config.metrics.listen ||
         config.admin.listen == config.metrics.health_listen)) {
        fail(whereOfKey(source, nested.at("admin"), "listen", "admin.listen"),
             "is the same address as metrics." +
                 std::string(config.admin.listen == config.metrics.listen ? "listen"
                                                                          : "health_listen") +
                 "; the runtime API needs its own");
    }
}

// The addresses this config makes the relay listen on, by the key that sets each. Port 0 is
// left out: the kernel picks the port at bind, so no backend can name it here (discovery
// checks the bound ports: Server::ownEndpoints()).
std::vector<std::pair<std::string, SocketAddress>> ownAddresses(const Config& config) {
    std::vector<std::pair<std::string, SocketAddress>> own;
    const auto add = [&](std::string key, const SocketAddress& a) {
        if (a.length != 0 && (a.family() == AF_UNIX || a.port() != 0))
            own.emplace_back(std::move(key), a);
    };
    for (size_t i = 0; i < config.listeners.size(); ++i)
        add("listeners[" + std::to_string(i) + "].listen", config.listeners[i].listen);
    if (config.metrics.enabled) {
        add("metrics.listen", config.metrics.listen);
        add("metrics.health_listen", config.metrics.health_listen);
    }
    if (config.admin.enabled()) add("admin.listen", config.admin.listen);
    return own;
}

// A backend that connects to no service (0.0.0.0 and :: reach the local host, broadcast,
// multicast, port 0) or to the relay itself: a connection to itself is relayed to itself
// again, per client, until the fds run out. Discovery refuses the same in DNS answers.
void checkBackendTarget(const Where& at, const SocketAddress& a,
                        const std::vector<std::pair<std::string, SocketAddress>>& own,
                        std::optional<std::vector<SocketAddress>>& local) {
    if (const auto refusal = refusalOf(a))
        fail(at, a.toString() + " is refused as a backend (" + std::string(label(*refusal)) + ": " +
                     std::string(whyRefused(*refusal)) + ")");
    for (const auto& [key, listen] : own) {
        const bool wildcard = refusalOf(listen) == BackendRefusal::Unspecified;
        if (wildcard && !local) local = localAddresses();
        if (reaches(a, listen,
                    wildcard ? std::span<const SocketAddress>(*local)
                             : std::span<const SocketAddress>{}))
            fail(at, a.toString() + " is the relay's own " + key + ": a loop");
    }
}

void checkBackendTargets(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                         const Config& config) {
    const auto own = ownAddresses(config);
    std::optional<std::vector<SocketAddress>> local;  // getifaddrs once, when a wildcard needs it
    if (const auto clusters = nested.find("clusters"); clusters != nested.end()) {
        const auto items = sequenceOfMaps(source, clusters->second, "clusters", "cluster");
        for (size_t i = 0; i < items.size() && i < config.clusters.size(); ++i) {
            const YAML::Node backends = items[i]["backends"];
            if (!backends.IsDefined() || config.clusters[i].discovery.enabled()) continue;
            const std::string path = "clusters[" + std::to_string(i) + "].backends";
            const auto nodes = sequenceOfMaps(source, backends, path, "backend");
            for (size_t b = 0; b < nodes.size() && b < config.clusters[i].backends.size(); ++b) {
                const std::string key = path + "[" + std::to_string(b) + "].address";
                checkBackendTarget(whereOfKey(source, nodes[b], "address", key),
                                   config.clusters[i].backends[b].address, own, local);
            }
        }
    }
    const auto items = sequenceOfMaps(source, nested.at("listeners"), "listeners", "listener");
    for (size_t i = 0; i < items.size() && i < config.listeners.size(); ++i) {
        const SocketAddress& upstream = config.listeners[i].upstream;
        if (upstream.length == 0) continue;
        const std::string key = "listeners[" + std::to_string(i) + "].upstream";
        checkBackendTarget(whereOfKey(source, items[i], "upstream", key), upstream, own, local);
    }
}

}  // namespace zcrelay::config_detail
