#include "upstream.hpp"

#include <netinet/in.h>
#include <sys/socket.h>

namespace zcrelay {

Result<UniqueFd> openUpstreamSocket(const SocketAddress& backend, const SocketAddress& source) {
    const bool unix_socket = backend.family() == AF_UNIX;
    UniqueFd fd(::socket(backend.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC,
                         unix_socket ? 0 : IPPROTO_TCP));
    if (!fd) return sysError("socket");
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

}  // namespace zcrelay
