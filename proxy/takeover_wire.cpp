#include "takeover_wire.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "clock.hpp"
#include "result.hpp"

namespace zcrelay::takeover {
namespace {

bool plain(unsigned char c) { return c > ' ' && c < 0x7f && c != '%' && c != '='; }

std::string escape(std::string_view v) {
    static const char kHex[] = "0123456789ABCDEF";
    std::string out;
    for (unsigned char c : v) {
        if (plain(c)) {
            out += static_cast<char>(c);
        } else {
            out += '%';
            out += kHex[c >> 4];
            out += kHex[c & 15];
        }
    }
    return out;
}

int hexValue(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

tl::expected<std::string, std::string> unescape(std::string_view v) {
    std::string out;
    for (size_t i = 0; i < v.size(); ++i) {
        if (v[i] != '%') {
            out += v[i];
            continue;
        }
        const int a = i + 1 < v.size() ? hexValue(v[i + 1]) : -1;
        const int b = i + 2 < v.size() ? hexValue(v[i + 2]) : -1;
        if (a < 0 || b < 0) return tl::unexpected(std::string("a bad escape"));
        out += static_cast<char>(a * 16 + b);
        i += 2;
    }
    return out;
}

// Waits for `events` on `sock` until the deadline: "" when ready, else why not.
std::string waitFor(int sock, short events, int64_t deadline_ms) {
    for (;;) {
        const int64_t left = deadline_ms - monotonicMs();
        if (left <= 0) return "timed out";
        pollfd p{sock, events, 0};
        const int n = ::poll(&p, 1, static_cast<int>(left));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return errnoText("poll");
        if (n > 0) return "";
    }
}

}  // namespace

std::string Message::get(std::string_view key) const {
    for (const auto& [k, v] : fields)
        if (k == key) return v;
    return "";
}

std::vector<std::string> Message::all(std::string_view key) const {
    std::vector<std::string> out;
    for (const auto& [k, v] : fields)
        if (k == key) out.push_back(v);
    return out;
}

std::string Message::line() const {
    std::string out = verb;
    for (const auto& [k, v] : fields) out += " " + k + "=" + escape(v);
    return out;
}

tl::expected<Message, std::string> parse(std::string_view text) {
    Message m;
    size_t at = 0;
    auto word = [&]() -> std::string_view {
        while (at < text.size() && text[at] == ' ') ++at;
        const size_t start = at;
        while (at < text.size() && text[at] != ' ') ++at;
        return text.substr(start, at - start);
    };
    m.verb = std::string(word());
    if (m.verb.empty()) return tl::unexpected(std::string("an empty message"));
    for (unsigned char c : m.verb)
        if (c < 'A' || c > 'Z') return tl::unexpected("a bad verb \"" + escape(m.verb) + "\"");
    for (std::string_view w = word(); !w.empty(); w = word()) {
        const size_t eq = w.find('=');
        if (eq == 0 || eq == std::string_view::npos)
            return tl::unexpected("a field without key=value: \"" + escape(w) + "\"");
        auto value = unescape(w.substr(eq + 1));
        if (!value) return tl::unexpected(value.error() + " in \"" + escape(w) + "\"");
        m.set(std::string(w.substr(0, eq)), std::move(*value));
    }
    return m;
}

tl::expected<void, std::string> send(int sock, const Message& m, int64_t deadline_ms,
                                     std::span<const int> fds) {
    const std::string text = m.line();
    if (text.size() > kMaxMessage) return tl::unexpected(m.verb + ": longer than kMaxMessage");
    if (fds.size() > kMaxFds) return tl::unexpected(m.verb + ": more than kMaxFds fds");
    iovec iov{const_cast<char*>(text.data()), text.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
    if (!fds.empty()) {
        msg.msg_control = control;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    for (;;) {
        const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n == static_cast<ssize_t>(text.size())) return {};
        if (n >= 0) return tl::unexpected(m.verb + ": sent in part");
        if (errno == EINTR) continue;
        if (errno == EPIPE || errno == ECONNRESET) return tl::unexpected(std::string("closed"));
        if (errno != EAGAIN) return tl::unexpected(errnoText("sendmsg " + m.verb));
        if (std::string why = waitFor(sock, POLLOUT, deadline_ms); !why.empty())
            return tl::unexpected("sending " + m.verb + ": " + why);
    }
}

tl::expected<Message, std::string> receive(int sock, int64_t deadline_ms) {
    // One byte over the limit, so that a longer record shows as MSG_TRUNC; room for one fd
    // over kMaxFds, so that more show as too many rather than as cut off.
    thread_local std::vector<char> buf(kMaxMessage + 1);
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * (kMaxFds + 1))] = {};
    iovec iov{buf.data(), buf.size()};
    msghdr msg{};
    for (;;) {
        msg = msghdr{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        const ssize_t n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (n > 0) {
            // Every fd that came is owned before anything is judged, so none leaks.
            std::vector<UniqueFd> fds;
            for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
                if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
                const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                for (size_t i = 0; i < count; ++i) {
                    int fd = -1;
                    std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                    fds.emplace_back(fd);
                }
            }
            if (msg.msg_flags & MSG_TRUNC) return tl::unexpected(std::string("a message too long"));
            if (msg.msg_flags & MSG_CTRUNC) return tl::unexpected(std::string(kFdsCutOff));
            if (fds.size() > kMaxFds)
                return tl::unexpected("more than " + std::to_string(kMaxFds) + " fds in a message");
            auto m = parse(std::string_view(buf.data(), static_cast<size_t>(n)));
            if (!m) return tl::unexpected(m.error());
            m->fds = std::move(fds);
            return m;
        }
        if (n == 0) return tl::unexpected(std::string("closed"));
        // A peer that closed with our message unread makes the kernel report ECONNRESET once,
        // before the messages it sent first: those are still queued, and read next.
        if (errno == EINTR || errno == ECONNRESET) continue;
        if (errno != EAGAIN) return tl::unexpected(errnoText("recvmsg"));
        if (std::string why = waitFor(sock, POLLIN, deadline_ms); !why.empty())
            return tl::unexpected("waiting for a message: " + why);
    }
}

}  // namespace zcrelay::takeover
