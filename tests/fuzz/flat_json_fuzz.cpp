// libFuzzer target for the runtime API's request reader (tests/fuzz/CMakeLists.txt): the body
// of an admin request is the bytes of whoever reached the API. parseFlatObject must never crash;
// what it refuses says where ("... at byte N", N within the text); what it takes, written back
// member by member with jsonString(), must read back as the same object. A broken invariant
// traps, so libFuzzer keeps the input.
//
// "The same object": jsonString() escapes byte by byte, so a byte >= 0x80 is written as \u00XX
// and reads back as U+00XX, two UTF-8 bytes (flat_json.hpp: replies are ASCII whatever they
// echo). Strings of ASCII must come back unchanged; any other byte as its U+00XX.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "flat_json.hpp"
#include "support/latin1.hpp"

namespace {

using namespace zcrelay;

void check(bool ok) {
    if (!ok) __builtin_trap();
}

using zcrelay::test::latin1ToUtf8;  // tests/support/latin1.hpp

// An error ends in " at byte N" with N at most the text's size.
void checkError(const std::string& error, size_t size) {
    constexpr std::string_view kAt = " at byte ";
    const size_t at = error.rfind(kAt);
    check(at != std::string::npos && at > 0);
    const std::string_view digits = std::string_view(error).substr(at + kAt.size());
    check(!digits.empty() && digits.size() <= 20);
    uint64_t n = 0;
    for (const char c : digits) {
        check(c >= '0' && c <= '9');
        n = n * 10 + static_cast<uint64_t>(c - '0');
    }
    check(n <= size);
}

void checkAscii(const std::string& json) {
    check(json.size() >= 2 && json.front() == '"' && json.back() == '"');
    for (const char c : json) check(c >= 0x20 && c < 0x7f);
}

std::string write(const FlatObject& object) {
    std::string out = "{";
    for (const auto& [key, value] : object) {
        if (out.size() > 1) out += ',';
        const std::string k = jsonString(key);
        checkAscii(k);
        out += k + ':';
        switch (value.type) {
            case FlatValue::Type::String: {
                const std::string v = jsonString(value.string);
                checkAscii(v);
                out += v;
                break;
            }
            case FlatValue::Type::Integer:
                out += std::to_string(value.integer);
                break;
            case FlatValue::Type::Bool:
                out += value.boolean ? "true" : "false";
                break;
            case FlatValue::Type::Null:
                out += "null";
                break;
        }
    }
    return out + "}";
}

bool sameValue(const FlatValue& a, const FlatValue& b) {
    if (a.type != b.type) return false;
    switch (a.type) {
        case FlatValue::Type::String:
            return a.string == b.string;
        case FlatValue::Type::Integer:
            return a.integer == b.integer;
        case FlatValue::Type::Bool:
            return a.boolean == b.boolean;
        case FlatValue::Type::Null:
            return true;
    }
    return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    const auto parsed = parseFlatObject(text);
    if (!parsed) {
        checkError(parsed.error(), size);
        return 0;
    }
    const FlatObject& object = *parsed;
    check(object.size() <= 32);

    // What the second read should give: keys and strings through the byte -> U+00XX mapping.
    FlatObject expected = object;
    bool fits = true;  // every string still at most 1 KiB once mapped
    for (auto& [key, value] : expected) {
        key = latin1ToUtf8(key);
        fits = fits && key.size() <= 1024;
        if (value.type == FlatValue::Type::String) {
            value.string = latin1ToUtf8(value.string);
            fits = fits && value.string.size() <= 1024;
        }
    }
    for (size_t i = 0; i < object.size(); ++i) {
        // Distinct keys stay distinct (the mapping is one to one).
        for (size_t j = 0; j < i; ++j) check(object[i].first != object[j].first);
        // A string is at most 1 KiB, plus the 2 bytes a \u escape decoding to 3 bytes can carry
        // it past (reported: the bound is checked before an escape is decoded, not after).
        check(object[i].first.size() <= 1024 + 2);
        if (object[i].second.type == FlatValue::Type::String)
            check(object[i].second.string.size() <= 1024 + 2);
    }

    const std::string written = write(object);
    const auto again = parseFlatObject(written);
    if (!again) {
        // Only the 1 KiB bound may refuse it: a high byte reads back as two.
        check(!fits);
        check(again.error().rfind("string longer than 1024 bytes at byte ", 0) == 0);
        checkError(again.error(), written.size());
        return 0;
    }
    check(again->size() == expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
        check((*again)[i].first == expected[i].first);
        check(sameValue((*again)[i].second, expected[i].second));
    }
    // Written again, an object of ASCII is the same text: the second read changed nothing.
    bool ascii = true;
    for (const auto& [key, value] : object) {
        for (const char c : key) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
        if (value.type == FlatValue::Type::String) {
            for (const char c : value.string) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
        }
    }
    if (ascii) check(write(*again) == written);
    return 0;
}
