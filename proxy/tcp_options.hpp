#pragma once
// The TCP options a listener sets on both sockets of every connection it relays.
#include "config.hpp"

namespace zcrelay {

// TCP_NODELAY (listener tcp_nodelay) and TCP_NOTSENT_LOWAT (listener notsent_lowat) on `fd`.
// Failures are ignored: both only tune, and the connection works without them.
void applyTcpOptions(int fd, const ListenerConfig& lc);

}  // namespace zcrelay
