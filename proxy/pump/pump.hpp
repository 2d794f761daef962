#pragma once
// What the three data paths share: how a pump is driven and what it answers.
//
// A pump owns one direction of one connection on one path (splice_pump.hpp, copy_pump.hpp,
// sockmap_pump.hpp): its waits, its pipe or buffers, its kernel bookkeeping. The connection's
// lifecycle (the worker) hands it the completions of the SQEs it issued and gets back a Step:
// bytes moved, and what happens to the direction. A pump never closes its connection, never
// counts the connection's lifecycle and never looks at the other direction; what it needs to
// know about the sockets it is told in its PumpPort.
//
// Every pump answers the same calls, so the worker drives them all alike (std::visit):
//   Step start(port, env)                         the connection is relaying: arm the first wait
//   Step onCompletion(port, env, op, res, flags, aux)
//                                                 a CQE of an SQE it issued (aux: its user_data's)
//   Step resume(port, env)                        after Step::starved: buffers came back
//   Step scan(port, env)                          the sockmap program signalled this connection
//   uint64_t kernelBytes(env)                     bytes the kernel moved without it, since last asked
//   void quiet(env)                               a tick with no bytes: give back what idles
//   void abort(port, env)                         the connection closes: release, cancel timers
//   void reclaim(env)                             the slot is freed, nothing in flight: buffers back
#include <liburing.h>

#include <cstdint>

#include "reasons.hpp"
#include "stats.hpp"
#include "uring/ring.hpp"
#include "uring/user_data.hpp"

namespace zcrelay {

class BufRing;
class PipePool;
class Sockmap;
class ZerocopyHolds;

// A pump's verdict after it started or handled a completion.
struct Step {
    enum Kind : uint8_t {
        Wait,      // something is armed (or, copy, the direction waits for a free buffer)
        Finished,  // src's FIN was passed on: dst is shut down for writing
        Failed,    // a socket error: on_src says which socket, error the errno
        ToCopy,    // splice: no pipe can be had; the direction moves by copy from now on
        Broken,    // sockmap: the kernel gave the program a stream it cannot relay exactly;
                   // on_src says which socket's. Both peers must be reset.
    };
    Kind kind = Wait;
    bool on_src = false;
    bool active = false;   // progress without bytes of its own (the idle timeout counts it)
    bool starved = false;  // copy: no buffer was free; resume() once some came back
    int error = 0;
    PipeFallback fallback = PipeFallback::PoolExhausted;  // ToCopy: why
    uint64_t moved = 0;  // bytes this step put on dst (or, sockmap, saw the kernel move)

    static Step failed(bool on_src, int error) {
        Step s;
        s.fail(on_src, error);
        return s;
    }
    // Keeps what the step moved before it failed: those bytes did reach dst.
    void fail(bool src, int err) {
        kind = Failed;
        on_src = src;
        error = err;
    }
};

// The direction a pump works on, as its connection lends it for one call: the two sockets,
// what is known about them, and SQEs tagged for this connection and direction. Every SQE it
// hands out is counted in the connection's inflight, so the slot is not reused before its CQE
// has come back.
struct PumpPort {
    Ring& ring;
    uint64_t tag;  // UserData of the connection and direction, op left 0
    uint32_t& inflight;
    uint8_t dir;  // 0: client -> upstream, 1: upstream -> client
    int src;
    int dst;
    bool src_write_shut;    // the other direction finished: src's writing side is shut down
    uint32_t pipe_size;     // the listener's pipe_size (splice grows a busy pipe to it)
    ListenerStats& counts;  // the counters of the listener the connection came in on
    // max_connection_duration: the connection is being ended, both sources shut for reading.
    // A pump then keeps its FIN (the lifecycle sends both once both directions are done: a
    // socket that has sent its FIN with its reading side shut answers any byte that still comes
    // with an RST, tcp_rcv_state_process() in FIN_WAIT1/2), and a reset source, which is that
    // RST's echo on a socket already half-closed, ends its direction like a FIN.
    bool ending = false;
    // While ending: what src held when the end began (endForDuration), less what has been read
    // since; at 0 the direction reads no more. TCP goes on queueing what the peer sends after
    // shutdown(SHUT_RD), and a read returns it, so "read until empty" would chase a client that
    // keeps uploading until the grace reset it. Null while not ending. A splice direction reads
    // at most this much; a copy direction's recv may already be armed for a whole buffer, so it
    // can take one buffer past it, never more. A sockmap direction counts what its program
    // passed instead (sockmap_pump.hpp): its bytes do not wait in src's receive queue.
    uint32_t* end_left = nullptr;
    // send_zerocopy: the listener lets large copy sends lend their buffer to the kernel
    // (copy_pump.hpp).
    bool zerocopy = false;
    // Handing over to the next relay (handover.hpp): the direction sends what it holds and
    // reads nothing more, and arms no watch, so that nothing of it is left in flight.
    bool handing = false;

    // `aux` goes into the SQE's user_data beside the op (uring/user_data.hpp).
    io_uring_sqe* sqe(Op op, uint8_t aux = 0) const {
        io_uring_sqe* s = ring.sqe();
        io_uring_sqe_set_data64(s, tag | UserData::opBits(op, aux));
        ++inflight;
        return s;
    }
};

// What a worker's pumps share: its buffer ring, its pipes, its counters, and
// what the kernel offers for zero-copy sends (uring/ring.hpp).
struct PumpEnv {
    BufRing& bufs;
    PipePool& pipes;
    WorkerStats& stats;
    SendZcSupport send_zc;
    // The buffers zero-copy sends have lent to the kernel, a bounded share of `bufs`: a peer that
    // stops acknowledging keeps its direction's, and a few such peers must not take the pool
    // every recv needs (pump/copy_pump.hpp).
    ZerocopyHolds& holds;
};

// A sockmap direction at rest (sockmap_pump.hpp): its phase, and its counts of what the
// program and user space moved, which its records in the maps go on from.
struct SockmapResting {
    uint8_t phase = 0;
    bool stopped = false;
    uint32_t src_skipped = 0;
    uint32_t dst_extra = 0;
    uint64_t dst_before = 0;
    uint64_t seen = 0;
    uint64_t taken = 0;
    uint64_t end_passed = UINT64_MAX;
    uint64_t consumed = 0;
    uint64_t copied = 0;
};

// A direction at rest: nothing of it armed, and nothing held in user space. What another
// process needs to resume it (handover.hpp) beside its sockets and, on splice, its pipe.
struct RestingDirection {
    bool finished = false;  // src's FIN was passed on: dst is shut down for writing
    bool eof = false;       // src's end was read; the bytes before it may still be in the pipe
    bool hup = false;       // a watch saw src's FIN, not read yet
    uint32_t in_pipe = 0;   // splice: bytes in the pipe, which crosses with them
    bool copy = false;      // on the copy path
    bool sockmap = false;   // on the sockmap path, at `kernel`
    SockmapResting kernel;
};

// A watch on src while its direction is not reading it. POLLRDHUP alone does not fire on data
// (no wake-up per segment), only on FIN; POLLERR and POLLHUP are always reported, so an RST
// on a source nobody reads is noticed at once.
struct SourceWatch {
    bool armed = false;
    bool hup = false;  // src's FIN was seen; the bytes before it are still to be read

    // Not once the FIN was seen: the condition is level-triggered and would fire at once,
    // every time.
    void arm(const PumpPort& p, bool eof);
    // Errors only (POLLERR | POLLHUP), for a source that is done but still written to.
    void armErrors(const PumpPort& p);
};

// The errno a POLLERR on `fd` stands for (SO_ERROR, which it reads and clears), ECONNRESET if
// the socket reports none.
int pendingError(int fd);

// max_connection_duration, for a direction's source: shuts its reading side (a read then
// returns what is queued, then 0, and whoever waits on it wakes) and returns how many bytes were
// queued then (SIOCINQ), which is all the direction reads from now on (PumpPort::end_left).
uint32_t endForDuration(int src);

}  // namespace zcrelay
