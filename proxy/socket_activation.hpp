#pragma once
// systemd socket activation: listening sockets a service manager opened for the relay and passed
// at exec, with sd_listen_fds(3)'s protocol and without libsystemd. LISTEN_PID names the process
// they are meant for, LISTEN_FDS how many there are (fds 3, 4, ...), LISTEN_FDNAMES their names.
// A relay started this way listens on the sockets the manager keeps open: connections that
// arrive while it starts, or while it restarts under `systemctl restart`, wait in the socket's
// queue instead of being refused (deploy/systemd/zcrelay.socket).
#include <string>
#include <vector>

#include "address.hpp"
#include "result.hpp"
#include "unique_fd.hpp"

namespace zcrelay {

struct InheritedSocket {
    UniqueFd fd;            // close-on-exec and nonblocking from here on
    SocketAddress address;  // where it listens (getsockname)
    std::string name;       // from LISTEN_FDNAMES, or "" when not given
};

// The sockets passed to this process: none without LISTEN_FDS, or when LISTEN_PID names another
// process (they were meant for a parent that did not unset them). The variables are removed from
// the environment either way, so no child process the relay starts sees them. A passed fd that
// is not a listening TCP socket over IPv4 or IPv6 is an error naming it.
tl::expected<std::vector<InheritedSocket>, std::string> takeInheritedSockets();

}  // namespace zcrelay
