#include "worker.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "log.hpp"
#include "pump/copy_pump.hpp"
#include "pump/sockmap_pump.hpp"
#include "pump/splice_pump.hpp"
#include "tcp_options.hpp"
#include "upstream.hpp"

namespace zcrelay {
namespace {

constexpr unsigned kRingEntries = 4096;
constexpr uint32_t kCopyBuffers = 256;  // per worker; a power of two (buffer ring)
constexpr uint32_t kCopyBufferSize = 64 * 1024;
constexpr uint16_t kBufGroup = 0;
// Accepts armed at once per listener: enough to take a burst of connections per ring
// round trip, few enough that the fd budget is never overshot by more than the batch.
constexpr uint32_t kAcceptBatch = 16;
// Pipes stop this far below RLIMIT_NOFILE: half of the fds the server keeps in reserve.
constexpr rlim_t kPipeFdHeadroom = 32;

int64_t monotonicMs() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

__kernel_timespec toTimespec(Duration d) {
    __kernel_timespec ts{};
    ts.tv_sec = d.count() / 1000;
    ts.tv_nsec = (d.count() % 1000) * 1000000;
    return ts;
}

bool isPeerError(int err) {
    switch (err) {
        case ECONNRESET:
        case EPIPE:
        case ETIMEDOUT:
        case ECONNABORTED:
        case EHOSTUNREACH:
        case ENETUNREACH:
        case ENOTCONN:
            return true;
        default:
            return false;
    }
}

// The tick drives idle timeouts, the drain deadline and accept resumption. It follows the
// shortest idle timeout so an idle connection is closed within ~1/4 of its timeout late.
int64_t tickFor(const Config& config) {
    int64_t tick = 250;
    for (const auto& l : config.listeners) {
        if (l.idle_timeout.count() > 0) tick = std::min<int64_t>(tick, l.idle_timeout.count() / 4);
    }
    return std::max<int64_t>(tick, 10);
}

}  // namespace

Worker::Worker(unsigned id, const Config& config, std::vector<UniqueFd> listen_fds,
               uint32_t max_conns, Sockmap* sockmap, uint32_t sockmap_base)
    : id_(id),
      config_(config),
      name_("w" + std::to_string(id)),
      max_conns_(max_conns),
      sockmap_(sockmap),
      sockmap_base_(sockmap_base),
      stats_(config.listeners.size()) {
    listeners_.resize(listen_fds.size());
    for (size_t i = 0; i < listen_fds.size(); ++i) {
        listeners_[i].fd = std::move(listen_fds[i]);
        listeners_[i].connect_timeout = toTimespec(config.listeners[i].connect_timeout);
    }
    tick_ms_ = tickFor(config);
    tick_ = toTimespec(Duration(tick_ms_));
}

Worker::~Worker() { join(); }

std::future<Result<void>> Worker::start() {
    auto ready = std::make_shared<std::promise<Result<void>>>();
    auto future = ready->get_future();
    thread_ = std::thread([this, ready] { run(*ready); });
    return future;
}

void Worker::join() {
    if (thread_.joinable()) thread_.join();
}

void Worker::post(uint32_t cmd) {
    commands_.fetch_or(cmd);
    uint64_t one = 1;
    if (wake_fd_ && ::write(wake_fd_.get(), &one, sizeof one) < 0)
        LOG_WARN("wake %s: %s", name_.c_str(), strerror(errno));
}

void Worker::run(std::promise<Result<void>>& ready) {
    setLogThreadName(name_.c_str());
    auto up = setUp();
    bool ok = up.has_value();
    ready.set_value(std::move(up));
    if (ok) loop();
    ring_.reset();  // cancels whatever is still armed before the fds it references go away
    finished_.store(true);
}

Result<void> Worker::setUp() {
    // Created here, not in the constructor: SINGLE_ISSUER binds the ring to the creating thread.
    auto ring = Ring::create(kRingEntries);
    if (!ring) return tl::unexpected(ring.error());
    ring_ = std::move(*ring);
    auto bufs = BufRing::create(ring_->raw(), kBufGroup, kCopyBuffers, kCopyBufferSize);
    if (!bufs) return tl::unexpected(bufs.error());
    bufs_ = std::move(*bufs);
    uint64_t pipes = config_.max_pipes / std::max(1u, config_.workers);
    if (config_.max_pipes > 0) pipes = std::max<uint64_t>(pipes, 1);
    rlimit nofile{};
    getrlimit(RLIMIT_NOFILE, &nofile);
    int ceiling = static_cast<int>(std::min<rlim_t>(nofile.rlim_cur, INT32_MAX) - kPipeFdHeadroom);
    pipes_ = std::make_unique<PipePool>(pipes, ceiling, stats_);
    spare_fd_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    wake_fd_.reset(::eventfd(0, EFD_CLOEXEC));
    if (!wake_fd_) return sysError("eventfd");
    starved_.reserve(4096);
    starved_retry_.reserve(4096);
    fd_waiters_.reserve(1024);
    now_ms_ = monotonicMs();
    for (uint32_t i = 0; i < listeners_.size(); ++i) armAccept(i);
    armWake();
    armTick();
    if (int r = ring_->submit(); r < 0) return sysError("io_uring_submit", -r);
    return {};
}

void Worker::loop() {
    for (;;) {
        if (draining_ && live_ == 0) {
            ring_->submit();  // the listeners' close SQEs
            break;
        }
        int r = ring_->submitAndWait();
        if (r < 0 && r != -EINTR && r != -EBUSY && r != -EAGAIN) {
            LOG_ERROR("io_uring_submit_and_wait: %s", strerror(-r));
            break;
        }
        now_ms_ = monotonicMs();
        unsigned head, count = 0;
        io_uring_cqe* cqe;
        io_uring_for_each_cqe(ring_->raw(), head, cqe) {
            dispatch(cqe);
            ++count;
        }
        io_uring_cq_advance(ring_->raw(), count);
        if (!starved_.empty() && buffers_freed_) retryStarved();
        if (resume_pending_) resumeAccepting();
    }
}

void Worker::dispatch(const io_uring_cqe* cqe) {
    UserData ud = UserData::unpack(cqe->user_data);
    switch (ud.op) {
        case Op::Ignore:
            return;
        case Op::Wake:
            onWake();
            return;
        case Op::Tick:
            onTick();
            return;
        case Op::SockmapScan:
            onSockmapScan();
            return;
        case Op::Accept:
            onAccept(ud.slot, cqe->res, cqe->flags);
            return;
        default:
            break;
    }
    Conn& c = conn(ud.slot);
    if (c.generation != ud.generation || c.state == ConnState::Free) {
        LOG_ERROR("stale completion op=%d slot=%u gen=%u (slot gen %u): bookkeeping bug",
                  static_cast<int>(ud.op), ud.slot, ud.generation, c.generation);
        if (cqe->flags & IORING_CQE_F_BUFFER) bufs_->recycle(cqe->flags >> IORING_CQE_BUFFER_SHIFT);
        return;
    }
    --c.inflight;
    int d = ud.dir;
    switch (ud.op) {
        case Op::Connect:
            onConnect(c, ud.slot, cqe->res);
            break;
        case Op::ConnectTimeout:
            break;  // the connect's own CQE says -ECANCELED if this fired
        case Op::PollIn:
            onPollIn(c, ud.slot, d, cqe->res);
            break;
        case Op::PollOut:
            c.dir[d].poll_out = false;
            if (c.state == ConnState::Relaying && cqe->res >= 0) pumpSpliceDir(c, ud.slot, d);
            break;
        case Op::Watch:
            onWatch(c, ud.slot, d, cqe->res);
            break;
        case Op::Recv:
            onRecv(c, ud.slot, d, cqe->res, cqe->flags);
            break;
        case Op::Send:
            onSend(c, ud.slot, d, cqe->res);
            break;
        case Op::Barrier:
            c.dir[d].barrier_armed = false;
            if (c.state == ConnState::Relaying) onBarrier(c, ud.slot, d);
            break;
        default:
            break;
    }
    if (c.state == ConnState::Closing && c.inflight == 0) freeConn(c, ud.slot);
}

// ---- listening and commands ----------------------------------------------------------------

void Worker::armAccept(uint32_t li) {
    ListenerState& l = listeners_[li];
    // Single-shot accepts, kAcceptBatch at a time, never more than the fd budget has room for.
    // A multishot accept would be one SQE less per connection, but the kernel loops it until
    // the backlog is empty: one burst could take thousands of connections past the budget
    // and into EMFILE, where the fds the process needs for itself (its metrics socket) are.
    while (!l.closed && !l.paused && !draining_ && l.armed < kAcceptBatch &&
           live_ + accepts_armed_ < max_conns_) {
        io_uring_sqe* sqe = ring_->sqe();
        // The accepted sockets come out nonblocking, as the inline splice needs.
        io_uring_prep_accept(sqe, l.fd.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        io_uring_sqe_set_data64(sqe, UserData{Op::Accept, 0, li, 0}.pack());
        ++l.armed;
        ++accepts_armed_;
    }
}

void Worker::onAccept(uint32_t li, int res, uint32_t /*flags*/) {
    ListenerState& l = listeners_[li];
    --l.armed;
    --accepts_armed_;
    if (res >= 0) {
        if (draining_) {
            ::close(res);
        } else if (uint32_t slot = allocConn(); slot != UINT32_MAX) {
            Conn* c = &conn(slot);
            c->listener = static_cast<uint8_t>(li);
            c->fd[0] = res;
            c->counted_active = true;
            stats_.listeners[li].accepted.add();
            applyTcpOptions(res, config_.listeners[li]);
            startConnect(*c, slot);
            // This worker's share of the fd budget is spent: stop accepting (backpressure:
            // clients wait in the kernel's queue) rather than run into EMFILE.
            if (live_ >= max_conns_) pauseAccepting();
        } else {
            ::close(res);
        }
    } else if (res == -EMFILE || res == -ENFILE || res == -ENOBUFS || res == -ENOMEM) {
        // Out of fds (or socket memory) all the same, e.g. pipes took them: the connection stays
        // in the kernel's accept queue until we have room.
        // Logged at most once a second: while fds stay short, every connection that closes
        // lets accepting resume and hit the limit again.
        ++emfile_unlogged_;
        if (now_ms_ - emfile_logged_ms_ >= 1000) {
            LOG_WARN("accept on %s: %s; pausing accepts (x%u since the last report)",
                     config_.listeners[li].name.c_str(), strerror(-res), emfile_unlogged_);
            emfile_logged_ms_ = now_ms_;
            emfile_unlogged_ = 0;
        }
        pauseAccepting();
        return;
    } else if (res != -ECANCELED && res != -EINTR && res != -ECONNABORTED && res != -EAGAIN &&
               res != -EINVAL) {
        // -EINVAL: the listener was shut down for draining.
        LOG_WARN("accept on %s: %s", config_.listeners[li].name.c_str(), strerror(-res));
    }
    armAccept(li);
}

void Worker::pauseAccepting() {
    // Stop accepting rather than spin on the same error. onTick (or a connection closing)
    // resumes once the budget has room and the spare fd can be reopened.
    if (!accept_paused_) stats_.accept_paused.add();
    accept_paused_ = true;
    for (uint32_t i = 0; i < listeners_.size(); ++i) {
        ListenerState& l = listeners_[i];
        if (l.closed) continue;
        l.paused = true;
        if (l.armed > 0) {
            io_uring_sqe* sqe = ring_->sqe();
            io_uring_prep_cancel_fd(sqe, l.fd.get(), IORING_ASYNC_CANCEL_ALL);
            io_uring_sqe_set_data64(sqe, UserData{}.pack());
        }
    }
}

void Worker::resumeAccepting() {
    resume_pending_ = false;
    if (!fd_waiters_.empty()) retryFdWaiters();
    if (draining_ || !fd_waiters_.empty() || live_ >= max_conns_) return;
    if (!spare_fd_) spare_fd_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!spare_fd_) return;  // still out of fds: try again next tick
    accept_paused_ = false;
    for (uint32_t i = 0; i < listeners_.size(); ++i) {
        if (!listeners_[i].paused) continue;
        listeners_[i].paused = false;
        armAccept(i);
    }
}

void Worker::armWake() {
    io_uring_sqe* sqe = ring_->sqe();
    io_uring_prep_read(sqe, wake_fd_.get(), &wake_value_, sizeof wake_value_, 0);
    io_uring_sqe_set_data64(sqe, UserData{Op::Wake}.pack());
}

void Worker::onWake() {
    uint32_t cmds = commands_.exchange(0);
    if ((cmds & (kCmdDrain | kCmdStop)) && !draining_) {
        draining_ = true;
        drain_deadline_ms_ = now_ms_ + config_.drain_timeout.count();
        closeListeners();
        LOG_INFO("draining %u connections (deadline %lld ms)", live_,
                 static_cast<long long>(config_.drain_timeout.count()));
    }
    if (cmds & kCmdStop) drain_deadline_ms_ = now_ms_;
    if (draining_ && now_ms_ >= drain_deadline_ms_) sweep();
    armWake();
}

void Worker::armTick() {
    io_uring_sqe* sqe = ring_->sqe();
    io_uring_prep_timeout(sqe, &tick_, 0, 0);
    io_uring_sqe_set_data64(sqe, UserData{Op::Tick}.pack());
}

void Worker::onTick() {
    sweep();
    resumeAccepting();
    armTick();
}

void Worker::sweep() {
    // Idle timeouts and the drain deadline: a linear sweep, a few times a second. A sweep over
    // 10k slots is microseconds, far cheaper than a timer per connection on the data path.
    bool deadline = draining_ && now_ms_ >= drain_deadline_ms_;
    for (uint32_t slot = 0; slot < slots_used_; ++slot) {
        Conn& c = conn(slot);
        if (c.state == ConnState::Free || c.state == ConnState::Closing) continue;
        if (deadline) {
            closeConn(c, slot, CloseReason::Drain);
            continue;
        }
        // The kernel moved a sockmap connection's bytes: what it counted is activity too.
        if (c.linked[0] || c.linked[1]) foldSockmapBytes(c);
        int64_t idle = config_.listeners[c.listener].idle_timeout.count();
        if (c.state == ConnState::Relaying && idle > 0 && now_ms_ - c.last_active_ms >= idle) {
            closeConn(c, slot, CloseReason::IdleTimeout);
            continue;
        }
        // A direction that kept its (empty) pipe through a quiet tick gives it back.
        if (now_ms_ - c.last_active_ms >= tick_ms_) {
            for (Direction& dir : c.dir) releaseIdlePipe(dir, *pipes_);
        }
    }
}

void Worker::closeListeners() {
    for (ListenerState& l : listeners_) {
        if (l.closed) continue;
        // shutdown() first: it takes a listening socket out of LISTEN (and out of its
        // SO_REUSEPORT group) at once, even while an io_uring accept still holds a reference
        // to the file; close() alone would leave it completing handshakes nobody accepts until
        // that reference goes (with DEFER_TASKRUN, when this ring next runs task work). The
        // armed accept then ends with an error; the cancel and close below release the rest.
        ::shutdown(l.fd.get(), SHUT_RDWR);
        io_uring_sqe* sqe = ring_->sqe();
        io_uring_prep_cancel_fd(sqe, l.fd.get(), IORING_ASYNC_CANCEL_ALL);
        // Hardlinked: the close runs even when the cancel finds nothing armed.
        sqe->flags |= IOSQE_IO_HARDLINK;
        io_uring_sqe_set_data64(sqe, UserData{}.pack());
        sqe = ring_->sqe();
        io_uring_prep_close(sqe, l.fd.release());
        io_uring_sqe_set_data64(sqe, UserData{}.pack());
        l.closed = true;
    }
}

// ---- connections ---------------------------------------------------------------------------

uint32_t Worker::allocConn() {
    if (free_head_ == UINT32_MAX) {
        if (slots_used_ + kChunk > UserData::kMaxSlot) return UINT32_MAX;
        // Grows only past the previous peak of connections: no allocation in steady state.
        chunks_.push_back(std::make_unique<Conn[]>(kChunk));
        uint32_t base = static_cast<uint32_t>((chunks_.size() - 1) * kChunk);
        for (uint32_t i = kChunk; i-- > 0;) {
            conn(base + i).next_free = free_head_;
            free_head_ = base + i;
        }
    }
    uint32_t slot = free_head_;
    Conn& c = conn(slot);
    free_head_ = c.next_free;
    slots_used_ = std::max(slots_used_, slot + 1);
    ++live_;
    c.state = ConnState::Connecting;
    return slot;
}

io_uring_sqe* Worker::sqeFor(Conn& c, uint32_t slot, Op op, int d) {
    io_uring_sqe* sqe = ring_->sqe();
    io_uring_sqe_set_data64(sqe, UserData{op, static_cast<uint8_t>(d), slot, c.generation}.pack());
    ++c.inflight;
    return sqe;
}

void Worker::startConnect(Conn& c, uint32_t slot) {
    const ListenerConfig& lc = config_.listeners[c.listener];
    auto fd = openUpstreamSocket(lc.upstream.family());
    if (!fd && (fd.error().code == EMFILE || fd.error().code == ENFILE)) {
        // The fd budget keeps this rare, but pipes or the metrics server can take the last fds
        // between an accept and its upstream socket. The client is not dropped: it gets the
        // spare fd, or waits (accepting stops) until a closing connection gives fds back,
        // bounded by connect_timeout.
        pauseAccepting();
        if (spare_fd_) {
            spare_fd_.reset();
            fd = openUpstreamSocket(lc.upstream.family());
        }
        if (!fd) {
            c.last_active_ms = now_ms_;  // the wait is bounded by connect_timeout from here
            fd_waiters_.push_back(UserData{Op::Connect, 0, slot, c.generation}.pack());
            return;
        }
    }
    if (!fd) {
        LOG_WARN("%s: upstream %s", lc.name.c_str(), fd.error().message().c_str());
        closeConn(c, slot, CloseReason::Error);
        return;
    }
    c.fd[1] = fd->release();
    applyTcpOptions(c.fd[1], lc);
    io_uring_sqe* sqe = sqeFor(c, slot, Op::Connect, 0);
    io_uring_prep_connect(sqe, c.fd[1], lc.upstream.sockaddrPtr(), lc.upstream.length);
    // The linked timeout cancels the connect (CQE -ECANCELED) when connect_timeout runs out.
    sqe->flags |= IOSQE_IO_LINK;
    sqe = sqeFor(c, slot, Op::ConnectTimeout, 0);
    io_uring_prep_link_timeout(sqe, &listeners_[c.listener].connect_timeout, 0);
}

void Worker::retryFdWaiters() {
    // Oldest first; a waiter that still finds no fd goes back on the list (at its end, which
    // keeps the order since every later one fails the same way).
    size_t n = fd_waiters_.size();
    for (size_t i = 0; i < n && !fd_waiters_.empty(); ++i) {
        UserData ud = UserData::unpack(fd_waiters_.front());
        fd_waiters_.erase(fd_waiters_.begin());
        Conn& c = conn(ud.slot);
        if (c.generation != ud.generation || c.state != ConnState::Connecting || c.fd[1] >= 0)
            continue;
        int64_t budget = config_.listeners[c.listener].connect_timeout.count();
        if (now_ms_ - c.last_active_ms >= budget) {
            stats_.listeners[c.listener].connect_failures[idx(ConnectFailure::Other)].add();
            LOG_WARN("%s: no fd for an upstream socket within connect_timeout",
                     config_.listeners[c.listener].name.c_str());
            closeConn(c, ud.slot, CloseReason::ConnectFailed);
            continue;
        }
        startConnect(c, ud.slot);
    }
}

void Worker::onConnect(Conn& c, uint32_t slot, int res) {
    if (c.state != ConnState::Connecting) return;
    if (res < 0) {
        ConnectFailure why = classifyConnectError(-res);
        stats_.listeners[c.listener].connect_failures[idx(why)].add();
        LOG_DEBUG("%s: connect %s: %s", config_.listeners[c.listener].name.c_str(),
                  config_.listeners[c.listener].upstream.toString().c_str(), strerror(-res));
        closeConn(c, slot, CloseReason::ConnectFailed);
        return;
    }
    c.state = ConnState::Relaying;
    c.last_active_ms = now_ms_;
    Mode mode = config_.listeners[c.listener].mode;
    if (mode == Mode::Sockmap && sockmap_ != nullptr) {
        startSockmap(c, slot);
    } else {
        DataPath path = mode == Mode::Copy ? DataPath::Copy : DataPath::Splice;
        for (Direction& dir : c.dir) dir.path = path;
    }
    for (int d = 0; d < 2; ++d) {
        startDirection(c, slot, d);
        if (c.state != ConnState::Relaying) return;
    }
}

void Worker::startDirection(Conn& c, uint32_t slot, int d) {
    switch (c.dir[d].path) {
        case DataPath::Splice:
            armPollIn(c, slot, d);
            break;
        case DataPath::Copy:
            advanceCopy(c, slot, d);
            break;
        case DataPath::Sockmap:
            startRedirecting(c, slot, d);
            break;
    }
}

void Worker::addBytes(Conn& c, int d, uint64_t n) {
    ListenerStats& s = stats_.listeners[c.listener];
    (d == 0 ? s.bytes_upstream : s.bytes_downstream).add(n);
    c.last_active_ms = now_ms_;
}

void Worker::finishDirection(Conn& c, uint32_t slot, int d) {
    c.dir[d].finished = true;
    if (c.bothFinished()) closeConn(c, slot, CloseReason::Done);
}

void Worker::failDirection(Conn& c, uint32_t slot, int d, bool on_src, int err) {
    if (isPeerError(err)) {
        closeConn(c, slot, resetReason(d, on_src));
    } else {
        LOG_WARN("%s: %s on %s socket", config_.listeners[c.listener].name.c_str(), strerror(err),
                 (on_src ? d : 1 - d) == 0 ? "client" : "upstream");
        closeConn(c, slot, CloseReason::Error);
    }
}

void Worker::closeConn(Conn& c, uint32_t slot, CloseReason reason) {
    if (c.state == ConnState::Closing || c.state == ConnState::Free) return;
    if (c.counted_active) {
        stats_.listeners[c.listener].closed[idx(reason)].add();
        c.counted_active = false;
    }
    c.state = ConnState::Closing;
    if (c.linked[0] || c.linked[1]) {
        foldSockmapBytes(c);
        for (int d = 0; d < 2; ++d)
            if (c.linked[d])
                stats_.listeners[c.listener].sockmap_replays.add(
                    loadRelaxed(sockmap_->record(c.record + d).replayed));
        // Out of the maps before close(): see pump/sockmap_pump.hpp.
        for (int i = 0; i < 2; ++i)
            if (c.in_map[i]) stats_.sockmap_sockets.sub();
        tearDownPair(*sockmap_, c);
        --sockmap_conns_;
    }
    for (int d = 0; d < 2; ++d) {
        if (!c.dir[d].barrier_armed) continue;
        // A timer holds no file, so the cancels below would miss it.
        io_uring_sqe* sqe = ring_->sqe();
        io_uring_prep_timeout_remove(
            sqe, UserData{Op::Barrier, static_cast<uint8_t>(d), slot, c.generation}.pack(), 0);
        io_uring_sqe_set_data64(sqe, UserData{}.pack());
    }
    for (Direction& dir : c.dir) {
        if (!dir.pipe.valid()) continue;
        // Bytes still in a pipe were never delivered; the connection is gone, so are they.
        if (dir.in_pipe == 0)
            pipes_->release(dir.pipe);
        else
            pipes_->discard(dir.pipe);
        dir.in_pipe = 0;
    }
    if (reason == CloseReason::ClientReset || reason == CloseReason::UpstreamReset) {
        // Propagate the reset: SO_LINGER {1, 0} makes close() send RST, so the survivor's
        // peer learns at once that the stream broke instead of seeing a clean FIN.
        linger lg{1, 0};
        int survivor = reason == CloseReason::ClientReset ? 1 : 0;
        if (c.fd[survivor] >= 0)
            ::setsockopt(c.fd[survivor], SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    }
    for (int& fd : c.fd) {
        if (fd < 0) continue;
        // Wakes a recv still waiting on this socket. In 1 of 30-50 runs of
        // SockmapTest.UpstreamResetMidStreamResetsClientPromptly a copy-path recv on a sockmap
        // socket, issued in the same batch as the cancel below, survived the cancel (no CQE,
        // traced): its file reference then kept the socket open, and the client never got its
        // RST. Not root-caused; SHUT_RD makes that recv complete (0 failures in 120 runs) and
        // sends nothing on the wire.
        ::shutdown(fd, SHUT_RD);
        // In-flight polls, recvs, sends and the connect hold references to the socket: cancel
        // them (their CQEs still arrive and are counted down in inflight), then close. The
        // cancel is matched by file at submit time, so it must go in before the close.
        io_uring_sqe* sqe = ring_->sqe();
        io_uring_prep_cancel_fd(sqe, fd, IORING_ASYNC_CANCEL_ALL);
        sqe->flags |= IOSQE_IO_HARDLINK;
        io_uring_sqe_set_data64(sqe, UserData{}.pack());
        sqe = ring_->sqe();
        io_uring_prep_close(sqe, fd);
        io_uring_sqe_set_data64(sqe, UserData{}.pack());
        fd = -1;
    }
    if (c.inflight == 0) freeConn(c, slot);
}

void Worker::freeConn(Conn& c, uint32_t slot) {
    for (Direction& dir : c.dir) {
        while (!dir.queue.empty()) {
            bufs_->recycle(dir.queue.front().bid);
            buffers_freed_ = true;
            dir.queue.pop();
        }
    }
    uint32_t generation = c.generation + 1;
    c = Conn{};
    c.generation = generation;
    c.next_free = free_head_;
    free_head_ = slot;
    --live_;
    // Not resumed from here: freeConn runs inside completion handling, and resuming retries
    // fd waiters, which can close connections again. The loop resumes after the batch.
    if (accept_paused_) resume_pending_ = true;
}

// ---- splice path ---------------------------------------------------------------------------

void Worker::armPollIn(Conn& c, uint32_t slot, int d) {
    if (c.dir[d].poll_in) return;
    io_uring_sqe* sqe = sqeFor(c, slot, Op::PollIn, d);
    // One-shot poll: a level-triggered check at arm time, so data that arrived while no poll
    // was armed is seen at once, and no stream of wake-ups while we are busy elsewhere.
    io_uring_prep_poll_add(sqe, c.fd[d], POLLIN | POLLRDHUP);
    c.dir[d].poll_in = true;
}

void Worker::armPollOut(Conn& c, uint32_t slot, int d) {
    if (c.dir[d].poll_out) return;
    io_uring_sqe* sqe = sqeFor(c, slot, Op::PollOut, d);
    io_uring_prep_poll_add(sqe, c.fd[1 - d], POLLOUT);
    c.dir[d].poll_out = true;
}

void Worker::armWatch(Conn& c, uint32_t slot, int d) {
    Direction& dir = c.dir[d];
    if (dir.watch || dir.eof || dir.src_hup) return;
    // While a direction waits for dst to drain it does not read src, so nothing would notice an
    // RST there. POLLRDHUP alone does not fire on data (no wake-up per segment), only on FIN;
    // POLLERR and POLLHUP are always reported.
    io_uring_sqe* sqe = sqeFor(c, slot, Op::Watch, d);
    io_uring_prep_poll_add(sqe, c.fd[d], POLLRDHUP | POLLERR | POLLHUP);
    dir.watch = true;
}

void Worker::onPollIn(Conn& c, uint32_t slot, int d, int res) {
    c.dir[d].poll_in = false;
    if (c.state != ConnState::Relaying || res < 0) return;
    if (c.dir[d].path == DataPath::Splice) pumpSpliceDir(c, slot, d);
}

void Worker::onWatch(Conn& c, uint32_t slot, int d, int res) {
    c.dir[d].watch = false;
    if (c.state != ConnState::Relaying || res < 0) return;
    if (c.dir[d].path == DataPath::Sockmap) {
        onSockmapWatch(c, slot, d, res);
        return;
    }
    if (res & POLLERR) {
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(c.fd[d], SOL_SOCKET, SO_ERROR, &err, &len);
        failDirection(c, slot, d, true, err != 0 ? err : ECONNRESET);
    }
    // POLLRDHUP alone: a FIN, which the direction reads in order once dst drains. Never armed
    // again: the condition is level-triggered and would fire at once, every time.
    c.dir[d].src_hup = true;
}

void Worker::pumpSpliceDir(Conn& c, uint32_t slot, int d) {
    Direction& dir = c.dir[d];
    if (dir.finished) return;
    uint64_t moved = 0;
    SpliceStep step =
        pumpSplice(dir, c.fd[d], c.fd[1 - d], *pipes_,
                   static_cast<uint32_t>(config_.listeners[c.listener].pipe_size), moved);
    if (moved > 0) addBytes(c, d, moved);
    switch (step.kind) {
        case SpliceStep::WaitRead:
            armPollIn(c, slot, d);
            break;
        case SpliceStep::WaitWrite:
            armPollOut(c, slot, d);
            armWatch(c, slot, d);
            break;
        case SpliceStep::Finished:
            finishDirection(c, slot, d);
            break;
        case SpliceStep::NeedCopy:
            stats_.pipe_fallbacks[idx(step.fallback)].add();
            dir.path = DataPath::Copy;
            advanceCopy(c, slot, d);
            break;
        case SpliceStep::Failed:
            failDirection(c, slot, d, step.on_src, step.error);
            break;
    }
}

// ---- sockmap path --------------------------------------------------------------------------

void Worker::startSockmap(Conn& c, uint32_t slot) {
    PairSetUp r;
    if (slot < max_conns_) {
        // In flight per direction (the psock's backlog plus the peer's send queue): four pipes'
        // worth, comparable to what splice has the kernel hold for a direction (one pipe plus
        // the socket buffers). pipe_size is the one knob for both.
        uint64_t limit = std::max<uint64_t>(4 * config_.listeners[c.listener].pipe_size, 64 * 1024);
        r = setUpPair(*sockmap_, c, sockmap_base_ + 2 * slot, limit);
    } else {
        // Slots stay below max_conns (the fd budget bounds live connections); defensive.
        r.fell_back = true;
        r.reason = SockmapFallback::NoRecord;
        for (Direction& dir : c.dir) dir.path = DataPath::Splice;
    }
    for (int i = 0; i < 2; ++i)
        if (c.in_map[i]) stats_.sockmap_sockets.add();
    if (c.linked[0] || c.linked[1]) {
        if (sockmap_conns_++ == 0) armSockmapScan();
    }
    if (r.fell_back) {
        stats_.listeners[c.listener].sockmap_fallbacks[idx(r.reason)].add();
        LOG_DEBUG("%s: sockmap fallback %s", config_.listeners[c.listener].name.c_str(),
                  std::string(label(r.reason)).c_str());
    }
}

bool Worker::hasPassedBytes(const Conn& c, int d) const {
    return loadRelaxed(sockmap_->record(c.record + d).passed) > c.dir[d].taken;
}

void Worker::startRedirecting(Conn& c, uint32_t slot, int d) {
    Direction& dir = c.dir[d];
    if (hasPassedBytes(c, d)) {
        startCatchUp(c, slot, d);
    } else if (dir.src_hup) {
        sockmapEof(c, slot, d);  // the FIN came while we were moving passed bytes
    } else {
        armWatch(c, slot, d);
    }
}

void Worker::onSockmapWatch(Conn& c, uint32_t slot, int d, int res) {
    Direction& dir = c.dir[d];
    if (dir.finished) {
        // The error watch of a finished source (see sockmapFinBarrier): POLLHUP alone means
        // its writing side was shut too, i.e. the connection is done.
        if (res & POLLERR) failDirection(c, slot, d, true, ECONNRESET);
        return;
    }
    if (res & POLLERR) {
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(c.fd[d], SOL_SOCKET, SO_ERROR, &err, &len);  // reads and clears it
        // The psock worker reports a send it could not make into this socket as EPIPE on
        // it. Once this socket's writing side is shut down (direction 1 - d finished) that is
        // the FIN-time artefact of the teardown, not a broken stream.
        if (err != EPIPE || !c.dir[1 - d].finished) {
            failDirection(c, slot, d, true, err != 0 ? err : ECONNRESET);
            return;
        }
    }
    if (!(res & (POLLRDHUP | POLLHUP))) {
        armWatch(c, slot, d);
        return;
    }
    dir.src_hup = true;
    // Moving passed bytes: the copy path reads the FIN in order after them.
    if (dir.catching_up || dir.user_copy) return;
    sockmapEof(c, slot, d);
}

void Worker::sockmapEof(Conn& c, uint32_t slot, int d) {
    SockmapEof e = checkEof(c.fd[d], c.dir[1 - d].finished);
    switch (e.kind) {
        case SockmapEof::Eof:
            if (hasPassedBytes(c, d)) {
                // See onRecv: passed bytes still on their way; they come first.
                startCatchUp(c, slot, d);
                return;
            }
            c.dir[d].eof = true;
            c.dir[d].barrier_step = 0;
            sockmapFinBarrier(c, slot, d);
            return;
        case SockmapEof::Again:
            armBarrier(c, slot, d, true);
            return;
        case SockmapEof::Passed:
            startCatchUp(c, slot, d);
            return;
        case SockmapEof::Failed:
            failDirection(c, slot, d, true, e.error);
            return;
    }
}

void Worker::startCatchUp(Conn& c, uint32_t slot, int d) {
    Direction& dir = c.dir[d];
    if (dir.catching_up || dir.user_copy) return;
    dir.catching_up = true;
    dir.barrier_step = 0;
    stats_.listeners[c.listener].sockmap_catchups.add();
    catchUp(c, slot, d);
}

void Worker::catchUp(Conn& c, uint32_t slot, int d) {
    // The program stopped redirecting when it passed the first of these bytes, so the
    // redirected count is final: once dst has queued all of it (and what we copied before),
    // the passed bytes go next, by copy.
    Direction& dir = c.dir[d];
    uint64_t expected = loadRelaxed(sockmap_->record(c.record + d).redirected) + dir.copied;
    if (!barrierDone(c, slot, d, checkQueued(c.fd[1 - d], expected))) return;
    dir.catching_up = false;
    dir.user_copy = true;
    advanceCopy(c, slot, d);
}

void Worker::sockmapFinBarrier(Conn& c, uint32_t slot, int d) {
    if (sockmapBroken(c, slot)) return;
    if (!barrierDone(c, slot, d, checkFinBarrier(c.fd[d], c.fd[1 - d]))) return;
    foldSockmapBytes(c);
    ::shutdown(c.fd[1 - d], SHUT_WR);
    finishDirection(c, slot, d);
    if (c.state == ConnState::Relaying && !c.dir[d].watch) {
        // src is done but still the other direction's destination, written by the kernel
        // alone: only a poll notices an RST on it now.
        io_uring_prep_poll_add(sqeFor(c, slot, Op::Watch, d), c.fd[d], POLLERR | POLLHUP);
        c.dir[d].watch = true;
    }
}

bool Worker::barrierDone(Conn& c, uint32_t slot, int d, const SockmapBarrier& b) {
    switch (b.kind) {
        case SockmapBarrier::Done:
            return true;
        case SockmapBarrier::Wait:
            waitBarrier(c, slot, d, b.remaining);
            return false;
        case SockmapBarrier::Failed:
            failDirection(c, slot, d, b.on_src, b.error);
            return false;
    }
    return false;
}

void Worker::waitBarrier(Conn& c, uint32_t slot, int d, uint64_t remaining) {
    // A slow reader on dst holds the psock's backlog: that is progress, not idleness, as long
    // as the backlog shrinks, and the next look comes as soon; only a stall backs off.
    bool progress = remaining != c.dir[d].barrier_left;
    if (progress) {
        c.dir[d].barrier_left = remaining;
        c.last_active_ms = now_ms_;
    }
    armBarrier(c, slot, d, !progress);
}

void Worker::armBarrier(Conn& c, uint32_t slot, int d, bool back_off) {
    // Read by the kernel when the SQE is submitted, so they must outlive this call.
    // 1 ms first: at the end of a 100 MiB burst the backlog took 6-20 ms to drain. Doubling
    // to 32 ms bounds both the latency added to a FIN and the polling of a stalled reader.
    static constexpr __kernel_timespec kWaits[] = {{0, 1000000}, {0, 2000000},  {0, 4000000},
                                                   {0, 8000000}, {0, 16000000}, {0, 32000000}};
    Direction& dir = c.dir[d];
    if (dir.barrier_armed) return;
    uint8_t step = std::min<uint8_t>(dir.barrier_step, std::size(kWaits) - 1);
    if (back_off && dir.barrier_step + 1u < std::size(kWaits)) ++dir.barrier_step;
    io_uring_sqe* sqe = sqeFor(c, slot, Op::Barrier, d);
    io_uring_prep_timeout(sqe, const_cast<__kernel_timespec*>(&kWaits[step]), 0, 0);
    dir.barrier_armed = true;
}

void Worker::onBarrier(Conn& c, uint32_t slot, int d) {
    Direction& dir = c.dir[d];
    if (dir.path != DataPath::Sockmap || dir.finished) return;
    if (dir.catching_up)
        catchUp(c, slot, d);
    else if (dir.user_copy)
        advanceCopy(c, slot, d);
    else if (dir.eof)
        sockmapFinBarrier(c, slot, d);
    else
        sockmapEof(c, slot, d);
}

void Worker::armSockmapScan() {
    static constexpr __kernel_timespec kScan = {0, 10000000};
    io_uring_sqe* sqe = ring_->sqe();
    io_uring_prep_timeout(sqe, const_cast<__kernel_timespec*>(&kScan), 0, 0);
    io_uring_sqe_set_data64(sqe, UserData{Op::SockmapScan}.pack());
}

void Worker::onSockmapScan() {
    // The program never wakes us: passed bytes are found by reading the records, which are
    // mapped into our memory, so a scan costs no syscall (~2 ns per connection). While passed
    // bytes wait, their socket's receive window closes: the scan period bounds that stall.
    if (sockmap_conns_ == 0) return;  // the last one closed: armed again by the next
    for (uint32_t slot = 0; slot < slots_used_; ++slot) {
        Conn& c = conn(slot);
        if (c.state != ConnState::Relaying) continue;
        for (int d = 0; d < 2 && c.state == ConnState::Relaying; ++d) {
            Direction& dir = c.dir[d];
            if (dir.path != DataPath::Sockmap || dir.catching_up || dir.user_copy || dir.eof ||
                dir.finished)
                continue;
            if (hasPassedBytes(c, d)) startCatchUp(c, slot, d);
        }
        if (c.state == ConnState::Relaying) sockmapBroken(c, slot);
    }
    armSockmapScan();
}

uint32_t Worker::dropReplayed(Conn& c, int d, char* data, uint32_t len) {
    Direction& dir = c.dir[d];
    zcr_sock_stats& r = sockmap_->record(c.record + d);
    // The chunk holds passed bytes [taken, taken + len). Every queued replayed stretch inside
    // it is cut out and the rest closed up in place; a stretch reaching past its end stays
    // queued, shortened by what was cut. Rare (a few per hundred connections under heavy
    // passing), so a memmove of at most one buffer is fine.
    uint64_t from = dir.taken;
    uint32_t kept = len;
    uint64_t cut = 0;
    for (;;) {
        uint32_t head = loadRelaxed(r.skip_head);
        if (head == loadRelaxed(r.skip_tail)) break;
        uint32_t i = head & (ZCR_SKIPS - 1);
        uint64_t at = loadRelaxed(r.skip_at[i]);
        uint64_t end = at + loadRelaxed(r.skip_len[i]);
        uint64_t to = from + len;
        if (at >= to) break;
        uint64_t lo = std::max(at, from), hi = std::min(end, to);
        if (hi > lo) {
            // Offsets within the chunk as it is now, after earlier cuts.
            uint32_t off = static_cast<uint32_t>(lo - from - cut);
            uint32_t n = static_cast<uint32_t>(hi - lo);
            std::memmove(data + off, data + off + n, kept - off - n);
            kept -= n;
            cut += n;
        }
        if (end > to) break;  // continues into the next chunk
        storeRelaxed(r.skip_head, head + 1);
    }
    if (cut > 0) {
        // Dropped bytes count as handled, or the program would wait for them forever.
        dir.consumed += cut;
        storeRelaxed(r.consumed, __u64{dir.consumed});
        stats_.listeners[c.listener].sockmap_skipped.add(cut);
    }
    return kept;
}

bool Worker::sockmapBroken(Conn& c, uint32_t slot) {
    for (int d = 0; d < 2; ++d) {
        if (!c.linked[d] || !(loadRelaxed(sockmap_->record(c.record + d).flags) & ZCR_BROKEN))
            continue;
        // Never deliver a stream we know is wrong: both peers get an RST instead of a FIN.
        LOG_ERROR(
            "%s: the kernel gave the sockmap program a %s stream it cannot relay exactly; "
            "resetting the connection",
            config_.listeners[c.listener].name.c_str(), d == 0 ? "client" : "upstream");
        linger lg{1, 0};
        for (int fd : c.fd)
            if (fd >= 0) ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        closeConn(c, slot, CloseReason::Error);
        return true;
    }
    return false;
}

void Worker::foldSockmapBytes(Conn& c) {
    for (int d = 0; d < 2; ++d) {
        if (!c.linked[d]) continue;
        uint64_t v = loadRelaxed(sockmap_->record(c.record + d).redirected);
        if (v > c.dir[d].bpf_seen) {
            addBytes(c, d, v - c.dir[d].bpf_seen);
            c.dir[d].bpf_seen = v;
        }
    }
}

// ---- copy path -----------------------------------------------------------------------------

void Worker::advanceCopy(Conn& c, uint32_t slot, int d) {
    Direction& dir = c.dir[d];
    CopyNext next = copyNext(dir);
    if (dir.path == DataPath::Sockmap) {
        // Moving passed bytes: read only what the program passed. A recv armed with nothing
        // passed would sit on a socket whose bytes the kernel redirects, woken by each skb.
        next.arm_recv = next.arm_recv && hasPassedBytes(c, d);
        if (next.finish) {
            // The FIN: after the kernel's backlog, like any sockmap FIN.
            dir.user_copy = false;
            dir.barrier_step = 0;
            sockmapFinBarrier(c, slot, d);
            return;
        }
        if (!next.arm_send && !next.arm_recv && !dir.send_armed && !dir.recv_armed &&
            dir.queue.empty() && !dir.eof) {
            // Caught up (consumed == passed): the program redirects again from the next skb.
            dir.user_copy = false;
            startRedirecting(c, slot, d);
            return;
        }
    }
    if (next.arm_send) {
        prepCopySend(sqeFor(c, slot, Op::Send, d), c.fd[1 - d], *bufs_, dir.queue.front());
        dir.send_armed = true;
    }
    if (next.arm_recv) {
        prepCopyRecv(sqeFor(c, slot, Op::Recv, d), c.fd[d], *bufs_);
        dir.recv_armed = true;
    }
    if (dir.queue.full() && !dir.recv_armed) armWatch(c, slot, d);
    if (next.finish) {
        ::shutdown(c.fd[1 - d], SHUT_WR);
        finishDirection(c, slot, d);
    }
}

void Worker::onRecv(Conn& c, uint32_t slot, int d, int res, uint32_t flags) {
    Direction& dir = c.dir[d];
    dir.recv_armed = false;
    bool has_buffer = flags & IORING_CQE_F_BUFFER;
    uint16_t bid = static_cast<uint16_t>(flags >> IORING_CQE_BUFFER_SHIFT);
    if (c.state != ConnState::Relaying) {
        if (has_buffer) bufs_->recycle(bid);
        return;
    }
    if (res > 0) {
        CopyChunk chunk{bid, static_cast<uint32_t>(res), 0};
        if (dir.path == DataPath::Sockmap)
            chunk.len = dropReplayed(c, d, bufs_->data(bid), chunk.len);
        dir.taken += static_cast<uint64_t>(res);
        c.last_active_ms = now_ms_;
        if (chunk.len == 0) {
            bufs_->recycle(bid);
            buffers_freed_ = true;
        } else {
            dir.queue.push(chunk);
        }
    } else {
        if (has_buffer) bufs_->recycle(bid);
        if (res == 0 && dir.path == DataPath::Sockmap && hasPassedBytes(c, d)) {
            // Not the end yet. A passed skb that finds its psock's queue busy (with the other
            // direction's bytes on their way out of this socket) is delivered later by the
            // psock worker, and the FIN behind it can be seen first: recvmsg() returns 0
            // while the program's count says bytes are missing (measured, 1 in ~30 runs of
            // 200 concurrent echoes). The recv would keep returning 0 at once, so look again
            // on a timer until they arrived.
            armBarrier(c, slot, d, true);
            return;
        }
        if (res == 0) {
            dir.eof = true;
        } else if (res == -ENOBUFS) {
            // Every buffer of this worker is queued somewhere: retry once sends give some back.
            starved_.push_back(
                UserData{Op::Recv, static_cast<uint8_t>(d), slot, c.generation}.pack());
            if (!dir.send_armed && dir.queue.empty()) armWatch(c, slot, d);
            return;
        } else if (res != -EINTR && res != -EAGAIN) {
            failDirection(c, slot, d, true, -res);
            return;
        }
    }
    advanceCopy(c, slot, d);
}

void Worker::onSend(Conn& c, uint32_t slot, int d, int res) {
    Direction& dir = c.dir[d];
    dir.send_armed = false;
    if (c.state != ConnState::Relaying) return;
    if (res < 0) {
        if (res != -EINTR && res != -EAGAIN) {
            failDirection(c, slot, d, false, -res);
            return;
        }
    } else {
        CopyChunk& chunk = dir.queue.front();
        chunk.sent += static_cast<uint32_t>(res);
        addBytes(c, d, static_cast<uint64_t>(res));
        if (dir.path == DataPath::Sockmap) {
            // Queued on dst: the program may redirect again once all passed bytes are.
            dir.copied += static_cast<uint64_t>(res);
            dir.consumed += static_cast<uint64_t>(res);
            storeRelaxed(sockmap_->record(c.record + d).consumed, __u64{dir.consumed});
            stats_.listeners[c.listener].sockmap_copied.add(static_cast<uint64_t>(res));
        }
        if (chunk.sent == chunk.len) {
            bufs_->recycle(chunk.bid);
            buffers_freed_ = true;
            dir.queue.pop();
        }
    }
    advanceCopy(c, slot, d);
}

void Worker::retryStarved() {
    // Swap out first: a retry that is starved again re-enters the list for the next round.
    buffers_freed_ = false;
    starved_retry_.clear();
    starved_retry_.swap(starved_);
    for (uint64_t packed : starved_retry_) {
        UserData ud = UserData::unpack(packed);
        Conn& c = conn(ud.slot);
        if (c.generation != ud.generation || c.state != ConnState::Relaying) continue;
        advanceCopy(c, ud.slot, ud.dir);
    }
}

}  // namespace zcrelay
