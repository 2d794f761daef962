#pragma once
// One worker = one thread = one io_uring, its listening sockets, its connections, its pipes and
// buffers, its counters. Nothing else touches any of them: other threads talk to a worker only
// through post() (an eventfd the ring reads), and read its counters through WorkerStats.
//
// The worker runs the loop: it submits, waits, and hands each completion to its owner by the
// Op in its user_data (uring/user_data.hpp): accepts to the Acceptor, a connection's I/O to
// Connections (the lifecycle, which hands it on to the pump, the upstream side or the PROXY
// reader), health checks to the HealthChecker. It also keeps what is the worker's own: the
// commands other threads post (drain, stop, reload), the config generations, and the tick.
#include <linux/time_types.h>

#include <atomic>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "acceptor.hpp"
#include "access_log.hpp"
#include "config.hpp"
#include "connections.hpp"
#include "generation.hpp"
#include "handover.hpp"
#include "health_check.hpp"
#include "pipe_pool.hpp"
#include "process_shared.hpp"
#include "pump/pump.hpp"
#include "runtime.hpp"
#include "sockmap.hpp"
#include "stats.hpp"
#include "unique_fd.hpp"
#include "uring/buf_ring.hpp"
#include "uring/ring.hpp"
#include "uring/user_data.hpp"

struct io_uring_cqe;

namespace zcrelay {

class Worker {
  public:
    // `listen_fds`: this worker's sockets for rt's listeners (one or more each). `max_conns`: this
    // worker's share of the process's fd budget, in connections (2 fds each). `sockmap`
    // (shared, may be null) holds records [sockmap_base, sockmap_base + 2 * max_conns) for
    // this worker: two per connection slot.
    Worker(unsigned id, std::shared_ptr<const Runtime> rt, std::vector<ListenSocket> listen_fds,
           uint32_t max_conns, Sockmap* sockmap, uint32_t sockmap_base, ProcessShared& process);
    ~Worker();

    // Starts the thread; the future resolves once the ring is up and accepting (or failed).
    std::future<Result<void>> start();
    // Stop accepting; live connections get config.drain_timeout to finish, then are closed.
    void drain() { post(kCmdDrain); }
    // Close every connection now (a second SIGTERM).
    void stop() { post(kCmdStop); }
    // Switch to `rt` (SIGHUP): `new_fds` are this worker's sockets for the listeners of `rt`
    // whose address no listener of the current generation has. Live connections keep the
    // generation they started in.
    void reload(std::shared_ptr<const Runtime> rt, std::vector<ListenSocket> new_fds);
    // Close this worker's connections to `backend` (any generation) as `reason`: the runtime
    // API (admin_shutdown), a health check's on_marked_down and on_marked_up. `name` is the
    // backend in the log line.
    void endConnectionsOf(std::shared_ptr<BackendState> backend, CloseReason reason,
                          std::string name);
    // After a takeover (takeover.hpp), with drain(): hand the connections `out` admits over to
    // the next relay.
    void handOver(std::shared_ptr<handover::Outbound> out);
    // A connection the previous relay handed over, to relay from here on.
    void adopt(handover::HandedConn conn);
    // A wake-up ring of adopted sockmap maps (Server::adoptRing), read from now on: before the
    // connections on it that come next.
    void adoptRing(Sockmap& map, uint32_t index);
    // The generation this worker runs now (any thread): reload() is done when it reaches rt's.
    uint64_t appliedGeneration() const { return applied_generation_.load(); }
    void join();
    bool finished() const { return finished_.load(); }
    const WorkerStats& stats() const { return stats_; }

  private:
    static constexpr uint32_t kCmdDrain = 1;
    static constexpr uint32_t kCmdStop = 2;
    static constexpr uint32_t kCmdReload = 4;
    static constexpr uint32_t kCmdEndBackend = 8;
    static constexpr uint32_t kCmdHandOver = 16;
    static constexpr uint32_t kCmdAdopt = 32;

    void post(uint32_t cmd);
    void run(std::promise<Result<void>>& ready);
    Result<void> setUp();
    void loop();
    void dispatch(const io_uring_cqe* cqe);

    const Runtime& rt() const { return generations_.rt(); }
    // Commands, reload, the tick.
    void armWake();
    void onWake();
    void applyReload();
    void armTick();
    void onTick();
    // While clients wait in a cluster's queue: a timer of its own, every 10 ms, so that a place
    // another worker freed is taken within that and queue_timeout holds to it, while the sweep
    // over every connection keeps the usual tick.
    void armQueueTick();
    void onQueueTick();
    void restoreEjected();

    const unsigned id_;
    std::string name_;
    ProcessShared& process_;
    const uint32_t max_conns_;
    Sockmap* const sockmap_;
    const uint32_t sockmap_base_;
    WorkerStats stats_;
    UniqueFd wake_fd_;  // made in the constructor: any thread may post() once workers run
    int wake_errno_ = 0;
    std::atomic<uint32_t> commands_{0};
    std::atomic<bool> finished_{false};
    std::atomic<uint64_t> applied_generation_{0};
    std::thread thread_;
    // reload() -> the worker thread: taken under the mutex once per reload, never per I/O.
    std::mutex reload_mutex_;
    std::shared_ptr<const Runtime> pending_rt_;
    std::vector<ListenSocket> pending_fds_;
    struct PendingEnd {
        std::shared_ptr<BackendState> backend;
        CloseReason reason;
        std::string name;
    };
    std::vector<PendingEnd> pending_ends_;                     // endConnectionsOf()
    std::shared_ptr<handover::Outbound> pending_handover_;     // handOver()
    std::vector<handover::HandedConn> adopting_;               // adopt()
    std::vector<std::pair<Sockmap*, uint32_t>> adopting_rings_;  // adoptRing()

    // Owned by the worker thread from here on.
    Generations generations_;
    std::unique_ptr<Ring> ring_;
    std::unique_ptr<BufRing> bufs_;
    std::unique_ptr<PipePool> pipes_;
    // This worker's share of the health checks, on its ring (health_check.hpp).
    std::unique_ptr<HealthChecker> checker_;
    std::unique_ptr<ZerocopyHolds> holds_;  // the buffers zero-copy sends lent to the kernel
    std::unique_ptr<PumpEnv> pumps_;      // what the data paths share: buffers, pipes, sockmap
    std::unique_ptr<Paths> paths_;        // which pump each direction runs, and the paths' state
    std::unique_ptr<Acceptor> acceptor_;  // accepting: listeners, admission, pause and resume
    std::unique_ptr<Connections> conns_;  // the slot table and the connections' lifecycle
    uint64_t wake_value_ = 0;
    __kernel_timespec tick_{};
    __kernel_timespec queued_tick_{0, 10'000'000};  // the queue's tick (armQueueTick)
    bool queue_tick_armed_ = false;
    int64_t now_ms_ = 0;
    int64_t tick_ms_ = 100;
    bool draining_ = false;
    int64_t drain_deadline_ms_ = 0;
};

}  // namespace zcrelay
