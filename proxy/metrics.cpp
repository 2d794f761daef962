#include "metrics.hpp"

#include <prometheus/collectable.h>

#include <prometheus/client_metric.h>
#include <prometheus/metric_family.h>
#include <prometheus/metric_type.h>

#include <cstdio>
#include <limits>

#include "access_log.hpp"
#include "admin_api.hpp"
#include "address.hpp"
#include "config.hpp"
#include "discovery.hpp"
#include "process_shared.hpp"
#include "process_stats.hpp"
#include "runtime.hpp"

namespace zcrelay {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

class Family {
  public:
    Family(std::string name, std::string help, MetricType type) {
        f_.name = std::move(name);
        f_.help = std::move(help);
        f_.type = type;
    }
    // A histogram from per-bucket (not cumulative) counts; the last count is +Inf's.
    template <size_t N>
    Family& addHistogram(std::vector<ClientMetric::Label> labels,
                         const std::array<double, N>& bounds,
                         const std::array<uint64_t, N + 1>& counts, double sum) {
        ClientMetric m;
        m.label = std::move(labels);
        uint64_t cumulative = 0;
        for (size_t i = 0; i < N; ++i) {
            cumulative += counts[i];
            m.histogram.bucket.push_back({cumulative, bounds[i]});
        }
        cumulative += counts[N];
        m.histogram.bucket.push_back({cumulative, std::numeric_limits<double>::infinity()});
        m.histogram.sample_count = cumulative;
        m.histogram.sample_sum = sum;
        f_.metric.push_back(std::move(m));
        return *this;
    }
    // The same, summed over the workers' shards of one UsHistogram (µs sum in seconds).
    template <size_t N, class Shards, class Get>
    Family& addShardedHistogram(std::vector<ClientMetric::Label> labels,
                                const std::array<double, N>& bounds, const Shards& shards,
                                Get histogram) {
        std::array<uint64_t, N + 1> counts{};
        for (size_t b = 0; b <= N; ++b)
            counts[b] = shards.sum([&](const auto& s) { return histogram(s).buckets[b].get(); });
        double sum_us = static_cast<double>(
            shards.sum([&](const auto& s) { return histogram(s).sum_us.get(); }));
        return addHistogram(std::move(labels), bounds, counts, sum_us / 1e6);
    }
    Family& add(std::vector<ClientMetric::Label> labels, double value) {
        ClientMetric m;
        m.label = std::move(labels);
        if (f_.type == MetricType::Counter)
            m.counter.value = value;
        else
            m.gauge.value = value;
        f_.metric.push_back(std::move(m));
        return *this;
    }
    MetricFamily take() { return std::move(f_); }

  private:
    MetricFamily f_;
};

class Collector : public prometheus::Collectable {
  public:
    Collector(std::function<std::shared_ptr<const Runtime>()> current,
              std::vector<const WorkerStats*> workers, const ProcessShared* process)
        : current_(std::move(current)), workers_(std::move(workers)), process_(process) {}

    std::vector<MetricFamily> Collect() const override {
        std::shared_ptr<const Runtime> rt = current_();
        auto sum = [&](auto get) {
            uint64_t total = 0;
            for (const WorkerStats* w : workers_) total += get(*w);
            return static_cast<double>(total);
        };
        std::vector<MetricFamily> out;
        collectListeners(*rt, out);
        collectBackends(*rt, out);
        collectDiscovery(*rt, out);
        collectAdmin(out);
        Family fallbacks(
            "zcrelay_pipe_fallbacks_total",
            "Directions that wanted a pipe and moved their bytes by copy instead, by reason.",
            MetricType::Counter);
        for (size_t r = 0; r < idx(PipeFallback::kCount); ++r) {
            fallbacks.add({{"reason", std::string(kPipeFallbackLabels[r])}},
                          sum([r](const WorkerStats& w) { return w.pipe_fallbacks[r].get(); }));
        }
        Family zerocopy("zcrelay_zerocopy_sends_total",
                        "Copy sends of 16KiB or more on send_zerocopy listeners, by what became "
                        "of them: zerocopy (sent from the buffer's pages), copied (the kernel "
                        "copied after all, as on loopback), unreported (the kernel cannot say), "
                        "plain (the direction's 16 holds or the worker's 127 were taken: sent "
                        "plainly).",
                        MetricType::Counter);
        for (size_t r = 0; r < idx(ZerocopySend::kCount); ++r) {
            zerocopy.add({{"result", std::string(kZerocopySendLabels[r])}},
                         sum([r](const WorkerStats& w) { return w.zerocopy_sends[r].get(); }));
        }
        Family buffers_busy("zcrelay_copy_buffers_busy",
                            "Copy-path buffers (64KiB, 256 per worker) holding bytes not yet sent "
                            "or lent to the kernel by a zero-copy send; 0 when no connection is.",
                            MetricType::Gauge);
        buffers_busy.add({}, sum([](const WorkerStats& w) { return w.copy_buffers_busy.get(); }));
        Family per_worker(
            "zcrelay_worker_connections_total",
            "Connections accepted by each worker (shows how SO_REUSEPORT spreads them).",
            MetricType::Counter);
        for (size_t w = 0; w < workers_.size(); ++w) {
            per_worker.add({{"worker", std::to_string(w)}},
                           static_cast<double>(workers_[w]->accepted.get()));
        }
        Family in_use("zcrelay_pipes_in_use", "Pipes held by busy directions.", MetricType::Gauge);
        in_use.add({}, sum([](const WorkerStats& w) { return w.pipes_in_use.get(); }));
        Family cached("zcrelay_pipes_cached", "Empty pipes kept open for reuse (2 fds each).",
                      MetricType::Gauge);
        cached.add({}, sum([](const WorkerStats& w) { return w.pipes_cached.get(); }));
        Family paused(
            "zcrelay_accept_paused_total",
            "Times a worker stopped accepting because the process or system ran out of fds.",
            MetricType::Counter);
        paused.add({}, sum([](const WorkerStats& w) { return w.accept_paused.get(); }));
        Family sockmap_sockets("zcrelay_sockmap_sockets",
                               "Sockets in the sockmap SOCKHASH now (two per connection).",
                               MetricType::Gauge);
        sockmap_sockets.add({}, sum([](const WorkerStats& w) { return w.sockmap_sockets.get(); }));
        Family pipes_capacity("zcrelay_pipes_capacity",
                              "Pipes the process may hold (max_pipes); 0: never splice.",
                              MetricType::Gauge);
        pipes_capacity.add({}, static_cast<double>(rt->config.max_pipes));
        Family eagain("zcrelay_splice_eagain_total",
                      "Splice steps that found nothing to do: the source socket was empty "
                      "(socket_empty), or the destination took nothing (pipe_full).",
                      MetricType::Counter);
        static constexpr const char* kCauses[] = {"socket_empty", "pipe_full"};
        for (int d = 0; d < 2; ++d) {
            for (int cause = 0; cause < 2; ++cause) {
                eagain.add(
                    {{"direction", d == 0 ? "upstream" : "downstream"}, {"cause", kCauses[cause]}},
                    sum([d, cause](const WorkerStats& w) {
                        return w.splice_eagain[d][cause].get();
                    }));
            }
        }
        Family sqes("zcrelay_ring_sqes_submitted_total", "SQEs each worker's io_uring submitted.",
                    MetricType::Counter);
        Family overflow("zcrelay_ring_cq_overflow_total",
                        "CQEs each worker's io_uring held back because its CQ ring was full "
                        "(the kernel's count).",
                        MetricType::Counter);
        for (size_t w = 0; w < workers_.size(); ++w) {
            std::string worker = std::to_string(w);
            sqes.add({{"worker", worker}}, static_cast<double>(workers_[w]->sqes_submitted.get()));
            overflow.add({{"worker", worker}}, static_cast<double>(workers_[w]->cq_overflow.get()));
        }
        ProcessStats ps = readProcessStats();
        Family threads("zcrelay_process_threads",
                       "Threads of the process, io_uring io-wq workers included.",
                       MetricType::Gauge);
        threads.add({}, ps.threads);
        Family iowq("zcrelay_iowq_workers",
                    "io_uring io-wq worker threads (iou-wrk-*): work the kernel could not do "
                    "inline. Stays near 0 when the data path never blocks.",
                    MetricType::Gauge);
        iowq.add({}, ps.iowq_workers);
        Family fds("process_open_fds", "Open file descriptors.", MetricType::Gauge);
        fds.add({}, ps.open_fds);
        Family max_fds("process_max_fds", "RLIMIT_NOFILE: the most fds the process may open.",
                       MetricType::Gauge);
        max_fds.add({}, static_cast<double>(ps.max_fds));
        Family rss("process_resident_memory_bytes", "Resident memory.", MetricType::Gauge);
        rss.add({}, static_cast<double>(ps.rss_bytes));
        Family vsz("process_virtual_memory_bytes", "Virtual memory.", MetricType::Gauge);
        vsz.add({}, static_cast<double>(ps.virtual_bytes));
        Family cpu("process_cpu_seconds_total", "User and system CPU time.", MetricType::Counter);
        cpu.add({}, ps.cpu_seconds);
        Family started("process_start_time_seconds", "When the process started (Unix time).",
                       MetricType::Gauge);
        started.add({}, ps.start_time_seconds);
        Family draining("zcrelay_draining",
                        "1 after SIGTERM/SIGINT: not accepting, live connections finishing.",
                        MetricType::Gauge);
        draining.add({}, process_->draining.load() ? 1 : 0);
        Family info("zcrelay_build_info", "Build information; the value is always 1.",
                    MetricType::Gauge);
        info.add({{"version", ZCRELAY_VERSION},
                  {"io_backend", "io_uring"},
                  {"sockmap", process_->sockmap_loaded ? "loaded" : "off"}},
                 1);
        Family generation("zcrelay_config_generation",
                          "The running config's generation: 1 at start, +1 per applied reload.",
                          MetricType::Gauge);
        generation.add({}, static_cast<double>(rt->generation));
        Family reloads("zcrelay_config_reloads_total", "SIGHUP reloads, by result.",
                       MetricType::Counter);
        reloads.add({{"result", "success"}}, static_cast<double>(process_->reloads_ok.load()));
        reloads.add({{"result", "failure"}}, static_cast<double>(process_->reloads_failed.load()));
        Family dropped("zcrelay_access_log_dropped_total",
                       "Access log lines dropped because the writer fell behind.",
                       MetricType::Counter);
        dropped.add({}, process_->access_log ? process_->access_log->totalDropped() : 0);
        Family signals("zcrelay_signals_total",
                       "Signals taken, by name (what each does: docs/operating.md, Signals).",
                       MetricType::Counter);
        for (size_t i = 0; i < kSignals.size(); ++i)
            signals.add({{"signal", std::string(kSignals[i].name)}},
                        static_cast<double>(process_->signals[i].load()));
        const HttpStats& http = process_->endpoint;
        Family endpoint_rejected(
            "zcrelay_metrics_endpoint_rejected_total",
            "Connections the metrics endpoint closed and requests it refused, by reason.",
            MetricType::Counter);
        for (size_t r = 0; r < kHttpRejectLabels.size(); ++r)
            endpoint_rejected.add({{"reason", std::string(kHttpRejectLabels[r])}},
                                  static_cast<double>(http.rejected[r].load()));
        Family endpoint_requests("zcrelay_metrics_endpoint_requests_total",
                                 "Requests the metrics endpoint answered from a path it serves.",
                                 MetricType::Counter);
        endpoint_requests.add({}, static_cast<double>(http.requests.load()));
        Family endpoint_conns("zcrelay_metrics_endpoint_connections",
                              "Connections open to the metrics endpoint now.", MetricType::Gauge);
        endpoint_conns.add({}, static_cast<double>(http.connections.load()));

        for (Family* f : {&fallbacks,
                          &zerocopy,
                          &buffers_busy,
                          &per_worker,
                          &in_use,
                          &cached,
                          &pipes_capacity,
                          &sockmap_sockets,
                          &paused,
                          &eagain,
                          &sqes,
                          &overflow,
                          &threads,
                          &iowq,
                          &fds,
                          &max_fds,
                          &rss,
                          &vsz,
                          &cpu,
                          &started,
                          &draining,
                          &info,
                          &generation,
                          &reloads,
                          &dropped,
                          &signals,
                          &endpoint_rejected,
                          &endpoint_requests,
                          &endpoint_conns})
            out.push_back(f->take());
        return out;
    }

  private:
    void collectListeners(const Runtime& rt, std::vector<MetricFamily>& out) const {
        Family conns("zcrelay_connections_total", "Downstream connections accepted.",
                     MetricType::Counter);
        Family active("zcrelay_connections_active",
                      "Connections open now (accepted, not yet closed).", MetricType::Gauge);
        Family bytes("zcrelay_bytes_total",
                     "Bytes relayed: direction=upstream is client to upstream, downstream is "
                     "upstream to client; path is the data path that moved them.",
                     MetricType::Counter);
        Family duration("zcrelay_connection_duration_seconds",
                        "Time from accept to close, per connection.", MetricType::Histogram);
        Family half_closed("zcrelay_half_closed_connections",
                           "Connections with one direction finished (FIN relayed) and the other "
                           "still open.",
                           MetricType::Gauge);
        Family rejected("zcrelay_connections_rejected_total",
                        "Connections closed before relaying anything, by reason (also in "
                        "zcrelay_connections_closed_total, except draining: accepted while "
                        "draining).",
                        MetricType::Counter);
        Family sockmap_conns("zcrelay_sockmap_connections_total",
                             "Connections whose sockets entered the sockmap (the kernel "
                             "redirects their bytes).",
                             MetricType::Counter);
        Family failures("zcrelay_upstream_connect_failures_total",
                        "Upstream connect attempts that failed, by reason.", MetricType::Counter);
        Family closed("zcrelay_connections_closed_total", "Connections closed, by reason.",
                      MetricType::Counter);
        Family proxy_errors("zcrelay_proxy_protocol_errors_total",
                            "Clients closed because of their PROXY header, by reason "
                            "(accept_proxy listeners).",
                            MetricType::Counter);
        Family datapath("zcrelay_datapath_info",
                        "The data path each listener runs (mode sockmap runs as splice where the "
                        "BPF program cannot load); the value is always 1.",
                        MetricType::Gauge);
        Family catchups("zcrelay_sockmap_catchups_total",
                        "Times a sockmap direction had bytes the BPF program left to user space "
                        "(its peer not in the map yet, or too much in flight towards it).",
                        MetricType::Counter);
        Family copied("zcrelay_sockmap_copied_bytes_total",
                      "Bytes of sockmap connections moved by user space instead of the kernel "
                      "redirect (also in zcrelay_bytes_total).",
                      MetricType::Counter);
        Family replays("zcrelay_sockmap_replays_total",
                       "skbs the kernel ran through the sockmap verdict a second time (a 6.18 "
                       "behaviour after bytes were passed to user space); their bytes are "
                       "dropped, never relayed twice.",
                       MetricType::Counter);
        Family skipped("zcrelay_sockmap_skipped_bytes_total",
                       "Bytes of replayed skbs dropped by user space.", MetricType::Counter);
        Family sockmap_fallbacks(
            "zcrelay_sockmap_fallbacks_total",
            "Sockmap connections relayed by splice instead, by reason: not_established (a FIN "
            "came first), insert_failed (the kernel refused the map update), no_record, "
            "partly_read (a segment the relay read in part, after a PROXY header, is queued).",
            MetricType::Counter);
        Family selections("zcrelay_route_selections_total",
                          "Connections each route took (listeners with routes; the default "
                          "route included).",
                          MetricType::Counter);
        Family inspect_failures(
            "zcrelay_inspect_failures_total",
            "Inspections of a client's first bytes that matched no conditional route, by reason "
            "(timeout, not_tls, too_large, malformed, no_sni, no_route, closed); the default "
            "route takes those clients if there is one, else they are closed (reason no_route).",
            MetricType::Counter);
        Family inspect_duration("zcrelay_inspect_duration_seconds",
                                "Time from the start of inspection to the route's choice.",
                                MetricType::Histogram);
        for (const ListenerRt& l : rt.listeners) {
            const std::string& name = l.config.name;
            const Sharded<ListenerStats>& st = l.shared->stats;
            if (l.inspects()) {
                for (const RouteRt& r : l.routes) {
                    selections.add({{"listener", name}, {"route", r.config.name}},
                                   static_cast<double>(r.state->selections.sum(
                                       [](const StatCounter& c) { return c.get(); })));
                }
                for (size_t r = 0; r < idx(InspectFailure::kCount); ++r) {
                    inspect_failures.add(
                        {{"listener", name}, {"reason", std::string(kInspectFailureLabels[r])}},
                        static_cast<double>(st.sum([r](const ListenerStats& s) {
                            return s.inspect_failures[r].get();
                        })));
                }
                inspect_duration.addShardedHistogram(
                    {{"listener", name}}, kInspectBuckets, st,
                    [](const ListenerStats& s) -> const auto& { return s.inspect_duration; });
            }
            auto sum = [&](auto get) { return static_cast<double>(st.sum(get)); };
            double accepted = sum([](const ListenerStats& s) { return s.accepted.get(); });
            double closed_total = 0;
            for (size_t r = 0; r < idx(CloseReason::kCount); ++r) {
                double v = sum([r](const ListenerStats& s) { return s.closed[r].get(); });
                closed_total += v;
                closed.add({{"listener", name}, {"reason", std::string(kCloseReasonLabels[r])}}, v);
            }
            conns.add({{"listener", name}}, accepted);
            active.add({{"listener", name}}, accepted - closed_total);
            datapath.add({{"listener", name}, {"mode", std::string(modeName(l.config.mode))}}, 1);
            catchups.add({{"listener", name}},
                         sum([](const ListenerStats& s) { return s.sockmap_catchups.get(); }));
            replays.add({{"listener", name}},
                        sum([](const ListenerStats& s) { return s.sockmap_replays.get(); }));
            skipped.add({{"listener", name}},
                        sum([](const ListenerStats& s) { return s.sockmap_skipped.get(); }));
            copied.add({{"listener", name}},
                       sum([](const ListenerStats& s) { return s.sockmap_copied.get(); }));
            for (size_t r = 0; r < idx(SockmapFallback::kCount); ++r) {
                sockmap_fallbacks.add(
                    {{"listener", name}, {"reason", std::string(kSockmapFallbackLabels[r])}},
                    sum([r](const ListenerStats& s) { return s.sockmap_fallbacks[r].get(); }));
            }
            for (int d = 0; d < 2; ++d) {
                for (size_t p = 0; p < kDataPathLabels.size(); ++p) {
                    bytes.add({{"direction", d == 0 ? "upstream" : "downstream"},
                               {"listener", name},
                               {"path", std::string(kDataPathLabels[p])}},
                              sum([d, p](const ListenerStats& s) { return s.bytes[d][p].get(); }));
                }
            }
            duration.addShardedHistogram(
                {{"listener", name}}, kDurationBuckets, st,
                [](const ListenerStats& s) -> const auto& { return s.duration; });
            half_closed.add({{"listener", name}},
                            sum([](const ListenerStats& s) { return s.half_closed.get(); }));
            sockmap_conns.add({{"listener", name}}, sum([](const ListenerStats& s) {
                                  return s.sockmap_connections.get();
                              }));
            // Rejected: closed before any byte was relayed, for a reason of the relay's own.
            for (CloseReason r :
                 {CloseReason::NoBackend, CloseReason::ProxyProtocol, CloseReason::SourceLimit,
                  CloseReason::NoRoute, CloseReason::Loop}) {
                rejected.add({{"listener", name}, {"reason", std::string(label(r))}},
                             sum([r](const ListenerStats& s) { return s.closed[idx(r)].get(); }));
            }
            rejected.add({{"listener", name}, {"reason", "draining"}},
                         sum([](const ListenerStats& s) { return s.rejected_draining.get(); }));
            for (size_t r = 0; r < idx(ConnectFailure::kCount); ++r) {
                failures.add(
                    {{"listener", name}, {"reason", std::string(kConnectFailureLabels[r])}},
                    sum([r](const ListenerStats& s) { return s.connect_failures[r].get(); }));
            }
            if (l.config.accept_proxy) {
                for (size_t r = 0; r < idx(ProxyFailure::kCount); ++r) {
                    proxy_errors.add(
                        {{"listener", name}, {"reason", std::string(kProxyFailureLabels[r])}},
                        sum([r](const ListenerStats& s) { return s.proxy_errors[r].get(); }));
                }
            }
        }
        for (Family* f : {&conns, &active, &bytes, &duration, &half_closed, &failures, &closed,
                          &rejected, &proxy_errors, &datapath, &sockmap_conns, &sockmap_fallbacks,
                          &catchups, &copied, &replays, &skipped, &selections,
                          &inspect_failures, &inspect_duration})
            out.push_back(f->take());
    }

    void collectBackends(const Runtime& rt, std::vector<MetricFamily>& out) const {
        Family up("zcrelay_backend_up",
                  "1 while health checks and passive ejection let the backend take new "
                  "connections; 0 while they hold it down (the runtime API's say is "
                  "zcrelay_backend_admin_state and zcrelay_backend_weight).",
                  MetricType::Gauge);
        Family attempts("zcrelay_backend_connect_attempts_total",
                        "Connects started to the backend (retries included).", MetricType::Counter);
        Family conns("zcrelay_backend_connections_total",
                     "Connections relayed to the backend (connects that succeeded).",
                     MetricType::Counter);
        Family active("zcrelay_backend_connections_active", "Connections to the backend open now.",
                      MetricType::Gauge);
        Family failures("zcrelay_backend_connect_failures_total",
                        "Connects to the backend that failed, by reason.", MetricType::Counter);
        Family bytes("zcrelay_backend_bytes_total",
                     "Bytes relayed through the backend's connections, by direction.",
                     MetricType::Counter);
        Family connect_time("zcrelay_backend_connect_duration_seconds",
                            "Time from connect() to the connection being established.",
                            MetricType::Histogram);
        Family checks("zcrelay_backend_health_checks_total",
                      "Active health checks of the backend, by result.", MetricType::Counter);
        Family transitions("zcrelay_backend_transitions_total",
                           "Times the backend went up or down (checks or passive ejection).",
                           MetricType::Counter);
        Family admin_state("zcrelay_backend_admin_state",
                           "The runtime API's state of the backend: 1 for the one it is in.",
                           MetricType::Gauge);
        Family weight("zcrelay_backend_weight",
                      "The backend's weight now: the config's or SRV record's, or the runtime "
                      "API's.",
                      MetricType::Gauge);
        for (const ClusterRt& c : rt.clusters) {
            for (const BackendRt& b : c.backends) {
                const BackendState& st = *b.state;
                std::vector<ClientMetric::Label> labels{{"backend", b.key},
                                                        {"cluster", c.config.name}};
                auto with = [&](const char* key, std::string value) {
                    auto l = labels;
                    l.push_back({key, std::move(value)});
                    return l;
                };
                auto sum = [&](auto get) { return static_cast<double>(st.stats.sum(get)); };
                up.add(labels, st.up.load() ? 1 : 0);
                const AdminState now = st.admin.load();
                for (AdminState a : {AdminState::Ready, AdminState::Drain, AdminState::Maint})
                    admin_state.add(with("state", std::string(adminStateName(a))), a == now ? 1 : 0);
                const int32_t set = st.weight_override.load();
                weight.add(labels, set >= 0 ? set : static_cast<double>(b.spec_weight));
                attempts.add(labels, sum([](const BackendStats& s) { return s.attempts.get(); }));
                conns.add(labels, sum([](const BackendStats& s) { return s.connections.get(); }));
                active.add(labels, std::max(0, st.active.load()));
                for (size_t r = 0; r < idx(ConnectFailure::kCount); ++r) {
                    failures.add(
                        with("reason", std::string(kConnectFailureLabels[r])),
                        sum([r](const BackendStats& s) { return s.connect_failures[r].get(); }));
                }
                bytes.add(with("direction", "upstream"),
                          sum([](const BackendStats& s) { return s.bytes_upstream.get(); }));
                bytes.add(with("direction", "downstream"),
                          sum([](const BackendStats& s) { return s.bytes_downstream.get(); }));
                connect_time.addShardedHistogram(
                    labels, kConnectBuckets, st.stats,
                    [](const BackendStats& s) -> const auto& { return s.connect_time; });
                if (c.config.health_check.enabled) {
                    checks.add(with("result", "passed"),
                               static_cast<double>(st.checks_passed.load()));
                    checks.add(with("result", "failed"),
                               static_cast<double>(st.checks_failed.load()));
                }
                transitions.add(with("to", "up"), static_cast<double>(st.went_up.load()));
                transitions.add(with("to", "down"), static_cast<double>(st.went_down.load()));
            }
        }
        for (Family* f : {&up, &attempts, &conns, &active, &failures, &bytes, &connect_time,
                          &checks, &transitions, &admin_state, &weight})
            out.push_back(f->take());
    }

    // Per discovered cluster: its resolutions, when one last succeeded, what it found. The
    // per-backend series above come and go with the discovered set (at most max_backends).
    void collectDiscovery(const Runtime& rt, std::vector<MetricFamily>& out) const {
        const Discovery* discovery = process_->discovery.load();
        if (discovery == nullptr) return;
        Family results("zcrelay_discovery_resolutions_total",
                       "DNS resolutions of a discovered cluster's name, by outcome.",
                       MetricType::Counter);
        Family last("zcrelay_discovery_last_success_timestamp_seconds",
                    "When the cluster's name last resolved to a non-empty set (Unix time; 0: "
                    "never).",
                    MetricType::Gauge);
        Family found("zcrelay_discovery_backends",
                     "Backends the cluster has from DNS now (what the last good answer gave, "
                     "until hold runs out).",
                     MetricType::Gauge);
        Family changes("zcrelay_discovery_changes_total",
                       "Times the cluster's discovered set of backends changed.",
                       MetricType::Counter);
        Family failing("zcrelay_discovery_failing",
                       "1 while the cluster's name fails to resolve (its last good set serving "
                       "for hold, or none).",
                       MetricType::Gauge);
        Family refused("zcrelay_discovery_refused_total",
                       "Addresses DNS answers named that were refused as backends, by reason "
                       "(unspecified, broadcast, multicast, port_zero, self: the relay's own), "
                       "counted per answer.",
                       MetricType::Counter);
        Family refused_now("zcrelay_discovery_refused_addresses",
                           "Addresses the cluster's last answer named that were refused as "
                           "backends, by reason.",
                           MetricType::Gauge);
        const auto views = discovery->views();
        for (const ClusterRt& c : rt.clusters) {
            const auto v = views.find(c.config.name);
            if (v == views.end()) continue;
            const DiscoveryView& view = v->second;
            const std::vector<ClientMetric::Label> labels{{"cluster", c.config.name}};
            for (size_t o = 0; o < kDiscoveryOutcomeLabels.size(); ++o)
                results.add({{"cluster", c.config.name},
                             {"outcome", std::string(kDiscoveryOutcomeLabels[o])}},
                            static_cast<double>(view.results[o]));
            last.add(labels, static_cast<double>(view.last_success_unix_ms) / 1000.0);
            found.add(labels, static_cast<double>(view.backends.size()));
            changes.add(labels, static_cast<double>(view.changes));
            failing.add(labels, view.state == "holding" || view.state == "expired" ? 1 : 0);
            for (size_t r = 0; r < kBackendRefusalLabels.size(); ++r) {
                const std::vector<ClientMetric::Label> by_reason{
                    {"cluster", c.config.name}, {"reason", std::string(kBackendRefusalLabels[r])}};
                refused.add(by_reason, static_cast<double>(view.refused[r]));
                refused_now.add(by_reason, static_cast<double>(view.refused_now[r]));
            }
        }
        for (Family* f : {&results, &last, &found, &changes, &failing, &refused, &refused_now})
            out.push_back(f->take());
    }

    void collectAdmin(std::vector<MetricFamily>& out) const {
        const AdminStats* admin = process_->admin;
        if (admin == nullptr) return;
        Family changes("zcrelay_admin_changes_total",
                       "Changes made through the runtime API, by kind.", MetricType::Counter);
        for (size_t i = 0; i < kAdminChangeLabels.size(); ++i)
            changes.add({{"change", std::string(kAdminChangeLabels[i])}},
                        static_cast<double>(admin->changes[i].load()));
        Family requests("zcrelay_admin_requests_total",
                        "Requests the runtime API answered, by result.", MetricType::Counter);
        for (size_t i = 0; i < kAdminResultLabels.size(); ++i)
            requests.add({{"result", std::string(kAdminResultLabels[i])}},
                         static_cast<double>(admin->results[i].load()));
        Family rejected("zcrelay_admin_endpoint_rejected_total",
                        "Connections the runtime API's server closed and requests it refused, by "
                        "reason.",
                        MetricType::Counter);
        for (size_t r = 0; r < kHttpRejectLabels.size(); ++r)
            rejected.add({{"reason", std::string(kHttpRejectLabels[r])}},
                         static_cast<double>(admin->http.rejected[r].load()));
        for (Family* f : {&changes, &requests, &rejected}) out.push_back(f->take());
    }

    std::function<std::shared_ptr<const Runtime>()> current_;
    std::vector<const WorkerStats*> workers_;
    const ProcessShared* process_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> makeCollector(
    std::function<std::shared_ptr<const Runtime>()> current,
    std::vector<const WorkerStats*> workers, const ProcessShared* process) {
    return std::make_shared<Collector>(std::move(current), std::move(workers), process);
}

}  // namespace zcrelay
