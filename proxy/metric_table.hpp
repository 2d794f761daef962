#pragma once
// Every metric zcrelay exports, declared once: name, type, label names and help. The /metrics
// endpoint makes its families from this list (metrics.cpp, which also says what each reads),
// the tests take the names they scrape from it (tests/support/relay_process.hpp), and a unit
// case fails when the README, a page of docs/, the Grafana board or the Prometheus rules name a
// metric it lacks, or docs/metrics.md leaves one out (tests/unit/metric_table_test.cpp). Plain
// data, no Prometheus: the tests include it.
//
// X(Id, name, type, (label names), help). The label names are in the order every series of the
// family carries them on /metrics. A `{key}` in a help is a number of the code's (a buffer
// size, a hold count), filled in once at start (metricHelp() in metrics.hpp), so the help
// cannot go stale when the constant changes. The order is the order of the families in a scrape.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace zcrelay {

#define ZCRELAY_METRICS(X)                                                                         \
    /* Per listener. */                                                                            \
    X(Connections, "zcrelay_connections_total", Counter, ("listener"),                             \
      "Downstream connections accepted.")                                                          \
    X(ConnectionsActive, "zcrelay_connections_active", Gauge, ("listener"),                        \
      "Connections open now (accepted, not yet closed).")                                          \
    X(Bytes, "zcrelay_bytes_total", Counter, ("direction", "listener", "path"),                    \
      "Bytes relayed: direction=upstream is client to upstream, downstream is "                    \
      "upstream to client; path is the data path that moved them.")                                \
    X(ConnectionDuration, "zcrelay_connection_duration_seconds", Histogram, ("listener"),          \
      "Time from accept to close, per connection.")                                                \
    X(HalfClosed, "zcrelay_half_closed_connections", Gauge, ("listener"),                          \
      "Connections with one direction finished (FIN relayed) and the other "                       \
      "still open.")                                                                               \
    X(UpstreamConnectFailures, "zcrelay_upstream_connect_failures_total", Counter,                 \
      ("listener", "reason"), "Upstream connect attempts that failed, by reason.")                 \
    X(ConnectionsClosed, "zcrelay_connections_closed_total", Counter, ("listener", "reason"),      \
      "Connections closed, by reason.")                                                            \
    X(ConnectionsRejected, "zcrelay_connections_rejected_total", Counter, ("listener", "reason"),  \
      "Connections closed before relaying anything, by reason (also in "                           \
      "zcrelay_connections_closed_total, except draining: accepted while "                         \
      "draining).")                                                                                \
    X(ProxyProtocolErrors, "zcrelay_proxy_protocol_errors_total", Counter, ("listener", "reason"), \
      "Clients closed because of their PROXY header, by reason "                                   \
      "(accept_proxy listeners).")                                                                 \
    X(DatapathInfo, "zcrelay_datapath_info", Gauge, ("listener", "mode"),                          \
      "The data path each listener runs (mode sockmap and auto run as splice where "               \
      "the BPF program cannot load); the value is always 1.")                                      \
    X(DatapathSwitches, "zcrelay_datapath_switches_total", Counter,                                \
      ("listener", "from", "to", "reason"),                                                        \
      "Directions of live connections that changed data path, by reason: interactive "             \
      "(mode auto promoted a request/response connection from splice to sockmap, or to copy "      \
      "one way where the kernel took only the client's socket).")                                  \
    X(SockmapConnections, "zcrelay_sockmap_connections_total", Counter, ("listener"),              \
      "Connections whose sockets entered the sockmap (the kernel "                                 \
      "redirects their bytes).")                                                                   \
    X(SockmapFallbacks, "zcrelay_sockmap_fallbacks_total", Counter, ("listener", "reason"),        \
      "Sockmap connections relayed by splice instead, by reason: not_established (a FIN "          \
      "came first), insert_failed (the kernel refused the map update; when it refused only "       \
      "the upstream socket, client to upstream moves by copy), no_record, "                        \
      "partly_read (a segment the relay read in part, after a PROXY header, is queued).")          \
    X(SockmapCatchups, "zcrelay_sockmap_catchups_total", Counter, ("listener"),                    \
      "Times a sockmap direction had bytes the BPF program left to user space "                    \
      "(its peer not in the map yet, or too much in flight towards it).")                          \
    X(SockmapCopiedBytes, "zcrelay_sockmap_copied_bytes_total", Counter, ("listener"),             \
      "Bytes of sockmap connections moved by user space instead of the kernel "                    \
      "redirect (also in zcrelay_bytes_total).")                                                   \
    X(SockmapReplays, "zcrelay_sockmap_replays_total", Counter, ("listener"),                      \
      "skbs the kernel ran through the sockmap verdict a second time (a 6.18 "                     \
      "behaviour after bytes were passed to user space); their bytes are "                         \
      "dropped, never relayed twice.")                                                             \
    X(SockmapSkippedBytes, "zcrelay_sockmap_skipped_bytes_total", Counter, ("listener"),           \
      "Bytes of replayed skbs dropped by user space.")                                             \
    X(RouteSelections, "zcrelay_route_selections_total", Counter, ("listener", "route"),           \
      "Connections each route took (listeners with routes; the default "                           \
      "route included).")                                                                          \
    X(InspectFailures, "zcrelay_inspect_failures_total", Counter, ("listener", "reason"),          \
      "Inspections of a client's first bytes that matched no conditional route, by reason "        \
      "(timeout, not_tls, too_large, malformed, no_sni, no_route, closed); the default "           \
      "route takes those clients if there is one, else they are closed (reason no_route).")        \
    X(InspectDuration, "zcrelay_inspect_duration_seconds", Histogram, ("listener"),                \
      "Time from the start of inspection to the route's choice.")                                  \
    /* Per backend of each cluster. */                                                             \
    X(BackendUp, "zcrelay_backend_up", Gauge, ("backend", "cluster"),                              \
      "1 while health checks and passive ejection let the backend take new "                       \
      "connections; 0 while they hold it down (the runtime API's say is "                          \
      "zcrelay_backend_admin_state and zcrelay_backend_weight).")                                  \
    X(BackendTier, "zcrelay_backend_tier", Gauge, ("backend", "cluster"),                          \
      "The backend's tier: 0 for a primary, 1 for `backup: true`, an SRV priority's rank.")        \
    X(BackendServing, "zcrelay_backend_serving", Gauge, ("backend", "cluster"),                    \
      "1 while new connections may go to the backend: up, ready, and in the tier that serves "     \
      "(backups only while no primary is up).")                                                    \
    X(BackendSlowStart, "zcrelay_backend_slow_start_ratio", Gauge, ("backend", "cluster"),         \
      "The share of its weight the backend has now: 1, or, in its cluster's slow_start after "     \
      "it came up, the part of slow_start elapsed.")                                               \
    X(BackendConnectAttempts, "zcrelay_backend_connect_attempts_total", Counter,                   \
      ("backend", "cluster"), "Connects started to the backend (retries included).")               \
    X(BackendConnections, "zcrelay_backend_connections_total", Counter, ("backend", "cluster"),    \
      "Connections relayed to the backend (connects that succeeded).")                             \
    X(BackendConnectionsActive, "zcrelay_backend_connections_active", Gauge,                       \
      ("backend", "cluster"), "Connections to the backend open now.")                              \
    X(BackendConnectFailures, "zcrelay_backend_connect_failures_total", Counter,                   \
      ("backend", "cluster", "reason"), "Connects to the backend that failed, by reason.")         \
    X(BackendBytes, "zcrelay_backend_bytes_total", Counter, ("backend", "cluster", "direction"),   \
      "Bytes relayed through the backend's connections, by direction.")                            \
    X(BackendConnectDuration, "zcrelay_backend_connect_duration_seconds", Histogram,               \
      ("backend", "cluster"), "Time from connect() to the connection being established.")          \
    X(BackendHealthChecks, "zcrelay_backend_health_checks_total", Counter,                         \
      ("backend", "cluster", "result"), "Active health checks of the backend, by result.")         \
    X(BackendTransitions, "zcrelay_backend_transitions_total", Counter,                            \
      ("backend", "cluster", "to"),                                                                \
      "Times the backend went up or down (checks or passive ejection).")                           \
    X(BackendAdminState, "zcrelay_backend_admin_state", Gauge, ("backend", "cluster", "state"),    \
      "The runtime API's state of the backend: 1 for the one it is in.")                           \
    X(BackendWeight, "zcrelay_backend_weight", Gauge, ("backend", "cluster"),                      \
      "The backend's weight now: the config's or SRV record's, or the runtime "                    \
      "API's.")                                                                                    \
    /* Per discovered cluster (only while discovery runs). */                                      \
    X(DiscoveryResolutions, "zcrelay_discovery_resolutions_total", Counter,                        \
      ("cluster", "outcome"), "DNS resolutions of a discovered cluster's name, by outcome.")       \
    X(DiscoveryLastSuccess, "zcrelay_discovery_last_success_timestamp_seconds", Gauge,             \
      ("cluster"),                                                                                 \
      "When the cluster's name last resolved to a non-empty set (Unix time; 0: "                   \
      "never).")                                                                                   \
    X(DiscoveryBackends, "zcrelay_discovery_backends", Gauge, ("cluster"),                         \
      "Backends the cluster has from DNS now (what the last good answer gave, "                    \
      "until hold runs out).")                                                                     \
    X(DiscoveryChanges, "zcrelay_discovery_changes_total", Counter, ("cluster"),                   \
      "Times the cluster's discovered set of backends changed.")                                   \
    X(DiscoveryFailing, "zcrelay_discovery_failing", Gauge, ("cluster"),                           \
      "1 while the cluster's name fails to resolve (its last good set serving "                    \
      "for hold, or none).")                                                                       \
    X(DiscoveryRefused, "zcrelay_discovery_refused_total", Counter, ("cluster", "reason"),         \
      "Addresses DNS answers named that were refused as backends, by reason "                      \
      "(unspecified, broadcast, multicast, port_zero, self: the relay's own), "                    \
      "counted per answer.")                                                                       \
    X(DiscoveryRefusedAddresses, "zcrelay_discovery_refused_addresses", Gauge,                     \
      ("cluster", "reason"),                                                                       \
      "Addresses the cluster's last answer named that were refused as "                            \
      "backends, by reason.")                                                                      \
    /* The runtime API (only while it serves). */                                                  \
    X(AdminChanges, "zcrelay_admin_changes_total", Counter, ("change"),                            \
      "Changes made through the runtime API, by kind.")                                            \
    X(AdminRequests, "zcrelay_admin_requests_total", Counter, ("result"),                          \
      "Requests the runtime API answered, by result.")                                             \
    X(AdminEndpointRejected, "zcrelay_admin_endpoint_rejected_total", Counter, ("reason"),         \
      "Connections the runtime API's server closed and requests it refused, by "                   \
      "reason.")                                                                                   \
    /* Summed over the workers, or per worker. */                                                  \
    X(PipeFallbacks, "zcrelay_pipe_fallbacks_total", Counter, ("reason"),                          \
      "Directions that wanted a pipe and moved their bytes by copy instead, by reason.")           \
    X(ZerocopySends, "zcrelay_zerocopy_sends_total", Counter, ("result"),                          \
      "Copy sends of {zerocopy_min} or more on send_zerocopy listeners, by what became "           \
      "of them: zerocopy (sent from the buffer's pages), copied (the kernel "                      \
      "copied after all, as on loopback), unreported (the kernel cannot say), "                    \
      "plain (the direction's {direction_holds} holds or the worker's {worker_holds} were "        \
      "taken: sent plainly).")                                                                     \
    X(CopyBuffersBusy, "zcrelay_copy_buffers_busy", Gauge, (),                                     \
      "Copy-path buffers ({copy_buffer_size}, {copy_buffers} per worker) holding bytes not "       \
      "yet sent or lent to the kernel by a zero-copy send; 0 when no connection is.")              \
    X(WorkerConnections, "zcrelay_worker_connections_total", Counter, ("worker"),                  \
      "Connections accepted by each worker (shows how SO_REUSEPORT spreads them).")                \
    X(PipesInUse, "zcrelay_pipes_in_use", Gauge, (), "Pipes held by busy directions.")             \
    X(PipesCached, "zcrelay_pipes_cached", Gauge, (),                                              \
      "Empty pipes kept open for reuse (2 fds each).")                                             \
    X(PipesCapacity, "zcrelay_pipes_capacity", Gauge, (),                                          \
      "Pipes the process may hold (max_pipes); 0: never splice.")                                  \
    X(SockmapSockets, "zcrelay_sockmap_sockets", Gauge, (),                                        \
      "Sockets in the sockmap SOCKHASH now (two per connection).")                                 \
    X(SockmapWakeupsLost, "zcrelay_sockmap_wakeups_lost_total", Counter, (),                       \
      "Wake-ups the sockmap program could not write into a worker's full ring; the worker "        \
      "then looked at every connection it relays.")                                                \
    X(AcceptPaused, "zcrelay_accept_paused_total", Counter, (),                                    \
      "Times a worker stopped accepting because the process or system ran out of fds.")            \
    X(SpliceEagain, "zcrelay_splice_eagain_total", Counter, ("direction", "cause"),                \
      "Splice steps that found nothing to do: the source socket was empty "                        \
      "(socket_empty), or the destination took nothing (pipe_full).")                              \
    X(RingSqesSubmitted, "zcrelay_ring_sqes_submitted_total", Counter, ("worker"),                 \
      "SQEs each worker's io_uring submitted.")                                                    \
    X(RingCqOverflow, "zcrelay_ring_cq_overflow_total", Counter, ("worker"),                       \
      "CQEs each worker's io_uring held back because its CQ ring was full "                        \
      "(the kernel's count).")                                                                     \
    /* The process (/proc/self). */                                                                \
    X(ProcessThreads, "zcrelay_process_threads", Gauge, (),                                        \
      "Threads of the process, io_uring io-wq workers included.")                                  \
    X(IowqWorkers, "zcrelay_iowq_workers", Gauge, (),                                              \
      "io_uring io-wq worker threads (iou-wrk-*): work the kernel could not do "                   \
      "inline. Stays near 0 when the data path never blocks.")                                     \
    X(ProcessOpenFds, "process_open_fds", Gauge, (), "Open file descriptors.")                     \
    X(ProcessMaxFds, "process_max_fds", Gauge, (),                                                 \
      "RLIMIT_NOFILE: the most fds the process may open.")                                         \
    X(ProcessResidentMemory, "process_resident_memory_bytes", Gauge, (), "Resident memory.")       \
    X(ProcessVirtualMemory, "process_virtual_memory_bytes", Gauge, (), "Virtual memory.")          \
    X(ProcessCpuSeconds, "process_cpu_seconds_total", Counter, (), "User and system CPU time.")    \
    X(ProcessStartTime, "process_start_time_seconds", Gauge, (),                                   \
      "When the process started (Unix time).")                                                     \
    /* The process's own state and control plane. */                                               \
    X(Draining, "zcrelay_draining", Gauge, (),                                                     \
      "1 after SIGTERM/SIGINT: not accepting, live connections finishing.")                        \
    X(BuildInfo, "zcrelay_build_info", Gauge, ("version", "io_backend", "sockmap"),                \
      "Build information; the value is always 1.")                                                 \
    X(ConfigGeneration, "zcrelay_config_generation", Gauge, (),                                    \
      "The running config's generation: 1 at start, +1 per applied reload.")                       \
    X(ConfigReloads, "zcrelay_config_reloads_total", Counter, ("result"),                          \
      "SIGHUP reloads, by result.")                                                                \
    X(Takeovers, "zcrelay_takeovers_total", Counter, ("result"),                                   \
      "Takeovers of the listening sockets, by result: handed_over, failed and refused as the "     \
      "giver; taken_over and fallback (bound its own) as the new process.")                        \
    X(HandoverConnections, "zcrelay_handover_connections_total", Counter, ("result"),              \
      "Live connections across a takeover, by result: handed_over, kept (to drain here) and "      \
      "failed as the old process; taken and lost as the new one.")                                 \
    X(AccessLogDropped, "zcrelay_access_log_dropped_total", Counter, (),                           \
      "Access log lines dropped because the writer fell behind.")                                  \
    X(Signals, "zcrelay_signals_total", Counter, ("signal"),                                       \
      "Signals taken, by name (what each does: docs/operating.md, Signals).")                      \
    X(MetricsEndpointRejected, "zcrelay_metrics_endpoint_rejected_total", Counter, ("reason"),     \
      "Connections the metrics endpoint closed and requests it refused, by reason.")               \
    X(MetricsEndpointRequests, "zcrelay_metrics_endpoint_requests_total", Counter, (),             \
      "Requests the metrics endpoint answered from a path it serves.")                             \
    X(MetricsEndpointConnections, "zcrelay_metrics_endpoint_connections", Gauge, (),               \
      "Connections open to the metrics endpoint now.")

enum class MetricKind : uint8_t { Counter, Gauge, Histogram };

// At most this many labels per series (zcrelay_bytes_total, a backend's by-reason counters).
inline constexpr size_t kMaxMetricLabels = 4;

struct MetricSpec {
    std::string_view name;
    MetricKind kind;
    std::array<std::string_view, kMaxMetricLabels> labels;  // the unused ones empty
    std::string_view help;                                  // `{key}`: see the top of the file

    size_t labelCount() const {
        size_t n = 0;
        while (n < labels.size() && !labels[n].empty()) ++n;
        return n;
    }
};

#define ZCRELAY_METRIC_ID(id, name, type, labels, help) id,
enum class Metric : uint8_t { ZCRELAY_METRICS(ZCRELAY_METRIC_ID) kCount };
#undef ZCRELAY_METRIC_ID

// `labels` is a parenthesised list; the macro before it makes that a braced initialiser.
#define ZCRELAY_METRIC_LABELS(...) \
    { __VA_ARGS__ }
#define ZCRELAY_METRIC_SPEC(id, name, type, labels, help) \
    MetricSpec{name, MetricKind::type, ZCRELAY_METRIC_LABELS labels, help},
inline constexpr std::array<MetricSpec, static_cast<size_t>(Metric::kCount)> kMetrics{
    {ZCRELAY_METRICS(ZCRELAY_METRIC_SPEC)}};
#undef ZCRELAY_METRIC_SPEC
#undef ZCRELAY_METRIC_LABELS

constexpr const MetricSpec& metricSpec(Metric m) { return kMetrics[static_cast<size_t>(m)]; }
// A string literal's, so NUL-terminated: the tests keep their names as const char*.
constexpr const char* metricName(Metric m) { return metricSpec(m).name.data(); }

}  // namespace zcrelay
