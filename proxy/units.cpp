#include "units.hpp"

#include <array>
#include <cstdint>
#include <utility>

namespace zcrelay {
namespace {

bool isDigit(char c) { return c >= '0' && c <= '9'; }

// Reads leading digits into `value`; false on uint64 overflow. `pos` ends after the digits.
bool readDigits(std::string_view text, size_t& pos, uint64_t& value, int& digits) {
    for (; pos < text.size() && isDigit(text[pos]); ++pos, ++digits) {
        if (__builtin_mul_overflow(value, 10, &value) ||
            __builtin_add_overflow(value, uint64_t(text[pos] - '0'), &value)) {
            return false;
        }
    }
    return true;
}

constexpr std::array<std::pair<std::string_view, uint64_t>, 5> kDurationUnitsUs{
    {{"us", 1}, {"ms", 1000}, {"s", 1000'000}, {"m", 60'000'000}, {"h", 3600'000'000}}};

constexpr std::array<std::pair<std::string_view, uint64_t>, 11> kSizeUnits{
    {{"B", 1},
     {"K", kKiB},
     {"k", kKiB},
     {"KB", kKiB},
     {"KiB", kKiB},
     {"M", kMiB},
     {"MB", kMiB},
     {"MiB", kMiB},
     {"G", kGiB},
     {"GB", kGiB},
     {"GiB", kGiB}}};

}  // namespace

tl::expected<Duration, std::string> parseDuration(std::string_view text) {
    constexpr std::string_view kUnits = "(use us, ms, s, m or h)";
    if (text.empty()) return tl::unexpected("empty duration " + std::string(kUnits));
    // "0" is the one number that means the same in every unit, so it may go without one.
    if (text == "0") return Duration{0};
    if (text[0] == '-') return tl::unexpected("negative duration " + quoted(text));

    // A decimal number: mantissa / 10^decimals, kept exact so "1.5s" is 1500ms, not 1499.
    size_t pos = 0;
    uint64_t mantissa = 0;
    int int_digits = 0, decimals = 0;
    bool fits = readDigits(text, pos, mantissa, int_digits);
    if (fits && pos < text.size() && text[pos] == '.') {
        ++pos;
        fits = readDigits(text, pos, mantissa, decimals) && decimals <= 18;
        if (decimals == 0) int_digits = 0;  // "5." is malformed like ".5"
    }
    if (!fits) return tl::unexpected(quoted(text) + " is too large");
    if (int_digits == 0) {
        return tl::unexpected("expected a number and a unit, e.g. 5s, got " + quoted(text));
    }

    const std::string_view unit = text.substr(pos);
    if (unit.empty()) {
        return tl::unexpected("missing unit in " + quoted(text) + " " + std::string(kUnits));
    }
    uint64_t unit_us = 0;
    for (const auto& [name, us] : kDurationUnitsUs) {
        if (name == unit) unit_us = us;
    }
    if (unit_us == 0) {
        return tl::unexpected("unknown unit " + quoted(unit) + " in " + quoted(text) + " " +
                              std::string(kUnits));
    }

    uint64_t us = 0;
    if (__builtin_mul_overflow(mantissa, unit_us, &us)) {
        return tl::unexpected(quoted(text) + " is too large");
    }
    uint64_t scale = 1;
    for (int i = 0; i < decimals; ++i) scale *= 10;
    // Round up, to the microsecond and then to the millisecond: a timeout shorter than asked
    // for would fire early, a slightly longer one is harmless.
    us = us / scale + (us % scale != 0);
    const uint64_t ms = us / 1000 + (us % 1000 != 0);
    // The largest duration is the largest whose milliseconds can be written back and read
    // again: "Nms" is N * 1000 us. Rounded up, 18446744073709551615us would be
    // 18446744073709552ms, which formatDuration writes and no parse takes (found by
    // fuzz.units), and a reload reads the config as written back (--dump-config).
    if (ms > UINT64_MAX / 1000) return tl::unexpected(quoted(text) + " is too large");
    return Duration{static_cast<Duration::rep>(ms)};
}

tl::expected<uint64_t, std::string> parseSize(std::string_view text) {
    constexpr std::string_view kUnits = "(use B, KiB, MiB, GiB or K, M, G)";
    if (text.empty()) return tl::unexpected(std::string("empty size"));
    if (text[0] == '-') return tl::unexpected("negative size " + quoted(text));

    size_t pos = 0;
    uint64_t value = 0;
    int digits = 0;
    if (!readDigits(text, pos, value, digits)) {
        return tl::unexpected(quoted(text) + " is too large");
    }
    if (digits == 0) {
        return tl::unexpected("expected a number with an optional unit, e.g. 64KiB, got " +
                              quoted(text));
    }
    if (pos < text.size() && text[pos] == '.') {
        return tl::unexpected("sizes are whole numbers of a unit, got " + quoted(text));
    }

    const std::string_view unit = text.substr(pos);
    if (unit.empty()) return value;
    for (const auto& [name, bytes] : kSizeUnits) {
        if (name != unit) continue;
        uint64_t total = 0;
        if (__builtin_mul_overflow(value, bytes, &total)) {
            return tl::unexpected(quoted(text) + " is too large");
        }
        return total;
    }
    return tl::unexpected("unknown unit " + quoted(unit) + " in " + quoted(text) + " " +
                          std::string(kUnits));
}

std::string formatDuration(Duration d) {
    const auto ms = d.count();
    if (ms == 0) return "0s";
    if (ms % 3600'000 == 0) return std::to_string(ms / 3600'000) + "h";
    if (ms % 60'000 == 0) return std::to_string(ms / 60'000) + "m";
    if (ms % 1000 == 0) return std::to_string(ms / 1000) + "s";
    return std::to_string(ms) + "ms";
}

std::string formatSize(uint64_t bytes) {
    if (bytes == 0) return "0";
    if (bytes % kGiB == 0) return std::to_string(bytes >> 30) + "GiB";
    if (bytes % kMiB == 0) return std::to_string(bytes >> 20) + "MiB";
    if (bytes % kKiB == 0) return std::to_string(bytes >> 10) + "KiB";
    return std::to_string(bytes);
}

namespace {

// At most kQuoteBytes of `text`, cut before a UTF-8 continuation byte, not inside a character;
// `rest` gets what says the text went on ("...(N bytes)"), or nothing.
std::string_view clip(std::string_view text, std::string& rest) {
    if (text.size() <= kQuoteBytes) return text;
    size_t cut = kQuoteBytes;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
    rest = "...(" + std::to_string(text.size()) + " bytes)";
    return text.substr(0, cut);
}

}  // namespace

std::string clipped(std::string_view text) {
    std::string rest;
    return std::string(clip(text, rest)) + rest;
}

std::string quoted(std::string_view text) {
    std::string rest;
    return "\"" + std::string(clip(text, rest)) + "\"" + rest;
}

}  // namespace zcrelay
