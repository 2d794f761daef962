#pragma once
// Loops caught at run time: a connection the relay accepts from one of its own upstream
// sockets. Discovery and the config refuse a backend that is one of the relay's own addresses,
// but a loop can pass through what they cannot see: a DNAT rule, a Service VIP, a name that
// resolves elsewhere later. Without this, each looped connection opens another until the fds
// run out (~9,800 connections to itself in two seconds, measured before this existed).
//
// Each worker records the local end of every TCP upstream socket it connected (getsockname,
// once per connection) in its own Table, keyed by slot; the process keeps one count per local
// port across all tables. An accept whose peer port has no upstream socket behind it, almost
// every accept, costs one relaxed load. Otherwise the accepting worker looks in every table
// for an upstream socket whose local end is the peer, and calls it a loop only if that
// socket's backend address is where the client connected: the accepted socket's local
// address, or, through a DNAT rule, its original destination (SO_ORIGINAL_DST, from
// conntrack). The kernel lets unrelated sockets share a local port as long as their 4-tuples
// differ (connect() autobinds that way), so the port alone would close innocent clients.
//
// What it cannot see: a loop through another proxy (the connection that comes back is that
// proxy's, not ours), and the first hop of a loop whose accept completes on one worker before
// the upstream's connect completion was handled on another (the next hop is caught).
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "address.hpp"

namespace zcrelay {

struct ClusterRt;

class LoopGuard {
  public:
    static constexpr unsigned kMaxWorkers = 256;  // the config's bound on `workers`

    // An address as the table compares it: IPv4 as its v4-mapped IPv6 form, so a dual-stack
    // listener's view of an IPv4 peer matches the IPv4 socket that made it.
    struct Endpoint {
        std::array<uint8_t, 16> addr{};
        uint16_t port = 0;
        bool operator==(const Endpoint&) const = default;
    };
    // Port 0: not an IPv4 or IPv6 address (a unix one), so nothing to compare.
    static Endpoint endpointOf(const SocketAddress& a);

    // One worker's upstream sockets. Written by its worker only; read by any worker's accept,
    // under the mutex, which the owner takes once per connection (never per I/O).
    class Table {
      public:
        Table() : heads_(kBuckets, 0) {}
        // Slot `slot`'s upstream socket `fd` connected to backend `backend` of `cluster`,
        // which stays alive while the connection holds its generation, so at least until
        // forget(slot). False if the socket has no TCP local address (unix backend).
        bool remember(LoopGuard& guard, uint32_t slot, int fd, const ClusterRt& cluster,
                      int16_t backend);
        // The slot's upstream socket is closing.
        void forget(LoopGuard& guard, uint32_t slot);

      private:
        friend class LoopGuard;
        static constexpr uint32_t kBuckets = 4096;  // by local port; chains are short
        struct Entry {
            Endpoint local;
            int16_t backend = -1;
            uint32_t next = 0;  // slot + 1 of the next entry in the bucket; 0 ends it
            const ClusterRt* cluster = nullptr;  // null: the slot has no entry
        };
        std::mutex mutex_;
        std::vector<Entry> entries_;  // by slot; grows past its peak only, as the slots do
        std::vector<uint32_t> heads_;  // slot + 1 of each bucket's first entry; 0 for none
    };

    // Worker `worker`'s table, made on its first call; lives as long as the guard.
    Table& table(unsigned worker);

    // Whether `peer` may be one of our upstream sockets: one relaxed load.
    bool suspect(const SocketAddress& peer) const {
        const uint16_t p = peer.port();
        return p != 0 && ports_[p].load(std::memory_order_relaxed) != 0;
    }

    // The accepted socket `fd` came from `peer`: if that is an upstream socket of ours
    // connected to this socket, `onLoop(cluster, backend)` runs (with the owning table's mutex
    // held, so the cluster cannot go away under it) and the result is true.
    template <class OnLoop>
    bool cameBack(const SocketAddress& peer, int fd, OnLoop&& onLoop);

  private:
    // Where the accepted socket's client meant to connect: its local address and, through a
    // DNAT rule, its original destination (port 0 where there is none).
    static std::array<Endpoint, 2> destinationsOf(int fd);
    static bool sameBackend(const ClusterRt& cluster, int16_t backend,
                            const std::array<Endpoint, 2>& to);

    std::array<std::atomic<uint16_t>, 65536> ports_{};  // upstream sockets per local port
    std::array<std::atomic<Table*>, kMaxWorkers> tables_{};
    std::mutex make_mutex_;
    std::vector<std::unique_ptr<Table>> owned_;
};

template <class OnLoop>
bool LoopGuard::cameBack(const SocketAddress& peer, int fd, OnLoop&& onLoop) {
    const Endpoint from = endpointOf(peer);
    if (from.port == 0) return false;
    std::array<Endpoint, 2> to{};
    bool asked = false;
    for (auto& slot : tables_) {
        Table* t = slot.load(std::memory_order_acquire);
        if (t == nullptr) continue;
        std::lock_guard lock(t->mutex_);
        for (uint32_t e = t->heads_[from.port % Table::kBuckets]; e != 0;
             e = t->entries_[e - 1].next) {
            const Table::Entry& entry = t->entries_[e - 1];
            if (!(entry.local == from)) continue;
            // Only now, on a port match: two system calls on an accept that is almost surely
            // a loop or a port shared by chance.
            if (!asked) to = destinationsOf(fd);
            asked = true;
            if (!sameBackend(*entry.cluster, entry.backend, to)) continue;
            onLoop(*entry.cluster, entry.backend);
            return true;
        }
    }
    return false;
}

}  // namespace zcrelay
