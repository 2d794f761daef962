#include "support/netns.hpp"

#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace zcrelay::test {
namespace {

Isolation& state() {
    static Isolation s{NetScope::Unavailable,
                       "isolate() was not called (tests/support/test_main.cpp)"};
    return s;
}

std::string errnoText(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// A new namespace's lo exists but is down: nothing, not even 127.0.0.1, answers until it is up.
std::string bringLoopbackUp() {
    const int s = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) return errnoText("socket");
    ifreq ifr{};
    std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
    std::string why;
    if (::ioctl(s, SIOCGIFFLAGS, &ifr) != 0) {
        why = errnoText("SIOCGIFFLAGS lo");
    } else {
        ifr.ifr_flags |= IFF_UP;
        if (::ioctl(s, SIOCSIFFLAGS, &ifr) != 0) why = errnoText("SIOCSIFFLAGS lo up");
    }
    ::close(s);
    return why;
}

std::string writeSysctl(const char* path, std::string_view value) {
    const int fd = ::open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return errnoText(path);
    const bool ok = ::write(fd, value.data(), value.size()) == static_cast<ssize_t>(value.size());
    std::string why = ok ? "" : errnoText(path);
    ::close(fd);
    return why;
}

}  // namespace

const Isolation& isolate() {
    Isolation& s = state();
    const char* host = std::getenv("ZCRELAY_TEST_HOST_NET");
    if (host != nullptr && std::string_view(host) == "1") {
        s = {NetScope::Host, ""};
        return s;
    }
    if (::unshare(CLONE_NEWNET) != 0) {
        s = {NetScope::Unavailable,
             errnoText("unshare(CLONE_NEWNET)") +
                 (errno == EPERM ? " (a network namespace needs root)" : "")};
        return s;
    }
    if (std::string why = bringLoopbackUp(); !why.empty()) {
        s = {NetScope::Unavailable, why};
        return s;
    }
    // The /proc/sys/net files a process opens are its namespace's, fresh at their defaults.
    // 10000-65535 rather than 32768-60999: a churn case's TIME_WAITs (tens of thousands) leave
    // ports for the binds after it. Below 10000 stay the ports services listen on by default.
    if (std::string why = writeSysctl("/proc/sys/net/ipv4/ip_local_port_range", "10000 65535");
        !why.empty()) {
        s = {NetScope::Unavailable, why};
        return s;
    }
    s = {NetScope::Private, ""};
    return s;
}

const Isolation& isolation() { return state(); }

std::string relayRefusal() {
    const Isolation& s = isolation();
    if (s.scope != NetScope::Unavailable) return "";
    return "refusing to start a relay on the host's network: this test process has no network "
           "namespace of its own (" +
           s.why + "). Run it as root, or set ZCRELAY_TEST_HOST_NET=1 to use the host's loopback.";
}

}  // namespace zcrelay::test
