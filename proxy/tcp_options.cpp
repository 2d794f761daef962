#include "tcp_options.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>

namespace zcrelay {

void applyTcpOptions(int fd, const ListenerConfig& lc, const KeepaliveConfig& keepalive) {
    if (lc.tcp_nodelay) {
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    // Without a low-water mark a socket takes bytes until its send buffer (up to tcp_wmem[2],
    // 4 MiB) is full, and most of them wait for the peer's window. The kernel then sends them
    // from wherever the peer's ACK is processed: in softirq on the peer's CPU, not on the
    // relay's. With 100 bulk clients that moved the relay's sending onto the load's CPU and
    // halved throughput (bench/profile.sh; TcpExtTCPWantZeroWindowAdv 1974 against 439). With
    // the mark, a socket says "full" once that much is unsent: the bytes stay in the pipe (or
    // the copy buffer), and the relay sends them itself when POLLOUT comes.
    // Not for sockmap: there the kernel's psock worker is the sender, and a socket that reports
    // full makes it back off and retry (10 x 10 MiB fell from ~1,500 to ~1,000 MB/s).
    if (lc.notsent_lowat > 0 && lc.mode != Mode::Sockmap) {  // auto: unset at promotion
        int lowat = static_cast<int>(lc.notsent_lowat);
        ::setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &lowat, sizeof lowat);
    }
    if (keepalive.idle.count() > 0) {
        // The kernel counts these in whole seconds; the config keeps them >= 1 s.
        int on = 1;
        int idle = static_cast<int>(std::max<int64_t>(1, keepalive.idle.count() / 1000));
        int interval = static_cast<int>(std::max<int64_t>(1, keepalive.interval.count() / 1000));
        int count = static_cast<int>(keepalive.count);
        ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
        ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
        ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
        ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
    }
    if (keepalive.user_timeout.count() > 0) {
        // Linux sends no keepalive probe while sent bytes are unacknowledged: a peer that
        // vanished with bytes in flight is retransmitted to for tcp_retries2 (15, about 15
        // minutes) before the socket fails. The user timeout bounds that, and the time a peer
        // may keep a zero window (a reader that stopped reading), and with keepalive on it
        // replaces the probe count as the deadline.
        unsigned ms = static_cast<unsigned>(keepalive.user_timeout.count());
        ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof ms);
    }
}

void leaveSendingToTheKernel(int fd) {
    int unset = 0;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &unset, sizeof unset);
}

void acknowledgeNow(int fd) {
    // TCP_QUICKACK leaves pingpong mode and sends a pending ACK at once (in ESTABLISHED and
    // CLOSE_WAIT, which is where a socket whose FIN was read sits).
    int one = 1;
    if (fd >= 0) ::setsockopt(fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof one);
}

}  // namespace zcrelay
