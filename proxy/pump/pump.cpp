#include "pump/pump.hpp"

#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <cerrno>

namespace zcrelay {

void SourceWatch::arm(const PumpPort& p, bool eof) {
    // Handing over: nothing of the connection may be in flight when it crosses.
    if (armed || eof || hup || p.handing) return;
    io_uring_prep_poll_add(p.sqe(Op::Watch), p.src, POLLRDHUP | POLLERR | POLLHUP);
    armed = true;
}

void SourceWatch::armErrors(const PumpPort& p) {
    if (armed || p.handing) return;
    io_uring_prep_poll_add(p.sqe(Op::Watch), p.src, POLLERR | POLLHUP);
    armed = true;
}

int pendingError(int fd) {
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    return err != 0 ? err : ECONNRESET;
}

uint32_t endForDuration(int src) {
    // Shut first, then count: a byte that lands in between is counted and read, one that lands
    // after is the peer's sent past the end, which stays unread.
    ::shutdown(src, SHUT_RD);
    int queued = 0;
    return ::ioctl(src, SIOCINQ, &queued) == 0 && queued > 0 ? static_cast<uint32_t>(queued) : 0;
}

}  // namespace zcrelay
