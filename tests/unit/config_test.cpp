#include "config.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "unit/config_values.hpp"

namespace zcrelay {
namespace {

using namespace std::chrono_literals;

std::string sourcePath(const std::string& relative) {
    return std::string(ZCRELAY_SOURCE_DIR) + "/" + relative;
}
std::string dataPath(const std::string& name) { return sourcePath("tests/data/" + name); }

using unit::addr;
using unit::errorOf;
using unit::errorOfYaml;
using unit::expectSameConfig;

unsigned onlineCpus() { return std::clamp(sysconf(_SC_NPROCESSORS_ONLN), 1L, 256L); }

constexpr const char* kOneListener =
    "listeners:\n"
    "  - listen: 127.0.0.1:10000\n"
    "    upstream: 127.0.0.1:9999\n";

struct BadFixture {
    const char* file;
    const char* error;  // what follows "<path>:"
};

class ConfigFixtureError : public testing::TestWithParam<BadFixture> {};

TEST_P(ConfigFixtureError, NamesLineColumnAndKey) {
    const std::string path = dataPath(GetParam().file);
    EXPECT_EQ(errorOf([&] { loadConfigFile(path); }), path + ":" + GetParam().error);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, ConfigFixtureError,
    testing::Values(
        BadFixture{"bad_syntax.yaml", "4:1: (yaml): end of sequence flow not found"},
        BadFixture{
            "unknown_key.yaml",
            "5:5: listeners[0].pipesize: unknown key; expected one of: name, listen, cluster, "
            "upstream, inspect_timeout, inspect_max_size, accept_proxy, proxy_timeout, "
            "proxy_max_size, max_connections, max_connections_per_source, mode, auto_sockmap_max, "
            "pipe_size, "
            "connect_timeout, idle_timeout, client_fin_timeout, server_fin_timeout, "
            "max_connection_duration, max_connection_duration_jitter, tcp_nodelay, "
            "notsent_lowat, send_zerocopy, tcp_keepalive, routes"},
        BadFixture{"wrong_type.yaml",
                   "5:16: listeners[0].pipe_size: expected a size such as 64KiB, got a map"},
        BadFixture{"workers_not_number.yaml",
                   "2:10: workers: expected a whole number, got \"abc\""},
        BadFixture{"out_of_range.yaml",
                   "5:16: listeners[0].pipe_size: \"32MiB\" is out of range (4KiB..16MiB)"},
        BadFixture{
            "bad_duration.yaml",
            "5:22: listeners[0].connect_timeout: missing unit in \"5\" (use us, ms, s, m or h)"},
        BadFixture{"bad_size.yaml",
                   "5:16: listeners[0].pipe_size: unknown unit \"XB\" in \"64XB\" (use B, KiB, "
                   "MiB, GiB or K, M, G)"},
        BadFixture{"bad_address.yaml",
                   "4:15: listeners[0].upstream: \"localhost\" is not a numeric IP address; names "
                   "are not resolved"},
        BadFixture{"metrics_bad_address.yaml",
                   "3:11: metrics.listen: port 91000 is out of range (0..65535)"},
        BadFixture{"missing_upstream.yaml",
                   "5:5: listeners[1]: missing `cluster` (or `upstream`, a one-backend cluster, or "
                   "`routes`)"},
        BadFixture{"empty_listeners.yaml",
                   "3:12: listeners: empty; at least one listener is needed"},
        BadFixture{"duplicate_listen.yaml",
                   "5:13: listeners[1].listen: 127.0.0.1:10000 is already the listen address of "
                   "listeners[0]"},
        BadFixture{"duplicate_name.yaml",
                   "5:11: listeners[1].name: \"listener0\" is already the name of listeners[0]"},
        BadFixture{"bad_mode.yaml",
                   "5:11: listeners[0].mode: \"zerocopy\" is not a mode; expected one of: splice, "
                   "copy, sockmap, auto"},
        BadFixture{"empty.yaml",
                   "1:1: (document): empty; expected a map with at least `listeners`"},
        BadFixture{"not_a_map.yaml",
                   "2:1: (document): expected a map of settings, got a sequence"}),
    [](const testing::TestParamInfo<BadFixture>& info) {
        std::string name = info.param.file;
        name = name.substr(0, name.find('.'));
        name.erase(std::remove(name.begin(), name.end(), '_'), name.end());
        return name;
    });

TEST(LoadConfig, FullFixtureSetsEveryKey) {
    const Config c = loadConfigFile(dataPath("full.yaml"));
    EXPECT_EQ(c.workers, 3u);
    EXPECT_EQ(c.drain_timeout, 1500ms);
    EXPECT_EQ(c.max_pipes, 0u);
    EXPECT_FALSE(c.metrics.enabled);
    EXPECT_EQ(c.metrics.listen, addr("[::1]:9200"));
    ASSERT_EQ(c.listeners.size(), 2u);

    const ListenerConfig& a = c.listeners[0];
    EXPECT_EQ(a.name, "edge.v4-1");
    EXPECT_EQ(a.listen, addr("127.0.0.1:0"));
    EXPECT_EQ(a.upstream, addr("127.0.0.2:80"));
    EXPECT_EQ(a.mode, Mode::Copy);
    EXPECT_EQ(a.pipe_size, 65536u);
    EXPECT_EQ(a.connect_timeout, 1ms);
    EXPECT_EQ(a.idle_timeout, 0ms);
    EXPECT_FALSE(a.tcp_nodelay);
    EXPECT_EQ(a.notsent_lowat, 0u) << "0 turns it off";

    const ListenerConfig& b = c.listeners[1];
    EXPECT_EQ(b.name, "listener1");
    EXPECT_EQ(b.listen, a.listen);  // port 0 twice is allowed
    EXPECT_EQ(b.upstream, addr("[::1]:443"));
    EXPECT_EQ(b.mode, Mode::Splice);
    EXPECT_EQ(b.pipe_size, 64u * 1024);
    EXPECT_EQ(b.connect_timeout, 2min);
    EXPECT_EQ(b.idle_timeout, 720h);
    EXPECT_TRUE(b.tcp_nodelay) << "the default";
    EXPECT_EQ(b.notsent_lowat, 128u * 1024) << "the default";
}

// The table's defaults must agree with the struct initialisers in config.hpp that other code
// may rely on.
TEST(LoadConfig, MinimalFileTakesTheDefaults) {
    const Config c = loadConfigFile(sourcePath("config/minimal.yaml"));
    const Config plain;
    EXPECT_EQ(c.workers, onlineCpus());
    EXPECT_EQ(c.drain_timeout, plain.drain_timeout);
    EXPECT_EQ(c.max_pipes, plain.max_pipes);
    EXPECT_TRUE(c.metrics.enabled);
    EXPECT_EQ(c.metrics.listen, addr("127.0.0.1:9100"));
    ASSERT_EQ(c.listeners.size(), 1u);

    ListenerConfig expected;
    expected.name = "listener0";
    expected.listen = addr("127.0.0.1:10000");
    expected.upstream = addr("127.0.0.1:9999");
    EXPECT_TRUE(c.listeners[0] == expected) << renderConfig(c);
}

TEST(LoadConfig, ExampleFileLoadsAsTheEmbeddedDefault) {
    expectSameConfig(loadConfigFile(sourcePath("config/zcrelay.example.yaml")),
                     loadConfigString(defaultConfigYaml(), "<default>"));
}

// The example is generated from the key table, so help, defaults and ranges stay in step.
TEST(LoadConfig, ExampleFileIsTheGeneratedDefault) {
    std::ifstream file(sourcePath("config/zcrelay.example.yaml"));
    std::stringstream text;
    text << file.rdbuf();
    EXPECT_EQ(text.str(), defaultConfigYaml())
        << "regenerate: build/zcrelay --print-default-config > config/zcrelay.example.yaml";
}

TEST(LoadConfig, EmbeddedDefaultIsTheDocumentedOne) {
    const Config c = loadConfigString(defaultConfigYaml(), "<default>");
    EXPECT_EQ(defaultConfigYaml().find("\nworkers:"), std::string_view::npos);
    EXPECT_EQ(c.workers, onlineCpus());
    EXPECT_TRUE(c.metrics.enabled);
    EXPECT_EQ(c.metrics.listen, addr("127.0.0.1:9100"));
    ASSERT_EQ(c.listeners.size(), 1u);
    EXPECT_EQ(c.listeners[0].name, "default");
    EXPECT_EQ(c.listeners[0].listen, addr("127.0.0.1:10000"));
    EXPECT_EQ(c.listeners[0].upstream, addr("127.0.0.1:9999"));
}

TEST(RenderConfig, LoadsBackToAnEqualConfig) {
    const Config metrics_off =
        loadConfigString(std::string("metrics: {listen: \"\"}\n") + kOneListener, "t");
    for (const Config& c : {loadConfigFile(dataPath("full.yaml")),
                            loadConfigString(defaultConfigYaml(), "<d>"), metrics_off}) {
        const std::string text = renderConfig(c);
        expectSameConfig(loadConfigString(text, "<rendered>"), c);
    }
}

TEST(LoadConfig, MetricsTurnOffEitherWay) {
    const Config by_listen =
        loadConfigString(std::string("metrics:\n  listen: \"\"\n") + kOneListener, "t");
    EXPECT_FALSE(by_listen.metrics.enabled);
    const Config by_flag =
        loadConfigString(std::string("metrics:\n  enabled: false\n") + kOneListener, "t");
    EXPECT_FALSE(by_flag.metrics.enabled);
    EXPECT_EQ(errorOfYaml(std::string("metrics:\n  enabled: nope\n") + kOneListener),
              "t.yaml:2:12: metrics.enabled: expected true or false, got \"nope\"");
    EXPECT_EQ(errorOfYaml(std::string("metrics: 9100\n") + kOneListener),
              "t.yaml:1:10: metrics: expected a map, got a scalar");
}

TEST(LoadConfig, RangesAreEnforcedWithTheRangeInTheMessage) {
    EXPECT_EQ(errorOfYaml(std::string("workers: 0\n") + kOneListener),
              "t.yaml:1:10: workers: \"0\" is out of range (1..256)");
    EXPECT_EQ(errorOfYaml(std::string("workers: 99999999999999999999\n") + kOneListener),
              "t.yaml:1:10: workers: \"99999999999999999999\" is out of range (1..256)");
    EXPECT_EQ(errorOfYaml(std::string("drain_timeout: 61m\n") + kOneListener),
              "t.yaml:1:16: drain_timeout: \"61m\" is out of range (0s..1h)");
    EXPECT_EQ(errorOfYaml(std::string("max_pipes: 100001\n") + kOneListener),
              "t.yaml:1:12: max_pipes: \"100001\" is out of range (0..100000)");
    EXPECT_EQ(errorOfYaml(std::string(kOneListener) + "    connect_timeout: 0s\n"),
              "t.yaml:4:22: listeners[0].connect_timeout: \"0s\" is out of range (1ms..10m)");
    EXPECT_EQ(errorOfYaml(std::string(kOneListener) + "    idle_timeout: 721h\n"),
              "t.yaml:4:19: listeners[0].idle_timeout: \"721h\" is out of range (0s..720h)");
    EXPECT_EQ(errorOfYaml(std::string(kOneListener) + "    pipe_size: 4095\n"),
              "t.yaml:4:16: listeners[0].pipe_size: \"4095\" is out of range (4KiB..16MiB)");
    EXPECT_EQ(loadConfigString(std::string(kOneListener) + "    idle_timeout: 0s\n", "t")
                  .listeners[0]
                  .idle_timeout,
              0ms);
}

TEST(LoadConfig, StructureErrors) {
    EXPECT_EQ(errorOfYaml("workers: 2\n"), "t.yaml:1:1: listeners: missing required key");
    EXPECT_EQ(errorOfYaml("listeners: {listen: 127.0.0.1:1}\n"),
              "t.yaml:1:12: listeners: expected a sequence of listeners, got a map");
    EXPECT_EQ(errorOfYaml("listeners:\n  - 127.0.0.1:1\n"),
              "t.yaml:2:5: listeners[0]: expected a map, got a scalar");
    EXPECT_EQ(errorOfYaml("listeners:\n  - listen: 127.0.0.1:1\n"),
              "t.yaml:2:5: listeners[0]: missing `cluster` (or `upstream`, a one-backend cluster, or `routes`)");
    EXPECT_EQ(errorOfYaml(std::string("worker: 2\n") + kOneListener),
              "t.yaml:1:1: worker: unknown key; expected one of: workers, drain_timeout, "
              "max_pipes, max_connections, user, group, takeover_socket, metrics, access_log, "
              "resolvers, admin, clusters, listeners");
    EXPECT_EQ(errorOfYaml(std::string("workers: 2\nworkers: 3\n") + kOneListener),
              "t.yaml:2:1: workers: key given twice");
    EXPECT_EQ(errorOfYaml("just text\n"),
              "t.yaml:1:1: (document): expected a map of settings, got a scalar");
}

TEST(LoadConfig, MissingValuePointsAtItsKey) {
    // yaml-cpp marks an empty value where the next line starts; the key is where to look.
    EXPECT_EQ(errorOfYaml(std::string("workers:\n") + kOneListener),
              "t.yaml:1:1: workers: expected a whole number, got nothing");
}

TEST(LoadConfig, BadNameAndMode) {
    EXPECT_EQ(errorOfYaml(std::string(kOneListener) + "    name: \"a b\"\n"),
              "t.yaml:4:11: listeners[0].name: \"a b\" is not a valid name; use 1 to 64 of "
              "[A-Za-z0-9_.-]");
    EXPECT_EQ(errorOfYaml(std::string(kOneListener) + "    name: " + std::string(65, 'x') + "\n"),
              "t.yaml:4:11: listeners[0].name: \"" + std::string(65, 'x') +
                  "\" is not a valid name; use 1 to 64 of [A-Za-z0-9_.-]");
    EXPECT_EQ(errorOfYaml(std::string(kOneListener) + "    mode: [splice]\n"),
              "t.yaml:4:11: listeners[0].mode: expected one of: splice, copy, sockmap, auto, got a "
              "sequence");
}

TEST(LoadConfig, UnquotedIPv6GetsAHint) {
    EXPECT_EQ(
        errorOfYaml("listeners:\n  - listen: [::1]:80\n    upstream: 127.0.0.1:1\n"),
        "t.yaml:2:18: (yaml): end of map not found (IPv6 addresses need quotes: \"[::1]:10000\")");
}

TEST(LoadConfig, SameAddressOnDifferentPortsIsNoDuplicate) {
    const Config c = loadConfigString(
        "listeners:\n"
        "  - {listen: 127.0.0.1:1000, upstream: 127.0.0.1:1}\n"
        "  - {listen: 127.0.0.1:1001, upstream: 127.0.0.1:1}\n"
        "  - {listen: 127.0.0.2:1000, upstream: 127.0.0.1:1}\n",
        "t");
    EXPECT_EQ(c.listeners.size(), 3u);
}

TEST(LoadConfigFile, UnreadableFileSaysWhy) {
    const std::string path = dataPath("does-not-exist.yaml");
    EXPECT_EQ(errorOf([&] { loadConfigFile(path); }),
              path + ": cannot read: No such file or directory");
    EXPECT_EQ(errorOf([&] { loadConfigFile(dataPath("")); }),
              dataPath("") + ": is a directory; the config must be a regular file");
}

// What is not a regular file is refused before a byte is read: a FIFO would block the reader
// until a writer comes (a SIGHUP's reload, forever), a device such as /dev/zero would be read
// until memory runs out.
TEST(LoadConfigFile, RefusesWhatIsNotARegularFile) {
    const std::string dir = testing::TempDir() + "zcrelay-config-kinds";
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    const std::string fifo = dir + "/fifo.yaml";
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    EXPECT_EQ(errorOf([&] { loadConfigFile(fifo); }),
              fifo + ": is a FIFO; the config must be a regular file");
    const std::string zero = dir + "/zero.yaml";
    std::filesystem::create_symlink("/dev/zero", zero);
    EXPECT_EQ(errorOf([&] { loadConfigFile(zero); }),
              zero + ": is a character device; the config must be a regular file");
    std::filesystem::remove_all(dir);
}

// The cap is on the bytes read, whatever fstat said; the message names the cap.
TEST(LoadConfigFile, RefusesAFileLargerThanTheCap) {
    const std::string path = testing::TempDir() + "zcrelay-config-big.yaml";
    {
        std::ofstream out(path);
        out << kOneListener << "# " << std::string(4096, 'x') << "\n";
    }
    EXPECT_EQ(errorOf([&] { loadConfigFile(path, 4096); }),
              path + ": larger than 4KiB, the most a config file may hold (--max-config-size)");
    EXPECT_NO_THROW(loadConfigFile(path, 8192));
    EXPECT_EQ(errorOf([&] { loadConfigFile(path); }), "(no error)") << "1MiB by default";
    std::filesystem::remove(path);
}

TEST(LoadConfig, HealthListenNeedsTheEndpoint) {
    EXPECT_EQ(errorOfYaml("metrics: {listen: \"\", health_listen: 127.0.0.1:9101}\n" +
                          std::string(kOneListener)),
              "t.yaml:1:38: metrics.health_listen: is set while metrics are off (listen \"\" or "
              "enabled: false); probes are served only with the endpoint on");
    EXPECT_EQ(errorOfYaml("metrics: {listen: 127.0.0.1:9100, health_listen: 127.0.0.1:9100}\n" +
                          std::string(kOneListener)),
              "t.yaml:1:50: metrics.health_listen: is the same address as metrics.listen; leave "
              "it unset to serve probes there");
    const Config c = loadConfigString(
        "metrics: {listen: 127.0.0.1:9100, health_listen: \"[::1]:9101\"}\n" +
            std::string(kOneListener),
        "t");
    EXPECT_EQ(c.metrics.health_listen.toString(), "[::1]:9101");
}

TEST(LoadConfig, RefusesASecondYamlDocument) {
    EXPECT_EQ(errorOfYaml(std::string(kOneListener) + "---\nworkers: 1\n"),
              "t.yaml:5:1: (document 2): a second YAML document (after `---`); the config is "
              "one document");
    // One document that starts with `---` is still one document, and an empty one after it
    // (a trailing `---`) configures nothing to lose.
    EXPECT_EQ(errorOfYaml(std::string("---\n") + kOneListener), "(no error)");
    EXPECT_EQ(errorOfYaml(std::string(kOneListener) + "---\n# nothing\n"), "(no error)");
    EXPECT_EQ(errorOfYaml(std::string(kOneListener) + "---\n---\nworkers: 1\n"),
              "t.yaml:6:1: (document 3): a second YAML document (after `---`); the config is "
              "one document");
}

// 396 bytes that yaml-cpp 0.7's parser reads as documents without end (fuzz.config found it:
// YAML::LoadAll grew to 2 GiB and never returned). Refused after a bounded look.
TEST(LoadConfig, InputThatYieldsEndlessDocumentsIsRefused) {
    const std::string path = sourcePath("tests/fuzz/corpus/config/regress-endless-documents.yaml");
    EXPECT_EQ(errorOf([&] { loadConfigFile(path); }),
              path + ": (yaml): more than 64 YAML documents; the config is one");
}

// A value of megabytes is quoted in kQuoteBytes and its length: the error stays a line.
TEST(LoadConfig, ErrorsQuoteALongValueInEightyBytes) {
    const std::string name(1 << 20, 'n');
    const std::string error = errorOfYaml("listeners:\n  - name: " + name +
                                          "\n    listen: 127.0.0.1:1\n    upstream: 127.0.0.1:2\n");
    EXPECT_LT(error.size(), 300u) << error.substr(0, 300);
    EXPECT_NE(error.find("\"" + std::string(kQuoteBytes, 'n') + "\"...(1048576 bytes)"),
              std::string::npos)
        << error;
    // A key of megabytes too.
    const std::string key_error = errorOfYaml(std::string(kOneListener) + name + ": 1\n");
    EXPECT_LT(key_error.size(), 600u) << key_error.substr(0, 600);
}

TEST(ApplyFlag, ChecksLikeTheYamlKeyAndNamesTheFlag) {
    Config c = loadConfigString(defaultConfigYaml(), "<default>");
    applyFlag(c, "workers", "7", "--workers");
    EXPECT_EQ(c.workers, 7u);
    EXPECT_EQ(errorOf([&] { applyFlag(c, "workers", "300", "--workers"); }),
              "<command line>: --workers: \"300\" is out of range (1..256)");
    applyFlag(c, "metrics.listen", "", "--metrics");
    EXPECT_FALSE(c.metrics.enabled);
    applyFlag(c, "metrics.listen", "[::1]:9000", "--metrics");
    EXPECT_TRUE(c.metrics.enabled);
    EXPECT_EQ(c.metrics.listen, addr("[::1]:9000"));
}

// The shorthand's ends are backends too: `--upstream` that names the relay's own listener or
// metrics address, or an address that is no host, is refused like the file's key.
TEST(ApplyFlag, AnUpstreamFlagThatLoopsIsRefused) {
    Config c = loadConfigString(defaultConfigYaml(), "<default>");
    applyFlag(c, "listen", "127.0.0.1:10000", "--listen");
    EXPECT_EQ(errorOf([&] { applyFlag(c, "upstream", "127.0.0.1:10000", "--upstream"); }),
              "<command line>: --upstream: 127.0.0.1:10000 is the relay's own "
              "listeners[0].listen: a loop");
    EXPECT_EQ(errorOf([&] { applyFlag(c, "upstream", "0.0.0.0:80", "--upstream"); }).find(
                  "<command line>: --upstream: 0.0.0.0:80 is refused as a backend (unspecified"),
              0u);
    EXPECT_EQ(errorOf([&] { applyFlag(c, "upstream", "127.0.0.1:9100", "--upstream"); }),
              "<command line>: --upstream: 127.0.0.1:9100 is the relay's own metrics.listen: a "
              "loop");
    applyFlag(c, "upstream", "127.0.0.1:9200", "--upstream");
    EXPECT_EQ(errorOf([&] { applyFlag(c, "metrics.listen", "127.0.0.1:9200", "--metrics"); }),
              "<command line>: --metrics: 127.0.0.1:9200 is the relay's own metrics.listen: a "
              "loop");
}

}  // namespace
}  // namespace zcrelay

// ---- the examples in config/: each loads, and says what its comments say -----------------

namespace zcrelay {
namespace {

Config example(const std::string& name) { return loadConfigFile(sourcePath("config/" + name)); }

TEST(ConfigExamples, EveryExampleFileLoads) {
    size_t loaded = 0;
    for (const auto& entry : std::filesystem::directory_iterator(sourcePath("config"))) {
        if (entry.path().extension() != ".yaml") continue;
        EXPECT_NO_THROW(loadConfigFile(entry.path())) << entry.path();
        ++loaded;
    }
    EXPECT_GE(loaded, 8u);
}

TEST(ConfigExamples, Clusters) {
    const Config c = example("clusters.yaml");
    ASSERT_EQ(c.clusters.size(), 2u);
    const ClusterConfig& app = c.clusters[0];
    EXPECT_EQ(app.balance, Balance::RoundRobin);
    EXPECT_EQ(app.retries, 2u);
    ASSERT_EQ(app.backends.size(), 3u);
    EXPECT_EQ(app.backends[0].weight, 3u);
    EXPECT_EQ(app.backends[1].weight, 1u);
    EXPECT_EQ(app.backends[2].address.family(), AF_UNIX);
    EXPECT_EQ(app.backends[2].address.toString(), "unix:/run/app.sock");
    EXPECT_EQ(c.clusters[1].balance, Balance::SourceHash);
    // `upstream:` is the one-backend cluster named after its listener, after the declared ones.
    const auto all = clustersOf(c);
    ASSERT_EQ(all.size(), 3u);
    EXPECT_EQ(all[2].name, "legacy");
    EXPECT_EQ(all[2].backends.at(0).address.toString(), "127.0.0.1:9999");
    EXPECT_EQ(clusterIndex(c, 0), 0u);
    EXPECT_EQ(clusterIndex(c, 1), 1u);
    EXPECT_EQ(clusterIndex(c, 2), 2u);
}

TEST(ConfigExamples, HealthChecks) {
    const Config c = example("health_checks.yaml");
    ASSERT_EQ(c.clusters.size(), 2u);
    EXPECT_TRUE(c.clusters[0].health_check.enabled);
    EXPECT_EQ(c.clusters[0].health_check.fall, 3u);
    const HealthCheckConfig& redis = c.clusters[1].health_check;
    EXPECT_EQ(redis.send, "PING\r\n");
    EXPECT_EQ(redis.expect, "+PONG");
    EXPECT_EQ(redis.timeout, 500ms);
}

TEST(ConfigExamples, Patroni) {
    const Config c = example("patroni.yaml");
    ASSERT_EQ(c.clusters.size(), 2u);
    const ClusterConfig& rw = c.clusters[0];
    EXPECT_EQ(rw.on_marked_down, OnMarkedDown::ShutdownSessions);
    EXPECT_TRUE(rw.health_check.http.enabled);
    EXPECT_EQ(rw.health_check.http.method, "OPTIONS");
    EXPECT_EQ(rw.health_check.http.path, "/primary");
    EXPECT_TRUE(rw.health_check.http.statusPasses(200));
    EXPECT_FALSE(rw.health_check.http.statusPasses(503));
    ASSERT_EQ(rw.backends.size(), 3u);
    EXPECT_EQ(rw.backends[1].check_address, addr("127.0.0.1:8009"));
    EXPECT_EQ(c.clusters[1].health_check.http.path, "/replica");
}

// What an HTTP check, backups and the session policies refuse, each with its key.
TEST(LoadConfig, HttpChecksBackupsAndSessionPoliciesAreChecked) {
    const std::string head =
        "clusters:\n"
        "  - name: db\n";
    const std::string tail =
        "    backends:\n"
        "      - {address: 127.0.0.1:5432}\n"
        "listeners:\n"
        "  - {listen: 127.0.0.1:5000, cluster: db}\n";
    auto error = [&](const std::string& middle) { return errorOfYaml(head + middle + tail); };
    EXPECT_EQ(error("    health_check:\n      http: {method: \"GE T\"}\n"),
              "t.yaml:4:22: clusters[0].health_check.http.method: \"GE T\" is not an HTTP "
              "method (a token such as GET or OPTIONS)");
    EXPECT_EQ(error("    health_check:\n      http: {path: primary}\n"),
              "t.yaml:4:20: clusters[0].health_check.http.path: \"primary\" is not a path: it "
              "starts with / and has no spaces or control characters");
    EXPECT_EQ(error("    health_check:\n      http: {expect_status: \"2xx\"}\n"),
              "t.yaml:4:29: clusters[0].health_check.http.expect_status: \"2xx\" is not a "
              "status list: codes 100 to 599 and ranges, such as 200, \"200,204\" or "
              "\"200-299\"");
    EXPECT_EQ(error("    health_check:\n      http: {expect_status: \"299-200\"}\n"),
              "t.yaml:4:29: clusters[0].health_check.http.expect_status: \"299-200\" is not a "
              "status list: codes 100 to 599 and ranges, such as 200, \"200,204\" or "
              "\"200-299\"");
    EXPECT_EQ(error("    health_check:\n      send: \"x\"\n      http: {path: /}\n"),
              "t.yaml:4:7: clusters[0].health_check: has both `http` and send/expect; a check "
              "is one or the other");
    EXPECT_EQ(error("    on_marked_down: cut\n"),
              "t.yaml:3:21: clusters[0].on_marked_down: \"cut\" is not a choice of "
              "on_marked_down; expected one of: none, shutdown_sessions");
    EXPECT_EQ(
        errorOfYaml(head + "    backends:\n"
                           "      - {address: 127.0.0.1:5432, check_address: 127.0.0.1:8008}\n"
                           "listeners:\n"
                           "  - {listen: 127.0.0.1:5000, cluster: db}\n"),
        "t.yaml:4:50: clusters[0].backends[0].check_address: is set while cluster \"db\" "
        "has no health_check");
    EXPECT_EQ(errorOfYaml(head + "    health_check: {port: 8008}\n"
                                 "    backends:\n"
                                 "      - {address: unix:/run/db.sock}\n"
                                 "listeners:\n"
                                 "  - {listen: 127.0.0.1:5000, cluster: db}\n"),
              "t.yaml:5:19: clusters[0].backends[0].address: is a unix socket, which has no port "
              "for health_check.port to replace; set check_address");
    const Config ok = loadConfigString(head +
                                           "    all_backups: true\n"
                                           "    on_marked_up: shutdown_backup_sessions\n"
                                           "    health_check: {port: 8008, http: {}}\n"
                                           "    backends:\n"
                                           "      - {address: 127.0.0.1:5432}\n"
                                           "      - {address: 127.0.0.1:5433, backup: true}\n"
                                           "listeners:\n"
                                           "  - {listen: 127.0.0.1:5000, cluster: db}\n",
                                       "t.yaml");
    const ClusterConfig& db = ok.clusters[0];
    EXPECT_TRUE(db.all_backups);
    EXPECT_EQ(db.on_marked_up, OnMarkedUp::ShutdownBackupSessions);
    EXPECT_EQ(db.health_check.port, 8008u);
    EXPECT_EQ(db.health_check.http.method, "GET");
    EXPECT_TRUE(db.health_check.http.statusPasses(302));
    EXPECT_EQ(db.backends[0].tier, 0u);
    EXPECT_EQ(db.backends[1].tier, 1u);
    // Rendered and loaded again, it is the same config.
    expectSameConfig(loadConfigString(renderConfig(ok), "rendered.yaml"), ok);
}

TEST(ConfigExamples, ProxyProtocol) {
    const Config c = example("proxy_protocol.yaml");
    EXPECT_EQ(c.clusters.at(0).backends.at(0).send_proxy, ProxyVersion::V2) << "the cluster's";
    EXPECT_EQ(c.clusters.at(0).backends.at(1).send_proxy, ProxyVersion::V1) << "its own";
    EXPECT_TRUE(c.listeners.at(0).accept_proxy);
    EXPECT_EQ(c.listeners.at(0).proxy_timeout, 3s);
}

TEST(ConfigExamples, Limits) {
    const Config c = example("limits.yaml");
    EXPECT_EQ(c.max_connections, 20000u);
    EXPECT_EQ(c.listeners.at(0).max_connections, 10000u);
    EXPECT_EQ(c.listeners.at(0).max_connections_per_source, 100u);
}

TEST(ConfigExamples, UpstreamSockets) {
    const Config c = example("upstream_sockets.yaml");
    EXPECT_EQ(c.clusters.at(0).source.toString(), "127.0.0.2:0");
    EXPECT_EQ(c.clusters.at(0).tcp_keepalive.idle, 60s);
    EXPECT_EQ(c.listeners.at(0).tcp_keepalive.count, 4u);
    EXPECT_EQ(c.listeners.at(0).tcp_keepalive.user_timeout, 60s);
    EXPECT_EQ(c.clusters.at(0).tcp_keepalive.user_timeout, 0s) << "unset: the kernel's";
}

TEST(ConfigExamples, AccessLog) {
    const Config c = example("access_log.yaml");
    EXPECT_EQ(c.access_log.path, "/var/log/zcrelay/access.log");
    EXPECT_EQ(c.access_log.format, AccessLogFormat::Json);
}

// config/discovery.yaml says what its comments say: an A/AAAA cluster and an SRV cluster, the
// resolvers block, and the runtime API on a unix socket without a token.
TEST(ConfigExamples, Discovery) {
    const Config c = example("discovery.yaml");
    ASSERT_EQ(c.resolvers.nameservers.size(), 1u);
    EXPECT_EQ(c.resolvers.nameservers[0].toString(), "127.0.0.1:53");
    EXPECT_EQ(c.resolvers.resolv_conf, "/etc/resolv.conf");
    EXPECT_EQ(c.resolvers.timeout, 1s);
    EXPECT_EQ(c.resolvers.attempts, 3u);

    EXPECT_TRUE(c.admin.enabled());
    EXPECT_EQ(c.admin.listen.family(), AF_UNIX);
    EXPECT_EQ(c.admin.listen.toString(), "unix:/run/zcrelay/admin.sock");
    EXPECT_EQ(c.admin.token_file, "");

    ASSERT_EQ(c.clusters.size(), 2u);
    const ClusterConfig& web = c.clusters[0];
    EXPECT_EQ(web.name, "web");
    EXPECT_EQ(web.balance, Balance::LeastConn);
    EXPECT_TRUE(web.backends.empty()) << "discovered: the Runtime takes the resolved set";
    const DiscoveryConfig& a = web.discovery;
    EXPECT_TRUE(a.enabled());
    EXPECT_EQ(a.dns, "web.example.internal.") << "absolute: no search domain is tried";
    EXPECT_EQ(a.srv, "");
    EXPECT_EQ(a.port, 8080u);
    EXPECT_EQ(a.weight, 1u);
    EXPECT_EQ(a.family, AddressFamilies::Any);
    EXPECT_EQ(a.refresh_min, 1s);
    EXPECT_EQ(a.refresh_max, 30s);
    EXPECT_EQ(a.hold, 30s);
    EXPECT_EQ(a.after_hold, AfterHold::Empty);
    EXPECT_EQ(a.startup, StartupPolicy::Fail);
    EXPECT_EQ(a.max_backends, 64u);
    EXPECT_TRUE(web.health_check.enabled);
    EXPECT_EQ(web.health_check.rise, 2u);

    const ClusterConfig& ldap = c.clusters[1];
    EXPECT_EQ(ldap.name, "ldap");
    EXPECT_TRUE(ldap.backends.empty());
    const DiscoveryConfig& srv = ldap.discovery;
    EXPECT_EQ(srv.srv, "_ldap._tcp.corp.example.internal.");
    EXPECT_EQ(srv.dns, "");
    EXPECT_EQ(srv.name(), srv.srv);
    EXPECT_EQ(srv.port, 0u) << "SRV records carry the ports";
    EXPECT_EQ(srv.hold, 60s);
    EXPECT_EQ(srv.after_hold, AfterHold::Keep);
    EXPECT_EQ(srv.startup, StartupPolicy::Empty);
    EXPECT_EQ(srv.max_backends, 16u);
    EXPECT_TRUE(ldap.health_check.enabled);

    ASSERT_EQ(c.listeners.size(), 2u);
    EXPECT_EQ(clustersOf(c).size(), 2u) << "no upstream: listener";
    EXPECT_EQ(clustersOf(c)[clusterIndex(c, 0)].name, "web");
    EXPECT_EQ(clustersOf(c)[clusterIndex(c, 1)].name, "ldap");
    // What the relay prints at start loads back to the same config.
    expectSameConfig(loadConfigString(renderConfig(c), "<rendered>"), c);
}

// ---- clusters: the errors a user meets ---------------------------------------------------

TEST(ClusterConfig, ErrorsNameTheKey) {
    const std::string listener = "listeners: [{listen: 127.0.0.1:1, cluster: app}]\n";
    EXPECT_EQ(errorOfYaml("listeners: [{listen: 127.0.0.1:1, cluster: nope}]\n"),
              "t.yaml:1:44: listeners[0].cluster: no cluster named \"nope\"");
    EXPECT_EQ(errorOfYaml("clusters: [{name: app, backends: [{address: 127.0.0.1:2}]}]\n"
                          "listeners: [{listen: 127.0.0.1:1, cluster: app, upstream: "
                          "127.0.0.1:3}]\n"),
              "t.yaml:2:13: listeners[0]: set `cluster` or `upstream`, not both");
    EXPECT_EQ(errorOfYaml("clusters: [{name: app}]\n" + listener),
              "t.yaml:1:12: clusters[0].backends: missing required key (or `discovery` to take "
              "them from DNS)");
    EXPECT_EQ(errorOfYaml("clusters: [{name: app, backends: []}]\n" + listener),
              "t.yaml:1:34: clusters[0].backends: empty; at least one backend is needed");
    EXPECT_EQ(errorOfYaml("clusters: [{name: app, balance: fastest, backends: [{address: "
                          "127.0.0.1:2}]}]\n" +
                          listener),
              "t.yaml:1:33: clusters[0].balance: \"fastest\" is not a balance algorithm; "
              "expected one of: round_robin, least_conn, random, source_hash");
    EXPECT_EQ(errorOfYaml("clusters: [{name: app, backends: [{address: 127.0.0.1:2, weight: "
                          "0}]}]\n" +
                          listener),
              "t.yaml:1:66: clusters[0].backends[0].weight: \"0\" is out of range (1..256)");
    EXPECT_EQ(errorOfYaml("clusters: [{name: app, backends: [{address: 127.0.0.1:2}, "
                          "{address: 127.0.0.1:2}]}]\n" +
                          listener),
              "t.yaml:1:69: clusters[0].backends[1].address: 127.0.0.1:2 is already "
              "clusters[0].backends[0]");
    EXPECT_EQ(errorOfYaml("clusters: [{name: app, backends: [{address: \"unix:run.sock\"}]}]\n" +
                          listener),
              "t.yaml:1:45: clusters[0].backends[0].address: a unix socket needs an absolute "
              "path, e.g. unix:/run/app.sock");
    EXPECT_EQ(errorOfYaml("listeners: [{listen: \"unix:/tmp/x\", upstream: 127.0.0.1:1}]\n"),
              "t.yaml:1:22: listeners[0].listen: unix sockets are only supported as backend "
              "addresses");
    EXPECT_EQ(errorOfYaml("clusters: [{name: app, health_check: {rise: 0}, backends: [{address: "
                          "127.0.0.1:2}]}]\n" +
                          listener),
              "t.yaml:1:45: clusters[0].health_check.rise: \"0\" is out of range (1..1000)");
}

// A backend that reaches no service, or the relay itself (a loop: each connection to itself is
// relayed to itself again until the fds run out), is refused at load, naming the key.
TEST(BackendTargets, AddressesThatReachNoServiceAreRefused) {
    const std::string listener = "listeners: [{listen: 127.0.0.1:1, cluster: app}]\n";
    const auto backend = [&](const std::string& address) {
        return errorOfYaml(
            "clusters: [{name: app, backends: [{address: \"127.0.0.1:2\"}, "
            "{address: \"" +
            address + "\"}]}]\n" + listener);
    };
    EXPECT_EQ(backend("0.0.0.0:80"),
              "t.yaml:1:71: clusters[0].backends[1].address: 0.0.0.0:80 is refused as a backend "
              "(unspecified: a connect to it reaches the local host)");
    EXPECT_EQ(backend("[::]:80"),
              "t.yaml:1:71: clusters[0].backends[1].address: [::]:80 is refused as a backend "
              "(unspecified: a connect to it reaches the local host)");
    EXPECT_EQ(backend("255.255.255.255:80"),
              "t.yaml:1:71: clusters[0].backends[1].address: 255.255.255.255:80 is refused as a "
              "backend (broadcast: the broadcast address: no TCP service answers there)");
    EXPECT_EQ(backend("224.0.0.1:80"),
              "t.yaml:1:71: clusters[0].backends[1].address: 224.0.0.1:80 is refused as a "
              "backend (multicast: a multicast address: no TCP service answers there)");
    EXPECT_EQ(backend("[ff02::1]:80"),
              "t.yaml:1:71: clusters[0].backends[1].address: [ff02::1]:80 is refused as a "
              "backend (multicast: a multicast address: no TCP service answers there)");
    EXPECT_EQ(backend("127.0.0.1:0"),
              "t.yaml:1:71: clusters[0].backends[1].address: 127.0.0.1:0 is refused as a "
              "backend (port_zero: port 0 is no service)");
    EXPECT_EQ(errorOfYaml("listeners: [{listen: 127.0.0.1:1, upstream: 127.0.0.1:0}]\n"),
              "t.yaml:1:45: listeners[0].upstream: 127.0.0.1:0 is refused as a backend "
              "(port_zero: port 0 is no service)");
    EXPECT_EQ(errorOfYaml("listeners: [{listen: 127.0.0.1:1, upstream: 0.0.0.0:5}]\n"),
              "t.yaml:1:45: listeners[0].upstream: 0.0.0.0:5 is refused as a backend "
              "(unspecified: a connect to it reaches the local host)");
}

TEST(BackendTargets, TheRelaysOwnAddressesAreALoop) {
    const std::string cluster =
        "clusters: [{name: app, backends: [{address: 127.0.0.1:5}, {address: \"BACKEND\"}]}]\n";
    const auto with = [&](const std::string& address, const std::string& rest) {
        std::string c = cluster;
        c.replace(c.find("BACKEND"), 7, address);
        return errorOfYaml(c + rest);
    };
    const std::string two =
        "listeners: [{listen: 127.0.0.1:10001, cluster: app}, "
        "{listen: \"[::1]:10000\", cluster: app}]\n";
    EXPECT_EQ(with("127.0.0.1:10001", two),
              "t.yaml:1:69: clusters[0].backends[1].address: 127.0.0.1:10001 is the relay's own "
              "listeners[0].listen: a loop");
    EXPECT_EQ(with("[::1]:10000", two),
              "t.yaml:1:69: clusters[0].backends[1].address: [::1]:10000 is the relay's own "
              "listeners[1].listen: a loop");
    EXPECT_EQ(with("[::ffff:127.0.0.1]:10001", two),
              "t.yaml:1:69: clusters[0].backends[1].address: [::ffff:127.0.0.1]:10001 is the "
              "relay's own listeners[0].listen: a loop");
    // A listener's own upstream, and one listener's upstream that is another's address.
    EXPECT_EQ(errorOfYaml("listeners: [{listen: 127.0.0.1:10000, upstream: 127.0.0.1:10000}]\n"),
              "t.yaml:1:49: listeners[0].upstream: 127.0.0.1:10000 is the relay's own "
              "listeners[0].listen: a loop");
    EXPECT_EQ(errorOfYaml("listeners: [{listen: 127.0.0.1:1, upstream: 127.0.0.1:2},\n"
                          "            {listen: 127.0.0.1:2, upstream: 127.0.0.1:9}]\n"),
              "t.yaml:1:45: listeners[0].upstream: 127.0.0.1:2 is the relay's own "
              "listeners[1].listen: a loop");
    const std::string one = "listeners: [{listen: 127.0.0.1:10001, cluster: app}]\n";
    EXPECT_EQ(with("127.0.0.1:9100", one),
              "t.yaml:1:69: clusters[0].backends[1].address: 127.0.0.1:9100 is the relay's own "
              "metrics.listen: a loop");
    EXPECT_EQ(with("127.0.0.1:9200", one + "metrics: {health_listen: 127.0.0.1:9200}\n"),
              "t.yaml:1:69: clusters[0].backends[1].address: 127.0.0.1:9200 is the relay's own "
              "metrics.health_listen: a loop");
    EXPECT_EQ(with("127.0.0.1:9300", one + "admin: {listen: 127.0.0.1:9300}\n"),
              "t.yaml:1:69: clusters[0].backends[1].address: 127.0.0.1:9300 is the relay's own "
              "admin.listen: a loop");
    EXPECT_EQ(with("unix:/run/zcrelay-admin.sock", one + "admin: {listen: "
                                                         "\"unix:/run/zcrelay-admin.sock\"}\n"),
              "t.yaml:1:69: clusters[0].backends[1].address: unix:/run/zcrelay-admin.sock is "
              "the relay's own admin.listen: a loop");
    // A wildcard listener listens on every local address at its port.
    const std::string wildcard = "listeners: [{listen: 0.0.0.0:10002, cluster: app}]\n";
    EXPECT_EQ(with("127.0.0.9:10002", wildcard),
              "t.yaml:1:69: clusters[0].backends[1].address: 127.0.0.9:10002 is the relay's own "
              "listeners[0].listen: a loop");
    // Not the relay: metrics off, another port, another loopback address, a port 0 listener.
    EXPECT_NO_THROW(loadConfigString(cluster.substr(0, cluster.find("BACKEND")) + "127.0.0.1:9100" +
                                         cluster.substr(cluster.find("BACKEND") + 7) + one +
                                         "metrics: {listen: \"\"}\n",
                                     "t.yaml"));
    EXPECT_EQ(with("127.0.0.1:10003", wildcard), "(no error)");
    EXPECT_EQ(with("127.0.0.2:10001", one), "(no error)");
    EXPECT_EQ(with("127.0.0.1:10001", "listeners: [{listen: 127.0.0.1:0, cluster: app}]\n"),
              "(no error)");
}

TEST(ClusterConfig, RendersBackToAnEqualConfig) {
    for (const char* name : {"clusters.yaml", "health_checks.yaml", "proxy_protocol.yaml",
                             "limits.yaml", "upstream_sockets.yaml", "access_log.yaml"}) {
        const Config c = example(name);
        expectSameConfig(loadConfigString(renderConfig(c), "<rendered>"), c);
    }
}

}  // namespace
}  // namespace zcrelay

// Found by tests/fuzz/config_fuzz.cpp: what renders must load back equal.
namespace zcrelay {
namespace {

TEST(RenderConfig, ZeroCountsRenderAsZeroNotAsUnset) {
    const Config c = loadConfigString(
        "clusters: [{name: a, retries: 0, max_fails: 0, backends: [{address: 127.0.0.1:2}]}]\n"
        "listeners: [{listen: 127.0.0.1:1, cluster: a}]\n",
        "t.yaml");
    ASSERT_EQ(c.clusters.at(0).retries, 0u);
    const Config again = loadConfigString(renderConfig(c), "<rendered>");
    EXPECT_EQ(again.clusters.at(0).retries, 0u) << renderConfig(c);
    EXPECT_EQ(again.clusters.at(0).max_fails, 0u);
    expectSameConfig(again, c);
}

TEST(RenderConfig, HighBytesInStringsRoundTripExactly) {
    const std::string yaml =
        "clusters: [{name: a, health_check: {send: \"PING\\r\xff\xfe\\n\", expect: \"\xc3\xa9\"}, "
        "backends: [{address: 127.0.0.1:2}]}]\n"
        "listeners: [{listen: 127.0.0.1:1, cluster: a}]\n";
    const Config c = loadConfigString(yaml, "t.yaml");
    ASSERT_EQ(c.clusters.at(0).health_check.send, "PING\r\xff\xfe\n");
    expectSameConfig(loadConfigString(renderConfig(c), "<rendered>"), c);
}

}  // namespace
}  // namespace zcrelay

// ---- user and group: resolved at load, so an unknown one is an error with its line -------

#include <grp.h>
#include <pwd.h>

#include <optional>

namespace zcrelay {
namespace {

struct Account {
    uint32_t uid = 0;
    uint32_t gid = 0;
};
std::optional<Account> account(const char* name) {
    const passwd* pw = getpwnam(name);
    if (pw == nullptr) return std::nullopt;
    return Account{static_cast<uint32_t>(pw->pw_uid), static_cast<uint32_t>(pw->pw_gid)};
}

TEST(RunAsConfig, UserByNameTakesItsPrimaryGroup) {
    const auto nobody = account("nobody");
    if (!nobody) GTEST_SKIP() << "this system has no user nobody";
    const Config c = loadConfigString(std::string("user: nobody\n") + kOneListener, "t.yaml");
    EXPECT_EQ(c.user, "nobody");
    EXPECT_EQ(c.group, "");
    EXPECT_EQ(c.uid, nobody->uid);
    EXPECT_EQ(c.gid, nobody->gid);
    expectSameConfig(loadConfigString(renderConfig(c), "<rendered>"), c);
}

TEST(RunAsConfig, NumericIdsNeedNoEntryButAUidWithoutOneNeedsAGroup) {
    const auto nobody = account("nobody");
    if (!nobody) GTEST_SKIP() << "this system has no user nobody";
    const std::string uid = std::to_string(nobody->uid);
    Config c = loadConfigString("user: " + uid + "\n" + kOneListener, "t.yaml");
    EXPECT_EQ(c.uid, nobody->uid);
    EXPECT_EQ(c.gid, nobody->gid) << "a uid with a passwd entry takes its primary group";

    ASSERT_EQ(getpwuid(4242), nullptr) << "the test needs uid 4242 unused";
    c = loadConfigString(std::string("user: 4242\ngroup: 4243\n") + kOneListener, "t.yaml");
    EXPECT_EQ(c.uid, 4242u);
    EXPECT_EQ(c.gid, 4243u);
    expectSameConfig(loadConfigString(renderConfig(c), "<rendered>"), c);
    EXPECT_EQ(errorOfYaml(std::string("user: 4242\n") + kOneListener),
              "t.yaml:1:7: user: uid 4242 has no passwd entry to take a group from: set "
              "`group`");
}

TEST(RunAsConfig, GroupByName) {
    const group* root = getgrgid(0);
    ASSERT_NE(root, nullptr);
    const Config c = loadConfigString(
        std::string("user: root\ngroup: ") + root->gr_name + "\n" + kOneListener, "t.yaml");
    EXPECT_EQ(c.uid, 0u);
    EXPECT_EQ(c.gid, 0u);
}

TEST(RunAsConfig, ErrorsNameTheKeyAndTheValue) {
    EXPECT_EQ(errorOfYaml(std::string("user: no-such-user-zcrelay\n") + kOneListener),
              "t.yaml:1:7: user: \"no-such-user-zcrelay\" is not a user of this system "
              "(/etc/passwd, NSS)");
    EXPECT_EQ(errorOfYaml(std::string("user: root\ngroup: no-such-group-zcrelay\n") + kOneListener),
              "t.yaml:2:8: group: \"no-such-group-zcrelay\" is not a group of this system "
              "(/etc/group, NSS)");
    EXPECT_EQ(errorOfYaml(std::string("group: root\n") + kOneListener),
              "t.yaml:1:8: group: needs `user`: the relay switches user and group together");
    EXPECT_EQ(errorOfYaml(std::string("user: \"a b\"\n") + kOneListener),
              "t.yaml:1:7: user: \"a b\" is not a valid name; use 1 to 64 of [A-Za-z0-9_.-]");
}

TEST(RunAsConfig, DefaultLeavesItUnsetAndTheExampleNamesBoth) {
    const Config c = loadConfigString(defaultConfigYaml(), "<default>");
    EXPECT_EQ(c.user, "");
    EXPECT_EQ(c.group, "");
    EXPECT_NE(defaultConfigYaml().find("\n# user:\n"), std::string_view::npos);
    EXPECT_NE(defaultConfigYaml().find("\n# group:\n"), std::string_view::npos);
    EXPECT_EQ(renderConfig(c).find("\nuser:"), std::string::npos) << "unset is not rendered";
    EXPECT_EQ(renderConfig(c).find("\ngroup:"), std::string::npos) << "unset is not rendered";
}

TEST(ConfigExamples, Unprivileged) {
    const auto nobody = account("nobody");
    if (!nobody) GTEST_SKIP() << "this system has no user nobody";
    const Config c = example("unprivileged.yaml");
    EXPECT_EQ(c.user, "nobody");
    EXPECT_EQ(c.uid, nobody->uid);
    EXPECT_EQ(c.gid, nobody->gid);
    EXPECT_EQ(c.listeners.at(0).listen.port(), 80);
}

// takeover_socket: a path a unix socket address can hold, with room for the temporary name the
// bind renames from; anything else is refused with its line.
TEST(LoadConfig, TakeoverSocketIsAnAbsoluteShortPath) {
    EXPECT_EQ(errorOfYaml(std::string("takeover_socket: run/x.sock\n") + kOneListener),
              "t.yaml:1:18: takeover_socket: must be an absolute path of at most 80 bytes, e.g. "
              "/run/zcrelay/takeover.sock");
    EXPECT_EQ(errorOfYaml("takeover_socket: /" + std::string(90, 'x') + "\n" + kOneListener),
              "t.yaml:1:18: takeover_socket: must be an absolute path of at most 80 bytes, e.g. "
              "/run/zcrelay/takeover.sock");
    const Config c =
        loadConfigString(std::string("takeover_socket: /run/zcrelay/t.sock\n") + kOneListener, "t");
    EXPECT_EQ(c.takeover_socket, "/run/zcrelay/t.sock");
}

}  // namespace
}  // namespace zcrelay
