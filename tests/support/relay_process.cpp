#include "support/relay_process.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string_view>
#include <utility>

#include "support/netns.hpp"

namespace zcrelay::test {

// ---------------------------------------------------------------------------------------------
// TempDir and files.

TempDir::TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string templ =
        std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/zcrelay-test-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) != nullptr) path_ = buf.data();
}

TempDir::~TempDir() {
    if (path_.empty() || std::getenv("ZCRELAY_KEEP_TEST_DIRS") != nullptr) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
}

std::string TempDir::writeFile(const std::string& name, const std::string& content) const {
    std::string p = file(name);
    std::ofstream(p, std::ios::binary | std::ios::trunc) << content;
    return p;
}

std::string readFileText(const std::string& path, size_t max_bytes) {
    std::ifstream in(path, std::ios::binary);
    std::string out(max_bytes, '\0');
    in.read(out.data(), static_cast<std::streamsize>(max_bytes));
    out.resize(static_cast<size_t>(in.gcount()));
    return out;
}

std::string fileTail(const std::string& path, size_t max_bytes) {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in) return "";
    auto size = static_cast<size_t>(in.tellg());
    size_t start = size > max_bytes ? size - max_bytes : 0;
    in.seekg(static_cast<std::streamoff>(start));
    std::string out(size - start, '\0');
    in.read(out.data(), static_cast<std::streamsize>(out.size()));
    out.resize(static_cast<size_t>(in.gcount()));
    return (start > 0 ? "[...]" : "") + out;
}

// ---------------------------------------------------------------------------------------------
// ChildProcess.

std::string ExitStatus::describe() const {
    std::ostringstream os;
    if (exited)
        os << "exited with code " << code;
    else if (signal != 0)
        os << "killed by signal " << signal << " (" << strsignal(signal) << ")";
    else
        os << "no exit status";
    if (timed_out) os << " after it did not exit in time and was SIGKILLed by the test";
    return os.str();
}

ChildProcess::~ChildProcess() {
    if (pid_ > 0 && !status_) killAndWait();
}

bool ChildProcess::spawn(const Options& options, std::string& error) {
    if (options.argv.empty()) {
        error = "empty argv";
        return false;
    }
    // Everything the child needs is prepared before fork: after fork (in a process with threads)
    // only async-signal-safe calls are allowed.
    std::vector<std::string> args = options.argv;
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    Fd in(::open(options.stdin_path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!in) {
        error = "open " + options.stdin_path + ": " + std::strerror(errno);
        return false;
    }
    Fd out;
    if (options.stdout_fd < 0 && !options.stdout_path.empty()) {
        out.reset(
            ::open(options.stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
        if (!out) {
            error = "open " + options.stdout_path + ": " + std::strerror(errno);
            return false;
        }
    }
    int out_fd = options.stdout_fd >= 0 ? options.stdout_fd : out.get();
    Fd err;
    if (!options.stderr_path.empty()) {
        err.reset(
            ::open(options.stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
        if (!err) {
            error = "open " + options.stderr_path + ": " + std::strerror(errno);
            return false;
        }
    }
    int status_pipe[2];
    if (::pipe2(status_pipe, O_CLOEXEC) != 0) {
        error = std::string("pipe2: ") + std::strerror(errno);
        return false;
    }
    Fd status_read(status_pipe[0]);
    Fd status_write(status_pipe[1]);
    pid_t parent = ::getpid();

    pid_t pid = ::fork();
    if (pid < 0) {
        error = std::string("fork: ") + std::strerror(errno);
        return false;
    }
    if (pid == 0) {
        // Child. If the test process dies, take the child with it.
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != parent) ::_exit(127);
        sigset_t none;
        sigemptyset(&none);
        ::sigprocmask(SIG_SETMASK, &none, nullptr);
        ::signal(SIGPIPE, SIG_DFL);
        ::dup2(in.get(), 0);
        if (out_fd >= 0) ::dup2(out_fd, 1);
        if (err.valid()) ::dup2(err.get(), 2);
        if (options.nofile_limit) {
            rlimit lim{*options.nofile_limit, *options.nofile_limit};
            if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) ::_exit(126);
        }
        ::execv(argv[0], argv.data());
        int e = errno;
        ssize_t ignored = ::write(status_write.get(), &e, sizeof e);
        (void)ignored;
        ::_exit(127);
    }
    pid_ = pid;
    status_write.reset();
    // EOF on the status pipe means exec succeeded (CLOEXEC closed it); an int means it failed.
    int child_errno = 0;
    ssize_t n;
    do {
        n = ::read(status_read.get(), &child_errno, sizeof child_errno);
    } while (n < 0 && errno == EINTR);
    pidfd_.reset(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
    if (n == static_cast<ssize_t>(sizeof child_errno)) {
        error = "exec " + args[0] + ": " + std::strerror(child_errno);
        waitExit(Millis{5'000});
        return false;
    }
    return true;
}

bool ChildProcess::reap(bool block) {
    if (status_) return true;
    if (pid_ <= 0) return false;
    int st = 0;
    pid_t r;
    do {
        r = ::waitpid(pid_, &st, block ? 0 : WNOHANG);
    } while (r < 0 && errno == EINTR);
    if (r != pid_) return false;
    ExitStatus s;
    if (WIFEXITED(st)) {
        s.exited = true;
        s.code = WEXITSTATUS(st);
    } else if (WIFSIGNALED(st)) {
        s.signal = WTERMSIG(st);
    }
    status_ = s;
    pidfd_.reset();
    return true;
}

bool ChildProcess::running() { return pid_ > 0 && !reap(false); }

bool ChildProcess::sendSignal(int sig) {
    if (pid_ <= 0 || status_) return false;
    return ::kill(pid_, sig) == 0;  // only ever our own child's pid
}

std::optional<ExitStatus> ChildProcess::waitExit(Millis timeout) {
    if (pid_ <= 0) return std::nullopt;
    auto deadline = Clock::now() + timeout;
    for (;;) {
        if (reap(false)) return status_;
        auto now = Clock::now();
        if (now >= deadline) return std::nullopt;
        auto left = std::chrono::duration_cast<Millis>(deadline - now).count() + 1;
        if (pidfd_.valid()) {
            pollfd p{pidfd_.get(), POLLIN, 0};
            ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 100)));
        } else {
            std::this_thread::sleep_for(Millis{std::min<int64_t>(left, 5)});
        }
    }
}

ExitStatus ChildProcess::killAndWait() {
    if (status_) return *status_;
    sendSignal(SIGKILL);
    auto s = waitExit(Millis{10'000});
    if (!s) reap(true);  // SIGKILL cannot be ignored; this returns
    ExitStatus out = status_.value_or(ExitStatus{});
    out.timed_out = true;
    return out;
}

std::string CommandResult::describe() const {
    std::ostringstream os;
    if (!spawn_error.empty()) os << "spawn failed: " << spawn_error << "\n";
    os << "status: " << status.describe() << "\n--- stdout ---\n"
       << out << "\n--- stderr ---\n"
       << err;
    return os.str();
}

CommandResult runCommand(const std::vector<std::string>& argv, Millis timeout,
                         const std::string& stdin_path) {
    CommandResult result;
    TempDir dir;
    ChildProcess::Options opts;
    opts.argv = argv;
    opts.stdin_path = stdin_path;
    opts.stdout_path = dir.file("stdout");
    opts.stderr_path = dir.file("stderr");
    ChildProcess child;
    if (!child.spawn(opts, result.spawn_error)) {
        result.status.exited = true;
        result.status.code = 127;
        return result;
    }
    auto st = child.waitExit(timeout);
    result.status = st ? *st : child.killAndWait();
    result.out = readFileText(opts.stdout_path);
    result.err = readFileText(opts.stderr_path);
    return result;
}

::testing::AssertionResult startOnFreeLoopbackPort(
    int family, const std::function<PortLaunch(uint16_t port, std::string& why)>& launch,
    int attempts) {
    std::string why;
    for (int attempt = 0; attempt < attempts; ++attempt) {
        Listening probe = listenLoopback(family);
        if (!probe.fd) return ::testing::AssertionFailure() << probe.error;
        uint16_t port = probe.port;
        probe.fd.reset();
        switch (launch(port, why)) {
            case PortLaunch::Up:
                return ::testing::AssertionSuccess();
            case PortLaunch::Failed:
                return ::testing::AssertionFailure() << why;
            case PortLaunch::Retry:
                break;
        }
    }
    return ::testing::AssertionFailure() << why;
}

std::optional<std::string> findExecutable(const std::string& name) {
    std::string path = std::getenv("PATH") != nullptr ? std::getenv("PATH") : "";
    path += ":/usr/local/sbin:/usr/sbin:/sbin:/usr/bin:/bin";
    std::stringstream ss(path);
    std::string dir;
    while (std::getline(ss, dir, ':')) {
        if (dir.empty()) continue;
        std::string candidate = dir + "/" + name;
        if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    }
    return std::nullopt;
}

namespace {

// `iptables -w 5 OP INPUT -p tcp -i lo MATCH... -j DROP`: a rule on loopback only, never beyond.
std::vector<std::string> loopbackDropArgs(const std::string& iptables, const std::string& op,
                                          std::initializer_list<std::string> match) {
    std::vector<std::string> argv{iptables, "-w", "5", op, "INPUT", "-p", "tcp", "-i", "lo"};
    argv.insert(argv.end(), match);
    argv.insert(argv.end(), {"-j", "DROP"});
    return argv;
}

}  // namespace

SynDropRule::SynDropRule(std::string iptables, uint16_t port)
    : iptables_(std::move(iptables)), port_(port) {
    CommandResult r = runCommand(args("-I"), Millis{15'000});
    added_ = r.status.cleanExit();
    if (!added_) error_ = r.describe();
}

SynDropRule::~SynDropRule() {
    if (!added_) return;
    CommandResult r = runCommand(args("-D"), Millis{15'000});
    if (!r.status.cleanExit())
        ADD_FAILURE() << "could not remove the iptables rule for port " << port_ << ": "
                      << r.describe();
}

std::vector<std::string> SynDropRule::args(const std::string& op) const {
    return loopbackDropArgs(
        iptables_, op, {"--dport", std::to_string(port_), "--tcp-flags", "SYN,ACK,FIN,RST", "SYN"});
}

FlowDropRule::FlowDropRule(std::string iptables, uint16_t port_a, uint16_t port_b)
    : iptables_(std::move(iptables)), port_a_(port_a), port_b_(port_b) {
    for (auto [sport, dport] : {std::pair{port_a_, port_b_}, std::pair{port_b_, port_a_}}) {
        CommandResult r = runCommand(args("-I", sport, dport), Millis{15'000});
        if (!r.status.cleanExit()) {
            error_ = r.describe();
            return;  // the destructor deletes what was inserted
        }
        ++added_;
    }
}

FlowDropRule::~FlowDropRule() {
    std::pair<uint16_t, uint16_t> rules[] = {{port_a_, port_b_}, {port_b_, port_a_}};
    for (int i = 0; i < added_; ++i) {
        CommandResult r = runCommand(args("-D", rules[i].first, rules[i].second), Millis{15'000});
        if (!r.status.cleanExit())
            ADD_FAILURE() << "could not remove the iptables rule dropping " << rules[i].first
                          << " -> " << rules[i].second << ": " << r.describe();
    }
}

std::vector<std::string> FlowDropRule::args(const std::string& op, uint16_t sport,
                                            uint16_t dport) const {
    return loopbackDropArgs(iptables_, op,
                            {"--sport", std::to_string(sport), "--dport", std::to_string(dport)});
}

// ---------------------------------------------------------------------------------------------
// Config.

std::vector<Fd> relaySocketsTo(pid_t pid, const std::vector<uint16_t>& peer_ports) {
    std::vector<Fd> found;
    Fd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
    EXPECT_TRUE(pidfd) << "pidfd_open: " << std::strerror(errno);
    std::string dir = "/proc/" + std::to_string(pid) + "/fd";
    DIR* d = ::opendir(dir.c_str());
    EXPECT_NE(d, nullptr) << dir;
    if (!pidfd || d == nullptr) {
        if (d != nullptr) ::closedir(d);
        return found;
    }
    while (dirent* e = ::readdir(d)) {
        int target = std::atoi(e->d_name);
        if (e->d_name[0] == '.' || target < 0) continue;
        Fd fd(static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.get(), target, 0)));
        sockaddr_storage peer{};
        socklen_t len = sizeof peer;
        if (!fd || ::getpeername(fd.get(), reinterpret_cast<sockaddr*>(&peer), &len) != 0) continue;
        uint16_t port = peer.ss_family == AF_INET6
                            ? ntohs(reinterpret_cast<sockaddr_in6*>(&peer)->sin6_port)
                            : ntohs(reinterpret_cast<sockaddr_in*>(&peer)->sin_port);
        if (std::find(peer_ports.begin(), peer_ports.end(), port) == peer_ports.end()) continue;
        found.push_back(std::move(fd));
    }
    ::closedir(d);
    return found;
}

std::string RelayConfig::yaml() const {
    std::ostringstream os;
    os << "workers: " << workers << "\n";
    os << "drain_timeout: " << drain_timeout << "\n";
    os << "metrics:\n  listen: \"" << metrics_listen << "\"\n";
    if (!metrics_extra_yaml.empty())
        os << metrics_extra_yaml << (metrics_extra_yaml.back() == '\n' ? "" : "\n");
    if (!extra_yaml.empty()) os << extra_yaml << (extra_yaml.back() == '\n' ? "" : "\n");
    os << "listeners:\n";
    for (const auto& l : listeners) {
        os << "  - name: " << l.name << "\n";
        os << "    listen: \"" << l.listen << "\"\n";
        if (!l.omit_target) {
            if (l.cluster.empty())
                os << "    upstream: \"" << l.upstream << "\"\n";
            else
                os << "    cluster: " << l.cluster << "\n";
        }
        os << "    mode: " << l.mode << "\n";
        os << "    pipe_size: " << l.pipe_size << "\n";
        os << "    connect_timeout: " << l.connect_timeout << "\n";
        os << "    idle_timeout: " << l.idle_timeout << "\n";
        if (!l.extra_yaml.empty()) os << l.extra_yaml << (l.extra_yaml.back() == '\n' ? "" : "\n");
        if (kSendZerocopyEverywhere && l.extra_yaml.find("send_zerocopy:") == std::string::npos)
            os << "    send_zerocopy: true\n";
    }
    return os.str();
}

RelayConfig singleListenerConfig(const std::string& upstream_host_port, const std::string& mode,
                                 int family) {
    RelayConfig c;
    ListenerSpec l;
    l.listen = family == AF_INET6 ? "[::1]:0" : "127.0.0.1:0";
    l.upstream = upstream_host_port;
    l.mode = mode;
    c.listeners.push_back(l);
    return c;
}

// ---------------------------------------------------------------------------------------------
// Prometheus text format.

namespace {

bool isNameChar(char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == ':';
}

// Parses one sample line; false for comments, blanks and anything malformed.
bool parseSampleLine(const std::string& line, Sample& out) {
    size_t i = 0;
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    if (i >= line.size() || line[i] == '#') return false;
    size_t start = i;
    while (i < line.size() && isNameChar(line[i])) ++i;
    out.name = line.substr(start, i - start);
    out.labels.clear();
    if (out.name.empty()) return false;
    if (i < line.size() && line[i] == '{') {
        ++i;
        for (;;) {
            while (i < line.size() && (line[i] == ' ' || line[i] == ',')) ++i;
            if (i >= line.size()) return false;
            if (line[i] == '}') {
                ++i;
                break;
            }
            size_t ks = i;
            while (i < line.size() && isNameChar(line[i])) ++i;
            std::string key = line.substr(ks, i - ks);
            if (i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"') return false;
            i += 2;
            std::string value;
            while (i < line.size() && line[i] != '"') {
                if (line[i] == '\\' && i + 1 < line.size()) {
                    ++i;
                    value += line[i] == 'n' ? '\n' : line[i];
                } else {
                    value += line[i];
                }
                ++i;
            }
            if (i >= line.size()) return false;
            ++i;  // closing quote
            out.labels[key] = value;
        }
    }
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    size_t vs = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
    std::string v = line.substr(vs, i - vs);
    if (v.empty()) return false;
    char* end = nullptr;
    out.value = std::strtod(v.c_str(), &end);
    return end != nullptr && *end == '\0';
}

std::string decodeChunked(const std::string& body) {
    std::string out;
    size_t pos = 0;
    while (pos < body.size()) {
        size_t eol = body.find("\r\n", pos);
        if (eol == std::string::npos) break;
        size_t len = std::strtoul(body.substr(pos, eol - pos).c_str(), nullptr, 16);
        if (len == 0) break;
        out.append(body, eol + 2, len);
        pos = eol + 2 + len + 2;
    }
    return out;
}

bool splitHostPort(const std::string& hp, std::string& host, uint16_t& port) {
    size_t colon = hp.rfind(':');
    if (colon == std::string::npos) return false;
    host = hp.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
        host = host.substr(1, host.size() - 2);
    long p = std::strtol(hp.c_str() + colon + 1, nullptr, 10);
    if (p <= 0 || p > 65535) return false;
    port = static_cast<uint16_t>(p);
    return true;
}

std::optional<std::string> procStatusField(pid_t pid, const std::string& field) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind(field + ":", 0) == 0) return line.substr(field.size() + 1);
    }
    return std::nullopt;
}

}  // namespace

std::vector<Sample> parseMetrics(const std::string& text) {
    std::vector<Sample> out;
    std::istringstream in(text);
    std::string line;
    Sample s;
    while (std::getline(in, line)) {
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (parseSampleLine(line, s)) out.push_back(s);
    }
    return out;
}

std::optional<double> findSample(const std::string& text, const std::string& name,
                                 const Labels& labels) {
    std::optional<double> sum;
    for (const auto& s : parseMetrics(text)) {
        if (s.name != name) continue;
        if (s.labels == labels) return s.value;
        // A series with more labels than asked for (e.g. bytes by `path` as well) adds up.
        bool has_all = std::all_of(labels.begin(), labels.end(), [&](const auto& kv) {
            auto it = s.labels.find(kv.first);
            return it != s.labels.end() && it->second == kv.second;
        });
        if (has_all) sum = sum.value_or(0) + s.value;
    }
    return sum;
}

std::string formatSeries(const std::string& name, const Labels& labels) {
    std::string out = name;
    if (!labels.empty()) {
        out += "{";
        bool first = true;
        for (const auto& [k, v] : labels) {
            if (!first) out += ",";
            first = false;
            out += k + "=\"" + v + "\"";
        }
        out += "}";
    }
    return out;
}

const char* relayBinaryUnderTest() {
    const char* named = std::getenv("ZCRELAY_TEST_RELAY");
    return named != nullptr && *named != '\0' ? named : ZCRELAY_BINARY;
}

bool relayIsSanitized() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    return true;
#else
    const char* said = std::getenv("ZCRELAY_TEST_RELAY_SANITIZED");
    return said != nullptr && std::string_view(said) == "1";
#endif
}

// ---------------------------------------------------------------------------------------------
// RelayProcess.

RelayProcess::~RelayProcess() {
    if (child_.pid() > 0 && child_.running()) child_.killAndWait();
    stop_stdout_.store(true);
    if (stdout_thread_.joinable()) stdout_thread_.join();
    // Whatever a test checked, a completion the relay could not match to its connection is a
    // bookkeeping bug (the worker logs it and drops the CQE): no test may pass with one.
    if (!stderr_path_.empty()) {
        std::string log = fileTail(stderr_path_, 1 << 20);
        EXPECT_EQ(log.find("bookkeeping bug"), std::string::npos)
            << "zcrelay logged a stale completion:\n"
            << log;
        // A sanitizer build of the relay reports on stderr when it finds something (TSan and
        // UBSan keep running; the exit code says so only at a clean exit, and most tests end
        // the relay with SIGKILL here).
        for (const char* report : {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                                   "WARNING: ThreadSanitizer", "runtime error: "}) {
            EXPECT_EQ(log.find(report), std::string::npos)
                << "zcrelay's sanitizer reported (" << report << "):\n"
                << log;
        }
    }
}

::testing::AssertionResult RelayProcess::start(const RelayConfig& config) {
    if (dir_.path().empty()) return ::testing::AssertionFailure() << "mkdtemp failed";
    config_path_ = dir_.writeFile("zcrelay.yaml", config.yaml());
    return launch({"-c", config_path_});
}

::testing::AssertionResult RelayProcess::startWithArgs(const std::vector<std::string>& args) {
    if (dir_.path().empty()) return ::testing::AssertionFailure() << "mkdtemp failed";
    return launch(args);
}

::testing::AssertionResult RelayProcess::launch(const std::vector<std::string>& args) {
    if (child_.pid() > 0) return ::testing::AssertionFailure() << "RelayProcess started twice";
    if (std::string refusal = relayRefusal(); !refusal.empty())
        return ::testing::AssertionFailure() << refusal;
    stderr_path_ = dir_.file("stderr.log");
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0)
        return ::testing::AssertionFailure() << "pipe2: " << std::strerror(errno);
    stdout_read_.reset(p[0]);
    Fd write_end(p[1]);

    ChildProcess::Options opts;
    opts.argv = launch_prefix_;
    opts.argv.push_back(kRelayBinary);
    opts.argv.insert(opts.argv.end(), args.begin(), args.end());
    opts.stdout_fd = write_end.get();
    opts.stderr_path = stderr_path_;
    opts.nofile_limit = nofile_limit_;
    std::string error;
    if (!child_.spawn(opts, error))
        return ::testing::AssertionFailure() << "could not start " << kRelayBinary << ": " << error;
    write_end.reset();  // the child holds the only write end now: EOF when it exits
    stdout_thread_ = std::thread([this] { drainStdout(); });

    // Wait for the ready line, the child's death, or the deadline.
    auto deadline = Clock::now() + kReadyTimeout;
    for (;;) {
        {
            std::unique_lock lock(out_mu_);
            out_cv_.wait_for(lock, Millis{50}, [&] {
                return stdout_.find("zcrelay: ready\n") != std::string::npos || stdout_eof_;
            });
            if (stdout_.find("zcrelay: ready\n") != std::string::npos) break;
        }
        if (!child_.running()) {
            child_.waitExit(Millis{1'000});
            return ::testing::AssertionFailure()
                   << "zcrelay exited before printing \"zcrelay: ready\"\n"
                   << diagnostics();
        }
        if (Clock::now() >= deadline) {
            return ::testing::AssertionFailure()
                   << "zcrelay did not print \"zcrelay: ready\" within " << kReadyTimeout.count()
                   << " ms\n"
                   << diagnostics();
        }
    }
    if (!parseReadyOutput(error))
        return ::testing::AssertionFailure() << error << "\n" << diagnostics();
    return ::testing::AssertionSuccess();
}

void RelayProcess::drainStdout() {
    // A pipe, not a socket: poll + read(2). Ends at EOF (the child exited) or when told to stop.
    char buf[4096];
    for (;;) {
        ssize_t n = 0;
        if (stop_stdout_.load()) {
            n = 0;
        } else {
            pollfd p{stdout_read_.get(), POLLIN, 0};
            int r = ::poll(&p, 1, 100);
            if (r == 0 || (r < 0 && errno == EINTR)) continue;
            n = r < 0 ? -1 : ::read(stdout_read_.get(), buf, sizeof buf);
            if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        }
        std::lock_guard lock(out_mu_);
        if (n > 0) {
            // Keep the head (the startup lines) and a bounded amount after it.
            if (stdout_.size() < (1 << 20)) stdout_.append(buf, static_cast<size_t>(n));
        } else {
            stdout_eof_ = true;
        }
        out_cv_.notify_all();
        if (n <= 0) return;
    }
}

::testing::AssertionResult RelayProcess::reload(const std::string& yaml, bool expect_success) {
    auto count = [&](const char* result) {
        return metric(metric::kConfigReloadsTotal, {{"result", result}}).value_or(-1);
    };
    double ok = count("success"), failed = count("failure");
    if (ok < 0 || failed < 0)
        return ::testing::AssertionFailure() << "no zcrelay_config_reloads_total before reload";
    dir_.writeFile("zcrelay.yaml", yaml);
    if (!sendSignal(SIGHUP)) return ::testing::AssertionFailure() << "SIGHUP failed";
    bool done = waitUntil([&] { return count("success") > ok || count("failure") > failed; },
                          kMetricTimeout);
    if (!done) return ::testing::AssertionFailure() << "reload not counted\n" << diagnostics();
    bool succeeded = count("success") > ok;
    if (succeeded) {
        // The listener lines of this reload end at its "zcrelay: reloaded" line.
        std::string text;
        const std::string marker = "zcrelay: reloaded\n";
        bool printed = waitUntil(
            [&] {
                text = stdoutText();
                size_t n = 0;
                for (size_t at = text.find(marker); at != std::string::npos;
                     at = text.find(marker, at + 1))
                    ++n;
                return n >= static_cast<size_t>(ok) + 1;
            },
            kMetricTimeout);
        if (!printed) return ::testing::AssertionFailure() << "no reloaded line\n" << diagnostics();
        size_t end = text.rfind(marker);
        size_t prev = end == 0 ? std::string::npos : text.rfind(marker, end - 1);
        size_t ready = text.find("zcrelay: ready\n");
        size_t begin = prev != std::string::npos ? prev + marker.size()
                                                 : (ready != std::string::npos ? ready : 0);
        std::string error;
        listeners_.clear();
        if (!parseListenerLines(text.substr(begin, end - begin), error))
            return ::testing::AssertionFailure() << error << "\n" << diagnostics();
    }
    if (succeeded != expect_success) {
        return ::testing::AssertionFailure()
               << "reload " << (succeeded ? "succeeded" : "was refused") << "\n"
               << diagnostics();
    }
    return ::testing::AssertionSuccess();
}

bool RelayProcess::parseListenerLines(const std::string& text, std::string& error) {
    static const std::regex kListenerLine(
        R"(^zcrelay: listener (\S+) listening on (\S+) -> (.+) \(mode (\w+)\)$)");
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
        std::smatch m;
        if (!std::regex_match(line, m, kListenerLine)) continue;
        ListenerInfo info;
        info.name = m[1];
        info.upstream = m[3];
        info.mode = m[4];
        if (!splitHostPort(m[2], info.host, info.port)) {
            error = "cannot parse the listen address in: " + line;
            return false;
        }
        listeners_.push_back(info);
    }
    return true;
}

bool RelayProcess::parseReadyOutput(std::string& error) {
    static const std::regex kMetricsLine(R"(^zcrelay: metrics on http://(\S+)/metrics$)");
    std::string text = stdoutText();
    text = text.substr(0, text.find("zcrelay: ready\n"));
    if (!parseListenerLines(text, error)) return false;
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
        std::smatch m;
        if (std::regex_match(line, m, kMetricsLine) &&
            !splitHostPort(m[1], metrics_host_, metrics_port_)) {
            error = "cannot parse the metrics address in: " + line;
            return false;
        }
    }
    if (listeners_.empty()) {
        error =
            "no \"zcrelay: listener NAME listening on ADDR -> UPSTREAM (mode M)\" line before "
            "ready";
        return false;
    }
    return true;
}

const ListenerInfo* RelayProcess::listener(const std::string& name) const {
    for (const auto& l : listeners_) {
        if (name.empty() || l.name == name) return &l;
    }
    return nullptr;
}

uint16_t RelayProcess::port(const std::string& name) const {
    const ListenerInfo* l = listener(name);
    return l != nullptr ? l->port : 0;
}

std::string RelayProcess::host(const std::string& name) const {
    const ListenerInfo* l = listener(name);
    return l != nullptr ? l->host : "";
}

std::optional<HttpResponse> RelayProcess::get(const std::string& path, std::string* error) const {
    auto fail = [&](const std::string& e) -> std::optional<HttpResponse> {
        if (error != nullptr) *error = e;
        return std::nullopt;
    };
    if (metrics_port_ == 0) return fail("no metrics port was printed");
    Connected c = connectTo(metrics_host_, metrics_port_, Millis{2'000});
    if (!c.fd) return fail("metrics " + c.error);
    std::string req = "GET " + path + " HTTP/1.0\r\nHost: " + metrics_host_ + "\r\n\r\n";
    IoResult w = writeAll(c.fd.get(), req.data(), req.size(), Millis{2'000});
    if (!w.ok()) return fail(path + " request: " + w.describe());
    std::string resp;
    IoResult r = readUntilEof(c.fd.get(), resp, Millis{5'000});
    if (r.status != IoStatus::Eof) return fail(path + " response: " + r.describe());
    size_t hdr_end = resp.find("\r\n\r\n");
    if (hdr_end == std::string::npos) return fail(path + " response has no header end");
    HttpResponse out;
    std::string status_line = resp.substr(0, resp.find("\r\n"));
    size_t sp = status_line.find(' ');
    out.status = sp == std::string::npos ? 0 : std::atoi(status_line.c_str() + sp + 1);
    std::string headers = resp.substr(0, hdr_end);
    out.body = resp.substr(hdr_end + 4);
    std::string lower;
    for (char ch : headers)
        lower += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (lower.find("transfer-encoding: chunked") != std::string::npos)
        out.body = decodeChunked(out.body);
    return out;
}

std::optional<HttpResponse> httpRequest(const std::string& host, uint16_t port,
                                        const std::string& method, const std::string& path,
                                        const std::string& body, const std::string& headers,
                                        std::string* error) {
    auto fail = [&](const std::string& e) -> std::optional<HttpResponse> {
        if (error != nullptr) *error = e;
        return std::nullopt;
    };
    Connected c = connectTo(host, port, Millis{2'000});
    if (!c.fd) return fail(method + " " + path + ": " + c.error);
    std::string req = method + " " + path + " HTTP/1.0\r\nHost: " + host + "\r\n" + headers;
    if (!body.empty()) req += "Content-Length: " + std::to_string(body.size()) + "\r\n";
    req += "\r\n" + body;
    IoResult w = writeAll(c.fd.get(), req.data(), req.size(), Millis{2'000});
    // A server may answer (413) and close before it took the whole body: read the answer anyway.
    if (!w.ok() && w.status != IoStatus::Reset)
        return fail(method + " " + path + " request: " + w.describe());
    std::string resp;
    IoResult r = readUntilEof(c.fd.get(), resp, Millis{5'000});
    if (r.status != IoStatus::Eof && (r.status != IoStatus::Reset || resp.empty()))
        return fail(method + " " + path + " response: " + r.describe());
    const size_t hdr_end = resp.find("\r\n\r\n");
    if (hdr_end == std::string::npos)
        return fail(method + " " + path + " response has no header end: " + resp.substr(0, 200));
    HttpResponse out;
    const std::string status_line = resp.substr(0, resp.find("\r\n"));
    const size_t sp = status_line.find(' ');
    out.status = sp == std::string::npos ? 0 : std::atoi(status_line.c_str() + sp + 1);
    out.body = resp.substr(hdr_end + 4);
    return out;
}

std::optional<std::string> RelayProcess::scrape(std::string* error) const {
    auto r = get("/metrics", error);
    if (!r) return std::nullopt;
    if (r->status != 200) {
        if (error != nullptr) *error = "metrics status: " + std::to_string(r->status);
        return std::nullopt;
    }
    return r->body;
}

std::optional<double> RelayProcess::metric(const std::string& name, const Labels& labels) const {
    auto body = scrape();
    if (!body) return std::nullopt;
    return findSample(*body, name, labels);
}

::testing::AssertionResult RelayProcess::waitForMetric(const std::string& name,
                                                       const Labels& labels,
                                                       const std::function<bool(double)>& predicate,
                                                       const std::string& expectation,
                                                       Millis timeout) const {
    auto deadline = Clock::now() + timeout;
    std::optional<double> last;
    std::string last_body;
    std::string last_error;
    for (;;) {
        std::string err;
        auto body = scrape(&err);
        if (body) {
            last_body = *body;
            last = findSample(*body, name, labels);
            if (last && predicate(*last)) return ::testing::AssertionSuccess();
        } else {
            last_error = err;
        }
        if (Clock::now() >= deadline) break;
        std::this_thread::sleep_for(Millis{20});
    }
    auto f = ::testing::AssertionFailure();
    f << formatSeries(name, labels) << ": expected " << expectation << " within " << timeout.count()
      << " ms; ";
    if (last)
        f << "last value " << *last;
    else
        f << "the sample was absent";
    if (!last_error.empty()) f << "; last scrape error: " << last_error;
    // The family's lines from the last good scrape, to see what the relay did export.
    std::istringstream in(last_body);
    std::string line;
    std::string family_lines;
    while (std::getline(in, line)) {
        if (line.rfind(name, 0) == 0) family_lines += "\n  " + line;
    }
    if (!family_lines.empty()) f << "\nexported:" << family_lines;
    return f;
}

::testing::AssertionResult RelayProcess::waitForMetric(const std::string& name,
                                                       const Labels& labels, double expected,
                                                       Millis timeout) const {
    std::ostringstream what;
    what.precision(17);
    what << "== " << expected;
    return waitForMetric(
        name, labels, [expected](double v) { return v == expected; }, what.str(), timeout);
}

std::optional<int> RelayProcess::threadCount() const {
    if (pid() <= 0) return std::nullopt;
    auto v = procStatusField(pid(), "Threads");
    if (!v) return std::nullopt;
    return std::atoi(v->c_str());
}

std::optional<long> RelayProcess::rssKiB() const {
    if (pid() <= 0) return std::nullopt;
    auto v = procStatusField(pid(), "VmRSS");
    if (!v) return std::nullopt;
    return std::atol(v->c_str());  // "   12345 kB"
}

std::optional<int> RelayProcess::openFdCount() const {
    if (pid() <= 0) return std::nullopt;
    std::string path = "/proc/" + std::to_string(pid()) + "/fd";
    DIR* d = ::opendir(path.c_str());
    if (d == nullptr) return std::nullopt;
    int n = 0;
    while (dirent* e = ::readdir(d)) {
        if (e->d_name[0] != '.') ++n;
    }
    ::closedir(d);
    return n;
}

::testing::AssertionResult RelayProcess::waitForLog(const std::string& text, Millis timeout) const {
    if (waitUntil([&] { return stderrText().find(text) != std::string::npos; }, timeout))
        return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "the log never said \"" << text << "\" within " << timeout.count() << " ms:\n"
           << stderrText();
}

ExitStatus RelayProcess::terminate(Millis timeout) {
    if (auto s = child_.status()) return *s;
    sendSignal(SIGTERM);
    auto s = child_.waitExit(timeout);
    if (s) return *s;
    ExitStatus killed = child_.killAndWait();
    ADD_FAILURE() << "zcrelay (pid " << pid() << ") did not exit within " << timeout.count()
                  << " ms of SIGTERM; SIGKILLed it\n"
                  << diagnostics();
    return killed;
}

std::string RelayProcess::stdoutText() const {
    std::lock_guard lock(out_mu_);
    return stdout_;
}

std::string RelayProcess::diagnostics() const {
    std::ostringstream os;
    os << "--- zcrelay pid " << pid() << ", binary " << kRelayBinary;
    if (!launch_prefix_.empty()) {
        os << ", launched through";
        for (const std::string& a : launch_prefix_) os << " " << a;
    }
    if (!config_path_.empty()) os << ", config " << config_path_;
    if (auto s = child_.status()) os << ", " << s->describe();
    os << "\n";
    if (!config_path_.empty()) os << "--- config ---\n" << readFileText(config_path_, 16384);
    os << "--- stdout ---\n"
       << stdoutText() << "\n--- stderr (tail) ---\n"
       << fileTail(stderr_path_, 8192) << "\n---";
    return os.str();
}

uint16_t startIperf3Server(ChildProcess& server, const TempDir& dir) {
    auto iperf3 = findExecutable("iperf3");
    if (!iperf3) {
        ADD_FAILURE() << "iperf3 is not installed (deploy/install-deps.sh installs it)";
        return 0;
    }
    const std::string err_path = dir.file("iperf3-server.err");
    uint16_t server_port = 0;
    EXPECT_TRUE(startOnFreeLoopbackPort(AF_INET, [&](uint16_t port, std::string& why) {
        ChildProcess::Options o;
        o.argv = {*iperf3, "-s", "-B", "127.0.0.1", "-p", std::to_string(port)};
        o.stdout_path = dir.file("iperf3-server.out");
        o.stderr_path = err_path;
        if (!server.spawn(o, why)) return PortLaunch::Failed;
        if (waitUntil([&] { return listensOnLoopback4(port); }, Millis{5'000})) {
            server_port = port;
            return PortLaunch::Up;
        }
        why = "iperf3 -s never listened: " + readFileText(err_path);
        server.killAndWait();
        return PortLaunch::Retry;
    }));
    return server_port;
}

}  // namespace zcrelay::test
