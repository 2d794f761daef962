#pragma once
// A provided-buffer ring: the kernel picks a free buffer at recv time, so an idle connection
// holds no buffer at all. The copy path's memory is this pool, shared by a worker's connections
// and bounded by count x size.
//
// The kernel takes buffers from the ring in the order they were added. Were every free buffer
// in the ring, a recycled one would come back only after all the others, and a long copy
// transfer would touch the whole pool in turn: RSS would grow to count x size per worker (16 MiB
// at 256 x 64 KiB) for a single connection. So only `provided` buffers sit in the ring; the
// other free ones wait on a stack in user space, and the ring is topped up from its top, the
// most recently recycled buffer, whose pages are resident already. The pages touched stay near
// the most buffers ever in use at once, plus `provided`.
#include <liburing.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "result.hpp"

namespace zcrelay {

class BufRing {
  public:
    // liburing 2.3 has no io_uring_setup_buf_ring: map the ring ourselves and register it.
    // `count` buffers of `size` bytes, `provided` of them in the ring at a time (count a power
    // of two, provided <= count).
    static Result<std::unique_ptr<BufRing>> create(io_uring* ring, uint16_t group, uint32_t count,
                                                   uint32_t size, uint32_t provided);
    ~BufRing();

    uint16_t group() const { return group_; }
    uint32_t bufferSize() const { return size_; }
    char* data(uint16_t bid) { return base_ + static_cast<size_t>(bid) * size_; }
    // The buffer a CQE carries (its flags have IORING_CQE_F_BUFFER): the kernel took it from
    // the ring. Every such CQE's buffer is taken here, once, and later recycled, once: that is
    // how the ring's fill is known (the kernel's head is not in shared memory).
    uint16_t take(uint32_t cqe_flags);
    // Give buffer `bid` back (each taken buffer exactly once).
    void recycle(uint16_t bid);
    // Whether buffers went into the ring since the last call: a recv that found it empty
    // (-ENOBUFS) while free buffers waited on the stack can try again.
    bool replenished() {
        bool r = replenished_;
        replenished_ = false;
        return r;
    }
    // Buffers taken and not yet recycled: what the copy paths hold.
    uint32_t inUse() const { return count_ - in_ring_ - static_cast<uint32_t>(free_.size()); }

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
    uint32_t provided_ = 0;         // the ring's fill to keep
    uint32_t in_ring_ = 0;          // buffers in the ring now
    std::vector<uint16_t> free_;    // free buffers not in the ring; the last recycled on top
    bool replenished_ = false;
};

}  // namespace zcrelay
