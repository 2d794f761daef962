#include "pipe_pool.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "log.hpp"

namespace zcrelay {

PipePool::~PipePool() {
    for (Pipe& p : free_) closePipe(p);
}

tl::expected<Pipe, PipeFallback> PipePool::acquire() {
    if (!free_.empty()) {
        Pipe p = free_.back();
        free_.pop_back();
        ++in_use_;
        stats_.pipes_cached.sub();
        stats_.pipes_in_use.add();
        return p;
    }
    if (in_use_ >= limit_) return tl::unexpected(PipeFallback::PoolExhausted);
    int fds[2];
    // O_NONBLOCK on both ends: splice(SPLICE_F_NONBLOCK) only makes the *pipe* side
    // nonblocking, and a relay thread must never sleep in the kernel.
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) < 0) {
        // ENFILE is not our fd table: for a user without CAP_SYS_RESOURCE it is, in practice,
        // pipe-user-pages-hard (the kernel refuses the pipe outright once the user's pipes hold
        // that many pages). The system-wide fs.file-max says the same, but sockets would be
        // failing everywhere by then.
        if (errno == ENFILE) return tl::unexpected(PipeFallback::PipeLimit);
        if (errno != EMFILE) LOG_WARN("pipe2: %s", strerror(errno));
        return tl::unexpected(PipeFallback::Emfile);
    }
    Pipe p{fds[0], fds[1], 0, false};
    if (p.write_fd >= fd_ceiling_) {
        closePipe(p);
        return tl::unexpected(PipeFallback::Emfile);
    }
    int size = fcntl(p.write_fd, F_GETPIPE_SZ);
    if (size < static_cast<int>(kStartSize)) {
        // Over pipe-user-pages-soft the kernel gives a minimal pipe (two pages on 6.x); try to
        // set the normal size (allowed for a privileged process), else this pipe would splice
        // 8 KiB at a time.
        size = fcntl(p.write_fd, F_SETPIPE_SZ, kStartSize);
        if (size < static_cast<int>(kStartSize)) {
            closePipe(p);
            return tl::unexpected(PipeFallback::PipeLimit);
        }
    }
    p.capacity = static_cast<uint32_t>(size);
    ++in_use_;
    stats_.pipes_in_use.add();
    return p;
}

void PipePool::release(Pipe& pipe) {
    --in_use_;
    stats_.pipes_in_use.sub();
    if (free_.size() >= kMaxCached) {
        closePipe(pipe);
        return;
    }
    if (pipe.capacity > kStartSize) {
        // Shrink a grown pipe before caching it, so cached pipes do not hold a busy flow's
        // page budget. The pipe is empty, so the kernel cannot refuse for lack of room.
        int size = fcntl(pipe.write_fd, F_SETPIPE_SZ, kStartSize);
        if (size > 0) pipe.capacity = static_cast<uint32_t>(size);
    }
    pipe.grow_failed = false;
    free_.push_back(pipe);
    stats_.pipes_cached.add();
    pipe = Pipe{};
}

void PipePool::discard(Pipe& pipe) {
    --in_use_;
    stats_.pipes_in_use.sub();
    closePipe(pipe);
}

Pipe PipePool::adopt(UniqueFd read_end, UniqueFd write_end) {
    Pipe pipe;
    const int capacity = ::fcntl(write_end.get(), F_GETPIPE_SZ);
    pipe.capacity = capacity > 0 ? static_cast<uint32_t>(capacity) : kStartSize;
    pipe.read_fd = read_end.release();
    pipe.write_fd = write_end.release();
    ++in_use_;
    stats_.pipes_in_use.add();
    return pipe;
}

void PipePool::grow(Pipe& pipe, uint32_t size) {
    if (pipe.grow_failed || pipe.capacity >= size) return;
    int got = fcntl(pipe.write_fd, F_SETPIPE_SZ, size);
    if (got < 0) {
        // EPERM: above fs.pipe-max-size or over the user's pipe pages; keep the current size.
        pipe.grow_failed = true;
        return;
    }
    pipe.capacity = static_cast<uint32_t>(got);
}

void PipePool::closePipe(Pipe& pipe) {
    if (pipe.read_fd >= 0) ::close(pipe.read_fd);
    if (pipe.write_fd >= 0) ::close(pipe.write_fd);
    pipe = Pipe{};
}

}  // namespace zcrelay
