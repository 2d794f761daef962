// The worker's tick over every connection (Connections::sweep and what it calls): the PROXY
// and inspection timeouts, idle, the half-close fin timeouts, max_connection_duration and its
// graceful end, the drain's deadline, and quiet pipes going back to the pool; and the close
// that walks every slot on request (the runtime API's end of a backend). Each reads the clock
// the worker ticks (now_ms_) and closes through the lifecycle (connections.cpp); none moves a
// byte.
#include <sys/socket.h>

#include <variant>

#include "connections.hpp"
#include "log.hpp"

namespace zcrelay {

void Connections::sweep(bool drain_deadline, int64_t tick_ms) {
    for (uint32_t slot = 0; slot < slots_used_; ++slot) {
        Conn& c = conn(slot);
        if (c.state == ConnState::Free || c.state == ConnState::Closing) continue;
        if (drain_deadline) {
            closeConn(c, slot, CloseReason::Drain);
            continue;
        }
        const ListenerConfig& l = listenerConfig(c);
        if (c.state == ConnState::ReadingProxy &&
            now_ms_ - c.last_active_ms >= l.proxy_timeout.count()) {
            proxyFailed(c, slot, ProxyFailure::Timeout);
            continue;
        }
        if (c.state == ConnState::Inspecting &&
            now_ms_ - c.last_active_ms >= l.inspect_timeout.count()) {
            routeChosen(c, slot, hello_reader_.onTimeout(c, listenerOf(c)));
            continue;
        }
        if (c.state == ConnState::HandingOver) {
            // A copy direction whose peer did not take what it holds in time: it stays.
            if (now_ms_ >= handing_deadline_ms_) keepHere(c, slot);
            continue;
        }
        if (c.state != ConnState::Relaying) continue;
        // Bytes the kernel moved without a pump reading them: what it counted is activity too.
        for (int d = 0; d < 2; ++d) {
            uint64_t n =
                std::visit([&](auto& pump) { return pump.kernelBytes(pumps_); }, c.dir[d].pump);
            if (n > 0) addBytes(c, d, n);
        }
        lookAtKernel(c, slot);
        if (c.state != ConnState::Relaying) continue;
        int64_t idle = l.idle_timeout.count();
        if (idle > 0 && now_ms_ - c.last_active_ms >= idle) {
            closeConn(c, slot, CloseReason::IdleTimeout);
            continue;
        }
        if (lifetimeSweep(c, slot, l)) continue;
        // Half-closed at a tick: its finished side is watched for a reset from now on. Not at
        // the FIN itself: most connections end both ways within milliseconds of it, and the
        // watch would cost each of them a poll and, at the close, the cancels of both fds
        // (bench/costs.sh --workload conn: 9 SQEs per connection against 12).
        if (c.dir[0].finished != c.dir[1].finished && !c.watching_finished) watchFinished(c, slot);
        // A direction that kept its (empty) pipe through a quiet tick gives it back.
        if (now_ms_ - c.last_active_ms >= tick_ms) {
            for (Direction& dir : c.dir)
                std::visit([&](auto& pump) { pump.quiet(pumps_); }, dir.pump);
        }
    }
}

uint32_t Connections::endBackend(const BackendState* backend, CloseReason reason) {
    uint32_t ended = 0;
    for (uint32_t slot = 0; slot < slots_used_; ++slot) {
        Conn& c = conn(slot);
        if (c.state != ConnState::Connecting && c.state != ConnState::Relaying) continue;
        if (c.cluster == Conn::kNoCluster || c.backend < 0) continue;
        if (clusterOf(c).backends[c.backend].state.get() != backend) continue;
        closeConn(c, slot, reason);
        ++ended;
    }
    return ended;
}

bool Connections::lifetimeSweep(Conn& c, uint32_t slot, const ListenerConfig& l) {
    if (c.dir[0].finished != c.dir[1].finished) {
        // Half-closed, and silent since (last_active_ms). The client closed first: its FIN went
        // to the backend, whose turn it is (server_fin_timeout); or the other way round.
        const bool client_closed = c.dir[0].finished;
        const int64_t fin = (client_closed ? l.server_fin_timeout : l.client_fin_timeout).count();
        if (fin > 0 && now_ms_ - c.last_active_ms >= fin) {
            closeConn(c, slot,
                      client_closed ? CloseReason::ServerFinTimeout : CloseReason::ClientFinTimeout);
            return true;
        }
    }
    const int64_t max = l.max_connection_duration.count();
    if (max > 0) {
        // The jitter is fixed per connection without storing it: a hash of the slot's identity.
        const int64_t jitter = l.max_connection_duration_jitter.count();
        int64_t limit = max;
        if (jitter > 0) {
            uint64_t h = (uint64_t{slot} << 32 | c.generation) * 0x9E3779B97F4A7C15ull;
            h ^= h >> 29;
            limit += static_cast<int64_t>(h % static_cast<uint64_t>(jitter + 1));
        }
        const int64_t age = now_ms_ - c.accepted_mono_us / 1000;
        if (!c.ending && age >= limit) {
            endGracefully(c, slot);
        } else if (c.ending && age >= limit + kEndGraceMs) {
            // Still not done: a peer that does not read what is left for it. Both peers get
            // an RST, so neither mistakes the cut for a clean end.
            LOG_DEBUG("%s: slot %u did not end within %lld ms of max_connection_duration; "
                      "resetting it",
                      l.name.c_str(), slot, static_cast<long long>(kEndGraceMs));
            linger lg{1, 0};
            for (int fd : c.fd)
                if (fd >= 0) ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
            closeConn(c, slot, CloseReason::MaxDuration);
        }
    }
    return c.state != ConnState::Relaying;
}

void Connections::endGracefully(Conn& c, uint32_t slot) {
    // shutdown(SHUT_RD) marks each socket's receive side shut: a read returns what is already
    // queued, then 0, as if the peer had sent its FIN, and the poll waiting on it wakes (the
    // socket's state change wakes every waiter). Each pump then does what it does at any EOF,
    // writes out what it read, but keeps the FIN (PumpPort::ending): a socket that has sent
    // its FIN with its reading side shut resets the connection on the next byte its peer
    // sends, and that peer's bytes may still be on their way to the other side. Once both
    // directions are done, finishDirection sends both FINs and the connection closes: each
    // peer has every byte the relay took from the other, then a FIN. What a peer sent after
    // the relay stopped reading stays unread, and close() answers it with an RST. "After"
    // is counted, not left to the socket: TCP still queues what a peer sends once the reading
    // side is shut, and a read returns it (PumpPort::end_left).
    c.ending = true;
    LOG_DEBUG("%s: slot %u reached max_connection_duration, ending it",
              listenerConfig(c).name.c_str(), slot);
    for (int d = 0; d < 2; ++d)
        c.dir[d].end_left =
            !c.dir[d].finished && c.fd[d] >= 0 ? endForDuration(c.fd[d]) : 0;
}

}  // namespace zcrelay
