// echo_server: a minimal single-threaded epoll echo server on loopback (127.0.0.1 unless
// --addr), used as the upstream of the relay in the bench scripts.
//
//   echo_server [--port PORT (0 = let the kernel pick)] [--seconds N (600)] [--close-after BYTES]
//               [--addr A.B.C.D (127.0.0.1)] [--events FILE]
//
// Prints the bound port alone on the first line of stdout (flushed), so a script can read it.
// --addr listens on another loopback address (127.0.0.0/8 is all local on Linux), so several
// backends can share one port, as the addresses of a DNS name do (bench/discovery.sh).
// --events FILE: on exit, writes one line per accepted and per closed connection,
// "<CLOCK_REALTIME ns> +" or "<ns> -", in the order they happened (at most 4M lines; kept in
// memory until then, so the hot path is a push_back), for the backend's own view of its
// connections over time.
// Echoes every byte back; when the peer half-closes, finishes sending what is pending and closes.
// With --close-after BYTES the server half-closes first, once it has echoed that many bytes on a
// connection, as a server that closes after its response does. That decides who holds TIME_WAIT:
// the side that sends the first FIN. When the relay's upstream socket sends it (it forwards the
// client's close), every TIME_WAIT lands on the relay's own ephemeral ports toward this one
// ip:port, and past ~14k conn/s the relay's connect() spends its time hunting for a port that
// net.ipv4.tcp_tw_reuse_delay (1 s) lets it reuse. Closing here first moves TIME_WAIT to the
// listening side, where it does not block anyone's port choice.
// Exits 0 after --seconds or on SIGTERM/SIGINT, so a forgotten instance cannot linger for ever.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace {

constexpr int kDefaultSeconds = 600;
constexpr int kPollMs = 200;  // how often the lifetime and the stop flag are checked
constexpr size_t kBufSize = 16 * 1024;
constexpr uint32_t kListenTag = UINT32_MAX;
constexpr size_t kMaxEvents = 4'000'000;

volatile sig_atomic_t g_stop = 0;

void onSignal(int) { g_stop = 1; }

// Bytes read but not yet written back (the peer's receive window was full).
struct Conn {
    std::string pending;
    bool peer_done = false;  // peer sent FIN; close once pending is flushed
    uint64_t echoed = 0;     // bytes handed to send()
    bool shut = false;       // we sent our FIN (--close-after)
    bool want_out = false;   // interest set is EPOLLOUT (flushing) rather than EPOLLIN
};

class EchoServer {
  public:
    EchoServer(uint64_t close_after, bool log_events)
        : close_after_(close_after), log_events_(log_events) {}

    bool open(in_addr_t addr, uint16_t port) {
        listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (listen_fd_ < 0) return perr("socket");
        int one = 1;
        // Successive bench runs reuse a fixed port while the last run's sockets sit in TIME_WAIT.
        ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(port);
        a.sin_addr.s_addr = addr;
        if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) < 0) return perr("bind");
        // Capped by net.core.somaxconn; connection-rate runs need a deep queue.
        if (::listen(listen_fd_, SOMAXCONN) < 0) return perr("listen");
        socklen_t len = sizeof a;
        if (::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) < 0)
            return perr("getsockname");
        port_ = ntohs(a.sin_port);
        ep_ = ::epoll_create1(EPOLL_CLOEXEC);
        if (ep_ < 0) return perr("epoll_create1");
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u32 = kListenTag;
        if (::epoll_ctl(ep_, EPOLL_CTL_ADD, listen_fd_, &ev) < 0) return perr("epoll_ctl");
        return true;
    }

    uint16_t port() const { return port_; }

    void run(int seconds) {
        timespec t0{};
        ::clock_gettime(CLOCK_MONOTONIC, &t0);
        epoll_event events[256];
        while (!g_stop) {
            timespec t{};
            ::clock_gettime(CLOCK_MONOTONIC, &t);
            if (t.tv_sec - t0.tv_sec >= seconds) break;
            int n = ::epoll_wait(ep_, events, 256, kPollMs);
            if (n < 0) {
                if (errno == EINTR) continue;
                perr("epoll_wait");
                return;
            }
            for (int k = 0; k < n; ++k) {
                if (events[k].data.u32 == kListenTag) {
                    acceptAll();
                } else {
                    serve(static_cast<int>(events[k].data.u32), events[k].events);
                }
            }
        }
    }

    // --events: "<ns> +" per accept, "<ns> -" per close. false if the file cannot be written.
    bool writeEvents(const char* path) const {
        FILE* f = std::fopen(path, "w");
        if (!f) return perr("events file");
        for (int64_t e : events_)
            std::fprintf(f, "%lld %c\n", static_cast<long long>(e < 0 ? -e : e), e < 0 ? '-' : '+');
        return std::fclose(f) == 0;
    }

  private:
    static bool perr(const char* what) {
        std::fprintf(stderr, "echo_server: %s: %s\n", what, std::strerror(errno));
        return false;
    }

    // An accept as +ns, a close as -ns (CLOCK_REALTIME: comparable with other processes' logs).
    void event(bool accepted) {
        if (!log_events_ || events_.size() >= kMaxEvents) return;
        timespec t{};
        ::clock_gettime(CLOCK_REALTIME, &t);
        int64_t ns = int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec;
        events_.push_back(accepted ? ns : -ns);
    }

    void acceptAll() {
        for (;;) {
            int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0) {
                // EAGAIN: queue drained. EMFILE and friends: leave the rest queued, retry on the
                // next wake-up rather than spin here.
                return;
            }
            int one = 1;
            ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            epoll_event ev{};
            ev.events = EPOLLIN | EPOLLRDHUP;
            ev.data.u32 = static_cast<uint32_t>(fd);
            if (::epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &ev) < 0) {
                ::close(fd);
                continue;
            }
            conns_[fd] = Conn{};
            event(true);
        }
    }

    void serve(int fd, uint32_t events) {
        auto it = conns_.find(fd);
        if (it == conns_.end()) return;
        Conn& c = it->second;
        if (events & EPOLLERR) return drop(fd);
        if ((events & EPOLLOUT) && !flush(fd, c)) return drop(fd);
        if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP)) {
            char buf[kBufSize];
            // Stop reading while a backlog waits: the peer must drain its echo first.
            while ((c.pending.empty() || c.shut) && !c.peer_done) {
                ssize_t r = ::recv(fd, buf, sizeof buf, 0);
                if (r > 0 && c.shut) continue;  // we are done talking; discard until the peer's FIN
                if (r > 0) {
                    c.echoed += static_cast<uint64_t>(r);
                    ssize_t w = ::send(fd, buf, static_cast<size_t>(r), MSG_NOSIGNAL);
                    if (w < 0 && errno != EAGAIN) return drop(fd);
                    if (w < r) c.pending.assign(buf + (w < 0 ? 0 : w), buf + r);
                } else if (r == 0) {
                    c.peer_done = true;
                } else if (errno == EAGAIN) {
                    break;
                } else {
                    return drop(fd);
                }
            }
        }
        if (close_after_ && !c.shut && c.pending.empty() && c.echoed >= close_after_) {
            ::shutdown(fd, SHUT_WR);
            c.shut = true;
        }
        if (c.peer_done && c.pending.empty()) return drop(fd);
        // Only touch the interest set when it changes: this shares CPU 0 with the load generator,
        // so a syscall per event would be charged to the relay's numbers.
        bool want_out = !c.pending.empty();
        if (want_out == c.want_out) return;
        c.want_out = want_out;
        epoll_event ev{};
        ev.events = want_out ? EPOLLOUT : (EPOLLIN | EPOLLRDHUP);
        ev.data.u32 = static_cast<uint32_t>(fd);
        ::epoll_ctl(ep_, EPOLL_CTL_MOD, fd, &ev);
    }

    static bool flush(int fd, Conn& c) {
        while (!c.pending.empty()) {
            ssize_t w = ::send(fd, c.pending.data(), c.pending.size(), MSG_NOSIGNAL);
            if (w < 0) return errno == EAGAIN;
            c.pending.erase(0, static_cast<size_t>(w));
        }
        return true;
    }

    void drop(int fd) {
        conns_.erase(fd);
        ::close(fd);
        event(false);
    }

    uint64_t close_after_ = 0;  // 0: never close first
    bool log_events_ = false;
    std::vector<int64_t> events_;
    int listen_fd_ = -1;
    int ep_ = -1;
    uint16_t port_ = 0;
    std::unordered_map<int, Conn> conns_;
};

[[noreturn]] void usage(int code) {
    std::fprintf(code ? stderr : stdout,
                 "usage: echo_server [--port PORT (0 = pick)] [--seconds N (%d)] [--close-after "
                 "BYTES (0 = never)]\n"
                 "                   [--addr A.B.C.D (127.0.0.1)] [--events FILE]\n",
                 kDefaultSeconds);
    std::exit(code);
}

}  // namespace

int main(int argc, char** argv) {
    long port = 0;
    long seconds = kDefaultSeconds;
    long close_after = 0;
    in_addr_t addr = htonl(INADDR_LOOPBACK);
    const char* events_path = nullptr;
    for (int i = 1; i < argc; ++i) {
        std::string_view a = argv[i];
        if ((a == "--port" || a == "--seconds" || a == "--close-after") && i + 1 < argc) {
            long v = std::strtol(argv[++i], nullptr, 10);
            (a == "--port" ? port : a == "--seconds" ? seconds : close_after) = v;
        } else if (a == "--addr" && i + 1 < argc) {
            in_addr parsed{};
            if (::inet_pton(AF_INET, argv[++i], &parsed) != 1) usage(2);
            addr = parsed.s_addr;
        } else if (a == "--events" && i + 1 < argc) {
            events_path = argv[++i];
        } else if (a == "-h" || a == "--help") {
            usage(0);
        } else {
            usage(2);
        }
    }
    if (port < 0 || port > 65535 || seconds < 1 || close_after < 0) usage(2);

    struct sigaction sa {};
    sa.sa_handler = onSignal;
    ::sigaction(SIGTERM, &sa, nullptr);
    ::sigaction(SIGINT, &sa, nullptr);
    ::signal(SIGPIPE, SIG_IGN);

    EchoServer server(static_cast<uint64_t>(close_after), events_path != nullptr);
    if (!server.open(addr, static_cast<uint16_t>(port))) return 1;
    std::printf("%u\n", server.port());
    std::fflush(stdout);
    server.run(static_cast<int>(seconds));
    if (events_path && !server.writeEvents(events_path)) return 1;
    return 0;
}
