// Prometheus's own checker on what we ship and serve: the deploy config and rules, their unit
// tests, and a scrape after traffic in every mode.
#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <set>
#include <string>

#include "integration/observability_fixture.hpp"

namespace zcrelay::test::observability_test {
namespace {

// =============================================================================================
// The deploy files as promtool reads them.

TEST(PrometheusFiles, ConfigAndRulesPassPromtool) {
    SKIP_WITHOUT("promtool")
    std::string promtool = *findExecutable("promtool");
    // check config also loads the rule files the config names, relative to it.
    CommandResult config = runCommand({promtool, "check", "config", kPrometheusYml}, kToolTimeout);
    EXPECT_TRUE(config.status.cleanExit()) << config.describe();
    EXPECT_NE(config.out.find("1 rule files found"), std::string::npos)
        << "prometheus.yml should load zcrelay.rules.yml: " << config.describe();
    CommandResult rules = runCommand({promtool, "check", "rules", kRulesYml}, kToolTimeout);
    EXPECT_TRUE(rules.status.cleanExit()) << rules.describe();
    // The alerts fire on the series they are meant for, with these labels, and not before their
    // `for`; the throughput recording rule sums away labels the relay may add.
    CommandResult unit = runCommand({promtool, "test", "rules", kRulesTestYml}, kToolTimeout);
    EXPECT_TRUE(unit.status.cleanExit()) << unit.describe();
}

// =============================================================================================
// A scrape after traffic through every data path, as Prometheus's linter reads it.

TEST(MetricsScrape, PassesPromtoolLintAfterTrafficInEveryMode) {
    SKIP_WITHOUT("promtool")
    TrafficRelay traffic;
    ASSERT_NO_FATAL_FAILURE(traffic.run());
    std::string scrape = traffic.scrape();
    ASSERT_FALSE(scrape.empty());

    // promtool prints one line per problem (missing HELP, a counter without _total, a unit that
    // is not a base unit, ...). No exceptions: any output is a failure.
    TempDir dir;
    std::string file = dir.writeFile("metrics.txt", scrape);
    CommandResult lint =
        runCommand({*findExecutable("promtool"), "check", "metrics"}, kToolTimeout, file);
    EXPECT_TRUE(lint.status.cleanExit()) << lint.describe();
    EXPECT_EQ(lint.out + lint.err, "") << "promtool check metrics reported problems:\n"
                                       << lint.out << lint.err;

    // What promtool does not look at: a series exported twice (Prometheus would reject the
    // whole scrape), and a zcrelay family without samples after this traffic.
    std::map<std::string, int> seen;
    for (const Sample& s : parseMetrics(scrape)) ++seen[formatSeries(s.name, s.labels)];
    for (const auto& [series, count] : seen) EXPECT_EQ(count, 1) << "duplicate series " << series;
    std::set<std::string> names = sampleNames(scrape);
    std::regex type_line(R"(# TYPE (zcrelay_\w+) (\w+))");
    for (std::sregex_iterator it(scrape.begin(), scrape.end(), type_line), end; it != end; ++it) {
        std::string family = (*it)[1];
        std::string sample = (*it)[2] == "histogram" ? family + "_count" : family;
        // proxy_protocol_errors_total has series only for accept_proxy listeners (none here).
        if (family == metric::kProxyErrorsTotal) continue;
        EXPECT_EQ(names.count(sample), 1u) << "family " << family << " has no samples";
    }
}

}  // namespace
}  // namespace zcrelay::test::observability_test
