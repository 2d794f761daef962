#pragma once
// The zero-copy data path: socket -> pipe -> socket with splice(2), issued inline by the worker.
//
// Why not IORING_OP_SPLICE: the kernel always punts it to an io-wq thread (REQ_F_FORCE_ASYNC in
// io_uring/splice.c), so a blocking splice parks one kernel thread per waiting direction (101
// threads for 50 connections, measured) and capping io-wq deadlocks it. The ring tells us when
// a socket is ready; the splice itself then runs on this thread, nonblocking, and costs one
// syscall that moves up to a pipe's worth of bytes without touching them.
#include <cstdint>

#include "conn.hpp"
#include "pipe_pool.hpp"

namespace zcrelay {

struct SpliceStep {
    enum Kind : uint8_t {
        WaitRead,   // src is empty (the empty pipe stays until releaseIdlePipe)
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

// Moves what can be moved now from src to dst through d's pipe. `moved` gets the bytes written
// to dst. Never blocks.
SpliceStep pumpSplice(Direction& d, int src, int dst, PipePool& pool, uint32_t pipe_size,
                      uint64_t& moved);

// Gives an empty pipe back to the pool; false when there is none or it still holds bytes.
bool releaseIdlePipe(Direction& d, PipePool& pool);

}  // namespace zcrelay
