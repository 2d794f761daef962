// <linux/tcp.h>, not <netinet/tcp.h>: glibc's struct tcp_info stops before tcpi_bytes_sent.
#include "pump/sockmap_kernel.hpp"

#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

namespace zcrelay {
namespace {

// tcpi_state values (include/net/tcp_states.h is not UAPI).
constexpr uint8_t kTcpEstablished = 1;
constexpr uint8_t kTcpClose = 7;

bool tcpInfo(int fd, tcp_info& info) {
    socklen_t len = sizeof info;
    return ::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) == 0;
}

bool established(int fd) {
    tcp_info info{};
    return tcpInfo(fd, info) && info.tcpi_state == kTcpEstablished;
}

// The kick: see the header. Returns the peeked count (0 or 1), or -errno.
int peek(int fd) {
    char b;
    ssize_t n = ::recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n >= 0 ? static_cast<int>(n) : -errno;
}

}  // namespace

PairSetUp setUpPair(Sockmap& map, SockmapPair& c, const int (&fd)[2], uint32_t index_base,
                    uint64_t limit, const uint64_t (&sent_before)[2]) {
    PairSetUp out;
    auto fallBack = [&](SockmapFallback why, DataPath p0, DataPath p1) {
        out.fell_back = true;
        out.reason = why;
        out.path[0] = p0;
        out.path[1] = p1;
        return out;
    };
    if (index_base + 1 >= map.capacity())
        return fallBack(SockmapFallback::NoRecord, DataPath::Splice, DataPath::Splice);
    // Either socket may have had its FIN by now; the kernel would refuse it (EOPNOTSUPP).
    // Asking first keeps the refusal from striking after the other socket went in.
    if (!established(fd[0]) || !established(fd[1]))
        return fallBack(SockmapFallback::NotEstablished, DataPath::Splice, DataPath::Splice);
    for (int i = 0; i < 2; ++i) {
        auto cookie = socketCookie(fd[i]);
        if (!cookie)
            return fallBack(SockmapFallback::InsertFailed, DataPath::Splice, DataPath::Splice);
        c.cookie[i] = *cookie;
    }
    c.record = index_base;
    c.map = &map;
    for (int i = 0; i < 2; ++i) {
        if (!map.link(c.cookie[i], c.cookie[1 - i], index_base + i, limit, sent_before[i])) {
            tearDownPair(map, c);
            return fallBack(SockmapFallback::InsertFailed, DataPath::Splice, DataPath::Splice);
        }
        c.linked[i] = true;
    }
    // The client's socket goes in, and is kicked, before its peer: what it received before
    // insertion is then passed (its peer is not in the map yet) instead of redirected. Drained
    // by a redirect from the kick, which runs in our process context, the queue leaves the
    // window the client last saw closed: no window update goes out, and a client blocked on
    // it waits for its persist timer (208 ms in 1 of 3 1-MiB half-close exchanges, measured).
    // Passed, the bytes are read by the catch-up copy, whose recvmsg() sends the update.
    if (!map.insert(fd[0], c.cookie[0])) {
        tearDownPair(map, c);
        return fallBack(SockmapFallback::InsertFailed, DataPath::Splice, DataPath::Splice);
    }
    c.in_map[0] = true;
    peek(fd[0]);
    if (!map.insert(fd[1], c.cookie[1])) {
        // The client's socket stays in: its psock may hold passed bytes, which taking it out
        // would purge. With its peer never in the map, the program passes all it receives:
        // client -> upstream moves by copy. Upstream -> client never entered the kernel path.
        fallBack(SockmapFallback::InsertFailed, DataPath::Copy, DataPath::Splice);
    } else {
        c.in_map[1] = true;
        peek(fd[1]);
    }
    return out;
}

void tearDownPair(Sockmap& map, SockmapPair& c) {
    for (int i = 0; i < 2; ++i) {
        if (!c.linked[i]) continue;
        map.remove(c.cookie[i], c.in_map[i]);
        c.linked[i] = false;
        c.in_map[i] = false;
    }
}

bool pairBroken(Sockmap& map, const SockmapPair& pair, int& side) {
    for (int i = 0; i < 2; ++i) {
        if (pair.linked[i] && recordBroken(map, pair.record + i)) {
            side = i;
            return true;
        }
    }
    return false;
}

SockmapEof checkEof(int src, bool src_write_shut) {
    int n = peek(src);
    if (n > 0) return {SockmapEof::Passed, 0};
    if (n == 0) return {SockmapEof::Eof, 0};
    if (n == -EAGAIN || n == -EINTR) return {SockmapEof::Again, 0};
    if (n == -EPIPE && src_write_shut) return {SockmapEof::Eof, 0};
    return {SockmapEof::Failed, -n};
}

uint64_t queuedOn(int fd) {
    tcp_info out{};
    if (!tcpInfo(fd, out)) return 0;
    return out.tcpi_bytes_sent - out.tcpi_bytes_retrans + out.tcpi_notsent_bytes;
}

SockmapBarrier checkQueued(int dst, uint64_t bytes) {
    tcp_info out{};
    if (!tcpInfo(dst, out)) return {SockmapBarrier::Failed, false, errno, 0};
    if (out.tcpi_state == kTcpClose) return {SockmapBarrier::Failed, false, ECONNRESET, 0};
    // bytes_sent counts retransmissions again; notsent_bytes is still in the send queue.
    uint64_t queued = out.tcpi_bytes_sent - out.tcpi_bytes_retrans + out.tcpi_notsent_bytes;
    if (queued >= bytes) return {SockmapBarrier::Done, false, 0, 0};
    return {SockmapBarrier::Wait, false, 0, bytes - queued};
}

SockmapBarrier checkFinBarrier(int src, int dst, uint64_t src_skipped, uint64_t dst_extra) {
    tcp_info in{};
    if (!tcpInfo(src, in)) return {SockmapBarrier::Failed, true, errno, 0};
    // bytes_received counts the FIN as one byte.
    uint64_t received = in.tcpi_bytes_received > 0 ? in.tcpi_bytes_received - 1 : 0;
    return checkQueued(dst, received - std::min(received, src_skipped) + dst_extra);
}

void stopRedirecting(Sockmap& map, uint32_t index, int src) {
    storeRelaxed(map.record(index).stop, __u32{1});
    // A verdict that read stop before this store may still be redirecting. Verdicts run under
    // src's socket lock (bh_lock_sock in softirq, or as its owner in release_sock), which
    // TCP_INFO takes too (lock_sock_fast): once it returns, that verdict has ended and every
    // later one reads the store, which the fence orders before the lock. (If TCP_INFO failed,
    // src would be gone, and no verdict with it.)
    std::atomic_thread_fence(std::memory_order_seq_cst);
    tcp_info info{};
    (void)tcpInfo(src, info);
}

}  // namespace zcrelay
