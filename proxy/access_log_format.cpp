// An access record as one line, in either format (both are drawn in access_log.hpp): what the
// writer thread does with each record it takes from a worker's ring (access_log.cpp).
#include <time.h>

#include <charconv>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>

#include "access_log.hpp"

namespace zcrelay {
namespace {

template <size_t N>
std::string_view fieldView(const char (&field)[N]) {
    // strnlen: a record filled without copyField may lack its NUL; never read past the field.
    return std::string_view(field, strnlen(field, N));
}

void appendUint(std::string& out, uint64_t value) {
    char buf[24];
    const auto end = std::to_chars(buf, buf + sizeof buf, value).ptr;
    out.append(buf, end);
}

// Exact milliseconds with three decimals from integer microseconds: no float rounding.
void appendMillis(std::string& out, uint64_t us) {
    appendUint(out, us / 1000);
    const unsigned frac = static_cast<unsigned>(us % 1000);
    const char digits[4] = {'.', static_cast<char>('0' + frac / 100),
                            static_cast<char>('0' + frac / 10 % 10),
                            static_cast<char>('0' + frac % 10)};
    out.append(digits, sizeof digits);
}

// "2026-11-22T18:06:19.123456Z", UTC.
void appendTime(std::string& out, int64_t unix_us) {
    int64_t secs = unix_us / 1'000'000;
    int64_t frac = unix_us % 1'000'000;
    if (frac < 0) {  // C++ division truncates toward zero; times before 1970 still format
        frac += 1'000'000;
        --secs;
    }
    const time_t t = static_cast<time_t>(secs);
    tm parts{};
    gmtime_r(&t, &parts);
    char buf[64];
    const int n = std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%06dZ",
                                parts.tm_year + 1900, parts.tm_mon + 1, parts.tm_mday,
                                parts.tm_hour, parts.tm_min, parts.tm_sec, static_cast<int>(frac));
    out.append(buf, std::clamp(n, 0, static_cast<int>(sizeof buf) - 1));
}

// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is not one (overlong forms,
// surrogates and code points above U+10FFFF included: JSON parsers reject them).
size_t utf8Length(std::string_view s, size_t i) {
    const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
    const unsigned char c = byte(i);
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else {
        return 0;
    }
    if (i + len > s.size()) return 0;
    if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
    for (size_t k = 2; k < len; ++k) {
        if ((byte(i + k) & 0xC0) != 0x80) return 0;
    }
    return len;
}

void appendJsonString(std::string& out, std::string_view s) {
    static constexpr char kHex[] = "0123456789abcdef";
    out += '"';
    for (size_t i = 0; i < s.size();) {
        const unsigned char c = static_cast<unsigned char>(s[i]);
        if (c >= 0x80) {
            const size_t len = utf8Length(s, i);
            if (len == 0) {
                // A stray byte: keep the line parseable, and show that something was there.
                out += "\\ufffd";
                ++i;
            } else {
                out.append(s.substr(i, len));
                i += len;
            }
            continue;
        }
        switch (c) {
            case '"':
                out += "\\\"";
                break;
            case '\\':
                out += "\\\\";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\r':
                out += "\\r";
                break;
            case '\t':
                out += "\\t";
                break;
            case '\b':
                out += "\\b";
                break;
            case '\f':
                out += "\\f";
                break;
            default:
                if (c < 0x20 || c == 0x7f) {
                    const char esc[6] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 0xf]};
                    out.append(esc, sizeof esc);
                } else {
                    out += static_cast<char>(c);
                }
        }
        ++i;
    }
    out += '"';
}

// A text field is one word: "-" when empty; bytes that would split the field or the line
// (controls, space) and the escape character itself become \xNN.
void appendTextField(std::string& out, std::string_view s) {
    static constexpr char kHex[] = "0123456789abcdef";
    if (s.empty()) {
        out += '-';
        return;
    }
    for (const char ch : s) {
        const unsigned char c = static_cast<unsigned char>(ch);
        if (c <= 0x20 || c == 0x7f || c == '\\') {
            const char esc[4] = {'\\', 'x', kHex[c >> 4], kHex[c & 0xf]};
            out.append(esc, sizeof esc);
        } else {
            out += ch;
        }
    }
}

std::string_view reasonLabel(CloseReason reason) {
    // A record is plain memory filled by another thread; never index past the table.
    return idx(reason) < idx(CloseReason::kCount) ? label(reason) : std::string_view("unknown");
}

// One field of a line, as both formats write it.
struct FieldValue {
    enum Kind : uint8_t {
        Time,         // start_unix_us, RFC 3339 UTC
        Text,         // a string, escaped per format
        Count,        // an unsigned number
        Millis,       // microseconds written as milliseconds with three decimals
        MaybeMillis,  // the same, or absent (negative): null in JSON, "-" in text
    } kind;
    std::string_view text = {};
    int64_t number = 0;
};

// The fields of a record, in line order: the only list of them. `json` names the key; `text`
// is what precedes the value on a text line (a separator, or a separator and the key).
struct AccessField {
    std::string_view json;
    std::string_view text;
    FieldValue (*value)(const AccessRecord& r, std::string_view client);
};

constexpr AccessField kAccessFields[] = {
    {"time", "", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Time, {}, r.start_unix_us};
     }},
    {"listener", " ", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Text, fieldView(r.listener)};
     }},
    {"client", " ", [](const AccessRecord&, std::string_view client) {
         return FieldValue{FieldValue::Text, client};
     }},
    {"cluster", " ", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Text, fieldView(r.cluster)};
     }},
    {"backend", "/", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Text, fieldView(r.backend)};
     }},
    {"attempts", " attempts=", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Count, {}, r.attempts};
     }},
    {"connect_ms", " connect_ms=", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::MaybeMillis, {}, r.connect_us};
     }},
    {"duration_ms", " duration_ms=", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Millis, {}, static_cast<int64_t>(r.duration_us)};
     }},
    {"bytes_up", " up=", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Count, {}, static_cast<int64_t>(r.bytes_upstream)};
     }},
    {"bytes_down", " down=", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Count, {}, static_cast<int64_t>(r.bytes_downstream)};
     }},
    {"termination", " ", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Text, reasonLabel(r.reason)};
     }},
    {"path", " ", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Text, fieldView(r.path)};
     }},
    {"route", " route=", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Text, fieldView(r.route)};
     }},
    {"sni", " sni=", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Text, fieldView(r.sni)};
     }},
    {"alpn", " alpn=", [](const AccessRecord& r, std::string_view) {
         return FieldValue{FieldValue::Text, fieldView(r.alpn)};
     }},
};

// A value as JSON (strings quoted and escaped, an absent connect time null) or as a word of a
// text line (escaped, "-" when absent).
void appendValue(std::string& out, const FieldValue& v, bool json) {
    switch (v.kind) {
        case FieldValue::Time:
            if (json) out += '"';
            appendTime(out, v.number);
            if (json) out += '"';
            return;
        case FieldValue::Text:
            if (json)
                appendJsonString(out, v.text);
            else
                appendTextField(out, v.text);
            return;
        case FieldValue::Count:
            appendUint(out, static_cast<uint64_t>(v.number));
            return;
        case FieldValue::MaybeMillis:
            if (v.number < 0) {
                out += json ? "null" : "-";
                return;
            }
            [[fallthrough]];
        case FieldValue::Millis:
            appendMillis(out, static_cast<uint64_t>(v.number));
            return;
    }
}

}  // namespace

void formatAccessRecord(const AccessRecord& r, AccessLogFormat f, std::string& out) {
    const std::string client = r.client.toString();
    const bool json = f == AccessLogFormat::Json;
    bool first = true;
    for (const AccessField& field : kAccessFields) {
        const FieldValue v = field.value(r, client);
        if (json) {
            out += first ? "{\"" : ",\"";
            out += field.json;
            out += "\":";
        } else {
            out += field.text;
        }
        appendValue(out, v, json);
        first = false;
    }
    out += json ? "}\n" : "\n";
}

}  // namespace zcrelay
