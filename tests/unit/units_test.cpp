#include "units.hpp"

#include <gtest/gtest.h>

namespace zcrelay {
namespace {

using std::chrono::milliseconds;

TEST(ParseDuration, AcceptsEveryUnit) {
    EXPECT_EQ(parseDuration("250ms"), milliseconds(250));
    EXPECT_EQ(parseDuration("5s"), milliseconds(5000));
    EXPECT_EQ(parseDuration("2m"), milliseconds(120'000));
    EXPECT_EQ(parseDuration("1h"), milliseconds(3'600'000));
    EXPECT_EQ(parseDuration("0s"), milliseconds(0));
}

TEST(ParseDuration, RoundsMicrosecondsUpToWholeMilliseconds) {
    EXPECT_EQ(parseDuration("100us"), milliseconds(1));
    EXPECT_EQ(parseDuration("1000us"), milliseconds(1));
    EXPECT_EQ(parseDuration("1001us"), milliseconds(2));
    EXPECT_EQ(parseDuration("0us"), milliseconds(0));
}

TEST(ParseDuration, AcceptsDecimalsExactly) {
    EXPECT_EQ(parseDuration("1.5s"), milliseconds(1500));
    EXPECT_EQ(parseDuration("0.25m"), milliseconds(15'000));
    EXPECT_EQ(parseDuration("1.0001s"), milliseconds(1001));  // rounded up, never down
}

TEST(ParseDuration, ZeroAloneNeedsNoUnit) {
    EXPECT_EQ(parseDuration("0"), milliseconds(0));
    ASSERT_FALSE(parseDuration("5"));
    EXPECT_EQ(parseDuration("5").error(), "missing unit in \"5\" (use us, ms, s, m or h)");
    EXPECT_FALSE(parseDuration("00"));
}

TEST(ParseDuration, RejectsMalformedText) {
    EXPECT_EQ(parseDuration("-5s").error(), "negative duration \"-5s\"");
    EXPECT_EQ(parseDuration("5x").error(), "unknown unit \"x\" in \"5x\" (use us, ms, s, m or h)");
    EXPECT_EQ(parseDuration("").error(), "empty duration (use us, ms, s, m or h)");
    EXPECT_EQ(parseDuration("s").error(), "expected a number and a unit, e.g. 5s, got \"s\"");
    EXPECT_FALSE(parseDuration(".5s"));
    EXPECT_FALSE(parseDuration("5.s"));
    EXPECT_FALSE(parseDuration("5 s"));
    EXPECT_FALSE(parseDuration("1.2.3s"));
    EXPECT_EQ(parseDuration("99999999999999999999s").error(),
              "\"99999999999999999999s\" is too large");
    EXPECT_EQ(parseDuration("9999999999999h").error(), "\"9999999999999h\" is too large");
}

// Every duration that parses writes back (formatDuration) to text that parses to it again: a
// reload reads the config as --dump-config wrote it. UINT64_MAX microseconds rounds up to one
// millisecond more than "Nms" can say (N * 1000 us), so it is too large; one millisecond less
// is the largest duration, and it goes round.
TEST(ParseDuration, TheLargestDurationWritesBackToItself) {
    EXPECT_EQ(parseDuration("18446744073709551615us").error(),
              "\"18446744073709551615us\" is too large");
    EXPECT_EQ(parseDuration("00018446744073709551615us").error(),
              "\"00018446744073709551615us\" is too large");
    auto largest = parseDuration("18446744073709551000us");
    ASSERT_TRUE(largest) << largest.error();
    EXPECT_EQ(largest->count(), 18446744073709551);
    EXPECT_EQ(formatDuration(*largest), "18446744073709551ms");
    EXPECT_EQ(parseDuration(formatDuration(*largest)), *largest);
}

TEST(ParseSize, AcceptsBytesAndBinaryUnits) {
    EXPECT_EQ(parseSize("4096"), 4096u);
    EXPECT_EQ(parseSize("0"), 0u);
    EXPECT_EQ(parseSize("10B"), 10u);
    EXPECT_EQ(parseSize("64KiB"), 64u * 1024);
    EXPECT_EQ(parseSize("1MiB"), 1u << 20);
    EXPECT_EQ(parseSize("1GiB"), 1u << 30);
}

TEST(ParseSize, ShortUnitsArePowersOf1024) {
    for (const char* text : {"64k", "64K", "64KB"}) EXPECT_EQ(parseSize(text), 64u * 1024) << text;
    for (const char* text : {"1M", "1MB"}) EXPECT_EQ(parseSize(text), 1u << 20) << text;
    for (const char* text : {"1G", "1GB"}) EXPECT_EQ(parseSize(text), 1u << 30) << text;
}

TEST(ParseSize, RejectsMalformedText) {
    EXPECT_EQ(parseSize("-1").error(), "negative size \"-1\"");
    EXPECT_EQ(parseSize("").error(), "empty size");
    EXPECT_EQ(parseSize("1XB").error(),
              "unknown unit \"XB\" in \"1XB\" (use B, KiB, MiB, GiB or K, M, G)");
    EXPECT_EQ(parseSize("MiB").error(),
              "expected a number with an optional unit, e.g. 64KiB, got \"MiB\"");
    EXPECT_EQ(parseSize("1.5MiB").error(), "sizes are whole numbers of a unit, got \"1.5MiB\"");
    EXPECT_FALSE(parseSize("1mib"));
}

TEST(ParseSize, RejectsOverflow) {
    EXPECT_EQ(parseSize("18446744073709551615"), UINT64_MAX);
    EXPECT_EQ(parseSize("18446744073709551616").error(), "\"18446744073709551616\" is too large");
    EXPECT_EQ(parseSize("17179869184GiB").error(),
              "\"17179869184GiB\" is too large");  // 2^64 bytes
}

TEST(FormatDuration, PicksTheLargestExactUnit) {
    EXPECT_EQ(formatDuration(milliseconds(0)), "0s");
    EXPECT_EQ(formatDuration(milliseconds(300'000)), "5m");
    EXPECT_EQ(formatDuration(milliseconds(1500)), "1500ms");
    EXPECT_EQ(formatDuration(milliseconds(7'200'000)), "2h");
    EXPECT_EQ(formatDuration(milliseconds(90'000)), "90s");
}

TEST(FormatSize, PicksTheLargestExactUnit) {
    EXPECT_EQ(formatSize(1 << 20), "1MiB");
    EXPECT_EQ(formatSize(1000), "1000");
    EXPECT_EQ(formatSize(4096), "4KiB");
    EXPECT_EQ(formatSize(3ull << 30), "3GiB");
    EXPECT_EQ(formatSize(0), "0");
}

TEST(Format, ParsesBackToTheSameValue) {
    for (long ms : {0L, 1L, 999L, 1000L, 61'000L, 3'600'000L, 2'592'000'000L}) {
        EXPECT_EQ(parseDuration(formatDuration(milliseconds(ms))), milliseconds(ms)) << ms;
    }
    for (uint64_t bytes :
         {0ull, 1ull, 4095ull, 4096ull, 1ull << 20, (1ull << 20) + 1, 5ull << 30}) {
        EXPECT_EQ(parseSize(formatSize(bytes)), bytes) << bytes;
    }
}

// Errors quote at most kQuoteBytes of a value, then its length; never half a UTF-8 character.
TEST(Quoted, ShortTextWholeLongTextCutWithItsLength) {
    EXPECT_EQ(zcrelay::quoted("abc"), "\"abc\"");
    EXPECT_EQ(zcrelay::quoted(std::string(kQuoteBytes, 'a')), "\"" + std::string(kQuoteBytes, 'a') + "\"");
    EXPECT_EQ(zcrelay::quoted(std::string(100, 'a')),
              "\"" + std::string(kQuoteBytes, 'a') + "\"...(100 bytes)");
    EXPECT_EQ(clipped(std::string(100, 'a')), std::string(kQuoteBytes, 'a') + "...(100 bytes)");
    // "é" is two bytes; the cut would fall between them.
    const std::string text = std::string(kQuoteBytes - 1, 'a') + "\xc3\xa9" + "tail";
    EXPECT_EQ(clipped(text), std::string(kQuoteBytes - 1, 'a') + "...(" +
                                 std::to_string(text.size()) + " bytes)");
}

}  // namespace
}  // namespace zcrelay
