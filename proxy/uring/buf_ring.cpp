#include "uring/buf_ring.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>

namespace zcrelay {
namespace {

// Linux 6.12's uapi; liburing 2.3's header predates both.
constexpr uint16_t kPbufRingInc = 2;         // IOU_PBUF_RING_INC
constexpr uint32_t kCqeBufMore = 1u << 4;    // IORING_CQE_F_BUF_MORE

}  // namespace

Result<std::unique_ptr<BufRing>> BufRing::create(io_uring* ring, uint16_t group, uint32_t count,
                                                 uint32_t size, uint32_t provided) {
    std::unique_ptr<BufRing> b(new BufRing());
    b->ring_ = ring;
    b->group_ = group;
    b->count_ = count;
    b->size_ = size;
    b->provided_max_ = std::min(provided, count);
    b->provided_ = std::min(kStartFill, b->provided_max_);
    b->ring_bytes_ = count * sizeof(io_uring_buf);
    void* r =
        mmap(nullptr, b->ring_bytes_, PROT_READ | PROT_WRITE, MAP_ANONYMOUS | MAP_PRIVATE, -1, 0);
    if (r == MAP_FAILED) return sysError("mmap buffer ring");
    b->br_ = static_cast<io_uring_buf_ring*>(r);
    // The buffers themselves: untouched pages cost nothing until a recv lands in them.
    b->base_bytes_ = static_cast<size_t>(count) * size;
    void* d =
        mmap(nullptr, b->base_bytes_, PROT_READ | PROT_WRITE, MAP_ANONYMOUS | MAP_PRIVATE, -1, 0);
    if (d == MAP_FAILED) return sysError("mmap buffers");
    b->base_ = static_cast<char*>(d);

    io_uring_buf_ring_init(b->br_);
    io_uring_buf_reg reg{};
    reg.ring_addr = reinterpret_cast<uint64_t>(b->br_);
    reg.ring_entries = count;
    reg.bgid = group;
    // liburing 2.3's io_uring_buf_reg calls the kernel's `flags` field `pad`.
    reg.pad = kPbufRingInc;
    int ret = io_uring_register_buf_ring(ring, &reg, 0);
    if (ret == -EINVAL) {  // before Linux 6.12: a buffer per recv
        reg.pad = 0;
        ret = io_uring_register_buf_ring(ring, &reg, 0);
    }
    if (ret < 0) return sysError("io_uring_register_buf_ring", -ret);
    b->use_.resize(count);
    // Reserved once: recycling never allocates. The lowest buffers go in first, and the stack
    // hands out the next lowest, so a light load keeps to the start of the mapping.
    b->free_.reserve(count);
    for (uint32_t i = count; i-- > b->provided_;) b->free_.push_back(static_cast<uint16_t>(i));
    for (uint32_t i = 0; i < b->provided_; ++i) b->provide(static_cast<uint16_t>(i));
    b->replenished_ = false;
    return b;
}

BufRing::~BufRing() {
    if (br_ != nullptr) {
        io_uring_unregister_buf_ring(ring_, group_);
        munmap(br_, ring_bytes_);
    }
    if (base_ != nullptr) munmap(base_, base_bytes_);
}

void BufRing::provide(uint16_t bid) {
    io_uring_buf_ring_add(br_, data(bid), size_, bid, io_uring_buf_ring_mask(count_), 0);
    io_uring_buf_ring_advance(br_, 1);
    ++in_ring_;
    replenished_ = true;
}

void BufRing::refill() {
    while (in_ring_ < provided_ && !free_.empty()) {
        uint16_t bid = free_.back();
        free_.pop_back();
        provide(bid);
    }
}

BufRing::Piece BufRing::take(uint32_t cqe_flags, int res) {
    Piece piece{static_cast<uint16_t>(cqe_flags >> IORING_CQE_BUFFER_SHIFT), 0};
    Use& u = use_[piece.bid];
    piece.offset = u.filled;
    if (res > 0) u.filled += static_cast<uint32_t>(res);
    ++u.pieces;
    // BUF_MORE: the buffer has room left and stays at the ring's head for the next recv.
    if (!(cqe_flags & kCqeBufMore)) {
        u.left = true;
        --in_ring_;
        refill();
    }
    return piece;
}

void BufRing::ranDry() {
    if (free_.empty() || provided_ >= provided_max_) return;  // the pool itself is spent
    provided_ = std::min(provided_ * 2, provided_max_);
    refill();
}

void BufRing::recycle(uint16_t bid) {
    Use& u = use_[bid];
    if (--u.pieces > 0 || !u.left) return;
    u = Use{};
    free_.push_back(bid);
    refill();
}

}  // namespace zcrelay
