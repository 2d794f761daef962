#pragma once
// Handover: the live connections a relay passes to the one that took its listeners over
// (takeover.hpp, protocol version 2), each as one CONN message with its sockets and the bytes
// in flight between them.
//
// Why that is all a connection is: on the splice path its state is two sockets, the bytes a
// pipe holds between them, and a few flags per direction. The sockets cross by SCM_RIGHTS, and
// the kernel's TCP state (queues, sequence numbers, timers) belongs to the socket, not to the
// process that holds an fd of it: the peers notice nothing, and the old relay closing its fds
// afterwards sends no FIN. A pipe crosses the same way, bytes and all. Nothing moves meanwhile:
// the old relay cancels the connection's polls and waits for their completions before it
// sends, so no byte of it is anywhere but in the kernel.
//
// A sockmap connection's sockets stay in the SOCKHASH they are in, with the program that
// relays them: taking them out mid-stream is not exact (proxy/kernel.md). The new relay adopts
// the old one's maps instead, by their fds, and reads the records and wake-up ring as the old
// one did. A ring has one reader, so each old worker's connections on a ring cross together or
// not at all: the RING message carries the map set and the ring, before the connections on it.
// The new relay keeps the map set until it exits, and passes it on in turn at the next upgrade.
//
// What stays with the old relay, which finishes it as it drains (counted as kept):
//   - a connection not relaying yet (connecting, reading a PROXY header or a ClientHello, held
//     at max_connections): it has state in the old relay's ring and memory, and becomes
//     relayable within its connect or inspect timeout;
//   - a copy direction whose peer does not take what it holds within a second; sockmap
//     connections whose ring one such connection, or one that cannot cross, shares;
//   - one being ended at max_connection_duration;
//   - one whose listener, cluster or backend the new relay has not (its READY says what it
//     has), or past the fds the new relay has room for (READY's fds: 2 per connection, 2 more
//     per pipe that crosses with it).
//
//   CONN listener=L cluster=C backend=K [route=R] [client=A] [local=A] start=US age=US quiet=MS
//        connect=US attempts=N up=BYTES down=BYTES [proxy=IN,OUT] [fin0=1] [eof0=1] [hup0=1] [pipe0=N]
//        [copy0=1] [sm0=PHASE,STOPPED,SKIPPED,EXTRA,BEFORE,SEEN,TAKEN,END,CONSUMED,COPIED]
//        ... the same for direction 1
//        [map=ID record=N linked=01 in=01 [promoted=1]]   on sockmap: the pair in the maps
//   + fds: the client's socket, the upstream socket, then the read and write ends of each
//     direction's pipe that holds bytes (pipeD=N > 0), direction 0 first.
//   RING map=ID rings=N rpw=N ring=K layout=L
//   + fds: the map set's SOCKHASH, links, records and wake-up counts, then ring K.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <tl/expected.hpp>
#include <vector>

#include "address.hpp"
#include "pump/pump.hpp"
#include "takeover_wire.hpp"
#include "unique_fd.hpp"

namespace zcrelay {
class Sockmap;
}

namespace zcrelay::handover {

struct HandedConn {
    std::string listener;
    std::string cluster;
    std::string backend;   // the backend's key in its cluster
    std::string route;     // "" without routes
    SocketAddress client;  // length 0: not known
    SocketAddress local;
    int64_t start_unix_us = 0;  // wall clock at accept (the access log's start)
    int64_t age_us = 0;    // how long it had lived when sent: max_connection_duration counts on
    int64_t quiet_ms = 0;  // since its last byte: the idle and fin timeouts count on
    int64_t connect_us = 0;
    uint32_t attempts = 0;
    uint64_t bytes[2] = {0, 0};  // relayed so far, per direction
    // PROXY header bytes read from the client and sent upstream, outside the data path: a
    // connection promoted to sockmap later (mode auto) counts them in its FIN barrier.
    uint32_t proxy_in = 0;
    uint32_t proxy_out = 0;
    RestingDirection dir[2];
    // On sockmap: the pair's place in the maps, a map set named by its SOCKHASH's id.
    struct Pair {
        uint32_t map_id = 0;  // 0: not on sockmap
        uint32_t record = 0;
        bool linked[2] = {false, false};
        bool in_map[2] = {false, false};
        bool promoted = false;  // mode auto moved it there from splice
    } pair;
    // Received only: the adopted map set it is in (Server::adopt).
    Sockmap* map = nullptr;
    // Received only: the fds that came with it.
    UniqueFd client_fd;
    UniqueFd upstream_fd;
    UniqueFd pipe_read[2];
    UniqueFd pipe_write[2];
};

// The CONN message for `h` (fds apart: the sender passes its own).
takeover::Message toMessage(const HandedConn& h);
// A received CONN, its fds taken from `m`; the error names what was wrong, and every fd that
// came is closed with `m`.
tl::expected<HandedConn, std::string> fromMessage(takeover::Message& m);

// A wake-up ring and its map set (RING), sent by the worker that read it before the sockmap
// connections on it.
struct HandedRing {
    uint32_t map_id = 0;
    uint32_t rings = 0;               // rings in the map set: the workers of the relay that made it
    uint32_t records_per_worker = 0;  // records per ring
    uint32_t ring = 0;
    std::string layout;  // Sockmap::layout() of the build that sent it
    // Received only: the SOCKHASH, the links, the records, the wake-up counts, the ring.
    static constexpr size_t kFds = 5;
    UniqueFd fds[kFds];
};
inline constexpr size_t kRingFds = HandedRing::kFds;

takeover::Message toMessage(const HandedRing& h);
tl::expected<HandedRing, std::string> ringFromMessage(takeover::Message& m);

// What a taker can take, said in its READY: connections on these listeners to these backends
// ("cluster/key"), and how many fds it has room for: its connection budget's, and no more than
// its open-file limit leaves (an fd that does not fit is cut off in recvmsg, MSG_CTRUNC, and the
// connection with it).
struct Acceptance {
    uint64_t fds = 0;
    std::vector<std::string> listeners;
    std::vector<std::string> backends;
    std::string sockmap;  // the record layout it adopts maps of (Sockmap::layout()); "" none

    bool takes(const std::string& listener, const std::string& cluster,
               const std::string& backend) const;
    void addTo(takeover::Message& m) const;
    static Acceptance from(const takeover::Message& m);
};

// zcrelay_handover_connections_total's results: as the old relay, then as the new one.
enum class Outcome : uint8_t { HandedOver, Kept, Failed, Taken, Lost, kCount };
inline constexpr const char* kResultLabels[] = {"handed_over", "kept", "failed", "taken", "lost"};
static_assert(std::size(kResultLabels) == static_cast<size_t>(Outcome::kCount));

// One handover on the old relay's side, shared by its workers: each hands over its own
// connections on its own thread (SOCK_SEQPACKET keeps each sendmsg one record, whoever sends
// it), and the takeover's thread waits for all of them before it says DONE.
class Outbound {
  public:
    Outbound(UniqueFd channel, Acceptance accepts, unsigned workers, int64_t deadline_ms);

    // Whether a connection on `listener` to `cluster`/`backend`, crossing with `fds` fds, may
    // go: the taker has them (takes), and room for the fds (reserve: taken here).
    bool admits(const std::string& listener, const std::string& cluster, const std::string& backend,
                uint32_t fds) {
        return takes(listener, cluster, backend) && reserve(fds);
    }
    bool takes(const std::string& listener, const std::string& cluster,
               const std::string& backend) const {
        return !failed_.load() && accepts_.takes(listener, cluster, backend);
    }
    bool reserve(uint64_t fds);
    // Whether the taker adopts sockmap maps of this build's layout.
    bool adoptsSockmap(const std::string& layout) const { return accepts_.sockmap == layout; }
    // Sends a CONN or RING with `fds`, bounded by the handover's deadline. After a failure every
    // later send fails at once: the taker is gone or stuck.
    tl::expected<void, std::string> send(const takeover::Message& m, std::span<const int> fds);
    bool failed() const { return failed_.load(); }
    // A worker has handed over all it could.
    void workerDone();
    // Until every worker is done, or `deadline_ms`; false on the deadline.
    bool waitForWorkers(int64_t deadline_ms);

  private:
    UniqueFd channel_;
    const Acceptance accepts_;
    const int64_t deadline_ms_;
    std::atomic<int64_t> fds_left_;
    std::atomic<bool> failed_{false};
    std::mutex mutex_;
    std::condition_variable done_;
    unsigned workers_left_;
};

}  // namespace zcrelay::handover
