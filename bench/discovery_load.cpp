// discovery_load: the load of bench/discovery.sh, a relay whose backends change under it. Plain
// sockets and one epoll thread, like the other bench tools.
//
//   discovery_load client --connect 127.0.0.1:PORT --seconds S [--rate R (200)]
//                         [--sessions M (40)] [--session-ms L (2000)] [--long K (8)]
//                         [--interval-ms I (100)] [--timeline FILE]
//   discovery_load transfer --connect 127.0.0.1:PORT --in FILE --out FILE [--rate-mib R (0)]
//                           [--timeout S (120)]
//
// client: three kinds of connections at once, against an echo server behind the relay, for S s.
//
//   short     R per second, on a fixed schedule (not closed-loop, so a slow relay cannot slow
//             the load down): connect, send 64 B, read the 64 B echo, close. At most 256 in
//             flight; a start that finds none free is counted as `skipped`, not queued.
//   sessions  M connections that each live L ms, sending 16 B every I ms and reading each
//             echo before the next; then SHUT_WR, the server's FIN, close, and a new one at
//             once. Their first starts are spread over L, so about M / L * 1000 open per second.
//   long      K connections opened in the first I ms that ping every I ms for the whole run.
//
// At the end every session and long connection is closed the same polite way (SHUT_WR, wait
// for the server's FIN). Each message carries the connection's number and a sequence number, and
// its echo must come back byte for byte. Anything else counts as a failure by kind:
//
//   refused    ECONNREFUSED from connect
//   reset      ECONNRESET / EPIPE while talking
//   early_eof  the far side closed before the echo was complete or before our SHUT_WR
//   timeout    a connect, an echo or the closing FIN took longer than 2 s
//   mismatch   an echo that differs from what was sent, or bytes after our SHUT_WR
//   other      any other errno
//
// Output: one JSON line on stdout with the counts per kind of connection, the failures by kind,
// and p50/p99/max of the short connections' time (connect to echo) and of the pings' round
// trips. Every failure is also printed on stderr as it happens (the first 100), with its
// CLOCK_REALTIME time, so it can be set against the moments DNS changed. Exit 0 if it ran
// (failures or not), 2 on bad arguments or if it could not run.
//
// --timeline FILE: per 100 ms of the run, one line: the bin's start (s since the run began),
// short connections started and completed, the slowest completed one (µs), pings completed, the
// slowest ping (µs), failures, and the longest gap between two turns of this client's own event
// loop (µs; it waits at most 5 ms, so a gap far above that means the client itself did not run:
// its CPU was busy elsewhere). A latency spike with a loop gap as long is the load's CPU, not
// the relay.
//
// transfer: one connection, FILE sent at R MiB/s (0 = as fast as it goes), every byte the echo
// server returns written to the --out file, SHUT_WR after the last byte, done at the server's
// FIN. The caller compares the two files (sha256). Output: one JSON line (bytes sent and
// received, seconds, MiB/s, the connect time as CLOCK_REALTIME seconds, the longest wait
// between two received chunks). Exit 0 if every byte came back and the connection ended with a
// FIN, 1 otherwise (reason in the JSON's "error" and on stderr), 2 on bad arguments.
//
// Every loop is bounded: no start after S s, every phase of a connection has a 2 s deadline,
// and the client gives the last connections at most 5 s after S to close; the transfer ends at
// --timeout whatever happens.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
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

using bench::nowNs;

constexpr size_t kShortPayload = 64;
constexpr size_t kPingSize = 16;
constexpr size_t kMaxShortInFlight = 256;
constexpr int64_t kPhaseDeadlineNs = 2'000'000'000;  // connect, echo, FIN: each
constexpr int64_t kEndGraceNs = 5'000'000'000;       // after S: time left to close politely
constexpr int kMaxLoggedFailures = 100;
constexpr int kMaxPollMs = 5;

double realtimeS() {
    timespec ts{};
    ::clock_gettime(CLOCK_REALTIME, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

[[noreturn]] void usage(int code) {
    std::fprintf(code ? stderr : stdout,
                 "usage: discovery_load client --connect 127.0.0.1:PORT --seconds S [--rate R "
                 "(200)]\n"
                 "                             [--sessions M (40)] [--session-ms L (2000)] "
                 "[--long K (8)] [--interval-ms I (100)]\n"
                 "                             [--timeline FILE]\n"
                 "       discovery_load transfer --connect 127.0.0.1:PORT --in FILE --out FILE "
                 "[--rate-mib R (0)] [--timeout S (120)]\n");
    std::exit(code);
}

// ---------------------------------------------------------------- client

enum class Kind : uint8_t { Short, Session, Long };
enum class State : uint8_t { Idle, Connecting, Open, AwaitEcho, Closing };

struct Conn {
    Kind kind = Kind::Short;
    State state = State::Idle;
    int fd = -1;
    uint64_t id = 0;         // connection number, in every message
    uint64_t seq = 0;        // messages sent on it
    int64_t start_ns = 0;    // connect() (short: the latency's start)
    int64_t opened_ns = 0;   // connected (sessions: their lifetime counts from here)
    int64_t deadline_ns = 0; // of the current phase
    int64_t next_ns = 0;     // Idle: when to (re)connect; Open: next ping
    int64_t sent_ns = 0;     // the ping in flight
    unsigned char expect[kShortPayload];
    size_t len = 0;          // bytes of the message in flight
    size_t got = 0;          // of its echo
};

struct Failures {
    uint64_t refused = 0, reset = 0, early_eof = 0, timeout = 0, mismatch = 0, other = 0;
    uint64_t total() const { return refused + reset + early_eof + timeout + mismatch + other; }
};

struct PerKind {
    uint64_t started = 0;  // connects issued
    uint64_t ok = 0;       // completed as planned
    uint64_t failed = 0;
};

// One 100 ms slice of the run (--timeline).
struct Bin {
    uint32_t short_started = 0, short_done = 0, pings = 0, failures = 0;
    int64_t short_max_ns = 0, ping_max_ns = 0, loop_gap_ns = 0;
};
constexpr int64_t kBinNs = 100'000'000;

struct ClientOptions {
    sockaddr_in addr{};
    double seconds = 0;
    double rate = 200;
    int sessions = 40;
    int session_ms = 2000;
    int long_conns = 8;
    int interval_ms = 100;
    const char* timeline = nullptr;
};

class Client {
  public:
    explicit Client(const ClientOptions& o) : opt_(o) {}

    bool run() {
        ep_ = ::epoll_create1(EPOLL_CLOEXEC);
        if (ep_ < 0) {
            std::perror("epoll_create1");
            return false;
        }
        begin_ns_ = nowNs();
        stop_ns_ = begin_ns_ + static_cast<int64_t>(opt_.seconds * 1e9);
        const int64_t interval = int64_t{opt_.interval_ms} * 1'000'000;
        const int64_t life = int64_t{opt_.session_ms} * 1'000'000;
        // Slots: long first, then sessions, then the short ones.
        for (int i = 0; i < opt_.long_conns; ++i) {
            Conn c;
            c.kind = Kind::Long;
            c.next_ns = begin_ns_ + interval * i / std::max(1, opt_.long_conns);
            conns_.push_back(c);
        }
        for (int i = 0; i < opt_.sessions; ++i) {
            Conn c;
            c.kind = Kind::Session;
            c.next_ns = begin_ns_ + life * i / std::max(1, opt_.sessions);
            conns_.push_back(c);
        }
        first_short_ = conns_.size();
        if (opt_.rate > 0) conns_.resize(conns_.size() + kMaxShortInFlight);
        next_short_ns_ = begin_ns_;
        const int64_t short_period = opt_.rate > 0 ? static_cast<int64_t>(1e9 / opt_.rate) : 0;

        std::vector<epoll_event> events(conns_.size() + 1);
        const int64_t hard_end = stop_ns_ + kEndGraceNs;
        bins_.resize(static_cast<size_t>((hard_end - begin_ns_) / kBinNs) + 2);
        int64_t last_turn = begin_ns_;
        for (;;) {
            int64_t now = nowNs();
            Bin& b = bin(now);
            b.loop_gap_ns = std::max(b.loop_gap_ns, now - last_turn);
            last_turn = now;
            bool running = now < stop_ns_;
            // Short connections on their schedule.
            while (short_period > 0 && running && now >= next_short_ns_) {
                next_short_ns_ += short_period;
                startShort(now);
            }
            // Timers of the other slots: (re)connects, pings, lifetimes, deadlines.
            for (size_t i = 0; i < conns_.size(); ++i) tick(i, now, running);
            if (!running && busy() == 0) break;
            if (now >= hard_end) {
                for (size_t i = 0; i < conns_.size(); ++i)
                    if (conns_[i].state != State::Idle) fail(i, ETIMEDOUT, "run end");
                break;
            }
            int n = ::epoll_wait(ep_, events.data(), static_cast<int>(events.size()), kMaxPollMs);
            if (n < 0 && errno != EINTR) {
                std::perror("epoll_wait");
                return false;
            }
            for (int k = 0; k < n; ++k) onEvent(events[k].data.u32, events[k].events);
        }
        end_ns_ = nowNs();
        ::close(ep_);
        return true;
    }

    Bin& bin(int64_t t) {
        size_t i = t <= begin_ns_ ? 0 : static_cast<size_t>((t - begin_ns_) / kBinNs);
        return bins_[std::min(i, bins_.size() - 1)];
    }

    bool writeTimeline(const char* path) const {
        FILE* f = std::fopen(path, "w");
        if (!f) {
            std::perror("discovery_load: timeline");
            return false;
        }
        std::fprintf(f, "# t_s short_started short_done short_max_us pings ping_max_us failures "
                        "loop_gap_us\n");
        for (size_t i = 0; i < bins_.size(); ++i) {
            const Bin& b = bins_[i];
            std::fprintf(f, "%.1f %u %u %.0f %u %.0f %u %.0f\n", static_cast<double>(i) / 10.0,
                         b.short_started, b.short_done, static_cast<double>(b.short_max_ns) / 1e3,
                         b.pings, static_cast<double>(b.ping_max_ns) / 1e3, b.failures,
                         static_cast<double>(b.loop_gap_ns) / 1e3);
        }
        return std::fclose(f) == 0;
    }

    void report() {
        if (opt_.timeline) writeTimeline(opt_.timeline);
        double s = static_cast<double>(end_ns_ - begin_ns_) / 1e9;
        auto pct = [](std::vector<uint32_t>& v, double q) {
            if (v.empty()) return 0.0;
            size_t r = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
            return static_cast<double>(v[r]) / 1e3;
        };
        std::sort(short_ns_.begin(), short_ns_.end());
        std::sort(ping_ns_.begin(), ping_ns_.end());
        const PerKind& sh = kinds_[0];
        const PerKind& se = kinds_[1];
        const PerKind& lo = kinds_[2];
        std::printf(
            "{\"seconds\":%.3f,\"failures\":%llu,"
            "\"short_started\":%llu,\"short_ok\":%llu,\"short_failed\":%llu,\"short_skipped\":%llu,"
            "\"sessions_started\":%llu,\"sessions_ok\":%llu,\"sessions_failed\":%llu,"
            "\"long_started\":%llu,\"long_ok\":%llu,\"long_failed\":%llu,\"pings\":%llu,"
            "\"refused\":%llu,\"reset\":%llu,\"early_eof\":%llu,\"timeout\":%llu,"
            "\"mismatch\":%llu,\"other\":%llu,"
            "\"short_p50_us\":%.1f,\"short_p99_us\":%.1f,\"short_max_us\":%.1f,"
            "\"ping_p50_us\":%.1f,\"ping_p99_us\":%.1f,\"ping_max_us\":%.1f}\n",
            s, ull(failures_.total()), ull(sh.started), ull(sh.ok), ull(sh.failed), ull(skipped_),
            ull(se.started), ull(se.ok), ull(se.failed), ull(lo.started), ull(lo.ok),
            ull(lo.failed), ull(pings_), ull(failures_.refused), ull(failures_.reset),
            ull(failures_.early_eof), ull(failures_.timeout), ull(failures_.mismatch),
            ull(failures_.other), pct(short_ns_, 0.5), pct(short_ns_, 0.99), pct(short_ns_, 1.0),
            pct(ping_ns_, 0.5), pct(ping_ns_, 0.99), pct(ping_ns_, 1.0));
    }

  private:
    static unsigned long long ull(uint64_t v) { return static_cast<unsigned long long>(v); }
    static const char* kindName(Kind k) {
        return k == Kind::Short ? "short" : k == Kind::Session ? "session" : "long";
    }
    PerKind& per(const Conn& c) { return kinds_[static_cast<int>(c.kind)]; }

    size_t busy() const {
        size_t n = 0;
        for (const Conn& c : conns_) n += c.state != State::Idle;
        return n;
    }

    void startShort(int64_t now) {
        for (size_t i = first_short_; i < conns_.size(); ++i) {
            if (conns_[i].state == State::Idle) {
                conns_[i].kind = Kind::Short;
                ++bin(now).short_started;
                connectSlot(i, now);
                return;
            }
        }
        ++skipped_;
    }

    void connectSlot(size_t i, int64_t now) {
        Conn& c = conns_[i];
        ++per(c).started;
        c.id = ++next_id_;
        c.seq = 0;
        c.got = 0;
        c.start_ns = now;
        c.deadline_ns = now + kPhaseDeadlineNs;
        c.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP);
        if (c.fd < 0) {
            fail(i, errno, "socket");
            return;
        }
        int one = 1;
        ::setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        int rc = ::connect(c.fd, reinterpret_cast<const sockaddr*>(&opt_.addr), sizeof opt_.addr);
        if (rc < 0 && errno != EINPROGRESS) {
            fail(i, errno, "connect");
            return;
        }
        c.state = State::Connecting;
        epoll_event ev{};
        ev.events = EPOLLOUT;
        ev.data.u32 = static_cast<uint32_t>(i);
        if (::epoll_ctl(ep_, EPOLL_CTL_ADD, c.fd, &ev) < 0) fail(i, errno, "epoll_ctl");
    }

    void watchInput(size_t i) {
        epoll_event ev{};
        ev.events = EPOLLIN | EPOLLRDHUP;
        ev.data.u32 = static_cast<uint32_t>(i);
        if (::epoll_ctl(ep_, EPOLL_CTL_MOD, conns_[i].fd, &ev) < 0) fail(i, errno, "epoll_ctl");
    }

    void tick(size_t i, int64_t now, bool running) {
        Conn& c = conns_[i];
        switch (c.state) {
            case State::Idle:
                if (c.kind != Kind::Short && running && c.next_ns != 0 && now >= c.next_ns)
                    connectSlot(i, now);
                return;
            case State::Open:
                if (!running || (c.kind == Kind::Session &&
                                 now - c.opened_ns >= int64_t{opt_.session_ms} * 1'000'000)) {
                    beginClose(i, now);
                } else if (now >= c.next_ns) {
                    sendPing(i, now);
                }
                return;
            default:
                if (now > c.deadline_ns) fail(i, ETIMEDOUT, "deadline");
                return;
        }
    }

    void onEvent(uint32_t i, uint32_t events) {
        if (i >= conns_.size()) return;
        Conn& c = conns_[i];
        if (c.state == State::Connecting) {
            int err = 0;
            socklen_t len = sizeof err;
            ::getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
            if (err != 0) return fail(i, err, "connect");
            if (!(events & EPOLLOUT)) return;
            int64_t now = nowNs();
            c.opened_ns = now;
            watchInput(i);
            if (c.state == State::Idle) return;
            if (c.kind == Kind::Short) {
                std::memset(c.expect, 0, sizeof c.expect);
                std::memcpy(c.expect, &c.id, sizeof c.id);
                std::memset(c.expect + sizeof c.id, 'z', kShortPayload - sizeof c.id);
                sendMessage(i, now, kShortPayload);
            } else {
                c.state = State::Open;
                sendPing(i, now);
            }
            return;
        }
        if (c.state == State::Idle) return;
        readInput(i);
    }

    void sendPing(size_t i, int64_t now) {
        Conn& c = conns_[i];
        ++c.seq;
        std::memcpy(c.expect, &c.id, sizeof c.id);
        std::memcpy(c.expect + sizeof c.id, &c.seq, sizeof c.seq);
        sendMessage(i, now, kPingSize);
    }

    void sendMessage(size_t i, int64_t now, size_t len) {
        Conn& c = conns_[i];
        c.len = len;
        c.got = 0;
        c.sent_ns = now;
        c.deadline_ns = now + kPhaseDeadlineNs;
        // A few bytes into a socket with nothing unacknowledged: all or nothing.
        ssize_t n = ::send(c.fd, c.expect, len, MSG_NOSIGNAL);
        if (n != static_cast<ssize_t>(len)) return fail(i, n < 0 ? errno : EIO, "send");
        c.state = State::AwaitEcho;
    }

    void beginClose(size_t i, int64_t now) {
        Conn& c = conns_[i];
        if (::shutdown(c.fd, SHUT_WR) < 0) return fail(i, errno, "shutdown");
        c.state = State::Closing;
        c.deadline_ns = now + kPhaseDeadlineNs;
    }

    void readInput(size_t i) {
        Conn& c = conns_[i];
        unsigned char buf[256];
        for (;;) {
            ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
            if (n < 0) {
                if (errno == EAGAIN || errno == EINTR) return;
                return fail(i, errno, "recv");
            }
            if (n == 0) {
                if (c.state == State::Closing) return done(i);
                return fail(i, -1, "eof");
            }
            if (c.state != State::AwaitEcho || c.got + static_cast<size_t>(n) > c.len ||
                std::memcmp(buf, c.expect + c.got, static_cast<size_t>(n)) != 0)
                return fail(i, -2, "echo");
            c.got += static_cast<size_t>(n);
            if (c.got < c.len) continue;
            int64_t now = nowNs();
            Bin& b = bin(now);
            if (c.kind == Kind::Short) {
                short_ns_.push_back(static_cast<uint32_t>(now - c.start_ns));
                ++b.short_done;
                b.short_max_ns = std::max(b.short_max_ns, now - c.start_ns);
                return done(i);
            }
            ++pings_;
            ++b.pings;
            b.ping_max_ns = std::max(b.ping_max_ns, now - c.sent_ns);
            if (ping_ns_.size() < 10'000'000) ping_ns_.push_back(static_cast<uint32_t>(now - c.sent_ns));
            c.state = State::Open;
            c.next_ns = c.sent_ns + int64_t{opt_.interval_ms} * 1'000'000;
        }
    }

    void done(size_t i) {
        Conn& c = conns_[i];
        ++per(c).ok;
        closeSlot(i);
        // A session is replaced at once; a long connection only lives once.
        c.next_ns = c.kind == Kind::Session ? nowNs() : 0;
    }

    // err: an errno, -1 = early EOF, -2 = echo mismatch.
    void fail(size_t i, int err, const char* where) {
        Conn& c = conns_[i];
        const char* what = "other";
        switch (err) {
            case ECONNREFUSED: ++failures_.refused; what = "refused"; break;
            case ECONNRESET:
            case EPIPE: ++failures_.reset; what = "reset"; break;
            case ETIMEDOUT: ++failures_.timeout; what = "timeout"; break;
            case -1: ++failures_.early_eof; what = "early_eof"; break;
            case -2: ++failures_.mismatch; what = "mismatch"; break;
            default: ++failures_.other; break;
        }
        ++per(c).failed;
        ++bin(nowNs()).failures;
        if (logged_ < kMaxLoggedFailures) {
            ++logged_;
            std::fprintf(stderr,
                         "discovery_load: failure %s (%s, %s) on %s connection %llu, message %llu, "
                         "at %.6f (%.3f s into the run)\n",
                         what, where, err > 0 ? std::strerror(err) : "-", kindName(c.kind),
                         ull(c.id), ull(c.seq), realtimeS(),
                         static_cast<double>(nowNs() - begin_ns_) / 1e9);
        }
        closeSlot(i);
        // A failed session is replaced after 10 ms, so a relay that fails every connection
        // cannot make this loop spin.
        c.next_ns = c.kind == Kind::Session ? nowNs() + 10'000'000 : 0;
    }

    void closeSlot(size_t i) {
        Conn& c = conns_[i];
        if (c.fd >= 0) ::close(c.fd);
        c.fd = -1;
        c.state = State::Idle;
    }

    ClientOptions opt_;
    std::vector<Conn> conns_;
    size_t first_short_ = 0;
    int ep_ = -1;
    int64_t begin_ns_ = 0, stop_ns_ = 0, end_ns_ = 0, next_short_ns_ = 0;
    uint64_t next_id_ = 0, skipped_ = 0, pings_ = 0;
    int logged_ = 0;
    PerKind kinds_[3];
    Failures failures_;
    std::vector<uint32_t> short_ns_, ping_ns_;
    std::vector<Bin> bins_;
};

int runClient(int argc, char** argv) {
    ClientOptions o;
    bool have_addr = false;
    for (int i = 2; i < argc; ++i) {
        std::string_view a = argv[i];
        if (i + 1 >= argc) usage(2);
        const char* v = argv[++i];
        if (a == "--connect") {
            have_addr = bench::parseAddr(v, o.addr);
            if (!have_addr) usage(2);
        } else if (a == "--seconds") {
            o.seconds = std::atof(v);
        } else if (a == "--rate") {
            o.rate = std::atof(v);
        } else if (a == "--sessions") {
            o.sessions = std::atoi(v);
        } else if (a == "--session-ms") {
            o.session_ms = std::atoi(v);
        } else if (a == "--long") {
            o.long_conns = std::atoi(v);
        } else if (a == "--interval-ms") {
            o.interval_ms = std::atoi(v);
        } else if (a == "--timeline") {
            o.timeline = v;
        } else {
            usage(2);
        }
    }
    if (!have_addr || !(o.seconds > 0 && o.seconds <= 3600) || o.rate < 0 || o.rate > 20000 ||
        o.sessions < 0 || o.sessions > 2000 || o.session_ms < 10 || o.long_conns < 0 ||
        o.long_conns > 2000 || o.interval_ms < 1 || o.interval_ms > 60000)
        usage(2);
    Client client(o);
    if (!client.run()) return 2;
    client.report();
    return 0;
}

// ---------------------------------------------------------------- transfer

int runTransfer(int argc, char** argv) {
    sockaddr_in addr{};
    bool have_addr = false;
    const char* in_path = nullptr;
    const char* out_path = nullptr;
    double rate_mib = 0, timeout_s = 120;
    for (int i = 2; i < argc; ++i) {
        std::string_view a = argv[i];
        if (i + 1 >= argc) usage(2);
        const char* v = argv[++i];
        if (a == "--connect") {
            have_addr = bench::parseAddr(v, addr);
        } else if (a == "--in") {
            in_path = v;
        } else if (a == "--out") {
            out_path = v;
        } else if (a == "--rate-mib") {
            rate_mib = std::atof(v);
        } else if (a == "--timeout") {
            timeout_s = std::atof(v);
        } else {
            usage(2);
        }
    }
    if (!have_addr || !in_path || !out_path || rate_mib < 0 || !(timeout_s > 0)) usage(2);
    int in = ::open(in_path, O_RDONLY | O_CLOEXEC);
    int out = ::open(out_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (in < 0 || out < 0) {
        std::perror("discovery_load transfer: open");
        return 2;
    }
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        std::perror("socket");
        return 2;
    }
    const double connect_at = realtimeS();
    const int64_t begin = nowNs();
    const int64_t end = begin + static_cast<int64_t>(timeout_s * 1e9);
    std::string error;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) < 0 &&
        errno != EINPROGRESS)
        error = std::string("connect: ") + std::strerror(errno);

    constexpr size_t kChunk = 256 * 1024;
    std::vector<char> sendbuf(kChunk), recvbuf(kChunk);
    size_t buf_off = 0, buf_len = 0;
    uint64_t sent = 0, received = 0;
    bool in_eof = false, shut = false, peer_eof = false, connected = false;
    int64_t last_recv = begin, max_gap = 0;
    const double bytes_per_ns = rate_mib * 1048576.0 / 1e9;
    while (error.empty() && !peer_eof) {
        int64_t now = nowNs();
        if (now > end) {
            error = "timeout";
            break;
        }
        if (buf_off == buf_len && !in_eof) {
            ssize_t r = ::read(in, sendbuf.data(), kChunk);
            if (r < 0) {
                error = std::string("read input: ") + std::strerror(errno);
                break;
            }
            if (r == 0) in_eof = true;
            buf_off = 0;
            buf_len = static_cast<size_t>(r);
        }
        // Paced: never ahead of rate x elapsed (+ one chunk).
        size_t allowed = buf_len - buf_off;
        if (rate_mib > 0) {
            double budget = bytes_per_ns * static_cast<double>(now - begin) + kChunk -
                            static_cast<double>(sent);
            allowed = budget <= 0 ? 0 : std::min(allowed, static_cast<size_t>(budget));
        }
        if (connected && in_eof && buf_off == buf_len && !shut) {
            if (::shutdown(fd, SHUT_WR) < 0) {
                error = std::string("shutdown: ") + std::strerror(errno);
                break;
            }
            shut = true;
        }
        pollfd p{fd, POLLIN, 0};
        if (!connected || (allowed > 0 && !shut)) p.events |= POLLOUT;
        int n = ::poll(&p, 1, 10);
        if (n < 0 && errno != EINTR) {
            error = std::string("poll: ") + std::strerror(errno);
            break;
        }
        if (n <= 0) continue;
        if (!connected && (p.revents & (POLLOUT | POLLERR | POLLHUP))) {
            int err = 0;
            socklen_t len = sizeof err;
            ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
            if (err) {
                error = std::string("connect: ") + std::strerror(err);
                break;
            }
            connected = true;
        }
        if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
            for (;;) {
                ssize_t r = ::recv(fd, recvbuf.data(), kChunk, 0);
                if (r > 0) {
                    int64_t t = nowNs();
                    max_gap = std::max(max_gap, t - last_recv);
                    last_recv = t;
                    received += static_cast<uint64_t>(r);
                    if (received > sent) {
                        error = "more bytes back than sent";
                        break;
                    }
                    if (::write(out, recvbuf.data(), static_cast<size_t>(r)) != r) {
                        error = std::string("write output: ") + std::strerror(errno);
                        break;
                    }
                    continue;
                }
                if (r == 0) {
                    peer_eof = true;
                    if (!shut) error = "the server closed before the transfer ended";
                } else if (errno != EAGAIN && errno != EINTR) {
                    error = std::string("recv: ") + std::strerror(errno);
                }
                break;
            }
        }
        if (error.empty() && connected && !shut && allowed > 0 && (p.revents & POLLOUT)) {
            ssize_t w = ::send(fd, sendbuf.data() + buf_off, allowed, MSG_NOSIGNAL);
            if (w > 0) {
                buf_off += static_cast<size_t>(w);
                sent += static_cast<uint64_t>(w);
            } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
                error = std::string("send: ") + std::strerror(errno);
            }
        }
    }
    if (error.empty() && received != sent) error = "fewer bytes back than sent";
    double secs = static_cast<double>(nowNs() - begin) / 1e9;
    ::close(fd);
    ::close(in);
    if (::close(out) < 0 && error.empty()) error = "close output";
    std::printf(
        "{\"bytes_sent\":%llu,\"bytes_received\":%llu,\"seconds\":%.3f,\"mib_per_s\":%.2f,"
        "\"connect_at\":%.6f,\"max_recv_gap_ms\":%.1f,\"error\":\"%s\"}\n",
        static_cast<unsigned long long>(sent), static_cast<unsigned long long>(received), secs,
        secs > 0 ? static_cast<double>(received) / 1048576.0 / secs : 0.0, connect_at,
        static_cast<double>(max_gap) / 1e6, error.c_str());
    if (!error.empty()) std::fprintf(stderr, "discovery_load transfer: %s\n", error.c_str());
    return error.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    ::signal(SIGPIPE, SIG_IGN);
    if (argc < 2) usage(2);
    std::string_view role = argv[1];
    if (role == "client") return runClient(argc, argv);
    if (role == "transfer") return runTransfer(argc, argv);
    usage(role == "-h" || role == "--help" ? 0 : 2);
}
