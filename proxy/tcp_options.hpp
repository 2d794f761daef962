#pragma once
// The TCP options a listener sets on both sockets of every connection it relays.
#include "config.hpp"

namespace zcrelay {

// TCP_NODELAY (listener tcp_nodelay), TCP_NOTSENT_LOWAT (listener notsent_lowat) and TCP
// keepalive (`keepalive`: the listener's for the client socket, the cluster's for the
// upstream one) on `fd`. Failures are ignored: they only tune, and the connection works
// without them.
void applyTcpOptions(int fd, const ListenerConfig& lc, const KeepaliveConfig& keepalive);

}  // namespace zcrelay
