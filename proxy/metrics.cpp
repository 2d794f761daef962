#include "metrics.hpp"

#include <prometheus/client_metric.h>
#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>
#include <prometheus/metric_type.h>

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <map>
#include <stdexcept>

#include "access_log.hpp"
#include "address.hpp"
#include "admin_api.hpp"
#include "clock.hpp"
#include "config.hpp"
#include "discovery.hpp"
#include "handover.hpp"
#include "metric_table.hpp"
#include "process_shared.hpp"
#include "process_stats.hpp"
#include "pump/copy_pump.hpp"
#include "runtime.hpp"
#include "units.hpp"
#include "version.hpp"

// Every row of the metric table needs its case in Reader::read: a missing one fails the build.
#pragma GCC diagnostic error "-Wswitch"

namespace zcrelay {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// The numbers the helps quote, by the `{key}` the table writes: the constants the code runs with.
struct HelpValue {
    std::string_view key;
    std::string value;
};
std::vector<HelpValue> helpValues() {
    return {{"zerocopy_min", formatSize(kZerocopyMin)},
            {"direction_holds", std::to_string(kDirectionHolds)},
            {"worker_holds", std::to_string(kWorkerHolds)},
            {"copy_buffer_size", formatSize(kCopyBufferSize)},
            {"copy_buffers", std::to_string(kCopyBuffers)}};
}

MetricType prometheusType(MetricKind k) {
    switch (k) {
        case MetricKind::Counter:
            return MetricType::Counter;
        case MetricKind::Gauge:
            return MetricType::Gauge;
        case MetricKind::Histogram:
            return MetricType::Histogram;
    }
    return MetricType::Untyped;
}

// One family of kMetrics being filled for a scrape. A series is given its label values only, in
// the order of the table's label names, so the names are written in one place.
class Family {
  public:
    using Values = std::initializer_list<std::string_view>;

    Family(const MetricSpec& spec, const std::string& help) : spec_(spec) {
        f_.name = std::string(spec.name);
        f_.help = help;
        f_.type = prometheusType(spec.kind);
    }
    // A histogram from per-bucket (not cumulative) counts; the last count is +Inf's.
    template <size_t N>
    void addHistogram(Values values, const std::array<double, N>& bounds,
                      const std::array<uint64_t, N + 1>& counts, double sum) {
        ClientMetric m;
        m.label = labels(values);
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
    }
    // The same, summed over the workers' shards of one UsHistogram (µs sum in seconds).
    template <size_t N, class Shards, class Get>
    void addShardedHistogram(Values values, const std::array<double, N>& bounds,
                             const Shards& shards, Get histogram) {
        std::array<uint64_t, N + 1> counts{};
        for (size_t b = 0; b <= N; ++b)
            counts[b] = shards.sum([&](const auto& s) { return histogram(s).buckets[b].get(); });
        double sum_us = static_cast<double>(
            shards.sum([&](const auto& s) { return histogram(s).sum_us.get(); }));
        addHistogram(values, bounds, counts, sum_us / 1e6);
    }
    void add(Values values, double value) {
        ClientMetric m;
        m.label = labels(values);
        if (f_.type == MetricType::Counter)
            m.counter.value = value;
        else
            m.gauge.value = value;
        f_.metric.push_back(std::move(m));
    }
    MetricFamily take() { return std::move(f_); }

  private:
    std::vector<ClientMetric::Label> labels(Values values) const {
        // A reader below that disagrees with the table: every scrape of every test hits it.
        if (values.size() != spec_.labelCount())
            throw std::logic_error("metric " + f_.name + ": label values and names differ");
        std::vector<ClientMetric::Label> out;
        out.reserve(values.size());
        size_t i = 0;
        for (std::string_view v : values)
            out.push_back({std::string(spec_.labels[i++]), std::string(v)});
        return out;
    }

    const MetricSpec& spec_;
    MetricFamily f_;
};

std::string_view directionLabel(int d) { return d == 0 ? "upstream" : "downstream"; }

template <class S, class Get>
double sumOf(const Sharded<S>& shards, Get get) {
    return static_cast<double>(shards.sum(get));
}

// What one scrape reads once, whichever families need it.
struct Scrape {
    std::shared_ptr<const Runtime> rt;
    ProcessStats ps;
    bool discovering = false;  // discovery runs: its families are exported
    std::map<std::string, DiscoveryView> views;
};

class Collector : public prometheus::Collectable {
  public:
    Collector(std::function<std::shared_ptr<const Runtime>()> current,
              std::vector<const WorkerStats*> workers, const ProcessShared* process)
        : current_(std::move(current)), workers_(std::move(workers)), process_(process) {
        for (const MetricSpec& m : kMetrics) help_.push_back(metricHelp(m));
    }

    std::vector<MetricFamily> Collect() const override {
        Scrape s;
        s.rt = current_();
        s.ps = readProcessStats();
        if (const Discovery* discovery = process_->discovery.load()) {
            s.discovering = true;
            s.views = discovery->views();
        }
        std::vector<MetricFamily> out;
        out.reserve(kMetrics.size());
        for (size_t i = 0; i < kMetrics.size(); ++i) {
            Family f(kMetrics[i], help_[i]);
            if (read(static_cast<Metric>(i), s, f)) out.push_back(f.take());
        }
        return out;
    }

  private:
    template <class Get>
    double workerSum(Get get) const {
        uint64_t total = 0;
        for (const WorkerStats* w : workers_) total += get(*w);
        return static_cast<double>(total);
    }
    template <class Get>
    void perWorker(Family& f, Get get) const {
        for (size_t w = 0; w < workers_.size(); ++w)
            f.add({std::to_string(w)}, static_cast<double>(get(*workers_[w])));
    }
    // fn(listener, name, stats) for each listener.
    template <class Fn>
    static void perListener(const Scrape& s, Fn fn) {
        for (const ListenerRt& l : s.rt->listeners) fn(l, l.config.name, l.shared->stats);
    }
    // fn(backend key, cluster name, cluster, backend, state) for each backend of each cluster.
    template <class Fn>
    static void perBackend(const Scrape& s, Fn fn) {
        for (const ClusterRt& c : s.rt->clusters)
            for (const BackendRt& b : c.backends) fn(b.key, c.config.name, c, b, *b.state);
    }
    // fn(cluster name, view) for each discovered cluster; false when discovery is off.
    template <class Fn>
    static bool perDiscovered(const Scrape& s, Fn fn) {
        if (!s.discovering) return false;
        for (const ClusterRt& c : s.rt->clusters) {
            const auto v = s.views.find(c.config.name);
            if (v != s.views.end()) fn(c.config.name, v->second);
        }
        return true;
    }

    // Fills `f` with metric `m`'s series: what each metric of the table reads. False: the
    // family is not exported at all (discovery or the runtime API is off).
    bool read(Metric m, const Scrape& s, Family& f) const {
        using LS = ListenerStats;
        using BS = BackendStats;
        using WS = WorkerStats;
        switch (m) {
            case Metric::Connections:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    f.add({name}, sumOf(st, [](const LS& x) { return x.accepted.get(); }));
                });
                return true;
            case Metric::ConnectionsActive:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    f.add({name}, sumOf(st, [](const LS& x) { return x.open(); }));
                });
                return true;
            case Metric::Bytes:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    for (int d = 0; d < 2; ++d)
                        for (size_t p = 0; p < kDataPathLabels.size(); ++p)
                            f.add({directionLabel(d), name, kDataPathLabels[p]},
                                  sumOf(st, [d, p](const LS& x) { return x.bytes[d][p].get(); }));
                });
                return true;
            case Metric::ConnectionDuration:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    f.addShardedHistogram(
                        {name}, kDurationBuckets, st,
                        [](const LS& x) -> const auto& { return x.duration; });
                });
                return true;
            case Metric::HalfClosed:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    f.add({name}, sumOf(st, [](const LS& x) { return x.half_closed.get(); }));
                });
                return true;
            case Metric::UpstreamConnectFailures:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    for (size_t r = 0; r < idx(ConnectFailure::kCount); ++r)
                        f.add({name, kConnectFailureLabels[r]},
                              sumOf(st, [r](const LS& x) { return x.connect_failures[r].get(); }));
                });
                return true;
            case Metric::ConnectionsClosed:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    for (size_t r = 0; r < idx(CloseReason::kCount); ++r)
                        f.add({name, kCloseReasonLabels[r]},
                              sumOf(st, [r](const LS& x) { return x.closed[r].get(); }));
                });
                return true;
            case Metric::ConnectionsRejected:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    // Closed before any byte was relayed, for a reason of the relay's own.
                    for (CloseReason r :
                         {CloseReason::NoBackend, CloseReason::ProxyProtocol,
                          CloseReason::SourceLimit, CloseReason::NoRoute, CloseReason::Loop})
                        f.add({name, label(r)},
                              sumOf(st, [r](const LS& x) { return x.closed[idx(r)].get(); }));
                    f.add({name, "draining"},
                          sumOf(st, [](const LS& x) { return x.rejected_draining.get(); }));
                });
                return true;
            case Metric::ProxyProtocolErrors:
                perListener(s, [&](auto& l, auto& name, auto& st) {
                    if (!l.config.accept_proxy) return;
                    for (size_t r = 0; r < idx(ProxyFailure::kCount); ++r)
                        f.add({name, kProxyFailureLabels[r]},
                              sumOf(st, [r](const LS& x) { return x.proxy_errors[r].get(); }));
                });
                return true;
            case Metric::DatapathInfo:
                perListener(s, [&](auto& l, auto& name, auto&) {
                    f.add({name, modeName(l.config.mode)}, 1);
                });
                return true;
            case Metric::DatapathSwitches:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    for (size_t r = 0; r < idx(SwitchReason::kCount); ++r) {
                        DataPath from = switchedFrom(static_cast<SwitchReason>(r));
                        for (size_t p = 0; p < kDataPathLabels.size(); ++p) {
                            if (p == idx(from)) continue;
                            f.add({name, label(from), kDataPathLabels[p], kSwitchReasonLabels[r]},
                                  sumOf(st, [p, r](const LS& x) {
                                      return x.path_switches[p][r].get();
                                  }));
                        }
                    }
                });
                return true;
            case Metric::SockmapConnections:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    f.add({name},
                          sumOf(st, [](const LS& x) { return x.sockmap_connections.get(); }));
                });
                return true;
            case Metric::SockmapFallbacks:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    for (size_t r = 0; r < idx(SockmapFallback::kCount); ++r)
                        f.add({name, kSockmapFallbackLabels[r]},
                              sumOf(st, [r](const LS& x) { return x.sockmap_fallbacks[r].get(); }));
                });
                return true;
            case Metric::SockmapCatchups:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    f.add({name}, sumOf(st, [](const LS& x) { return x.sockmap_catchups.get(); }));
                });
                return true;
            case Metric::SockmapCopiedBytes:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    f.add({name}, sumOf(st, [](const LS& x) { return x.sockmap_copied.get(); }));
                });
                return true;
            case Metric::SockmapReplays:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    f.add({name}, sumOf(st, [](const LS& x) { return x.sockmap_replays.get(); }));
                });
                return true;
            case Metric::SockmapSkippedBytes:
                perListener(s, [&](auto&, auto& name, auto& st) {
                    f.add({name}, sumOf(st, [](const LS& x) { return x.sockmap_skipped.get(); }));
                });
                return true;
            case Metric::RouteSelections:
                perListener(s, [&](auto& l, auto& name, auto&) {
                    if (!l.inspects()) return;
                    for (const RouteRt& r : l.routes)
                        f.add({name, r.config.name},
                              sumOf(r.state->selections,
                                    [](const StatCounter& c) { return c.get(); }));
                });
                return true;
            case Metric::InspectFailures:
                perListener(s, [&](auto& l, auto& name, auto& st) {
                    if (!l.inspects()) return;
                    for (size_t r = 0; r < idx(InspectFailure::kCount); ++r)
                        f.add({name, kInspectFailureLabels[r]},
                              sumOf(st, [r](const LS& x) { return x.inspect_failures[r].get(); }));
                });
                return true;
            case Metric::InspectDuration:
                perListener(s, [&](auto& l, auto& name, auto& st) {
                    if (!l.inspects()) return;
                    f.addShardedHistogram(
                        {name}, kInspectBuckets, st,
                        [](const LS& x) -> const auto& { return x.inspect_duration; });
                });
                return true;

            case Metric::BackendUp:
                perBackend(s, [&](auto& key, auto& cluster, auto&, auto&, auto& st) {
                    f.add({key, cluster}, st.up.load() ? 1 : 0);
                });
                return true;
            case Metric::BackendTier:
                perBackend(s, [&](auto& key, auto& cluster, auto&, auto& b, auto&) {
                    f.add({key, cluster}, b.config.tier);
                });
                return true;
            case Metric::BackendServing:
                for (const ClusterRt& c : s.rt->clusters) {
                    const Serving now = c.serving();
                    for (size_t i = 0; i < c.backends.size(); ++i)
                        f.add({c.backends[i].key, c.config.name},
                              now.admits(c.backends, i) ? 1 : 0);
                }
                return true;
            case Metric::BackendSlowStart: {
                const int64_t now_ms = monotonicMs();
                perBackend(s, [&](auto& key, auto& cluster, auto& c, auto&, auto& st) {
                    f.add({key, cluster},
                          static_cast<double>(st.ramp(c.config.slow_start, now_ms)) /
                              Balancer::kFullRamp);
                });
                return true;
            }
            case Metric::BackendConnectAttempts:
                perBackend(s, [&](auto& key, auto& cluster, auto&, auto&, auto& st) {
                    f.add({key, cluster},
                          sumOf(st.stats, [](const BS& x) { return x.attempts.get(); }));
                });
                return true;
            case Metric::BackendConnections:
                perBackend(s, [&](auto& key, auto& cluster, auto&, auto&, auto& st) {
                    f.add({key, cluster},
                          sumOf(st.stats, [](const BS& x) { return x.connections.get(); }));
                });
                return true;
            case Metric::BackendConnectionsActive:
                perBackend(s, [&](auto& key, auto& cluster, auto&, auto&, auto& st) {
                    f.add({key, cluster}, std::max(0, st.active.load()));
                });
                return true;
            case Metric::BackendConnectFailures:
                perBackend(s, [&](auto& key, auto& cluster, auto&, auto&, auto& st) {
                    for (size_t r = 0; r < idx(ConnectFailure::kCount); ++r)
                        f.add({key, cluster, kConnectFailureLabels[r]},
                              sumOf(st.stats,
                                    [r](const BS& x) { return x.connect_failures[r].get(); }));
                });
                return true;
            case Metric::BackendBytes:
                perBackend(s, [&](auto& key, auto& cluster, auto&, auto&, auto& st) {
                    f.add({key, cluster, "upstream"},
                          sumOf(st.stats, [](const BS& x) { return x.bytes_upstream.get(); }));
                    f.add({key, cluster, "downstream"},
                          sumOf(st.stats, [](const BS& x) { return x.bytes_downstream.get(); }));
                });
                return true;
            case Metric::BackendConnectDuration:
                perBackend(s, [&](auto& key, auto& cluster, auto&, auto&, auto& st) {
                    f.addShardedHistogram(
                        {key, cluster}, kConnectBuckets, st.stats,
                        [](const BS& x) -> const auto& { return x.connect_time; });
                });
                return true;
            case Metric::BackendHealthChecks:
                perBackend(s, [&](auto& key, auto& cluster, auto& c, auto&, auto& st) {
                    if (!c.config.health_check.enabled) return;
                    f.add({key, cluster, "passed"}, static_cast<double>(st.checks_passed.load()));
                    f.add({key, cluster, "failed"}, static_cast<double>(st.checks_failed.load()));
                });
                return true;
            case Metric::BackendTransitions:
                perBackend(s, [&](auto& key, auto& cluster, auto&, auto&, auto& st) {
                    f.add({key, cluster, "up"}, static_cast<double>(st.went_up.load()));
                    f.add({key, cluster, "down"}, static_cast<double>(st.went_down.load()));
                });
                return true;
            case Metric::BackendAdminState:
                perBackend(s, [&](auto& key, auto& cluster, auto&, auto&, auto& st) {
                    const AdminState now = st.admin.load();
                    for (AdminState a : {AdminState::Ready, AdminState::Drain, AdminState::Maint})
                        f.add({key, cluster, adminStateName(a)}, a == now ? 1 : 0);
                });
                return true;
            case Metric::BackendWeight:
                perBackend(s, [&](auto& key, auto& cluster, auto&, auto& b, auto& st) {
                    const int32_t set = st.weight_override.load();
                    f.add({key, cluster}, set >= 0 ? set : static_cast<double>(b.spec_weight));
                });
                return true;

            // Per discovered cluster: its resolutions, when one last succeeded, what it found.
            // The per-backend series above come and go with the discovered set (at most
            // max_backends).
            case Metric::DiscoveryResolutions:
                return perDiscovered(s, [&](auto& cluster, const DiscoveryView& view) {
                    for (size_t o = 0; o < kDiscoveryOutcomeLabels.size(); ++o)
                        f.add({cluster, kDiscoveryOutcomeLabels[o]},
                              static_cast<double>(view.results[o]));
                });
            case Metric::DiscoveryLastSuccess:
                return perDiscovered(s, [&](auto& cluster, const DiscoveryView& view) {
                    f.add({cluster}, static_cast<double>(view.last_success_unix_ms) / 1000.0);
                });
            case Metric::DiscoveryBackends:
                return perDiscovered(s, [&](auto& cluster, const DiscoveryView& view) {
                    f.add({cluster}, static_cast<double>(view.backends.size()));
                });
            case Metric::DiscoveryChanges:
                return perDiscovered(s, [&](auto& cluster, const DiscoveryView& view) {
                    f.add({cluster}, static_cast<double>(view.changes));
                });
            case Metric::DiscoveryFailing:
                return perDiscovered(s, [&](auto& cluster, const DiscoveryView& view) {
                    f.add({cluster}, view.state == "holding" || view.state == "expired" ? 1 : 0);
                });
            case Metric::DiscoveryRefused:
                return perDiscovered(s, [&](auto& cluster, const DiscoveryView& view) {
                    for (size_t r = 0; r < kBackendRefusalLabels.size(); ++r)
                        f.add({cluster, kBackendRefusalLabels[r]},
                              static_cast<double>(view.refused[r]));
                });
            case Metric::DiscoveryRefusedAddresses:
                return perDiscovered(s, [&](auto& cluster, const DiscoveryView& view) {
                    for (size_t r = 0; r < kBackendRefusalLabels.size(); ++r)
                        f.add({cluster, kBackendRefusalLabels[r]},
                              static_cast<double>(view.refused_now[r]));
                });

            case Metric::AdminChanges:
                if (process_->admin == nullptr) return false;
                for (size_t i = 0; i < kAdminChangeLabels.size(); ++i)
                    f.add({kAdminChangeLabels[i]},
                          static_cast<double>(process_->admin->changes[i].load()));
                return true;
            case Metric::AdminRequests:
                if (process_->admin == nullptr) return false;
                for (size_t i = 0; i < kAdminResultLabels.size(); ++i)
                    f.add({kAdminResultLabels[i]},
                          static_cast<double>(process_->admin->results[i].load()));
                return true;
            case Metric::AdminEndpointRejected:
                if (process_->admin == nullptr) return false;
                for (size_t r = 0; r < kHttpRejectLabels.size(); ++r)
                    f.add({kHttpRejectLabels[r]},
                          static_cast<double>(process_->admin->http.rejected[r].load()));
                return true;

            case Metric::PipeFallbacks:
                for (size_t r = 0; r < idx(PipeFallback::kCount); ++r)
                    f.add({kPipeFallbackLabels[r]},
                          workerSum([r](const WS& w) { return w.pipe_fallbacks[r].get(); }));
                return true;
            case Metric::ZerocopySends:
                for (size_t r = 0; r < idx(ZerocopySend::kCount); ++r)
                    f.add({kZerocopySendLabels[r]},
                          workerSum([r](const WS& w) { return w.zerocopy_sends[r].get(); }));
                return true;
            case Metric::CopyBuffersBusy:
                f.add({}, workerSum([](const WS& w) { return w.copy_buffers_busy.get(); }));
                return true;
            case Metric::WorkerConnections:
                perWorker(f, [](const WS& w) { return w.accepted.get(); });
                return true;
            case Metric::PipesInUse:
                f.add({}, workerSum([](const WS& w) { return w.pipes_in_use.get(); }));
                return true;
            case Metric::PipesCached:
                f.add({}, workerSum([](const WS& w) { return w.pipes_cached.get(); }));
                return true;
            case Metric::PipesCapacity:
                f.add({}, static_cast<double>(s.rt->config.max_pipes));
                return true;
            case Metric::SockmapSockets:
                f.add({}, workerSum([](const WS& w) { return w.sockmap_sockets.get(); }));
                return true;
            case Metric::SockmapWakeupsLost:
                f.add({}, workerSum([](const WS& w) { return w.sockmap_wakeups_lost.get(); }));
                return true;
            case Metric::AcceptPaused:
                f.add({}, workerSum([](const WS& w) { return w.accept_paused.get(); }));
                return true;
            case Metric::SpliceEagain: {
                // WorkerStats::splice_eagain's second index.
                static constexpr std::string_view kCauses[] = {"socket_empty", "pipe_full"};
                for (int d = 0; d < 2; ++d)
                    for (int cause = 0; cause < 2; ++cause)
                        f.add({directionLabel(d), kCauses[cause]},
                              workerSum([d, cause](const WS& w) {
                                  return w.splice_eagain[d][cause].get();
                              }));
                return true;
            }
            case Metric::RingSqesSubmitted:
                perWorker(f, [](const WS& w) { return w.sqes_submitted.get(); });
                return true;
            case Metric::RingCqOverflow:
                perWorker(f, [](const WS& w) { return w.cq_overflow.get(); });
                return true;

            case Metric::ProcessThreads:
                f.add({}, s.ps.threads);
                return true;
            case Metric::IowqWorkers:
                f.add({}, s.ps.iowq_workers);
                return true;
            case Metric::ProcessOpenFds:
                f.add({}, s.ps.open_fds);
                return true;
            case Metric::ProcessMaxFds:
                f.add({}, static_cast<double>(s.ps.max_fds));
                return true;
            case Metric::ProcessResidentMemory:
                f.add({}, static_cast<double>(s.ps.rss_bytes));
                return true;
            case Metric::ProcessVirtualMemory:
                f.add({}, static_cast<double>(s.ps.virtual_bytes));
                return true;
            case Metric::ProcessCpuSeconds:
                f.add({}, s.ps.cpu_seconds);
                return true;
            case Metric::ProcessStartTime:
                f.add({}, s.ps.start_time_seconds);
                return true;

            case Metric::Draining:
                f.add({}, process_->draining.load() ? 1 : 0);
                return true;
            case Metric::BuildInfo:
                f.add({releaseVersion(), "io_uring", process_->sockmap_loaded ? "loaded" : "off"},
                      1);
                return true;
            case Metric::ConfigGeneration:
                f.add({}, static_cast<double>(s.rt->generation));
                return true;
            case Metric::ConfigReloads:
                f.add({"success"}, static_cast<double>(process_->reloads_ok.load()));
                f.add({"failure"}, static_cast<double>(process_->reloads_failed.load()));
                return true;
            case Metric::Takeovers:
                for (size_t r = 0; r < kTakeoverResults.size(); ++r)
                    f.add({kTakeoverResults[r]},
                          static_cast<double>(process_->takeovers[r].load()));
                return true;
            case Metric::HandoverConnections:
                for (size_t r = 0; r < kHandoverResults; ++r)
                    f.add({handover::kResultLabels[r]},
                          static_cast<double>(process_->handovers[r].load()));
                return true;
            case Metric::AccessLogDropped:
                f.add({}, process_->access_log ? process_->access_log->totalDropped() : 0);
                return true;
            case Metric::Signals:
                for (size_t i = 0; i < kSignals.size(); ++i)
                    f.add({kSignals[i].name}, static_cast<double>(process_->signals[i].load()));
                return true;
            case Metric::MetricsEndpointRejected:
                for (size_t r = 0; r < kHttpRejectLabels.size(); ++r)
                    f.add({kHttpRejectLabels[r]},
                          static_cast<double>(process_->endpoint.rejected[r].load()));
                return true;
            case Metric::MetricsEndpointRequests:
                f.add({}, static_cast<double>(process_->endpoint.requests.load()));
                return true;
            case Metric::MetricsEndpointConnections:
                f.add({}, static_cast<double>(process_->endpoint.connections.load()));
                return true;
            case Metric::kCount:
                break;
        }
        return false;
    }

    std::function<std::shared_ptr<const Runtime>()> current_;
    std::vector<const WorkerStats*> workers_;
    const ProcessShared* process_;
    std::vector<std::string> help_;  // kMetrics' helps, their numbers filled in (metricHelp)
};

}  // namespace

std::string metricHelp(const MetricSpec& spec) {
    std::string help(spec.help);
    for (const auto& [key, value] : helpValues()) {
        const std::string placeholder = "{" + std::string(key) + "}";
        for (size_t at; (at = help.find(placeholder)) != std::string::npos;)
            help.replace(at, placeholder.size(), value);
    }
    return help;
}

std::shared_ptr<prometheus::Collectable> makeCollector(
    std::function<std::shared_ptr<const Runtime>()> current,
    std::vector<const WorkerStats*> workers, const ProcessShared* process) {
    return std::make_shared<Collector>(std::move(current), std::move(workers), process);
}

}  // namespace zcrelay
