#include "support/patroni_cluster.hpp"

#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>

#include "support/json.hpp"

namespace zcrelay::test {

namespace {

constexpr const char* kUser = "postgres";
constexpr const char* kScope = "zcrelay";
// Every Patroni, together, to stop its PostgreSQL (fast shutdown) and leave on SIGTERM.
constexpr Millis kPatroniStopTimeout{30'000};
// Patroni binds its REST port first, before it bootstraps anything; the Python start of a
// loaded 2-CPU machine takes a few seconds of that.
constexpr Millis kRestListenTimeout{30'000};
constexpr Millis kEtcdUpTimeout{20'000};
constexpr Millis kEtcdStopTimeout{10'000};
constexpr Millis kRestPoll{200};
// Patroni 3.0 (Debian 12's) knows PostgreSQL up to 15: a newer server is the last resort.
constexpr const char* kPgVersions[] = {"15", "16", "17"};

Millis leftUntil(Clock::time_point deadline) {
    return std::max(Millis{0}, std::chrono::duration_cast<Millis>(deadline - Clock::now()));
}

std::vector<std::string> splitNul(const std::string& s) {
    std::vector<std::string> out;
    for (size_t at = 0, end; at < s.size(); at = end + 1) {
        end = s.find('\0', at);
        if (end == std::string::npos) end = s.size();
        out.push_back(s.substr(at, end - at));
    }
    return out;
}

// The tail of a node's log without Patroni's once-a-loop "no action. I am (nodeN), ..." lines,
// which would otherwise fill it: at loop_wait 1 they are 60 lines a minute of nothing.
std::string logTail(const std::string& path, size_t max_bytes = 6'000) {
    std::istringstream in(fileTail(path, 1 << 16));
    std::string line, kept;
    while (std::getline(in, line))
        if (line.find(": no action. I am (") == std::string::npos) kept += line + "\n";
    return kept.size() > max_bytes ? "[...]" + kept.substr(kept.size() - max_bytes) : kept;
}

std::string describeChild(ChildProcess* child) {
    if (child == nullptr) return "not started";
    std::string pid = "pid " + std::to_string(child->pid());
    if (child->running()) return pid + ", running";
    return pid + ", " + (child->status() ? child->status()->describe() : "gone");
}

// SIGKILL to every process of the postgres user whose command line names `dir`: what a
// SIGKILLed Patroni left behind (a pg_basebackup, pg_rewind or initdb it ran, a postmaster it
// started before writing postmaster.pid). `dir` is mkdtemp's, so they are this cluster's alone.
void killLeftovers(const std::string& dir, uid_t uid) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.empty() ||
            !std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; }))
            continue;
        struct stat st {};
        if (::stat(entry.path().c_str(), &st) != 0 || st.st_uid != uid) continue;
        for (const std::string& arg : splitNul(readFileText(entry.path().string() + "/cmdline")))
            if (arg.find(dir + "/") != std::string::npos) {
                ::kill(static_cast<pid_t>(std::stol(name)), SIGKILL);
                break;
            }
    }
}

}  // namespace

PatroniCluster::PatroniCluster() : tools_(findTools()) {}

PatroniCluster::Tools PatroniCluster::findTools() {
    Tools t;
    const auto lacks = [&](const std::string& what) {
        t.missing += (t.missing.empty() ? "" : ", ") + what;
    };
    for (auto [name, out] :
         {std::pair{"patroni", &t.patroni}, std::pair{"patronictl", &t.patronictl},
          std::pair{"etcd", &t.etcd}, std::pair{"setpriv", &t.setpriv}, std::pair{"env", &t.env}}) {
        if (auto path = findExecutable(name))
            *out = *path;
        else
            lacks(name);
    }
    for (const char* v : kPgVersions) {
        const std::string bin = std::string("/usr/lib/postgresql/") + v + "/bin";
        if (::access((bin + "/initdb").c_str(), X_OK) == 0 &&
            ::access((bin + "/postgres").c_str(), X_OK) == 0) {
            t.pg_bin = bin;
            break;
        }
    }
    if (t.pg_bin.empty()) lacks("PostgreSQL's server binaries (/usr/lib/postgresql/15/bin)");
    if (::getpwnam(kUser) == nullptr) lacks("the postgres user");
    return t;
}

std::string PatroniCluster::missingPrerequisites() { return findTools().missing; }

std::vector<std::string> PatroniCluster::asPostgres(const std::string& cwd,
                                                    const std::vector<std::string>& argv) const {
    // --reset-env: the postgres user's HOME, PATH and no root environment. --pdeathsig: the
    // uid change cleared ChildProcess's PR_SET_PDEATHSIG, and a Patroni must not outlive a
    // crashed test (its postmaster still can: Patroni detaches it, and stop() is not run then).
    std::vector<std::string> out{tools_.env,
                                 "-C",
                                 cwd,
                                 tools_.setpriv,
                                 "--reuid=postgres",
                                 "--regid=postgres",
                                 "--init-groups",
                                 "--reset-env",
                                 "--pdeathsig=SIGKILL",
                                 "--"};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
}

::testing::AssertionResult PatroniCluster::start(const Options& options) {
    if (started_) return ::testing::AssertionFailure() << "PatroniCluster::start() runs once";
    started_ = true;
    options_ = options;
    if (!tools_.missing.empty())
        return ::testing::AssertionFailure()
               << "cannot run a Patroni cluster here, missing: " << tools_.missing;
    if (options.nodes == 0) return ::testing::AssertionFailure() << "a cluster needs a node";
    if (dir_.path().empty()) return ::testing::AssertionFailure() << "no temp dir (mkdtemp)";
    const auto deadline = Clock::now() + options.start_timeout;
    const passwd* pg = ::getpwnam(kUser);
    // mkdtemp made the dir 0700 for root; the postgres user must get through it to its nodes.
    if (::chmod(dir_.path().c_str(), 0755) != 0)
        return ::testing::AssertionFailure()
               << "chmod " << dir_.path() << ": " << std::strerror(errno);
    nodes_.resize(options.nodes);
    procs_.resize(options.nodes);
    for (size_t i = 0; i < options.nodes; ++i) {
        nodes_[i].name = "node" + std::to_string(i);
        procs_[i].dir = dir_.file(nodes_[i].name);
        if (::mkdir(procs_[i].dir.c_str(), 0700) != 0 ||
            ::chown(procs_[i].dir.c_str(), pg->pw_uid, pg->pw_gid) != 0)
            return ::testing::AssertionFailure()
                   << "node dir " << procs_[i].dir << ": " << std::strerror(errno);
    }
    if (auto up = startEtcd(deadline); !up) return up << "\n" << diagnostics();
    // Node 0 bootstraps alone (initdb) and so is the first primary: started together, the
    // nodes would race for the initialize key, and a case could not know who won.
    if (auto up = startNode(0); !up) return up << "\n" << diagnostics();
    int status = 0;
    if (!waitUntil([&] { return (status = restStatus(0, "/primary")) == 200; }, leftUntil(deadline),
                   kRestPoll))
        return ::testing::AssertionFailure()
               << "node0 did not bootstrap into a primary within " << options.start_timeout.count()
               << " ms (its last answer to /primary: " << status << ")\n"
               << diagnostics();
    for (size_t i = 1; i < nodes_.size(); ++i)
        if (auto up = startNode(i); !up) return up << "\n" << diagnostics();
    if (auto settled = waitForPrimary(0, leftUntil(deadline)); !settled)
        return ::testing::AssertionFailure()
               << "the cluster did not settle within " << options.start_timeout.count()
               << " ms of start(): " << settled.message();
    return ::testing::AssertionSuccess();
}

::testing::AssertionResult PatroniCluster::startEtcd(Clock::time_point deadline) {
    const std::string dir = dir_.file("etcd");
    if (::mkdir(dir.c_str(), 0700) != 0)
        return ::testing::AssertionFailure() << "mkdir " << dir << ": " << std::strerror(errno);
    return startOnFreeLoopbackPort(AF_INET, [&](uint16_t port, std::string& why) {
        // etcd listens for peers too, even alone: a second port, learnt the same way, so a
        // taken one fails this try like a taken client port.
        Listening probe = listenLoopback(AF_INET);
        if (!probe.fd) {
            why = probe.error;
            return PortLaunch::Failed;
        }
        const uint16_t peer_port = probe.port;
        probe.fd.reset();
        if (peer_port == port) return PortLaunch::Retry;
        // A failed try's member would come back with its old peer URL.
        std::error_code ec;
        std::filesystem::remove_all(dir + "/data", ec);
        const std::string client = "http://127.0.0.1:" + std::to_string(port);
        const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port);
        ChildProcess::Options o;
        // --unsafe-no-fsync: Patroni gives each etcd request retry_timeout / 3 (1 s at 3 s),
        // and an fsync on a disk the CI's builds keep busy took 1.25 s: the primary then took
        // etcd for gone and demoted itself. A test's etcd dies with its case; it needs no
        // durability. (Not in etcd 3.4's --help, but 3.4.23 has it.)
        o.argv = {tools_.etcd,
                  "--name=etcd",
                  "--data-dir=" + dir + "/data",
                  "--listen-client-urls=" + client,
                  "--advertise-client-urls=" + client,
                  "--listen-peer-urls=" + peer,
                  "--initial-advertise-peer-urls=" + peer,
                  "--initial-cluster=etcd=" + peer,
                  "--initial-cluster-state=new",
                  "--unsafe-no-fsync"};
        o.stdout_path = dir + "/etcd.out";
        o.stderr_path = dir + "/etcd.log";
        etcd_ = std::make_unique<ChildProcess>();
        if (!etcd_->spawn(o, why)) return PortLaunch::Failed;
        std::string last = "no answer";
        const bool answered = waitUntil(
            [&] {
                if (!etcd_->running()) return true;
                auto r = httpRequest("127.0.0.1", port, "GET", "/health", "", "", &last);
                if (r) last = std::to_string(r->status) + " " + r->body;
                return r && r->status == 200 && r->body.find("true") != std::string::npos;
            },
            std::min(kEtcdUpTimeout, leftUntil(deadline)), kRestPoll);
        if (answered && etcd_->running()) {
            etcd_port_ = port;
            return PortLaunch::Up;
        }
        why = "etcd on 127.0.0.1:" + std::to_string(port) + " (peers " + std::to_string(peer_port) +
              ") was not healthy: " + last + "; " + describeChild(etcd_.get()) + "; its log:\n" +
              fileTail(dir + "/etcd.log", 4096);
        etcd_->killAndWait();
        etcd_.reset();
        return PortLaunch::Retry;
    });
}

::testing::AssertionResult PatroniCluster::startNode(size_t node) {
    NodeProcess& proc = procs_[node];
    PatroniNode& n = nodes_[node];
    const passwd* pg = ::getpwnam(kUser);
    return startOnFreeLoopbackPort(AF_INET, [&](uint16_t port, std::string& why) {
        // PostgreSQL binds its port only after initdb or pg_basebackup, seconds later, so it is
        // learnt now like the REST port. A port just closed can come back from the next probe:
        // it must differ from every other port of this cluster's.
        std::set<uint16_t> taken{etcd_port_, port};
        for (size_t i = 0; i < node; ++i) taken.insert({nodes_[i].pg_port, nodes_[i].rest_port});
        n.pg_port = 0;
        for (int tries = 0; tries < 10 && n.pg_port == 0; ++tries) {
            Listening probe = listenLoopback(AF_INET);
            if (!probe.fd) {
                why = probe.error;
                return PortLaunch::Failed;
            }
            if (taken.count(probe.port) == 0) n.pg_port = probe.port;
        }
        if (n.pg_port == 0) {
            why = "no PostgreSQL port apart from the cluster's others in 10 probes";
            return PortLaunch::Retry;
        }
        n.rest_port = port;
        const std::string config = dir_.writeFile(n.name + "/patroni.yml", nodeConfig(node));
        if (::chown(config.c_str(), pg->pw_uid, pg->pw_gid) != 0) {
            why = "chown " + config + ": " + std::strerror(errno);
            return PortLaunch::Failed;
        }
        ChildProcess::Options o;
        o.argv = asPostgres(proc.dir, {tools_.patroni, config});
        o.stdout_path = proc.dir + "/patroni.out";
        o.stderr_path = proc.dir + "/patroni.log";  // Patroni's log, and its PostgreSQL's
        proc.patroni = std::make_unique<ChildProcess>();
        if (!proc.patroni->spawn(o, why)) return PortLaunch::Failed;
        const bool listens =
            waitUntil([&] { return !proc.patroni->running() || listensOnLoopback4(port); },
                      kRestListenTimeout, kRestPoll);
        if (listens && proc.patroni->running()) return PortLaunch::Up;
        const std::string log = fileTail(proc.dir + "/patroni.log", 4096);
        why = n.name + "'s Patroni did not listen on 127.0.0.1:" + std::to_string(port) + " (" +
              describeChild(proc.patroni.get()) + "); its log:\n" + log;
        proc.patroni->killAndWait();
        proc.patroni.reset();
        // Another process took the port in between: a new one. Anything else fails the same
        // on every port.
        return log.find("Address already in use") != std::string::npos ? PortLaunch::Retry
                                                                       : PortLaunch::Failed;
    });
}

std::string PatroniCluster::nodeConfig(size_t node) const {
    const PatroniNode& n = nodes_[node];
    const std::string& dir = procs_[node].dir;
    const std::string rest = "127.0.0.1:" + std::to_string(n.rest_port);
    const std::string pg = "127.0.0.1:" + std::to_string(n.pg_port);
    // Every replica streams, and a new one's pg_basebackup takes two senders more meanwhile.
    const unsigned senders = std::max(5u, options_.nodes + 3);
    std::ostringstream y;
    y << "scope: " << kScope << "\n"
      << "name: " << n.name << "\n"
      << "log:\n"
      << "  level: INFO\n"
      << "restapi:\n"
      << "  listen: " << rest << "\n"
      << "  connect_address: " << rest
      << "\n"
      // etcd3: the v3 API through etcd's gRPC gateway, which etcd 3.4 serves by default; the
      // `etcd` key would need its v2 API (--enable-v2). Patroni speaks it over HTTP itself
      // (python3-etcd only for the errors), no etcd3 module needed.
      << "etcd3:\n"
      << "  hosts: 127.0.0.1:" << etcd_port_ << "\n"
      << "watchdog:\n"
      << "  mode: 'off'\n"
      << "bootstrap:\n"
      << "  dcs:\n"
      << "    ttl: " << options_.ttl << "\n"
      << "    loop_wait: " << options_.loop_wait << "\n"
      << "    retry_timeout: " << options_.retry_timeout << "\n"
      << "    primary_start_timeout: " << options_.primary_start_timeout << "\n"
      << "    maximum_lag_on_failover: 1048576\n"
      << "    synchronous_mode: " << (options_.synchronous ? "true" : "false") << "\n"
      << "    postgresql:\n"
      << "      use_pg_rewind: true\n"
      << "      use_slots: true\n"
      << "      parameters:\n"
      << "        max_connections: 100\n"
      << "        wal_level: replica\n"
      << "        hot_standby: 'on'\n"
      << "        max_wal_senders: " << senders << "\n"
      << "        max_replication_slots: " << senders << "\n"
      << "        wal_keep_size: 64MB\n"
      // A rejoining replica's first try to stream fails while the new primary has not made
      // its slot yet (a Patroni loop later); PostgreSQL's 5 s to the next try was most of the
      // time a switchover or failover took to settle.
      << "        wal_retrieve_retry_interval: 500ms\n"
      // No data checksums (initdb's default): pg_rewind needs wal_log_hints instead, which
      // Patroni turns on itself with use_pg_rewind. locale C: no dependence on the host's.
      << "  initdb:\n"
      << "  - encoding: UTF8\n"
      << "  - locale: C\n"
      << "postgresql:\n"
      << "  listen: " << pg << "\n"
      << "  connect_address: " << pg << "\n"
      << "  data_dir: '" << dir << "/data'\n"
      << "  bin_dir: '" << tools_.pg_bin << "'\n"
      << "  pgpass: '" << dir
      << "/pgpass'\n"
      // pg_basebackup's default, a spread checkpoint, can hold a new replica for minutes.
      << "  basebackup:\n"
      << "  - checkpoint: fast\n"
      << "  authentication:\n"
      << "    superuser:\n"
      << "      username: postgres\n"
      << "      password: postgres\n"
      << "    replication:\n"
      << "      username: replicator\n"
      << "      password: replicator\n"
      << "  parameters:\n"
      // Not /var/run/postgresql, which may be missing or another server's.
      << "    unix_socket_directories: '" << dir << "'\n"
      << "    shared_buffers: 16MB\n"
      // A test's database dies with its case: fsync would only make every checkpoint, and so
      // every bootstrap, switchover and promotion, wait on a disk the CI's builds keep busy.
      // A kill -9 of a postmaster loses nothing written to the page cache either.
      << "    fsync: 'off'\n"
      << "  pg_hba:\n"
      << "  - local all all trust\n"
      << "  - host all all 127.0.0.1/32 trust\n"
      << "  - host replication all 127.0.0.1/32 trust\n";
    return y.str();
}

int PatroniCluster::restStatus(size_t node, const std::string& path) const {
    if (node >= nodes_.size()) return 0;
    auto r = httpRequest("127.0.0.1", nodes_[node].rest_port, "GET", path);
    return r ? r->status : 0;
}

std::optional<size_t> PatroniCluster::primary() const {
    std::optional<size_t> found;
    for (size_t i = 0; i < nodes_.size(); ++i) {
        if (restStatus(i, "/primary") != 200) continue;
        if (found) return std::nullopt;
        found = i;
    }
    return found;
}

std::optional<size_t> PatroniCluster::syncStandby() const {
    for (size_t i = 0; i < nodes_.size(); ++i)
        if (restStatus(i, "/sync") == 200) return i;
    return std::nullopt;
}

std::string PatroniCluster::notSettled(size_t node) const {
    const PatroniNode& p = nodes_[node];
    std::string error;
    auto r = httpRequest("127.0.0.1", p.rest_port, "GET", "/primary", "", "", &error);
    if (!r) return p.name + ": " + error;
    if (r->status != 200) return p.name + " answers " + std::to_string(r->status) + " to /primary";
    auto doc = parseJson(r->body, error);
    if (!doc) return p.name + "'s /primary answer is not JSON (" + error + "): " + r->body;
    // The primary's pg_stat_replication, by application_name, which Patroni sets to the name.
    std::set<std::string> streaming, sync;
    for (const Json& standby : doc->items("replication")) {
        if (standby.str("state") == "streaming") streaming.insert(standby.str("application_name"));
        if (standby.str("sync_state") == "sync") sync.insert(standby.str("application_name"));
    }
    bool has_sync = false;
    for (size_t i = 0; i < nodes_.size(); ++i) {
        if (i == node) continue;
        if (int status = restStatus(i, "/replica"); status != 200)
            return nodes_[i].name + " answers " + std::to_string(status) + " to /replica";
        if (streaming.count(nodes_[i].name) == 0)
            return nodes_[i].name + " does not stream from " + p.name + " (" + r->body + ")";
        // Synchronous in PostgreSQL and in etcd's /sync key both: Patroni writes the key after
        // PostgreSQL reports the standby synchronous, and a switchover goes only to the
        // standby the key names (else 412 "candidate name does not match with sync_standby").
        if (options_.synchronous && !has_sync && sync.count(nodes_[i].name) != 0)
            has_sync = restStatus(i, "/sync") == 200;
    }
    if (options_.synchronous && nodes_.size() > 1 && !has_sync)
        return p.name + " has no synchronous standby yet (" + r->body + ")";
    return "";
}

::testing::AssertionResult PatroniCluster::waitForPrimary(size_t node, Millis timeout) const {
    if (node >= nodes_.size())
        return ::testing::AssertionFailure() << "no node " << node << " in the cluster";
    std::string why;
    if (waitUntil([&] { return (why = notSettled(node)).empty(); }, timeout, kRestPoll))
        return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << nodes_[node].name << " was not the primary of streaming replicas within "
           << timeout.count() << " ms: " << why << "\n"
           << diagnostics();
}

::testing::AssertionResult PatroniCluster::switchover(size_t from, size_t to, Millis timeout) {
    if (from >= nodes_.size() || to >= nodes_.size() || from == to)
        return ::testing::AssertionFailure() << "no switchover from node " << from << " to node "
                                             << to << " in a cluster of " << nodes_.size();
    const auto deadline = Clock::now() + timeout;
    CommandResult r = runCommand(
        asPostgres(procs_[from].dir,
                   {tools_.patronictl, "-c", procs_[from].dir + "/patroni.yml", "switchover",
                    "--leader", nodes_[from].name, "--candidate", nodes_[to].name, "--force"}),
        timeout);
    // A refusal ("Switchover failed, details: 412, ...") still exits 0.
    if (!r.status.cleanExit() || r.out.find(" failed, details: ") != std::string::npos)
        return ::testing::AssertionFailure()
               << "patronictl switchover " << nodes_[from].name << " -> " << nodes_[to].name << ": "
               << r.describe() << "\n"
               << diagnostics();
    return waitForPrimary(to, leftUntil(deadline));
}

pid_t PatroniCluster::postmasterPid(size_t node) const {
    if (node >= nodes_.size()) return -1;
    const std::string text = readFileText(dataDir(node) + "/postmaster.pid", 64);
    const long pid = std::strtol(text.c_str(), nullptr, 10);
    return pid > 0 ? static_cast<pid_t>(pid) : -1;
}

std::optional<pid_t> PatroniCluster::runningPostmaster(size_t node) const {
    const pid_t pid = postmasterPid(node);
    if (pid <= 0) return std::nullopt;
    // postmaster.pid outlives a SIGKILLed postmaster, and its PID can be reused: it counts
    // while /proc shows Patroni's command line for it, `.../postgres -D DATA ...` (a zombie's
    // is empty). A postmaster keeps its own; only its children retitle themselves.
    const auto args = splitNul(readFileText("/proc/" + std::to_string(pid) + "/cmdline"));
    if (args.size() < 3 || args[0] != tools_.pg_bin + "/postgres") return std::nullopt;
    for (size_t i = 1; i + 1 < args.size(); ++i)
        if (args[i] == "-D" && args[i + 1] == dataDir(node)) return pid;
    return std::nullopt;
}

bool PatroniCluster::killPostmaster(size_t node) {
    if (node >= nodes_.size()) return false;
    const auto pid = runningPostmaster(node);
    if (!pid || ::kill(*pid, SIGKILL) != 0) return false;
    // Gone once /proc no longer shows it running PostgreSQL here: dead (init, its parent since
    // Patroni detached it, reaps it), or Patroni has already started the next one.
    return waitUntil([&] { return runningPostmaster(node) != pid; }, Millis{5'000});
}

CommandResult PatroniCluster::psql(uint16_t port, const std::string& sql, Millis timeout) const {
    if (!tools_.missing.empty()) {
        CommandResult r;
        r.spawn_error = "missing: " + tools_.missing;
        r.status.exited = true;
        r.status.code = 127;
        return r;
    }
    return runCommand(asPostgres(dir_.path(), {tools_.pg_bin + "/psql", "-X", "-h", "127.0.0.1",
                                               "-p", std::to_string(port), "-U", kUser, "-d",
                                               "dbname=postgres connect_timeout=5", "-Atc", sql}),
                      timeout);
}

std::string PatroniCluster::diagnostics() const {
    std::ostringstream os;
    os << "--- Patroni cluster in " << dir_.path() << " (ZCRELAY_KEEP_TEST_DIRS=1 keeps it)\n"
       << "--- etcd on 127.0.0.1:" << etcd_port_ << ", " << describeChild(etcd_.get())
       << "; its log:\n"
       << fileTail(dir_.file("etcd/etcd.log"), 3000) << "\n";
    for (size_t i = 0; i < nodes_.size(); ++i) {
        const PatroniNode& n = nodes_[i];
        os << "--- " << n.name << ": PostgreSQL on 127.0.0.1:" << n.pg_port
           << ", REST on 127.0.0.1:" << n.rest_port << ", Patroni "
           << describeChild(procs_[i].patroni.get()) << ", postmaster.pid " << postmasterPid(i)
           << "\n";
        if (n.rest_port != 0) {
            std::string error;
            auto r = httpRequest("127.0.0.1", n.rest_port, "GET", "/patroni", "", "", &error);
            os << "GET /patroni: "
               << (r ? std::to_string(r->status) + " " + r->body.substr(0, 1000) : error) << "\n";
        }
        os << "its log:\n" << logTail(procs_[i].dir + "/patroni.log") << "\n";
    }
    return os.str();
}

void PatroniCluster::stop() {
    for (auto& proc : procs_)
        if (proc.patroni && proc.patroni->running()) proc.patroni->sendSignal(SIGTERM);
    const auto deadline = Clock::now() + kPatroniStopTimeout;
    for (auto& proc : procs_)
        if (proc.patroni && !proc.patroni->waitExit(leftUntil(deadline)))
            proc.patroni->killAndWait();
    for (size_t i = 0; i < procs_.size(); ++i) killPostmaster(i);
    if (const passwd* pg = ::getpwnam(kUser);
        pg != nullptr && !procs_.empty() && !dir_.path().empty())
        killLeftovers(dir_.path(), pg->pw_uid);
    if (etcd_ && etcd_->running()) {
        etcd_->sendSignal(SIGTERM);
        if (!etcd_->waitExit(kEtcdStopTimeout)) etcd_->killAndWait();
    }
}

}  // namespace zcrelay::test
