#pragma once
// The path table: which pump each direction of a connection runs, and the kernel state a path
// keeps per connection beside its two pumps (sockmap: both sockets' entries in the maps, and
// their records). The lifecycle (connections.cpp) asks it for the pumps when a connection starts
// relaying, lends it that state at the 10 ms scan and at close, and never names a path itself.
// A fourth path is a pump in pump/, one more alternative of Pump below, one more row of
// data_path.hpp's table, and its case in Paths::choose.
#include <cstdint>
#include <string>
#include <variant>

#include "data_path.hpp"
#include "pump/copy_pump.hpp"
#include "pump/pump.hpp"
#include "pump/sockmap_kernel.hpp"
#include "pump/sockmap_pump.hpp"
#include "pump/splice_pump.hpp"
#include "stats.hpp"

namespace zcrelay {

// In DataPath order: the alternative's index is the direction's path.
using Pump = std::variant<SplicePump, CopyPump, SockmapPump>;
static_assert(std::variant_size_v<Pump> == idx(DataPath::kCount));
static_assert(std::is_same_v<std::variant_alternative_t<idx(DataPath::Splice), Pump>, SplicePump>);
static_assert(std::is_same_v<std::variant_alternative_t<idx(DataPath::Copy), Pump>, CopyPump>);
static_assert(
    std::is_same_v<std::variant_alternative_t<idx(DataPath::Sockmap), Pump>, SockmapPump>);

// What a connection's paths hold in the kernel beyond their pumps, for as long as it relays.
struct PathState {
    SockmapPair sockmap;  // the sockets' entries in the sockmap, if any

    bool any() const { return sockmap.any(); }
};

// What the lifecycle knows of a connection when it starts relaying.
struct PathRequest {
    DataPath mode;          // the listener's
    bool unix_backend;      // the backend is a unix socket
    bool partly_read;       // the client's queue starts with a segment read in part
    uint32_t slot;          // the connection's slot in the worker
    uint64_t pipe_size;     // the listener's
    const int (&fd)[2];     // [0] client, [1] upstream
    uint32_t proxy_in;      // PROXY header bytes read from the client (outside the data path)
    uint32_t proxy_out;     // PROXY header bytes sent upstream (outside it)
    uint32_t early;         // client bytes sent on before the start (forwardEarly)
    ListenerStats& counts;  // the listener's counters
    const std::string& listener;  // its name, for the log
};

class Paths {
  public:
    // `sockmap` (null when the program is not loaded) holds records [base, base + 2 * max_conns)
    // for this worker's connections: two per slot.
    Paths(Ring& ring, Sockmap* sockmap, uint32_t base, uint32_t max_conns, WorkerStats& stats);

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
    bool wantsQueueSentFirst(DataPath mode) const {
        return mode == DataPath::Sockmap && sockmap_ != nullptr;
    }
    // Sets up `state` for the paths the listener's mode asks for and the kernel grants, and puts
    // each direction's pump in place, not started: `up` client -> upstream, `down` the other.
    void choose(const PathRequest& r, PathState& state, Pump& up, Pump& down);
    // A pump answered Step::ToCopy: `pump` becomes a copy pump, started on `p`.
    Step fallBack(Pump& pump, const PumpPort& p, PumpEnv& env, PipeFallback why);

    // The scan's timer (Op::PathScan): armed while some connection holds state, every 10 ms.
    // The sockmap program never wakes user space: passed bytes are found by reading the
    // records, which are mapped into our memory, so a scan costs no syscall (~2 ns per
    // connection). While passed bytes wait, their socket's receive window closes: the scan
    // period bounds that stall.
    bool scanning() const { return holders_ > 0; }
    void armScan();
    // At the scan, after the pumps' own: whether the kernel marked `state`'s stream beyond
    // repair; `side` says which socket's (0 client, 1 upstream).
    bool broken(const PathState& state, int& side) const;
    // The connection closes, its pumps aborted, its sockets still open: `state` leaves the
    // kernel (sockets out of the maps before close(): pump/sockmap_kernel.hpp).
    void tearDown(PathState& state, ListenerStats& counts);

  private:
    Ring& ring_;
    Sockmap* const sockmap_;
    const uint32_t base_;
    const uint32_t max_conns_;
    WorkerStats& stats_;
    uint32_t holders_ = 0;  // connections whose state is in the kernel; the scan runs while > 0
};

}  // namespace zcrelay
