// msg_ring_probe: what handing a connection from one ring to another costs.
//
// The acceptor design (one thread accepts, then passes each socket to a worker's ring with
// IORING_OP_MSG_RING) adds, per connection, one message from the acceptor's ring to a worker's
// ring, and usually one wake-up of that worker. This probe measures that message in isolation:
// two threads, each with its own ring set up the way zcrelay's workers set theirs up
// (SINGLE_ISSUER | DEFER_TASKRUN, created on the thread that uses it), play ping-pong:
//
//   A: msg_ring(B, seq) + wait ----------------> B: wait -> CQE(seq)
//   A: CQE(seq) <------------------------------- B: msg_ring(A, seq) + wait
//
// Both sides block in io_uring_enter between messages, so every message includes the wake-up
// of a sleeping thread: the worst case, and the one an idle or lightly loaded worker sees. The
// one-way latency is RTT / 2. CPU time (RUSAGE_THREAD, both threads) per message is reported as
// well, since for a busy relay the CPU a hand-off burns matters more than its latency.
//
// Variants, one JSON line each on stdout:
//   msg_ring         ping-pong, cross-CPU (A on CPU 0, B on CPU 1) and same-CPU (both on CPU 0)
//   msg_ring_burst   A sends 16 messages in one submit, B replies once after all 16 arrived:
//                    how the cost amortises when an acceptor batches its hand-offs (cross-CPU)
//   eventfd          the same ping-pong over two eventfds with blocking read(2)/write(2): what a
//                    hand-off through a plain wake-up primitive costs, for comparison
//
// Options: --iters N (100000) --warmup N (1000). A 120 s alarm ends the process if a peer ever
// stops answering, so it cannot hang.

#include <liburing.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
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
#include "probe_ring.hpp"

namespace {

constexpr uint32_t kDefaultIters = 100'000;
constexpr uint32_t kDefaultWarmup = 1'000;
constexpr uint32_t kBurst = 16;
constexpr unsigned kHardLimitSeconds = 120;
constexpr unsigned kRingEntries = 64;  // >= kBurst, and room for the CQEs of one burst

// user_data of the CQE the target ring gets: tells a peer's message from anything else.
constexpr uint64_t kMsgTag = 0x6d73672d72696e67;  // "msg-ring"
// user_data of the sender's own msg_ring SQE. With IOSQE_CQE_SKIP_SUCCESS it only ever shows
// up on failure, which is exactly when we want to see it.
constexpr uint64_t kSendTag = 1;

using bench::nowNs;

int64_t threadCpuNs() { return bench::cpuNs(RUSAGE_THREAD); }

[[noreturn]] void die(const char* what, int err) { bench::failWith("msg_ring_probe", what, err); }
void pinTo(int cpu) { bench::pinOrFail("msg_ring_probe", cpu); }

struct Options {
    uint32_t iters = kDefaultIters;
    uint32_t warmup = kDefaultWarmup;
};

struct Result {
    std::vector<uint32_t> rtt_ns;  // one per measured round trip (on A)
    int64_t cpu_ns_a = 0;
    int64_t cpu_ns_b = 0;
};

// The probe's ring (bench/probe_ring.hpp) and the messages it sends and takes.
class Ring : public bench::ProbeRing {
  public:
    Ring() : ProbeRing(kRingEntries, die) {}

    // Queue one message for the ring `target_fd`: its CQE will carry res = seq, user_data = kMsgTag.
    void queueMsg(int target_fd, uint32_t seq) {
        io_uring_sqe* s = sqe();
        io_uring_prep_msg_ring(s, target_fd, seq, kMsgTag, 0);
        io_uring_sqe_set_data64(s, kSendTag);
        s->flags |= IOSQE_CQE_SKIP_SUCCESS;
    }

    // Take every ready CQE; each must be a peer message. Returns how many, and the last seq.
    unsigned reap(uint32_t* last_seq) {
        unsigned n = 0;
        io_uring_cqe* cqe;
        unsigned head;
        io_uring_for_each_cqe(raw(), head, cqe) {
            if (cqe->user_data != kMsgTag)
                die("msg_ring send failed", cqe->res < 0 ? -cqe->res : EPROTO);
            *last_seq = static_cast<uint32_t>(cqe->res);
            ++n;
        }
        io_uring_cq_advance(raw(), n);
        return n;
    }

    // Block until `count` peer messages have arrived (submitting anything queued first).
    uint32_t waitFor(unsigned count) {
        uint32_t seq = 0;
        unsigned got = 0;
        while (got < count) {
            got += reap(&seq);
            if (got < count) submitAndWait();
        }
        return seq;
    }
};

// Hands each thread the other's ring fd once both rings exist.
struct Rendezvous {
    std::atomic<int> fd_a{-1};
    std::atomic<int> fd_b{-1};
    static int await(const std::atomic<int>& fd) {
        int v;
        // Bounded by the process alarm; yields so a same-CPU peer gets to run.
        while ((v = fd.load(std::memory_order_acquire)) < 0) std::this_thread::yield();
        return v;
    }
};

Result runMsgRing(int cpu_a, int cpu_b, uint32_t burst, const Options& opt) {
    Result res;
    res.rtt_ns.reserve(opt.iters);
    Rendezvous rv;
    const uint32_t total = opt.warmup + opt.iters;

    std::thread b([&] {
        pinTo(cpu_b);
        Ring ring;
        rv.fd_b.store(ring.fd(), std::memory_order_release);
        int peer = Rendezvous::await(rv.fd_a);
        int64_t cpu0 = 0;
        for (uint32_t i = 0; i < total; ++i) {
            if (i == opt.warmup) cpu0 = threadCpuNs();
            // The reply to the previous round goes out in the same enter that waits for this one.
            uint32_t seq = ring.waitFor(burst);
            ring.queueMsg(peer, seq);
        }
        ring.submit();
        res.cpu_ns_b = threadCpuNs() - cpu0;
    });

    pinTo(cpu_a);
    {
        Ring ring;
        rv.fd_a.store(ring.fd(), std::memory_order_release);
        int peer = Rendezvous::await(rv.fd_b);
        int64_t cpu0 = 0;
        for (uint32_t i = 0; i < total; ++i) {
            if (i == opt.warmup) cpu0 = threadCpuNs();
            int64_t t0 = nowNs();
            for (uint32_t k = 0; k < burst; ++k) ring.queueMsg(peer, i);
            uint32_t seq = ring.waitFor(1);
            int64_t t1 = nowNs();
            if (seq != i) die("reply out of order", EPROTO);
            if (i >= opt.warmup)
                res.rtt_ns.push_back(static_cast<uint32_t>(std::min<int64_t>(t1 - t0, UINT32_MAX)));
        }
        res.cpu_ns_a = threadCpuNs() - cpu0;
        // The ring must outlive B's last message to it: B is done once join returns.
        b.join();
    }
    return res;
}

Result runEventfd(int cpu_a, int cpu_b, const Options& opt) {
    Result res;
    res.rtt_ns.reserve(opt.iters);
    // Blocking eventfds: each read sleeps until the peer's write wakes it, as a thread parked
    // on a condition would.
    int ab = ::eventfd(0, EFD_CLOEXEC);
    int ba = ::eventfd(0, EFD_CLOEXEC);
    if (ab < 0 || ba < 0) die("eventfd", errno);
    const uint32_t total = opt.warmup + opt.iters;
    auto put = [](int fd) {
        uint64_t one = 1;
        if (::write(fd, &one, sizeof one) != sizeof one) die("eventfd write", errno);
    };
    auto take = [](int fd) {
        uint64_t v;
        while (::read(fd, &v, sizeof v) != sizeof v) {
            if (errno != EINTR) die("eventfd read", errno);
        }
    };

    std::thread b([&] {
        pinTo(cpu_b);
        int64_t cpu0 = 0;
        for (uint32_t i = 0; i < total; ++i) {
            if (i == opt.warmup) cpu0 = threadCpuNs();
            take(ab);
            put(ba);
        }
        res.cpu_ns_b = threadCpuNs() - cpu0;
    });

    pinTo(cpu_a);
    int64_t cpu0 = 0;
    for (uint32_t i = 0; i < total; ++i) {
        if (i == opt.warmup) cpu0 = threadCpuNs();
        int64_t t0 = nowNs();
        put(ab);
        take(ba);
        int64_t t1 = nowNs();
        if (i >= opt.warmup)
            res.rtt_ns.push_back(static_cast<uint32_t>(std::min<int64_t>(t1 - t0, UINT32_MAX)));
    }
    res.cpu_ns_a = threadCpuNs() - cpu0;
    b.join();
    ::close(ab);
    ::close(ba);
    return res;
}

double percentileNs(std::vector<uint32_t>& v, double q) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    size_t rank = std::min(static_cast<size_t>(q * static_cast<double>(v.size())), v.size() - 1);
    return v[rank];
}

double meanNs(const std::vector<uint32_t>& v) {
    if (v.empty()) return 0;
    double s = 0;
    for (uint32_t x : v) s += x;
    return s / static_cast<double>(v.size());
}

const char* placement(int cpu_a, int cpu_b) { return cpu_a == cpu_b ? "same_cpu" : "cross_cpu"; }

// Ping-pong: every message is one one-way trip, so one-way = RTT / 2 and each thread's CPU
// covers one send and one receive per round trip.
void printPingPong(const char* probe, int cpu_a, int cpu_b, Result& r) {
    double n = static_cast<double>(r.rtt_ns.size());
    double cpu_per_msg_us =
        n > 0 ? static_cast<double>(r.cpu_ns_a + r.cpu_ns_b) / (2 * n) / 1e3 : 0;
    double mean = meanNs(r.rtt_ns);
    double p50 = percentileNs(r.rtt_ns, 0.50);
    double p99 = percentileNs(r.rtt_ns, 0.99);
    std::printf(
        "{\"probe\":\"%s\",\"placement\":\"%s\",\"cpu_a\":%d,\"cpu_b\":%d,\"round_trips\":%zu,"
        "\"one_way_p50_us\":%.2f,\"one_way_p99_us\":%.2f,\"one_way_mean_us\":%.2f,\"cpu_us_per_"
        "msg\":%.2f}\n",
        probe, placement(cpu_a, cpu_b), cpu_a, cpu_b, r.rtt_ns.size(), p50 / 2e3, p99 / 2e3,
        mean / 2e3, cpu_per_msg_us);
    std::fflush(stdout);
}

// Burst: kBurst messages A -> B and one reply per round trip; per-message figures divide the
// round trip (and the CPU of both threads) by kBurst, so the reply is amortised into them.
void printBurst(int cpu_a, int cpu_b, Result& r) {
    double n = static_cast<double>(r.rtt_ns.size());
    double cpu_per_msg_us =
        n > 0 ? static_cast<double>(r.cpu_ns_a + r.cpu_ns_b) / (kBurst * n) / 1e3 : 0;
    double p50 = percentileNs(r.rtt_ns, 0.50);
    double p99 = percentileNs(r.rtt_ns, 0.99);
    std::printf(
        "{\"probe\":\"msg_ring_burst\",\"placement\":\"%s\",\"cpu_a\":%d,\"cpu_b\":%d,\"burst\":%u,"
        "\"round_trips\":%zu,\"rtt_p50_us\":%.2f,\"rtt_p99_us\":%.2f,\"per_msg_p50_us\":%.3f,"
        "\"cpu_us_per_msg\":%.3f}\n",
        placement(cpu_a, cpu_b), cpu_a, cpu_b, kBurst, r.rtt_ns.size(), p50 / 1e3, p99 / 1e3,
        p50 / kBurst / 1e3, cpu_per_msg_us);
    std::fflush(stdout);
}

void onAlarm(int) {
    static const char msg[] = "msg_ring_probe: hard time limit reached, a peer stopped answering\n";
    ssize_t ignored = ::write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)ignored;
    ::_exit(3);
}

Options parseArgs(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        std::string_view a = argv[i];
        if ((a == "--iters" || a == "--warmup") && i + 1 < argc) {
            long v = std::strtol(argv[++i], nullptr, 10);
            if (v < (a == "--iters" ? 1 : 0) || v > 10'000'000) {
                std::fprintf(stderr, "msg_ring_probe: %s out of range\n", argv[i - 1]);
                std::exit(2);
            }
            (a == "--iters" ? o.iters : o.warmup) = static_cast<uint32_t>(v);
        } else {
            std::fprintf(stderr, "usage: msg_ring_probe [--iters N (%u)] [--warmup N (%u)]\n",
                         kDefaultIters, kDefaultWarmup);
            std::exit(a == "-h" || a == "--help" ? 0 : 2);
        }
    }
    return o;
}

}  // namespace

int main(int argc, char** argv) {
    Options opt = parseArgs(argc, argv);
    ::signal(SIGALRM, onAlarm);
    ::alarm(kHardLimitSeconds);

    bool two_cpus = false;
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        two_cpus = ::sched_getaffinity(0, sizeof set, &set) == 0 && CPU_ISSET(0, &set) &&
                   CPU_ISSET(1, &set);
    }
    if (!two_cpus)
        std::fprintf(
            stderr,
            "msg_ring_probe: CPUs 0 and 1 are not both available; skipping cross-CPU variants\n");

    struct Placement {
        int a, b;
    };
    std::vector<Placement> placements;
    if (two_cpus) placements.push_back({0, 1});
    placements.push_back({0, 0});

    for (const Placement& p : placements) {
        Result r = runMsgRing(p.a, p.b, 1, opt);
        printPingPong("msg_ring", p.a, p.b, r);
    }
    if (two_cpus) {
        Result r = runMsgRing(0, 1, kBurst, opt);
        printBurst(0, 1, r);
    }
    for (const Placement& p : placements) {
        Result r = runEventfd(p.a, p.b, opt);
        printPingPong("eventfd", p.a, p.b, r);
    }
    return 0;
}
