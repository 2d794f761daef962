#include "upstream.hpp"

#include <netinet/in.h>
#include <sys/socket.h>

namespace zcrelay {

Result<UniqueFd> openUpstreamSocket(int family) {
    UniqueFd fd(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP));
    if (!fd) return sysError("socket");
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
