#pragma once
// Takeover: a new relay process (the taker) takes the listening sockets of the running one (the
// giver) and starts on them; only once it says it is ready does the giver stop accepting and
// drain. No listening socket is closed in between: a connection that arrives meanwhile waits in
// a queue one of the two accepts from, and the connections already queued stay queued in the
// same socket. That is the whole reason to pass the sockets rather than bind new ones: a socket
// that leaves an SO_REUSEPORT group takes its accept queue with it (the kernel resets those
// connections unless net.ipv4.tcp_migrate_req is set, a host-wide sysctl), and one that closes
// before the next binds refuses SYNs.
//
// How the taker finds the giver: over the giver's takeover socket (config `takeover_socket`,
// a unix socket only the relay's own user, or root, may use), for `zcrelay --takeover`; or over
// a socketpair the giver made when SIGUSR2 told it to execute its binary again (main.cpp).
//
// The conversation, protocol version 2 (takeover_wire.hpp is the wire):
//   taker  HELLO versions=1,2 pid=P release=R
//   giver  OFFER version=V pid=P release=R sockets=N       (or REFUSE code=C reason=...)
//   giver  SOCKET kind=K listen=A bound=B [name=L] [held=systemd]  + fd    N times
//   giver  END
//          the taker starts: binds what it was not given, loads what it needs, starts workers
//   taker  READY pid=P [fds=N listener=L... backend=C/K... sockmap=LAYOUT]
//                                                        (or ABORT reason=..., or it dies)
//          the giver stops accepting (closes its copies without shutdown) and drains; in
//          version 2 its workers first hand over the connections the taker can take:
//   giver  CONN ...  + fds                                  (handover.hpp), any number,
//          each sockmap one after the RING of its wake-up ring: RING ... + fds
//   giver  DONE
// V is the highest version both speak. Version 1 (no CONN, READY without what the taker takes)
// is spoken still, to and from a relay that knows no more: its connections drain as before.
// Kinds: listener (one per worker per listener: name, configured and bound address), metrics,
// health, admin (the control plane's sockets), takeover (the takeover socket itself).
// REFUSE codes: version (no version in common: the taker binds its own sockets, loudly),
// busy (another takeover is under way), draining (nothing left to give: the taker binds its
// own), denied (a peer not of the relay's user).
//
// What does not cross: counters, gauges, runtime API changes, passive-ejection state and
// discovered sets start afresh in the new process (docs/operating.md says why for each).
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tl/expected.hpp>
#include <vector>

#include "address.hpp"
#include "handover.hpp"
#include "unique_fd.hpp"
#include "unix_path.hpp"

namespace zcrelay::takeover {

// The newest version this binary speaks; it speaks every one from 1.
inline constexpr unsigned kVersion = 2;

struct HandedSocket {
    std::string kind;      // "listener", "metrics", "health", "admin", "takeover"
    std::string name;      // a listener's name; "" for the others
    SocketAddress listen;  // as configured (port 0 included)
    SocketAddress bound;   // where it listens
    UniqueFd fd;
    // A listener's socket systemd holds (socket activation): whoever relays on it closes it
    // without shutdown() when it stops, as the first relay did.
    bool systemd = false;
};

// ---- the taker -------------------------------------------------------------------------------

struct Taken {
    std::vector<HandedSocket> sockets;
    size_t count = 0;  // sockets handed over (the vector is moved out to start on them)
    UniqueFd channel;  // READY goes back over it
    pid_t giver = 0;
    std::string giver_release;
    unsigned version = 0;  // the one the giver chose
    int64_t started_us = 0;
};

struct TakeError {
    enum Kind {
        Unreachable,  // no giver answered (nothing at the path): start as a new relay
        Version,      // no protocol version in common: bind own sockets, loudly
        Draining,     // the giver gives nothing any more: bind own sockets
        Refused,      // busy, denied: do not start
        Broken,       // the conversation broke off: start with what came, bind the rest
    };
    Kind kind;
    std::string why;
    std::vector<HandedSocket> partial;  // Broken: the sockets that came before the break
    pid_t giver = 0;
};

// The taker's channel to the giver listening on `path`; Unreachable when nothing does.
tl::expected<UniqueFd, TakeError> connectTo(const std::string& path);
// HELLO to END: the sockets, or why not.
tl::expected<Taken, TakeError> take(UniqueFd channel);
// The taker is ready: READY (saying what it can take, `accepts`), then hands every connection
// that comes to `adopt` (which counts it, taken or lost: nullopt when it came unusable), and
// every RING to `adopt_ring`, until the giver's DONE, each awaited within a bound. The text to
// log.
std::string sayReady(Taken& taken, const handover::Acceptance& accepts,
                     const std::function<void(std::optional<handover::HandedConn>)>& adopt,
                     const std::function<void(handover::HandedRing)>& adopt_ring);
// The taker failed to start: ABORT with `why`, so the giver logs it and serves on.
void sayAborted(Taken& taken, const std::string& why);

// ---- the giver -------------------------------------------------------------------------------

// The takeover socket for `path`, made 0600 before anyone can connect: a stale one there is
// replaced, a live one (a running relay) refused unless `replace_live` (a taker that could not
// take over). Bound while the process may still be root (Server::start), like the listeners,
// and published at `path` only once the relay runs: a taker never finds a relay that is still
// starting, and a relay that fails to start leaves the path to the one before it.
tl::expected<UnpublishedUnixSocket, std::string> bindTakeover(const std::string& path,
                                                              bool replace_live);

// Runs on a thread of its own: accepts on the takeover socket (and any channel a SIGUSR2
// child was given), one conversation at a time; a second taker meanwhile is refused (busy).
class Giver {
  public:
    struct Hooks {
        // Dups of every socket to hand over. From here until withdraw() or hand_over(), a
        // taker may hold them: a drain meanwhile must not shut them down.
        std::function<std::vector<HandedSocket>()> offer;
        // The taker failed: the sockets are this relay's alone again.
        std::function<void()> withdraw;
        // "" when sockets may be handed over, else the REFUSE reason (e.g. draining).
        std::function<std::string()> refusal;
        // The taker is ready: stop accepting, drain, and hand over the connections `out`
        // admits (null: a version 1 taker takes none). Returns how many listeners it gave up.
        std::function<size_t(std::shared_ptr<handover::Outbound> out)> hand_over;
        // How many workers hand connections over (Outbound waits for each).
        unsigned workers = 1;
        // One takeover's end, for zcrelay_takeovers_total: "handed_over", "failed", "refused".
        std::function<void(const char* result)> count;
    };

    // Serves `listening` (the takeover socket at `file`'s path, or none) and the SIGUSR2
    // channels added later.
    static tl::expected<std::unique_ptr<Giver>, std::string> start(UnixFile file,
                                                                   UniqueFd listening, Hooks hooks);
    ~Giver();
    Giver(const Giver&) = delete;
    Giver& operator=(const Giver&) = delete;

    // A SIGUSR2 child's channel: its conversation runs as one from the socket would.
    void addChannel(UniqueFd channel, pid_t child);
    // The listening socket, to hand over (-1 without a path).
    int listenFd() const { return listen_.get(); }
    // Handed over: the taker now serves (no more takeovers from this process).
    bool handedOver() const { return handed_over_.load(); }

  private:
    Giver(UnixFile file, UniqueFd listen, Hooks hooks);
    void run();
    // One taker, from HELLO to DONE (or its failure); `from` names it in the log.
    void converse(UniqueFd channel, const std::string& from);
    // While a conversation waits: a second taker, on the socket or a SIGUSR2 channel, is
    // refused (busy).
    void refuseWaiting(const std::string& under_way);
    // REFUSE with `code` and `reason` to `peer` (`who` names it in the log), counted.
    void refuse(int peer, const char* code, const std::string& reason, const std::string& who);
    // The same to a peer whose HELLO is still unread, read first; the peer is closed after.
    void refuseUnheard(UniqueFd peer, const char* code, const std::string& reason,
                       const std::string& who);
    // A channel of a SIGUSR2 child, or -1.
    UniqueFd takeChannel(pid_t& child);

    UnixFile file_;  // removed at the end unless handed over
    UniqueFd listen_;
    Hooks hooks_;
    UniqueFd wake_;  // eventfd: stop, or a channel added
    std::mutex channels_mutex_;
    std::vector<std::pair<UniqueFd, pid_t>> channels_;
    std::atomic<bool> stopping_{false};
    std::atomic<bool> handed_over_{false};
    std::thread thread_;
};

}  // namespace zcrelay::takeover
