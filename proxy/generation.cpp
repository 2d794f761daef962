#include "generation.hpp"

#include <sys/socket.h>

namespace zcrelay {

namespace {

std::unique_ptr<Generation> makeGeneration(std::shared_ptr<const Runtime> rt, unsigned worker) {
    auto gen = std::make_unique<Generation>();
    for (const ClusterRt& c : rt->clusters) {
        // Seeded per worker: N workers with one connection each start at different backends.
        gen->balancers.emplace_back(c.config.balance, c.specs,
                                    0x9e3779b97f4a7c15ull * (worker + 1) + rt->generation);
    }
    gen->rt = std::move(rt);
    return gen;
}

}  // namespace

Generations::Generations(std::shared_ptr<const Runtime> rt, unsigned worker) : worker_(worker) {
    list_.push_back(makeGeneration(std::move(rt), worker));
}

void Generations::advance(std::shared_ptr<const Runtime> rt) {
    Generation* old = list_.back().get();
    list_.push_back(makeGeneration(std::move(rt), worker_));
    if (old->live == 0) std::erase_if(list_, [&](const auto& g) { return g.get() == old; });
}

void Generations::release(Generation& g) {
    // The last connection of an older config generation: it can go.
    if (--g.live == 0 && &g != list_.back().get())
        std::erase_if(list_, [&](const auto& p) { return p.get() == &g; });
}

namespace {

// getpeername() or getsockname() of the client's socket; an empty address if it fails.
SocketAddress nameOf(int fd, int (*ask)(int, sockaddr*, socklen_t*)) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (ask(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return {};
    return addressFromSockaddr(reinterpret_cast<sockaddr*>(&ss), len);
}

}  // namespace

const SocketAddress& clientAddress(Conn& c) {
    if (!c.have_client) {
        c.client = nameOf(c.fd[0], ::getpeername);
        c.have_client = true;
    }
    return c.client;
}

const SocketAddress& localAddress(Conn& c) {
    if (!c.have_local) {
        c.local = nameOf(c.fd[0], ::getsockname);
        c.have_local = true;
    }
    return c.local;
}

}  // namespace zcrelay
