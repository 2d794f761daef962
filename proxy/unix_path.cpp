#include "unix_path.hpp"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "file_kind.hpp"
#include "result.hpp"

namespace zcrelay {

tl::expected<void, std::string> clearUnixPath(const SocketAddress& listen,
                                              const std::string& path) {
    const std::string where = listen.toString();
    struct stat st {};
    if (::lstat(path.c_str(), &st) < 0) {
        if (errno == ENOENT) return {};
        const std::string why = errnoText("lstat");
        return tl::unexpected(where + ": " + why);
    }
    if (!S_ISSOCK(st.st_mode))
        return tl::unexpected(where + ": " + path + " exists and is " + fileKind(st.st_mode) +
                              ", not a socket; refusing to remove it");
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!probe) {
        const std::string why = errnoText("socket");
        return tl::unexpected(where + ": " + why);
    }
    int connected = ::connect(probe.get(), listen.sockaddrPtr(), listen.length);
    int err = errno;
    if (connected < 0 && err == EPROTOTYPE) {
        // A socket of another type (the takeover socket is SOCK_SEQPACKET) answers only its own.
        probe.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        connected = ::connect(probe.get(), listen.sockaddrPtr(), listen.length);
        err = errno;
    }
    // Accepted, or queued behind a full backlog: someone listens.
    if (connected == 0 || err == EAGAIN)
        return tl::unexpected(where + ": " + path +
                              " is a socket another server is listening on; not removing it");
    if (err != ECONNREFUSED && err != ENOENT)
        return tl::unexpected(where + ": cannot tell whether the socket " + path + " is in use (" +
                              errnoText("connect", err) + "); not removing it");
    if (::unlink(path.c_str()) < 0 && errno != ENOENT) {
        const std::string why = errnoText("unlink");
        return tl::unexpected(where + ": removing the stale socket " + path + ": " + why);
    }
    return {};
}

UnixFile UnixFile::at(const std::string& path) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) < 0 || !S_ISSOCK(st.st_mode)) return UnixFile{};
    return UnixFile{path, st.st_dev, st.st_ino};
}

void UnixFile::removeIfSame() const {
    if (path.empty()) return;
    const UnixFile now = at(path);
    if (now.dev == dev && now.ino == ino) ::unlink(path.c_str());
}

tl::expected<UnpublishedUnixSocket, std::string> bindUnix(const std::string& path, int type,
                                                          mode_t mode, bool replace_live) {
    auto addr = parseAddress("unix:" + path);
    if (!addr) return tl::unexpected(addr.error());
    if (!replace_live) {
        if (auto cleared = clearUnixPath(*addr, path); !cleared)
            return tl::unexpected(cleared.error());
    }
    const std::string temporary = path + ".new." + std::to_string(::getpid());
    auto temp_addr = parseAddress("unix:" + temporary);
    if (!temp_addr) return tl::unexpected(temp_addr.error());
    ::unlink(temporary.c_str());
    UniqueFd fd(::socket(AF_UNIX, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) return tl::unexpected(errnoText("socket"));
    if (::bind(fd.get(), temp_addr->sockaddrPtr(), temp_addr->length) < 0)
        return tl::unexpected(errnoText("bind " + temporary));
    UnpublishedUnixSocket bound(std::move(fd), temporary, path);
    // Before listen(): until then nobody can connect under the umask's mode.
    if (::chmod(temporary.c_str(), mode) < 0)
        return tl::unexpected(errnoText("chmod " + temporary));
    return bound;
}

UnpublishedUnixSocket::~UnpublishedUnixSocket() {
    if (!temporary_.empty()) ::unlink(temporary_.c_str());
}

tl::expected<UniqueFd, std::string> UnpublishedUnixSocket::publish() {
    if (::listen(fd_.get(), 16) < 0) return tl::unexpected(errnoText("listen " + temporary_));
    if (::rename(temporary_.c_str(), path_.c_str()) < 0)
        return tl::unexpected(errnoText("rename " + temporary_ + " to " + path_));
    temporary_.clear();
    return std::move(fd_);
}

tl::expected<UniqueFd, std::string> listenUnix(const std::string& path, int type, mode_t mode,
                                               bool replace_live) {
    auto bound = bindUnix(path, type, mode, replace_live);
    if (!bound) return tl::unexpected(bound.error());
    return bound->publish();
}

}  // namespace zcrelay
