// Where a Server's listening sockets come from, and what it keeps of them for the next relay
// (server_sockets.hpp).
#include "server_sockets.hpp"

#include <fcntl.h>

#include <algorithm>
#include <cstring>

#include "log.hpp"

namespace zcrelay {
namespace {

// The socket systemd passed for `addr` (socket activation), taken out of `inherited`; an
// invalid fd if none was passed for it.
UniqueFd takeInherited(std::vector<InheritedSocket>& inherited, const SocketAddress& addr) {
    for (InheritedSocket& s : inherited) {
        if (s.fd && s.address == addr) return std::move(s.fd);
    }
    return UniqueFd();
}

// The sockets a takeover handed over for listener `l`, taken out of `handed`: the previous
// relay's, one per its worker. Matched as a reload matches (the address; a port-0 one by name
// too).
std::vector<takeover::HandedSocket> takeHanded(std::vector<takeover::HandedSocket>& handed,
                                               const ListenerConfig& l) {
    std::vector<takeover::HandedSocket> out;
    for (takeover::HandedSocket& s : handed) {
        if (s.fd && s.kind == "listener" && s.listen == l.listen &&
            (l.listen.port() != 0 || s.name == l.name))
            out.push_back(std::move(s));
    }
    return out;
}

// A listening socket as the next relay will be handed it: a dup, so that a worker closing its
// own leaves this one.
tl::expected<takeover::HandedSocket, std::string> handable(const ListenerConfig& l,
                                                           const SocketAddress& bound, int fd) {
    UniqueFd dup(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (!dup) return tl::unexpected("listener " + l.name + ": " + errnoText("dup"));
    return takeover::HandedSocket{"listener", l.name, l.listen, bound, std::move(dup)};
}

}  // namespace

UniqueFd takeHandedOf(std::vector<takeover::HandedSocket>& handed, const char* kind,
                      const SocketAddress& listen) {
    for (takeover::HandedSocket& s : handed)
        if (s.fd && s.kind == kind && s.listen == listen) return std::move(s.fd);
    return UniqueFd();
}

tl::expected<BoundListeners, std::string> bindListeners(
    const Config& config, const std::vector<size_t>& which, std::vector<SocketAddress>& bound,
    std::vector<InheritedSocket>& inherited, std::vector<takeover::HandedSocket>& handed,
    std::vector<SocketAddress>& passed_addresses) {
    BoundListeners out;
    out.per_worker.resize(config.workers);
    auto give = [&](unsigned w, size_t i, UniqueFd fd) {
        out.per_worker[w].push_back(ListenSocket{i, std::move(fd)});
    };
    for (size_t i : which) {
        const ListenerConfig& l = config.listeners[i];
        SocketAddress addr = l.listen;
        if (std::vector<takeover::HandedSocket> taken = takeHanded(handed, l); !taken.empty()) {
            LOG_INFO("listener %s: listening on %zu socket%s handed over for %s", l.name.c_str(),
                     taken.size(), taken.size() == 1 ? "" : "s", taken[0].bound.toString().c_str());
            bound.push_back(taken[0].bound);
            if (taken[0].systemd) passed_addresses.push_back(addr);
            const size_t rounds = std::max<size_t>(taken.size(), config.workers);
            for (size_t j = 0; j < rounds; ++j) {
                const int fd = taken[j % taken.size()].fd.get();
                UniqueFd dup(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
                if (!dup) return tl::unexpected("listener " + l.name + ": " + errnoText("dup"));
                give(static_cast<unsigned>(j % config.workers), i, std::move(dup));
            }
            for (takeover::HandedSocket& s : taken) out.handable.push_back(std::move(s));
            continue;
        }
        if (UniqueFd passed = takeInherited(inherited, addr)) {
            LOG_INFO("listener %s: listening on the socket systemd passed for %s (fd %d)",
                     l.name.c_str(), addr.toString().c_str(), passed.get());
            bound.push_back(addr);
            passed_addresses.push_back(addr);
            auto kept = handable(l, addr, passed.get());
            if (!kept) return tl::unexpected(kept.error());
            kept->systemd = true;
            out.handable.push_back(std::move(*kept));
            // Every worker accepts on the one socket: each accept SQE takes its own connection.
            for (unsigned w = 1; w < config.workers; ++w) {
                UniqueFd dup(::fcntl(passed.get(), F_DUPFD_CLOEXEC, 0));
                if (!dup)
                    return tl::unexpected("listener " + l.name +
                                          ": dup of the passed socket: " + std::strerror(errno));
                give(w, i, std::move(dup));
            }
            give(0, i, std::move(passed));
            continue;
        }
        for (unsigned w = 0; w < config.workers; ++w) {
            auto fd = openListener(addr);
            if (!fd) {
                return tl::unexpected("listener " + l.name + ": " + fd.error().what + " " +
                                      addr.toString() + ": " + std::strerror(fd.error().code));
            }
            if (w == 0) {
                // With port 0 the first bind picks the port; the other workers join it.
                auto got = boundAddress(fd->get());
                if (!got)
                    return tl::unexpected("listener " + l.name + ": " + got.error().message());
                addr = *got;
                bound.push_back(addr);
            }
            auto kept = handable(l, addr, fd->get());
            if (!kept) return tl::unexpected(kept.error());
            out.handable.push_back(std::move(*kept));
            give(w, i, std::move(*fd));
        }
    }
    return out;
}

}  // namespace zcrelay
