#include "hello_reader.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "access_log.hpp"

namespace zcrelay {
namespace {

// inspect_max_size's bound, plus room for the bytes a client may send after its hello.
constexpr size_t kMaxPeek = 64 * 1024;

InspectFailure failureOf(tls_hello::Status s) {
    switch (s) {
        case tls_hello::Status::NotTls:
            return InspectFailure::NotTls;
        case tls_hello::Status::TooLarge:
            return InspectFailure::TooLarge;
        default:
            return InspectFailure::Malformed;
    }
}

}  // namespace

HelloReader::HelloReader() : scratch_(kMaxPeek), work_(kMaxPeek) {}

void HelloReader::start(Ring& ring, Conn& c, uint32_t slot) {
    io_uring_prep_poll_add(connSqe(ring, c, slot, Op::HelloRead), c.fd[0], POLLIN | POLLRDHUP);
}

void HelloReader::done(Conn& c) {
    if (!c.lowat) return;
    int one = 1;
    ::setsockopt(c.fd[0], SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    c.lowat = false;
}

Inspected HelloReader::onReadable(Ring& ring, Conn& c, uint32_t slot, const ListenerRt& l,
                                  int res, HelloNames* names) {
    const size_t max_size = std::min<size_t>(l.config.inspect_max_size, kMaxPeek);
    auto chosen = [&](RouteChoice choice) {
        done(c);
        return Inspected{Inspected::Chosen, choice};
    };
    // Peeked, not read: every byte stays in the socket for the backend. The window is the
    // size cap: the parser never needs a byte past it.
    ssize_t n = ::recv(c.fd[0], scratch_.data(), max_size, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) {
            start(ring, c, slot);
            return {};
        }
        return {Inspected::Reset, {}};
    }
    tls_hello::Parse p = tls_hello::parse({scratch_.data(), static_cast<size_t>(n)}, max_size,
                                          {work_.data(), work_.size()});
    switch (p.status) {
        case tls_hello::Status::Complete:
            if (names != nullptr) {
                copyField(names->sni, p.hello.sni);
                size_t len = tls_hello::joinProtocols(p.hello.alpn,
                                                      {names->alpn, sizeof names->alpn - 1});
                names->alpn[len] = '\0';
            }
            return chosen(chooseRoute(l, &p.hello));
        case tls_hello::Status::Incomplete:
            break;
        default:
            return chosen(chooseRoute(l, nullptr, failureOf(p.status)));
    }
    // The client's FIN is in (or it sent nothing at all): the peek saw every byte it will send
    // before it, so the hello cannot complete, and POLLRDHUP would fire again at once.
    if (n == 0 || (res & (POLLRDHUP | POLLHUP)))
        return chosen(chooseRoute(l, nullptr, InspectFailure::Closed));
    int lowat = static_cast<int>(p.wake);
    ::setsockopt(c.fd[0], SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat);
    c.lowat = true;
    start(ring, c, slot);
    return {};
}

Forwarded HelloReader::forward(Conn& c) {
    // The peek is fresh: scratch_ is shared by the worker's connections, and more may have
    // come since the choice. Nothing else reads the client before its data path starts, so the
    // bytes peeked are still the first in its queue when the read below takes them.
    ssize_t n = ::recv(c.fd[0], scratch_.data(), scratch_.size(), MSG_PEEK | MSG_DONTWAIT);
    if (n <= 0) {
        // Nothing queued, or the FIN or an error first: the data path sees it in order.
        return {};
    }
    ssize_t sent =
        ::send(c.fd[1], scratch_.data(), static_cast<size_t>(n), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent < 0) {
        // Left for the data path; what the PROXY reader read in part is still queued.
        if (errno == EAGAIN || errno == EINTR) return {0, 0, false, c.proxy_in > 0};
        return {0, errno, false};
    }
    ssize_t got = ::recv(c.fd[0], scratch_.data(), static_cast<size_t>(sent), MSG_DONTWAIT);
    if (got != sent) {
        // Bytes the upstream has, not taken from the client: relaying on would send them twice.
        return {0, got < 0 ? errno : EIO, true};
    }
    c.proxy_in += static_cast<uint32_t>(sent);
    c.proxy_out += static_cast<uint32_t>(sent);
    return {static_cast<uint32_t>(sent), 0, false, sent < n};
}

RouteChoice HelloReader::onTimeout(Conn& c, const ListenerRt& l) {
    done(c);
    return chooseRoute(l, nullptr, InspectFailure::Timeout);
}

}  // namespace zcrelay
