#pragma once
// A relayed connection: a client socket, an upstream socket, and two directions between them.
//
// Lifecycle (Conn::state):
//
//   Free ─accept─▶ [Queued] ─▶ [ReadingProxy] ─▶ Connecting ─connect ok─▶ Relaying ─both Finished─▶ Closing ─▶ Free
//                        │               │  ▲ retry              │                         ▲
//                        │               └──┘ (another backend)  │                         │
//                        └─bad/slow header──┴─no backend, all connects failed──┴─reset, error, idle, drain─┘
//
//   Queued      accepted while the listener or the process was at max_connections (accepts
//               armed before the limit was reached): held, unserved, until a connection ends.
//   ReadingProxy  accept_proxy: the client's PROXY header is awaited (SO_RCVLOWAT makes the
//               kernel wake us only once the bytes the parser needs are there), bounded by
//               proxy_timeout.
//   Connecting  a connect to the backend the cluster picked is in flight, bounded by a linked
//               timeout; a failure tries another backend (retries) within connect_timeout.
//   Relaying    each direction moves bytes on its own: src readable -> pump -> dst. A FIN read on
//               src becomes shutdown(dst, SHUT_WR) once everything read before it was written,
//               and the other direction keeps flowing: one direction never ends the other.
//               An RST or error on either socket ends both (the survivor is reset too).
//   Closing     both fds are being cancelled and closed; the slot waits for every SQE issued for
//               it to complete (inflight == 0) before it is reused, so no stale CQE can hit a
//               new connection.
//
// Direction d reads fd[d] and writes fd[1 - d]: direction 0 is client -> upstream ("upstream"
// in metrics), direction 1 is upstream -> client ("downstream").
//
// A direction, in the splice and copy paths, is in one of these waits at any time:
//   waiting to read   its src has no data: a POLLIN (splice) or a recv (copy) is armed on src;
//                     the direction holds no pipe and no buffer.
//   waiting to write  dst's send buffer is full: a POLLOUT (splice) or a send (copy) is armed on
//                     dst, and a POLLRDHUP watch on src so an RST there is noticed at once.
//   finished          src sent FIN and all of it reached dst, which was shut down for writing.
// A sockmap direction waits for src's FIN (POLLRDHUP) while the kernel moves its bytes, and
// otherwise for a barrier (the kernel's backlog to reach dst) or, moving passed bytes, as copy.
#include <linux/time_types.h>

#include <array>
#include <cstdint>

#include "address.hpp"
#include "data_path.hpp"
#include "pipe_pool.hpp"
#include "reasons.hpp"

namespace zcrelay {

enum class ConnState : uint8_t { Free, Queued, ReadingProxy, Connecting, Relaying, Closing };


// Copy path: buffers received on src and not yet fully sent to dst, in order. Bounded: recv is
// re-armed only while there is room, which is the backpressure.
struct CopyChunk {
    uint16_t bid = 0;
    uint32_t len = 0;
    uint32_t sent = 0;
};

struct CopyQueue {
    static constexpr uint8_t kCapacity = 4;
    std::array<CopyChunk, kCapacity> items;
    uint8_t head = 0;
    uint8_t count = 0;

    bool empty() const { return count == 0; }
    bool full() const { return count == kCapacity; }
    CopyChunk& front() { return items[head]; }
    void push(CopyChunk c) { items[(head + count++) % kCapacity] = c; }
    void pop() {
        head = (head + 1) % kCapacity;
        --count;
    }
};

struct Direction {
    DataPath path = DataPath::Splice;
    bool eof = false;         // src returned end of stream
    bool finished = false;    // eof propagated: dst shut down for writing
    bool poll_in = false;     // POLLIN armed on src
    bool watch = false;       // POLLRDHUP watch armed on src (while not reading it)
    bool src_hup = false;     // the watch saw src's FIN; the data before it is still to be read
    bool poll_out = false;    // POLLOUT armed on dst
    bool recv_armed = false;  // copy: a recv on src in flight
    bool send_armed = false;  // copy: a send on dst in flight
    Pipe pipe;                // splice: held only while bytes are moving
    uint32_t in_pipe = 0;     // splice: bytes read into the pipe and not yet written out
    CopyQueue queue;          // copy: buffers in flight
    // Sockmap (pump/sockmap_pump.hpp): the kernel redirects; these track what is left to us.
    bool catching_up = false;    // passed bytes wait for dst to queue all redirected before them
    bool user_copy = false;      // passed bytes are moving by copy (recv/send, the queue above)
    bool barrier_armed = false;  // a timer to look at a barrier (or the EOF) again
    uint8_t barrier_step = 0;    // how many times it waited in a row (the back-off)
    uint64_t bpf_seen = 0;       // record.redirected already added to the metrics
    uint64_t taken = 0;          // passed bytes received by user space
    uint64_t consumed = 0;       // of those, bytes sent to dst or skipped (mirrored in the record)
    uint64_t copied = 0;         // of those, bytes sent to dst
    uint64_t barrier_left = 0;   // bytes the barrier still waited for last time
    // Bytes outside the data path, for the barriers (they compare the kernel's counts of both
    // sockets): read from src by the worker (a PROXY header taken) and written to dst by it (a
    // PROXY header sent).
    uint32_t src_skipped = 0;
    uint32_t dst_extra = 0;

    bool waitingToWrite() const { return in_pipe > 0 || !queue.empty(); }
};

struct Generation;

struct Conn {
    ConnState state = ConnState::Free;
    uint8_t listener = 0;              // index into gen->rt->listeners
    bool counted_active = false;       // accepted and counted, not yet counted as closed
    bool counted_live = false;         // counted against max_connections (admitted)
    bool counted_source = false;       // counted against max_connections_per_source
    bool have_client = false;          // client holds the peer's address (accepted or PROXY)
    bool have_local = false;           // local holds the address the client reached
    uint8_t attempts = 0;              // connects started
    int16_t backend = -1;              // index into the cluster's backends; -1 before a pick
    Generation* gen = nullptr;         // the config generation it was accepted under
    uint64_t tried = 0;                // backends tried (bit i % 64)
    int64_t accepted_us = 0;           // wall clock at accept (access log)
    int64_t accepted_mono_us = 0;      // monotonic at accept: duration, connect budget
    int64_t connect_start_us = 0;      // monotonic at the current connect attempt
    int64_t connect_deadline_us = 0;   // monotonic: the first attempt + connect_timeout
    int64_t connect_us = -1;           // how long the successful connect took
    uint64_t bytes[2] = {0, 0};        // relayed per direction (access log)
    __kernel_timespec connect_left{};  // the attempt's link timeout: read by the kernel at submit
    SocketAddress client;              // the client (after PROXY, the one it names)
    SocketAddress local;               // the address it connected to (PROXY dst)
    uint32_t generation = 0;           // bumped on every reuse of the slot
    uint32_t inflight = 0;             // SQEs issued for this slot whose CQE has not arrived
    int fd[2] = {-1, -1};              // [0] client, [1] upstream
    uint64_t cookie[2] = {0, 0};       // sockmap: SO_COOKIE of fd[i], its key in the maps
    bool linked[2] = {false, false};   // sockmap: fd[i] has an entry in zcr_links
    bool in_map[2] = {false, false};   // sockmap: fd[i] is in the SOCKHASH
    uint32_t record = 0;         // sockmap: the index of fd[0]'s counters; fd[1]'s is record + 1
    int64_t last_active_ms = 0;  // monotonic ms of the last byte moved (idle timeout)
    std::array<Direction, 2> dir;
    uint32_t next_free = 0;  // free-list link while Free

    bool bothFinished() const { return dir[0].finished && dir[1].finished; }
};

// Which metric reason an error on direction d's src (read side) or dst (write side) means.
inline CloseReason resetReason(int dir, bool on_src) {
    int side = on_src ? dir : 1 - dir;  // 0 = client socket, 1 = upstream socket
    return side == 0 ? CloseReason::ClientReset : CloseReason::UpstreamReset;
}

}  // namespace zcrelay
