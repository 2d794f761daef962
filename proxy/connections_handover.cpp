// The lifecycle across a takeover (handover.hpp): a worker of the old relay hands its relaying
// connections over to the next relay (Relaying -> HandingOver -> Closing as handed_over), and a
// worker of the new one adopts them (Free -> Relaying). Each side counts what it did in
// zcrelay_handover_connections_total and closes through the lifecycle (connections.cpp).
#include <sys/socket.h>

#include <algorithm>
#include <variant>

#include "clock.hpp"
#include "connections.hpp"
#include "log.hpp"

namespace zcrelay {
namespace {

using handover::Outcome;

// How long a copy direction has to pass on what it holds before it crosses.
constexpr int64_t kHandingMs = 1000;

template <typename List, typename Name>
int32_t indexOf(const List& list, Name name) {
    for (size_t i = 0; i < list.size(); ++i)
        if (name(list[i])) return static_cast<int32_t>(i);
    return -1;
}

// The fds c crosses with: its two sockets, and the two ends of each splice direction's pipe
// that holds bytes (a direction HandingOver moves none, so this stays true until it is sent).
uint32_t fdsToSend(const Conn& c) {
    uint32_t fds = 2;
    for (const Direction& d : c.dir)
        if (const auto* splice = std::get_if<SplicePump>(&d.pump); splice && splice->inPipe() > 0)
            fds += 2;
    return fds;
}

}  // namespace

// ---- the relay that hands over ---------------------------------------------------------------

bool Connections::handable(const Conn& c) const {
    if (c.state != ConnState::Relaying || c.ending || c.paths.any()) return false;
    if (c.backend < 0 || c.cluster == Conn::kNoCluster) return false;
    return std::all_of(c.dir.begin(), c.dir.end(), [](const Direction& d) {
        return d.path() == DataPath::Splice || d.path() == DataPath::Copy;
    });
}

void Connections::handOver(std::shared_ptr<handover::Outbound> out) {
    outbound_ = std::move(out);
    walking_ = true;
    handing_deadline_ms_ = now_ms_ + kHandingMs;
    for (uint32_t slot = 0; slot < slots_used_; ++slot) {
        Conn& c = conn(slot);
        if (c.state == ConnState::Free || c.state == ConnState::Closing) continue;
        if (!handable(c) ||
            !outbound_->admits(listenerConfig(c).name, clusterOf(c).config.name,
                               clusterOf(c).backends[c.backend].key, fdsToSend(c))) {
            process_.handovers[idx(Outcome::Kept)].fetch_add(1);
            ++handed_counts_[1];
            continue;
        }
        enter(c, ConnState::HandingOver);
        ++handing_;
        if (c.inflight == 0) {
            sendHandOver(c, slot);
            continue;
        }
        // What waits to read (and the watches) is cancelled, by its user_data: a splice
        // direction's polls end -ECANCELED, or with the readiness they saw first, unheeded,
        // the bytes staying in the socket for the next relay. A copy direction's recv ends
        // too, or brings bytes it then sends on: its sends go on until it holds nothing
        // (PumpPort::handing).
        for (uint8_t d = 0; d < 2; ++d) {
            const bool copy = c.dir[d].path() == DataPath::Copy;
            for (Op op : {copy ? Op::Recv : Op::PollIn, Op::Watch, Op::PollOut}) {
                if (copy && op == Op::PollOut) continue;  // a send waiting for room goes on
                io_uring_sqe* sqe = ring_.sqe();
                io_uring_prep_cancel64(sqe, UserData{op, d, slot, c.generation}.pack(), 0);
                io_uring_sqe_set_data64(sqe, UserData{}.pack());
            }
        }
    }
    walking_ = false;
    if (handing_ == 0) handedOne();
}

void Connections::sendHandOver(Conn& c, uint32_t slot) {
    const ClusterRt& cluster = clusterOf(c);
    handover::HandedConn h;
    h.listener = listenerConfig(c).name;
    h.cluster = cluster.config.name;
    h.backend = cluster.backends[c.backend].key;
    if (c.route != Conn::kNoRoute) h.route = listenerOf(c).routes[c.route].config.name;
    if (c.have_client) h.client = c.client;
    if (c.have_local) h.local = c.local;
    h.start_unix_us = c.accepted_us;
    h.age_us = monotonicUs() - c.accepted_mono_us;
    h.quiet_ms = now_ms_ - c.last_active_ms;
    h.connect_us = c.connect_us;
    h.attempts = c.attempts;
    int fds[takeover::kMaxFds];
    size_t n = 0;
    fds[n++] = c.fd[0];
    fds[n++] = c.fd[1];
    bool whole = true;
    for (int d = 0; d < 2; ++d) {
        h.bytes[d] = c.bytes[d];
        if (const auto* copy = std::get_if<CopyPump>(&c.dir[d].pump)) {
            whole = whole && copy->empty();
            h.dir[d] = copy->resting();
        } else {
            const SplicePump& pump = std::get<SplicePump>(c.dir[d].pump);
            h.dir[d] = pump.resting();
            if (h.dir[d].in_pipe > 0) {
                fds[n++] = pump.pipe().read_fd;
                fds[n++] = pump.pipe().write_fd;
            }
        }
        h.dir[d].finished = c.dir[d].finished;
    }
    if (!whole) {
        // Nothing in flight, yet bytes held: never so (a send is armed while any are).
        LOG_ERROR(
            "handover: slot %u holds copy bytes with nothing in flight: bookkeeping bug; "
            "it stays",
            slot);
        keepHere(c, slot);
        return;
    }
    --handing_;
    if (auto sent = outbound_->send(h, {fds, n}); sent) {
        // The next relay has its own fds of the sockets and pipes now: closing ours sends no
        // FIN, and the pipe's bytes stay in it (abort() discards our ends).
        process_.handovers[idx(Outcome::HandedOver)].fetch_add(1);
        ++handed_counts_[0];
        closeConn(c, slot, CloseReason::HandedOver);
    } else {
        if (handed_counts_[2]++ == 0)
            LOG_WARN("handover: %s; this worker's connections not sent yet stay here",
                     sent.error().c_str());
        process_.handovers[idx(Outcome::Failed)].fetch_add(1);
        resumeHere(c, slot);
    }
    if (handing_ == 0 && !walking_) handedOne();
}

void Connections::resumeHere(Conn& c, uint32_t slot) {
    enter(c, ConnState::Relaying);
    rearm(c, slot);
}

void Connections::rearm(Conn& c, uint32_t slot) {
    for (int d = 0; d < 2 && c.state == ConnState::Relaying; ++d) {
        if (c.dir[d].finished) continue;
        PumpPort p = port(c, slot, d);
        if (auto* copy = std::get_if<CopyPump>(&c.dir[d].pump))
            apply(c, slot, d, copy->start(p, pumps_));
        else
            apply(c, slot, d, std::get<SplicePump>(c.dir[d].pump).restart(p, pumps_));
    }
}

void Connections::keepHere(Conn& c, uint32_t slot) {
    if (c.state == ConnState::HandingOver) --handing_;
    process_.handovers[idx(Outcome::Kept)].fetch_add(1);
    ++handed_counts_[1];
    resumeHere(c, slot);
    if (handing_ == 0 && !walking_) handedOne();
}

void Connections::endHandOver() {
    if (!outbound_) return;
    handing_ = 0;
    walking_ = false;
    handedOne();
}

void Connections::handedOne() {
    if (handing_ > 0 || walking_ || !outbound_) return;
    LOG_INFO("handover: %u connections handed over, %u kept here to drain, %u failed",
             handed_counts_[0], handed_counts_[1], handed_counts_[2]);
    outbound_->workerDone();
    outbound_.reset();
}

// ---- the relay that adopts -------------------------------------------------------------------

void Connections::adopt(handover::HandedConn& h) {
    auto lost = [&](const char* what) {
        // Its fds close with h: both peers see the connection end.
        LOG_WARN("handover: a connection on listener %s (cluster %s, backend %s): %s; closed",
                 h.listener.c_str(), h.cluster.c_str(), h.backend.c_str(), what);
        process_.handovers[idx(Outcome::Lost)].fetch_add(1);
    };
    Generation& gen = generations_.current();
    const Runtime& rt = *gen.rt;
    const int32_t li =
        indexOf(rt.listeners, [&](const ListenerRt& l) { return l.config.name == h.listener; });
    const int32_t ci =
        indexOf(rt.clusters, [&](const ClusterRt& cl) { return cl.config.name == h.cluster; });
    if (li < 0 || ci < 0) return lost("no such listener or cluster here");
    const int32_t bi =
        indexOf(rt.clusters[ci].backends, [&](const BackendRt& b) { return b.key == h.backend; });
    if (bi < 0) return lost("no such backend here");
    int32_t route = Conn::kNoRoute;
    if (!h.route.empty()) {
        route = indexOf(rt.listeners[li].routes,
                        [&](const RouteRt& r) { return r.config.name == h.route; });
        if (route < 0) return lost("no such route here");
    }
    const uint32_t slot = allocConn();
    if (slot == UINT32_MAX) return lost("no connection slot left");

    Conn& c = conn(slot);
    enter(c, ConnState::Relaying);
    c.listener = static_cast<uint8_t>(li);
    c.cluster = static_cast<uint16_t>(ci);
    c.backend = static_cast<int16_t>(bi);
    c.route = static_cast<uint8_t>(route);
    c.gen = &gen;
    ++gen.live;
    c.fd[0] = h.client_fd.release();
    c.fd[1] = h.upstream_fd.release();
    c.counted_active = true;
    // Its timeouts count on from where they were: max_connection_duration (and the access
    // log's duration) from its start, idle and fin timeouts from its last byte.
    c.accepted_us = h.start_unix_us;
    c.accepted_mono_us = monotonicUs() - h.age_us;
    c.connect_us = h.connect_us;
    c.attempts = static_cast<uint8_t>(std::min<uint32_t>(h.attempts, UINT8_MAX));
    c.client = h.client;
    c.have_client = h.client.length != 0;
    c.local = h.local;
    c.have_local = h.local.length != 0;
    c.last_active_ms = now_ms_ - h.quiet_ms;
    lstats(c).handed_in.add();
    acceptor_.adopted(c);
    upstream_.adopted(c);
    loops_.remember(process_.loops, slot, c.fd[1], clusterOf(c), c.backend);
    for (int d = 0; d < 2; ++d) {
        c.bytes[d] = h.bytes[d];
        if (h.dir[d].copy) {
            // It held no bytes when it crossed: a fresh copy direction, its watch's FIN kept.
            SourceWatch watch;
            watch.hup = h.dir[d].hup;
            c.dir[d].pump.emplace<CopyPump>(watch);
        } else {
            Pipe pipe;
            if (h.dir[d].in_pipe > 0)
                pipe = pumps_.pipes.adopt(std::move(h.pipe_read[d]), std::move(h.pipe_write[d]));
            c.dir[d].pump.emplace<SplicePump>(SplicePump::adopted(h.dir[d], pipe));
        }
        c.dir[d].finished = h.dir[d].finished;
    }
    if (c.dir[0].finished != c.dir[1].finished) lstats(c).half_closed.add();
    process_.handovers[idx(Outcome::Taken)].fetch_add(1);
    rearm(c, slot);
}

}  // namespace zcrelay
