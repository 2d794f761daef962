// The per-listener lifetime limits of a relayed connection, in every data path (splice, copy,
// sockmap): server_fin_timeout and client_fin_timeout (a half-closed connection whose other side
// stays silent), and max_connection_duration with its jitter (a connection ended gracefully:
// what was read is delivered, then a FIN both ways).
// The oracle is what the peers see (byte-exact prefixes, EOF or RST, the order of the ends) and
// the relay's own counters, waited on with deadlines. A timeout's lower bound is checked (the
// relay must not close early); its upper bound is only the generous deadline of the wait.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/labels.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::lifetime_test {
namespace {

constexpr uint64_t kSeedUp = 0x11FE;    // what clients send
constexpr uint64_t kSeedDown = 0xD0E5;  // what backends send
// A stream that never runs out before the relay ends it (loopback moves GB/s, not PB).
constexpr uint64_t kEndless = uint64_t{1} << 50;

// Every limit under test is 1 s: short enough for a quick suite, long enough that a close at
// the right moment and a close far too early are told apart.
constexpr Millis kLimit{1'000};
// The relay sweeps at most every 250 ms; the rest is room for a loaded machine. "Promptly":
// within kLimit + kMargin of the moment the limit started counting. 10 s in all for a 1 s limit:
// a loaded 2-core machine delays a sweep by tens of ms, not seconds, and a limit that never
// fires (or fires from the wrong start) is still caught.
constexpr Millis kMargin{9'000};
// A close earlier than this after the limit started counting is a close too early. Below
// kLimit because the relay's clock is its loop's (it may lag the test's by a few ms) and the
// limit may start counting a moment before the test's own timestamp.
constexpr double kMinLimitSeconds = 0.75;

// A half-closed or idle connection should be left alone for this long when no limit applies.
// Load can only delay a wrong close past this window (a missed failure), never make one.
constexpr Millis kLeftAlone{3'000};

// ---------------------------------------------------------------------------------------------
// The backend: every accepted connection is read to its end and then held open, so nothing the
// backend does ends a connection unless the test makes it (the relay's limits must).

// What one backend connection saw, shared between its script thread and the test.
struct PeerConn {
    int fd = -1;  // valid until the backend is stopped; the test may write and shut it down
    std::atomic<uint64_t> received{0};
    std::atomic<int64_t> first_mismatch{-1};  // against the backend's seed; -1 when intact
    // Under HeldBackend::mu_:
    bool ended = false;  // the read side ended (EOF, RST, error, or the script's deadline)
    IoResult read_end;
    Clock::time_point ended_at{};
};

// Reads each connection to its end checking the bytes against payload `seed`, then holds the
// socket open (never closed nor shut down by the script) until the backend is destroyed. The
// script thread keeps reading while the test writes into the same socket (a TCP socket is full
// duplex), so the moment the relay closes or passes a FIN is seen when it happens.
class HeldBackend {
  public:
    explicit HeldBackend(uint64_t seed) : seed_(seed), up_(AF_INET, script()) {}
    ~HeldBackend() { up_.stop(); }  // joins the scripts before the peers they fill go
    HeldBackend(const HeldBackend&) = delete;
    HeldBackend& operator=(const HeldBackend&) = delete;

    ScriptedUpstream& upstream() { return up_; }

    // The connection accepted `index`-th (0-based), once its script runs; nullptr on timeout.
    std::shared_ptr<PeerConn> waitForPeer(size_t index, Millis timeout) {
        std::unique_lock lock(mu_);
        std::shared_ptr<PeerConn> found;
        cv_.wait_for(lock, timeout, [&] {
            auto it = peers_.find(index);
            if (it != peers_.end()) found = it->second;
            return found != nullptr;
        });
        return found;
    }
    bool waitForEnd(const PeerConn& peer, Millis timeout) {
        std::unique_lock lock(mu_);
        return cv_.wait_for(lock, timeout, [&] { return peer.ended; });
    }
    bool ended(const PeerConn& peer) {
        std::lock_guard lock(mu_);
        return peer.ended;
    }
    IoResult readEnd(const PeerConn& peer) {
        std::lock_guard lock(mu_);
        return peer.read_end;
    }
    Clock::time_point endedAt(const PeerConn& peer) {
        std::lock_guard lock(mu_);
        return peer.ended_at;
    }
    std::string describe(const PeerConn& peer) {
        std::lock_guard lock(mu_);
        std::ostringstream os;
        os << "backend connection: received " << peer.received.load() << " bytes, first mismatch "
           << peer.first_mismatch.load() << ", read side "
           << (peer.ended ? peer.read_end.describe() : std::string("still open"));
        return os.str();
    }

  private:
    ConnScript script() {
        return [this](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream&) {
            auto peer = std::make_shared<PeerConn>();
            peer->fd = fd.get();
            {
                std::lock_guard lock(mu_);
                peers_[rec.index] = peer;
            }
            cv_.notify_all();
            PayloadVerifier verifier(seed_);
            IoResult end = readStreamUntilEof(
                fd.get(),
                [&](std::span<const uint8_t> d) {
                    verifier.update(d);
                    peer->first_mismatch.store(verifier.firstMismatch());
                    peer->received.store(verifier.bytes());
                },
                Millis{60'000}, &stop);
            {
                std::lock_guard lock(mu_);
                peer->read_end = end;
                peer->ended_at = Clock::now();
                peer->ended = true;
            }
            cv_.notify_all();
            // Hold the socket: a close here would be the backend ending the connection.
            for (int i = 0; i < 6'000 && !stop.load(); ++i) std::this_thread::sleep_for(Millis{10});
        };
    }

    const uint64_t seed_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::map<size_t, std::shared_ptr<PeerConn>> peers_;
    ScriptedUpstream up_;  // last: built after what its scripts use, stopped before it goes
};

// ---------------------------------------------------------------------------------------------
// Client-side helpers.

// How a watched socket ended, as the test process saw it.
struct EndSeen {
    IoStatus status = IoStatus::Timeout;  // Eof, Reset, Error; Timeout if it never ended
    int err = 0;
    uint64_t bytes = 0;  // bytes that arrived before the end (discarded)
    Clock::time_point at{};
    std::string describe() const {
        std::ostringstream os;
        os << ioStatusName(status);
        if (err != 0) os << " (" << std::strerror(err) << ")";
        os << " after " << bytes << " bytes";
        return os.str();
    }
};

// Watches every socket in one poll loop until each has ended (EOF or error) or `deadline`
// passes, discarding what arrives: the order of the ends is the order they happened in, give
// or take one poll round.
std::vector<EndSeen> watchEnds(const std::vector<int>& fds, Clock::time_point deadline) {
    std::vector<EndSeen> seen(fds.size());
    std::vector<uint8_t> buf(64 * kKiB);
    size_t pending = fds.size();
    for (int round = 0; round < 100'000 && pending > 0 && Clock::now() < deadline; ++round) {
        std::vector<pollfd> pfds;
        std::vector<size_t> which;
        for (size_t i = 0; i < fds.size(); ++i) {
            if (seen[i].at != Clock::time_point{}) continue;
            pfds.push_back({fds[i], POLLIN, 0});
            which.push_back(i);
        }
        auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
        int n =
            ::poll(pfds.data(), pfds.size(), static_cast<int>(std::clamp<int64_t>(left, 0, 100)));
        if (n <= 0) continue;
        for (size_t k = 0; k < pfds.size(); ++k) {
            if (pfds[k].revents == 0) continue;
            EndSeen& s = seen[which[k]];
            ssize_t r = ::recv(pfds[k].fd, buf.data(), buf.size(), MSG_DONTWAIT);
            if (r > 0) {
                s.bytes += static_cast<uint64_t>(r);
                continue;
            }
            if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
            s.at = Clock::now();
            if (r == 0) {
                s.status = IoStatus::Eof;
            } else {
                s.err = errno;
                s.status =
                    (errno == ECONNRESET || errno == EPIPE) ? IoStatus::Reset : IoStatus::Error;
            }
            --pending;
        }
    }
    return seen;
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// `len` bytes of payload `seed` from `offset`, sent into `from` (a backend socket) and read back
// exactly at `to` (the client): the backend -> client direction still relays.
::testing::AssertionResult relaysToClient(int from, int to, uint64_t seed, uint64_t offset,
                                          uint64_t len) {
    IoResult w = sendPayloadAt(from, seed, offset, len, Millis{5'000});
    if (!w.ok()) return ::testing::AssertionFailure() << "backend send: " << w.describe();
    std::vector<uint8_t> got(len), want(len);
    IoResult r = readExactly(to, got.data(), len, Millis{5'000});
    if (!r.ok()) return ::testing::AssertionFailure() << "client read: " << r.describe();
    fillPayload(seed, offset, want);
    if (got != want) return ::testing::AssertionFailure() << "client received different bytes";
    return ::testing::AssertionSuccess();
}

// `len` bytes of payload kSeedUp from `offset`, sent by the client and counted intact at the
// backend (whose script reads them): the client -> backend direction still relays.
::testing::AssertionResult relaysToBackend(int client, const PeerConn& peer, uint64_t offset,
                                           uint64_t len) {
    IoResult w = sendPayloadAt(client, kSeedUp, offset, len, Millis{5'000});
    if (!w.ok()) return ::testing::AssertionFailure() << "client send: " << w.describe();
    if (!waitUntil([&] { return peer.received.load() >= offset + len; }, Millis{5'000}))
        return ::testing::AssertionFailure()
               << "backend received " << peer.received.load() << " of " << offset + len;
    if (peer.first_mismatch.load() >= 0)
        return ::testing::AssertionFailure()
               << "backend received different bytes from offset " << peer.first_mismatch.load();
    return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------------

class LifetimeTest : public ::testing::TestWithParam<std::string> {
  protected:
    const std::string& mode() const { return GetParam(); }

    // ASSERTs inside: call through ASSERT_NO_FATAL_FAILURE. `extra_yaml`: the listener keys
    // under test, indented by 4 spaces.
    void startRelay(HeldBackend& backend, const std::string& extra_yaml) {
        ASSERT_TRUE(backend.upstream().ok()) << backend.upstream().error();
        RelayConfig config = singleListenerConfig(backend.upstream().hostPort(), mode());
        config.listeners.at(0).extra_yaml = extra_yaml;
        ASSERT_TRUE(relay_.start(config));
        // A sockmap listener that quietly ran splice would make every sockmap case a second
        // splice case.
        EXPECT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath(mode())), 1.0)
            << "listener t should run the " << mode() << " data path";
    }

    // Connects a client and waits until the backend has its side: accept `index`.
    void connectPair(HeldBackend& backend, size_t index, Connected& client,
                     std::shared_ptr<PeerConn>& peer) {
        client = connectTo(relay_.host(), relay_.port());
        ASSERT_TRUE(client.fd) << client.error;
        peer = backend.waitForPeer(index, Millis{5'000});
        ASSERT_NE(peer, nullptr) << "the relay never connected client #" << index
                                 << " to the backend\n"
                                 << relay_.diagnostics();
    }

    // closed_total of listener t is `count` for `why` and 0 for every other reason.
    void expectClosedOnly(const std::string& why, double count) {
        std::string error;
        std::optional<std::string> text = relay_.scrape(&error);
        ASSERT_TRUE(text) << error;
        for (std::string_view label : metric::kClosedReasons) {
            std::string r(label);
            std::optional<double> v = findSample(*text, metric::kClosedTotal, metric::reason(r));
            EXPECT_EQ(v.value_or(-1), r == why ? count : 0.0)
                << formatSeries(metric::kClosedTotal, metric::reason(r));
        }
    }

    // Waits until `count` connections of listener t have closed, for whatever reason, then
    // checks that they all closed for `why`: a wrong reason fails at once, naming the reason.
    void expectClosedAs(const std::string& why, double count) {
        ASSERT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::listener(), count))
            << relay_.diagnostics();
        ASSERT_NO_FATAL_FAILURE(expectClosedOnly(why, count));
    }

    RelayProcess relay_;
};

// =============================================================================================
// server_fin_timeout: the client half-closed, its FIN went to the backend, and the backend
// stays silent. That connection, and only that one, is closed once the silence lasts.

TEST_P(LifetimeTest, ServerFinTimeoutClosesOnlyTheClientHalfClosedConnection) {
    constexpr uint64_t kSent = 64 * kKiB;
    HeldBackend backend(kSeedUp);
    ASSERT_NO_FATAL_FAILURE(startRelay(backend, "    server_fin_timeout: 1s\n"));
    Connected a, b;
    std::shared_ptr<PeerConn> peer_a, peer_b;
    ASSERT_NO_FATAL_FAILURE(connectPair(backend, 0, a, peer_a));
    ASSERT_NO_FATAL_FAILURE(connectPair(backend, 1, b, peer_b));

    // A: a request, then the client's FIN. B stays open both ways, idle: the fin timeout must
    // not take a connection that is not half-closed, however silent.
    IoResult sent = sendPayload(a.fd.get(), kSeedUp, kSent, Millis{5'000});
    ASSERT_TRUE(sent.ok()) << sent.describe();
    ASSERT_EQ(::shutdown(a.fd.get(), SHUT_WR), 0) << std::strerror(errno);
    auto t_fin = Clock::now();

    ASSERT_TRUE(backend.waitForEnd(*peer_a, Millis{5'000}))
        << "the client's FIN never reached the backend; " << backend.describe(*peer_a);
    EXPECT_EQ(backend.readEnd(*peer_a).status, IoStatus::Eof) << backend.describe(*peer_a);
    EXPECT_EQ(peer_a->received.load(), kSent) << backend.describe(*peer_a);
    EXPECT_LT(peer_a->first_mismatch.load(), 0) << backend.describe(*peer_a);

    // The backend never answers: the relay must end A after 1 s of silence; the client sees
    // its connection closed with a clean FIN (nothing it sent was left unread).
    std::string rest;
    IoResult end = readUntilEof(a.fd.get(), rest, kLimit + kMargin);
    double elapsed = secondsSince(t_fin);
    EXPECT_EQ(end.status, IoStatus::Eof)
        << "server_fin_timeout 1s should close the half-closed connection within "
        << seconds(kLimit + kMargin) << " s; the client saw " << end.describe() << "\n"
        << relay_.diagnostics();
    EXPECT_TRUE(rest.empty()) << "the backend sent nothing";
    if (end.status == IoStatus::Eof) {
        EXPECT_GE(elapsed, kMinLimitSeconds)
            << "closed " << elapsed << " s after the client's FIN: before server_fin_timeout";
    }
    ASSERT_NO_FATAL_FAILURE(expectClosedAs("server_fin_timeout", 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 1))
        << "B must still be open";

    // B, silent all along and not half-closed, still relays both ways.
    EXPECT_FALSE(backend.ended(*peer_b)) << backend.describe(*peer_b);
    EXPECT_TRUE(relaysToBackend(b.fd.get(), *peer_b, 0, 4 * kKiB));
    EXPECT_TRUE(relaysToClient(peer_b->fd, b.fd.get(), kSeedDown, 0, 4 * kKiB));
    // Counted once, under its own reason only.
    ASSERT_NO_FATAL_FAILURE(expectClosedOnly("server_fin_timeout", 1));
}

// =============================================================================================
// client_fin_timeout: the backend answered and half-closed, its FIN went to the client, and the
// client stays silent without closing.

TEST_P(LifetimeTest, ClientFinTimeoutClosesOnlyTheBackendHalfClosedConnection) {
    constexpr uint64_t kReply = 64 * kKiB;
    HeldBackend backend(kSeedUp);
    ASSERT_NO_FATAL_FAILURE(startRelay(backend, "    client_fin_timeout: 1s\n"));
    Connected a, b;
    std::shared_ptr<PeerConn> peer_a, peer_b;
    ASSERT_NO_FATAL_FAILURE(connectPair(backend, 0, a, peer_a));
    ASSERT_NO_FATAL_FAILURE(connectPair(backend, 1, b, peer_b));

    // A: the backend's reply and FIN; it keeps its socket open, reading (the script does).
    IoResult sent = sendPayload(peer_a->fd, kSeedDown, kReply, Millis{5'000});
    ASSERT_TRUE(sent.ok()) << sent.describe();
    ASSERT_EQ(::shutdown(peer_a->fd, SHUT_WR), 0) << std::strerror(errno);
    auto t_fin = Clock::now();

    // The client takes the reply and the FIN, and then neither sends nor closes.
    ReceiveCheck got = receivePayloadUntilEof(a.fd.get(), kSeedDown, Millis{5'000});
    EXPECT_EQ(got.io.status, IoStatus::Eof) << got.describe();
    EXPECT_EQ(got.bytes, kReply) << got.describe();
    EXPECT_LT(got.first_mismatch, 0) << got.describe();

    // The relay ends A after 1 s of silence: the backend's read side sees the relay's FIN.
    ASSERT_TRUE(backend.waitForEnd(*peer_a, kLimit + kMargin))
        << "client_fin_timeout 1s should close the half-closed connection within "
        << seconds(kLimit + kMargin) << " s; " << backend.describe(*peer_a) << "\n"
        << relay_.diagnostics();
    double elapsed = seconds(backend.endedAt(*peer_a) - t_fin);
    EXPECT_EQ(backend.readEnd(*peer_a).status, IoStatus::Eof) << backend.describe(*peer_a);
    EXPECT_EQ(peer_a->received.load(), 0u) << "the client sent nothing";
    EXPECT_GE(elapsed, kMinLimitSeconds)
        << "closed " << elapsed << " s after the backend's FIN: before client_fin_timeout";
    ASSERT_NO_FATAL_FAILURE(expectClosedAs("client_fin_timeout", 1));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 1))
        << "B must still be open";

    EXPECT_FALSE(backend.ended(*peer_b)) << backend.describe(*peer_b);
    EXPECT_TRUE(relaysToBackend(b.fd.get(), *peer_b, 0, 4 * kKiB));
    EXPECT_TRUE(relaysToClient(peer_b->fd, b.fd.get(), kSeedDown, 0, 4 * kKiB));
    ASSERT_NO_FATAL_FAILURE(expectClosedOnly("client_fin_timeout", 1));
}

// =============================================================================================
// Without the fin timeouts (the default), a half-closed connection is a normal one: it stays
// until idle_timeout (300 s here) or until the other side finishes too.

TEST_P(LifetimeTest, WithoutFinTimeoutsHalfClosedConnectionsKeepRelayingTheOtherWay) {
    constexpr uint64_t kBytes = 16 * kKiB;
    HeldBackend backend(kSeedUp);
    ASSERT_NO_FATAL_FAILURE(startRelay(backend, ""));
    Connected a, c;
    std::shared_ptr<PeerConn> peer_a, peer_c;
    ASSERT_NO_FATAL_FAILURE(connectPair(backend, 0, a, peer_a));
    ASSERT_NO_FATAL_FAILURE(connectPair(backend, 1, c, peer_c));

    // A: the client half-closes. C: the backend half-closes.
    ASSERT_EQ(::shutdown(a.fd.get(), SHUT_WR), 0) << std::strerror(errno);
    ASSERT_TRUE(backend.waitForEnd(*peer_a, Millis{5'000})) << backend.describe(*peer_a);
    EXPECT_EQ(backend.readEnd(*peer_a).status, IoStatus::Eof) << backend.describe(*peer_a);
    ASSERT_EQ(::shutdown(peer_c->fd, SHUT_WR), 0) << std::strerror(errno);
    std::string none;
    IoResult c_eof = readUntilEof(c.fd.get(), none, Millis{5'000});
    ASSERT_EQ(c_eof.status, IoStatus::Eof) << "the backend's FIN should reach the client";

    // Both stay silent for a while: nothing may close them.
    EXPECT_FALSE(waitUntil(
        [&] { return relay_.metric(metric::kConnectionsActive, metric::listener()) != 2.0; },
        kLeftAlone, Millis{100}))
        << "a half-closed connection was closed without any fin timeout configured\n"
        << relay_.diagnostics();

    // The open direction of each still relays.
    EXPECT_TRUE(relaysToClient(peer_a->fd, a.fd.get(), kSeedDown, 0, kBytes));
    EXPECT_TRUE(relaysToBackend(c.fd.get(), *peer_c, 0, kBytes));
    EXPECT_FALSE(backend.ended(*peer_c)) << backend.describe(*peer_c);

    // And each ends normally once its other side finishes.
    ASSERT_EQ(::shutdown(peer_a->fd, SHUT_WR), 0) << std::strerror(errno);
    IoResult a_eof = readUntilEof(a.fd.get(), none, Millis{5'000});
    EXPECT_EQ(a_eof.status, IoStatus::Eof) << a_eof.describe();
    ASSERT_EQ(::shutdown(c.fd.get(), SHUT_WR), 0) << std::strerror(errno);
    ASSERT_TRUE(backend.waitForEnd(*peer_c, Millis{5'000})) << backend.describe(*peer_c);
    EXPECT_EQ(backend.readEnd(*peer_c).status, IoStatus::Eof) << backend.describe(*peer_c);
    ASSERT_NO_FATAL_FAILURE(expectClosedAs("done", 2));
}
ZCRELAY_LABEL(LifetimeTest, WithoutFinTimeoutsHalfClosedConnectionsKeepRelayingTheOtherWay, "", kSanitizeSkip,
              "3 s of a half-closed connection left alone");

// =============================================================================================
// max_connection_duration: a connection past its age is ended gracefully. Each side receives a
// byte-exact prefix of what the other sent, then a FIN; a side that was not sending sees a
// clean EOF.

TEST_P(LifetimeTest, MaxDurationEndsADownloadWithACleanEofAndAnExactPrefix) {
    HeldBackend backend(kSeedUp);
    ASSERT_NO_FATAL_FAILURE(startRelay(backend, "    max_connection_duration: 1s\n"));
    auto t_connect = Clock::now();
    Connected client;
    std::shared_ptr<PeerConn> peer;
    ASSERT_NO_FATAL_FAILURE(connectPair(backend, 0, client, peer));
    // The backend streams as fast as the client reads, until the relay stops taking it. (The
    // sender may then sit blocked on a closed window; its destructor cancels it.)
    GatedSender stream(peer->fd, kSeedDown, kEndless, kEndless);

    ReceiveCheck got = receivePayloadUntilEof(client.fd.get(), kSeedDown, kLimit + kMargin);
    double elapsed = secondsSince(t_connect);
    EXPECT_EQ(got.io.status, IoStatus::Eof)
        << "the client, which only reads, should see a clean EOF when max_connection_duration "
           "1s ends the download; it saw "
        << got.describe() << "; the backend had sent " << stream.sent() << " bytes\n"
        << relay_.diagnostics();
    EXPECT_LT(got.first_mismatch, 0) << "the client must receive a byte-exact prefix of the "
                                     << "backend's stream: " << got.describe();
    EXPECT_GT(got.bytes, 0u) << got.describe();
    if (got.io.status == IoStatus::Eof) {
        EXPECT_GE(elapsed, kMinLimitSeconds)
            << "ended " << elapsed << " s after the connect: before max_connection_duration";
    }

    // The backend's read side: the client's (relayed) FIN.
    ASSERT_TRUE(backend.waitForEnd(*peer, Millis{5'000})) << backend.describe(*peer);
    EXPECT_EQ(backend.readEnd(*peer).status, IoStatus::Eof) << backend.describe(*peer);
    EXPECT_EQ(peer->received.load(), 0u);

    ASSERT_NO_FATAL_FAILURE(expectClosedAs("max_duration", 1));
    // What the relay counts as sent to the client is exactly what the client got (after an
    // RST the two would differ by what the client's kernel discarded: checked only after a FIN).
    if (got.io.status == IoStatus::Eof) {
        EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("downstream"),
                                         static_cast<double>(got.bytes)))
            << "client received " << got.bytes;
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"), 0));
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
}

TEST_P(LifetimeTest, MaxDurationEndsAnUploadWithAnExactPrefixAndEofAtTheBackend) {
    HeldBackend backend(kSeedUp);
    ASSERT_NO_FATAL_FAILURE(startRelay(backend, "    max_connection_duration: 1s\n"));
    auto t_connect = Clock::now();
    Connected client;
    std::shared_ptr<PeerConn> peer;
    ASSERT_NO_FATAL_FAILURE(connectPair(backend, 0, client, peer));
    GatedSender stream(client.fd.get(), kSeedUp, kEndless, kEndless);

    // The backend only reads: it sees a byte-exact prefix and then a clean EOF.
    ASSERT_TRUE(backend.waitForEnd(*peer, kLimit + kMargin))
        << "max_connection_duration 1s should end the upload within " << seconds(kLimit + kMargin)
        << " s; " << backend.describe(*peer) << "\n"
        << relay_.diagnostics();
    double elapsed = seconds(backend.endedAt(*peer) - t_connect);
    EXPECT_EQ(backend.readEnd(*peer).status, IoStatus::Eof)
        << "the backend, which only reads, should see a clean EOF; " << backend.describe(*peer)
        << "\n"
        << relay_.diagnostics();
    EXPECT_LT(peer->first_mismatch.load(), 0) << backend.describe(*peer);
    EXPECT_GT(peer->received.load(), 0u) << backend.describe(*peer);
    if (backend.readEnd(*peer).status == IoStatus::Eof) {
        EXPECT_GE(elapsed, kMinLimitSeconds)
            << "ended " << elapsed << " s after the connect: before max_connection_duration";
    }

    // The client was sending: it may get an RST at the close (its last bytes were not
    // delivered), or the FIN first; either way its connection ends.
    IoResult client_end = waitForPeerClose(client.fd.get(), Millis{5'000});
    EXPECT_TRUE(endedByPeer(client_end)) << client_end.describe();

    ASSERT_NO_FATAL_FAILURE(expectClosedAs("max_duration", 1));
    if (backend.readEnd(*peer).status == IoStatus::Eof) {
        EXPECT_TRUE(relay_.waitForMetric(metric::kBytesTotal, metric::bytes("upstream"),
                                         static_cast<double>(peer->received.load())))
            << "backend received " << peer->received.load();
    }
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
}

TEST_P(LifetimeTest, MaxDurationCountsFromEachConnectionsOwnStart) {
    constexpr Millis kStagger{800};
    HeldBackend backend(kSeedUp);
    ASSERT_NO_FATAL_FAILURE(startRelay(backend, "    max_connection_duration: 1s\n"));
    Connected first, second;
    std::shared_ptr<PeerConn> peer_first, peer_second;
    auto t_first = Clock::now();
    ASSERT_NO_FATAL_FAILURE(connectPair(backend, 0, first, peer_first));
    // The second connection is younger by kStagger (a sleep that makes the age difference, not
    // a wait for a result). The order below holds unless one 250 ms sweep is late by the
    // remaining 550 ms: far more than a loaded 2-core machine delays a runnable thread.
    std::this_thread::sleep_for(kStagger);
    auto t_second = Clock::now();
    ASSERT_NO_FATAL_FAILURE(connectPair(backend, 1, second, peer_second));

    std::vector<EndSeen> ends =
        watchEnds({first.fd.get(), second.fd.get()}, t_second + kLimit + kMargin);
    for (size_t i = 0; i < ends.size(); ++i)
        EXPECT_EQ(ends[i].status, IoStatus::Eof)
            << "client #" << i << ": " << ends[i].describe() << "\n"
            << relay_.diagnostics();
    ASSERT_TRUE(ends[0].status == IoStatus::Eof && ends[1].status == IoStatus::Eof);
    EXPECT_LT(ends[0].at, ends[1].at) << "the older connection must end first: the younger ended "
                                      << seconds(ends[0].at - ends[1].at) << " s before it";
    EXPECT_GE(seconds(ends[1].at - t_second), kMinLimitSeconds)
        << "the younger connection was ended before its own max_connection_duration";
    EXPECT_GE(seconds(ends[0].at - t_first), kMinLimitSeconds);

    // The backends' read sides end in the same order.
    ASSERT_TRUE(backend.waitForEnd(*peer_first, Millis{5'000})) << backend.describe(*peer_first);
    ASSERT_TRUE(backend.waitForEnd(*peer_second, Millis{5'000})) << backend.describe(*peer_second);
    EXPECT_EQ(backend.readEnd(*peer_first).status, IoStatus::Eof);
    EXPECT_EQ(backend.readEnd(*peer_second).status, IoStatus::Eof);
    EXPECT_LT(backend.endedAt(*peer_first), backend.endedAt(*peer_second));
    ASSERT_NO_FATAL_FAILURE(expectClosedAs("max_duration", 2));
}
ZCRELAY_LABEL(LifetimeTest, MaxDurationCountsFromEachConnectionsOwnStart, "", kSanitizeSkip,
              "waits for a second deadline: the ending the download and upload cases run");

// max_connection_duration_jitter: connections opened together end spread over the jitter, so
// their clients do not all reconnect at once.
TEST_P(LifetimeTest, MaxDurationJitterSpreadsTheEndsOfConnectionsOpenedTogether) {
    constexpr size_t kConns = 20;
    constexpr Millis kJitter{2'000};
    // The sweep runs every 250 ms at most: ends that all fell into one window would mean no
    // jitter. 0.5 s is far below what 20 draws over 2 s give, and far above one tick.
    constexpr double kMinSpread = 0.5;
    HeldBackend backend(kSeedUp);
    ASSERT_NO_FATAL_FAILURE(startRelay(
        backend, "    max_connection_duration: 1s\n    max_connection_duration_jitter: 2s\n"));
    std::vector<Connected> clients(kConns);
    std::vector<std::shared_ptr<PeerConn>> peers(kConns);
    auto t_open = Clock::now();
    for (size_t i = 0; i < kConns; ++i)
        ASSERT_NO_FATAL_FAILURE(connectPair(backend, i, clients[i], peers[i]));
    auto t_opened = Clock::now();

    std::vector<int> fds;
    for (const Connected& c : clients) fds.push_back(c.fd.get());
    std::vector<EndSeen> ends = watchEnds(fds, t_opened + kLimit + kJitter + kMargin);
    Clock::time_point lo = Clock::time_point::max(), hi = Clock::time_point::min();
    size_t eofs = 0;
    for (size_t i = 0; i < kConns; ++i) {
        EXPECT_EQ(ends[i].status, IoStatus::Eof) << "client #" << i << ": " << ends[i].describe();
        if (ends[i].status != IoStatus::Eof) continue;
        ++eofs;
        lo = std::min(lo, ends[i].at);
        hi = std::max(hi, ends[i].at);
        EXPECT_GE(seconds(ends[i].at - t_open), kMinLimitSeconds)
            << "client #" << i << " ended before max_connection_duration";
    }
    ASSERT_EQ(eofs, kConns) << "every connection must end by 1 s + 2 s jitter + "
                            << seconds(kMargin) << " s margin\n"
                            << relay_.diagnostics();
    EXPECT_GE(seconds(hi - lo), kMinSpread)
        << "20 connections with max_connection_duration_jitter 2s all ended within "
        << seconds(hi - lo) << " s of each other";
    for (size_t i = 0; i < kConns; ++i) {
        ASSERT_TRUE(backend.waitForEnd(*peers[i], Millis{5'000})) << backend.describe(*peers[i]);
        EXPECT_EQ(backend.readEnd(*peers[i]).status, IoStatus::Eof) << backend.describe(*peers[i]);
    }
    ASSERT_NO_FATAL_FAILURE(expectClosedAs("max_duration", static_cast<double>(kConns)));
}
ZCRELAY_LABEL(LifetimeTest, MaxDurationJitterSpreadsTheEndsOfConnectionsOpenedTogether, "", kSanitizeSkip,
              "waits for a spread: the ending the download and upload cases run");

INSTANTIATE_TEST_SUITE_P(Modes, LifetimeTest, ::testing::ValuesIn(kModes), modeName);

}  // namespace
}  // namespace zcrelay::test::lifetime_test
