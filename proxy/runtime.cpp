#include "runtime.hpp"

namespace zcrelay {

std::shared_ptr<const Runtime> Runtime::build(Config config, const Runtime* previous,
                                              unsigned workers) {
    auto rt = std::make_shared<Runtime>();
    rt->generation = previous ? previous->generation + 1 : 1;
    for (ClusterConfig& cc : clustersOf(config)) {
        ClusterRt cluster;
        const ClusterRt* old = nullptr;
        if (previous) {
            for (const ClusterRt& c : previous->clusters)
                if (c.config.name == cc.name) old = &c;
        }
        for (const BackendConfig& bc : cc.backends) {
            BackendRt b{bc, bc.address.toString(), nullptr};
            if (old) {
                for (const BackendRt& ob : old->backends)
                    if (ob.key == b.key) b.state = ob.state;
            }
            if (!b.state) b.state = std::make_shared<BackendState>(workers);
            cluster.specs.push_back({b.key, bc.weight});
            cluster.backends.push_back(std::move(b));
        }
        cluster.config = std::move(cc);
        rt->clusters.push_back(std::move(cluster));
    }
    for (size_t i = 0; i < config.listeners.size(); ++i) {
        ListenerRt l{config.listeners[i], static_cast<uint32_t>(clusterIndex(config, i)), nullptr};
        if (previous) {
            for (const ListenerRt& ol : previous->listeners)
                if (ol.config.name == l.config.name) l.shared = ol.shared;
        }
        if (!l.shared) l.shared = std::make_shared<ListenerShared>(workers);
        rt->listeners.push_back(std::move(l));
    }
    rt->config = std::move(config);
    return rt;
}

}  // namespace zcrelay
