// send_zc_probe: do zero-copy send and recv bundles pay over the plain ops on this kernel?
//
// zcrelay's copy mode moves bytes with plain IORING_OP_SEND and IORING_OP_RECV (one provided
// buffer per CQE). The kernel offers two ways to do less work per byte or per completion:
//   IORING_OP_SEND_ZC (6.0)  pins the user pages and attaches them to the skbs instead of
//       copying them. The buffer stays the kernel's until a second CQE, the notification
//       (IORING_CQE_F_NOTIF), says the stack let go of it; with IORING_SEND_ZC_REPORT_USAGE the
//       notification's res has IORING_NOTIF_USAGE_ZC_COPIED set when the kernel copied after all.
//       Over loopback it always does: an skb delivered to a local socket may sit in its receive
//       queue for ever, so the receive path copies zerocopy frags (skb_orphan_frags_rx) before
//       queueing them (Documentation/networking/msg_zerocopy.rst, "Loopback"). Pinning plus a
//       notification per send is then pure overhead on top of the copy; this probe says how much.
//   IORING_RECVSEND_BUNDLE (6.10) lets one recv fill several provided buffers and post one CQE
//       for all of them, so a backlog costs one completion (and one submit) instead of many.
//
// A TCP pair over 127.0.0.1; the sender pinned to CPU 1, the receiver to CPU 0 (--no-pin).
// Variants, one JSON line each on stdout:
//   send         sender: io_uring send, one in flight; receiver: blocking recv(2), discards
//   send_zc      sender: IORING_OP_SEND_ZC, up to --inflight outstanding from a buffer pool;
//                counts notifications and how many report ZC_COPIED
//   recv_bundle  reverse: sender is blocking send(2); receiver an io_uring recv from a provided
//                buffer ring (32 x 64 KiB), mode "single" (one buffer per CQE) and "bundle"
// Rates use wall time from go to both threads done; CPU is RUSAGE_THREAD per side and
// RUSAGE_SELF for the process, in seconds per 1e9 bytes. The receiver must count exactly
// --bytes or the probe exits 1. A 120 s alarm ends the process if a side stops, so it cannot hang.
//
// Options: --bytes N (1 GiB) --chunk N (65536) --inflight N (1, send_zc only)
//          --variant send|send_zc|recv_bundle|all (all) --no-pin

#include <liburing.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "bench_util.hpp"
#include "probe_ring.hpp"

// liburing 2.3's own copy of the uapi header predates these; values from Linux's
// include/uapi/linux/io_uring.h.
#ifndef IORING_SEND_ZC_REPORT_USAGE
#define IORING_SEND_ZC_REPORT_USAGE (1U << 3)  // 6.2: notification res reports a copy
#endif
#ifndef IORING_NOTIF_USAGE_ZC_COPIED
#define IORING_NOTIF_USAGE_ZC_COPIED (1U << 31)
#endif
#ifndef IORING_RECVSEND_BUNDLE
#define IORING_RECVSEND_BUNDLE (1U << 4)  // 6.10
#endif

namespace {

constexpr uint64_t kDefaultBytes = 1ull << 30;
constexpr uint32_t kDefaultChunk = 65536;
constexpr uint32_t kMaxInflight = 32;
constexpr uint32_t kZcPool = 8;        // buffers, or --inflight if larger
constexpr unsigned kRingEntries = 64;  // CQ gets 128: room for kMaxInflight sends + their notifs
constexpr uint32_t kRecvBufs = 32;     // power of two, as a buffer ring must be
constexpr uint32_t kRecvBufSize = 65536;
constexpr uint16_t kBufGroup = 0;
constexpr unsigned kHardLimitSeconds = 120;

using bench::cpuNs;
using bench::nowNs;

[[noreturn]] void die(const char* what, int err) { bench::failWith("send_zc_probe", what, err); }
void pinTo(int cpu) { bench::pinOrFail("send_zc_probe", cpu); }

struct Options {
    uint64_t bytes = kDefaultBytes;
    uint32_t chunk = kDefaultChunk;
    uint32_t inflight = 1;
    std::string_view variant = "all";
    bool pin = true;
};

// Anonymous, page-aligned and touched up front: page faults stay out of the measurement.
char* mapBytes(size_t n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_ANONYMOUS | MAP_PRIVATE, -1, 0);
    if (p == MAP_FAILED) die("mmap", errno);
    std::memset(p, 'z', n);
    return static_cast<char*>(p);
}

// The probe's ring, as zcrelay's workers make theirs (bench/probe_ring.hpp).
struct Ring : bench::ProbeRing {
    Ring() : ProbeRing(kRingEntries, die) {}
};

// Both sides set up (ring, buffers) before the clock starts, then wait here for main's go.
struct Gate {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    void wait() {
        ready.fetch_add(1, std::memory_order_acq_rel);
        while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
    }
};

struct Stats {
    int64_t tx_cpu_ns = 0, rx_cpu_ns = 0, proc_cpu_ns = 0, wall_ns = 0;
    uint64_t received = 0;
    uint64_t sends = 0, short_sends = 0, notifs = 0, zc_copied = 0;  // ring sender
    uint64_t recv_cqes = 0, recv_bufs = 0, enobufs = 0;              // ring receiver
};

// Sender over a ring: plain send (pool 1, one in flight) or SEND_ZC. A buffer is lent to the
// kernel from its send until that send's CQE and, for ZC, its notification: only then may a
// relay refill it, so the pool (not the socket) is what bounds how much ZC keeps in flight.
// Concurrent sends on one TCP socket may interleave after a short send; the receiver only
// counts bytes, so that does not matter here (a relay would have to order them).
void ringSender(int fd, bool zc, const Options& opt, Gate& gate, Stats& st) {
    Ring ring;
    const uint32_t pool = zc ? std::max(kZcPool, opt.inflight) : 1;
    const uint32_t max_inflight = zc ? opt.inflight : 1;
    struct Slot {
        char* data;
        uint32_t len = 0, done = 0, notifs = 0;
        bool sending = false;
    };
    char* mem = mapBytes(size_t{pool} * opt.chunk);
    std::vector<Slot> slots(pool);
    std::vector<uint32_t> free_slots;
    for (uint32_t i = pool; i-- > 0;) {
        slots[i].data = mem + size_t{i} * opt.chunk;
        free_slots.push_back(i);
    }
    std::deque<uint32_t> resend;  // slots whose last send was short
    uint64_t unassigned = opt.bytes;
    uint32_t inflight = 0;

    gate.wait();
    const int64_t cpu0 = cpuNs(RUSAGE_THREAD);
    while (unassigned > 0 || free_slots.size() < pool) {
        while (inflight < max_inflight) {
            uint32_t i;
            if (!resend.empty()) {
                i = resend.front();
                resend.pop_front();
            } else if (unassigned > 0 && !free_slots.empty()) {
                i = free_slots.back();
                free_slots.pop_back();
                slots[i].len = static_cast<uint32_t>(std::min<uint64_t>(unassigned, opt.chunk));
                slots[i].done = 0;
                unassigned -= slots[i].len;
            } else {
                break;
            }
            Slot& s = slots[i];
            io_uring_sqe* sqe = ring.sqe();
            if (zc)
                io_uring_prep_send_zc(sqe, fd, s.data + s.done, s.len - s.done, MSG_NOSIGNAL,
                                      IORING_SEND_ZC_REPORT_USAGE);
            else
                io_uring_prep_send(sqe, fd, s.data + s.done, s.len - s.done, MSG_NOSIGNAL);
            // The notification carries the same user_data as its send: the slot index.
            io_uring_sqe_set_data64(sqe, i);
            s.sending = true;
            ++inflight;
            ++st.sends;
        }
        ring.submitAndWait();
        io_uring_cqe* cqe;
        unsigned head, n = 0;
        io_uring_for_each_cqe(ring.raw(), head, cqe) {
            ++n;
            const uint32_t i = static_cast<uint32_t>(cqe->user_data);
            Slot& s = slots[i];
            if (cqe->flags & IORING_CQE_F_NOTIF) {
                --s.notifs;
                ++st.notifs;
                if (static_cast<uint32_t>(cqe->res) & IORING_NOTIF_USAGE_ZC_COPIED) ++st.zc_copied;
            } else {
                --inflight;
                s.sending = false;
                if (cqe->res < 0) die(zc ? "IORING_OP_SEND_ZC" : "IORING_OP_SEND", -cqe->res);
                // F_MORE: a notification for this send will follow. Only the flag says so (a
                // send that failed early gets none), so count on it, not on the opcode.
                if (cqe->flags & IORING_CQE_F_MORE) ++s.notifs;
                s.done += static_cast<uint32_t>(cqe->res);
                if (s.done < s.len) {
                    ++st.short_sends;
                    resend.push_back(i);
                }
            }
            if (!s.sending && s.notifs == 0 && s.done == s.len) {
                s.len = s.done = 0;
                free_slots.push_back(i);
            }
        }
        io_uring_cq_advance(ring.raw(), n);
    }
    st.tx_cpu_ns = cpuNs(RUSAGE_THREAD) - cpu0;
    if (::shutdown(fd, SHUT_WR) < 0) die("shutdown", errno);
    ::munmap(mem, size_t{pool} * opt.chunk);
}

// Plain blocking recv(2) until EOF, counting and discarding.
void plainReceiver(int fd, Gate& gate, Stats& st) {
    char* buf = mapBytes(kRecvBufSize);
    gate.wait();
    const int64_t cpu0 = cpuNs(RUSAGE_THREAD);
    for (;;) {
        ssize_t r = ::recv(fd, buf, kRecvBufSize, 0);
        if (r == 0) break;
        if (r < 0) {
            if (errno == EINTR) continue;
            die("recv", errno);
        }
        st.received += static_cast<uint64_t>(r);
    }
    st.rx_cpu_ns = cpuNs(RUSAGE_THREAD) - cpu0;
    ::munmap(buf, kRecvBufSize);
}

// Plain blocking send(2) of --bytes from one buffer, then SHUT_WR.
void plainSender(int fd, const Options& opt, Gate& gate, Stats& st) {
    char* buf = mapBytes(opt.chunk);
    gate.wait();
    const int64_t cpu0 = cpuNs(RUSAGE_THREAD);
    for (uint64_t left = opt.bytes; left > 0;) {
        ssize_t w = ::send(fd, buf, std::min<uint64_t>(left, opt.chunk), MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            die("send", errno);
        }
        left -= static_cast<uint64_t>(w);
    }
    st.tx_cpu_ns = cpuNs(RUSAGE_THREAD) - cpu0;
    if (::shutdown(fd, SHUT_WR) < 0) die("shutdown", errno);
    ::munmap(buf, opt.chunk);
}

// Ring receiver: one recv at a time, buffers picked by the kernel from a provided buffer ring.
// Single: a CQE names one buffer. Bundle: a CQE covers res bytes over consecutive ring entries
// from the bid in its flags, each filled whole except the last. Every buffer goes back at the
// tail in the order taken, so ring entry p always holds bid p % kRecvBufs and consecutive
// entries mean consecutive bids (mod kRecvBufs).
void ringReceiver(int fd, bool bundle, Gate& gate, Stats& st) {
    Ring ring;
    // liburing 2.3 has no io_uring_setup_buf_ring: map and register the ring ourselves, as
    // proxy/uring/buf_ring.cpp does.
    const size_t ring_bytes = kRecvBufs * sizeof(io_uring_buf);
    auto* br = reinterpret_cast<io_uring_buf_ring*>(mapBytes(ring_bytes));
    char* base = mapBytes(size_t{kRecvBufs} * kRecvBufSize);
    io_uring_buf_ring_init(br);
    io_uring_buf_reg reg{};
    reg.ring_addr = reinterpret_cast<uint64_t>(br);
    reg.ring_entries = kRecvBufs;
    reg.bgid = kBufGroup;
    if (int rc = io_uring_register_buf_ring(ring.raw(), &reg, 0); rc < 0)
        die("io_uring_register_buf_ring", -rc);
    const int mask = io_uring_buf_ring_mask(kRecvBufs);
    for (uint32_t b = 0; b < kRecvBufs; ++b)
        io_uring_buf_ring_add(br, base + size_t{b} * kRecvBufSize, kRecvBufSize,
                              static_cast<uint16_t>(b), mask, static_cast<int>(b));
    io_uring_buf_ring_advance(br, kRecvBufs);

    gate.wait();
    const int64_t cpu0 = cpuNs(RUSAGE_THREAD);
    for (bool eof = false; !eof;) {
        io_uring_sqe* sqe = ring.sqe();
        // len 0: a single recv takes one whole buffer; a bundle is bounded only by the buffers
        // the ring holds and the data queued on the socket.
        io_uring_prep_recv(sqe, fd, nullptr, 0, 0);
        sqe->flags |= IOSQE_BUFFER_SELECT;
        sqe->buf_group = kBufGroup;
        if (bundle) sqe->ioprio |= IORING_RECVSEND_BUNDLE;
        ring.submitAndWait();
        io_uring_cqe* cqe;
        unsigned head, n = 0;
        io_uring_for_each_cqe(ring.raw(), head, cqe) {
            ++n;
            ++st.recv_cqes;
            const int res = cqe->res;
            if (res == 0) {
                eof = true;
                continue;
            }
            if (res == -ENOBUFS) {  // flow control, not an error; cannot happen while we
                ++st.enobufs;       // recycle every buffer before the next recv
                continue;
            }
            if (res < 0)
                die(bundle ? "IORING_OP_RECV with IORING_RECVSEND_BUNDLE" : "IORING_OP_RECV", -res);
            if (!(cqe->flags & IORING_CQE_F_BUFFER)) die("recv CQE without a buffer", EPROTO);
            const uint32_t bid = cqe->flags >> IORING_CQE_BUFFER_SHIFT;
            const uint32_t nbufs = (static_cast<uint32_t>(res) + kRecvBufSize - 1) / kRecvBufSize;
            if (!bundle && nbufs != 1) die("single recv spanned buffers", EPROTO);
            for (uint32_t k = 0; k < nbufs; ++k) {
                uint32_t b = (bid + k) % kRecvBufs;
                io_uring_buf_ring_add(br, base + size_t{b} * kRecvBufSize, kRecvBufSize,
                                      static_cast<uint16_t>(b), mask, static_cast<int>(k));
            }
            io_uring_buf_ring_advance(br, static_cast<int>(nbufs));
            st.recv_bufs += nbufs;
            st.received += static_cast<uint64_t>(res);
        }
        io_uring_cq_advance(ring.raw(), n);
    }
    st.rx_cpu_ns = cpuNs(RUSAGE_THREAD) - cpu0;
    io_uring_unregister_buf_ring(ring.raw(), kBufGroup);
    ::munmap(base, size_t{kRecvBufs} * kRecvBufSize);
    ::munmap(br, ring_bytes);
}

// A connected TCP pair over loopback: {sending end, receiving end}.
std::pair<int, int> tcpPair() {
    int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0) die("socket", errno);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof a;
    if (::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) < 0) die("bind", errno);
    if (::listen(lfd, 1) < 0) die("listen", errno);
    if (::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &alen) < 0) die("getsockname", errno);
    int cfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (cfd < 0) die("socket", errno);
    if (::connect(cfd, reinterpret_cast<sockaddr*>(&a), sizeof a) < 0) die("connect", errno);
    int sfd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (sfd < 0) die("accept4", errno);
    ::close(lfd);
    return {cfd, sfd};
}

// Runs tx(fd, gate, stats) on CPU 1 and rx(fd, gate, stats) on CPU 0 over a fresh pair; the
// clock and the process CPU start once both have set up.
template <class Tx, class Rx>
Stats measure(bool pin, Tx tx, Rx rx) {
    auto [txfd, rxfd] = tcpPair();
    Stats st;
    Gate gate;
    std::thread r([&] {
        if (pin) pinTo(0);
        rx(rxfd, gate, st);
    });
    std::thread t([&] {
        if (pin) pinTo(1);
        tx(txfd, gate, st);
    });
    while (gate.ready.load(std::memory_order_acquire) < 2) std::this_thread::yield();
    const int64_t proc0 = cpuNs(RUSAGE_SELF), t0 = nowNs();
    gate.go.store(true, std::memory_order_release);
    t.join();
    r.join();
    st.wall_ns = nowNs() - t0;
    st.proc_cpu_ns = cpuNs(RUSAGE_SELF) - proc0;
    ::close(txfd);
    ::close(rxfd);
    return st;
}

void checkTotal(const char* probe, const Stats& st, uint64_t want) {
    if (st.received == want) return;
    std::fprintf(stderr, "send_zc_probe: %s: received %" PRIu64 " of %" PRIu64 " bytes\n", probe,
                 st.received, want);
    std::exit(1);
}

// The fields every line shares: rate and CPU seconds per 1e9 bytes.
void printCommon(const Stats& st, const Options& opt) {
    const double gb = static_cast<double>(opt.bytes) / 1e9;
    std::printf(
        "\"bytes\":%" PRIu64
        ",\"chunk\":%u,\"pinned\":%s,\"seconds\":%.4f,\"bytes_per_s\":%.0f,"
        "\"sender_cpu_s_per_gb\":%.4f,\"receiver_cpu_s_per_gb\":%.4f,\"process_cpu_s_per_gb\":%.4f",
        opt.bytes, opt.chunk, opt.pin ? "true" : "false", st.wall_ns / 1e9,
        static_cast<double>(opt.bytes) / (st.wall_ns / 1e9), st.tx_cpu_ns / 1e9 / gb,
        st.rx_cpu_ns / 1e9 / gb, st.proc_cpu_ns / 1e9 / gb);
}

void runSend(bool zc, const Options& opt) {
    const char* probe = zc ? "send_zc" : "send";
    Stats st = measure(
        opt.pin, [&](int fd, Gate& g, Stats& s) { ringSender(fd, zc, opt, g, s); },
        [](int fd, Gate& g, Stats& s) { plainReceiver(fd, g, s); });
    checkTotal(probe, st, opt.bytes);
    std::printf("{\"probe\":\"%s\",\"inflight\":%u,", probe, zc ? opt.inflight : 1);
    printCommon(st, opt);
    std::printf(",\"sends\":%" PRIu64 ",\"short_sends\":%" PRIu64 ",\"notifs\":%" PRIu64
                ",\"zc_copied\":%" PRIu64 "}\n",
                st.sends, st.short_sends, st.notifs, st.zc_copied);
    std::fflush(stdout);
}

void runRecv(bool bundle, const Options& opt) {
    Stats st = measure(
        opt.pin, [&](int fd, Gate& g, Stats& s) { plainSender(fd, opt, g, s); },
        [&](int fd, Gate& g, Stats& s) { ringReceiver(fd, bundle, g, s); });
    checkTotal("recv_bundle", st, opt.bytes);
    std::printf("{\"probe\":\"recv_bundle\",\"mode\":\"%s\",\"bufs\":%u,\"buf_size\":%u,",
                bundle ? "bundle" : "single", kRecvBufs, kRecvBufSize);
    printCommon(st, opt);
    const double cqes = static_cast<double>(st.recv_cqes);
    std::printf(",\"recv_cqes\":%" PRIu64
                ",\"cqes_per_mb\":%.3f,\"bufs_per_cqe\":%.3f,"
                "\"enobufs\":%" PRIu64 "}\n",
                st.recv_cqes, cqes / (static_cast<double>(opt.bytes) / 1e6),
                cqes > 0 ? static_cast<double>(st.recv_bufs) / cqes : 0, st.enobufs);
    std::fflush(stdout);
}

void onAlarm(int) {
    static const char msg[] = "send_zc_probe: hard time limit reached, a side stopped\n";
    ssize_t ignored = ::write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)ignored;
    ::_exit(3);
}

[[noreturn]] void usage(int code) {
    std::fprintf(stderr,
                 "usage: send_zc_probe [--bytes N (%llu)] [--chunk N (%u)] [--inflight N (1..%u)]"
                 " [--variant send|send_zc|recv_bundle|all] [--no-pin]\n",
                 static_cast<unsigned long long>(kDefaultBytes), kDefaultChunk, kMaxInflight);
    std::exit(code);
}

Options parseArgs(int argc, char** argv) {
    Options o;
    auto num = [&](int& i, unsigned long long lo, unsigned long long hi) {
        if (i + 1 >= argc) usage(2);
        char* end = nullptr;
        errno = 0;
        unsigned long long v = std::strtoull(argv[++i], &end, 10);
        if (errno != 0 || *end != '\0' || v < lo || v > hi) {
            std::fprintf(stderr, "send_zc_probe: %s out of range [%llu, %llu]\n", argv[i - 1], lo,
                         hi);
            std::exit(2);
        }
        return v;
    };
    for (int i = 1; i < argc; ++i) {
        std::string_view a = argv[i];
        if (a == "--bytes") {
            o.bytes = num(i, 1, 1ull << 40);
        } else if (a == "--chunk") {
            o.chunk = static_cast<uint32_t>(num(i, 1, 64u << 20));
        } else if (a == "--inflight") {
            o.inflight = static_cast<uint32_t>(num(i, 1, kMaxInflight));
        } else if (a == "--variant" && i + 1 < argc) {
            o.variant = argv[++i];
            if (o.variant != "send" && o.variant != "send_zc" && o.variant != "recv_bundle" &&
                o.variant != "all")
                usage(2);
        } else if (a == "--no-pin") {
            o.pin = false;
        } else {
            usage(a == "-h" || a == "--help" ? 0 : 2);
        }
    }
    return o;
}

}  // namespace

int main(int argc, char** argv) {
    Options opt = parseArgs(argc, argv);
    ::signal(SIGALRM, onAlarm);
    ::alarm(kHardLimitSeconds);
    if (opt.pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        if (::sched_getaffinity(0, sizeof set, &set) != 0 || !CPU_ISSET(0, &set) ||
            !CPU_ISSET(1, &set)) {
            std::fprintf(stderr,
                         "send_zc_probe: CPUs 0 and 1 are not both available; not pinning\n");
            opt.pin = false;
        }
    }
    const bool all = opt.variant == "all";
    if (all || opt.variant == "send") runSend(false, opt);
    if (all || opt.variant == "send_zc") runSend(true, opt);
    if (all || opt.variant == "recv_bundle") {
        runRecv(false, opt);
        runRecv(true, opt);
    }
    return 0;
}
