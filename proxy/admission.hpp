#pragma once
// Who may come in, and who waits. max_connections, of the listener and of the process, shared
// by every worker, and max_connections_per_source. Two gates:
//   belowLimits  stops arming accepts at the limit, so clients wait in the kernel's accept
//                queue (backpressure, as HAProxy's maxconn) instead of being accepted and
//                closed;
//   admit        counts a connection in, exactly. Accepts armed before the limit was reached
//                (at most a batch per worker) can still complete: those connections wait,
//                accepted but not served, in the admit queue until a connection ends.
// And the fd budget's reserve: one fd held back (the spare) so that a client whose accept took
// the last free fd still gets its upstream socket, and the clients that found no fd even so,
// waiting (bounded by connect_timeout) for a closing connection to give some back.
// It lives inside the Acceptor (acceptor.hpp), which alone asks it and decides when to serve.
#include <atomic>
#include <cstdint>
#include <vector>

#include "generation.hpp"
#include "process_shared.hpp"
#include "unique_fd.hpp"
#include "uring/user_data.hpp"

namespace zcrelay {

class Admission {
  public:
    explicit Admission(ProcessShared& process);

    // Whether listener `lr` may take one more connection.
    bool belowLimits(const Runtime& rt, const ListenerRt& lr) const;
    // Counts c in against max_connections (listener and process); false at a limit.
    bool admit(Conn& c);
    // Counts c in against max_connections_per_source; false at that limit.
    bool admitSource(Conn& c);
    // A connection the previous relay handed over: counted in as admit() and admitSource() do,
    // whatever the limits (it is relaying already; refusing it would cut it).
    void adopt(Conn& c);
    // Counts c out of every limit it was counted in; true if a limit may have room now.
    bool release(Conn& c);

    // Connections accepted past a limit, oldest first.
    bool queued() const { return !queue_.empty(); }
    void enqueue(const Conn& c, uint32_t slot);
    // Hands queued connections to `serve(conn, slot)`, oldest first, while admit() lets
    // them in; `lookup(UserData)` gives the connection still Queued under that tag, or null.
    template <class Lookup, class Serve>
    void admitQueued(Lookup&& lookup, Serve&& serve);
    // Drain: every queued connection, for the caller to close; the queue is empty after.
    std::vector<uint64_t> takeQueue();

    // The spare fd is given up so one upstream socket can be opened; false if already gone.
    bool useSpareFd();
    // Takes the spare fd back; false while the process is still out of fds.
    bool holdSpareFd();
    void waitForFd(const Conn& c, uint32_t slot);
    bool fdWaiters() const { return !fd_waiters_.empty(); }
    // Hands each waiter, oldest first, to `retry(UserData)` once; a waiter that still finds no
    // fd calls waitForFd again (at the end, which keeps the order).
    template <class Retry>
    void retryFdWaiters(Retry&& retry);

  private:
    ProcessShared& process_;
    UniqueFd spare_fd_;
    std::vector<uint64_t> queue_;       // packed UserData of Queued connections
    std::vector<uint64_t> fd_waiters_;  // packed UserData of connections waiting for an fd
};

template <class Lookup, class Serve>
void Admission::admitQueued(Lookup&& lookup, Serve&& serve) {
    while (!queue_.empty()) {
        UserData ud = UserData::unpack(queue_.front());
        if (Conn* c = lookup(ud)) {
            if (!admit(*c)) return;  // still at the limit: the oldest stays first
            serve(*c, ud.slot);
        }
        queue_.erase(queue_.begin());
    }
}

template <class Retry>
void Admission::retryFdWaiters(Retry&& retry) {
    size_t n = fd_waiters_.size();
    for (size_t i = 0; i < n && !fd_waiters_.empty(); ++i) {
        UserData ud = UserData::unpack(fd_waiters_.front());
        fd_waiters_.erase(fd_waiters_.begin());
        retry(ud);
    }
}

}  // namespace zcrelay
