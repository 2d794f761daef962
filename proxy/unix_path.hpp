#pragma once
// A unix socket's file in the filesystem: made way for before a bind, and removed after, only
// when it is still the one this process bound. The runtime API's socket (http_server.hpp) and the
// takeover socket (takeover.hpp) both live at such a path.
#include <sys/types.h>

#include <string>
#include <tl/expected.hpp>

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

// A listening unix socket of `type` (SOCK_STREAM, SOCK_SEQPACKET) at `path`, its file made
// `mode` before anyone can connect. It is bound at a temporary name and renamed over `path`, so
// the path never lacks a listener; a socket already there that someone listens on is refused,
// unless `replace_live`.
tl::expected<UniqueFd, std::string> listenUnix(const std::string& path, int type, mode_t mode,
                                               bool replace_live);

}  // namespace zcrelay
