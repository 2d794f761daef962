#pragma once
// Accepting, one owner: a worker's listening sockets, the accepts armed on them, who is let in
// (the Admission inside: max_connections, per source, the admit queue, the spare fd and the fd
// waiters), when accepting stops and when it resumes. The worker routes completions here (Accept
// CQEs, the tick, the end of a batch, drain, reload); Connections asks for verdicts (admit this
// one? the fds ran out; this one was released) and serves the clients let in, through Host:
// the arrow runs one way, Connections -> Acceptor, and back only through that interface.
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
//   at a limit   a listener at max_connections stops arming (limitPaused); resumption is
//                tried on every tick and after a batch in which a connection closed;
//   out of fds   every listener's accepts are cancelled (pause) until the budget has room and
//                the spare fd can be taken back (resume).
// Resuming serves the fd waiters first, then (with fds to spare) the admit queue, oldest first,
// then arms again. A release or a freed slot only marks it wanted, for the end of the batch:
// resuming there and then would serve and close connections from inside another one's close.
#include <sys/socket.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "address.hpp"
#include "admission.hpp"
#include "conn.hpp"
#include "generation.hpp"
#include "listener.hpp"
#include "process_shared.hpp"
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

    // What serves the clients the Acceptor lets in (Connections): the Acceptor decides when,
    // the host does the serving.
    class Host {
      public:
        // Slots in use, Closing ones included: the fd budget's count.
        virtual uint32_t live() const = 0;
        // A client accepted on listener `listener` of the current generation, from `peer`;
        // false when the slot space is exhausted (the Acceptor closes it).
        virtual bool accept(int fd, int32_t listener, const SocketAddress& peer) = 0;
        // The connection still Queued under `ud` (the admit queue's tag), or null.
        virtual Conn* queued(UserData ud) = 0;
        // A queued connection, admitted at last: its next step.
        virtual void serve(Conn& c, uint32_t slot) = 0;
        // Drain: a queued connection that will never be served.
        virtual void refuse(Conn& c, uint32_t slot) = 0;
        // A connection that found no fd for its upstream socket tries again (or gives up).
        virtual void retryFdWaiter(UserData ud) = 0;

      protected:
        ~Host() = default;
    };

    // `fds` are worker `worker`'s sockets for the current generation's listeners (at least one
    // per listener). `max_conns`: the worker's share of the fd budget, in connections. `pauses` counts the
    // times accepting stopped for want of fds.
    Acceptor(unsigned worker, std::vector<ListenSocket> fds, const Generations& generations,
             ProcessShared& process, uint32_t max_conns, StatCounter& pauses);

    // The ring is up and `host` serves: the first accepts are armed.
    void start(Ring& ring, Host& host);

    // ---- from the worker
    // An Accept CQE on listener li; `aux` is the user_data's, naming the address slot.
    void onAccept(uint32_t li, uint8_t aux, int res, int64_t now_ms);
    // The tick: resumption is tried whether or not a connection asked for it.
    void onTick() { resume(); }
    // The end of a completion batch: resumes if a connection ended while accepting was stopped.
    void afterBatch() {
        if (resume_wanted_) resume();
    }
    // Drain: every listener closes, every queued connection goes unserved, nothing is armed
    // again.
    void drain();
    // A reload: listeners whose address stays keep their sockets (and whatever waits in their
    // accept queues); the rest of the old ones close, the new ones open with `fds` (for the
    // listeners of `next` no current one matches). A port-0 listener matches by name too, as
    // its configured address says nothing. Called before the generation switches; armAll()
    // once it has.
    void reload(const Runtime& next, std::vector<ListenSocket> fds);
    // Arms every listener as far as the fd budget and the limits allow.
    void armAll();

    // ---- from Connections: verdicts
    // Counts c (accepted into `slot`) in against max_connections; false: c waits in the admit
    // queue, behind any already there, and is handed back through Host::serve.
    bool admit(Conn& c, uint32_t slot);
    // Counts c in against max_connections_per_source; false at that limit.
    bool admitSource(Conn& c) { return admission_.admitSource(c); }
    // c was handed over by the previous relay: counted in every limit, whatever they say.
    void adopted(Conn& c) { admission_.adopt(c); }
    // c closes: it is counted out of every limit it was counted in.
    void release(Conn& c);
    // A connection's slot went back to the free list.
    void slotFreed();
    // An upstream socket found no fd: accepting pauses. True if the spare fd was given up, so
    // that one more socket can be opened now.
    bool outOfFds();
    // c found no fd even so: it is retried (Host::retryFdWaiter) when accepting resumes.
    void waitForFd(const Conn& c, uint32_t slot) { admission_.waitForFd(c, slot); }

    // ---- state
    // Whether listener `listener` of the current generation is below its max_connections (and
    // the process below its own): accepts are armed only then.
    bool belowLimits(int32_t listener) const;
    // A listener stopped arming at max_connections, or a connection waits in the admit queue.
    bool limitPaused() const { return limit_paused_; }
    // A listener closed after a hand-over still waits for its cancelled accepts, to sweep its
    // queue: a draining worker with no connection left stays until it did.
    bool sweeping() const;

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
        uint32_t sweep = 0;     // closed after a hand-over: accepts to try once armed is 0
        bool closed = false;
    };
    struct Accepted {
        int fd = -1;              // the client's socket; -1: nothing to serve
        SocketAddress peer;       // the client's address, as the kernel wrote it at accept
        int32_t listener = -1;    // its index in the current generation's listeners
        bool out_of_fds = false;  // EMFILE and the like: pause()
    };

    const Runtime& rt() const { return generations_.rt(); }
    // Arms accepts on listener li while the budget has room for more connections beyond those
    // armed and its max_connections allow one more.
    void arm(uint32_t li);
    // What an Accept CQE on listener li brought.
    Accepted take(uint32_t li, uint8_t aux, int res, int64_t now_ms);
    // Out of fds: every listener's armed accepts are cancelled, none armed until resume().
    void pause();
    // Serves what waited for room (fd waiters, then the admit queue) and arms again, if the
    // fd budget allows.
    void resume();
    void close(Listener& l);
    // A listener closed after a hand-over, its cancelled accepts all back: accepts up to
    // l.sweep connections the cancels may have left unwoken in its queue, then closes it.
    void sweep(Listener& l);
    // The socket outlives this process's use of it: handed over (or offered) to the next
    // relay, or held by systemd (socket activation). Closed without shutdown(), what it
    // accepts served.
    bool listensOnElsewhere(const Listener& l) const;
    // The TCP options `config` asks for on client sockets, set on the listening socket: every
    // socket accepted from it inherits them.
    static void setClientOptions(const Listener& l, const ListenerConfig& config);

    const unsigned worker_;
    const Generations& generations_;
    const ProcessShared& process_;  // passed_listeners
    const uint32_t max_conns_;
    StatCounter& pauses_;
    Ring* ring_ = nullptr;  // from start()
    Host* host_ = nullptr;  // from start()
    Admission admission_;
    std::vector<Listener> listeners_;
    uint32_t armed_ = 0;     // accepts armed over all listeners: each may become a connection
    bool paused_ = false;    // out of fds: none armed until resume()
    bool limit_paused_ = false;
    // A connection ended while accepting was stopped (at a limit or out of fds).
    bool resume_wanted_ = false;
    bool draining_ = false;
    int64_t emfile_logged_ms_ = -1000000;  // rate limit for the EMFILE warning
    uint32_t emfile_unlogged_ = 0;
};

}  // namespace zcrelay
