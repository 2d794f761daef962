#pragma once
// The TCP options a listener sets on both sockets of every connection it relays, what a
// connection moved to the kernel path unsets, and the ACK a connection sends at once for a FIN
// it read.
#include "config.hpp"

namespace zcrelay {

// TCP_NODELAY (listener tcp_nodelay), TCP_NOTSENT_LOWAT (listener notsent_lowat) and TCP
// keepalive (`keepalive`: the listener's for the client socket, the cluster's for the
// upstream one) on `fd`. Failures are ignored: they only tune, and the connection works
// without them.
void applyTcpOptions(int fd, const ListenerConfig& lc, const KeepaliveConfig& keepalive);

// A connection promoted to sockmap (mode auto): the kernel's psock worker sends from now on,
// and TCP_NOTSENT_LOWAT, which splice relies on, would make it back off and retry (see
// applyTcpOptions). 0 hands the socket back to the sysctl's mark (unlimited by default).
void leaveSendingToTheKernel(int fd);

// Sends the ACK the kernel holds back for what `fd` received, its FIN included (TCP_QUICKACK).
// A FIN puts the receiving socket in delayed-ACK ("pingpong") mode, on the bet that the
// application closes soon and the ACK rides on its FIN. A relay's FIN waits for the other
// peer's, often milliseconds (a database backend ending its session: 6 to 11 ms), and a peer
// with its data and FIN unacknowledged that long sends the FIN again (a tail loss probe, 2
// jiffies after 2 RTTs). If that copy arrives after the relay's socket closed, it meets an RST:
// a clean close that ends in a reset in every capture. Failures are ignored: it only hurries.
void acknowledgeNow(int fd);

}  // namespace zcrelay
