#pragma once
// Starting a child from a process with threads: posix_spawn (a vfork-style clone in glibc), so
// nothing of the relay runs in the child before exec. The child gets exactly the fds asked for,
// none else (even one a library opened without O_CLOEXEC), an empty signal mask (the relay
// blocks every signal it takes, and a mask survives exec) and SIGPIPE back to its default. Used
// for a SIGHUP's config reader (config_reader.hpp) and a SIGUSR2's new relay (upgrade.hpp).
#include <sys/types.h>

#include <string>
#include <tl/expected.hpp>
#include <vector>

namespace zcrelay {

// Runs `binary` with argv `zcrelay ARGS...` and `env` (KEY=VALUE each). Child fd i is this
// process's fds[i], or /dev/null where that is -1; fds past the list are closed.
tl::expected<pid_t, std::string> spawnChild(const std::string& binary,
                                            const std::vector<std::string>& args,
                                            const std::vector<std::string>& env,
                                            const std::vector<int>& fds);

// This process's environment, as spawnChild takes it.
std::vector<std::string> currentEnvironment();

}  // namespace zcrelay
