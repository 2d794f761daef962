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
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "support/json.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kSeed = 0x0B5E;
constexpr Millis kToolTimeout{20'000};
constexpr Millis kPrometheusReady{20'000};
constexpr Millis kPrometheusStop{10'000};
// Prometheus scrapes and evaluates every second in these tests (the deploy file says 15s).
constexpr Millis kScrape{1'000};

const std::string kSourceDir = ZCRELAY_SOURCE_DIR;
const std::string kPrometheusYml = kSourceDir + "/deploy/prometheus/prometheus.yml";
const std::string kRulesYml = kSourceDir + "/deploy/prometheus/zcrelay.rules.yml";
const std::string kRulesTestYml = kSourceDir + "/deploy/prometheus/zcrelay.rules.test.yml";
const std::string kDashboardJson = kSourceDir + "/deploy/grafana/zcrelay.json";
// The target deploy/prometheus/prometheus.yml scrapes: zcrelay's default metrics.listen.
const std::string kDefaultTarget = "targets: [\"127.0.0.1:9100\"]";

// =============================================================================================
// The metric names a PromQL expression selects. Not a PromQL parser: a scan that skips strings,
// label matchers {...}, ranges [...], Grafana variables ($x, ${x}), numbers and durations, the
// label lists of by/without/on/ignoring/group_left/group_right, and identifiers followed by "("
// (functions and aggregations). What is left are bare selectors: the metric names. A histogram's
// series keep their suffix (name_bucket), which is what the scrape shows too.

bool isIdentStart(char c) {
    return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':';
}
bool isIdentChar(char c) { return isIdentStart(c) || std::isdigit(static_cast<unsigned char>(c)); }

// Index just past the bracket that closes the one at `i` (same kind), skipping quoted strings.
size_t skipBracketed(std::string_view q, size_t i) {
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

std::set<std::string> promqlMetricNames(std::string_view q) {
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
std::set<std::string> variableQueryMetricNames(std::string_view q) {
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

// Grafana's built-in variables, and values that make a dashboard expr plain PromQL for Prometheus.
std::string substituteGrafanaVariables(std::string expr) {
    static const std::vector<std::pair<std::string, std::string>> kValues = {
        {"$__rate_interval", "1m"}, {"$__interval", "15s"}, {"$__range", "5m"}};
    for (const auto& [var, value] : kValues) {
        for (size_t at = expr.find(var); at != std::string::npos; at = expr.find(var, at))
            expr.replace(at, var.size(), value);
    }
    // Every template variable of the board is multi-value with allValue ".*", used with =~.
    return std::regex_replace(expr, std::regex(R"(\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)"), ".*");
}

// =============================================================================================
// The dashboard and the rules, as lists of expressions with where they came from.

struct Expr {
    std::string where;  // "panel 3 \"Active connections\" target A"
    std::string expr;
    bool variable = false;      // a template variable's query (label_values(...)), not PromQL
    bool may_be_empty = false;  // annotations and filters: no series is a valid answer
};

std::string readText(const std::string& path) { return readFileText(path, 4 << 20); }

std::optional<Json> readDashboard(std::string& error) {
    std::string text = readText(kDashboardJson);
    if (text.empty()) {
        error = "cannot read " + kDashboardJson;
        return std::nullopt;
    }
    return parseJson(text, error);
}

// Top-level panels and the panels of collapsed rows (an expanded row's panels follow it at the
// top level).
std::vector<const Json*> dashboardPanels(const Json& board) {
    std::vector<const Json*> out;
    for (const Json& p : board.items("panels")) {
        out.push_back(&p);
        for (const Json& nested : p.items("panels")) out.push_back(&nested);
    }
    return out;
}

std::vector<Expr> dashboardExprs(const Json& board) {
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

size_t indentOf(const std::string& line) { return line.find_first_not_of(' '); }

std::string trim(std::string s) {
    size_t b = s.find_first_not_of(" \t\r");
    size_t e = s.find_last_not_of(" \t\r");
    return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// Enough YAML for zcrelay.rules.yml as written: `expr:` with the expression on the same line
// (plain or quoted) or in a block scalar (| or >-) on the lines indented deeper; `record:` and
// `alert:` name the rule. The YAML itself is checked by promtool; this only lists the exprs.
RuleFile readRules(const std::string& path) {
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
        config.extra_yaml =
            "clusters:\n  - name: app\n"
            "    health_check: {interval: 200ms, timeout: 500ms, rise: 1, fall: 2}\n"
            "    backends:\n      - {address: \"" +
            backend_a_.hostPort() + "\"}\n      - {address: \"" + backend_b_.hostPort() + "\"}\n";
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

        for (const std::string name : {"s", "c", "m"}) expectCounters(name, kListenerBytes, 1);
        expectCounters("k", kClusterConnections * kClusterBytes, kClusterConnections);
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
    RelayProcess relay_;
};

// The names of the samples in a scrape (a histogram's are name_bucket, name_sum, name_count).
std::set<std::string> sampleNames(const std::string& scrape) {
    std::set<std::string> names;
    for (const Sample& s : parseMetrics(scrape)) names.insert(s.name);
    return names;
}

std::string joined(const std::set<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
}

// =============================================================================================
// Prometheus, run from this test on a copy of deploy/prometheus/prometheus.yml.

struct HttpAnswer {
    int status = 0;
    std::string body;
};

std::optional<HttpAnswer> httpGet(uint16_t port, const std::string& target, std::string& error) {
    Connected c = connectTo("127.0.0.1", port, Millis{2'000});
    if (!c.fd) {
        error = c.error;
        return std::nullopt;
    }
    // HTTP/1.0: Go's server answers without chunking and closes, so EOF ends the body.
    std::string req = "GET " + target + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    IoResult w = writeAll(c.fd.get(), req.data(), req.size(), Millis{2'000});
    if (!w.ok()) {
        error = "request: " + w.describe();
        return std::nullopt;
    }
    std::string resp;
    IoResult r = readUntilEof(c.fd.get(), resp, Millis{10'000});
    if (r.status != IoStatus::Eof) {
        error = "response: " + r.describe();
        return std::nullopt;
    }
    size_t sp = resp.find(' ');
    size_t end = resp.find("\r\n\r\n");
    if (sp == std::string::npos || end == std::string::npos) {
        error = "not an HTTP response: " + resp.substr(0, 200);
        return std::nullopt;
    }
    return HttpAnswer{std::atoi(resp.c_str() + sp + 1), resp.substr(end + 4)};
}

std::string urlEncode(std::string_view s) {
    std::string out;
    char buf[4];
    for (unsigned char c : s) {
        if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
            out += static_cast<char>(c);
        } else {
            std::snprintf(buf, sizeof buf, "%%%02X", c);
            out += buf;
        }
    }
    return out;
}

std::string formatTime(double unix_seconds) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f", unix_seconds);
    return buf;
}

// One sample of an instant vector: its labels, time and value.
struct PromSample {
    std::map<std::string, std::string> labels;
    double time = 0;
    double value = 0;
};

double promValue(const Json& pair) {
    // [ <unix time>, "<value>" ]; strtod reads "NaN" and "+Inf" too.
    if (pair.array.size() != 2) return std::nan("");
    return std::strtod(pair.array[1].string.c_str(), nullptr);
}

class Prometheus {
  public:
    ~Prometheus() {
        if (child_ && child_->pid() > 0 && !child_->status()) stop();
    }

    // Writes the config (deploy's, with the relay as the target and 1 s intervals) and the rules
    // next to it, starts Prometheus on a free loopback port and waits until it is ready.
    ::testing::AssertionResult start(uint16_t relay_metrics_port) {
        std::string config = readText(kPrometheusYml);
        size_t at = config.find(kDefaultTarget);
        if (at == std::string::npos)
            return ::testing::AssertionFailure()
                   << kPrometheusYml << " does not scrape " << kDefaultTarget;
        config.replace(at, kDefaultTarget.size(),
                       "targets: [\"127.0.0.1:" + std::to_string(relay_metrics_port) + "\"]");
        config = std::regex_replace(config, std::regex(R"((scrape|evaluation)_interval: *\S+)"),
                                    "$1_interval: 1s");
        dir_.writeFile("prometheus.yml", config);
        dir_.writeFile("zcrelay.rules.yml", readText(kRulesYml));

        // A free port: the kernel's pick, released just before Prometheus binds it. Another
        // process could take it in between; then Prometheus exits and we try another.
        std::string last_error;
        for (int attempt = 0; attempt < 3; ++attempt) {
            Listening probe = listenLoopback(AF_INET);
            if (!probe.fd) return ::testing::AssertionFailure() << probe.error;
            port_ = probe.port;
            probe.fd.reset();
            ChildProcess::Options opts;
            opts.argv = {
                *findExecutable("prometheus"), "--config.file=" + dir_.file("prometheus.yml"),
                "--storage.tsdb.path=" + dir_.file("data"),
                "--web.listen-address=127.0.0.1:" + std::to_string(port_), "--log.level=warn"};
            opts.stdout_path = dir_.file("prometheus.out");
            opts.stderr_path = dir_.file("prometheus.err");
            child_ = std::make_unique<ChildProcess>();
            if (!child_->spawn(opts, last_error))
                return ::testing::AssertionFailure() << last_error;
            auto deadline = Clock::now() + kPrometheusReady;
            while (Clock::now() < deadline && child_->running()) {
                std::string error;
                auto ready = httpGet(port_, "/-/ready", error);
                if (ready && ready->status == 200) return ::testing::AssertionSuccess();
                std::this_thread::sleep_for(Millis{100});
            }
            last_error = "prometheus on port " + std::to_string(port_) +
                         " not ready: " + fileTail(dir_.file("prometheus.err"), 2000);
            if (child_->running()) {
                child_->killAndWait();
                return ::testing::AssertionFailure() << last_error;
            }
            child_->waitExit(Millis{1'000});  // it exited (port taken?): try another port
        }
        return ::testing::AssertionFailure() << last_error;
    }

    // SIGTERM to the PID this test started; SIGKILL if it does not exit in time.
    ::testing::AssertionResult stop() {
        if (!child_) return ::testing::AssertionFailure() << "prometheus was not started";
        child_->sendSignal(SIGTERM);
        auto st = child_->waitExit(kPrometheusStop);
        if (!st) {
            child_->killAndWait();
            return ::testing::AssertionFailure() << "prometheus ignored SIGTERM for 10 s";
        }
        if (!st->cleanExit())
            return ::testing::AssertionFailure() << "prometheus: " << st->describe() << "\n"
                                                 << fileTail(dir_.file("prometheus.err"), 4000);
        return ::testing::AssertionSuccess();
    }

    // GET an API path; the "data" member of a successful answer, or nullopt with `error` set.
    std::optional<Json> api(const std::string& target, std::string& error) const {
        auto answer = httpGet(port_, target, error);
        if (!answer) return std::nullopt;
        std::optional<Json> doc = parseJson(answer->body, error);
        if (!doc) {
            error = "HTTP " + std::to_string(answer->status) + ", not JSON (" + error +
                    "): " + answer->body.substr(0, 300);
            return std::nullopt;
        }
        if (answer->status != 200 || doc->str("status") != "success") {
            error = "HTTP " + std::to_string(answer->status) + ": " + doc->str("errorType") + ": " +
                    doc->str("error");
            return std::nullopt;
        }
        const Json* data = doc->get("data");
        if (data == nullptr) {
            error = "no data in " + answer->body.substr(0, 300);
            return std::nullopt;
        }
        return *data;
    }

    // /api/v1/query; the result list (vector or matrix), or nullopt with `error` set.
    std::optional<std::vector<Json>> query(const std::string& promql, std::string& error,
                                           std::optional<double> at = std::nullopt) const {
        std::string target = "/api/v1/query?query=" + urlEncode(promql);
        if (at) target += "&time=" + formatTime(*at);
        auto data = api(target, error);
        if (!data) return std::nullopt;
        return data->items("result");
    }

    // The single value of an instant-vector query; nullopt unless there is exactly one series.
    std::optional<double> scalar(const std::string& promql, std::string& error,
                                 std::optional<double> at = std::nullopt) const {
        auto result = query(promql, error, at);
        if (!result) return std::nullopt;
        if (result->size() != 1) {
            error = std::to_string(result->size()) + " series for " + promql;
            return std::nullopt;
        }
        const Json* v = result->front().get("value");
        if (v == nullptr) {
            error = "not an instant vector: " + promql;
            return std::nullopt;
        }
        return promValue(*v);
    }

    // Polls `promql` every 200 ms until its single value satisfies `ok` (bounded by `timeout`).
    ::testing::AssertionResult waitFor(const std::string& promql,
                                       const std::function<bool(double)>& ok,
                                       const std::string& expectation,
                                       Millis timeout = Millis{10'000}) const {
        auto deadline = Clock::now() + timeout;
        std::string error;
        std::optional<double> last;
        while (Clock::now() < deadline) {
            error.clear();
            last = scalar(promql, error);
            if (last && ok(*last)) return ::testing::AssertionSuccess();
            std::this_thread::sleep_for(Millis{200});
        }
        return ::testing::AssertionFailure()
               << promql << " never became " << expectation << " in " << timeout.count()
               << " ms; last value " << (last ? std::to_string(*last) : "none") << " " << error
               << "\nprometheus stderr: " << fileTail(dir_.file("prometheus.err"), 2000);
    }

    std::string errText() const { return fileTail(dir_.file("prometheus.err"), 4000); }

  private:
    TempDir dir_;  // declared before child_: the data dir outlives the process
    std::unique_ptr<ChildProcess> child_;
    uint16_t port_ = 0;
};

#define SKIP_WITHOUT(tool)                                                           \
    if (!findExecutable(tool)) {                                                     \
        GTEST_SKIP() << tool                                                         \
            " is not installed (Debian package prometheus, deploy/install-deps.sh)"; \
    }

// =============================================================================================
// 1. The deploy files as promtool reads them.

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
// 2. A scrape after traffic through every data path, as Prometheus's linter reads it.

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

// =============================================================================================
// 3. The dashboard and the rules name only metrics a live relay exports.

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

// =============================================================================================
// 4. A real Prometheus scraping the relay.

class PrometheusScrape : public ::testing::TestWithParam<std::string> {};

// 64 MiB client -> upstream, paced over ~2.5 s so that scrapes land inside the transfer. What
// Prometheus stored must add up to exactly the bytes sent, and its rate() must account for them.
TEST_P(PrometheusScrape, StoresTheExactBytesOfATransfer) {
    SKIP_WITHOUT("prometheus")
    constexpr uint64_t kChunk = 4 * kMiB;
    constexpr int kChunks = 16;
    constexpr uint64_t kTotal = kChunk * kChunks;
    // Every series of the direction, whatever labels the relay adds (`path` splits it by data
    // path): the checks below are on their sum.
    const std::string series =
        "zcrelay_bytes_total{job=\"zcrelay\",listener=\"t\","
        "direction=\"upstream\"}";

    ScriptedUpstream up(AF_INET, sinkScript());
    ASSERT_TRUE(up.ok()) << up.error();
    RelayProcess relay;
    ASSERT_TRUE(relay.start(singleListenerConfig(up.hostPort(), GetParam())));
    EXPECT_EQ(relay.metric(metric::kDatapathInfo, metric::datapath(GetParam())), 1.0);

    Prometheus prom;
    ASSERT_TRUE(prom.start(relay.metricsPort()));
    ASSERT_TRUE(prom.waitFor(
        "up{job=\"zcrelay\"}", [](double v) { return v == 1; }, "1"));
    // A stored 0 before the transfer: increase() below then needs no extrapolation at the start.
    ASSERT_TRUE(prom.waitFor(
        "sum(" + series + ")", [](double v) { return v == 0; }, "0"));

    Connected client = connectTo(relay.host(), relay.port());
    ASSERT_TRUE(client.fd) << client.error;
    for (int i = 0; i < kChunks; ++i) {
        IoResult sent = sendPayloadAt(client.fd.get(), kSeed, i * kChunk, kChunk, Millis{10'000});
        ASSERT_TRUE(sent.ok()) << "chunk " << i << ": " << sent.describe();
        std::this_thread::sleep_for(Millis{150});
    }
    ::shutdown(client.fd.get(), SHUT_WR);
    std::string reply;
    IoResult end = readUntilEof(client.fd.get(), reply, Millis{10'000});
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
    ASSERT_TRUE(up.waitForFinished(1, Millis{10'000}));
    ConnRecord rec = up.records().at(0);
    ASSERT_EQ(rec.bytes_received, kTotal) << rec.describe();
    EXPECT_EQ(rec.received_hash, payloadHash(kSeed, kTotal)) << rec.describe();
    ASSERT_TRUE(relay.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"),
                                    static_cast<double>(kTotal)));

    // The scrape after the transfer: the sum over every series of the direction (whatever
    // labels the relay adds) is the bytes sent, exactly.
    ASSERT_TRUE(prom.waitFor(
        "sum(zcrelay_bytes_total{job=\"zcrelay\",direction=\"upstream\"})",
        [&](double v) { return v == static_cast<double>(kTotal); }, std::to_string(kTotal)));

    // The raw samples, summed per scrape (the series of one target share its timestamps):
    // from 0 to the total, never down, and at least one in between (scraped during the
    // transfer, not only before and after).
    std::string error;
    auto raw = prom.query(series + "[5m]", error);
    ASSERT_TRUE(raw) << error;
    ASSERT_GE(raw->size(), 1u);
    std::map<double, std::pair<double, size_t>> per_scrape;  // time -> (sum, series)
    for (const Json& s : *raw) {
        for (const Json& pair : s.items("values")) {
            auto& [sum, count] = per_scrape[pair.array.at(0).number];
            sum += promValue(pair);
            ++count;
        }
    }
    ASSERT_GE(per_scrape.size(), 3u);
    double first_t = per_scrape.begin()->first;
    double last_t = per_scrape.rbegin()->first;
    EXPECT_EQ(per_scrape.begin()->second.first, 0);
    EXPECT_EQ(per_scrape.rbegin()->second.first, static_cast<double>(kTotal));
    int inside = 0;
    double previous = 0;
    for (const auto& [t, sum_count] : per_scrape) {
        auto [v, count] = sum_count;
        EXPECT_EQ(count, raw->size()) << "a scrape at " << formatTime(t) << " lacks series";
        if (v > 0 && v < static_cast<double>(kTotal)) ++inside;
        EXPECT_GE(v, previous) << "the bytes went down at " << formatTime(t);
        previous = v;
    }
    EXPECT_GE(inside, 1) << "no scrape saw the transfer in progress (" << per_scrape.size()
                         << " scrapes)";

    // increase() and rate() over a window holding every sample, evaluated at the last one: no
    // extrapolation at either end (it starts from a stored 0 and ends on a sample), so increase
    // should be the total; the brief allows 10%.
    int window = static_cast<int>(std::ceil(last_t - first_t)) + 2;
    std::string range = "[" + std::to_string(window) + "s]";
    auto increase = prom.scalar("sum(increase(" + series + range + "))", error, last_t);
    ASSERT_TRUE(increase) << error;
    EXPECT_NEAR(*increase, static_cast<double>(kTotal), 0.10 * kTotal);
    auto rate = prom.scalar("sum(rate(" + series + range + "))", error, last_t);
    ASSERT_TRUE(rate) << error;
    EXPECT_GT(*rate, 0);
    EXPECT_NEAR(*rate * window, static_cast<double>(kTotal), 0.10 * kTotal)
        << "rate over " << range << " is " << *rate << " B/s";
    std::cout << GetParam() << ": " << per_scrape.size() << " scrapes, " << inside
              << " during the transfer; increase" << range << " = " << std::fixed << *increase
              << ", rate = " << *rate << " B/s\n";
    // The dashboard's throughput expr, at the end of the transfer.
    auto by =
        prom.query("sum by (listener, direction) (rate(zcrelay_bytes_total[1m]))", error, last_t);
    ASSERT_TRUE(by) << error;
    int checked = 0;
    for (const Json& s : *by) {
        const Json* labels = s.get("metric");
        const Json* value = s.get("value");
        ASSERT_TRUE(labels != nullptr && value != nullptr);
        if (labels->str("listener") != "t") continue;
        ++checked;
        if (labels->str("direction") == "upstream")
            EXPECT_GT(promValue(*value), 0) << "upstream throughput";
        else
            EXPECT_EQ(promValue(*value), 0) << "nothing went downstream";
    }
    EXPECT_EQ(checked, 2) << "one series per direction";

    EXPECT_TRUE(prom.stop());
    EXPECT_TRUE(relay.terminate().cleanExit()) << relay.diagnostics();
}

INSTANTIATE_TEST_SUITE_P(Modes, PrometheusScrape, ::testing::ValuesIn(kModes),
                         [](const auto& info) { return info.param; });

// Every dashboard query and every rule, evaluated by Prometheus over a relay that ran traffic
// through every data path: each parses, each panel query has series, every rule is healthy.
TEST(PrometheusEvaluates, EveryDashboardQueryAndRule) {
    SKIP_WITHOUT("prometheus")
    std::string error;
    std::optional<Json> board = readDashboard(error);
    ASSERT_TRUE(board) << kDashboardJson << ": " << error;
    TrafficRelay traffic;
    ASSERT_NO_FATAL_FAILURE(traffic.run());
    Prometheus prom;
    ASSERT_TRUE(prom.start(traffic.relay().metricsPort()));
    // rate() needs two samples in its window.
    ASSERT_TRUE(prom.waitFor(
        "count_over_time(zcrelay_build_info[1m])", [](double v) { return v >= 2; },
        ">= 2 samples"));

    for (const Expr& e : dashboardExprs(*board)) {
        std::string promql = e.expr;
        if (e.variable) {
            // label_values(selector, label): the selector must match series.
            std::set<std::string> names = variableQueryMetricNames(e.expr);
            if (names.empty()) continue;
            size_t open = e.expr.find('(');
            size_t comma = e.expr.rfind(',');
            promql = e.expr.substr(open + 1, comma - open - 1);
        }
        promql = substituteGrafanaVariables(promql);
        auto result = prom.query(promql, error);
        ASSERT_TRUE(result) << e.where << ": Prometheus rejects " << promql << ": " << error;
        if (!e.may_be_empty) {
            EXPECT_FALSE(result->empty()) << e.where << ": no series for " << promql;
        }
    }

    // Rules: wait for an evaluation of every rule (health "unknown" before), then all "ok".
    std::vector<std::string> problems;
    auto deadline = Clock::now() + Millis{10'000};
    size_t rules_seen = 0;
    do {
        problems.clear();
        rules_seen = 0;
        auto data = prom.api("/api/v1/rules", error);
        ASSERT_TRUE(data) << error;
        for (const Json& group : data->items("groups")) {
            for (const Json& rule : group.items("rules")) {
                ++rules_seen;
                if (rule.str("health") != "ok")
                    problems.push_back(rule.str("name") + ": " + rule.str("health") + " " +
                                       rule.str("lastError"));
            }
        }
        if (problems.empty() && rules_seen > 0) break;
        std::this_thread::sleep_for(Millis{200});
    } while (Clock::now() < deadline);
    EXPECT_EQ(rules_seen, readRules(kRulesYml).exprs.size()) << "rules Prometheus loaded";
    for (const std::string& p : problems) ADD_FAILURE() << "rule " << p;
    // A healthy relay raises no alert, not even a pending one (ZcrelayIoWqWorkers included:
    // the copy path's sends no longer reach io-wq, see pump/copy_pump.cpp).
    auto alerts = prom.query("ALERTS", error);
    ASSERT_TRUE(alerts) << error;
    for (const Json& a : *alerts) {
        const Json* m = a.get("metric");
        if (m == nullptr) continue;
        ADD_FAILURE() << "alert " << m->str("alertname") << " " << m->str("alertstate");
    }

    EXPECT_TRUE(prom.stop());
}

}  // namespace
}  // namespace zcrelay::test
