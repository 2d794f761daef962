#pragma once
// A Runtime as one worker uses it, and what a connection reaches through the generation it
// was accepted under: its listener, its cluster, their counters.
#include <cstdint>
#include <memory>
#include <vector>

#include "balance.hpp"
#include "conn.hpp"
#include "runtime.hpp"

namespace zcrelay {

// The newest is current; older ones live on while their connections do.
struct Generation {
    std::shared_ptr<const Runtime> rt;
    std::vector<Balancer> balancers;  // per rt->clusters: worker-local state
    uint32_t live = 0;                // this worker's connections that belong to it
};

// The generations a worker holds: the current one, and older ones while they have connections.
class Generations {
  public:
    Generations(std::shared_ptr<const Runtime> rt, unsigned worker);
    Generation& current() { return *list_.back(); }
    const Runtime& rt() const { return *list_.back()->rt; }
    // A reload: `rt` is current from now on; the previous one goes if nothing uses it.
    void advance(std::shared_ptr<const Runtime> rt);
    // One of g's connections is gone: an older generation with none left goes.
    void release(Generation& g);

  private:
    unsigned worker_;
    std::vector<std::unique_ptr<Generation>> list_;  // back(): the current one
};

inline const ListenerRt& listenerOf(const Conn& c) { return c.gen->rt->listeners[c.listener]; }
inline const ListenerConfig& listenerConfig(const Conn& c) { return listenerOf(c).config; }
inline ListenerStats& listenerStats(const Conn& c, unsigned worker) {
    return listenerOf(c).shared->stats[worker];
}
// Only once the cluster is chosen (c.cluster != Conn::kNoCluster): at accept, or by a route.
inline const ClusterRt& clusterOf(const Conn& c) { return c.gen->rt->clusters[c.cluster]; }

// The client's address (getpeername, once), for whatever needs it: source_hash, a PROXY
// header, the access log, a per-source limit. One syscall then, none per connection otherwise.
const SocketAddress& clientAddress(Conn& c);
// The address the client reached (getsockname, once), for a PROXY header sent on.
const SocketAddress& localAddress(Conn& c);

}  // namespace zcrelay
