#include "pump/copy_pump.hpp"

#include <sys/socket.h>

namespace zcrelay {

void prepCopyRecv(io_uring_sqe* sqe, int src, const BufRing& bufs) {
    // No buffer address: IOSQE_BUFFER_SELECT lets the kernel pick one from the group when data
    // is actually there, so a waiting recv pins no memory.
    io_uring_prep_recv(sqe, src, nullptr, bufs.bufferSize(), 0);
    sqe->flags |= IOSQE_BUFFER_SELECT;
    sqe->buf_group = bufs.group();
}

void prepCopySend(io_uring_sqe* sqe, int dst, BufRing& bufs, const CopyChunk& chunk) {
    // MSG_NOSIGNAL: a peer that vanished must surface as -EPIPE, not as SIGPIPE.
    io_uring_prep_send(sqe, dst, bufs.data(chunk.bid) + chunk.sent, chunk.len - chunk.sent,
                       MSG_NOSIGNAL);
}

CopyNext copyNext(const Direction& d) {
    CopyNext next;
    // One send in flight per direction: two sends on one socket may complete out of order
    // when one of them has to wait for space (liburing proxy.c serializes sends for this).
    next.arm_send = !d.send_armed && !d.queue.empty();
    next.arm_recv = !d.recv_armed && !d.eof && !d.queue.full();
    next.finish = d.eof && d.queue.empty() && !d.send_armed && !d.finished;
    return next;
}

}  // namespace zcrelay
