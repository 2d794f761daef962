#include "upstream.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

namespace zcrelay {

Result<UniqueFd> openUpstreamSocket(int family, bool nodelay) {
    UniqueFd fd(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP));
    if (!fd) return sysError("socket");
    int one = 1;
    if (nodelay) ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
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
