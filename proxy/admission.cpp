#include "admission.hpp"

#include <fcntl.h>

#include "log.hpp"

namespace zcrelay {
namespace {

// One more on `live` unless that would pass `max` (0 = no limit); true if taken.
bool takeOne(std::atomic<uint32_t>& live, uint64_t max) {
    uint32_t n = live.load(std::memory_order_relaxed);
    do {
        if (max > 0 && n >= max) return false;
    } while (!live.compare_exchange_weak(n, n + 1, std::memory_order_relaxed));
    return true;
}

}  // namespace

Admission::Admission(ProcessShared& process) : process_(process) {
    spare_fd_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    queue_.reserve(1024);
    fd_waiters_.reserve(1024);
}

bool Admission::belowLimits(const Runtime& rt, const ListenerRt& lr) const {
    if (lr.config.max_connections > 0 &&
        lr.shared->live.load(std::memory_order_relaxed) >= lr.config.max_connections)
        return false;
    if (rt.config.max_connections > 0 &&
        process_.live.load(std::memory_order_relaxed) >= rt.config.max_connections)
        return false;
    return true;
}

bool Admission::admit(Conn& c) {
    const ListenerRt& lr = listenerOf(c);
    if (!takeOne(lr.shared->live, lr.config.max_connections)) return false;
    if (!takeOne(process_.live, c.gen->rt->config.max_connections)) {
        lr.shared->live.fetch_sub(1, std::memory_order_relaxed);
        return false;
    }
    c.counted_live = true;
    return true;
}

bool Admission::admitSource(Conn& c) {
    const ListenerRt& lr = listenerOf(c);
    uint64_t limit = lr.config.max_connections_per_source;
    if (limit == 0) return true;
    if (lr.shared->sources.take(clientAddress(c), limit)) {
        c.counted_source = true;
        return true;
    }
    LOG_DEBUG("%s: %s is at max_connections_per_source %llu", lr.config.name.c_str(),
              c.client.toString().c_str(), static_cast<unsigned long long>(limit));
    return false;
}

void Admission::adopt(Conn& c) {
    const ListenerRt& lr = listenerOf(c);
    lr.shared->live.fetch_add(1, std::memory_order_relaxed);
    process_.live.fetch_add(1, std::memory_order_relaxed);
    c.counted_live = true;
    if (lr.config.max_connections_per_source > 0 &&
        lr.shared->sources.take(clientAddress(c), UINT64_MAX))
        c.counted_source = true;
}

bool Admission::release(Conn& c) {
    bool freed = false;
    if (c.counted_live) {
        c.counted_live = false;
        listenerOf(c).shared->live.fetch_sub(1, std::memory_order_relaxed);
        process_.live.fetch_sub(1, std::memory_order_relaxed);
        freed = true;
    }
    if (c.counted_source) {
        c.counted_source = false;
        listenerOf(c).shared->sources.give(c.client);
    }
    return freed;
}

void Admission::enqueue(const Conn& c, uint32_t slot) {
    queue_.push_back(UserData{Op::Accept, 0, slot, c.generation}.pack());
}

std::vector<uint64_t> Admission::takeQueue() {
    std::vector<uint64_t> out;
    out.swap(queue_);
    queue_.reserve(out.capacity());
    return out;
}

bool Admission::useSpareFd() {
    if (!spare_fd_) return false;
    spare_fd_.reset();
    return true;
}

bool Admission::holdSpareFd() {
    if (!spare_fd_) spare_fd_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    return static_cast<bool>(spare_fd_);
}

void Admission::waitForFd(const Conn& c, uint32_t slot) {
    fd_waiters_.push_back(UserData{Op::Connect, 0, slot, c.generation}.pack());
}

}  // namespace zcrelay
