#include "listener.hpp"

#include <netinet/in.h>
#include <sys/socket.h>

namespace zcrelay {

Result<UniqueFd> openListener(const SocketAddress& addr) {
    UniqueFd fd(::socket(addr.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP));
    if (!fd) return sysError("socket");
    int one = 1;
    // SO_REUSEADDR: restart without waiting for TIME_WAIT of the previous run's sockets.
    if (::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0)
        return sysError("SO_REUSEADDR");
    if (::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) < 0)
        return sysError("SO_REUSEPORT");
    if (addr.family() == AF_INET6) {
        // [::]:port means IPv6 only, so a separate 0.0.0.0:port listener does not collide.
        if (::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one) < 0)
            return sysError("IPV6_V6ONLY");
    }
    if (::bind(fd.get(), addr.sockaddrPtr(), addr.length) < 0) return sysError("bind");
    // The kernel caps the backlog at net.core.somaxconn; ask for the most it allows.
    if (::listen(fd.get(), SOMAXCONN) < 0) return sysError("listen");
    return fd;
}

Result<SocketAddress> boundAddress(int fd) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) < 0)
        return sysError("getsockname");
    return addressFromSockaddr(reinterpret_cast<sockaddr*>(&ss), len);
}

}  // namespace zcrelay
