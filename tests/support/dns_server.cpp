#include "support/dns_server.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

namespace zcrelay::test {

namespace {

constexpr uint16_t kTypeA = 1;
constexpr uint16_t kTypeSoa = 6;
constexpr uint16_t kTypeAaaa = 28;
constexpr uint16_t kTypeSrv = 33;
constexpr int kRcodeServfail = 2;

constexpr Millis kReadyWait{10'000};  // dnsmasq itself starts in ~10-50 ms
constexpr Millis kEffectWait{5'000};  // a change shows in the very first query; this is slack
constexpr Millis kQueryTimeout{1'000};

std::string lower(std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
}

// "Web.Test." -> "web.test"; nullopt unless it is a plain host name of labels [a-z0-9_-].
std::optional<std::string> normalizeName(const std::string& name) {
    std::string n = lower(name);
    if (!n.empty() && n.back() == '.') n.pop_back();
    if (n.empty() || n.size() > 253) return std::nullopt;
    size_t label = 0;
    for (char c : n) {
        if (c == '.') {
            if (label == 0) return std::nullopt;
            label = 0;
        } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') {
            if (++label > 63) return std::nullopt;
        } else {
            return std::nullopt;
        }
    }
    return label == 0 ? std::nullopt : std::optional<std::string>(n);
}

// A name strictly under test. (the zone dnsmasq serves), normalized; nullopt otherwise.
std::optional<std::string> nameUnderTest(const std::string& name) {
    auto n = normalizeName(name);
    const std::string suffix = ".test";
    if (!n || n->size() <= suffix.size() || !n->ends_with(suffix)) return std::nullopt;
    return n;
}

// The canonical text of an IPv4 or IPv6 address (as inet_ntop, and so dig, prints it).
std::optional<std::string> canonicalAddress(const std::string& text, int& family) {
    unsigned char buf[16];
    char out[INET6_ADDRSTRLEN];
    for (int f : {AF_INET, AF_INET6}) {
        if (::inet_pton(f, text.c_str(), buf) == 1 && ::inet_ntop(f, buf, out, sizeof out)) {
            family = f;
            return std::string(out);
        }
    }
    return std::nullopt;
}

std::string srvText(uint16_t priority, uint16_t weight, uint16_t port, const std::string& target) {
    return std::to_string(priority) + " " + std::to_string(weight) + " " + std::to_string(port) +
           " " + target;
}

// ---------------------------------------------------------------------------------------------
// Just enough of the DNS wire format (RFC 1035) to ask dnsmasq one question and read the
// records of the answer section.

void putU16(std::string& out, uint16_t v) {
    out.push_back(static_cast<char>(v >> 8));
    out.push_back(static_cast<char>(v & 0xff));
}

uint16_t getU16(const std::string& m, size_t at) {
    return static_cast<uint16_t>((static_cast<uint8_t>(m[at]) << 8) |
                                 static_cast<uint8_t>(m[at + 1]));
}

std::string encodeQuery(uint16_t id, const std::string& name, uint16_t qtype) {
    std::string q;
    putU16(q, id);
    putU16(q, 0x0100);  // RD, as stub resolvers send it
    putU16(q, 1);       // QDCOUNT
    putU16(q, 0);
    putU16(q, 0);
    putU16(q, 0);
    std::stringstream labels(name);
    std::string label;
    while (std::getline(labels, label, '.')) {
        q.push_back(static_cast<char>(label.size()));
        q += label;
    }
    q.push_back('\0');
    putU16(q, qtype);
    putU16(q, 1);  // IN
    return q;
}

// Reads the (possibly compressed) name at `pos`; `next` is the offset just past it in place.
bool readName(const std::string& m, size_t pos, std::string& name, size_t& next) {
    name.clear();
    bool jumped = false;
    for (int hops = 0; hops < 128; ++hops) {
        if (pos >= m.size()) return false;
        uint8_t len = static_cast<uint8_t>(m[pos]);
        if ((len & 0xc0) == 0xc0) {
            if (pos + 1 >= m.size()) return false;
            if (!jumped) next = pos + 2;
            jumped = true;
            pos = getU16(m, pos) & 0x3fff;
        } else if (len == 0) {
            if (!jumped) next = pos + 1;
            return true;
        } else {
            if (pos + 1 + len > m.size()) return false;
            if (!name.empty()) name += '.';
            name += lower(m.substr(pos + 1, len));
            pos += 1 + len;
        }
    }
    return false;
}

// Sets `error` and yields the empty optional: `return failWith(error, "...");`
std::nullopt_t failWith(std::string& error, std::string message) {
    error = std::move(message);
    return std::nullopt;
}

struct DnsReply {
    int rcode = -1;
    bool truncated = false;
    // The answer-section records of the asked type as text: "127.0.0.1", "::1",
    // "10 20 8080 web.test" (SRV), sorted.
    std::vector<std::string> records;

    std::string describe() const {
        static const char* const kNames[] = {"NOERROR",  "FORMERR", "SERVFAIL",
                                             "NXDOMAIN", "NOTIMP",  "REFUSED"};
        std::string s = rcode >= 0 && rcode < 6 ? kNames[rcode] : "rcode " + std::to_string(rcode);
        if (truncated) s += " (TC)";
        s += " [";
        for (size_t i = 0; i < records.size(); ++i) s += (i ? ", " : "") + records[i];
        return s + "]";
    }
};

std::optional<DnsReply> parseReply(const std::string& m, uint16_t id, uint16_t qtype,
                                   std::string& error) {
    if (m.size() < 12 || getU16(m, 0) != id || !(m[2] & 0x80)) {
        error = "not a reply to our query (" + std::to_string(m.size()) + " bytes)";
        return std::nullopt;
    }
    DnsReply r;
    r.truncated = (m[2] & 0x02) != 0;
    r.rcode = m[3] & 0x0f;
    size_t pos = 12;
    std::string name;
    for (uint16_t i = 0, n = getU16(m, 4); i < n; ++i) {
        if (!readName(m, pos, name, pos) || pos + 4 > m.size())
            return failWith(error, "bad question");
        pos += 4;
    }
    for (uint16_t i = 0, n = getU16(m, 6); i < n; ++i) {
        if (!readName(m, pos, name, pos) || pos + 10 > m.size())
            return failWith(error, "bad answer record");
        uint16_t type = getU16(m, pos);
        uint16_t rdlen = getU16(m, pos + 8);
        size_t rdata = pos + 10;
        if (rdata + rdlen > m.size()) return failWith(error, "bad rdata length");
        pos = rdata + rdlen;
        if (type != qtype) continue;  // a CNAME would come first; dnsmasq sends none here
        char text[INET6_ADDRSTRLEN];
        if (type == kTypeA && rdlen == 4) {
            r.records.push_back(::inet_ntop(AF_INET, m.data() + rdata, text, sizeof text));
        } else if (type == kTypeAaaa && rdlen == 16) {
            r.records.push_back(::inet_ntop(AF_INET6, m.data() + rdata, text, sizeof text));
        } else if (type == kTypeSrv && rdlen >= 7) {
            std::string target;
            size_t ignored;
            if (!readName(m, rdata + 6, target, ignored)) return failWith(error, "bad SRV target");
            r.records.push_back(
                srvText(getU16(m, rdata), getU16(m, rdata + 2), getU16(m, rdata + 4), target));
        }
    }
    std::sort(r.records.begin(), r.records.end());
    return r;
}

// One query over TCP to 127.0.0.1:port, sent from kSelfQuerySource (queriesFor() leaves those
// out). TCP because the answer is never truncated, and because dnsmasq serves each TCP
// connection in a child forked at accept time with a copy of its records: an answer over TCP
// shows what the main process (which serves UDP) had at that moment.
std::optional<DnsReply> querySelf(uint16_t port, const std::string& name, uint16_t qtype,
                                  std::string& error) {
    auto deadline = Clock::now() + kQueryTimeout;
    Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!s) return failWith(error, std::string("socket: ") + std::strerror(errno));
    sockaddr_in src{};
    src.sin_family = AF_INET;
    ::inet_pton(AF_INET, DnsServer::kSelfQuerySource, &src.sin_addr);
    if (::bind(s.get(), reinterpret_cast<sockaddr*>(&src), sizeof src) != 0)
        return failWith(error, std::string("bind: ") + std::strerror(errno));
    sockaddr_in dst{};
    dst.sin_family = AF_INET;
    dst.sin_port = htons(port);
    dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(s.get(), reinterpret_cast<sockaddr*>(&dst), sizeof dst) != 0) {
        if (errno != EINPROGRESS)
            return failWith(error, std::string("connect: ") + std::strerror(errno));
        pollfd p{s.get(), POLLOUT, 0};
        int err = 0;
        socklen_t len = sizeof err;
        if (::poll(&p, 1, static_cast<int>(kQueryTimeout.count())) != 1 ||
            ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)
            return failWith(error, std::string("connect: ") + std::strerror(err ? err : ETIMEDOUT));
    }
    setNonBlocking(s.get(), false);
    static std::atomic<uint16_t> next_id{0x5a00};
    uint16_t id = next_id.fetch_add(1);
    std::string query = encodeQuery(id, name, qtype);
    std::string framed;
    putU16(framed, static_cast<uint16_t>(query.size()));
    framed += query;
    auto left = [&] {
        return std::max(Millis{1}, std::chrono::duration_cast<Millis>(deadline - Clock::now()));
    };
    if (IoResult w = writeAll(s.get(), framed.data(), framed.size(), left()); !w.ok())
        return failWith(error, "send: " + w.describe());
    unsigned char len_bytes[2];
    if (IoResult rd = readExactly(s.get(), len_bytes, 2, left()); !rd.ok())
        return failWith(error, "no answer: " + rd.describe());
    std::string reply((len_bytes[0] << 8) | len_bytes[1], '\0');
    if (IoResult rd = readExactly(s.get(), reply.data(), reply.size(), left()); !rd.ok())
        return failWith(error, "short answer: " + rd.describe());
    return parseReply(reply, id, qtype, error);
}

// Queries every 10 ms until the reply satisfies `good`, for at most `timeout`.
::testing::AssertionResult waitForReply(uint16_t port, const std::string& name, uint16_t qtype,
                                        const std::function<bool(const DnsReply&)>& good,
                                        const std::string& expectation,
                                        Millis timeout = kEffectWait) {
    auto deadline = Clock::now() + timeout;
    std::string last;
    for (;;) {
        std::string error;
        auto reply = querySelf(port, name, qtype, error);
        if (reply && good(*reply)) return ::testing::AssertionSuccess();
        last = reply ? reply->describe() : error;
        if (Clock::now() >= deadline) break;
        std::this_thread::sleep_for(Millis{10});
    }
    return ::testing::AssertionFailure()
           << "query for " << name << " (type " << qtype << ") did not answer " << expectation
           << " within " << timeout.count() << " ms; last answer: " << last;
}

// The SERVFAIL reply to `query`: same id, opcode, RD and question, no records.
std::optional<std::string> servfailFor(const std::string& query) {
    if (query.size() < 12 || (query[2] & 0x80)) return std::nullopt;
    std::string r = query.substr(0, 12);
    r[2] = static_cast<char>(0x80 | (query[2] & 0x79));  // QR + opcode + RD
    r[3] = static_cast<char>(0x80 | kRcodeServfail);     // RA + SERVFAIL
    for (size_t i = 6; i < 12; ++i) r[i] = '\0';         // no answer, authority, additional
    size_t pos = 12;
    std::string name;
    if (getU16(query, 4) == 1 && readName(query, pos, name, pos) && pos + 4 <= query.size()) {
        r += query.substr(12, pos + 4 - 12);
    } else {
        r[4] = r[5] = '\0';
    }
    return r;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The upstream of the failing domains: answers every query with SERVFAIL, on 127.0.0.1 UDP and
// TCP (same port; dnsmasq forwards a query over the transport it came in on). One thread polls
// the UDP socket, the listener and every open TCP connection, so a connection held open (dnsmasq
// keeps one per TCP client) never stalls the others. Stopped and joined within ~100 ms.
class DnsServer::ServfailResponder {
  public:
    ~ServfailResponder() {
        stop_.store(true);
        if (thread_.joinable()) thread_.join();
    }

    ::testing::AssertionResult start() {
        std::string why;
        for (int attempt = 0; attempt < 5; ++attempt) {
            Listening tcp = listenLoopback(AF_INET, 16);
            if (!tcp.fd) return ::testing::AssertionFailure() << tcp.error;
            Fd udp(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
            sockaddr_in a{};
            a.sin_family = AF_INET;
            a.sin_port = htons(tcp.port);
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            if (udp && ::bind(udp.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
                setNonBlocking(tcp.fd.get(), true);
                tcp_ = std::move(tcp.fd);
                udp_ = std::move(udp);
                port_ = tcp.port;
                thread_ = std::thread([this] { run(); });
                return ::testing::AssertionSuccess();
            }
            why = std::string("bind UDP 127.0.0.1:") + std::to_string(tcp.port) + ": " +
                  std::strerror(errno);  // that UDP port is taken: try another pair
        }
        return ::testing::AssertionFailure() << "SERVFAIL responder: " << why;
    }
    uint16_t port() const { return port_; }

  private:
    struct Conn {
        Fd fd;
        std::string in;  // bytes received, not yet a whole length-prefixed query
    };

    void run() {
        while (!stop_.load()) {
            std::vector<pollfd> p = {{udp_.get(), POLLIN, 0}, {tcp_.get(), POLLIN, 0}};
            for (const Conn& c : conns_) p.push_back({c.fd.get(), POLLIN, 0});
            if (::poll(p.data(), p.size(), 100) <= 0) continue;
            for (size_t i = 2; i < p.size(); ++i)
                if (p[i].revents != 0 && !serve(conns_[i - 2])) conns_[i - 2].fd.reset();
            std::erase_if(conns_, [](const Conn& c) { return !c.fd; });
            if (p[0].revents & POLLIN) answerUdp();
            if (p[1].revents & POLLIN) {
                Fd conn(::accept4(tcp_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
                if (conn && conns_.size() < 64) conns_.push_back({std::move(conn), {}});
            }
        }
    }

    void answerUdp() {
        std::string buf(4096, '\0');
        sockaddr_storage from{};
        socklen_t from_len = sizeof from;
        ssize_t n = ::recvfrom(udp_.get(), buf.data(), buf.size(), 0,
                               reinterpret_cast<sockaddr*>(&from), &from_len);
        if (n <= 0) return;
        buf.resize(static_cast<size_t>(n));
        if (auto reply = servfailFor(buf))
            ::sendto(udp_.get(), reply->data(), reply->size(), 0,
                     reinterpret_cast<sockaddr*>(&from), from_len);
    }

    // Reads what arrived and answers every whole query in it. False: close the connection
    // (the peer closed it, an error, or not DNS).
    bool serve(Conn& c) {
        char buf[4096];
        ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, 0);
        if (n < 0) return errno == EAGAIN || errno == EINTR;
        if (n == 0) return false;
        c.in.append(buf, static_cast<size_t>(n));
        while (c.in.size() >= 2 && c.in.size() >= 2u + getU16(c.in, 0)) {
            auto reply = servfailFor(c.in.substr(2, getU16(c.in, 0)));
            c.in.erase(0, 2u + getU16(c.in, 0));
            if (!reply) return false;
            std::string framed;
            putU16(framed, static_cast<uint16_t>(reply->size()));
            framed += *reply;
            // A few dozen bytes into an empty socket buffer: this does not wait.
            if (!writeAll(c.fd.get(), framed.data(), framed.size(), Millis{100}).ok()) return false;
        }
        return c.in.size() < 4096;
    }

    Fd udp_;
    Fd tcp_;
    uint16_t port_ = 0;
    std::vector<Conn> conns_;  // the thread's own
    std::atomic<bool> stop_{false};
    std::thread thread_;
};

// ---------------------------------------------------------------------------------------------

// The hosts directory exists from the start, so records can be set before start() (start()
// reports it if it could not be made).
DnsServer::DnsServer() {
    std::error_code ec;
    if (!dir_.path().empty()) std::filesystem::create_directories(dir_.file("hosts"), ec);
}

DnsServer::~DnsServer() { stop(); }

std::string DnsServer::address() const { return "127.0.0.1:" + std::to_string(port_); }

bool DnsServer::running() { return child_ && child_->running(); }

std::vector<std::string> DnsServer::argv() const {
    std::vector<std::string> a = {
        findExecutable("dnsmasq").value_or("dnsmasq"),
        "--keep-in-foreground",
        "--conf-file=/dev/null",
        "--pid-file=",  // none: we hold the PID ourselves
        "--port=" + std::to_string(port_),
        "--listen-address=127.0.0.1",
        "--bind-interfaces",
        "--no-hosts",
        "--no-resolv",
        "--no-poll",
        "--cache-size=0",
        "--local=/test/",
        "--hostsdir=" + dir_.file("hosts"),
        "--servers-file=" + dir_.file("servers.conf"),
        "--local-ttl=" + std::to_string(options_.ttl),
        "--log-queries",
        "--log-facility=" + logPath(),
    };
    if (::geteuid() == 0) a.push_back("--user=root");
    for (const auto& [name, records] : srv_) {
        for (const Srv& r : records) {
            // --srv-host=_service._proto.name,target,port,priority,weight
            a.push_back("--srv-host=" + name + "," + r.target + "," + std::to_string(r.port) + "," +
                        std::to_string(r.priority) + "," + std::to_string(r.weight));
        }
    }
    return a;
}

PortLaunch DnsServer::launch(std::string& why) {
    child_ = std::make_unique<ChildProcess>();
    ChildProcess::Options opts;
    opts.argv = argv();
    opts.stdout_path = dir_.file("dnsmasq.out");
    opts.stderr_path = dir_.file("dnsmasq.err");
    std::string error;
    if (!child_->spawn(opts, error)) {
        why = "spawn dnsmasq: " + error;
        child_.reset();
        return PortLaunch::Failed;
    }
    // Up once it answers anything over TCP: it binds UDP and TCP before it serves either.
    std::string last;
    bool up = waitUntil(
        [&] {
            if (!child_->running()) return true;
            return querySelf(port_, "test", kTypeSoa, last).has_value();
        },
        kReadyWait, Millis{10});
    if (up && child_->running()) return PortLaunch::Up;
    why = diagnostics();
    auto status = child_->status();
    if (!status) {
        why = "dnsmasq did not answer on " + address() + " within 10 s (" + last + ")\n" + why;
        child_->killAndWait();
    }
    child_.reset();
    // Exit code 2 is dnsmasq's "network problem": here, the port is taken.
    return status && status->exited && status->code == 2 ? PortLaunch::Retry : PortLaunch::Failed;
}

::testing::AssertionResult DnsServer::start(Options options) {
    if (child_) return ::testing::AssertionFailure() << "DnsServer already started";
    if (dir_.path().empty()) return ::testing::AssertionFailure() << "no temp dir";
    if (!findExecutable("dnsmasq")) return ::testing::AssertionFailure() << "dnsmasq not found";
    if (!std::filesystem::is_directory(dir_.file("hosts")))
        return ::testing::AssertionFailure() << "could not create " << dir_.file("hosts");
    options_ = options;
    if (auto written = writeServersFile(); !written) return written;
    return startOnFreeLoopbackPort(AF_INET, [&](uint16_t port, std::string& why) {
        port_ = port;
        return launch(why);
    });
}

void DnsServer::stop() {
    if (!child_) return;
    if (child_->running()) {
        child_->sendSignal(SIGTERM);
        if (!child_->waitExit(Millis{5'000})) child_->killAndWait();
    }
    child_.reset();
}

::testing::AssertionResult DnsServer::restart() {
    if (port_ == 0) return ::testing::AssertionFailure() << "DnsServer was never started";
    stop();
    // Same port: nothing of ours holds it now, but another process could have taken it in the
    // moment; dnsmasq then exits 2 and is tried again, for at most ~5 s.
    auto deadline = Clock::now() + Millis{5'000};
    std::string why;
    for (;;) {
        switch (launch(why)) {
            case PortLaunch::Up:
                return ::testing::AssertionSuccess();
            case PortLaunch::Failed:
                return ::testing::AssertionFailure() << "restart: " << why;
            case PortLaunch::Retry:
                break;
        }
        if (Clock::now() >= deadline)
            return ::testing::AssertionFailure()
                   << "restart: port " << port_ << " stays taken: " << why;
        std::this_thread::sleep_for(Millis{100});
    }
}

::testing::AssertionResult DnsServer::setAddresses(const std::string& name,
                                                   const std::vector<std::string>& addrs) {
    auto n = nameUnderTest(name);
    if (!n) return ::testing::AssertionFailure() << "not a name under test.: '" << name << "'";
    std::vector<std::string> v4, v6;
    std::string hosts;  // hosts(5) format, one line per address
    for (const std::string& text : addrs) {
        int family = 0;
        auto addr = canonicalAddress(text, family);
        if (!addr) return ::testing::AssertionFailure() << "not an IP address: '" << text << "'";
        (family == AF_INET ? v4 : v6).push_back(*addr);
        hosts += *addr + " " + *n + "\n";
    }
    for (auto* v : {&v4, &v6}) {
        std::sort(v->begin(), v->end());
        v->erase(std::unique(v->begin(), v->end()), v->end());
    }
    // One file per name in the watched directory. A new version is written beside it and
    // renamed in, so dnsmasq (inotify IN_MOVED_TO) never reads half a file; deleting the file
    // (IN_DELETE) drops the name's records.
    std::string path = dir_.file("hosts/" + *n);
    if (addrs.empty()) {
        if (::unlink(path.c_str()) != 0 && errno != ENOENT)
            return ::testing::AssertionFailure()
                   << "unlink " << path << ": " << std::strerror(errno);
    } else {
        std::string tmp = dir_.writeFile("hosts.tmp", hosts);
        if (::rename(tmp.c_str(), path.c_str()) != 0)
            return ::testing::AssertionFailure()
                   << "rename to " << path << ": " << std::strerror(errno);
    }
    if (!child_) return ::testing::AssertionSuccess();  // not running: read at (re)start
    for (auto [qtype, want] : {std::pair{kTypeA, &v4}, std::pair{kTypeAaaa, &v6}}) {
        auto effective = waitForReply(
            port_, *n, qtype,
            [&](const DnsReply& r) { return r.rcode != kRcodeServfail && r.records == *want; },
            "[" + std::to_string(want->size()) + " addresses as set]");
        if (!effective) return effective << "\n" << diagnostics();
    }
    return ::testing::AssertionSuccess();
}

::testing::AssertionResult DnsServer::setSrv(const std::string& name,
                                             const std::vector<Srv>& records) {
    auto n = nameUnderTest(name);
    if (!n) return ::testing::AssertionFailure() << "not a name under test.: '" << name << "'";
    std::vector<Srv> normalized;
    std::vector<std::string> want;
    for (const Srv& r : records) {
        auto target = normalizeName(r.target);
        if (!target) return ::testing::AssertionFailure() << "bad SRV target '" << r.target << "'";
        normalized.push_back({r.priority, r.weight, r.port, *target});
        want.push_back(srvText(r.priority, r.weight, r.port, *target));
    }
    std::sort(want.begin(), want.end());
    auto it = std::find_if(srv_.begin(), srv_.end(), [&](const auto& e) { return e.first == *n; });
    if (it != srv_.end()) srv_.erase(it);
    if (!normalized.empty()) srv_.emplace_back(*n, std::move(normalized));
    if (!child_) return ::testing::AssertionSuccess();  // not running: passed at (re)start
    if (auto restarted = restart(); !restarted) return restarted;
    auto effective = waitForReply(
        port_, *n, kTypeSrv, [&](const DnsReply& r) { return r.records == want; },
        "[" + std::to_string(want.size()) + " SRV records as set]");
    if (!effective) return effective << "\n" << diagnostics();
    return ::testing::AssertionSuccess();
}

::testing::AssertionResult DnsServer::writeServersFile() {
    std::string lines;
    for (const std::string& domain : failing_)
        lines += "server=/" + domain + "/127.0.0.1#" + std::to_string(responder_->port()) + "\n";
    std::string tmp = dir_.writeFile("servers.tmp", lines);
    if (::rename(tmp.c_str(), dir_.file("servers.conf").c_str()) != 0)
        return ::testing::AssertionFailure() << "rename servers.conf: " << std::strerror(errno);
    return ::testing::AssertionSuccess();
}

::testing::AssertionResult DnsServer::reloadServers() {
    if (!child_) return ::testing::AssertionSuccess();  // not running: read at (re)start
    if (!child_->sendSignal(SIGHUP))
        return ::testing::AssertionFailure() << "dnsmasq is not running\n" << diagnostics();
    return ::testing::AssertionSuccess();
}

::testing::AssertionResult DnsServer::failWithServfail(const std::string& domain) {
    auto d = nameUnderTest(domain);
    if (!d) return ::testing::AssertionFailure() << "not a domain under test.: '" << domain << "'";
    std::error_code ec;
    if (std::filesystem::exists(dir_.file("hosts/" + *d), ec))
        return ::testing::AssertionFailure()
               << *d << " has A/AAAA records, which dnsmasq answers before it forwards: "
               << "setAddresses(\"" << *d << "\", {}) first";
    if (!responder_) {
        auto responder = std::make_unique<ServfailResponder>();
        if (auto started = responder->start(); !started) return started;
        responder_ = std::move(responder);
    }
    failing_.insert(*d);
    if (auto r = writeServersFile(); !r) return r;
    if (auto r = reloadServers(); !r || !child_) return r;
    auto effective = waitForReply(
        port_, *d, kTypeA, [](const DnsReply& r) { return r.rcode == kRcodeServfail; }, "SERVFAIL");
    if (!effective) return effective << "\n" << diagnostics();
    return ::testing::AssertionSuccess();
}

::testing::AssertionResult DnsServer::stopFailing(const std::string& domain) {
    auto d = nameUnderTest(domain);
    if (!d || failing_.erase(*d) == 0)
        return ::testing::AssertionFailure() << "'" << domain << "' is not failing";
    if (auto r = writeServersFile(); !r) return r;
    if (auto r = reloadServers(); !r || !child_) return r;
    auto effective = waitForReply(
        port_, *d, kTypeA, [](const DnsReply& r) { return r.rcode != kRcodeServfail; },
        "anything but SERVFAIL");
    if (!effective) return effective << "\n" << diagnostics();
    return ::testing::AssertionSuccess();
}

size_t DnsServer::queriesFor(const std::string& name, const std::string& type) const {
    auto want = normalizeName(name);
    if (!want) return 0;
    const std::string want_type = lower(type);
    const std::string self_suffix = std::string(" from ") + kSelfQuerySource;
    // Lines look like "Nov 25 18:40:34 dnsmasq[29559]: query[AAAA] web.test from 127.0.0.1"
    // (the PID is a forked child's for queries over TCP).
    std::ifstream log(logPath());
    size_t count = 0;
    std::string line;
    while (std::getline(log, line)) {
        size_t q = line.find(": query[");
        if (q == std::string::npos) continue;
        size_t type_begin = q + 8;
        size_t type_end = line.find("] ", type_begin);
        size_t from = line.rfind(" from ");
        if (type_end == std::string::npos || from == std::string::npos || from < type_end) continue;
        if (line.compare(from, std::string::npos, self_suffix) == 0) continue;
        if (!want_type.empty() &&
            lower(line.substr(type_begin, type_end - type_begin)) != want_type)
            continue;
        std::string logged = lower(line.substr(type_end + 2, from - type_end - 2));
        if (!logged.empty() && logged.back() == '.') logged.pop_back();
        if (logged == *want) ++count;
    }
    return count;
}

std::string DnsServer::diagnostics() const {
    std::ostringstream os;
    os << "--- dnsmasq on " << address() << " (" << dir_.path() << ")";
    if (child_ && child_->status()) os << ", " << child_->status()->describe();
    os << " ---\nstderr: " << fileTail(dir_.file("dnsmasq.err"), 2048) << "\nlog tail:\n"
       << fileTail(logPath(), 2048) << "\n---";
    return os.str();
}

}  // namespace zcrelay::test
