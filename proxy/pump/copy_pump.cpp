#include "pump/copy_pump.hpp"

#include <sys/socket.h>

namespace zcrelay {

void prepCopyRecv(io_uring_sqe* sqe, int src, const BufRing& bufs, RecvWait wait) {
    // No buffer address: IOSQE_BUFFER_SELECT lets the kernel pick one from the group when data
    // is actually there, so a waiting recv pins no memory.
    io_uring_prep_recv(sqe, src, nullptr, bufs.bufferSize(),
                       wait == RecvWait::Caller ? MSG_DONTWAIT : 0);
    sqe->flags |= IOSQE_BUFFER_SELECT;
    sqe->buf_group = bufs.group();
}

void prepCopySend(io_uring_sqe* sqe, int dst, BufRing& bufs, const CopyChunk& chunk) {
    // MSG_NOSIGNAL: a peer that vanished must surface as -EPIPE, not as SIGPIPE.
    // MSG_DONTWAIT: a send that cannot write now completes with -EAGAIN (io_uring marks it
    // REQ_F_NOWAIT) and the worker waits for POLLOUT itself, as the splice path does. Without
    // it io_uring arms its own poll, and a send that still finds no room after that poll fired
    // (TCP_NOTSENT_LOWAT makes POLLOUT and the send's own check disagree) is handed to an io-wq
    // thread that blocks in sendmsg: 3 iou-wrk threads after 8 full-duplex 1 MiB echoes,
    // measured with the io_uring:io_uring_queue_async_work tracepoint (opcode SEND).
    io_uring_prep_send(sqe, dst, bufs.data(chunk.bid) + chunk.sent, chunk.len - chunk.sent,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
}

CopyNext copyNext(const Direction& d) {
    CopyNext next;
    // One send in flight per direction: two sends on one socket may complete out of order
    // when one of them has to wait for space (liburing proxy.c serializes sends for this).
    // Not while waiting for POLLOUT on dst after a send found no room (prepCopySend).
    next.arm_send = !d.send_armed && !d.poll_out && !d.queue.empty();
    next.arm_recv = !d.recv_armed && !d.eof && !d.queue.full();
    next.finish = d.eof && d.queue.empty() && !d.send_armed && !d.finished;
    return next;
}

}  // namespace zcrelay
