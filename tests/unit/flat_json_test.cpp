// flat_json: the runtime API's request reader (one flat object) and its string writer.
#include "flat_json.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>

#include "support/labels.hpp"
#include "support/json.hpp"
#include "support/latin1.hpp"

namespace zcrelay {
namespace {

using Type = FlatValue::Type;

std::string jsonErrorOf(std::string_view text) {
    const auto parsed = parseFlatObject(text);
    return parsed ? std::string("(parsed)") : parsed.error();
}

const FlatValue* member(const FlatObject& o, std::string_view key) {
    for (const auto& [k, v] : o)
        if (k == key) return &v;
    return nullptr;
}

// What a JSON reader makes of jsonString(text) (support/latin1.hpp).
using test::latin1ToUtf8;

// ---- parseFlatObject: what it takes ----

TEST(FlatJson, TakesStringsIntegersBooleansAndNullInOrder) {
    const auto o = parseFlatObject(R"({"state":"drain","weight":0,"shutdown":true,"x":null})");
    ASSERT_TRUE(o) << o.error();
    ASSERT_EQ(o->size(), 4u);
    EXPECT_EQ((*o)[0].first, "state");
    EXPECT_EQ((*o)[0].second.type, Type::String);
    EXPECT_EQ((*o)[0].second.string, "drain");
    EXPECT_EQ((*o)[1].first, "weight");
    EXPECT_EQ((*o)[1].second.type, Type::Integer);
    EXPECT_EQ((*o)[1].second.integer, 0);
    EXPECT_EQ((*o)[2].first, "shutdown");
    EXPECT_EQ((*o)[2].second.type, Type::Bool);
    EXPECT_TRUE((*o)[2].second.boolean);
    EXPECT_EQ((*o)[3].first, "x");
    EXPECT_EQ((*o)[3].second.type, Type::Null);
}

TEST(FlatJson, EmptyObjectAndFalse) {
    const auto empty = parseFlatObject("{}");
    ASSERT_TRUE(empty) << empty.error();
    EXPECT_TRUE(empty->empty());
    const auto f = parseFlatObject(R"({"a":false,"b":true})");
    ASSERT_TRUE(f) << f.error();
    EXPECT_EQ(member(*f, "a")->type, Type::Bool);
    EXPECT_FALSE(member(*f, "a")->boolean);
    EXPECT_TRUE(member(*f, "b")->boolean);
}

TEST(FlatJson, WhitespaceAnywhereBetweenTokens) {
    const auto o = parseFlatObject(" \t\r\n{ \"a\" :\t\"b\" ,\n\"c\"\r:\n-12 , \"d\" : null } \n");
    ASSERT_TRUE(o) << o.error();
    ASSERT_EQ(o->size(), 3u);
    EXPECT_EQ(member(*o, "a")->string, "b");
    EXPECT_EQ(member(*o, "c")->integer, -12);
    EXPECT_EQ(member(*o, "d")->type, Type::Null);
    const auto spaced = parseFlatObject("  {  }  ");
    ASSERT_TRUE(spaced) << spaced.error();
    EXPECT_TRUE(spaced->empty());
}

TEST(FlatJson, Escapes) {
    const auto o = parseFlatObject(
        R"({"q":"a\"b","bs":"\\","sl":"\/","c":"\b\f\n\r\t","A":"\u0041","e":"\u00e9",)"
        R"("E":"\u00C9","euro":"\u20ac","nul":"x\u0000y","k\u00e9y":"v"})");
    ASSERT_TRUE(o) << o.error();
    EXPECT_EQ(member(*o, "q")->string, "a\"b");
    EXPECT_EQ(member(*o, "bs")->string, "\\");
    EXPECT_EQ(member(*o, "sl")->string, "/");
    EXPECT_EQ(member(*o, "c")->string, "\b\f\n\r\t");
    EXPECT_EQ(member(*o, "A")->string, "A");
    EXPECT_EQ(member(*o, "e")->string, "\xc3\xa9");  // é in UTF-8
    EXPECT_EQ(member(*o, "E")->string, "\xc3\x89");  // É
    EXPECT_EQ(member(*o, "euro")->string, "\xe2\x82\xac");
    EXPECT_EQ(member(*o, "nul")->string, std::string("x\0y", 3));
    ASSERT_NE(member(*o, "k\xc3\xa9y"), nullptr);
    EXPECT_EQ(member(*o, "k\xc3\xa9y")->string, "v");
}

TEST(FlatJson, RawUtf8AndDelPassThrough) {
    const auto o = parseFlatObject("{\"a\":\"caf\xc3\xa9\x7f\"}");
    ASSERT_TRUE(o) << o.error();
    EXPECT_EQ(member(*o, "a")->string, "caf\xc3\xa9\x7f");
}

TEST(FlatJson, IntegersOverTheWholeInt64Range) {
    const auto o = parseFlatObject(
        R"({"max":9223372036854775807,"min":-9223372036854775808,"neg":-1,"z":-0,"w":256})");
    ASSERT_TRUE(o) << o.error();
    EXPECT_EQ(member(*o, "max")->integer, std::numeric_limits<int64_t>::max());
    EXPECT_EQ(member(*o, "min")->integer, std::numeric_limits<int64_t>::min());
    EXPECT_EQ(member(*o, "neg")->integer, -1);
    EXPECT_EQ(member(*o, "z")->integer, 0);
    EXPECT_EQ(member(*o, "w")->integer, 256);
}

TEST(FlatJson, ThirtyTwoMembersAndOneKiBStringsAreTheLimits) {
    std::string text = "{";
    for (int i = 0; i < 32; ++i)
        text += (i ? "," : "") + ("\"m" + std::to_string(i) + "\":" + std::to_string(i));
    const auto o = parseFlatObject(text + "}");
    ASSERT_TRUE(o) << o.error();
    EXPECT_EQ(o->size(), 32u);
    EXPECT_EQ(member(*o, "m31")->integer, 31);

    const std::string kib(1024, 'k');
    const auto s = parseFlatObject("{\"" + kib + "\":\"" + kib + "\"}");
    ASSERT_TRUE(s) << s.error();
    EXPECT_EQ((*s)[0].first, kib);
    EXPECT_EQ((*s)[0].second.string, kib);
    // 1024 bytes after decoding escapes count the same.
    std::string escaped;
    for (int i = 0; i < 1024; ++i) escaped += "\\u0041";
    const auto e = parseFlatObject("{\"a\":\"" + escaped + "\"}");
    ASSERT_TRUE(e) << e.error();
    EXPECT_EQ(member(*e, "a")->string, std::string(1024, 'A'));
}

// ---- parseFlatObject: what it refuses, and where ----

struct Refusal {
    const char* name;
    std::string text;
    std::string error;
};

// gtest would print the struct's bytes.
void PrintTo(const Refusal& r, std::ostream* os) { *os << r.name; }

class FlatJsonRefuses : public testing::TestWithParam<Refusal> {};

TEST_P(FlatJsonRefuses, WithWhatAndTheByteOffset) {
    EXPECT_EQ(jsonErrorOf(GetParam().text), GetParam().error) << GetParam().text;
}

std::string manyMembers(int n) {
    std::string text = "{";
    for (int i = 0; i < n; ++i) text += (i ? "," : "") + ("\"m" + std::to_string(i) + "\":1");
    return text + "}";
}

INSTANTIATE_TEST_SUITE_P(
    Structure, FlatJsonRefuses,
    testing::Values(
        Refusal{"Empty", "", "expected '{' at byte 0"},
        Refusal{"OnlySpace", "  \n", "expected '{' at byte 3"},
        Refusal{"Array", "[1]", "expected '{' at byte 0"},
        Refusal{"String", "\"state\"", "expected '{' at byte 0"},
        Refusal{"Number", "  42", "expected '{' at byte 2"},
        Refusal{"Null", "null", "expected '{' at byte 0"},
        Refusal{"TrailingText", R"({"a":1} x)", "expected the end after the object at byte 8"},
        Refusal{"SecondObject", R"({"a":1}{})", "expected the end after the object at byte 7"},
        Refusal{"TrailingComma", R"({"a":1,})", "expected '\"' at byte 7"},
        Refusal{"MissingColon", R"({"a" 1})", "expected ':' at byte 5"},
        Refusal{"MissingValue", R"({"a":})", "expected a value at byte 5"},
        Refusal{"ValueAtTheEnd", R"({"a":)", "expected a value at byte 5"},
        Refusal{"MissingComma", R"({"a":1 "b":2})", "expected ',' or '}' at byte 7"},
        Refusal{"Unclosed", R"({"a":1)", "expected ',' or '}' at byte 6"},
        Refusal{"UnquotedKey", R"({a:1})", "expected '\"' at byte 1"},
        Refusal{"DuplicateMember", R"({"a":1, "a":2})",
                "duplicate member \"a\" at byte 8"},
        Refusal{"DuplicateOfAnEscapedKey", R"({"a":1,"\u0061":2})",
                "duplicate member \"a\" at byte 7"},
        Refusal{"NestedObject", R"({"a":{}})",
                "member \"a\" is an object or array; only strings, numbers, booleans and null "
                "are accepted at byte 5"},
        Refusal{"NestedArray", R"({"list":[1,2]})",
                "member \"list\" is an object or array; only strings, numbers, booleans and "
                "null are accepted at byte 8"},
        Refusal{"Fraction", R"({"w":1.5})", "member \"w\" must be a whole number at byte 6"},
        Refusal{"Exponent", R"({"w":1e3})", "member \"w\" must be a whole number at byte 6"},
        Refusal{"ExponentUpper", R"({"w":2E1})", "member \"w\" must be a whole number at byte 6"},
        Refusal{"TooLarge", R"({"w":9223372036854775808})",
                "member \"w\" is not a number in range at byte 24"},
        Refusal{"TooSmall", R"({"w":-9223372036854775809})",
                "member \"w\" is not a number in range at byte 25"},
        Refusal{"HugeNumber", R"({"w":99999999999999999999999999})",
                "member \"w\" is not a number in range at byte 31"},
        Refusal{"LoneMinus", R"({"w":-})", "member \"w\" is not a number in range at byte 6"},
        Refusal{"PlusSign", R"({"w":+1})", "expected a value at byte 5"},
        Refusal{"CapitalTrue", R"({"b":True})", "expected a value at byte 5"},
        Refusal{"ShortTrue", R"({"b":tru})", "expected a value at byte 5"},
        Refusal{"TrueWithSuffix", R"({"b":truex})", "expected ',' or '}' at byte 9"},
        Refusal{"UnterminatedString", R"({"a":"abc)", "unterminated string at byte 9"},
        Refusal{"UnterminatedKey", R"({"abc)", "unterminated string at byte 5"},
        Refusal{"EscapeAtTheEnd", "{\"a\":\"abc\\", "unterminated string at byte 10"},
        Refusal{"ShortUnicodeEscape", R"({"a":"\u00e)", "short \\u escape at byte 6"},
        Refusal{"ThirtyThreeMembers", manyMembers(33),
                "more than 32 members at byte " +
                    std::to_string(manyMembers(33).find("\"m32\":1") + 7)}),
    [](const testing::TestParamInfo<Refusal>& info) { return std::string(info.param.name); });

// Errors inside a string: what is wrong, and an offset within the string at or just past the
// offending byte (`bad` is where that byte, or the escape's backslash, is).
struct InString {
    const char* name;
    std::string text;
    const char* what;
    size_t bad;
};

class FlatJsonRefusesInString : public testing::TestWithParam<InString> {};

void PrintTo(const InString& r, std::ostream* os) { *os << r.name; }

TEST_P(FlatJsonRefusesInString, WithWhatAndAnOffsetAtTheFault) {
    const InString& r = GetParam();
    const std::string error = jsonErrorOf(r.text);
    const std::string what = std::string(r.what) + " at byte ";
    ASSERT_EQ(error.substr(0, what.size()), what) << error;
    const size_t offset = std::stoul(error.substr(what.size()));
    EXPECT_GE(offset, r.bad) << error;
    EXPECT_LE(offset, r.bad + 6) << error;  // at most one escape past it
    EXPECT_LE(offset, r.text.size()) << error;
}

const InString kInString[] = {
    {"RawNewline", "{\"a\":\"x\ny\"}", "raw control character in a string", 7},
    {"RawNul", std::string("{\"a\":\"\0\"}", 9), "raw control character in a string", 6},
    {"RawTabInKey", "{\"a\tb\":1}", "raw control character in a string", 3},
    {"UnknownEscape", R"({"a":"\q"})", "unknown escape", 6},
    {"SingleQuoteEscape", R"({"a":"\'"})", "unknown escape", 6},
    {"BadHexDigit", R"({"a":"\u00g0"})", "bad hex digit in \\u escape", 10},
    {"LoneHighSurrogate", R"({"a":"\ud800"})", "surrogate in \\u escape", 6},
    {"LoneLowSurrogate", R"({"a":"\uDC00"})", "surrogate in \\u escape", 6},
    {"SurrogatePair", R"({"a":"\ud83d\ude00"})", "surrogate in \\u escape", 6},
    {"StringOver1KiB", "{\"a\":\"" + std::string(1025, 's') + "\"}",
     "string longer than 1024 bytes", 6 + 1024},
    {"KeyOver1KiB", "{\"" + std::string(1025, 'k') + "\":1}", "string longer than 1024 bytes",
     2 + 1024},
};

INSTANTIATE_TEST_SUITE_P(
    Kinds, FlatJsonRefusesInString, testing::ValuesIn(kInString),
    [](const testing::TestParamInfo<InString>& info) { return std::string(info.param.name); });

// Elsewhere the offset names the byte that is wrong ("expected ':' at byte 5" is where the ':'
// should be). Inside strings it is one past it, or past the whole escape: the control character,
// the escape's backslash, the bad hex digit, the first byte over 1 KiB are where to look.
TEST(FlatJson, OffsetsInsideStringsNameTheOffendingByte) {
    EXPECT_EQ(jsonErrorOf("{\"a\":\"x\ny\"}"), "raw control character in a string at byte 7");
    EXPECT_EQ(jsonErrorOf(R"({"a":"\q"})"), "unknown escape at byte 6");
    EXPECT_EQ(jsonErrorOf(R"({"a":"\u00g0"})"), "bad hex digit in \\u escape at byte 10");
    EXPECT_EQ(jsonErrorOf(R"({"a":"\ud800"})"), "surrogate in \\u escape at byte 6");
    EXPECT_EQ(jsonErrorOf("{\"a\":\"" + std::string(1025, 's') + "\"}"),
              "string longer than 1024 bytes at byte 1030");
}

// The header promises "a string at most 1 KiB"; a \u escape that decodes to 2 or 3 bytes must
// not carry a string past it.
TEST(FlatJson, DecodedStringsNeverExceedOneKiB) {
    for (const char* tail : {"\\u00e9", "\\u20ac"}) {
        const std::string text = "{\"a\":\"" + std::string(1023, 'a') + tail + "\"}";
        const auto o = parseFlatObject(text);
        if (o) {
            EXPECT_LE(member(*o, "a")->string.size(), 1024u)
                << "1023 bytes + " << tail << " decoded to " << member(*o, "a")->string.size()
                << " bytes";
        }
    }
}

// ---- jsonString ----

TEST(JsonString, EscapesQuotesBackslashControlAndHighBytes) {
    EXPECT_EQ(jsonString(""), "\"\"");
    EXPECT_EQ(jsonString("drain"), "\"drain\"");
    EXPECT_EQ(jsonString("10.0.0.1:80"), "\"10.0.0.1:80\"");
    EXPECT_EQ(jsonString("a\"b"), R"("a\"b")");
    EXPECT_EQ(jsonString("a\\b"), R"("a\\b")");
    EXPECT_EQ(jsonString("/"), R"("/")");
    EXPECT_EQ(jsonString("\n"), R"("\u000a")");
    EXPECT_EQ(jsonString(std::string("\0", 1)), R"("\u0000")");
    EXPECT_EQ(jsonString("\x1f"), R"("\u001f")");
    EXPECT_EQ(jsonString(" ~"), R"(" ~")");
    EXPECT_EQ(jsonString("\x7f"), R"("\u007f")");
    EXPECT_EQ(jsonString("\x80\xff"), R"("\u0080\u00ff")");
    // Byte by byte, UTF-8 included: é (c3 a9) is written as two escapes.
    EXPECT_EQ(jsonString("caf\xc3\xa9"), R"("caf\u00c3\u00a9")");
}

TEST(JsonString, EveryByteAloneIsPrintableAsciiAndParsesBack) {
    for (int b = 0; b < 256; ++b) {
        const std::string in(1, static_cast<char>(b));
        const std::string out = jsonString(in);
        for (const char c : out) ASSERT_TRUE(c >= 0x20 && c < 0x7f) << "byte " << b;
        std::string error;
        const auto json = test::parseJson(out, error);
        ASSERT_TRUE(json) << "byte " << b << ": " << error << " in " << out;
        ASSERT_EQ(json->type, test::Json::Type::String);
        EXPECT_EQ(json->string, latin1ToUtf8(in)) << "byte " << b;
        if (b < 0x80) {
            EXPECT_EQ(json->string, in) << "byte " << b;
        }
    }
}

// Random byte strings: jsonString() is always one valid JSON string (the strict test reader
// takes it, and parseFlatObject too), ASCII comes back unchanged, and every other byte comes
// back as its U+00XX.
TEST(JsonString, RandomBytesAlwaysParseBack) {
    std::mt19937_64 rng(20240611);
    for (int round = 0; round < 20000; ++round) {
        const size_t size = rng() % 200;
        const bool ascii = round % 2 == 0;
        std::string in;
        for (size_t i = 0; i < size; ++i)
            in += static_cast<char>(ascii ? rng() % 0x80 : rng() % 0x100);
        const std::string out = jsonString(in);
        ASSERT_GE(out.size(), 2u);
        ASSERT_EQ(out.front(), '"');
        ASSERT_EQ(out.back(), '"');
        for (const char c : out) ASSERT_TRUE(c >= 0x20 && c < 0x7f) << out;

        std::string error;
        const auto json = test::parseJson(out, error);
        ASSERT_TRUE(json) << error << " in " << out;
        ASSERT_EQ(json->type, test::Json::Type::String);
        ASSERT_EQ(json->string, latin1ToUtf8(in)) << out;
        if (ascii) {
            ASSERT_EQ(json->string, in);
        }

        // As a member value and as a key of a flat object.
        const auto flat = parseFlatObject("{" + out + ":" + out + "}");
        ASSERT_TRUE(flat) << flat.error() << " in " << out;
        ASSERT_EQ(flat->size(), 1u);
        ASSERT_EQ((*flat)[0].first, json->string);
        ASSERT_EQ((*flat)[0].second.type, Type::String);
        ASSERT_EQ((*flat)[0].second.string, json->string);
    }
}
ZCRELAY_LABEL(JsonString, RandomBytesAlwaysParseBack, "", test::kSanitizeSkip,
              "the flat_json fuzzer runs this parser under ASan+UBSan; it has no threads for TSan");

// A whole reply built with jsonString() is valid JSON that the strict reader takes.
TEST(JsonString, ARepliesObjectParses) {
    const std::string key = "we\"ird\\key\n";
    const std::string value = std::string("\x01\x7f\x80 \xff", 5);
    const std::string reply = "{" + jsonString(key) + ":" + jsonString(value) + "," +
                              jsonString("n") + ":3}";
    std::string error;
    const auto json = test::parseJson(reply, error);
    ASSERT_TRUE(json) << error << " in " << reply;
    EXPECT_EQ(json->str(key), latin1ToUtf8(value));
    ASSERT_NE(json->get("n"), nullptr);
    EXPECT_EQ(json->get("n")->raw, "3");
}

}  // namespace
}  // namespace zcrelay
