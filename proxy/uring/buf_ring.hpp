#pragma once
// A provided-buffer ring: the kernel picks a free buffer at recv time, so an idle connection
// holds no buffer at all. The copy path's memory is this pool, shared by a worker's connections
// and bounded by count x size.
//
// Two things keep what the pool touches near what is in use:
//   the stack   the kernel takes buffers from the ring in the order they were added. Were every
//               free buffer in the ring, a recycled one would come back only after all the
//               others, and one long copy transfer would touch the whole pool in turn: 16 MiB
//               resident per worker at 256 x 64 KiB. So only `provided` buffers sit in the ring;
//               the other free ones wait on a stack in user space, and the ring is topped up from
//               its top, the most recently recycled buffer, whose pages are resident already.
//   increments  with IOU_PBUF_RING_INC (Linux 6.12) a recv uses only what it received of the
//               buffer at the ring's head, and the next recv goes on where it ended: 64-byte
//               messages of many connections share one buffer instead of taking one each. Without
//               it, 50 connections' requests took more buffers at once than the ring held, and
//               each recv that found it empty (-ENOBUFS) cost a retry, a watch and its cancel
//               (2.2 SQEs per connection more, bench/costs.sh). A buffer then goes back to the
//               stack once the kernel has moved past it and every piece of it was recycled.
#include <liburing.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "result.hpp"

namespace zcrelay {

class BufRing {
  public:
    // Small messages share buffers (increments), so a few in the ring serve many connections,
    // and every buffer the ring cycles through ends up fully resident: with 32, 100,000 short
    // connections over 2 workers left 3.1 MiB more resident (SoakTest.ChurnShortConnections).
    static constexpr uint32_t kStartFill = 8;

    // liburing 2.3 has no io_uring_setup_buf_ring: map the ring ourselves and register it.
    // `count` buffers of `size` bytes, `provided` of them in the ring at a time (count a power
    // of two, provided <= count). The ring starts with kStartFill of them and grows towards
    // `provided` while recvs find it empty. Increments are asked for, and done without where the
    // kernel refuses them.
    static Result<std::unique_ptr<BufRing>> create(io_uring* ring, uint16_t group, uint32_t count,
                                                   uint32_t size, uint32_t provided);
    ~BufRing();

    uint16_t group() const { return group_; }
    uint32_t bufferSize() const { return size_; }
    char* data(uint16_t bid) { return base_ + static_cast<size_t>(bid) * size_; }
    // The piece of a buffer a recv's CQE carries (its flags have IORING_CQE_F_BUFFER): `res`
    // bytes at data(bid) + offset. Every such CQE's piece is taken here, once, and later
    // recycled, once: that is how the ring's fill is known (the kernel's head is not in shared
    // memory).
    struct Piece {
        uint16_t bid = 0;
        uint32_t offset = 0;
    };
    Piece take(uint32_t cqe_flags, int res);
    // Give a piece of buffer `bid` back (each taken piece exactly once).
    void recycle(uint16_t bid);
    // One more reference to buffer `bid`, which some piece of is taken: a zero-copy send lends
    // it to the kernel until its notification. Given back with recycle(), as a piece is.
    void hold(uint16_t bid) { ++use_[bid].pieces; }
    // A recv CQE whose bytes nobody wants (it completed as its connection closed, or after
    // its direction stopped): its piece is taken and recycled at once.
    void drop(uint32_t cqe_flags, int res) { recycle(take(cqe_flags, res).bid); }
    // Buffers in the kernel's ring now: how many recvs can get one before it runs dry.
    uint32_t inRing() const { return in_ring_; }
    // Buffers neither in the ring nor free: they hold bytes not yet sent, or are lent to the
    // kernel by a zero-copy send. 0 once every connection is gone.
    uint32_t busy() const { return count_ - in_ring_ - static_cast<uint32_t>(free_.size()); }
    uint32_t count() const { return count_; }
    // A recv found the ring empty (-ENOBUFS). If free buffers were waiting on the stack, the ring
    // held too few for the load: it holds twice as many from now on, up to `provided`.
    void ranDry();
    // Whether buffers went into the ring since the last call: a recv that found it empty
    // (-ENOBUFS) can try again. A recycled piece that frees no buffer, or a freed buffer that
    // waits on the stack because the ring is full, does not count: neither helps such a recv.
    bool replenished() {
        bool r = replenished_;
        replenished_ = false;
        return r;
    }

  private:
    BufRing() = default;
    void provide(uint16_t bid);
    void refill();

    io_uring* ring_ = nullptr;
    io_uring_buf_ring* br_ = nullptr;
    size_t ring_bytes_ = 0;
    char* base_ = nullptr;
    size_t base_bytes_ = 0;
    uint16_t group_ = 0;
    uint32_t count_ = 0;
    uint32_t size_ = 0;
    uint32_t provided_ = 0;         // the ring's fill to keep; grows on ranDry()
    uint32_t provided_max_ = 0;
    uint32_t in_ring_ = 0;          // buffers in the ring now
    std::vector<uint16_t> free_;    // free buffers not in the ring; the last recycled on top
    // Per buffer: how far recvs have filled it, the pieces of it not yet recycled, and whether
    // the kernel has moved past it (without increments, after every recv).
    struct Use {
        uint32_t filled = 0;
        uint32_t pieces = 0;
        bool left = false;
    };
    std::vector<Use> use_;
    bool replenished_ = false;
};

}  // namespace zcrelay
