#pragma once
// SIGUSR2, nginx's binary upgrade: the relay executes its binary again (the file on disk now, so
// a package upgrade takes effect) as a child, with one end of a socketpair as fd 3 and
// ZCRELAY_TAKEOVER_FD=3 in its environment. The child takes the listening sockets over through
// it (takeover.hpp) and serves; this process then drains and exits. A child that fails to start
// (a bad config, a crash) says so or dies: this process serves on, nothing was closed.
#include <sys/types.h>

#include <string>
#include <tl/expected.hpp>
#include <vector>

#include "unique_fd.hpp"

namespace zcrelay {

// The path of the binary this process was started from, read once at start: after an upgrade
// replaced the file, /proc/self/exe names the old (deleted) one, the path the new one.
std::string startedBinary();

struct Successor {
    pid_t pid = -1;
    UniqueFd channel;  // the giver's end of the socketpair
};

// Starts `binary` with `args` (argv[1..] of this process) as the next relay.
tl::expected<Successor, std::string> spawnSuccessor(const std::string& binary,
                                                    const std::vector<std::string>& args);

// The channel a SIGUSR2 parent gave this process (ZCRELAY_TAKEOVER_FD), or none. The variable
// is removed from the environment either way; an fd that is not a SOCK_SEQPACKET unix socket is
// an error.
tl::expected<UniqueFd, std::string> takeSuccessorChannel();

}  // namespace zcrelay
