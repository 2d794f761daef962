// zcrelay in front of a real Patroni cluster (two PostgreSQL 15 nodes, one etcd, all from
// Debian, on loopback), configured as Patroni's docs configure HAProxy: a read-write listener
// whose backends are checked with `OPTIONS /primary` on each node's REST API and closed at once
// when it says no more (on_marked_down: shutdown_sessions), a read-only one checking /replica.
// HAProxy runs beside it with Patroni's reference config on the same cluster, in the same run,
// with the same check timing, and gets the same clients.
//
// Through each read-write listener a probe session asks `SELECT pg_is_in_recovery()` every
// 100 ms (reconnecting when cut) and a writer session inserts a row every 50 ms (reconnecting
// too), noting the rows whose commit it saw. Then a planned `patronictl switchover` (Patroni's
// synchronous mode on: no acknowledged commit may be lost) and a `kill -9` of the new
// primary's postmaster. For each: the longest a probe kept answering `true` (connected to a
// node that is no longer primary), which must stay within fall x interval + timeout (and some
// room for a loaded machine); the time from the change to the first write through the relay;
// the acknowledged rows missing afterwards.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/haproxy.hpp"
#include "support/labels.hpp"
#include "support/loopback.hpp"
#include "support/patroni_cluster.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::patroni_test {
namespace {

// The relay's (and HAProxy's) check timing: a demoted primary is down within fall x interval
// after its REST API says so, plus one check's time (timeout).
constexpr int kIntervalMs = 500;
constexpr int kFall = 2;
constexpr int kTimeoutMs = 1000;
constexpr double kBoundSeconds = (kFall * kIntervalMs + kTimeoutMs) / 1000.0;
// What a loaded 2-core machine may add to the bound: the probe's own 100 ms, a reconnect, the
// relay's worker wake-up.
constexpr double kSlackSeconds = 1.0;

// How long a client waits for a session to open or a statement to answer before it gives up
// and opens another. Long enough that a relay which holds a new connection until a server is
// up (HAProxy queues it, up to `timeout connect`) is timed by when it serves it, not by this:
// with 3 s here, HAProxy's outages read 3.1-3.2 s every time. A session the relay or the
// server cuts ends at once (EOF), whatever this is.
constexpr Millis kPatience{10'000};

// One psql session fed statement by statement: stdin is a FIFO this side holds open, stdout a
// pipe read line by line (stdbuf -oL: psql's stdout is a pipe, fully buffered otherwise).
class PsqlSession {
  public:
    PsqlSession(std::string dir, uint16_t port) : dir_(std::move(dir)), port_(port) {}
    ~PsqlSession() { close(); }

    // A new session: psql started and connected (a `SELECT 1` answered). False if not.
    bool open(Millis timeout) {
        close();
        const std::string fifo = dir_ + "/stdin." + std::to_string(++opened_);
        ::unlink(fifo.c_str());
        if (::mkfifo(fifo.c_str(), 0600) != 0) return false;
        // O_RDWR: the open does not wait for psql to open its end.
        in_ = Fd(::open(fifo.c_str(), O_RDWR | O_CLOEXEC));
        int p[2];
        if (!in_ || ::pipe2(p, O_CLOEXEC) != 0) return false;
        out_ = Fd(p[0]);
        Fd write_end(p[1]);
        static const std::string stdbuf = findExecutable("stdbuf").value_or("/usr/bin/stdbuf");
        static const std::string psql = findExecutable("psql").value_or("/usr/bin/psql");
        ChildProcess::Options o;
        // ON_ERROR_STOP: an error (an INSERT on a node that turned read-only) ends psql, as a
        // client drops a connection that failed it, instead of printing nothing on stdout while
        // we wait for a line.
        o.argv = {stdbuf,
                  "-oL",
                  psql,
                  "-X",
                  "-A",
                  "-t",
                  "-q",
                  "-v",
                  "ON_ERROR_STOP=1",
                  "-h",
                  "127.0.0.1",
                  "-p",
                  std::to_string(port_),
                  "-U",
                  "postgres",
                  "-d",
                  "postgres"};
        o.stdin_path = fifo;
        o.stdout_fd = write_end.get();
        o.stderr_path = dir_ + "/psql.err";
        child_ = std::make_unique<ChildProcess>();
        std::string error;
        if (!child_->spawn(o, error)) return false;
        // psql's alone now: its exit (a connect that failed) is our EOF at once. Held here,
        // a failed connect waited out the whole timeout, and the outages measured the test's
        // 3 s, not the relays.
        write_end.reset();
        return ask("SELECT 1;", timeout) == "1";
    }

    // The one-line answer to `sql`, or nullopt when the session ended (the relay or the server
    // cut it) or did not answer within `timeout`; then open() starts another.
    std::optional<std::string> ask(const std::string& sql, Millis timeout) {
        if (!child_) return std::nullopt;
        const std::string line = sql + "\n";
        // A FIFO and a pipe, not sockets: plain write() and read() (the loopback helpers
        // send and recv). The FIFO's buffer takes a statement whole.
        if (::write(in_.get(), line.data(), line.size()) != static_cast<ssize_t>(line.size()))
            return fail();
        const auto until = Clock::now() + timeout;
        for (;;) {
            const size_t eol = buffered_.find('\n');
            if (eol != std::string::npos) {
                std::string answer = buffered_.substr(0, eol);
                buffered_.erase(0, eol + 1);
                return answer;
            }
            const auto left = std::chrono::duration_cast<Millis>(until - Clock::now());
            if (left.count() <= 0) return fail();
            pollfd p{out_.get(), POLLIN, 0};
            if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return fail();
            char buf[512];
            const ssize_t n = ::read(out_.get(), buf, sizeof buf);
            if (n <= 0) return fail();  // psql exited: the session was cut
            buffered_.append(buf, static_cast<size_t>(n));
        }
    }

    void close() {
        in_.reset();  // psql reads EOF and exits
        if (child_ && !child_->waitExit(Millis{2'000})) child_->killAndWait();
        child_.reset();
        out_.reset();
        buffered_.clear();
    }

  private:
    std::optional<std::string> fail() {
        close();
        return std::nullopt;
    }

    std::string dir_;
    uint16_t port_;
    int opened_ = 0;
    Fd in_, out_;
    std::unique_ptr<ChildProcess> child_;
    std::string buffered_;
};

// What a probe saw: each answer's time (s since the probe started) and whether it was `t`.
struct Probe {
    std::mutex mu;
    std::vector<std::pair<double, bool>> answers;
    // The longest run of `t` answers, from the first to the one after the last (a session cut
    // in between is part of the run: the client did not reach a primary meanwhile).
    double longestInRecovery(double from) {
        std::lock_guard lock(mu);
        double longest = 0, start = -1;
        for (auto [t, in_recovery] : answers) {
            if (t < from) continue;
            if (in_recovery && start < 0) start = t;
            if (!in_recovery && start >= 0) {
                longest = std::max(longest, t - start);
                start = -1;
            }
        }
        if (start >= 0) longest = std::max(longest, answers.back().first - start);
        return longest;
    }
};

// What a writer saw: the ids whose INSERT came back committed, and when.
struct Writes {
    std::mutex mu;
    std::vector<std::pair<double, long>> acked;
    // The longest time without an acknowledged write, between `from` and `to`: how long
    // clients could not write across a change (from its start, or from the last write before
    // it, to the first one after it, on whichever node). -1 when none came after `from`.
    double outage(double from, double to) {
        std::lock_guard lock(mu);
        double last = from, longest = -1;
        for (auto [at, id] : acked) {
            if (at <= from) continue;
            if (at > to) break;
            longest = std::max(longest, at - last);
            last = at;
        }
        return longest;
    }
    std::set<long> ids() {
        std::lock_guard lock(mu);
        std::set<long> out;
        for (auto [at, id] : acked) out.insert(id);
        return out;
    }
};

// One read-write listener's clients: a probe and a writer, each on its own thread until stop.
class Clients {
  public:
    Clients(const std::string& dir, const std::string& name, uint16_t port, Clock::time_point t0)
        : t0_(t0) {
        ::mkdir((dir + "/" + name).c_str(), 0700);
        probe_thread_ = std::thread([this, d = dir + "/" + name, port] {
            PsqlSession s(d, port);
            while (!stop_.load()) {
                auto a = s.ask("SELECT pg_is_in_recovery();", kPatience);
                if (!a) {
                    ++probe_reconnects;
                    if (!s.open(kPatience)) std::this_thread::sleep_for(Millis{50});
                    continue;
                }
                std::lock_guard lock(probe.mu);
                probe.answers.push_back({secondsSince(t0_), *a == "t"});
                std::this_thread::sleep_for(Millis{100});
            }
        });
        writer_thread_ = std::thread([this, d = dir + "/" + name + "w", port, name] {
            ::mkdir(d.c_str(), 0700);
            PsqlSession s(d, port);
            while (!stop_.load()) {
                auto a = s.ask("INSERT INTO writes (who) VALUES ('" + name + "') RETURNING id;",
                               kPatience);
                if (!a || a->empty() || a->find_first_not_of("0123456789") != std::string::npos) {
                    if (!s.open(kPatience)) std::this_thread::sleep_for(Millis{50});
                    continue;
                }
                std::lock_guard lock(writes.mu);
                writes.acked.push_back({secondsSince(t0_), std::stol(*a)});
                std::this_thread::sleep_for(Millis{50});
            }
        });
        // pgbench's TPC-B-like writes as load, a second at a time: pgbench (15) drops a client
        // whose connection is lost and does not reconnect, so a run cut by the failover ends
        // and the next one starts; the writer above is the exact account.
        pgbench_thread_ = std::thread([this, port] {
            static const std::string pgbench = findExecutable("pgbench").value_or("pgbench");
            while (!stop_.load()) {
                const CommandResult r =
                    runCommand({pgbench, "-n", "-c", "2", "-T", "1", "-h", "127.0.0.1", "-p",
                                std::to_string(port), "-U", "postgres", "postgres"},
                               Millis{10'000});
                ++pgbench_runs;
                const std::string key = "number of transactions actually processed: ";
                if (const size_t at = r.out.find(key); at != std::string::npos)
                    pgbench_transactions += std::stol(r.out.substr(at + key.size()));
                if (!r.status.cleanExit()) {
                    ++pgbench_cut;
                    std::this_thread::sleep_for(Millis{100});
                }
            }
        });
    }
    ~Clients() { stop(); }
    void stop() {
        stop_.store(true);
        if (probe_thread_.joinable()) probe_thread_.join();
        if (writer_thread_.joinable()) writer_thread_.join();
        if (pgbench_thread_.joinable()) pgbench_thread_.join();
    }

    Probe probe;
    Writes writes;
    std::atomic<int> probe_reconnects{0};
    std::atomic<long> pgbench_transactions{0};
    std::atomic<int> pgbench_runs{0}, pgbench_cut{0};

  private:
    Clock::time_point t0_;
    std::atomic<bool> stop_{false};
    std::thread probe_thread_, writer_thread_, pgbench_thread_;
};

std::string relayClusters(const PatroniCluster& pg) {
    auto cluster = [&](const std::string& name, const std::string& path) {
        std::string y = "  - name: " + name +
                        "\n"
                        "    on_marked_down: shutdown_sessions\n"
                        "    health_check:\n"
                        "      interval: " +
                        std::to_string(kIntervalMs) +
                        "ms\n"
                        "      timeout: " +
                        std::to_string(kTimeoutMs) +
                        "ms\n"
                        "      rise: 1\n"
                        "      fall: " +
                        std::to_string(kFall) +
                        "\n"
                        "      http: {method: OPTIONS, path: " +
                        path +
                        ", expect_status: \"200\"}\n"
                        "    backends:\n";
        for (const PatroniNode& n : pg.nodes())
            y += "      - {address: \"127.0.0.1:" + std::to_string(n.pg_port) +
                 "\", check_address: \"127.0.0.1:" + std::to_string(n.rest_port) + "\"}\n";
        return y;
    };
    return "clusters:\n" + cluster("pg-primary", "/primary") + cluster("pg-replicas", "/replica");
}

// Patroni's documented HAProxy config (its `defaults`: retries 2, timeout connect 4s, client
// and server 30m), with the relay's check timing. The retries matter: HAProxy tries a refused
// server again, a second apart, before it gives the client up.
std::string haproxyConfig(const PatroniCluster& pg, const std::string& bind) {
    std::string c = std::string(
                        "global\n"
                        "    maxconn 100\n"
                        "defaults\n"
                        "    mode tcp\n"
                        "    retries 2\n"
                        "    timeout client 30m\n"
                        "    timeout connect 4s\n"
                        "    timeout server 30m\n") +
                    "listen primary\n"
                    "    bind " +
                    bind +
                    "\n"
                    "    option httpchk OPTIONS /primary\n"
                    "    http-check expect status 200\n"
                    "    default-server inter " +
                    std::to_string(kIntervalMs) + "ms fall " + std::to_string(kFall) +
                    " rise 1 on-marked-down shutdown-sessions\n"
                    "    timeout check " +
                    std::to_string(kTimeoutMs) + "ms\n";
    for (const PatroniNode& n : pg.nodes())
        c += "    server " + n.name + " 127.0.0.1:" + std::to_string(n.pg_port) +
             " maxconn 100 check port " + std::to_string(n.rest_port) + "\n";
    return c;
}

class PatroniFailover : public ::testing::TestWithParam<std::string> {};

TEST_P(PatroniFailover, ClientsFollowTheLeaderAndNoneStaysOnADemotedPrimary) {
    if (std::string missing = PatroniCluster::missingPrerequisites(); !missing.empty())
        FAIL() << "this host cannot run a Patroni cluster: " << missing
               << " (deploy/install-deps.sh installs it)";
    PatroniCluster pg;
    PatroniCluster::Options options;
    options.nodes = 2;
    options.synchronous = true;
    ASSERT_TRUE(pg.start(options));
    ASSERT_TRUE(
        pg.psql(pg.nodes()[0].pg_port, "CREATE TABLE writes (id bigserial PRIMARY KEY, who text)")
            .status.cleanExit())
        << pg.diagnostics();

    RelayProcess relay;
    RelayConfig config;
    ListenerSpec rw, ro;
    rw.name = "rw";
    rw.cluster = "pg-primary";
    rw.mode = GetParam();
    ro.name = "ro";
    ro.cluster = "pg-replicas";
    ro.mode = GetParam();
    config.listeners = {rw, ro};
    config.extra_yaml = relayClusters(pg);
    ASSERT_TRUE(relay.start(config)) << relay.diagnostics();
    auto up = [&](const std::string& cluster, size_t node, double v) {
        return relay.waitForMetric(
            metric::kBackendUp,
            metric::backend(cluster, "127.0.0.1:" + std::to_string(pg.nodes()[node].pg_port)), v,
            Millis{20'000});
    };
    ASSERT_TRUE(up("pg-primary", 0, 1));
    ASSERT_TRUE(up("pg-primary", 1, 0));
    ASSERT_TRUE(up("pg-replicas", 1, 1));
    EXPECT_EQ(pg.psql(relay.port("rw"), "SELECT pg_is_in_recovery()").out, "f\n");
    EXPECT_EQ(pg.psql(relay.port("ro"), "SELECT pg_is_in_recovery()").out, "t\n");

    HaproxyProcess haproxy(findExecutable("haproxy").value_or("haproxy"));
    ASSERT_TRUE(
        haproxy.start(AF_INET, [&](const std::string& bind) { return haproxyConfig(pg, bind); }));
    // HAProxy starts its servers up, the replica too, until a check says otherwise: its
    // clients start once ten sessions in a row reached the primary (an INSERT that went to the
    // replica first cost the writer a retry, which a bench run counted as HAProxy's outage).
    ASSERT_TRUE(waitUntil(
        [&] {
            for (int i = 0; i < 10; ++i)
                if (pg.psql(haproxy.port(), "SELECT pg_is_in_recovery()", Millis{5'000}).out !=
                    "f\n")
                    return false;
            return true;
        },
        Millis{30'000}, Millis{200}))
        << "HAProxy did not settle on the primary";

    // pgbench's tables, through the relay.
    const CommandResult init = runCommand(
        {findExecutable("pgbench").value_or("pgbench"), "-i", "-s", "1", "-q", "-h", "127.0.0.1",
         "-p", std::to_string(relay.port("rw")), "-U", "postgres", "postgres"},
        Millis{60'000});
    ASSERT_TRUE(init.status.cleanExit()) << init.describe();

    TempDir dir;
    const auto t0 = Clock::now();
    auto zc = std::make_unique<Clients>(dir.path(), "zcrelay", relay.port("rw"), t0);
    auto ha = std::make_unique<Clients>(dir.path(), "haproxy", haproxy.port(), t0);
    std::this_thread::sleep_for(Millis{2'000});
    ASSERT_GT(zc->writes.ids().size(), 5u)
        << "writes go through the relay; psql said: "
        << readFileText(dir.path() + "/zcrelayw/psql.err") << relay.diagnostics();

    // A planned switchover, 0 -> 1.
    const double switch_at = secondsSince(t0);
    ASSERT_TRUE(pg.switchover(0, 1)) << pg.diagnostics();
    ASSERT_TRUE(up("pg-primary", 1, 1));
    ASSERT_TRUE(up("pg-primary", 0, 0));
    std::this_thread::sleep_for(Millis{3'000});

    // The new primary's postmaster dies: Patroni fails over to node 0.
    const double kill_at = secondsSince(t0);
    ASSERT_TRUE(pg.killPostmaster(1));
    ASSERT_TRUE(pg.waitForPrimary(0, Millis{60'000})) << pg.diagnostics();
    ASSERT_TRUE(up("pg-primary", 0, 1));
    std::this_thread::sleep_for(Millis{3'000});
    const double end_at = secondsSince(t0);
    zc->stop();
    ha->stop();

    // What each saw. Rows are read from the primary now, directly.
    const CommandResult rows =
        pg.psql(pg.nodes()[0].pg_port, "SELECT id FROM writes ORDER BY id", Millis{30'000});
    ASSERT_TRUE(rows.status.cleanExit()) << rows.describe();
    std::set<long> stored;
    for (size_t at = 0; at < rows.out.size();) {
        const size_t eol = rows.out.find('\n', at);
        stored.insert(std::stol(rows.out.substr(at, eol - at)));
        at = eol + 1;
    }
    struct Seen {
        const char* who;
        Clients* c;
    };
    for (const Seen& s : {Seen{"zcrelay", zc.get()}, Seen{"haproxy", ha.get()}}) {
        const std::set<long> acked = s.c->writes.ids();
        std::set<long> lost_switch, lost_kill;
        for (auto [at, id] : s.c->writes.acked) {
            if (stored.count(id)) continue;
            (at < kill_at ? lost_switch : lost_kill).insert(id);
        }
        const double in_recovery = s.c->probe.longestInRecovery(switch_at);
        const double switch_outage = s.c->writes.outage(switch_at, kill_at);
        const double kill_outage = s.c->writes.outage(kill_at, end_at);
        std::printf(
            "[ failover %s %s ] probe on a non-primary at most %.3f s (bound %.1f s); "
            "no write for %.3f s across the switchover, %.3f s across the kill -9; "
            "acked %zu, lost %zu at the switchover (synchronous mode), %zu at the kill; "
            "probe reconnects %d\n",
            s.who, GetParam().c_str(), in_recovery, kBoundSeconds, switch_outage, kill_outage,
            acked.size(), lost_switch.size(), lost_kill.size(), s.c->probe_reconnects.load());
        {
            // The writer's acknowledged rows per second of the case, for a reader to see where
            // an outage or a slowdown was.
            std::vector<int> per_second(static_cast<size_t>(end_at) + 1);
            for (auto [at, id] : s.c->writes.acked)
                if (at >= 0 && at < per_second.size()) ++per_second[static_cast<size_t>(at)];
            std::string line;
            for (int n : per_second) line += " " + std::to_string(n);
            std::printf("[ writes %s %s ] per second:%s (switchover at %.1f s, kill at %.1f s)\n",
                        s.who, GetParam().c_str(), line.c_str(), switch_at, kill_at);
        }
        std::printf("[ pgbench %s %s ] %ld transactions in %d runs of 1 s, %d of them cut\n", s.who,
                    GetParam().c_str(), s.c->pgbench_transactions.load(), s.c->pgbench_runs.load(),
                    s.c->pgbench_cut.load());
        if (std::string(s.who) != "zcrelay") continue;
        EXPECT_GT(s.c->pgbench_transactions.load(), 0) << "pgbench wrote through the relay";
        EXPECT_LE(in_recovery, kBoundSeconds + kSlackSeconds)
            << "a session stayed on a node no longer primary";
        EXPECT_EQ(lost_switch.size(), 0u) << "a planned switchover in synchronous mode";
        EXPECT_GT(kill_outage, 0) << "writes resumed after the failover";
        EXPECT_GT(switch_outage, 0) << "writes resumed after the switchover";
    }
}

ZCRELAY_LABEL(PatroniFailover, ClientsFollowTheLeaderAndNoneStaysOnADemotedPrimary, "",
              kSanitizeSkip,
              "the relay's failover code (HTTP checks, closing a down backend's sessions) is "
              "failover_test's, which runs sanitized; this adds a real cluster's 35 s");
INSTANTIATE_TEST_SUITE_P(Modes, PatroniFailover, ::testing::ValuesIn(kModes), modeName);

}  // namespace
}  // namespace zcrelay::test::patroni_test
