#pragma once
// What the relay counts, and how the counts reach Prometheus.
//
// Workers keep plain per-thread counters (WorkerStats): one writer each, so an increment is a
// relaxed load + store (a plain mov on x86), never a locked instruction or a mutex on the data
// path. The exposer thread reads them at scrape time through a prometheus-cpp Collectable that
// sums all workers; a relaxed read may lag a few increments behind, never tears.
#include <prometheus/collectable.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "address.hpp"
#include "proxy_protocol.hpp"
#include "reasons.hpp"

namespace prometheus {
class Exposer;
}

namespace zcrelay {

struct Runtime;
struct ProcessShared;

class StatCounter {
  public:
    void add(uint64_t n = 1) {
        v_.store(v_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
    }
    void sub(uint64_t n = 1) {
        v_.store(v_.load(std::memory_order_relaxed) - n, std::memory_order_relaxed);
    }
    uint64_t get() const { return v_.load(std::memory_order_relaxed); }

  private:
    std::atomic<uint64_t> v_{0};
};

// Why a client's PROXY header was refused: the parser's reasons, then the worker's own.
enum class ProxyFailure : uint8_t { ZCRELAY_PROXY_ERRORS(ZCRELAY_ENUM_ITEM) Timeout, Eof, kCount };
inline constexpr std::array<std::string_view, idx(ProxyFailure::kCount)> kProxyFailureLabels{
    ZCRELAY_PROXY_ERRORS(ZCRELAY_LABEL_ITEM) "timeout", "eof"};

struct ListenerStats {
    StatCounter accepted;
    StatCounter bytes_upstream;    // client -> upstream
    StatCounter bytes_downstream;  // upstream -> client
    std::array<StatCounter, idx(CloseReason::kCount)> closed;
    std::array<StatCounter, idx(ConnectFailure::kCount)> connect_failures;
    std::array<StatCounter, idx(SockmapFallback::kCount)> sockmap_fallbacks;
    StatCounter sockmap_catchups;  // times a sockmap direction had passed bytes to move
    StatCounter sockmap_copied;    // bytes the program passed and user space moved
    StatCounter sockmap_replays;   // skbs the verdict saw again (relay.bpf.c)
    StatCounter sockmap_skipped;   // bytes of those that user space dropped
    std::array<StatCounter, idx(ProxyFailure::kCount)> proxy_errors;
};

struct WorkerStats {
    StatCounter accepted;  // over all listeners
    std::array<StatCounter, idx(PipeFallback::kCount)> pipe_fallbacks;
    StatCounter pipes_in_use;     // gauge: pipes held by directions
    StatCounter pipes_cached;     // gauge: empty pipes kept for reuse
    StatCounter accept_paused;    // accept stopped on EMFILE/ENFILE
    StatCounter sockmap_sockets;  // gauge: sockets this worker has in the SOCKHASH
};

// The /metrics endpoint: a civetweb server (prometheus-cpp pull) serving the sum of all
// workers' stats, for the listeners, clusters and backends of the current Runtime (which
// `current` returns at each scrape). Throws std::exception if the address cannot be bound
// (start-up only).
class MetricsEndpoint {
  public:
    MetricsEndpoint(const SocketAddress& listen,
                    std::function<std::shared_ptr<const Runtime>()> current,
                    std::vector<const WorkerStats*> workers, const ProcessShared* process);
    ~MetricsEndpoint();
    uint16_t port() const;

  private:
    SocketAddress address_;
    std::shared_ptr<prometheus::Collectable> collector_;
    std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace zcrelay
