// The access log of the real binary: one line per finished connection, in JSON or text, to a
// file or to stdout, naming what the peers saw (the client's own address, the bytes each way)
// and how it ended. Lines are written by a thread every ~50 ms: tests wait for them, bounded.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <regex>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "support/json.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::access_log_test {
namespace {

constexpr uint64_t kReplySeed = 0xD0;
constexpr uint64_t kReplyBytes = 3000;
constexpr Millis kLogWait{10'000};

const std::vector<std::string> kJsonFields = {
    "time",       "listener",    "client",   "cluster",    "backend",     "attempts",
    "connect_ms", "duration_ms", "bytes_up", "bytes_down", "termination", "path",
    "route",      "sni",         "alpn"};

// "127.0.0.1:PORT": where a connected socket is bound (the relay's view of the client).
std::string localAddress(int fd) {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "?";
    char host[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &a.sin_addr, host, sizeof host);
    return std::string(host) + ":" + std::to_string(ntohs(a.sin_port));
}

std::vector<std::string> splitLines(const std::string& text) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
}

// The complete lines of `path` (a line the writer has not finished yet is left out).
std::vector<std::string> fileLines(const std::string& path) {
    std::string text = readFileText(path, 16 << 20);
    text.erase(text.find_last_of('\n') == std::string::npos ? 0 : text.find_last_of('\n') + 1);
    return splitLines(text);
}

// One flat JSON object (what the access log writes): keys in order, values as text. Strings
// are unescaped; numbers and null are kept as written, `quoted` tells them apart.
struct JsonValue {
    std::string text;
    bool quoted = false;
};
struct JsonLine {
    std::vector<std::string> keys;
    std::map<std::string, JsonValue> values;
    const JsonValue& at(const std::string& k) const {
        static const JsonValue kMissing{"<missing>", false};
        auto it = values.find(k);
        return it == values.end() ? kMissing : it->second;
    }
    std::string str(const std::string& k) const { return at(k).text; }
    double num(const std::string& k) const { return std::strtod(at(k).text.c_str(), nullptr); }
};

std::optional<JsonLine> parseJsonLine(const std::string& s) {
    std::string error;
    std::optional<Json> doc = parseJson(s, error);
    if (!doc || doc->type != Json::Type::Object) return std::nullopt;
    JsonLine line;
    for (const auto& [key, value] : doc->object) {
        JsonValue v;
        v.quoted = value.type == Json::Type::String;
        v.text = v.quoted ? value.string : value.type == Json::Type::Null ? "null" : value.raw;
        line.keys.push_back(key);
        line.values[key] = v;
    }
    return line;
}

bool isTime(const std::string& t) {
    static const std::regex kTime(R"(^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$)");
    return std::regex_match(t, kTime);
}
bool isMillis(const std::string& t) {
    static const std::regex kMillis(R"(^\d+\.\d{3}$)");
    return std::regex_match(t, kMillis);
}

// A client's side of one connection: its address and the bytes it moved each way.
struct ClientSide {
    std::string address;
    uint64_t sent = 0;
    uint64_t received = 0;
};

// The backend of the "done" cases: greets with the first kGreeting bytes of reply payload, reads
// until the client's FIN, then sends the rest of kReplyBytes and its own FIN. The greeting
// tells the client the relay is relaying before it sends its FIN: a sockmap connection whose
// client is gone before the backend answered is moved by splice instead (not_established).
constexpr uint64_t kGreeting = 100;
ConnScript greetThenSinkScript() {
    return [](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream& up) {
        rec.write_end = sendPayloadAt(fd.get(), kReplySeed, 0, kGreeting, kDefaultIoTimeout, &stop);
        if (!rec.write_end.ok()) return;
        StreamHash hash;
        rec.read_end = readStreamUntilEof(
            fd.get(),
            [&](std::span<const uint8_t> d) {
                hash.update(d);
                up.addLiveBytes(d.size());
            },
            kDefaultIoTimeout, &stop);
        rec.bytes_received = hash.bytes();
        rec.received_hash = hash.value();
        if (rec.read_end.status != IoStatus::Eof) return;
        rec.write_end = sendPayloadAt(fd.get(), kReplySeed, kGreeting, kReplyBytes - kGreeting,
                                      kDefaultIoTimeout, &stop);
        rec.bytes_sent = kGreeting + rec.write_end.bytes;
        ::shutdown(fd.get(), SHUT_WR);
    };
}

// The client of greetThenSinkScript: waits for the greeting, sends `bytes` of payload `seed`,
// FIN, reads the rest of the reply until EOF.
ClientSide sendAndReadReply(uint16_t port, uint64_t seed, uint64_t bytes) {
    ClientSide side;
    Connected c = connectTo("127.0.0.1", port);
    EXPECT_TRUE(c.fd) << c.error;
    if (!c.fd) return side;
    side.address = localAddress(c.fd.get());
    PayloadVerifier reply(kReplySeed);
    std::vector<uint8_t> greeting(kGreeting);
    IoResult greeted = readExactly(c.fd.get(), greeting.data(), greeting.size(), Millis{20'000});
    EXPECT_TRUE(greeted.ok()) << "no greeting: " << greeted.describe();
    reply.update(greeting);
    IoResult sent = sendPayload(c.fd.get(), seed, bytes, Millis{20'000});
    EXPECT_TRUE(sent.ok()) << sent.describe();
    side.sent = sent.bytes;
    ::shutdown(c.fd.get(), SHUT_WR);
    IoResult end = readStreamUntilEof(
        c.fd.get(), [&](std::span<const uint8_t> d) { reply.update(d); }, Millis{20'000});
    EXPECT_EQ(end.status, IoStatus::Eof) << end.describe();
    EXPECT_TRUE(reply.intact()) << "reply mismatch at " << reply.firstMismatch();
    side.received = reply.bytes();
    return side;
}

// A client the relay cannot serve (its backend refuses): it is closed; returns its address.
std::string refusedClient(uint16_t port) {
    Connected c = connectTo("127.0.0.1", port);
    EXPECT_TRUE(c.fd) << c.error;
    if (!c.fd) return "";
    std::string address = localAddress(c.fd.get());
    IoResult end = waitForPeerClose(c.fd.get(), Millis{10'000});
    EXPECT_TRUE(end.status == IoStatus::Eof || end.status == IoStatus::Reset) << end.describe();
    return address;
}

// An echo client that sends each of `exchanges` bytes in turn and reads them back (1000 by
// default), then resets the connection.
std::string resettingClient(uint16_t port, std::initializer_list<uint64_t> exchanges = {1000}) {
    Connected c = connectTo("127.0.0.1", port);
    EXPECT_TRUE(c.fd) << c.error;
    if (!c.fd) return "";
    std::string address = localAddress(c.fd.get());
    uint64_t moved = 0;
    for (uint64_t size : exchanges) {
        EXPECT_TRUE(sendPayload(c.fd.get(), 77 + moved, size).ok());
        std::vector<uint8_t> back(size);
        IoResult r = readExactly(c.fd.get(), back.data(), back.size(), Millis{10'000});
        EXPECT_TRUE(r.ok()) << r.describe();
        moved += size;
    }
    closeWithReset(c.fd);
    return address;
}

// Waits until `lines()` returns at least `n` lines; returns the last result.
std::vector<std::string> waitForLines(const std::function<std::vector<std::string>()>& lines,
                                      size_t n) {
    std::vector<std::string> got;
    waitUntil(
        [&] {
            got = lines();
            return got.size() >= n;
        },
        kLogWait);
    return got;
}

std::vector<JsonLine> parseAll(const std::vector<std::string>& lines) {
    std::vector<JsonLine> out;
    for (const auto& l : lines) {
        auto parsed = parseJsonLine(l);
        EXPECT_TRUE(parsed) << "not a flat JSON object: " << l;
        if (parsed) out.push_back(*parsed);
    }
    return out;
}

const JsonLine* byClient(const std::vector<JsonLine>& lines, const std::string& client) {
    for (const auto& l : lines)
        if (l.str("client") == client) return &l;
    return nullptr;
}

// Adds the top-level cluster `app` with this one backend.
void addCluster(RelayConfig& config, const std::string& backend) {
    config.extra_yaml +=
        "clusters:\n  - name: app\n    backends:\n      - address: \"" + backend + "\"\n";
}

// The relay of the one-listener cases: the access log at `path` (in `format`, or the default
// when empty), the cluster `app` of `backend`, and listener t on it in `mode` (or the default).
RelayConfig oneListenerConfig(const std::string& path, const std::string& format,
                              const std::string& backend, const std::string& mode = "") {
    RelayConfig config;
    config.extra_yaml = "access_log:\n  path: \"" + path + "\"\n";
    if (!format.empty()) config.extra_yaml += "  format: " + format + "\n";
    addCluster(config, backend);
    ListenerSpec t;
    t.cluster = "app";
    if (!mode.empty()) t.mode = mode;
    config.listeners = {t};
    return config;
}

// =============================================================================================

class JsonAccessLogTest : public ::testing::TestWithParam<std::string> {};

// N connections through listener t (cluster app) each log one line with the client's own
// address, the bytes it sent and received, the backend, and "done" on the data path it ran.
TEST_P(JsonAccessLogTest, EachConnectionLogsOneLineWithItsAddressBytesAndBackend) {
    const std::string mode = GetParam();
    constexpr int kConnections = 5;
    ScriptedUpstream backend(AF_INET, greetThenSinkScript());
    ASSERT_TRUE(backend.ok()) << backend.error();
    RelayProcess relay;
    const std::string log_path = relay.dir() + "/access.log";
    ASSERT_TRUE(relay.start(oneListenerConfig(log_path, "json", backend.hostPort(), mode)));
    EXPECT_EQ(relay.metric(metric::kDatapathInfo, metric::datapath(mode)), 1.0);

    std::vector<ClientSide> clients;
    for (int i = 0; i < kConnections; ++i)
        clients.push_back(sendAndReadReply(relay.port("t"), 500 + i, 1000 * (i + 1) + i));
    std::vector<std::string> raw = waitForLines([&] { return fileLines(log_path); }, kConnections);
    ASSERT_EQ(raw.size(), static_cast<size_t>(kConnections)) << readFileText(log_path);
    std::vector<JsonLine> lines = parseAll(raw);

    for (const ClientSide& c : clients) {
        const JsonLine* l = byClient(lines, c.address);
        ASSERT_NE(l, nullptr) << "no line for client " << c.address << " in\n"
                              << readFileText(log_path);
        EXPECT_EQ(l->keys, kJsonFields) << "field order";
        EXPECT_TRUE(isTime(l->str("time"))) << l->str("time");
        EXPECT_EQ(l->str("listener"), "t");
        EXPECT_EQ(l->str("cluster"), "app");
        EXPECT_EQ(l->str("backend"), backend.hostPort());
        EXPECT_EQ(l->str("attempts"), "1");
        EXPECT_TRUE(isMillis(l->str("connect_ms"))) << l->str("connect_ms");
        EXPECT_TRUE(isMillis(l->str("duration_ms"))) << l->str("duration_ms");
        EXPECT_LE(l->num("connect_ms"), l->num("duration_ms"));
        EXPECT_LT(l->num("duration_ms"), 30'000) << "generous bound";
        EXPECT_EQ(l->str("bytes_up"), std::to_string(c.sent)) << "what the client sent";
        EXPECT_EQ(l->str("bytes_down"), std::to_string(c.received)) << "what it received";
        EXPECT_EQ(c.received, kReplyBytes);
        EXPECT_EQ(l->str("termination"), "done");
        EXPECT_EQ(l->str("path"), mode);
        EXPECT_FALSE(l->at("bytes_up").quoted) << "numbers are JSON numbers";
    }
    EXPECT_TRUE(relay.waitForMetric(metric::kClosedTotal, metric::reason("done"), kConnections));
    EXPECT_EQ(fileLines(log_path).size(), static_cast<size_t>(kConnections))
        << "exactly one line per connection";
}

// The line's fields are formatted alike in every mode; its bytes are each data path's count.
// Splice and copy count theirs as their completions come, sockmap's are what the kernel moved,
// read from the BPF program's counters at close: splice and sockmap cover both.
INSTANTIATE_TEST_SUITE_P(Modes, JsonAccessLogTest, ::testing::Values("splice", "sockmap"),
                         modeName);

// The ways a connection ends besides "done": a backend that refuses (connect_failed, no
// connect time, no data path) and a client that resets (client_reset, with the bytes moved).
TEST(AccessLogTest, JsonLinesNameConnectFailedAndClientReset) {
    ScriptedUpstream echo(AF_INET, echoScript());
    ASSERT_TRUE(echo.ok()) << echo.error();
    Bound dead = bindLoopbackNoListen(AF_INET);
    ASSERT_TRUE(dead.fd) << dead.error;
    const std::string dead_addr = loopbackHostPort(AF_INET, dead.port);
    RelayProcess relay;
    const std::string log_path = relay.dir() + "/access.log";
    RelayConfig config;
    config.extra_yaml = "access_log:\n  path: \"" + log_path + "\"\n";  // json by default
    addCluster(config, echo.hostPort());
    ListenerSpec ok;
    ok.name = "ok";
    ok.cluster = "app";
    ListenerSpec refused;
    refused.name = "refused";
    refused.upstream = dead_addr;  // a one-backend cluster named after the listener
    config.listeners = {ok, refused};
    ASSERT_TRUE(relay.start(config));

    std::string failed_client = refusedClient(relay.port("refused"));
    std::string reset_client = resettingClient(relay.port("ok"));
    std::vector<JsonLine> lines = parseAll(waitForLines([&] { return fileLines(log_path); }, 2));
    ASSERT_EQ(lines.size(), 2u) << readFileText(log_path);

    const JsonLine* f = byClient(lines, failed_client);
    ASSERT_NE(f, nullptr) << readFileText(log_path);
    EXPECT_EQ(f->str("listener"), "refused");
    EXPECT_EQ(f->str("cluster"), "refused");
    EXPECT_EQ(f->str("backend"), dead_addr);
    EXPECT_EQ(f->str("attempts"), "3") << "the first try and 2 retries (the default)";
    EXPECT_EQ(f->str("connect_ms"), "null");
    EXPECT_FALSE(f->at("connect_ms").quoted);
    EXPECT_EQ(f->str("bytes_up"), "0");
    EXPECT_EQ(f->str("bytes_down"), "0");
    EXPECT_EQ(f->str("termination"), "connect_failed");
    EXPECT_EQ(f->str("path"), "") << "it never relayed";

    const JsonLine* r = byClient(lines, reset_client);
    ASSERT_NE(r, nullptr) << readFileText(log_path);
    EXPECT_EQ(r->str("listener"), "ok");
    EXPECT_EQ(r->str("cluster"), "app");
    EXPECT_EQ(r->str("backend"), echo.hostPort());
    EXPECT_EQ(r->str("attempts"), "1");
    EXPECT_TRUE(isMillis(r->str("connect_ms"))) << r->str("connect_ms");
    EXPECT_EQ(r->str("bytes_up"), "1000");
    EXPECT_EQ(r->str("bytes_down"), "1000");
    EXPECT_EQ(r->str("termination"), "client_reset");
    EXPECT_EQ(r->str("path"), "splice");

    EXPECT_TRUE(
        relay.waitForMetric(metric::kClosedTotal, metric::reason("connect_failed", "refused"), 1));
    EXPECT_TRUE(relay.waitForMetric(metric::kClosedTotal, metric::reason("client_reset", "ok"), 1));
}

// A client that resets after two exchanges: its line counts every byte its data path moved,
// the same bytes as zcrelay_bytes_total, in every mode. Sockmap's bytes are the kernel's, read
// from the program's counters every tick and at close; the line used to be written before that
// last read, so a connection reset within a tick of its last bytes logged only what was read
// before (a psql session over TLS, reset by psql at its end, logged 8 bytes up and 0 down).
class ResetAccessLogTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ResetAccessLogTest, AClientResetLogsEveryByteItsDataPathMoved) {
    const std::string mode = GetParam();
    ScriptedUpstream echo(AF_INET, echoScript());
    ASSERT_TRUE(echo.ok()) << echo.error();
    RelayProcess relay;
    const std::string log_path = relay.dir() + "/access.log";
    ASSERT_TRUE(relay.start(oneListenerConfig(log_path, "", echo.hostPort(), mode)));
    EXPECT_EQ(relay.metric(metric::kDatapathInfo, metric::datapath(mode)), 1.0);

    // The first answer shows the connection relaying (a sockmap pair is in the map by then);
    // the second exchange is the data path's alone: in sockmap mode, the kernel's.
    constexpr uint64_t kFirst = 1000, kSecond = 64 << 10, moved = kFirst + kSecond;
    const std::string address = resettingClient(relay.port("t"), {kFirst, kSecond});
    ASSERT_FALSE(address.empty());

    std::vector<JsonLine> lines = parseAll(waitForLines([&] { return fileLines(log_path); }, 1));
    const JsonLine* l = byClient(lines, address);
    ASSERT_NE(l, nullptr) << readFileText(log_path);
    EXPECT_EQ(l->str("termination"), "client_reset");
    EXPECT_EQ(l->str("path"), mode);
    EXPECT_EQ(l->str("bytes_up"), std::to_string(moved)) << "what the client sent";
    EXPECT_EQ(l->str("bytes_down"), std::to_string(moved)) << "what it received";
    for (const char* direction : {"upstream", "downstream"}) {
        Labels labels = metric::bytes(direction);
        labels["path"] = mode;
        EXPECT_EQ(relay.metric(metric::kBytesTotal, labels), static_cast<double>(moved))
            << direction << ": the line and the metric count the same bytes";
    }
}

INSTANTIATE_TEST_SUITE_P(Modes, ResetAccessLogTest, ::testing::ValuesIn(kModes), modeName);

// Text: space-separated fields, "-" for what is absent.
TEST(AccessLogTest, TextLinesHaveTheDocumentedFields) {
    ScriptedUpstream backend(AF_INET, greetThenSinkScript());
    ASSERT_TRUE(backend.ok()) << backend.error();
    Bound dead = bindLoopbackNoListen(AF_INET);
    ASSERT_TRUE(dead.fd) << dead.error;
    const std::string dead_addr = loopbackHostPort(AF_INET, dead.port);
    RelayProcess relay;
    const std::string log_path = relay.dir() + "/access.log";
    RelayConfig config;
    config.extra_yaml = "access_log:\n  path: \"" + log_path + "\"\n  format: text\n";
    addCluster(config, backend.hostPort());
    ListenerSpec web;
    web.name = "web";
    web.cluster = "app";
    web.mode = "copy";
    ListenerSpec refused;
    refused.name = "refused";
    refused.upstream = dead_addr;
    config.listeners = {web, refused};
    ASSERT_TRUE(relay.start(config));

    constexpr int kConnections = 3;
    std::vector<ClientSide> clients;
    for (int i = 0; i < kConnections; ++i)
        clients.push_back(sendAndReadReply(relay.port("web"), 700 + i, 4096 * (i + 1)));
    std::string failed_client = refusedClient(relay.port("refused"));
    std::vector<std::string> raw =
        waitForLines([&] { return fileLines(log_path); }, kConnections + 1);
    ASSERT_EQ(raw.size(), static_cast<size_t>(kConnections + 1)) << readFileText(log_path);

    // time listener client cluster/backend attempts=N connect_ms=X duration_ms=Y up=U down=D
    // termination path route=R sni=S alpn=A (no routes here: "-")
    std::map<std::string, std::vector<std::string>> by_client;
    for (const auto& line : raw) {
        std::istringstream in(line);
        std::vector<std::string> f;
        for (std::string w; in >> w;) f.push_back(w);
        ASSERT_EQ(f.size(), 14u) << line;
        by_client[f[2]] = f;
    }
    for (const ClientSide& c : clients) {
        ASSERT_TRUE(by_client.count(c.address)) << c.address << " missing in\n"
                                                << readFileText(log_path);
        const auto& f = by_client[c.address];
        EXPECT_TRUE(isTime(f[0])) << f[0];
        EXPECT_EQ(f[1], "web");
        EXPECT_EQ(f[3], "app/" + backend.hostPort());
        EXPECT_EQ(f[4], "attempts=1");
        EXPECT_TRUE(f[5].rfind("connect_ms=", 0) == 0 && isMillis(f[5].substr(11))) << f[5];
        EXPECT_TRUE(f[6].rfind("duration_ms=", 0) == 0 && isMillis(f[6].substr(12))) << f[6];
        EXPECT_EQ(f[7], "up=" + std::to_string(c.sent));
        EXPECT_EQ(f[8], "down=" + std::to_string(c.received));
        EXPECT_EQ(f[9], "done");
        EXPECT_EQ(f[10], "copy");
        EXPECT_EQ(f[11], "route=-");
        EXPECT_EQ(f[12], "sni=-");
        EXPECT_EQ(f[13], "alpn=-");
    }
    ASSERT_TRUE(by_client.count(failed_client)) << readFileText(log_path);
    const auto& f = by_client[failed_client];
    EXPECT_EQ(f[1], "refused");
    EXPECT_EQ(f[3], "refused/" + dead_addr);
    EXPECT_EQ(f[4], "attempts=3");
    EXPECT_EQ(f[5], "connect_ms=-");
    EXPECT_EQ(f[7], "up=0");
    EXPECT_EQ(f[8], "down=0");
    EXPECT_EQ(f[9], "connect_failed");
    EXPECT_EQ(f[10], "-");
}

// path "-": the same JSON lines on stdout, among the relay's own "zcrelay: " lines.
TEST(AccessLogTest, DashWritesJsonLinesToStdout) {
    ScriptedUpstream backend(AF_INET, greetThenSinkScript());
    ASSERT_TRUE(backend.ok()) << backend.error();
    RelayProcess relay;
    ASSERT_TRUE(relay.start(oneListenerConfig("-", "json", backend.hostPort())));

    constexpr int kConnections = 3;
    std::vector<ClientSide> clients;
    for (int i = 0; i < kConnections; ++i)
        clients.push_back(sendAndReadReply(relay.port("t"), 900 + i, 2000 + i));
    auto logLines = [&] {
        std::vector<std::string> out;
        for (const auto& l : splitLines(relay.stdoutText()))
            if (!l.empty() && l.front() == '{' && l.back() == '}') out.push_back(l);
        return out;
    };
    std::vector<JsonLine> lines = parseAll(waitForLines(logLines, kConnections));
    ASSERT_EQ(lines.size(), static_cast<size_t>(kConnections)) << relay.stdoutText();
    for (const ClientSide& c : clients) {
        const JsonLine* l = byClient(lines, c.address);
        ASSERT_NE(l, nullptr) << c.address << " missing in\n" << relay.stdoutText();
        EXPECT_EQ(l->str("listener"), "t");
        EXPECT_EQ(l->str("backend"), backend.hostPort());
        EXPECT_EQ(l->str("bytes_up"), std::to_string(c.sent));
        EXPECT_EQ(l->str("bytes_down"), std::to_string(c.received));
        EXPECT_EQ(l->str("termination"), "done");
    }
}

}  // namespace
}  // namespace zcrelay::test::access_log_test
