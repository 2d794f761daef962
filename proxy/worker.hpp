#pragma once
// One worker = one thread = one io_uring, its listening sockets, its connections, its pipes and
// buffers, its counters. Nothing else touches any of them: other threads talk to a worker only
// through post() (an eventfd the ring reads), and read its counters through WorkerStats.
#include <linux/time_types.h>

#include <atomic>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "access_log.hpp"
#include "config.hpp"
#include "conn.hpp"
#include "health_check.hpp"
#include "pipe_pool.hpp"
#include "process_shared.hpp"
#include "proxy_protocol.hpp"
#include "pump/sockmap_pump.hpp"
#include "runtime.hpp"
#include "sockmap.hpp"
#include "stats.hpp"
#include "unique_fd.hpp"
#include "uring/buf_ring.hpp"
#include "uring/ring.hpp"
#include "uring/user_data.hpp"

struct io_uring_cqe;

namespace zcrelay {

// A Runtime as one worker uses it: its Balancers (worker-local state) and how many of this
// worker's connections still belong to it. The newest is current; older ones live on while
// their connections do.
struct Generation {
    std::shared_ptr<const Runtime> rt;
    std::vector<Balancer> balancers;  // per rt->clusters
    uint32_t live = 0;
};

class Worker {
  public:
    // `listen_fds[i]` is this worker's socket for rt->listeners[i]. `max_conns`: this
    // worker's share of the process's fd budget, in connections (2 fds each). `sockmap`
    // (shared, may be null) holds records [sockmap_base, sockmap_base + 2 * max_conns) for
    // this worker: two per connection slot.
    Worker(unsigned id, std::shared_ptr<const Runtime> rt, std::vector<UniqueFd> listen_fds,
           uint32_t max_conns, Sockmap* sockmap, uint32_t sockmap_base, ProcessShared& process);
    ~Worker();

    // Starts the thread; the future resolves once the ring is up and accepting (or failed).
    std::future<Result<void>> start();
    // Stop accepting; live connections get config.drain_timeout to finish, then are closed.
    void drain() { post(kCmdDrain); }
    // Close every connection now (a second SIGTERM).
    void stop() { post(kCmdStop); }
    // Switch to `rt` (SIGHUP): `new_fds` are this worker's sockets for the listeners of `rt`
    // whose address no listener of the current generation has, in rt order. Live connections
    // keep the generation they started in.
    void reload(std::shared_ptr<const Runtime> rt, std::vector<UniqueFd> new_fds);
    // The generation this worker runs now (any thread): reload() is done when it reaches rt's.
    uint64_t appliedGeneration() const { return applied_generation_.load(); }
    void join();
    bool finished() const { return finished_.load(); }
    const WorkerStats& stats() const { return stats_; }

  private:
    static constexpr uint32_t kCmdDrain = 1;
    static constexpr uint32_t kCmdStop = 2;
    static constexpr uint32_t kCmdReload = 4;

    // A listening socket. listeners_ only grows (an index is the Accept SQE's slot, so it must
    // stay valid while accepts are armed); a listener a reload removed stays closed in place.
    struct ListenerState {
        UniqueFd fd;
        SocketAddress address;  // as configured (port 0 included)
        int32_t rt_index = -1;  // its index in the current generation's listeners
        uint32_t armed = 0;     // single-shot accepts in flight
        bool paused = false;    // at the fd budget or on EMFILE; resumeAccepting() re-arms
        bool closed = false;
    };

    void post(uint32_t cmd);
    void run(std::promise<Result<void>>& ready);
    Result<void> setUp();
    void loop();
    void dispatch(const io_uring_cqe* cqe);

    // Listening and commands.
    const Runtime& rt() const { return *generations_.back()->rt; }
    // Whether listener li may take one more connection (max_connections, listener and global).
    bool belowLimits(const ListenerState& l) const;
    // Counts c in against max_connections (listener and process); false at a limit.
    bool admit(Conn& c);
    // An admitted connection's next step: its PROXY header, or its backend.
    void serve(Conn& c, uint32_t slot);
    void admitQueued();
    void applyReload();
    void closeListener(ListenerState& l);
    void armAccept(uint32_t li);
    void onAccept(uint32_t li, int res, uint32_t flags);
    void armWake();
    void onWake();
    void armTick();
    void onTick();
    // Idle timeouts and the drain deadline.
    void sweep();
    void closeListeners();
    void restoreEjected();
    void pauseAccepting();
    void resumeAccepting();

    // Connections.
    // A free slot, now Connecting; UINT32_MAX when the slot space is exhausted.
    uint32_t allocConn();
    Conn& conn(uint32_t slot) { return chunks_[slot / kChunk][slot % kChunk]; }
    const ListenerConfig& lc(const Conn& c) const {
        return c.gen->rt->listeners[c.listener].config;
    }
    ListenerStats& lstats(const Conn& c) {
        return c.gen->rt->listeners[c.listener].shared->stats[id_];
    }
    const ClusterRt& cluster(const Conn& c) const {
        return c.gen->rt->clusters[c.gen->rt->listeners[c.listener].cluster];
    }
    // The client's address (getpeername, once), for whatever needs it.
    const SocketAddress& clientAddress(Conn& c);
    // False (and c closed) when the client's address is at max_connections_per_source.
    bool admitSource(Conn& c, uint32_t slot);
    void releaseSource(Conn& c);
    void startConnect(Conn& c, uint32_t slot);
    // accept_proxy: wait for the client's PROXY header, parse it, consume exactly it.
    void startProxyRead(Conn& c, uint32_t slot);
    void onProxyReadable(Conn& c, uint32_t slot, int res);
    void proxyFailed(Conn& c, uint32_t slot, ProxyFailure why);
    // A backend for the next connect attempt, -1 if none is up (and untried).
    int pickBackend(Conn& c);
    void connectBackend(Conn& c, uint32_t slot);
    void onConnectFailed(Conn& c, uint32_t slot, int err);
    bool sendProxyHeader(Conn& c, uint32_t slot);
    void logConnection(Conn& c, CloseReason reason);

    void retryFdWaiters();
    void onConnect(Conn& c, uint32_t slot, int res);
    void startDirection(Conn& c, uint32_t slot, int d);
    void closeConn(Conn& c, uint32_t slot, CloseReason reason);
    void freeConn(Conn& c, uint32_t slot);
    void failDirection(Conn& c, uint32_t slot, int d, bool on_src, int err);

    // Splice path.
    void armPollIn(Conn& c, uint32_t slot, int d);
    void armPollOut(Conn& c, uint32_t slot, int d);
    void armWatch(Conn& c, uint32_t slot, int d);
    void onPollIn(Conn& c, uint32_t slot, int d, int res);
    void onWatch(Conn& c, uint32_t slot, int d, int res);
    void pumpSpliceDir(Conn& c, uint32_t slot, int d);

    // Sockmap path.
    void startSockmap(Conn& c, uint32_t slot);
    bool hasPassedBytes(const Conn& c, int d) const;
    // Back to the kernel path: watch for the FIN, unless passed bytes or the FIN wait.
    void startRedirecting(Conn& c, uint32_t slot, int d);
    void onSockmapWatch(Conn& c, uint32_t slot, int d, int res);
    void sockmapEof(Conn& c, uint32_t slot, int d);
    void startCatchUp(Conn& c, uint32_t slot, int d);
    void catchUp(Conn& c, uint32_t slot, int d);
    void sockmapFinBarrier(Conn& c, uint32_t slot, int d);
    // True if the barrier `b` is passed; otherwise it waits (timer) or failed (closed).
    bool barrierDone(Conn& c, uint32_t slot, int d, const SockmapBarrier& b);
    void waitBarrier(Conn& c, uint32_t slot, int d, uint64_t remaining);
    // A timer for onBarrier; `back_off`: wait longer than last time (nothing moved).
    void armBarrier(Conn& c, uint32_t slot, int d, bool back_off);
    void onBarrier(Conn& c, uint32_t slot, int d);
    void armSockmapScan();
    void onSockmapScan();
    // Cuts what the program marked as seen before (relay.bpf.c) out of `len` passed bytes just
    // received into `data`; returns how many are left.
    uint32_t dropReplayed(Conn& c, int d, char* data, uint32_t len);
    // Resets c if the program found its stream beyond repair; true if it did.
    bool sockmapBroken(Conn& c, uint32_t slot);
    // Adds what the program counted since the last look to the byte metrics.
    void foldSockmapBytes(Conn& c);

    // Copy path.
    void advanceCopy(Conn& c, uint32_t slot, int d);
    void onRecv(Conn& c, uint32_t slot, int d, int res, uint32_t flags);
    void onSend(Conn& c, uint32_t slot, int d, int res);
    void retryStarved();

    io_uring_sqe* sqeFor(Conn& c, uint32_t slot, Op op, int d);
    void addBytes(Conn& c, int d, uint64_t n);
    void finishDirection(Conn& c, uint32_t slot, int d);

    static constexpr uint32_t kChunk = 256;

    const unsigned id_;
    std::string name_;
    ProcessShared& process_;
    const uint32_t max_conns_;
    Sockmap* const sockmap_;
    const uint32_t sockmap_base_;
    WorkerStats stats_;
    std::vector<ListenerState> listeners_;
    UniqueFd wake_fd_;
    // One fd held in reserve: when accept() took the last free fd, giving this up lets that
    // client still get its upstream socket instead of being dropped.
    UniqueFd spare_fd_;
    std::atomic<uint32_t> commands_{0};
    std::atomic<bool> finished_{false};
    std::atomic<uint64_t> applied_generation_{0};
    std::thread thread_;
    // reload() -> the worker thread: taken under the mutex once per reload, never per I/O.
    std::mutex reload_mutex_;
    std::shared_ptr<const Runtime> pending_rt_;
    std::vector<UniqueFd> pending_fds_;

    // Owned by the worker thread from here on.
    std::vector<std::unique_ptr<Generation>> generations_;  // back(): the current one
    std::unique_ptr<Ring> ring_;
    std::unique_ptr<BufRing> bufs_;
    std::unique_ptr<PipePool> pipes_;
    std::vector<std::unique_ptr<Conn[]>> chunks_;
    uint32_t free_head_ = UINT32_MAX;
    uint32_t slots_used_ = 0;     // high-water mark of slots ever handed out
    uint32_t live_ = 0;           // slots not Free (Closing ones included)
    uint32_t accepts_armed_ = 0;  // over all listeners: each may become a connection
    // This worker's share of the health checks, on its ring (health_check.hpp).
    std::unique_ptr<HealthChecker> checker_;
    std::vector<uint8_t> scratch_;       // PROXY headers are peeked into this
    std::vector<uint64_t> admit_queue_;  // accepted past max_connections, oldest first
    std::vector<uint64_t> fd_waiters_;   // accepted clients waiting for an fd for their upstream
    std::vector<uint64_t> starved_;      // packed UserData of copy directions waiting for a buffer
    std::vector<uint64_t> starved_retry_;  // swapped with starved_: both reserved, no allocation
    bool buffers_freed_ = false;           // a buffer went back to the ring since the last retry
    uint64_t wake_value_ = 0;
    __kernel_timespec tick_{};
    int64_t now_ms_ = 0;
    int64_t tick_ms_ = 100;
    uint32_t sockmap_conns_ = 0;           // connections with records; the scan runs while > 0
    int64_t emfile_logged_ms_ = -1000000;  // rate limit for the EMFILE warning
    uint32_t emfile_unlogged_ = 0;
    bool accept_paused_ = false;   // listeners paused for want of fds (not for draining)
    bool limit_paused_ = false;    // a listener stopped arming accepts at max_connections
    bool resume_pending_ = false;  // a connection was freed while paused
    bool draining_ = false;
    int64_t drain_deadline_ms_ = 0;
};

}  // namespace zcrelay
