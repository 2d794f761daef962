#pragma once
// The takeover's wire (takeover.hpp has the conversation): one message per SOCK_SEQPACKET
// record, a verb and key=value fields in one line of text, and at most one fd riding along
// (SCM_RIGHTS). Text, so that `strace -s` of either side reads as the protocol does; one
// record per message, so that an fd always arrives with the message that says what it is
// (on a stream socket the kernel attaches it to a byte, and a short read could split them).
//
//   SOCKET kind=listener name=web listen=127.0.0.1:80 bound=127.0.0.1:80   (+ fd)
//
// Values are percent-escaped where they hold a space, '=', '%' or a byte outside printable
// ASCII. A record over kMaxMessage, a line that does not parse, more than one fd, or a
// truncated one (MSG_CTRUNC) is an error naming what came.
#include <cstdint>
#include <string>
#include <string_view>
#include <tl/expected.hpp>
#include <utility>
#include <vector>

#include "unique_fd.hpp"

namespace zcrelay::takeover {

inline constexpr size_t kMaxMessage = 4096;

struct Message {
    std::string verb;
    std::vector<std::pair<std::string, std::string>> fields;
    UniqueFd fd;  // none for most messages

    Message() = default;
    explicit Message(std::string v) : verb(std::move(v)) {}
    Message& set(std::string key, std::string value) {
        fields.emplace_back(std::move(key), std::move(value));
        return *this;
    }
    // The value of `key`, or "" when absent.
    std::string get(std::string_view key) const;
    // "SOCKET kind=listener ...": for logs and errors.
    std::string line() const;
};

tl::expected<Message, std::string> parse(std::string_view text);

// Both wait at most until `deadline_ms` (monotonicMs()) on a nonblocking socket; the error
// says what failed, "closed" when the other side went away first.
tl::expected<void, std::string> send(int sock, const Message& m, int64_t deadline_ms);
tl::expected<Message, std::string> receive(int sock, int64_t deadline_ms);

}  // namespace zcrelay::takeover
