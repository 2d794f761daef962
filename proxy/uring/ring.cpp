#include "uring/ring.hpp"

#include <unistd.h>

#include <cerrno>

#include "log.hpp"
#include "uring/user_data.hpp"

namespace zcrelay {

Result<std::unique_ptr<Ring>> Ring::create(unsigned entries) {
    std::unique_ptr<Ring> ring(new Ring());
    io_uring_params p{};
    // SINGLE_ISSUER: only this worker thread submits, which lets the kernel skip locking.
    // DEFER_TASKRUN: completions' task work runs only when we enter the kernel to wait, in
    //   batches, instead of interrupting the thread (measured: best single-flow throughput).
    // CQSIZE at 8x entries: one connection can have several completions in flight (two polls per
    //   direction, connect + its timeout); a CQ overflow would cost a slow path, not data.
    // SUBMIT_ALL: keep submitting the rest of a batch when one SQE fails at submit time.
    p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_CQSIZE |
              IORING_SETUP_SUBMIT_ALL;
    p.cq_entries = entries * 8;
    int ret = io_uring_queue_init_params(entries, &ring->ring_, &p);
    if (ret < 0) {
        // Kernels before 6.1 lack DEFER_TASKRUN: fall back to cooperative task work.
        io_uring_params q{};
        q.flags = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_CQSIZE;
        q.cq_entries = entries * 8;
        ret = io_uring_queue_init_params(entries, &ring->ring_, &q);
        if (ret < 0) return sysError("io_uring_queue_init", -ret);
        LOG_WARN("io_uring: DEFER_TASKRUN unavailable, using COOP_TASKRUN");
        ring->flags_ = q.flags;
    } else {
        ring->flags_ = p.flags;
    }
    return ring;
}

Ring::~Ring() { io_uring_queue_exit(&ring_); }

io_uring_sqe* Ring::sqe() {
    io_uring_sqe* s = io_uring_get_sqe(&ring_);
    while (s == nullptr) {
        io_uring_submit(&ring_);
        s = io_uring_get_sqe(&ring_);
    }
    return s;
}

SendZcSupport Ring::probeSendZc() {
    SendZcSupport out;
    io_uring_probe* probe = io_uring_get_probe_ring(&ring_);
    if (probe == nullptr) return out;
    out.op = io_uring_opcode_supported(probe, IORING_OP_SEND_ZC);
    io_uring_free_probe(probe);
    if (!out.op) return out;
    io_uring_sqe* s = sqe();
    io_uring_prep_send_zc(s, -1, nullptr, 0, 0, kSendZcReportUsage);
    io_uring_sqe_set_data64(s, UserData{}.pack());
    if (io_uring_submit_and_wait(&ring_, 1) < 0) return out;
    // The failed request still has its notification allocated and posts it (its first CQE
    // says so with IORING_CQE_F_MORE): both are taken here.
    for (bool more = true; more;) {
        io_uring_cqe* cqe = nullptr;
        if (io_uring_wait_cqe(&ring_, &cqe) < 0) break;
        if (!(cqe->flags & IORING_CQE_F_NOTIF)) out.report_usage = cqe->res != -EINVAL;
        more = (cqe->flags & IORING_CQE_F_MORE) != 0;
        io_uring_cqe_seen(&ring_, cqe);
    }
    return out;
}

int Ring::submitAndWait() { return io_uring_submit_and_wait(&ring_, 1); }
int Ring::submit() { return io_uring_submit(&ring_); }

#if defined(__SANITIZE_THREAD__)
#define ZCRELAY_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ZCRELAY_TSAN 1
#endif
#endif

io_uring_sqe* Ring::prepCancel(int fd) {
    io_uring_sqe* s = sqe();
    io_uring_prep_cancel_fd(s, fd, IORING_ASYNC_CANCEL_ALL);
    io_uring_sqe_set_data64(s, UserData{}.pack());
    return s;
}

void Ring::cancel(int fd) { prepCancel(fd); }

void Ring::cancelRequest(uint64_t user_data) {
    io_uring_sqe* s = sqe();
    io_uring_prep_cancel64(s, user_data, 0);
    io_uring_sqe_set_data64(s, UserData{}.pack());
}

void Ring::cancelAndClose(int fd) {
    io_uring_sqe* s = prepCancel(fd);
#ifdef ZCRELAY_TSAN
    // TSan cannot see a close io_uring does: the fd number, reused by another thread's open,
    // looks like a race on it (every report of the TSan run was one). So the cancel is issued
    // now, while the fd still names the socket, and the close is the intercepted one.
    (void)s;
    submit();
    ::close(fd);
#else
    // Hardlinked: the close runs even when the cancel finds nothing armed.
    s->flags |= IOSQE_IO_HARDLINK;
    s = sqe();
    io_uring_prep_close(s, fd);
    io_uring_sqe_set_data64(s, UserData{}.pack());
#endif
}

void Ring::close(int fd) {
#ifdef ZCRELAY_TSAN
    ::close(fd);  // see cancelAndClose
#else
    io_uring_sqe* s = sqe();
    io_uring_prep_close(s, fd);
    io_uring_sqe_set_data64(s, UserData{}.pack());
#endif
}

}  // namespace zcrelay
