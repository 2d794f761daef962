#pragma once
// A relayed connection: a client socket, an upstream socket, and two directions between them.
//
// Lifecycle (Conn::state); enter() in conn.cpp is the only writer and checks every edge:
//
//   Free ─accept─▶ Accepted ─▶ [Queued] ─▶ [ReadingProxy] ─▶ [Inspecting] ─▶ Connecting ─▶ Relaying
//                     │            │              │               │             │ ▲ connect   │
//                     │            │              │               │             └─┘ retry  ok │
//                     ▼            ▼              ▼               ▼             ▼             ▼
//                  Closing ◀──────────────────────────────────────────────────────────────────
//                     │
//                     ▼ every SQE issued for the slot has completed
//                   Free
//
//   Across a takeover (handover.hpp), in the relay that hands over and in the one that adopts:
//     Relaying ─hand over─▶ HandingOver ─sent─▶ Closing (handed_over; or the drain deadline)
//        ▲                      │
//        └── the send failed ───┘
//     Free ─adopt─▶ Relaying
//
//   [ ] a step taken only when needed: Accepted and Queued may go to any later one but
//   Relaying, ReadingProxy to Inspecting or Connecting. Into Closing: refused (a
//   limit), drain, a bad or slow PROXY header, no route, no backend, every connect failed;
//   from Relaying: both directions finished, a reset or error, idle, a half-closed side silent
//   past its fin timeout, max_connection_duration, drain.
//
//   Accepted    counted in, its next step not chosen yet (within the accept's completion).
//   Queued      accepted while the listener or the process was at max_connections (accepts
//               armed before the limit was reached): held, unserved, until a connection ends.
//   ReadingProxy  accept_proxy: the client's PROXY header is awaited (proxy_reader.hpp),
//               bounded by proxy_timeout.
//   Inspecting  routes: the client's TLS ClientHello is peeked until a route can be chosen
//               (hello_reader.hpp), bounded by inspect_timeout and inspect_max_size; the bytes
//               stay in the socket for the backend.
//   Connecting  a connect to the backend the cluster picked is in flight, bounded by a linked
//               timeout; a failure tries another backend (retries) within connect_timeout.
//               Or, every backend that may take it being at its max_connections, it waits in
//               the worker's queue for a place (no upstream socket yet), up to queue_timeout
//               (upstream.hpp); a client that resets meanwhile is closed at once (QueueWatch).
//   Relaying    each direction moves bytes on its own: src readable -> pump -> dst. A FIN read on
//               src becomes shutdown(dst, SHUT_WR) once everything read before it was written,
//               and the other direction keeps flowing: one direction never ends the other.
//               An RST or error on either socket ends both (the survivor is reset too), a
//               finished side's too, which is watched for it (FinishedWatch).
//   HandingOver after a takeover (handover.hpp): its pumps' waits are cancelled, and once every
//               SQE of it has completed its sockets and pipes go to the next relay, and it
//               closes here as handed_over (or, the send failed, relays on here).
//   Closing     both fds are being cancelled and closed; the slot waits for every SQE issued for
//               it to complete (inflight == 0) before it is reused, so no stale CQE can hit a
//               new connection.
//
// Direction d reads fd[d] and writes fd[1 - d]: direction 0 is client -> upstream ("upstream"
// in metrics), direction 1 is upstream -> client ("downstream"). Each direction's bytes move
// through one pump (pump/), whose state is its own: the waits of each path are drawn in its
// header.
#include <linux/time_types.h>

#include <array>
#include <cstdint>
#include <variant>

#include "address.hpp"
#include "data_path.hpp"
#include "pump/paths.hpp"
#include "reasons.hpp"

namespace zcrelay {

enum class ConnState : uint8_t {
    Free,
    Accepted,
    Queued,
    ReadingProxy,
    Inspecting,
    Connecting,
    Relaying,
    HandingOver,
    Closing
};

struct Direction {
    bool finished = false;  // src's FIN was passed on: dst is shut down for writing
    uint32_t end_left = 0;  // max_connection_duration: what is left to read (PumpPort::end_left)
    Pump pump;

    DataPath path() const { return static_cast<DataPath>(pump.index()); }
};

struct Generation;

struct Conn {
    static constexpr uint8_t kNoRoute = UINT8_MAX;
    static constexpr uint16_t kNoCluster = UINT16_MAX;  // not chosen yet (routes: inspecting)

    ConnState state = ConnState::Free;
    uint8_t listener = 0;              // index into gen->rt->listeners
    bool counted_active = false;       // accepted and counted, not yet counted as closed
    bool counted_live = false;         // counted against max_connections (admitted)
    bool counted_source = false;       // counted against max_connections_per_source
    bool have_client = false;          // client holds the peer's address (accepted or PROXY)
    bool have_local = false;           // local holds the address the client reached
    uint8_t attempts = 0;              // connects started
    int16_t backend = -1;              // index into the cluster's backends; -1 before a pick
    uint16_t cluster = kNoCluster;     // index into gen->rt->clusters: the listener's, or the route's
    uint8_t route = kNoRoute;          // index into the listener's routes, once inspected
    bool ending = false;               // max_connection_duration: both sides shut for reading
    bool lowat = false;                // SO_RCVLOWAT on the client raised (inspecting)
    bool rested = false;               // HandingOver on sockmap: at rest, waiting for its ring
    bool holding = false;              // holds a place under its backend's max_connections
    bool watching_finished = false;    // half-closed: its finished side's reset is watched for
    Generation* gen = nullptr;         // the config generation it was accepted under
    uint64_t tried = 0;                // backends tried (bit i % 64)
    int64_t accepted_us = 0;           // wall clock at accept (access log)
    int64_t accepted_mono_us = 0;      // monotonic at accept: duration, connect budget
    int64_t connect_start_us = 0;      // monotonic at the current connect attempt (Inspecting:
                                       // at the inspection's start)
    int64_t connect_deadline_us = 0;   // monotonic: the first attempt + connect_timeout
    int64_t connect_us = -1;           // how long the successful connect took
    int64_t queued_until_ms = 0;       // in its cluster's queue until then (monotonic); 0: not
    uint64_t bytes[2] = {0, 0};        // relayed per direction (access log)
    __kernel_timespec connect_left{};  // the attempt's link timeout: read by the kernel at submit
    SocketAddress client;              // the client (after PROXY, the one it names)
    SocketAddress local;               // the address it connected to (PROXY dst)
    uint32_t generation = 0;           // bumped on every reuse of the slot
    uint32_t inflight = 0;             // SQEs issued for this slot whose CQE has not arrived
    int fd[2] = {-1, -1};              // [0] client, [1] upstream
    // Bytes outside the data path, which the sockmap barriers count (they compare the kernel's
    // counts of both sockets): the PROXY header read from the client, and the one sent on.
    uint32_t proxy_in = 0;
    uint32_t proxy_out = 0;
    PathState paths;             // what its paths hold in the kernel (pump/paths.hpp)
    int64_t last_active_ms = 0;  // monotonic ms of the last byte moved (idle timeout)
    std::array<Direction, 2> dir;
    uint32_t next_free = 0;  // free-list link while Free

    bool bothFinished() const { return dir[0].finished && dir[1].finished; }
};

// Whether the diagram above draws an edge from `from` to `to`.
bool isEdge(ConnState from, ConnState to);
// Moves c to `to`. An edge the diagram above does not draw is a bookkeeping bug: logged, and
// fatal in debug and sanitizer builds.
void enter(Conn& c, ConnState to);
const char* name(ConnState s);

// An SQE for connection c (in `slot`), tagged with its slot, generation and direction and
// counted in its inflight: the slot is not reused before the CQE has come back.
inline io_uring_sqe* connSqe(Ring& ring, Conn& c, uint32_t slot, Op op, int d = 0) {
    io_uring_sqe* sqe = ring.sqe();
    io_uring_sqe_set_data64(sqe, UserData{op, static_cast<uint8_t>(d), slot, c.generation}.pack());
    ++c.inflight;
    return sqe;
}

// Which metric reason an error on direction d's src (read side) or dst (write side) means.
inline CloseReason resetReason(int dir, bool on_src) {
    int side = on_src ? dir : 1 - dir;  // 0 = client socket, 1 = upstream socket
    return side == 0 ? CloseReason::ClientReset : CloseReason::UpstreamReset;
}

}  // namespace zcrelay
