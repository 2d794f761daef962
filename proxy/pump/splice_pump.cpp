#include "pump/splice_pump.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
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

bool SplicePump::releaseIdle(PipePool& pool) {
    if (!pipe_.valid() || in_pipe_ != 0) return false;
    pool.release(pipe_);
    return true;
}

void SplicePump::abort(const PumpPort&, PumpEnv& env) {
    PipePool& pool = env.pipes;
    if (!pipe_.valid()) return;
    // Bytes still in a pipe were never delivered; the connection is gone, so are they.
    if (in_pipe_ == 0)
        pool.release(pipe_);
    else
        pool.discard(pipe_);
    in_pipe_ = 0;
}

SplicePump SplicePump::adopted(const RestingDirection& d, Pipe pipe) {
    SplicePump pump;
    pump.pipe_ = pipe;
    pump.in_pipe_ = pipe.valid() ? d.in_pipe : 0;
    pump.eof_ = d.eof;
    pump.done_ = d.finished;
    pump.watch_.hup = d.hup;
    return pump;
}

Step SplicePump::restart(const PumpPort& p, PumpEnv& env) {
    poll_in_ = false;
    poll_out_ = false;
    watch_.armed = false;
    // Bytes in the pipe, or an end seen: move now. Otherwise wait as start() does: a poll checks
    // readiness when armed, so what src holds is not missed, and an idle direction takes no
    // pipe (thousands adopted at once would otherwise take two fds each until the next sweep).
    if (in_pipe_ > 0 || eof_ || watch_.hup || done_) return pump(p, env);
    armPollIn(p);
    return {};
}

Step SplicePump::start(const PumpPort& p, PumpEnv&) {
    armPollIn(p);
    return {};
}

void SplicePump::armPollIn(const PumpPort& p) {
    if (poll_in_) return;
    // One-shot poll: a level-triggered check at arm time, so data that arrived while no poll
    // was armed is seen at once, and no stream of wake-ups while we are busy elsewhere.
    io_uring_prep_poll_add(p.sqe(Op::PollIn), p.src, POLLIN | POLLRDHUP);
    poll_in_ = true;
}

Step SplicePump::onCompletion(const PumpPort& p, PumpEnv& env, Op op, int res, uint32_t /*flags*/,
                              uint8_t /*aux*/) {
    switch (op) {
        case Op::PollIn:
            poll_in_ = false;
            break;
        case Op::PollOut:
            poll_out_ = false;
            break;
        case Op::Watch:
            watch_.armed = false;
            if (res < 0) return {};
            if (res & POLLERR) return Step::failed(true, pendingError(p.src));
            // POLLRDHUP alone: a FIN, which the direction reads in order once dst drains.
            watch_.hup = true;
            return {};
        default:
            return {};
    }
    if (res < 0) return {};  // cancelled: the connection is closing
    return pump(p, env);
}

Step SplicePump::pump(const PumpPort& p, PumpEnv& env) {
    Step out;
    if (done_) return out;
    SpliceStep step = move(p.src, p.dst, env.pipes, p.pipe_size, out.moved, p.ending, p.end_left);
    switch (step.kind) {
        case SpliceStep::WaitRead:
            env.stats.splice_eagain[p.dir][0].add();
            armPollIn(p);
            break;
        case SpliceStep::WaitWrite:
            env.stats.splice_eagain[p.dir][1].add();
            if (!poll_out_) {
                io_uring_prep_poll_add(p.sqe(Op::PollOut), p.dst, POLLOUT);
                poll_out_ = true;
            }
            // While it waits for dst it does not read src: only the watch sees an RST there.
            watch_.arm(p, eof_);
            break;
        case SpliceStep::Finished:
            done_ = true;
            out.kind = Step::Finished;
            break;
        case SpliceStep::NeedCopy:
            out.kind = Step::ToCopy;
            out.fallback = step.fallback;
            break;
        case SpliceStep::Failed:
            out.kind = Step::Failed;
            out.on_src = step.on_src;
            out.error = step.error;
            break;
    }
    return out;
}

SpliceStep SplicePump::move(int src, int dst, PipePool& pool, uint32_t pipe_size, uint64_t& moved,
                            bool ending, uint32_t* end_left) {
    Pipe& pipe = pipe_;
    uint32_t& in_pipe = in_pipe_;
    bool& eof = eof_;
    moved = 0;
    if (!pipe.valid()) {
        auto fresh = pool.acquire();
        if (!fresh) return SpliceStep{SpliceStep::NeedCopy, false, 0, fresh.error()};
        pipe = *fresh;
    }
    bool stuck_nonempty = false;  // a 0-byte splice with data still waiting on src
    for (;;) {
        bool progress = false;
        bool src_emptied = false;
        if (end_left && *end_left == 0) eof = true;  // what came before the end is read
        if (!eof && in_pipe < pipe.capacity) {
            uint32_t asked = pipe.capacity - in_pipe;
            if (end_left) asked = std::min(asked, *end_left);
            ssize_t n = ::splice(src, nullptr, pipe.write_fd, nullptr, asked, kSpliceFlags);
            if (n > 0) {
                if (end_left) *end_left -= static_cast<uint32_t>(n);  // n <= asked <= *end_left
                in_pipe += static_cast<uint32_t>(n);
                progress = true;
                src_emptied = n < kSmallRead && static_cast<uint32_t>(n) < asked;
                // A full pipe means this flow is bulk: let it have the listener's pipe_size.
                if (in_pipe == pipe.capacity) pool.grow(pipe, pipe_size);
            } else if (n == 0) {
                int err = 0;
                switch (confirmEof(src, err)) {
                    case ReadResult::Eof:
                        eof = true;
                        break;
                    case ReadResult::NotEof:
                        stuck_nonempty = true;
                        break;
                    case ReadResult::Error:
                        if (ending && err == ECONNRESET) {  // see PumpPort::ending
                            eof = true;
                            break;
                        }
                        return SpliceStep{SpliceStep::Failed, true, err, {}};
                    default:
                        break;
                }
            } else if (ending && errno == ECONNRESET) {
                eof = true;  // see PumpPort::ending
            } else if (errno != EAGAIN && errno != EINTR) {
                return SpliceStep{SpliceStep::Failed, true, errno, {}};
            }
            // EAGAIN here is ambiguous: src is empty, or the pipe has no free slot (each skb
            // fragment takes a slot however small, so a 64 KiB pipe can be "full" at 23 KiB).
            // It is only read as "src empty" below, when the pipe is empty too.
        }
        if (in_pipe > 0) {
            ssize_t n = ::splice(pipe.read_fd, nullptr, dst, nullptr, in_pipe, kSpliceFlags);
            if (n > 0) {
                in_pipe -= static_cast<uint32_t>(n);
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
        if (src_emptied && in_pipe == 0) break;
    }
    if (in_pipe > 0) return SpliceStep{SpliceStep::WaitWrite, false, 0, {}};
    if (eof) {
        pool.release(pipe);
        // Everything read before the FIN has been written: pass the FIN on. ENOTCONN means dst
        // is already gone, which its own direction will report.
        if (!ending) ::shutdown(dst, SHUT_WR);
        return SpliceStep{SpliceStep::Finished, false, 0, {}};
    }
    if (stuck_nonempty) {
        // src has bytes, the pipe is empty and splice still moved nothing: the kernel cannot
        // give this pipe pages. Copy is the only way left to make progress.
        pool.release(pipe);
        return SpliceStep{SpliceStep::NeedCopy, false, 0, PipeFallback::PipeLimit};
    }
    // The pipe is empty but stays with the direction: a bulk flow goes quiet between bursts
    // thousands of times per GiB, and handing the pipe back each time would shrink and regrow
    // it (two F_SETPIPE_SZ) per burst. The worker's sweep takes back pipes of directions that
    // stayed idle (releaseIdle), so idle connections still hold none.
    return SpliceStep{SpliceStep::WaitRead, false, 0, {}};
}

}  // namespace zcrelay
