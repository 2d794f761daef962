#pragma once
// The real zcrelay binary as a test fixture: write a YAML config into a temp dir, fork/exec
// ZCRELAY_BINARY, wait for "zcrelay: ready", learn the ports from stdout, scrape /metrics, look at
// /proc/PID, stop it with SIGTERM. Also a small fork/exec helper for other programs (nc, iptables)
// and iptables rules that blackhole SYNs to one loopback port, or every packet of one flow.
//
// Everything is bounded: start waits at most 60 s, scrapes 5 s, waits on metrics their timeout,
// terminate() SIGKILLs after its timeout and records a test failure. Only the PID this fixture
// started is ever signalled.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/types.h>

#include <atomic>
#include <cstdlib>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "data_path.hpp"
#include "metric_table.hpp"
#include "reasons.hpp"
#include "support/loopback.hpp"

#ifndef ZCRELAY_BINARY
#error "ZCRELAY_BINARY (path of the zcrelay binary, a string literal) must be defined"
#endif

namespace zcrelay::test {

// The relay under test: this build's binary (ZCRELAY_BINARY), or the one the environment names
// in ZCRELAY_TEST_RELAY. A sanitizer tree (tests/sanitize/run.sh) runs the main tree's relay
// cases that way against its own sanitized relay, rather than compiling them all again.
const char* relayBinaryUnderTest();
inline const char* const kRelayBinary = relayBinaryUnderTest();
// The next release of the relay under test: the same sources linked as "<version>-next"
// (zcrelay-next, beside zcrelay in every tree, a sanitizer tree's too), so that an upgrade test
// goes from one binary to another that reports a different --version.
inline std::string nextRelayBinary() { return std::string(kRelayBinary) + "-next"; }
// Generous: the suite runs cases side by side (ctest -j) beside the sanitizer trees' builds, and
// a sanitized relay starts in seconds on a loaded machine. A passing case never waits them out.
inline constexpr Millis kReadyTimeout{60'000};
inline constexpr Millis kMetricTimeout{30'000};

// ---------------------------------------------------------------------------------------------
// Temp dirs and child processes.

// mkdtemp under $TMPDIR (or /tmp); removed recursively by the destructor unless
// ZCRELAY_KEEP_TEST_DIRS is set in the environment.
class TempDir {
  public:
    TempDir();
    ~TempDir();
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    const std::string& path() const { return path_; }
    std::string file(const std::string& name) const { return path_ + "/" + name; }
    // Writes `content` to path()/name and returns the full path.
    std::string writeFile(const std::string& name, const std::string& content) const;

  private:
    std::string path_;
};

std::string readFileText(const std::string& path, size_t max_bytes = 1 << 20);
// The last `max_bytes` of a file (for failure output).
std::string fileTail(const std::string& path, size_t max_bytes = 8192);

struct ExitStatus {
    bool exited = false;  // normal exit; `code` is valid
    int code = -1;
    int signal = 0;          // killed by this signal
    bool timed_out = false;  // did not exit in time; we SIGKILLed it
    bool cleanExit() const { return exited && code == 0; }
    std::string describe() const;
};

// One forked child. Never signals anything but its own pid.
class ChildProcess {
  public:
    struct Options {
        std::vector<std::string> argv;  // argv[0] is the path to exec (no PATH search)
        std::string stdin_path = "/dev/null";
        std::string stdout_path;  // empty: inherit (unless stdout_fd is given)
        int stdout_fd = -1;       // e.g. a pipe's write end; wins over stdout_path
        std::string stderr_path;  // empty: inherit
        // RLIMIT_NOFILE (soft and hard) for the child only, set between fork and exec: the
        // test process itself cannot raise a lowered hard limit again (no CAP_SYS_RESOURCE).
        std::optional<rlim_t> nofile_limit;
    };

    ChildProcess() = default;
    ~ChildProcess();  // SIGKILLs and reaps the child if it is still running
    ChildProcess(const ChildProcess&) = delete;
    ChildProcess& operator=(const ChildProcess&) = delete;

    // Returns false with `error` set if the fork or the exec failed.
    bool spawn(const Options& options, std::string& error);
    pid_t pid() const { return pid_; }
    bool running();
    bool sendSignal(int sig);
    // The exit status, or nullopt if the child is still running after `timeout`.
    std::optional<ExitStatus> waitExit(Millis timeout);
    // SIGKILL, then reap (bounded). The status has timed_out set.
    ExitStatus killAndWait();
    const std::optional<ExitStatus>& status() const { return status_; }

  private:
    bool reap(bool block);

    pid_t pid_ = -1;
    Fd pidfd_;
    std::optional<ExitStatus> status_;
};

struct CommandResult {
    ExitStatus status;
    std::string out;
    std::string err;
    std::string spawn_error;
    std::string describe() const;  // status + both outputs, for failure messages
};
// Runs argv to completion (bounded: SIGKILL after `timeout`), capturing stdout and stderr.
CommandResult runCommand(const std::vector<std::string>& argv, Millis timeout = Millis{30'000},
                         const std::string& stdin_path = "/dev/null");

// Full path of `name` on $PATH plus /usr/sbin and /sbin, or nullopt.
std::optional<std::string> findExecutable(const std::string& name);

// What one attempt of startOnFreeLoopbackPort came to.
enum class PortLaunch {
    Up,      // the program runs on the port
    Retry,   // it did not come up there (the port may have been taken meanwhile): try a new port
    Failed,  // it cannot work on any port (exec failed, bad config): give up now
};
// For programs that cannot report a port the kernel picked (haproxy, dnsmasq) and must be told
// one: learns a free loopback port of `family` (listen on port 0, close) and calls
// `launch(port, why)`. Another process may take the port between the close and the program's
// bind, so an attempt that answers Retry is repeated on a new port, `attempts` times in all.
// `launch` cleans up after its own failed attempt and sets `why`; the last `why` is the failure.
::testing::AssertionResult startOnFreeLoopbackPort(
    int family, const std::function<PortLaunch(uint16_t port, std::string& why)>& launch,
    int attempts = 3);

// `iperf3 -s` on a free loopback port (IPv4) as `server`, its output in `dir`: the port, or 0
// with the failure recorded.
uint16_t startIperf3Server(ChildProcess& server, const TempDir& dir);

// Adds `iptables -I INPUT -p tcp -i lo --dport PORT --tcp-flags SYN,ACK,FIN,RST SYN -j DROP` and
// always deletes it again (at destruction; a failed delete is a test failure). Loopback only, one
// port: a connect to PORT then hangs in SYN_SENT, retransmitting, until the rule goes.
class SynDropRule {
  public:
    SynDropRule(std::string iptables, uint16_t port);
    ~SynDropRule();
    SynDropRule(const SynDropRule&) = delete;
    SynDropRule& operator=(const SynDropRule&) = delete;
    bool added() const { return added_; }
    const std::string& error() const { return error_; }

  private:
    std::vector<std::string> args(const std::string& op) const;

    std::string iptables_;
    uint16_t port_;
    bool added_ = false;
    std::string error_;
};

// Adds `iptables -I INPUT -p tcp -i lo --sport A --dport B -j DROP` and the same with the ports
// swapped, and always deletes both again (at destruction; a failed delete is a test failure).
// Every packet of the one loopback TCP flow between ports A and B disappears, both ways: each
// end still believes the connection is up, but nothing the other sends arrives, not even a FIN
// or an RST, as when a host vanishes from the network. Both ports, not one: another flow may
// share a local port (connects to different destinations can reuse an ephemeral port).
class FlowDropRule {
  public:
    FlowDropRule(std::string iptables, uint16_t port_a, uint16_t port_b);
    ~FlowDropRule();
    FlowDropRule(const FlowDropRule&) = delete;
    FlowDropRule& operator=(const FlowDropRule&) = delete;
    bool added() const { return added_ == 2; }
    const std::string& error() const { return error_; }

  private:
    std::vector<std::string> args(const std::string& op, uint16_t sport, uint16_t dport) const;

    std::string iptables_;
    uint16_t port_a_;
    uint16_t port_b_;
    int added_ = 0;  // rules inserted: 0, 1 (a -> b) or 2 (both)
    std::string error_;
};

// The sockets of process `pid` whose peer port is one of `peer_ports` (IPv4 or IPv6), duplicated
// into this process with pidfd_getfd (root, or ptrace rights) so getsockopt can read what the
// relay set on them. In /proc/PID/fd order.
std::vector<Fd> relaySocketsTo(pid_t pid, const std::vector<uint16_t>& peer_ports);

// The relay under test is built with ASan or TSan (tests/sanitize): this test binary is, or
// ZCRELAY_TEST_RELAY_SANITIZED=1 says so of ZCRELAY_TEST_RELAY. It runs several times slower,
// so cases whose size only adds volume move less, and no address-space limit is put on it (its
// shadow memory needs terabytes of address space).
bool relayIsSanitized();
inline const bool kSanitized = relayIsSanitized();

// ZCRELAY_TEST_SEND_ZEROCOPY=1 in the environment: RelayConfig::yaml() turns `send_zerocopy` on
// in every listener that does not set it itself, so the copy-mode cases run once more with the
// switch on (ctest's send_zerocopy.* tests).
inline const bool kSendZerocopyEverywhere = [] {
    const char* v = std::getenv("ZCRELAY_TEST_SEND_ZEROCOPY");
    return v != nullptr && std::string(v) == "1";
}();

// The three data paths a listener can run (`mode:`), for the TEST_Ps that cover each of them.
inline const std::vector<std::string> kModes(kDataPathLabels.begin(), kDataPathLabels.end());
inline std::string modeName(const ::testing::TestParamInfo<std::string>& info) {
    return info.param;
}

// The peer ended the connection: a FIN (EOF) or an RST.
inline bool endedByPeer(const IoResult& r) {
    return r.status == IoStatus::Eof || r.status == IoStatus::Reset;
}

// ---------------------------------------------------------------------------------------------
// Relay configuration as the tests write it.

struct ListenerSpec {
    std::string name = "t";
    std::string listen = "127.0.0.1:0";
    std::string upstream;
    std::string cluster;  // set: the listener routes to this cluster, `upstream` is left out
    std::string mode = "splice";
    std::string pipe_size = "1MiB";
    std::string connect_timeout = "5s";
    std::string idle_timeout = "300s";
    std::string extra_yaml;  // more keys for this listener, already indented by 4 spaces
    // Write neither `upstream:` nor `cluster:`: the listener names its targets in extra_yaml
    // (`routes:` without a default route, for one).
    bool omit_target = false;
};

struct RelayConfig {
    int workers = 2;
    std::string drain_timeout = "30s";
    std::string metrics_listen = "127.0.0.1:0";
    std::string metrics_extra_yaml;  // more keys under `metrics:`, already indented by 2 spaces
    std::vector<ListenerSpec> listeners;
    std::string extra_yaml;  // more top-level keys (clusters: ..., access_log: ...)
    std::string yaml() const;
};

// The usual single-listener config "t": listen on loopback port 0 of `family`, relay to
// `upstream_host_port` in `mode`.
RelayConfig singleListenerConfig(const std::string& upstream_host_port, const std::string& mode,
                                 int family = AF_INET);

// ---------------------------------------------------------------------------------------------
// Prometheus text parsing.

using Labels = std::map<std::string, std::string>;

struct Sample {
    std::string name;
    Labels labels;
    double value = 0;
};
std::vector<Sample> parseMetrics(const std::string& text);
// The sample with exactly this name and exactly this label set; else the sum of the samples
// whose labels include these (a family split by more labels than asked for); else nullopt.
std::optional<double> findSample(const std::string& text, const std::string& name,
                                 const Labels& labels);
std::string formatSeries(const std::string& name, const Labels& labels);  // name{a="b",...}

// The metric names of the contract, from the relay's own table (proxy/metric_table.hpp), so a
// typo fails to compile instead of timing out, and a renamed metric renames them.
namespace metric {
inline constexpr const char* kConnectionsTotal = metricName(Metric::Connections);
inline constexpr const char* kConnectionsActive = metricName(Metric::ConnectionsActive);
inline constexpr const char* kBytesTotal = metricName(Metric::Bytes);
inline constexpr const char* kConnectFailuresTotal = metricName(Metric::UpstreamConnectFailures);
inline constexpr const char* kClosedTotal = metricName(Metric::ConnectionsClosed);
inline constexpr const char* kPipeFallbacksTotal = metricName(Metric::PipeFallbacks);
inline constexpr const char* kPipesInUse = metricName(Metric::PipesInUse);
inline constexpr const char* kPipesCached =
    metricName(Metric::PipesCached);  // optional, not in the contract
inline constexpr const char* kProcessThreads = metricName(Metric::ProcessThreads);
inline constexpr const char* kAcceptPausedTotal = metricName(Metric::AcceptPaused);
inline constexpr const char* kDatapathInfo =
    metricName(Metric::DatapathInfo);  // {listener, mode} = 1
inline constexpr const char* kSockmapFallbacksTotal = metricName(Metric::SockmapFallbacks);
inline constexpr const char* kSockmapSockets = metricName(Metric::SockmapSockets);
inline constexpr const char* kConfigReloadsTotal = metricName(Metric::ConfigReloads);  // {result}
inline constexpr const char* kBackendUp = metricName(Metric::BackendUp);  // {cluster, backend}
inline constexpr const char* kBackendConnectionsTotal = metricName(Metric::BackendConnections);
inline constexpr const char* kBackendConnectionsActive =
    metricName(Metric::BackendConnectionsActive);
inline constexpr const char* kBackendAttemptsTotal = metricName(Metric::BackendConnectAttempts);
inline constexpr const char* kBackendFailuresTotal = metricName(Metric::BackendConnectFailures);
inline constexpr const char* kBackendBytesTotal = metricName(Metric::BackendBytes);
inline constexpr const char* kBackendChecksTotal = metricName(Metric::BackendHealthChecks);
inline constexpr const char* kBackendTransitionsTotal = metricName(Metric::BackendTransitions);
inline constexpr const char* kBackendConnectSeconds = metricName(Metric::BackendConnectDuration);
inline constexpr const char* kProxyErrorsTotal = metricName(Metric::ProxyProtocolErrors);
inline constexpr const char* kSockmapCatchupsTotal = metricName(Metric::SockmapCatchups);

// Every label value of these metrics, from the relay's own tables (proxy/reasons.hpp), so a
// reason added there is covered here without a second list to forget.
inline constexpr const auto& kClosedReasons = kCloseReasonLabels;
inline constexpr const auto& kConnectFailureReasons = kConnectFailureLabels;
inline constexpr const auto& kPipeFallbackReasons = kPipeFallbackLabels;
inline constexpr const auto& kSockmapFallbackReasons = kSockmapFallbackLabels;

inline Labels listener(const std::string& name = "t") { return {{"listener", name}}; }
// direction: "upstream" (client -> upstream) or "downstream" (upstream -> client)
inline Labels bytes(const std::string& direction, const std::string& name = "t") {
    return {{"listener", name}, {"direction", direction}};
}
inline Labels reason(const std::string& why, const std::string& name = "t") {
    return {{"listener", name}, {"reason", why}};
}
inline Labels datapath(const std::string& mode, const std::string& name = "t") {
    return {{"listener", name}, {"mode", mode}};
}
inline Labels backend(const std::string& cluster, const std::string& address) {
    return {{"cluster", cluster}, {"backend", address}};
}
}  // namespace metric

// ---------------------------------------------------------------------------------------------

struct HttpResponse {
    int status = 0;
    std::string body;
};

// One HTTP/1.0 request on a fresh connection to host:port (read until the server closes it):
// `method` `path`, with `body` sent under a Content-Length when it is not empty, and `headers`,
// more header lines each ending in "\r\n" ("Authorization: Bearer x\r\n"). Status and body, or
// nullopt with `error` set. Bounded: 2 s to connect and send, 5 s for the response.
std::optional<HttpResponse> httpRequest(const std::string& host, uint16_t port,
                                        const std::string& method, const std::string& path,
                                        const std::string& body = "",
                                        const std::string& headers = "",
                                        std::string* error = nullptr);

struct ListenerInfo {
    std::string name;
    std::string host;  // without brackets: "127.0.0.1" or "::1"
    uint16_t port = 0;
    std::string upstream;
    std::string mode;
};

class RelayProcess {
  public:
    RelayProcess() = default;
    ~RelayProcess();
    RelayProcess(const RelayProcess&) = delete;
    RelayProcess& operator=(const RelayProcess&) = delete;

    // Writes the config, spawns `zcrelay -c FILE`, waits for "zcrelay: ready".
    ::testing::AssertionResult start(const RelayConfig& config);
    // Rewrites the config file with `yaml`, sends SIGHUP and waits until the relay counts the
    // reload (zcrelay_config_reloads_total{result="success"|"failure"} one up). A success
    // (expected or not) re-reads the listeners from the lines printed before "zcrelay:
    // reloaded". Fails if the outcome is not `expect_success`.
    ::testing::AssertionResult reload(const std::string& yaml, bool expect_success = true);
    // The next start() runs the relay with at most `limit` open files.
    void setNofileLimit(rlim_t limit) { nofile_limit_ = limit; }
    // The next start() runs `prefix... ZCRELAY_BINARY ARGS...`: prefix[0] (a full path, see
    // findExecutable) is exec'd instead of the relay, e.g. {setpriv, --bounding-set, -bpf, --}.
    // The wrapper must exec the relay in place (same pid), as setpriv, env or taskset do: pid(),
    // signals and /proc/PID then reach the relay itself.
    void setLaunchPrefix(std::vector<std::string> prefix) { launch_prefix_ = std::move(prefix); }
    // Spawns `zcrelay ARGS...` (e.g. the --listen/--upstream shorthand) and waits for ready.
    ::testing::AssertionResult startWithArgs(const std::vector<std::string>& args);

    pid_t pid() const { return child_.pid(); }
    const std::string& configPath() const { return config_path_; }
    const std::string& dir() const { return dir_.path(); }

    // The listener of that name (empty: the first one printed), or nullptr.
    const ListenerInfo* listener(const std::string& name = "") const;
    uint16_t port(const std::string& name = "") const;
    std::string host(const std::string& name = "") const;
    const std::vector<ListenerInfo>& listeners() const { return listeners_; }
    uint16_t metricsPort() const { return metrics_port_; }

    // HTTP/1.0 GET `path` on the metrics listener: status and body, or nullopt with `error` set.
    std::optional<HttpResponse> get(const std::string& path, std::string* error = nullptr) const;
    // HTTP/1.0 GET /metrics on 127.0.0.1:<metrics port>; the body, or nullopt with `error` set.
    std::optional<std::string> scrape(std::string* error = nullptr) const;
    // One sample with exactly these labels, from a fresh scrape.
    std::optional<double> metric(const std::string& name, const Labels& labels = {}) const;
    // Scrapes every 20 ms until the sample satisfies `predicate` or `timeout` passes.
    ::testing::AssertionResult waitForMetric(const std::string& name, const Labels& labels,
                                             const std::function<bool(double)>& predicate,
                                             const std::string& expectation,
                                             Millis timeout = kMetricTimeout) const;
    ::testing::AssertionResult waitForMetric(const std::string& name, const Labels& labels,
                                             double expected,
                                             Millis timeout = kMetricTimeout) const;

    // From /proc/PID: Threads:, number of /proc/PID/fd entries, VmRSS in KiB.
    std::optional<int> threadCount() const;
    std::optional<int> openFdCount() const;
    std::optional<long> rssKiB() const;

    // Until the relay's log holds `text`; the failure quotes the log's tail.
    ::testing::AssertionResult waitForLog(const std::string& text,
                                          Millis timeout = Millis{10'000}) const;

    bool running() { return child_.running(); }
    bool sendSignal(int sig) { return child_.sendSignal(sig); }
    std::optional<ExitStatus> waitExit(Millis timeout) { return child_.waitExit(timeout); }
    // SIGTERM and wait; on timeout SIGKILL, ADD_FAILURE, and return a status with timed_out.
    ExitStatus terminate(Millis timeout = Millis{15'000});

    std::string stdoutText() const;
    std::string stderrText() const { return fileTail(stderr_path_, 1 << 16); }
    // Config path, exit status if any, stdout so far and the tail of stderr.
    std::string diagnostics() const;

  private:
    ::testing::AssertionResult launch(const std::vector<std::string>& args);
    void drainStdout();
    bool parseReadyOutput(std::string& error);
    // The listener lines of `text`, a block of stdout.
    bool parseListenerLines(const std::string& text, std::string& error);

    TempDir dir_;
    std::optional<rlim_t> nofile_limit_;
    std::vector<std::string> launch_prefix_;
    std::string config_path_;
    std::string stderr_path_;
    ChildProcess child_;
    Fd stdout_read_;
    std::thread stdout_thread_;
    std::atomic<bool> stop_stdout_{false};
    mutable std::mutex out_mu_;
    std::condition_variable out_cv_;
    std::string stdout_;
    bool stdout_eof_ = false;
    std::vector<ListenerInfo> listeners_;
    std::string metrics_host_ = "127.0.0.1";
    uint16_t metrics_port_ = 0;
};

}  // namespace zcrelay::test
