// Setting a pair up and taking it down: the program loads and attaches, bytes that arrived before
// insertion need the kick, a socket not ESTABLISHED falls back, teardown empties the maps.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "kernel/sockmap_fixture.hpp"

namespace zcrelay::sockmap_test {
namespace {

// tcpi_state values (include/net/tcp_states.h is not UAPI).
constexpr uint8_t kTcpEstablished = 1;
constexpr uint8_t kTcpCloseWait = 8;

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

std::string attachName(const ::testing::TestParamInfo<Sockmap::Attach>& info) {
    return info.param == Sockmap::Attach::StreamVerdict ? "StreamVerdict" : "SkbVerdict";
}

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

// The control for BytesSentBeforeInsertionAreDeliveredAfterTheKick (sockmap_passed_bytes_test.cpp):
// bytes that reached A before it entered the map stay in its receive queue, because the verdict
// runs from sk_data_ready, which only a new segment (or a recvmsg) calls. Inserted by hand, with no
// peek, nothing moves; one recv(MSG_PEEK) on A runs A's queue through the verdict
// (tcp_bpf_recvmsg_parser() calls tcp_data_ready()) and returns EAGAIN, since every byte was
// redirected.
TEST_P(SockmapTest, BytesSentBeforeInsertionWaitWithoutTheKick) {
    constexpr uint64_t kRequest = 64 * kKiB;
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    int a = p->a.get(), u = p->upstream.get();
    ASSERT_TRUE(test::sendPayload(p->client.get(), kSeedUp, kRequest, 5s).ok());
    ASSERT_TRUE(test::waitUntil([&] { return inq(a) == kRequest; }, 5s)) << "inq(A) " << inq(a);

    SockmapPair& c = p->conn;
    for (int i = 0; i < 2; ++i) {
        auto cookie = socketCookie(p->fds[i]);
        ASSERT_TRUE(cookie.has_value()) << cookie.error().message();
        c.cookie[i] = *cookie;
    }
    for (int i = 0; i < 2; ++i) {
        auto linked = map_->link(c.cookie[i], c.cookie[1 - i], i, kLimit, 0);
        ASSERT_TRUE(linked.has_value()) << linked.error().message();
        c.linked[i] = true;
    }
    for (int i : {1, 0}) {
        auto inserted = map_->insert(p->fds[i], c.cookie[i]);
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
            PairSetUp s = setUpPair(*map_, ps[i]->conn, ps[i]->fds, base, kLimit);
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

    PairSetUp s = setUpPair(*map_, p->conn, p->fds, 0, kLimit);
    EXPECT_TRUE(s.fell_back);
    EXPECT_EQ(s.reason, SockmapFallback::NotEstablished) << label(s.reason);
    EXPECT_EQ(s.path[0], DataPath::Splice);
    EXPECT_EQ(s.path[1], DataPath::Splice);
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

// The attach points every SockmapTest case runs with, in every sockmap_*_test.cpp of this
// binary: gtest allows one instantiation per suite.
INSTANTIATE_TEST_SUITE_P(Attach, SockmapTest,
                         ::testing::Values(Sockmap::Attach::StreamVerdict,
                                           Sockmap::Attach::SkbVerdict),
                         attachName);

}  // namespace
}  // namespace zcrelay::sockmap_test
