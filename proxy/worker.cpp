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

#include "clock.hpp"
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
        if (l.accept_proxy) tick = std::min<int64_t>(tick, l.proxy_timeout.count() / 4);
    }
    for (const auto& c : config.clusters) {
        // Ejected backends come back after fail_timeout without checks: see it within ~1/4.
        tick = std::min<int64_t>(tick, c.fail_timeout.count() / 4);
    }
    return std::max<int64_t>(tick, 10);
}

std::unique_ptr<Generation> makeGeneration(std::shared_ptr<const Runtime> rt, unsigned worker) {
    auto gen = std::make_unique<Generation>();
    for (const ClusterRt& c : rt->clusters) {
        // Seeded per worker: N workers with one connection each start at different backends.
        gen->balancers.emplace_back(c.config.balance, c.specs,
                                    0x9e3779b97f4a7c15ull * (worker + 1) + rt->generation);
    }
    gen->rt = std::move(rt);
    return gen;
}

}  // namespace

Worker::Worker(unsigned id, std::shared_ptr<const Runtime> runtime,
               std::vector<UniqueFd> listen_fds, uint32_t max_conns, Sockmap* sockmap,
               uint32_t sockmap_base, ProcessShared& process)
    : id_(id),
      name_("w" + std::to_string(id)),
      process_(process),
      max_conns_(max_conns),
      sockmap_(sockmap),
      sockmap_base_(sockmap_base) {
    generations_.push_back(makeGeneration(std::move(runtime), id));
    applied_generation_.store(rt().generation);
    listeners_.resize(listen_fds.size());
    for (size_t i = 0; i < listen_fds.size(); ++i) {
        listeners_[i].fd = std::move(listen_fds[i]);
        listeners_[i].address = rt().config.listeners[i].listen;
        listeners_[i].rt_index = static_cast<int32_t>(i);
    }
    tick_ms_ = tickFor(rt().config);
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
    const Config& config = rt().config;
    uint64_t pipes = config.max_pipes / std::max(1u, config.workers);
    if (config.max_pipes > 0) pipes = std::max<uint64_t>(pipes, 1);
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
    admit_queue_.reserve(1024);
    scratch_.resize(64 * 1024);
    now_ms_ = monotonicMs();
    for (uint32_t i = 0; i < listeners_.size(); ++i) armAccept(i);
    armWake();
    armTick();
    checker_ = std::make_unique<HealthChecker>(id_, *ring_);
    checker_->reset(rt());
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
        if (r > 0) stats_.sqes_submitted.add(static_cast<uint64_t>(r));
        // The kernel counts CQEs it had to hold back because the CQ ring was full.
        stats_.cq_overflow.set(IO_URING_READ_ONCE(*ring_->raw()->cq.koverflow));
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
        case Op::Check:
        case Op::CheckTimer:
        case Op::CheckTimeout:
            checker_->onCompletion(ud, cqe->res);
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
            if (c.state != ConnState::Relaying || cqe->res < 0) break;
            if (c.dir[d].path == DataPath::Splice)
                pumpSpliceDir(c, ud.slot, d);
            else
                advanceCopy(c, ud.slot, d);  // copy, or a sockmap direction moving passed bytes
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
        case Op::ProxyRead:
            onProxyReadable(c, ud.slot, cqe->res);
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

namespace {

// One more on `live` unless that would pass `max` (0 = no limit); true if taken.
bool takeOne(std::atomic<uint32_t>& live, uint64_t max) {
    uint32_t n = live.load(std::memory_order_relaxed);
    do {
        if (max > 0 && n >= max) return false;
    } while (!live.compare_exchange_weak(n, n + 1, std::memory_order_relaxed));
    return true;
}

}  // namespace

// max_connections, of the listener and of the process, shared by every worker. Two gates:
//   belowLimits  stops arming accepts at the limit, so clients wait in the kernel's accept
//                queue (backpressure, as HAProxy's maxconn) instead of being accepted and
//                closed;
//   admit        counts a connection in, exactly. Accepts armed before the limit was reached
//                (at most kAcceptBatch per worker) can still complete: those connections wait,
//                accepted but not served, in admit_queue_ until a connection ends.
bool Worker::belowLimits(const ListenerState& l) const {
    const Runtime& r = rt();
    const ListenerRt& lr = r.listeners[l.rt_index];
    if (lr.config.max_connections > 0 &&
        lr.shared->live.load(std::memory_order_relaxed) >= lr.config.max_connections)
        return false;
    if (r.config.max_connections > 0 &&
        process_.live.load(std::memory_order_relaxed) >= r.config.max_connections)
        return false;
    return true;
}

bool Worker::admit(Conn& c) {
    const ListenerRt& lr = c.gen->rt->listeners[c.listener];
    if (!takeOne(lr.shared->live, lr.config.max_connections)) return false;
    if (!takeOne(process_.live, c.gen->rt->config.max_connections)) {
        lr.shared->live.fetch_sub(1, std::memory_order_relaxed);
        return false;
    }
    c.counted_live = true;
    return true;
}

void Worker::serve(Conn& c, uint32_t slot) {
    // With accept_proxy the client is the one the header names: its limit waits for that.
    if (lc(c).accept_proxy)
        startProxyRead(c, slot);
    else if (admitSource(c, slot))
        startConnect(c, slot);
}

void Worker::admitQueued() {
    while (!admit_queue_.empty()) {
        UserData ud = UserData::unpack(admit_queue_.front());
        Conn& c = conn(ud.slot);
        if (c.generation == ud.generation && c.state == ConnState::Queued) {
            if (!admit(c)) return;  // still at the limit: the oldest stays first
            serve(c, ud.slot);
        }
        admit_queue_.erase(admit_queue_.begin());
    }
}

void Worker::armAccept(uint32_t li) {
    ListenerState& l = listeners_[li];
    // Single-shot accepts, kAcceptBatch at a time, never more than the fd budget has room for.
    // A multishot accept would be one SQE less per connection, but the kernel loops it until
    // the backlog is empty: one burst could take thousands of connections past the budget
    // and into EMFILE, where the fds the process needs for itself (its metrics socket) are.
    while (!l.closed && !l.paused && !draining_ && l.armed < kAcceptBatch &&
           live_ + accepts_armed_ < max_conns_) {
        if (!belowLimits(l)) {
            // Rechecked on every tick and whenever one of this worker's connections closes.
            if (l.armed == 0) limit_paused_ = true;
            break;
        }
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
    if (l.closed) {
        if (res >= 0) ::close(res);  // accepted just before a reload removed the listener
        return;
    }
    if (res >= 0) {
        if (draining_) {
            rt().listeners[l.rt_index].shared->stats[id_].rejected_draining.add();
            ::close(res);
        } else if (uint32_t slot = allocConn(); slot != UINT32_MAX) {
            Conn* c = &conn(slot);
            const ListenerRt& lr = rt().listeners[l.rt_index];
            c->listener = static_cast<uint8_t>(l.rt_index);
            c->gen = generations_.back().get();
            ++c->gen->live;
            c->fd[0] = res;
            c->counted_active = true;
            c->accepted_us = wallClockUs();
            c->accepted_mono_us = monotonicUs();
            c->last_active_ms = now_ms_;
            lr.shared->stats[id_].accepted.add();
            stats_.accepted.add();
            applyTcpOptions(res, lr.config, lr.config.tcp_keepalive);
            // The access log names the client when the connection ends, and by then
            // getpeername() fails: a socket that saw both FINs or an RST is in TCP_CLOSE, which
            // the kernel answers with ENOTCONN. Ask while it is still connected.
            if (process_.access_log != nullptr) clientAddress(*c);
            if (admit_queue_.empty() && admit(*c)) {
                serve(*c, slot);
            } else {
                c->state = ConnState::Queued;
                admit_queue_.push_back(UserData{Op::Accept, 0, slot, c->generation}.pack());
                limit_paused_ = true;
            }
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
                     l.address.toString().c_str(), strerror(-res), emfile_unlogged_);
            emfile_logged_ms_ = now_ms_;
            emfile_unlogged_ = 0;
        }
        pauseAccepting();
        return;
    } else if (res != -ECANCELED && res != -EINTR && res != -ECONNABORTED && res != -EAGAIN &&
               res != -EINVAL) {
        // -EINVAL: the listener was shut down for draining.
        LOG_WARN("accept on %s: %s", l.address.toString().c_str(), strerror(-res));
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
    limit_paused_ = !admit_queue_.empty();  // armAccept sets it again where a limit holds
    admitQueued();
    for (uint32_t i = 0; i < listeners_.size(); ++i) {
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
        checker_->drain();
        drain_deadline_ms_ = now_ms_ + rt().config.drain_timeout.count();
        closeListeners();
        // Connections held at max_connections were never served: they go now, as the kernel's
        // accept queue does with the listeners.
        for (uint64_t packed : admit_queue_) {
            UserData ud = UserData::unpack(packed);
            Conn& c = conn(ud.slot);
            if (c.generation == ud.generation && c.state == ConnState::Queued)
                closeConn(c, ud.slot, CloseReason::Drain);
        }
        admit_queue_.clear();
        LOG_INFO("draining %u connections (deadline %lld ms)", live_,
                 static_cast<long long>(rt().config.drain_timeout.count()));
    }
    if (cmds & kCmdStop) drain_deadline_ms_ = now_ms_;
    if (draining_ && now_ms_ >= drain_deadline_ms_) sweep();
    if (cmds & kCmdReload) applyReload();
    armWake();
}

void Worker::reload(std::shared_ptr<const Runtime> rt, std::vector<UniqueFd> new_fds) {
    {
        std::lock_guard lock(reload_mutex_);
        pending_rt_ = std::move(rt);
        pending_fds_ = std::move(new_fds);
    }
    post(kCmdReload);
}

void Worker::applyReload() {
    std::shared_ptr<const Runtime> next;
    std::vector<UniqueFd> fds;
    {
        std::lock_guard lock(reload_mutex_);
        next = std::move(pending_rt_);
        fds = std::move(pending_fds_);
    }
    if (!next) return;
    if (draining_) {
        // Closing down: new listeners would only be closed again. Said done all the same, so
        // the reload does not wait for a worker that will not switch.
        applied_generation_.store(next->generation);
        return;
    }
    // Listeners whose address stays keep their socket (and whatever waits in its accept
    // queue); the rest of the old ones close, the new ones open. A port-0 listener matches
    // by name too, as its configured address says nothing.
    std::vector<bool> kept(listeners_.size(), false);
    size_t next_fd = 0;
    for (size_t i = 0; i < next->config.listeners.size(); ++i) {
        const ListenerConfig& l = next->config.listeners[i];
        int32_t found = -1;
        for (size_t j = 0; j < listeners_.size(); ++j) {
            const ListenerState& old = listeners_[j];
            if (old.closed || kept[j] || !(old.address == l.listen)) continue;
            if (l.listen.port() == 0 && rt().config.listeners[old.rt_index].name != l.name)
                continue;
            found = static_cast<int32_t>(j);
        }
        if (found >= 0) {
            kept[found] = true;
            listeners_[found].rt_index = static_cast<int32_t>(i);
            continue;
        }
        if (next_fd >= fds.size()) {
            LOG_ERROR("reload: no socket for new listener %s: bookkeeping bug", l.name.c_str());
            continue;
        }
        ListenerState fresh;
        fresh.fd = std::move(fds[next_fd++]);
        fresh.address = l.listen;
        fresh.rt_index = static_cast<int32_t>(i);
        listeners_.push_back(std::move(fresh));
        kept.push_back(true);
    }
    for (size_t j = 0; j < listeners_.size(); ++j) {
        if (!kept[j] && !listeners_[j].closed) {
            listeners_[j].rt_index = -1;
            closeListener(listeners_[j]);
        }
    }
    Generation* old = generations_.back().get();
    generations_.push_back(makeGeneration(std::move(next), id_));
    if (old->live == 0) std::erase_if(generations_, [&](const auto& g) { return g.get() == old; });
    tick_ms_ = tickFor(rt().config);
    tick_ = toTimespec(Duration(tick_ms_));
    checker_->reset(rt());
    for (uint32_t i = 0; i < listeners_.size(); ++i) armAccept(i);
    applied_generation_.store(rt().generation);
}

void Worker::armTick() {
    io_uring_sqe* sqe = ring_->sqe();
    io_uring_prep_timeout(sqe, &tick_, 0, 0);
    io_uring_sqe_set_data64(sqe, UserData{Op::Tick}.pack());
}

void Worker::onTick() {
    sweep();
    restoreEjected();
    resumeAccepting();
    armTick();
}

void Worker::restoreEjected() {
    // Passive ejection without health checks lasts fail_timeout (nginx's max_fails and
    // fail_timeout); with checks, they alone bring the backend back.
    for (const ClusterRt& cl : rt().clusters) {
        if (cl.config.health_check.enabled) continue;
        for (const BackendRt& b : cl.backends) {
            BackendState& st = *b.state;
            if (st.up.load(std::memory_order_relaxed) ||
                now_ms_ < st.ejected_until_ms.load(std::memory_order_relaxed))
                continue;
            if (st.markUp(true)) {
                st.failure_streak.store(0, std::memory_order_relaxed);
                LOG_INFO("cluster %s: backend %s back up after fail_timeout",
                         cl.config.name.c_str(), b.key.c_str());
            }
        }
    }
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
        if (c.state == ConnState::ReadingProxy &&
            now_ms_ - c.last_active_ms >= lc(c).proxy_timeout.count()) {
            proxyFailed(c, slot, ProxyFailure::Timeout);
            continue;
        }
        // The kernel moved a sockmap connection's bytes: what it counted is activity too.
        if (c.linked[0] || c.linked[1]) foldSockmapBytes(c);
        int64_t idle = lc(c).idle_timeout.count();
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
    for (ListenerState& l : listeners_)
        if (!l.closed) closeListener(l);
}

void Worker::closeListener(ListenerState& l) {
    // shutdown() first: it takes a listening socket out of LISTEN (and out of its
    // SO_REUSEPORT group) at once, even while an io_uring accept still holds a reference
    // to the file; close() alone would leave it completing handshakes nobody accepts until
    // that reference goes (with DEFER_TASKRUN, when this ring next runs task work). The
    // armed accept then ends with an error; the cancel and close below release the rest.
    ::shutdown(l.fd.get(), SHUT_RDWR);
    ring_->cancelAndClose(l.fd.release());
    l.closed = true;
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

const SocketAddress& Worker::clientAddress(Conn& c) {
    if (!c.have_client) {
        // Only asked for when something needs it (source_hash, a PROXY header, the access log,
        // a per-source limit): one getpeername() then, none per connection otherwise.
        sockaddr_storage ss{};
        socklen_t len = sizeof ss;
        if (::getpeername(c.fd[0], reinterpret_cast<sockaddr*>(&ss), &len) == 0)
            c.client = addressFromSockaddr(reinterpret_cast<sockaddr*>(&ss), len);
        c.have_client = true;
    }
    return c.client;
}

bool Worker::admitSource(Conn& c, uint32_t slot) {
    const ListenerRt& lr = c.gen->rt->listeners[c.listener];
    uint64_t limit = lr.config.max_connections_per_source;
    if (limit == 0) return true;
    if (lr.shared->sources.take(clientAddress(c), limit)) {
        c.counted_source = true;
        return true;
    }
    LOG_DEBUG("%s: %s is at max_connections_per_source %llu", lr.config.name.c_str(),
              c.client.toString().c_str(), static_cast<unsigned long long>(limit));
    closeConn(c, slot, CloseReason::SourceLimit);
    return false;
}

void Worker::releaseSource(Conn& c) {
    if (!c.counted_source) return;
    c.counted_source = false;
    c.gen->rt->listeners[c.listener].shared->sources.give(c.client);
}

int Worker::pickBackend(Conn& c) {
    const ClusterRt& cl = cluster(c);
    const uint32_t ci = c.gen->rt->listeners[c.listener].cluster;
    uint64_t key = 0;
    if (cl.config.balance == Balance::SourceHash) key = hashAddress(clientAddress(c));
    return c.gen->balancers[ci].pick(
        key,
        [&](size_t i) {
            return !(c.tried & (uint64_t{1} << (i % 64))) &&
                   cl.backends[i].state->up.load(std::memory_order_relaxed);
        },
        [&](size_t i) {
            return static_cast<uint32_t>(
                std::max(0, cl.backends[i].state->active.load(std::memory_order_relaxed)));
        });
}

void Worker::startConnect(Conn& c, uint32_t slot) {
    c.state = ConnState::Connecting;
    c.connect_deadline_us = monotonicUs() + lc(c).connect_timeout.count() * 1000;
    connectBackend(c, slot);
}

void Worker::connectBackend(Conn& c, uint32_t slot) {
    const ClusterRt& cl = cluster(c);
    if (c.fd[1] < 0) {
        // A waiter for an fd (below) comes back here with its backend already picked.
        int b = c.backend >= 0 && c.attempts == 0 ? c.backend : pickBackend(c);
        if (b < 0 && c.attempts > 0) {
            // Every backend that is up was tried once: go round again (a lone backend that
            // refused once may well accept now), still within the budget.
            c.tried = 0;
            b = pickBackend(c);
        }
        if (b < 0) {
            if (c.attempts == 0) {
                LOG_DEBUG("%s: no backend of cluster %s is up", lc(c).name.c_str(),
                          cl.config.name.c_str());
                closeConn(c, slot, CloseReason::NoBackend);
            } else {
                closeConn(c, slot, CloseReason::ConnectFailed);
            }
            return;
        }
        c.backend = static_cast<int16_t>(b);
        const BackendRt& be = cl.backends[b];
        auto fd = openUpstreamSocket(be.config.address, cl.config.source);
        if (!fd && (fd.error().code == EMFILE || fd.error().code == ENFILE)) {
            // The fd budget keeps this rare, but pipes or the metrics server can take the last
            // fds between an accept and its upstream socket. The client is not dropped: it
            // gets the spare fd, or waits (accepting stops) until a closing connection gives
            // fds back, bounded by connect_timeout.
            pauseAccepting();
            if (spare_fd_) {
                spare_fd_.reset();
                fd = openUpstreamSocket(be.config.address, cl.config.source);
            }
            if (!fd) {
                fd_waiters_.push_back(UserData{Op::Connect, 0, slot, c.generation}.pack());
                return;
            }
        }
        if (!fd && (fd.error().code == EADDRINUSE || fd.error().code == EADDRNOTAVAIL)) {
            // `source` has no port left (a fixed source port, or ports exhausted): a failed
            // attempt like a connect's EADDRNOTAVAIL, counted and retried, not a local error.
            c.tried |= uint64_t{1} << (c.backend % 64);
            ++c.attempts;
            be.state->stats[id_].attempts.add();
            onConnectFailed(c, slot, EADDRNOTAVAIL);
            return;
        }
        if (!fd) {
            LOG_WARN("%s: backend %s: %s", lc(c).name.c_str(), be.key.c_str(),
                     fd.error().message().c_str());
            closeConn(c, slot, CloseReason::Error);
            return;
        }
        c.fd[1] = fd->release();
    }
    const BackendRt& be = cl.backends[c.backend];
    if (be.config.address.family() != AF_UNIX)
        applyTcpOptions(c.fd[1], lc(c), cl.config.tcp_keepalive);
    c.tried |= uint64_t{1} << (c.backend % 64);
    ++c.attempts;
    be.state->stats[id_].attempts.add();
    c.connect_start_us = monotonicUs();
    int64_t left = std::max<int64_t>(c.connect_deadline_us - c.connect_start_us, 1000);
    c.connect_left = usToTimespec(left);
    io_uring_sqe* sqe = sqeFor(c, slot, Op::Connect, 0);
    io_uring_prep_connect(sqe, c.fd[1], be.config.address.sockaddrPtr(), be.config.address.length);
    // The linked timeout cancels the connect (CQE -ECANCELED) when what is left of
    // connect_timeout runs out: retries share one budget, as HAProxy's `timeout connect` does
    // per attempt but bounded overall here, so a client never waits longer than configured.
    sqe->flags |= IOSQE_IO_LINK;
    sqe = sqeFor(c, slot, Op::ConnectTimeout, 0);
    io_uring_prep_link_timeout(sqe, &c.connect_left, 0);
}

void Worker::onConnectFailed(Conn& c, uint32_t slot, int err) {
    const ClusterRt& cl = cluster(c);
    const BackendRt& be = cl.backends[c.backend];
    ConnectFailure why = classifyConnectError(err);
    lstats(c).connect_failures[idx(why)].add();
    be.state->stats[id_].connect_failures[idx(why)].add();
    LOG_DEBUG("%s: connect %s: %s", lc(c).name.c_str(), be.key.c_str(), strerror(err));
    // Passive ejection: max_fails failures in a row, from any worker, take the backend down.
    // Never the only backend (as nginx): down, it would turn every client away for
    // fail_timeout, where trying it still serves whoever comes when it is back. Nor for
    // EADDRNOTAVAIL: out of local ports is this host's state, not the backend's.
    uint32_t streak = err == EADDRNOTAVAIL
                          ? 0
                          : be.state->failure_streak.fetch_add(1, std::memory_order_relaxed) + 1;
    if (cl.config.max_fails > 0 && streak >= cl.config.max_fails && cl.backends.size() > 1) {
        if (be.state->markUp(false)) {
            be.state->check_passes.store(0, std::memory_order_relaxed);
            be.state->ejected_until_ms.store(now_ms_ + cl.config.fail_timeout.count(),
                                             std::memory_order_relaxed);
            LOG_WARN("cluster %s: backend %s down after %u connect failures in a row (%s)%s",
                     cl.config.name.c_str(), be.key.c_str(), streak, strerror(err),
                     cl.config.health_check.enabled ? "; health checks bring it back" : "");
        }
    }
    if (c.fd[1] >= 0) ::close(c.fd[1]);  // the connect completed: no SQE holds it any more
    c.fd[1] = -1;
    bool budget_left = monotonicUs() < c.connect_deadline_us;
    if (c.attempts <= cl.config.retries && budget_left) {
        connectBackend(c, slot);
        return;
    }
    closeConn(c, slot, CloseReason::ConnectFailed);
}

void Worker::startProxyRead(Conn& c, uint32_t slot) {
    c.state = ConnState::ReadingProxy;
    c.last_active_ms = now_ms_;  // proxy_timeout counts from here (sweep)
    io_uring_prep_poll_add(sqeFor(c, slot, Op::ProxyRead, 0), c.fd[0], POLLIN | POLLRDHUP);
}

void Worker::onProxyReadable(Conn& c, uint32_t slot, int res) {
    if (c.state != ConnState::ReadingProxy || res < 0) return;
    const ListenerConfig& l = lc(c);
    // Peeked, not read: the bytes after the header are the client's payload and stay in the
    // socket for the data path. A header still incomplete sets SO_RCVLOWAT to what the parser
    // needs, so the next poll fires only once that much is there, instead of at once again.
    // At least one byte past the longest v1 line, so a line without its CRLF within the spec's
    // bound is seen to be too long rather than waited for.
    size_t window = std::min<size_t>(
        scratch_.size(), std::max<uint64_t>(l.proxy_max_size, proxy_protocol::kV1MaxLength + 1));
    ssize_t n = ::recv(c.fd[0], scratch_.data(), window, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) {
        proxyFailed(c, slot, ProxyFailure::Eof);
        return;
    }
    if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) {
            startProxyRead(c, slot);
        } else {
            closeConn(c, slot, CloseReason::ClientReset);
        }
        return;
    }
    auto r = proxy_protocol::parse({scratch_.data(), static_cast<size_t>(n)}, l.proxy_max_size);
    if (r.kind == proxy_protocol::ParseResult::Malformed) {
        proxyFailed(c, slot, static_cast<ProxyFailure>(r.error));
        return;
    }
    if (r.kind == proxy_protocol::ParseResult::Incomplete) {
        // The client's FIN is in: the peek (its window covers any `need`) saw every byte it
        // will send, so the header cannot complete, and POLLRDHUP would fire again at once.
        if (res & (POLLRDHUP | POLLHUP)) {
            proxyFailed(c, slot, ProxyFailure::Eof);
            return;
        }
        int lowat = static_cast<int>(r.need);
        ::setsockopt(c.fd[0], SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat);
        io_uring_prep_poll_add(sqeFor(c, slot, Op::ProxyRead, 0), c.fd[0], POLLIN | POLLRDHUP);
        return;
    }
    // Consume exactly the header. The peek saw all of it, so this read takes it at once.
    if (::recv(c.fd[0], scratch_.data(), r.length, MSG_DONTWAIT) != r.length) {
        closeConn(c, slot, CloseReason::Error);
        return;
    }
    c.dir[0].src_skipped = r.length;
    int one = 1;
    ::setsockopt(c.fd[0], SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    if (r.has_addresses) {
        // The client from now on: source_hash, limits, the access log, a PROXY header sent on.
        c.client = r.src;
        c.local = r.dst;
        c.have_client = c.have_local = true;
    }
    if (admitSource(c, slot)) startConnect(c, slot);
}

void Worker::proxyFailed(Conn& c, uint32_t slot, ProxyFailure why) {
    lstats(c).proxy_errors[idx(why)].add();
    LOG_DEBUG("%s: PROXY header refused: %s", lc(c).name.c_str(),
              std::string(label(why)).c_str());
    closeConn(c, slot, CloseReason::ProxyProtocol);
}

void Worker::logConnection(Conn& c, CloseReason reason) {
    AccessRecord r;
    r.start_unix_us = c.accepted_us;
    r.duration_us = static_cast<uint64_t>(std::max<int64_t>(0, monotonicUs() - c.accepted_mono_us));
    r.connect_us = c.connect_us;
    r.bytes_upstream = c.bytes[0];
    r.bytes_downstream = c.bytes[1];
    r.client = clientAddress(c);
    copyField(r.listener, lc(c).name);
    copyField(r.cluster, cluster(c).config.name);
    if (c.backend >= 0) copyField(r.backend, cluster(c).backends[c.backend].key);
    r.reason = reason;
    r.attempts = c.attempts;
    if (c.state == ConnState::Relaying) {
        copyField(r.path, label(c.dir[0].path));
    }
    process_.access_log->push(id_, r);
}

bool Worker::sendProxyHeader(Conn& c, uint32_t slot) {
    const BackendRt& be = cluster(c).backends[c.backend];
    if (be.config.send_proxy == ProxyVersion::Off) return true;
    if (!c.have_local) {
        sockaddr_storage ss{};
        socklen_t len = sizeof ss;
        if (::getsockname(c.fd[0], reinterpret_cast<sockaddr*>(&ss), &len) == 0)
            c.local = addressFromSockaddr(reinterpret_cast<sockaddr*>(&ss), len);
        c.have_local = true;
    }
    std::array<uint8_t, proxy_protocol::kMaxWrite> header;
    size_t n = proxy_protocol::writeHeader(be.config.send_proxy == ProxyVersion::V1
                                               ? proxy_protocol::Version::V1
                                               : proxy_protocol::Version::V2,
                                           clientAddress(c), c.local, header);
    // A socket that just connected has an empty send buffer, so the whole header (at most
    // kMaxWrite bytes) is queued by this one nonblocking send, ahead of any relayed byte in every
    // data path (the sockmap's redirect starts only after this).
    ssize_t sent = ::send(c.fd[1], header.data(), n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent == static_cast<ssize_t>(n)) {
        c.dir[0].dst_extra = static_cast<uint32_t>(n);
        return true;
    }
    failDirection(c, slot, 0, false, sent < 0 ? errno : EAGAIN);
    return false;
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
        if (monotonicUs() >= c.connect_deadline_us) {
            lstats(c).connect_failures[idx(ConnectFailure::Other)].add();
            LOG_WARN("%s: no fd for an upstream socket within connect_timeout", lc(c).name.c_str());
            closeConn(c, ud.slot, CloseReason::ConnectFailed);
            continue;
        }
        connectBackend(c, ud.slot);
    }
}

void Worker::onConnect(Conn& c, uint32_t slot, int res) {
    if (c.state != ConnState::Connecting) return;
    if (res < 0) {
        onConnectFailed(c, slot, -res);
        return;
    }
    const BackendRt& be = cluster(c).backends[c.backend];
    BackendStats& bs = be.state->stats[id_];
    c.connect_us = monotonicUs() - c.connect_start_us;
    bs.connections.add();
    bs.connect_time.observe(kConnectBuckets, static_cast<uint64_t>(c.connect_us));
    be.state->failure_streak.store(0, std::memory_order_relaxed);
    be.state->active.fetch_add(1, std::memory_order_relaxed);
    c.state = ConnState::Relaying;
    c.last_active_ms = now_ms_;
    if (!sendProxyHeader(c, slot)) return;
    Mode mode = lc(c).mode;
    // The sockmap program relays TCP sockets only; a unix backend runs splice.
    if (mode == Mode::Sockmap && sockmap_ != nullptr && be.config.address.family() != AF_UNIX) {
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
        case DataPath::kCount:  // not a path: the table's size
            break;
    }
}

void Worker::addBytes(Conn& c, int d, uint64_t n) {
    ListenerStats& s = lstats(c);
    s.bytes[d][static_cast<size_t>(c.dir[d].path)].add(n);
    c.bytes[d] += n;
    BackendStats& b = cluster(c).backends[c.backend].state->stats[id_];
    (d == 0 ? b.bytes_upstream : b.bytes_downstream).add(n);
    c.last_active_ms = now_ms_;
}

void Worker::finishDirection(Conn& c, uint32_t slot, int d) {
    c.dir[d].finished = true;
    if (!c.bothFinished()) {
        lstats(c).half_closed.add();  // one way done, the other still flowing
        return;
    }
    lstats(c).half_closed.sub();
    closeConn(c, slot, CloseReason::Done);
}

void Worker::failDirection(Conn& c, uint32_t slot, int d, bool on_src, int err) {
    if (isPeerError(err)) {
        closeConn(c, slot, resetReason(d, on_src));
    } else {
        LOG_WARN("%s: %s on %s socket", lc(c).name.c_str(), strerror(err),
                 (on_src ? d : 1 - d) == 0 ? "client" : "upstream");
        closeConn(c, slot, CloseReason::Error);
    }
}

void Worker::closeConn(Conn& c, uint32_t slot, CloseReason reason) {
    if (c.state == ConnState::Closing || c.state == ConnState::Free) return;
    if (c.dir[0].finished != c.dir[1].finished) lstats(c).half_closed.sub();
    if (c.counted_active) {
        ListenerStats& ls = lstats(c);
        ls.closed[idx(reason)].add();
        ls.duration.observe(kDurationBuckets, static_cast<uint64_t>(std::max<int64_t>(
                                                  0, monotonicUs() - c.accepted_mono_us)));
        c.counted_active = false;
        if (process_.access_log != nullptr) logConnection(c, reason);
    }
    if (c.counted_live) {
        c.counted_live = false;
        c.gen->rt->listeners[c.listener].shared->live.fetch_sub(1, std::memory_order_relaxed);
        process_.live.fetch_sub(1, std::memory_order_relaxed);
        // A listener held at max_connections (by any worker) may take one more now.
        if (limit_paused_) resume_pending_ = true;
    }
    if (c.connect_us >= 0)
        cluster(c).backends[c.backend].state->active.fetch_sub(1, std::memory_order_relaxed);
    releaseSource(c);
    c.state = ConnState::Closing;
    if (c.linked[0] || c.linked[1]) {
        foldSockmapBytes(c);
        for (int d = 0; d < 2; ++d)
            if (c.linked[d])
                lstats(c).sockmap_replays.add(loadRelaxed(sockmap_->record(c.record + d).replayed));
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
        // In-flight polls, recvs, sends and the connect: their CQEs still arrive after the
        // cancel and are counted down in inflight.
        ring_->cancelAndClose(fd);
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
    if (--c.gen->live == 0 && c.gen != generations_.back().get()) {
        // The last connection of an older config generation: it can go.
        std::erase_if(generations_, [&](const auto& g) { return g.get() == c.gen; });
    }
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
    SpliceStep step = pumpSplice(dir, c.fd[d], c.fd[1 - d], *pipes_,
                                 static_cast<uint32_t>(lc(c).pipe_size), moved);
    if (moved > 0) addBytes(c, d, moved);
    switch (step.kind) {
        case SpliceStep::WaitRead:
            stats_.splice_eagain[d][0].add();
            armPollIn(c, slot, d);
            break;
        case SpliceStep::WaitWrite:
            stats_.splice_eagain[d][1].add();
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
        uint64_t limit = std::max<uint64_t>(4 * lc(c).pipe_size, 64 * 1024);
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
        lstats(c).sockmap_connections.add();
    }
    if (r.fell_back) {
        lstats(c).sockmap_fallbacks[idx(r.reason)].add();
        LOG_DEBUG("%s: sockmap fallback %s", lc(c).name.c_str(),
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
    lstats(c).sockmap_catchups.add();
    catchUp(c, slot, d);
}

void Worker::catchUp(Conn& c, uint32_t slot, int d) {
    // The program stopped redirecting when it passed the first of these bytes, so the
    // redirected count is final: once dst has queued all of it (and what we copied before),
    // the passed bytes go next, by copy.
    Direction& dir = c.dir[d];
    uint64_t expected =
        loadRelaxed(sockmap_->record(c.record + d).redirected) + dir.copied + dir.dst_extra;
    if (!barrierDone(c, slot, d, checkQueued(c.fd[1 - d], expected))) return;
    dir.catching_up = false;
    dir.user_copy = true;
    advanceCopy(c, slot, d);
}

void Worker::sockmapFinBarrier(Conn& c, uint32_t slot, int d) {
    if (sockmapBroken(c, slot)) return;
    if (!barrierDone(
            c, slot, d,
            checkFinBarrier(c.fd[d], c.fd[1 - d], c.dir[d].src_skipped, c.dir[d].dst_extra)))
        return;
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
        lstats(c).sockmap_skipped.add(cut);
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
            lc(c).name.c_str(), d == 0 ? "client" : "upstream");
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
        prepCopyRecv(sqeFor(c, slot, Op::Recv, d), c.fd[d], *bufs_,
                     dir.path == DataPath::Sockmap ? RecvWait::Caller : RecvWait::Kernel);
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
        if ((res == 0 || res == -EAGAIN) && dir.path == DataPath::Sockmap &&
            hasPassedBytes(c, d)) {
            // Not the end yet. A passed skb that finds its psock's queue busy (with the other
            // direction's bytes on their way out of this socket) is delivered later by the
            // psock worker, and the FIN behind it can be seen first: recvmsg() returns 0
            // while the program's count says bytes are missing (measured, 1 in ~30 runs of
            // 200 concurrent echoes). The recv would keep returning 0 at once, so look again
            // on a timer until they arrived. -EAGAIN: the same bytes, not yet on the psock's
            // queue (RecvWait::Caller).
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
        if (res == -EAGAIN) {
            armPollOut(c, slot, d);  // dst is full: send again once it says it has room
        } else if (res != -EINTR) {
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
            lstats(c).sockmap_copied.add(static_cast<uint64_t>(res));
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
