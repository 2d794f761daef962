#pragma once
// What the relay counts: plain per-thread counters, with no HTTP or Prometheus in sight.
//
// Workers keep them (WorkerStats, and ListenerStats per listener and worker): one writer each,
// so an increment is a relaxed load + store (a plain mov on x86), never a locked instruction or
// a mutex on the data path. The metrics collector (metrics.hpp) reads them at scrape time and
// sums all workers; a relaxed read may lag a few increments behind, never tears.
#include <array>
#include <atomic>
#include <cstdint>
#include <string_view>

#include "data_path.hpp"
#include "proxy_protocol.hpp"
#include "reasons.hpp"

namespace zcrelay {

class StatCounter {
  public:
    void add(uint64_t n = 1) {
        v_.store(v_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
    }
    void sub(uint64_t n = 1) {
        v_.store(v_.load(std::memory_order_relaxed) - n, std::memory_order_relaxed);
    }
    // For a value the worker copies from elsewhere (a kernel counter in the ring).
    void set(uint64_t v) { v_.store(v, std::memory_order_relaxed); }
    uint64_t get() const { return v_.load(std::memory_order_relaxed); }

  private:
    std::atomic<uint64_t> v_{0};
};

// A histogram of microsecond observations against upper bounds in seconds: per-bucket counts
// (not cumulative; the last is +Inf) and the sum, each with one writer like StatCounter.
template <size_t N>
struct UsHistogram {
    std::array<StatCounter, N + 1> buckets;
    StatCounter sum_us;

    void observe(const std::array<double, N>& bounds, uint64_t us) {
        size_t b = 0;
        while (b<N&& static_cast<double>(us)> bounds[b] * 1e6) ++b;
        buckets[b].add();
        sum_us.add(us);
    }
};

// Upper bounds (seconds) of the connection duration histogram: 1 ms to an hour, the span from
// a health probe to a long-lived tunnel.
inline constexpr std::array<double, 16> kDurationBuckets = {
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800, 3600, 7200};

// Upper bounds (seconds) of the inspection time histogram: from a ClientHello already queued
// at accept (tens of microseconds) to one that trickles in up to the longest inspect_timeout.
inline constexpr std::array<double, 14> kInspectBuckets = {
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30};

struct ListenerStats {
    StatCounter accepted;
    StatCounter handed_in;  // connections the previous relay handed over (handover.hpp)
    // [direction][data path]: direction 0 is client -> upstream, 1 upstream -> client; the
    // path is the DataPath that moved them (kDataPathLabels).
    std::array<std::array<StatCounter, idx(DataPath::kCount)>, 2> bytes;
    UsHistogram<kDurationBuckets.size()> duration;  // accept to close
    StatCounter half_closed;          // gauge: one direction finished, the other still flowing
    StatCounter rejected_draining;    // accepted while draining, closed at once
    StatCounter sockmap_connections;  // connections whose sockets entered the sockmap
    std::array<StatCounter, idx(CloseReason::kCount)> closed;
    std::array<StatCounter, idx(ConnectFailure::kCount)> connect_failures;
    std::array<StatCounter, idx(SockmapFallback::kCount)> sockmap_fallbacks;
    StatCounter sockmap_catchups;  // times a sockmap direction had passed bytes to move
    StatCounter sockmap_copied;    // bytes the program passed and user space moved
    StatCounter sockmap_replays;   // skbs the verdict saw again (relay.bpf.c)
    StatCounter sockmap_skipped;   // bytes of those that user space dropped
    // Directions that changed path while live: [the path they moved to][why]. The path they
    // came from follows from the reason (SwitchReason).
    std::array<std::array<StatCounter, idx(SwitchReason::kCount)>, idx(DataPath::kCount)>
        path_switches;
    std::array<StatCounter, idx(ProxyFailure::kCount)> proxy_errors;
    // routes: inspections that matched no conditional route, and how long each took.
    std::array<StatCounter, idx(InspectFailure::kCount)> inspect_failures;
    UsHistogram<kInspectBuckets.size()> inspect_duration;

    // Connections accepted and not yet closed (zcrelay_connections_active, per worker).
    uint64_t open() const {
        uint64_t n = accepted.get() + handed_in.get();
        for (const StatCounter& c : closed) n -= c.get();
        return n;
    }
};

struct WorkerStats {
    StatCounter accepted;  // over all listeners
    // Splice steps that found nothing to do: [direction][cause], cause 0 = the source socket
    // had no bytes (socket_empty), 1 = the destination could take none (pipe_full: the pipe
    // holds bytes the socket's send buffer has no room for).
    std::array<std::array<StatCounter, 2>, 2> splice_eagain;
    StatCounter sqes_submitted;  // SQEs this worker's ring has submitted
    StatCounter cq_overflow;     // the ring's CQ overflow count (kernel's), copied per loop
    std::array<StatCounter, idx(PipeFallback::kCount)> pipe_fallbacks;
    StatCounter pipes_in_use;     // gauge: pipes held by directions
    StatCounter pipes_cached;     // gauge: empty pipes kept for reuse
    StatCounter accept_paused;    // accept stopped on EMFILE/ENFILE
    StatCounter sockmap_sockets;  // gauge: sockets this worker has in the SOCKHASH
    StatCounter sockmap_wakeups_lost;  // the program's count for this worker's ring, copied
    std::array<StatCounter, idx(ZerocopySend::kCount)> zerocopy_sends;
    StatCounter copy_buffers_busy;  // gauge: BufRing::busy(), copied per loop
};

}  // namespace zcrelay
