#pragma once
// A real Patroni cluster on loopback, for the cases that put the relay in front of one the way
// Patroni's docs put HAProxy there: a read-write listener whose health check asks each node's
// REST API for /primary, a read-only one asking /replica. One etcd (the DCS) and N Patroni
// nodes, each with its own PostgreSQL, all in one TempDir, every socket on 127.0.0.1.
//
// Patroni and PostgreSQL run as the `postgres` user (PostgreSQL refuses root), exec'd through
// setpriv, which keeps the PID: the PID this class signals is Patroni's own, never a runuser or
// su in between (those forward SIGTERM and SIGKILL the child 2 s later, cutting Patroni's own
// shutdown of its PostgreSQL short). Only the PIDs it started, and the postmasters its nodes
// recorded in their own data directories, are ever signalled.
//
// Every wait is bounded: start() and the waits by their timeouts, each REST request by
// httpRequest's (2 s to connect, 5 s to answer), each command by its runCommand timeout. A
// failure carries diagnostics(): the tails of etcd's and every node's log.
#include <gtest/gtest.h>
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "support/relay_process.hpp"

namespace zcrelay::test {

struct PatroniNode {
    std::string name;        // Patroni's member name: "node0", "node1", ...
    uint16_t pg_port = 0;    // PostgreSQL on 127.0.0.1
    uint16_t rest_port = 0;  // Patroni's REST API on 127.0.0.1 (/primary, /replica, ...)
};

class PatroniCluster {
  public:
    struct Options {
        unsigned nodes = 2;
        bool synchronous = false;  // Patroni's synchronous_mode
        // Patroni's timing (bootstrap.dcs), in seconds. Patroni wants loop_wait + 2 *
        // retry_timeout <= ttl. A switchover, or a failover after a postmaster crash, does not
        // wait for the ttl (the old leader gives its key up); the ttl counts only when a Patroni
        // itself stops answering. retry_timeout is also how long a primary rides out an etcd
        // that does not answer before it demotes itself: with one etcd, Patroni gives each
        // request a third of it, so 3 s is 1 s per try, which a loaded machine still meets
        // because this etcd runs without fsync.
        unsigned ttl = 10;
        unsigned loop_wait = 1;
        unsigned retry_timeout = 3;
        // 0: a primary whose postmaster dies fails over at once to a replica fit to take over.
        // Patroni's default, 300, restarts it in place and keeps it primary.
        unsigned primary_start_timeout = 0;
        Millis start_timeout{90'000};
    };

    PatroniCluster();
    ~PatroniCluster() { stop(); }
    PatroniCluster(const PatroniCluster&) = delete;
    PatroniCluster& operator=(const PatroniCluster&) = delete;

    // What this host lacks to run a cluster (patroni, etcd, PostgreSQL's server binaries, the
    // postgres user, setpriv), or "" when nothing: for a case to skip or fail with the reason.
    static std::string missingPrerequisites();

    // etcd, then node 0 alone until it is primary (so node 0 is always the first primary), then
    // the others, which clone it with pg_basebackup. Returns once waitForPrimary(0) holds, or
    // fails within options.start_timeout with diagnostics(). Once per PatroniCluster, from the
    // case's own thread: each Patroni gets SIGKILL when the thread that started it ends.
    ::testing::AssertionResult start(const Options& options);
    ::testing::AssertionResult start() { return start(Options{}); }

    const std::vector<PatroniNode>& nodes() const { return nodes_; }
    uint16_t etcdPort() const { return etcd_port_; }

    // The HTTP status node `node`'s REST API answers to GET `path` now, or 0 with no answer.
    int restStatus(size_t node, const std::string& path) const;
    // The one node whose REST API answers 200 to /primary now; nullopt when none does, or more
    // than one.
    std::optional<size_t> primary() const;
    // Synchronous mode: the node whose REST API answers 200 to /sync now, the one standby a
    // switchover may go to; nullopt when none does.
    std::optional<size_t> syncStandby() const;
    // Until `node` answers 200 to /primary, every other node 200 to /replica and streams from
    // it (pg_stat_replication on the primary, as its /primary answer lists it), and, in
    // synchronous mode, one of them is its synchronous standby (in PostgreSQL, and in the /sync
    // key Patroni keeps in etcd, which a switchover needs: its REST /sync answers 200).
    ::testing::AssertionResult waitForPrimary(size_t node, Millis timeout) const;
    // `patronictl switchover --leader FROM --candidate TO --force`, then waitForPrimary(to).
    // patronictl itself exits 0 when Patroni refuses, so its words and the REST API decide.
    ::testing::AssertionResult switchover(size_t from, size_t to, Millis timeout = Millis{60'000});

    // The postmaster's PID, the first line of the node's data/postmaster.pid, or -1 when there
    // is none. The file can outlive its postmaster (kill -9): killPostmaster checks the process.
    pid_t postmasterPid(size_t node) const;
    // SIGKILL to that postmaster alone (its backends notice and exit by themselves), when
    // /proc says the PID still runs PostgreSQL on this node's data directory; true once it is
    // gone, within 5 s.
    bool killPostmaster(size_t node);

    // `psql -X -h 127.0.0.1 -p PORT -U postgres -d postgres -Atc SQL` as the postgres user, 5 s
    // to connect: a node's pg_port, or a relay listener in front of the nodes.
    CommandResult psql(uint16_t port, const std::string& sql,
                       Millis timeout = Millis{30'000}) const;

    // Ports, PIDs, each node's REST answer to /patroni now, and the tails of etcd's log and each
    // node's log (Patroni's and its PostgreSQL's, without Patroni's once-a-loop "no action").
    std::string diagnostics() const;

    // SIGTERM to every Patroni (each stops its PostgreSQL), at most 30 s for all, SIGKILL the
    // rest; SIGKILL every postmaster still running (Patroni detaches them, so one outlives a
    // killed Patroni) and any other process of this cluster's (pg_basebackup, pg_rewind);
    // then etcd, which the Patronis needed to the end to leave cleanly. Idempotent.
    void stop();

  private:
    struct Tools {
        std::string patroni, patronictl, etcd, setpriv, env, pg_bin;
        std::string missing;  // what was not found, "" when all was
    };
    struct NodeProcess {
        std::string dir;  // node dir, the postgres user's: config, log, data/, pgpass, sockets
        std::unique_ptr<ChildProcess> patroni;
    };

    static Tools findTools();
    // `env -C CWD setpriv --reuid=postgres ... -- ARGV...`: every exec in place, one PID.
    std::vector<std::string> asPostgres(const std::string& cwd,
                                        const std::vector<std::string>& argv) const;
    ::testing::AssertionResult startEtcd(Clock::time_point deadline);
    ::testing::AssertionResult startNode(size_t node);
    std::string nodeConfig(size_t node) const;
    // "" when waitForPrimary's condition holds for `node` now, else what is missing.
    std::string notSettled(size_t node) const;
    // The PID of postmaster.pid when /proc shows PostgreSQL running there on this node's data.
    std::optional<pid_t> runningPostmaster(size_t node) const;
    std::string dataDir(size_t node) const { return procs_[node].dir + "/data"; }

    TempDir dir_;  // the first member, so the last destroyed: removed after stop() ran
    Options options_;
    Tools tools_;
    bool started_ = false;
    std::unique_ptr<ChildProcess> etcd_;
    uint16_t etcd_port_ = 0;
    std::vector<PatroniNode> nodes_;
    std::vector<NodeProcess> procs_;
};

}  // namespace zcrelay::test
