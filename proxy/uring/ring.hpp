#pragma once
// RAII owner of one io_uring. A ring belongs to the thread that created it (SINGLE_ISSUER):
// create it on the worker thread, never touch it from another.
#include <liburing.h>

#include <memory>

#include "result.hpp"

namespace zcrelay {

class Ring {
  public:
    static Result<std::unique_ptr<Ring>> create(unsigned entries);
    ~Ring();
    Ring(const Ring&) = delete;
    Ring& operator=(const Ring&) = delete;

    // A free SQE. When the SQ is full the queued SQEs are submitted first, so this never fails
    // while the kernel accepts submissions.
    io_uring_sqe* sqe();
    // Submit what is queued and wait for at least one CQE (task work runs here: DEFER_TASKRUN).
    int submitAndWait();
    int submit();
    // Cancels every request armed on `fd`, then closes it. In-flight requests hold references
    // to the file, so only this frees the socket; the cancel is matched by file when it is
    // issued, so it must go in before the close. Both CQEs carry UserData{} (nothing to do).
    void cancelAndClose(int fd);
    // Closes `fd` on the ring, for a socket nothing is armed on: no cancel to match (the cancel
    // walks every request in flight on the ring). The CQE carries UserData{}.
    void close(int fd);
    io_uring* raw() { return &ring_; }
    unsigned flags() const { return flags_; }

  private:
    Ring() = default;
    io_uring ring_{};
    unsigned flags_ = 0;
};

}  // namespace zcrelay
