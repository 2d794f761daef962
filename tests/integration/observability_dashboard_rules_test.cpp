// The Grafana dashboard and the Prometheus rules name only metrics a live relay exports, and the
// dashboard is shaped to import anywhere.
#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>

#include "integration/observability_fixture.hpp"

namespace zcrelay::test::observability_test {
namespace {

std::string joined(const std::set<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
}

// =============================================================================================
// The dashboard and the rules name only metrics a live relay exports.

TEST(PromqlNames, ExtractsTheSelectedMetrics) {
    using Names = std::set<std::string>;
    EXPECT_EQ(promqlMetricNames("sum by (listener, direction) (rate(zcrelay_bytes_total"
                                "{listener=~\"$listener\"}[$__rate_interval]))"),
              Names{"zcrelay_bytes_total"});
    EXPECT_EQ(promqlMetricNames("histogram_quantile(0.99, sum by (le) (rate(a_bucket{x=\"y,z\"}"
                                "[5m]))) > bool 1e-3"),
              Names{"a_bucket"});
    EXPECT_EQ(promqlMetricNames("a / on(instance) group_left(le) b offset 5m > 0.05 and "
                                "sum(c) without (d) or up{job=\"zcrelay\"} == 0 unless e"),
              (Names{"a", "b", "c", "up", "e"}));
    EXPECT_EQ(promqlMetricNames("changes(g[${__interval}]) > 0 # comment f"), Names{"g"});
    EXPECT_EQ(variableQueryMetricNames("label_values(zcrelay_connections_total{instance=~\"$i\"},"
                                       " listener)"),
              Names{"zcrelay_connections_total"});
    EXPECT_EQ(variableQueryMetricNames("label_values(listener)"), Names{});
}

TEST(GrafanaDashboard, ShapeDatasourceAndVariables) {
    std::string error;
    std::optional<Json> board = readDashboard(error);
    ASSERT_TRUE(board) << kDashboardJson << ": " << error;
    const Json* schema = board->get("schemaVersion");
    ASSERT_NE(schema, nullptr);
    EXPECT_GE(schema->number, 36) << "a dashboard for Grafana 9.4+";
    EXPECT_EQ(board->str("uid"), "zcrelay");

    std::map<std::string, std::string> variables;  // name -> type
    if (const Json* templating = board->get("templating"))
        for (const Json& v : templating->items("list")) variables[v.str("name")] = v.str("type");
    EXPECT_EQ(variables["datasource"], "datasource") << "a Prometheus data source variable";
    EXPECT_EQ(variables["listener"], "query");
    EXPECT_EQ(variables["cluster"], "query");

    // Every query goes to the data source the variable picks, so the board imports anywhere.
    auto usesVariable = [](const Json& owner) {
        const Json* ds = owner.get("datasource");
        return ds != nullptr && ds->str("type") == "prometheus" &&
               ds->str("uid") == "${datasource}";
    };
    std::set<int> ids;
    for (const Json* p : dashboardPanels(*board)) {
        std::string title = p->str("title");
        const Json* id = p->get("id");
        ASSERT_NE(id, nullptr) << title;
        EXPECT_TRUE(ids.insert(static_cast<int>(id->number)).second) << "duplicate id " << title;
        EXPECT_NE(p->get("gridPos"), nullptr) << title;
        if (p->str("type") == "row") continue;
        EXPECT_TRUE(usesVariable(*p)) << "panel " << title;
        EXPECT_FALSE(p->items("targets").empty()) << "panel " << title << " has no query";
        for (const Json& t : p->items("targets")) {
            EXPECT_TRUE(usesVariable(t)) << "panel " << title << " target " << t.str("refId");
            EXPECT_FALSE(t.str("expr").empty()) << "panel " << title;
        }
    }
    // Variables the exprs use exist (Grafana leaves an unknown $x in the query, which then
    // matches nothing).
    std::regex var(R"(\$\{?([A-Za-z_][A-Za-z0-9_]*))");
    for (const Expr& e : dashboardExprs(*board)) {
        for (std::sregex_iterator it(e.expr.begin(), e.expr.end(), var), end; it != end; ++it) {
            std::string name = (*it)[1];
            if (name.rfind("__", 0) == 0) continue;  // Grafana's built-ins
            EXPECT_EQ(variables.count(name), 1u) << e.where << " uses undefined $" << name;
        }
    }
}

TEST(GrafanaDashboard, NamesOnlyMetricsTheRelayExports) {
    std::string error;
    std::optional<Json> board = readDashboard(error);
    ASSERT_TRUE(board) << kDashboardJson << ": " << error;
    TrafficRelay traffic;
    ASSERT_NO_FATAL_FAILURE(traffic.run());
    std::set<std::string> exported = sampleNames(traffic.scrape());
    ASSERT_FALSE(exported.empty());

    std::set<std::string> used;
    for (const Expr& e : dashboardExprs(*board)) {
        std::set<std::string> names =
            e.variable ? variableQueryMetricNames(e.expr) : promqlMetricNames(e.expr);
        EXPECT_FALSE(names.empty()) << e.where << " selects no metric: " << e.expr;
        for (const std::string& n : names) {
            EXPECT_EQ(exported.count(n), 1u)
                << e.where << " uses " << n << ", which the relay does not export: " << e.expr;
            used.insert(n);
        }
    }
    // The panels an operator looks for first.
    for (const char* must :
         {"zcrelay_bytes_total", "zcrelay_connections_active", "zcrelay_connections_closed_total",
          "zcrelay_backend_connect_duration_seconds_bucket", "zcrelay_backend_up",
          "zcrelay_backend_transitions_total", "zcrelay_pipe_fallbacks_total",
          "zcrelay_sockmap_fallbacks_total", "zcrelay_process_threads",
          "zcrelay_config_reloads_total", "zcrelay_upstream_connect_failures_total"})
        EXPECT_EQ(used.count(must), 1u) << "the dashboard has no panel on " << must;
    std::cout << "dashboard metrics: " << joined(used) << "\n";
}

TEST(PrometheusRules, NameOnlyMetricsTheRelayExports) {
    RuleFile rules = readRules(kRulesYml);
    ASSERT_GE(rules.exprs.size(), 5u) << "read too few exprs from " << kRulesYml;
    TrafficRelay traffic;
    ASSERT_NO_FATAL_FAILURE(traffic.run());
    std::set<std::string> known = sampleNames(traffic.scrape());
    // `up` is Prometheus's own series per target; recorded names are the file's own.
    known.insert("up");
    known.insert(rules.recorded.begin(), rules.recorded.end());
    for (const Expr& e : rules.exprs) {
        std::set<std::string> names = promqlMetricNames(e.expr);
        EXPECT_FALSE(names.empty()) << e.where << " selects no metric: " << e.expr;
        for (const std::string& n : names)
            EXPECT_EQ(known.count(n), 1u)
                << e.where << " uses " << n << ", which the relay does not export: " << e.expr;
    }
}

}  // namespace
}  // namespace zcrelay::test::observability_test
