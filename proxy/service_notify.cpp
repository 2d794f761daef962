#include "service_notify.hpp"

#include <sys/socket.h>
#include <sys/un.h>

#include <cstdlib>
#include <cstring>

#include "log.hpp"
#include "unique_fd.hpp"

namespace zcrelay {

void notifyServiceManager(const std::string& state) {
    // Left in the environment: a SIGUSR2 child is in the same service and notifies the same
    // manager.
    const char* where = std::getenv("NOTIFY_SOCKET");
    if (where == nullptr || where[0] == '\0') return;
    const size_t length = std::strlen(where);
    sockaddr_un sun{};
    sun.sun_family = AF_UNIX;
    if ((where[0] != '/' && where[0] != '@') || length >= sizeof sun.sun_path) {
        LOG_WARN("NOTIFY_SOCKET %s: not a unix socket path or @name; not notifying", where);
        return;
    }
    std::memcpy(sun.sun_path, where, length);
    if (where[0] == '@') sun.sun_path[0] = '\0';
    const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + length);
    UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd || ::sendto(fd.get(), state.data(), state.size(), MSG_NOSIGNAL,
                        reinterpret_cast<sockaddr*>(&sun), len) < 0)
        LOG_WARN("NOTIFY_SOCKET %s: %s not sent: %s", where, state.c_str(), std::strerror(errno));
}

}  // namespace zcrelay
