// conn_rate: a connection-rate load generator for one TCP port on loopback.
//
// Keeps N connections in flight from one thread. Each connection is one short transaction:
//
//   Connecting --(connect done)--> write 64 B --> Reading --(64 B echoed)--> close, record latency
//        |                                           |
//        +--- refused / reset / EOF early / 2 s deadline --> close, count an error
//
// and every finished connection is replaced by a new one until the duration or the count cap is
// reached. Latency runs from just before connect() to the moment the last echoed byte is read,
// so it covers the handshake, the accept on the far side (through the relay: its accept, its
// upstream connect and both splices) and the echo.
//
// With --log FILE, every connection, ok or not, is also written there as one line
// "start end outcome" (CLOCK_MONOTONIC seconds; outcome 0 ok, 1 refused, 2 reset, 3 timeout,
// 4 other), for a bench that looks at when connections failed or paused (bench/upgrade.py).
// --start-at T waits until CLOCK_MONOTONIC T before the first connection.
//
// Output: one JSON line on stdout,
//   {"conns_per_s":..,"completed":..,"errors":..,"p50_us":..,"p99_us":..}
// with an error breakdown on stderr when there were errors. Exit 0 if it ran (errors or not),
// 2 on bad arguments or if it could not run at all.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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
#include <vector>

#include "bench_util.hpp"

namespace {

constexpr size_t kPayload = 64;
constexpr int kDefaultConns = 50;
constexpr double kDefaultSeconds = 5.0;
constexpr uint64_t kDefaultMaxCount = 10'000'000;
// Source addresses 127.0.0.2.. used in turn. With one source address every connection needs a
// fresh ephemeral port toward the same ip:port, and ports held in TIME_WAIT (we close first)
// come back only after net.ipv4.tcp_tw_reuse_delay (1 s): connect() then scans the whole range
// for a free port. Measured here: with 1 address the client itself stalled at ~14.4k conn/s with
// 100 ms tails, with 16 it did ~38k conn/s against the echo server directly.
constexpr uint32_t kDefaultSrcIps = 16;
constexpr int64_t kConnDeadlineNs = 2'000'000'000;  // per connection, connect to echo
// Longest epoll_wait: bounds how late a connection's 2 s deadline is noticed.
constexpr int kPollMs = 20;

using bench::nowNs;

enum class SlotState { Idle, Connecting, Reading };

struct Slot {
    SlotState state = SlotState::Idle;
    int fd = -1;
    int64_t start_ns = 0;
    size_t got = 0;
};

// Why each failed connection failed; reported on stderr so a bad run explains itself.
struct ErrorCounts {
    uint64_t refused = 0;    // ECONNREFUSED at connect
    uint64_t reset = 0;      // ECONNRESET / EPIPE while talking
    uint64_t early_eof = 0;  // peer closed before the whole echo came back
    uint64_t timeout = 0;    // 2 s deadline passed
    uint64_t no_port = 0;    // EADDRNOTAVAIL: ephemeral ports exhausted (TIME_WAIT pile-up)
    uint64_t other = 0;
    uint64_t total() const { return refused + reset + early_eof + timeout + no_port + other; }
};

struct Options {
    uint16_t port = 0;
    int conns = kDefaultConns;
    double seconds = kDefaultSeconds;
    uint64_t max_count = kDefaultMaxCount;
    uint32_t src_ips = kDefaultSrcIps;
    std::string log;      // --log FILE: every connection's times and outcome
    double start_at = 0;  // --start-at T: CLOCK_MONOTONIC seconds to begin at
};

[[noreturn]] void usage(int code) {
    std::fprintf(code ? stderr : stdout,
                 "usage: conn_rate --port PORT [--conns N (%d)] [--seconds S (%.0f)] [--max-count "
                 "N (%llu)]\n"
                 "                 [--src-ips N (%u): source addresses 127.0.0.2.., 1 = let the "
                 "kernel pick]\n"
                 "                 [--log FILE: each connection's start, end, outcome] "
                 "[--start-at MONOTONIC_S]\n"
                 "Connects to 127.0.0.1:PORT, writes %zu B, reads the echo, closes; N in flight.\n",
                 kDefaultConns, kDefaultSeconds, static_cast<unsigned long long>(kDefaultMaxCount),
                 kDefaultSrcIps, kPayload);
    std::exit(code);
}

Options parseArgs(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        std::string_view a = argv[i];
        auto value = [&]() -> const char* {
            if (i + 1 >= argc) usage(2);
            return argv[++i];
        };
        if (a == "--port") {
            long p = std::strtol(value(), nullptr, 10);
            if (p <= 0 || p > 65535) usage(2);
            o.port = static_cast<uint16_t>(p);
        } else if (a == "--conns") {
            o.conns = std::atoi(value());
            if (o.conns < 1 || o.conns > 10000) usage(2);
        } else if (a == "--seconds") {
            o.seconds = std::atof(value());
            if (!(o.seconds > 0 && o.seconds <= 3600)) usage(2);
        } else if (a == "--max-count") {
            o.max_count = std::strtoull(value(), nullptr, 10);
            if (o.max_count == 0) usage(2);
        } else if (a == "--src-ips") {
            o.src_ips = static_cast<uint32_t>(std::atoi(value()));
            if (o.src_ips < 1 || o.src_ips > 250) usage(2);
        } else if (a == "--log") {
            o.log = value();
        } else if (a == "--start-at") {
            o.start_at = std::atof(value());
            if (!(o.start_at > 0)) usage(2);
        } else if (a == "-h" || a == "--help") {
            usage(0);
        } else {
            usage(2);
        }
    }
    if (o.port == 0) usage(2);
    return o;
}

class Generator {
  public:
    explicit Generator(const Options& o) : opt_(o), slots_(static_cast<size_t>(o.conns)) {
        std::memset(payload_, 'z', sizeof payload_);
        addr_.sin_family = AF_INET;
        addr_.sin_port = htons(o.port);
        addr_.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        // Reserve up front for a typical run so the vector does not reallocate mid-measurement.
        latencies_ns_.reserve(std::min<uint64_t>(o.max_count, 2'000'000));
    }

    bool run() {
        ep_ = ::epoll_create1(EPOLL_CLOEXEC);
        if (ep_ < 0) {
            std::perror("epoll_create1");
            return false;
        }
        if (opt_.start_at > 0) {
            const int64_t at = static_cast<int64_t>(opt_.start_at * 1e9);
            if (const int64_t left = at - nowNs(); left > 0 && left < 60'000'000'000) {
                timespec ts{left / 1'000'000'000, left % 1'000'000'000};
                ::nanosleep(&ts, nullptr);
            }
        }
        begin_ns_ = nowNs();
        stop_ns_ = begin_ns_ + static_cast<int64_t>(opt_.seconds * 1e9);
        if (!opt_.log.empty()) log_.reserve(std::min<uint64_t>(opt_.max_count, 2'000'000));
        for (size_t i = 0; i < slots_.size(); ++i) startConn(i);

        std::vector<epoll_event> events(slots_.size());
        // Bounded: no new connection starts after stop_ns_, and each one in flight ends within
        // its 2 s deadline, so this loop ends at most ~2 s after the duration.
        while (inFlight() > 0) {
            int n = ::epoll_wait(ep_, events.data(), static_cast<int>(events.size()), kPollMs);
            if (n < 0 && errno != EINTR) {
                std::perror("epoll_wait");
                return false;
            }
            for (int k = 0; k < n; ++k) onEvent(events[k].data.u32);
            expire();
        }
        end_ns_ = nowNs();
        ::close(ep_);
        return true;
    }

    // --log: one line per connection, in the order they ended.
    bool writeLog() const {
        if (opt_.log.empty()) return true;
        FILE* f = std::fopen(opt_.log.c_str(), "w");
        if (f == nullptr) {
            std::perror(opt_.log.c_str());
            return false;
        }
        for (const Logged& l : log_)
            std::fprintf(f, "%.6f %.6f %d\n", static_cast<double>(l.start_ns) / 1e9,
                         static_cast<double>(l.end_ns) / 1e9, l.outcome);
        return std::fclose(f) == 0;
    }

    void report() {
        double elapsed_s = static_cast<double>(end_ns_ - begin_ns_) / 1e9;
        double rate = elapsed_s > 0 ? static_cast<double>(latencies_ns_.size()) / elapsed_s : 0;
        std::sort(latencies_ns_.begin(), latencies_ns_.end());
        std::printf(
            "{\"conns_per_s\":%.1f,\"completed\":%zu,\"errors\":%llu,\"p50_us\":%.1f,\"p99_us\":%."
            "1f}\n",
            rate, latencies_ns_.size(), static_cast<unsigned long long>(errors_.total()),
            percentileUs(0.50), percentileUs(0.99));
        // The tail beyond p99 on stderr: enough to tell a scheduling hiccup from a SYN retransmit
        // (1 s) without widening the JSON line the scripts parse.
        std::fprintf(stderr, "conn_rate: p90=%.1fus p99.9=%.1fus max=%.1fus elapsed=%.3fs\n",
                     percentileUs(0.90), percentileUs(0.999), percentileUs(1.0), elapsed_s);
        if (errors_.total() > 0) {
            std::fprintf(stderr,
                         "conn_rate: errors: refused=%llu reset=%llu early_eof=%llu timeout=%llu "
                         "no_port=%llu other=%llu\n",
                         static_cast<unsigned long long>(errors_.refused),
                         static_cast<unsigned long long>(errors_.reset),
                         static_cast<unsigned long long>(errors_.early_eof),
                         static_cast<unsigned long long>(errors_.timeout),
                         static_cast<unsigned long long>(errors_.no_port),
                         static_cast<unsigned long long>(errors_.other));
        }
    }

  private:
    size_t inFlight() const {
        size_t n = 0;
        for (const Slot& s : slots_) n += s.state != SlotState::Idle;
        return n;
    }

    // Nearest-rank percentile; a run with no completed connection reports 0.
    double percentileUs(double q) const {
        if (latencies_ns_.empty()) return 0;
        size_t rank = static_cast<size_t>(q * static_cast<double>(latencies_ns_.size()));
        rank = std::min(rank, latencies_ns_.size() - 1);
        return static_cast<double>(latencies_ns_[rank]) / 1e3;
    }

    bool mayStart() const { return started_ < opt_.max_count && nowNs() < stop_ns_; }

    void startConn(size_t i) {
        // A connection that fails at once (refused, no port) frees its slot immediately; retry in
        // the same slot, but only while the run may still start connections, so this is bounded.
        while (mayStart()) {
            Slot& s = slots_[i];
            ++started_;
            s.start_ns = nowNs();  // again just before connect(); this one dates an early failure
            s.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP);
            if (s.fd < 0) {
                std::perror("socket");
                ++errors_.other;
                continue;
            }
            int one = 1;
            // The 64 B request must leave at once, not wait for Nagle.
            ::setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            if (opt_.src_ips > 1) {
                // IP_BIND_ADDRESS_NO_PORT: fix the source address now, pick the port at connect()
                // against the full 4-tuple.
                ::setsockopt(s.fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
                sockaddr_in src{};
                src.sin_family = AF_INET;
                src.sin_addr.s_addr =
                    htonl(INADDR_LOOPBACK + 1 + static_cast<uint32_t>(started_ % opt_.src_ips));
                if (::bind(s.fd, reinterpret_cast<const sockaddr*>(&src), sizeof src) < 0) {
                    fail(i, errno);
                    continue;
                }
            }
            s.start_ns = nowNs();
            s.got = 0;
            int rc = ::connect(s.fd, reinterpret_cast<const sockaddr*>(&addr_), sizeof addr_);
            // Loopback may finish the handshake inside connect(); either way the socket turns
            // writable once connected, so both cases go through the Connecting event.
            if (rc < 0 && errno != EINPROGRESS) {
                fail(i, errno);
                continue;
            }
            s.state = SlotState::Connecting;
            if (arm(i)) return;
        }
    }

    // One epoll_ctl per connection: edge-triggered IN|OUT reports the connect (OUT edge) and
    // later the echo (IN edge) without a MOD in between, which keeps the client's own syscall
    // count, and so its share of CPU 0, down.
    bool arm(size_t i) {
        epoll_event ev{};
        ev.events = EPOLLIN | EPOLLOUT | EPOLLET;
        ev.data.u32 = static_cast<uint32_t>(i);
        if (::epoll_ctl(ep_, EPOLL_CTL_ADD, slots_[i].fd, &ev) < 0) {
            fail(i, errno);
            return false;
        }
        return true;
    }

    void onEvent(uint32_t i) {
        Slot& s = slots_[i];
        if (s.state == SlotState::Connecting) {
            int err = 0;
            socklen_t len = sizeof err;
            ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len);
            if (err != 0) {
                finish(i, err);
                return;
            }
            sendRequest(i);
        } else if (s.state == SlotState::Reading) {
            readEcho(i);
        }
    }

    void sendRequest(size_t i) {
        Slot& s = slots_[i];
        // 64 B into an empty, freshly connected socket buffer: all or nothing in practice.
        ssize_t n = ::send(s.fd, payload_, sizeof payload_, MSG_NOSIGNAL);
        if (n != static_cast<ssize_t>(sizeof payload_)) {
            finish(i, n < 0 ? errno : EIO);
            return;
        }
        // No recv here: the echo cannot exist before the request, and its arrival raises a fresh
        // IN edge, so waiting for that edge misses nothing and saves an EAGAIN recv per connection.
        s.state = SlotState::Reading;
    }

    void readEcho(size_t i) {
        Slot& s = slots_[i];
        char buf[kPayload];
        for (;;) {
            ssize_t n = ::recv(s.fd, buf, sizeof buf - s.got, 0);
            if (n > 0) {
                s.got += static_cast<size_t>(n);
                if (s.got == kPayload) {
                    finish(i, 0);
                    return;
                }
                continue;
            }
            if (n == 0) {
                ++errors_.early_eof;
                finish(i, -1);
                return;
            }
            if (errno == EAGAIN || errno == EINTR) return;
            finish(i, errno);
            return;
        }
    }

    // err: 0 = success, -1 = already counted, else an errno to classify.
    void finish(size_t i, int err) {
        Slot& s = slots_[i];
        if (!opt_.log.empty()) log_.push_back({s.start_ns, nowNs(), outcomeOf(err)});
        if (err == 0) {
            latencies_ns_.push_back(static_cast<uint32_t>(nowNs() - s.start_ns));
        } else if (err > 0) {
            classify(err);
        }
        closeSlot(i);
        startConn(i);
    }

    void fail(size_t i, int err) {
        if (!opt_.log.empty()) log_.push_back({slots_[i].start_ns, nowNs(), outcomeOf(err)});
        classify(err);
        closeSlot(i);
    }

    // --log's outcome codes (the header comment); -1 is an early EOF, counted already.
    static int outcomeOf(int err) {
        switch (err) {
            case 0:
                return 0;
            case ECONNREFUSED:
                return 1;
            case ECONNRESET:
            case EPIPE:
                return 2;
            case ETIMEDOUT:
                return 3;
            default:
                return 4;
        }
    }

    void closeSlot(size_t i) {
        Slot& s = slots_[i];
        // close() also drops the fd from the epoll set.
        if (s.fd >= 0) ::close(s.fd);
        s.fd = -1;
        s.state = SlotState::Idle;
    }

    void classify(int err) {
        switch (err) {
            case ECONNREFUSED:
                ++errors_.refused;
                break;
            case ECONNRESET:
            case EPIPE:
                ++errors_.reset;
                break;
            case ETIMEDOUT:
                ++errors_.timeout;
                break;
            case EADDRNOTAVAIL:
                ++errors_.no_port;
                break;
            default:
                ++errors_.other;
                break;
        }
    }

    void expire() {
        int64_t now = nowNs();
        for (size_t i = 0; i < slots_.size(); ++i) {
            if (slots_[i].state != SlotState::Idle && now - slots_[i].start_ns > kConnDeadlineNs)
                finish(i, ETIMEDOUT);
        }
    }

    Options opt_;
    std::vector<Slot> slots_;
    sockaddr_in addr_{};
    char payload_[kPayload];
    int ep_ = -1;
    int64_t begin_ns_ = 0;
    int64_t stop_ns_ = 0;
    int64_t end_ns_ = 0;
    uint64_t started_ = 0;
    // Nanoseconds fit in 32 bits: no connection lives past its 2 s deadline.
    std::vector<uint32_t> latencies_ns_;
    ErrorCounts errors_;
    struct Logged {
        int64_t start_ns;
        int64_t end_ns;
        int outcome;
    };
    std::vector<Logged> log_;  // --log only
};

}  // namespace

int main(int argc, char** argv) {
    Options opt = parseArgs(argc, argv);
    Generator gen(opt);
    if (!gen.run()) return 2;
    gen.report();
    return gen.writeLog() ? 0 : 2;
}
