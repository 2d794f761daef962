// transfer: bulk-transfer load generator and sink for comparing the relay's data paths.
//
//   transfer sink   --listen 127.0.0.1:PORT [--seconds N (3600)]
//   transfer client --connect 127.0.0.1:PORT [--conns N (1)] [--size-mib S (10)] [--rounds K (1)]
//                   [--verify] [--timeout SECONDS (60)]
//
// The client opens N connections at once and writes S MiB on each, then shuts down its write
// side (SHUT_WR). The sink reads every connection to EOF and only then answers with a 24-byte
// receipt and closes:
//
//   client                               sink
//   connect ---- header + S MiB ---->    count (and, if asked, check the pattern)
//   SHUT_WR  ----------- FIN ------->    EOF: write receipt {bytes, flags, bad offset}, close
//   read receipt, compare bytes <----    (so a byte lost or added anywhere is a failure)
//
// A relay that buffers or drops bytes cannot fake the receipt: it exists only once the sink has
// seen EOF, and EOF only follows the last byte. So the clock, from the first connect to the last
// receipt, covers every byte arriving, not just the client handing it to its socket buffer.
// With --rounds K the client does K such rounds one after another (each waits for all N
// receipts): a single 1 MiB transfer lasts about a millisecond, too short for a rate or for
// CPU counters that tick every 10 ms.
//
// The stream: an 8-byte header ("zct1" + 32-bit little-endian word: bit 31 = please verify,
// bits 0-30 = start offset into the pattern), then bytes pattern[(start + i) % kPeriod]. The
// header counts towards the S MiB. The pattern is pseudo-random with a prime period, so a
// chunk that is duplicated, skipped or reordered at any power-of-two size shows as a mismatch;
// each connection starts at a different offset, so streams swapped or mixed between
// connections show too. Checking is memcmp against the same pattern, cheap next to the copy
// the sink does anyway, but it is optional (--verify) because it does add to CPU 0.
//
// Client output: one JSON line on stdout,
//   {"conns":N,"rounds":K,"size_mib":S,"bytes":..,"seconds":..,"mb_per_s":..,"failures":F,
//    "verified":V}
// with MB/s = 10^6 B/s, and a failure breakdown on stderr. Exit 0 only if every connection's
// receipt matched (and, with --verify, the sink checked it clean); 1 if any did not; 2 on bad
// arguments or if it could not run at all.
//
// Sink output: the bound port alone on the first stdout line (flushed; --listen 127.0.0.1:0
// lets the kernel pick), then on exit (SIGTERM/SIGINT or --seconds) one JSON line with totals.
// Every bad stream is also reported on stderr as it happens.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
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
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "bench_util.hpp"

namespace {

// A prime just under 1 MiB: not a divisor of any buffer or segment size a relay might use.
constexpr size_t kPeriod = 1'048'573;
constexpr size_t kHeaderSize = 8;
constexpr char kMagic[4] = {'z', 'c', 't', '1'};
constexpr uint32_t kVerifyBit = 1u << 31;
constexpr size_t kReceiptSize = 24;
// Receipt flags.
constexpr uint64_t kVerified = 1;  // the sink compared every byte against the pattern
constexpr uint64_t kBad = 2;       // header or pattern mismatch at the receipt's offset
constexpr size_t kRecvBuf = 256 * 1024;
constexpr int kPollMs = 200;  // how often deadlines and the stop flag are checked
constexpr int kDefaultSinkSeconds = 3600;
constexpr double kDefaultTimeout = 60;

volatile sig_atomic_t g_stop = 0;
void onSignal(int) { g_stop = 1; }

using bench::nowNs;

// The pattern twice over, so pattern[(start + i) % kPeriod] for i < kPeriod is one contiguous
// window: the client sends straight from it and the sink compares straight against it.
const std::vector<unsigned char>& pattern() {
    static const std::vector<unsigned char> p =
        bench::doubledPattern(kPeriod, 0x9e3779b97f4a7c15ull);
    return p;
}

void putLe64(unsigned char* p, uint64_t v) {
    for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint64_t getLe64(const unsigned char* p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
    return v;
}

using bench::parseAddr;

// ---------------------------------------------------------------- sink

struct SinkConn {
    unsigned char header[kHeaderSize];
    size_t header_got = 0;
    uint64_t bytes = 0;  // everything read, header included
    uint32_t start = 0;  // pattern offset of the first byte after the header
    bool verify = false;
    bool bad = false;
    uint64_t bad_at = 0;  // stream offset of the first wrong byte
};

class Sink {
  public:
    bool open(const sockaddr_in& addr) {
        listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (listen_fd_ < 0) return perr("socket");
        int one = 1;
        ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) < 0)
            return perr("bind");
        // 100 clients connect in the same instant: the queue must hold them all.
        if (::listen(listen_fd_, SOMAXCONN) < 0) return perr("listen");
        sockaddr_in bound{};
        socklen_t len = sizeof bound;
        ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
        port_ = ntohs(bound.sin_port);
        ep_ = ::epoll_create1(EPOLL_CLOEXEC);
        if (ep_ < 0) return perr("epoll_create1");
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.fd = listen_fd_;
        if (::epoll_ctl(ep_, EPOLL_CTL_ADD, listen_fd_, &ev) < 0) return perr("epoll_ctl");
        return true;
    }

    uint16_t port() const { return port_; }

    void run(int seconds) {
        const int64_t end = nowNs() + int64_t{seconds} * 1'000'000'000;
        epoll_event events[256];
        while (!g_stop && nowNs() < end) {
            int n = ::epoll_wait(ep_, events, 256, kPollMs);
            if (n < 0) {
                if (errno == EINTR) continue;
                perr("epoll_wait");
                return;
            }
            for (int k = 0; k < n; ++k) {
                if (events[k].data.fd == listen_fd_) {
                    acceptAll();
                } else {
                    serve(events[k].data.fd);
                }
            }
        }
    }

    void report() const {
        std::printf(
            "{\"conns\":%llu,\"bytes\":%llu,\"bad\":%llu,\"verified\":%llu,\"aborted\":%llu,"
            "\"open\":%zu}\n",
            static_cast<unsigned long long>(done_), static_cast<unsigned long long>(bytes_),
            static_cast<unsigned long long>(bad_), static_cast<unsigned long long>(verified_),
            static_cast<unsigned long long>(aborted_), conns_.size());
    }

  private:
    static bool perr(const char* what) {
        std::fprintf(stderr, "transfer sink: %s: %s\n", what, std::strerror(errno));
        return false;
    }

    void acceptAll() {
        for (;;) {
            int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0) return;  // EAGAIN: drained; EMFILE etc.: leave queued, retry next wake
            epoll_event ev{};
            // Level-triggered: serve() reads a bounded amount per wake-up so one fast stream
            // cannot starve the others, and what is left raises the event again.
            ev.events = EPOLLIN;
            ev.data.fd = fd;
            if (::epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &ev) < 0) {
                ::close(fd);
                continue;
            }
            conns_[fd] = std::make_unique<SinkConn>();
        }
    }

    void serve(int fd) {
        auto it = conns_.find(fd);
        if (it == conns_.end()) return;
        SinkConn& c = *it->second;
        for (int i = 0; i < 8; ++i) {
            ssize_t r = ::recv(fd, buf_, sizeof buf_, 0);
            if (r > 0) {
                consume(c, buf_, static_cast<size_t>(r));
                continue;
            }
            if (r == 0) return finish(fd, c);
            if (errno == EAGAIN || errno == EINTR) return;
            // Reset: the client gave up or the relay dropped us. The client sees no receipt
            // and counts the failure; here it is only tallied.
            ++aborted_;
            return drop(fd);
        }
    }

    void consume(SinkConn& c, const unsigned char* p, size_t n) {
        uint64_t at = c.bytes;  // stream offset of p[0], header included
        c.bytes += n;
        if (c.header_got < kHeaderSize) {
            size_t take = std::min(n, kHeaderSize - c.header_got);
            std::memcpy(c.header + c.header_got, p, take);
            c.header_got += take;
            p += take;
            n -= take;
            at += take;
            if (c.header_got < kHeaderSize) return;
            uint32_t word = static_cast<uint32_t>(getLe64(c.header) >> 32);
            c.verify = word & kVerifyBit;
            c.start = word & ~kVerifyBit;
            if (std::memcmp(c.header, kMagic, sizeof kMagic) != 0 || c.start >= kPeriod) {
                markBad(c, 0);
                return;
            }
        }
        if (!c.verify || c.bad || n == 0) return;
        const unsigned char* want = pattern().data() + (c.start + (at - kHeaderSize)) % kPeriod;
        // n <= kRecvBuf < kPeriod, so one window of the doubled pattern covers it.
        if (std::memcmp(p, want, n) != 0) {
            size_t k = 0;
            while (p[k] == want[k]) ++k;
            markBad(c, at + k);
        }
    }

    void markBad(SinkConn& c, uint64_t at) {
        c.bad = true;
        c.bad_at = at;
    }

    void finish(int fd, SinkConn& c) {
        uint64_t flags = 0;
        if (c.header_got < kHeaderSize) markBad(c, c.bytes);  // stream shorter than its header
        if (c.bad) {
            flags |= kBad;
            ++bad_;
            std::fprintf(stderr,
                         "transfer sink: bad stream: %llu bytes, first wrong byte at %llu\n",
                         static_cast<unsigned long long>(c.bytes),
                         static_cast<unsigned long long>(c.bad_at));
        } else if (c.verify) {
            flags |= kVerified;
            ++verified_;
        }
        unsigned char receipt[kReceiptSize];
        putLe64(receipt, c.bytes);
        putLe64(receipt + 8, flags);
        putLe64(receipt + 16, c.bad_at);
        // Our send buffer is empty (we never sent before), so 24 B go out whole or not at all;
        // a failure here leaves the client without a receipt, which it counts.
        ::send(fd, receipt, sizeof receipt, MSG_NOSIGNAL);
        ++done_;
        bytes_ += c.bytes;
        drop(fd);
    }

    void drop(int fd) {
        conns_.erase(fd);
        ::close(fd);
    }

    int listen_fd_ = -1;
    int ep_ = -1;
    uint16_t port_ = 0;
    std::unordered_map<int, std::unique_ptr<SinkConn>> conns_;
    unsigned char buf_[kRecvBuf];
    uint64_t done_ = 0, bytes_ = 0, bad_ = 0, verified_ = 0, aborted_ = 0;
};

// ---------------------------------------------------------------- client

struct ClientOptions {
    sockaddr_in addr{};
    bool have_addr = false;
    int conns = 1;
    uint64_t size_mib = 10;
    int rounds = 1;
    bool verify = false;
    double timeout_s = kDefaultTimeout;
};

// Why connections failed; on stderr so a bad run explains itself.
struct Failures {
    uint64_t connect = 0;     // refused, or socket/connect error
    uint64_t reset = 0;       // error while sending or reading the receipt
    uint64_t no_receipt = 0;  // EOF before a whole receipt
    uint64_t count = 0;       // receipt's byte count != bytes sent
    uint64_t bad = 0;         // the sink found a header or pattern mismatch
    uint64_t unverified = 0;  // --verify, but the sink did not check
    uint64_t timeout = 0;     // --timeout passed first
    uint64_t total() const {
        return connect + reset + no_receipt + count + bad + unverified + timeout;
    }
};

enum class State { Idle, Connecting, Sending, Receipt, Done };

struct ClientConn {
    State state = State::Idle;
    int fd = -1;
    uint64_t sent = 0;  // header included
    unsigned char header[kHeaderSize];
    unsigned char receipt[kReceiptSize];
    size_t receipt_got = 0;
    uint32_t start = 0;
};

class Client {
  public:
    explicit Client(const ClientOptions& o)
        : opt_(o), total_(o.size_mib * 1024 * 1024), conns_(static_cast<size_t>(o.conns)) {}

    bool run() {
        ep_ = ::epoll_create1(EPOLL_CLOEXEC);
        if (ep_ < 0) {
            std::perror("transfer client: epoll_create1");
            return false;
        }
        pattern();  // build it before the clock starts
        const int64_t deadline = nowNs() + static_cast<int64_t>(opt_.timeout_s * 1e9);
        std::vector<epoll_event> events(conns_.size());
        begin_ns_ = nowNs();
        for (int round = 0; round < opt_.rounds; ++round) {
            for (size_t i = 0; i < conns_.size(); ++i) start(i, round);
            // Bounded: every pass either finishes connections or waits at most kPollMs, and at
            // the deadline whatever is left is failed.
            while (active_ > 0) {
                if (nowNs() >= deadline) {
                    for (size_t i = 0; i < conns_.size(); ++i) {
                        if (conns_[i].state != State::Done && conns_[i].state != State::Idle) {
                            ++fail_.timeout;
                            close(i);
                        }
                    }
                    timed_out_ = true;
                    active_ = 0;
                    break;
                }
                int n = ::epoll_wait(ep_, events.data(), static_cast<int>(events.size()), kPollMs);
                if (n < 0 && errno != EINTR) {
                    std::perror("transfer client: epoll_wait");
                    return false;
                }
                for (int k = 0; k < n; ++k) onEvent(events[k].data.u32, events[k].events);
            }
            if (timed_out_) {
                // Rounds not started are failures too: every connection asked for is counted.
                fail_.timeout += static_cast<uint64_t>(opt_.rounds - round - 1) * conns_.size();
                break;
            }
        }
        end_ns_ = nowNs();
        ::close(ep_);
        return true;
    }

    int report() const {
        const double secs = static_cast<double>(end_ns_ - begin_ns_) / 1e9;
        const uint64_t bytes = confirmed_bytes_;
        std::printf(
            "{\"conns\":%d,\"rounds\":%d,\"size_mib\":%llu,\"bytes\":%llu,\"seconds\":%.6f,"
            "\"mb_per_s\":%.1f,\"failures\":%llu,\"verified\":%llu}\n",
            opt_.conns, opt_.rounds, static_cast<unsigned long long>(opt_.size_mib),
            static_cast<unsigned long long>(bytes), secs,
            secs > 0 ? static_cast<double>(bytes) / secs / 1e6 : 0.0,
            static_cast<unsigned long long>(fail_.total()),
            static_cast<unsigned long long>(verified_));
        if (fail_.total() > 0) {
            std::fprintf(stderr,
                         "transfer client: failures: connect=%llu reset=%llu no_receipt=%llu "
                         "count=%llu bad=%llu unverified=%llu timeout=%llu\n",
                         static_cast<unsigned long long>(fail_.connect),
                         static_cast<unsigned long long>(fail_.reset),
                         static_cast<unsigned long long>(fail_.no_receipt),
                         static_cast<unsigned long long>(fail_.count),
                         static_cast<unsigned long long>(fail_.bad),
                         static_cast<unsigned long long>(fail_.unverified),
                         static_cast<unsigned long long>(fail_.timeout));
        }
        return fail_.total() == 0 ? 0 : 1;
    }

  private:
    void start(size_t i, int round) {
        ClientConn& c = conns_[i];
        c = ClientConn{};
        // Spread the streams over the pattern so that no two connections of a run carry the same
        // bytes at the same offset.
        c.start = static_cast<uint32_t>((static_cast<uint64_t>(round) * conns_.size() + i) * 7919 *
                                        131 % kPeriod);
        std::memcpy(c.header, kMagic, sizeof kMagic);
        uint32_t word = c.start | (opt_.verify ? kVerifyBit : 0);
        for (int b = 0; b < 4; ++b) c.header[4 + b] = static_cast<unsigned char>(word >> (8 * b));
        c.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP);
        if (c.fd < 0) {
            std::perror("transfer client: socket");
            ++fail_.connect;
            return;
        }
        int rc = ::connect(c.fd, reinterpret_cast<const sockaddr*>(&opt_.addr), sizeof opt_.addr);
        if (rc < 0 && errno != EINPROGRESS) {
            ++fail_.connect;
            close(i);
            return;
        }
        c.state = State::Connecting;
        epoll_event ev{};
        // Writable = connected (or failed, see SO_ERROR); after SHUT_WR the interest becomes IN.
        ev.events = EPOLLOUT;
        ev.data.u32 = static_cast<uint32_t>(i);
        if (::epoll_ctl(ep_, EPOLL_CTL_ADD, c.fd, &ev) < 0) {
            ++fail_.connect;
            close(i);
            return;
        }
        ++active_;
    }

    void onEvent(uint32_t i, uint32_t events) {
        ClientConn& c = conns_[i];
        if (c.state == State::Connecting) {
            int err = 0;
            socklen_t len = sizeof err;
            ::getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
            if (err != 0) {
                ++fail_.connect;
                return finish(i);
            }
            c.state = State::Sending;
        }
        if (c.state == State::Sending) {
            if (events & EPOLLERR) {
                ++fail_.reset;
                return finish(i);
            }
            return send(i);
        }
        if (c.state == State::Receipt) readReceipt(i);
    }

    void send(size_t i) {
        ClientConn& c = conns_[i];
        const unsigned char* pat = pattern().data();
        while (c.sent < total_) {
            const unsigned char* p;
            size_t len;
            if (c.sent < kHeaderSize) {
                p = c.header + c.sent;
                len = kHeaderSize - c.sent;
            } else {
                uint64_t pos = c.sent - kHeaderSize;
                p = pat + (c.start + pos) % kPeriod;
                len = static_cast<size_t>(std::min<uint64_t>(total_ - c.sent, kPeriod));
            }
            len = static_cast<size_t>(std::min<uint64_t>(len, total_ - c.sent));
            ssize_t n = ::send(c.fd, p, len, MSG_NOSIGNAL);
            if (n > 0) {
                c.sent += static_cast<uint64_t>(n);
                continue;
            }
            if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
            ++fail_.reset;
            return finish(i);
        }
        // All handed over: half-close, and from now on wait for the receipt.
        if (::shutdown(c.fd, SHUT_WR) < 0) {
            ++fail_.reset;
            return finish(i);
        }
        c.state = State::Receipt;
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u32 = static_cast<uint32_t>(i);
        ::epoll_ctl(ep_, EPOLL_CTL_MOD, c.fd, &ev);
    }

    void readReceipt(size_t i) {
        ClientConn& c = conns_[i];
        for (;;) {
            unsigned char buf[64];
            ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
            if (n > 0) {
                // Anything past the 24 B receipt is a protocol error: count it as a bad receipt.
                size_t take = std::min(static_cast<size_t>(n), kReceiptSize - c.receipt_got);
                std::memcpy(c.receipt + c.receipt_got, buf, take);
                c.receipt_got += take;
                if (take < static_cast<size_t>(n)) c.receipt_got = kReceiptSize + 1;
                continue;
            }
            if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
            if (n < 0) {
                ++fail_.reset;
                return finish(i);
            }
            break;  // EOF: the sink closed after its receipt
        }
        if (c.receipt_got != kReceiptSize) {
            ++fail_.no_receipt;
            return finish(i);
        }
        const uint64_t got = getLe64(c.receipt);
        const uint64_t flags = getLe64(c.receipt + 8);
        if (flags & kBad) {
            ++fail_.bad;
            std::fprintf(stderr, "transfer client: conn %zu: sink found a wrong byte at %llu\n", i,
                         static_cast<unsigned long long>(getLe64(c.receipt + 16)));
        } else if (got != total_) {
            ++fail_.count;
            std::fprintf(stderr, "transfer client: conn %zu: sent %llu, sink got %llu\n", i,
                         static_cast<unsigned long long>(total_),
                         static_cast<unsigned long long>(got));
        } else if (opt_.verify && !(flags & kVerified)) {
            ++fail_.unverified;
        } else {
            confirmed_bytes_ += got;
            verified_ += (flags & kVerified) ? 1 : 0;
        }
        finish(i);
    }

    void finish(size_t i) {
        close(i);
        --active_;
    }

    void close(size_t i) {
        ClientConn& c = conns_[i];
        if (c.fd >= 0) ::close(c.fd);  // also leaves the epoll set
        c.fd = -1;
        c.state = State::Done;
    }

    ClientOptions opt_;
    uint64_t total_;
    std::vector<ClientConn> conns_;
    int ep_ = -1;
    size_t active_ = 0;
    bool timed_out_ = false;
    int64_t begin_ns_ = 0, end_ns_ = 0;
    uint64_t confirmed_bytes_ = 0;
    uint64_t verified_ = 0;
    Failures fail_;
};

// ---------------------------------------------------------------- main

[[noreturn]] void usage(int code) {
    std::fprintf(code ? stderr : stdout,
                 "usage: transfer sink --listen 127.0.0.1:PORT [--seconds N (%d)]\n"
                 "       transfer client --connect 127.0.0.1:PORT [--conns N (1)] [--size-mib S "
                 "(10)] [--rounds K (1)]\n"
                 "                       [--verify] [--timeout SECONDS (%.0f)]\n"
                 "The client sends S MiB on each of N concurrent connections (K rounds), "
                 "half-closes,\nand checks the sink's receipt of the byte count.\n",
                 kDefaultSinkSeconds, kDefaultTimeout);
    std::exit(code);
}

int runSink(int argc, char** argv) {
    sockaddr_in addr{};
    bool have_addr = false;
    long seconds = kDefaultSinkSeconds;
    for (int i = 2; i < argc; ++i) {
        std::string_view a = argv[i];
        if (a == "--listen" && i + 1 < argc) {
            have_addr = parseAddr(argv[++i], addr);
            if (!have_addr) usage(2);
        } else if (a == "--seconds" && i + 1 < argc) {
            seconds = std::strtol(argv[++i], nullptr, 10);
        } else {
            usage(a == "-h" || a == "--help" ? 0 : 2);
        }
    }
    if (!have_addr || seconds < 1) usage(2);
    struct sigaction sa {};
    sa.sa_handler = onSignal;
    ::sigaction(SIGTERM, &sa, nullptr);
    ::sigaction(SIGINT, &sa, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
    pattern();
    static Sink sink;  // static: 256 KiB receive buffer inside
    if (!sink.open(addr)) return 2;
    std::printf("%u\n", sink.port());
    std::fflush(stdout);
    sink.run(static_cast<int>(seconds));
    sink.report();
    return 0;
}

int runClient(int argc, char** argv) {
    ClientOptions o;
    for (int i = 2; i < argc; ++i) {
        std::string_view a = argv[i];
        auto value = [&]() -> const char* {
            if (i + 1 >= argc) usage(2);
            return argv[++i];
        };
        if (a == "--connect") {
            o.have_addr = parseAddr(value(), o.addr);
            if (!o.have_addr || o.addr.sin_port == 0) usage(2);
        } else if (a == "--conns") {
            o.conns = std::atoi(value());
            if (o.conns < 1 || o.conns > 10000) usage(2);
        } else if (a == "--size-mib") {
            o.size_mib = std::strtoull(value(), nullptr, 10);
            if (o.size_mib < 1 || o.size_mib > 1024 * 1024) usage(2);
        } else if (a == "--rounds") {
            o.rounds = std::atoi(value());
            if (o.rounds < 1 || o.rounds > 1'000'000) usage(2);
        } else if (a == "--verify") {
            o.verify = true;
        } else if (a == "--timeout") {
            o.timeout_s = std::atof(value());
            if (!(o.timeout_s > 0 && o.timeout_s <= 86400)) usage(2);
        } else {
            usage(a == "-h" || a == "--help" ? 0 : 2);
        }
    }
    if (!o.have_addr) usage(2);
    ::signal(SIGPIPE, SIG_IGN);
    Client client(o);
    if (!client.run()) return 2;
    return client.report();
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) usage(2);
    std::string_view role = argv[1];
    if (role == "sink") return runSink(argc, argv);
    if (role == "client") return runClient(argc, argv);
    usage(role == "-h" || role == "--help" ? 0 : 2);
}
