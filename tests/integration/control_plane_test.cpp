// The control plane under attack, as an operator's tooling and a hostile client would meet it:
// the metrics endpoint with thousands of idle, trickling or lying connections open to it, config
// files that are not files (a FIFO, /dev/zero, a directory, 2 MiB, two YAML documents) at start
// and by SIGHUP, and the signals people send by habit. The relay must answer probes, refuse what
// it should with the reason counted, keep the running config, and move every byte of a live
// transfer. Each case here failed on the relay before the endpoint, the config reader and the
// signal table were rebuilt. Loopback only; every wait and loop is bounded.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/labels.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::control_plane_test {
namespace {

constexpr const char* kRejected = "zcrelay_metrics_endpoint_rejected_total";
constexpr const char* kEndpointConnections = "zcrelay_metrics_endpoint_connections";
constexpr const char* kSignalsTotal = "zcrelay_signals_total";
// What a Kubernetes probe waits by default (timeoutSeconds: 1) before it counts a failure.
// A Kubernetes probe's default timeout is 1 s. On a loaded 2-core machine a loopback request
// can take longer than that without anything wrong, so the bound is 3 s: still short of the 5 s
// request_timeout a probe queued behind the idle connections would wait for.
constexpr Millis kProbeBound{3'000};
constexpr Millis kProbeTimeout{4'500};  // the probe's I/O deadline, also short of 5 s

Labels why(const char* reason) { return {{"reason", reason}}; }

struct Reply {
    int status = 0;
    std::string head;  // status line and headers
    std::string body;
    double seconds = 0;  // connect to the end of the response
    std::string error;   // set when there was no complete response
};

// One request on a fresh connection (`request` is sent as is), read until the server closes.
Reply roundTrip(uint16_t port, const std::string& request, Millis timeout = Millis{5'000}) {
    Reply r;
    const auto start = Clock::now();
    Connected c = connectTo("127.0.0.1", port, timeout);
    if (!c.fd) {
        r.error = "connect: " + c.error;
        return r;
    }
    IoResult w = writeAll(c.fd.get(), request.data(), request.size(), timeout);
    if (!w.ok() && w.status != IoStatus::Reset) {
        r.error = "send: " + w.describe();
        return r;
    }
    std::string text;
    IoResult end = readUntilEof(c.fd.get(), text, timeout);
    r.seconds = secondsSince(start);
    const size_t head_end = text.find("\r\n\r\n");
    if (head_end == std::string::npos) {
        r.error = "no complete response (" + end.describe() + "): " + text.substr(0, 200);
        return r;
    }
    r.head = text.substr(0, head_end);
    r.body = text.substr(head_end + 4);
    r.status = std::atoi(r.head.c_str() + r.head.find(' ') + 1);
    return r;
}

// A probe as the kubelet sends one: new connection, GET, Connection: close.
Reply probe(uint16_t port, const std::string& path) {
    return roundTrip(port,
                    "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: kube-probe/1.31\r\n"
                                    "Connection: close\r\n\r\n",
                    kProbeTimeout);
}

// Makes the relay's config path a symlink to `target`: what the next SIGHUP reads.
void pointConfigAt(const std::string& config, const std::string& target) {
    ASSERT_EQ(::unlink(config.c_str()), 0) << config << ": " << std::strerror(errno);
    ASSERT_EQ(::symlink(target.c_str(), config.c_str()), 0) << std::strerror(errno);
}

// One 64 KiB message there and back through the echo upstream, the connection left open.
void exchangeOnce(int fd, uint64_t seed) {
    ASSERT_TRUE(sendPayload(fd, seed, 64 * 1024).ok());
    std::vector<uint8_t> echoed(64 * 1024), expected(64 * 1024);
    ASSERT_TRUE(readExactly(fd, echoed.data(), echoed.size()).ok());
    fillPayload(seed, 0, expected);
    ASSERT_EQ(echoed, expected);
}

class ControlPlaneTest : public ::testing::Test {
  protected:
    void SetUp() override { ASSERT_TRUE(up_.ok()) << up_.error(); }

    void startRelay(const std::string& metrics_extra = "", const std::string& mode = "splice") {
        RelayConfig config = singleListenerConfig(up_.hostPort(), mode);
        config.metrics_extra_yaml = metrics_extra;
        ASSERT_TRUE(relay_.start(config));
        ASSERT_NE(relay_.metricsPort(), 0);
    }

    // A relayed connection, one 64 KiB exchange done, left open for what the test does next.
    Fd openLive(uint64_t seed) {
        Connected c = connectTo(relay_.host(), relay_.port());
        EXPECT_TRUE(c.fd) << c.error;
        if (c.fd) exchangeOnce(c.fd.get(), seed);
        return std::move(c.fd);
    }

    // The relay still relays: 256 KiB there and back, byte-exact.
    void expectRelaying() {
        Connected c = connectTo(relay_.host(), relay_.port());
        ASSERT_TRUE(c.fd) << c.error;
        ReceiveCheck got = echoRoundTrip(c.fd.get(), 77, 256 * 1024);
        EXPECT_EQ(got.bytes, 256u * 1024) << got.describe();
        EXPECT_LT(got.first_mismatch, 0) << got.describe();
    }

    // After a SIGTERM: /readyz says draining, `live` still relays (64 KiB both ways, then its
    // FIN), and once it is closed the relay exits 0.
    void expectDrainedAndExited(Fd live, uint64_t seed) {
        EXPECT_TRUE(waitUntil(
            [&] {
                auto r = relay_.get("/readyz");
                return r && r->status == 503 && r->body == "draining\n";
            },
            Millis{5'000}))
            << "SIGTERM was not taken: " << relay_.diagnostics();
        ReceiveCheck during = echoRoundTrip(live.get(), seed, 64 * 1024);
        EXPECT_EQ(during.bytes, 64u * 1024) << "a live connection keeps relaying while draining";
        EXPECT_LT(during.first_mismatch, 0) << during.describe();
        live.reset();
        auto status = relay_.waitExit(Millis{10'000});
        ASSERT_TRUE(status) << "the relay did not exit after its last connection closed";
        EXPECT_TRUE(status->cleanExit()) << status->describe();
    }

    ScriptedUpstream up_{AF_INET, echoScript()};
    RelayProcess relay_;
};

// ---------------------------------------------------------------------------------------------
// The endpoint under siege.

class EndpointSiege : public ControlPlaneTest, public ::testing::WithParamInterface<size_t> {};

// N connections that never send a byte, all open at once (two took /healthz down before: two
// civetweb threads, each waiting 30 s for a request). Every probe meanwhile is answered within
// a Kubernetes probe's timeout; past max_connections the oldest idle ones are closed for newer
// ones (evicted), the rest at request_timeout; the data path never notices.
TEST_P(EndpointSiege, ProbesAreAnsweredWhileIdleConnectionsHoldTheEndpoint) {
    const size_t hostile = GetParam();
    ASSERT_NO_FATAL_FAILURE(startRelay());  // the defaults: request_timeout 5s, 64 connections
    const uint16_t port = relay_.metricsPort();
    std::vector<Fd> idle = openIdle(port, hostile);
    ASSERT_EQ(idle.size(), hostile) << "could not open every hostile connection";

    for (int i = 0; i < 20; ++i) {
        const char* path = i % 2 == 0 ? "/healthz" : "/readyz";
        Reply r = probe(port, path);
        ASSERT_TRUE(r.error.empty()) << "probe " << i << " " << path << " with " << hostile
                                     << " idle connections open: " << r.error;
        EXPECT_EQ(r.status, 200) << path << ": " << r.head;
        EXPECT_LT(r.seconds, kProbeBound.count() / 1000.0) << "probe " << i;
    }
    auto scrape = relay_.scrape();
    ASSERT_TRUE(scrape) << "a scrape must be served too";

    // The 64 newest idle connections wait for their 5 s; every older one was evicted at once.
    const double cap = 64;
    if (hostile > cap) {
        EXPECT_TRUE(relay_.waitForMetric(kRejected, why("evicted"),
                                         [&](double v) { return v >= hostile - cap; },
                                         ">= " + std::to_string(hostile - 64)));
    }
    EXPECT_EQ(closedByPeer(idle, Millis{15'000}), hostile)
        << "every idle connection must be closed by the relay (timeout or eviction)";
    EXPECT_TRUE(relay_.waitForMetric(kRejected, why("timeout"),
                                     [&](double v) { return v >= std::min<double>(hostile, 1); },
                                     ">= 1"));
    const double evicted = relay_.metric(kRejected, why("evicted")).value_or(-1);
    const double timed_out = relay_.metric(kRejected, why("timeout")).value_or(-1);
    EXPECT_GE(evicted + timed_out, static_cast<double>(hostile))
        << "evicted " << evicted << " + timed out " << timed_out;
    EXPECT_TRUE(relay_.waitForMetric(kEndpointConnections, {}, [](double v) { return v <= 1; },
                                     "<= 1 (the scrape's own)"));
    expectRelaying();
}
ZCRELAY_LABEL(EndpointSiege, ProbesAreAnsweredWhileIdleConnectionsHoldTheEndpoint, "", kSanitizeSkip,
              "mostly waits for deadlines; its HTTP server runs sanitized in HttpServerTest");

INSTANTIATE_TEST_SUITE_P(Hostile, EndpointSiege, ::testing::Values(2, 200, 5000),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                             return std::to_string(info.param) + "Idle";
                         });

// A slowloris: each connection sends a request line and then one header line every 200 ms, never
// idle long enough for an inactivity timeout. The deadline is for the whole request, so each is
// closed about request_timeout after it connected, counted as a timeout.
TEST_F(ControlPlaneTest, TricklingClientsAreClosedAtTheRequestDeadline) {
    constexpr int kClients = 20;
    ASSERT_NO_FATAL_FAILURE(startRelay("  request_timeout: 1s\n"));
    std::vector<Fd> clients;
    for (int i = 0; i < kClients; ++i) {
        Connected c = connectTo("127.0.0.1", relay_.metricsPort());
        ASSERT_TRUE(c.fd) << c.error;
        const std::string line = "GET /metrics HTTP/1.1\r\n";
        ASSERT_TRUE(writeAll(c.fd.get(), line.data(), line.size()).ok());
        clients.push_back(std::move(c.fd));
    }
    const auto start = Clock::now();
    std::vector<bool> open(kClients, true);
    int still_open = kClients;
    // Trickle for at most 8 s; the relay must end every one long before (8x its 1 s timer: room
    // for a loaded 2-core machine, and a missing deadline would leave them open for ever).
    while (still_open > 0 && secondsSince(start) < 8) {
        for (int i = 0; i < kClients; ++i) {
            if (!open[i]) continue;
            const char header[] = "X-Slow: 1\r\n";
            if (::send(clients[i].get(), header, sizeof header - 1, MSG_NOSIGNAL) < 0) {
                open[i] = false;
                --still_open;
            }
        }
        std::this_thread::sleep_for(Millis{200});  // the trickle's pace, not a wait
        for (int i = 0; i < kClients; ++i) {
            char buf[256];
            if (open[i] && ::recv(clients[i].get(), buf, sizeof buf, MSG_DONTWAIT) == 0) {
                open[i] = false;
                --still_open;
            }
        }
    }
    EXPECT_EQ(still_open, 0) << "trickling clients still open after " << secondsSince(start)
                             << " s with request_timeout 1s";
    EXPECT_TRUE(relay_.waitForMetric(kRejected, why("timeout"), kClients));
    Reply r = probe(relay_.metricsPort(), "/healthz");
    EXPECT_EQ(r.status, 200) << r.error;
}

// What the endpoint does not serve is refused at once, with the reason counted: a body (even one
// promised by Content-Length 2^63-1, which used to hold a civetweb thread), a method other than
// GET/HEAD, headers past max_request_size, an unknown path. HEAD and keep-alive work as HTTP says.
TEST_F(ControlPlaneTest, RefusesBodiesMethodsOversizedRequestsAndUnknownPaths) {
    ASSERT_NO_FATAL_FAILURE(startRelay());
    const uint16_t port = relay_.metricsPort();

    Reply body = roundTrip(port,
                           "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: "
                           "9223372036854775807\r\n\r\nabc",
                           kProbeTimeout);
    EXPECT_EQ(body.status, 413) << body.error << body.head;
    // At once: the other way is request_timeout (5 s) later. kProbeBound, as for the probes.
    EXPECT_LT(body.seconds, kProbeBound.count() / 1000.0)
        << "refused at once, and the connection closed";

    Reply post = roundTrip(port, "POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
    EXPECT_EQ(post.status, 405) << post.error << post.head;
    EXPECT_NE(post.head.find("Allow: GET, HEAD"), std::string::npos) << post.head;

    const std::string big(20'000, 'a');
    Reply oversized = roundTrip(port, "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + big +
                                         "\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(oversized.status, 431) << oversized.error << oversized.head;
    // 8 KiB of headers, the default max_request_size, is still taken.
    const std::string fits(7'900, 'a');
    Reply taken = roundTrip(port, "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + fits +
                                     "\r\nConnection: close\r\n\r\n");
    EXPECT_EQ(taken.status, 200) << taken.error << taken.head;

    Reply missing = roundTrip(port, "GET /nope HTTP/1.0\r\n\r\n");
    EXPECT_EQ(missing.status, 404) << missing.error;

    Reply head = roundTrip(port, "HEAD /healthz HTTP/1.0\r\n\r\n");
    EXPECT_EQ(head.status, 200) << head.error;
    EXPECT_NE(head.head.find("Content-Length: 3"), std::string::npos) << head.head;
    EXPECT_TRUE(head.body.empty()) << "HEAD has no body: " << head.body;

    // Keep-alive: two requests, two answers, one connection.
    Connected c = connectTo("127.0.0.1", port);
    ASSERT_TRUE(c.fd) << c.error;
    for (int i = 0; i < 2; ++i) {
        const std::string get = "GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n";
        ASSERT_TRUE(writeAll(c.fd.get(), get.data(), get.size()).ok());
        std::string text;
        while (text.find("ready\n") == std::string::npos) {
            char buf[512];
            IoResult r = readSome(c.fd.get(), buf, sizeof buf, Millis{10'000});
            ASSERT_TRUE(r.ok()) << "request " << i << " on a kept-alive connection: "
                                << r.describe() << " after " << text;
            text.append(buf, r.bytes);
        }
        EXPECT_EQ(text.rfind("HTTP/1.1 200", 0), 0u) << text;
    }

    EXPECT_TRUE(relay_.waitForMetric(kRejected, why("body"), 1));
    EXPECT_TRUE(relay_.waitForMetric(kRejected, why("method"), 1));
    EXPECT_TRUE(relay_.waitForMetric(kRejected, why("bad_request"), 1));
    EXPECT_TRUE(relay_.waitForMetric(kRejected, why("not_found"), 1));
}

// What RFC 9112 says a server must refuse, on the real metrics endpoint: a NUL in the target
// (libmicrohttpd answered "/healthz\0x" as /healthz), a NUL or control byte in a header, two
// Content-Lengths, Content-Length with Transfer-Encoding. Each 400 and closed at once, counted
// as bad_request; a probe right after is answered.
TEST_F(ControlPlaneTest, NulBytesAndAmbiguousLengthsAreRefusedWith400) {
    using namespace std::string_literals;
    ASSERT_NO_FATAL_FAILURE(startRelay());
    const uint16_t port = relay_.metricsPort();
    const std::vector<std::string> refused = {
        "GET /healthz\0x HTTP/1.1\r\nHost: x\r\n\r\n"s,
        "GET /metrics\0/../healthz HTTP/1.1\r\nHost: x\r\n\r\n"s,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Probe: ok\0junk\r\n\r\n"s,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Probe: a\x01z\r\n\r\n",
        "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n",
        "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
        "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    };
    for (const std::string& request : refused) {
        Reply r = roundTrip(port, request, kProbeTimeout);
        EXPECT_EQ(r.status, 400) << r.error << r.head << "\nfor " << request;
        // At once, not at request_timeout (5 s): kProbeBound, as for the probes.
        EXPECT_LT(r.seconds, kProbeBound.count() / 1000.0) << "closed at once after the 400";
        EXPECT_EQ(r.body.find("ok"), std::string::npos) << "the probe answered: " << r.body;
    }
    EXPECT_TRUE(relay_.waitForMetric(kRejected, why("bad_request"), refused.size()));
    Reply ok = probe(port, "/healthz");
    EXPECT_EQ(ok.status, 200) << ok.error << ok.head;
}

// metrics.health_listen: /healthz and /readyz on a port of their own (and /metrics not), so a
// probe never shares a connection cap with scrapes.
TEST_F(ControlPlaneTest, HealthListenServesProbesApartFromScrapes) {
    ASSERT_NO_FATAL_FAILURE(startRelay("  health_listen: 127.0.0.1:0\n  max_connections: 4\n"));
    std::smatch m;
    const std::string out = relay_.stdoutText();
    ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(health probes on http://127\.0\.0\.1:(\d+)/healthz)")))
        << out;
    const uint16_t health = static_cast<uint16_t>(std::stoi(m[1]));
    ASSERT_NE(health, relay_.metricsPort());
    // The scrape port full of idle connections: the health port does not care.
    std::vector<Fd> idle = openIdle(relay_.metricsPort(), 100);
    EXPECT_EQ(probe(health, "/healthz").status, 200);
    EXPECT_EQ(probe(health, "/readyz").status, 200);
    EXPECT_EQ(probe(health, "/metrics").status, 404) << "scrapes stay on metrics.listen";
    EXPECT_EQ(probe(relay_.metricsPort(), "/healthz").status, 200) << "and probes still work there";
}

// ---------------------------------------------------------------------------------------------
// Config files that are not config files.

struct BadFile {
    const char* name;
    std::function<std::string(const TempDir&)> make;  // returns the path
    const char* message;                               // a part of the error
};

const std::vector<BadFile>& badFiles() {
    static const std::vector<BadFile> files = {
        {"fifo",
         [](const TempDir& d) {
             const std::string p = d.file("fifo.yaml");
             ::mkfifo(p.c_str(), 0600);
             return p;
         },
         "is a FIFO"},
        {"dev_zero",
         [](const TempDir& d) {
             const std::string p = d.file("zero.yaml");
             EXPECT_EQ(::symlink("/dev/zero", p.c_str()), 0) << std::strerror(errno);
             return p;
         },
         "is a character device"},
        {"directory", [](const TempDir& d) { return d.path(); }, "is a directory"},
        {"two_megabytes",
         [](const TempDir& d) {
             return d.writeFile("big.yaml", "# " + std::string(2 * kMiB, 'x') + "\n");
         },
         "larger than 1MiB"},
        {"two_documents",
         [](const TempDir& d) {
             return d.writeFile("two.yaml",
                                "listeners: [{listen: 127.0.0.1:0, upstream: 127.0.0.1:9}]\n"
                                "---\nworkers: 1\n");
         },
         "3:1: (document 2): a second YAML document"},
    };
    return files;
}

// --check-config and a start on each: exit 1 within seconds (the FIFO hung, /dev/zero aborted
// with std::bad_alloc, the second document was ignored), with a message naming what is wrong.
TEST(ConfigFiles, CheckConfigAndStartRefuseFilesThatAreNotConfigs) {
    TempDir dir;
    for (const BadFile& bad : badFiles()) {
        SCOPED_TRACE(bad.name);
        const std::string path = bad.make(dir);
        for (const char* flag : {"--check-config", "-c"}) {
            // Under an address-space limit /dev/zero would have ended in bad_alloc (rc 134).
            // Not in a sanitizer build, whose shadow memory needs terabytes of address space.
            std::vector<std::string> argv = {kRelayBinary, flag, path, "--metrics", "off"};
            if (!kSanitized) argv.insert(argv.begin(), {"/usr/bin/prlimit", "--as=3000000000"});
            CommandResult r = runCommand(argv, Millis{10'000});
            EXPECT_TRUE(r.status.exited && r.status.code == 1) << flag << ": " << r.describe();
            EXPECT_NE(r.err.find(bad.message), std::string::npos) << flag << ": " << r.err;
        }
    }
}

// A 1 MiB value is quoted in 80 bytes and its length, not echoed whole. (It was 10 MiB: the
// same property for ten times the parse, 17 s of the CPUs under TSan.)
TEST(ConfigFiles, ErrorsQuoteAtMostEightyBytesOfAValue) {
    TempDir dir;
    const std::string path = dir.writeFile(
        "long.yaml", "listeners: [{name: " + std::string(kMiB, 'a') +
                         ", listen: 127.0.0.1:0, upstream: 127.0.0.1:9}]\n");
    // The bound only catches a hang: the parse takes a fraction of a second, a few seconds
    // under TSan beside the rest of the suite.
    CommandResult r = runCommand({kRelayBinary, "--check-config", path, "--max-config-size", "16MiB"},
                                 Millis{kSanitized ? 180'000 : 60'000});
    EXPECT_EQ(r.status.code, 1) << r.describe();
    EXPECT_NE(r.err.find("...(1048576 bytes) is not a valid name"), std::string::npos) << r.err.substr(0, 400);
    EXPECT_LT(r.err.size(), 400u) << "the error line quotes the whole value";
}
ZCRELAY_LABEL(ConfigFiles, ErrorsQuoteAtMostEightyBytesOfAValue, "", kCpuBound,
              "parses 1 MiB of YAML against a deadline");

// `bytes` of YAML that yaml-cpp needs about 250 times as much memory to hold: one-element
// sequences, each a node of its own (1 MiB: 262,000 of them, 260 MiB).
std::string memoryHungryConfig(const TempDir& dir, const std::string& name, uint64_t bytes) {
    std::string text = "listeners: [";
    while (text.size() < bytes - 64) text += "[1],";
    text += "[1]]\n";
    return dir.writeFile(name, text);
}

// The relay's peak resident memory (VmHWM), in KiB.
uint64_t peakRssKib(pid_t pid) {
    const std::string status = readFileText("/proc/" + std::to_string(pid) + "/status");
    const size_t at = status.find("VmHWM:");
    return at == std::string::npos ? 0 : std::stoull(status.substr(at + 6));
}

// A config that needs hundreds of MiB to parse costs the relay none of it. At start, memory
// running out is a refused config (under an address-space limit --check-config used to end in
// an uncaught std::bad_alloc, rc 134). By SIGHUP the file is parsed by a child process: 1 MiB
// of it (260 MiB to parse) is refused for what it says, 8 MiB (over 2 GiB) for the child's
// address-space limit; in-process, either would have been the relay's memory (and, under a
// limit, another thread's std::bad_alloc that ended the relay). The relay's peak RSS does not
// move, and its live connection and probes go on.
TEST_F(ControlPlaneTest, AConfigThatNeedsTooMuchMemoryCostsTheRelayNone) {
    TempDir dir;
    const std::string one = memoryHungryConfig(dir, "one.yaml", kMiB);
    // Address-space limits are for builds without sanitizers, whose shadow memory needs
    // terabytes of it (the reader skips its own limit there too).
    if (!kSanitized) {
        CommandResult check = runCommand(
            {"/usr/bin/prlimit", "--as=150000000", kRelayBinary, "--check-config", one});
        EXPECT_TRUE(check.status.exited && check.status.code == 1) << check.describe();
        EXPECT_NE(check.err.find("out of memory while loading the config"), std::string::npos)
            << check.err;
    }

    const std::string config =
        dir.writeFile("zcrelay.yaml", singleListenerConfig(up_.hostPort(), "splice").yaml());
    ASSERT_TRUE(relay_.startWithArgs({"-c", config, "--max-config-size", "8MiB"}));
    Fd live = openLive(11);
    ASSERT_TRUE(live) << "no live connection";
    if (HasFatalFailure()) return;
    const uint64_t peak_before = peakRssKib(relay_.pid());

    const std::string eight = memoryHungryConfig(dir, "eight.yaml", 8 * kMiB);
    // The 8 MiB file ends the reader at its address-space limit (1.5 GiB with
    // --max-config-size 8MiB), but only after the page faults of 1.5 GiB: `--check-config`
    // under that limit took 8.9 to 12.3 s on this 2-core VM with a suite running beside it
    // (the builds before and after 2026-11-28's change alike), around the reader's 10 s
    // deadline, which then kills it instead (a clean-clone run failed here so). Either ending
    // is the reader's and refuses the reload; what this case is about is that the relay pays
    // nothing. The limit alone is checked above, by --check-config under prlimit.
    const struct {
        const std::string& file;
        const char* message;
        const char* or_message;
    } reloads[] = {{one, "listeners[0]: expected a map, got a sequence",
                    // 260 MiB of nodes: under TSan, or on a loaded machine, past the deadline.
                    "reading the config took longer than"},
                   {eight, "out of memory while loading the config",
                    "reading the config took longer than"}};
    double failures = 0;
    for (const auto& r : reloads) {
        if (kSanitized && &r.file == &eight) continue;  // no limit for the reader to meet
        ASSERT_NO_FATAL_FAILURE(pointConfigAt(config, r.file));
        ASSERT_TRUE(relay_.sendSignal(SIGHUP));
        failures += 1;
        EXPECT_TRUE(relay_.waitForMetric(metric::kConfigReloadsTotal, {{"result", "failure"}},
                                         failures, Millis{30'000}));
        const std::string err = relay_.stderrText();
        EXPECT_TRUE(err.find(r.message) != std::string::npos ||
                    (r.or_message != nullptr && err.find(r.or_message) != std::string::npos))
            << r.message;
    }
    // Parsing the 1 MiB file in the relay would take about 260 MiB (more under ASan, whose
    // redzones grow every node). Allocator noise stays far below that, but not below 32 MiB
    // under ASan: its quarantine holds freed blocks and each thread gets caches of its own (the
    // peak grew 40 MiB across these two refused reloads in one run). Hence a wider margin in
    // sanitizer builds that still tells the two apart.
    const uint64_t margin_kib = (kSanitized ? 128 : 32) * 1024;
    const uint64_t peak_after = peakRssKib(relay_.pid());
    EXPECT_LT(peak_after, peak_before + margin_kib)
        << "the relay's peak RSS grew from " << peak_before << " KiB to " << peak_after
        << " KiB: the config was parsed in the relay";
    EXPECT_TRUE(relay_.running());
    ASSERT_NO_FATAL_FAILURE(exchangeOnce(live.get(), 12));
    EXPECT_EQ(probe(relay_.metricsPort(), "/healthz").status, 200);
}
ZCRELAY_LABEL(ControlPlaneTest, AConfigThatNeedsTooMuchMemoryCostsTheRelayNone, "", kCpuBound,
              "faults in 1.5 GiB within the reader's 10 s deadline");

// The children of `pid`, from every one of its threads' /proc children list.
std::vector<pid_t> childrenOf(pid_t pid) {
    std::vector<pid_t> kids;
    const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
    for (const auto& task : std::filesystem::directory_iterator(tasks)) {
        std::istringstream list(readFileText(task.path().string() + "/children"));
        for (pid_t kid; list >> kid;) kids.push_back(kid);
    }
    return kids;
}

// A reader that does not finish (here: stopped by the test while it parses 8 MiB; in life, a
// file on a hung filesystem) is killed at the deadline and the reload refused; the relay was
// never waiting for it, and the next SIGHUP reads again.
TEST_F(ControlPlaneTest, AReaderPastTheDeadlineIsKilledAndTheReloadRefused) {
    TempDir dir;
    const std::string good = singleListenerConfig(up_.hostPort(), "splice").yaml();
    const std::string config = dir.writeFile("zcrelay.yaml", good);
    ASSERT_TRUE(relay_.startWithArgs({"-c", config, "--max-config-size", "8MiB"}));
    const std::string eight = memoryHungryConfig(dir, "eight.yaml", 8 * kMiB);
    ASSERT_NO_FATAL_FAILURE(pointConfigAt(config, eight));

    ASSERT_TRUE(relay_.sendSignal(SIGHUP));
    // Stopped only once it runs --dump-config: a child still between posix_spawn's clone and
    // its exec shares the relay's memory and command line.
    std::vector<pid_t> readers;
    const auto execd = [&] {
        readers = childrenOf(relay_.pid());
        return readers.size() == 1 &&
               readFileText("/proc/" + std::to_string(readers[0]) + "/cmdline")
                       .find("--dump-config") != std::string::npos;
    };
    // Well inside the reader's 10 s: it needs about 9 s to fault its memory in.
    ASSERT_TRUE(waitUntil(execd, Millis{5'000})) << "no reader process appeared";
    ASSERT_EQ(::kill(readers[0], SIGSTOP), 0) << std::strerror(errno);

    EXPECT_TRUE(relay_.waitForMetric(metric::kConfigReloadsTotal, {{"result", "failure"}}, 1,
                                     Millis{20'000}));
    EXPECT_NE(relay_.stderrText().find("took longer than 10s; the process reading it was killed"),
              std::string::npos)
        << relay_.diagnostics();
    EXPECT_TRUE(waitUntil([&] { return childrenOf(relay_.pid()).empty(); }, Millis{5'000}))
        << "the stopped reader was neither killed nor reaped";
    EXPECT_TRUE(relay_.running());

    ASSERT_EQ(::unlink(config.c_str()), 0);
    dir.writeFile("zcrelay.yaml", good);
    ASSERT_TRUE(relay_.sendSignal(SIGHUP));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConfigReloadsTotal, {{"result", "success"}}, 1));
    expectRelaying();
}

// ---------------------------------------------------------------------------------------------
// Reloads and signals while bytes flow.

class ControlPlaneDuringTransfer : public ::testing::TestWithParam<std::string> {};

// A 256 MiB upload is in flight (held at half way) while the config path becomes each bad file
// in turn, with a SIGHUP each time, and while every signal people send by habit arrives. Each
// reload is refused and counted, the relay keeps its config and answers probes, no signal ends
// it, and every byte arrives in order once the sender goes on.
TEST_P(ControlPlaneDuringTransfer, BadReloadsAndStraySignalsLeaveTheTransferExact) {
    const std::string mode = GetParam();
    constexpr uint64_t kSeed = 0xC0F1;
    const uint64_t total = (kSanitized ? 64 : 256) * kMiB;
    ScriptedUpstream sink(AF_INET, sinkScript());
    ASSERT_TRUE(sink.ok()) << sink.error();
    RelayProcess relay;
    ASSERT_TRUE(relay.start(singleListenerConfig(sink.hostPort(), mode)));
    Connected client = connectTo(relay.host(), relay.port());
    ASSERT_TRUE(client.fd) << client.error;
    GatedSender sender(client.fd.get(), kSeed, total, total / 2);
    ASSERT_TRUE(waitUntil([&] { return sink.liveBytesReceived() >= 16 * kMiB; }, Millis{30'000}))
        << "the upstream got only " << sink.liveBytesReceived() << " bytes";

    const std::string config = relay.configPath();
    const std::string good = readFileText(config);
    TempDir scratch;
    double failures = 0;
    for (const BadFile& bad : badFiles()) {
        SCOPED_TRACE(bad.name);
        const std::string path = bad.make(scratch);
        ASSERT_NO_FATAL_FAILURE(pointConfigAt(config, path));
        ASSERT_TRUE(relay.sendSignal(SIGHUP));
        failures += 1;
        EXPECT_TRUE(relay.waitForMetric(metric::kConfigReloadsTotal, {{"result", "failure"}},
                                        failures));
        EXPECT_NE(relay.stderrText().find(bad.message), std::string::npos);
        EXPECT_EQ(relay.get("/readyz").value_or(HttpResponse{}).status, 200);
    }
    ASSERT_NO_FATAL_FAILURE(pointConfigAt(config, scratch.writeFile("good.yaml", good)));

    // Each signal is counted before the next is sent: a second SIGUSR1 sent while the first is
    // still pending would merge with it.
    const std::vector<std::pair<int, std::string>> signals = {
        {SIGUSR1, "SIGUSR1"}, {SIGALRM, "SIGALRM"},   {SIGTTIN, "SIGTTIN"},
        {SIGTTOU, "SIGTTOU"}, {SIGWINCH, "SIGWINCH"}, {SIGUSR1, "SIGUSR1"}};
    std::map<std::string, double> counted;
    for (const auto& [sig, name] : signals) {
        ASSERT_TRUE(relay.sendSignal(sig));
        EXPECT_TRUE(relay.waitForMetric(kSignalsTotal, {{"signal", name}}, ++counted[name]))
            << name;
    }
    EXPECT_TRUE(relay.running()) << relay.diagnostics();
    EXPECT_EQ(relay.metric(metric::kConfigReloadsTotal, {{"result", "success"}}), 0.0);

    sender.release();
    IoResult sent = sender.join();
    EXPECT_TRUE(sent.ok()) << sent.describe();
    std::string reply;
    IoResult end = readUntilEof(client.fd.get(), reply, Millis{60'000});
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
    std::optional<ConnRecord> rec = sink.waitForRecord(0, Millis{60'000});
    ASSERT_TRUE(rec);
    EXPECT_EQ(rec->bytes_received, total) << rec->describe();
    EXPECT_EQ(rec->received_hash, payloadHash(kSeed, total)) << "bytes lost or reordered";
    EXPECT_TRUE(relay.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1));
    // And the good file still reloads.
    ASSERT_TRUE(relay.sendSignal(SIGHUP));
    EXPECT_TRUE(relay.waitForMetric(metric::kConfigReloadsTotal, {{"result", "success"}}, 1));
}

INSTANTIATE_TEST_SUITE_P(Modes, ControlPlaneDuringTransfer, ::testing::ValuesIn(kModes), modeName);

// A FIFO at the config path used to block the main thread in open() at SIGHUP, so the SIGTERM
// after it was never taken: /readyz stayed 200 and nothing drained. Now the reload is refused
// and SIGTERM drains: /readyz says so, the live connection finishes, the relay exits 0.
TEST_F(ControlPlaneTest, SigtermAfterARefusedFifoReloadDrains) {
    ASSERT_NO_FATAL_FAILURE(startRelay());
    Fd live = openLive(5);
    ASSERT_TRUE(live) << "no live connection";
    if (HasFatalFailure()) return;

    const std::string config = relay_.configPath();
    const std::string good = readFileText(config);
    ASSERT_EQ(::unlink(config.c_str()), 0);
    ASSERT_EQ(::mkfifo(config.c_str(), 0600), 0) << std::strerror(errno);
    ASSERT_TRUE(relay_.sendSignal(SIGHUP));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConfigReloadsTotal, {{"result", "failure"}}, 1));
    // A regular file again, so nothing else (a reader of the config on failure) meets the FIFO.
    ASSERT_EQ(::unlink(config.c_str()), 0);
    std::ofstream(config) << good;

    ASSERT_TRUE(relay_.sendSignal(SIGTERM));
    ASSERT_NO_FATAL_FAILURE(expectDrainedAndExited(std::move(live), 6));
}

// SIGTERM right behind a SIGHUP, while the reload's child process reads and parses a 1 MiB
// file: the drain starts whatever the reload is doing, and a reload that finishes after it
// is dropped (a draining relay takes no new config). Whichever comes first, the relay drains
// its live connection and exits 0.
TEST_F(ControlPlaneTest, SigtermDuringAReloadDrains) {
    ASSERT_NO_FATAL_FAILURE(startRelay());
    Fd live = openLive(8);
    ASSERT_TRUE(live) << "no live connection";
    if (HasFatalFailure()) return;

    // The same config, grown to just under the 1 MiB cap: the longest a reload may read.
    const std::string config = relay_.configPath();
    std::string text = readFileText(config);
    const std::string line = "# " + std::string(1000, 'p') + "\n";
    while (text.size() + line.size() < kMiB - 1024) text += line;
    std::ofstream(config, std::ios::trunc) << text;

    ASSERT_TRUE(relay_.sendSignal(SIGHUP));
    ASSERT_TRUE(relay_.sendSignal(SIGTERM));
    ASSERT_NO_FATAL_FAILURE(expectDrainedAndExited(std::move(live), 9));
}

// SIGUSR1 reopens the access log, as nginx does (logrotate renames, then signals).
TEST_F(ControlPlaneTest, SigusrOneReopensTheAccessLog) {
    RelayConfig config = singleListenerConfig(up_.hostPort(), "splice");
    TempDir logs;
    const std::string log = logs.file("access.log");
    config.extra_yaml = "access_log:\n  path: " + log + "\n";
    ASSERT_TRUE(relay_.start(config));
    expectRelaying();
    ASSERT_TRUE(waitUntil([&] { return readFileText(log).find('\n') != std::string::npos; },
                          Millis{5'000}));
    ASSERT_EQ(::rename(log.c_str(), (log + ".1").c_str()), 0);
    ASSERT_TRUE(relay_.sendSignal(SIGUSR1));
    EXPECT_TRUE(relay_.waitForMetric(kSignalsTotal, {{"signal", "SIGUSR1"}}, 1));
    expectRelaying();
    EXPECT_TRUE(waitUntil([&] { return readFileText(log).find('\n') != std::string::npos; },
                          Millis{5'000}))
        << "the new connection's line must go to the new file";
    EXPECT_TRUE(relay_.running());
}

}  // namespace
}  // namespace zcrelay::test::control_plane_test
