#pragma once
// A socket address as the config names it: "127.0.0.1:10000", "[::1]:10000" or, for a
// backend, "unix:/run/app.sock".
#include <sys/socket.h>

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tl/expected.hpp>
#include <vector>

namespace zcrelay {

struct SocketAddress {
    sockaddr_storage storage{};
    socklen_t length = 0;

    int family() const { return storage.ss_family; }
    const sockaddr* sockaddrPtr() const { return reinterpret_cast<const sockaddr*>(&storage); }
    uint16_t port() const;
    void setPort(uint16_t port);
    // "127.0.0.1:10000" / "[::1]:10000": the form parseAddress() accepts.
    std::string toString() const;

    bool operator==(const SocketAddress& other) const;
};

// Accepts numeric IPv4 "a.b.c.d:port", bracketed IPv6 "[addr]:port" (port 0..65535; 0 lets
// the kernel choose) and "unix:/absolute/path". No name resolution: a relay must not block on DNS at start-up or reload.
// The error says what is wrong with the text, without the key (the caller adds the key).
tl::expected<SocketAddress, std::string> parseAddress(std::string_view text);

// Same, for an address read from the kernel (getsockname, accept).
SocketAddress addressFromSockaddr(const sockaddr* sa, socklen_t len);

// The IP address of `a` as 16 bytes, IPv4 as its v4-mapped IPv6 form (::ffff:a.b.c.d), so that
// a dual-stack socket's view of an IPv4 peer compares equal to the IPv4 address; all zeros for
// a unix address. The port is not part of it.
std::array<uint8_t, 16> mappedIp(const SocketAddress& a);

// Why an address is refused as a backend (a DNS answer's, or a static one at config load): the
// `reason` label of zcrelay_discovery_refused_total. Each would connect to no service or to
// the relay itself, and a relay that connects to itself relays to itself again, once per
// client connection, until its fds run out.
#define ZCRELAY_BACKEND_REFUSALS(X)                                                        \
    X(Unspecified, "unspecified") /* 0.0.0.0, ::: Linux connects that to the local host */ \
    X(Broadcast, "broadcast")     /* 255.255.255.255: no TCP peer */                       \
    X(Multicast, "multicast")     /* 224.0.0.0/4, ff00::/8: no TCP peer */                 \
    X(PortZero, "port_zero")      /* port 0 is no service (connect fails ECONNREFUSED) */  \
    X(Self, "self")               /* an address:port the relay itself listens on */

#define ZCRELAY_REFUSAL_ITEM(name, label) name,
#define ZCRELAY_REFUSAL_LABEL(name, label) label,
enum class BackendRefusal : uint8_t { ZCRELAY_BACKEND_REFUSALS(ZCRELAY_REFUSAL_ITEM) kCount };
inline constexpr std::array<std::string_view, static_cast<size_t>(BackendRefusal::kCount)>
    kBackendRefusalLabels{ZCRELAY_BACKEND_REFUSALS(ZCRELAY_REFUSAL_LABEL)};
#undef ZCRELAY_REFUSAL_ITEM
#undef ZCRELAY_REFUSAL_LABEL
inline std::string_view label(BackendRefusal r) {
    return kBackendRefusalLabels[static_cast<size_t>(r)];
}

// What a refusal means, for a log line or an error: "port 0 is no service".
std::string_view whyRefused(BackendRefusal r);

// The refusal `a` earns whoever listens where (every reason but Self); nullopt when it may be
// a backend. A v4-mapped IPv6 address ([::ffff:a.b.c.d]) is judged as the IPv4 one it carries:
// a connect to it is IPv4. A unix address is never refused here.
std::optional<BackendRefusal> refusalOf(const SocketAddress& a);

// Whether a connect to `target` reaches a socket listening on `listen`: the same address and
// port, or, for a wildcard `listen` (0.0.0.0, [::]), any local address at that port: 127/8 and
// ::1, and `local` (the host's interface addresses, as localAddresses() gives them). [::] covers
// IPv6 only: every listening socket of the relay sets IPV6_V6ONLY (listener.cpp,
// http_server.cpp), so an IPv4 connect never reaches it. v4-mapped targets count as IPv4. Unix
// addresses: the same path. A `listen` at port 0 (not bound yet) is reached by nothing.
bool reaches(const SocketAddress& target, const SocketAddress& listen,
             std::span<const SocketAddress> local);

// The host's interface addresses (getifaddrs: IPv4 and IPv6, port 0); empty if it fails.
std::vector<SocketAddress> localAddresses();

}  // namespace zcrelay
