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
#include "sockmap.hpp"

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
    if (c.state != ConnState::Relaying || c.ending) return false;
    if (c.backend < 0 || c.cluster == Conn::kNoCluster) return false;
    return !c.paths.any() || paths_.ringOf(c.paths) >= 0;
}

void Connections::handOver(std::shared_ptr<handover::Outbound> out) {
    outbound_ = std::move(out);
    walking_ = true;
    handing_deadline_ms_ = now_ms_ + kHandingMs;
    auto taken = [&](const Conn& c) {
        return outbound_->takes(listenerConfig(c).name, clusterOf(c).config.name,
                                clusterOf(c).backends[c.backend].key);
    };
    // Sockmap connections go by ring, all of a ring or none (handover.hpp): first, which rings
    // can go whole, and room for their fds (each connection's two, the RING's five).
    const uint32_t rings = paths_.rings();
    ring_handoffs_.assign(rings, RingHandOff{});
    std::vector<uint8_t> blocked(rings, outbound_->adoptsSockmap(Sockmap::layout()) ? 0 : 1);
    std::vector<uint64_t> ring_fds(rings, handover::kRingFds);
    std::vector<uint32_t> ring_conns(rings, 0);
    for (uint32_t slot = 0; slot < slots_used_; ++slot) {
        const Conn& c = conn(slot);
        if (c.state == ConnState::Free || c.state == ConnState::Closing) continue;
        const int ring = paths_.ringOf(c.paths);
        if (ring < 0) continue;
        ring_fds[ring] += 2;
        ++ring_conns[ring];
        if (!handable(c) || !taken(c)) blocked[ring] = 1;
    }
    for (uint32_t r = 0; r < rings; ++r)
        ring_handoffs_[r].crossing =
            ring_conns[r] > 0 && !blocked[r] && outbound_->reserve(ring_fds[r]);
    for (uint32_t slot = 0; slot < slots_used_; ++slot) {
        Conn& c = conn(slot);
        if (c.state == ConnState::Free || c.state == ConnState::Closing) continue;
        const int ring = paths_.ringOf(c.paths);
        const bool goes = ring >= 0 ? ring_handoffs_[ring].crossing
                                    : handable(c) && taken(c) && outbound_->reserve(fdsToSend(c));
        if (!goes) {
            process_.handovers[idx(Outcome::Kept)].fetch_add(1);
            ++handed_counts_[1];
            continue;
        }
        enter(c, ConnState::HandingOver);
        ++handing_;
        if (ring >= 0) ++ring_handoffs_[ring].waiting;
        if (c.inflight == 0) {
            rested(c, slot);
            continue;
        }
        // What waits to read (and the watches) is cancelled, by its user_data: a splice
        // direction's polls end -ECANCELED, or with the readiness they saw first, unheeded,
        // the bytes staying in the socket for the next relay. A copy direction's recv ends
        // too, or brings bytes it then sends on: its sends go on until it holds nothing
        // (PumpPort::handing). A sockmap direction's watch and barrier timer end, and the step
        // they were waiting for runs once more, arming nothing.
        for (uint8_t d = 0; d < 2; ++d) {
            const DataPath path = c.dir[d].path();
            const Op read = path == DataPath::Splice    ? Op::PollIn
                            : path == DataPath::Sockmap ? Op::Barrier
                                                        : Op::Recv;
            for (Op op : {read, Op::Watch, Op::PollOut, Op::FinishedWatch}) {
                if (path != DataPath::Splice && op == Op::PollOut) continue;  // a send goes on
                if (op == Op::FinishedWatch && !(c.watching_finished && c.dir[d].finished))
                    continue;
                ring_.cancelRequest(UserData{op, d, slot, c.generation}.pack());
            }
        }
        // Armed again by the sweep should the hand-over fail and the connection relay on here.
        c.watching_finished = false;
    }
    // A crossing ring's poll is cancelled: from here on no wake-up of it is read here.
    for (uint32_t r = 0; r < rings; ++r) {
        if (!ring_handoffs_[r].crossing) continue;
        paths_.holdSignal(r);
        tryRing(r);
    }
    walking_ = false;
    if (handing_ == 0) handedOne();
}

void Connections::rested(Conn& c, uint32_t slot) {
    const int ring = paths_.ringOf(c.paths);
    if (ring < 0) {
        sendHandOver(c, slot);
        return;
    }
    c.rested = true;
    --ring_handoffs_[ring].waiting;
    tryRing(static_cast<uint32_t>(ring));
}

void Connections::tryRing(uint32_t ring) {
    const RingHandOff& h = ring_handoffs_[ring];
    if (!h.crossing || h.sent || h.waiting > 0 || !paths_.signalHeld(ring)) return;
    sendRing(ring);
}

void Connections::sendRing(uint32_t ring) {
    RingHandOff& h = ring_handoffs_[ring];
    Sockmap& map = paths_.ringMap(ring);
    handover::HandedRing m;
    m.map_id = map.socksMapId();
    m.rings = map.rings();
    m.records_per_worker = map.recordsPerWorker();
    m.ring = paths_.ringIndex(ring);
    m.layout = Sockmap::layout();
    const int fds[] = {map.socksFd(), map.linksFd(), map.statsFd(), map.wakeLostFd(),
                       map.wakeRingFd(m.ring)};
    static_assert(std::size(fds) == handover::kRingFds);
    if (auto sent = outbound_->send(handover::toMessage(m), fds); !sent) {
        if (handed_counts_[2]++ == 0)
            LOG_WARN("handover: %s; this worker's connections not sent yet stay here",
                     sent.error().c_str());
        keepRing(ring, Outcome::Failed);
        return;
    }
    h.sent = true;
    h.map_id = m.map_id;
    // The program stays attached when this relay exits: the next one relays these sockets.
    map.keepAttached();
    paths_.ringHandedOver(ring);
    for (uint32_t slot = 0; slot < slots_used_; ++slot) {
        Conn& c = conn(slot);
        if (c.state == ConnState::HandingOver && paths_.ringOf(c.paths) == static_cast<int>(ring))
            sendHandOver(c, slot);
    }
}

void Connections::keepRing(uint32_t ring, Outcome why) {
    ring_handoffs_[ring].crossing = false;
    for (uint32_t slot = 0; slot < slots_used_; ++slot) {
        Conn& c = conn(slot);
        if (c.state != ConnState::HandingOver || paths_.ringOf(c.paths) != static_cast<int>(ring))
            continue;
        --handing_;
        process_.handovers[idx(why)].fetch_add(1);
        ++handed_counts_[why == Outcome::Failed ? 2 : 1];
        resumeHere(c, slot);
    }
    paths_.releaseSignal(ring);
    if (handing_ == 0 && !walking_) handedOne();
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
    h.proxy_in = c.proxy_in;
    h.proxy_out = c.proxy_out;
    int fds[takeover::kMaxFds];
    size_t n = 0;
    fds[n++] = c.fd[0];
    fds[n++] = c.fd[1];
    bool whole = true;
    for (int d = 0; d < 2; ++d) {
        // What the kernel moved so far is in the bytes, and the pump's count of it goes along.
        if (uint64_t k =
                std::visit([&](auto& pump) { return pump.kernelBytes(pumps_); }, c.dir[d].pump))
            addBytes(c, d, k);
        h.bytes[d] = c.bytes[d];
        if (const auto* copy = std::get_if<CopyPump>(&c.dir[d].pump)) {
            whole = whole && copy->empty();
            h.dir[d] = copy->resting();
        } else if (const auto* kernel = std::get_if<SockmapPump>(&c.dir[d].pump)) {
            whole = whole && kernel->empty();
            h.dir[d] = kernel->resting();
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
    if (const int ring = paths_.ringOf(c.paths); ring >= 0) {
        const SockmapPair& pair = c.paths.sockmap;
        h.pair.map_id = ring_handoffs_[ring].map_id;
        h.pair.record = pair.record;
        for (int i = 0; i < 2; ++i) {
            h.pair.linked[i] = pair.linked[i];
            h.pair.in_map[i] = pair.in_map[i];
        }
        h.pair.promoted = c.paths.promoted;
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
    if (auto sent = outbound_->send(handover::toMessage(h), {fds, n}); sent) {
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
        // Its ring crossed already: this relay reads it again for what stays.
        if (int ring = paths_.ringOf(c.paths); ring >= 0) paths_.takeBack(ring);
    }
    if (handing_ == 0 && !walking_) handedOne();
}

void Connections::resumeHere(Conn& c, uint32_t slot) {
    c.rested = false;
    enter(c, ConnState::Relaying);
    rearm(c, slot);
}

void Connections::rearm(Conn& c, uint32_t slot) {
    for (int d = 0; d < 2 && c.state == ConnState::Relaying; ++d) {
        // A finished sockmap direction still watches its source for an RST (sockmap_pump.hpp).
        auto* kernel = std::get_if<SockmapPump>(&c.dir[d].pump);
        if (c.dir[d].finished && kernel == nullptr) continue;
        PumpPort p = port(c, slot, d);
        if (auto* copy = std::get_if<CopyPump>(&c.dir[d].pump))
            apply(c, slot, d, copy->start(p, pumps_));
        else if (kernel != nullptr)
            apply(c, slot, d, kernel->restart(p, pumps_));
        else
            apply(c, slot, d, std::get<SplicePump>(c.dir[d].pump).restart(p, pumps_));
    }
}

void Connections::keepHere(Conn& c, uint32_t slot) {
    if (int ring = paths_.ringOf(c.paths); ring >= 0 && c.state == ConnState::HandingOver) {
        keepRing(static_cast<uint32_t>(ring), Outcome::Kept);  // a ring stays whole
        return;
    }
    if (c.state == ConnState::HandingOver) --handing_;
    process_.handovers[idx(Outcome::Kept)].fetch_add(1);
    ++handed_counts_[1];
    resumeHere(c, slot);
    if (handing_ == 0 && !walking_) handedOne();
}

void Connections::endHandOver() {
    if (!outbound_) return;
    handing_ = 0;
    ring_handoffs_.clear();
    walking_ = false;
    handedOne();
}

void Connections::handedOne() {
    if (handing_ > 0 || walking_ || !outbound_) return;
    LOG_INFO("handover: %u connections handed over, %u kept here to drain, %u failed",
             handed_counts_[0], handed_counts_[1], handed_counts_[2]);
    outbound_->workerDone();
    outbound_.reset();
    ring_handoffs_.clear();
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
    // On sockmap: its sockets are in the maps it came with, whose ring this worker reads.
    SockmapPair pair;
    if (h.pair.map_id != 0) {
        if (h.map == nullptr) return lost("the sockmap maps it is in did not come");
        pair.map = h.map;
        pair.record = h.pair.record;
        for (int i = 0; i < 2; ++i) {
            pair.linked[i] = h.pair.linked[i];
            pair.in_map[i] = h.pair.in_map[i];
            auto cookie = socketCookie(i == 0 ? h.client_fd.get() : h.upstream_fd.get());
            if (!cookie) return lost("a socket without its cookie");
            pair.cookie[i] = *cookie;
        }
        if (pair.record + 1 >= h.map->capacity()) return lost("a record past the maps' end");
        PathState probe;
        probe.sockmap = pair;
        if (paths_.ringOf(probe) < 0) return lost("its wake-up ring is not read here");
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
    c.proxy_in = h.proxy_in;
    c.proxy_out = h.proxy_out;
    lstats(c).handed_in.add();
    acceptor_.adopted(c);
    upstream_.adopted(c);
    loops_.remember(process_.loops, slot, c.fd[1], clusterOf(c), c.backend);
    c.paths.sockmap = pair;
    c.paths.promoted = h.pair.promoted;
    paths_.adopt(c.paths, slot);
    for (int d = 0; d < 2; ++d) {
        c.bytes[d] = h.bytes[d];
        if (h.dir[d].sockmap && pair.map != nullptr) {
            c.dir[d].pump.emplace<SockmapPump>(
                SockmapPump::adopted(*pair.map, pair.record, static_cast<uint8_t>(d), h.dir[d]));
        } else if (h.dir[d].copy) {
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
    // Half-closed, its finished side is watched again from the next sweep (watchFinished).
    if (c.dir[0].finished != c.dir[1].finished) lstats(c).half_closed.add();
    // mode auto: a connection that crossed on splice is watched for promotion here too.
    const ListenerConfig& lc = listenerConfig(c);
    paths_.watchAdopted(c.paths, lc.mode,
                        clusterOf(c).backends[c.backend].config.address.family() == AF_UNIX, slot,
                        lc.auto_sockmap_max);
    process_.handovers[idx(Outcome::Taken)].fetch_add(1);
    rearm(c, slot);
}

}  // namespace zcrelay
