#include "config_reader.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>
#include <tl/expected.hpp>

#include "clock.hpp"
#include "result.hpp"
#include "spawn.hpp"
#include "unique_fd.hpp"

namespace zcrelay {
namespace {

// What the relay takes of the child's output: the rendering of a config, however large the
// config, stays far below the first; an error is a line.
constexpr size_t kMaxRendered = 64u << 20;
constexpr size_t kMaxError = 64u << 10;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// The child's error as the relay logs it: its last line, without the "zcrelay: " every error of
// main() starts with.
std::string childError(std::string text) {
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
    const size_t line = text.rfind('\n');
    if (line != std::string::npos) text.erase(0, line + 1);
    constexpr std::string_view kPrefix = "zcrelay: ";
    if (text.compare(0, kPrefix.size(), kPrefix) == 0) text.erase(0, kPrefix.size());
    return text;
}

struct Child {
    pid_t pid = -1;
    UniqueFd out, err;
};

// The reader's fds are 0 = /dev/null, 1 and 2 the pipes, nothing else (spawn.hpp).
tl::expected<Child, std::string> spawnReader(const std::vector<std::string>& args) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0) return tl::unexpected(errnoText("pipe2", errno));
    Child child;
    child.out.reset(out[0]);
    UniqueFd out_w(out[1]);
    if (::pipe2(err, O_CLOEXEC) != 0) return tl::unexpected(errnoText("pipe2", errno));
    child.err.reset(err[0]);
    UniqueFd err_w(err[1]);

    std::vector<std::string> words = args;
    words.push_back("--dump-config");
    // /proc/self/exe: the binary this process runs, even if a package upgrade has replaced the
    // file since: the reader checks the config with the code that will apply it.
    auto pid =
        spawnChild("/proc/self/exe", words, currentEnvironment(), {-1, out_w.get(), err_w.get()});
    if (!pid) return tl::unexpected(pid.error());
    child.pid = *pid;
    return child;
}

// Reads both pipes until the child closes them or `deadline_ms` passes; false at the deadline.
bool collect(Child& child, int64_t deadline_ms, std::string& out, std::string& err) {
    bool out_open = true, err_open = true;
    while (out_open || err_open) {
        const int64_t left = deadline_ms - monotonicMs();
        if (left <= 0) return false;
        pollfd fds[2] = {{out_open ? child.out.get() : -1, POLLIN, 0},
                         {err_open ? child.err.get() : -1, POLLIN, 0}};
        const int n = ::poll(fds, 2, static_cast<int>(left));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) continue;
        for (int i = 0; i < 2; ++i) {
            if (fds[i].revents == 0) continue;
            char buf[65536];
            const ssize_t got = ::read(fds[i].fd, buf, sizeof buf);
            if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            std::string& into = i == 0 ? out : err;
            const size_t cap = i == 0 ? kMaxRendered : kMaxError;
            if (got <= 0) {
                (i == 0 ? out_open : err_open) = false;
            } else if (into.size() < cap) {
                into.append(buf, std::min<size_t>(static_cast<size_t>(got), cap - into.size()));
            }
        }
    }
    return true;
}

// Waits for the child to exit, until `deadline_ms`: one that closed its pipes and lingers (an
// exit handler stuck) must not hold the reload either. False at the deadline.
bool reap(pid_t pid, int64_t deadline_ms, int& status) {
    for (;;) {
        const pid_t r = ::waitpid(pid, &status, WNOHANG);
        if (r == pid) return true;
        if (r < 0 && errno != EINTR) return true;  // not ours to wait for: nothing to kill
        if (monotonicMs() >= deadline_ms) return false;
        ::usleep(2000);
    }
}

// What became of the child, as the reload's outcome.
ConfigReader::Outcome outcomeOf(int status, bool in_time, std::string out, const std::string& err,
                                const std::string& source) {
    if (!in_time) {
        return "reading the config took longer than " + formatDuration(kConfigReadDeadline) +
               "; the process reading it was killed";
    }
    if (WIFSIGNALED(status)) {
        const int sig = WTERMSIG(status);
        return "the process reading the config was killed by signal " + std::to_string(sig) +
               (sig == SIGKILL ? " (the OOM killer, most likely: the config needs too much memory)"
                               : std::string(" (") + strsignal(sig) + ")");
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::string why = childError(err);
        return why.empty() ? "the process reading the config exited with status " +
                                 std::to_string(WEXITSTATUS(status))
                           : why;
    }
    if (out.size() >= kMaxRendered)
        return "the config, rendered, is larger than " + formatSize(kMaxRendered);
    try {
        return loadConfigString(out, source + " (as rendered by --dump-config)");
    } catch (const std::exception& e) {  // a rendering that does not load back: a bug
        return std::string(e.what());
    }
}

}  // namespace

struct ConfigReader::State {
    std::mutex mutex;
    std::optional<Outcome> outcome;
    bool taken = false;  // the relay has its outcome (or gave up waiting): later posts are dropped
    int64_t deadline_ms = 0;

    void post(Outcome o) {
        std::lock_guard lock(mutex);
        if (!taken && !outcome) outcome = std::move(o);
    }
};

namespace {

// The reader's whole life, on a thread of its own: spawn, collect, reap. posix_spawn suspends
// its caller until the child has exec'd (CLONE_VFORK), and exec reads the binary, so it runs
// here, never on the main thread that takes the signals.
void readConfig(const std::shared_ptr<ConfigReader::State>& state,
                const std::vector<std::string>& args, const std::string& source) {
    auto spawned = spawnReader(args);
    if (!spawned) {
        state->post("cannot start the process that reads the config: " + spawned.error());
        return;
    }
    Child& child = *spawned;
    std::string out, err;
    int status = 0;
    const bool in_time = collect(child, state->deadline_ms, out, err) &&
                         reap(child.pid, state->deadline_ms, status);
    if (!in_time) ::kill(child.pid, SIGKILL);
    state->post(outcomeOf(status, in_time, std::move(out), err, source));
    if (!in_time) ::waitpid(child.pid, &status, 0);  // reaped, however long it takes
}

}  // namespace

ConfigReader::ConfigReader(const std::vector<std::string>& args, const std::string& source)
    : state_(std::make_shared<State>()) {
    state_->deadline_ms = monotonicMs() + kConfigReadDeadline.count();
    try {
        // Detached: a child stuck in the kernel (a hung NFS read survives SIGKILL until the
        // read ends) must not hold up a drain or the exit.
        std::thread([state = state_, args, source] { readConfig(state, args, source); })
            .detach();
    } catch (const std::exception& e) {
        // No thread (no memory for its stack, or the thread limit): the reload is refused like
        // any other.
        state_->post("cannot start the thread that reads the config: " + std::string(e.what()));
    }
}

std::optional<ConfigReader::Outcome> ConfigReader::take() {
    std::lock_guard lock(state_->mutex);
    if (state_->taken) return std::nullopt;
    // A thread that cannot even report (stuck in posix_spawn while exec waits on a hung
    // filesystem) must not hold the reload: past the deadline and a second's grace, the relay
    // stops waiting; the thread kills the child whenever it gets its pid.
    if (!state_->outcome && monotonicMs() > state_->deadline_ms + 1000) {
        state_->outcome = "reading the config took longer than " +
                          formatDuration(kConfigReadDeadline) +
                          "; its process did not even start (is the binary's filesystem hung?)";
    }
    if (state_->outcome) state_->taken = true;
    return std::exchange(state_->outcome, std::nullopt);
}

uint64_t configReaderAddressSpace(uint64_t max_config_size) {
    return (uint64_t{512} << 20) + 128 * max_config_size;
}

void limitConfigReader(uint64_t max_config_size) {
    // The OOM killer's first choice in the cgroup it shares with the relay.
    if (int fd = ::open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC); fd >= 0) {
        ssize_t ignored = ::write(fd, "1000", 4);
        (void)ignored;
        ::close(fd);
    }
    if (kSanitized) return;
    rlimit as{};
    if (::getrlimit(RLIMIT_AS, &as) != 0) return;
    const rlim_t want = configReaderAddressSpace(max_config_size);
    if (as.rlim_cur == RLIM_INFINITY || as.rlim_cur > want) {
        as.rlim_cur = want;
        ::setrlimit(RLIMIT_AS, &as);
    }
}

}  // namespace zcrelay
