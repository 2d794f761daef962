#include "upstream.hpp"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include "clock.hpp"
#include "log.hpp"
#include "proxy_protocol.hpp"
#include "tcp_options.hpp"

// linux/in.h has it (Linux 6.3); glibc 2.36's netinet/in.h, which cannot be included beside it,
// does not.
#ifndef IP_LOCAL_PORT_RANGE
#define IP_LOCAL_PORT_RANGE 51
#endif

namespace zcrelay {

Result<UniqueFd> openUpstreamSocket(const SocketAddress& backend, const SocketAddress& source) {
    const bool unix_socket = backend.family() == AF_UNIX;
    UniqueFd fd(::socket(backend.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC,
                         unix_socket ? 0 : IPPROTO_TCP));
    if (!fd) return sysError("socket");
    if (!unix_socket) {
        // connect() picks the local port by searching the ephemeral range from a per-destination
        // offset, and without a per-socket range it tries all even ports first, then odd ones
        // (__inet_hash_connect(); bind() takes the odd ones first). Toward one backend at a high
        // connection rate, every connection this relay half-closed first leaves its port in
        // TIME_WAIT, reusable for the same backend only after a second and only where
        // tcp_tw_reuse allows (loopback, by default). With 14,116 even ports of 28,232 and
        // ~18,000 connections a second the even ports come round in under a second, so the
        // search walks past young TIME_WAIT entries on every connect: 17 % of the relay's CPU
        // in __inet_hash_connect, __inet_check_established and tcp_twsk_unique (perf during
        // bench/run's connrate, copy mode). A per-socket range, even the whole system range,
        // makes the kernel search every port in turn (step 1), which reaches ports twice as old.
        // The kernel clamps the socket's bounds to the sysctl's (inet_sk_get_local_port_range()),
        // and 0 and 65535 clamp to exactly the sysctl's: this only turns the per-socket search
        // on, for IPv4 and IPv6 alike. Kernels before 6.3 refuse the option; their search is
        // unchanged.
        uint32_t whole_range = 0xffffu << 16;
        ::setsockopt(fd.get(), IPPROTO_IP, IP_LOCAL_PORT_RANGE, &whole_range, sizeof whole_range);
    }
    if (source.length != 0 && !unix_socket) {
        // With port 0, bind() would pick a local port at once, from the ephemeral range, for
        // this address alone: at ~28k connections to anything the range is used up
        // (EADDRINUSE), although each (source, backend) 4-tuple could reuse the ports.
        // IP_BIND_ADDRESS_NO_PORT defers the choice to connect(), which knows the destination
        // and so shares ports across backends (Linux 4.2+; envoy PR#38288, istio#55491).
        if (source.port() == 0) {
            int one = 1;
            ::setsockopt(fd.get(), IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
        }
        if (::bind(fd.get(), source.sockaddrPtr(), source.length) != 0)
            return sysError("bind source");
    }
    return fd;
}

ConnectFailure classifyConnectError(int err) {
    switch (err) {
        case ECONNREFUSED:
            return ConnectFailure::Refused;
        case ECANCELED:
        case ETIMEDOUT:
            return ConnectFailure::Timeout;
        case ENETUNREACH:
        case EHOSTUNREACH:
        case ENETDOWN:
            return ConnectFailure::Unreachable;
        case EADDRNOTAVAIL:
            return ConnectFailure::AddrNotAvail;
        default:
            return ConnectFailure::Other;
    }
}

namespace {

// A backend that would take a client, but for its max_connections.
bool anyFull(const ClusterRt& cl) {
    const Serving serving = cl.serving();
    for (size_t i = 0; i < cl.backends.size(); ++i) {
        const BackendRt& b = cl.backends[i];
        if (b.config.max_connections == 0 || !b.state->full(b.config.max_connections)) continue;
        if (serving.admits(cl.backends, i)) return true;
    }
    return false;
}

}  // namespace

int UpstreamSide::pickBackend(Conn& c) {
    const ClusterRt& cl = clusterOf(c);
    const uint32_t ci = c.cluster;
    uint64_t key = 0;
    if (cl.config.balance == Balance::SourceHash) key = hashAddress(clientAddress(c));
    // Backups serve only while no primary takes connections; a primary that refused this
    // connect is still up (checks decide that), so the backups wait.
    const Serving serving = cl.serving();
    return c.gen->balancers[ci].pick(
        key,
        [&](size_t i) {
            const BackendRt& b = cl.backends[i];
            return !(c.tried & (uint64_t{1} << (i % 64))) && serving.admits(cl.backends, i) &&
                   !b.state->full(b.config.max_connections);
        },
        [&](size_t i) {
            return static_cast<uint32_t>(
                std::max(0, cl.backends[i].state->active.load(std::memory_order_relaxed)));
        },
        [&, now_ms = cl.config.slow_start.count() > 0 ? monotonicMs() : 0](size_t i) {
            return cl.backends[i].state->ramp(cl.config.slow_start, now_ms);
        });
}

ConnectStep UpstreamSide::start(Ring& ring, Conn& c, uint32_t slot) {
    c.connect_deadline_us = monotonicUs() + listenerConfig(c).connect_timeout.count() * 1000;
    return connect(ring, c, slot);
}

ConnectStep UpstreamSide::connect(Ring& ring, Conn& c, uint32_t slot) {
    const ClusterRt& cl = clusterOf(c);
    const ListenerConfig& lc = listenerConfig(c);
    if (c.fd[1] < 0) {
        // A connection that waited for an fd comes back here with its backend already picked.
        int b = c.backend >= 0 && c.attempts == 0 ? c.backend : pickBackend(c);
        if (b < 0 && c.attempts > 0) {
            // Every backend that is up was tried once: go round again (a lone backend that
            // refused once may well accept now), still within the budget.
            c.tried = 0;
            b = pickBackend(c);
        }
        // A place under the pick's max_connections; another worker may have taken the last
        // one since the pick looked: pick again without it.
        while (b >= 0 && !c.holding &&
               !cl.backends[b].state->take(cl.backends[b].config.max_connections)) {
            c.tried |= uint64_t{1} << (b % 64);
            b = pickBackend(c);
        }
        if (b >= 0 && !c.holding) c.holding = cl.backends[b].config.max_connections > 0;
        if (b < 0 && c.attempts == 0 && anyFull(cl)) {
            // Up, but every one that may take it is at max_connections: wait for a place.
            c.tried = 0;
            return {ConnectStep::Queue};
        }
        if (b < 0) {
            if (c.attempts == 0) {
                LOG_DEBUG("%s: no backend of cluster %s is up", lc.name.c_str(),
                          cl.config.name.c_str());
                return {ConnectStep::Close, CloseReason::NoBackend};
            }
            return {ConnectStep::Close, CloseReason::ConnectFailed};
        }
        c.backend = static_cast<int16_t>(b);
        const BackendRt& be = cl.backends[b];
        auto fd = openUpstreamSocket(be.config.address, cl.config.source);
        // The fd budget keeps this rare, but pipes or the metrics server can take the last
        // fds between an accept and its upstream socket: the client is not dropped (see
        // Acceptor::outOfFds).
        if (!fd && (fd.error().code == EMFILE || fd.error().code == ENFILE))
            return {ConnectStep::OutOfFds};
        if (!fd && (fd.error().code == EADDRINUSE || fd.error().code == EADDRNOTAVAIL)) {
            // `source` has no port left (a fixed source port, or ports exhausted): a failed
            // attempt like a connect's EADDRNOTAVAIL, counted and retried, not a local error.
            c.tried |= uint64_t{1} << (c.backend % 64);
            ++c.attempts;
            be.state->stats[worker_].attempts.add();
            return failed(ring, c, slot, EADDRNOTAVAIL, 0);
        }
        if (!fd) {
            LOG_WARN("%s: backend %s: %s", lc.name.c_str(), be.key.c_str(),
                     fd.error().message().c_str());
            return {ConnectStep::Close, CloseReason::Error};
        }
        c.fd[1] = fd->release();
    }
    const BackendRt& be = cl.backends[c.backend];
    if (be.config.address.family() != AF_UNIX)
        applyTcpOptions(c.fd[1], lc, cl.config.tcp_keepalive);
    c.tried |= uint64_t{1} << (c.backend % 64);
    ++c.attempts;
    be.state->stats[worker_].attempts.add();
    c.connect_start_us = monotonicUs();
    int64_t left = std::max<int64_t>(c.connect_deadline_us - c.connect_start_us, 1000);
    c.connect_left = usToTimespec(left);
    io_uring_sqe* sqe = connSqe(ring, c, slot, Op::Connect);
    io_uring_prep_connect(sqe, c.fd[1], be.config.address.sockaddrPtr(), be.config.address.length);
    // The linked timeout cancels the connect (CQE -ECANCELED) when what is left of
    // connect_timeout runs out: retries share one budget, as HAProxy's `timeout connect` does
    // per attempt but bounded overall here, so a client never waits longer than configured.
    sqe->flags |= IOSQE_IO_LINK;
    io_uring_prep_link_timeout(connSqe(ring, c, slot, Op::ConnectTimeout), &c.connect_left, 0);
    return {ConnectStep::Pending};
}

ConnectStep UpstreamSide::onConnect(Ring& ring, Conn& c, uint32_t slot, int res, int64_t now_ms) {
    if (res < 0) return failed(ring, c, slot, -res, now_ms);
    const BackendRt& be = clusterOf(c).backends[c.backend];
    BackendStats& bs = be.state->stats[worker_];
    c.connect_us = monotonicUs() - c.connect_start_us;
    bs.connections.add();
    bs.connect_time.observe(kConnectBuckets, static_cast<uint64_t>(c.connect_us));
    be.state->failure_streak.store(0, std::memory_order_relaxed);
    be.state->active.fetch_add(1, std::memory_order_relaxed);
    return {ConnectStep::Connected};
}

ConnectStep UpstreamSide::failed(Ring& ring, Conn& c, uint32_t slot, int err, int64_t now_ms) {
    releasePlace(c);  // the next attempt takes one where it goes
    const ClusterRt& cl = clusterOf(c);
    const BackendRt& be = cl.backends[c.backend];
    ConnectFailure why = classifyConnectError(err);
    listenerStats(c, worker_).connect_failures[idx(why)].add();
    be.state->stats[worker_].connect_failures[idx(why)].add();
    LOG_DEBUG("%s: connect %s: %s", listenerConfig(c).name.c_str(), be.key.c_str(), strerror(err));
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
            be.state->ejected_until_ms.store(now_ms + cl.config.fail_timeout.count(),
                                             std::memory_order_relaxed);
            LOG_WARN("cluster %s: backend %s down after %u connect failures in a row (%s)%s",
                     cl.config.name.c_str(), be.key.c_str(), streak, strerror(err),
                     cl.config.health_check.enabled ? "; health checks bring it back" : "");
        }
    }
    if (c.fd[1] >= 0) ::close(c.fd[1]);  // the connect completed: no SQE holds it any more
    c.fd[1] = -1;
    bool budget_left = monotonicUs() < c.connect_deadline_us;
    if (c.attempts <= cl.config.retries && budget_left) return connect(ring, c, slot);
    return {ConnectStep::Close, CloseReason::ConnectFailed};
}

int UpstreamSide::sendProxyHeader(Conn& c) {
    const BackendRt& be = clusterOf(c).backends[c.backend];
    if (be.config.send_proxy == ProxyVersion::Off) return 0;
    std::array<uint8_t, proxy_protocol::kMaxWrite> header;
    size_t n = proxy_protocol::writeHeader(be.config.send_proxy == ProxyVersion::V1
                                               ? proxy_protocol::Version::V1
                                               : proxy_protocol::Version::V2,
                                           clientAddress(c), localAddress(c), header);
    // A socket that just connected has an empty send buffer, so the whole header (at most
    // kMaxWrite bytes) is queued by this one nonblocking send, ahead of any relayed byte in every
    // data path (the sockmap's redirect starts only after this).
    ssize_t sent = ::send(c.fd[1], header.data(), n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent == static_cast<ssize_t>(n)) {
        c.proxy_out = static_cast<uint32_t>(n);
        return 0;
    }
    return sent < 0 ? errno : EAGAIN;
}

void UpstreamSide::ejectLoop(const ClusterRt& cluster, size_t b, Conn& looped, int64_t now_ms) {
    const BackendRt& be = cluster.backends[b];
    if (!be.state->markUp(false)) return;
    be.state->check_passes.store(0, std::memory_order_relaxed);
    be.state->ejected_until_ms.store(now_ms + cluster.config.fail_timeout.count(),
                                     std::memory_order_relaxed);
    LOG_WARN(
        "cluster %s: backend %s down: it leads back to this relay (listener %s accepted %s, "
        "the relay's own connection to it: a loop)%s",
        cluster.config.name.c_str(), be.key.c_str(), listenerConfig(looped).name.c_str(),
        clientAddress(looped).toString().c_str(),
        cluster.config.health_check.enabled ? "; health checks bring it back" : "");
}

void UpstreamSide::adopted(Conn& c) {
    const BackendRt& b = clusterOf(c).backends[c.backend];
    b.state->active.fetch_add(1, std::memory_order_relaxed);
    // Counted even past the limit: it is live, and the limit is this relay's promise to the
    // backend, which had it open already.
    if (b.config.max_connections > 0) {
        b.state->held.fetch_add(1, std::memory_order_relaxed);
        c.holding = true;
    }
}

void UpstreamSide::release(Conn& c) {
    if (c.connect_us >= 0)
        clusterOf(c).backends[c.backend].state->active.fetch_sub(1, std::memory_order_relaxed);
    releasePlace(c);
}

void UpstreamSide::releasePlace(Conn& c) {
    if (!c.holding) return;
    clusterOf(c).backends[c.backend].state->held.fetch_sub(1, std::memory_order_relaxed);
    c.holding = false;
    freed_ = true;
}

}  // namespace zcrelay
