#include "pump/pump.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>

namespace zcrelay {

void SourceWatch::arm(const PumpPort& p, bool eof) {
    if (armed || eof || hup) return;
    io_uring_prep_poll_add(p.sqe(Op::Watch), p.src, POLLRDHUP | POLLERR | POLLHUP);
    armed = true;
}

void SourceWatch::armErrors(const PumpPort& p) {
    if (armed) return;
    io_uring_prep_poll_add(p.sqe(Op::Watch), p.src, POLLERR | POLLHUP);
    armed = true;
}

int pendingError(int fd) {
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    return err != 0 ? err : ECONNRESET;
}

}  // namespace zcrelay
