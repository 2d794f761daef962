#pragma once
// The sockets a Server listens on, wherever they come from (server.cpp's Server::start and
// reload): bound by the relay, passed by systemd (socket activation), or handed over by the
// relay this one took over from (takeover.hpp); and a dup of each kept for the next relay.
#include <string>
#include <tl/expected.hpp>
#include <vector>

#include "config.hpp"
#include "listener.hpp"
#include "socket_activation.hpp"
#include "takeover.hpp"

namespace zcrelay {

// A handed-over socket of another kind than a listener's (metrics, health, admin, takeover) at
// `listen`, taken out of `handed`; none if none was handed over for it.
UniqueFd takeHandedOf(std::vector<takeover::HandedSocket>& handed, const char* kind,
                      const SocketAddress& listen);

// Each worker's sockets and, for the next relay, one dup of every distinct one.
struct BoundListeners {
    std::vector<std::vector<ListenSocket>> per_worker;
    std::vector<takeover::HandedSocket> handable;
};

// Binds, for every worker, one SO_REUSEPORT socket per listener in `which` (indices into
// config.listeners). `bound` gets where each really listens (port 0 resolved once, shared by
// all workers' sockets). A listener whose address a socket in `inherited` has (systemd socket
// activation) takes that socket instead, one fd of it per worker (its address goes into
// `passed_addresses`): the service manager keeps it open across restarts, which sockets of the
// relay's own could not be. One that a takeover handed over takes those sockets: all of them,
// as each holds its own accept queue and the kernel keeps hashing new connections to each. With
// as many workers as the previous relay had, each worker takes one; with fewer, some take
// several; with more, some share one.
tl::expected<BoundListeners, std::string> bindListeners(
    const Config& config, const std::vector<size_t>& which, std::vector<SocketAddress>& bound,
    std::vector<InheritedSocket>& inherited, std::vector<takeover::HandedSocket>& handed,
    std::vector<SocketAddress>& passed_addresses);

}  // namespace zcrelay
