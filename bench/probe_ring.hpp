#pragma once
// The io_uring the probes (msg_ring_probe, send_zc_probe) measure with, set up as zcrelay's
// workers set theirs up. Construct it on the thread that uses it: SINGLE_ISSUER binds the ring
// to its creator (the kernel returns -EEXIST to any other submitter), and DEFER_TASKRUN runs
// completion work only when that thread enters the kernel to wait. A failing call ends the
// probe through `die(what, errno)`, so no caller goes on with a ring it does not have.
#include <liburing.h>

#include <cerrno>

namespace bench {

class ProbeRing {
  public:
    using Die = void (*)(const char* what, int err);

    ProbeRing(unsigned entries, Die die) : die_(die) {
        io_uring_params p{};
        // SINGLE_ISSUER: only this thread submits, so the kernel skips submission locking.
        // DEFER_TASKRUN: completion task work waits until we wait; a cross-ring message then
        // arrives as remote task work that wakes us, the path a worker would take.
        p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
        if (int rc = io_uring_queue_init_params(entries, &ring_, &p); rc < 0)
            die_("io_uring_queue_init_params", -rc);
    }
    ~ProbeRing() { io_uring_queue_exit(&ring_); }
    ProbeRing(const ProbeRing&) = delete;
    ProbeRing& operator=(const ProbeRing&) = delete;

    io_uring* raw() { return &ring_; }
    int fd() const { return ring_.ring_fd; }
    // A free SQE; the probes keep fewer in flight than the ring has entries.
    io_uring_sqe* sqe() {
        io_uring_sqe* s = io_uring_get_sqe(&ring_);
        if (!s) die_("io_uring_get_sqe", EBUSY);
        return s;
    }
    void submit() {
        if (int rc = io_uring_submit(&ring_); rc < 0) die_("io_uring_submit", -rc);
    }
    // Submit what is queued and block until at least one CQE is there: one io_uring_enter, as a
    // worker's event loop does it.
    void submitAndWait() {
        if (int rc = io_uring_submit_and_wait(&ring_, 1); rc < 0 && rc != -EINTR)
            die_("io_uring_submit_and_wait", -rc);
    }

  protected:
    Die die_;

  private:
    io_uring ring_{};
};

}  // namespace bench
