// Who keeps a SOCKHASH redirecting: the facts a handover of live sockmap connections to a new
// relay process stands on (proxy/kernel.md, "A SOCKHASH outlives its loader"). A process's
// exit closes its fds, and SCM_RIGHTS gives the receiver a new fd of the same map; here the
// loader's fds are closed by destroying its Sockmap (without detaching, keepAttached(), as a
// process killed -9 would leave it), and the receiver's fd is a dup.
//   - Even a detach (bpf_prog_detach2) leaves them redirecting: each psock holds the verdict it
//     was inserted with. Only taking a socket out of the map (or closing it) stops it.
//
//   - With another fd of the SOCKHASH open, the program stays attached and keeps redirecting:
//     bytes C sends arrive at U byte-exact, and A, the relay's socket, receives none of them.
//   - With the last fd of the SOCKHASH closed too, it still redirects: the sockets in it hold
//     the map (each psock's link takes a reference), the map holds the attached program, and
//     the kernel frees them only when the last socket closes. A handover's sockmap connections
//     keep flowing however the old process ends; what the new one needs the map's fd for is
//     to manage them (records, removal), and only SCM_RIGHTS or CAP_SYS_ADMIN (map by id)
//     gets it one.
#include <gtest/gtest.h>
#include <unistd.h>

#include "kernel/sockmap_fixture.hpp"

namespace zcrelay::sockmap_test {
namespace {

constexpr uint64_t kHandedBytes = 1 * kMiB;

// kHandedBytes from C arrive at U byte-exact: redirected, as A then shows (it received none).
void expectRedirectedToU(Relayed& p) {
    int c = p.client.get(), u = p.upstream.get();
    IoResult sent, got;
    PayloadVerifier at_u(kSeedUp);
    {
        Background send(c, [&] { sent = test::sendPayload(c, kSeedUp, kHandedBytes, 30s); });
        got = readInto(u, at_u, kHandedBytes, 30s);
        send.join();
    }
    EXPECT_TRUE(sent.ok()) << sent.describe();
    EXPECT_TRUE(got.ok() && at_u.intact()) << "at U: " << describe(got, at_u);
}

TEST_P(SockmapTest, ASockhashWhoseLoaderIsGoneRedirectsWhileAnotherFdHoldsIt) {
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, 40, kUnbounded);
    ASSERT_FALSE(s.fell_back) << label(s.reason);
    Fd held(::dup(map_->socksFd()));  // the new process's, as SCM_RIGHTS would give it
    ASSERT_TRUE(held);
    const uint32_t id = map_->socksMapId();
    map_->keepAttached();
    map_.reset();  // the loader's fds closed: the program's, every map's, the counters' mapping

    expectRedirectedToU(*p);
    EXPECT_EQ(inq(p->a.get()), 0u) << "A received bytes: the program no longer redirects";
    EXPECT_EQ(countKeys(id), 2) << "both sockets still in the SOCKHASH";
}

TEST_P(SockmapTest, ASockhashWithNoFdLeftRedirectsWhileItsSocketsLive) {
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, 42, kUnbounded);
    ASSERT_FALSE(s.fell_back) << label(s.reason);
    const uint32_t id = map_->socksMapId();
    map_->keepAttached();
    map_.reset();  // and nobody else holds the SOCKHASH

    expectRedirectedToU(*p);
    EXPECT_EQ(inq(p->a.get()), 0u) << "A received bytes: the program no longer redirects";
    EXPECT_EQ(countKeys(id), 2) << "both sockets still in the SOCKHASH, found by its id";
    // The sockets hold the map: once they close, the kernel frees it (after an RCU grace
    // period and its free work, hence the wait).
    p->a.reset();
    p->b.reset();
    EXPECT_TRUE(test::waitUntil(
        [&] {
            Fd fd(bpf_map_get_fd_by_id(id));
            return !fd;
        },
        10s))
        << "the SOCKHASH outlived its last socket";
}

// Even a loader that detaches the program (Sockmap's destructor without keepAttached())
// leaves the sockets already in the map redirecting: each psock took its own reference to the
// verdict when it was inserted, and a detach changes only what sockets inserted after it get.
TEST_P(SockmapTest, ADetachLeavesTheSocketsAlreadyInTheMapRedirecting) {
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, 44, kUnbounded);
    ASSERT_FALSE(s.fell_back) << label(s.reason);
    map_.reset();  // bpf_prog_detach2, then every fd closed

    expectRedirectedToU(*p);
    EXPECT_EQ(inq(p->a.get()), 0u) << "A received bytes: the detach stopped the verdict";
}

// What a relay that adopts another's maps at a handover holds (Sockmap::adopt, from fds as
// SCM_RIGHTS gives them): the same records, which it reads and writes as the loader did, and
// the same SOCKHASH, from which it takes the sockets out once the loader is gone.
TEST_P(SockmapTest, AnAdoptedMapSetIsTheLoadersRecordsAndSockets) {
    Relayed* p = connectPair();
    ASSERT_NE(p, nullptr);
    constexpr uint32_t kRecord = 46;
    PairSetUp s = setUpPair(*map_, p->conn, p->fds, kRecord, kUnbounded);
    ASSERT_FALSE(s.fell_back) << label(s.reason);
    expectRedirectedToU(*p);
    auto adopted =
        Sockmap::adopt({UniqueFd(::dup(map_->socksFd())), UniqueFd(::dup(map_->linksFd())),
                        UniqueFd(::dup(map_->statsFd())), UniqueFd(::dup(map_->wakeLostFd()))},
                       map_->rings(), map_->recordsPerWorker());
    ASSERT_TRUE(adopted) << adopted.error();
    Sockmap& next = **adopted;
    ASSERT_TRUE(next.adoptRing(0, UniqueFd(::dup(map_->wakeRingFd(0)))));
    EXPECT_EQ(next.capacity(), map_->capacity());
    EXPECT_EQ(next.socksMapId(), map_->socksMapId());
    EXPECT_EQ(loadRelaxed(next.record(kRecord).redirected), kHandedBytes);
    const uint32_t id = map_->socksMapId();
    map_->keepAttached();
    map_.reset();

    expectRedirectedToU(*p);
    EXPECT_EQ(loadRelaxed(next.record(kRecord).redirected), 2 * kHandedBytes)
        << "the program counts on in the records the adopter reads";
    p->conn.map = &next;
    tearDownPair(next, p->conn);
    EXPECT_EQ(countKeys(id), 0) << "the adopter took both sockets out";
}

// Maps that are not what this build's program makes are refused, naming which.
TEST_P(SockmapTest, AdoptingMapsOfAnotherShapeIsRefusedNamingTheMap) {
    auto fd = [](int f) { return UniqueFd(::dup(f)); };
    auto swapped = Sockmap::adopt(
        {fd(map_->linksFd()), fd(map_->socksFd()), fd(map_->statsFd()), fd(map_->wakeLostFd())},
        map_->rings(), map_->recordsPerWorker());
    ASSERT_FALSE(swapped);
    EXPECT_NE(swapped.error().find("the SOCKHASH"), std::string::npos) << swapped.error();
    auto rings = Sockmap::adopt(
        {fd(map_->socksFd()), fd(map_->linksFd()), fd(map_->statsFd()), fd(map_->wakeLostFd())},
        map_->rings() + 1, map_->recordsPerWorker());
    ASSERT_FALSE(rings);
    EXPECT_NE(rings.error().find("wake-up counts"), std::string::npos) << rings.error();
    auto good = Sockmap::adopt(
        {fd(map_->socksFd()), fd(map_->linksFd()), fd(map_->statsFd()), fd(map_->wakeLostFd())},
        map_->rings(), map_->recordsPerWorker());
    ASSERT_TRUE(good) << good.error();
    auto ring = (*good)->adoptRing(0, fd(map_->statsFd()));
    ASSERT_FALSE(ring);
    EXPECT_NE(ring.error().find("not a ring buffer"), std::string::npos) << ring.error();
}

}  // namespace
}  // namespace zcrelay::sockmap_test
