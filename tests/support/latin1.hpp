#pragma once
// What a JSON reader makes of the relay's jsonString() (proxy/flat_json.hpp): each byte >= 0x80
// is written as \u00XX, which reads back as the code point U+00XX, i.e. two UTF-8 bytes (a
// Latin-1 reading of the bytes). The unit cases of flat_json and its fuzz target both compare
// against it. Header-only and free of gtest: the fuzz target is built by clang++ alone, without
// gtest or test_support (tests/fuzz/CMakeLists.txt).
#include <string>
#include <string_view>

namespace zcrelay::test {

inline std::string latin1ToUtf8(std::string_view bytes) {
    std::string out;
    for (const char ch : bytes) {
        const auto c = static_cast<unsigned char>(ch);
        if (c < 0x80) {
            out += ch;
        } else {
            out += static_cast<char>(0xc0 | (c >> 6));
            out += static_cast<char>(0x80 | (c & 0x3f));
        }
    }
    return out;
}

}  // namespace zcrelay::test
