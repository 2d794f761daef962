#pragma once
// A JSON reader for the tests: a Grafana dashboard, Prometheus API answers, the access log's
// lines. RFC 8259 values, strict where a writer could go wrong (raw control characters in
// strings, unknown escapes, duplicate keys, trailing text); \u escapes of the BMP become
// UTF-8; nesting is bounded so a broken file cannot overflow the stack.
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace zcrelay::test {

struct Json {
    enum class Type { Null, Bool, Number, String, Array, Object };
    Type type = Type::Null;
    bool boolean = false;
    double number = 0;
    std::string raw;  // a number as written (exact digits for comparisons)
    std::string string;
    std::vector<Json> array;
    std::vector<std::pair<std::string, Json>> object;  // in file order

    const Json* get(std::string_view key) const {
        if (type != Type::Object) return nullptr;
        for (const auto& [k, v] : object)
            if (k == key) return &v;
        return nullptr;
    }
    // The string member `key`, or "" when absent or not a string.
    std::string str(std::string_view key) const {
        const Json* v = get(key);
        return v != nullptr && v->type == Type::String ? v->string : std::string();
    }
    const std::vector<Json>& items(std::string_view key) const {
        static const std::vector<Json> kNone;
        const Json* v = get(key);
        return v != nullptr && v->type == Type::Array ? v->array : kNone;
    }
};

// The value `text` holds, or nullopt with `error` saying what is wrong and where.
std::optional<Json> parseJson(std::string_view text, std::string& error);

}  // namespace zcrelay::test
