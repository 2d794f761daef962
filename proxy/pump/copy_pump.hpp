#pragma once
// The copy data path: io_uring recv into a provided buffer, then send from it. Bytes pass
// through user-space memory (one copy in, one out), which is what the splice path avoids; it is
// the baseline the benches compare against, the fallback when no pipe can be had, and how a
// sockmap direction moves the bytes its program passed to user space (sockmap_pump.hpp).
//
// Why single-shot recv and not multishot: a multishot recv keeps filling buffers for as long as
// the socket has data and the worker's ring has buffers, so a connection whose reader is slow
// would take the whole worker's pool. One recv in flight per direction, re-armed only while
// the direction's queue (CopyQueue::kCapacity buffers) has room, bounds memory per connection;
// measured on this kernel, multishot recv moved no more bytes (1180 vs 1046 MB/s, within the
// VM's noise).
//
// A copy direction is in one of these waits at any time:
//   waiting to read   a recv is armed on src (the kernel picks a buffer once data is there);
//   waiting to write  a send is armed on dst, or a POLLOUT after a send found no room, and a
//                     watch on src while the queue is full and no recv is armed;
//   starved           every buffer of the worker is queued somewhere: it waits for one to come
//                     back (the worker calls resume());
//   finished          src sent FIN and all of it reached dst, which was shut down for writing.
//
// Zero-copy sends (the listener's `send_zerocopy`): a send of at least kZerocopyMin bytes goes
// as IORING_OP_SEND_ZC, whose skbs carry the buffer's own pages instead of a copy of them. The
// kernel keeps those pages until the peer has acknowledged the bytes (the skb leaves the
// retransmit queue), long after the send's CQE; a second CQE, the notification
// (IORING_CQE_F_NOTIF, with the send's user_data), says when. Until then the buffer is held,
// whatever becomes of the connection: a recv must not refill pages a retransmission may still
// read. The send's CQE says whether a notification follows (IORING_CQE_F_MORE); the hold ends
// with it, or with the CQE when none follows. Holds are the worker's (ZerocopyHolds, 127 at most,
// about half the pool), each named in its send's user_data (aux), so a notification finds its
// buffer in whatever order they come, even after its connection closed. A direction takes 16 at
// most; past that, or with the worker's all taken, the next send goes plain rather than wait: a
// peer that stops acknowledging (a slow reader's zero window keeps the skbs queued too) holds at
// most 16 buffers, and such peers together at most half the pool, so recvs always find
// buffers. Sends stay plain below 16 KiB:
// notifications then cost more than the copy they save (bench/send_zc_probe on this kernel,
// 16 sends in flight: 8 KiB sends moved 1,290 MB/s, 16 KiB 2,773, a plain send about 1,950;
// 4 KiB did not move 256 MiB in a minute).
#include <liburing.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "pump/pump.hpp"
#include "uring/buf_ring.hpp"

namespace zcrelay {

// Who waits when src has nothing to read. Kernel: io_uring arms its own poll and retries. That
// fails on a sockmap socket whose passed bytes are still in the psock's backlog: poll says
// readable (the bytes arrived) while recvmsg finds the psock's queue empty, and after 128 such
// retries io_uring hands the recv to an io-wq thread that blocks (1 in 10 runs of
// ConnectionMetricsTest.FullDuplexEchoesStartNoIoWqWorker/sockmap, io_uring_queue_async_work
// opcode RECV). Caller: MSG_DONTWAIT, the recv completes with -EAGAIN and the worker waits.
enum class RecvWait : uint8_t { Kernel, Caller };
// `poll_first` (Kernel only): src is probably empty, so io_uring waits for data before its first
// try (IORING_RECVSEND_POLL_FIRST).
void prepCopyRecv(io_uring_sqe* sqe, int src, const BufRing& bufs, RecvWait wait,
                  bool poll_first = false);

// Buffers received on src and not yet fully sent to dst, in order. Bounded: recv is re-armed
// only while there is room, which is the backpressure.
struct CopyChunk {
    uint16_t bid = 0;
    uint32_t offset = 0;  // where in the buffer the recv put the bytes (BufRing::Piece)
    uint32_t len = 0;
    uint32_t sent = 0;
};
// `zerocopy`: as IORING_OP_SEND_ZC, its notification reporting a copy if `report_usage`.
void prepCopySend(io_uring_sqe* sqe, int dst, BufRing& bufs, const CopyChunk& chunk,
                  bool zerocopy = false, bool report_usage = false);

// The buffers a worker's zero-copy sends have lent to the kernel, each until its send's
// notification. A hold's number (1..kHolds; 0 = none) is the aux of its send's user_data, so
// the notification gives the buffer back wherever it arrives: to its direction, or, once the
// connection stopped relaying, through the lifecycle (returnHold). Fixed arrays: taking and
// giving back never allocate.
class ZerocopyHolds {
  public:
    static constexpr uint8_t kHolds = UserData::kMaxAux;  // 127

    // At most `limit` (<= kHolds) holds at a time.
    explicit ZerocopyHolds(uint8_t limit) {
        for (uint8_t h = limit; h >= 1; --h) free_[free_count_++] = h;
    }
    // A hold for buffer `bid`, or 0 when `limit` are taken.
    uint8_t take(uint16_t bid) {
        if (free_count_ == 0) return 0;
        uint8_t h = free_[--free_count_];
        bid_[h] = bid;
        return h;
    }
    // The buffer of hold `h`, which is free again.
    uint16_t release(uint8_t h) {
        free_[free_count_++] = h;
        return bid_[h];
    }

  private:
    std::array<uint16_t, kHolds + 1> bid_{};
    std::array<uint8_t, kHolds> free_{};
    uint8_t free_count_ = 0;
};
// A Send CQE whose connection no longer relays, so no pump sees it: if it ends a zero-copy
// send's hold (its notification, or a send CQE that says none follows), the buffer goes back,
// and a notification is counted in zcrelay_zerocopy_sends_total.
void returnHold(PumpEnv& env, uint8_t aux, int res, uint32_t flags);
inline constexpr uint8_t kDirectionHolds = 16;  // a direction's share of the worker's holds
inline constexpr uint32_t kZerocopyMin = 16 * 1024;
// Each worker's copy-path buffers (its BufRing): how many, a power of two as a buffer ring's
// must be, and their size.
inline constexpr uint32_t kCopyBuffers = 256;
inline constexpr uint32_t kCopyBufferSize = 64 * 1024;
// A worker's holds: half its buffers, at most what a user_data aux can number.
inline constexpr uint8_t kWorkerHolds =
    static_cast<uint8_t>(std::min<uint32_t>(kCopyBuffers / 2, ZerocopyHolds::kHolds));

struct CopyQueue {
    static constexpr uint8_t kCapacity = 4;
    std::array<CopyChunk, kCapacity> items;
    uint8_t head = 0;
    uint8_t count = 0;

    bool empty() const { return count == 0; }
    bool full() const { return count == kCapacity; }
    CopyChunk& front() { return items[head]; }
    void push(CopyChunk c) { items[(head + count++) % kCapacity] = c; }
    void pop() {
        head = (head + 1) % kCapacity;
        --count;
    }
};

class CopyPump {
  public:
    CopyPump() = default;
    // A splice direction falling back to copy hands over its watch: one poll per socket.
    explicit CopyPump(const SourceWatch& carried) : watch_(carried) {}

    // ---- a copy direction
    Step start(const PumpPort& p, PumpEnv& env);
    // Recv, Send, PollOut and Watch completions, and the notifications of zero-copy sends.
    Step onCompletion(const PumpPort& p, PumpEnv& env, Op op, int res, uint32_t flags,
                      uint8_t aux);
    // After Step::starved: buffers came back to the ring.
    Step resume(const PumpPort& p, PumpEnv& env);
    Step scan(const PumpPort&, PumpEnv&) { return {}; }
    uint64_t kernelBytes(PumpEnv&) { return 0; }
    void quiet(PumpEnv&) {}
    // Nothing to release before the sockets close: a send in flight still reads its buffer,
    // and a zero-copy send's pages are the kernel's until its notification.
    void abort(const PumpPort&, PumpEnv&) {}
    // The slot is freed (nothing in flight, every notification in): the queued buffers go
    // back. Holds went back with their notifications (returnHold once not relaying).
    void reclaim(PumpEnv& env);

    // ---- the parts, for a pump that moves some of its bytes by copy
    enum class Flow : uint8_t {
        Moving,   // something is armed, or it waits for a buffer
        Drained,  // src's EOF was read and every byte before it sent (dst is not shut)
        Idle,     // nothing armed, nothing queued, no EOF: `may_recv` held it back
    };
    // Arms what the queue allows: a send of its head (one at a time: two sends on one socket
    // may complete out of order when one of them has to wait for space), a recv while it has
    // room and `may_recv`, a watch on src while it is full and not reading.
    Flow advance(const PumpPort& p, PumpEnv& env, bool may_recv, RecvWait wait);

    enum class Got : uint8_t { Data, Eof, Again, Starved, Failed };
    // A Recv CQE. Data: `keep(data, len)` returns how many of the `len` bytes received into
    // `data` are to be sent (it may close up what it drops); a chunk left empty goes straight
    // back to the ring. Failed: `error` is the errno.
    template <class Keep>
    Got onRecv(const PumpPort& p, PumpEnv& env, int res, uint32_t flags, Keep&& keep, int& error);
    // A Recv CQE the caller handles itself: the recv is over, its buffer goes back.
    void recvDone(PumpEnv& env, int res, uint32_t flags);
    // A Send CQE: the bytes sent (0 when dst was full: a POLLOUT is armed), or -errno.
    int64_t onSend(const PumpPort& p, PumpEnv& env, int res, uint32_t flags);
    // Whether a Send CQE is a zero-copy send's notification; if so its hold is given back.
    bool notified(PumpEnv& env, int res, uint32_t flags, uint8_t aux);
    void pollOutDone() { poll_out_ = false; }

    SourceWatch& watch() { return watch_; }
    const SourceWatch& watch() const { return watch_; }
    bool eof() const { return eof_; }
    // Handover (handover.hpp): nothing held, nothing armed, no buffer lent to a zero-copy send:
    // the direction is all in the kernel, and crosses as its flags.
    bool empty() const {
        return queue_.empty() && !recv_armed_ && !send_armed_ && !poll_out_ && lent_ == 0;
    }
    RestingDirection resting() const { return {done_, eof_, watch_.hup, 0, true, false, {}}; }

  private:
    Step settle(const PumpPort& p, Flow flow);
    void giveBack(PumpEnv& env, uint8_t hold);

    // One bit each: a connection has two directions, so every byte here is two bytes of every
    // connection's memory, idle ones included.
    CopyQueue queue_;               // buffers in flight
    bool eof_ : 1 = false;          // src returned end of stream
    bool done_ : 1 = false;         // Drained was reported (the FIN passed on)
    bool recv_armed_ : 1 = false;   // a recv on src in flight
    bool send_armed_ : 1 = false;   // a send on dst in flight
    bool poll_out_ : 1 = false;     // POLLOUT armed on dst after a send found no room
    bool src_emptied_ : 1 = false;  // the last recv took less than a buffer: src is probably empty
    bool zerocopy_refused_ : 1 = false;  // dst refused a zero-copy send (not TCP): plain sends
    uint8_t send_hold_ = 0;         // the armed send's hold if it is a zero-copy send, else 0
    uint8_t lent_ = 0;              // holds of this direction's sends (kDirectionHolds at most)
    SourceWatch watch_;
};

template <class Keep>
CopyPump::Got CopyPump::onRecv(const PumpPort& p, PumpEnv& env, int res, uint32_t flags,
                               Keep&& keep, int& error) {
    recv_armed_ = false;
    if (p.ending && res == -ECONNRESET) res = 0;  // see PumpPort::ending
    bool has_buffer = flags & IORING_CQE_F_BUFFER;
    BufRing::Piece piece = has_buffer ? env.bufs.take(flags, res) : BufRing::Piece{};
    if (res > 0) {
        // Less than the room the buffer had: what src held is read.
        src_emptied_ = static_cast<uint32_t>(res) < env.bufs.bufferSize() - piece.offset;
        char* data = env.bufs.data(piece.bid) + piece.offset;
        CopyChunk chunk{piece.bid, piece.offset, keep(data, static_cast<uint32_t>(res)), 0};
        if (chunk.len == 0)
            env.bufs.recycle(piece.bid);
        else
            queue_.push(chunk);
        return Got::Data;
    }
    if (has_buffer) env.bufs.recycle(piece.bid);
    if (res == 0) {
        eof_ = true;
        return Got::Eof;
    }
    if (res == -ENOBUFS) {
        env.bufs.ranDry();
        // With nothing queued and nothing to send, only a watch notices an RST meanwhile.
        if (!send_armed_ && queue_.empty()) watch_.arm(p, eof_);
        return Got::Starved;
    }
    if (res == -EINTR || res == -EAGAIN) return Got::Again;
    error = -res;
    return Got::Failed;
}

}  // namespace zcrelay
