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
// Server: reads exactly B bytes, writes them back, until EOF; one thread per connection. Prints
// the bound port alone on the first stdout line (flushed; port 0 = let the kernel pick). Exits 0
// after --seconds or on SIGTERM/SIGINT, so a forgotten instance cannot linger.
//
// With --conns N, N connections (one thread each) do the same at once, their timed phases
// started together; the percentiles are over all their round trips and req_per_s is the total
// timed round trips over the span from the first timed start to the last end.
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
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <string_view>
#include <thread>
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

void serveConn(int fd, size_t size) {
    noDelay(fd);
    std::vector<unsigned char> buf(size);
    while (readExact(fd, buf.data(), size) == 1 && writeAll(fd, buf.data(), size)) {
    }
    ::close(fd);
}

int runServer(const sockaddr_in& addr, size_t size, int seconds) {
    return bench::serveLoop("pingpong", addr, seconds, g_stop,
                            [size](int fd) { serveConn(fd, size); });
}

// ---------------------------------------------------------------- client

double percentileUs(const std::vector<int64_t>& sorted, double q) {
    size_t rank = static_cast<size_t>(q * static_cast<double>(sorted.size()));
    rank = std::min(rank, sorted.size() - 1);
    return static_cast<double>(sorted[rank]) / 1e3;
}

// One connection's round trips: `warmup` untimed, then `iters` timed into `rtt_ns`. Every
// connection waits at `timed` (a count of connections done warming up) so that the timed phases
// overlap and the aggregate rate is of all of them at once. false with `error` set on failure.
bool pingConn(const sockaddr_in& addr, size_t size, long iters, long warmup, long timeout_ms,
              std::atomic<int>& warmed, int conns, std::vector<int64_t>& rtt_ns, int64_t& start_ns,
              int64_t& end_ns, std::string& error) {
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

    std::vector<unsigned char> req(size), resp(size);
    for (size_t i = 0; i < size; ++i) req[i] = static_cast<unsigned char>('a' + i % 26);
    rtt_ns.reserve(static_cast<size_t>(iters));
    bool ok = true;
    for (long i = 0; i < warmup + iters && ok; ++i) {
        if (i == warmup) {
            // Bounded: a connection that never arrives fails the run after the timeout.
            warmed.fetch_add(1);
            const int64_t deadline = nowNs() + int64_t{timeout_ms} * 1'000'000;
            while (warmed.load() < conns && nowNs() < deadline) std::this_thread::yield();
            start_ns = nowNs();
        }
        // Sequence number in the first 8 bytes (or as many as fit).
        uint64_t seq = static_cast<uint64_t>(i);
        std::memcpy(req.data(), &seq, std::min(size, sizeof seq));
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
    if (!ok && warmed.load() < conns) warmed.fetch_add(1);  // do not hold the others back
    ::close(fd);
    return ok;
}

int runClient(const sockaddr_in& addr, size_t size, long iters, long warmup, long timeout_ms,
              int conns) {
    std::atomic<int> warmed{0};
    std::vector<std::vector<int64_t>> samples(static_cast<size_t>(conns));
    std::vector<int64_t> starts(static_cast<size_t>(conns)), ends(static_cast<size_t>(conns));
    std::vector<std::string> errors(static_cast<size_t>(conns));
    std::vector<char> oks(static_cast<size_t>(conns), 0);
    std::vector<std::thread> threads;
    for (int c = 0; c < conns; ++c) {
        threads.emplace_back([&, c] {
            size_t i = static_cast<size_t>(c);
            oks[i] = pingConn(addr, size, iters, warmup, timeout_ms, warmed, conns, samples[i],
                              starts[i], ends[i], errors[i]);
        });
    }
    for (auto& t : threads) t.join();
    for (int c = 0; c < conns; ++c) {
        if (!oks[static_cast<size_t>(c)]) {
            std::fprintf(stderr, "pingpong client: connection %d: %s\n", c,
                         errors[static_cast<size_t>(c)].c_str());
            return 1;
        }
    }
    std::vector<int64_t> rtt_ns;
    for (auto& v : samples) rtt_ns.insert(rtt_ns.end(), v.begin(), v.end());
    const int64_t t0 = *std::min_element(starts.begin(), starts.end());
    const int64_t t1 = *std::max_element(ends.begin(), ends.end());
    double sum = 0;
    for (int64_t v : rtt_ns) sum += static_cast<double>(v);
    std::sort(rtt_ns.begin(), rtt_ns.end());
    std::printf(
        "{\"conns\":%d,\"iters\":%ld,\"size\":%zu,\"req_per_s\":%.0f,\"p50_us\":%.1f,"
        "\"p99_us\":%.1f,\"p999_us\":%.1f,\"max_us\":%.1f,\"mean_us\":%.2f}\n",
        conns, iters, size, static_cast<double>(rtt_ns.size()) * 1e9 / static_cast<double>(t1 - t0),
        percentileUs(rtt_ns, 0.50), percentileUs(rtt_ns, 0.99), percentileUs(rtt_ns, 0.999),
        percentileUs(rtt_ns, 1.0), sum / static_cast<double>(rtt_ns.size()) / 1e3);
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
