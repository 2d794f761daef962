#pragma once
// The takeover's wire (takeover.hpp has the conversation): one message per SOCK_SEQPACKET
// record, a verb and key=value fields in one line of text, and at most kMaxFds fds riding along
// (SCM_RIGHTS). Text, so that `strace -s` of either side reads as the protocol does; one
// record per message, so that the fds always arrive with the message that says what they are
// (on a stream socket the kernel attaches them to a byte, and a short read could split them).
//
//   SOCKET kind=listener name=web listen=127.0.0.1:80 bound=127.0.0.1:80   (+ 1 fd)
//   CONN listener=web cluster=web backend=127.0.0.1:8080 ...               (+ 2 to 6 fds)
//
// Values are percent-escaped where they hold a space, '=', '%' or a byte outside printable
// ASCII; a key may repeat (a list). A record over kMaxMessage, a line that does not parse, more
// than kMaxFds fds, or fds cut off (MSG_CTRUNC) is an error naming what came, with every fd
// that came closed.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <tl/expected.hpp>
#include <utility>
#include <vector>

#include "unique_fd.hpp"

namespace zcrelay::takeover {

// A taker's READY lists every listener and backend it can take connections for.
inline constexpr size_t kMaxMessage = 64 * 1024;
// A connection's two sockets and, per direction, a pipe's two ends (handover.hpp).
inline constexpr size_t kMaxFds = 6;

struct Message {
    std::string verb;
    std::vector<std::pair<std::string, std::string>> fields;
    std::vector<UniqueFd> fds;  // received: what came with it, in order

    Message() = default;
    explicit Message(std::string v) : verb(std::move(v)) {}
    Message& set(std::string key, std::string value) {
        fields.emplace_back(std::move(key), std::move(value));
        return *this;
    }
    // The value of `key`, or "" when absent.
    std::string get(std::string_view key) const;
    // Every value of `key`, in order.
    std::vector<std::string> all(std::string_view key) const;
    // "SOCKET kind=listener ...": for logs and errors.
    std::string line() const;
};

tl::expected<Message, std::string> parse(std::string_view text);

// receive()'s error for a record whose fds the kernel could not all install (MSG_CTRUNC: the
// receiver's open-file limit); the record itself is consumed.
inline constexpr std::string_view kFdsCutOff = "fds cut off";

// Both wait at most until `deadline_ms` (monotonicMs()) on a nonblocking socket; the error
// says what failed, "closed" when the other side went away first. `fds` (at most kMaxFds) ride
// along: the receiver gets its own, and the caller's stay open.
tl::expected<void, std::string> send(int sock, const Message& m, int64_t deadline_ms,
                                     std::span<const int> fds = {});
tl::expected<Message, std::string> receive(int sock, int64_t deadline_ms);

}  // namespace zcrelay::takeover
