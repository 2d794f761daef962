// halfclose: does a relay deliver the upstream's reply after the client half-closed?
//
//   halfclose server --listen 127.0.0.1:PORT [--reply-mib N (1)] [--reply-delay-ms MS (0)]
//                    [--timeout S (10)] [--seconds N (3600)]
//   halfclose client --connect 127.0.0.1:PORT [--size-mib N (1)] [--reply-mib N (1)]
//                    [--timeout S (10)]
//
// The exchange many request/response protocols rely on (a client sends its whole request, says
// so with shutdown(SHUT_WR), and waits for the answer):
//
//   client                                  server (the upstream)
//   connect, send N MiB ------------------> count bytes
//   shutdown(SHUT_WR) ------ FIN ---------> EOF: (wait --reply-delay-ms) send the reply, close
//   read to EOF, check count + pattern <--- reply: --reply-mib MiB
//
// A relay that treats the client's FIN as the end of the session (nginx stream without
// proxy_half_close, for one) closes the upstream side and the reply never arrives: the client
// then sees EOF early, or nothing at all until its deadline. Either way it fails within
// --timeout seconds: every socket call waits in poll() against one deadline for the whole
// exchange, so a relay that drops the reply can fail the test but never hang it.
//
// Both directions carry a pseudo-random pattern with a prime period (as in transfer.cpp); the
// reply starts at another offset than the request, so a relay that loops the client's bytes back
// fails too. The server also checks the request's pattern and reports it.
//
// Client output: one JSON line on stdout,
//   {"pass":true|false,"sent":B,"received":B,"reason":"...","ms":T}
// with "reason" empty on a pass. Exit 0 on pass, 1 on fail, 2 on bad arguments.
//
// Server output: the bound port alone on the first stdout line (flushed; port 0 = let the kernel
// pick), then one JSON line per finished connection,
//   {"conn":K,"received":B,"request_ok":true|false,"replied":B,"error":"..."}
// which tells a relay that never forwarded the request (received short) from one that dropped
// the reply (replied short, or "error" from the write). One thread per connection. Exits 0 after
// --seconds or on SIGTERM/SIGINT, so a forgotten instance cannot linger.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
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
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bench_util.hpp"

namespace {

// A prime just over 1 MiB: the default 1 MiB stream never repeats, and a chunk shifted by any
// power-of-two amount shows as a mismatch.
constexpr size_t kPeriod = 1'048'583;
constexpr size_t kRequestStart = 0;      // pattern offset of the request's first byte
constexpr size_t kReplyStart = 524'287;  // ... and of the reply's: an echo does not pass
constexpr size_t kMiB = 1024 * 1024;
constexpr long kMaxMiB = 1024;
constexpr size_t kChunk = 64 * 1024;
constexpr long kDefaultTimeoutS = 10;
constexpr long kDefaultServerSeconds = 3600;
constexpr int kPollMs = 200;  // how often the server checks its lifetime and the stop flag

volatile sig_atomic_t g_stop = 0;
void onSignal(int) { g_stop = 1; }

using bench::nowNs;
using bench::parseAddr;

// The pattern twice over, so pattern()[(start + i) % kPeriod] for i < kPeriod is contiguous.
const std::vector<unsigned char>& pattern() {
    static const std::vector<unsigned char> p =
        bench::doubledPattern(kPeriod, 0x2545f4914f6cdd1dull);
    return p;
}

// Index of the first byte of p[0..n) that differs from the pattern at stream offset `off`
// (pattern offset start + off), or n if all match.
size_t firstMismatch(const unsigned char* p, size_t n, size_t start, uint64_t off) {
    const auto& pat = pattern();
    size_t done = 0;
    while (done < n) {
        size_t at = (start + off + done) % kPeriod;
        size_t len = std::min(n - done, kPeriod - at);
        if (std::memcmp(p + done, pat.data() + at, len) != 0) {
            for (size_t i = 0; i < len; ++i)
                if (p[done + i] != pat[at + i]) return done + i;
        }
        done += len;
    }
    return n;
}

// One deadline for a whole exchange; each call waits in poll() for at most what is left of it.
class Deadline {
  public:
    explicit Deadline(long seconds) : end_ns_(nowNs() + int64_t{seconds} * 1'000'000'000) {}
    // 1 ready, 0 deadline passed, -1 poll error.
    int wait(int fd, short events) const {
        for (;;) {
            int64_t left_ms = (end_ns_ - nowNs()) / 1'000'000;
            if (left_ms <= 0) return 0;
            pollfd p{fd, events, 0};
            int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left_ms, kPollMs)));
            if (r > 0) return 1;  // POLLERR/POLLHUP too: the next call reports what happened
            if (r < 0 && errno != EINTR) return -1;
        }
    }

  private:
    int64_t end_ns_;
};

// Result of a transfer step: ok, or a reason in words.
struct Step {
    bool ok = true;
    std::string reason;
};

std::string errnoText(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// Send `total` bytes of the pattern from `start`, bounded by the deadline.
Step sendPattern(int fd, size_t start, uint64_t total, const Deadline& dl, uint64_t& sent) {
    const auto& pat = pattern();
    while (sent < total) {
        int w = dl.wait(fd, POLLOUT);
        if (w == 0) return {false, "timeout sending"};
        if (w < 0) return {false, errnoText("poll")};
        size_t at = (start + sent) % kPeriod;
        size_t len = static_cast<size_t>(std::min<uint64_t>(total - sent, kChunk));
        ssize_t n = ::send(fd, pat.data() + at, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            sent += static_cast<uint64_t>(n);
        } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            return {false, errnoText("send")};
        }
    }
    return {};
}

// Read to EOF, counting and checking against the pattern from `start`. Stops checking after
// the first mismatch (recorded in bad_at) but keeps counting. Fails on timeout or error.
Step readToEof(int fd, size_t start, const Deadline& dl, uint64_t& received, uint64_t& bad_at,
               bool& bad) {
    std::vector<unsigned char> buf(kChunk);
    for (;;) {
        int w = dl.wait(fd, POLLIN);
        if (w == 0) return {false, "timeout waiting for EOF"};
        if (w < 0) return {false, errnoText("poll")};
        ssize_t n = ::recv(fd, buf.data(), buf.size(), MSG_DONTWAIT);
        if (n == 0) return {};
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
            return {false, errnoText("recv")};
        }
        if (!bad) {
            size_t m = firstMismatch(buf.data(), static_cast<size_t>(n), start, received);
            if (m < static_cast<size_t>(n)) {
                bad = true;
                bad_at = received + m;
            }
        }
        received += static_cast<uint64_t>(n);
    }
}

// Quotes and backslashes out, so a reason can go into a JSON string as it is.
std::string jsonSafe(std::string s) {
    for (char& c : s)
        if (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20) c = '\'';
    return s;
}

// ---------------------------------------------------------------- server

struct ServerOpts {
    uint64_t reply_bytes = kMiB;
    long reply_delay_ms = 0;
    long timeout_s = kDefaultTimeoutS;
};

std::mutex g_out_mu;
std::atomic<uint64_t> g_conns{0};

void serveConn(int fd, ServerOpts opts) {
    const uint64_t id = ++g_conns;
    Deadline dl(opts.timeout_s);
    uint64_t received = 0, bad_at = 0, replied = 0;
    bool bad = false;
    Step st = readToEof(fd, kRequestStart, dl, received, bad_at, bad);
    if (st.ok && opts.reply_delay_ms > 0) {
        // An upstream that takes a while to answer: some relays give up on a half-closed
        // session after a fixed time (socat's -t, 0.5 s by default).
        ::usleep(static_cast<useconds_t>(opts.reply_delay_ms) * 1000);
    }
    if (st.ok) st = sendPattern(fd, kReplyStart, opts.reply_bytes, dl, replied);
    ::close(fd);
    std::lock_guard<std::mutex> lock(g_out_mu);
    std::printf(
        "{\"conn\":%llu,\"received\":%llu,\"request_ok\":%s,\"replied\":%llu,\"error\":\"%s\"}\n",
        static_cast<unsigned long long>(id), static_cast<unsigned long long>(received),
        bad ? "false" : "true", static_cast<unsigned long long>(replied),
        jsonSafe(bad && st.ok ? "request differs from the pattern at byte " + std::to_string(bad_at)
                              : st.reason)
            .c_str());
    std::fflush(stdout);
}

int runServer(const sockaddr_in& addr, const ServerOpts& opts, long seconds) {
    return bench::serveLoop("halfclose", addr, seconds, g_stop,
                            [opts](int fd) { serveConn(fd, opts); });
}

// ---------------------------------------------------------------- client

// Non-blocking connect, bounded by the deadline.
Step connectTo(int fd, const sockaddr_in& addr, const Deadline& dl) {
    int r = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
    if (r == 0) return {};
    if (errno != EINPROGRESS) return {false, errnoText("connect")};
    int w = dl.wait(fd, POLLOUT);
    if (w == 0) return {false, "timeout connecting"};
    if (w < 0) return {false, errnoText("poll")};
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return {false, std::string("connect: ") + std::strerror(err)};
    return {};
}

int runClient(const sockaddr_in& addr, uint64_t size, uint64_t reply_bytes, long timeout_s) {
    const int64_t t0 = nowNs();
    Deadline dl(timeout_s);
    uint64_t sent = 0, received = 0, bad_at = 0;
    bool bad = false;
    Step st;
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        st = {false, errnoText("socket")};
    } else {
        st = connectTo(fd, addr, dl);
        if (st.ok) st = sendPattern(fd, kRequestStart, size, dl, sent);
        if (st.ok && ::shutdown(fd, SHUT_WR) < 0) st = {false, errnoText("shutdown")};
        if (st.ok) {
            st = readToEof(fd, kReplyStart, dl, received, bad_at, bad);
            if (!st.ok) st.reason += " (reply)";
        } else {
            st.reason += " (request, after " + std::to_string(sent) + " bytes)";
        }
        ::close(fd);
    }
    if (st.ok) {
        if (received == 0) {
            st = {false, "no reply: EOF after the half-close"};
        } else if (received != reply_bytes) {
            st = {false, "reply has " + std::to_string(received) + " bytes, expected " +
                             std::to_string(reply_bytes)};
        } else if (bad) {
            st = {false, "reply differs from the pattern at byte " + std::to_string(bad_at)};
        }
    } else if (bad) {
        st.reason += "; reply differs from the pattern at byte " + std::to_string(bad_at);
    }
    std::printf("{\"pass\":%s,\"sent\":%llu,\"received\":%llu,\"reason\":\"%s\",\"ms\":%.1f}\n",
                st.ok ? "true" : "false", static_cast<unsigned long long>(sent),
                static_cast<unsigned long long>(received), jsonSafe(st.reason).c_str(),
                static_cast<double>(nowNs() - t0) / 1e6);
    return st.ok ? 0 : 1;
}

[[noreturn]] void usage(int code) {
    std::fprintf(code ? stderr : stdout,
                 "usage: halfclose server --listen 127.0.0.1:PORT [--reply-mib N (1)]\n"
                 "                        [--reply-delay-ms MS (0)] [--timeout S (%ld)] "
                 "[--seconds N (%ld)]\n"
                 "       halfclose client --connect 127.0.0.1:PORT [--size-mib N (1)] "
                 "[--reply-mib N (1)]\n"
                 "                        [--timeout S (%ld)]\n",
                 kDefaultTimeoutS, kDefaultServerSeconds, kDefaultTimeoutS);
    std::exit(code);
}

// A whole number in [lo, hi], or usage(2).
long number(const char* s, long lo, long hi) {
    char* end = nullptr;
    errno = 0;
    long v = std::strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) usage(2);
    return v;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) usage(2);
    std::string_view role = argv[1];
    if (role != "server" && role != "client") usage(role == "-h" || role == "--help" ? 0 : 2);
    const bool server = role == "server";

    sockaddr_in addr{};
    bool have_addr = false;
    long size_mib = 1, reply_mib = 1, delay_ms = 0, timeout_s = kDefaultTimeoutS;
    long seconds = kDefaultServerSeconds;
    for (int i = 2; i < argc; ++i) {
        std::string_view a = argv[i];
        auto value = [&]() -> const char* {
            if (i + 1 >= argc) usage(2);
            return argv[++i];
        };
        if (a == (server ? "--listen" : "--connect")) {
            have_addr = parseAddr(value(), addr);
            if (!have_addr) usage(2);
        } else if (!server && a == "--size-mib") {
            size_mib = number(value(), 0, kMaxMiB);
        } else if (a == "--reply-mib") {
            reply_mib = number(value(), 1, kMaxMiB);
        } else if (server && a == "--reply-delay-ms") {
            delay_ms = number(value(), 0, 60'000);
        } else if (a == "--timeout") {
            timeout_s = number(value(), 1, 3600);
        } else if (server && a == "--seconds") {
            seconds = number(value(), 1, 86'400);
        } else {
            usage(a == "-h" || a == "--help" ? 0 : 2);
        }
    }
    if (!have_addr || (!server && addr.sin_port == 0)) usage(2);
    ::signal(SIGPIPE, SIG_IGN);
    (void)pattern();  // built once, before any timing or thread

    if (server) {
        struct sigaction sa {};
        sa.sa_handler = onSignal;  // no SA_RESTART: poll() returns EINTR and the loop sees it
        ::sigaction(SIGTERM, &sa, nullptr);
        ::sigaction(SIGINT, &sa, nullptr);
        ServerOpts opts;
        opts.reply_bytes = static_cast<uint64_t>(reply_mib) * kMiB;
        opts.reply_delay_ms = delay_ms;
        opts.timeout_s = timeout_s;
        return runServer(addr, opts, seconds);
    }
    return runClient(addr, static_cast<uint64_t>(size_mib) * kMiB,
                     static_cast<uint64_t>(reply_mib) * kMiB, timeout_s);
}
