#include "support/loopback.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace zcrelay::test {

static_assert(std::endian::native == std::endian::little, "payload words are memcpy'd as LE");

void Fd::reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
}

// ---------------------------------------------------------------------------------------------
// Addresses.

std::string loopbackHost(int family) { return family == AF_INET6 ? "::1" : "127.0.0.1"; }

std::string loopbackHostPort(int family, uint16_t port) {
    return family == AF_INET6 ? "[::1]:" + std::to_string(port)
                              : "127.0.0.1:" + std::to_string(port);
}

const char* familyName(int family) { return family == AF_INET6 ? "ipv6" : "ipv4"; }

namespace {

struct SockAddr {
    sockaddr_storage storage{};
    socklen_t len = 0;
    int family = AF_UNSPEC;
};

// Only loopback addresses: these tests must never send a packet anywhere else.
bool loopbackAddr(const std::string& host, uint16_t port, SockAddr& out, std::string& error) {
    in_addr a4{};
    in6_addr a6{};
    if (inet_pton(AF_INET, host.c_str(), &a4) == 1) {
        if ((ntohl(a4.s_addr) >> 24) != 127) {
            error = "refusing non-loopback address " + host;
            return false;
        }
        auto* sin = reinterpret_cast<sockaddr_in*>(&out.storage);
        sin->sin_family = AF_INET;
        sin->sin_port = htons(port);
        sin->sin_addr = a4;
        out.len = sizeof(sockaddr_in);
        out.family = AF_INET;
        return true;
    }
    if (inet_pton(AF_INET6, host.c_str(), &a6) == 1) {
        if (!IN6_IS_ADDR_LOOPBACK(&a6)) {
            error = "refusing non-loopback address " + host;
            return false;
        }
        auto* sin6 = reinterpret_cast<sockaddr_in6*>(&out.storage);
        sin6->sin6_family = AF_INET6;
        sin6->sin6_port = htons(port);
        sin6->sin6_addr = a6;
        out.len = sizeof(sockaddr_in6);
        out.family = AF_INET6;
        return true;
    }
    error = "not a numeric address: " + host;
    return false;
}

std::string errnoText(int err) { return std::string(std::strerror(err)); }

uint16_t boundPort(int fd) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return 0;
    if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
    return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

Fd bindLoopbackSocket(int family, std::string& error, uint16_t& port) {
    SockAddr addr;
    if (!loopbackAddr(loopbackHost(family), 0, addr, error)) return Fd{};
    Fd fd(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) {
        error = "socket: " + errnoText(errno);
        return Fd{};
    }
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr.storage), addr.len) != 0) {
        error = std::string("bind ") + loopbackHost(family) + ": " + errnoText(errno);
        return Fd{};
    }
    port = boundPort(fd.get());
    return fd;
}

enum class Wait { Ready, Timeout, Cancelled, Error };

// Polls one fd for `events` until ready or the deadline, in slices of <= 100 ms so a cancel flag
// is noticed promptly. POLLERR/POLLHUP count as ready: the following syscall reports them.
Wait waitFor(int fd, short events, Clock::time_point deadline, CancelFlag cancel, int& err) {
    for (;;) {
        if (cancel != nullptr && cancel->load()) return Wait::Cancelled;
        auto now = Clock::now();
        if (now >= deadline) return Wait::Timeout;
        auto left = std::chrono::duration_cast<Millis>(deadline - now).count() + 1;
        int slice = static_cast<int>(std::min<int64_t>(left, 100));
        pollfd p{fd, events, 0};
        int r = ::poll(&p, 1, slice);
        if (r > 0) return Wait::Ready;
        if (r < 0 && errno != EINTR) {
            err = errno;
            return Wait::Error;
        }
    }
}

IoResult fromWait(Wait w, uint64_t bytes, int err) {
    IoResult r;
    r.bytes = bytes;
    r.err = err;
    switch (w) {
        case Wait::Timeout:
            r.status = IoStatus::Timeout;
            break;
        case Wait::Cancelled:
            r.status = IoStatus::Cancelled;
            break;
        default:
            r.status = IoStatus::Error;
            break;
    }
    return r;
}

IoResult fromErrno(int err, uint64_t bytes) {
    IoResult r;
    r.bytes = bytes;
    r.err = err;
    r.status = (err == ECONNRESET || err == EPIPE || err == ECONNABORTED) ? IoStatus::Reset
                                                                          : IoStatus::Error;
    return r;
}

uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

uint64_t payloadWord(uint64_t seed, uint64_t block) {
    return splitmix64(seed * 0xD1B54A32D192ED03ULL ^ block);
}

}  // namespace

Listening listenLoopback(int family, int backlog) {
    Listening out;
    out.fd = bindLoopbackSocket(family, out.error, out.port);
    if (!out.fd) return out;
    if (::listen(out.fd.get(), backlog) != 0) {
        out.error = "listen: " + errnoText(errno);
        out.fd.reset();
    }
    return out;
}

Bound bindLoopbackNoListen(int family) {
    Bound out;
    out.fd = bindLoopbackSocket(family, out.error, out.port);
    return out;
}

void setNonBlocking(int fd, bool on) {
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0) return;
    fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void closeWithReset(Fd& fd) {
    if (!fd) return;
    linger lg{1, 0};
    setsockopt(fd.get(), SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    fd.reset();
}

Connected connectTo(const std::string& host, uint16_t port, Millis timeout) {
    Connected out;
    SockAddr addr;
    if (!loopbackAddr(host, port, addr, out.error)) {
        out.err = EINVAL;
        return out;
    }
    Fd fd(::socket(addr.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) {
        out.err = errno;
        out.error = "socket: " + errnoText(out.err);
        return out;
    }
    auto where = host + " port " + std::to_string(port);
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr.storage), addr.len) != 0) {
        if (errno != EINPROGRESS) {
            out.err = errno;
            out.error = "connect " + where + ": " + errnoText(out.err);
            return out;
        }
        int perr = 0;
        Wait w = waitFor(fd.get(), POLLOUT, Clock::now() + timeout, nullptr, perr);
        if (w != Wait::Ready) {
            out.err = w == Wait::Timeout ? ETIMEDOUT : perr;
            out.error =
                "connect " + where + ": " +
                (w == Wait::Timeout ? "no answer within " + std::to_string(timeout.count()) + " ms"
                                    : errnoText(perr));
            return out;
        }
        int soerr = 0;
        socklen_t len = sizeof soerr;
        getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &soerr, &len);
        if (soerr != 0) {
            out.err = soerr;
            out.error = "connect " + where + ": " + errnoText(soerr);
            return out;
        }
    }
    setNonBlocking(fd.get(), false);
    int one = 1;
    setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    out.fd = std::move(fd);
    return out;
}

// ---------------------------------------------------------------------------------------------
// I/O.

const char* ioStatusName(IoStatus s) {
    switch (s) {
        case IoStatus::Ok:
            return "Ok";
        case IoStatus::Eof:
            return "Eof";
        case IoStatus::Reset:
            return "Reset";
        case IoStatus::Timeout:
            return "Timeout";
        case IoStatus::Cancelled:
            return "Cancelled";
        case IoStatus::Error:
            return "Error";
    }
    return "?";
}

std::string IoResult::describe() const {
    std::ostringstream os;
    os << ioStatusName(status);
    if (err != 0) os << " (" << errnoText(err) << ")";
    os << " after " << bytes << " bytes";
    return os.str();
}

IoResult writeAll(int fd, const void* data, size_t len, Millis timeout, CancelFlag cancel) {
    auto deadline = Clock::now() + timeout;
    const auto* p = static_cast<const uint8_t*>(data);
    uint64_t done = 0;
    while (done < len) {
        ssize_t n = ::send(fd, p + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            done += static_cast<uint64_t>(n);
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return fromErrno(errno, done);
        int err = 0;
        Wait w = waitFor(fd, POLLOUT, deadline, cancel, err);
        if (w != Wait::Ready) return fromWait(w, done, err);
    }
    return IoResult{IoStatus::Ok, done, 0};
}

IoResult readSome(int fd, void* data, size_t cap, Millis timeout, CancelFlag cancel) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
        ssize_t n = ::recv(fd, data, cap, MSG_DONTWAIT);
        if (n > 0) return IoResult{IoStatus::Ok, static_cast<uint64_t>(n), 0};
        if (n == 0) return IoResult{IoStatus::Eof, 0, 0};
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return fromErrno(errno, 0);
        int err = 0;
        Wait w = waitFor(fd, POLLIN, deadline, cancel, err);
        if (w != Wait::Ready) return fromWait(w, 0, err);
    }
}

IoResult readExactly(int fd, void* data, size_t len, Millis timeout, CancelFlag cancel) {
    auto deadline = Clock::now() + timeout;
    auto* p = static_cast<uint8_t*>(data);
    uint64_t done = 0;
    while (done < len) {
        auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
        IoResult r = readSome(fd, p + done, len - done, std::max(left, Millis{0}), cancel);
        if (!r.ok()) {
            r.bytes = done;
            return r;
        }
        done += r.bytes;
    }
    return IoResult{IoStatus::Ok, done, 0};
}

IoResult readStreamUntilEof(int fd, const std::function<void(std::span<const uint8_t>)>& onData,
                            Millis timeout, CancelFlag cancel) {
    auto deadline = Clock::now() + timeout;
    std::vector<uint8_t> buf(256 << 10);
    uint64_t total = 0;
    for (;;) {
        auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
        IoResult r = readSome(fd, buf.data(), buf.size(), std::max(left, Millis{0}), cancel);
        if (!r.ok()) {
            r.bytes = total;
            return r;  // Eof is the success case
        }
        total += r.bytes;
        if (onData) onData(std::span<const uint8_t>(buf.data(), r.bytes));
    }
}

IoResult readUntilEof(int fd, std::string& out, Millis timeout, size_t limit, CancelFlag cancel) {
    return readStreamUntilEof(
        fd,
        [&](std::span<const uint8_t> d) {
            size_t room = limit > out.size() ? limit - out.size() : 0;
            out.append(reinterpret_cast<const char*>(d.data()), std::min(room, d.size()));
        },
        timeout, cancel);
}

IoResult echoBack(int fd, std::string_view bytes, Millis timeout) {
    IoResult w = writeAll(fd, bytes.data(), bytes.size(), timeout);
    if (!w.ok()) return w;
    std::string back(bytes.size(), '\0');
    IoResult r = readExactly(fd, back.data(), back.size(), timeout);
    if (r.ok() && back != bytes) {
        r.status = IoStatus::Error;
        r.err = EBADMSG;
    }
    return r;
}

std::string endStream(int fd, Millis timeout) {
    ::shutdown(fd, SHUT_WR);
    std::string rest;
    IoResult end = readUntilEof(fd, rest, timeout);
    if (end.status == IoStatus::Eof && rest.empty()) return "";
    return "end: " + end.describe() + ", " + std::to_string(rest.size()) + " bytes more";
}

std::string echoExchange(const std::string& host, uint16_t port, Millis connect_timeout,
                         Millis io_timeout) {
    Connected c = connectTo(host, port, connect_timeout);
    if (!c.fd) return "connect: " + c.error;
    const char out[8] = {'e', 'x', 'c', 'h', 'a', 'n', 'g', 'e'};
    IoResult w = writeAll(c.fd.get(), out, sizeof out, io_timeout);
    if (!w.ok()) return "send: " + w.describe();
    char in[8] = {};
    IoResult r = readExactly(c.fd.get(), in, sizeof in, io_timeout);
    if (!r.ok()) return "echo: " + r.describe();
    return std::string(in, 8) == std::string(out, 8) ? "" : "echo differs";
}

IoResult waitForPeerClose(int fd, Millis timeout) {
    return readStreamUntilEof(fd, nullptr, timeout, nullptr);
}

// ---------------------------------------------------------------------------------------------
// Payload.

void fillPayload(uint64_t seed, uint64_t offset, std::span<uint8_t> out) {
    size_t i = 0;
    uint64_t block = offset / 8;
    size_t skip = offset % 8;
    if (skip != 0 && !out.empty()) {
        uint64_t w = payloadWord(seed, block++);
        uint8_t bytes[8];
        std::memcpy(bytes, &w, 8);
        for (size_t k = skip; k < 8 && i < out.size(); ++k) out[i++] = bytes[k];
    }
    for (; i + 8 <= out.size(); i += 8) {
        uint64_t w = payloadWord(seed, block++);
        std::memcpy(out.data() + i, &w, 8);
    }
    if (i < out.size()) {
        uint64_t w = payloadWord(seed, block);
        uint8_t bytes[8];
        std::memcpy(bytes, &w, 8);
        for (size_t k = 0; i < out.size(); ++k) out[i++] = bytes[k];
    }
}

void StreamHash::update(std::span<const uint8_t> data) {
    uint64_t h = hash_;
    for (uint8_t b : data) {
        h ^= b;
        h *= 0x100000001b3ULL;
    }
    hash_ = h;
    bytes_ += data.size();
}

uint64_t payloadHash(uint64_t seed, uint64_t length) {
    StreamHash h;
    std::vector<uint8_t> buf(1 << 20);
    for (uint64_t off = 0; off < length;) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), length - off));
        fillPayload(seed, off, std::span<uint8_t>(buf.data(), n));
        h.update(std::span<const uint8_t>(buf.data(), n));
        off += n;
    }
    return h.value();
}

void PayloadVerifier::update(std::span<const uint8_t> data) {
    if (data.empty()) return;
    if (first_mismatch_ < 0) {
        scratch_.resize(data.size());
        fillPayload(seed_, bytes_, std::span<uint8_t>(scratch_.data(), data.size()));
        if (std::memcmp(scratch_.data(), data.data(), data.size()) != 0) {
            for (size_t i = 0; i < data.size(); ++i) {
                if (scratch_[i] != data[i]) {
                    first_mismatch_ = static_cast<int64_t>(bytes_ + i);
                    break;
                }
            }
        }
    }
    bytes_ += data.size();
}

IoResult sendPayload(int fd, uint64_t seed, uint64_t length, Millis timeout, CancelFlag cancel) {
    return sendPayloadAt(fd, seed, 0, length, timeout, cancel);
}

IoResult sendPayloadAt(int fd, uint64_t seed, uint64_t offset, uint64_t length, Millis timeout,
                       CancelFlag cancel) {
    auto deadline = Clock::now() + timeout;
    std::vector<uint8_t> buf(static_cast<size_t>(std::min<uint64_t>(length, 256 << 10)));
    uint64_t off = 0;
    while (off < length) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), length - off));
        fillPayload(seed, offset + off, std::span<uint8_t>(buf.data(), n));
        auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
        IoResult r = writeAll(fd, buf.data(), n, std::max(left, Millis{0}), cancel);
        off += r.bytes;
        if (!r.ok()) {
            r.bytes = off;
            return r;
        }
    }
    return IoResult{IoStatus::Ok, off, 0};
}

std::string ReceiveCheck::describe() const {
    std::ostringstream os;
    os << "received " << bytes << " bytes, read ended " << io.describe();
    if (first_mismatch >= 0) os << ", FIRST MISMATCH at byte " << first_mismatch;
    return os.str();
}

ReceiveCheck receivePayloadUntilEof(int fd, uint64_t seed, Millis timeout, CancelFlag cancel) {
    PayloadVerifier v(seed);
    ReceiveCheck out;
    out.io = readStreamUntilEof(
        fd, [&](std::span<const uint8_t> d) { v.update(d); }, timeout, cancel);
    out.bytes = v.bytes();
    out.first_mismatch = v.firstMismatch();
    return out;
}

ReceiveCheck echoRoundTrip(int fd, uint64_t seed, uint64_t length, Millis timeout,
                           IoResult* send_result) {
    IoResult sent;
    std::thread writer([&] {
        sent = sendPayload(fd, seed, length, timeout);
        if (sent.ok()) ::shutdown(fd, SHUT_WR);
    });
    ReceiveCheck got = receivePayloadUntilEof(fd, seed, timeout);
    if (got.io.status != IoStatus::Eof) ::shutdown(fd, SHUT_RDWR);  // unblock the writer
    writer.join();
    if (send_result != nullptr) *send_result = sent;
    return got;
}

// ---------------------------------------------------------------------------------------------
// Scripts.

std::string ConnRecord::describe() const {
    std::ostringstream os;
    os << "upstream conn #" << index << ": received " << bytes_received << " bytes (hash 0x"
       << std::hex << received_hash << std::dec << "), sent " << bytes_sent
       << ", read end: " << read_end.describe() << ", write end: " << write_end.describe();
    if (!note.empty()) os << ", " << note;
    return os.str();
}

ConnScript echoScript() {
    return [](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream& up) {
        std::vector<uint8_t> buf(64 << 10);
        StreamHash h;
        for (;;) {
            IoResult r = readSome(fd.get(), buf.data(), buf.size(), kDefaultIoTimeout, &stop);
            if (!r.ok()) {
                rec.read_end = r;
                rec.read_end.bytes = h.bytes();
                break;
            }
            h.update(std::span<const uint8_t>(buf.data(), r.bytes));
            up.addLiveBytes(r.bytes);
            IoResult w = writeAll(fd.get(), buf.data(), r.bytes, kDefaultIoTimeout, &stop);
            rec.bytes_sent += w.bytes;
            rec.write_end = w;
            if (!w.ok()) break;
        }
        rec.ended_at = Clock::now();
        rec.bytes_received = h.bytes();
        rec.received_hash = h.value();
        if (rec.read_end.status == IoStatus::Eof) ::shutdown(fd.get(), SHUT_WR);
    };
}

void readToEof(Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream& up,
               Millis timeout) {
    StreamHash h;
    rec.read_end = readStreamUntilEof(
        fd.get(),
        [&](std::span<const uint8_t> d) {
            h.update(d);
            up.addLiveBytes(d.size());
        },
        timeout, &stop);
    rec.ended_at = Clock::now();
    rec.bytes_received = h.bytes();
    rec.received_hash = h.value();
}

ConnScript sinkScript(uint64_t reply_seed, uint64_t reply_bytes) {
    return [=](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream& up) {
        readToEof(fd, rec, stop, up);
        if (rec.read_end.status != IoStatus::Eof) return;
        if (reply_bytes > 0) {
            rec.write_end =
                sendPayload(fd.get(), reply_seed, reply_bytes, kDefaultIoTimeout, &stop);
            rec.bytes_sent = rec.write_end.bytes;
        }
        ::shutdown(fd.get(), SHUT_WR);
    };
}

ConnScript sourceScript(uint64_t seed, uint64_t bytes) {
    return [=](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream& up) {
        rec.write_end = sendPayload(fd.get(), seed, bytes, kDefaultIoTimeout, &stop);
        rec.bytes_sent = rec.write_end.bytes;
        if (!rec.write_end.ok()) {
            rec.ended_at = Clock::now();
            rec.note = "send failed";
            return;
        }
        ::shutdown(fd.get(), SHUT_WR);
        readToEof(fd, rec, stop, up);
    };
}

ConnScript resetScript(uint64_t seed, uint64_t bytes_before_reset, bool wait_for_data) {
    return [=](Fd& fd, ConnRecord& rec, const std::atomic<bool>& stop, ScriptedUpstream& up) {
        if (wait_for_data) {
            std::vector<uint8_t> buf(64 << 10);
            rec.read_end = readSome(fd.get(), buf.data(), buf.size(), kDefaultIoTimeout, &stop);
            rec.bytes_received = rec.read_end.bytes;
            up.addLiveBytes(rec.read_end.bytes);
            if (!rec.read_end.ok()) {
                rec.ended_at = Clock::now();
                rec.note = "no data arrived before the planned reset";
                return;
            }
        }
        if (bytes_before_reset > 0) {
            rec.write_end =
                sendPayload(fd.get(), seed, bytes_before_reset, kDefaultIoTimeout, &stop);
            rec.bytes_sent = rec.write_end.bytes;
        }
        closeWithReset(fd);
        rec.ended_at = Clock::now();
        rec.note = "sent RST";
    };
}

// ---------------------------------------------------------------------------------------------
// ScriptedUpstream.

ScriptedUpstream::ScriptedUpstream(int family, ConnScript script, int backlog)
    : family_(family), script_(std::move(script)), listening_(listenLoopback(family, backlog)) {
    if (!listening_.fd) return;
    setNonBlocking(listening_.fd.get(), true);
    acceptor_ = std::thread([this] { acceptLoop(); });
}

ScriptedUpstream::~ScriptedUpstream() { stop(); }

void ScriptedUpstream::acceptLoop() {
    while (!stop_.load()) {
        reapFinished(false);
        pollfd p{listening_.fd.get(), POLLIN, 0};
        int r = ::poll(&p, 1, 50);
        if (r <= 0) continue;
        for (;;) {
            int c = ::accept4(listening_.fd.get(), nullptr, nullptr, SOCK_CLOEXEC);
            if (c < 0) break;  // EAGAIN: drained (or a transient error); poll again
            Fd conn(c);
            int one = 1;
            setsockopt(conn.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            // Counted before the script runs: once a client has seen anything the script sent,
            // accepted() already includes its connection.
            size_t index = 0;
            {
                std::lock_guard lock(mu_);
                index = accepted_.fetch_add(1);
            }
            cv_.notify_all();
            if (!script_) {
                held_.push_back(std::move(conn));
            } else {
                auto done = std::make_shared<std::atomic<bool>>(false);
                Worker w;
                w.done = done;
                w.thread = std::thread([this, index, done, fd = std::move(conn)]() mutable {
                    ConnRecord rec;
                    rec.index = index;
                    rec.accepted_at = Clock::now();
                    try {
                        script_(fd, rec, stop_, *this);
                    } catch (const std::exception& e) {
                        rec.note = std::string("script threw: ") + e.what();
                    }
                    if (rec.ended_at == Clock::time_point{}) rec.ended_at = Clock::now();
                    fd.reset();
                    {
                        std::lock_guard lock(mu_);
                        finished_.push_back(std::move(rec));
                    }
                    cv_.notify_all();
                    done->store(true);
                });
                workers_.push_back(std::move(w));
            }
        }
    }
}

void ScriptedUpstream::reapFinished(bool all) {
    auto it = std::remove_if(workers_.begin(), workers_.end(), [all](Worker& w) {
        if (all || w.done->load()) {
            if (w.thread.joinable()) w.thread.join();
            return true;
        }
        return false;
    });
    workers_.erase(it, workers_.end());
}

void ScriptedUpstream::stop() {
    stop_.store(true);
    if (acceptor_.joinable()) acceptor_.join();
    reapFinished(true);
    held_.clear();
    listening_.fd.reset();
}

bool ScriptedUpstream::waitForAccepted(size_t n, Millis timeout) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return accepted_.load() >= n; });
}

bool ScriptedUpstream::waitForFinished(size_t n, Millis timeout) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return finished_.size() >= n; });
}

std::optional<ConnRecord> ScriptedUpstream::waitForRecord(size_t index, Millis timeout) {
    std::unique_lock lock(mu_);
    std::optional<ConnRecord> found;
    cv_.wait_for(lock, timeout, [&] {
        for (const ConnRecord& r : finished_) {
            if (r.index == index) {
                found = r;
                return true;
            }
        }
        return false;
    });
    return found;
}

std::vector<ConnRecord> ScriptedUpstream::records() const {
    std::lock_guard lock(mu_);
    return finished_;
}

size_t ScriptedUpstream::finished() const {
    std::lock_guard lock(mu_);
    return finished_.size();
}

// ---------------------------------------------------------------------------------------------

int loopbackListeners4(uint16_t port) {
    std::ifstream in("/proc/net/tcp");
    std::string line;
    std::getline(in, line);  // header
    char want[16];
    std::snprintf(want, sizeof want, ":%04X", port);
    int n = 0;
    while (std::getline(in, line)) {
        std::istringstream ls(line);
        std::string slot, local, remote, state;
        ls >> slot >> local >> remote >> state;
        if (local == std::string("0100007F") + want && state == "0A") ++n;
    }
    return n;
}

bool waitUntil(const std::function<bool()>& condition, Millis timeout, Millis interval) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
        if (condition()) return true;
        if (Clock::now() >= deadline) return condition();
        std::this_thread::sleep_for(interval);
    }
}

double secondsSince(Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
}

void GatedSender::run() {
    uint64_t offset = 0;
    while (offset < total_) {
        if (offset >= hold_at_) {
            std::unique_lock lock(mu_);
            if (!cv_.wait_for(lock, Millis{60'000}, [&] { return released_; })) {
                result_ = IoResult{IoStatus::Timeout, offset, 0};
                return;
            }
        }
        uint64_t piece = std::min<uint64_t>(uint64_t{1} << 20, total_ - offset);
        IoResult r = sendPayloadAt(fd_, seed_, offset, piece, Millis{60'000}, &cancel_);
        offset += r.bytes;
        sent_.store(offset);
        if (!r.ok()) {
            result_ = r;
            result_.bytes = offset;
            return;
        }
    }
    ::shutdown(fd_, SHUT_WR);
    result_ = IoResult{IoStatus::Ok, offset, 0};
}

std::vector<Fd> openIdle(uint16_t port, size_t n) {
    std::vector<Fd> fds;
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(port);
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (size_t i = 0; i < n; ++i) {
        Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        if (!fd) break;
        int rc = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&to), sizeof to);
        if (rc < 0 && errno != EINPROGRESS) break;
        fds.push_back(std::move(fd));
    }
    // Wait for every handshake: writable means connected (or failed, which the count shows).
    const auto deadline = Clock::now() + Millis{20'000};
    std::vector<pollfd> pending;
    for (const Fd& fd : fds) pending.push_back({fd.get(), POLLOUT, 0});
    while (!pending.empty() && Clock::now() < deadline) {
        ::poll(pending.data(), pending.size(), 100);
        std::erase_if(pending, [](const pollfd& p) { return p.revents != 0; });
        for (pollfd& p : pending) p.revents = 0;
    }
    return fds;
}

size_t closedByPeer(const std::vector<Fd>& fds, Millis timeout) {
    const auto deadline = Clock::now() + timeout;
    std::vector<bool> closed(fds.size(), false);
    size_t count = 0;
    while (count < fds.size() && Clock::now() < deadline) {
        std::vector<pollfd> polls;
        std::vector<size_t> which;
        for (size_t i = 0; i < fds.size(); ++i) {
            if (closed[i]) continue;
            polls.push_back({fds[i].get(), POLLIN | POLLRDHUP, 0});
            which.push_back(i);
        }
        if (::poll(polls.data(), polls.size(), 100) <= 0) continue;
        for (size_t k = 0; k < polls.size(); ++k) {
            if (polls[k].revents == 0) continue;
            char buf[4096];
            ssize_t n = ::recv(polls[k].fd, buf, sizeof buf, MSG_DONTWAIT);
            if (n == 0 || (n < 0 && errno != EAGAIN)) {
                closed[which[k]] = true;
                ++count;
            }
        }
    }
    return count;
}

}  // namespace zcrelay::test
