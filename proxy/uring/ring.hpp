#pragma once
// RAII owner of one io_uring. A ring belongs to the thread that created it (SINGLE_ISSUER):
// create it on the worker thread, never touch it from another.
#include <liburing.h>

#include <cstdint>
#include <memory>

#include "result.hpp"

namespace zcrelay {

// What this kernel offers for IORING_OP_SEND_ZC (Linux 6.0): whether it has the op at all, and
// whether a notification can report that the kernel copied after all
// (IORING_SEND_ZC_REPORT_USAGE, Linux 6.2; Debian 12's own 6.1 has the op but not the flag).
// liburing 2.3's headers predate these (Linux 6.2's uapi).
inline constexpr uint16_t kSendZcReportUsage = 1u << 3;   // IORING_SEND_ZC_REPORT_USAGE
inline constexpr uint32_t kNotifZcCopied = 1u << 31;      // IORING_NOTIF_USAGE_ZC_COPIED
struct SendZcSupport {
    bool op = false;
    bool report_usage = false;
};

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
    // Cancels every request armed on `fd` and leaves it open. The CQE carries UserData{}.
    void cancel(int fd);
    // Cancels the one request tagged `user_data` (its own CQE then says -ECANCELED, unless it
    // completed first). The cancel's CQE carries UserData{}.
    void cancelRequest(uint64_t user_data);
    // Closes `fd` on the ring, for a socket nothing is armed on: no cancel to match (the cancel
    // walks every request in flight on the ring). The CQE carries UserData{}.
    void close(int fd);
    // Asks the kernel once, on this ring: a SEND_ZC on no socket fails in its flag check (no
    // such flag: -EINVAL) before it looks at the fd (-EBADF). Call before any other SQE is
    // queued; a notification it may leave behind carries UserData{} (nothing to do).
    SendZcSupport probeSendZc();
    io_uring* raw() { return &ring_; }
    unsigned flags() const { return flags_; }

  private:
    Ring() = default;
    // Queues an IORING_ASYNC_CANCEL_ALL of `fd`'s requests; the SQE, for a link.
    io_uring_sqe* prepCancel(int fd);
    io_uring ring_{};
    unsigned flags_ = 0;
};

}  // namespace zcrelay
