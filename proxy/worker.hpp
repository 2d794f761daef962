#pragma once
// One worker = one thread = one io_uring, its listening sockets, its connections, its pipes and
// buffers, its counters. Nothing else touches any of them: other threads talk to a worker only
// through post() (an eventfd the ring reads), and read its counters through WorkerStats.
#include <linux/time_types.h>

#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "config.hpp"
#include "conn.hpp"
#include "metrics.hpp"
#include "pipe_pool.hpp"
#include "pump/sockmap_pump.hpp"
#include "sockmap.hpp"
#include "unique_fd.hpp"
#include "uring/buf_ring.hpp"
#include "uring/ring.hpp"
#include "uring/user_data.hpp"

struct io_uring_cqe;

namespace zcrelay {

class Worker {
  public:
    // `listen_fds[i]` is this worker's socket for config.listeners[i]. `max_conns`: this
    // worker's share of the process's fd budget, in connections (2 fds each). `sockmap`
    // (shared, may be null) holds records [sockmap_base, sockmap_base + 2 * max_conns) for
    // this worker: two per connection slot.
    Worker(unsigned id, const Config& config, std::vector<UniqueFd> listen_fds, uint32_t max_conns,
           Sockmap* sockmap, uint32_t sockmap_base);
    ~Worker();

    // Starts the thread; the future resolves once the ring is up and accepting (or failed).
    std::future<Result<void>> start();
    // Stop accepting; live connections get config.drain_timeout to finish, then are closed.
    void drain() { post(kCmdDrain); }
    // Close every connection now (a second SIGTERM).
    void stop() { post(kCmdStop); }
    void join();
    bool finished() const { return finished_.load(); }
    const WorkerStats& stats() const { return stats_; }

  private:
    static constexpr uint32_t kCmdDrain = 1;
    static constexpr uint32_t kCmdStop = 2;

    struct ListenerState {
        UniqueFd fd;
        uint32_t armed = 0;   // single-shot accepts in flight
        bool paused = false;  // at the fd budget or on EMFILE; resumeAccepting() re-arms
        bool closed = false;
        __kernel_timespec connect_timeout{};  // read by the kernel at submit: must outlive it
    };

    void post(uint32_t cmd);
    void run(std::promise<Result<void>>& ready);
    Result<void> setUp();
    void loop();
    void dispatch(const io_uring_cqe* cqe);

    // Listening and commands.
    void armAccept(uint32_t li);
    void onAccept(uint32_t li, int res, uint32_t flags);
    void armWake();
    void onWake();
    void armTick();
    void onTick();
    // Idle timeouts and the drain deadline.
    void sweep();
    void closeListeners();
    void pauseAccepting();
    void resumeAccepting();

    // Connections.
    // A free slot, now Connecting; UINT32_MAX when the slot space is exhausted.
    uint32_t allocConn();
    Conn& conn(uint32_t slot) { return chunks_[slot / kChunk][slot % kChunk]; }
    void startConnect(Conn& c, uint32_t slot);
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
    const Config& config_;
    std::string name_;
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
    std::thread thread_;

    // Owned by the worker thread from here on.
    std::unique_ptr<Ring> ring_;
    std::unique_ptr<BufRing> bufs_;
    std::unique_ptr<PipePool> pipes_;
    std::vector<std::unique_ptr<Conn[]>> chunks_;
    uint32_t free_head_ = UINT32_MAX;
    uint32_t slots_used_ = 0;           // high-water mark of slots ever handed out
    uint32_t live_ = 0;                 // slots not Free (Closing ones included)
    uint32_t accepts_armed_ = 0;        // over all listeners: each may become a connection
    std::vector<uint64_t> fd_waiters_;  // accepted clients waiting for an fd for their upstream
    std::vector<uint64_t> starved_;     // packed UserData of copy directions waiting for a buffer
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
    bool resume_pending_ = false;  // a connection was freed while paused
    bool draining_ = false;
    int64_t drain_deadline_ms_ = 0;
};

}  // namespace zcrelay
