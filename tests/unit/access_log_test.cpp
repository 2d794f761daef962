#include "access_log.hpp"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/json.hpp"

namespace zcrelay {
namespace {

using test::Json;
using test::parseJson;

// 2026-11-22T18:06:19.123456Z
constexpr int64_t kStartUs = 1795370779LL * 1'000'000 + 123456;

AccessRecord sampleRecord() {
    AccessRecord r;
    r.start_unix_us = kStartUs;
    r.duration_us = 12345;
    r.connect_us = 123;
    r.bytes_upstream = 123;
    r.bytes_downstream = 456;
    r.client = parseAddress("127.0.0.1:50000").value();
    copyField(r.listener, "web");
    copyField(r.cluster, "app");
    copyField(r.backend, "127.0.0.1:9001");
    r.reason = CloseReason::Done;
    r.attempts = 1;
    copyField(r.path, "splice");
    return r;
}

std::string format(const AccessRecord& r, AccessLogFormat f) {
    std::string out;
    formatAccessRecord(r, f, out);
    return out;
}

// A JSON value as the tests need it: strings decoded, numbers as their text, null as nullopt.
using JsonObject = std::map<std::string, std::optional<std::string>>;

// One line of ours: a flat object of strings, numbers and null, ending in a newline.
std::optional<JsonObject> parseLine(std::string_view line) {
    if (line.empty() || line.back() != '\n') return std::nullopt;
    line.remove_suffix(1);
    std::string error;
    std::optional<Json> doc = parseJson(line, error);
    if (!doc || doc->type != Json::Type::Object) return std::nullopt;
    JsonObject object;
    for (const auto& [key, value] : doc->object) {
        switch (value.type) {
            case Json::Type::Null:
                object[key] = std::nullopt;
                break;
            case Json::Type::String:
                object[key] = value.string;
                break;
            case Json::Type::Number:
                object[key] = value.raw;
                break;
            default:
                return std::nullopt;  // the access log writes no bool, array or object
        }
    }
    return object;
}

// A fresh directory per test, removed with its files at the end.
class TempDir {
  public:
    TempDir() {
        std::string pattern = ::testing::TempDir() + "zcrelay-alog-XXXXXX";
        path_ = ::mkdtemp(pattern.data()) ? pattern : std::string();
    }
    ~TempDir() {
        if (!path_.empty()) std::system(("rm -rf '" + path_ + "'").c_str());
    }
    const std::string& path() const { return path_; }
    std::string file(const char* name) const { return path_ + "/" + name; }

  private:
    std::string path_;
};

std::vector<std::string> readLines(const std::string& path) {
    std::ifstream in(path);
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line + "\n");
    return lines;
}

bool fileExists(const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0;
}

// The writer runs every kFlushInterval; wait for what it should have done, not a fixed sleep.
template <typename Pred>
bool waitFor(Pred pred) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!pred()) {
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
}

TEST(AccessLogFormat, JsonLineIsExact) {
    EXPECT_EQ(format(sampleRecord(), AccessLogFormat::Json),
              R"({"time":"2026-11-22T18:06:19.123456Z","listener":"web",)"
              R"("client":"127.0.0.1:50000","cluster":"app","backend":"127.0.0.1:9001",)"
              R"("attempts":1,"connect_ms":0.123,"duration_ms":12.345,"bytes_up":123,)"
              R"("bytes_down":456,"termination":"done","path":"splice","route":"","sni":"",)"
              R"("alpn":""})"
              "\n");
}

TEST(AccessLogFormat, RoutedLineNamesRouteSniAndAlpn) {
    AccessRecord r = sampleRecord();
    copyField(r.route, "api");
    copyField(r.sni, "API.example.com");
    copyField(r.alpn, "h2,http/1.1");
    std::string json = format(r, AccessLogFormat::Json);
    EXPECT_NE(json.find(R"("path":"splice","route":"api","sni":"API.example.com",)"
                        R"("alpn":"h2,http/1.1"})"),
              std::string::npos)
        << json;
    // A client's server name is its own text: a space or a newline in it cannot split the line.
    copyField(r.sni, "a b\nc");
    std::string text = format(r, AccessLogFormat::Text);
    EXPECT_NE(text.find(" splice route=api sni=a\\x20b\\x0ac alpn=h2,http/1.1\n"),
              std::string::npos)
        << text;
}

TEST(AccessLogFormat, TextLineIsExact) {
    EXPECT_EQ(format(sampleRecord(), AccessLogFormat::Text),
              "2026-11-22T18:06:19.123456Z web 127.0.0.1:50000 app/127.0.0.1:9001 attempts=1 "
              "connect_ms=0.123 duration_ms=12.345 up=123 down=456 done splice route=- sni=- "
              "alpn=-\n");
}

TEST(AccessLogFormat, NeverConnectedHasNullConnectAndNoBackend) {
    AccessRecord r = sampleRecord();
    r.connect_us = -1;
    r.backend[0] = '\0';
    r.reason = CloseReason::ConnectFailed;
    r.attempts = 3;
    r.duration_us = 3'000'000'007;  // large values keep every digit
    r.client = parseAddress("[2001:db8::1]:443").value();

    const auto json = parseLine(format(r, AccessLogFormat::Json));
    ASSERT_TRUE(json);
    EXPECT_EQ((*json).at("connect_ms"), std::nullopt);
    EXPECT_EQ((*json).at("backend"), "");
    EXPECT_EQ((*json).at("termination"), "connect_failed");
    EXPECT_EQ((*json).at("attempts"), "3");
    EXPECT_EQ((*json).at("duration_ms"), "3000000.007");
    EXPECT_EQ((*json).at("client"), "[2001:db8::1]:443");

    EXPECT_EQ(format(r, AccessLogFormat::Text),
              "2026-11-22T18:06:19.123456Z web [2001:db8::1]:443 app/- attempts=3 connect_ms=- "
              "duration_ms=3000000.007 up=123 down=456 connect_failed splice route=- sni=- "
              "alpn=-\n");
}

TEST(AccessLogFormat, JsonEscapesHostileNames) {
    AccessRecord r = sampleRecord();
    const std::string hostile = "we\"b\\\n\r\t\x01\x1f\x7f}";
    copyField(r.listener, hostile);
    // A stray continuation byte and a truncated sequence: not UTF-8, so not copied raw.
    copyField(r.cluster, "caf\xc3\xa9 \x80 \xe2\x82");

    const std::string line = format(r, AccessLogFormat::Json);
    EXPECT_NE(line.find(R"("listener":"we\"b\\\n\r\t\u0001\u001f\u007f}")"), std::string::npos)
        << line;
    EXPECT_NE(line.find("\"cluster\":\"caf\xc3\xa9 \\ufffd \\ufffd\\ufffd\""), std::string::npos)
        << line;
    // One line, and it parses back to the same name.
    EXPECT_EQ(line.find('\n'), line.size() - 1);
    const auto json = parseLine(line);
    ASSERT_TRUE(json) << line;
    EXPECT_EQ((*json).at("listener"), hostile);
    EXPECT_EQ((*json).at("bytes_down"), "456");
}

TEST(AccessLogFormat, TextFieldsCannotSplitOrForgeLines) {
    AccessRecord r = sampleRecord();
    copyField(r.listener, "a b\n2026 fake\\");
    copyField(r.path, "");
    const std::string line = format(r, AccessLogFormat::Text);
    EXPECT_NE(line.find(" a\\x20b\\x0a2026\\x20fake\\x5c "), std::string::npos) << line;
    EXPECT_EQ(line.find('\n'), line.size() - 1);
    EXPECT_EQ(line.substr(line.size() - 29), " done - route=- sni=- alpn=-\n");
}

TEST(AccessLogFormat, CopyFieldTruncatesAtCharacterBoundary) {
    char field[8];
    copyField(field, "splice");
    EXPECT_STREQ(field, "splice");
    copyField(field, "0123456789");
    EXPECT_STREQ(field, "0123456");
    // "abcde" + U+20AC (3 bytes) needs 9: the euro sign goes whole, not its first two bytes.
    copyField(field, "abcde\xe2\x82\xac");
    EXPECT_STREQ(field, "abcde");
    copyField(field, "abcd\xe2\x82\xac");  // exactly 7 bytes: fits
    EXPECT_STREQ(field, "abcd\xe2\x82\xac");
}

TEST(AccessLog, OpenReturnsErrorsInsteadOfThrowing) {
    TempDir dir;
    ASSERT_FALSE(dir.path().empty());
    auto log = AccessLog::open(dir.file("missing/access.log"), AccessLogFormat::Json, 1);
    ASSERT_FALSE(log);
    EXPECT_EQ(log.error().code, ENOENT);

    auto to_stdout = AccessLog::open("-", AccessLogFormat::Text, 2);
    ASSERT_TRUE(to_stdout) << to_stdout.error().message();
    EXPECT_EQ((*to_stdout)->capacity(), AccessLog::kDefaultCapacity);
    (*to_stdout)->stop();
}

TEST(AccessLog, FileSinkWritesEveryRecordFromTwoProducers) {
    TempDir dir;
    ASSERT_FALSE(dir.path().empty());
    const std::string path = dir.file("access.log");
    auto opened = AccessLog::open(path, AccessLogFormat::Json, 2);
    ASSERT_TRUE(opened) << opened.error().message();
    AccessLog& log = **opened;

    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    // 0640 less the umask: never readable by others, whatever the umask.
    EXPECT_EQ(st.st_mode & 0777 & ~0640, 0u);
    EXPECT_NE(st.st_mode & S_IWUSR, 0u);

    constexpr unsigned kPerProducer = 5000;
    uint64_t failed[2] = {};
    std::vector<std::thread> producers;
    for (unsigned p = 0; p < 2; ++p) {
        producers.emplace_back([&log, &failed, p] {
            for (unsigned i = 0; i < kPerProducer; ++i) {
                AccessRecord r = sampleRecord();
                r.bytes_upstream = p;
                r.bytes_downstream = i;
                // The test wants every line, so it waits where a worker would drop.
                while (!log.push(p, r)) {
                    ++failed[p];
                    std::this_thread::sleep_for(std::chrono::milliseconds(1));
                }
            }
        });
    }
    for (auto& t : producers) t.join();
    log.stop();
    log.stop();  // idempotent
    EXPECT_EQ(log.dropped(0), failed[0]);
    EXPECT_EQ(log.dropped(1), failed[1]);

    const auto lines = readLines(path);
    ASSERT_EQ(lines.size(), 2 * kPerProducer);
    std::set<std::pair<unsigned, unsigned>> seen;
    unsigned next[2] = {};
    for (const auto& line : lines) {
        const auto json = parseLine(line);
        ASSERT_TRUE(json) << line;
        ASSERT_EQ(json->size(), 15u) << line;
        const unsigned p = std::stoul(*json->at("bytes_up"));
        const unsigned i = std::stoul(*json->at("bytes_down"));
        ASSERT_LT(p, 2u);
        EXPECT_EQ(i, next[p]++) << "producer " << p << " out of order";
        seen.emplace(p, i);
    }
    EXPECT_EQ(seen.size(), 2 * kPerProducer);

    // Byte for byte, the first record of producer 1 is what formatAccessRecord makes of it.
    AccessRecord first = sampleRecord();
    first.bytes_upstream = 1;
    first.bytes_downstream = 0;
    const std::string expected = format(first, AccessLogFormat::Json);
    EXPECT_EQ(std::count(lines.begin(), lines.end(), expected), 1);
}

TEST(AccessLog, FullRingDropsAndCounts) {
    TempDir dir;
    ASSERT_FALSE(dir.path().empty());
    const std::string path = dir.file("access.log");
    auto opened = AccessLog::open(path, AccessLogFormat::Text, 2, /*capacity=*/3);
    ASSERT_TRUE(opened) << opened.error().message();
    AccessLog& log = **opened;
    EXPECT_EQ(log.capacity(), 4u);  // rounded up to a power of two

    // 100 pushes in a tight loop take microseconds; the writer drains every 50 ms, so a ring of
    // 4 fills. Whatever the interleaving, every record is either written or counted.
    constexpr unsigned kPushes = 100;
    unsigned accepted = 0;
    for (unsigned i = 0; i < kPushes; ++i) accepted += log.push(1, sampleRecord()) ? 1 : 0;
    EXPECT_FALSE(log.push(2, sampleRecord()));  // no such producer: refused, not counted

    EXPECT_GE(accepted, 4u);
    EXPECT_GT(log.dropped(1), 0u);
    EXPECT_EQ(log.dropped(1), kPushes - accepted);
    EXPECT_EQ(log.dropped(0), 0u);
    EXPECT_EQ(log.totalDropped(), kPushes - accepted);

    // Drained rings take records again.
    ASSERT_TRUE(waitFor([&] { return readLines(path).size() == accepted; }));
    EXPECT_TRUE(log.push(1, sampleRecord()));
    log.stop();
    EXPECT_EQ(readLines(path).size(), accepted + 1);
}

TEST(AccessLog, ReopenAfterRenameWritesToTheNewFile) {
    TempDir dir;
    ASSERT_FALSE(dir.path().empty());
    const std::string path = dir.file("access.log");
    const std::string rotated = dir.file("access.log.1");
    auto opened = AccessLog::open(path, AccessLogFormat::Json, 1);
    ASSERT_TRUE(opened) << opened.error().message();
    AccessLog& log = **opened;

    AccessRecord before = sampleRecord();
    copyField(before.listener, "before");
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(log.push(0, before));
    ASSERT_TRUE(waitFor([&] { return readLines(path).size() == 3; }));

    // What logrotate does: rename, then signal; the writer creates the file again by path.
    ASSERT_EQ(std::rename(path.c_str(), rotated.c_str()), 0);
    log.reopen();
    ASSERT_TRUE(waitFor([&] { return fileExists(path); }));

    AccessRecord after = sampleRecord();
    copyField(after.listener, "after");
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(log.push(0, after));
    log.stop();

    const auto old_lines = readLines(rotated);
    const auto new_lines = readLines(path);
    ASSERT_EQ(old_lines.size(), 3u);
    ASSERT_EQ(new_lines.size(), 2u);
    for (const auto& line : old_lines) EXPECT_EQ(parseLine(line)->at("listener"), "before");
    for (const auto& line : new_lines) EXPECT_EQ(parseLine(line)->at("listener"), "after");
}

TEST(AccessLog, ReopenOnStdoutIsHarmless) {
    auto opened = AccessLog::open("stdout", AccessLogFormat::Text, 1);
    ASSERT_TRUE(opened) << opened.error().message();
    (*opened)->reopen();
    std::this_thread::sleep_for(2 * AccessLog::kFlushInterval);
    // No push: nothing reaches the test's stdout. The destructor stops the writer.
}

}  // namespace
}  // namespace zcrelay
