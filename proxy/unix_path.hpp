#pragma once
// A unix socket's file in the filesystem: made way for before a bind, and removed after, only
// when it is still the one this process bound. The runtime API's socket (http_server.hpp) and the
// takeover socket (takeover.hpp) both live at such a path.
#include <sys/types.h>

#include <string>
#include <tl/expected.hpp>
#include <utility>

#include "address.hpp"
#include "unique_fd.hpp"

namespace zcrelay {

// Makes way for a unix socket at `path` (`listen` names it in errors): nothing there, or a stale
// socket (one nobody listens on: connect() is refused), which is removed. Anything else is
// refused and left as it is: a regular file or a directory (a typo in the config must not
// delete data), a symlink (lstat: never followed), a socket another server listens on (its
// clients would be cut off silently).
tl::expected<void, std::string> clearUnixPath(const SocketAddress& listen, const std::string& path);

// The file bound at a path, to remove it later only if it is still this one (same device and
// inode): another process may have replaced it meanwhile.
struct UnixFile {
    std::string path;
    dev_t dev = 0;
    ino_t ino = 0;

    // What is at `path` now; empty when nothing (or no socket) is there.
    static UnixFile at(const std::string& path);
    void removeIfSame() const;
};

// A listening unix socket bound at a temporary name beside `path` and not yet renamed over it:
// nobody finds it at `path` until publish(). The temporary file goes with the object unless
// it was published.
class UnpublishedUnixSocket {
  public:
    UnpublishedUnixSocket(UniqueFd fd, std::string temporary, std::string path)
        : fd_(std::move(fd)), temporary_(std::move(temporary)), path_(std::move(path)) {}
    UnpublishedUnixSocket(UnpublishedUnixSocket&& other) noexcept
        : fd_(std::move(other.fd_)),
          temporary_(std::exchange(other.temporary_, std::string())),
          path_(std::move(other.path_)) {}
    UnpublishedUnixSocket& operator=(UnpublishedUnixSocket&&) = delete;
    ~UnpublishedUnixSocket();

    // Renames it over `path` (atomically: the path never lacks a listener, and a socket there
    // before is replaced). The listening socket, from then on found at `path`.
    tl::expected<UniqueFd, std::string> publish();

  private:
    UniqueFd fd_;
    std::string temporary_;  // "" once published (or moved from)
    std::string path_;
};

// A listening unix socket of `type` (SOCK_STREAM, SOCK_SEQPACKET) for `path`, its file made
// `mode` before anyone can connect, bound at a temporary name until published. A socket already
// at `path` that someone listens on is refused, unless `replace_live`.
tl::expected<UnpublishedUnixSocket, std::string> bindUnix(const std::string& path, int type,
                                                          mode_t mode, bool replace_live);
// bindUnix, published at once.
tl::expected<UniqueFd, std::string> listenUnix(const std::string& path, int type, mode_t mode,
                                               bool replace_live);

}  // namespace zcrelay
