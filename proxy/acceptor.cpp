#include "acceptor.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "log.hpp"
#include "tcp_options.hpp"
#include "uring/user_data.hpp"

namespace zcrelay {

Acceptor::Acceptor(std::vector<UniqueFd> fds, const Runtime& rt, StatCounter& pauses)
    : pauses_(pauses) {
    listeners_.resize(fds.size());
    for (size_t i = 0; i < fds.size(); ++i) {
        listeners_[i].fd = std::move(fds[i]);
        listeners_[i].address = rt.config.listeners[i].listen;
        listeners_[i].rt_index = static_cast<int32_t>(i);
        setClientOptions(listeners_[i], rt.config.listeners[i]);
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

Acceptor::Accepted Acceptor::onAccept(uint32_t li, uint8_t aux, int res, int64_t now_ms) {
    Listener& l = listeners_[li];
    --l.armed;
    --armed_;
    const uint32_t at = aux % kBatch;
    l.peers->busy &= ~(1u << at);
    Accepted out;
    if (l.closed) {
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

void Acceptor::pause(Ring& ring) {
    // Stop accepting rather than spin on the same error.
    if (!paused_) pauses_.add();
    paused_ = true;
    for (Listener& l : listeners_) {
        if (l.closed || l.armed == 0) continue;
        io_uring_sqe* sqe = ring.sqe();
        io_uring_prep_cancel_fd(sqe, l.fd.get(), IORING_ASYNC_CANCEL_ALL);
        io_uring_sqe_set_data64(sqe, UserData{}.pack());
    }
}

void Acceptor::resume() { paused_ = false; }

void Acceptor::reload(Ring& ring, const Runtime& current, const Runtime& next,
                      std::vector<UniqueFd> fds) {
    std::vector<bool> kept(listeners_.size(), false);
    size_t next_fd = 0;
    for (size_t i = 0; i < next.config.listeners.size(); ++i) {
        const ListenerConfig& l = next.config.listeners[i];
        int32_t found = -1;
        for (size_t j = 0; j < listeners_.size(); ++j) {
            const Listener& old = listeners_[j];
            if (old.closed || kept[j] || !(old.address == l.listen)) continue;
            if (l.listen.port() == 0 && current.config.listeners[old.rt_index].name != l.name)
                continue;
            found = static_cast<int32_t>(j);
        }
        if (found >= 0) {
            kept[found] = true;
            listeners_[found].rt_index = static_cast<int32_t>(i);
            setClientOptions(listeners_[found], l);
            continue;
        }
        if (next_fd >= fds.size()) {
            LOG_ERROR("reload: no socket for new listener %s: bookkeeping bug", l.name.c_str());
            continue;
        }
        Listener fresh;
        fresh.fd = std::move(fds[next_fd++]);
        fresh.address = l.listen;
        fresh.rt_index = static_cast<int32_t>(i);
        setClientOptions(fresh, l);
        listeners_.push_back(std::move(fresh));
        kept.push_back(true);
    }
    for (size_t j = 0; j < listeners_.size(); ++j) {
        if (!kept[j] && !listeners_[j].closed) {
            listeners_[j].rt_index = -1;
            close(ring, listeners_[j]);
        }
    }
}

void Acceptor::closeAll(Ring& ring) {
    for (Listener& l : listeners_)
        if (!l.closed) close(ring, l);
}

void Acceptor::close(Ring& ring, Listener& l) {
    // shutdown() first: it takes a listening socket out of LISTEN (and out of its
    // SO_REUSEPORT group) at once, even while an io_uring accept still holds a reference
    // to the file; close() alone would leave it completing handshakes nobody accepts until
    // that reference goes (with DEFER_TASKRUN, when this ring next runs task work). The
    // armed accept then ends with an error; the cancel and close below release the rest.
    ::shutdown(l.fd.get(), SHUT_RDWR);
    ring.cancelAndClose(l.fd.release());
    l.closed = true;
}

}  // namespace zcrelay
