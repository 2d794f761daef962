#include "metrics.hpp"

#include <prometheus/exposer.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "address.hpp"
#include "config.hpp"

namespace zcrelay {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

int processThreads() {
    // /proc/self/status "Threads:" counts io-wq workers too (they are threads of this process):
    // the number that shows a thread explosion if the data path ever starts blocking in io-wq.
    FILE* f = std::fopen("/proc/self/status", "r");
    if (f == nullptr) return -1;
    char line[256];
    int threads = -1;
    while (std::fgets(line, sizeof line, f) != nullptr) {
        if (std::sscanf(line, "Threads: %d", &threads) == 1) break;
    }
    std::fclose(f);
    return threads;
}

class Family {
  public:
    Family(std::string name, std::string help, MetricType type) {
        f_.name = std::move(name);
        f_.help = std::move(help);
        f_.type = type;
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
    Collector(const Config& config, std::vector<const WorkerStats*> workers)
        : workers_(std::move(workers)) {
        for (const auto& l : config.listeners) {
            listeners_.push_back(l.name);
            modes_.push_back(std::string(modeName(l.mode)));
        }
    }

    std::vector<MetricFamily> Collect() const override {
        auto sum = [&](auto get) {
            uint64_t total = 0;
            for (const WorkerStats* w : workers_) total += get(*w);
            return static_cast<double>(total);
        };
        Family conns("zcrelay_connections_total", "Downstream connections accepted.",
                     MetricType::Counter);
        Family active("zcrelay_connections_active",
                      "Connections open now (accepted, not yet closed).", MetricType::Gauge);
        Family bytes("zcrelay_bytes_total",
                     "Bytes relayed: direction=upstream is client to upstream, downstream is "
                     "upstream to client.",
                     MetricType::Counter);
        Family failures("zcrelay_upstream_connect_failures_total",
                        "Upstream connects that failed, by reason.", MetricType::Counter);
        Family closed("zcrelay_connections_closed_total", "Connections closed, by reason.",
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
            "came first), insert_failed (the kernel refused the map update), no_record.",
            MetricType::Counter);
        for (size_t i = 0; i < listeners_.size(); ++i) {
            const std::string& name = listeners_[i];
            double accepted =
                sum([i](const WorkerStats& w) { return w.listeners[i].accepted.get(); });
            double closed_total = 0;
            for (size_t r = 0; r < idx(CloseReason::kCount); ++r) {
                double v =
                    sum([i, r](const WorkerStats& w) { return w.listeners[i].closed[r].get(); });
                closed_total += v;
                closed.add({{"listener", name}, {"reason", std::string(kCloseReasonLabels[r])}}, v);
            }
            conns.add({{"listener", name}}, accepted);
            datapath.add({{"listener", name}, {"mode", modes_[i]}}, 1);
            catchups.add({{"listener", name}}, sum([i](const WorkerStats& w) {
                             return w.listeners[i].sockmap_catchups.get();
                         }));
            replays.add({{"listener", name}}, sum([i](const WorkerStats& w) {
                            return w.listeners[i].sockmap_replays.get();
                        }));
            skipped.add({{"listener", name}}, sum([i](const WorkerStats& w) {
                            return w.listeners[i].sockmap_skipped.get();
                        }));
            copied.add({{"listener", name}}, sum([i](const WorkerStats& w) {
                           return w.listeners[i].sockmap_copied.get();
                       }));
            for (size_t r = 0; r < idx(SockmapFallback::kCount); ++r) {
                sockmap_fallbacks.add(
                    {{"listener", name}, {"reason", std::string(kSockmapFallbackLabels[r])}},
                    sum([i, r](const WorkerStats& w) {
                        return w.listeners[i].sockmap_fallbacks[r].get();
                    }));
            }
            active.add({{"listener", name}}, accepted - closed_total);
            bytes.add(
                {{"direction", "upstream"}, {"listener", name}},
                sum([i](const WorkerStats& w) { return w.listeners[i].bytes_upstream.get(); }));
            bytes.add(
                {{"direction", "downstream"}, {"listener", name}},
                sum([i](const WorkerStats& w) { return w.listeners[i].bytes_downstream.get(); }));
            for (size_t r = 0; r < idx(ConnectFailure::kCount); ++r) {
                failures.add(
                    {{"listener", name}, {"reason", std::string(kConnectFailureLabels[r])}},
                    sum([i, r](const WorkerStats& w) {
                        return w.listeners[i].connect_failures[r].get();
                    }));
            }
        }
        Family fallbacks(
            "zcrelay_pipe_fallbacks_total",
            "Directions that wanted a pipe and moved their bytes by copy instead, by reason.",
            MetricType::Counter);
        for (size_t r = 0; r < idx(PipeFallback::kCount); ++r) {
            fallbacks.add({{"reason", std::string(kPipeFallbackLabels[r])}},
                          sum([r](const WorkerStats& w) { return w.pipe_fallbacks[r].get(); }));
        }
        Family per_worker(
            "zcrelay_worker_connections_total",
            "Connections accepted by each worker (shows how SO_REUSEPORT spreads them).",
            MetricType::Counter);
        for (size_t w = 0; w < workers_.size(); ++w) {
            uint64_t n = 0;
            for (const ListenerStats& l : workers_[w]->listeners) n += l.accepted.get();
            per_worker.add({{"worker", std::to_string(w)}}, static_cast<double>(n));
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
        Family threads("zcrelay_process_threads",
                       "Threads of the process, io_uring io-wq workers included.",
                       MetricType::Gauge);
        threads.add({}, processThreads());
        Family info("zcrelay_build_info", "Build information; the value is always 1.",
                    MetricType::Gauge);
        info.add({{"version", ZCRELAY_VERSION}}, 1);

        std::vector<MetricFamily> out;
        for (Family* f : {&conns, &active, &bytes, &failures, &closed, &datapath, &fallbacks,
                          &sockmap_fallbacks, &catchups, &copied, &replays, &skipped, &per_worker,
                          &in_use, &cached, &sockmap_sockets, &paused, &threads, &info})
            out.push_back(f->take());
        return out;
    }

  private:
    std::vector<const WorkerStats*> workers_;
    std::vector<std::string> listeners_;
    std::vector<std::string> modes_;
};

}  // namespace

MetricsEndpoint::MetricsEndpoint(const Config& config, std::vector<const WorkerStats*> workers)
    : address_(config.metrics.listen),
      collector_(std::make_shared<Collector>(config, std::move(workers))) {
    // One civetweb thread is plenty for scrapes and keeps the process's thread count small.
    exposer_ = std::make_unique<prometheus::Exposer>(config.metrics.listen.toString(), 1);
    exposer_->RegisterCollectable(collector_);
}

MetricsEndpoint::~MetricsEndpoint() {
    // civetweb's mg_stop() raises a flag and joins its listening thread, which looks at the flag
    // only between poll() rounds of 2 s: shutting down would take up to 2 s for nothing. A
    // connection to our own port ends the round at once. Bounded: the loop ends when the
    // exposer is gone, which the poll quantum guarantees anyway.
    SocketAddress self = address_;
    self.setPort(port());
    std::atomic<bool> stopped{false};
    std::thread kick([&] {
        while (!stopped.load()) {
            int fd = ::socket(self.family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
            if (fd < 0) break;
            ::connect(fd, self.sockaddrPtr(), self.length);
            ::close(fd);
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
    });
    exposer_.reset();
    stopped.store(true);
    kick.join();
}

uint16_t MetricsEndpoint::port() const {
    auto ports = exposer_->GetListeningPorts();
    return ports.empty() ? 0 : static_cast<uint16_t>(ports.front());
}

std::string renderMetrics(const Config& config, const std::vector<const WorkerStats*>& workers) {
    Collector c(config, workers);
    return prometheus::TextSerializer().Serialize(c.Collect());
}

}  // namespace zcrelay
