#include "proxy_reader.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace zcrelay {

void ProxyReader::start(Ring& ring, Conn& c, uint32_t slot) {
    io_uring_prep_poll_add(connSqe(ring, c, slot, Op::ProxyRead), c.fd[0], POLLIN | POLLRDHUP);
}

ProxyRead ProxyReader::onReadable(Ring& ring, Conn& c, uint32_t slot, const ListenerConfig& l,
                                  int res) {
    auto fail = [](ProxyFailure why) { return ProxyRead{ProxyRead::Failed, why}; };
    // Peeked, not read: the bytes after the header are the client's payload and stay in the
    // socket for the data path. At least one byte past the longest v1 line, so a line without
    // its CRLF within the spec's bound is seen to be too long rather than waited for.
    size_t window = std::min<size_t>(
        scratch_.size(), std::max<uint64_t>(l.proxy_max_size, proxy_protocol::kV1MaxLength + 1));
    ssize_t n = ::recv(c.fd[0], scratch_.data(), window, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return fail(ProxyFailure::Eof);
    if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) {
            start(ring, c, slot);
            return {};
        }
        return {ProxyRead::Reset};
    }
    auto r = proxy_protocol::parse({scratch_.data(), static_cast<size_t>(n)}, l.proxy_max_size);
    if (r.kind == proxy_protocol::ParseResult::Malformed)
        return fail(static_cast<ProxyFailure>(r.error));
    if (r.kind == proxy_protocol::ParseResult::Incomplete) {
        // The client's FIN is in: the peek (its window covers any `need`) saw every byte it
        // will send, so the header cannot complete, and POLLRDHUP would fire again at once.
        if (res & (POLLRDHUP | POLLHUP)) return fail(ProxyFailure::Eof);
        int lowat = static_cast<int>(r.need);
        ::setsockopt(c.fd[0], SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat);
        start(ring, c, slot);
        return {};
    }
    // Consume exactly the header. The peek saw all of it, so this read takes it at once.
    if (::recv(c.fd[0], scratch_.data(), r.length, MSG_DONTWAIT) != r.length)
        return {ProxyRead::Error};
    c.proxy_in = r.length;
    int one = 1;
    ::setsockopt(c.fd[0], SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    if (r.has_addresses) {
        // The client from now on: source_hash, limits, the access log, a PROXY header sent on.
        c.client = r.src;
        c.local = r.dst;
        c.have_client = c.have_local = true;
    }
    return {ProxyRead::Done};
}

}  // namespace zcrelay
