#pragma once
// A worker's listening sockets and the accepts armed on them.
//
// Single-shot accepts, a batch at a time, never more than the fd budget has room for. A
// multishot accept is one SQE less per connection, but the kernel loops it until the backlog is
// empty: one burst could take thousands of connections past the budget and into EMFILE, where
// the fds the process needs for itself (its metrics socket) are. Nor did it pay: measured
// without that guard against 16 single-shot accepts armed, io_uring_enter calls per connection
// went from 0.25-0.27 to 0.38-0.74 and task-work runs from 0.44-0.49 to 0.62-1.21, and the
// connection rate was within noise (bench/costs.sh and bench/ab.sh; bench/results/README.md,
// "Small work").
//
// Accepting stops in two ways, and clients wait in the kernel's accept queue meanwhile:
//   at a limit   a listener at max_connections stops arming (limitPaused); the worker
//                rechecks on every tick and whenever one of its connections closes;
//   out of fds   every listener's accepts are cancelled (pause) until the budget has room and
//                the spare fd can be taken back (the worker's resume).
#include <sys/socket.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "address.hpp"
#include "runtime.hpp"
#include "stats.hpp"
#include "unique_fd.hpp"
#include "uring/ring.hpp"
#include "uring/user_data.hpp"

namespace zcrelay {

class Acceptor {
  public:
    // Accepts armed at once per listener: enough to take a burst of connections per ring
    // round trip, few enough that the fd budget is never overshot by more than the batch.
    static constexpr uint32_t kBatch = 16;

    // `fds[i]` is the worker's socket for rt.listeners[i]. `pauses` counts the times accepting
    // stopped for want of fds.
    Acceptor(std::vector<UniqueFd> fds, const Runtime& rt, StatCounter& pauses);

    uint32_t count() const { return static_cast<uint32_t>(listeners_.size()); }
    // Accepts armed over all listeners: each may become a connection.
    uint32_t armed() const { return armed_; }
    // Arms accepts on listener li while the budget has `room` connections left beyond those
    // armed and `below_limits(rt_index)` says its max_connections allow one more.
    template <class BelowLimits>
    void arm(Ring& ring, uint32_t li, uint32_t room, BelowLimits&& below_limits);

    struct Accepted {
        int fd = -1;              // the client's socket; -1: nothing to serve
        SocketAddress peer;       // the client's address, as the kernel wrote it at accept
        int32_t listener = -1;    // its index in the current generation's listeners
        bool out_of_fds = false;  // EMFILE and the like: pause()
    };
    // An Accept CQE on listener li; `aux` is the user_data's, naming the address slot.
    Accepted onAccept(uint32_t li, uint8_t aux, int res, int64_t now_ms);

    // Out of fds: every listener's armed accepts are cancelled, none armed until resume().
    void pause(Ring& ring);
    bool paused() const { return paused_; }
    void resume();
    // A listener stopped arming at max_connections, or a connection waits in the admit queue.
    bool limitPaused() const { return limit_paused_; }
    void setLimitPaused(bool on) { limit_paused_ = on; }

    // A reload: listeners whose address stays keep their socket (and whatever waits in its
    // accept queue); the rest of the old ones close, the new ones open with `fds` (the
    // listeners of `next` no current one matches, in order). A port-0 listener matches by
    // name too, as its configured address says nothing.
    void reload(Ring& ring, const Runtime& current, const Runtime& next, std::vector<UniqueFd> fds);
    // Drain: every listener closes.
    void closeAll(Ring& ring);

  private:
    // A listening socket. listeners_ only grows (an index is the Accept SQE's slot, so it must
    // stay valid while accepts are armed); a listener a reload removed stays closed in place.
    // Where the kernel writes each armed accept's peer address: it keeps the pointers until the
    // accept completes, so the block stays put (held by pointer) when listeners_ grows.
    struct PeerSlots {
        std::array<sockaddr_storage, kBatch> addr{};
        std::array<socklen_t, kBatch> len{};
        uint32_t busy = 0;  // bit i: slot i is armed
    };
    struct Listener {
        std::unique_ptr<PeerSlots> peers = std::make_unique<PeerSlots>();
        UniqueFd fd;
        SocketAddress address;  // as configured (port 0 included)
        int32_t rt_index = -1;  // its index in the current generation's listeners
        uint32_t armed = 0;     // single-shot accepts in flight
        bool closed = false;
    };
    void close(Ring& ring, Listener& l);
    // The TCP options `config` asks for on client sockets, set on the listening socket: every
    // socket accepted from it inherits them.
    static void setClientOptions(const Listener& l, const ListenerConfig& config);

    std::vector<Listener> listeners_;
    StatCounter& pauses_;
    uint32_t armed_ = 0;
    bool paused_ = false;
    bool limit_paused_ = false;
    int64_t emfile_logged_ms_ = -1000000;  // rate limit for the EMFILE warning
    uint32_t emfile_unlogged_ = 0;
};

template <class BelowLimits>
void Acceptor::arm(Ring& ring, uint32_t li, uint32_t room, BelowLimits&& below_limits) {
    Listener& l = listeners_[li];
    while (!l.closed && !paused_ && l.armed < kBatch && armed_ < room) {
        if (!below_limits(l.rt_index)) {
            if (l.armed == 0) limit_paused_ = true;
            break;
        }
        io_uring_sqe* sqe = ring.sqe();
        // A free address slot: at most kBatch are armed, so there is one. The peer's address
        // comes with the accept, not from a getpeername() per connection.
        const auto at = static_cast<uint8_t>(__builtin_ctz(~l.peers->busy));
        l.peers->busy |= 1u << at;
        l.peers->len[at] = sizeof(sockaddr_storage);
        // The accepted sockets come out nonblocking, as the inline splice needs.
        io_uring_prep_accept(sqe, l.fd.get(), reinterpret_cast<sockaddr*>(&l.peers->addr[at]),
                             &l.peers->len[at], SOCK_NONBLOCK | SOCK_CLOEXEC);
        io_uring_sqe_set_data64(sqe, UserData{Op::Accept, 0, li, 0, at}.pack());
        ++l.armed;
        ++armed_;
    }
}

}  // namespace zcrelay
