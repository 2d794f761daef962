// Sockmap and the sockmap_pump functions on real loopback TCP sockets, with no relay process:
// each kernel behaviour the sockmap data path relies on (pump/sockmap_pump.hpp lists them, as
// measured on this kernel) reproduced and
// checked, with byte-exact payloads and the program's own counters (zcr_sock_stats) as the
// oracle.
//
// Every test builds the relay's view of one connection:
//
//   C (client) ──TCP── A (conn.fd[0])   [relay]   B (conn.fd[1]) ──TCP── U (upstream)
//
// A and B are nonblocking, as the relay's sockets are; C and U are the two peers. Direction 0
// (C -> U) uses record index_base, direction 1 (U -> C) index_base + 1. Where user space has a
// part in the data path (moving passed bytes, the FIN barrier), the test does what the worker
// does, with the same sockmap_pump functions.
//
// Needs CAP_BPF + CAP_NET_ADMIN: skipped (with the reason) unless root, and a load that fails as
// root is a failure, not a skip. Every case runs with both attach points; with no stream parser
// they reach the same kernel path (sockmap.hpp), and these tests are where that is checked.
#include "sockmap.hpp"

#include <bpf/bpf.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <linux/sockios.h>
#include <linux/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "conn.hpp"
#include "pump/sockmap_pump.hpp"
#include "support/loopback.hpp"

namespace zcrelay {

// Test names and failure messages show the attach point, not "1-byte object <00>". Outside the
// unnamed namespace: gtest finds it by argument-dependent lookup in Sockmap's namespace.
void PrintTo(Sockmap::Attach a, std::ostream* os) {
    *os << (a == Sockmap::Attach::StreamVerdict ? "StreamVerdict" : "SkbVerdict");
}

namespace {

using namespace std::chrono_literals;
using test::Clock;
using test::Fd;
using test::IoResult;
using test::IoStatus;
using test::Millis;
using test::PayloadVerifier;

constexpr uint32_t kCapacity = 4096;  // records, i.e. sockets: two per pair
constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
// The in-flight bound the worker gives each direction with the default pipe_size (1 MiB):
// 4 x pipe_size. Tests whose point is elsewhere, and that must not meet the bound, use
// kUnbounded.
constexpr uint64_t kLimit = 4 * kMiB;
constexpr uint64_t kUnbounded = uint64_t{1} << 40;
constexpr uint64_t kSeedUp = 0xC11E;    // C -> U
constexpr uint64_t kSeedDown = 0x0B57;  // U -> C

// tcpi_state values (include/net/tcp_states.h is not UAPI).
constexpr uint8_t kTcpEstablished = 1;
constexpr uint8_t kTcpCloseWait = 8;

// ---------------------------------------------------------------------------------------------
// Looking at the kernel from outside.

tcp_info tcpInfo(int fd) {
    tcp_info info{};
    socklen_t len = sizeof info;
    ::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len);
    return info;
}

// What `fd` has taken into its send queue, by its own TCP_INFO: the dst half of the barrier's
// formula, read without going through checkQueued().
uint64_t queuedOn(int fd) {
    tcp_info i = tcpInfo(fd);
    return i.tcpi_bytes_sent - i.tcpi_bytes_retrans + i.tcpi_notsent_bytes;
}

// SIOCINQ: bytes in the receive queue not yet read (for a socket in a sockmap, only those in
// the psock's queue: see procRxQueue()). SIOCOUTQ: bytes written and not yet acked.
uint64_t inq(int fd) {
    int n = 0;
    return ::ioctl(fd, SIOCINQ, &n) == 0 ? static_cast<uint64_t>(n) : 0;
}
uint64_t outq(int fd) {
    int n = 0;
    return ::ioctl(fd, SIOCOUTQ, &n) == 0 ? static_cast<uint64_t>(n) : 0;
}

// SO_ERROR reads and clears the pending error: where the psock's failed sends leave their EPIPE.
int pendingError(int fd) {
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    return err;
}

// The keys of a map, counted by id as bpftool would: the kernel's view, not what Sockmap or
// Conn believe was inserted. -1 if the map cannot be opened or walked.
long countKeys(uint32_t map_id) {
    Fd fd(bpf_map_get_fd_by_id(map_id));
    if (!fd) return -1;
    uint64_t key = 0, next = 0;
    long n = 0;
    int r = bpf_map_get_next_key(fd.get(), nullptr, &next);
    while (r == 0) {
        ++n;
        key = next;
        r = bpf_map_get_next_key(fd.get(), &key, &next);
    }
    return r == -ENOENT ? n : -1;
}

// The receive queue as /proc/net/tcp reports it (rcv_nxt - copied_seq), found by the socket's
// inode. SIOCINQ cannot say this for a socket in a sockmap: there it counts only the psock's
// queue of bytes passed to user space (tcp_bpf_ioctl()), not what waits in the TCP receive
// queue. -1 if the socket is not found.
long procRxQueue(int fd) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return -1;
    std::ifstream f("/proc/net/tcp");
    std::string line;
    std::getline(f, line);  // header
    while (std::getline(f, line)) {
        std::istringstream in(line);
        std::string sl, local, remote, state, queues, timer, retransmits, uid, timeout;
        unsigned long inode = 0;
        in >> sl >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >>
            inode;
        if (!in || inode != st.st_ino) continue;
        size_t colon = queues.find(':');
        if (colon == std::string::npos) return -1;
        return std::stol(queues.substr(colon + 1), nullptr, 16);
    }
    return -1;
}

// Open fds of this process: the leak check of the many-pairs test.
long openFds() {
    DIR* d = ::opendir("/proc/self/fd");
    if (d == nullptr) return -1;
    long n = 0;
    while (dirent* e = ::readdir(d))
        if (e->d_name[0] != '.') ++n;
    ::closedir(d);
    return n - 1;  // the DIR's own fd
}

// One record, loaded once: the program keeps writing it from softirq on any CPU.
struct Counters {
    uint64_t redirected = 0;
    uint64_t passed = 0;
    uint64_t consumed = 0;
    uint64_t limit = 0;
    uint64_t replayed = 0;
    uint32_t flags = 0;
};

std::ostream& operator<<(std::ostream& os, const Counters& c) {
    return os << "{redirected " << c.redirected << ", passed " << c.passed << ", consumed "
              << c.consumed << ", limit " << c.limit << ", replayed " << c.replayed << ", flags "
              << c.flags << "}";
}

// ---------------------------------------------------------------------------------------------
// Waiting, always with a deadline.

// Polls fd until one of `events` is reported. POLLERR/POLLHUP do not count: the caller asks for
// the event it means (POLLRDHUP: the peer's FIN was received).
bool waitForEvents(int fd, short events, Millis timeout) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
        auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
        if (left < 0) return false;
        pollfd p{fd, events, 0};
        int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left + 1, 100)));
        if (r > 0 && (p.revents & events) != 0) return true;
        if (r > 0 && (p.revents & (POLLERR | POLLNVAL)) != 0) return false;
    }
}

// checkEof() until it stops saying Again: the receive queue could not be run yet.
SockmapEof awaitEof(int src, bool src_write_shut, Millis timeout) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
        SockmapEof e = checkEof(src, src_write_shut);
        if (e.kind != SockmapEof::Again || Clock::now() >= deadline) return e;
        std::this_thread::sleep_for(1ms);
    }
}

// checkFinBarrier() until Done or Failed, as the worker's back-off timer would.
SockmapBarrier awaitFinBarrier(int src, int dst, Millis timeout) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
        SockmapBarrier b = checkFinBarrier(src, dst);
        if (b.kind != SockmapBarrier::Wait || Clock::now() >= deadline) return b;
        std::this_thread::sleep_for(1ms);
    }
}

// Reads fd into `v` until `v` has seen `until` bytes in all, never more: what follows stays in
// the socket for the test's next step.
IoResult readInto(int fd, PayloadVerifier& v, uint64_t until, Millis timeout) {
    auto deadline = Clock::now() + timeout;
    std::vector<uint8_t> buf(256 * kKiB);
    uint64_t start = v.bytes();
    while (v.bytes() < until) {
        size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), until - v.bytes()));
        auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
        IoResult r = test::readSome(fd, buf.data(), want, std::max(left, Millis{0}));
        if (!r.ok()) {
            r.bytes = v.bytes() - start;
            return r;
        }
        v.update(std::span<const uint8_t>(buf.data(), r.bytes));
    }
    return IoResult{IoStatus::Ok, v.bytes() - start, 0};
}

std::string describe(const IoResult& r, const PayloadVerifier& v) {
    std::string s = r.describe() + ", " + std::to_string(v.bytes()) + " bytes verified";
    if (!v.intact()) s += ", FIRST MISMATCH at byte " + std::to_string(v.firstMismatch());
    return s;
}

// The worker's part of one direction when the program passes bytes (pump/sockmap_pump.hpp,
// "Passed bytes"; bpf/relay.bpf.c for replays), done inline: wait until dst has queued every
// byte redirected or copied before the passed ones (checkQueued), then copy the passed bytes
// src -> dst, dropping the stretches the program reports as replayed (the skip queue), and
// publish `consumed` (sent + skipped) after each step, until consumed == passed and the program
// redirects again.
class UserCopy {
  public:
    UserCopy(Sockmap& map, uint32_t index, int src, int dst)
        : record_(map.record(index)), src_(src), dst_(dst) {}

    uint64_t rounds() const { return rounds_; }
    uint64_t skipped() const { return skipped_; }
    bool caughtUp() const { return loadRelaxed(record_.passed) == consumed_; }

    // Moves every byte passed so far, and those passed meanwhile. Empty, or what went wrong.
    std::string catchUp(Millis timeout) {
        if (loadRelaxed(record_.passed) == consumed_) return {};
        ++rounds_;
        auto deadline = Clock::now() + timeout;
        // The program stopped redirecting at the first passed byte, so `redirected` stays put
        // until consumed == passed: dst must hold all of it, and all we sent, before the passed
        // bytes follow. Skipped bytes never reach dst, so they are not waited for.
        uint64_t expected = loadRelaxed(record_.redirected) + sent_;
        for (;;) {
            SockmapBarrier b = checkQueued(dst_, expected);
            if (b.kind == SockmapBarrier::Done) break;
            if (b.kind == SockmapBarrier::Failed)
                return std::string("checkQueued: ") + std::strerror(b.error);
            if (Clock::now() >= deadline)
                return "checkQueued still waits for " + std::to_string(b.remaining) + " bytes";
            std::this_thread::sleep_for(1ms);
        }
        std::vector<uint8_t> buf(64 * kKiB);
        while (consumed_ < loadRelaxed(record_.passed)) {
            if (loadRelaxed(record_.flags) & ZCR_BROKEN)
                return "the program marked the stream broken";
            // Only passed bytes are readable on src: the others went through the verdict.
            ssize_t n = ::recv(src_, buf.data(), buf.size(), MSG_DONTWAIT);
            if (n > 0) {
                std::string err = forward(buf.data(), static_cast<uint64_t>(n), deadline);
                if (!err.empty()) return err;
                continue;
            }
            // 0: the FIN can be seen before a passed skb the psock worker has not delivered
            // yet (bpf/relay.bpf.c, proxy/worker.cpp): look again until the count is reached.
            if (n < 0 && errno != EAGAIN && errno != EINTR)
                return std::string("recv on src: ") + std::strerror(errno);
            if (Clock::now() >= deadline)
                return "passed bytes never became readable: consumed " + std::to_string(consumed_) +
                       " of " + std::to_string(loadRelaxed(record_.passed));
            if (n == 0) {
                std::this_thread::sleep_for(1ms);
            } else {
                pollfd p{src_, POLLIN, 0};
                ::poll(&p, 1, 10);
            }
        }
        return {};
    }

  private:
    // Bytes [taken_, taken_ + len) of the passed stream, just read: sends all but a replayed
    // stretch, wherever it falls in them, and publishes the progress.
    std::string forward(const uint8_t* data, uint64_t len, Clock::time_point deadline) {
        uint64_t from = taken_, to = taken_ + len, pos = from;
        auto send = [&](uint64_t a, uint64_t b) -> std::string {
            if (a >= b) return {};
            auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
            IoResult w = test::writeAll(dst_, data + (a - from), b - a, std::max(left, Millis{0}));
            if (!w.ok()) return "send to dst: " + w.describe();
            sent_ += b - a;
            return {};
        };
        // The queued replayed stretches, in order (relay_shared.h): send around each.
        for (;;) {
            uint32_t head = loadRelaxed(record_.skip_head);
            if (head == loadRelaxed(record_.skip_tail)) break;
            uint32_t i = head & (ZCR_SKIPS - 1);
            uint64_t at = loadRelaxed(record_.skip_at[i]);
            uint64_t end = at + loadRelaxed(record_.skip_len[i]);
            if (at >= to) break;
            uint64_t lo = std::clamp(at, pos, to), hi = std::clamp(end, pos, to);
            if (std::string err = send(pos, lo); !err.empty()) return err;
            skipped_ += hi - lo;
            pos = hi;
            if (end > to) break;
            storeRelaxed(record_.skip_head, head + 1);
        }
        if (std::string err = send(pos, to); !err.empty()) return err;
        consumed_ += len;
        taken_ = to;
        storeRelaxed(record_.consumed, __u64{consumed_});
        return {};
    }

    zcr_sock_stats& record_;
    int src_;
    int dst_;
    uint64_t taken_ = 0;     // passed bytes read from src
    uint64_t sent_ = 0;      // of those, written to dst
    uint64_t consumed_ = 0;  // read and either sent or skipped
    uint64_t skipped_ = 0;
    uint64_t rounds_ = 0;
};

// A thread that is always joined. If the test leaves early (a failed ASSERT), the destructor
// first shuts `fd` down, so a send or recv blocked on it returns at once, then joins.
class Background {
  public:
    Background(int fd, std::function<void()> fn) : fd_(fd), thread_(std::move(fn)) {}
    ~Background() {
        if (!thread_.joinable()) return;
        ::shutdown(fd_, SHUT_RDWR);
        thread_.join();
    }
    void join() { thread_.join(); }

  private:
    int fd_;
    std::thread thread_;
};

// ---------------------------------------------------------------------------------------------
// The fixture: one loaded Sockmap, two listeners, and the pairs a test built.

struct Relayed {
    Fd client;    // C
    Fd a;         // relay side of C, conn.fd[0]
    Fd b;         // relay side of U, conn.fd[1]
    Fd upstream;  // U
    Conn conn;
};

Fd acceptOne(int listener, bool nonblocking) {
    pollfd p{listener, POLLIN, 0};
    if (::poll(&p, 1, 5000) != 1) return Fd{};
    return Fd(
        ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0)));
}

std::string attachName(const ::testing::TestParamInfo<Sockmap::Attach>& info) {
    return info.param == Sockmap::Attach::StreamVerdict ? "StreamVerdict" : "SkbVerdict";
}

class SockmapTest : public ::testing::TestWithParam<Sockmap::Attach> {
  protected:
    void SetUp() override {
        if (geteuid() != 0)
            GTEST_SKIP() << "loading BPF needs CAP_BPF and CAP_NET_ADMIN: run as root";
        auto loaded = Sockmap::load(kCapacity, GetParam());
        ASSERT_TRUE(loaded.has_value()) << "Sockmap::load as root: " << loaded.error();
        map_ = std::move(*loaded);
        front_ = test::listenLoopback(AF_INET);
        ASSERT_TRUE(front_.fd) << front_.error;
        back_ = test::listenLoopback(AF_INET);
        ASSERT_TRUE(back_.fd) << back_.error;
    }

    void TearDown() override { closePairs(); }

    // Every socket leaves the maps before it is closed, as the relay does.
    void closePairs() {
        for (auto& p : pairs_)
            if (map_) tearDownPair(*map_, p->conn);
        pairs_.clear();
    }

    // C connects to the front listener (A accepted nonblocking); B connects to the back
    // listener (U accepted). nullptr, with the failure recorded, if any step fails.
    Relayed* connectPair() {
        auto p = std::make_unique<Relayed>();
        test::Connected c = test::connectTo("127.0.0.1", front_.port);
        if (!c.fd) {
            ADD_FAILURE() << "client connect: " << c.error;
            return nullptr;
        }
        p->client = std::move(c.fd);
        p->a = acceptOne(front_.fd.get(), true);
        test::Connected b = test::connectTo("127.0.0.1", back_.port);
        if (!p->a || !b.fd) {
            ADD_FAILURE() << "accept of A or connect of B failed: " << b.error;
            return nullptr;
        }
        p->b = std::move(b.fd);
        test::setNonBlocking(p->b.get(), true);
        p->upstream = acceptOne(back_.fd.get(), false);
        if (!p->upstream) {
            ADD_FAILURE() << "accept of U failed";
            return nullptr;
        }
        p->conn.state = ConnState::Relaying;
        p->conn.fd[0] = p->a.get();
        p->conn.fd[1] = p->b.get();
        pairs_.push_back(std::move(p));
        return pairs_.back().get();
    }

    Counters counters(uint32_t index) {
        zcr_sock_stats& r = map_->record(index);
        return {loadRelaxed(r.redirected), loadRelaxed(r.passed),   loadRelaxed(r.consumed),
                loadRelaxed(r.limit),      loadRelaxed(r.replayed), loadRelaxed(r.flags)};
    }

    std::unique_ptr<Sockmap> map_;
    test::Listening front_;
    test::Listening back_;
    std::vector<std::unique_ptr<Relayed>> pairs_;
};

// ---------------------------------------------------------------------------------------------

// The skeleton loads, the maps exist, and the verdict sits on the SOCKHASH at the attach point
// asked for and only there (BPF_PROG_QUERY on the map).
TEST_P(SockmapTest, LoadsAndAttaches) {
    EXPECT_EQ(map_->capacity(), kCapacity);
    uint32_t socks = map_->socksMapId();
    uint32_t links = map_->linksMapId();
    EXPECT_NE(socks, 0u);
    EXPECT_NE(links, 0u);
    EXPECT_NE(socks, links);
    EXPECT_EQ(countKeys(socks), 0);
    EXPECT_EQ(countKeys(links), 0);

    Fd fd(bpf_map_get_fd_by_id(socks));
    ASSERT_TRUE(fd) << "bpf_map_get_fd_by_id: " << std::strerror(errno);
    bpf_attach_type wanted = GetParam() == Sockmap::Attach::StreamVerdict
                                 ? BPF_SK_SKB_STREAM_VERDICT
                                 : BPF_SK_SKB_VERDICT;
    bpf_attach_type other =
        wanted == BPF_SK_SKB_STREAM_VERDICT ? BPF_SK_SKB_VERDICT : BPF_SK_SKB_STREAM_VERDICT;
    auto query = [&](bpf_attach_type type, uint32_t& count) {
        uint32_t ids[4] = {};
        uint32_t flags = 0;
        count = 4;
        return bpf_prog_query(fd.get(), type, 0, &flags, ids, &count);
    };
    uint32_t count = 0;
    ASSERT_EQ(query(wanted, count), 0) << "BPF_PROG_QUERY: " << std::strerror(errno);
    EXPECT_EQ(count, 1u) << "the verdict at attach type " << wanted;
    ASSERT_EQ(query(BPF_SK_SKB_STREAM_PARSER, count), 0) << std::strerror(errno);
    EXPECT_EQ(count, 0u) << "no stream parser";
    // The two verdict attach points exclude each other: with one taken, the kernel answers a
    // query for the other with EBUSY (sock_map_prog_link_lookup()), not with a count of 0.
    EXPECT_EQ(query(other, count), -EBUSY) << "attach type " << other;

    // The counters are mmap()ed whole: the last record is addressable and starts at zero.
    Counters last = counters(kCapacity - 1);
    EXPECT_EQ(
        last.redirected + last.passed + last.consumed + last.limit + last.replayed + last.flags,
        0u);
}

// Both directions at once, 8 MiB each: every byte is redirected by the program (none passed to
// user space) and arrives byte-exact and in order. Unbounded: with the worker's limit, a burst
// that outruns the psock's sending may legitimately be passed (the next tests cover that).
TEST_P(SockmapTest, RedirectsBothWaysByteExact) {
    constexpr uint64_t kBytes = 8 * kMiB;
    constexpr uint32_t kBase = 10;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    PairSetUp s = setUpPair(*map_, p->conn, kBase, kUnbounded);
    ASSERT_FALSE(s.fell_back) << label(s.reason);
    ASSERT_EQ(p->conn.dir[0].path, DataPath::Sockmap);
    ASSERT_EQ(p->conn.dir[1].path, DataPath::Sockmap);
    EXPECT_TRUE(p->conn.in_map[0] && p->conn.in_map[1] && p->conn.linked[0] && p->conn.linked[1]);
    EXPECT_EQ(p->conn.record, kBase);
    EXPECT_EQ(countKeys(map_->socksMapId()), 2);
    EXPECT_EQ(countKeys(map_->linksMapId()), 2);
    EXPECT_EQ(counters(kBase).limit, kUnbounded);

    int c = p->client.get(), u = p->upstream.get();
    IoResult sent_up, sent_down, got_up, got_down;
    PayloadVerifier at_u(kSeedUp), at_c(kSeedDown);
    {
        Background send_up(c, [&] { sent_up = test::sendPayload(c, kSeedUp, kBytes, 30s); });
        Background send_down(u, [&] { sent_down = test::sendPayload(u, kSeedDown, kBytes, 30s); });
        Background recv_up(u, [&] { got_up = readInto(u, at_u, kBytes, 30s); });
        got_down = readInto(c, at_c, kBytes, 30s);
        send_up.join();
        send_down.join();
        recv_up.join();
    }
    EXPECT_TRUE(sent_up.ok()) << sent_up.describe();
    EXPECT_TRUE(sent_down.ok()) << sent_down.describe();
    EXPECT_TRUE(got_up.ok() && at_u.intact()) << "at U: " << describe(got_up, at_u);
    EXPECT_TRUE(got_down.ok() && at_c.intact()) << "at C: " << describe(got_down, at_c);

    // U read kBytes, so the program has counted them; the wait is for the last increment to
    // become visible, not for bytes still in flight.
    EXPECT_TRUE(test::waitUntil(
        [&] {
            return counters(kBase).redirected == kBytes && counters(kBase + 1).redirected == kBytes;
        },
        5s));
    for (uint32_t i : {kBase, kBase + 1}) {
        Counters k = counters(i);
        EXPECT_EQ(k.redirected, kBytes) << "record " << i << " " << k;
        EXPECT_EQ(k.passed, 0u) << "record " << i << " " << k;
    }
    EXPECT_EQ(inq(u), 0u) << "nothing extra at U";
    EXPECT_EQ(inq(c), 0u) << "nothing extra at C";
}

// The program counts the bytes in flight towards the peer as redirected + consumed - the peer's
// bytes_acked. A socket that connect()ed starts with bytes_acked == 1, not 0: the kernel counts
// the SYN that the SYN-ACK acknowledged (tcp_ack() advances snd_una past it); an accepted
// socket starts at 0. B, the relay's upstream socket, is the connecting kind, so for C -> U the
// count must allow for that one byte, both at the first byte and whenever B has everything
// acknowledged. Each direction here sends 1 KiB on an idle pair, twice: all of it must be
// redirected, none passed.
TEST_P(SockmapTest, InFlightCountAllowsForTheAckedSyn) {
    constexpr uint64_t kChunk = 1 * kKiB;
    constexpr uint32_t kBase = 20;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    EXPECT_EQ(tcpInfo(b).tcpi_bytes_acked, 1u) << "connect()ed: the acked SYN counts";
    EXPECT_EQ(tcpInfo(a).tcpi_bytes_acked, 0u) << "accepted: nothing acked yet";
    PairSetUp s = setUpPair(*map_, p->conn, kBase, kLimit);
    ASSERT_FALSE(s.fell_back) << label(s.reason);

    struct Way {
        const char* name;
        int from, to, peer;  // peer: the relay socket the program redirects to
        uint32_t record;
        uint64_t seed;
        uint64_t syn;  // the peer's bytes_acked before any byte
    };
    for (const Way& w : {Way{"C -> U", c, u, b, kBase, kSeedUp, 1},
                         Way{"U -> C", u, c, a, kBase + 1, kSeedDown, 0}}) {
        PayloadVerifier at(w.seed);
        for (uint64_t round = 1; round <= 2; ++round) {
            ASSERT_TRUE(test::sendPayloadAt(w.from, w.seed, (round - 1) * kChunk, kChunk, 5s).ok());
            IoResult got = readInto(w.to, at, round * kChunk, 2s);
            Counters k = counters(w.record);
            EXPECT_TRUE(got.ok() && at.intact())
                << w.name << " round " << round << ": " << describe(got, at) << ", " << k;
            EXPECT_EQ(k.redirected, round * kChunk) << w.name << " round " << round << ": " << k;
            EXPECT_EQ(k.passed, 0u)
                << w.name << " round " << round
                << ": passed, so the in-flight count (redirected + consumed - bytes_acked of the "
                   "peer, which is "
                << tcpInfo(w.peer).tcpi_bytes_acked << ") went below zero: " << k;
            if (k.passed != 0) break;  // the rest would only repeat it
            // Idle again: the peer has every byte acknowledged before the next round.
            ASSERT_TRUE(test::waitUntil(
                [&] { return tcpInfo(w.peer).tcpi_bytes_acked == round * kChunk + w.syn; }, 5s))
                << w.name << ": bytes_acked " << tcpInfo(w.peer).tcpi_bytes_acked;
        }
    }
}

// The control for the next test: bytes that reached A before it entered the map stay in its
// receive queue, because the verdict runs from sk_data_ready, which only a new segment (or a
// recvmsg) calls. Inserted by hand, with no peek, nothing moves; one recv(MSG_PEEK) on A runs
// A's queue through the verdict (tcp_bpf_recvmsg_parser() calls tcp_data_ready()) and returns
// EAGAIN, since every byte was redirected.
TEST_P(SockmapTest, BytesSentBeforeInsertionWaitWithoutTheKick) {
    constexpr uint64_t kRequest = 64 * kKiB;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), u = p->upstream.get();
    ASSERT_TRUE(test::sendPayload(p->client.get(), kSeedUp, kRequest, 5s).ok());
    ASSERT_TRUE(test::waitUntil([&] { return inq(a) == kRequest; }, 5s)) << "inq(A) " << inq(a);

    Conn& c = p->conn;
    for (int i = 0; i < 2; ++i) {
        auto cookie = socketCookie(c.fd[i]);
        ASSERT_TRUE(cookie.has_value()) << cookie.error().message();
        c.cookie[i] = *cookie;
    }
    for (int i = 0; i < 2; ++i) {
        auto linked = map_->link(c.cookie[i], c.cookie[1 - i], i, kLimit);
        ASSERT_TRUE(linked.has_value()) << linked.error().message();
        c.linked[i] = true;
    }
    for (int i : {1, 0}) {
        auto inserted = map_->insert(c.fd[i], c.cookie[i]);
        ASSERT_TRUE(inserted.has_value()) << inserted.error().message();
        c.in_map[i] = true;
    }

    // Nothing may happen: a bounded look for a change that must not come.
    EXPECT_FALSE(test::waitUntil([&] { return inq(u) > 0 || counters(0).redirected > 0; }, 300ms))
        << "the pre-insertion bytes moved without a kick: inq(U) " << inq(u) << ", A "
        << counters(0);
    EXPECT_EQ(procRxQueue(a), static_cast<long>(kRequest)) << "the bytes wait in A's receive queue";
    RecordProperty("siocinq_in_map", std::to_string(inq(a)));

    char byte;
    errno = 0;
    EXPECT_EQ(::recv(a, &byte, 1, MSG_PEEK | MSG_DONTWAIT), -1);
    EXPECT_EQ(errno, EAGAIN) << "the peek found the queue redirected, not bytes to read";
    PayloadVerifier at_u(kSeedUp);
    IoResult got = readInto(u, at_u, kRequest, 5s);
    EXPECT_TRUE(got.ok() && at_u.intact()) << describe(got, at_u);
    EXPECT_EQ(counters(0).redirected, kRequest) << counters(0);
    EXPECT_EQ(procRxQueue(a), 0) << "A's receive queue was run through the verdict";
}

// The same situation through setUpPair(), which peeks both sockets: a request C sent and a
// banner U sent before the pair entered the map both arrive with no further byte from anyone
// (without the kick a request waiting for its answer waits forever), ahead of later bytes. The
// request is passed (A goes in and is kicked before B) and moved as the worker would.
TEST_P(SockmapTest, BytesSentBeforeInsertionAreDeliveredAfterTheKick) {
    constexpr uint64_t kRequest = 64 * kKiB;
    constexpr uint64_t kBanner = 100;
    constexpr uint32_t kBase = 2;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    ASSERT_TRUE(test::sendPayload(c, kSeedUp, kRequest, 5s).ok());
    ASSERT_TRUE(test::sendPayload(u, kSeedDown, kBanner, 5s).ok());
    ASSERT_TRUE(test::waitUntil([&] { return inq(a) == kRequest && inq(b) == kBanner; }, 5s))
        << "before set-up: inq(A) " << inq(a) << ", inq(B) " << inq(b);

    PairSetUp s = setUpPair(*map_, p->conn, kBase, kLimit);
    ASSERT_FALSE(s.fell_back) << label(s.reason);
    ASSERT_EQ(p->conn.dir[0].path, DataPath::Sockmap);
    ASSERT_EQ(p->conn.dir[1].path, DataPath::Sockmap);

    // The client's socket went in and was kicked first, with its peer not in yet: its early
    // bytes were passed, for the worker to move (so that its recvmsg() reopens the window the
    // client saw). The upstream's banner, kicked with both in, was redirected.
    Counters up = counters(kBase), down = counters(kBase + 1);
    EXPECT_EQ(up.passed, kRequest) << up;
    EXPECT_EQ(up.redirected, 0u) << up;
    PayloadVerifier at_u(kSeedUp), at_c(kSeedDown);
    IoResult got_c = readInto(c, at_c, kBanner, 5s);
    EXPECT_TRUE(got_c.ok() && at_c.intact()) << "banner at C: " << describe(got_c, at_c);
    UserCopy copy(*map_, kBase, a, b);
    std::string err = copy.catchUp(10s);
    ASSERT_TRUE(err.empty()) << err << ", " << counters(kBase);
    IoResult got_u = readInto(u, at_u, kRequest, 5s);
    EXPECT_TRUE(got_u.ok() && at_u.intact()) << "request at U: " << describe(got_u, at_u);

    // Later bytes come after them, redirected now that user space has caught up.
    ASSERT_TRUE(test::sendPayloadAt(c, kSeedUp, kRequest, kRequest, 5s).ok());
    ASSERT_TRUE(test::sendPayloadAt(u, kSeedDown, kBanner, kBanner, 5s).ok());
    got_u = readInto(u, at_u, 2 * kRequest, 5s);
    got_c = readInto(c, at_c, 2 * kBanner, 5s);
    EXPECT_TRUE(got_u.ok() && at_u.intact()) << "at U: " << describe(got_u, at_u);
    EXPECT_TRUE(got_c.ok() && at_c.intact()) << "at C: " << describe(got_c, at_c);
    up = counters(kBase);
    down = counters(kBase + 1);
    EXPECT_EQ(up.redirected, kRequest) << up;
    EXPECT_EQ(up.passed, kRequest) << up;
    EXPECT_EQ(down.redirected, 2 * kBanner) << down;
    EXPECT_EQ(down.passed, 0u) << down;
}

// A in the map, its peer B not: the redirect fails, and the program must pass the bytes to A
// instead of returning the helper's SK_DROP (TCP has already acknowledged them). It keeps
// passing after B goes in too, for as long as user space has not moved every passed byte
// (consumed != passed), so A's bytes never overtake one another. Once the test, as the worker,
// has copied them to B and published consumed == passed, the program redirects again, behind
// them.
TEST_P(SockmapTest, PeerMissingPassesInsteadOfDropping) {
    constexpr uint64_t kFirst = 1 * kMiB;
    constexpr uint64_t kSecond = 256 * kKiB;
    constexpr uint64_t kThird = 512 * kKiB;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    Conn& conn = p->conn;
    for (int i = 0; i < 2; ++i) {
        auto cookie = socketCookie(conn.fd[i]);
        ASSERT_TRUE(cookie.has_value()) << cookie.error().message();
        conn.cookie[i] = *cookie;
    }
    for (int i = 0; i < 2; ++i) {
        auto linked = map_->link(conn.cookie[i], conn.cookie[1 - i], i, kLimit);
        ASSERT_TRUE(linked.has_value()) << linked.error().message();
        conn.linked[i] = true;
    }
    auto inserted = map_->insert(a, conn.cookie[0]);
    ASSERT_TRUE(inserted.has_value()) << inserted.error().message();
    conn.in_map[0] = true;
    EXPECT_EQ(countKeys(map_->socksMapId()), 1);

    // A's passed bytes are charged to A's receive buffer: read while C sends.
    PayloadVerifier at_a(kSeedUp);
    IoResult sent, got;
    {
        Background sender(c, [&] { sent = test::sendPayload(c, kSeedUp, kFirst, 30s); });
        got = readInto(a, at_a, kFirst, 30s);
        sender.join();
    }
    ASSERT_TRUE(sent.ok()) << sent.describe();
    ASSERT_TRUE(got.ok() && at_a.intact()) << "plain recv on A: " << describe(got, at_a);
    Counters k = counters(0);
    EXPECT_EQ(k.passed, kFirst) << k;
    EXPECT_EQ(k.redirected, 0u) << k;

    inserted = map_->insert(b, conn.cookie[1]);
    ASSERT_TRUE(inserted.has_value()) << inserted.error().message();
    conn.in_map[1] = true;
    {
        Background sender(c, [&] { sent = test::sendPayloadAt(c, kSeedUp, kFirst, kSecond, 30s); });
        got = readInto(a, at_a, kFirst + kSecond, 30s);
        sender.join();
    }
    ASSERT_TRUE(sent.ok()) << sent.describe();
    EXPECT_TRUE(got.ok() && at_a.intact()) << "after B went in: " << describe(got, at_a);
    k = counters(0);
    EXPECT_EQ(k.passed, kFirst + kSecond) << "consumed != passed keeps it passing: " << k;
    EXPECT_EQ(k.redirected, 0u) << k;
    EXPECT_EQ(inq(u), 0u) << "no byte of C's may reach U while A passes";
    Counters other = counters(1);
    EXPECT_EQ(other.redirected + other.passed, 0u) << other;

    // The test read them, as the worker's copy path would: it sends them on to B and says so.
    IoResult copied = test::sendPayload(b, kSeedUp, kFirst + kSecond, 10s);
    ASSERT_TRUE(copied.ok()) << copied.describe();
    storeRelaxed(map_->record(0).consumed, __u64{kFirst + kSecond});
    PayloadVerifier at_u(kSeedUp);
    IoResult sent_third;
    {
        Background sender(c, [&] {
            sent_third = test::sendPayloadAt(c, kSeedUp, kFirst + kSecond, kThird, 30s);
        });
        got = readInto(u, at_u, kFirst + kSecond + kThird, 30s);
        sender.join();
    }
    ASSERT_TRUE(sent_third.ok()) << sent_third.describe();
    EXPECT_TRUE(got.ok() && at_u.intact())
        << "at U, copied then redirected: " << describe(got, at_u);
    k = counters(0);
    EXPECT_EQ(k.redirected, kThird) << "caught up, the program redirects again: " << k;
    EXPECT_EQ(k.passed, kFirst + kSecond) << k;
}

// A FIN is not data: after C's SHUT_WR the program sees a FIN-only skb (len 0) and must drop it,
// not redirect it. Redirected, the psock worker's zero-length send to B reports EPIPE on B
// (sk_psock_backlog() treats a 0 return as a broken pipe). User space propagates the FIN:
// POLLRDHUP, checkEof() == Eof, checkFinBarrier() == Done, shutdown(B). Then the same the other
// way round, to the end of both directions: no socket may be left with an error.
TEST_P(SockmapTest, FinOnlySkbIsNotRedirected) {
    constexpr uint64_t kRequest = 1 * kMiB;
    constexpr uint64_t kReply = 4 * kKiB;
    constexpr uint32_t kBase = 6;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    PairSetUp s = setUpPair(*map_, p->conn, kBase, kLimit);
    ASSERT_FALSE(s.fell_back) << label(s.reason);

    // C -> U.
    test::ReceiveCheck at_u;
    {
        Background reader(u, [&] { at_u = test::receivePayloadUntilEof(u, kSeedUp, 30s); });
        IoResult sent = test::sendPayload(c, kSeedUp, kRequest, 30s);
        ASSERT_TRUE(sent.ok()) << sent.describe();
        // Every byte through the verdict before the FIN leaves C: A's receive queue is empty
        // when it arrives, and C had nothing unsent to hang it on (tcp_send_fin() then builds a
        // skb of its own), so the FIN reaches the program as its own zero-length skb.
        ASSERT_TRUE(test::waitUntil([&] { return counters(kBase).redirected == kRequest; }, 10s))
            << counters(kBase);
        ASSERT_EQ(::shutdown(c, SHUT_WR), 0);
        ASSERT_TRUE(waitForEvents(a, POLLRDHUP, 5s)) << "A never saw C's FIN";
        SockmapEof eof = awaitEof(a, false, 5s);
        ASSERT_EQ(eof.kind, SockmapEof::Eof)
            << "kind " << int(eof.kind) << " " << std::strerror(eof.error);
        SockmapBarrier bar = awaitFinBarrier(a, b, 10s);
        ASSERT_EQ(bar.kind, SockmapBarrier::Done)
            << "kind " << int(bar.kind) << ", remaining " << bar.remaining << ", "
            << std::strerror(bar.error);
        ASSERT_EQ(::shutdown(b, SHUT_WR), 0);
        reader.join();
    }
    EXPECT_EQ(at_u.io.status, IoStatus::Eof) << at_u.describe();
    EXPECT_EQ(at_u.bytes, kRequest) << at_u.describe();
    EXPECT_EQ(at_u.first_mismatch, -1) << at_u.describe();
    Counters up = counters(kBase);
    EXPECT_EQ(up.flags & ZCR_BROKEN, 0u) << up;
    EXPECT_EQ(up.redirected, kRequest) << up;
    EXPECT_EQ(up.passed, 0u) << up;
    EXPECT_EQ(pendingError(b), 0) << "B, written to by the psock and then shut down";

    // U -> C, with B's write side already shut: the case the EPIPE was seen in.
    test::ReceiveCheck at_c;
    {
        Background reader(c, [&] { at_c = test::receivePayloadUntilEof(c, kSeedDown, 30s); });
        IoResult sent = test::sendPayload(u, kSeedDown, kReply, 30s);
        ASSERT_TRUE(sent.ok()) << sent.describe();
        ASSERT_TRUE(test::waitUntil([&] { return counters(kBase + 1).redirected == kReply; }, 10s))
            << counters(kBase + 1);
        ASSERT_EQ(::shutdown(u, SHUT_WR), 0);
        ASSERT_TRUE(waitForEvents(b, POLLRDHUP, 5s)) << "B never saw U's FIN";
        SockmapEof eof = awaitEof(b, true, 5s);
        ASSERT_EQ(eof.kind, SockmapEof::Eof)
            << "kind " << int(eof.kind) << " " << std::strerror(eof.error);
        SockmapBarrier bar = awaitFinBarrier(b, a, 10s);
        ASSERT_EQ(bar.kind, SockmapBarrier::Done) << "remaining " << bar.remaining;
        ASSERT_EQ(::shutdown(a, SHUT_WR), 0);
        reader.join();
    }
    EXPECT_EQ(at_c.io.status, IoStatus::Eof) << at_c.describe();
    EXPECT_EQ(at_c.bytes, kReply) << at_c.describe();
    EXPECT_EQ(at_c.first_mismatch, -1) << at_c.describe();
    Counters down = counters(kBase + 1);
    EXPECT_EQ(down.flags & ZCR_BROKEN, 0u) << down;
    EXPECT_EQ(down.redirected, kReply) << down;

    // Both directions are done. With FINs dropped, no psock send failed: a peek on either
    // socket says end of stream, not EPIPE, even when its own write side does not excuse one.
    for (int fd : {a, b}) {
        SockmapEof end = checkEof(fd, false);
        EXPECT_EQ(end.kind, SockmapEof::Eof) << (fd == a ? "A" : "B") << ": kind " << int(end.kind)
                                             << " " << std::strerror(end.error);
        EXPECT_EQ(pendingError(fd), 0) << (fd == a ? "A" : "B");
    }
}

// The FIN barrier in front of a deep backlog, with a reader that does not read. Unbounded, the
// program takes every skb off A's receive queue and the kernel uncharges it from A
// (tcp_read_skb() re-owns it with skb_set_owner_sk_safe()), so A's window stays open: C's
// 32 MiB and its FIN all reach A while most of the bytes wait in B's psock backlog. The
// barrier must say Wait until B's send queue has taken all of them; a shutdown(B) at Done must
// then lose nothing. (The worker's limit keeps that backlog small: next test.)
TEST_P(SockmapTest, BarrierWaitsForASlowReader) {
    constexpr uint64_t kTotal = 32 * kMiB;
    constexpr uint32_t kBase = 100;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    PairSetUp s = setUpPair(*map_, p->conn, kBase, kUnbounded);
    ASSERT_FALSE(s.fell_back) << label(s.reason);

    IoResult sent;
    Background sender(c, [&] {
        sent = test::sendPayload(c, kSeedUp, kTotal, 30s);
        if (sent.ok()) ::shutdown(c, SHUT_WR);
    });
    ASSERT_TRUE(waitForEvents(a, POLLRDHUP, 30s))
        << "C's FIN never reached A while U was not reading: A received "
        << tcpInfo(a).tcpi_bytes_received << " bytes, B queued " << queuedOn(b) << ", "
        << counters(kBase);
    SockmapEof eof = awaitEof(a, false, 5s);
    ASSERT_EQ(eof.kind, SockmapEof::Eof)
        << "kind " << int(eof.kind) << " " << std::strerror(eof.error);
    sender.join();
    ASSERT_TRUE(sent.ok()) << sent.describe();
    EXPECT_EQ(tcpInfo(a).tcpi_bytes_received, kTotal + 1) << "bytes_received counts the FIN";

    // U has read nothing: B holds at most its send buffer plus U's receive window.
    SockmapBarrier first = checkFinBarrier(a, b);
    ASSERT_EQ(first.kind, SockmapBarrier::Wait)
        << "Done with U having read nothing: B queued " << queuedOn(b) << " of " << kTotal;
    EXPECT_GT(first.remaining, 0u);
    EXPECT_LE(first.remaining, kTotal);
    EXPECT_FALSE(
        test::waitUntil([&] { return checkFinBarrier(a, b).kind != SockmapBarrier::Wait; }, 200ms))
        << "the barrier must keep waiting while U does not read";

    // U reads 64 KiB at a time and the barrier is asked after every read. At the first Done, B
    // must hold every byte by its own accounting: the send queue counters, and the bytes not
    // yet acked (SIOCOUTQ, read first) plus those waiting at U (SIOCINQ) plus those U read.
    PayloadVerifier at_u(kSeedUp);
    std::vector<uint8_t> buf(64 * kKiB);
    uint64_t waits = 0;
    bool done = false;
    auto deadline = Clock::now() + 60s;
    while (!done && Clock::now() < deadline) {
        IoResult r = test::readSome(u, buf.data(), buf.size(), 10s);
        ASSERT_TRUE(r.ok()) << "U: " << describe(r, at_u);
        at_u.update(std::span<const uint8_t>(buf.data(), r.bytes));
        SockmapBarrier bar = checkFinBarrier(a, b);
        ASSERT_NE(bar.kind, SockmapBarrier::Failed) << std::strerror(bar.error);
        if (bar.kind == SockmapBarrier::Wait) {
            EXPECT_GT(bar.remaining, 0u);
            ++waits;
            continue;
        }
        uint64_t unacked = outq(b);
        uint64_t waiting = inq(u);
        EXPECT_GE(queuedOn(b), kTotal) << "Done with U at " << at_u.bytes();
        EXPECT_GE(unacked + waiting + at_u.bytes(), kTotal)
            << "Done with bytes missing: unacked " << unacked << ", at U " << waiting << ", read "
            << at_u.bytes();
        done = true;
    }
    ASSERT_TRUE(done) << "the barrier never said Done; U read " << at_u.bytes();
    EXPECT_GT(waits, 0u);
    RecordProperty("first_remaining", std::to_string(first.remaining));
    RecordProperty("waits_while_reading", std::to_string(waits));
    ASSERT_EQ(::shutdown(b, SHUT_WR), 0);
    IoResult rest = test::readStreamUntilEof(
        u, [&](std::span<const uint8_t> d) { at_u.update(d); }, 30s);
    EXPECT_EQ(rest.status, IoStatus::Eof) << describe(rest, at_u);
    EXPECT_EQ(at_u.bytes(), kTotal) << "U after shutdown(B) at Done";
    EXPECT_TRUE(at_u.intact()) << describe(rest, at_u);
    Counters k = counters(kBase);
    EXPECT_EQ(k.redirected, kTotal) << k;
    EXPECT_EQ(k.passed, 0u) << k;
    EXPECT_EQ(pendingError(b), 0);
    EXPECT_EQ(k.flags & ZCR_BROKEN, 0u) << k;
}

// With the worker's limit, a reader that does not read stops the redirect once the bytes in
// flight towards it (psock backlog + B's unacked send queue) pass the limit: the program passes
// the rest, which stays on A, charged to A's receive buffer, so A's window closes and C stalls.
// Kernel memory stays bounded where the unbounded test above parked 32 MiB. When U reads again,
// the test does the worker's part (UserCopy: checkQueued, copy, consumed) whenever passed bytes
// wait, then the FIN barrier: U must get the 32 MiB byte-exact and in order, the copied pieces
// between the redirected ones.
TEST_P(SockmapTest, InFlightLimitPassesTheRestToUserSpace) {
    constexpr uint64_t kTotal = 32 * kMiB;
    constexpr uint32_t kBase = 200;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), b = p->b.get(), c = p->client.get(), u = p->upstream.get();
    PairSetUp s = setUpPair(*map_, p->conn, kBase, kLimit);
    ASSERT_FALSE(s.fell_back) << label(s.reason);

    IoResult sent;
    Background sender(c, [&] {
        sent = test::sendPayload(c, kSeedUp, kTotal, 60s);
        if (sent.ok()) ::shutdown(c, SHUT_WR);
    });
    // The stall: passed bytes appear and A stops receiving (checked as no progress over 200 ms).
    uint64_t last = 0;
    bool stalled = test::waitUntil(
        [&] {
            uint64_t now = tcpInfo(a).tcpi_bytes_received;
            bool same = now == last;
            last = now;
            return counters(kBase).passed > 0 && same;
        },
        20s, 200ms);
    Counters k = counters(kBase);
    uint64_t received = tcpInfo(a).tcpi_bytes_received;
    uint64_t acked = tcpInfo(b).tcpi_bytes_acked;
    int rcvbuf = 0;
    socklen_t len = sizeof rcvbuf;
    ::getsockopt(a, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &len);
    ASSERT_TRUE(stalled) << "no stall with U not reading: A received " << received << ", " << k;
    // Passed bytes are charged to A (skb_set_owner_r() on the psock's ingress queue), so they
    // stop at A's receive buffer, plus the skb that crossed it. That buffer is not small for
    // long: every redirected skb runs tcp_rcv_space_adjust() (tcp_eat_skb()) as if user space
    // had read it, so autotuning may have grown it towards net.ipv4.tcp_rmem[2] (32 MiB here)
    // before the stall: this bound, not the initial 128 KiB, is what a stalled reader costs.
    EXPECT_LE(k.passed, static_cast<uint64_t>(rcvbuf) + 256 * kKiB)
        << k << ", A's SO_RCVBUF " << rcvbuf;
    EXPECT_LE(received, acked + kLimit + static_cast<uint64_t>(rcvbuf) + 1 * kMiB)
        << "what C got into the kernel while U did not read: " << k << ", A's SO_RCVBUF " << rcvbuf;
    // The program redirected until the count passed the limit, and not past it.
    EXPECT_GT(k.redirected, kLimit) << k;
    // The bound, as the program checks it before each redirect: in flight <= limit, plus the
    // skb that crossed it (loopback skbs are at most 64 KiB; a coalesced one a few times that).
    EXPECT_LE(k.redirected, acked + kLimit + 1 * kMiB) << k << ", B's bytes_acked " << acked;
    EXPECT_EQ(k.consumed, 0u) << k;
    RecordProperty("stalled_at_received", std::to_string(received));
    RecordProperty("stalled_redirected", std::to_string(k.redirected));
    RecordProperty("stalled_passed", std::to_string(k.passed));
    RecordProperty("stalled_rcvbuf", std::to_string(rcvbuf));

    test::ReceiveCheck at_u;
    Background reader(u, [&] { at_u = test::receivePayloadUntilEof(u, kSeedUp, 60s); });
    UserCopy copy(*map_, kBase, a, b);
    auto deadline = Clock::now() + 60s;
    bool eof = false;
    while (!eof) {
        ASSERT_LT(Clock::now(), deadline) << "not finished in time: " << counters(kBase);
        std::string err = copy.catchUp(30s);
        ASSERT_TRUE(err.empty()) << err << ", " << counters(kBase);
        // The worker scans the records every 10 ms; here a poll for the FIN is the scan period.
        if (!waitForEvents(a, POLLRDHUP, 10ms)) continue;
        SockmapEof e = checkEof(a, false);
        ASSERT_NE(e.kind, SockmapEof::Failed) << std::strerror(e.error);
        // Passed: the next catch-up moves them. Again: ask again. Eof with passed bytes still
        // on their way to A's queue: the next catch-up waits for them.
        eof = e.kind == SockmapEof::Eof && copy.caughtUp();
    }
    SockmapBarrier bar = awaitFinBarrier(a, b, 30s);
    ASSERT_EQ(bar.kind, SockmapBarrier::Done) << "remaining " << bar.remaining;
    ASSERT_EQ(::shutdown(b, SHUT_WR), 0);
    reader.join();
    sender.join();
    ASSERT_TRUE(sent.ok()) << sent.describe();
    EXPECT_EQ(at_u.io.status, IoStatus::Eof) << at_u.describe();
    EXPECT_EQ(at_u.bytes, kTotal) << at_u.describe();
    EXPECT_EQ(at_u.first_mismatch, -1) << at_u.describe();
    k = counters(kBase);
    // A replayed stretch is counted in passed twice and skipped once.
    EXPECT_EQ(k.redirected + k.passed - copy.skipped(), kTotal) << k;
    EXPECT_EQ(k.consumed, k.passed) << k;
    EXPECT_EQ(k.flags & ZCR_BROKEN, 0u) << k;
    EXPECT_GE(copy.rounds(), 1u);
    EXPECT_EQ(pendingError(b), 0);
    RecordProperty("passed", std::to_string(k.passed));
    RecordProperty("catch_up_rounds", std::to_string(copy.rounds()));
    RecordProperty("replayed", std::to_string(k.replayed));
    RecordProperty("skipped", std::to_string(copy.skipped()));
}

// tearDownPair() leaves nothing behind: after 1000 pairs, in 20 batches of 50, the SOCKHASH and
// the links hash are empty as the kernel reports them, and while a batch is set up they hold
// exactly two entries per pair. A socket taken out is a plain TCP socket again.
TEST_P(SockmapTest, TearDownEmptiesTheMaps) {
    constexpr int kBatch = 50;
    constexpr int kBatches = 20;
    auto start = Clock::now();
    auto deadline = start + 120s;
    long fds_before = openFds();
    uint32_t socks = map_->socksMapId(), links = map_->linksMapId();
    for (int batch = 0; batch < kBatches; ++batch) {
        ASSERT_LT(Clock::now(), deadline) << "batch " << batch << " not reached in time";
        std::vector<Relayed*> ps;
        for (int i = 0; i < kBatch; ++i) {
            Relayed* p = connectPair();
            ASSERT_NE(p, nullptr) << "batch " << batch << " pair " << i;
            ps.push_back(p);
        }
        for (int i = 0; i < kBatch; ++i) {
            uint32_t base = static_cast<uint32_t>(2 * (batch * kBatch + i));
            PairSetUp s = setUpPair(*map_, ps[i]->conn, base, kLimit);
            ASSERT_FALSE(s.fell_back)
                << "batch " << batch << " pair " << i << ": " << label(s.reason);
        }
        ASSERT_EQ(countKeys(socks), 2 * kBatch) << "batch " << batch;
        ASSERT_EQ(countKeys(links), 2 * kBatch) << "batch " << batch;

        for (Relayed* p : ps) tearDownPair(*map_, p->conn);
        tearDownPair(*map_, ps[0]->conn);  // idempotent
        for (Relayed* p : ps)
            ASSERT_FALSE(p->conn.linked[0] || p->conn.linked[1] || p->conn.in_map[0] ||
                         p->conn.in_map[1]);
        ASSERT_EQ(countKeys(socks), 0) << "batch " << batch;
        ASSERT_EQ(countKeys(links), 0) << "batch " << batch;

        // Out of the map, A's data_ready is TCP's own again: C's bytes wait on A for recv().
        char out[16] = "after teardown!";
        char in[16] = {};
        ASSERT_TRUE(test::writeAll(ps[0]->client.get(), out, sizeof out, 5s).ok());
        IoResult r = test::readExactly(ps[0]->a.get(), in, sizeof in, 5s);
        ASSERT_TRUE(r.ok()) << r.describe();
        EXPECT_EQ(std::memcmp(in, out, sizeof in), 0);
        closePairs();
    }
    EXPECT_EQ(openFds(), fds_before) << "every socket and map fd closed";
    RecordProperty("seconds", std::to_string(test::secondsSince(start)));
}

// Only ESTABLISHED sockets may enter a SOCKHASH. A client that sent its request and its FIN
// before set-up has an A in CLOSE_WAIT: setUpPair() must fall back to splice before touching
// the maps, and the bytes stay on A for that path to read.
TEST_P(SockmapTest, NotEstablishedFallsBack) {
    constexpr uint64_t kRequest = 4 * kKiB;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get();
    ASSERT_TRUE(test::sendPayload(p->client.get(), kSeedUp, kRequest, 5s).ok());
    ASSERT_EQ(::shutdown(p->client.get(), SHUT_WR), 0);
    ASSERT_TRUE(waitForEvents(a, POLLRDHUP, 5s));
    ASSERT_EQ(tcpInfo(a).tcpi_state, kTcpCloseWait);
    ASSERT_EQ(tcpInfo(p->b.get()).tcpi_state, kTcpEstablished);

    PairSetUp s = setUpPair(*map_, p->conn, 0, kLimit);
    EXPECT_TRUE(s.fell_back);
    EXPECT_EQ(s.reason, SockmapFallback::NotEstablished) << label(s.reason);
    EXPECT_EQ(p->conn.dir[0].path, DataPath::Splice);
    EXPECT_EQ(p->conn.dir[1].path, DataPath::Splice);
    EXPECT_FALSE(p->conn.linked[0] || p->conn.linked[1] || p->conn.in_map[0] || p->conn.in_map[1]);
    EXPECT_EQ(countKeys(map_->socksMapId()), 0);
    EXPECT_EQ(countKeys(map_->linksMapId()), 0);

    // The kernel's own rule, behind the check: the insert itself is refused.
    auto cookie = socketCookie(a);
    ASSERT_TRUE(cookie.has_value());
    auto inserted = map_->insert(a, *cookie);
    ASSERT_FALSE(inserted.has_value()) << "a CLOSE_WAIT socket entered the SOCKHASH";
    EXPECT_EQ(inserted.error().code, EOPNOTSUPP) << inserted.error().message();

    PayloadVerifier at_a(kSeedUp);
    IoResult got = readInto(a, at_a, kRequest, 5s);
    EXPECT_TRUE(got.ok() && at_a.intact()) << describe(got, at_a);
    char byte;
    EXPECT_EQ(::recv(a, &byte, 1, MSG_DONTWAIT), 0) << "then end of stream";
}

INSTANTIATE_TEST_SUITE_P(Attach, SockmapTest,
                         ::testing::Values(Sockmap::Attach::StreamVerdict,
                                           Sockmap::Attach::SkbVerdict),
                         attachName);

}  // namespace
}  // namespace zcrelay
