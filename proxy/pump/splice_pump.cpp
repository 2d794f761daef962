#include "pump/splice_pump.hpp"

#include <fcntl.h>
#include <sys/socket.h>

#include <cerrno>

namespace zcrelay {
namespace {

constexpr unsigned kSpliceFlags = SPLICE_F_NONBLOCK | SPLICE_F_MOVE;
// A read shorter than this and shorter than asked is taken to have emptied src (see below).
constexpr ssize_t kSmallRead = 16 * 1024;

enum class ReadResult { Progress, Blocked, Eof, NotEof, Error };

// splice() from a TCP socket returns 0 at EOF, but relays have shipped truncation bugs by
// trusting it (HAProxy #2505: a 0 that was really "no pipe memory"). A peek settles it: 0 from
// recv() is a FIN, anything else means bytes are still waiting.
ReadResult confirmEof(int src, int& error) {
    char c;
    ssize_t r = ::recv(src, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r == 0) return ReadResult::Eof;
    if (r > 0) return ReadResult::NotEof;
    if (errno == EAGAIN || errno == EINTR) return ReadResult::Blocked;
    error = errno;
    return ReadResult::Error;
}

}  // namespace

bool releaseIdlePipe(Direction& d, PipePool& pool) {
    if (!d.pipe.valid() || d.in_pipe != 0) return false;
    pool.release(d.pipe);
    return true;
}

SpliceStep pumpSplice(Direction& d, int src, int dst, PipePool& pool, uint32_t pipe_size,
                      uint64_t& moved) {
    moved = 0;
    if (!d.pipe.valid()) {
        auto pipe = pool.acquire();
        if (!pipe) return SpliceStep{SpliceStep::NeedCopy, false, 0, pipe.error()};
        d.pipe = *pipe;
    }
    bool stuck_nonempty = false;  // a 0-byte splice with data still waiting on src
    for (;;) {
        bool progress = false;
        bool src_emptied = false;
        if (!d.eof && d.in_pipe < d.pipe.capacity) {
            uint32_t asked = d.pipe.capacity - d.in_pipe;
            ssize_t n = ::splice(src, nullptr, d.pipe.write_fd, nullptr, asked, kSpliceFlags);
            if (n > 0) {
                d.in_pipe += static_cast<uint32_t>(n);
                progress = true;
                src_emptied = n < kSmallRead && static_cast<uint32_t>(n) < asked;
                // A full pipe means this flow is bulk: let it have the listener's pipe_size.
                if (d.in_pipe == d.pipe.capacity) pool.grow(d.pipe, pipe_size);
            } else if (n == 0) {
                int err = 0;
                switch (confirmEof(src, err)) {
                    case ReadResult::Eof:
                        d.eof = true;
                        break;
                    case ReadResult::NotEof:
                        stuck_nonempty = true;
                        break;
                    case ReadResult::Error:
                        return SpliceStep{SpliceStep::Failed, true, err, {}};
                    default:
                        break;
                }
            } else if (errno != EAGAIN && errno != EINTR) {
                return SpliceStep{SpliceStep::Failed, true, errno, {}};
            }
            // EAGAIN here is ambiguous: src is empty, or the pipe has no free slot (each skb
            // fragment takes a slot however small, so a 64 KiB pipe can be "full" at 23 KiB).
            // It is only read as "src empty" below, when the pipe is empty too.
        }
        if (d.in_pipe > 0) {
            ssize_t n = ::splice(d.pipe.read_fd, nullptr, dst, nullptr, d.in_pipe, kSpliceFlags);
            if (n > 0) {
                d.in_pipe -= static_cast<uint32_t>(n);
                moved += static_cast<uint64_t>(n);
                progress = true;
            } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
                return SpliceStep{SpliceStep::Failed, false, errno, {}};
            }
        }
        if (!progress) break;
        // A small message went through whole: src is almost surely empty, and asking again
        // costs a splice that returns EAGAIN, one syscall in three on a request/response
        // stream. Wait for POLLIN instead. If src did have more (a pipe can run out of slots
        // before bytes), nothing stalls: io_uring polls once when the poll is armed and
        // completes it at once.
        if (src_emptied && d.in_pipe == 0) break;
    }
    if (d.in_pipe > 0) return SpliceStep{SpliceStep::WaitWrite, false, 0, {}};
    if (d.eof) {
        pool.release(d.pipe);
        // Everything read before the FIN has been written: pass the FIN on. ENOTCONN means dst
        // is already gone, which its own direction will report.
        ::shutdown(dst, SHUT_WR);
        return SpliceStep{SpliceStep::Finished, false, 0, {}};
    }
    if (stuck_nonempty) {
        // src has bytes, the pipe is empty and splice still moved nothing: the kernel cannot
        // give this pipe pages. Copy is the only way left to make progress.
        pool.release(d.pipe);
        return SpliceStep{SpliceStep::NeedCopy, false, 0, PipeFallback::PipeLimit};
    }
    // The pipe is empty but stays with the direction: a bulk flow goes quiet between bursts
    // thousands of times per GiB, and handing the pipe back each time would shrink and regrow
    // it (two F_SETPIPE_SZ) per burst. The worker's sweep takes back pipes of directions that
    // stayed idle (releaseIdlePipe), so idle connections still hold none.
    return SpliceStep{SpliceStep::WaitRead, false, 0, {}};
}

}  // namespace zcrelay
