// The metric table (proxy/metric_table.hpp) and what the repository says about metrics agree:
// the README, every page of docs/, the Grafana board and the Prometheus rules name no metric the
// table lacks, and docs/metrics.md lists every metric the table has. Read as plain text, no relay: the
// observability integration cases check the same files against a live scrape.
//
// How a name in those files is told apart from the rest of the text: a name is a maximal run of
// [A-Za-z0-9_:] that starts with one of our prefixes, `zcrelay_` or `process_` (the six
// standard process metrics), and has more after it (`process_*` in a comment names none).
//  - A run with a colon is a recording rule's name (instance_cluster:zcrelay_backend_up:sum):
//    Prometheus keeps colons for those, and no metric of ours has one. It is not checked.
//  - `_bucket`, `_sum`, `_count` after a histogram's name are the series it exposes; `_total`
//    is part of our counters' names in the table, as on /metrics, so it is never stripped.
//  - A run followed by a dot and a letter, a digit or a `*` is a file's name or a version
//    (process_stats.hpp, process_stats.*, zcrelay_0.1.0_amd64.deb), not a metric's; a name
//    that ends a sentence has a space or a line's end after its dot.
#include "metric_table.hpp"

#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "metrics.hpp"

namespace zcrelay::test {
namespace {

const std::filesystem::path kSourceDir = ZCRELAY_SOURCE_DIR;

std::string readFile(const std::filesystem::path& path) {
    std::ifstream f(path);
    EXPECT_TRUE(f) << "cannot read " << path;
    std::stringstream text;
    text << f.rdbuf();
    return text.str();
}

bool isNameChar(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == ':';
}

// The metric names `text` mentions (see the top of the file), recording rules left out.
std::set<std::string> namesIn(const std::string& text) {
    std::set<std::string> out;
    for (size_t i = 0; i < text.size();) {
        if (!isNameChar(text[i])) {
            ++i;
            continue;
        }
        size_t end = i;
        while (end < text.size() && isNameChar(text[end])) ++end;
        const std::string run = text.substr(i, end - i);
        const bool file_name = end + 1 < text.size() && text[end] == '.' &&
                               (std::isalnum(static_cast<unsigned char>(text[end + 1])) ||
                                text[end + 1] == '*');
        i = end;
        if (file_name) continue;
        bool ours = false;
        for (std::string_view prefix : {"zcrelay_", "process_"})
            ours = ours || (run.size() > prefix.size() && run.starts_with(prefix));
        if (ours && run.find(':') == std::string::npos) out.insert(run);
    }
    return out;
}

const MetricSpec* findMetric(std::string_view name) {
    for (const MetricSpec& m : kMetrics)
        if (m.name == name) return &m;
    return nullptr;
}

// Whether `name` is a metric of the table or a series one of its histograms exposes.
bool inTable(const std::string& name) {
    if (findMetric(name) != nullptr) return true;
    for (std::string_view suffix : {"_bucket", "_sum", "_count"}) {
        if (!name.ends_with(suffix)) continue;
        const MetricSpec* m =
            findMetric(std::string_view(name).substr(0, name.size() - suffix.size()));
        if (m != nullptr && m->kind == MetricKind::Histogram) return true;
    }
    return false;
}

// file -> the names it mentions that the table lacks.
std::map<std::string, std::set<std::string>> unknownNames(
    const std::vector<std::filesystem::path>& files) {
    std::map<std::string, std::set<std::string>> out;
    for (const auto& file : files) {
        for (const std::string& name : namesIn(readFile(file)))
            if (!inTable(name)) out[file.lexically_relative(kSourceDir).string()].insert(name);
    }
    return out;
}

std::string describe(const std::map<std::string, std::set<std::string>>& unknown) {
    std::string out;
    for (const auto& [file, names] : unknown) {
        out += file + ":";
        for (const auto& n : names) out += " " + n;
        out += "\n";
    }
    return out;
}

TEST(MetricTable, TellsNamesFromRecordingRulesAndHistogramSeries) {
    EXPECT_EQ(namesIn("sum(rate(zcrelay_bytes_total{listener=\"a\"}[1m])) "
                      "instance_cluster:zcrelay_backend_up:sum process_open_fds process_* "
                      "zcrelay_connection_duration_seconds_bucket"),
              (std::set<std::string>{"zcrelay_bytes_total", "process_open_fds",
                                     "zcrelay_connection_duration_seconds_bucket"}));
    EXPECT_EQ(namesIn("process_stats.hpp process_stats.* zcrelay_0.1.0_amd64.deb ends "
                      "zcrelay_bytes_total.\n"),
              (std::set<std::string>{"zcrelay_bytes_total"}));
    EXPECT_TRUE(inTable("zcrelay_connection_duration_seconds_bucket"));
    EXPECT_TRUE(inTable("zcrelay_backend_connect_duration_seconds_count"));
    EXPECT_FALSE(inTable("zcrelay_connections_total_count"));  // a counter has no such series
    EXPECT_FALSE(inTable("zcrelay_connections"));              // _total is part of the name
}

TEST(MetricTable, NamesAreUniqueAndHelpsFilled) {
    std::set<std::string_view> seen;
    for (const MetricSpec& m : kMetrics) {
        EXPECT_TRUE(seen.insert(m.name).second) << m.name << " declared twice";
        const std::string help = metricHelp(m);
        EXPECT_EQ(help.find_first_of("{}"), std::string::npos) << m.name << ": " << help;
    }
}

TEST(MetricTable, DocsNameOnlyMetricsOfTheTable) {
    const auto unknown = unknownNames({kSourceDir / "docs/metrics.md"});
    EXPECT_TRUE(unknown.empty()) << "not in proxy/metric_table.hpp:\n" << describe(unknown);
}

// The README and every page a reader walks to from it, beside docs/metrics.md above.
TEST(MetricTable, ReadmeAndEveryDocNameOnlyMetricsOfTheTable) {
    std::vector<std::filesystem::path> files{kSourceDir / "README.md",
                                             kSourceDir / "proxy/kernel.md"};
    for (const auto& entry : std::filesystem::directory_iterator(kSourceDir / "docs"))
        if (entry.path().extension() == ".md") files.push_back(entry.path());
    ASSERT_GE(files.size(), 7u);  // README, kernel notes, five pages
    const auto unknown = unknownNames(files);
    EXPECT_TRUE(unknown.empty()) << "not in proxy/metric_table.hpp:\n" << describe(unknown);
}

TEST(MetricTable, DocsListEveryMetricOfTheTable) {
    const std::set<std::string> listed = namesIn(readFile(kSourceDir / "docs/metrics.md"));
    for (const MetricSpec& m : kMetrics)
        EXPECT_TRUE(listed.contains(std::string(m.name))) << m.name << " not in docs/metrics.md";
}

// Every file of the board and the rules (their unit tests included: their input series).
TEST(MetricTable, GrafanaAndPrometheusNameOnlyMetricsOfTheTable) {
    std::vector<std::filesystem::path> files;
    for (const char* dir : {"deploy/grafana", "deploy/prometheus"})
        for (const auto& entry : std::filesystem::directory_iterator(kSourceDir / dir))
            if (entry.is_regular_file()) files.push_back(entry.path());
    ASSERT_GE(files.size(), 3u);  // the board, the rules, the rules' tests
    const auto unknown = unknownNames(files);
    EXPECT_TRUE(unknown.empty()) << "not in proxy/metric_table.hpp:\n" << describe(unknown);
}

}  // namespace
}  // namespace zcrelay::test
