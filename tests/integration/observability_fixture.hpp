#pragma once
// What the observability tests (observability_*_test.cpp) share: the deploy files' paths and
// readers, the metric names a PromQL expression selects, and a relay with traffic in every mode.
//
// Operating zcrelay: its /metrics as Prometheus's own tools read it, a real Prometheus scraping a
// relay during a known transfer, and the files in deploy/ (the Prometheus config, its rules, the
// Grafana dashboard) checked against the metrics a live relay really exports, so renaming a
// metric fails here instead of leaving an empty panel or an alert that can never fire.
//
// promtool and prometheus come from Debian's `prometheus` package (deploy/install-deps.sh); a
// test that needs one skips, saying so, where it is missing. Every wait is bounded: the relay
// fixture's own deadlines, promtool runs at most 20 s, Prometheus gets 20 s to become ready and
// each query 10 s, and it is stopped by its PID (SIGTERM, then SIGKILL after 10 s).
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cctype>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "support/dns_server.hpp"
#include "support/json.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::observability_test {

inline constexpr uint64_t kSeed = 0x0B5E;
inline constexpr Millis kToolTimeout{20'000};

inline const std::string kSourceDir = ZCRELAY_SOURCE_DIR;
inline const std::string kPrometheusYml = kSourceDir + "/deploy/prometheus/prometheus.yml";
inline const std::string kRulesYml = kSourceDir + "/deploy/prometheus/zcrelay.rules.yml";
inline const std::string kRulesTestYml = kSourceDir + "/deploy/prometheus/zcrelay.rules.test.yml";
inline const std::string kDashboardJson = kSourceDir + "/deploy/grafana/zcrelay.json";

// =============================================================================================
// The metric names a PromQL expression selects. Not a PromQL parser: a scan that skips strings,
// label matchers {...}, ranges [...], Grafana variables ($x, ${x}), numbers and durations, the
// label lists of by/without/on/ignoring/group_left/group_right, and identifiers followed by "("
// (functions and aggregations). What is left are bare selectors: the metric names. A histogram's
// series keep their suffix (name_bucket), which is what the scrape shows too.

inline bool isIdentStart(char c) {
    return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':';
}
inline bool isIdentChar(char c) {
    return isIdentStart(c) || std::isdigit(static_cast<unsigned char>(c));
}

// Index just past the bracket that closes the one at `i` (same kind), skipping quoted strings.
inline size_t skipBracketed(std::string_view q, size_t i) {
    char open = q[i];
    char close = open == '{' ? '}' : open == '[' ? ']' : ')';
    int depth = 0;
    for (; i < q.size(); ++i) {
        char c = q[i];
        if (c == '"' || c == '\'') {
            for (++i; i < q.size() && q[i] != c; ++i)
                if (q[i] == '\\') ++i;
        } else if (c == open) {
            ++depth;
        } else if (c == close && --depth == 0) {
            return i + 1;
        }
    }
    return q.size();
}

inline std::set<std::string> promqlMetricNames(std::string_view q) {
    static const std::set<std::string> kLabelListKeywords = {
        "by", "without", "on", "ignoring", "group_left", "group_right"};
    static const std::set<std::string> kKeywords = {
        "by",   "without", "on", "ignoring", "group_left", "group_right", "offset",
        "bool", "and",     "or", "unless",   "atan2",      "inf",         "nan"};
    std::set<std::string> names;
    size_t i = 0;
    while (i < q.size()) {
        char c = q[i];
        if (c == '"' || c == '\'' || c == '`') {
            for (++i; i < q.size() && q[i] != c; ++i)
                if (q[i] == '\\' && c != '`') ++i;
            ++i;
        } else if (c == '{' || c == '[') {
            i = skipBracketed(q, i);
        } else if (c == '#') {  // a PromQL comment runs to the end of the line
            while (i < q.size() && q[i] != '\n') ++i;
        } else if (c == '$') {  // a Grafana variable: $name or ${name}
            ++i;
            if (i < q.size() && q[i] == '{')
                i = skipBracketed(q, i);
            else
                while (i < q.size() && isIdentChar(q[i])) ++i;
        } else if (std::isdigit(static_cast<unsigned char>(c)) || c == '.') {
            // Numbers (1e-9, 0.99, 0x1f) and durations (5m, 1h30m).
            while (i < q.size() &&
                   (isIdentChar(q[i]) || q[i] == '.' ||
                    ((q[i] == '+' || q[i] == '-') && (q[i - 1] == 'e' || q[i - 1] == 'E'))))
                ++i;
        } else if (isIdentStart(c)) {
            size_t start = i;
            while (i < q.size() && isIdentChar(q[i])) ++i;
            std::string ident(q.substr(start, i - start));
            size_t next = i;
            while (next < q.size() && std::isspace(static_cast<unsigned char>(q[next]))) ++next;
            std::string lower = ident;
            for (char& ch : lower)
                ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
            // An aggregation may put its clause first: `sum by (l) (x)`.
            bool call = next < q.size() &&
                        (q[next] == '(' || q.compare(next, 3, "by ") == 0 ||
                         q.compare(next, 3, "by(") == 0 || q.compare(next, 7, "without") == 0);
            if (call && kLabelListKeywords.count(lower) != 0)
                i = skipBracketed(q, next);
            else if (!call && kKeywords.count(lower) == 0)
                names.insert(ident);
        } else {
            ++i;
        }
    }
    return names;
}

// The metric names a Grafana query variable reads: label_values(selector, label) reads the
// selector's; label_values(label) and label_names() read none; query_result(expr) reads expr's.
inline std::set<std::string> variableQueryMetricNames(std::string_view q) {
    auto inner = [&](std::string_view fn) -> std::optional<std::string_view> {
        size_t open = q.find('(');
        if (q.substr(0, open).find(fn) == std::string_view::npos || open == std::string_view::npos)
            return std::nullopt;
        size_t close = q.rfind(')');
        if (close == std::string_view::npos || close < open) return std::nullopt;
        return q.substr(open + 1, close - open - 1);
    };
    if (auto args = inner("label_values")) {
        // The selector ends at the last top-level comma.
        size_t comma = std::string_view::npos;
        for (size_t i = 0; i < args->size(); ++i) {
            char c = (*args)[i];
            if (c == '{' || c == '[' || c == '(')
                i = skipBracketed(*args, i) - 1;
            else if (c == ',')
                comma = i;
        }
        if (comma == std::string_view::npos) return {};
        return promqlMetricNames(args->substr(0, comma));
    }
    if (auto expr = inner("query_result")) return promqlMetricNames(*expr);
    return {};
}

// =============================================================================================
// The dashboard and the rules, as lists of expressions with where they came from.

struct Expr {
    std::string where;  // "panel 3 \"Active connections\" target A"
    std::string expr;
    bool variable = false;      // a template variable's query (label_values(...)), not PromQL
    bool may_be_empty = false;  // annotations and filters: no series is a valid answer
};

inline std::string readText(const std::string& path) { return readFileText(path, 4 << 20); }

inline std::optional<Json> readDashboard(std::string& error) {
    std::string text = readText(kDashboardJson);
    if (text.empty()) {
        error = "cannot read " + kDashboardJson;
        return std::nullopt;
    }
    return parseJson(text, error);
}

// Top-level panels and the panels of collapsed rows (an expanded row's panels follow it at the
// top level).
inline std::vector<const Json*> dashboardPanels(const Json& board) {
    std::vector<const Json*> out;
    for (const Json& p : board.items("panels")) {
        out.push_back(&p);
        for (const Json& nested : p.items("panels")) out.push_back(&nested);
    }
    return out;
}

inline std::vector<Expr> dashboardExprs(const Json& board) {
    std::vector<Expr> out;
    for (const Json* p : dashboardPanels(board)) {
        std::string panel =
            "panel " + std::to_string(static_cast<int>(p->get("id") ? p->get("id")->number : -1)) +
            " \"" + p->str("title") + "\"";
        for (const Json& t : p->items("targets"))
            out.push_back({panel + " target " + t.str("refId"), t.str("expr")});
    }
    if (const Json* annotations = board.get("annotations")) {
        for (const Json& a : annotations->items("list"))
            if (!a.str("expr").empty())
                out.push_back({"annotation \"" + a.str("name") + "\"", a.str("expr"), false, true});
    }
    if (const Json* templating = board.get("templating")) {
        for (const Json& v : templating->items("list")) {
            if (v.str("type") != "query") continue;
            const Json* q = v.get("query");
            std::string text = q == nullptr                    ? ""
                               : q->type == Json::Type::String ? q->string
                                                               : q->str("query");
            out.push_back({"variable $" + v.str("name"), text, true});
        }
    }
    return out;
}

struct RuleFile {
    std::vector<Expr> exprs;
    std::set<std::string> recorded;  // names the file's recording rules define
};

inline size_t indentOf(const std::string& line) { return line.find_first_not_of(' '); }

inline std::string trim(std::string s) {
    size_t b = s.find_first_not_of(" \t\r");
    size_t e = s.find_last_not_of(" \t\r");
    return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// Enough YAML for zcrelay.rules.yml as written: `expr:` with the expression on the same line
// (plain or quoted) or in a block scalar (| or >-) on the lines indented deeper; `record:` and
// `alert:` name the rule. The YAML itself is checked by promtool; this only lists the exprs.
inline RuleFile readRules(const std::string& path) {
    RuleFile out;
    std::vector<std::string> lines;
    {
        std::string text = readText(path);
        size_t start = 0;
        while (start <= text.size()) {
            size_t end = text.find('\n', start);
            if (end == std::string::npos) end = text.size();
            lines.push_back(text.substr(start, end - start));
            start = end + 1;
        }
    }
    std::string rule;
    auto value = [](const std::string& line, const std::string& key) -> std::optional<std::string> {
        std::string t = trim(line);
        if (t.rfind("- ", 0) == 0) t = trim(t.substr(2));
        if (t.rfind(key + ":", 0) != 0) return std::nullopt;
        return trim(t.substr(key.size() + 1));
    };
    for (size_t i = 0; i < lines.size(); ++i) {
        const std::string& line = lines[i];
        if (trim(line).empty() || trim(line)[0] == '#') continue;
        if (auto r = value(line, "record")) {
            rule = "record " + *r;
            out.recorded.insert(*r);
        } else if (auto a = value(line, "alert")) {
            rule = "alert " + *a;
        } else if (auto e = value(line, "expr")) {
            std::string expr = *e;
            if (expr.empty() || expr[0] == '|' || expr[0] == '>') {
                expr.clear();
                size_t indent = indentOf(line);
                while (i + 1 < lines.size() &&
                       (trim(lines[i + 1]).empty() || indentOf(lines[i + 1]) > indent)) {
                    expr += trim(lines[++i]) + "\n";
                }
            } else if (expr.size() >= 2 && (expr[0] == '"' || expr[0] == '\'') &&
                       expr.back() == expr[0]) {
                expr = expr.substr(1, expr.size() - 2);
            }
            out.exprs.push_back({rule, expr, false, true});
        }
    }
    return out;
}

// =============================================================================================
// A relay with traffic through every data path: listeners s (splice), c (copy), m (sockmap) to
// echo upstreams, and k to cluster "app" of two health-checked echo backends. After run(), every
// family the relay exports has had the chance to show its series.

class TrafficRelay {
  public:
    static constexpr uint64_t kListenerBytes = 1 * kMiB;
    static constexpr uint64_t kClusterBytes = 64 * kKiB;
    static constexpr int kClusterConnections = 4;

    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void run() {
        for (const auto* up : {&splice_up_, &copy_up_, &sockmap_up_, &backend_a_, &backend_b_})
            ASSERT_TRUE(up->ok()) << up->error();
        // A cluster from DNS (backend_a's address, from a real dnsmasq), so the discovery
        // families have samples for promtool and the rules that read them.
        ASSERT_TRUE(dns_.start());
        ASSERT_TRUE(dns_.setAddresses("obs.test", {"127.0.0.1"}));
        RelayConfig config;
        config.workers = 2;
        auto add = [&](const std::string& name, const std::string& mode,
                       const ScriptedUpstream* up) {
            ListenerSpec l;
            l.name = name;
            l.mode = mode;
            if (up != nullptr)
                l.upstream = up->hostPort();
            else
                l.cluster = "app";
            config.listeners.push_back(l);
        };
        add("s", "splice", &splice_up_);
        add("c", "copy", &copy_up_);
        add("m", "sockmap", &sockmap_up_);
        add("k", "splice", nullptr);
        // Routes: the echo's bytes are no ClientHello, so the default route (the cluster) takes
        // them, and the route and inspection families have samples.
        add("r", "splice", nullptr);
        config.listeners.back().extra_yaml =
            "    routes:\n      - {name: never, alpn: [x-never], cluster: app}\n";
        add("d", "splice", nullptr);
        config.listeners.back().cluster = "dyn";
        config.extra_yaml =
            "clusters:\n  - name: app\n"
            "    health_check: {interval: 200ms, timeout: 500ms, rise: 1, fall: 2}\n"
            "    backends:\n      - {address: \"" +
            backend_a_.hostPort() + "\"}\n      - {address: \"" + backend_b_.hostPort() + "\"}\n" +
            "  - name: dyn\n    discovery: {dns: obs.test, port: " +
            std::to_string(backend_a_.port()) + "}\n" + "resolvers: {nameservers: [\"" +
            dns_.address() + "\"]}\n";
        ASSERT_TRUE(relay_.start(config)) << relay_.diagnostics();
        // This machine loads BPF: a sockmap listener quietly running splice would leave the
        // sockmap families untested.
        EXPECT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath("sockmap", "m")), 1.0);
        for (const auto* b : {&backend_a_, &backend_b_}) {
            ASSERT_TRUE(relay_.waitForMetric(metric::kBackendUp,
                                             metric::backend("app", b->hostPort()), 1.0))
                << "backend " << b->hostPort() << " never came up";
        }

        for (const std::string name : {"s", "c", "m"}) roundTrip(name, kListenerBytes);
        for (int i = 0; i < kClusterConnections; ++i) roundTrip("k", kClusterBytes);
        roundTrip("r", kClusterBytes);
        roundTrip("d", kClusterBytes);

        for (const std::string name : {"s", "c", "m"}) expectCounters(name, kListenerBytes, 1);
        expectCounters("k", kClusterConnections * kClusterBytes, kClusterConnections);
        expectCounters("r", kClusterBytes, 1);
        expectCounters("d", kClusterBytes, 1);
        EXPECT_TRUE(relay_.waitForMetric("zcrelay_route_selections_total",
                                         {{"listener", "r"}, {"route", "app"}}, 1.0));
        EXPECT_TRUE(relay_.waitForMetric(
            metric::kBackendChecksTotal,
            {{"cluster", "app"}, {"backend", backend_a_.hostPort()}, {"result", "passed"}},
            [](double v) { return v >= 1; }, "at least one passed health check"));
    }

    RelayProcess& relay() { return relay_; }

    // A fresh scrape; ADD_FAILUREs and returns "" if there is none.
    std::string scrape() {
        std::string error;
        auto body = relay_.scrape(&error);
        EXPECT_TRUE(body.has_value()) << error;
        return body.value_or("");
    }

  private:
    void roundTrip(const std::string& listener, uint64_t bytes) {
        Connected client = connectTo(relay_.host(listener), relay_.port(listener));
        ASSERT_TRUE(client.fd) << listener << ": " << client.error;
        IoResult sent;
        ReceiveCheck got = echoRoundTrip(client.fd.get(), kSeed, bytes, Millis{20'000}, &sent);
        EXPECT_TRUE(sent.ok()) << listener << ": " << sent.describe();
        EXPECT_EQ(got.bytes, bytes) << listener << ": " << got.describe();
        EXPECT_LT(got.first_mismatch, 0) << listener << ": " << got.describe();
    }
    void expectCounters(const std::string& listener, uint64_t bytes, double connections) {
        for (const char* direction : {"upstream", "downstream"}) {
            EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal,
                                             metric::bytes(direction, listener),
                                             static_cast<double>(bytes)))
                << listener << " " << direction;
        }
        EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done", listener),
                                         connections))
            << listener;
        EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(listener), 0))
            << listener;
    }

    ScriptedUpstream splice_up_{AF_INET, echoScript()};
    ScriptedUpstream copy_up_{AF_INET, echoScript()};
    ScriptedUpstream sockmap_up_{AF_INET, echoScript()};
    ScriptedUpstream backend_a_{AF_INET, echoScript()};
    ScriptedUpstream backend_b_{AF_INET, echoScript()};
    DnsServer dns_;
    RelayProcess relay_;
};

// The names of the samples in a scrape (a histogram's are name_bucket, name_sum, name_count).
inline std::set<std::string> sampleNames(const std::string& scrape) {
    std::set<std::string> names;
    for (const Sample& s : parseMetrics(scrape)) names.insert(s.name);
    return names;
}

#define SKIP_WITHOUT(tool)                                                           \
    if (!findExecutable(tool)) {                                                     \
        GTEST_SKIP() << tool                                                         \
            " is not installed (Debian package prometheus, deploy/install-deps.sh)"; \
    }

}  // namespace zcrelay::test::observability_test
