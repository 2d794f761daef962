// zcrelay started as root with `user: nobody`: it binds and loads what needs root, then runs as
// nobody with only CAP_NET_BIND_SERVICE. The oracles are /proc/PID/task/*/status (every thread,
// not just the main one: capabilities are per thread) and the relay's own metrics; the bytes
// are checked end to end on real loopback sockets.
//
// Everything here needs root (to start the relay as root, and to lower the pipe sysctls), and
// skips with that reason otherwise.
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/labels.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::privileges_test {
namespace {

// CAP_NET_BIND_SERVICE is capability 10: the one bit left in CapEff, CapPrm and CapBnd.
constexpr const char* kOnlyNetBindService = "0000000000000400";

struct Account {
    uid_t uid = 0;
    gid_t gid = 0;
};

std::optional<Account> nobody() {
    const passwd* pw = getpwnam("nobody");
    if (pw == nullptr) return std::nullopt;
    return Account{pw->pw_uid, pw->pw_gid};
}

// The "Key:\tvalue" lines of a /proc status file.
std::map<std::string, std::string> statusFields(const std::string& path) {
    std::map<std::string, std::string> fields;
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
        size_t colon = line.find(':');
        if (colon == std::string::npos) continue;
        size_t value = line.find_first_not_of(" \t", colon + 1);
        size_t end = line.find_last_not_of(" \t");  // "Groups:" ends with a space
        fields[line.substr(0, colon)] =
            value == std::string::npos ? "" : line.substr(value, end + 1 - value);
    }
    return fields;
}

std::vector<std::string> taskIds(pid_t pid) {
    std::vector<std::string> tids;
    const std::string dir = "/proc/" + std::to_string(pid) + "/task";
    if (DIR* d = opendir(dir.c_str())) {
        while (dirent* e = readdir(d))
            if (e->d_name[0] != '.') tids.push_back(e->d_name);
        closedir(d);
    }
    return tids;
}

// Every thread of `pid` runs as `who` (real, effective, saved and filesystem ids), holds only
// CAP_NET_BIND_SERVICE, effective and permitted, has a bounding set of just that, no
// inheritable or ambient capability, and no_new_privs.
::testing::AssertionResult everyThreadRunsAs(pid_t pid, const Account& who, size_t min_threads) {
    const std::vector<std::string> tids = taskIds(pid);
    if (tids.size() < min_threads)
        return ::testing::AssertionFailure() << tids.size() << " threads in /proc/" << pid
                                             << "/task, expected >= " << min_threads;
    const std::string uid = std::to_string(who.uid), gid = std::to_string(who.gid);
    const std::string ids_uid = uid + "\t" + uid + "\t" + uid + "\t" + uid;
    const std::string ids_gid = gid + "\t" + gid + "\t" + gid + "\t" + gid;
    for (const std::string& tid : tids) {
        auto f = statusFields("/proc/" + std::to_string(pid) + "/task/" + tid + "/status");
        const std::string name = "thread " + tid + " (" + f["Name"] + ")";
        auto expect = [&](const char* key, const std::string& want) -> ::testing::AssertionResult {
            if (f[key] == want) return ::testing::AssertionSuccess();
            return ::testing::AssertionFailure()
                   << name << ": " << key << " is \"" << f[key] << "\", want \"" << want << "\"";
        };
        for (auto r : {expect("Uid", ids_uid), expect("Gid", ids_gid), expect("Groups", gid),
                       expect("CapEff", kOnlyNetBindService), expect("CapPrm", kOnlyNetBindService),
                       expect("CapBnd", kOnlyNetBindService), expect("CapInh", "0000000000000000"),
                       expect("CapAmb", "0000000000000000"), expect("NoNewPrivs", "1")}) {
            if (!r) return r;
        }
    }
    return ::testing::AssertionSuccess() << tids.size() << " threads";
}

// A port in [first, last] on 127.0.0.1 that nothing listens on or is bound to right now.
std::optional<uint16_t> freeLowPort(uint16_t first, uint16_t last) {
    for (uint16_t port = first; port <= last; ++port) {
        Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(port);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return port;
    }
    return std::nullopt;
}

// Lowers a /proc/sys value for the length of a scope. The old value comes back in the
// destructor; a restore that does not take is a test failure (the sysctl is system-wide).
class SysctlOverride {
  public:
    SysctlOverride(std::string path, const std::string& value) : path_(std::move(path)) {
        old_ = read();
        if (old_.empty()) {
            error_ = "cannot read " + path_;
            return;
        }
        if (!write(value)) {
            error_ = "cannot write " + value + " to " + path_ + ": " + std::strerror(errno);
            return;
        }
        set_ = true;
    }
    ~SysctlOverride() { restore(); }
    SysctlOverride(const SysctlOverride&) = delete;
    SysctlOverride& operator=(const SysctlOverride&) = delete;

    bool ok() const { return set_; }
    const std::string& error() const { return error_; }
    void restore() {
        if (!set_) return;
        set_ = false;
        if (!write(old_) || read() != old_)
            ADD_FAILURE() << "could not restore " << path_ << " to " << old_ << " (now \"" << read()
                          << "\"): restore it by hand";
    }

  private:
    std::string read() const {
        std::ifstream in(path_);
        std::string v;
        in >> v;
        return v;
    }
    bool write(const std::string& v) const {
        std::ofstream out(path_);
        out << v << "\n";
        out.flush();
        return static_cast<bool>(out);
    }

    std::string path_;
    std::string old_;
    std::string error_;
    bool set_ = false;
};

// A relay started as root, `user: nobody`, relaying to an echo upstream.
class Unprivileged : public ::testing::Test {
  protected:
    void SetUp() override {
        if (geteuid() != 0) GTEST_SKIP() << "needs root: the relay must start as root to drop it";
        auto who = nobody();
        if (!who) GTEST_SKIP() << "this system has no user nobody";
        nobody_ = *who;
        ASSERT_TRUE(up_.ok()) << up_.error();
        // mkdtemp made the dir 0700: nobody must be able to re-read the config on SIGHUP.
        ASSERT_EQ(::chmod(relay_.dir().c_str(), 0755), 0) << std::strerror(errno);
    }

    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void startRelay(const std::string& mode, const std::string& extra_yaml = "") {
        RelayConfig config = singleListenerConfig(up_.hostPort(), mode);
        config.extra_yaml = "user: nobody\n" + extra_yaml;
        ASSERT_TRUE(relay_.start(config));
        ASSERT_NE(relay_.stderrText().find("running as user nobody"), std::string::npos)
            << relay_.diagnostics();
    }

    static void expectEcho(const std::string& host, uint16_t port, uint64_t seed, uint64_t bytes) {
        Connected c = connectTo(host, port);
        ASSERT_TRUE(c.fd) << c.error;
        IoResult sent;
        ReceiveCheck got = echoRoundTrip(c.fd.get(), seed, bytes, kDefaultIoTimeout, &sent);
        EXPECT_TRUE(sent.ok()) << sent.describe();
        EXPECT_EQ(got.bytes, bytes) << got.describe();
        EXPECT_LT(got.first_mismatch, 0) << got.describe();
    }

    Account nobody_;
    ScriptedUpstream up_{AF_INET, echoScript()};
    RelayProcess relay_;
};

class UnprivilegedPath : public Unprivileged, public ::testing::WithParamInterface<const char*> {};

// 1 MiB each way through every data path as nobody; every thread of the relay (main, workers,
// the metrics endpoint's, the access log writer when there is one) has nobody's ids and only
// CAP_NET_BIND_SERVICE, and the bytes went the way the mode says, not by a fallback.
TEST_P(UnprivilegedPath, RelaysByteExactAndEveryThreadIsDropped) {
    const std::string mode = GetParam();
    ASSERT_NO_FATAL_FAILURE(startRelay(mode));
    // main + 2 workers + the metrics endpoint's thread
    EXPECT_TRUE(everyThreadRunsAs(relay_.pid(), nobody_, 4));

    ASSERT_NO_FATAL_FAILURE(expectEcho(relay_.host(), relay_.port(), 11, kMiB));
    for (const char* direction : {"upstream", "downstream"}) {
        EXPECT_TRUE(relay_.waitForMetric(
            metric::kBytesTotal, {{"listener", "t"}, {"direction", direction}, {"path", mode}},
            static_cast<double>(kMiB)))
            << direction << " bytes must have gone by " << mode;
    }
    EXPECT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath(mode)).value_or(-1), 1)
        << "the listener runs " << mode << ", not a fallback";
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1));
    for (std::string_view why : metric::kPipeFallbackReasons)
        EXPECT_EQ(relay_.metric(metric::kPipeFallbacksTotal, {{"reason", std::string(why)}})
                      .value_or(-1),
                  0)
            << why;
    if (mode == "sockmap") {
        EXPECT_EQ(
            relay_.metric("zcrelay_sockmap_connections_total", metric::listener()).value_or(-1), 1);
        for (std::string_view why : metric::kSockmapFallbackReasons)
            EXPECT_EQ(relay_.metric(metric::kSockmapFallbacksTotal, metric::reason(std::string(why)))
                          .value_or(-1),
                      0)
                << why;
    }
    // Threads started while relaying (none are expected) would have inherited the same sets.
    EXPECT_TRUE(everyThreadRunsAs(relay_.pid(), nobody_, 4));
    EXPECT_TRUE(relay_.terminate().cleanExit()) << relay_.diagnostics();
}
ZCRELAY_LABEL(UnprivilegedPath, RelaysByteExactAndEveryThreadIsDropped, "", kHostPipePages,
              "runs as nobody, whose pipe pages (fs.pipe-user-pages-*) are host-wide");

INSTANTIATE_TEST_SUITE_P(Modes, UnprivilegedPath, ::testing::Values("splice", "copy", "sockmap"),
                         [](const auto& info) { return std::string(info.param); });

// CAP_NET_BIND_SERVICE is what is kept, for this: a reload that adds a listener below 1024.
TEST_F(Unprivileged, ReloadBindsAPortBelow1024AndRelays) {
    ASSERT_NO_FATAL_FAILURE(startRelay("splice"));
    auto low = freeLowPort(900, 1000);
    if (!low) GTEST_SKIP() << "no free port in 900..1000 on 127.0.0.1";

    RelayConfig config = singleListenerConfig(up_.hostPort(), "splice");
    config.extra_yaml = "user: nobody\n";
    ListenerSpec l;
    l.name = "low";
    l.listen = "127.0.0.1:" + std::to_string(*low);
    l.upstream = up_.hostPort();
    config.listeners.push_back(l);
    ASSERT_TRUE(relay_.reload(config.yaml())) << relay_.diagnostics();
    ASSERT_NE(relay_.listener("low"), nullptr);
    EXPECT_EQ(relay_.port("low"), *low);

    ASSERT_NO_FATAL_FAILURE(expectEcho("127.0.0.1", *low, 21, kMiB));
    ASSERT_NO_FATAL_FAILURE(expectEcho(relay_.host("t"), relay_.port("t"), 22, kMiB));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("downstream", "low"),
                                     static_cast<double>(kMiB)));
    EXPECT_TRUE(everyThreadRunsAs(relay_.pid(), nobody_, 4));
    EXPECT_TRUE(relay_.terminate().cleanExit()) << relay_.diagnostics();
}
ZCRELAY_LABEL(Unprivileged, ReloadBindsAPortBelow1024AndRelays, "", kHostPipePages,
              "runs as nobody, whose pipe pages (fs.pipe-user-pages-*) are host-wide");

// The access log is opened as the user, at start and on SIGHUP (logrotate). A reopen the user
// may not do is one clear error line; the relay keeps the old file and keeps relaying.
TEST_F(Unprivileged, AccessLogReopenRefusedKeepsTheOldFileAndRelays) {
    // A directory nobody may not write into, holding a log file nobody owns: the situation
    // after a `logrotate` whose `create` is missing, or made the file as root.
    const std::string log = relay_.dir() + "/access.log";
    { std::ofstream touch(log); }
    ASSERT_EQ(::chown(log.c_str(), nobody_.uid, nobody_.gid), 0) << std::strerror(errno);
    ASSERT_NO_FATAL_FAILURE(startRelay("splice", "access_log: {path: \"" + log + "\"}\n"));
    EXPECT_TRUE(everyThreadRunsAs(relay_.pid(), nobody_, 5)) << "with the access log writer";

    ASSERT_EQ(::rename(log.c_str(), (log + ".1").c_str()), 0) << std::strerror(errno);
    RelayConfig same = singleListenerConfig(up_.hostPort(), "splice");
    same.extra_yaml = "user: nobody\naccess_log: {path: \"" + log + "\"}\n";
    ASSERT_TRUE(relay_.reload(same.yaml())) << relay_.diagnostics();
    ASSERT_TRUE(
        relay_.waitForLog("access log: reopen " + log + ": Permission denied", kMetricTimeout))
        << relay_.diagnostics();
    ASSERT_NO_FATAL_FAILURE(expectEcho(relay_.host(), relay_.port(), 31, 64 * 1024));
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), 1));
    EXPECT_TRUE(relay_.terminate().cleanExit()) << relay_.diagnostics();
    EXPECT_NE(readFileText(log + ".1").find("\"termination\":\"done\""), std::string::npos)
        << "the line went to the file still open";
    EXPECT_NE(::access(log.c_str(), F_OK), 0) << "nobody could not have created a new file";
}
ZCRELAY_LABEL(Unprivileged, AccessLogReopenRefusedKeepsTheOldFileAndRelays, "", kHostPipePages,
              "runs as nobody, whose pipe pages (fs.pipe-user-pages-*) are host-wide");

// Start-up refusals: each names what is wrong and exits 1 before relaying anything.
TEST_F(Unprivileged, RefusalsAtStartNameTheCause) {
    TempDir dir;
    ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0) << std::strerror(errno);
    auto run = [&](const std::string& name, const std::string& top,
                   std::vector<std::string> prefix = {}) {
        RelayConfig config = singleListenerConfig(up_.hostPort(), "splice");
        config.extra_yaml = top;
        const std::string path = dir.writeFile(name, config.yaml());
        prefix.push_back(kRelayBinary);
        prefix.push_back("-c");
        prefix.push_back(path);
        return runCommand(prefix, Millis{15'000});
    };

    // An unknown user is a config error, with its file, line and column.
    CommandResult r = run("unknown.yaml", "user: no-such-user-zcrelay\n");
    EXPECT_TRUE(r.status.exited && r.status.code == 1) << r.describe();
    EXPECT_NE(r.err.find("unknown.yaml:5:7: user: \"no-such-user-zcrelay\" is not a user of this "
                         "system"),
              std::string::npos)
        << r.describe();

    // The access log is opened as the user: a file only root may write is refused at start.
    r = run("log.yaml", "user: nobody\naccess_log: {path: \"" + dir.path() + "/root.log\"}\n");
    EXPECT_TRUE(r.status.exited && r.status.code == 1) << r.describe();
    EXPECT_NE(r.err.find("open access log: Permission denied (opened as user nobody)"),
              std::string::npos)
        << r.describe();

    // Not root, asked to become someone else: refused, not half done.
    auto setpriv = findExecutable("setpriv");
    if (!setpriv) GTEST_SKIP() << "setpriv (util-linux) is not installed";
    r = run("notroot.yaml", "user: root\n",
            {*setpriv, "--reuid=" + std::to_string(nobody_.uid),
             "--regid=" + std::to_string(nobody_.gid), "--clear-groups", "--"});
    EXPECT_TRUE(r.status.exited && r.status.code == 1) << r.describe();
    EXPECT_NE(r.err.find("that needs root"), std::string::npos) << r.describe();

    // Root that may not cut its bounding set (no CAP_SETPCAP, as in a container that dropped
    // it): the first step is refused, and the relay exits instead of running half-dropped.
    r = run("nosetpcap.yaml", "user: nobody\n", {*setpriv, "--bounding-set=-setpcap", "--"});
    EXPECT_TRUE(r.status.exited && r.status.code == 1) << r.describe();
    const std::string ids =
        "(uid " + std::to_string(nobody_.uid) + ", gid " + std::to_string(nobody_.gid) + ")";
    EXPECT_NE(r.err.find("user: switching to user nobody " + ids +
                         ": PR_CAPBSET_DROP 0: Operation not permitted"),
              std::string::npos)
        << r.describe();
}
ZCRELAY_LABEL(Unprivileged, RefusalsAtStartNameTheCause, "", kHostPipePages,
              "runs as nobody, whose pipe pages (fs.pipe-user-pages-*) are host-wide");

// Without CAP_SYS_RESOURCE the relay's pipes count against nobody's pipe-user-pages. Past the
// soft limit the kernel hands out 2-page pipes that cannot be resized (EPERM); past the hard
// limit pipe2() fails with ENFILE. Either way each direction that cannot get a real pipe moves
// its bytes by copy, counted as pipe_limit, and no byte is lost.
struct PipePagesCase {
    const char* name;
    const char* soft;  // /proc/sys/fs/pipe-user-pages-soft, in pages; "" = leave it
    const char* hard;  // /proc/sys/fs/pipe-user-pages-hard; "" = leave it
};

class UnprivilegedPipePages : public Unprivileged,
                              public ::testing::WithParamInterface<PipePagesCase> {};

TEST_P(UnprivilegedPipePages, DirectionsWithoutAPipeFallBackToCopyByteExact) {
    constexpr int kClients = 16;
    constexpr uint64_t kBytes = 4 * kMiB;
    ASSERT_NO_FATAL_FAILURE(startRelay("splice"));
    {
        // A few 64 KiB pipes (16 pages each) fit in 64 pages; most of the 32 busy directions
        // must copy. The window stays short: the limits are system-wide, for every user
        // without CAP_SYS_RESOURCE.
        std::optional<SysctlOverride> soft, hard;
        if (*GetParam().soft != '\0') {
            soft.emplace("/proc/sys/fs/pipe-user-pages-soft", GetParam().soft);
            ASSERT_TRUE(soft->ok()) << soft->error();
        }
        if (*GetParam().hard != '\0') {
            hard.emplace("/proc/sys/fs/pipe-user-pages-hard", GetParam().hard);
            ASSERT_TRUE(hard->ok()) << hard->error();
        }
        std::vector<std::thread> clients;
        std::vector<ReceiveCheck> results(kClients);
        std::vector<IoResult> sends(kClients);
        std::vector<std::string> errors(kClients);
        for (int i = 0; i < kClients; ++i) {
            clients.emplace_back([&, i] {
                Connected c = connectTo(relay_.host(), relay_.port());
                if (!c.fd) {
                    errors[i] = c.error;
                    return;
                }
                results[i] = echoRoundTrip(c.fd.get(), 4000 + i, kBytes, Millis{60'000}, &sends[i]);
            });
        }
        for (auto& t : clients) t.join();
        for (int i = 0; i < kClients; ++i) {
            EXPECT_EQ(errors[i], "") << "client " << i;
            EXPECT_TRUE(sends[i].ok()) << "client " << i << ": " << sends[i].describe();
            EXPECT_EQ(results[i].bytes, kBytes) << "client " << i << ": " << results[i].describe();
            EXPECT_LT(results[i].first_mismatch, 0)
                << "client " << i << ": " << results[i].describe();
        }
    }
    const double total = static_cast<double>(kClients * kBytes);
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"), total));
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("downstream"), total));
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), kClients));
    auto limited = relay_.metric(metric::kPipeFallbacksTotal, {{"reason", "pipe_limit"}});
    EXPECT_GT(limited.value_or(0), 0) << relay_.diagnostics();
    EXPECT_EQ(relay_.metric(metric::kPipeFallbacksTotal, {{"reason", "emfile"}}).value_or(-1), 0)
        << "the user's pipe pages are not the fd table";
    auto copied = relay_.metric(metric::kBytesTotal, {{"listener", "t"}, {"path", "copy"}});
    EXPECT_GT(copied.value_or(0), 0) << "fallen-back directions move their bytes by copy";
    auto spliced = relay_.metric(metric::kBytesTotal, {{"listener", "t"}, {"path", "splice"}});
    EXPECT_GT(spliced.value_or(0), 0) << "the pipes that fit still splice";
    // One pipe at a time is not worth a log line: no warning per pipe, none at all.
    EXPECT_EQ(relay_.stderrText().find("pipe2"), std::string::npos) << relay_.stderrText();
    EXPECT_TRUE(relay_.waitForMetric(metric::kPipesInUse, {}, 0));
    std::printf("[ METRIC   ] %s: pipe_limit fallbacks %.0f, copy %.1f MiB, splice %.1f MiB\n",
                GetParam().name, limited.value_or(0), copied.value_or(0) / kMiB,
                spliced.value_or(0) / kMiB);
    EXPECT_TRUE(relay_.terminate().cleanExit()) << relay_.diagnostics();
}
ZCRELAY_LABEL(UnprivilegedPipePages, DirectionsWithoutAPipeFallBackToCopyByteExact, "",
              kHostPipePages,
              "lowers fs.pipe-user-pages-*: host-wide, for every process of nobody");

INSTANTIATE_TEST_SUITE_P(Limits, UnprivilegedPipePages,
                         ::testing::Values(PipePagesCase{"soft", "64", ""},
                                           PipePagesCase{"hard", "", "64"}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace zcrelay::test::privileges_test
