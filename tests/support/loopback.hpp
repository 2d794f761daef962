#pragma once
// Loopback sockets for tests: an RAII fd, listen/connect on 127.0.0.1 or ::1, I/O with bounded
// waits, a deterministic payload both ends can generate or verify without holding it, and
// scripted upstreams that run in std::threads and are always joined.
//
// Every wait here is bounded: I/O helpers poll in slices of at most 100 ms until a deadline
// (default 60 s) and give up with IoStatus::Timeout, so a broken relay fails a test instead of
// hanging it. Nothing here raises SIGPIPE: sends use MSG_NOSIGNAL.
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace zcrelay::test {

using Millis = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

inline constexpr Millis kDefaultIoTimeout{60'000};

// ---------------------------------------------------------------------------------------------
// Fd: the one owner of a file descriptor.
class Fd {
  public:
    Fd() = default;
    explicit Fd(int fd) : fd_(fd) {}
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    Fd(Fd&& other) noexcept : fd_(other.release()) {}
    Fd& operator=(Fd&& other) noexcept {
        if (this != &other) reset(other.release());
        return *this;
    }
    ~Fd() { reset(); }

    int get() const { return fd_; }
    bool valid() const { return fd_ >= 0; }
    explicit operator bool() const { return valid(); }
    int release() {
        int fd = fd_;
        fd_ = -1;
        return fd;
    }
    void reset(int fd = -1);

  private:
    int fd_ = -1;
};

// ---------------------------------------------------------------------------------------------
// Addresses and sockets.

// "127.0.0.1" for AF_INET, "::1" for AF_INET6.
std::string loopbackHost(int family);
// "127.0.0.1:PORT" or "[::1]:PORT": the form zcrelay's config takes.
std::string loopbackHostPort(int family, uint16_t port);
const char* familyName(int family);  // "ipv4" / "ipv6"

struct Listening {
    Fd fd;
    uint16_t port = 0;
    std::string error;  // set when fd is invalid
};

// A TCP listening socket on the loopback address of `family`, port 0 (the kernel picks).
Listening listenLoopback(int family = AF_INET, int backlog = 1024);

struct Bound {
    Fd fd;
    uint16_t port = 0;
    std::string error;
};
// A TCP socket bound to a loopback port but NOT listening: the port stays reserved and a SYN to
// it is answered with RST (connection refused).
Bound bindLoopbackNoListen(int family = AF_INET);

struct Connected {
    Fd fd;
    int err = 0;  // errno of the failure (ETIMEDOUT for our own deadline)
    std::string error;
};

// Blocking-style connect with a deadline (nonblocking connect + poll). The returned socket is
// back in blocking mode; the helpers below use poll with deadlines anyway. TCP_NODELAY is set.
Connected connectTo(const std::string& host, uint16_t port, Millis timeout = Millis{5'000});

void setNonBlocking(int fd, bool on);
// SO_LINGER {1, 0} then close: the kernel sends RST instead of FIN.
void closeWithReset(Fd& fd);

// ---------------------------------------------------------------------------------------------
// I/O with deadlines.

enum class IoStatus {
    Ok,       // did what was asked
    Eof,      // peer's FIN arrived (read side) before the request was satisfied / as expected
    Reset,    // ECONNRESET / EPIPE
    Timeout,  // deadline passed
    Cancelled,
    Error,  // anything else; see err
};
const char* ioStatusName(IoStatus s);

struct IoResult {
    IoStatus status = IoStatus::Ok;
    uint64_t bytes = 0;  // bytes moved before the call returned
    int err = 0;
    bool ok() const { return status == IoStatus::Ok; }
    // "Ok after 1048576 bytes", "Reset (Connection reset by peer) after 12 bytes", ...
    std::string describe() const;
};

// An optional flag that makes a blocked helper return IoStatus::Cancelled within ~100 ms.
using CancelFlag = const std::atomic<bool>*;

// `bytes` written to fd and as many read back, through an echo: Ok, or how it failed (a reply
// that differs is Error, EBADMSG).
IoResult echoBack(int fd, std::string_view bytes, Millis timeout = kDefaultIoTimeout);

// A client's end of a stream: its FIN sent (shutdown SHUT_WR), then nothing more may come but
// the peer's FIN. "" or what came instead.
std::string endStream(int fd, Millis timeout = kDefaultIoTimeout);

IoResult writeAll(int fd, const void* data, size_t len, Millis timeout = kDefaultIoTimeout,
                  CancelFlag cancel = nullptr);
// One read of up to `cap` bytes: Ok with bytes > 0, or Eof / Reset / Timeout / ...
IoResult readSome(int fd, void* data, size_t cap, Millis timeout = kDefaultIoTimeout,
                  CancelFlag cancel = nullptr);
// Ok only when all `len` bytes arrived; Eof if the peer closed before.
IoResult readExactly(int fd, void* data, size_t len, Millis timeout = kDefaultIoTimeout,
                     CancelFlag cancel = nullptr);
// The one-byte tag a tagged backend sends first (the cluster and runtime API cases tell their
// backends apart by it), or 0 if none came within `timeout`: the relay closed the client, or no
// backend took it.
inline char servedBy(const Fd& fd, Millis timeout = Millis{20'000}) {
    char tag = 0;
    return readExactly(fd.get(), &tag, 1, timeout).ok() ? tag : 0;
}
// Reads until EOF (status Eof on success: that is what was asked for). Keeps at most `limit`
// bytes in `out`; further bytes are counted and dropped.
IoResult readUntilEof(int fd, std::string& out, Millis timeout = kDefaultIoTimeout,
                      size_t limit = 64 << 20, CancelFlag cancel = nullptr);
// Reads until EOF handing every chunk to `onData`. Status Eof on success.
IoResult readStreamUntilEof(int fd, const std::function<void(std::span<const uint8_t>)>& onData,
                            Millis timeout = kDefaultIoTimeout, CancelFlag cancel = nullptr);
// One short exchange with an echo behind host:port (a relay in front of one, usually): 8 bytes
// out, the same 8 back. "" when it went so, else what failed ("connect: ...", "send: ...",
// "echo: ...", "echo differs").
std::string echoExchange(const std::string& host, uint16_t port, Millis connect_timeout,
                         Millis io_timeout);

// Waits until the peer has closed (EOF or RST), discarding anything that arrives.
// Status Eof or Reset when it happened, Timeout otherwise.
IoResult waitForPeerClose(int fd, Millis timeout);

// ---------------------------------------------------------------------------------------------
// Deterministic payload: byte i of stream `seed` is a pure function of (seed, i), so any chunking
// produces the same bytes and a receiver can verify at any offset.
void fillPayload(uint64_t seed, uint64_t offset, std::span<uint8_t> out);

// FNV-1a 64 over a stream.
class StreamHash {
  public:
    void update(std::span<const uint8_t> data);
    uint64_t value() const { return hash_; }
    uint64_t bytes() const { return bytes_; }

  private:
    uint64_t hash_ = 0xcbf29ce484222325ULL;
    uint64_t bytes_ = 0;
};
uint64_t payloadHash(uint64_t seed, uint64_t length);

// Checks a received stream against payload `seed` as it arrives.
class PayloadVerifier {
  public:
    explicit PayloadVerifier(uint64_t seed) : seed_(seed) {}
    void update(std::span<const uint8_t> data);
    uint64_t bytes() const { return bytes_; }
    bool intact() const { return first_mismatch_ < 0; }
    int64_t firstMismatch() const { return first_mismatch_; }  // -1 when none

  private:
    uint64_t seed_;
    uint64_t bytes_ = 0;
    int64_t first_mismatch_ = -1;
    std::vector<uint8_t> scratch_;
};

// Sends `length` bytes of payload `seed` (in chunks of up to 256 KiB).
IoResult sendPayload(int fd, uint64_t seed, uint64_t length, Millis timeout = kDefaultIoTimeout,
                     CancelFlag cancel = nullptr);
// Sends bytes [offset, offset + length) of payload `seed`: a stream sent in paced pieces.
IoResult sendPayloadAt(int fd, uint64_t seed, uint64_t offset, uint64_t length,
                       Millis timeout = kDefaultIoTimeout, CancelFlag cancel = nullptr);

struct ReceiveCheck {
    IoResult io;  // Eof when the stream ended cleanly
    uint64_t bytes = 0;
    int64_t first_mismatch = -1;
    std::string describe() const;
};
// Reads until EOF verifying the bytes against payload `seed`.
ReceiveCheck receivePayloadUntilEof(int fd, uint64_t seed, Millis timeout = kDefaultIoTimeout,
                                    CancelFlag cancel = nullptr);

// Full duplex through an echo: a writer thread sends `length` bytes of payload `seed` then
// shutdown(SHUT_WR), while this thread reads until EOF verifying the same payload. The writer is
// always joined; if reading fails the socket is shut down first so the writer cannot linger.
// `send_result` (optional) receives the writer's outcome.
ReceiveCheck echoRoundTrip(int fd, uint64_t seed, uint64_t length,
                           Millis timeout = kDefaultIoTimeout, IoResult* send_result = nullptr);

// ---------------------------------------------------------------------------------------------
// Scripted upstreams.

// What one accepted upstream connection saw. Filled by the script, published when it returns.
struct ConnRecord {
    size_t index = 0;  // accept order
    uint64_t bytes_received = 0;
    uint64_t received_hash = StreamHash{}.value();
    uint64_t bytes_sent = 0;
    IoResult read_end;   // how the read side ended (Eof normally; Reset; Timeout...)
    IoResult write_end;  // how the last write went
    Clock::time_point accepted_at{};
    Clock::time_point ended_at{};  // when the script saw the end (EOF/RST/error) or finished
    std::string note;              // free text for failure messages
    std::string describe() const;
};

class ScriptedUpstream;
// A script's read until EOF (or `stop`): the bytes' count and hash into `rec` (read_end,
// bytes_received, received_hash, ended_at), each chunk counted live on `up` as it arrives.
// The sink and source scripts read their peer with it; a case's own script can too.
void readToEof(Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream& up,
               Millis timeout = kDefaultIoTimeout);
// Runs on its own thread with the accepted socket (blocking mode). Must return within its own
// I/O deadlines, and promptly once `stop` is set (pass it as the CancelFlag).
// The script may close `fd` itself (e.g. with closeWithReset); otherwise it is closed when the
// script returns.
using ConnScript = std::function<void(Fd& fd, ConnRecord& record, const std::atomic<bool>& stop,
                                      ScriptedUpstream& upstream)>;

// Echo: read, write it back; on EOF shutdown(SHUT_WR) and close.
ConnScript echoScript();
// Sink: read until EOF counting and hashing; then send `reply_bytes` of payload `reply_seed`
// (maybe 0), shutdown(SHUT_WR), close.
ConnScript sinkScript(uint64_t reply_seed = 0, uint64_t reply_bytes = 0);
// Source: send `bytes` of payload `seed`, shutdown(SHUT_WR), then read until EOF counting and
// hashing what the client sends back, close. If the send fails, the failure is recorded and the
// script ends.
ConnScript sourceScript(uint64_t seed, uint64_t bytes);
// Send `bytes_before_reset` of payload `seed` (0 is fine), then RST (SO_LINGER {1,0} + close).
// If `wait_for_data` is set, first waits until at least one byte from the client arrived.
ConnScript resetScript(uint64_t seed = 0, uint64_t bytes_before_reset = 0,
                       bool wait_for_data = false);

class ScriptedUpstream {
  public:
    // script == nullptr: "accept and hold": the accept thread itself keeps every connection open,
    // never reads it, and closes them all in stop(). Use this for "never reads" and for holding
    // many idle connections without a thread each.
    ScriptedUpstream(int family, ConnScript script, int backlog = 4096);
    ~ScriptedUpstream();
    ScriptedUpstream(const ScriptedUpstream&) = delete;
    ScriptedUpstream& operator=(const ScriptedUpstream&) = delete;

    bool ok() const { return listening_.fd.valid(); }
    const std::string& error() const { return listening_.error; }
    uint16_t port() const { return listening_.port; }
    int family() const { return family_; }
    std::string hostPort() const { return loopbackHostPort(family_, port()); }

    size_t accepted() const { return accepted_.load(); }
    // Bytes received so far by all scripts that report live progress (sink, source, echo).
    uint64_t liveBytesReceived() const { return live_bytes_received_.load(); }
    void addLiveBytes(uint64_t n) { live_bytes_received_.fetch_add(n); }

    bool waitForAccepted(size_t n, Millis timeout);
    bool waitForFinished(size_t n, Millis timeout);
    // The record of the connection accepted `index`-th (0-based), once its script finished.
    std::optional<ConnRecord> waitForRecord(size_t index, Millis timeout);
    std::vector<ConnRecord> records() const;  // finished connections, in finish order
    size_t finished() const;

    // Stops accepting, cancels scripts, closes held connections and joins every thread.
    // Bounded: scripts observe `stop` within ~100 ms. Idempotent.
    void stop();

  private:
    void acceptLoop();
    void reapFinished(bool all);

    struct Worker {
        std::thread thread;
        std::shared_ptr<std::atomic<bool>> done;
    };

    int family_;
    ConnScript script_;
    Listening listening_;
    std::atomic<bool> stop_{false};
    std::atomic<size_t> accepted_{0};
    std::atomic<uint64_t> live_bytes_received_{0};
    std::thread acceptor_;
    std::vector<Worker> workers_;  // touched only by the accept thread and stop() after join
    std::vector<Fd> held_;         // hold mode only; accept thread, then stop() after join
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::vector<ConnRecord> finished_;
};

// Sends `total` bytes of payload `seed` in 1 MiB pieces, then shutdown(SHUT_WR), on its own
// thread. Past `hold_at` bytes it waits (at most 60 s) for release(): the stream is still
// going, whatever the speed of loopback, when the test acts in the middle of it.
class GatedSender {
  public:
    GatedSender(int fd, uint64_t seed, uint64_t total, uint64_t hold_at)
        : fd_(fd), seed_(seed), total_(total), hold_at_(hold_at), thread_([this] { run(); }) {}
    ~GatedSender() {
        cancel_.store(true);
        release();
        if (thread_.joinable()) thread_.join();
    }
    GatedSender(const GatedSender&) = delete;
    GatedSender& operator=(const GatedSender&) = delete;

    void release() {
        std::lock_guard lock(mu_);
        released_ = true;
        cv_.notify_all();
    }
    uint64_t sent() const { return sent_.load(); }
    IoResult join() {
        if (thread_.joinable()) thread_.join();
        return result_;
    }

  private:
    void run();

    int fd_;
    uint64_t seed_, total_, hold_at_;
    std::atomic<bool> cancel_{false};
    std::atomic<uint64_t> sent_{0};
    std::mutex mu_;
    std::condition_variable cv_;
    bool released_ = false;
    IoResult result_;
    std::thread thread_;  // last: starts once everything above is built
};

// ---------------------------------------------------------------------------------------------
// Small utilities.

// `n` connections to 127.0.0.1:`port` that send nothing, connected at the TCP level (the
// kernel's accept queue is enough; the server need not have accepted them). Bounded: 20 s.
std::vector<Fd> openIdle(uint16_t port, size_t n);
// How many of `fds` the peer has closed (EOF or RST), after waiting at most `timeout` for all.
size_t closedByPeer(const std::vector<Fd>& fds, Millis timeout);

// The sockets in LISTEN state on 127.0.0.1:port, from /proc/net/tcp: for a program told a port
// (nc, iperf3, nginx) that serves one connection or counts them, where a connect() to probe it
// would take its place; and to count who listens there.
int loopbackListeners4(uint16_t port);
inline bool listensOnLoopback4(uint16_t port) { return loopbackListeners4(port) > 0; }

// Polls `condition` every `interval` until it is true or `timeout` passes. Returns its last value.
bool waitUntil(const std::function<bool()>& condition, Millis timeout,
               Millis interval = Millis{20});

double secondsSince(Clock::time_point t);

// A thread that is always joined. If the test leaves early (a failed ASSERT), the destructor
// first shuts `fd` down, so a send or recv blocked on it returns at once, then joins.
class Background {
  public:
    Background(int fd, std::function<void()> fn) : fd_(fd), thread_(std::move(fn)) {}
    ~Background() {
        if (!thread_.joinable()) return;
        ::shutdown(fd_, SHUT_RDWR);
        thread_.join();
    }
    void join() { thread_.join(); }

  private:
    int fd_;
    std::thread thread_;
};

}  // namespace zcrelay::test
