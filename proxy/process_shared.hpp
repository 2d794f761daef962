#pragma once
// What the workers, the main thread and the metrics share for the whole process, besides the
// Runtime (runtime.hpp): a handful of atomics and the access log. Written rarely (once per
// connection at most), read at scrape time.
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "address.hpp"
#include "http_stats.hpp"
#include "loop_guard.hpp"
#include "reasons.hpp"
#include "signals.hpp"

namespace zcrelay {

class AccessLog;
class Discovery;
struct AdminStats;
struct BackendState;

// zcrelay_takeovers_total's results (takeover.hpp): as the giver, then as the new process.
inline constexpr std::array<const char*, 5> kTakeoverResults = {"handed_over", "failed", "refused",
                                                                "taken_over", "fallback"};
inline size_t takeoverResult(std::string_view result) {
    for (size_t i = 0; i < kTakeoverResults.size(); ++i)
        if (result == kTakeoverResults[i]) return i;
    return 0;
}

// handover::Outcome's count (handover.hpp).
inline constexpr size_t kHandoverResults = 5;

struct ProcessShared {
    std::atomic<uint32_t> live{0};    // connections over all listeners (Config::max_connections)
    AccessLog* access_log = nullptr;  // null when off
    std::atomic<bool> draining{false};
    bool sockmap_loaded = false;  // set at start, before any worker runs
    std::atomic<uint64_t> reloads_ok{0};
    std::atomic<uint64_t> reloads_failed{0};
    // Signals taken, by kSignals index.
    std::array<std::atomic<uint64_t>, kSignals.size()> signals{};
    HttpStats endpoint;  // the metrics endpoint's servers
    AdminStats* admin = nullptr;  // the runtime API's counts (set at start)
    // Discovery, from the start or the first reload that needs it; lives as long as the Server.
    std::atomic<const Discovery*> discovery{nullptr};
    // Every worker's upstream sockets, for the accepts that come back from one of them.
    LoopGuard loops;
    // Listen addresses whose socket systemd passed (socket activation): set at start, before any
    // worker runs. Such a socket is the service manager's, kept across the relay's restarts, and
    // is closed, never shut down (Acceptor::close).
    std::vector<SocketAddress> passed_listeners;
    // The next relay took the listening sockets over (takeover.hpp): set before the drain, so
    // that the drain closes them without shutdown() (they listen on in that process) and serves
    // what it accepted as it stopped.
    std::atomic<bool> listeners_handed_over{false};
    // Offered to a taker that is not ready yet (takeover.hpp): a drain that starts meanwhile
    // closes them without shutdown() too, as the taker may be about to listen on them.
    std::atomic<bool> listeners_offered{false};
    std::array<std::atomic<uint64_t>, kTakeoverResults.size()> takeovers{};
    // zcrelay_handover_connections_total, by handover::Outcome.
    std::array<std::atomic<uint64_t>, kHandoverResults> handovers{};
    // Closes a backend's live connections on every worker (each closes its own), as
    // `reason`; `backend` names it in their log lines. Set at start, before any worker runs:
    // a health check's on_marked_down and on_marked_up, and the runtime API.
    std::function<void(std::shared_ptr<BackendState>, CloseReason, const std::string& backend)>
        end_connections;
};

}  // namespace zcrelay
