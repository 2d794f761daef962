#pragma once
// What the pump tests (pump_test.cpp) share: a worker's pump environment built in the test's
// own process on a real io_uring, real loopback TCP connections, and a loop that does what the
// worker does with a direction's completions, one CQE at a time.
//
// One direction, as the relay sees it:
//
//   C (writer) ──TCP── A (src)   [pump]   B (dst) ──TCP── U (reader)
//
// A and B are nonblocking, as the relay's sockets are; C and U are the test's ends. The pump is
// driven exactly as Connections drives it (std::visit on the same Pump variant): start(), the
// ring submitted and waited on, every CQE of the direction handed to onCompletion(), the Step
// read back. Closing is done as the lifecycle does it: abort(), cancel and close both sockets
// on the ring, wait until every SQE the pump issued has completed (a late recv's buffer
// dropped, a zero-copy send's hold returned, as Connections::onCompletion does once a
// connection stops relaying), then reclaim().
//
// Every wait has a deadline and is a wait for an event (a CQE, an fd's readiness): nothing
// here sleeps and then looks.
#include <gtest/gtest.h>
#include <liburing.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <variant>

#include "conn.hpp"
#include "pipe_pool.hpp"
#include "pump/copy_pump.hpp"
#include "pump/pump.hpp"
#include "pump/splice_pump.hpp"
#include "stats.hpp"
#include "support/loopback.hpp"
#include "uring/buf_ring.hpp"
#include "uring/ring.hpp"
#include "uring/user_data.hpp"

namespace zcrelay::pump_test {

using namespace std::chrono_literals;
using test::Clock;
using test::Fd;
using test::Millis;

// Generous: a loaded machine may be slow, a correct pump is never this slow.
inline constexpr Millis kDeadline{10'000};

// ---------------------------------------------------------------------------------------------
// Sockets.

// One loopback TCP connection: `peer` is the test's end (blocking), `relay` the relay's
// (nonblocking, as Acceptor and openUpstreamSocket make them). Buffer sizes, when given, are set
// before the handshake so the window is scaled for them: a test that needs dst to fill up fills
// it with kilobytes, not megabytes.
struct Link {
    Fd peer;
    Fd relay;
};

inline void setBuf(int fd, int opt, int bytes) {
    if (bytes > 0) ::setsockopt(fd, SOL_SOCKET, opt, &bytes, sizeof bytes);
}

inline Link makeLink(int peer_sndbuf = 0, int peer_rcvbuf = 0, int relay_bufs = 0) {
    Link out;
    test::Listening l = test::listenLoopback(AF_INET, 4);
    if (!l.fd) {
        ADD_FAILURE() << "listen: " << l.error;
        return out;
    }
    setBuf(l.fd.get(), SO_RCVBUF, relay_bufs);
    setBuf(l.fd.get(), SO_SNDBUF, relay_bufs);
    Fd peer(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    setBuf(peer.get(), SO_SNDBUF, peer_sndbuf);
    setBuf(peer.get(), SO_RCVBUF, peer_rcvbuf);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(l.port);
    if (::connect(peer.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
        ADD_FAILURE() << "connect: " << strerror(errno);
        return out;
    }
    int one = 1;
    ::setsockopt(peer.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    out.relay = Fd(::accept4(l.fd.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!out.relay) ADD_FAILURE() << "accept: " << strerror(errno);
    ::setsockopt(out.relay.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    out.peer = std::move(peer);
    return out;
}

inline int tcpState(int fd) {
    tcp_info info{};
    socklen_t len = sizeof info;
    ::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len);
    return info.tcpi_state;
}

// True once `fd` reports one of `events` (POLLERR/POLLHUP count when asked for).
inline bool waitFd(int fd, short events, Millis timeout = kDeadline) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
        pollfd p{fd, events, 0};
        if (::poll(&p, 1, 20) > 0 && (p.revents & events) != 0) return true;
        if (Clock::now() >= deadline) return false;
    }
}

using test::Background;

// ---------------------------------------------------------------------------------------------
// The worker's side.

struct RigOptions {
    uint64_t pipes = 16;               // PipePool limit (0: splice never gets one)
    int pipe_fd_ceiling = INT32_MAX;   // PipePool fd ceiling (0: every pipe refused, Emfile)
    uint32_t buffers = 8;              // BufRing count (a power of two)
    uint32_t buffer_size = 16 * 1024;  // BufRing buffer size
    uint32_t provided = 8;             // BufRing: in the kernel's ring at most
    uint8_t holds = 4;                 // ZerocopyHolds limit
};

// One direction of one connection: its sockets, what the lifecycle keeps for it (inflight,
// the listener's flags), its UserData tag.
struct Dir {
    Link in;   // C -> A: A is src
    Link out;  // B <- U: B (relay) is dst, U (peer) reads
    uint32_t slot = 1;
    uint8_t dir = 0;
    uint32_t inflight = 0;
    bool ending = false;
    uint32_t end_left = 0;  // while ending: PumpPort::end_left
    bool zerocopy = false;
    bool src_write_shut = false;
    uint32_t pipe_size = 64 * 1024;  // no growth past the start size unless a test asks

    int src() const { return in.relay.get(); }
    int dst() const { return out.relay.get(); }
    int writer() const { return in.peer.get(); }
    int reader() const { return out.peer.get(); }
};

// What a run of completions produced.
struct Seen {
    Step last;  // the last step (its kind is the verdict)
    Op last_op = Op::Ignore;
    uint64_t moved = 0;    // sum of every step's moved
    bool starved = false;  // some step said starved
    bool timed_out = false;
    int cqes = 0;
};

inline std::string describe(const Seen& s) {
    return "kind " + std::to_string(s.last.kind) + " on_src " + std::to_string(s.last.on_src) +
           " error " + std::to_string(s.last.error) + " (" + strerror(s.last.error) + ") moved " +
           std::to_string(s.moved) + " last op " + std::to_string(static_cast<int>(s.last_op)) +
           (s.timed_out ? " TIMED OUT" : "") + " after " + std::to_string(s.cqes) + " CQEs";
}

// A completion, copied out of the ring (io_uring_cqe ends in a flexible array: not a value type).
struct Cqe {
    uint64_t user_data = 0;
    int32_t res = 0;
    uint32_t flags = 0;
};

class Rig {
  public:
    explicit Rig(RigOptions o = {}) {
        auto ring = Ring::create(64);
        if (!ring) {
            ADD_FAILURE() << "Ring::create: " << ring.error().message();
            return;
        }
        ring_ = std::move(*ring);
        // Asked first, as the worker does: nothing else may be queued yet.
        zc_ = ring_->probeSendZc();
        auto bufs = BufRing::create(ring_->raw(), 0, o.buffers, o.buffer_size, o.provided);
        if (!bufs) {
            ADD_FAILURE() << "BufRing::create: " << bufs.error().message();
            return;
        }
        bufs_ = std::move(*bufs);
        pipes_ = std::make_unique<PipePool>(o.pipes, o.pipe_fd_ceiling, stats);
        holds_ = std::make_unique<ZerocopyHolds>(o.holds);
        env_.reset(new PumpEnv{*bufs_, *pipes_, stats, zc_, *holds_});
    }
    ~Rig() {
        // Whatever a failed test left armed: cancelled and waited for, before the buffer ring
        // (and then the ring) goes.
        if (!ring_) return;
        io_uring_sqe* sqe = ring_->sqe();
        io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
        io_uring_sqe_set_data64(sqe, UserData{}.pack());
        ring_->submit();
        io_uring_cqe* cqe = nullptr;
        __kernel_timespec ts{0, 50'000'000};
        while (io_uring_wait_cqe_timeout(ring_->raw(), &cqe, &ts) == 0)
            io_uring_cqe_seen(ring_->raw(), cqe);
    }

    bool ok() const { return env_ != nullptr; }
    Ring& ring() { return *ring_; }
    PumpEnv& env() { return *env_; }
    BufRing& bufs() { return *bufs_; }
    PipePool& pipes() { return *pipes_; }

    PumpPort port(Dir& d) {
        return PumpPort{*ring_,           UserData{Op::Ignore, d.dir, d.slot, 1}.pack(),
                        d.inflight,       d.dir,
                        d.src(),          d.dst(),
                        d.src_write_shut, d.pipe_size,
                        counts,           d.ending,
                        d.ending ? &d.end_left : nullptr,
                        d.zerocopy};
    }

    // The next CQE of `slot` (a copy; the ring's entry is consumed). CQEs that carry UserData{}
    // (a cancel's, a close's: nothing to act on) are consumed and skipped, those of another
    // slot kept for whoever asks for that slot.
    std::optional<Cqe> next(uint32_t slot, Millis timeout = kDeadline) {
        for (auto it = stash_.begin(); it != stash_.end(); ++it) {
            if (UserData::unpack(it->user_data).slot == slot) {
                Cqe c = *it;
                stash_.erase(it);
                return c;
            }
        }
        auto deadline = Clock::now() + timeout;
        for (;;) {
            io_uring_cqe* cqe = nullptr;
            __kernel_timespec ts{0, 20'000'000};
            int r = io_uring_submit_and_wait_timeout(ring_->raw(), &cqe, 1, &ts, nullptr);
            if (r >= 0 && cqe != nullptr) {
                Cqe c{cqe->user_data, cqe->res, cqe->flags};
                io_uring_cqe_seen(ring_->raw(), cqe);
                UserData ud = UserData::unpack(c.user_data);
                if (ud.op == Op::Ignore) continue;
                if (ud.slot == slot) return c;
                stash_.push_back(c);
                continue;
            }
            if (Clock::now() >= deadline) return std::nullopt;
        }
    }

    // Hands d's completions to `pump` until a step is not Wait, a step is starved (when
    // `stop_on_starved`), `until(seen)` holds, or the deadline passes.
    Seen drive(Dir& d, Pump& pump, const std::function<bool(const Seen&)>& until = nullptr,
               Millis timeout = kDeadline, bool stop_on_starved = true) {
        Seen s;
        auto deadline = Clock::now() + timeout;
        while (!(until && until(s))) {
            auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
            if (left <= Millis{0}) {
                s.timed_out = true;
                break;
            }
            std::optional<Cqe> c = next(d.slot, left);
            if (!c) {
                s.timed_out = true;
                break;
            }
            apply(s, d, pump, *c);
            if (s.last.kind != Step::Wait || (stop_on_starved && s.last.starved)) break;
        }
        return s;
    }

    // One CQE of d, handed to its pump as Connections::onCompletion does.
    void apply(Seen& s, Dir& d, Pump& pump, const Cqe& c) {
        UserData ud = UserData::unpack(c.user_data);
        // IORING_CQE_F_MORE: a zero-copy send's notification follows; still in flight.
        if (!(c.flags & IORING_CQE_F_MORE)) --d.inflight;
        PumpPort p = port(d);
        Step step = std::visit(
            [&](auto& pm) { return pm.onCompletion(p, *env_, ud.op, c.res, c.flags, ud.aux); },
            pump);
        ++s.cqes;
        s.last = step;
        s.last_op = ud.op;
        s.moved += step.moved;
        if (step.starved) s.starved = true;
    }

    Step start(Dir& d, Pump& pump) {
        PumpPort p = port(d);
        return std::visit([&](auto& pm) { return pm.start(p, *env_); }, pump);
    }
    Step resume(Dir& d, Pump& pump) {
        PumpPort p = port(d);
        return std::visit([&](auto& pm) { return pm.resume(p, *env_); }, pump);
    }

    // The connection closes as Connections::closeConn and freeConn close it: the pump aborts,
    // both relay sockets are cancelled and closed on the ring, every SQE issued for the
    // direction completes, then the pump reclaims. False if some SQE never completed.
    bool close(Dir& d, Pump& pump) {
        PumpPort p = port(d);
        std::visit([&](auto& pm) { pm.abort(p, *env_); }, pump);
        for (Fd* fd : {&d.in.relay, &d.out.relay}) {
            if (!*fd) continue;
            if (d.inflight == 0)
                ring_->close(fd->release());
            else
                ring_->cancelAndClose(fd->release());
        }
        while (d.inflight > 0) {
            std::optional<Cqe> c = next(d.slot);
            if (!c) return false;
            UserData ud = UserData::unpack(c->user_data);
            if (!(c->flags & IORING_CQE_F_MORE)) --d.inflight;
            if (c->flags & IORING_CQE_F_BUFFER)
                bufs_->drop(c->flags, c->res);
            else if (ud.op == Op::Send)
                returnHold(*env_, ud.aux, c->res, c->flags);
        }
        std::visit([&](auto& pm) { pm.reclaim(*env_); }, pump);
        // The closes' own CQEs (UserData{}): the sockets are gone once they are in.
        ring_->submit();
        return true;
    }

    WorkerStats stats;
    ListenerStats counts;

  private:
    std::unique_ptr<Ring> ring_;
    std::unique_ptr<BufRing> bufs_;
    std::unique_ptr<PipePool> pipes_;
    std::unique_ptr<ZerocopyHolds> holds_;
    std::unique_ptr<PumpEnv> env_;
    std::deque<Cqe> stash_;
    SendZcSupport zc_;
};

inline Pump makePump(DataPath path) {
    Pump p;
    if (path == DataPath::Copy) p.emplace<CopyPump>();
    return p;  // Splice: the variant's first alternative
}

}  // namespace zcrelay::pump_test
