#pragma once
// A worker's pipes: a bounded pool, so that pipes belong to directions that are moving bytes,
// not to connections. A direction takes a pipe when its socket turns readable and gives it back
// once the pipe is empty and the direction was quiet for a tick; 10,000 idle connections hold
// no pipe.
//
// What the kernel does with pipes, and why this shape:
// - Every pipe costs two fds against RLIMIT_NOFILE, and its capacity is charged to the user's
//   pipe-user-pages-soft (64 MiB by default) unless the process has CAP_SYS_RESOURCE or
//   CAP_SYS_ADMIN (a relay running as `user` has neither). Past that limit pipe2() still
//   succeeds but the kernel hands out a minimal pipe (2 pages, 8 KiB, on 6.18), and
//   F_SETPIPE_SZ fails with EPERM: we detect the small pipe and report PipeLimit. Past
//   pipe-user-pages-hard (0 = none by default) pipe2() fails with ENFILE: PipeLimit too.
//   Either way the direction moves its bytes by copy; nothing is logged per pipe.
// - Without CAP_SYS_RESOURCE, F_SETPIPE_SZ above fs.pipe-max-size (1 MiB) fails with EPERM
//   too: the pipe keeps its size (grow_failed).
// - F_SETPIPE_SZ rounds up to a power-of-two number of pages and caps at fs.pipe-max-size; its
//   return value is the real capacity, which is what we account with.
// - A pipe starts at kStartSize and grows to the listener's pipe_size only when a splice fills
//   it, and shrinks back when cached: a busy bulk flow gets 1 MiB, a chatty one stays small.
#include <cstdint>
#include <tl/expected.hpp>
#include <vector>

#include "reasons.hpp"
#include "stats.hpp"
#include "unique_fd.hpp"

namespace zcrelay {

struct Pipe {
    int read_fd = -1;
    int write_fd = -1;
    uint32_t capacity = 0;
    bool grow_failed = false;  // F_SETPIPE_SZ refused once: do not ask again for this pipe

    bool valid() const { return read_fd >= 0; }
};

class PipePool {
  public:
    static constexpr uint32_t kStartSize = 64 * 1024;
    static constexpr size_t kMaxCached = 64;

    // `limit`: pipes this worker may hold at once (in use + cached). `fd_ceiling`: a pipe whose
    // fds land at or above this number is refused (as Emfile), so pipes never eat the fds
    // kept in reserve for the process's own needs: the kernel hands out the lowest free fd,
    // so an fd that high means the table is nearly full.
    PipePool(uint64_t limit, int fd_ceiling, WorkerStats& stats)
        : limit_(limit), fd_ceiling_(fd_ceiling), stats_(stats) {
        free_.reserve(kMaxCached);
    }
    ~PipePool();
    PipePool(const PipePool&) = delete;
    PipePool& operator=(const PipePool&) = delete;

    tl::expected<Pipe, PipeFallback> acquire();
    // Only an empty pipe may come back: bytes left in a pipe belong to a dead connection.
    void release(Pipe& pipe);
    // A pipe that still holds bytes (its connection died): closed, never reused.
    void discard(Pipe& pipe);
    // A pipe the previous relay handed over with bytes in it (handover.hpp), owned from here
    // on: counted in use, beyond the limit if need be (its bytes must be delivered).
    Pipe adopt(UniqueFd read_end, UniqueFd write_end);
    // Grow to `size` (the listener's pipe_size) after a splice filled the pipe.
    void grow(Pipe& pipe, uint32_t size);

    uint64_t inUse() const { return in_use_; }
    size_t cached() const { return free_.size(); }

  private:
    void closePipe(Pipe& pipe);

    uint64_t limit_;
    int fd_ceiling_;
    uint64_t in_use_ = 0;
    std::vector<Pipe> free_;  // reserved to kMaxCached: no allocation after start
    WorkerStats& stats_;
};

}  // namespace zcrelay
