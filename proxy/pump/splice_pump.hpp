#pragma once
// The zero-copy data path: socket -> pipe -> socket with splice(2), issued inline by the worker.
//
// Why not IORING_OP_SPLICE: the kernel always punts it to an io-wq thread (REQ_F_FORCE_ASYNC in
// io_uring/splice.c), so a blocking splice parks one kernel thread per waiting direction (101
// threads for 50 connections, measured) and capping io-wq deadlocks it. The ring tells us when
// a socket is ready; the splice itself then runs on this thread, nonblocking, and costs one
// syscall that moves up to a pipe's worth of bytes without touching them.
//
// A splice direction is in one of these waits at any time:
//   waiting to read   src has no data: a POLLIN is armed on src; the direction holds at most
//                     an empty pipe (given back by the sweep if it stays quiet).
//   waiting to write  dst's send buffer is full: a POLLOUT is armed on dst, and a watch on src
//                     so an RST there is noticed at once.
//   finished          src sent FIN and all of it reached dst, which was shut down for writing.
#include <cstdint>

#include "pipe_pool.hpp"
#include "pump/pump.hpp"

namespace zcrelay {

// What one round of inline splices found.
struct SpliceStep {
    enum Kind : uint8_t {
        WaitRead,   // src is empty (the empty pipe stays until releaseIdle)
        WaitWrite,  // dst is full and the pipe holds bytes
        Finished,   // src reached EOF, everything was delivered, dst was shut down
        NeedCopy,   // no pipe could be had: move this direction by copy (reason in fallback)
        Failed,     // a socket error; on_src says which socket
    };
    Kind kind = WaitRead;
    bool on_src = false;
    int error = 0;
    PipeFallback fallback = PipeFallback::PoolExhausted;
};

class SplicePump {
  public:
    // Arms the first POLLIN.
    Step start(const PumpPort& p, PumpEnv& env);
    // PollIn, PollOut and Watch completions.
    Step onCompletion(const PumpPort& p, PumpEnv& env, Op op, int res, uint32_t flags,
                      uint8_t aux);
    Step resume(const PumpPort&, PumpEnv&) { return {}; }
    Step scan(const PumpPort&, PumpEnv&) { return {}; }
    uint64_t kernelBytes(PumpEnv&) { return 0; }
    // The pipe of a direction that stayed quiet through a tick goes back to the pool.
    void quiet(PumpEnv& env) { releaseIdle(env.pipes); }
    // The connection closes: the pipe goes back, or is discarded with bytes never delivered.
    void abort(const PumpPort& p, PumpEnv& env);
    void reclaim(PumpEnv&) {}
    // Moves what can be moved now from src to dst through the pipe; `moved` gets the bytes
    // written to dst. Never blocks, arms nothing (start/onCompletion do).
    // `ending`, `end_left`: PumpPort::ending and PumpPort::end_left.
    SpliceStep move(int src, int dst, PipePool& pool, uint32_t pipe_size, uint64_t& moved,
                    bool ending = false, uint32_t* end_left = nullptr);
    // Gives an empty pipe back to the pool; false when there is none or it still holds bytes.
    bool releaseIdle(PipePool& pool);
    // A direction that falls back to copy keeps its watch on src (one poll per socket).
    const SourceWatch& watch() const { return watch_; }

    // Nothing in the pipe, no write waiting, no FIN seen: the direction only waits for src
    // (mode auto promotes a connection only then).
    bool betweenReads() const {
        return in_pipe_ == 0 && !eof_ && !done_ && !poll_out_ && !watch_.hup;
    }

    uint32_t inPipe() const { return in_pipe_; }
    const Pipe& pipe() const { return pipe_; }

    // ---- handover (handover.hpp): what crosses to the next relay, once nothing is armed. The
    // pipe crosses with it only when it holds bytes (the caller sends pipe()'s fds); an empty
    // one stays in this relay's pool (abort()).
    RestingDirection resting() const {
        return {done_, eof_, watch_.hup, in_pipe_, false, false, {}};
    }
    // A direction the previous relay handed over, its pipe (holding d.in_pipe bytes) adopted.
    static SplicePump adopted(const RestingDirection& d, Pipe pipe);
    // Its waits were cancelled (a handover that failed) or never armed here (adopted): moves
    // what can move now, and arms the wait it is then in.
    Step restart(const PumpPort& p, PumpEnv& env);

  private:
    Step pump(const PumpPort& p, PumpEnv& env);
    void armPollIn(const PumpPort& p);

    Pipe pipe_;              // held only while bytes are moving (and through short pauses)
    uint32_t in_pipe_ = 0;   // bytes read into the pipe and not yet written out
    bool eof_ = false;       // src returned end of stream
    bool done_ = false;      // the FIN was passed on
    bool poll_in_ = false;   // POLLIN armed on src
    bool poll_out_ = false;  // POLLOUT armed on dst
    SourceWatch watch_;
};

}  // namespace zcrelay
