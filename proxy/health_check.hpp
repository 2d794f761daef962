#pragma once
// A worker's active health checks: each backend of a cluster with `health_check` is checked by
// one worker (its index over all checked backends, modulo the worker count), on that worker's
// ring, one step at a time:
//
//   Idle --interval--> Connect --ok--> [Send --all sent-->] [Recv --reply judged-->] passed
//                         \______________ error, timeout, wrong or missing reply ______/ failed
//
// Send is `send` or an HTTP request (http_check.hpp); Recv compares with `expect`, or reads an
// HTTP reply until its verdict (at most 16 KiB). The check goes to the backend's address, on
// health_check.port if set, or to the backend's check_address.
//
// Every step is one SQE with a linked timeout carrying what is left of health_check.timeout.
// A result moves the backend's streaks in its BackendState (shared by all workers): `fall`
// failures in a row take it down, `rise` passes bring it up. A transition may end live
// connections on every worker (ProcessShared::end_connections): the backend's own when it goes
// down and the cluster says on_marked_down: shutdown_sessions; its cluster's backups' when a
// primary comes up and it says on_marked_up: shutdown_backup_sessions.
//
// The checker owns its checks and their sockets; the worker only routes the completions whose
// op is Check, CheckTimer or CheckTimeout to it, and tells it of a new generation or a drain.
#include <linux/time_types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "process_shared.hpp"
#include "runtime.hpp"
#include "uring/ring.hpp"
#include "uring/user_data.hpp"

struct io_uring_sqe;

namespace zcrelay {

class HealthChecker {
  public:
    HealthChecker(unsigned worker_id, Ring& ring, ProcessShared& process)
        : worker_id_(worker_id), ring_(ring), process_(process) {}
    HealthChecker(const HealthChecker&) = delete;
    HealthChecker& operator=(const HealthChecker&) = delete;

    // Start, or a reload: this worker's share of `rt`'s checked backends, checked from now on.
    // The previous generation's checks are retired: their sockets close, their CQEs and timers
    // are dropped (generation mismatch). The backends' streaks live in BackendState and carry
    // over. `rt` must outlive the checks (the worker keeps its generation alive).
    void reset(const Runtime& rt);
    // Draining: no check starts any more.
    void drain() { draining_ = true; }
    // A completion of op Check, CheckTimer or CheckTimeout.
    void onCompletion(const UserData& ud, int res);

  private:
    // One check in progress or waiting for its next turn.
    struct Check {
        enum class Step : uint8_t { Idle, Connect, Send, Recv };
        const ClusterRt* cluster = nullptr;  // of the generation reset() was given
        const BackendRt* backend = nullptr;
        SocketAddress target;  // the backend's address, on health_check.port, or check_address
        std::string send;      // what it sends once connected: `send`, or the HTTP request
        bool http = false;     // the reply is judged as HTTP (http_check.hpp), not `expect`
        int fd = -1;
        Step step = Step::Idle;
        uint32_t done = 0;  // bytes of `send` sent, or of `expect` received
        int64_t deadline_us = 0;
        __kernel_timespec left{};      // the step's link timeout: read by the kernel at submit
        __kernel_timespec interval{};  // the wait until the next check
        std::string reply;             // what came back: compared with `expect`, or judged as HTTP
    };

    void start(uint32_t i);
    void step(uint32_t i);
    void onStep(uint32_t i, int res);
    void finish(uint32_t i, bool passed, const char* why);
    // A transition's effect on live connections (on_marked_down, on_marked_up).
    void endSessions(const Check& ck, bool went_up);
    void armTimer(uint32_t i);
    io_uring_sqe* sqe(uint32_t i, Op op);

    const unsigned worker_id_;
    Ring& ring_;
    ProcessShared& process_;
    std::vector<Check> checks_;
    // The previous generation's checks: a cancelled recv may still name their buffers until
    // the cancel is processed, so they are freed one reload later.
    std::vector<Check> retired_;
    uint32_t generation_ = 0;  // bumped on every reset(): older CQEs are dropped
    bool draining_ = false;
};

}  // namespace zcrelay
