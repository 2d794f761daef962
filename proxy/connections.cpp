#include "connections.hpp"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "clock.hpp"
#include "log.hpp"
#include "tcp_options.hpp"

namespace zcrelay {
namespace {

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

}  // namespace

Connections::Connections(unsigned worker, Ring& ring, ProcessShared& process, WorkerStats& stats,
                         PumpEnv& pumps, Acceptor& acceptor, Generations& generations,
                         const int64_t& now_ms, uint32_t max_conns, Paths& paths)
    : id_(worker),
      ring_(ring),
      process_(process),
      stats_(stats),
      pumps_(pumps),
      acceptor_(acceptor),
      generations_(generations),
      now_ms_(now_ms),
      max_conns_(max_conns),
      paths_(paths),
      upstream_(worker),
      loops_(process.loops.table(worker)) {
    starved_.reserve(4096);
    starved_retry_.reserve(4096);
    queued_.reserve(1024);
    queued_retry_.reserve(1024);
}

void Connections::onCompletion(UserData ud, const io_uring_cqe* cqe) {
    Conn& c = conn(ud.slot);
    if (c.generation != ud.generation || c.state == ConnState::Free) {
        LOG_ERROR("stale completion op=%d slot=%u gen=%u (slot gen %u): bookkeeping bug",
                  static_cast<int>(ud.op), ud.slot, ud.generation, c.generation);
        if (cqe->flags & IORING_CQE_F_BUFFER)
            pumps_.bufs.drop(cqe->flags, cqe->res);
        return;
    }
    // IORING_CQE_F_MORE: another CQE of this SQE follows (a zero-copy send's notification), so
    // it stays in flight and the slot is not reused before that one came.
    if (!(cqe->flags & IORING_CQE_F_MORE)) --c.inflight;
    switch (ud.op) {
        case Op::Connect:
            if (c.state == ConnState::Connecting)
                onConnectStep(c, ud.slot,
                              upstream_.onConnect(ring_, c, ud.slot, cqe->res, now_ms_));
            break;
        case Op::ConnectTimeout:
            break;  // the connect's own CQE says -ECANCELED if this fired
        case Op::FinishedWatch:
            // A finished side's peer reset (in CLOSE_WAIT the kernel says EPIPE). The FIN every
            // poll reports, and a POLLHUP alone once both ways are shut, are nothing.
            if (c.state == ConnState::Relaying && cqe->res > 0 && (cqe->res & POLLERR))
                closeConn(c, ud.slot, resetReason(ud.dir, true));
            break;
        case Op::QueueWatch:
            // Still in the queue (not out of it, its watch cancelled), and a reset, not the
            // FIN every poll reports.
            if (c.state == ConnState::Connecting && c.queued_until_ms != 0 && cqe->res > 0 &&
                (cqe->res & (POLLERR | POLLHUP))) {
                c.queued_until_ms = 0;
                closeConn(c, ud.slot, CloseReason::ClientReset);
            }
            break;
        case Op::ProxyRead:
            if (c.state == ConnState::ReadingProxy && cqe->res >= 0)
                onProxyRead(c, ud.slot, cqe->res);
            break;
        case Op::HelloRead:
            // After inspect_timeout the connection went on without it: the poll stays armed
            // until the client sends or the socket closes, and ends here, unheeded.
            if (c.state == ConnState::Inspecting && cqe->res >= 0)
                onHelloRead(c, ud.slot, cqe->res);
            break;
        case Op::PollIn:
        case Op::PollOut:
        case Op::Watch:
        case Op::Recv:
        case Op::Send:
        case Op::Barrier:
            if (c.state == ConnState::Relaying ||
                (c.state == ConnState::HandingOver && c.dir[ud.dir].path() != DataPath::Splice)) {
                // Handing over, a copy direction still sends what it holds, and a sockmap one
                // finishes its step (PumpPort::handing); a splice direction's polls just end.
                onPumpCompletion(c, ud.slot, ud.dir, ud.op, cqe->res, cqe->flags, ud.aux);
            } else if (cqe->flags & IORING_CQE_F_BUFFER) {
                // A recv that completed as the connection closed: its buffer goes back.
                pumps_.bufs.drop(cqe->flags, cqe->res);
            } else if (ud.op == Op::Send) {
                // A zero-copy send's CQE after the connection stopped relaying: the buffer it
                // lent goes back once the kernel let go of it.
                returnHold(pumps_, ud.aux, cqe->res, cqe->flags);
            }
            break;
        default:
            break;
    }
    if (c.state == ConnState::Closing && c.inflight == 0) freeConn(c, ud.slot);
    if (c.state == ConnState::HandingOver && c.inflight == 0) rested(c, ud.slot);
}

bool Connections::accept(int fd, int32_t listener, const SocketAddress& peer) {
    uint32_t slot = allocConn();
    if (slot == UINT32_MAX) return false;
    Generation& gen = generations_.current();
    const ListenerRt& lr = gen.rt->listeners[listener];
    Conn& c = conn(slot);
    enter(c, ConnState::Accepted);
    c.listener = static_cast<uint8_t>(listener);
    // With routes the cluster is the route's, chosen once the ClientHello is in.
    if (!lr.inspects()) c.cluster = static_cast<uint16_t>(lr.cluster);
    c.gen = &gen;
    ++gen.live;
    c.fd[0] = fd;
    c.counted_active = true;
    c.accepted_us = wallClockUs();
    c.accepted_mono_us = monotonicUs();
    c.last_active_ms = now_ms_;
    lr.shared->stats[id_].accepted.add();
    stats_.accepted.add();
    // The client socket's TCP options came with it from the listener (Acceptor), and its
    // address with the accept. (The access log names the client when the connection ends,
    // and by then getpeername() would fail: a socket that saw both FINs or an RST is in
    // TCP_CLOSE, which the kernel answers with ENOTCONN.)
    if (peer.length != 0) {
        c.client = peer;
        c.have_client = true;
    } else if (process_.access_log != nullptr) {
        clientAddress(c);
    }
    if (process_.loops.suspect(peer) && closedAsLoop(c, slot)) return true;
    if (acceptor_.admit(c, slot)) {
        serve(c, slot);
    } else {
        enter(c, ConnState::Queued);
    }
    return true;
}

Conn* Connections::queued(UserData ud) {
    Conn& c = conn(ud.slot);
    return c.generation == ud.generation && c.state == ConnState::Queued ? &c : nullptr;
}

void Connections::refuse(Conn& c, uint32_t slot) { closeConn(c, slot, CloseReason::Drain); }

// ---- the lifecycle of a connection ---------------------------------------------------------

uint32_t Connections::allocConn() {
    if (free_head_ == UINT32_MAX) {
        if (slots_used_ + kChunk > UserData::kMaxSlot) return UINT32_MAX;
        // Grows only past the previous peak of connections: no allocation in steady state.
        chunks_.push_back(std::make_unique<Conn[]>(kChunk));
        if (process_.access_log != nullptr) names_.push_back(std::make_unique<HelloNames[]>(kChunk));
        uint32_t base = static_cast<uint32_t>((chunks_.size() - 1) * kChunk);
        for (uint32_t i = kChunk; i-- > 0;) {
            conn(base + i).next_free = free_head_;
            free_head_ = base + i;
        }
    }
    uint32_t slot = free_head_;
    free_head_ = conn(slot).next_free;
    slots_used_ = std::max(slots_used_, slot + 1);
    ++live_;
    return slot;
}

void Connections::serve(Conn& c, uint32_t slot) {
    // With accept_proxy the client is the one the header names: its limit waits for that.
    if (listenerConfig(c).accept_proxy) {
        enter(c, ConnState::ReadingProxy);
        c.last_active_ms = now_ms_;  // proxy_timeout counts from here (sweep)
        proxy_reader_.start(ring_, c, slot);
    } else {
        clientKnown(c, slot);
    }
}

void Connections::onProxyRead(Conn& c, uint32_t slot, int res) {
    ProxyRead r = proxy_reader_.onReadable(ring_, c, slot, listenerConfig(c), res);
    switch (r.kind) {
        case ProxyRead::Wait:
            return;
        case ProxyRead::Done:
            clientKnown(c, slot);
            return;
        case ProxyRead::Failed:
            proxyFailed(c, slot, r.why);
            return;
        case ProxyRead::Reset:
            closeConn(c, slot, CloseReason::ClientReset);
            return;
        case ProxyRead::Error:
            closeConn(c, slot, CloseReason::Error);
            return;
    }
}

void Connections::proxyFailed(Conn& c, uint32_t slot, ProxyFailure why) {
    lstats(c).proxy_errors[idx(why)].add();
    LOG_DEBUG("%s: PROXY header refused: %s", listenerConfig(c).name.c_str(),
              std::string(label(why)).c_str());
    closeConn(c, slot, CloseReason::ProxyProtocol);
}

void Connections::clientKnown(Conn& c, uint32_t slot) {
    if (!acceptor_.admitSource(c)) {
        closeConn(c, slot, CloseReason::SourceLimit);
        return;
    }
    if (!listenerOf(c).inspects()) {
        startConnect(c, slot);
        return;
    }
    enter(c, ConnState::Inspecting);
    c.last_active_ms = now_ms_;  // inspect_timeout counts from here (sweep)
    c.connect_start_us = monotonicUs();
    hello_reader_.start(ring_, c, slot);
}

void Connections::onHelloRead(Conn& c, uint32_t slot, int res) {
    HelloNames* names = helloNames(slot);
    Inspected r = hello_reader_.onReadable(ring_, c, slot, listenerOf(c), res, names);
    switch (r.kind) {
        case Inspected::Wait:
            return;
        case Inspected::Chosen:
            routeChosen(c, slot, r.choice);
            return;
        case Inspected::Reset:
            closeConn(c, slot, CloseReason::ClientReset);
            return;
    }
}

void Connections::routeChosen(Conn& c, uint32_t slot, RouteChoice choice) {
    const ListenerRt& l = listenerOf(c);
    ListenerStats& s = lstats(c);
    s.inspect_duration.observe(kInspectBuckets, static_cast<uint64_t>(std::max<int64_t>(
                                                    0, monotonicUs() - c.connect_start_us)));
    if (choice.failed) {
        s.inspect_failures[idx(choice.why)].add();
        LOG_DEBUG("%s: inspect: %s%s", l.config.name.c_str(),
                  std::string(label(choice.why)).c_str(),
                  choice.route == ListenerRt::kNoRoute ? ", no default route" : "");
    }
    if (choice.route == ListenerRt::kNoRoute) {
        closeConn(c, slot, CloseReason::NoRoute);
        return;
    }
    const RouteRt& route = l.routes[choice.route];
    c.route = static_cast<uint8_t>(choice.route);
    c.cluster = static_cast<uint16_t>(route.cluster);
    route.state->selections[id_].add();
    startConnect(c, slot);
}

void Connections::startConnect(Conn& c, uint32_t slot) {
    enter(c, ConnState::Connecting);
    onConnectStep(c, slot, upstream_.start(ring_, c, slot));
}

void Connections::connect(Conn& c, uint32_t slot) {
    onConnectStep(c, slot, upstream_.connect(ring_, c, slot));
}

void Connections::onConnectStep(Conn& c, uint32_t slot, ConnectStep step) {
    switch (step.kind) {
        case ConnectStep::Pending:
            return;
        case ConnectStep::OutOfFds:
            // The client is not dropped: it gets the spare fd, or waits (accepting stops)
            // until a closing connection gives fds back, bounded by connect_timeout.
            if (acceptor_.outOfFds()) {
                step = upstream_.connect(ring_, c, slot);
                if (step.kind != ConnectStep::OutOfFds) {
                    onConnectStep(c, slot, step);
                    return;
                }
            }
            acceptor_.waitForFd(c, slot);
            return;
        case ConnectStep::Connected:
            // Recorded before the first byte moves, so that our own listener, should the
            // backend lead back to it, knows the connection it accepts for ours.
            if (clusterOf(c).backends[c.backend].config.address.family() != AF_UNIX)
                loops_.remember(process_.loops, slot, c.fd[1], clusterOf(c), c.backend);
            startRelaying(c, slot);
            return;
        case ConnectStep::Close:
            closeConn(c, slot, step.reason);
            return;
        case ConnectStep::Queue: {
            const ClusterConfig& cc = clusterOf(c).config;
            if (c.queued_until_ms == 0) {
                size_t waiting = 0;
                for (uint64_t packed : queued_) {
                    const UserData q = UserData::unpack(packed);
                    if (waitsInQueue(q) && conn(q.slot).cluster == c.cluster) ++waiting;
                }
                if (waiting >= cc.queue_size) {
                    closeConn(c, slot, CloseReason::QueueFull);
                    return;
                }
                c.queued_until_ms = now_ms_ + cc.queue_timeout.count();
                // Waiting here it has no upstream socket, so nothing else watches the client:
                // one that resets leaves the queue at once, instead of taking a place (and a
                // backend connection: for PostgreSQL, a forked backend) only to close then.
                // A FIN alone is no abort, as with HAProxy's abortonclose off: a client may
                // half-close after its request and still wait for the answer. io_uring reports
                // a FIN to every poll whatever it asks (proxy/kernel.md), so a one-shot poll
                // would end there and could not be armed again; a multishot one reports the
                // FIN once and stays for the reset.
                io_uring_prep_poll_multishot(connSqe(ring_, c, slot, Op::QueueWatch), c.fd[0],
                                             POLLERR | POLLHUP);
            }
            queued_.push_back(UserData{Op::Connect, 0, slot, c.generation}.pack());
            return;
        }
    }
}

void Connections::retryQueued() {
    queued_retry_.clear();
    queued_retry_.swap(queued_);
    for (uint64_t packed : queued_retry_) {
        const UserData ud = UserData::unpack(packed);
        if (!waitsInQueue(ud)) continue;
        Conn& c = conn(ud.slot);
        if (now_ms_ >= c.queued_until_ms) {
            c.queued_until_ms = 0;
            closeConn(c, ud.slot, CloseReason::QueueTimeout);
            continue;
        }
        // The connect budget starts once it has a place, as HAProxy's `timeout connect` does
        // after `timeout queue`.
        c.connect_deadline_us = monotonicUs() + listenerConfig(c).connect_timeout.count() * 1000;
        const ConnectStep step = upstream_.connect(ring_, c, ud.slot);
        if (step.kind != ConnectStep::Queue) {
            // Out of the queue: its watch ends (a close would cancel it with the fd anyway).
            c.queued_until_ms = 0;
            ring_.cancelRequest(UserData{Op::QueueWatch, 0, ud.slot, c.generation}.pack());
        }
        onConnectStep(c, ud.slot, step);  // Queue: back in line, behind the older ones
    }
}

void Connections::retryFdWaiter(UserData ud) {
    Conn& c = conn(ud.slot);
    if (c.generation != ud.generation || c.state != ConnState::Connecting || c.fd[1] >= 0)
        return;
    if (monotonicUs() >= c.connect_deadline_us) {
        lstats(c).connect_failures[idx(ConnectFailure::Other)].add();
        LOG_WARN("%s: no fd for an upstream socket within connect_timeout",
                 listenerConfig(c).name.c_str());
        closeConn(c, ud.slot, CloseReason::ConnectFailed);
        return;
    }
    connect(c, ud.slot);
}

bool Connections::closedAsLoop(Conn& c, uint32_t slot) {
    const bool loop = process_.loops.cameBack(
        c.client, c.fd[0], [&](const ClusterRt& cluster, int16_t backend) {
            upstream_.ejectLoop(cluster, static_cast<size_t>(backend), c, now_ms_);
        });
    if (loop) closeConn(c, slot, CloseReason::Loop);
    return loop;
}

void Connections::startRelaying(Conn& c, uint32_t slot) {
    enter(c, ConnState::Relaying);
    c.last_active_ms = now_ms_;
    if (int err = upstream_.sendProxyHeader(c); err != 0) {
        failDirection(c, slot, 0, false, err);
        return;
    }
    // A path may want what waits in the client's socket sent on before it starts: the rest of
    // a segment the PROXY header or the ClientHello was read from (Paths::wantsQueueSentFirst).
    const ListenerRt& lr = listenerOf(c);
    Forwarded early;
    if ((lr.inspects() || lr.config.accept_proxy) && paths_.wantsQueueSentFirst(lr.config.mode)) {
        early = hello_reader_.forward(c);
        if (early.error != 0) {
            failDirection(c, slot, 0, early.on_src, early.error);
            return;
        }
    }
    const BackendRt& be = clusterOf(c).backends[c.backend];
    paths_.choose(
        PathRequest{lr.config.mode, be.config.address.family() == AF_UNIX, early.cut_short, slot,
                    lr.config.pipe_size, c.fd, c.proxy_in, c.proxy_out, early.bytes, lstats(c),
                    lr.config.name, lr.config.auto_sockmap_max},
        c.paths, c.dir[0].pump, c.dir[1].pump);
    if (early.bytes > 0) addBytes(c, 0, early.bytes);
    for (int d = 0; d < 2; ++d) {
        PumpPort p = port(c, slot, d);
        apply(c, slot, d,
              std::visit([&](auto& pump) { return pump.start(p, pumps_); }, c.dir[d].pump));
        if (c.state != ConnState::Relaying) return;
    }
}

PumpPort Connections::port(Conn& c, uint32_t slot, int d) {
    return PumpPort{ring_,
                    UserData{Op::Ignore, static_cast<uint8_t>(d), slot, c.generation}.pack(),
                    c.inflight,
                    static_cast<uint8_t>(d),
                    c.fd[d],
                    c.fd[1 - d],
                    c.dir[1 - d].finished,
                    static_cast<uint32_t>(listenerConfig(c).pipe_size),
                    lstats(c),
                    c.ending,
                    c.ending ? &c.dir[d].end_left : nullptr,
                    listenerConfig(c).send_zerocopy,
                    c.state == ConnState::HandingOver};
}

void Connections::onPumpCompletion(Conn& c, uint32_t slot, int d, Op op, int res, uint32_t flags,
                                   uint8_t aux) {
    PumpPort p = port(c, slot, d);
    apply(c, slot, d,
          std::visit([&](auto& pump) { return pump.onCompletion(p, pumps_, op, res, flags, aux); },
                     c.dir[d].pump));
}

void Connections::apply(Conn& c, uint32_t slot, int d, Step step) {
    bool promote = false;
    if (step.moved > 0) {
        addBytes(c, d, step.moved);
        promote = Paths::observe(c.paths, d, step.moved);
    }
    if (step.active) c.last_active_ms = now_ms_;
    if (step.starved)
        starved_.push_back(UserData{Op::Recv, static_cast<uint8_t>(d), slot, c.generation}.pack());
    switch (step.kind) {
        case Step::Wait:
            if (promote && c.state == ConnState::Relaying) promoteToSockmap(c, slot);
            return;
        case Step::Finished:
            finishDirection(c, slot, d);
            return;
        case Step::Failed:
            failDirection(c, slot, d, step.on_src, step.error);
            return;
        case Step::ToCopy: {
            PumpPort p = port(c, slot, d);
            apply(c, slot, d, paths_.fallBack(c.dir[d].pump, p, pumps_, step.fallback));
            return;
        }
        case Step::Broken:
            resetBroken(c, slot, step.on_src ? d : 1 - d);
            return;
    }
}

void Connections::promoteToSockmap(Conn& c, uint32_t slot) {
    if (c.ending || c.dir[0].finished || c.dir[1].finished) return;
    const ListenerConfig& lc = listenerConfig(c);
    ListenerStats& s = lstats(c);
    unsigned replaced =
        paths_.promote(PromoteRequest{slot, lc.pipe_size, c.fd, c.proxy_in, c.proxy_out, s,
                                      lc.auto_sockmap_max, s.open()},
                       c.paths, c.dir[0].pump, c.dir[1].pump, pumps_.pipes);
    for (int d = 0; d < 2 && c.state == ConnState::Relaying; ++d) {
        if ((replaced & (1u << d)) == 0) continue;
        PumpPort p = port(c, slot, d);
        apply(c, slot, d,
              std::visit([&](auto& pump) { return pump.start(p, pumps_); }, c.dir[d].pump));
    }
}

void Connections::addBytes(Conn& c, int d, uint64_t n) {
    ListenerStats& s = lstats(c);
    s.bytes[d][idx(c.dir[d].path())].add(n);
    c.bytes[d] += n;
    BackendStats& b = clusterOf(c).backends[c.backend].state->stats[id_];
    (d == 0 ? b.bytes_upstream : b.bytes_downstream).add(n);
    c.last_active_ms = now_ms_;
}

void Connections::finishDirection(Conn& c, uint32_t slot, int d) {
    c.dir[d].finished = true;
    if (c.ending && c.bothFinished()) {
        // Both sources are read to their end and everything read was written: now the FINs
        // the pumps kept (PumpPort::ending) go out, and the sockets close at once. A peer
        // whose bytes came after the relay stopped reading gets an RST from close().
        for (int i = 0; i < 2; ++i)
            if (c.fd[i] >= 0) ::shutdown(c.fd[i], SHUT_WR);
    }
    if (!c.bothFinished()) {
        lstats(c).half_closed.add();  // one way done, the other still flowing
        acknowledgeNow(c.fd[d]);      // its FIN: the peer must not wait for the other's
        return;
    }
    lstats(c).half_closed.sub();
    closeConn(c, slot, CloseReason::Done);
}

void Connections::watchFinished(Conn& c, uint32_t slot) {
    // Its source is read no more, and written only when the other direction has bytes for it:
    // while that side is silent (a long query behind the client's FIN), nothing else would see
    // this peer reset, and the connection would hold the other peer until a fin or idle timeout.
    // Multishot: a one-shot poll would end at once on the FIN it already read (proxy/kernel.md,
    // "A poll always reports a FIN"); this one reports that FIN once and stays for the reset.
    const int d = c.dir[0].finished ? 0 : 1;
    io_uring_prep_poll_multishot(connSqe(ring_, c, slot, Op::FinishedWatch, d), c.fd[d],
                                 POLLERR | POLLHUP);
    c.watching_finished = true;
}

void Connections::failDirection(Conn& c, uint32_t slot, int d, bool on_src, int err) {
    if (isPeerError(err)) {
        closeConn(c, slot, resetReason(d, on_src));
    } else {
        LOG_WARN("%s: %s on %s socket", listenerConfig(c).name.c_str(), strerror(err),
                 (on_src ? d : 1 - d) == 0 ? "client" : "upstream");
        closeConn(c, slot, CloseReason::Error);
    }
}

void Connections::retryStarved() {
    // Swap out first: a retry that is starved again re-enters the list for the next round.
    starved_retry_.clear();
    starved_retry_.swap(starved_);
    // No more retries than the ring has buffers: with 100 bulk clients, every direction retried
    // whenever one buffer came back found the ring empty again, 26 failed recvs per MB and
    // 1.45x the relay CPU per GB. The rest wait, in order, for the next round (a buffer back,
    // or the tick).
    uint32_t budget = pumps_.bufs.inRing();
    for (uint64_t packed : starved_retry_) {
        UserData ud = UserData::unpack(packed);
        Conn& c = conn(ud.slot);
        if (c.generation != ud.generation || c.state != ConnState::Relaying) continue;
        if (budget == 0) {
            starved_.push_back(packed);
            continue;
        }
        --budget;
        PumpPort p = port(c, ud.slot, ud.dir);
        apply(c, ud.slot, ud.dir,
              std::visit([&](auto& pump) { return pump.resume(p, pumps_); }, c.dir[ud.dir].pump));
    }
}

void Connections::onPathSignal(uint32_t ring, int res) {
    paths_.onSignal(ring, res, slots_used_,
                    [this](uint32_t slot) { lookAtKernel(conn(slot), slot); });
    // Handing the ring over: its poll is back, and it may go now.
    if (outbound_ && ring < ring_handoffs_.size()) tryRing(ring);
}

void Connections::lookAtKernel(Conn& c, uint32_t slot) {
    if (c.state != ConnState::Relaying || !c.paths.any()) return;
    for (int d = 0; d < 2 && c.state == ConnState::Relaying; ++d) {
        if (c.dir[d].finished) continue;
        PumpPort p = port(c, slot, d);
        apply(c, slot, d,
              std::visit([&](auto& pump) { return pump.scan(p, pumps_); }, c.dir[d].pump));
    }
    if (int side = 0; c.state == ConnState::Relaying && paths_.broken(c.paths, side))
        resetBroken(c, slot, side);
}

void Connections::resetBroken(Conn& c, uint32_t slot, int side) {
    // Never deliver a stream we know is wrong: both peers get an RST instead of a FIN.
    LOG_ERROR(
        "%s: the kernel gave the %s program a %s stream it cannot relay exactly; "
        "resetting the connection",
        listenerConfig(c).name.c_str(), std::string(label(c.dir[side].path())).c_str(),
        side == 0 ? "client" : "upstream");
    linger lg{1, 0};
    for (int fd : c.fd)
        if (fd >= 0) ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    closeConn(c, slot, CloseReason::Error);
}

void Connections::closeConn(Conn& c, uint32_t slot, CloseReason reason) {
    if (c.state == ConnState::Closing || c.state == ConnState::Free) return;
    // Accounting: metrics, the access log, the limits and the backend's count.
    if (c.ending && reason == CloseReason::Done) reason = CloseReason::MaxDuration;
    const bool handing = c.state == ConnState::HandingOver;
    const bool relaying = c.state == ConnState::Relaying || handing;
    // Handing over on sockmap: its ring waits for it unless it came to rest (rested()).
    const int handing_ring = handing && !c.rested ? paths_.ringOf(c.paths) : -1;
    // What the kernel moved since the last tick is counted before the access log's record is
    // made: a connection reset within a tick of its last bytes logged only what the tick had
    // read (a psql session over TLS: 8 bytes up, 0 down), while the metrics had it all.
    if (relaying) {
        for (int d = 0; d < 2; ++d) {
            std::visit(
                [&](auto& pump) {
                    if (uint64_t n = pump.kernelBytes(pumps_)) addBytes(c, d, n);
                },
                c.dir[d].pump);
        }
    }
    countClose(c, slot, reason);
    acceptor_.release(c);
    if (c.connect_us >= 0) loops_.forget(process_.loops, slot);
    upstream_.release(c);
    enter(c, ConnState::Closing);
    // The pumps tear down: timers and pipes go.
    if (relaying) {
        for (int d = 0; d < 2; ++d) {
            PumpPort p = port(c, slot, d);
            std::visit([&](auto& pump) { pump.abort(p, pumps_); }, c.dir[d].pump);
        }
    }
    if (reason == CloseReason::HandedOver)
        paths_.handedOver(c.paths);  // its sockets stay in the maps, the next relay's now
    else
        paths_.tearDown(c.paths, lstats(c));
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
        // In-flight polls, recvs, sends and the connect: their CQEs still arrive after the
        // cancel and are counted down in inflight. The cancel reaches each of them because none
        // runs in an io-wq worker. One that did would block in recvmsg() there, beyond the
        // cancel's reach, its file reference keeping the socket open: a recv on a sockmap
        // socket that io_uring's own poll had retried 128 times did exactly that, and the
        // client never got its RST (130 of 374 runs of
        // SockmapTest.UpstreamResetMidStreamResetsClientPromptly with RecvWait::Kernel and no
        // shutdown(SHUT_RD) before the cancel; 0 of 400 with RecvWait::Caller, as now). Sends
        // are MSG_DONTWAIT for the same reason (pump/copy_pump.cpp).
        // With nothing in flight (a connection that ended cleanly: both EOFs read, every send
        // completed) there is nothing to cancel, and the close goes alone: two SQEs fewer per
        // connection, and the cancel's walk over the ring's requests was 1.3 % of the relay's
        // CPU in bench/run's connrate.
        if (c.inflight == 0)
            ring_.close(fd);
        else
            ring_.cancelAndClose(fd);
        fd = -1;
    }
    if (c.inflight == 0) freeConn(c, slot);
    // One that was waiting to cross ended here after all (both directions finished, a reset,
    // the drain deadline); a sent one was counted already.
    if (handing && reason != CloseReason::HandedOver) {
        --handing_;
        // A sockmap connection still on its way to rest: its ring waits for one fewer.
        if (handing_ring >= 0) {
            --ring_handoffs_[handing_ring].waiting;
            tryRing(static_cast<uint32_t>(handing_ring));
        }
        handedOne();
    }
}

void Connections::countClose(Conn& c, uint32_t slot, CloseReason reason) {
    if (c.dir[0].finished != c.dir[1].finished) lstats(c).half_closed.sub();
    if (!c.counted_active) return;
    ListenerStats& ls = lstats(c);
    ls.closed[idx(reason)].add();
    // Handed over, it lives on in the next relay, which observes its whole duration.
    if (reason != CloseReason::HandedOver)
        ls.duration.observe(kDurationBuckets, static_cast<uint64_t>(std::max<int64_t>(
                                                  0, monotonicUs() - c.accepted_mono_us)));
    c.counted_active = false;
    if (process_.access_log != nullptr) logConnection(c, slot, reason);
}

void Connections::logConnection(Conn& c, uint32_t slot, CloseReason reason) {
    AccessRecord r;
    r.start_unix_us = c.accepted_us;
    r.duration_us = static_cast<uint64_t>(std::max<int64_t>(0, monotonicUs() - c.accepted_mono_us));
    r.connect_us = c.connect_us;
    r.bytes_upstream = c.bytes[0];
    r.bytes_downstream = c.bytes[1];
    r.client = clientAddress(c);
    copyField(r.listener, listenerConfig(c).name);
    if (c.cluster != Conn::kNoCluster) copyField(r.cluster, clusterOf(c).config.name);
    if (c.backend >= 0) copyField(r.backend, clusterOf(c).backends[c.backend].key);
    if (c.route != Conn::kNoRoute) copyField(r.route, listenerOf(c).routes[c.route].config.name);
    if (const HelloNames* names = helloNames(slot); names != nullptr) {
        copyField(r.sni, names->sni);
        copyField(r.alpn, names->alpn);
    }
    r.reason = reason;
    r.attempts = c.attempts;
    // A promoted connection (mode auto) names both paths, in the order it used them.
    if (c.state == ConnState::Relaying || c.state == ConnState::HandingOver)
        copyField(r.path, c.paths.promoted ? "splice>sockmap" : label(c.dir[0].path()));
    process_.access_log->push(id_, r);
}

void Connections::freeConn(Conn& c, uint32_t slot) {
    if (HelloNames* names = helloNames(slot); names != nullptr && listenerOf(c).inspects())
        *names = HelloNames{};
    for (Direction& dir : c.dir) std::visit([&](auto& pump) { pump.reclaim(pumps_); }, dir.pump);
    uint32_t generation = c.generation + 1;
    generations_.release(*c.gen);
    enter(c, ConnState::Free);
    c = Conn{};
    c.generation = generation;
    c.next_free = free_head_;
    free_head_ = slot;
    --live_;
    acceptor_.slotFreed();
}

}  // namespace zcrelay
