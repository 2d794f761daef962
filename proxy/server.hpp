#pragma once
// The process's one Server: listening sockets, workers and the metrics endpoint, started and
// stopped in a fixed order.
//   start: bind every listener (port 0 resolved once, shared by all workers' sockets) -> load
//          the sockmap program if a listener wants it (else it runs splice) -> with `user`,
//          drop root while this is the only thread (privileges.hpp) -> the access log -> the
//          metrics endpoint -> the workers, each accepting once its ring is up.
//   drain: every worker stops accepting and lets its connections finish (drain_timeout).
//   join:  workers exit once their connections are gone; the metrics endpoint goes last, so
//          the final counts can still be scraped during the drain.
//   reload (SIGHUP): the new config is checked and its new listeners bound first; any error
//          refuses the whole reload and the running config goes on serving. Otherwise every
//          worker switches to the new Runtime; live connections keep the one they started in.
//   discovery (discovery.hpp): with a discovered cluster, its first answers are awaited
//          before the workers start (startup: fail stops here). A later change of a set, or
//          of a weight through the runtime API, builds the next generation like a reload
//          with the same config: one publish at a time (publish_mutex_). Discovery is told
//          where the relay listens (ownEndpoints) before it judges an answer, so that a name
//          resolving to the relay itself is refused: the listeners as bound, and the metrics,
//          health and admin addresses as configured, again with their ports once bound (port 0),
//          and on every reload.
//   takeover (takeover.hpp; the sockets in server_sockets.cpp): a new process starts on the
//          sockets the running one handed it (StartWith) and binds only the rest; the running
//          one's giver offers a dup of every listening socket, and once the new one is ready
//          the hand-over drains this one without shutting any socket down.
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tl/expected.hpp>
#include <vector>

#include "access_log.hpp"
#include "admin_api.hpp"
#include "config.hpp"
#include "discovery.hpp"
#include "metrics.hpp"
#include "metrics_endpoint.hpp"
#include "runtime.hpp"
#include "sockmap.hpp"
#include "takeover.hpp"
#include "worker.hpp"

namespace zcrelay {

// What a process starts with besides its config: the sockets the relay it takes over from
// handed it (takeover.hpp), used in place of binding its own.
struct StartWith {
    std::vector<takeover::HandedSocket> handed;
    // Taking over: a listener that wants the sockmap program and cannot load it stops the start
    // (the running relay serves on) instead of running splice.
    bool taking_over = false;
    // A takeover that failed to take: the takeover socket at the config's path is the running
    // relay's, and this one replaces it (the next --takeover comes here).
    bool replace_takeover_socket = false;
};

class Server {
  public:
    // The error names what failed, e.g. "listener web: bind 127.0.0.1:80: Permission denied".
    static tl::expected<std::unique_ptr<Server>, std::string> start(Config config,
                                                                    StartWith with = {});
    ~Server();

    // The current generation's config (a copy: discovery and the runtime API publish
    // generations from their own threads, so the current one may be replaced at any time), and
    // where each of its listeners really listens (port 0 resolved), in config order. The
    // addresses: main thread only (reload() changes them).
    Config config() const { return current()->config; }
    const std::vector<SocketAddress>& boundAddresses() const { return bound_; }
    // Switches to `config`, or returns why not (the running config stays).
    tl::expected<void, std::string> reload(Config config);
    // The current Runtime: any thread (the metrics scrape).
    std::shared_ptr<const Runtime> current() const;
    // SIGHUP also reopens the access log file (logrotate).
    void reopenAccessLog();
    ProcessShared& process() { return process_; }
    // Taking over (takeover.hpp, version 2): what this relay can take of the old one's
    // connections, said in READY; and each that came, to a worker (nullopt: it came unusable,
    // counted lost).
    handover::Acceptance acceptance() const;
    void adopt(std::optional<handover::HandedConn> conn);
    // A RING that came: its map set adopted (once per set), its ring given to a worker, which
    // also gets every connection on it.
    void adoptRing(handover::HandedRing ring);
    // "" when fine, else why: /healthz (a worker died) and /readyz (draining, or a listener
    // with no backend up). Any thread.
    std::string unhealthy() const;
    std::string unready() const;
    // Ready, but not as configured: what /readyz adds under "ready" (backups serving, a
    // backend in slow_start).
    std::string readyNotes() const;
    // 0 when metrics are disabled.
    uint16_t metricsPort() const { return metrics_ ? metrics_->port() : 0; }
    // 0 without metrics.health_listen.
    uint16_t healthPort() const { return metrics_ ? metrics_->healthPort() : 0; }

    // The runtime API's address; empty without admin.listen.
    SocketAddress adminAddress() const { return admin_ ? admin_->address() : SocketAddress{}; }

    void drain();
    void stop();
    bool finished() const;
    void join();

    // Takeover (takeover.hpp), as the giver: a SIGUSR2 child's channel; whether the listening
    // sockets went to a new process (which then serves; this one drains).
    void addTakeoverChannel(UniqueFd channel, pid_t child);
    bool handedOver() const { return giver_ && giver_->handedOver(); }

  private:
    Server() = default;
    // Hands `next` to every worker (with `fds`, its new listeners' sockets, per worker) and
    // waits until each runs it. publish_mutex_ held.
    tl::expected<void, std::string> reloadLocked(Config config);
    // What following discovery for a config gave: the sets to build its generation from and,
    // when a name had no first answer in time, awaitFirstAnswers()'s text naming it (fatal at
    // start under startup: fail, a warning on reload).
    struct Followed {
        DiscoveredSets sets;
        std::string unresolved;
    };
    // Start or reload: discovery started (the first config that has a discovered cluster) or
    // told of `config`, and every name's first answer awaited (bounded). An error is discovery
    // failing to start at all.
    tl::expected<Followed, std::string> followDiscovery(const Config& config,
                                                        const std::vector<SocketAddress>& bound);
    // Where the relay listens with `config` and its listeners at `bound`: the metrics, health
    // and admin addresses as their endpoints bound them, as configured before they run.
    OwnEndpoints ownEndpoints(const Config& config, const std::vector<SocketAddress>& bound) const;
    void switchTo(std::shared_ptr<const Runtime> next, std::vector<std::vector<ListenSocket>> fds);
    // The giver's hooks: dups of every socket to hand over; the hand-over itself.
    std::vector<takeover::HandedSocket> offer();
    size_t handOver(std::shared_ptr<handover::Outbound> out);
    // A discovered set changed (or, `force`, a weight): the next generation, from the running
    // config. Any thread; when another publish holds the mutex, that one builds again as it
    // lets go.
    void republish(bool force = false);
    void rebuildLocked();
    // After letting publish_mutex_ go: a change that came meanwhile is built now.
    void publishPending() {
        if (dirty_.load()) republish();
    }

    mutable std::mutex current_mutex_;
    std::shared_ptr<const Runtime> current_;
    std::vector<SocketAddress> bound_;
    ProcessShared process_;
    std::unique_ptr<AccessLog> access_log_;  // outlives the workers (declared before them)
    std::unique_ptr<Sockmap> sockmap_;       // outlives the workers (declared before them)
    // Map sets adopted with sockmap connections at a takeover, by their SOCKHASH's id, and
    // which worker reads each of their rings (adoptRing). Written by the thread that takes the
    // connections in, before any worker relays them; kept until the process exits.
    std::map<uint32_t, std::unique_ptr<Sockmap>> adopted_maps_;
    std::map<std::pair<uint32_t, uint32_t>, size_t> ring_readers_;
    std::vector<std::unique_ptr<Worker>> workers_;
    uint32_t per_worker_ = 0;    // each worker's share of the fd budget, in connections
    uint64_t reserved_fds_ = 0;  // the fds the budget keeps for what is not a connection
    size_t next_adopter_ = 0;  // adopt(): the workers in turn
    // Builds of the next generation, one at a time: reload, discovery, the runtime API.
    std::mutex publish_mutex_;
    std::atomic<bool> dirty_{false};    // a publish is wanted (republish)
    std::atomic<bool> force_{false};    // ... even if the discovered sets did not move
    std::atomic<bool> started_{false};  // the workers run: publishes go to them
    uint64_t built_version_ = 0;        // the discovery version the current generation has
    AdminStats admin_stats_;
    // Stopped before the workers and the endpoints that read it (declared after them).
    std::unique_ptr<Discovery> discovery_;
    std::unique_ptr<MetricsEndpoint> metrics_;
    std::unique_ptr<AdminApi> admin_;
    // One dup of each listening socket the workers accept on, with its listener, for the next
    // relay: kept up to date by reloads (main thread), read by the giver's thread.
    std::mutex listening_mutex_;
    std::vector<takeover::HandedSocket> listening_;
    std::unique_ptr<takeover::Giver> giver_;  // stopped first (declared last)
};

}  // namespace zcrelay
