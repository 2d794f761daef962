#include "runtime.hpp"

#include <netinet/in.h>

#include <algorithm>
#include <cstring>

namespace zcrelay {

size_t SourceCounts::KeyHash::operator()(const Key& k) const {
    uint64_t hi, lo;
    std::memcpy(&hi, k.data(), 8);
    std::memcpy(&lo, k.data() + 8, 8);
    return std::hash<uint64_t>{}(hi * 0x9e3779b97f4a7c15ull ^ lo);
}

bool SourceCounts::take(const SocketAddress& a, uint64_t limit) {
    std::lock_guard lock(mutex_);
    auto [it, added] = counts_.try_emplace(mappedIp(a), 0);
    if (it->second >= limit) return false;  // not added: limit >= 1 makes a new entry pass
    ++it->second;
    return true;
}

void SourceCounts::give(const SocketAddress& a) {
    std::lock_guard lock(mutex_);
    auto it = counts_.find(mappedIp(a));
    if (it != counts_.end() && --it->second == 0) counts_.erase(it);
}

std::string_view adminStateName(AdminState s) {
    switch (s) {
        case AdminState::Ready:
            return "ready";
        case AdminState::Drain:
            return "drain";
        case AdminState::Maint:
            return "maint";
    }
    return "?";
}

std::optional<AdminState> parseAdminState(std::string_view s) {
    for (AdminState a : {AdminState::Ready, AdminState::Drain, AdminState::Maint})
        if (adminStateName(a) == s) return a;
    return std::nullopt;
}

std::shared_ptr<const Runtime> Runtime::build(
    Config config, const Runtime* previous, unsigned workers,
    const std::map<std::string, std::vector<BackendConfig>>& discovered) {
    auto rt = std::make_shared<Runtime>();
    rt->generation = previous ? previous->generation + 1 : 1;
    for (ClusterConfig& cc : clustersOf(config)) {
        ClusterRt cluster;
        const ClusterRt* old = nullptr;
        if (previous) {
            for (const ClusterRt& c : previous->clusters)
                if (c.config.name == cc.name) old = &c;
        }
        static const std::vector<BackendConfig> kNone;
        const std::vector<BackendConfig>* list = &cc.backends;
        if (cc.discovery.enabled()) {
            auto found = discovered.find(cc.name);
            list = found != discovered.end() ? &found->second : &kNone;
        }
        for (const BackendConfig& bc : *list) {
            BackendRt b{bc, bc.weight, bc.address.toString(), nullptr};
            if (cc.discovery.enabled()) b.config.send_proxy = cc.send_proxy;
            if (old) {
                for (const BackendRt& ob : old->backends)
                    if (ob.key == b.key) b.state = ob.state;
            }
            if (!b.state) {
                b.state = std::make_shared<BackendState>(workers);
                // Added while running (discovery, a reload): slow_start ramps it from now.
                // At start every backend takes its full share at once.
                if (previous) b.state->cameUp();
                // Discovered and checked: a new address proves itself first (rise passes).
                if (cc.discovery.enabled() && cc.health_check.enabled)
                    b.state->up.store(false, std::memory_order_relaxed);
            }
            const int32_t set = b.state->weight_override.load(std::memory_order_relaxed);
            if (set > 0) b.config.weight = static_cast<unsigned>(set);
            cluster.specs.push_back({b.key, b.config.weight});
            cluster.tiered = cluster.tiered || b.config.tier > 0;
            cluster.backends.push_back(std::move(b));
        }
        cluster.config = std::move(cc);
        rt->clusters.push_back(std::move(cluster));
    }
    for (size_t i = 0; i < config.listeners.size(); ++i) {
        ListenerRt l;
        l.config = config.listeners[i];
        const size_t cluster = clusterIndex(config, i);
        l.cluster = cluster == kNoCluster ? ListenerRt::kNoRoute : static_cast<uint32_t>(cluster);
        const ListenerRt* old = nullptr;
        if (previous) {
            for (const ListenerRt& ol : previous->listeners)
                if (ol.config.name == l.config.name) old = &ol;
        }
        l.shared = old ? old->shared : std::make_shared<ListenerShared>(workers);
        for (const RouteConfig& rc : l.config.routes)
            l.routes.push_back({rc, static_cast<uint32_t>(clusterNamed(config, rc.cluster)), {}});
        if (std::string_view fallback = implicitDefaultRoute(l.config); !fallback.empty()) {
            // The listener's own cluster is the default route, after every routes entry.
            RouteConfig route;
            route.cluster = route.name = std::string(fallback);
            l.routes.push_back({std::move(route), l.cluster, {}});
        }
        for (size_t r = 0; r < l.routes.size(); ++r) {
            RouteRt& route = l.routes[r];
            if (!route.config.conditional() && l.default_route == ListenerRt::kNoRoute)
                l.default_route = static_cast<uint32_t>(r);
            if (old) {
                for (const RouteRt& o : old->routes)
                    if (o.config.name == route.config.name) route.state = o.state;
            }
            if (!route.state) route.state = std::make_shared<RouteState>(workers);
        }
        rt->listeners.push_back(std::move(l));
    }
    rt->config = std::move(config);
    return rt;
}

}  // namespace zcrelay
