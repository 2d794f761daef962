#pragma once
// The path table: which pump each direction of a connection runs, and the kernel state a path
// keeps per connection beside its two pumps (sockmap: both sockets' entries in the maps, and
// their records). The lifecycle (connections.cpp) asks it for the pumps when a connection starts
// relaying, lends it that state when the program signals and at close, and never names a path
// itself.
// A fourth path is a pump in pump/, one more alternative of Pump below, one more row of
// data_path.hpp's table, and its case in Paths::choose.
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "data_path.hpp"
#include "pump/copy_pump.hpp"
#include "pump/pump.hpp"
#include "pump/sockmap_kernel.hpp"
#include "pump/sockmap_pump.hpp"
#include "pump/splice_pump.hpp"
#include "result.hpp"
#include "stats.hpp"

struct ring_buffer;

namespace zcrelay {

// In DataPath order: the alternative's index is the direction's path.
using Pump = std::variant<SplicePump, CopyPump, SockmapPump>;
static_assert(std::variant_size_v<Pump> == idx(DataPath::kCount));
static_assert(std::is_same_v<std::variant_alternative_t<idx(DataPath::Splice), Pump>, SplicePump>);
static_assert(std::is_same_v<std::variant_alternative_t<idx(DataPath::Copy), Pump>, CopyPump>);
static_assert(
    std::is_same_v<std::variant_alternative_t<idx(DataPath::Sockmap), Pump>, SockmapPump>);

// mode auto: whom a connection on splice hears from. A turn is the bytes one direction moves
// until the other moves some; a connection whose last kAutoTurns turns were each at most
// kAutoSmallTurn bytes talks request/response, and is promoted to sockmap.
struct AutoWatch {
    bool on = false;          // the connection may still be promoted
    int8_t last = -1;         // the direction that moved bytes last
    uint8_t turns = 0;        // small turns in a row, the current one not counted
    uint64_t turn_bytes = 0;  // bytes of the current turn
};

// What a connection's paths hold in the kernel beyond their pumps, for as long as it relays.
struct PathState {
    SockmapPair sockmap;    // the sockets' entries in the sockmap, if any
    AutoWatch watch;        // mode auto, while on splice
    bool promoted = false;  // mode auto: moved from splice to sockmap (once, for good)

    bool any() const { return sockmap.any(); }
};

// What the lifecycle knows of a connection when it starts relaying.
struct PathRequest {
    Mode mode;                    // the listener's
    bool unix_backend;            // the backend is a unix socket
    bool partly_read;             // the client's queue starts with a segment read in part
    uint32_t slot;                // the connection's slot in the worker
    uint64_t pipe_size;           // the listener's
    const int (&fd)[2];           // [0] client, [1] upstream
    uint32_t proxy_in;            // PROXY header bytes read from the client (outside the data path)
    uint32_t proxy_out;           // PROXY header bytes sent upstream (outside it)
    uint32_t early;               // client bytes sent on before the start (forwardEarly)
    ListenerStats& counts;        // the listener's counters
    const std::string& listener;  // its name, for the log
    unsigned auto_max;            // the listener's auto_sockmap_max
};

// What the lifecycle knows of a connection on splice that turned interactive (mode auto).
struct PromoteRequest {
    uint32_t slot;
    uint64_t pipe_size;
    const int (&fd)[2];
    uint32_t proxy_in;
    uint32_t proxy_out;
    ListenerStats& counts;
    unsigned auto_max;  // the listener's auto_sockmap_max
    uint64_t live;      // the listener's connections open on this worker, this one included
};

class Paths {
  public:
    // `sockmap` (null when the program is not loaded) holds records [base, base + 2 * max_conns)
    // for this worker's connections: two per slot.
    // `worker`: this worker's index, whose wake-up ring it reads (startSignal).
    Paths(Ring& ring, Sockmap* sockmap, uint32_t base, uint32_t max_conns, WorkerStats& stats,
          uint32_t worker);
    ~Paths();
    Paths(const Paths&) = delete;
    Paths& operator=(const Paths&) = delete;

    // Whether a connection on a listener in `mode` that read some of its client's bytes itself
    // (a PROXY header, a ClientHello) must send on what waits in the client's socket before its
    // path starts. Sockmap must: left there, they are bytes that came before the sockets
    // entered the map, moved by the sockmap pump's catch-up path: ~19 us a connection
    // (bench/run's sni workload), and a segment the relay had read the header from came back to
    // the verdict as a replay, after which that direction stalled (17 of 20 connections lost a
    // later write in the SNI routing cases, now tests/integration/sni_hello_framing_test.cpp
    // and sni_proxy_header_test.cpp). Sent on before the sockets enter the map, they cost a
    // peek, a send and a read; a send the upstream cut short leaves a read segment queued
    // again (PathRequest::partly_read), and that connection runs splice.
    bool wantsQueueSentFirst(Mode mode) const {
        return mode == Mode::Sockmap && sockmap_ != nullptr;
    }
    // Sets up `state` for the paths the listener's mode asks for and the kernel grants, and puts
    // each direction's pump in place, not started: `up` client -> upstream, `down` the other.
    void choose(const PathRequest& r, PathState& state, Pump& up, Pump& down);
    // A pump answered Step::ToCopy: `pump` becomes a copy pump, started on `p`.
    Step fallBack(Pump& pump, const PumpPort& p, PumpEnv& env, PipeFallback why);

    // mode auto, after direction `d` of a connection on splice moved `n` bytes: whether it has
    // shown the request/response pattern (AutoWatch) and should be promoted.
    static bool observe(PathState& state, int d, uint64_t n);
    // Moves a connection that observe() picked from splice to sockmap, if the worker relays few
    // enough of the listener's connections (at most auto_sockmap_max: past 2-4 busy ones the
    // kernel path's per-message work costs more than it saves, and a connection once promoted
    // cannot go back) and both splice pumps are between reads: nothing in their
    // pipes, no FIN seen. The sockets enter the maps as a new connection's do (setUpPair: what
    // arrived meanwhile is passed and moved first, and what splice wrote counts as written
    // before), and the pumps are replaced, not started. Returns a bit per direction whose pump
    // was replaced: 0 when the connection stays on splice (asked again after more turns).
    unsigned promote(const PromoteRequest& r, PathState& state, Pump& up, Pump& down,
                     PipePool& pipes);

    // The program's signal (Op::PathSignal): a poll on this worker's wake-up ring, where the
    // sockmap program writes a socket's record index when it starts passing bytes or breaks
    // (bpf/relay.bpf.c). Armed from the start while the program is loaded; nothing else wakes
    // the worker for a sockmap connection, so an idle one costs nothing.
    // Maps the wake-up ring and arms the first poll; fails only if the ring cannot be mapped.
    Result<void> startSignal();
    void armSignal();
    // After the poll fired: calls `look(slot)` for every connection slot the ring named, or, if
    // the program had to drop wake-ups (the ring was full), `look` for every slot, then arms the
    // poll again (unless `res` says it was cancelled: the worker is stopping).
    template <class Look>
    void onSignal(int res, uint32_t slots_used, Look&& look);
    // At a signal, after the pumps' own look: whether the kernel marked `state`'s stream beyond
    // repair; `side` says which socket's (0 client, 1 upstream).
    bool broken(const PathState& state, int& side) const;
    // The connection closes, its pumps aborted, its sockets still open: `state` leaves the
    // kernel (sockets out of the maps before close(): pump/sockmap_kernel.hpp).
    void tearDown(PathState& state, ListenerStats& counts);

  private:
    // Counts what a setUpPair() put in the kernel.
    void enter(PathState& state, const PairSetUp& s, ListenerStats& counts);
    // Reads the wake-up ring into woken_; true if the program lost some since the last time.
    bool drainSignal();
    static int onWake(void* self, void* data, size_t size);

    Ring& ring_;
    Sockmap* const sockmap_;
    const uint32_t base_;
    const uint32_t max_conns_;
    WorkerStats& stats_;
    const uint32_t worker_;
    ring_buffer* wake_ring_ = nullptr;  // libbpf's reader of this worker's ring
    uint64_t wake_lost_ = 0;            // Sockmap::wakeLost() at the last drain
    std::vector<uint32_t> woken_;       // record indexes of one drain (reserved: the ring's most)
    bool woken_overflow_ = false;       // a drain found more than woken_ holds
};

template <class Look>
void Paths::onSignal(int res, uint32_t slots_used, Look&& look) {
    if (res < 0) return;  // cancelled: the worker is stopping
    if (drainSignal()) {
        for (uint32_t slot = 0; slot < slots_used; ++slot) look(slot);
    } else {
        for (uint32_t index : woken_)
            if (index >= base_ && (index - base_) / 2 < max_conns_) look((index - base_) / 2);
    }
    armSignal();
}

}  // namespace zcrelay
