#pragma once
// A provided-buffer ring: the kernel picks a free buffer at recv time, so an idle connection
// holds no buffer at all. The copy path's memory is this ring, shared by a worker's
// connections and bounded by count x size.
#include <liburing.h>

#include <cstdint>
#include <memory>

#include "result.hpp"

namespace zcrelay {

class BufRing {
  public:
    // liburing 2.3 has no io_uring_setup_buf_ring: map the ring ourselves and register it.
    static Result<std::unique_ptr<BufRing>> create(io_uring* ring, uint16_t group, uint32_t count,
                                                   uint32_t size);
    ~BufRing();

    uint16_t group() const { return group_; }
    uint32_t bufferSize() const { return size_; }
    char* data(uint16_t bid) { return base_ + static_cast<size_t>(bid) * size_; }
    // Give buffer `bid` back to the kernel for the next recv.
    void recycle(uint16_t bid);

  private:
    BufRing() = default;
    io_uring* ring_ = nullptr;
    io_uring_buf_ring* br_ = nullptr;
    size_t ring_bytes_ = 0;
    char* base_ = nullptr;
    size_t base_bytes_ = 0;
    uint16_t group_ = 0;
    uint32_t count_ = 0;
    uint32_t size_ = 0;
};

}  // namespace zcrelay
