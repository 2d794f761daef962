#include "address.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/un.h>

#include <algorithm>
#include <charconv>
#include <cstring>

#include "units.hpp"

namespace zcrelay {
namespace {

constexpr std::string_view kExpected = "expected host:port, e.g. 127.0.0.1:10000 or [::1]:10000";

const sockaddr_in& v4(const SocketAddress& a) {
    return *reinterpret_cast<const sockaddr_in*>(&a.storage);
}
const sockaddr_in6& v6(const SocketAddress& a) {
    return *reinterpret_cast<const sockaddr_in6*>(&a.storage);
}
const sockaddr_un& un(const SocketAddress& a) {
    return *reinterpret_cast<const sockaddr_un*>(&a.storage);
}
constexpr std::string_view kUnixPrefix = "unix:";

tl::expected<uint16_t, std::string> parsePort(std::string_view port, std::string_view text) {
    if (port.empty()) {
        return tl::unexpected("missing port in " + quoted(text) + "; " + std::string(kExpected));
    }
    unsigned value = 0;
    const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
    if (end != port.data() + port.size() ||
        (ec != std::errc() && ec != std::errc::result_out_of_range)) {
        return tl::unexpected("bad port " + quoted(port) + " in " + quoted(text));
    }
    if (ec == std::errc::result_out_of_range || value > 65535) {
        return tl::unexpected("port " + std::string(port) + " is out of range (0..65535)");
    }
    return static_cast<uint16_t>(value);
}

}  // namespace

uint16_t SocketAddress::port() const {
    if (family() == AF_INET) return ntohs(v4(*this).sin_port);
    if (family() == AF_INET6) return ntohs(v6(*this).sin6_port);
    return 0;
}

void SocketAddress::setPort(uint16_t port) {
    if (family() == AF_INET) reinterpret_cast<sockaddr_in*>(&storage)->sin_port = htons(port);
    if (family() == AF_INET6) reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port = htons(port);
}

std::string SocketAddress::toString() const {
    char host[INET6_ADDRSTRLEN] = {};
    if (family() == AF_INET) {
        inet_ntop(AF_INET, &v4(*this).sin_addr, host, sizeof(host));
        return std::string(host) + ":" + std::to_string(port());
    }
    if (family() == AF_INET6) {
        inet_ntop(AF_INET6, &v6(*this).sin6_addr, host, sizeof(host));
        std::string out(1, '[');
        out.append(host).append("]:").append(std::to_string(port()));
        return out;
    }
    if (family() == AF_UNIX) return std::string(kUnixPrefix) + un(*this).sun_path;
    return "";
}

bool SocketAddress::operator==(const SocketAddress& other) const {
    if (family() != other.family() || port() != other.port()) return false;
    if (family() == AF_INET) return v4(*this).sin_addr.s_addr == v4(other).sin_addr.s_addr;
    if (family() == AF_INET6) {
        return std::memcmp(&v6(*this).sin6_addr, &v6(other).sin6_addr, sizeof(in6_addr)) == 0;
    }
    if (family() == AF_UNIX) return std::strcmp(un(*this).sun_path, un(other).sun_path) == 0;
    return true;  // both unset
}

tl::expected<SocketAddress, std::string> parseAddress(std::string_view text) {
    if (text.empty()) return tl::unexpected("empty address; " + std::string(kExpected));

    SocketAddress address;
    if (text.starts_with(kUnixPrefix)) {
        const std::string_view path = text.substr(kUnixPrefix.size());
        auto& sun = *reinterpret_cast<sockaddr_un*>(&address.storage);
        if (path.empty() || path.front() != '/') {
            return tl::unexpected(
                std::string("a unix socket needs an absolute path, e.g. unix:/run/app.sock"));
        }
        if (path.size() >= sizeof(sun.sun_path)) {
            return tl::unexpected("unix socket path longer than " +
                                  std::to_string(sizeof(sun.sun_path) - 1) + " bytes");
        }
        sun.sun_family = AF_UNIX;
        std::memcpy(sun.sun_path, path.data(), path.size());
        address.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + 1);
        return address;
    }
    std::string_view port;
    if (text.front() == '[') {
        const size_t close = text.find(']');
        if (close == std::string_view::npos) {
            return tl::unexpected("missing ']' in " + quoted(text));
        }
        const std::string host(text.substr(1, close - 1));
        const std::string_view rest = text.substr(close + 1);
        if (!rest.empty() && rest.front() != ':') {
            return tl::unexpected("expected ':' and a port after ']' in " + quoted(text));
        }
        auto& sin6 = *reinterpret_cast<sockaddr_in6*>(&address.storage);
        if (inet_pton(AF_INET6, host.c_str(), &sin6.sin6_addr) != 1) {
            return tl::unexpected(quoted(host) + " is not a numeric IPv6 address");
        }
        sin6.sin6_family = AF_INET6;
        address.length = sizeof(sockaddr_in6);
        port = rest.empty() ? rest : rest.substr(1);
    } else {
        const size_t colon = text.rfind(':');
        if (colon == std::string_view::npos) {
            return tl::unexpected("missing port in " + quoted(text) + "; " +
                                  std::string(kExpected));
        }
        const std::string host(text.substr(0, colon));
        if (host.find(':') != std::string::npos) {
            return tl::unexpected("IPv6 addresses need brackets, e.g. [::1]:10000, got " +
                                  quoted(text));
        }
        if (host.empty()) {
            return tl::unexpected("missing host in " + quoted(text) + "; " +
                                  std::string(kExpected));
        }
        auto& sin = *reinterpret_cast<sockaddr_in*>(&address.storage);
        if (inet_pton(AF_INET, host.c_str(), &sin.sin_addr) != 1) {
            const bool looks_like_name = std::any_of(host.begin(), host.end(), [](char c) {
                return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
            });
            return tl::unexpected(quoted(host) +
                                  (looks_like_name
                                       ? " is not a numeric IP address; names are not resolved"
                                       : " is not a valid IPv4 address"));
        }
        sin.sin_family = AF_INET;
        address.length = sizeof(sockaddr_in);
        port = text.substr(colon + 1);
    }

    const auto port_number = parsePort(port, text);
    if (!port_number) return tl::unexpected(port_number.error());
    address.setPort(*port_number);
    return address;
}

SocketAddress addressFromSockaddr(const sockaddr* sa, socklen_t len) {
    SocketAddress address;
    if (sa == nullptr) return address;
    address.length = std::min<socklen_t>(len, sizeof(address.storage));
    std::memcpy(&address.storage, sa, address.length);
    return address;
}

std::array<uint8_t, 16> mappedIp(const SocketAddress& a) {
    std::array<uint8_t, 16> ip{};
    if (a.family() == AF_INET6) {
        std::memcpy(ip.data(), &v6(a).sin6_addr, 16);
    } else if (a.family() == AF_INET) {
        ip[10] = ip[11] = 0xff;
        std::memcpy(ip.data() + 12, &v4(a).sin_addr, 4);
    }
    return ip;
}

namespace {

// An IPv4 address or a v4-mapped IPv6 one, as its IPv4 number (host order); nullopt otherwise.
std::optional<uint32_t> ipv4Of(const SocketAddress& a) {
    if (a.family() == AF_INET) return ntohl(v4(a).sin_addr.s_addr);
    if (a.family() == AF_INET6 && IN6_IS_ADDR_V4MAPPED(&v6(a).sin6_addr)) {
        uint32_t n;
        std::memcpy(&n, &v6(a).sin6_addr.s6_addr[12], sizeof n);
        return ntohl(n);
    }
    return std::nullopt;
}

const in6_addr* ipv6Of(const SocketAddress& a) {
    if (a.family() != AF_INET6 || IN6_IS_ADDR_V4MAPPED(&v6(a).sin6_addr)) return nullptr;
    return &v6(a).sin6_addr;
}

bool sameHost(const SocketAddress& a, const SocketAddress& b) {
    const auto a4 = ipv4Of(a), b4 = ipv4Of(b);
    if (a4 || b4) return a4 && b4 && *a4 == *b4;
    const in6_addr *a6 = ipv6Of(a), *b6 = ipv6Of(b);
    return a6 && b6 && std::memcmp(a6, b6, sizeof *a6) == 0;
}

}  // namespace

std::string_view whyRefused(BackendRefusal r) {
    switch (r) {
        case BackendRefusal::Unspecified:
            return "a connect to it reaches the local host";
        case BackendRefusal::Broadcast:
            return "the broadcast address: no TCP service answers there";
        case BackendRefusal::Multicast:
            return "a multicast address: no TCP service answers there";
        case BackendRefusal::PortZero:
            return "port 0 is no service";
        case BackendRefusal::Self:
        case BackendRefusal::kCount:
            break;
    }
    return "the relay's own address: a loop";
}

std::optional<BackendRefusal> refusalOf(const SocketAddress& a) {
    if (const auto ip = ipv4Of(a)) {
        if (*ip == 0) return BackendRefusal::Unspecified;
        if (*ip == 0xffffffffu) return BackendRefusal::Broadcast;
        if ((*ip >> 28) == 0xe) return BackendRefusal::Multicast;
    } else if (const in6_addr* ip6 = ipv6Of(a)) {
        if (IN6_IS_ADDR_UNSPECIFIED(ip6)) return BackendRefusal::Unspecified;
        if (IN6_IS_ADDR_MULTICAST(ip6)) return BackendRefusal::Multicast;
    } else {
        return std::nullopt;  // unix
    }
    if (a.port() == 0) return BackendRefusal::PortZero;
    return std::nullopt;
}

bool reaches(const SocketAddress& target, const SocketAddress& listen,
             std::span<const SocketAddress> local) {
    if (target.family() == AF_UNIX || listen.family() == AF_UNIX)
        return target.family() == listen.family() && target == listen;
    if (listen.port() == 0 || target.port() != listen.port()) return false;
    if (sameHost(target, listen)) return true;
    // A wildcard listener takes whatever arrives for a local address of its family.
    const auto listen4 = ipv4Of(listen);
    const in6_addr* listen6 = ipv6Of(listen);
    const bool wildcard4 = listen4 && *listen4 == 0;
    const bool wildcard6 = listen6 && IN6_IS_ADDR_UNSPECIFIED(listen6);
    if (!wildcard4 && !wildcard6) return false;
    const auto target4 = ipv4Of(target);
    const in6_addr* target6 = ipv6Of(target);
    if (wildcard4 && !target4) return false;
    if (wildcard6 && !target6) return false;
    // 127/8 is local as a whole (the kernel's loopback route), not only 127.0.0.1.
    if (target4 && (*target4 >> 24) == 127) return true;
    if (target6 && IN6_IS_ADDR_LOOPBACK(target6)) return true;
    return std::any_of(local.begin(), local.end(),
                       [&](const SocketAddress& l) { return sameHost(target, l); });
}

std::vector<SocketAddress> localAddresses() {
    std::vector<SocketAddress> out;
    ifaddrs* list = nullptr;
    if (getifaddrs(&list) != 0) return out;
    for (const ifaddrs* i = list; i; i = i->ifa_next) {
        if (!i->ifa_addr) continue;
        const int family = i->ifa_addr->sa_family;
        if (family == AF_INET)
            out.push_back(addressFromSockaddr(i->ifa_addr, sizeof(sockaddr_in)));
        else if (family == AF_INET6)
            out.push_back(addressFromSockaddr(i->ifa_addr, sizeof(sockaddr_in6)));
        else
            continue;
        out.back().setPort(0);
    }
    freeifaddrs(list);
    return out;
}

}  // namespace zcrelay
