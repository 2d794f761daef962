// pingpong: request/response latency over one TCP connection, for comparing the relay's data
// paths on small messages (where a bulk rate says nothing).
//
//   pingpong server --listen 127.0.0.1:PORT [--size B (64)] [--seconds N (3600)]
//   pingpong client --connect 127.0.0.1:PORT [--size B (64)] [--iters N (20000)]
//                   [--warmup W (1000)] [--timeout-ms MS (5000)] [--conns N (1)]
//
// The client writes B bytes, blocks until the B-byte answer is back, and repeats: W round trips
// to warm caches, the relay's buffers and the TCP state, then N timed ones. Each round trip is
// timed alone with CLOCK_MONOTONIC (before write, after the last byte read), so the percentiles
// are of single round trips, not of averages. Blocking sockets with TCP_NODELAY on both ends:
// every request leaves at once and every wait is a real sleep and wake-up, which is the cost a
// relay adds per hop. The first 8 bytes of each request carry its sequence number and the client
// checks the answer byte for byte, so a stale, duplicated or corrupted answer is an error, not a
// fast sample.
//
// Server: one thread and epoll for all connections; echoes what arrives as it arrives (each
// connection has one request in flight, so that is the answer). Prints the bound port alone on
// the first stdout line (flushed; port 0 = let the kernel pick). Exits 0 after --seconds or on
// SIGTERM/SIGINT, so a forgotten instance cannot linger.
//
// With --conns N > 1, N connections do the same at once from one thread with epoll and
// nonblocking sockets (a thread each would spend the load's CPU on context switches, a switch
// per round trip, and make that CPU the limit rather than the relay); their timed phases start
// together once all have warmed up. The percentiles are over all their round trips and
// req_per_s is the total timed round trips over the span of the timed phase.
//
// Client output: one JSON line on stdout,
//   {"conns":N,"iters":I,"size":B,"req_per_s":..,"p50_us":..,"p99_us":..,"p999_us":..,
//    "max_us":..,"mean_us":..}
// Exit 0 if all N + W round trips completed and matched, 1 otherwise (the reason on stderr),
// 2 on bad arguments.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
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

#include "bench_util.hpp"

namespace {

constexpr size_t kDefaultSize = 64;
constexpr size_t kMaxSize = 64 * 1024;
constexpr long kDefaultIters = 20000;
constexpr long kDefaultWarmup = 1000;
constexpr long kDefaultTimeoutMs = 5000;
constexpr int kDefaultServerSeconds = 3600;
constexpr int kPollMs = 200;  // how often the server checks its lifetime and the stop flag

volatile sig_atomic_t g_stop = 0;
void onSignal(int) { g_stop = 1; }

using bench::nowNs;

using bench::parseAddr;

void noDelay(int fd) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// 1 = got all n bytes, 0 = EOF before the first byte, -1 = error, timeout or EOF mid-message.
int readExact(int fd, unsigned char* p, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = ::recv(fd, p + got, n - got, 0);
        if (r > 0) {
            got += static_cast<size_t>(r);
        } else if (r == 0) {
            return got == 0 ? 0 : -1;
        } else if (errno != EINTR) {
            return -1;
        }
    }
    return 1;
}

bool writeAll(int fd, const unsigned char* p, size_t n) {
    size_t put = 0;
    while (put < n) {
        ssize_t w = ::send(fd, p + put, n - put, MSG_NOSIGNAL);
        if (w > 0) {
            put += static_cast<size_t>(w);
        } else if (w < 0 && errno != EINTR) {
            return false;
        }
    }
    return true;
}

// ---------------------------------------------------------------- server

// One thread and epoll for every connection: a thread per connection would put a context
// switch on the load's CPU for every request, and with 100 connections that, not the relay,
// is what the load CPU spends its time on. Each connection has at most one request in flight,
// so echoing whatever arrives, as it arrives, answers it byte for byte.
struct EchoConn {
    std::vector<unsigned char> pending;  // read but not yet written back (the send buffer filled)
    bool want_out = false;               // registered for EPOLLOUT instead of EPOLLIN
};

int runServer(const sockaddr_in& addr, size_t size, int seconds) {
    int ep = ::epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) {
        std::perror("pingpong server: epoll_create1");
        return 2;
    }
    int lfd = bench::listenAndAnnounce("pingpong", addr, SOCK_NONBLOCK);
    if (lfd < 0) return 2;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = lfd;
    ::epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    std::unordered_map<int, EchoConn> conns;
    std::vector<unsigned char> buf(std::max<size_t>(size, 64 * 1024));
    auto drop = [&](int fd) {
        ::close(fd);  // also leaves the epoll set
        conns.erase(fd);
    };
    // Writes what is pending; true while the connection is usable.
    auto flush = [&](int fd, EchoConn& c) {
        while (!c.pending.empty()) {
            ssize_t w = ::send(fd, c.pending.data(), c.pending.size(), MSG_NOSIGNAL);
            if (w < 0) return errno == EAGAIN || errno == EINTR;
            c.pending.erase(c.pending.begin(), c.pending.begin() + w);
        }
        return true;
    };
    const int64_t end = nowNs() + int64_t{seconds} * 1'000'000'000;
    epoll_event events[256];
    while (!g_stop && nowNs() < end) {
        int n = ::epoll_wait(ep, events, 256, kPollMs);
        for (int i = 0; i < n; ++i) {
            int fd = events[i].data.fd;
            if (fd == lfd) {
                int c;
                while ((c = ::accept4(lfd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
                    noDelay(c);
                    epoll_event cev{};
                    cev.events = EPOLLIN;
                    cev.data.fd = c;
                    ::epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev);
                    conns[c];
                }
                continue;
            }
            auto it = conns.find(fd);
            if (it == conns.end()) continue;
            EchoConn& c = it->second;
            if (!flush(fd, c)) {
                drop(fd);
                continue;
            }
            if (c.pending.empty()) {
                ssize_t r = ::recv(fd, buf.data(), buf.size(), 0);
                if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                    drop(fd);
                    continue;
                }
                if (r > 0) c.pending.assign(buf.begin(), buf.begin() + r);
                if (!flush(fd, c)) {
                    drop(fd);
                    continue;
                }
            }
            // Waiting to write: stop reading until the answer is out (one request in flight).
            if (c.want_out != !c.pending.empty()) {
                c.want_out = !c.pending.empty();
                epoll_event cev{};
                cev.events = c.want_out ? EPOLLOUT : EPOLLIN;
                cev.data.fd = fd;
                ::epoll_ctl(ep, EPOLL_CTL_MOD, fd, &cev);
            }
        }
    }
    for (auto& [fd, c] : conns) ::close(fd);
    ::close(lfd);
    ::close(ep);
    return 0;
}

// ---------------------------------------------------------------- client

double percentileUs(const std::vector<int64_t>& sorted, double q) {
    size_t rank = static_cast<size_t>(q * static_cast<double>(sorted.size()));
    rank = std::min(rank, sorted.size() - 1);
    return static_cast<double>(sorted[rank]) / 1e3;
}

// A request's bytes before its sequence number is stamped in.
std::vector<unsigned char> requestBytes(size_t size) {
    std::vector<unsigned char> req(size);
    for (size_t i = 0; i < size; ++i) req[i] = static_cast<unsigned char>('a' + i % 26);
    return req;
}

// Request `i`: its sequence number in the first 8 bytes (or as many as fit), so a stale or
// duplicated answer does not match.
void stampRequest(std::vector<unsigned char>& req, long i) {
    uint64_t seq = static_cast<uint64_t>(i);
    std::memcpy(req.data(), &seq, std::min(req.size(), sizeof seq));
}

// The client's JSON line; `rtt_ns` is sorted in place.
void printResult(int conns, long iters, size_t size, std::vector<int64_t>& rtt_ns,
                 int64_t t0, int64_t t1) {
    double sum = 0;
    for (int64_t v : rtt_ns) sum += static_cast<double>(v);
    std::sort(rtt_ns.begin(), rtt_ns.end());
    std::printf(
        "{\"conns\":%d,\"iters\":%ld,\"size\":%zu,\"req_per_s\":%.0f,\"p50_us\":%.1f,"
        "\"p99_us\":%.1f,\"p999_us\":%.1f,\"max_us\":%.1f,\"mean_us\":%.2f}\n",
        conns, iters, size, static_cast<double>(rtt_ns.size()) * 1e9 / static_cast<double>(t1 - t0),
        percentileUs(rtt_ns, 0.50), percentileUs(rtt_ns, 0.99), percentileUs(rtt_ns, 0.999),
        percentileUs(rtt_ns, 1.0), sum / static_cast<double>(rtt_ns.size()) / 1e3);
}

// One connection's round trips with blocking sockets: `warmup` untimed, then `iters` timed into
// `rtt_ns`, the timed phase from `start_ns` to `end_ns`. false with `error` set on failure.
bool pingConn(const sockaddr_in& addr, size_t size, long iters, long warmup, long timeout_ms,
              std::vector<int64_t>& rtt_ns, int64_t& start_ns, int64_t& end_ns,
              std::string& error) {
    auto fail = [&](const char* what, long i) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s %ld: %s", what, i, std::strerror(errno));
        error = buf;
        return false;
    };
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return fail("socket", 0);
    // A stalled relay must fail the run, not hang it: every blocking call is bounded.
    timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) < 0) {
        bool r = fail("connect", 0);
        ::close(fd);
        return r;
    }
    noDelay(fd);

    std::vector<unsigned char> req = requestBytes(size), resp(size);
    rtt_ns.reserve(static_cast<size_t>(iters));
    bool ok = true;
    for (long i = 0; i < warmup + iters && ok; ++i) {
        if (i == warmup) start_ns = nowNs();
        stampRequest(req, i);
        const int64_t t0 = nowNs();
        if (!writeAll(fd, req.data(), size)) {
            ok = fail("write", i);
            break;
        }
        int r = readExact(fd, resp.data(), size);
        const int64_t t1 = nowNs();
        if (r != 1) {
            if (r == 0) errno = ECONNRESET;
            ok = fail(r == 0 ? "read (EOF)" : "read", i);
            break;
        }
        if (std::memcmp(req.data(), resp.data(), size) != 0) {
            error = "answer " + std::to_string(i) + " does not match its request";
            ok = false;
            break;
        }
        if (i >= warmup) rtt_ns.push_back(t1 - t0);
    }
    end_ns = nowNs();
    ::close(fd);
    return ok;
}

// N connections on one thread with epoll. Blocking threads would cost the load's CPU a context
// switch per round trip and make that CPU, not the relay, the limit. Each connection has one
// request in flight. When a connection finishes its warm-up it waits for the others; the timed
// phase starts for all at once. Reads and writes are nonblocking; a request of up to 64 KiB
// into an empty send buffer goes out whole, and anything else is an error, not a slow sample.
struct PingConn {
    int fd = -1;
    long i = 0;       // round trip in progress (warm-up ones first)
    size_t got = 0;   // bytes of its answer received
    int64_t t0 = 0;   // when its request was written
};

bool sendRequest(PingConn& c, std::vector<unsigned char>& req, std::string& error) {
    stampRequest(req, c.i);
    c.got = 0;
    c.t0 = nowNs();
    ssize_t w = ::send(c.fd, req.data(), req.size(), MSG_NOSIGNAL);
    if (w == static_cast<ssize_t>(req.size())) return true;
    error = "write " + std::to_string(c.i) + (w < 0 ? ": " + std::string(std::strerror(errno))
                                                    : ": short write");
    return false;
}

int runClientEvents(const sockaddr_in& addr, size_t size, long iters, long warmup,
                    long timeout_ms, int conns) {
    auto fail = [](const std::string& what) {
        std::fprintf(stderr, "pingpong client: %s\n", what.c_str());
        return 1;
    };
    int ep = ::epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) return fail(std::string("epoll_create1: ") + std::strerror(errno));
    std::vector<PingConn> pc(static_cast<size_t>(conns));
    for (int k = 0; k < conns; ++k) {
        PingConn& c = pc[static_cast<size_t>(k)];
        c.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        // Connect blocking (bounded by SO_SNDTIMEO), then switch to nonblocking.
        timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
        ::setsockopt(c.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (c.fd < 0 || ::connect(c.fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) < 0)
            return fail("connection " + std::to_string(k) + ": connect: " + std::strerror(errno));
        noDelay(c.fd);
        ::fcntl(c.fd, F_SETFL, ::fcntl(c.fd, F_GETFL) | O_NONBLOCK);
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u32 = static_cast<uint32_t>(k);
        ::epoll_ctl(ep, EPOLL_CTL_ADD, c.fd, &ev);
    }
    std::vector<unsigned char> req = requestBytes(size);
    std::vector<int64_t> rtt_ns;
    rtt_ns.reserve(static_cast<size_t>(iters) * static_cast<size_t>(conns));
    std::vector<std::vector<unsigned char>> answers(static_cast<size_t>(conns),
                                                    std::vector<unsigned char>(size));
    std::string error;
    int warmed = 0, done = 0;
    int64_t start_ns = 0;
    auto startTimed = [&] {
        start_ns = nowNs();
        for (PingConn& c : pc)
            if (!sendRequest(c, req, error)) return false;
        return true;
    };
    if (warmup == 0) {
        warmed = conns;
        if (!startTimed()) return fail(error);
    } else {
        for (PingConn& c : pc)
            if (!sendRequest(c, req, error)) return fail(error);
    }
    epoll_event events[256];
    while (done < conns) {
        int n = ::epoll_wait(ep, events, 256, static_cast<int>(timeout_ms));
        if (n == 0) return fail("no answer within " + std::to_string(timeout_ms) + " ms");
        if (n < 0) {
            if (errno == EINTR) continue;
            return fail(std::string("epoll_wait: ") + std::strerror(errno));
        }
        for (int e = 0; e < n; ++e) {
            size_t k = events[e].data.u32;
            PingConn& c = pc[k];
            std::vector<unsigned char>& a = answers[k];
            ssize_t r = ::recv(c.fd, a.data() + c.got, size - c.got, 0);
            if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (r <= 0)
                return fail("connection " + std::to_string(k) + ": read " + std::to_string(c.i) +
                            (r == 0 ? ": EOF" : ": " + std::string(std::strerror(errno))));
            c.got += static_cast<size_t>(r);
            if (c.got < size) continue;
            const int64_t t1 = nowNs();
            stampRequest(req, c.i);  // what this answer must echo
            if (std::memcmp(req.data(), a.data(), size) != 0)
                return fail("connection " + std::to_string(k) + ": answer " +
                            std::to_string(c.i) + " does not match its request");
            if (c.i >= warmup) rtt_ns.push_back(t1 - c.t0);
            ++c.i;
            if (c.i == warmup + iters) {
                ++done;
                continue;
            }
            if (c.i == warmup) {
                if (++warmed == conns && !startTimed()) return fail(error);
                continue;  // waits for the others to finish warming up
            }
            if (!sendRequest(c, req, error))
                return fail("connection " + std::to_string(k) + ": " + error);
        }
    }
    const int64_t end_ns = nowNs();
    for (PingConn& c : pc) ::close(c.fd);
    ::close(ep);
    printResult(conns, iters, size, rtt_ns, start_ns, end_ns);
    return 0;
}

int runClient(const sockaddr_in& addr, size_t size, long iters, long warmup, long timeout_ms,
              int conns) {
    if (conns > 1) return runClientEvents(addr, size, iters, warmup, timeout_ms, conns);
    std::vector<int64_t> rtt_ns;
    int64_t start_ns = 0, end_ns = 0;
    std::string error;
    if (!pingConn(addr, size, iters, warmup, timeout_ms, rtt_ns, start_ns, end_ns, error)) {
        std::fprintf(stderr, "pingpong client: %s\n", error.c_str());
        return 1;
    }
    printResult(1, iters, size, rtt_ns, start_ns, end_ns);
    return 0;
}

[[noreturn]] void usage(int code) {
    std::fprintf(
        code ? stderr : stdout,
        "usage: pingpong server --listen 127.0.0.1:PORT [--size B (%zu)] [--seconds N "
        "(%d)]\n"
        "       pingpong client --connect 127.0.0.1:PORT [--size B (%zu)] [--iters N "
        "(%ld)]\n"
        "                       [--warmup W (%ld)] [--timeout-ms MS (%ld)] [--conns N (1)]\n",
        kDefaultSize, kDefaultServerSeconds, kDefaultSize, kDefaultIters, kDefaultWarmup,
        kDefaultTimeoutMs);
    std::exit(code);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) usage(2);
    std::string_view role = argv[1];
    if (role != "server" && role != "client") usage(role == "-h" || role == "--help" ? 0 : 2);
    const bool server = role == "server";

    sockaddr_in addr{};
    bool have_addr = false;
    long size = kDefaultSize, iters = kDefaultIters, warmup = kDefaultWarmup;
    long timeout_ms = kDefaultTimeoutMs, seconds = kDefaultServerSeconds, conns = 1;
    for (int i = 2; i < argc; ++i) {
        std::string_view a = argv[i];
        auto value = [&]() -> const char* {
            if (i + 1 >= argc) usage(2);
            return argv[++i];
        };
        if (a == (server ? "--listen" : "--connect")) {
            have_addr = parseAddr(value(), addr);
            if (!have_addr) usage(2);
        } else if (a == "--size") {
            size = std::strtol(value(), nullptr, 10);
        } else if (!server && a == "--iters") {
            iters = std::strtol(value(), nullptr, 10);
        } else if (!server && a == "--warmup") {
            warmup = std::strtol(value(), nullptr, 10);
        } else if (!server && a == "--conns") {
            conns = std::strtol(value(), nullptr, 10);
        } else if (!server && a == "--timeout-ms") {
            timeout_ms = std::strtol(value(), nullptr, 10);
        } else if (server && a == "--seconds") {
            seconds = std::strtol(value(), nullptr, 10);
        } else {
            usage(a == "-h" || a == "--help" ? 0 : 2);
        }
    }
    if (!have_addr || size < 1 || static_cast<size_t>(size) > kMaxSize || iters < 1 ||
        iters > 100'000'000 || warmup < 0 || timeout_ms < 1 || seconds < 1 || conns < 1 ||
        conns > 1000)
        usage(2);
    if (!server && addr.sin_port == 0) usage(2);
    ::signal(SIGPIPE, SIG_IGN);

    if (server) {
        struct sigaction sa {};
        sa.sa_handler = onSignal;  // no SA_RESTART: poll() returns EINTR and the loop sees it
        ::sigaction(SIGTERM, &sa, nullptr);
        ::sigaction(SIGINT, &sa, nullptr);
        return runServer(addr, static_cast<size_t>(size), static_cast<int>(seconds));
    }
    return runClient(addr, static_cast<size_t>(size), iters, warmup, timeout_ms,
                     static_cast<int>(conns));
}
