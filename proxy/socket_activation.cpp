#include "socket_activation.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace zcrelay {
namespace {

// SD_LISTEN_FDS_START: the first passed fd.
constexpr int kFirstFd = 3;

int intOption(int fd, int level, int name) {
    int v = -1;
    socklen_t len = sizeof v;
    return ::getsockopt(fd, level, name, &v, &len) == 0 ? v : -1;
}

// A whole non-negative decimal number, or -1.
long parseCount(const char* text) {
    if (text == nullptr || *text == '\0') return -1;
    char* end = nullptr;
    errno = 0;
    long v = std::strtol(text, &end, 10);
    return errno == 0 && *end == '\0' && v >= 0 ? v : -1;
}

std::vector<std::string> splitNames(const char* names) {
    std::vector<std::string> out;
    if (names == nullptr) return out;
    std::string_view rest(names);
    for (;;) {
        size_t colon = rest.find(':');
        out.emplace_back(rest.substr(0, colon));
        if (colon == std::string_view::npos) break;
        rest.remove_prefix(colon + 1);
    }
    return out;
}

}  // namespace

tl::expected<std::vector<InheritedSocket>, std::string> takeInheritedSockets() {
    const char* pid_text = std::getenv("LISTEN_PID");
    const char* fds_text = std::getenv("LISTEN_FDS");
    std::vector<std::string> names = splitNames(std::getenv("LISTEN_FDNAMES"));
    long pid = parseCount(pid_text);
    long count = parseCount(fds_text);
    // sd_listen_fds(1): unset, so that no process the relay starts takes them for its own.
    ::unsetenv("LISTEN_PID");
    ::unsetenv("LISTEN_FDS");
    ::unsetenv("LISTEN_FDNAMES");
    std::vector<InheritedSocket> out;
    if (fds_text == nullptr) return out;
    if (count < 0)
        return tl::unexpected(std::string("LISTEN_FDS: \"") + fds_text + "\" is not a count");
    if (pid != static_cast<long>(::getpid())) return out;
    for (int fd = kFirstFd; fd < kFirstFd + count; ++fd) {
        std::string which = "LISTEN_FDS: fd " + std::to_string(fd);
        if (::fcntl(fd, F_SETFD, FD_CLOEXEC) < 0)
            return tl::unexpected(which + ": " + std::strerror(errno));
        UniqueFd owned(fd);
        int domain = intOption(fd, SOL_SOCKET, SO_DOMAIN);
        if (intOption(fd, SOL_SOCKET, SO_TYPE) != SOCK_STREAM ||
            (domain != AF_INET && domain != AF_INET6) ||
            intOption(fd, SOL_SOCKET, SO_PROTOCOL) != IPPROTO_TCP)
            return tl::unexpected(which + " is not a TCP socket over IPv4 or IPv6");
        if (intOption(fd, SOL_SOCKET, SO_ACCEPTCONN) != 1)
            return tl::unexpected(which + " is not listening");
        int flags = ::fcntl(fd, F_GETFL);
        if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
            return tl::unexpected(which + ": " + std::strerror(errno));
        sockaddr_storage ss{};
        socklen_t len = sizeof ss;
        if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) < 0)
            return tl::unexpected(which + ": getsockname: " + std::strerror(errno));
        size_t i = static_cast<size_t>(fd - kFirstFd);
        out.push_back({std::move(owned), addressFromSockaddr(reinterpret_cast<sockaddr*>(&ss), len),
                       i < names.size() ? names[i] : std::string()});
    }
    return out;
}

}  // namespace zcrelay
