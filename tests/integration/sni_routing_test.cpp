// TLS SNI routing end to end, through the real binary on loopback, over every data path:
//   - real TLS peers: `openssl s_server` backends, each with a self-signed certificate of its own
//     (CN api, apps, fallback), and real clients (openssl s_client, curl, Python's ssl): a server
//     name lands on its backend (the certificate the client verified and reports), the handshake
//     completes end to end and the backend's HTTP answer comes back;
//   - the matching rules: exact names in any case, a trailing dot, a wildcard of exactly one
//     label, ALPN conditions, ALPN alone, first match wins, the default route;
//   - every inspection that fails (no SNI, not TLS, too large, malformed, timeout, no route) takes
//     the default route, or is closed as no_route without one;
//   - the ClientHello is peeked, never consumed: plain TCP capture backends get the client's
//     bytes unchanged, for real hellos split at every byte into two segments, re-framed into
//     several TLS records, after a PROXY header, or behind the relay's own send_proxy header;
//   - HAProxy's req.ssl_sni routing of the same hellos: what HAProxy sends to a named backend,
//     zcrelay sends to the same one;
//   - reload: new routes for new connections while a live one keeps its backend; the access
//     log's sni/alpn/route fields.
// The oracle is which backend got the connection and the relay's counters, waited on with
// deadlines; never a duration. Every external program runs under runCommand's timeout or is a
// ChildProcess of the test, signalled by its own PID only.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <regex>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/labels.hpp"
#include "support/json.hpp"
#include "support/bytes.hpp"
#include "support/haproxy.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::sni_routing_test {
namespace {

constexpr Millis kIo{20'000};
constexpr Millis kTool{30'000};  // one run of openssl, curl or python
// "Not yet": how long a case watches for something that must not have happened. Load only
// makes the relay later, so a short look cannot fail a correct relay.
constexpr Millis kNotYet{300};
constexpr Millis kPause{2};  // between two writes: separate segments under TCP_NODELAY

// The data paths a suite runs in. Routing is decided before any data path starts; what the
// cases check after it is the hand-off of the bytes read while inspecting: in sockmap mode the
// relay sends them on itself before the sockets enter the map (Connections::startRelaying),
// while splice and copy both just start their pumps on the client's socket. Splice and sockmap
// cover both hand-offs; copy's pumps are the relay suite's subject.
const std::vector<std::string> kHandOffModes = {"splice", "sockmap"};

// The contract's names.
constexpr const char* kRouteSelections = "zcrelay_route_selections_total";   // {listener, route}
constexpr const char* kInspectFailures = "zcrelay_inspect_failures_total";   // {listener, reason}
constexpr const char* kInspectSeconds = "zcrelay_inspect_duration_seconds";  // histogram
const std::vector<std::string> kInspectReasons = {"timeout",   "not_tls", "too_large",
                                                  "malformed", "no_sni",  "no_route"};
const std::string kNoRouteClose = "no_route";  // zcrelay_connections_closed_total{reason}

Labels routeLabels(const std::string& route, const std::string& listener = "t") {
    return {{"listener", listener}, {"route", route}};
}

// The relay's sockmap counters that are not zero, for failure messages: a connection whose bytes
// stop on the sockmap path shows up in them (catch-ups, replays, skipped bytes).
std::string sockmapCounters(const RelayProcess& relay) {
    std::optional<std::string> text = relay.scrape();
    if (!text) return "(no scrape)";
    std::string out;
    for (const Sample& s : parseMetrics(*text))
        if (s.name.rfind("zcrelay_sockmap_", 0) == 0 && s.value != 0)
            out += "\n    " + formatSeries(s.name, s.labels) + " " + std::to_string(s.value);
    return out.empty() ? "(all zero)" : out;
}

// =============================================================================================
// Bytes and the TLS record layer, written out here from RFC 8446 (5.1, 4.1.2) and RFC 6066 /
// RFC 7301 for the two extensions: the relay's own parser is never used to check itself.

uint16_t be16(const std::string& s, size_t at) {
    return static_cast<uint16_t>(static_cast<uint8_t>(s[at]) << 8 |
                                 static_cast<uint8_t>(s[at + 1]));
}
uint32_t be24(const std::string& s, size_t at) {
    return static_cast<uint32_t>(static_cast<uint8_t>(s[at])) << 16 | be16(s, at + 1);
}

// Where two byte strings first differ, for failure messages.
std::string firstDifference(const std::string& got, const std::string& want) {
    size_t i = 0;
    while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
    std::ostringstream os;
    os << "got " << got.size() << " bytes, sent " << want.size() << "; first difference at byte "
       << i << ": got " << hex(got.substr(i, 16)) << " instead of " << hex(want.substr(i, 16));
    return os.str();
}

constexpr size_t kNotHandshake = std::string::npos;

// How many bytes of `stream` carry its first handshake message: the handshake records up to the
// one that completes it. 0 while it is incomplete, kNotHandshake if the stream starts otherwise.
size_t helloExtent(const std::string& stream) {
    size_t at = 0;
    size_t message = 0;  // handshake bytes seen so far
    uint32_t need = 0;   // the message's length once its 4-byte header is in
    for (int record = 0; record < 100'000 && at + 5 <= stream.size(); ++record) {
        if (stream[at] != 0x16) return kNotHandshake;
        size_t len = be16(stream, at + 3);
        if (at + 5 + len > stream.size()) return 0;
        for (size_t i = 0; i < len; ++i, ++message) {
            if (message >= 1 && message <= 3)
                need = need << 8 | static_cast<uint8_t>(stream[at + 5 + i]);
        }
        at += 5 + len;
        if (message >= 4 && message >= 4 + need) return at;
    }
    return 0;
}

// The first handshake message of `records` (their fragments put back together).
std::string handshakeMessage(const std::string& records) {
    std::string message;
    for (size_t at = 0; at + 5 <= records.size();) {
        size_t len = be16(records, at + 3);
        message.append(records, at + 5, len);
        at += 5 + len;
    }
    if (message.size() >= 4) message.resize(std::min(message.size(), 4 + size_t{be24(message, 1)}));
    return message;
}

// `message` in handshake records of these fragment sizes in turn, the last taking what is left
// (a zero size is skipped). The record header is 0x16 0x03 0x01 and the fragment's length, as
// clients write their first records.
std::string frame(const std::string& message, const std::vector<size_t>& sizes) {
    std::string out;
    size_t at = 0;
    auto record = [&](size_t n) {
        out += std::string("\x16\x03\x01", 3);
        putBe16(out, static_cast<uint16_t>(n));
        out.append(message, at, n);
        at += n;
    };
    for (size_t s : sizes) {
        if (s == 0 || at + s >= message.size()) continue;
        record(s);
    }
    if (at < message.size()) record(message.size() - at);
    return out;
}

std::string frameEvery(const std::string& message, size_t fragment) {
    return frame(message, std::vector<size_t>(message.size() / fragment + 1, fragment));
}

// The records of `framed`, each on its own.
std::vector<std::string> recordsOf(const std::string& framed) {
    std::vector<std::string> out;
    for (size_t at = 0; at + 5 <= framed.size() && out.size() < 100'000;) {
        size_t len = 5 + be16(framed, at + 3);
        out.push_back(framed.substr(at, len));
        at += len;
    }
    return out;
}

// What a ClientHello says, read by hand (RFC 8446 4.1.2): its server name (the host_name entry
// of server_name) and the protocols of its ALPN extension.
struct HelloFields {
    bool parsed = false;
    std::optional<std::string> sni;
    size_t sni_at = 0;  // offset of the host name in the handshake message
    std::vector<std::string> alpn;
};

HelloFields parseHello(const std::string& m) {
    HelloFields f;
    if (m.size() < 4 || m[0] != 0x01) return f;
    size_t end = 4 + be24(m, 1);
    if (end > m.size()) return f;
    size_t p = 4 + 2 + 32;  // legacy_version, random
    auto need = [&](size_t n) { return p + n <= end; };
    if (!need(1)) return f;
    p += 1 + static_cast<uint8_t>(m[p]);  // legacy_session_id
    if (!need(2)) return f;
    p += 2 + be16(m, p);  // cipher_suites
    if (!need(1)) return f;
    p += 1 + static_cast<uint8_t>(m[p]);  // legacy_compression_methods
    if (p == end) {
        f.parsed = true;  // no extensions at all
        return f;
    }
    if (!need(2)) return f;
    size_t ext_end = p + 2 + be16(m, p);
    p += 2;
    if (ext_end > end) return f;
    for (int n = 0; n < 1000 && p + 4 <= ext_end; ++n) {
        uint16_t type = be16(m, p);
        size_t len = be16(m, p + 2);
        size_t data = p + 4;
        if (data + len > ext_end) return f;
        if (type == 0 && len >= 5) {  // server_name: list length, name type, name length, name
            size_t name_len = be16(m, data + 3);
            if (data + 5 + name_len > data + len) return f;
            f.sni = m.substr(data + 5, name_len);
            f.sni_at = data + 5;
        } else if (type == 16 && len >= 2) {  // ALPN: list length, then length-prefixed names
            size_t q = data + 2;
            for (int k = 0; k < 10'000 && q < data + len; ++k) {
                size_t l = static_cast<uint8_t>(m[q]);
                if (q + 1 + l > data + len) return f;
                f.alpn.push_back(m.substr(q + 1, l));
                q += 1 + l;
            }
        }
        p = data + len;
    }
    f.parsed = true;
    return f;
}

// PROXY headers as a client puts them in front (the proxy_protocol_test builds the same by hand
// from the spec): 192.0.2.10:40000 -> 198.51.100.20:443.
const std::string kProxyV1 = "PROXY TCP4 192.0.2.10 198.51.100.20 40000 443\r\n";
std::string proxyV2() {
    std::string h("\r\n\r\n\0\r\nQUIT\n", 12);
    h += std::string("\x21\x11\x00\x0c", 4);                  // v2 PROXY, TCP over IPv4, 12 bytes
    h += std::string("\xc0\x00\x02\x0a\xc6\x33\x64\x14", 8);  // 192.0.2.10, 198.51.100.20
    h += std::string("\x9c\x40\x01\xbb", 4);                  // 40000, 443
    return h;
}

// =============================================================================================
// Capture backends: plain TCP standing in for TLS servers where the bytes are the oracle.

constexpr char kGreeting = '*';
// What a client sends once its backend has answered: the stream goes on after the hello.
const std::string kSecondFlight = "the client's second flight\n";

// Greets with one byte, so the client knows the relay chose this backend and relays before it
// half-closes (a sockmap connection whose client is gone already would be moved by splice),
// then keeps every byte until the relay's EOF, by accept index, counting them as they come (so
// a client can tell its bytes arrived while the connection was open, not only with its FIN).
class CaptureBackend {
  public:
    explicit CaptureBackend(std::string name) : name_(std::move(name)) {}
    bool ok() const { return up_.ok(); }
    const std::string& error() const { return up_.error(); }
    const std::string& name() const { return name_; }
    std::string hostPort() const { return up_.hostPort(); }
    size_t accepted() const { return up_.accepted(); }
    uint64_t liveBytes() const { return up_.liveBytesReceived(); }
    // The bytes connection `index` brought, once it ended (nullopt with an ADD_FAILURE if not).
    std::optional<std::string> bytes(size_t index) {
        std::optional<ConnRecord> rec = up_.waitForRecord(index, kIo);
        if (!rec) {
            ADD_FAILURE() << name_ << ": backend connection " << index << " never ended";
            return std::nullopt;
        }
        EXPECT_EQ(rec->read_end.status, IoStatus::Eof) << name_ << ": " << rec->describe();
        std::lock_guard lock(state_->mu);
        return state_->by_index[index];
    }

  private:
    struct State {
        std::mutex mu;
        std::map<size_t, std::string> by_index;
    };
    ConnScript script() {
        return [state = state_](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop,
                                ScriptedUpstream& up) {
            rec.write_end = writeAll(fd.get(), &kGreeting, 1, kIo, &stop);
            std::string got;
            rec.read_end = readStreamUntilEof(
                fd.get(),
                [&](std::span<const uint8_t> d) {
                    if (got.size() < (1 << 20))
                        got.append(reinterpret_cast<const char*>(d.data()), d.size());
                    up.addLiveBytes(d.size());
                },
                kIo, &stop);
            rec.bytes_received = got.size();
            ::shutdown(fd.get(), SHUT_WR);
            std::lock_guard lock(state->mu);
            state->by_index[rec.index] = std::move(got);
        };
    }

    std::string name_;
    std::shared_ptr<State> state_ = std::make_shared<State>();
    ScriptedUpstream up_{AF_INET, script()};  // last: its threads use state_
};

struct ClusterAddrs {
    std::string api, apps, fallback;
};

// Where one client landed: the backend's name ("" if none) and what that backend received.
struct Landing {
    std::string backend;
    std::optional<std::string> bytes;
    std::string note;  // what the client saw, for failure messages
};

class CaptureSet {
  public:
    bool ok(std::string& error) const {
        for (const CaptureBackend* b : all())
            if (!b->ok()) error = b->name() + ": " + b->error();
        return error.empty();
    }
    ClusterAddrs addrs() const { return {api.hostPort(), apps.hostPort(), fallback.hostPort()}; }
    std::array<size_t, 3> counts() const {
        return {api.accepted(), apps.accepted(), fallback.accepted()};
    }
    size_t total() const { return api.accepted() + apps.accepted() + fallback.accepted(); }

    // One client through `port`: `parts` written in turn (kPause apart), then it waits for the
    // backend's greeting, writes `after` (a second flight, once the backend has answered, as a
    // TLS client's Finished and request), waits until the backend has every byte, half-closes
    // and reads to EOF. Where it landed, with the bytes; `note` says what went wrong, if anything.
    Landing through(uint16_t port, const std::vector<std::string>& parts,
                    const std::string& after = "") {
        Landing l;
        std::array<CaptureBackend*, 3> backends = all();
        std::array<size_t, 3> before = counts();
        std::array<uint64_t, 3> live_before{};
        for (size_t i = 0; i < 3; ++i) live_before[i] = backends[i]->liveBytes();
        size_t total_bytes = after.size();
        for (const auto& p : parts) total_bytes += p.size();

        Connected c = connectTo("127.0.0.1", port);
        if (!c.fd) {
            l.note = "connect: " + c.error;
            return l;
        }
        for (size_t i = 0; i < parts.size(); ++i) {
            if (i > 0) std::this_thread::sleep_for(kPause);
            IoResult w = writeAll(c.fd.get(), parts[i].data(), parts[i].size(), kIo);
            if (!w.ok()) {
                l.note = "write of part " + std::to_string(i) + ": " + w.describe();
                return l;
            }
        }
        char greeting = 0;
        IoResult g = readExactly(c.fd.get(), &greeting, 1, kIo);
        if (!g.ok() || greeting != kGreeting) {
            l.note = "no greeting from a backend: " + g.describe();
            return l;
        }
        // The backend greeted, so it has accepted: the count is in or about to be.
        waitUntil([&] { return total() > before[0] + before[1] + before[2]; }, kIo);
        int at = -1;
        for (size_t i = 0; i < 3; ++i) {
            if (backends[i]->accepted() == before[i]) continue;
            if (at >= 0) l.note += "two backends got a connection; ";
            at = static_cast<int>(i);
        }
        if (at < 0) {
            l.note += "greeted, but no backend counts an accept; ";
            return l;
        }
        CaptureBackend& b = *backends[static_cast<size_t>(at)];
        l.backend = b.name();
        if (!after.empty()) {
            IoResult w = writeAll(c.fd.get(), after.data(), after.size(), kIo);
            if (!w.ok()) l.note += "write after the greeting: " + w.describe() + "; ";
        }
        // Every byte must reach the backend while the connection is open, not only once the
        // client's FIN pushes it. Loopback takes microseconds; the bound only ends a broken run.
        auto arrived = [&] { return b.liveBytes() - live_before[static_cast<size_t>(at)]; };
        if (!waitUntil([&] { return arrived() >= total_bytes; }, Millis{5'000}, Millis{5}))
            l.note += "only " + std::to_string(arrived()) + " of the client's " +
                      std::to_string(total_bytes) + " bytes reached " + b.name() +
                      " while the connection was open; ";
        ::shutdown(c.fd.get(), SHUT_WR);
        std::string rest;
        IoResult end = readUntilEof(c.fd.get(), rest, kIo);
        if (end.status != IoStatus::Eof || !rest.empty())
            l.note += "after the greeting: " + end.describe() + ", " + hex(rest) + "; ";
        l.bytes = b.bytes(before[static_cast<size_t>(at)]);
        return l;
    }

    CaptureBackend api{"api"}, apps{"apps"}, fallback{"fallback"};

  private:
    std::array<CaptureBackend*, 3> all() { return {&api, &apps, &fallback}; }
    std::array<const CaptureBackend*, 3> all() const { return {&api, &apps, &fallback}; }
};

// The client writes `bytes` and the relay closes it without a backend. Returns what it saw.
IoResult expectClosedWithoutBackend(uint16_t port, const std::string& bytes) {
    Connected c = connectTo("127.0.0.1", port);
    EXPECT_TRUE(c.fd) << c.error;
    if (!c.fd) return {};
    // The relay may close while a large write is still going: that write's error is expected.
    if (!bytes.empty()) writeAll(c.fd.get(), bytes.data(), bytes.size(), kIo);
    IoResult end = waitForPeerClose(c.fd.get(), kIo);
    EXPECT_TRUE(endedByPeer(end)) << "the relay must close a client it cannot route; "
                                  << end.describe();
    EXPECT_EQ(end.bytes, 0u) << "nothing is sent to a client without a route";
    return end;
}

// =============================================================================================
// Real TLS peers: the programs, certificates, s_server backends and the clients.

struct Tools {
    std::string openssl, curl, python;
};

// Fills `t` with what a case needs, or says what to install.
std::optional<std::string> findTools(Tools& t, bool curl, bool python) {
    std::optional<std::string> p = findExecutable("openssl");
    if (!p) return "openssl is not installed (Debian package openssl)";
    t.openssl = *p;
    if (curl) {
        if (!(p = findExecutable("curl"))) return "curl is not installed (Debian package curl)";
        t.curl = *p;
    }
    if (python) {
        if (!(p = findExecutable("python3")))
            return "python3 is not installed (Debian package python3)";
        t.python = *p;
    }
    return std::nullopt;
}

#define SKIP_WITHOUT_TOOLS(tools, curl, python) \
    if (auto why = findTools(tools, curl, python)) GTEST_SKIP() << *why

// A real TLS client in Python's ssl module (OpenSSL underneath, but its own ClientHello): it
// verifies the backend's certificate against every backend's (check_hostname off: the names are
// routing keys, not the certificates'), prints the subject's CN, then talks:
//   get  - sends an HTTP GET, prints the answer (s_server -www closes after it);
//   echo - sends "ping-1", prints the line that comes back (s_server -rev reverses it);
//   hold - echo, then waits for the --gate file to appear, then "ping-2" on the same connection.
// --proxy-v1 writes a PROXY v1 line before the handshake; --big N puts N long protocol names
// before --alpn's, so the hello outgrows one TLS record and the listed ones come last.
// Every wait is bounded: socket timeouts, a byte cap on reads, a step count on the gate.
const char* kPythonClient = R"PY(
import argparse, os, socket, ssl, sys, time

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--sni", default="")
ap.add_argument("--alpn", default="")
ap.add_argument("--big", type=int, default=0)
ap.add_argument("--cafile", default="")
ap.add_argument("--proxy-v1", default="")
ap.add_argument("--mode", default="get", choices=["get", "echo", "hold"])
ap.add_argument("--gate", default="")
a = ap.parse_args()

ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname = False
if a.cafile:
    ctx.load_verify_locations(a.cafile)
else:
    ctx.verify_mode = ssl.CERT_NONE
protos = ["x%03d-" % i + "y" * 200 for i in range(a.big)]
protos += [p for p in a.alpn.split(",") if p]
if protos:
    ctx.set_alpn_protocols(protos)

def line(t):
    data = b""
    while not data.endswith(b"\n") and len(data) < 4096:
        chunk = t.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode("latin-1").strip()

raw = socket.create_connection(("127.0.0.1", a.port), timeout=10)
raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
if a.proxy_v1:
    raw.sendall(("PROXY " + a.proxy_v1 + "\r\n").encode())
t = ctx.wrap_socket(raw, server_hostname=a.sni or None)
subject = dict(x[0] for x in t.getpeercert()["subject"]) if a.cafile else {}
print("subject=CN = " + subject.get("commonName", ""), flush=True)
print("alpn=" + (t.selected_alpn_protocol() or ""), flush=True)
if a.mode == "get":
    t.sendall(b"GET / HTTP/1.0\r\n\r\n")
    data = b""
    while len(data) < (1 << 20):
        chunk = t.recv(65536)
        if not chunk:
            break
        data += chunk
    sys.stdout.write(data.decode("latin-1"))
else:
    t.sendall(b"ping-1\n")
    print("reply1=" + line(t), flush=True)
    if a.mode == "hold":
        for _ in range(600):
            if os.path.exists(a.gate):
                break
            time.sleep(0.05)
        t.sendall(b"ping-2\n")
        print("reply2=" + line(t), flush=True)
t.close()
)PY";

::testing::AssertionResult makeCertificate(const Tools& tools, const TempDir& dir,
                                           const std::string& cn) {
    CommandResult r =
        runCommand({tools.openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", "/CN=" + cn,
                    "-keyout", dir.file(cn + ".key"), "-out", dir.file(cn + ".crt")},
                   kTool);
    if (!r.status.cleanExit())
        return ::testing::AssertionFailure() << "openssl req for CN=" << cn << ": " << r.describe();
    return ::testing::AssertionSuccess();
}

// `openssl s_server` on a loopback port of its own, with certificate CN=`cn`. `style`: "-www"
// (answers a GET with a status page that names its command line, its certificate file too) or
// "-rev" (sends each line back reversed). It serves one connection at a time, which the cases
// here never need more of.
class TlsBackend {
  public:
    ~TlsBackend() { stop(); }

    ::testing::AssertionResult start(const Tools& tools, const TempDir& dir, const std::string& cn,
                                     const std::string& style) {
        cn_ = cn;
        cert_ = dir.file(cn + ".crt");
        if (auto made = makeCertificate(tools, dir, cn); !made) return made;
        // s_server cannot report a port the kernel picked: reserve one, release it, bind it.
        // Another process could take it in between, so a failed start retries on a new port.
        std::string why;
        for (int attempt = 0; attempt < 3; ++attempt) {
            Listening probe = listenLoopback(AF_INET);
            if (!probe.fd) return ::testing::AssertionFailure() << probe.error;
            port_ = probe.port;
            probe.fd.reset();
            child_ = std::make_unique<ChildProcess>();
            ChildProcess::Options opts;
            opts.argv = {tools.openssl, "s_server", "-accept", "127.0.0.1:" + std::to_string(port_),
                         "-cert",       cert_,      "-key",    dir.file(cn + ".key"),
                         "-quiet",      style};
            opts.stdout_path = dir.file(cn + ".s_server.out");
            opts.stderr_path = dir.file(cn + ".s_server.err");
            std::string error;
            if (!child_->spawn(opts, error))
                return ::testing::AssertionFailure() << "spawn s_server: " << error;
            // Ready when a connect succeeds (s_server drops the empty connection and goes on).
            bool up = waitUntil(
                [&] {
                    if (!child_->running()) return true;
                    return connectTo("127.0.0.1", port_, Millis{500}).fd.valid();
                },
                Millis{10'000}, Millis{20});
            if (up && child_->running()) return ::testing::AssertionSuccess();
            why = "s_server " + cn + " did not listen on port " + std::to_string(port_) +
                  "; stderr: " + fileTail(opts.stderr_path);
            stop();
        }
        return ::testing::AssertionFailure() << why;
    }

    void stop() {
        if (!child_) return;
        if (child_->running()) {
            child_->sendSignal(SIGTERM);
            if (!child_->waitExit(Millis{5'000})) child_->killAndWait();
        }
        child_.reset();
    }

    const std::string& cn() const { return cn_; }
    const std::string& certPath() const { return cert_; }
    std::string hostPort() const { return "127.0.0.1:" + std::to_string(port_); }

  private:
    std::string cn_, cert_;
    uint16_t port_ = 0;
    std::unique_ptr<ChildProcess> child_;
};

// A client's offer: the server name it sends (none: no server_name extension) and its ALPN
// protocols, comma-separated ("" = no ALPN extension).
struct Offer {
    std::optional<std::string> sni;
    std::string alpn;
};
std::string describe(const Offer& o) {
    return (o.sni ? "sni \"" + *o.sni + "\"" : std::string("no sni")) +
           (o.alpn.empty() ? ", no alpn" : ", alpn " + o.alpn);
}

// One run of a real TLS client and what it reported.
struct ClientRun {
    std::string what;  // the client and its offer
    CommandResult result;
    std::string cn;  // the CN of the certificate subject the client reports; "" if none
    std::string transcript() const { return what + "\n" + result.describe(); }
};

std::string reportedCn(const std::string& text, const std::regex& pattern) {
    std::smatch m;
    return std::regex_search(text, m, pattern) ? m[1].str() : std::string();
}

// openssl s_client: verifies against `cafile` (a failed verification ends the handshake),
// sends `stdin_path` and reads until the server closes (-ign_eof). Empty `cafile`: no checks,
// for captures.
ClientRun sClient(const Tools& tools, uint16_t port, const Offer& offer, const std::string& cafile,
                  const std::string& stdin_path = "/dev/null") {
    std::vector<std::string> argv = {tools.openssl, "s_client", "-connect",
                                     "127.0.0.1:" + std::to_string(port)};
    if (offer.sni)
        argv.insert(argv.end(), {"-servername", *offer.sni});
    else
        argv.push_back("-noservername");
    if (!offer.alpn.empty()) argv.insert(argv.end(), {"-alpn", offer.alpn});
    if (!cafile.empty())
        argv.insert(argv.end(), {"-CAfile", cafile, "-verify_return_error", "-ign_eof"});
    ClientRun run;
    run.what = "openssl s_client, " + describe(offer);
    run.result = runCommand(argv, kTool, stdin_path);
    static const std::regex kSubject(R"(subject=CN = ([^\s,/]+))");
    run.cn = reportedCn(run.result.out, kSubject);
    return run;
}

// curl -v -i (the answer's status line too) over https://NAME:PORT/ with NAME resolved to
// 127.0.0.1: SNI is NAME; curl offers ALPN h2 and http/1.1 itself.
ClientRun curlGet(const Tools& tools, uint16_t port, const std::string& name) {
    std::string p = std::to_string(port);
    ClientRun run;
    run.what = "curl, sni \"" + name + "\"";
    run.result = runCommand({tools.curl, "-sS", "-k", "-v", "-i", "--max-time", "20", "--resolve",
                             name + ":" + p + ":127.0.0.1", "https://" + name + ":" + p + "/"},
                            kTool);
    static const std::regex kSubject(R"(subject: CN=([^\s,/]+))");
    run.cn = reportedCn(run.result.err, kSubject);
    return run;
}

// kPythonClient (`script`) with `more` arguments (--mode, --big, --proxy-v1...).
ClientRun python(const Tools& tools, const std::string& script, uint16_t port, const Offer& offer,
                 const std::string& cafile, const std::vector<std::string>& more = {}) {
    std::vector<std::string> argv = {tools.python, script, "--port", std::to_string(port)};
    if (offer.sni) argv.insert(argv.end(), {"--sni", *offer.sni});
    if (!offer.alpn.empty()) argv.insert(argv.end(), {"--alpn", offer.alpn});
    if (!cafile.empty()) argv.insert(argv.end(), {"--cafile", cafile});
    argv.insert(argv.end(), more.begin(), more.end());
    ClientRun run;
    run.what = "python ssl, " + describe(offer);
    for (const auto& m : more) run.what += " " + m;
    run.result = runCommand(argv, kTool);
    static const std::regex kSubject(R"(subject=CN = ([^\s,/]+))");
    run.cn = reportedCn(run.result.out, kSubject);
    return run;
}

// The client finished its handshake with `backend` (the certificate it reports is that
// backend's; s_client and Python also verified it against the backends' certificates) and that
// backend's HTTP answer, a status page naming its own certificate file, came back through the
// relay.
void expectLanded(const ClientRun& run, const TlsBackend& backend) {
    EXPECT_EQ(run.cn, backend.cn())
        << "the client should have reached backend " << backend.cn() << "\n"
        << run.transcript();
    const std::string& out = run.result.out;
    EXPECT_NE(out.find("HTTP/1.0 200 ok"), std::string::npos)
        << "no HTTP answer came back through the relay\n"
        << run.transcript();
    EXPECT_NE(out.find(backend.certPath()), std::string::npos)
        << "the answer is not the status page of s_server " << backend.cn() << "\n"
        << run.transcript();
}

// A TLS client the relay closes: no certificate, no answer.
void expectRefused(const ClientRun& run) {
    EXPECT_EQ(run.cn, "") << "the client reached a backend\n" << run.transcript();
    EXPECT_EQ(run.result.out.find("HTTP/1.0 200 ok"), std::string::npos) << run.transcript();
    EXPECT_FALSE(run.result.status.timed_out) << run.transcript();
}

// =============================================================================================
// Real ClientHellos, captured once per test binary: a loopback listener of the test's own reads
// what a real client sends first, until its first handshake message is complete, and closes,
// which ends that client's handshake.

struct HelloSpec {
    std::string key;
    std::string client;  // "s_client", "python" or "curl"
    Offer offer;
    int big = 0;  // python: long ALPN names before offer.alpn
};

class HelloBank {
  public:
    // The records carrying the hello of `spec`, byte for byte as its client wrote them.
    static std::optional<std::string> get(const Tools& tools, const HelloSpec& spec,
                                          std::string& error) {
        static std::mutex mu;
        static std::map<std::string, std::string> bank;
        static TempDir dir;
        std::lock_guard lock(mu);
        if (auto it = bank.find(spec.key); it != bank.end()) return it->second;

        auto got = std::make_shared<std::string>();
        ScriptedUpstream listener(AF_INET, [got](Fd& fd, ConnRecord& rec,
                                                 const std::atomic<bool>& stop, ScriptedUpstream&) {
            char buf[16384];
            for (int i = 0; i < 10'000 && helloExtent(*got) == 0; ++i) {
                IoResult r = readSome(fd.get(), buf, sizeof buf, Millis{10'000}, &stop);
                if (!r.ok()) break;
                got->append(buf, r.bytes);
            }
            rec.bytes_received = got->size();
        });
        if (!listener.ok()) {
            error = listener.error();
            return std::nullopt;
        }
        uint16_t port = listener.port();
        ClientRun run;
        if (spec.client == "s_client") {
            run = sClient(tools, port, spec.offer, "");
        } else if (spec.client == "python") {
            std::string script = dir.writeFile("client.py", kPythonClient);
            std::vector<std::string> more;
            if (spec.big > 0) more = {"--big", std::to_string(spec.big)};
            run = python(tools, script, port, spec.offer, "", more);
        } else {
            run = curlGet(tools, port, spec.offer.sni.value_or("localhost"));
        }
        if (!listener.waitForRecord(0, kIo)) {
            error = "no hello captured from " + run.transcript();
            return std::nullopt;
        }
        size_t extent = helloExtent(*got);
        if (extent == 0 || extent == kNotHandshake) {
            error = "not a complete hello: " + hex(*got) + " from " + run.transcript();
            return std::nullopt;
        }
        HelloFields f = parseHello(handshakeMessage(got->substr(0, extent)));
        if (!f.parsed || f.sni != spec.offer.sni) {
            error = spec.key + ": the captured hello does not carry the server name asked for (" +
                    f.sni.value_or("<none>") + "): " + hex(*got);
            return std::nullopt;
        }
        return bank[spec.key] = got->substr(0, extent);
    }
};

// =============================================================================================
// Relay configuration.

std::string clustersYaml(const ClusterAddrs& a, const std::string& send_proxy = "") {
    std::string y = "clusters:\n";
    for (const auto& [name, addr] :
         {std::pair{"api", a.api}, std::pair{"apps", a.apps}, std::pair{"fallback", a.fallback}}) {
        y += std::string("  - name: ") + name + "\n";
        if (!send_proxy.empty()) y += "    send_proxy: " + send_proxy + "\n";
        y += "    backends: [{address: \"" + addr + "\"}]\n";
    }
    return y;
}

// The conditional routes every case uses, in this order: an exact name; a wildcard with an
// ALPN condition; ALPN alone. First match wins.
const std::string kConditionalRoutes =
    "    routes:\n"
    "      - {sni: [api.example.test], cluster: api}\n"
    "      - {name: apps, sni: [\"*.apps.example.test\"], alpn: [h2, http/1.1], cluster: apps}\n"
    "      - {name: acme, alpn: [acme-tls/1], cluster: apps}\n";
const std::string kRoutes = kConditionalRoutes + "      - {cluster: fallback}\n";

// Listener `name` routing by the ClientHello: `routes` then `more` (keys, 4 spaces in).
ListenerSpec routedListener(const std::string& name, const std::string& mode,
                            const std::string& routes = kRoutes, const std::string& more = "") {
    ListenerSpec l;
    l.name = name;
    l.mode = mode;
    l.omit_target = true;
    l.extra_yaml = routes + more;
    return l;
}

RelayConfig routedConfig(const ClusterAddrs& to, std::vector<ListenerSpec> listeners,
                         const std::string& send_proxy = "") {
    RelayConfig c;
    c.extra_yaml = clustersYaml(to, send_proxy);
    c.listeners = std::move(listeners);
    return c;
}

// =============================================================================================
// The fixture: the relay, and what its counters must say.

class SniFixture {
  protected:
    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE.
    void startRelay(const RelayConfig& config) {
        ASSERT_TRUE(relay_.start(config)) << relay_.diagnostics();
        for (const ListenerSpec& l : config.listeners)
            EXPECT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath(l.mode, l.name)), 1.0)
                << "listener " << l.name << " should run the " << l.mode << " data path";
    }

    // Each TLS backend started with `style`, and the CA file that holds all their certificates.
    void startTlsBackends(const std::string& style) {
        ASSERT_TRUE(api_.start(tools_, dir_, "api", style));
        ASSERT_TRUE(apps_.start(tools_, dir_, "apps", style));
        ASSERT_TRUE(fallback_.start(tools_, dir_, "fallback", style));
        std::string all;
        for (const char* cn : {"api", "apps", "fallback"})
            all += readFileText(dir_.file(std::string(cn) + ".crt"));
        cafile_ = dir_.writeFile("backends.crt", all);
        script_ = dir_.writeFile("client.py", kPythonClient);
        get_ = dir_.writeFile("get.txt", "GET / HTTP/1.0\r\n\r\n");
    }
    ClusterAddrs tlsAddrs() const {
        return {api_.hostPort(), apps_.hostPort(), fallback_.hostPort()};
    }
    const TlsBackend& tlsBackend(const std::string& cn) const {
        return cn == "api" ? api_ : cn == "apps" ? apps_ : fallback_;
    }

    // One more connection on listener `l` routed by `route`, or failing inspection for
    // `failure`, or both ("" for none). Then waits until the relay's counters say so.
    void count(const std::string& route, const std::string& failure, const std::string& l = "t") {
        if (!route.empty()) routes_[{l, route}] += 1;
        if (!failure.empty()) failures_[{l, failure}] += 1;
        expectCounters();
    }
    // Every counted route and failure has its value; failure reasons never counted are absent
    // or zero.
    void expectCounters() {
        for (const auto& [key, n] : routes_)
            EXPECT_TRUE(
                relay_.waitForMetric(kRouteSelections, routeLabels(key.second, key.first), n))
                << relay_.diagnostics();
        std::set<std::string> listeners;
        for (const auto& [key, n] : routes_) listeners.insert(key.first);
        for (const auto& [key, n] : failures_) listeners.insert(key.first);
        for (const std::string& l : listeners) {
            for (const std::string& reason : kInspectReasons) {
                auto it = failures_.find({l, reason});
                if (it != failures_.end()) {
                    EXPECT_TRUE(relay_.waitForMetric(kInspectFailures, metric::reason(reason, l),
                                                     it->second))
                        << relay_.diagnostics();
                } else {
                    EXPECT_EQ(
                        relay_.metric(kInspectFailures, metric::reason(reason, l)).value_or(0), 0)
                        << "listener " << l << ": no inspection failed for " << reason;
                }
            }
        }
    }
    double routed(const std::string& l = "t") const {
        double n = 0;
        for (const auto& [key, v] : routes_)
            if (key.first == l) n += v;
        return n;
    }

    Tools tools_;
    TempDir dir_;
    TlsBackend api_, apps_, fallback_;
    std::string cafile_, script_, get_;
    RelayProcess relay_;
    std::map<std::pair<std::string, std::string>, double> routes_, failures_;
};

// =============================================================================================
// 1. Real clients, real servers: each name lands on its backend, the handshake completes end
// to end.

class TlsRoutingTest : public SniFixture, public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        SKIP_WITHOUT_TOOLS(tools_, true, true);
        ASSERT_NO_FATAL_FAILURE(startTlsBackends("-www"));
        ASSERT_NO_FATAL_FAILURE(
            startRelay(routedConfig(tlsAddrs(), {routedListener("t", GetParam())})));
    }
};

TEST_P(TlsRoutingTest, RealClientsLandOnTheirBackend) {
    uint16_t port = relay_.port("t");
    struct Step {
        std::function<ClientRun()> run;
        std::string backend, route, failure;
    };
    const Offer api{"api.example.test", ""};
    std::vector<Step> steps = {
        {[&] { return sClient(tools_, port, api, cafile_, get_); }, "api", "api", ""},
        {[&] {
             return sClient(tools_, port, {"a.apps.example.test", "h2,http/1.1"}, cafile_, get_);
         },
         "apps", "apps", ""},
        {[&] { return curlGet(tools_, port, "api.example.test"); }, "api", "api", ""},
        // curl offers h2 and http/1.1 itself: the wildcard route's ALPN condition holds.
        {[&] { return curlGet(tools_, port, "x.apps.example.test"); }, "apps", "apps", ""},
        {[&] { return curlGet(tools_, port, "www.example.test"); }, "fallback", "fallback",
         "no_route"},
        {[&] { return python(tools_, script_, port, api, cafile_); }, "api", "api", ""},
        {[&] {
             return python(tools_, script_, port, {"y.apps.example.test", "http/1.1"}, cafile_);
         },
         "apps", "apps", ""},
        {[&] {
             return python(tools_, script_, port, {"y.apps.example.test", ""}, cafile_);
         },
         "fallback", "fallback", "no_route"},
        {[&] {
             return python(tools_, script_, port, {std::nullopt, "h2"}, cafile_);
         },
         "fallback", "fallback", "no_sni"},
    };
    for (size_t i = 0; i < steps.size(); ++i) {
        ClientRun run = steps[i].run();
        SCOPED_TRACE(run.what);
        expectLanded(run, tlsBackend(steps[i].backend));
        count(steps[i].route, steps[i].failure);
    }
    // Every connection was inspected once: the histogram has one observation each.
    double n = static_cast<double>(steps.size());
    EXPECT_TRUE(
        relay_.waitForMetric(std::string(kInspectSeconds) + "_count", metric::listener(), n));
    EXPECT_TRUE(relay_.waitForMetric(std::string(kInspectSeconds) + "_bucket",
                                     {{"listener", "t"}, {"le", "+Inf"}}, n));
    EXPECT_TRUE(relay_.metric(std::string(kInspectSeconds) + "_sum", metric::listener()))
        << "no " << kInspectSeconds << "_sum";
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), n))
        << relay_.diagnostics();
}

struct NameCase {
    Offer offer;
    std::string backend, route, failure;
};

// The matching rules, one s_client each, against the routes of kRoutes.
std::vector<NameCase> nameCases() {
    return {
        {{"api.example.test", ""}, "api", "api", ""},
        {{"API.Example.Test", ""}, "api", "api", ""},     // names compare case-insensitively
        {{"api.example.test.", ""}, "api", "api", ""},    // the client's trailing dot is ignored
        {{"Api.EXAMPLE.test.", "h2"}, "api", "api", ""},  // both at once
        {{"api.example.test.evil", ""}, "fallback", "fallback", "no_route"},
        {{"evilapi.example.test", ""}, "fallback", "fallback", "no_route"},
        {{"a.apps.example.test", "h2"}, "apps", "apps", ""},
        {{"A.APPS.Example.Test", "http/1.1"}, "apps", "apps", ""},
        {{"a.apps.example.test.", "h2"}, "apps", "apps", ""},
        {{"a.apps.example.test", "http/1.0,h2"}, "apps", "apps", ""},  // any offered one
        {{"a.apps.example.test", "http/1.0"}, "fallback", "fallback", "no_route"},
        {{"a.apps.example.test", ""}, "fallback", "fallback", "no_route"},
        {{"a.b.apps.example.test", "h2"}, "fallback", "fallback", "no_route"},  // one label only
        {{"apps.example.test", "h2"}, "fallback", "fallback", "no_route"},      // ... not zero
        {{"xapps.example.test", "h2"}, "fallback", "fallback", "no_route"},
        // ALPN alone: any name, or none.
        {{"whatever.example.test", "acme-tls/1"}, "apps", "acme", ""},
        {{std::nullopt, "acme-tls/1"}, "apps", "acme", ""},
        // First match wins: the wildcard route's ALPN does not hold, ALPN alone does; the exact
        // route comes before ALPN alone.
        {{"a.apps.example.test", "acme-tls/1"}, "apps", "acme", ""},
        {{"api.example.test", "acme-tls/1"}, "api", "api", ""},
        {{std::nullopt, ""}, "fallback", "fallback", "no_sni"},
        {{std::nullopt, "h2"}, "fallback", "fallback", "no_sni"},
    };
}

TEST_P(TlsRoutingTest, NameMatchingRules) {
    for (const NameCase& c : nameCases()) {
        ClientRun run = sClient(tools_, relay_.port("t"), c.offer, cafile_, get_);
        SCOPED_TRACE(run.what);
        expectLanded(run, tlsBackend(c.backend));
        count(c.route, c.failure);
    }
}

INSTANTIATE_TEST_SUITE_P(Modes, TlsRoutingTest, ::testing::ValuesIn(kHandOffModes), modeName);

// The clients really sent what the cases say: the names byte for byte as given (case, trailing
// dot), the protocols in order. Otherwise a case above could pass for the wrong reason.
TEST(SniClientPremiseTest, ClientsSendTheNamesAsGiven) {
    Tools tools;
    SKIP_WITHOUT_TOOLS(tools, true, true);
    struct Want {
        HelloSpec spec;
        std::vector<std::string> alpn;
    };
    std::vector<Want> wants = {
        {{"premise_upper_dot", "s_client", {"Api.EXAMPLE.test.", "h2"}}, {"h2"}},
        {{"premise_alpn_order", "s_client", {"a.apps.example.test", "http/1.0,h2"}},
         {"http/1.0", "h2"}},
        {{"premise_python", "python", {"y.apps.example.test", "http/1.1"}}, {"http/1.1"}},
        {{"premise_curl", "curl", {"x.apps.example.test", ""}}, {"h2", "http/1.1"}},
        {{"premise_nosni", "s_client", {std::nullopt, "h2"}}, {"h2"}},
    };
    for (const Want& w : wants) {
        SCOPED_TRACE(w.spec.key);
        std::string error;
        std::optional<std::string> hello = HelloBank::get(tools, w.spec, error);
        ASSERT_TRUE(hello) << error;
        HelloFields f = parseHello(handshakeMessage(*hello));
        ASSERT_TRUE(f.parsed) << hex(*hello);
        EXPECT_EQ(f.sni, w.spec.offer.sni);
        EXPECT_EQ(f.alpn, w.alpn);
    }
}

// =============================================================================================
// 2. Inspections that fail: the default route takes them with the bytes unchanged; without one
// they are closed, as no_route.

struct RawCase {
    std::string name;
    std::function<std::optional<std::string>(const Tools&, std::string&)> bytes;
    std::string reason;  // zcrelay_inspect_failures_total{reason}
};

std::optional<std::string> bankHello(const Tools& tools, const HelloSpec& spec,
                                     std::string& error) {
    return HelloBank::get(tools, spec, error);
}

std::vector<RawCase> rawCases() {
    auto fixed = [](std::string s) {
        return [s](const Tools&, std::string&) -> std::optional<std::string> { return s; };
    };
    // A record announcing 16 KiB of a ClientHello of 16380 bytes, and 1200 bytes of it: more than
    // inspect_max_size (1 KiB here) before the hello could be complete.
    std::string too_large =
        std::string("\x16\x03\x01\x40\x00\x01\x00\x3f\xfc\x03\x03", 11) + std::string(1200, '\x5a');
    // A valid record header, then bytes that are no handshake message at all.
    std::string garbage = std::string("\x16\x03\x01\x00\x20", 5) + std::string(32, '\xee');
    // A complete ClientHello record whose session id claims 255 bytes of the 7 that follow.
    std::string bad_session = std::string("\x16\x03\x01\x00\x2e\x01\x00\x00\x2a\x03\x03", 11) +
                              std::string(32, '\x11') + std::string("\xff", 1) +
                              std::string(7, '\x22');
    return {
        {"plain_http", fixed("GET / HTTP/1.0\r\n\r\n"), "not_tls"},
        {"ssh_banner", fixed("SSH-2.0-OpenSSH_9.2\r\n"), "not_tls"},
        {"too_large", fixed(too_large), "too_large"},
        {"garbage_after_header", fixed(garbage), "malformed"},
        {"session_id_overrun", fixed(bad_session), "malformed"},
        {"no_sni",
         [](const Tools& t, std::string& e) {
             return bankHello(t, {"nosni", "s_client", {std::nullopt, ""}}, e);
         },
         "no_sni"},
        {"no_route",
         [](const Tools& t, std::string& e) {
             return bankHello(t, {"other", "s_client", {"other.example.test", "h2"}}, e);
         },
         "no_route"},
    };
}

class InspectFailureTest : public SniFixture, public ::testing::TestWithParam<std::string> {
  protected:
    // Listener t has the default route, listener n has none; both take at most 1 KiB of hello
    // and wait for it at most 1 s.
    void SetUp() override {
        SKIP_WITHOUT_TOOLS(tools_, false, false);
        std::string error;
        ASSERT_TRUE(caps_.ok(error)) << error;
        const std::string limits = "    inspect_timeout: 1s\n    inspect_max_size: 1KiB\n";
        ASSERT_NO_FATAL_FAILURE(startRelay(routedConfig(
            caps_.addrs(), {routedListener("t", GetParam(), kRoutes, limits),
                            routedListener("n", GetParam(), kConditionalRoutes, limits)})));
    }
    CaptureSet caps_;
};

TEST_P(InspectFailureTest, FailedInspectionsTakeTheDefaultRoute) {
    for (const RawCase& c : rawCases()) {
        SCOPED_TRACE(c.name);
        std::string error;
        std::optional<std::string> bytes = c.bytes(tools_, error);
        ASSERT_TRUE(bytes) << error;
        Landing l = caps_.through(relay_.port("t"), {*bytes}, kSecondFlight);
        EXPECT_EQ(l.note, "");
        EXPECT_EQ(l.backend, "fallback") << l.note;
        ASSERT_TRUE(l.bytes) << l.note;
        const std::string sent = *bytes + kSecondFlight;
        EXPECT_EQ(*l.bytes, sent) << "the default backend must get the client's bytes unchanged; "
                                  << firstDifference(*l.bytes, sent);
        count("fallback", c.reason);
    }
    EXPECT_EQ(caps_.api.accepted() + caps_.apps.accepted(), 0u);
    EXPECT_TRUE(relay_.waitForMetric(std::string(kInspectSeconds) + "_count", metric::listener(),
                                     routed()));
}

TEST_P(InspectFailureTest, FailedInspectionsWithoutDefaultAreClosed) {
    double closed = 0;
    for (const RawCase& c : rawCases()) {
        SCOPED_TRACE(c.name);
        std::string error;
        std::optional<std::string> bytes = c.bytes(tools_, error);
        ASSERT_TRUE(bytes) << error;
        expectClosedWithoutBackend(relay_.port("n"), *bytes);
        count("", c.reason, "n");
        EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason(kNoRouteClose, "n"),
                                         ++closed))
            << relay_.diagnostics();
    }
    EXPECT_EQ(caps_.total(), 0u) << "a connection without a route never reaches a backend";
    EXPECT_EQ(relay_.metric(kRouteSelections, metric::listener("n")).value_or(0), 0);
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener("n"), 0));
}

// inspect_timeout 1s: a client that sends nothing, or half a hello, is inspected for that long
// and no less; then the default route takes it (and the bytes it sends from then on, or had sent
// already), or, on n, it is closed.
TEST_P(InspectFailureTest, SilentClientsTimeOut) {
    std::string error;
    std::optional<std::string> hello =
        HelloBank::get(tools_, {"api_h2", "s_client", {"api.example.test", "h2,http/1.1"}}, error);
    ASSERT_TRUE(hello) << error;
    const std::string half = hello->substr(0, 100);

    Connected silent = connectTo("127.0.0.1", relay_.port("t"));
    Connected partial = connectTo("127.0.0.1", relay_.port("t"));
    Connected unrouted = connectTo("127.0.0.1", relay_.port("n"));
    ASSERT_TRUE(silent.fd && partial.fd && unrouted.fd);
    ASSERT_TRUE(writeAll(partial.fd.get(), half.data(), half.size(), kIo).ok());

    std::this_thread::sleep_for(kNotYet);
    EXPECT_EQ(relay_.metric(kInspectFailures, metric::reason("timeout")).value_or(0), 0)
        << "timed out before inspect_timeout";
    EXPECT_EQ(caps_.total(), 0u) << "routed before the inspection ended";

    failures_[{"t", "timeout"}] = 2;
    failures_[{"n", "timeout"}] = 1;
    routes_[{"t", "fallback"}] = 2;
    expectCounters();

    // Both t clients are on the default backend now: the greeting comes, then their bytes go.
    for (Connected* c : {&silent, &partial}) {
        char g = 0;
        IoResult r = readExactly(c->fd.get(), &g, 1, kIo);
        EXPECT_TRUE(r.ok() && g == kGreeting) << r.describe();
    }
    const std::string late = "late bytes\n";
    const std::string rest = hello->substr(half.size());
    ASSERT_TRUE(writeAll(silent.fd.get(), late.data(), late.size(), kIo).ok());
    ASSERT_TRUE(writeAll(partial.fd.get(), rest.data(), rest.size(), kIo).ok());
    ::shutdown(silent.fd.get(), SHUT_WR);
    ::shutdown(partial.fd.get(), SHUT_WR);
    ASSERT_EQ(caps_.fallback.accepted(), 2u);
    std::optional<std::string> a = caps_.fallback.bytes(0), b = caps_.fallback.bytes(1);
    ASSERT_TRUE(a && b);
    std::multiset<std::string> got = {*a, *b}, want = {late, *hello};
    EXPECT_EQ(got, want) << "the default backend gets what each client sent, unchanged";
    EXPECT_EQ(caps_.api.accepted(), 0u) << "a hello completed after the timeout is not inspected";

    IoResult end = waitForPeerClose(unrouted.fd.get(), kIo);
    EXPECT_TRUE(endedByPeer(end)) << end.describe();
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason(kNoRouteClose, "n"), 1));
    // Each timed-out inspection lasted at least the timeout: a floor, never a ceiling.
    std::optional<double> sum =
        relay_.metric(std::string(kInspectSeconds) + "_sum", metric::listener());
    EXPECT_GE(sum.value_or(0), 2 * 0.9) << "two inspections of at least inspect_timeout (1s) each";
}

INSTANTIATE_TEST_SUITE_P(Modes, InspectFailureTest, ::testing::ValuesIn(kHandOffModes), modeName);

// =============================================================================================
// 3. Real hellos in pieces: split into two segments at every byte, and re-framed into several
// TLS records. Each lands on the backend of its name with the client's bytes, byte-exact.

class SplitHelloTest : public SniFixture, public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        SKIP_WITHOUT_TOOLS(tools_, false, false);
        std::string error;
        ASSERT_TRUE(caps_.ok(error)) << error;
        ASSERT_NO_FATAL_FAILURE(
            startRelay(routedConfig(caps_.addrs(), {routedListener("t", GetParam())})));
        api_hello_ = HelloBank::get(
            tools_, {"api_h2", "s_client", {"api.example.test", "h2,http/1.1"}}, error);
        ASSERT_TRUE(api_hello_) << error;
        apps_hello_ =
            HelloBank::get(tools_, {"apps_h2", "s_client", {"a.apps.example.test", "h2"}}, error);
        ASSERT_TRUE(apps_hello_) << error;
    }

    // `parts` (their concatenation is what the backend must get) lands on `backend`.
    void expectLandsExact(const std::vector<std::string>& parts, const std::string& backend,
                          const std::string& what, const std::string& after = "") {
        std::string sent;
        for (const auto& p : parts) sent += p;
        sent += after;
        Landing l = caps_.through(relay_.port("t"), parts, after);
        EXPECT_EQ(l.note, "") << what;
        EXPECT_EQ(l.backend, backend) << what << ": " << l.note;
        if (l.bytes) {
            EXPECT_EQ(*l.bytes, sent) << what << ": " << firstDifference(*l.bytes, sent);
        } else {
            ADD_FAILURE() << what << ": no bytes reached a backend; " << l.note;
        }
        routes_[{"t", backend}] += 1;
    }

    CaptureSet caps_;
    std::optional<std::string> api_hello_, apps_hello_;
};

TEST_P(SplitHelloTest, EverySplitPointLandsByteExact) {
    const std::string& api = *api_hello_;
    size_t n = 0;
    for (size_t k = 1; k < api.size(); ++k) {
        expectLandsExact({api.substr(0, k), api.substr(k)}, "api", "split at " + std::to_string(k));
        ++n;
        if (HasFailure()) break;  // one broken point says it; 500 would drown it
    }
    const std::string& apps = *apps_hello_;
    for (size_t k : {size_t{1}, size_t{5}, size_t{9}, apps.size() / 2, apps.size() - 1}) {
        expectLandsExact({apps.substr(0, k), apps.substr(k)}, "apps",
                         "apps split at " + std::to_string(k));
        ++n;
    }
    std::printf("[ INFO     ] %zu connections, hello of %zu bytes\n", n, api.size());
    expectCounters();
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), routed()))
        << relay_.diagnostics();
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
}
ZCRELAY_LABEL(SplitHelloTest, EverySplitPointLandsByteExact, "", kSanitizeSkip,
              "344 connections of the wait the record-split cases run");

TEST_P(SplitHelloTest, SeveralRecordsLandByteExact) {
    const std::string api = handshakeMessage(*api_hello_);
    HelloFields f = parseHello(api);
    ASSERT_TRUE(f.parsed && f.sni) << hex(api);
    struct Framing {
        std::string what;
        std::string bytes;
    };
    std::vector<Framing> framings = {
        {"a 1-byte first record", frame(api, {1})},
        {"the handshake header alone", frame(api, {4})},
        {"a record boundary inside the server name", frame(api, {f.sni_at + 2})},
        {"the server name's extension header cut", frame(api, {f.sni_at - 7})},
        {"64-byte records", frameEvery(api, 64)},
        {"1-byte records", frameEvery(api, 1)},
    };
    for (const Framing& fr : framings) {
        ASSERT_EQ(helloExtent(fr.bytes), fr.bytes.size()) << fr.what;
        ASSERT_EQ(handshakeMessage(fr.bytes), api) << fr.what;
        expectLandsExact({fr.bytes}, "api", fr.what, kSecondFlight);
    }
    // Each 64-byte record its own segment; and a segment boundary inside a record header.
    std::string framed = frameEvery(api, 64);
    expectLandsExact(recordsOf(framed), "api", "64-byte records, one segment each");
    expectLandsExact({framed.substr(0, 5 + 64 + 3), framed.substr(5 + 64 + 3)}, "api",
                     "a segment boundary inside the second record's header");
    const std::string apps = handshakeMessage(*apps_hello_);
    expectLandsExact({frameEvery(apps, 100)}, "apps", "the wildcard hello in 100-byte records");
    expectCounters();
}

INSTANTIATE_TEST_SUITE_P(Modes, SplitHelloTest, ::testing::ValuesIn(kHandOffModes), modeName);

// =============================================================================================
// 4. A large real ClientHello: Python with a long ALPN list, over 16 KiB, so OpenSSL writes it in
// two records. It routes by its name, and by an ALPN protocol in its second record.

class LargeHelloTest : public SniFixture, public ::testing::TestWithParam<std::string> {};

TEST_P(LargeHelloTest, RoutesByNameAndLateAlpn) {
    SKIP_WITHOUT_TOOLS(tools_, false, true);
    constexpr int kBig = 100;  // 100 names of 205 bytes: about 20 KiB of ALPN
    std::string error;
    std::optional<std::string> big = HelloBank::get(
        tools_, {"py_big_apps", "python", {"q.apps.example.test", "http/1.1"}, kBig}, error);
    ASSERT_TRUE(big) << error;
    ASSERT_GE(recordsOf(*big).size(), 2u) << "premise: the hello spans several records";
    ASSERT_GT(big->size(), size_t{16 * 1024});
    HelloFields f = parseHello(handshakeMessage(*big));
    ASSERT_TRUE(f.parsed);
    ASSERT_EQ(f.alpn.size(), size_t{kBig + 1});
    ASSERT_EQ(f.alpn.back(), "http/1.1");

    ASSERT_NO_FATAL_FAILURE(startTlsBackends("-www"));
    // t takes up to 64 KiB of hello; d keeps the default 16 KiB, which this hello exceeds.
    ASSERT_NO_FATAL_FAILURE(startRelay(routedConfig(
        tlsAddrs(), {routedListener("t", GetParam(), kRoutes, "    inspect_max_size: 64KiB\n"),
                     routedListener("d", GetParam())})));
    const std::vector<std::string> more = {"--big", std::to_string(kBig)};
    ClientRun a =
        python(tools_, script_, relay_.port("t"), {"api.example.test", ""}, cafile_, more);
    expectLanded(a, api_);
    count("api", "");
    ClientRun b = python(tools_, script_, relay_.port("t"), {"q.apps.example.test", "http/1.1"},
                         cafile_, more);
    expectLanded(b, apps_);
    count("apps", "");
    // Too large for d: the default route takes it, and the handshake still completes, with the
    // fallback server, because the bytes went on unchanged.
    ClientRun c =
        python(tools_, script_, relay_.port("d"), {"api.example.test", ""}, cafile_, more);
    expectLanded(c, fallback_);
    count("fallback", "too_large", "d");
}

INSTANTIATE_TEST_SUITE_P(Modes, LargeHelloTest, ::testing::ValuesIn(kHandOffModes), modeName);

// =============================================================================================
// 5. PROXY headers: accept_proxy (the header first, then the hello) and send_proxy (the relay's
// header, then the client's bytes unchanged).

struct ProxyCase {
    std::string mode;
    std::string version;  // the client's header and the cluster's send_proxy: "v1" | "v2"
};

void PrintTo(const ProxyCase& c, std::ostream* os) { *os << c.mode << "/" << c.version; }

std::vector<ProxyCase> proxyCases() {
    std::vector<ProxyCase> cases;
    for (const auto& m : kHandOffModes)
        for (const char* v : {"v1", "v2"}) cases.push_back({m, v});
    return cases;
}

class ProxyHeaderTest : public SniFixture, public ::testing::TestWithParam<ProxyCase> {};

TEST_P(ProxyHeaderTest, HeaderThenHelloRoutedUnchanged) {
    const ProxyCase& c = GetParam();
    SKIP_WITHOUT_TOOLS(tools_, false, false);
    CaptureSet caps;
    std::string error;
    ASSERT_TRUE(caps.ok(error)) << error;
    ASSERT_NO_FATAL_FAILURE(startRelay(routedConfig(
        caps.addrs(), {routedListener("t", c.mode, kRoutes, "    accept_proxy: true\n")},
        c.version)));
    std::optional<std::string> api =
        HelloBank::get(tools_, {"api_h2", "s_client", {"api.example.test", "h2,http/1.1"}}, error);
    ASSERT_TRUE(api) << error;
    std::optional<std::string> apps =
        HelloBank::get(tools_, {"apps_h2", "s_client", {"a.apps.example.test", "h2"}}, error);
    ASSERT_TRUE(apps) << error;
    std::optional<std::string> nosni =
        HelloBank::get(tools_, {"nosni", "s_client", {std::nullopt, ""}}, error);
    ASSERT_TRUE(nosni) << error;

    // The client's header and the one the relay must send for it: the same addresses (the
    // relay's is its own, built from what it read; for v2 without TLVs, as the client's).
    const std::string header = c.version == "v1" ? kProxyV1 : proxyV2();
    struct Step {
        std::string what;
        std::vector<std::string> parts;  // after the header
        bool header_apart;               // the header in a segment of its own
        std::string backend, failure;
    };
    std::vector<Step> steps = {
        {"header and hello in one write", {*api}, false, "api", ""},
        {"header, then the hello in two segments",
         {apps->substr(0, 50), apps->substr(50)},
         true,
         "apps",
         ""},
        {"header, then a hello without a name", {*nosni}, true, "fallback", "no_sni"},
    };
    for (const Step& s : steps) {
        SCOPED_TRACE(s.what);
        std::vector<std::string> parts = s.parts;
        std::string hello;
        for (const auto& p : s.parts) hello += p;
        if (s.header_apart)
            parts.insert(parts.begin(), header);
        else
            parts[0] = header + parts[0];
        hello += kSecondFlight;
        Landing l = caps.through(relay_.port("t"), parts, kSecondFlight);
        EXPECT_EQ(l.note, "") << "sockmap counters: " << sockmapCounters(relay_);
        EXPECT_EQ(l.backend, s.backend) << l.note;
        ASSERT_TRUE(l.bytes) << l.note;
        EXPECT_EQ(hex(l.bytes->substr(0, header.size())), hex(header))
            << "the backend's first bytes must be the relay's " << c.version << " header";
        EXPECT_EQ(l.bytes->substr(std::min(header.size(), l.bytes->size())), hello)
            << "after the header, the client's hello and what followed, unchanged; "
            << firstDifference(l.bytes->substr(std::min(header.size(), l.bytes->size())), hello);
        count(s.backend, s.failure);
    }
}

INSTANTIATE_TEST_SUITE_P(Modes, ProxyHeaderTest, ::testing::ValuesIn(proxyCases()),
                         [](const auto& info) {
                             return info.param.mode + "_" + info.param.version;
                         });

// A real TLS client behind a PROXY v1 line (Python writes it, then does its handshake on the same
// socket): routed by its hello, the handshake completes with the right server.
class ProxyTlsTest : public SniFixture, public ::testing::TestWithParam<std::string> {};

TEST_P(ProxyTlsTest, RealTlsClientBehindProxyHeader) {
    SKIP_WITHOUT_TOOLS(tools_, false, true);
    ASSERT_NO_FATAL_FAILURE(startTlsBackends("-www"));
    ASSERT_NO_FATAL_FAILURE(startRelay(routedConfig(
        tlsAddrs(), {routedListener("t", GetParam(), kRoutes, "    accept_proxy: true\n")})));
    const std::vector<std::string> header = {"--proxy-v1",
                                             "TCP4 192.0.2.10 198.51.100.20 40000 443"};
    expectLanded(python(tools_, script_, relay_.port(), {"api.example.test", ""}, cafile_, header),
                 api_);
    count("api", "");
    expectLanded(
        python(tools_, script_, relay_.port(), {"z.apps.example.test", "h2"}, cafile_, header),
        apps_);
    count("apps", "");
    expectLanded(python(tools_, script_, relay_.port(), {"nope.example.test", ""}, cafile_, header),
                 fallback_);
    count("fallback", "no_route");
    if (HasFailure())
        std::printf("[ INFO     ] sockmap counters: %s\n", sockmapCounters(relay_).c_str());
}

INSTANTIATE_TEST_SUITE_P(Modes, ProxyTlsTest, ::testing::ValuesIn(kHandOffModes), modeName);

// =============================================================================================
// 6. HAProxy cross-check: the same hellos through HAProxy 2.6 (req.ssl_sni content switching)
// and through zcrelay with the same routes, each to capture backends of its own.

// haproxy with one tcp frontend on a loopback port routing like kRoutes
// (tests/support/haproxy.hpp).
class HaproxyRouter {
  public:
    explicit HaproxyRouter(std::string binary) : process_(std::move(binary)) {}

    ::testing::AssertionResult start(const ClusterAddrs& to) {
        // The frontend waits for a whole ClientHello, as zcrelay does; its buffer, like
        // zcrelay's inspect_max_size here, holds 64 KiB. The ACLs say what kRoutes says:
        // -i for case; a regex for "exactly one label"; ALPN alone.
        return process_.start(AF_INET, [&](const std::string& bind) {
            return haproxyTcpPreamble("    tune.bufsize 65536\n") +
                   "frontend fe\n"
                   "    bind " +
                   bind +
                   "\n"
                   "    tcp-request inspect-delay 5s\n"
                   "    tcp-request content accept if { req.ssl_hello_type 1 }\n"
                   "    use_backend api if { req.ssl_sni -i api.example.test }\n"
                   "    use_backend apps if { req.ssl_sni -m reg -i "
                   "^[^.]+\\.apps\\.example\\.test$ } { req.ssl_alpn h2 http/1.1 }\n"
                   "    use_backend apps if { req.ssl_alpn acme-tls/1 }\n"
                   "    default_backend fallback\n"
                   "backend api\n    server s1 " +
                   to.api +
                   "\n"
                   "backend apps\n    server s1 " +
                   to.apps +
                   "\n"
                   "backend fallback\n    server s1 " +
                   to.fallback + "\n";
        });
    }
    void stop() { process_.stop(); }
    uint16_t port() const { return process_.port(); }

  private:
    HaproxyProcess process_;
};

struct CrossHello {
    std::string name;
    std::vector<std::string> parts;  // the client's writes
    std::string expected;            // zcrelay's backend by the contract
};

// The captured real hellos, the same in pieces, and two that are not TLS.
std::vector<CrossHello> crossHellos(const Tools& tools, std::string& error) {
    struct Captured {
        HelloSpec spec;
        std::string expected;
    };
    std::vector<Captured> captured = {
        {{"api_h2", "s_client", {"api.example.test", "h2,http/1.1"}}, "api"},
        {{"api", "s_client", {"api.example.test", ""}}, "api"},
        {{"api_upper", "s_client", {"API.Example.Test", ""}}, "api"},
        {{"api_dot", "s_client", {"api.example.test.", ""}}, "api"},
        {{"apps_h2", "s_client", {"a.apps.example.test", "h2"}}, "apps"},
        {{"apps_h10_h2", "s_client", {"a.apps.example.test", "http/1.0,h2"}}, "apps"},
        {{"apps_h10", "s_client", {"a.apps.example.test", "http/1.0"}}, "fallback"},
        {{"apps_noalpn", "s_client", {"a.apps.example.test", ""}}, "fallback"},
        {{"apps_two_labels", "s_client", {"a.b.apps.example.test", "h2"}}, "fallback"},
        {{"apps_bare", "s_client", {"apps.example.test", "h2"}}, "fallback"},
        {{"acme_nosni", "s_client", {std::nullopt, "acme-tls/1"}}, "apps"},
        {{"acme_named", "s_client", {"a.apps.example.test", "acme-tls/1"}}, "apps"},
        {{"nosni", "s_client", {std::nullopt, ""}}, "fallback"},
        {{"other", "s_client", {"other.example.test", "h2"}}, "fallback"},
        {{"py_api", "python", {"api.example.test", "h2,http/1.1"}}, "api"},
        {{"py_apps", "python", {"b.apps.example.test", "http/1.1"}}, "apps"},
        {{"py_big_apps", "python", {"q.apps.example.test", "http/1.1"}, 100}, "apps"},
        {{"curl_apps", "curl", {"c.apps.example.test", ""}}, "apps"},
        {{"curl_api", "curl", {"api.example.test", ""}}, "api"},
    };
    std::vector<CrossHello> out;
    std::map<std::string, std::string> by_key;
    for (const Captured& c : captured) {
        std::optional<std::string> h = HelloBank::get(tools, c.spec, error);
        if (!h) return {};
        by_key[c.spec.key] = *h;
        out.push_back({c.spec.key, {*h}, c.expected});
    }
    const std::string& api = by_key["api_h2"];
    for (size_t k : {size_t{1}, size_t{5}, size_t{6}, size_t{60}, api.size() / 2, api.size() - 1})
        out.push_back(
            {"api_h2 split at " + std::to_string(k), {api.substr(0, k), api.substr(k)}, "api"});
    const std::string m = handshakeMessage(api);
    HelloFields f = parseHello(m);
    out.push_back({"api_h2 in 1+rest records", {frame(m, {1})}, "api"});
    out.push_back({"api_h2 in 4+rest records", {frame(m, {4})}, "api"});
    out.push_back({"api_h2 cut in the name", {frame(m, {f.sni_at + 2})}, "api"});
    out.push_back({"api_h2 in 64-byte records", {frameEvery(m, 64)}, "api"});
    out.push_back(
        {"api_h2 in 64-byte records, a segment each", recordsOf(frameEvery(m, 64)), "api"});
    out.push_back({"apps_h2 in 100-byte records",
                   {frameEvery(handshakeMessage(by_key["apps_h2"]), 100)},
                   "apps"});
    out.push_back({"plain http", {"GET / HTTP/1.0\r\n\r\n"}, "fallback"});
    out.push_back({"garbage after a record header",
                   {std::string("\x16\x03\x01\x00\x20", 5) + std::string(32, '\xee')},
                   "fallback"});
    return out;
}

TEST(SniHaproxyCrossCheckTest, SameHellosSameNamedBackends) {
    Tools tools;
    SKIP_WITHOUT_TOOLS(tools, true, true);
    std::optional<std::string> binary = findExecutable("haproxy");
    if (!binary) GTEST_SKIP() << "haproxy is not installed (Debian package haproxy)";
    std::string error;
    std::vector<CrossHello> hellos = crossHellos(tools, error);
    ASSERT_FALSE(hellos.empty()) << error;

    // HAProxy once: its routing does not depend on zcrelay's data path.
    std::vector<std::string> by_haproxy;
    {
        CaptureSet caps;
        ASSERT_TRUE(caps.ok(error)) << error;
        HaproxyRouter haproxy(*binary);
        ASSERT_TRUE(haproxy.start(caps.addrs()));
        for (const CrossHello& h : hellos) {
            Landing l = caps.through(haproxy.port(), h.parts);
            EXPECT_EQ(l.note, "") << "haproxy: " << h.name;
            EXPECT_FALSE(l.backend.empty()) << "haproxy: " << h.name << ": " << l.note;
            by_haproxy.push_back(l.backend);
        }
    }

    for (const std::string& mode : kHandOffModes) {
        SCOPED_TRACE(mode);
        CaptureSet caps;
        ASSERT_TRUE(caps.ok(error)) << error;
        RelayProcess relay;
        ASSERT_TRUE(relay.start(routedConfig(
            caps.addrs(), {routedListener("t", mode, kRoutes, "    inspect_max_size: 64KiB\n")})))
            << relay.diagnostics();
        size_t haproxy_named = 0, zcrelay_named = 0, agree = 0;
        std::string more;
        for (size_t i = 0; i < hellos.size(); ++i) {
            const CrossHello& h = hellos[i];
            std::string sent;
            for (const auto& p : h.parts) sent += p;
            sent += kSecondFlight;
            Landing l = caps.through(relay.port(), h.parts, kSecondFlight);
            EXPECT_EQ(l.note, "") << "zcrelay: " << h.name;
            EXPECT_EQ(l.backend, h.expected) << "zcrelay: " << h.name << ": " << l.note;
            if (l.bytes) {
                EXPECT_EQ(*l.bytes, sent) << h.name << ": " << firstDifference(*l.bytes, sent);
            }
            bool h_named = by_haproxy[i] == "api" || by_haproxy[i] == "apps";
            bool z_named = l.backend == "api" || l.backend == "apps";
            haproxy_named += h_named;
            zcrelay_named += z_named;
            agree += by_haproxy[i] == l.backend;
            if (h_named) {
                EXPECT_EQ(l.backend, by_haproxy[i])
                    << h.name << ": HAProxy routed it to " << by_haproxy[i] << ", zcrelay did not";
            } else if (z_named) {
                more += "\n    " + h.name + " -> " + l.backend;
            }
        }
        std::printf(
            "[ INFO     ] %s: %zu hellos; HAProxy routed %zu to a named backend, zcrelay "
            "%zu; same backend for %zu; zcrelay routed where HAProxy did not:%s\n",
            mode.c_str(), hellos.size(), haproxy_named, zcrelay_named, agree,
            more.empty() ? " none" : more.c_str());
        EXPECT_GE(haproxy_named, 10u) << "premise: HAProxy routes the plain cases by name";
    }
}
ZCRELAY_LABEL(SniHaproxyCrossCheckTest, SameHellosSameNamedBackends, "", kSanitizeSkip,
              "its time is HAProxy's; the hellos are those the other cases send");

// =============================================================================================
// 7. Reload: routes change like clusters; a live connection keeps its backend.

class SniReloadTest : public SniFixture, public ::testing::TestWithParam<std::string> {};

TEST_P(SniReloadTest, NewRoutesForNewConnectionsLiveOnesStay) {
    SKIP_WITHOUT_TOOLS(tools_, false, true);
    ASSERT_NO_FATAL_FAILURE(startTlsBackends("-rev"));
    RelayConfig before = routedConfig(tlsAddrs(), {routedListener("t", GetParam())});
    ASSERT_NO_FATAL_FAILURE(startRelay(before));

    // A TLS connection to api, kept open across the reload by the gate file.
    const std::string gate = dir_.file("gate");
    ChildProcess held;
    ChildProcess::Options opts;
    opts.argv = {tools_.python, script_,
                 "--port",      std::to_string(relay_.port()),
                 "--sni",       "api.example.test",
                 "--cafile",    cafile_,
                 "--mode",      "hold",
                 "--gate",      gate};
    opts.stdout_path = dir_.file("held.out");
    opts.stderr_path = dir_.file("held.err");
    std::string error;
    ASSERT_TRUE(held.spawn(opts, error)) << error;
    auto heldSays = [&](const std::string& what) {
        return waitUntil(
            [&] { return readFileText(opts.stdout_path).find(what) != std::string::npos; }, kIo);
    };
    ASSERT_TRUE(heldSays("reply1=1-gnip"))
        << "the held client did not get its first answer: " << readFileText(opts.stdout_path)
        << fileTail(opts.stderr_path);
    EXPECT_NE(readFileText(opts.stdout_path).find("subject=CN = api"), std::string::npos);
    count("api", "");

    // The same names, the clusters swapped: the routes keep their names (so their counters).
    RelayConfig after = before;
    after.listeners[0].extra_yaml =
        "    routes:\n"
        "      - {name: api, sni: [api.example.test], cluster: apps}\n"
        "      - {name: apps, sni: [\"*.apps.example.test\"], alpn: [h2, http/1.1], cluster: api}\n"
        "      - {cluster: fallback}\n";
    ASSERT_TRUE(relay_.reload(after.yaml()));

    auto echo = [&](const Offer& o) {
        return python(tools_, script_, relay_.port(), o, cafile_, {"--mode", "echo"});
    };
    ClientRun a = echo({"api.example.test", ""});
    EXPECT_EQ(a.cn, "apps") << "after the reload api.example.test goes to cluster apps\n"
                            << a.transcript();
    EXPECT_NE(a.result.out.find("reply1=1-gnip"), std::string::npos) << a.transcript();
    count("api", "");

    // The live connection still talks to the api server: both ways, on its old TLS session.
    dir_.writeFile("gate", "");
    std::optional<ExitStatus> st = held.waitExit(kIo);
    ASSERT_TRUE(st) << "the held client did not finish";
    std::string out = readFileText(opts.stdout_path);
    EXPECT_TRUE(st->cleanExit()) << st->describe() << "\n" << out << fileTail(opts.stderr_path);
    EXPECT_NE(out.find("reply2=2-gnip"), std::string::npos)
        << "the connection opened before the reload stopped working\n"
        << out << fileTail(opts.stderr_path);

    // The wildcard now goes to the api server (free again: s_server serves one at a time).
    ClientRun b = echo({"b.apps.example.test", "h2"});
    EXPECT_EQ(b.cn, "api") << b.transcript();
    count("apps", "");
    // Two routes of one name (both after cluster api): the reload is refused, the routes stay.
    RelayConfig duplicate = after;
    duplicate.listeners[0].extra_yaml =
        "    routes:\n"
        "      - {sni: [api.example.test], cluster: api}\n"
        "      - {sni: [other.example.test], cluster: api}\n";
    ASSERT_TRUE(relay_.reload(duplicate.yaml(), false)) << "two routes named api";
    ClientRun c = echo({"api.example.test", ""});
    EXPECT_EQ(c.cn, "apps") << "a refused reload keeps the routes\n" << c.transcript();
    count("api", "");
}

INSTANTIATE_TEST_SUITE_P(Modes, SniReloadTest, ::testing::ValuesIn(kHandOffModes), modeName);

// =============================================================================================
// 8. Configuration: the default route from `cluster:` or `upstream:`, names unique.

class SniConfigTest : public SniFixture, public ::testing::Test {
  protected:
    // `zcrelay --check-config` on `yaml`.
    CommandResult check(const std::string& yaml) {
        return runCommand({kRelayBinary, "--check-config", dir_.writeFile("check.yaml", yaml)},
                          kTool);
    }
};

TEST_F(SniConfigTest, RouteNamesMustBeUnique) {
    ClusterAddrs to{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
    CommandResult good = check(routedConfig(to, {routedListener("t", "splice")}).yaml());
    EXPECT_TRUE(good.status.cleanExit()) << "the usual routes are a valid config\n"
                                         << good.describe();
    // Both named after cluster api.
    CommandResult same_default =
        check(routedConfig(to, {routedListener("t", "splice",
                                               "    routes:\n"
                                               "      - {sni: [a.example.test], cluster: api}\n"
                                               "      - {sni: [b.example.test], cluster: api}\n")})
                  .yaml());
    EXPECT_FALSE(same_default.status.cleanExit()) << same_default.describe();
    CommandResult same_given =
        check(routedConfig(
                  to, {routedListener("t", "splice",
                                      "    routes:\n"
                                      "      - {name: x, sni: [a.example.test], cluster: api}\n"
                                      "      - {name: x, sni: [b.example.test], cluster: apps}\n")})
                  .yaml());
    EXPECT_FALSE(same_given.status.cleanExit()) << same_given.describe();
    // The same name on two listeners is fine: unique within a listener.
    CommandResult two = check(
        routedConfig(to, {routedListener("t", "splice"), routedListener("u", "splice")}).yaml());
    EXPECT_TRUE(two.status.cleanExit()) << two.describe();
}

// Listener `c` has conditional routes and `cluster: fallback`; listener `u` the same with
// `upstream:` (a cluster of its own, named after the listener). Each is the default route.
TEST_F(SniConfigTest, ListenerTargetIsTheDefaultRoute) {
    SKIP_WITHOUT_TOOLS(tools_, false, false);
    ASSERT_NO_FATAL_FAILURE(startTlsBackends("-www"));
    ListenerSpec c = routedListener("c", "splice", kConditionalRoutes);
    c.omit_target = false;
    c.cluster = "fallback";
    ListenerSpec u = routedListener("u", "copy", kConditionalRoutes);
    u.omit_target = false;
    u.upstream = fallback_.hostPort();
    ASSERT_NO_FATAL_FAILURE(startRelay(routedConfig(tlsAddrs(), {c, u})));
    for (const std::string l : {"c", "u"}) {
        SCOPED_TRACE(l);
        expectLanded(sClient(tools_, relay_.port(l), {"api.example.test", ""}, cafile_, get_),
                     api_);
        count("api", "", l);
        expectLanded(sClient(tools_, relay_.port(l), {std::nullopt, ""}, cafile_, get_), fallback_);
        count(l == "c" ? "fallback" : "u", "no_sni", l);
    }
}

// =============================================================================================
// 9. The access log: sni as sent, the offered ALPN protocols, the route.

class SniAccessLogTest : public SniFixture, public ::testing::Test {};

TEST_F(SniAccessLogTest, JsonLinesCarrySniAlpnRoute) {
    SKIP_WITHOUT_TOOLS(tools_, false, false);
    ASSERT_NO_FATAL_FAILURE(startTlsBackends("-www"));
    const std::string log_path = dir_.file("access.log");
    RelayConfig config = routedConfig(
        tlsAddrs(),
        {routedListener("t", "splice"), routedListener("n", "splice", kConditionalRoutes)});
    config.extra_yaml += "access_log:\n  path: \"" + log_path + "\"\n  format: json\n";
    ASSERT_NO_FATAL_FAILURE(startRelay(config));

    expectLanded(
        sClient(tools_, relay_.port("t"), {"api.example.test", "h2,http/1.1"}, cafile_, get_),
        api_);
    expectLanded(sClient(tools_, relay_.port("t"), {"API.Example.Test.", ""}, cafile_, get_), api_);
    expectLanded(sClient(tools_, relay_.port("t"), {std::nullopt, ""}, cafile_, get_), fallback_);
    expectRefused(sClient(tools_, relay_.port("n"), {"other.example.test", "h2"}, cafile_, get_));

    struct Want {
        std::string listener, sni, alpn, route, termination;
    };
    const std::vector<Want> wants = {
        {"t", "api.example.test", "h2,http/1.1", "api", "done"},
        {"t", "API.Example.Test.", "", "api", "done"},  // as the client sent it
        {"t", "", "", "fallback", "done"},
        {"n", "other.example.test", "h2", "", "no_route"},
    };
    std::vector<Json> lines;
    waitUntil(
        [&] {
            lines.clear();
            std::istringstream in(readFileText(log_path));
            for (std::string line; std::getline(in, line) && lines.size() < 100;) {
                std::string error;
                if (auto j = parseJson(line, error)) lines.push_back(*j);
            }
            return lines.size() >= wants.size();
        },
        Millis{10'000});
    ASSERT_EQ(lines.size(), wants.size()) << readFileText(log_path);
    for (const Want& w : wants) {
        SCOPED_TRACE(w.listener + " sni \"" + w.sni + "\"");
        const Json* found = nullptr;
        for (const Json& j : lines)
            if (j.str("listener") == w.listener && j.str("sni") == w.sni) found = &j;
        ASSERT_NE(found, nullptr) << readFileText(log_path);
        for (const char* key : {"sni", "alpn", "route"}) {
            const Json* v = found->get(key);
            ASSERT_NE(v, nullptr) << "no \"" << key << "\" field";
            EXPECT_EQ(v->type, Json::Type::String) << key;
        }
        EXPECT_EQ(found->str("alpn"), w.alpn);
        EXPECT_EQ(found->str("route"), w.route);
        EXPECT_EQ(found->str("termination"), w.termination);
    }
}

}  // namespace
}  // namespace zcrelay::test::sni_routing_test
