#include "pump/copy_pump.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace zcrelay {

void prepCopyRecv(io_uring_sqe* sqe, int src, const BufRing& bufs, RecvWait wait,
                  bool poll_first) {
    // No buffer address: IOSQE_BUFFER_SELECT lets the kernel pick one from the group when data
    // is actually there, so a waiting recv pins no memory.
    io_uring_prep_recv(sqe, src, nullptr, bufs.bufferSize(),
                       wait == RecvWait::Caller ? MSG_DONTWAIT : 0);
    sqe->flags |= IOSQE_BUFFER_SELECT;
    sqe->buf_group = bufs.group();
    // A recv re-armed right after a short one finds src empty nearly always (a request/response
    // stream: the answer comes only after what was read is sent on). Without the flag io_uring
    // tries it at once anyway, a tcp_recvmsg() that takes the socket lock to return -EAGAIN,
    // and only then arms its poll. With it, the poll goes first. Not with MSG_DONTWAIT
    // (RecvWait::Caller): that recv must not wait, and would fail at once.
    if (poll_first && wait == RecvWait::Kernel) sqe->ioprio |= IORING_RECVSEND_POLL_FIRST;
}

void prepCopySend(io_uring_sqe* sqe, int dst, BufRing& bufs, const CopyChunk& chunk,
                  bool zerocopy, bool report_usage) {
    // MSG_NOSIGNAL: a peer that vanished must surface as -EPIPE, not as SIGPIPE.
    // MSG_DONTWAIT: a send that cannot write now completes with -EAGAIN (io_uring marks it
    // REQ_F_NOWAIT) and the worker waits for POLLOUT itself, as the splice path does. Without
    // it io_uring arms its own poll, and a send that still finds no room after that poll fired
    // (TCP_NOTSENT_LOWAT makes POLLOUT and the send's own check disagree) is handed to an io-wq
    // thread that blocks in sendmsg: 3 iou-wrk threads after 8 full-duplex 1 MiB echoes,
    // measured with the io_uring:io_uring_queue_async_work tracepoint (opcode SEND).
    char* data = bufs.data(chunk.bid) + chunk.offset + chunk.sent;
    if (zerocopy)
        io_uring_prep_send_zc(sqe, dst, data, chunk.len - chunk.sent, MSG_NOSIGNAL | MSG_DONTWAIT,
                              report_usage ? kSendZcReportUsage : 0);
    else
        io_uring_prep_send(sqe, dst, data, chunk.len - chunk.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
}

CopyPump::Flow CopyPump::advance(const PumpPort& p, PumpEnv& env, bool may_recv, RecvWait wait) {
    // Not while waiting for POLLOUT on dst after a send found no room (prepCopySend).
    bool arm_send = !send_armed_ && !poll_out_ && !queue_.empty();
    bool arm_recv = !recv_armed_ && !eof_ && !queue_.full() && may_recv && !p.handing;
    if (eof_ && queue_.empty() && !send_armed_ && !done_) {
        done_ = true;
        return Flow::Drained;
    }
    if (!arm_send && !arm_recv && !send_armed_ && !recv_armed_ && queue_.empty() && !eof_)
        return Flow::Idle;
    if (arm_send) {
        const CopyChunk& chunk = queue_.front();
        send_hold_ = 0;
        if (p.zerocopy && env.send_zc.op && !zerocopy_refused_ &&
            chunk.len - chunk.sent >= kZerocopyMin) {
            if (lent_ < kDirectionHolds) send_hold_ = env.holds.take(chunk.bid);
            if (send_hold_ == 0) env.stats.zerocopy_sends[idx(ZerocopySend::Plain)].add();
        }
        if (send_hold_ != 0) {
            // The hold's own reference: the buffer outlives the chunk's recycle on this CQE.
            env.bufs.hold(chunk.bid);
            ++lent_;
            prepCopySend(p.sqe(Op::Send, send_hold_), p.dst, env.bufs, chunk, true,
                         env.send_zc.report_usage);
        } else {
            prepCopySend(p.sqe(Op::Send), p.dst, env.bufs, chunk);
        }
        send_armed_ = true;
    }
    if (arm_recv) {
        prepCopyRecv(p.sqe(Op::Recv), p.src, env.bufs, wait, src_emptied_);
        recv_armed_ = true;
    }
    if (queue_.full() && !recv_armed_ && !p.handing) watch_.arm(p, eof_);
    return Flow::Moving;
}

void CopyPump::recvDone(PumpEnv& env, int res, uint32_t flags) {
    recv_armed_ = false;
    if (flags & IORING_CQE_F_BUFFER) env.bufs.drop(flags, res);
}

namespace {

void countNotification(PumpEnv& env, int res) {
    ZerocopySend what = !env.send_zc.report_usage                     ? ZerocopySend::Unreported
                        : static_cast<uint32_t>(res) & kNotifZcCopied ? ZerocopySend::Copied
                                                                      : ZerocopySend::Zerocopy;
    env.stats.zerocopy_sends[idx(what)].add();
}

}  // namespace

void returnHold(PumpEnv& env, uint8_t aux, int res, uint32_t flags) {
    if (aux == 0) return;  // a plain send
    bool notification = flags & IORING_CQE_F_NOTIF;
    if (!notification && (flags & IORING_CQE_F_MORE)) return;  // its notification will
    env.bufs.recycle(env.holds.release(aux));
    if (notification) countNotification(env, res);
}

bool CopyPump::notified(PumpEnv& env, int res, uint32_t flags, uint8_t aux) {
    if (!(flags & IORING_CQE_F_NOTIF)) return false;
    giveBack(env, aux);
    countNotification(env, res);
    return true;
}

int64_t CopyPump::onSend(const PumpPort& p, PumpEnv& env, int res, uint32_t flags) {
    send_armed_ = false;
    // A zero-copy send whose CQE promises no notification (it failed before the kernel took
    // the pages) gives its hold back now.
    bool zerocopy = send_hold_ != 0;
    if (zerocopy && !(flags & IORING_CQE_F_MORE)) giveBack(env, send_hold_);
    send_hold_ = 0;
    if (res == -EOPNOTSUPP && zerocopy) {
        // Only sockets with SOCK_SUPPORT_ZC (TCP, UDP) take a zero-copy send; a unix socket (a
        // unix backend) refuses it before sending anything. This direction sends plainly from
        // now on, starting with these bytes.
        zerocopy_refused_ = true;
        return 0;
    }
    if (res < 0) {
        if (res == -EAGAIN) {
            // dst is full: send again once it says it has room.
            if (!poll_out_) {
                io_uring_prep_poll_add(p.sqe(Op::PollOut), p.dst, POLLOUT);
                poll_out_ = true;
            }
            return 0;
        }
        return res == -EINTR ? 0 : res;
    }
    CopyChunk& chunk = queue_.front();
    chunk.sent += static_cast<uint32_t>(res);
    if (chunk.sent == chunk.len) {
        env.bufs.recycle(chunk.bid);
        queue_.pop();
    }
    return res;
}

Step CopyPump::settle(const PumpPort& p, Flow flow) {
    if (flow != Flow::Drained) return {};
    // Everything read before the FIN has been sent: pass the FIN on.
    if (!p.ending) ::shutdown(p.dst, SHUT_WR);
    Step out;
    out.kind = Step::Finished;
    return out;
}

Step CopyPump::start(const PumpPort& p, PumpEnv& env) {
    return settle(p, advance(p, env, true, RecvWait::Kernel));
}

Step CopyPump::resume(const PumpPort& p, PumpEnv& env) { return start(p, env); }

Step CopyPump::onCompletion(const PumpPort& p, PumpEnv& env, Op op, int res, uint32_t flags,
                            uint8_t aux) {
    Step out;
    // A notification: a buffer came back, which only a starved recv waits for (the worker
    // retries those when the ring was replenished).
    if (op == Op::Send && notified(env, res, flags, aux)) return out;
    switch (op) {
        case Op::Recv: {
            if (res == -ECANCELED) {
                // A handover cancelled it (the only cancel a relaying direction sees): it reads
                // no more, and sends what it holds.
                recv_armed_ = false;
                break;
            }
            int error = 0;
            Got got = onRecv(
                p, env, res, flags, [](char*, uint32_t len) { return len; }, error);
            if (got == Got::Failed) return Step::failed(true, error);
            if (got == Got::Starved) {
                out.starved = true;
                return out;
            }
            out.active = got == Got::Data;
            if (got == Got::Data && p.end_left) {
                // Ending: past what src held when the end began, what comes is the peer's
                // sent after it (PumpPort::end_left). What this recv took still goes out.
                *p.end_left -= std::min(*p.end_left, static_cast<uint32_t>(res));
                if (*p.end_left == 0) eof_ = true;
            }
            break;
        }
        case Op::Send: {
            int64_t n = onSend(p, env, res, flags);
            if (n < 0) return Step::failed(false, static_cast<int>(-n));
            out.moved = static_cast<uint64_t>(n);
            break;
        }
        case Op::PollOut:
            poll_out_ = false;
            if (res < 0) return out;
            break;
        case Op::Watch:
            watch_.armed = false;
            if (res < 0) return out;
            if (res & POLLERR) return Step::failed(true, pendingError(p.src));
            // POLLRDHUP alone: a FIN, which the recv reads in order after the queued bytes.
            watch_.hup = true;
            return out;
        default:
            return out;
    }
    Step next = settle(p, advance(p, env, true, RecvWait::Kernel));
    next.moved = out.moved;
    next.active = out.active;
    return next;
}

void CopyPump::reclaim(PumpEnv& env) {
    while (!queue_.empty()) {
        env.bufs.recycle(queue_.front().bid);
        queue_.pop();
    }
}

void CopyPump::giveBack(PumpEnv& env, uint8_t hold) {
    env.bufs.recycle(env.holds.release(hold));
    --lent_;
}

}  // namespace zcrelay
