#pragma once
// How the counts reach Prometheus: the one Collectable the /metrics endpoint serializes, its
// families made from the table of metric_table.hpp. Only metrics.cpp includes prometheus-cpp;
// the data path sees the plain counters of stats.hpp.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "metric_table.hpp"
#include "stats.hpp"

namespace prometheus {
class Collectable;
}

namespace zcrelay {

struct Runtime;
struct ProcessShared;

// Builds the Collectable the /metrics endpoint serializes: the sum of all workers' stats, for
// the listeners, clusters and backends of the current Runtime (`current`, called per scrape),
// plus the process's own numbers.
std::shared_ptr<prometheus::Collectable> makeCollector(
    std::function<std::shared_ptr<const Runtime>()> current,
    std::vector<const WorkerStats*> workers, const ProcessShared* process);

// The help /metrics gives `spec`: the table's, its `{key}`s replaced by the numbers of the code
// they name (a buffer size, a hold count). The collector makes each once, at start.
std::string metricHelp(const MetricSpec& spec);

}  // namespace zcrelay
