#include "upgrade.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "result.hpp"
#include "spawn.hpp"

namespace zcrelay {
namespace {

constexpr int kChannelFd = 3;
constexpr const char* kVariable = "ZCRELAY_TAKEOVER_FD";

std::string readExe() {
    char buf[PATH_MAX];
    const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n <= 0) return "/proc/self/exe";
    std::string path(buf, static_cast<size_t>(n));
    // Replaced since this process started: the kernel names the old inode so.
    constexpr std::string_view kDeleted = " (deleted)";
    if (path.size() > kDeleted.size() && path.ends_with(kDeleted))
        path.resize(path.size() - kDeleted.size());
    return path;
}

}  // namespace

std::string startedBinary() {
    static const std::string path = readExe();
    return path;
}

tl::expected<Successor, std::string> spawnSuccessor(const std::string& binary,
                                                    const std::vector<std::string>& args) {
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, pair) < 0)
        return tl::unexpected(errnoText("socketpair"));
    Successor next;
    next.channel.reset(pair[0]);
    UniqueFd child_end(pair[1]);

    std::vector<std::string> env;
    for (std::string& e : currentEnvironment())
        if (!e.starts_with(std::string(kVariable) + "=")) env.push_back(std::move(e));
    env.push_back(std::string(kVariable) + "=" + std::to_string(kChannelFd));
    // The child keeps stdin, stdout and stderr (the journal), and the channel as fd 3.
    auto pid = spawnChild(binary, args, env, {0, 1, 2, child_end.get()});
    if (!pid) return tl::unexpected(pid.error());
    next.pid = *pid;
    return next;
}

tl::expected<UniqueFd, std::string> takeSuccessorChannel() {
    const char* text = std::getenv(kVariable);
    const std::string value = text ? text : "";
    ::unsetenv(kVariable);
    if (value.empty()) return UniqueFd();
    char* end = nullptr;
    const long fd = std::strtol(value.c_str(), &end, 10);
    if (*end != '\0' || fd < 0 || fd > INT_MAX)
        return tl::unexpected(std::string(kVariable) + ": \"" + value + "\" is not an fd");
    const std::string which = std::string(kVariable) + ": fd " + value;
    if (::fcntl(static_cast<int>(fd), F_SETFD, FD_CLOEXEC) < 0)
        return tl::unexpected(which + ": " + std::strerror(errno));
    UniqueFd owned(static_cast<int>(fd));
    int type = -1;
    socklen_t len = sizeof type;
    if (::getsockopt(owned.get(), SOL_SOCKET, SO_TYPE, &type, &len) < 0 || type != SOCK_SEQPACKET)
        return tl::unexpected(which + " is not the takeover channel (a SOCK_SEQPACKET socket)");
    const int flags = ::fcntl(owned.get(), F_GETFL);
    ::fcntl(owned.get(), F_SETFL, flags | O_NONBLOCK);
    return owned;
}

}  // namespace zcrelay
