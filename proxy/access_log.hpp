#pragma once
// The access log: one line per finished connection, written off the data path.
//
// Workers never block, lock, allocate or make a syscall to log. Each worker (producer) owns one
// single-producer/single-consumer ring of fixed-size AccessRecords, preallocated at open(); push()
// copies a record in and publishes it with one release store. When the ring is full the record
// is dropped and the producer's counter goes up: a slow disk must cost log lines, never latency.
// One writer thread drains every ring each kFlushInterval (or at once on stop), formats the
// records and write()s them in batches of whole lines to the sink: stdout, or a file opened
// O_WRONLY|O_APPEND|O_CREAT, mode 0640. O_APPEND keeps each write() at the end of the file even if
// another process appends too. When the writer notices new drops it logs one warning,
// "access log: N records dropped".
//
// Field order is fixed; times are UTC with microseconds; durations are milliseconds with three
// decimals (exact, computed from integer microseconds).
//
// JSON lines (AccessLogFormat::Json):
//   {"time":"2026-11-22T18:06:19.123456Z","listener":"web","client":"127.0.0.1:50000",
//    "cluster":"app","backend":"127.0.0.1:9001","attempts":1,"connect_ms":0.123,
//    "duration_ms":12.345,"bytes_up":123,"bytes_down":456,"termination":"done","path":"splice",
//    "route":"api","sni":"api.example.com","alpn":"h2,http/1.1"}
//   (one line; wrapped here.) Strings are JSON-escaped: '"', '\\' and control characters are
//   escaped, bytes that are not valid UTF-8 become U+FFFD so every line parses. connect_ms is
//   null when the upstream never connected; "backend" is "" when none was chosen.
//
// Text (AccessLogFormat::Text), space separated:
//   2026-11-22T18:06:19.123456Z web 127.0.0.1:50000 app/127.0.0.1:9001 attempts=1
//   connect_ms=0.123 duration_ms=12.345 up=123 down=456 done splice route=api
//   sni=api.example.com alpn=h2,http/1.1
//   (one line; wrapped here.) "-" stands for an empty backend, client, path, route, sni or alpn
//   and a missing connect time. Control characters, spaces and '\\' inside a field are written \xNN so a field
//   cannot split into two or forge a second line.
//
// bytes_up counts client -> backend, bytes_down backend -> client. "termination" is the
// CloseReason label, the same word the metrics use.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>

#include "address.hpp"
#include "reasons.hpp"
#include "result.hpp"
#include "unique_fd.hpp"

namespace zcrelay {

enum class AccessLogFormat : uint8_t { Json, Text };

// What a worker knows when a connection ends. Fixed size and trivially copyable so that pushing
// it is a memcpy into a preallocated slot. Strings are NUL-terminated and truncated to fit (use
// copyField, which never cuts a UTF-8 sequence in half).
struct AccessRecord {
    int64_t start_unix_us = 0;      // when the connection was accepted (wall clock, microseconds)
    uint64_t duration_us = 0;       // accept -> close
    int64_t connect_us = -1;        // upstream connect time; -1 if never connected
    uint64_t bytes_upstream = 0;    // client -> backend
    uint64_t bytes_downstream = 0;  // backend -> client
    SocketAddress client;           // the real client (after PROXY protocol, if accepted)
    char listener[48] = {};
    char cluster[48] = {};
    char backend[112] = {};  // "127.0.0.1:9001", "unix:/run/app.sock"; "" if none was chosen
    CloseReason reason = CloseReason::Done;
    uint8_t attempts = 0;  // connect attempts made (retries + 1)
    char path[16] = {};    // data path: "splice", "copy", "sockmap", "splice>sockmap"
    // routes: the route taken, and what the client's ClientHello said ("" when not inspected).
    char route[48] = {};
    char sni[256] = {};
    char alpn[64] = {};  // offered protocols, comma-joined, cut after a whole one
};
static_assert(std::is_trivially_copyable_v<AccessRecord>);

// Copies `text` into a fixed field, truncated to N-1 bytes at a UTF-8 character boundary, and
// NUL-terminates it. No allocation: workers call it.
template <size_t N>
void copyField(char (&field)[N], std::string_view text) {
    static_assert(N > 0);
    size_t len = text.size();
    if (len > N - 1) {
        len = N - 1;
        // text[len] is the first byte left out; if it continues a sequence, drop the whole
        // sequence rather than leave its first bytes behind.
        while (len > 0 && (static_cast<unsigned char>(text[len]) & 0xC0) == 0x80) --len;
    }
    for (size_t i = 0; i < len; ++i) field[i] = text[i];
    field[len] = '\0';
}

// The formatted line (see the formats above): appended to `out`, ending with '\n'.
void formatAccessRecord(const AccessRecord& r, AccessLogFormat f, std::string& out);

class AccessLog {
  public:
    // 4096 records of ~770 bytes: 3.2 MB per worker, and at one drain per kFlushInterval a
    // worker can finish ~80k connections a second before it drops a line.
    static constexpr unsigned kDefaultCapacity = 4096;
    static constexpr std::chrono::milliseconds kFlushInterval{50};

    // path: "", "-" or "stdout" = stdout; anything else is a file, created if missing.
    // producers: how many rings (one per worker). capacity: records per ring, rounded up to a
    // power of two. Errors are returned (errno and "open access log"), the caller adds the path.
    static Result<std::unique_ptr<AccessLog>> open(const std::string& path, AccessLogFormat format,
                                                   unsigned producers,
                                                   unsigned capacity = kDefaultCapacity);
    ~AccessLog();
    AccessLog(const AccessLog&) = delete;
    AccessLog& operator=(const AccessLog&) = delete;

    // Producer `p` only (one thread per p). Wait-free: no lock, no allocation, no syscall.
    // false if the ring was full: the record is dropped and counted.
    bool push(unsigned p, const AccessRecord& r);
    // Records producer `p` has dropped since open(); any thread (for metrics).
    uint64_t dropped(unsigned p) const;
    uint64_t totalDropped() const;
    unsigned producers() const { return producers_; }
    unsigned capacity() const { return mask_ + 1; }

    // Any thread, async-signal-safe (one atomic store): the writer reopens the file by path
    // before its next write, within kFlushInterval, so logrotate's rename + SIGHUP works.
    // If the reopen fails the writer logs it and keeps writing to the old file. No-op on stdout.
    void reopen();
    // Wakes the writer, which drains every ring, writes, and exits; then joins it. Idempotent,
    // called by the destructor too. Records pushed after stop() began may never be written:
    // stop the producers first.
    void stop();

  private:
    struct Ring;

    AccessLog(std::string path, AccessLogFormat format, unsigned producers, unsigned capacity);
    void run();
    void drainAll();
    void drainRing(Ring& ring);
    void flush();
    void reopenNow();

    const std::string path_;  // empty for stdout
    const AccessLogFormat format_;
    const unsigned producers_;
    const uint64_t mask_;  // capacity - 1
    std::unique_ptr<Ring[]> rings_;

    // Writer thread only, after open().
    UniqueFd file_;
    int fd_ = STDOUT_FILENO;
    std::string batch_;
    uint64_t reportedDrops_ = 0;
    bool writeFailing_ = false;  // log a failing sink once, not once per batch

    std::atomic<bool> reopenRequested_{false};
    std::mutex mutex_;  // guards stopRequested_ for the condition variable
    std::condition_variable wake_;
    bool stopRequested_ = false;
    std::mutex stopMutex_;  // a second stop() waits for the first to finish joining
    std::thread writer_;
};

}  // namespace zcrelay
