#include "address.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "unit/config_values.hpp"

namespace zcrelay {

namespace {

SocketAddress parsed(std::string_view text) {
    auto address = parseAddress(text);
    EXPECT_TRUE(address) << text << ": " << address.error();
    return address.value_or(SocketAddress{});
}

TEST(ParseAddress, AcceptsIPv4) {
    const SocketAddress a = parsed("127.0.0.1:10000");
    EXPECT_EQ(a.family(), AF_INET);
    EXPECT_EQ(a.length, sizeof(sockaddr_in));
    EXPECT_EQ(a.port(), 10000);
    const auto& sin = *reinterpret_cast<const sockaddr_in*>(a.sockaddrPtr());
    EXPECT_EQ(ntohl(sin.sin_addr.s_addr), 0x7f000001u);

    EXPECT_EQ(parsed("0.0.0.0:80").port(), 80);
    EXPECT_EQ(parsed("1.2.3.4:65535").port(), 65535);
}

TEST(ParseAddress, AcceptsBracketedIPv6) {
    const SocketAddress a = parsed("[::1]:10000");
    EXPECT_EQ(a.family(), AF_INET6);
    EXPECT_EQ(a.length, sizeof(sockaddr_in6));
    EXPECT_EQ(a.port(), 10000);
    const auto& sin6 = *reinterpret_cast<const sockaddr_in6*>(a.sockaddrPtr());
    EXPECT_TRUE(IN6_IS_ADDR_LOOPBACK(&sin6.sin6_addr));

    const SocketAddress any = parsed("[::]:0");
    EXPECT_EQ(any.family(), AF_INET6);
    EXPECT_EQ(any.port(), 0);
}

TEST(ParseAddress, RejectsWithAReason) {
    EXPECT_EQ(
        parseAddress("127.0.0.1").error(),
        "missing port in \"127.0.0.1\"; expected host:port, e.g. 127.0.0.1:10000 or [::1]:10000");
    EXPECT_EQ(
        parseAddress("127.0.0.1:").error(),
        "missing port in \"127.0.0.1:\"; expected host:port, e.g. 127.0.0.1:10000 or [::1]:10000");
    EXPECT_EQ(parseAddress("[::1]").error(),
              "missing port in \"[::1]\"; expected host:port, e.g. 127.0.0.1:10000 or [::1]:10000");
    EXPECT_EQ(parseAddress("1.2.3.4:65536").error(), "port 65536 is out of range (0..65535)");
    EXPECT_EQ(parseAddress("1.2.3.4:99999999999").error(),
              "port 99999999999 is out of range (0..65535)");
    EXPECT_EQ(parseAddress("1.2.3.4:http").error(), "bad port \"http\" in \"1.2.3.4:http\"");
    EXPECT_EQ(parseAddress("1.2.3.4:-1").error(), "bad port \"-1\" in \"1.2.3.4:-1\"");
    EXPECT_EQ(parseAddress("localhost:80").error(),
              "\"localhost\" is not a numeric IP address; names are not resolved");
    EXPECT_EQ(parseAddress("300.1.1.1:80").error(), "\"300.1.1.1\" is not a valid IPv4 address");
    EXPECT_EQ(parseAddress("[::1").error(), "missing ']' in \"[::1\"");
    EXPECT_EQ(parseAddress("[::1]80").error(), "expected ':' and a port after ']' in \"[::1]80\"");
    EXPECT_EQ(parseAddress("[::g]:80").error(), "\"::g\" is not a numeric IPv6 address");
    EXPECT_EQ(parseAddress("::1:80").error(),
              "IPv6 addresses need brackets, e.g. [::1]:10000, got \"::1:80\"");
    EXPECT_EQ(parseAddress(":80").error(),
              "missing host in \":80\"; expected host:port, e.g. 127.0.0.1:10000 or [::1]:10000");
    EXPECT_EQ(parseAddress("").error(),
              "empty address; expected host:port, e.g. 127.0.0.1:10000 or [::1]:10000");
}

TEST(SocketAddress, ToStringRoundTrips) {
    for (const char* text :
         {"127.0.0.1:10000", "0.0.0.0:0", "[::1]:10000", "[::]:0", "[::ffff:127.0.0.1]:443"}) {
        const SocketAddress a = parsed(text);
        EXPECT_EQ(a.toString(), text);
        EXPECT_EQ(parsed(a.toString()), a) << text;
    }
    EXPECT_EQ(SocketAddress{}.toString(), "");
}

TEST(SocketAddress, EqualityComparesFamilyAddressAndPort) {
    EXPECT_EQ(parsed("127.0.0.1:80"), parsed("127.0.0.1:80"));
    EXPECT_NE(parsed("127.0.0.1:80"), parsed("127.0.0.1:81"));
    EXPECT_NE(parsed("127.0.0.1:80"), parsed("127.0.0.2:80"));
    EXPECT_NE(parsed("0.0.0.0:80"), parsed("[::]:80"));
    EXPECT_NE(parsed("[::1]:80"), parsed("[::2]:80"));
    EXPECT_EQ(SocketAddress{}, SocketAddress{});
}

TEST(SocketAddress, SetPort) {
    SocketAddress a = parsed("[::1]:0");
    a.setPort(4242);
    EXPECT_EQ(a.toString(), "[::1]:4242");
    SocketAddress b = parsed("127.0.0.9:1");
    b.setPort(65535);
    EXPECT_EQ(b.toString(), "127.0.0.9:65535");
}

TEST(AddressFromSockaddr, CopiesIPv4AndIPv6) {
    sockaddr_in sin{};
    sin.sin_family = AF_INET;
    sin.sin_port = htons(8080);
    sin.sin_addr.s_addr = htonl(0x7f000009);
    const SocketAddress a = addressFromSockaddr(reinterpret_cast<sockaddr*>(&sin), sizeof(sin));
    EXPECT_EQ(a.length, sizeof(sin));
    EXPECT_EQ(a, parsed("127.0.0.9:8080"));

    sockaddr_in6 sin6{};
    sin6.sin6_family = AF_INET6;
    sin6.sin6_port = htons(443);
    sin6.sin6_addr = in6addr_loopback;
    const SocketAddress b = addressFromSockaddr(reinterpret_cast<sockaddr*>(&sin6), sizeof(sin6));
    EXPECT_EQ(b.length, sizeof(sin6));
    EXPECT_EQ(b.toString(), "[::1]:443");
}

std::optional<BackendRefusal> refusal(std::string_view text) { return refusalOf(parsed(text)); }

TEST(RefusalOf, RefusesAddressesThatReachNoServiceOrTheLocalHost) {
    EXPECT_EQ(refusal("0.0.0.0:80"), BackendRefusal::Unspecified);
    EXPECT_EQ(refusal("[::]:80"), BackendRefusal::Unspecified);
    EXPECT_EQ(refusal("[::ffff:0.0.0.0]:80"), BackendRefusal::Unspecified);
    EXPECT_EQ(refusal("255.255.255.255:80"), BackendRefusal::Broadcast);
    EXPECT_EQ(refusal("[::ffff:255.255.255.255]:80"), BackendRefusal::Broadcast);
    EXPECT_EQ(refusal("224.0.0.1:80"), BackendRefusal::Multicast);
    EXPECT_EQ(refusal("239.255.255.255:80"), BackendRefusal::Multicast);
    EXPECT_EQ(refusal("[ff02::1]:80"), BackendRefusal::Multicast);
    EXPECT_EQ(refusal("[::ffff:224.0.0.1]:80"), BackendRefusal::Multicast);
    EXPECT_EQ(refusal("127.0.0.1:0"), BackendRefusal::PortZero);
    EXPECT_EQ(refusal("[::1]:0"), BackendRefusal::PortZero);
    // The address says more than the port: 0.0.0.0:0 is unspecified.
    EXPECT_EQ(refusal("0.0.0.0:0"), BackendRefusal::Unspecified);
}

TEST(RefusalOf, LeavesOrdinaryAddressesAlone) {
    for (const char* ok : {"127.0.0.1:80", "10.0.0.1:1", "223.255.255.255:80", "240.0.0.1:80",
                           "255.255.255.254:80", "[::1]:80", "[fe80::1]:80", "[2001:db8::1]:443",
                           "[::ffff:10.0.0.1]:80", "0.0.0.1:80", "unix:/run/app.sock"})
        EXPECT_EQ(refusal(ok), std::nullopt) << ok;
    EXPECT_EQ(label(BackendRefusal::PortZero), "port_zero");
    EXPECT_EQ(label(BackendRefusal::Self), "self");
}

bool reach(std::string_view target, std::string_view listen,
           const std::vector<SocketAddress>& local = {}) {
    return reaches(parsed(target), parsed(listen), local);
}

TEST(Reaches, TheSameAddressAndPortItsV4MappedFormButNotAnotherPort) {
    EXPECT_TRUE(reach("127.0.0.1:10000", "127.0.0.1:10000"));
    EXPECT_TRUE(reach("[::ffff:127.0.0.1]:10000", "127.0.0.1:10000"));
    EXPECT_TRUE(reach("[::1]:10000", "[::1]:10000"));
    EXPECT_TRUE(reach("10.1.2.3:80", "10.1.2.3:80"));
    EXPECT_FALSE(reach("127.0.0.1:10001", "127.0.0.1:10000"));
    // A listener bound to one loopback address does not take another's connections.
    EXPECT_FALSE(reach("127.0.0.2:10000", "127.0.0.1:10000"));
    EXPECT_FALSE(reach("[::1]:10000", "127.0.0.1:10000"));
    // Port 0 in `listen` is not bound yet: nothing reaches it.
    EXPECT_FALSE(reach("127.0.0.1:0", "127.0.0.1:0"));
    EXPECT_TRUE(reach("unix:/run/a.sock", "unix:/run/a.sock"));
    EXPECT_FALSE(reach("unix:/run/a.sock", "unix:/run/b.sock"));
    EXPECT_FALSE(reach("unix:/run/a.sock", "127.0.0.1:80"));
}

TEST(Reaches, AWildcardListenerEveryLocalAddressOfItsFamilyAtItsPort) {
    const std::vector<SocketAddress> local = {parsed("10.9.8.7:0"), parsed("[2001:db8::7]:0")};
    EXPECT_TRUE(reach("127.0.0.1:80", "0.0.0.0:80", local));
    EXPECT_TRUE(reach("127.45.0.3:80", "0.0.0.0:80", local));  // all of 127/8
    EXPECT_TRUE(reach("[::ffff:127.0.0.1]:80", "0.0.0.0:80", local));
    EXPECT_TRUE(reach("10.9.8.7:80", "0.0.0.0:80", local));
    EXPECT_TRUE(reach("[::ffff:10.9.8.7]:80", "0.0.0.0:80", local));
    EXPECT_FALSE(reach("10.9.8.6:80", "0.0.0.0:80", local));  // another host
    EXPECT_FALSE(reach("10.9.8.7:81", "0.0.0.0:80", local));
    EXPECT_FALSE(reach("[::1]:80", "0.0.0.0:80", local));
    EXPECT_TRUE(reach("[::1]:80", "[::]:80", local));
    EXPECT_TRUE(reach("[2001:db8::7]:80", "[::]:80", local));
    EXPECT_FALSE(reach("[2001:db8::8]:80", "[::]:80", local));
    // The relay's [::] sockets are IPV6_V6ONLY: an IPv4 connect never reaches them.
    EXPECT_FALSE(reach("127.0.0.1:80", "[::]:80", local));
    EXPECT_FALSE(reach("[::ffff:127.0.0.1]:80", "[::]:80", local));
}

TEST(LocalAddresses, HasTheLoopbackAddressesAtPortZero) {
    const std::vector<SocketAddress> local = localAddresses();
    // Every test host has lo; ::1 only where IPv6 is on, so only 127.0.0.1 is required.
    EXPECT_NE(std::find(local.begin(), local.end(), parsed("127.0.0.1:0")), local.end());
    for (const SocketAddress& a : local) {
        EXPECT_TRUE(a.family() == AF_INET || a.family() == AF_INET6) << a.toString();
        EXPECT_EQ(a.port(), 0);
    }
}

}  // namespace
}  // namespace zcrelay
