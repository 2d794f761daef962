#pragma once
// The JSON the runtime API reads and writes. Requests are one flat object of strings, whole
// numbers, booleans and nulls ({"state": "drain", "weight": 0}); anything else is refused with
// the byte offset and what was expected there, never guessed at. Replies are written with
// jsonString(), which escapes every byte outside printable ASCII as \u00XX: the names it writes
// (clusters, addresses, DNS names) are ASCII by construction, and the reply stays valid JSON
// whatever a request echoed back holds.
#include <cstdint>
#include <string>
#include <string_view>
#include <tl/expected.hpp>
#include <utility>
#include <vector>

namespace zcrelay {

struct FlatValue {
    enum class Type : uint8_t { String, Integer, Bool, Null };
    Type type = Type::Null;
    std::string string;
    int64_t integer = 0;
    bool boolean = false;
};

// Members in request order. Bounds: the text is at most what the caller read (the API caps
// the body), a string at most 1 KiB, at most 32 members.
using FlatObject = std::vector<std::pair<std::string, FlatValue>>;

// "expected ':' at byte 12", "duplicate member \"state\" at byte 30", ...
tl::expected<FlatObject, std::string> parseFlatObject(std::string_view text);

// `text` as a JSON string literal, quotes included.
std::string jsonString(std::string_view text);

}  // namespace zcrelay
