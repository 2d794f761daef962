#include "address.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>

namespace zcrelay {

// gtest shows failures as text, not as 128 bytes of sockaddr_storage.
inline void PrintTo(const SocketAddress& a, std::ostream* os) { *os << a.toString(); }

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

}  // namespace
}  // namespace zcrelay
