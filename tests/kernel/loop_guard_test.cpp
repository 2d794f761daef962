// LoopGuard on real loopback sockets, without the relay: an accepted socket is recognised as
// one of our upstream sockets exactly when the kernel says it is the other end of one, and not
// when an unrelated socket merely shares its local port (as connect() lets sockets to
// different destinations do; forced here with SO_REUSEADDR binds).
#include "loop_guard.hpp"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "runtime.hpp"
#include "support/loopback.hpp"

namespace zcrelay {
namespace {

using test::Fd;

SocketAddress loopback(uint16_t port) {
    auto a = parseAddress("127.0.0.1:" + std::to_string(port));
    return *a;
}

// A cluster of one backend at `to`, as the Runtime would hold it.
ClusterRt clusterTo(const SocketAddress& to) {
    ClusterRt c;
    c.config.name = "app";
    BackendRt b;
    b.config.address = to;
    b.key = to.toString();
    c.backends.push_back(b);
    return c;
}

SocketAddress nameOf(int fd, bool peer) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    (peer ? ::getpeername : ::getsockname)(fd, reinterpret_cast<sockaddr*>(&ss), &len);
    return addressFromSockaddr(reinterpret_cast<sockaddr*>(&ss), len);
}

// A blocking TCP socket bound to 127.0.0.1:`port` (0: any) with SO_REUSEADDR, connected to
// `to`.
Fd connectFrom(uint16_t port, const SocketAddress& to) {
    Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    SocketAddress from = loopback(port);
    EXPECT_EQ(::bind(fd.get(), from.sockaddrPtr(), from.length), 0) << std::strerror(errno);
    EXPECT_EQ(::connect(fd.get(), to.sockaddrPtr(), to.length), 0) << std::strerror(errno);
    return fd;
}

Fd acceptOne(const test::Listening& l) { return Fd(::accept4(l.fd.get(), nullptr, nullptr, SOCK_CLOEXEC)); }

TEST(LoopGuardTest, AnAcceptFromOurOwnUpstreamSocketComesBack) {
    auto guard = std::make_unique<LoopGuard>();
    test::Listening listener = test::listenLoopback(AF_INET);
    ASSERT_TRUE(listener.fd.valid()) << listener.error;
    const ClusterRt cluster = clusterTo(loopback(listener.port));
    Fd upstream = connectFrom(0, loopback(listener.port));
    // Worker 3's table: any worker's accept looks in every table.
    LoopGuard::Table& table = guard->table(3);
    ASSERT_TRUE(table.remember(*guard, 700, upstream.get(), cluster, 0));
    Fd accepted = acceptOne(listener);
    const SocketAddress peer = nameOf(accepted.get(), true);
    EXPECT_TRUE(guard->suspect(peer));
    int calls = 0;
    EXPECT_TRUE(guard->cameBack(peer, accepted.get(), [&](const ClusterRt& c, int16_t b) {
        ++calls;
        EXPECT_EQ(&c, &cluster);
        EXPECT_EQ(b, 0);
    }));
    EXPECT_EQ(calls, 1);
    // Once the upstream socket is forgotten (its connection closing), nothing is suspect.
    table.forget(*guard, 700);
    EXPECT_FALSE(guard->suspect(peer));
    EXPECT_FALSE(guard->cameBack(peer, accepted.get(), [](const ClusterRt&, int16_t) {}));
    table.forget(*guard, 700);  // twice is harmless
}

TEST(LoopGuardTest, ASharedLocalPortToAnotherDestinationIsNoLoop) {
    auto guard = std::make_unique<LoopGuard>();
    test::Listening ours = test::listenLoopback(AF_INET);
    test::Listening backend = test::listenLoopback(AF_INET);
    ASSERT_TRUE(ours.fd.valid() && backend.fd.valid());
    const ClusterRt cluster = clusterTo(loopback(backend.port));
    // Our upstream socket to the backend, and a stranger's socket to our listener, from one
    // local port: the kernel allows it, the 4-tuples differ.
    Fd upstream = connectFrom(0, loopback(backend.port));
    const uint16_t shared = nameOf(upstream.get(), false).port();
    Fd stranger = connectFrom(shared, loopback(ours.port));
    ASSERT_EQ(nameOf(stranger.get(), false).port(), shared);
    LoopGuard::Table& table = guard->table(0);
    ASSERT_TRUE(table.remember(*guard, 0, upstream.get(), cluster, 0));
    Fd accepted = acceptOne(ours);
    const SocketAddress peer = nameOf(accepted.get(), true);
    EXPECT_TRUE(guard->suspect(peer)) << "the port is one of our upstream sockets'";
    EXPECT_FALSE(guard->cameBack(peer, accepted.get(), [](const ClusterRt&, int16_t) {}))
        << "but that socket is connected to the backend, not to this listener";
    table.forget(*guard, 0);
}

TEST(LoopGuardTest, AnIpv4PeerSeenThroughADualStackListenerMatches) {
    auto guard = std::make_unique<LoopGuard>();
    // [::]:port takes IPv4 clients too, as ::ffff:127.0.0.1.
    Fd l(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
    int zero = 0;
    ::setsockopt(l.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    sockaddr_in6 any{};
    any.sin6_family = AF_INET6;
    ASSERT_EQ(::bind(l.get(), reinterpret_cast<sockaddr*>(&any), sizeof any), 0);
    ASSERT_EQ(::listen(l.get(), 16), 0);
    const uint16_t port = nameOf(l.get(), false).port();
    const ClusterRt cluster = clusterTo(loopback(port));
    Fd upstream = connectFrom(0, loopback(port));
    LoopGuard::Table& table = guard->table(1);
    ASSERT_TRUE(table.remember(*guard, 5, upstream.get(), cluster, 0));
    Fd accepted(::accept4(l.get(), nullptr, nullptr, SOCK_CLOEXEC));
    const SocketAddress peer = nameOf(accepted.get(), true);
    ASSERT_EQ(peer.family(), AF_INET6);
    EXPECT_TRUE(guard->cameBack(peer, accepted.get(), [](const ClusterRt&, int16_t) {}));
    table.forget(*guard, 5);
}

}  // namespace
}  // namespace zcrelay
