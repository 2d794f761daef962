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
    bool wantsQueueSentFirst(Mode mode) const { return mode == Mode::Sockmap && ownMaps(); }
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

    // The program's signal (Op::PathSignal): a poll on a wake-up ring, where the sockmap
    // program writes a socket's record index when it starts passing bytes or breaks
    // (bpf/relay.bpf.c). Nothing else wakes the worker for a sockmap connection, so an idle one
    // costs nothing. A worker reads its own ring (while the program is loaded) and each ring it
    // adopted with connections at a handover: another relay's program writes that relay's
    // worker's ring, and only one reader may consume a ring, so a ring crosses whole, with
    // every connection on it (handover.hpp).
    // Maps the worker's own ring and arms the first poll; fails only if it cannot be mapped.
    Result<void> startSignal();
    // After ring `ring`'s poll came back: calls `look(slot)` for every connection slot the ring
    // named, or, if the program had to drop wake-ups (the ring was full), `look` for every
    // slot, then arms the poll again (unless `res` says it was cancelled, or the ring is held).
    template <class Look>
    void onSignal(uint32_t ring, int res, uint32_t slots_used, Look&& look);
    // At a signal, after the pumps' own look: whether the kernel marked `state`'s stream beyond
    // repair; `side` says which socket's (0 client, 1 upstream).
    bool broken(const PathState& state, int& side) const;
    // The connection closes, its pumps aborted, its sockets still open: `state` leaves the
    // kernel (sockets out of the maps before close(): pump/sockmap_kernel.hpp).
    void tearDown(PathState& state, ListenerStats& counts);

    // ---- handover (connections_handover.cpp) ----
    // The ring `state`'s records wake, as an index into this worker's rings; -1 if none.
    int ringOf(const PathState& state) const;
    uint32_t rings() const { return static_cast<uint32_t>(rings_.size()); }
    Sockmap& ringMap(uint32_t ring) const { return *rings_[ring].map; }
    uint32_t ringIndex(uint32_t ring) const { return rings_[ring].index; }
    // Handing ring `ring` over: its poll is cancelled and not armed again; signalHeld() once
    // no poll is in flight. release() arms it again (its connections stay).
    void holdSignal(uint32_t ring);
    bool signalHeld(uint32_t ring) const { return rings_[ring].held && !rings_[ring].polling; }
    void releaseSignal(uint32_t ring);
    // The ring crossed: never read here again, and no connection is set on this worker's own
    // maps from now on (their wake-ups would go to the next relay).
    void ringHandedOver(uint32_t ring);
    // A connection of a handed-over ring could not be sent after all: the ring is read here
    // again, for what stays.
    void takeBack(uint32_t ring);
    // A connection crossed: its sockets stay in the maps, now the next relay's to take out.
    void handedOver(PathState& state);
    // A ring another relay's worker read, adopted with its connections (its map set adopted
    // first, Sockmap::adopt); returns its index here, or the ring it already has.
    Result<uint32_t> adoptRing(Sockmap& map, uint32_t index);
    // A connection adopted on `state` (its pair and map set), at `slot`: its ring names it.
    void adopt(PathState& state, uint32_t slot);
    // An adopted connection on splice on a listener in `mode`: watched for promotion as a new
    // one is (choose), its turns counted afresh.
    void watchAdopted(PathState& state, Mode mode, bool unix_backend, uint32_t slot,
                      unsigned auto_max);

  private:
    // A wake-up ring this worker reads.
    struct WakeRing {
        Sockmap* map = nullptr;
        uint32_t index = 0;             // which of the map's rings (the worker that made it)
        ring_buffer* reader = nullptr;  // libbpf's
        uint64_t lost = 0;              // Sockmap::wakeLost() at the last drain
        // Adopted: (record - first record of the ring) / 2 -> slot, UINT32_MAX for none. The
        // own ring's slots follow from the record (base_).
        std::vector<uint32_t> slot_of;
        // Adopted: record `record`'s place in slot_of (a pair's two records share one), or null.
        uint32_t* entry(uint32_t record);
        const uint32_t* entry(uint32_t record) const {
            return const_cast<WakeRing*>(this)->entry(record);
        }
        bool own = false;
        bool polling = false;  // a poll is in flight
        bool held = false;     // handing over: no poll is armed again
        bool handed = false;   // crossed to the next relay
    };

    // Counts what a setUpPair() put in the kernel.
    void enter(PathState& state, const PairSetUp& s, ListenerStats& counts);
    Result<void> openRing(WakeRing& r);
    void armSignal(uint32_t ring);
    // Reads the ring into woken_; true if the program lost some since the last time.
    bool drainSignal(WakeRing& r);
    // The slot a woken record index names on ring `r`, or UINT32_MAX.
    uint32_t slotOf(const WakeRing& r, uint32_t index) const;
    // The worker no longer counts `state`'s sockets nor hears their ring.
    void forget(PathState& state);
    // Whether connections may go on this worker's own maps (loaded, its ring not handed over).
    bool ownMaps() const { return sockmap_ != nullptr && !own_handed_; }
    static int onWake(void* self, void* data, size_t size);

    Ring& ring_;
    Sockmap* const sockmap_;
    const uint32_t base_;
    const uint32_t max_conns_;
    WorkerStats& stats_;
    const uint32_t worker_;
    std::vector<WakeRing> rings_;  // [0] the own ring, when the program is loaded
    bool own_handed_ = false;
    std::vector<uint32_t> woken_;  // record indexes of one drain (reserved: the ring's most)
    bool woken_overflow_ = false;  // a drain found more than woken_ holds
};

template <class Look>
void Paths::onSignal(uint32_t ring, int res, uint32_t slots_used, Look&& look) {
    if (ring >= rings_.size()) return;
    WakeRing& r = rings_[ring];
    r.polling = false;
    if (res < 0 || r.handed) return;  // cancelled: the worker is stopping, or handing it over
    if (drainSignal(r)) {
        for (uint32_t slot = 0; slot < slots_used; ++slot) look(slot);
    } else {
        for (uint32_t index : woken_)
            if (uint32_t slot = slotOf(r, index); slot != UINT32_MAX) look(slot);
    }
    if (!r.held) armSignal(ring);
}

}  // namespace zcrelay
