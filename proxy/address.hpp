#pragma once
// A socket address as the config names it: "127.0.0.1:10000", "[::1]:10000" or, for a
// backend, "unix:/run/app.sock".
#include <sys/socket.h>

#include <string>
#include <string_view>
#include <tl/expected.hpp>

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

}  // namespace zcrelay
