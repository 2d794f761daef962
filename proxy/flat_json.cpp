#include "flat_json.hpp"

#include <charconv>
#include <cstdio>

namespace zcrelay {
namespace {

constexpr size_t kMaxString = 1024;
constexpr size_t kMaxMembers = 32;

class Reader {
  public:
    explicit Reader(std::string_view text) : text_(text) {}

    tl::expected<FlatObject, std::string> object() {
        FlatObject out;
        space();
        if (!eat('{')) return fail("expected '{'");
        space();
        if (eat('}')) return finish(std::move(out));
        for (;;) {
            space();
            const size_t key_at = at_;
            auto key = string();
            if (!key) return tl::unexpected(key.error());
            for (const auto& member : out)
                if (member.first == *key)
                    return tl::unexpected("duplicate member " + jsonString(*key) + " at byte " +
                                          std::to_string(key_at));
            space();
            if (!eat(':')) return fail("expected ':'");
            space();
            auto value = this->value(*key);
            if (!value) return tl::unexpected(value.error());
            out.emplace_back(std::move(*key), std::move(*value));
            if (out.size() > kMaxMembers) return fail("more than 32 members");
            space();
            if (eat(',')) continue;
            if (eat('}')) return finish(std::move(out));
            return fail("expected ',' or '}'");
        }
    }

  private:
    tl::expected<FlatObject, std::string> finish(FlatObject out) {
        space();
        if (at_ != text_.size()) return fail("expected the end after the object");
        return out;
    }
    tl::unexpected<std::string> fail(const std::string& what) const { return failAt(what, at_); }
    static tl::unexpected<std::string> failAt(const std::string& what, size_t at) {
        return tl::unexpected(what + " at byte " + std::to_string(at));
    }
    void space() {
        while (at_ < text_.size() && (text_[at_] == ' ' || text_[at_] == '\t' ||
                                      text_[at_] == '\n' || text_[at_] == '\r'))
            ++at_;
    }
    bool eat(char c) {
        if (at_ < text_.size() && text_[at_] == c) {
            ++at_;
            return true;
        }
        return false;
    }
    bool word(std::string_view w) {
        if (text_.substr(at_, w.size()) != w) return false;
        at_ += w.size();
        return true;
    }

    tl::expected<FlatValue, std::string> value(const std::string& key) {
        FlatValue v;
        if (at_ >= text_.size()) return fail("expected a value");
        const char c = text_[at_];
        if (c == '"') {
            auto s = string();
            if (!s) return tl::unexpected(s.error());
            v.type = FlatValue::Type::String;
            v.string = std::move(*s);
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            const size_t start = at_;
            if (c == '-') ++at_;
            // RFC 8259: no leading zeros ("007" is not a number).
            if (at_ + 1 < text_.size() && text_[at_] == '0' && text_[at_ + 1] >= '0' &&
                text_[at_ + 1] <= '9')
                return failAt("member " + jsonString(key) + " has a leading zero", at_);
            while (at_ < text_.size() && text_[at_] >= '0' && text_[at_] <= '9') ++at_;
            if (at_ < text_.size() && (text_[at_] == '.' || text_[at_] == 'e' || text_[at_] == 'E'))
                return fail("member " + jsonString(key) + " must be a whole number");
            const auto [end, ec] =
                std::from_chars(text_.data() + start, text_.data() + at_, v.integer);
            if (ec != std::errc() || end != text_.data() + at_ || at_ == start + (c == '-'))
                return fail("member " + jsonString(key) + " is not a number in range");
            v.type = FlatValue::Type::Integer;
        } else if (word("true") || word("false")) {
            v.type = FlatValue::Type::Bool;
            v.boolean = text_[at_ - 1] == 'e' && text_[at_ - 2] == 'u';
        } else if (word("null")) {
            v.type = FlatValue::Type::Null;
        } else if (c == '{' || c == '[') {
            return fail("member " + jsonString(key) +
                        " is an object or array; only strings, "
                        "numbers, booleans and null are accepted");
        } else {
            return fail("expected a value");
        }
        return v;
    }

    tl::expected<std::string, std::string> string() {
        if (!eat('"')) return fail("expected '\"'");
        std::string out;
        while (at_ < text_.size()) {
            // Errors name the byte that starts what is wrong: the character or its escape.
            const size_t here = at_;
            const auto c = static_cast<unsigned char>(text_[at_++]);
            if (c == '"') return out;
            if (c < 0x20) return failAt("raw control character in a string", here);
            if (c != '\\') {
                out += static_cast<char>(c);
                if (out.size() > kMaxString) return failAt("string longer than 1024 bytes", here);
                continue;
            }
            if (at_ >= text_.size()) break;
            const char e = text_[at_++];
            switch (e) {
                case '"':
                case '\\':
                case '/':
                    out += e;
                    break;
                case 'b':
                    out += '\b';
                    break;
                case 'f':
                    out += '\f';
                    break;
                case 'n':
                    out += '\n';
                    break;
                case 'r':
                    out += '\r';
                    break;
                case 't':
                    out += '\t';
                    break;
                case 'u': {
                    unsigned cp = 0;
                    if (at_ + 4 > text_.size()) return failAt("short \\u escape", here);
                    for (int i = 0; i < 4; ++i) {
                        const char h = text_[at_];
                        cp <<= 4;
                        if (h >= '0' && h <= '9')
                            cp |= h - '0';
                        else if (h >= 'a' && h <= 'f')
                            cp |= h - 'a' + 10;
                        else if (h >= 'A' && h <= 'F')
                            cp |= h - 'A' + 10;
                        else
                            return fail("bad hex digit in \\u escape");
                        ++at_;
                    }
                    // Names and states are ASCII; surrogate pairs are not worth accepting.
                    if (cp >= 0xd800 && cp <= 0xdfff)
                        return failAt("surrogate in \\u escape", here);
                    if (cp < 0x80) {
                        out += static_cast<char>(cp);
                    } else if (cp < 0x800) {
                        out += static_cast<char>(0xc0 | (cp >> 6));
                        out += static_cast<char>(0x80 | (cp & 0x3f));
                    } else {
                        out += static_cast<char>(0xe0 | (cp >> 12));
                        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
                        out += static_cast<char>(0x80 | (cp & 0x3f));
                    }
                    break;
                }
                default:
                    return failAt("unknown escape", here);
            }
            if (out.size() > kMaxString) return failAt("string longer than 1024 bytes", here);
        }
        return fail("unterminated string");
    }

    std::string_view text_;
    size_t at_ = 0;
};

}  // namespace

tl::expected<FlatObject, std::string> parseFlatObject(std::string_view text) {
    return Reader(text).object();
}

std::string jsonString(std::string_view text) {
    std::string out = "\"";
    for (const char ch : text) {
        const auto c = static_cast<unsigned char>(ch);
        if (c == '"' || c == '\\') {
            out += '\\';
            out += ch;
        } else if (c < 0x20 || c >= 0x7f) {
            // Escaped byte by byte: what we write is ASCII whatever the input held.
            char hex[8];
            std::snprintf(hex, sizeof hex, "\\u%04x", c);
            out += hex;
        } else {
            out += ch;
        }
    }
    return out + "\"";
}

}  // namespace zcrelay
