#pragma once
// The copy data path: io_uring recv into a provided buffer, then send from it. Bytes pass
// through user-space memory (one copy in, one out), which is what the splice path avoids; it is
// the baseline the benches compare against and the fallback when no pipe can be had.
//
// Why single-shot recv and not multishot: a multishot recv keeps filling buffers for as long as
// the socket has data and the worker's ring has buffers, so a connection whose reader is slow
// would take the whole worker's pool. One recv in flight per direction, re-armed only while
// the direction's queue (CopyQueue::kCapacity buffers) has room, bounds memory per connection;
// measured on this kernel, multishot recv moved no more bytes (1180 vs 1046 MB/s, within the
// VM's noise).
#include <liburing.h>

#include "conn.hpp"
#include "uring/buf_ring.hpp"

namespace zcrelay {

// Who waits when src has nothing to read. Kernel: io_uring arms its own poll and retries. That
// fails on a sockmap socket whose passed bytes are still in the psock's backlog: poll says
// readable (the bytes arrived) while recvmsg finds the psock's queue empty, and after 128 such
// retries io_uring hands the recv to an io-wq thread that blocks (1 in 10 runs of
// ConnectionMetricsTest.FullDuplexEchoesStartNoIoWqWorker/sockmap, io_uring_queue_async_work
// opcode RECV). Caller: MSG_DONTWAIT, the recv completes with -EAGAIN and the worker waits.
enum class RecvWait : uint8_t { Kernel, Caller };
void prepCopyRecv(io_uring_sqe* sqe, int src, const BufRing& bufs, RecvWait wait);
void prepCopySend(io_uring_sqe* sqe, int dst, BufRing& bufs, const CopyChunk& chunk);

// What a copy direction should have in flight next, given its queue.
struct CopyNext {
    bool arm_send = false;
    bool arm_recv = false;
    bool finish = false;  // EOF read and every byte sent: shut dst down for writing
};
CopyNext copyNext(const Direction& d);

}  // namespace zcrelay
