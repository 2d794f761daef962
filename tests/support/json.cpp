#include "support/json.hpp"

#include <cctype>
#include <charconv>
#include <cstdlib>
#include <cstring>

namespace zcrelay::test {
namespace {

class JsonReader {
  public:
    explicit JsonReader(std::string_view text) : t_(text) {}

    std::optional<Json> read(std::string& error) {
        Json v;
        if (!value(v, 0) || (space(), i_ != t_.size())) {
            error = error_.empty() ? "trailing text" : error_;
            error += " at offset " + std::to_string(i_);
            return std::nullopt;
        }
        return v;
    }

  private:
    static constexpr int kMaxDepth = 64;

    bool fail(const char* why) {
        if (error_.empty()) error_ = why;
        return false;
    }
    void space() {
        while (i_ < t_.size() && std::isspace(static_cast<unsigned char>(t_[i_]))) ++i_;
    }
    bool literal(std::string_view word) {
        if (t_.substr(i_, word.size()) != word) return fail("bad literal");
        i_ += word.size();
        return true;
    }
    bool value(Json& out, int depth) {
        if (depth > kMaxDepth) return fail("nested too deep");
        space();
        if (i_ >= t_.size()) return fail("unexpected end");
        char c = t_[i_];
        if (c == '{') return object(out, depth);
        if (c == '[') return array(out, depth);
        if (c == '"') {
            out.type = Json::Type::String;
            return string(out.string);
        }
        if (c == 't' || c == 'f') {
            out.type = Json::Type::Bool;
            out.boolean = c == 't';
            return literal(c == 't' ? "true" : "false");
        }
        if (c == 'n') return literal("null");
        return number(out);
    }
    bool number(Json& out) {
        size_t start = i_;
        while (i_ < t_.size() && (std::isdigit(static_cast<unsigned char>(t_[i_])) ||
                                  std::strchr("+-.eE", t_[i_]) != nullptr))
            ++i_;
        std::string text(t_.substr(start, i_ - start));
        if (text.empty()) return fail("unexpected character");
        char* end = nullptr;
        out.type = Json::Type::Number;
        out.number = std::strtod(text.c_str(), &end);
        out.raw = text;
        return *end == '\0' || fail("bad number");
    }
    bool string(std::string& out) {
        ++i_;  // the opening quote
        while (i_ < t_.size()) {
            char c = t_[i_++];
            if (c == '"') return true;
            if (static_cast<unsigned char>(c) < 0x20)
                return fail("raw control character in a string");
            if (c != '\\') {
                out += c;
                continue;
            }
            if (i_ >= t_.size()) break;
            char e = t_[i_++];
            switch (e) {
                case 'n':
                    out += '\n';
                    break;
                case 't':
                    out += '\t';
                    break;
                case 'r':
                    out += '\r';
                    break;
                case 'b':
                    out += '\b';
                    break;
                case 'f':
                    out += '\f';
                    break;
                case 'u': {
                    if (i_ + 4 > t_.size()) return fail("short \\u escape");
                    unsigned cp = 0;
                    auto [p, ec] = std::from_chars(t_.data() + i_, t_.data() + i_ + 4, cp, 16);
                    if (ec != std::errc{} || p != t_.data() + i_ + 4) return fail("bad \\u");
                    i_ += 4;
                    if (cp < 0x80) {
                        out += static_cast<char>(cp);
                    } else if (cp < 0x800) {
                        out += static_cast<char>(0xC0 | (cp >> 6));
                        out += static_cast<char>(0x80 | (cp & 0x3F));
                    } else {
                        out += static_cast<char>(0xE0 | (cp >> 12));
                        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
                        out += static_cast<char>(0x80 | (cp & 0x3F));
                    }
                    break;
                }
                case '"':
                case '\\':
                case '/':
                    out += e;
                    break;
                default:
                    return fail("unknown escape");
            }
        }
        return fail("unterminated string");
    }
    bool array(Json& out, int depth) {
        out.type = Json::Type::Array;
        ++i_;
        space();
        if (i_ < t_.size() && t_[i_] == ']') return ++i_, true;
        while (true) {
            out.array.emplace_back();
            if (!value(out.array.back(), depth + 1)) return false;
            space();
            if (i_ >= t_.size()) return fail("unterminated array");
            char c = t_[i_++];
            if (c == ']') return true;
            if (c != ',') return fail("expected , or ]");
        }
    }
    bool object(Json& out, int depth) {
        out.type = Json::Type::Object;
        ++i_;
        space();
        if (i_ < t_.size() && t_[i_] == '}') return ++i_, true;
        while (true) {
            space();
            if (i_ >= t_.size() || t_[i_] != '"') return fail("expected a key");
            std::string key;
            if (!string(key)) return false;
            space();
            if (i_ >= t_.size() || t_[i_++] != ':') return fail("expected :");
            if (out.get(key) != nullptr) return fail("duplicate key");
            out.object.emplace_back(std::move(key), Json{});
            if (!value(out.object.back().second, depth + 1)) return false;
            space();
            if (i_ >= t_.size()) return fail("unterminated object");
            char c = t_[i_++];
            if (c == '}') return true;
            if (c != ',') return fail("expected , or }");
        }
    }

    std::string_view t_;
    size_t i_ = 0;
    std::string error_;
};

}  // namespace

std::optional<Json> parseJson(std::string_view text, std::string& error) {
    return JsonReader(text).read(error);
}

}  // namespace zcrelay::test
