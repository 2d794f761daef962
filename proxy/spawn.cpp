#include "spawn.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>

#include "result.hpp"

extern char** environ;

namespace zcrelay {

tl::expected<pid_t, std::string> spawnChild(const std::string& binary,
                                            const std::vector<std::string>& args,
                                            const std::vector<std::string>& env,
                                            const std::vector<int>& fds) {
    std::vector<std::string> words = {"zcrelay"};
    words.insert(words.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_words = env;
    std::vector<char*> envp;
    for (std::string& w : env_words) envp.push_back(w.data());
    envp.push_back(nullptr);

    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    for (size_t i = 0; i < fds.size(); ++i) {
        const int to = static_cast<int>(i);
        if (fds[i] < 0)
            posix_spawn_file_actions_addopen(&actions, to, "/dev/null", O_RDONLY, 0);
        else
            // dup2 onto itself clears FD_CLOEXEC (glibc 2.29 and later), as a plain dup2 does.
            posix_spawn_file_actions_adddup2(&actions, fds[i], to);
    }
    posix_spawn_file_actions_addclosefrom_np(&actions, static_cast<int>(fds.size()));
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    sigaddset(&defaults, SIGPIPE);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, binary.c_str(), &actions, &attr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) return tl::unexpected(errnoText("executing " + binary, rc));
    return pid;
}

std::vector<std::string> currentEnvironment() {
    std::vector<std::string> out;
    for (char** e = environ; *e != nullptr; ++e) out.emplace_back(*e);
    return out;
}

}  // namespace zcrelay
