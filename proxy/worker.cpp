#include "worker.hpp"

#include <fcntl.h>
#include <netinet/in.h>
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
#include "tcp_options.hpp"

namespace zcrelay {
namespace {

constexpr unsigned kRingEntries = 4096;
// The aux of the queue's tick (Op::Tick): the worker's own tick has 0.
constexpr uint8_t kQueueTick = 1;
// Of the copy buffers, in the kernel's ring at most (uring/buf_ring.hpp: it starts at 8 and
// doubles while recvs find it empty). Measured, 1 worker, 100 clients x 10 MiB through copy
// mode: peak RSS
// 25.7 MiB with the whole pool in the ring, 12.5 with 16, 14.4 with 32, 18.5 with 64. Fewer in the ring means more recvs find it empty (-ENOBUFS) and
// go again: 39, 33.5 and 25.9 recvs per MB against 20.8 with the whole pool, and with 16 the
// relay CPU per GB was 1.45x (bench/ab.sh); 32 is within the noise of it.
constexpr uint32_t kCopyProvided = 32;
constexpr uint16_t kBufGroup = 0;
// Pipes stop this far below RLIMIT_NOFILE: half of the fds the server keeps in reserve.
constexpr rlim_t kPipeFdHeadroom = 32;

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

bool wantsZerocopy(const Config& config) {
    for (const auto& l : config.listeners)
        if (l.send_zerocopy) return true;
    return false;
}

}  // namespace

Worker::Worker(unsigned id, std::shared_ptr<const Runtime> runtime,
               std::vector<ListenSocket> listen_fds, uint32_t max_conns, Sockmap* sockmap,
               uint32_t sockmap_base, ProcessShared& process)
    : id_(id),
      name_("w" + std::to_string(id)),
      process_(process),
      max_conns_(max_conns),
      sockmap_(sockmap),
      sockmap_base_(sockmap_base),
      generations_(std::move(runtime), id) {
    applied_generation_.store(rt().generation);
    acceptor_ = std::make_unique<Acceptor>(id_, std::move(listen_fds), generations_, process_,
                                           max_conns_, stats_.accept_paused);
    tick_ms_ = tickFor(rt().config);
    tick_ = toTimespec(Duration(tick_ms_));
    // Made here, before any worker thread starts: other workers post() to it (a health
    // check's on_marked_down ends connections on every worker), and a thread's start orders
    // this write before all their reads; made in setUp(), TSan saw two workers race on it.
    wake_fd_.reset(::eventfd(0, EFD_CLOEXEC));
    wake_errno_ = wake_fd_ ? 0 : errno;
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
    if (conns_) conns_->endHandOver();
    {
        // A handover this worker never got to (it had stopped): the giver waits for no one,
        // and connections sent to it are lost, counted.
        std::lock_guard lock(reload_mutex_);
        if (pending_handover_) pending_handover_->workerDone();
        pending_handover_.reset();
        process_.handovers[idx(handover::Outcome::Lost)].fetch_add(adopting_.size());
        adopting_.clear();
    }
    ring_.reset();  // cancels whatever is still armed before the fds it references go away
    finished_.store(true);
}

Result<void> Worker::setUp() {
    // Created here, not in the constructor: SINGLE_ISSUER binds the ring to the creating thread.
    auto ring = Ring::create(kRingEntries);
    if (!ring) return tl::unexpected(ring.error());
    ring_ = std::move(*ring);
    auto bufs =
        BufRing::create(ring_->raw(), kBufGroup, kCopyBuffers, kCopyBufferSize, kCopyProvided);
    if (!bufs) return tl::unexpected(bufs.error());
    bufs_ = std::move(*bufs);
    const Config& config = rt().config;
    uint64_t pipes = config.max_pipes / std::max(1u, config.workers);
    if (config.max_pipes > 0) pipes = std::max<uint64_t>(pipes, 1);
    rlimit nofile{};
    getrlimit(RLIMIT_NOFILE, &nofile);
    int ceiling = static_cast<int>(std::min<rlim_t>(nofile.rlim_cur, INT32_MAX) - kPipeFdHeadroom);
    pipes_ = std::make_unique<PipePool>(pipes, ceiling, stats_);
    holds_ = std::make_unique<ZerocopyHolds>(kWorkerHolds);
    pumps_.reset(new PumpEnv{*bufs_, *pipes_, stats_, ring_->probeSendZc(), *holds_});
    if (id_ == 0 && !pumps_->send_zc.op && wantsZerocopy(config))
        LOG_WARN("send_zerocopy: this kernel has no IORING_OP_SEND_ZC (Linux 6.0): plain sends");
    paths_ = std::make_unique<Paths>(*ring_, sockmap_, sockmap_base_, max_conns_, stats_, id_);
    if (auto signal = paths_->startSignal(); !signal) return tl::unexpected(signal.error());
    conns_ = std::make_unique<Connections>(id_, *ring_, process_, stats_, *pumps_, *acceptor_,
                                           generations_, now_ms_, max_conns_, *paths_);
    if (!wake_fd_) {
        errno = wake_errno_;
        return sysError("eventfd");
    }
    now_ms_ = monotonicMs();
    acceptor_->start(*ring_, *conns_);
    armWake();
    armTick();
    checker_ = std::make_unique<HealthChecker>(id_, *ring_, process_);
    checker_->reset(rt());
    if (int r = ring_->submit(); r < 0) return sysError("io_uring_submit", -r);
    return {};
}

void Worker::loop() {
    for (;;) {
        if (draining_ && conns_->live() == 0 && !acceptor_->sweeping()) {
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
        stats_.copy_buffers_busy.set(bufs_->busy());
        now_ms_ = monotonicMs();
        unsigned head, count = 0;
        io_uring_cqe* cqe;
        io_uring_for_each_cqe(ring_->raw(), head, cqe) {
            dispatch(cqe);
            ++count;
        }
        io_uring_cq_advance(ring_->raw(), count);
        // A recv that found the ring empty goes again once buffers went into it.
        if (bufs_->replenished()) conns_->retryStarved();
        if (conns_->freedPlace() && conns_->queued()) conns_->retryQueued();
        if (conns_->queued() && !queue_tick_armed_) armQueueTick();
        acceptor_->afterBatch();
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
            if (ud.aux == kQueueTick)
                onQueueTick();
            else
                onTick();
            return;
        case Op::PathSignal:
            conns_->onPathSignal(ud.slot, cqe->res);
            return;
        case Op::Accept:
            acceptor_->onAccept(ud.slot, ud.aux, cqe->res, now_ms_);
            return;
        case Op::Check:
        case Op::CheckTimer:
        case Op::CheckTimeout:
            checker_->onCompletion(ud, cqe->res);
            return;
        default:
            conns_->onCompletion(ud, cqe);
            return;
    }
}

// ---- commands, reload, the tick ------------------------------------------------------------

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
        acceptor_->drain();
        LOG_INFO("draining %u connections (deadline %lld ms)", conns_->live(),
                 static_cast<long long>(rt().config.drain_timeout.count()));
    }
    if (cmds & kCmdStop) drain_deadline_ms_ = now_ms_;
    if (cmds & kCmdEndBackend) {
        std::vector<PendingEnd> ends;
        {
            std::lock_guard lock(reload_mutex_);
            ends.swap(pending_ends_);
        }
        for (const PendingEnd& end : ends) {
            const uint32_t n = conns_->endBackend(end.backend.get(), end.reason);
            if (n > 0)
                LOG_INFO("closed %u connections to backend %s (%s)", n, end.name.c_str(),
                         std::string(label(end.reason)).c_str());
        }
    }
    if (cmds & kCmdHandOver) {
        std::shared_ptr<handover::Outbound> out;
        {
            std::lock_guard lock(reload_mutex_);
            out.swap(pending_handover_);
        }
        if (out) conns_->handOver(std::move(out));
    }
    if (cmds & kCmdAdopt) {
        std::vector<handover::HandedConn> conns;
        std::vector<std::pair<Sockmap*, uint32_t>> rings;
        {
            std::lock_guard lock(reload_mutex_);
            conns.swap(adopting_);
            rings.swap(adopting_rings_);
        }
        // The rings first: a connection on one is lost unless this worker reads it.
        for (auto [map, index] : rings)
            if (auto ring = paths_->adoptRing(*map, index); !ring)
                LOG_ERROR(
                    "handover: wake-up ring %u of sockmap maps adopted: %s; its "
                    "connections are lost",
                    index, ring.error().message().c_str());
        for (handover::HandedConn& c : conns) conns_->adopt(c);
    }
    if (draining_ && now_ms_ >= drain_deadline_ms_) conns_->sweep(true, tick_ms_);
    if (cmds & kCmdReload) applyReload();
    armWake();
}

void Worker::endConnectionsOf(std::shared_ptr<BackendState> backend, CloseReason reason,
                              std::string name) {
    {
        std::lock_guard lock(reload_mutex_);
        pending_ends_.push_back({std::move(backend), reason, std::move(name)});
    }
    post(kCmdEndBackend);
}

void Worker::handOver(std::shared_ptr<handover::Outbound> out) {
    {
        std::lock_guard lock(reload_mutex_);
        pending_handover_ = std::move(out);
    }
    post(kCmdHandOver);
}

void Worker::adoptRing(Sockmap& map, uint32_t index) {
    {
        std::lock_guard lock(reload_mutex_);
        adopting_rings_.emplace_back(&map, index);
    }
    post(kCmdAdopt);
}

void Worker::adopt(handover::HandedConn conn) {
    {
        std::lock_guard lock(reload_mutex_);
        adopting_.push_back(std::move(conn));
    }
    post(kCmdAdopt);
}

void Worker::reload(std::shared_ptr<const Runtime> rt, std::vector<ListenSocket> new_fds) {
    {
        std::lock_guard lock(reload_mutex_);
        pending_rt_ = std::move(rt);
        pending_fds_ = std::move(new_fds);
    }
    post(kCmdReload);
}

void Worker::applyReload() {
    std::shared_ptr<const Runtime> next;
    std::vector<ListenSocket> fds;
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
    acceptor_->reload(*next, std::move(fds));
    generations_.advance(std::move(next));
    tick_ms_ = tickFor(rt().config);
    tick_ = toTimespec(Duration(tick_ms_));
    checker_->reset(rt());
    acceptor_->armAll();
    applied_generation_.store(rt().generation);
}

void Worker::armTick() {
    io_uring_sqe* sqe = ring_->sqe();
    io_uring_prep_timeout(sqe, &tick_, 0, 0);
    io_uring_sqe_set_data64(sqe, UserData{Op::Tick}.pack());
}

void Worker::armQueueTick() {
    io_uring_sqe* sqe = ring_->sqe();
    io_uring_prep_timeout(sqe, &queued_tick_, 0, 0);
    UserData ud{Op::Tick};
    ud.aux = kQueueTick;
    io_uring_sqe_set_data64(sqe, ud.pack());
    queue_tick_armed_ = true;
}

void Worker::onQueueTick() {
    queue_tick_armed_ = false;
    conns_->retryQueued();
    if (conns_->queued()) armQueueTick();
}

void Worker::onTick() {
    // Idle timeouts and the drain deadline: a linear sweep, a few times a second. A sweep over
    // 10k slots is microseconds, far cheaper than a timer per connection on the data path.
    conns_->sweep(draining_ && now_ms_ >= drain_deadline_ms_, tick_ms_);
    // Starved copy directions left over by a round's budget, should no buffer come back.
    conns_->retryStarved();
    restoreEjected();
    acceptor_->onTick();
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

}  // namespace zcrelay
