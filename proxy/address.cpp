#include "address.hpp"

#include <arpa/inet.h>
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

}  // namespace zcrelay
