#pragma once
// The only place a completion's identity is packed into io_uring's 64-bit user_data.
//
//   bit  0..4   Op          what the SQE was (32 at most)
//   bit  5      direction   0 = client->upstream, 1 = upstream->client (per-connection ops)
//   bit  6..12  aux         what the op needs to name besides its slot: for a zero-copy Send,
//                           its hold (1..127, pump/copy_pump.hpp), which its notification
//                           brings back in the same user_data; 0 otherwise
//   bit 13..31  slot        connection slot, listener index for Accept, check for Check*
//                           (524,287 at most: a worker's connections are bounded by the
//                           process's fds, 20,000 here)
//   bit 32..63  generation  the slot's generation when the SQE was issued
//
// A slot is reused only after every SQE issued for it has completed (Conn::inflight), so a
// generation mismatch means a bookkeeping bug; the worker logs it and drops the CQE rather
// than acting on another connection.
#include <cstdint>

namespace zcrelay {

enum class Op : uint8_t {
    Ignore = 0,      // cancel / close / shutdown SQEs whose CQE carries nothing we act on
    Accept,          // a single-shot accept on a listener (slot = listener index)
    Wake,            // read on the worker's eventfd: another thread posted a command
    Tick,            // the worker's periodic timeout: idle sweeps, drain deadline, accept resume
    Connect,         // upstream connect
    ConnectTimeout,  // the link timeout bounding Connect
    PollIn,          // readability of a direction's source socket
    PollOut,         // writability of a direction's destination socket
    Watch,           // POLLRDHUP on a source not being read: notices an RST while dst is full
    Recv,            // copy path: recv into a provided buffer
    Send,            // copy path: send from a provided buffer
    Barrier,         // sockmap: a timer to look at a barrier (or the EOF) again
    PathSignal,      // the sockmap program's wake-up ring is readable (pump/paths.hpp)
    ProxyRead,       // accept_proxy: the client's PROXY header (or enough of it) is readable
    HelloRead,       // routes: the client's TLS ClientHello (or enough of it) is readable
    Check,           // health check I/O: connect, send or recv (slot = check index)
    CheckTimeout,    // the linked timeout bounding a check's I/O
    CheckTimer,      // the wait until a backend's next check
    QueueWatch,      // multishot POLLERR|POLLHUP on a client waiting in its cluster's queue
    FinishedWatch,   // multishot POLLERR|POLLHUP on a finished direction's source (its peer's RST)
};

// FinishedWatch is the last Op: one added after it moves this check.
static_assert(static_cast<uint8_t>(Op::FinishedWatch) < 32, "Op has 5 bits in user_data");

struct UserData {
    Op op = Op::Ignore;
    uint8_t dir = 0;
    uint32_t slot = 0;
    uint32_t generation = 0;
    uint8_t aux = 0;

    static constexpr uint32_t kMaxSlot = (1u << 19) - 1;
    static constexpr uint8_t kMaxAux = (1u << 7) - 1;
    static constexpr uint8_t kOpMask = (1u << 5) - 1;

    // The low bits of a packed value: an op and its aux, for a tag that has the rest.
    static constexpr uint64_t opBits(Op op, uint8_t aux = 0) {
        return (static_cast<uint64_t>(op) & kOpMask) | (static_cast<uint64_t>(aux & kMaxAux) << 6);
    }
    constexpr uint64_t pack() const {
        return opBits(op, aux) | (static_cast<uint64_t>(dir & 1) << 5) |
               (static_cast<uint64_t>(slot & kMaxSlot) << 13) |
               (static_cast<uint64_t>(generation) << 32);
    }
    static constexpr UserData unpack(uint64_t v) {
        return UserData{static_cast<Op>(v & kOpMask), static_cast<uint8_t>((v >> 5) & 1),
                        static_cast<uint32_t>((v >> 13) & kMaxSlot),
                        static_cast<uint32_t>(v >> 32), static_cast<uint8_t>((v >> 6) & kMaxAux)};
    }
    friend constexpr bool operator==(const UserData&, const UserData&) = default;
};

}  // namespace zcrelay
