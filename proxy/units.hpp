#pragma once
// Durations ("5s", "250ms", "2m", "1h", "100us") and sizes ("64KiB", "1MiB", "4096") as the
// config writes them.
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <tl/expected.hpp>

namespace zcrelay {

using Duration = std::chrono::milliseconds;

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kGiB = 1024 * kMiB;

// Units: us (rounded up to whole ms), ms, s, m, h; a number is required, a unit is required.
// Errors say what is wrong ("missing unit in \"5\"", "unknown unit \"x\"", "negative").
tl::expected<Duration, std::string> parseDuration(std::string_view text);
// Units: none (bytes), B, KiB, MiB, GiB (powers of 1024) and k/K/KB, M/MB, G/GB (also 1024:
// what HAProxy's tune.pipesize and nginx sizes mean). Overflow of uint64 is an error.
tl::expected<uint64_t, std::string> parseSize(std::string_view text);

// `text` in double quotes, as config errors show the offending value: at most kQuoteBytes of
// it, so a 10 MiB value costs the error line 80 bytes and its length, not 10 MiB.
inline constexpr size_t kQuoteBytes = 80;
std::string quoted(std::string_view text);
// The same cut without the quotes, for a key name in an error's key path.
std::string clipped(std::string_view text);

// Shortest exact form: 300000ms -> "5m", 1500ms -> "1500ms"; 1048576 -> "1MiB", 1000 -> "1000".
std::string formatDuration(Duration d);
std::string formatSize(uint64_t bytes);

}  // namespace zcrelay
