#include "access_log.hpp"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <system_error>

#include "log.hpp"

namespace zcrelay {

// Producer and writer each write their own index; keeping them on separate cache lines stops
// every push from invalidating the line the writer polls, and the reverse.
struct alignas(64) AccessLog::Ring {
    // Producer's line: tail is written by the worker only, published with release.
    alignas(64) std::atomic<uint64_t> tail{0};
    uint64_t cachedHead = 0;  // the worker's last view of head: saves a shared read per push
    std::atomic<uint64_t> dropped{0};  // written by the worker only, read by anyone
    std::unique_ptr<AccessRecord[]> slots;
    // Writer's line: head is written by the writer only, published with release.
    alignas(64) std::atomic<uint64_t> head{0};
};

namespace {

// Lock-free atomics are what make push() wait-free; a libatomic lock would defeat the design.
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// O_APPEND: every write lands at the current end, even after logrotate's copytruncate or with a
// second writer. O_CLOEXEC: a future exec'd helper must not inherit the log.
constexpr int kOpenFlags = O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC;
constexpr mode_t kFileMode = 0640;
// Lines are written in batches of about this size: one syscall per ~150 JSON lines.
constexpr size_t kBatchBytes = 64 * 1024;
// Under sustained overload drops happen every pass; one warning a second is enough to notice.
constexpr std::chrono::seconds kDropReportInterval{1};
constexpr unsigned kMaxCapacity = 1u << 24;

bool isStdout(const std::string& path) { return path.empty() || path == "-" || path == "stdout"; }

}  // namespace

AccessLog::AccessLog(std::string path, AccessLogFormat format, unsigned producers,
                     unsigned capacity)
    : path_(std::move(path)),
      format_(format),
      producers_(producers),
      mask_(capacity - 1),
      rings_(std::make_unique<Ring[]>(producers)) {
    for (unsigned p = 0; p < producers_; ++p) {
        // make_unique value-initialises: every slot page is touched now, not on a worker's
        // first pushes (a page fault on the data path is the stall this design avoids).
        rings_[p].slots = std::make_unique<AccessRecord[]>(capacity);
    }
    batch_.reserve(kBatchBytes + 4096);
}

Result<std::unique_ptr<AccessLog>> AccessLog::open(const std::string& path, AccessLogFormat format,
                                                   unsigned producers, unsigned capacity) {
    if (capacity > kMaxCapacity) return sysError("access log ring capacity", EINVAL);
    const unsigned rounded = std::bit_ceil(std::max(capacity, 1u));
    const bool to_stdout = isStdout(path);
    std::unique_ptr<AccessLog> log(
        new AccessLog(to_stdout ? std::string() : path, format, producers, rounded));

    if (to_stdout) {
        // A relay started with stdout closed would write lines into whatever fd 1 becomes.
        if (::fcntl(STDOUT_FILENO, F_GETFD) < 0) return sysError("access log on stdout");
    } else {
        const int fd = ::open(path.c_str(), kOpenFlags, kFileMode);
        if (fd < 0) return sysError("open access log");
        log->file_.reset(fd);
        log->fd_ = fd;
    }

    try {
        log->writer_ = std::thread(&AccessLog::run, log.get());
    } catch (const std::system_error& e) {
        return sysError("start access log thread", e.code().value());
    }
    return log;
}

AccessLog::~AccessLog() { stop(); }

bool AccessLog::push(unsigned p, const AccessRecord& r) {
    if (p >= producers_) return false;
    Ring& ring = rings_[p];
    const uint64_t tail = ring.tail.load(std::memory_order_relaxed);
    if (tail - ring.cachedHead > mask_) {
        // Looks full from the cached view; only now pay for reading the writer's line.
        ring.cachedHead = ring.head.load(std::memory_order_acquire);
        if (tail - ring.cachedHead > mask_) {
            // Single writer of this counter: a plain load+store, no locked read-modify-write.
            ring.dropped.store(ring.dropped.load(std::memory_order_relaxed) + 1,
                               std::memory_order_relaxed);
            return false;
        }
    }
    ring.slots[tail & mask_] = r;
    ring.tail.store(tail + 1, std::memory_order_release);
    return true;
}

uint64_t AccessLog::dropped(unsigned p) const {
    return p < producers_ ? rings_[p].dropped.load(std::memory_order_relaxed) : 0;
}

uint64_t AccessLog::totalDropped() const {
    uint64_t total = 0;
    for (unsigned p = 0; p < producers_; ++p) total += dropped(p);
    return total;
}

void AccessLog::reopen() { reopenRequested_.store(true, std::memory_order_release); }

void AccessLog::stop() {
    std::lock_guard stop_lock(stopMutex_);
    if (!writer_.joinable()) return;
    {
        std::lock_guard lock(mutex_);
        stopRequested_ = true;
    }
    wake_.notify_one();
    writer_.join();
}

void AccessLog::run() {
    setLogThreadName("access-log");
    auto last_drop_report = std::chrono::steady_clock::now() - kDropReportInterval;
    for (;;) {
        bool stopping = false;
        {
            std::unique_lock lock(mutex_);
            // Workers never signal: waking a thread is a syscall. A timed poll bounds the
            // latency of a line instead, and stop() wakes us at once.
            wake_.wait_for(lock, kFlushInterval, [this] { return stopRequested_; });
            stopping = stopRequested_;
        }
        drainAll();

        const uint64_t total = totalDropped();
        const auto now = std::chrono::steady_clock::now();
        if (total > reportedDrops_ && (stopping || now - last_drop_report >= kDropReportInterval)) {
            LOG_WARN("access log: %llu records dropped",
                     static_cast<unsigned long long>(total - reportedDrops_));
            reportedDrops_ = total;
            last_drop_report = now;
        }
        if (stopping) return;
    }
}

void AccessLog::drainAll() {
    if (reopenRequested_.exchange(false, std::memory_order_acq_rel)) reopenNow();
    for (unsigned p = 0; p < producers_; ++p) drainRing(rings_[p]);
    if (!batch_.empty()) flush();
}

void AccessLog::drainRing(Ring& ring) {
    const uint64_t tail = ring.tail.load(std::memory_order_acquire);
    uint64_t head = ring.head.load(std::memory_order_relaxed);
    while (head != tail) {
        formatAccessRecord(ring.slots[head & mask_], format_, batch_);
        ++head;
        if (batch_.size() >= kBatchBytes) {
            flush();
            // The slots are formatted: hand them back now, not after the whole ring.
            ring.head.store(head, std::memory_order_release);
        }
    }
    ring.head.store(head, std::memory_order_release);
}

void AccessLog::flush() {
    const char* sink = path_.empty() ? "stdout" : path_.c_str();
    size_t off = 0;
    while (off < batch_.size()) {
        const ssize_t n = ::write(fd_, batch_.data() + off, batch_.size() - off);
        if (n >= 0) {
            off += static_cast<size_t>(n);  // a pipe may take part of a batch; write the rest
            continue;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN) {
            // stdout inherited non-blocking: this thread may wait, workers never do.
            pollfd pfd{fd_, POLLOUT, 0};
            if (::poll(&pfd, 1, 1000) > 0) continue;
            errno = EAGAIN;
        }
        if (!writeFailing_) {
            LOG_ERROR("access log: write to %s: %s; lines are lost until it works again", sink,
                      std::strerror(errno));
            writeFailing_ = true;
        }
        batch_.clear();
        return;
    }
    if (writeFailing_) {
        LOG_INFO("access log: writing to %s again", sink);
        writeFailing_ = false;
    }
    batch_.clear();
}

void AccessLog::reopenNow() {
    if (path_.empty()) return;  // stdout belongs to whoever started us
    const int fd = ::open(path_.c_str(), kOpenFlags, kFileMode);
    if (fd < 0) {
        LOG_ERROR("access log: reopen %s: %s; still writing to the old file", path_.c_str(),
                  std::strerror(errno));
        return;
    }
    file_.reset(fd);
    fd_ = fd;
    LOG_INFO("access log: reopened %s", path_.c_str());
}

}  // namespace zcrelay
