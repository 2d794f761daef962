#include "loop_guard.hpp"

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>

#include "runtime.hpp"

// linux/netfilter_ipv4.h and linux/netfilter_ipv6/ip6_tables.h have them, but include
// linux/in.h, which cannot be included beside netinet/in.h. Both are 80 (the kernel's ABI).
#ifndef SO_ORIGINAL_DST
#define SO_ORIGINAL_DST 80
#endif
#ifndef IP6T_SO_ORIGINAL_DST
#define IP6T_SO_ORIGINAL_DST 80
#endif

namespace zcrelay {

LoopGuard::Endpoint LoopGuard::endpointOf(const SocketAddress& a) {
    const sa_family_t f = a.family();
    if (f != AF_INET && f != AF_INET6) return Endpoint{};
    return Endpoint{mappedIp(a), a.port()};
}

bool LoopGuard::Table::remember(LoopGuard& guard, uint32_t slot, int fd, const ClusterRt& cluster,
                                int16_t backend) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return false;
    const Endpoint local = endpointOf(addressFromSockaddr(reinterpret_cast<sockaddr*>(&ss), len));
    if (local.port == 0) return false;
    {
        std::lock_guard lock(mutex_);
        if (slot >= entries_.size()) entries_.resize((slot / 256 + 1) * 256);
        Entry& e = entries_[slot];
        uint32_t& head = heads_[local.port % kBuckets];
        e.local = local;
        e.backend = backend;
        e.cluster = &cluster;
        e.next = head;
        head = slot + 1;
    }
    // After the entry: an accept that sees the count finds the entry.
    guard.ports_[local.port].fetch_add(1, std::memory_order_release);
    return true;
}

void LoopGuard::Table::forget(LoopGuard& guard, uint32_t slot) {
    uint16_t port = 0;
    {
        std::lock_guard lock(mutex_);
        if (slot >= entries_.size() || entries_[slot].cluster == nullptr) return;
        Entry& e = entries_[slot];
        port = e.local.port;
        for (uint32_t* link = &heads_[port % kBuckets]; *link != 0;
             link = &entries_[*link - 1].next) {
            if (*link == slot + 1) {
                *link = e.next;
                break;
            }
        }
        e = Entry{};
    }
    guard.ports_[port].fetch_sub(1, std::memory_order_relaxed);
}

LoopGuard::Table& LoopGuard::table(unsigned worker) {
    std::lock_guard lock(make_mutex_);
    if (Table* t = tables_[worker].load(std::memory_order_acquire)) return *t;
    owned_.push_back(std::make_unique<Table>());
    tables_[worker].store(owned_.back().get(), std::memory_order_release);
    return *owned_.back();
}

std::array<LoopGuard::Endpoint, 2> LoopGuard::destinationsOf(int fd) {
    std::array<Endpoint, 2> to{};
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return to;
    const SocketAddress local = addressFromSockaddr(reinterpret_cast<sockaddr*>(&ss), len);
    to[0] = endpointOf(local);
    // conntrack's original destination of this connection: where the upstream socket
    // connected before a DNAT rule sent it here. ENOENT without conntrack or NAT; then the
    // local address is the only destination.
    sockaddr_storage orig{};
    len = sizeof orig;
    const bool v4 = local.family() == AF_INET;
    if (::getsockopt(fd, v4 ? SOL_IP : SOL_IPV6, v4 ? SO_ORIGINAL_DST : IP6T_SO_ORIGINAL_DST,
                     &orig, &len) == 0)
        to[1] = endpointOf(addressFromSockaddr(reinterpret_cast<sockaddr*>(&orig), len));
    return to;
}

bool LoopGuard::sameBackend(const ClusterRt& cluster, int16_t backend,
                            const std::array<Endpoint, 2>& to) {
    if (backend < 0 || static_cast<size_t>(backend) >= cluster.backends.size()) return false;
    const Endpoint b = endpointOf(cluster.backends[backend].config.address);
    return b.port != 0 && (b == to[0] || b == to[1]);
}

}  // namespace zcrelay
