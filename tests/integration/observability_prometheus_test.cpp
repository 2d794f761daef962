// A real Prometheus scraping the relay: the exact bytes of a transfer stored and rated, and every
// dashboard query and rule evaluated over a relay with traffic in every mode.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cctype>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
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
#include <utility>
#include <vector>

#include "integration/observability_fixture.hpp"
#include "support/labels.hpp"

namespace zcrelay::test::observability_test {
namespace {

constexpr Millis kPrometheusReady{20'000};
constexpr Millis kPrometheusStop{10'000};
// Prometheus scrapes and evaluates every second in these tests (the deploy file says 15s).
constexpr Millis kScrape{1'000};

// The target deploy/prometheus/prometheus.yml scrapes: zcrelay's default metrics.listen.
const std::string kDefaultTarget = "targets: [\"127.0.0.1:9100\"]";

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
                                       Millis timeout = Millis{30'000}) const {
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

// =============================================================================================
// A real Prometheus scraping the relay.

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
        std::this_thread::sleep_for(Millis{150});  // pacing: scrapes land inside the transfer
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
ZCRELAY_LABEL(PrometheusScrape, StoresTheExactBytesOfATransfer, "", kSanitizeSkip,
              "its time is Prometheus; the harness scrapes the same /metrics every 20 ms in every case");

// What Prometheus makes of the counters. Splice and copy count a direction's bytes as their
// completions come; sockmap's are what the kernel moved, read from the BPF program's counters on
// the relay's sweep and at close: splice and sockmap cover both ways of counting (MetricsTest
// checks copy's totals).
INSTANTIATE_TEST_SUITE_P(Modes, PrometheusScrape, ::testing::Values("splice", "sockmap"),
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
    auto deadline = Clock::now() + Millis{30'000};
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
ZCRELAY_LABEL(PrometheusEvaluates, EveryDashboardQueryAndRule, "", kSanitizeSkip,
              "Prometheus evaluating queries: no relay code the scrapes do not run");

}  // namespace
}  // namespace zcrelay::test::observability_test
