#include "acceptor.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "log.hpp"
#include "tcp_options.hpp"
#include "uring/user_data.hpp"

namespace zcrelay {

Acceptor::Acceptor(unsigned worker, std::vector<ListenSocket> fds, const Generations& generations,
                   ProcessShared& process, uint32_t max_conns, StatCounter& pauses)
    : worker_(worker),
      generations_(generations),
      process_(process),
      max_conns_(max_conns),
      pauses_(pauses),
      admission_(process) {
    const Runtime& current = rt();
    for (ListenSocket& s : fds) {
        Listener l;
        l.fd = std::move(s.fd);
        l.address = current.config.listeners[s.listener].listen;
        l.rt_index = static_cast<int32_t>(s.listener);
        setClientOptions(l, current.config.listeners[s.listener]);
        listeners_.push_back(std::move(l));
    }
}

void Acceptor::start(Ring& ring, Host& host) {
    ring_ = &ring;
    host_ = &host;
    armAll();
}

// ---- accepting -----------------------------------------------------------------------------

void Acceptor::onAccept(uint32_t li, uint8_t aux, int res, int64_t now_ms) {
    Accepted a = take(li, aux, res, now_ms);
    if (a.out_of_fds) {
        pause();
        return;
    }
    if (a.fd >= 0) {
        // A socket that listens on in the next process (handed over, or systemd's): a
        // connection this worker accepted as it stopped is served here, not reset. One of the
        // relay's own was shut down at the drain, its queue reset with it.
        if (draining_ && !listensOnElsewhere(listeners_[li])) {
            rt().listeners[a.listener].shared->stats[worker_].rejected_draining.add();
            ::close(a.fd);
        } else if (!host_->accept(a.fd, a.listener, a.peer)) {
            ::close(a.fd);  // no slot left
        }
        // This worker's share of the fd budget is spent: stop accepting (backpressure: clients
        // wait in the kernel's queue) rather than run into EMFILE.
        if (host_->live() >= max_conns_) pause();
    }
    arm(li);
    if (listeners_[li].sweep > 0 && listeners_[li].armed == 0) sweep(listeners_[li]);
}

void Acceptor::armAll() {
    for (uint32_t i = 0; i < listeners_.size(); ++i) arm(i);
}

void Acceptor::arm(uint32_t li) {
    if (draining_) return;
    const uint32_t live = host_->live();
    const uint32_t room = live < max_conns_ ? max_conns_ - live : 0;
    Listener& l = listeners_[li];
    while (!l.closed && !paused_ && l.armed < kBatch && armed_ < room) {
        if (!belowLimits(l.rt_index)) {
            if (l.armed == 0) limit_paused_ = true;
            break;
        }
        io_uring_sqe* sqe = ring_->sqe();
        // A free address slot: at most kBatch are armed, so there is one. The peer's address
        // comes with the accept, not from a getpeername() per connection.
        const auto at = static_cast<uint8_t>(__builtin_ctz(~l.peers->busy));
        l.peers->busy |= 1u << at;
        l.peers->len[at] = sizeof(sockaddr_storage);
        // The accepted sockets come out nonblocking, as the inline splice needs.
        io_uring_prep_accept(sqe, l.fd.get(), reinterpret_cast<sockaddr*>(&l.peers->addr[at]),
                             &l.peers->len[at], SOCK_NONBLOCK | SOCK_CLOEXEC);
        io_uring_sqe_set_data64(sqe, UserData{Op::Accept, 0, li, 0, at}.pack());
        ++l.armed;
        ++armed_;
    }
}

void Acceptor::setClientOptions(const Listener& l, const ListenerConfig& config) {
    // An accepted socket is a copy of its listener made when the handshake completes
    // (sk_clone_lock), so it comes out with the listener's TCP_NODELAY, TCP_NOTSENT_LOWAT,
    // keepalive and TCP_USER_TIMEOUT already set: up to seven setsockopt calls per connection
    // fewer than setting them after accept. A client that completed its handshake before a
    // reload changed them has the previous generation's.
    if (l.address.family() != AF_UNIX) applyTcpOptions(l.fd.get(), config, config.tcp_keepalive);
}

Acceptor::Accepted Acceptor::take(uint32_t li, uint8_t aux, int res, int64_t now_ms) {
    Listener& l = listeners_[li];
    --l.armed;
    --armed_;
    const uint32_t at = aux % kBatch;
    l.peers->busy &= ~(1u << at);
    Accepted out;
    if (l.closed && (res < 0 || l.rt_index < 0)) {
        if (res >= 0) ::close(res);  // accepted just before a reload removed the listener
        return out;
    }
    if (res >= 0) {
        out.fd = res;
        out.listener = l.rt_index;
        out.peer = addressFromSockaddr(reinterpret_cast<const sockaddr*>(&l.peers->addr[at]),
                                       l.peers->len[at]);
        return out;
    }
    if (res == -EMFILE || res == -ENFILE || res == -ENOBUFS || res == -ENOMEM) {
        // Out of fds (or socket memory) all the same, e.g. pipes took them: the connection
        // stays in the kernel's accept queue until we have room. Logged at most once a
        // second: while fds stay short, every connection that closes lets accepting resume
        // and hit the limit again.
        ++emfile_unlogged_;
        if (now_ms - emfile_logged_ms_ >= 1000) {
            LOG_WARN("accept on %s: %s; pausing accepts (x%u since the last report)",
                     l.address.toString().c_str(), strerror(-res), emfile_unlogged_);
            emfile_logged_ms_ = now_ms;
            emfile_unlogged_ = 0;
        }
        out.out_of_fds = true;
    } else if (res != -ECANCELED && res != -EINTR && res != -ECONNABORTED && res != -EAGAIN &&
               res != -EINVAL) {
        // -EINVAL: the listener was shut down for draining.
        LOG_WARN("accept on %s: %s", l.address.toString().c_str(), strerror(-res));
    }
    return out;
}

// ---- stopping and resuming ----------------------------------------------------------------

void Acceptor::pause() {
    // Stop accepting rather than spin on the same error. Resumed on the tick, or after a batch
    // in which a connection ended, once the budget has room and the spare fd can be reopened.
    if (!paused_) pauses_.add();
    paused_ = true;
    for (Listener& l : listeners_) {
        if (l.closed || l.armed == 0) continue;
        ring_->cancel(l.fd.get());
    }
}

bool Acceptor::outOfFds() {
    // More clients would only find no fd for their upstream sockets either.
    pause();
    return admission_.useSpareFd();
}

void Acceptor::release(Conn& c) {
    if (admission_.release(c) && limit_paused_) {
        // A listener held at max_connections (by any worker) may take one more now.
        resume_wanted_ = true;
    }
}

void Acceptor::slotFreed() {
    // Not resumed from here: a slot is freed inside completion handling, and resuming retries
    // fd waiters, which can close connections again. The loop resumes after the batch.
    if (paused_) resume_wanted_ = true;
}

void Acceptor::resume() {
    resume_wanted_ = false;
    if (admission_.fdWaiters())
        admission_.retryFdWaiters([&](UserData ud) { host_->retryFdWaiter(ud); });
    // Draining after a hand-over, the held connections are still admitted (arm() arms nothing).
    if ((draining_ && !process_.listeners_handed_over.load()) || admission_.fdWaiters() ||
        host_->live() >= max_conns_)
        return;
    if (!admission_.holdSpareFd()) return;  // still out of fds: try again next tick
    paused_ = false;
    limit_paused_ = admission_.queued();  // arming sets it again where a limit holds
    admission_.admitQueued([&](UserData ud) { return host_->queued(ud); },
                           [&](Conn& c, uint32_t slot) { host_->serve(c, slot); });
    armAll();
}

// ---- admission -----------------------------------------------------------------------------

bool Acceptor::belowLimits(int32_t listener) const {
    const Runtime& current = rt();
    return admission_.belowLimits(current, current.listeners[listener]);
}

bool Acceptor::admit(Conn& c, uint32_t slot) {
    if (!admission_.queued() && admission_.admit(c)) return true;
    admission_.enqueue(c, slot);
    limit_paused_ = true;
    return false;
}

// ---- reload and drain ----------------------------------------------------------------------

void Acceptor::reload(const Runtime& next, std::vector<ListenSocket> fds) {
    const Runtime& current = rt();
    std::vector<bool> kept(listeners_.size(), false);
    for (size_t i = 0; i < next.config.listeners.size(); ++i) {
        const ListenerConfig& l = next.config.listeners[i];
        bool found = false;
        // Every socket of the listener is kept (a taken-over one may have several).
        for (size_t j = 0; j < listeners_.size(); ++j) {
            Listener& old = listeners_[j];
            if (old.closed || kept[j] || old.rt_index < 0 || !(old.address == l.listen)) continue;
            if (l.listen.port() == 0 && current.config.listeners[old.rt_index].name != l.name)
                continue;
            kept[j] = true;
            old.rt_index = static_cast<int32_t>(i);
            setClientOptions(old, l);
            found = true;
        }
        for (ListenSocket& s : fds) {
            if (s.listener != i || !s.fd) continue;
            if (found) {
                LOG_ERROR("reload: listener %s has a socket already: bookkeeping bug",
                          l.name.c_str());
                continue;
            }
            Listener fresh;
            fresh.fd = std::move(s.fd);
            fresh.address = l.listen;
            fresh.rt_index = static_cast<int32_t>(i);
            setClientOptions(fresh, l);
            listeners_.push_back(std::move(fresh));
            kept.push_back(true);
        }
    }
    for (size_t j = 0; j < listeners_.size(); ++j) {
        if (!kept[j] && !listeners_[j].closed) {
            listeners_[j].rt_index = -1;
            close(listeners_[j]);
        }
    }
}

void Acceptor::drain() {
    draining_ = true;
    for (Listener& l : listeners_)
        if (!l.closed) close(l);
    // Handed over, the kernel's accept queues live on in the next relay, and so do the
    // connections held here at max_connections: served as this process's connections end.
    if (process_.listeners_handed_over.load()) return;
    // Connections held at max_connections were never served: they go now, as the kernel's
    // accept queue does with the listeners.
    for (uint64_t packed : admission_.takeQueue()) {
        UserData ud = UserData::unpack(packed);
        if (Conn* c = host_->queued(ud)) host_->refuse(*c, ud.slot);
    }
}

bool Acceptor::sweeping() const {
    return std::any_of(listeners_.begin(), listeners_.end(),
                       [](const Listener& l) { return l.sweep > 0; });
}

bool Acceptor::listensOnElsewhere(const Listener& l) const {
    const auto& passed = process_.passed_listeners;
    return process_.listeners_handed_over.load() || process_.listeners_offered.load() ||
           std::find(passed.begin(), passed.end(), l.address) != passed.end();
}

void Acceptor::sweep(Listener& l) {
    // Every accept armed here has come back, so none of this ring's wait entries is left on
    // the socket: whatever the queue holds now, the next relay's accepts are woken for, except
    // the connections whose wakeup an accept of ours took before it was cancelled (at most one
    // per accept armed). Accepted here, as many, they are served by this relay as it drains;
    // any taken beyond those the next relay would have had, and its accept finds the queue
    // empty and waits again. The socket is nonblocking: an empty queue is EAGAIN.
    for (uint32_t i = 0; i < l.sweep; ++i) {
        sockaddr_storage addr{};
        socklen_t len = sizeof addr;
        int fd = ::accept4(l.fd.get(), reinterpret_cast<sockaddr*>(&addr), &len,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        if (!host_->accept(fd, l.rt_index,
                           addressFromSockaddr(reinterpret_cast<const sockaddr*>(&addr), len)))
            ::close(fd);
    }
    l.sweep = 0;
    ring_->close(l.fd.release());
}

void Acceptor::close(Listener& l) {
    // shutdown() first: it takes a listening socket out of LISTEN (and out of its
    // SO_REUSEPORT group) at once, even while an io_uring accept still holds a reference
    // to the file; close() alone would leave it completing handshakes nobody accepts until
    // that reference goes (with DEFER_TASKRUN, when this ring next runs task work). The
    // armed accept then ends with an error; the cancel and close below release the rest.
    // Not a socket systemd passed: shut down, it would stop listening for the service manager
    // and the next process too, and connections that arrive while the relay restarts must
    // wait in its queue instead.
    // Nor one handed over to the next relay (takeover.hpp): it listens there now, with every
    // connection in its queue.
    l.closed = true;
    if (process_.listeners_handed_over.load() && l.armed > 0) {
        // The next relay accepts on this very socket already, and the kernel wakes one armed
        // accept per connection (io_uring arms accept's poll EPOLLEXCLUSIVE). One of ours woken
        // but cancelled before its task work ran (DEFER_TASKRUN: this ring's next wait) takes
        // the wakeup with it: the connection stays queued, and the next relay's accepts sleep
        // on until another connection comes (tests/kernel/accept_wakeup_test.cpp). So the fd
        // stays open until the cancelled accepts are back, then sweep() takes what they left.
        l.sweep = l.armed;
        ring_->cancel(l.fd.get());
        return;
    }
    if (!listensOnElsewhere(l)) ::shutdown(l.fd.get(), SHUT_RDWR);
    ring_->cancelAndClose(l.fd.release());
}

}  // namespace zcrelay
