#include "takeover.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "clock.hpp"
#include "log.hpp"
#include "result.hpp"
#include "takeover_wire.hpp"
#include "unix_path.hpp"
#include "version.hpp"

namespace zcrelay::takeover {
namespace {

// A taker says HELLO at once, and a giver offers at once: seconds mean one of them is stuck.
constexpr int64_t kStepMs = 5000;
// After READY, the giver's DONE comes within one round trip of its workers (they close their
// listeners): past this the taker serves on without it.
constexpr int64_t kDoneMs = 10000;
// The old relay's workers hand their connections over within this (a stuck taker): what is
// left stays with the old relay.
constexpr int64_t kHandOverMs = 10000;

std::string ourRelease() { return releaseVersion(); }

std::string versionList() {
    std::string out;
    for (unsigned v = 1; v <= kVersion; ++v) out += (v > 1 ? "," : "") + std::to_string(v);
    return out;
}

bool speaks(const std::string& versions, unsigned version) {
    size_t at = 0;
    while (at <= versions.size()) {
        size_t comma = versions.find(',', at);
        if (comma == std::string::npos) comma = versions.size();
        if (versions.substr(at, comma - at) == std::to_string(version)) return true;
        at = comma + 1;
    }
    return false;
}

pid_t pidOf(const Message& m) {
    const std::string text = m.get("pid");
    char* end = nullptr;
    const long v = std::strtol(text.c_str(), &end, 10);
    return text.empty() || *end != '\0' || v <= 0 ? 0 : static_cast<pid_t>(v);
}

int intOption(int fd, int name) {
    int v = -1;
    socklen_t len = sizeof v;
    return ::getsockopt(fd, SOL_SOCKET, name, &v, &len) == 0 ? v : -1;
}

// A SOCKET message as a HandedSocket, checked: a listening stream socket of the family its
// address says. The error names the message.
tl::expected<HandedSocket, std::string> handedFrom(Message& m) {
    HandedSocket s;
    s.kind = m.get("kind");
    s.name = m.get("name");
    const std::string what = "SOCKET kind=" + s.kind + (s.name.empty() ? "" : " name=" + s.name);
    if (s.kind != "listener" && s.kind != "metrics" && s.kind != "health" && s.kind != "admin" &&
        s.kind != "takeover")
        return tl::unexpected(what + ": an unknown kind");
    auto listen = parseAddress(m.get("listen"));
    auto bound = parseAddress(m.get("bound"));
    if (!listen || !bound) return tl::unexpected(what + ": a bad address");
    s.listen = *listen;
    s.bound = *bound;
    if (m.fds.size() != 1) return tl::unexpected(what + ": not one fd came with it");
    UniqueFd& fd = m.fds[0];
    // The takeover socket is the one SOCK_SEQPACKET among them (takeover_wire.hpp).
    const int type = s.kind == "takeover" ? SOCK_SEQPACKET : SOCK_STREAM;
    if (intOption(fd.get(), SO_ACCEPTCONN) != 1 || intOption(fd.get(), SO_TYPE) != type ||
        intOption(fd.get(), SO_DOMAIN) != s.bound.family())
        return tl::unexpected(what + ": the fd is not a socket listening on " + s.bound.toString());
    s.fd = std::move(fd);
    s.systemd = m.get("held") == "systemd";
    return s;
}

}  // namespace

// ---- the taker -------------------------------------------------------------------------------

tl::expected<UniqueFd, TakeError> connectTo(const std::string& path) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) return tl::unexpected(TakeError{TakeError::Unreachable, errnoText("socket"), {}, 0});
    sockaddr_un sun{};
    sun.sun_family = AF_UNIX;
    if (path.size() >= sizeof sun.sun_path)
        return tl::unexpected(TakeError{TakeError::Unreachable, path + ": too long", {}, 0});
    std::memcpy(sun.sun_path, path.data(), path.size());
    // A unix connect() never waits for the other side to accept: it completes, or fails (a full
    // backlog: EAGAIN), at once.
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&sun), sizeof sun) < 0)
        return tl::unexpected(
            TakeError{TakeError::Unreachable, errnoText("connect " + path), {}, 0});
    return fd;
}

tl::expected<Taken, TakeError> take(UniqueFd channel) {
    Taken taken;
    taken.started_us = monotonicUs();
    auto broken = [&](std::string why) {
        return tl::unexpected(
            TakeError{TakeError::Broken, std::move(why), std::move(taken.sockets), taken.giver});
    };
    Message hello("HELLO");
    hello.set("versions", versionList())
        .set("pid", std::to_string(::getpid()))
        .set("release", ourRelease());
    if (auto sent = send(channel.get(), hello, monotonicMs() + kStepMs); !sent)
        return tl::unexpected(
            TakeError{TakeError::Unreachable, "saying HELLO: " + sent.error(), {}, 0});
    auto offer = receive(channel.get(), monotonicMs() + kStepMs);
    if (!offer) return broken("waiting for the OFFER: " + offer.error());
    taken.giver = pidOf(*offer);
    if (offer->verb == "REFUSE") {
        const std::string code = offer->get("code");
        const std::string why = "pid " + std::to_string(taken.giver) +
                                " refused: " + offer->get("reason") + " (" + code + ")";
        const TakeError::Kind kind = code == "version"    ? TakeError::Version
                                     : code == "draining" ? TakeError::Draining
                                                          : TakeError::Refused;
        return tl::unexpected(TakeError{kind, why, {}, taken.giver});
    }
    if (offer->verb != "OFFER") return broken("expected OFFER, got " + offer->line());
    const std::string offered = offer->get("version");
    for (unsigned v = 1; v <= kVersion; ++v)
        if (offered == std::to_string(v)) taken.version = v;
    if (taken.version == 0)
        return tl::unexpected(TakeError{TakeError::Version,
                                        "pid " + std::to_string(taken.giver) +
                                            " offered protocol version " + offer->get("version") +
                                            ", this binary speaks " + versionList(),
                                        {},
                                        taken.giver});
    taken.giver_release = offer->get("release");
    for (;;) {
        auto m = receive(channel.get(), monotonicMs() + kStepMs);
        if (!m)
            return broken("after " + std::to_string(taken.sockets.size()) +
                          " sockets: " + m.error());
        if (m->verb == "END") break;
        if (m->verb != "SOCKET") return broken("expected SOCKET or END, got " + m->line());
        auto s = handedFrom(*m);
        if (!s) return broken(s.error());
        taken.sockets.push_back(std::move(*s));
    }
    taken.channel = std::move(channel);
    taken.count = taken.sockets.size();
    return taken;
}

std::string sayReady(Taken& taken, const handover::Acceptance& accepts,
                     const std::function<void(std::optional<handover::HandedConn>)>& adopt,
                     const std::function<void(handover::HandedRing)>& adopt_ring) {
    Message ready("READY");
    ready.set("pid", std::to_string(::getpid()));
    if (taken.version >= 2) accepts.addTo(ready);
    if (auto sent = send(taken.channel.get(), ready, monotonicMs() + kStepMs); !sent)
        return "pid " + std::to_string(taken.giver) + " did not hear READY (" + sent.error() +
               "); serving on the sockets it passed";
    size_t conns = 0;
    const int64_t handover_us = monotonicUs();
    const double ready_ms = static_cast<double>(handover_us - taken.started_us) / 1000.0;
    tl::expected<Message, std::string> done = tl::unexpected(std::string("nothing came"));
    for (;;) {
        done = receive(taken.channel.get(), monotonicMs() + kDoneMs);
        if (!done && done.error() == kFdsCutOff) {
            // Past this process's open-file limit (READY's fds keeps it from getting there):
            // the kernel closed the fds that did not fit, and the connection is cut.
            LOG_ERROR(
                "takeover: a connection from pid %d came with its fds cut off (the "
                "open-file limit); it is lost",
                static_cast<int>(taken.giver));
            adopt(std::nullopt);
            continue;
        }
        if (done && done->verb == "RING") {
            // Its connections follow; without it they come unusable, and are counted so.
            auto ring = handover::ringFromMessage(*done);
            if (ring)
                adopt_ring(std::move(*ring));
            else
                LOG_ERROR("takeover: a wake-up ring from pid %d came unusable: %s",
                          static_cast<int>(taken.giver), ring.error().c_str());
            continue;
        }
        if (!done || done->verb != "CONN") break;
        auto conn = handover::fromMessage(*done);
        if (!conn) {
            // Its fds are closed with the message: the giver gave them up, so its peers are
            // cut. Said once per connection; the rest still come.
            LOG_ERROR("takeover: a connection from pid %d came unusable: %s",
                      static_cast<int>(taken.giver), conn.error().c_str());
            adopt(std::nullopt);
            continue;
        }
        ++conns;
        adopt(std::move(*conn));
    }
    const double ms = static_cast<double>(monotonicUs() - taken.started_us) / 1000.0;
    char line[256];
    if (!done || done->verb != "DONE") {
        std::snprintf(line, sizeof line,
                      "took %zu sockets over from pid %d (zcrelay %s); it did not confirm it "
                      "stopped accepting (%s)",
                      taken.count, static_cast<int>(taken.giver), taken.giver_release.c_str(),
                      done ? done->line().c_str() : done.error().c_str());
        return line;
    }
    if (taken.version < 2) {
        std::snprintf(line, sizeof line,
                      "took %zu sockets (%s listeners) over from pid %d (zcrelay %s, protocol "
                      "version 1) in %.1f ms; it drains its connections",
                      taken.count, done->get("listeners").c_str(), static_cast<int>(taken.giver),
                      taken.giver_release.c_str(), ms);
        return line;
    }
    std::snprintf(line, sizeof line,
                  "took %zu sockets (%s listeners) over from pid %d (zcrelay %s) in %.1f ms, and "
                  "%zu connections in %.1f ms after READY; it drains the connections it kept",
                  taken.count, done->get("listeners").c_str(), static_cast<int>(taken.giver),
                  taken.giver_release.c_str(), ready_ms, conns,
                  static_cast<double>(monotonicUs() - handover_us) / 1000.0);
    return line;
}

void sayAborted(Taken& taken, const std::string& why) {
    Message abort("ABORT");
    abort.set("reason", why);
    (void)send(taken.channel.get(), abort, monotonicMs() + kStepMs);
}

// ---- the giver -------------------------------------------------------------------------------

tl::expected<UnpublishedUnixSocket, std::string> bindTakeover(const std::string& path,
                                                              bool replace_live) {
    auto bound = bindUnix(path, SOCK_SEQPACKET, 0600, replace_live);
    if (!bound) return tl::unexpected("takeover_socket " + path + ": " + bound.error());
    return bound;
}

tl::expected<std::unique_ptr<Giver>, std::string> Giver::start(UnixFile file, UniqueFd listening,
                                                               Hooks hooks) {
    std::unique_ptr<Giver> giver(
        new Giver(std::move(file), std::move(listening), std::move(hooks)));
    if (!giver->wake_) return tl::unexpected(errnoText("takeover: eventfd"));
    giver->thread_ = std::thread([g = giver.get()] { g->run(); });
    return giver;
}

Giver::Giver(UnixFile file, UniqueFd listen, Hooks hooks)
    : file_(std::move(file)),
      listen_(std::move(listen)),
      hooks_(std::move(hooks)),
      wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

Giver::~Giver() {
    stopping_.store(true);
    const uint64_t one = 1;
    ssize_t ignored = ::write(wake_.get(), &one, sizeof one);
    (void)ignored;
    if (thread_.joinable()) thread_.join();
    // The socket file stays for the relay that took it over; otherwise it goes with us.
    if (!handed_over_.load()) file_.removeIfSame();
}

void Giver::addChannel(UniqueFd channel, pid_t child) {
    {
        std::lock_guard lock(channels_mutex_);
        channels_.emplace_back(std::move(channel), child);
    }
    const uint64_t one = 1;
    ssize_t ignored = ::write(wake_.get(), &one, sizeof one);
    (void)ignored;
}

UniqueFd Giver::takeChannel(pid_t& child) {
    std::lock_guard lock(channels_mutex_);
    if (channels_.empty()) return UniqueFd();
    UniqueFd fd = std::move(channels_.front().first);
    child = channels_.front().second;
    channels_.erase(channels_.begin());
    return fd;
}

void Giver::run() {
    setLogThreadName("takeover");
    while (!stopping_.load() && !handed_over_.load()) {
        pollfd p[2] = {{wake_.get(), POLLIN, 0}, {listen_ ? listen_.get() : -1, POLLIN, 0}};
        const int n = ::poll(p, 2, -1);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            LOG_ERROR("takeover: poll: %s; no more takeovers from this process", strerror(errno));
            break;
        }
        if (p[0].revents) {
            uint64_t v = 0;
            ssize_t ignored = ::read(wake_.get(), &v, sizeof v);
            (void)ignored;
        }
        pid_t child = 0;
        while (!stopping_.load() && !handed_over_.load()) {
            UniqueFd channel = takeChannel(child);
            if (!channel) break;
            converse(std::move(channel), "the SIGUSR2 child pid " + std::to_string(child));
        }
        if (!(p[1].revents & POLLIN) || handed_over_.load()) continue;
        UniqueFd peer(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!peer) continue;
        // The listening sockets are the relay's to give: to its own user, or root, only.
        ucred cred{};
        socklen_t len = sizeof cred;
        if (::getsockopt(peer.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0 ||
            (cred.uid != 0 && cred.uid != ::geteuid())) {
            refuseUnheard(std::move(peer), "denied", "not the relay's user",
                          "pid " + std::to_string(cred.pid) + " (uid " + std::to_string(cred.uid) +
                              "): only uid " + std::to_string(::geteuid()) +
                              " or root may take over");
            continue;
        }
        converse(std::move(peer), "pid " + std::to_string(cred.pid));
    }
    // A SIGUSR2 child that came too late is told so: it must not start beside the relay that
    // took over.
    pid_t child = 0;
    while (UniqueFd channel = takeChannel(child))
        refuseUnheard(std::move(channel), "busy", "this relay handed its sockets over already",
                      "the SIGUSR2 child pid " + std::to_string(child));
}

void Giver::refuse(int peer, const char* code, const std::string& reason, const std::string& who) {
    Message no("REFUSE");
    no.set("code", code)
        .set("reason", reason)
        .set("pid", std::to_string(::getpid()))
        .set("versions", versionList());
    (void)send(peer, no, monotonicMs() + 1000);
    LOG_WARN("takeover: refused %s: %s", who.c_str(), reason.c_str());
    hooks_.count("refused");
}

void Giver::refuseUnheard(UniqueFd peer, const char* code, const std::string& reason,
                          const std::string& who) {
    // Its HELLO read first: a socket closed with a message unread makes the kernel report
    // ECONNRESET to the other side before it can read our REFUSE.
    (void)receive(peer.get(), monotonicMs() + 1000);
    refuse(peer.get(), code, reason, who);
}

void Giver::refuseWaiting(const std::string& under_way) {
    const std::string reason = "a takeover by " + under_way + " is under way";
    pid_t child = 0;
    while (UniqueFd channel = takeChannel(child))
        refuseUnheard(std::move(channel), "busy", reason,
                      "the SIGUSR2 child pid " + std::to_string(child));
    if (!listen_) return;
    for (;;) {
        UniqueFd peer(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!peer) return;
        refuseUnheard(std::move(peer), "busy", reason, "a second taker");
    }
}

void Giver::converse(UniqueFd channel, const std::string& from) {
    const int64_t started_us = monotonicUs();
    const std::string self = std::to_string(::getpid());
    auto hello = receive(channel.get(), monotonicMs() + kStepMs);
    if (!hello || hello->verb != "HELLO") {
        // A SIGUSR2 child whose config did not load dies here, before a word.
        LOG_WARN("takeover: %s said no HELLO (%s); this relay serves on", from.c_str(),
                 hello ? hello->line().c_str() : hello.error().c_str());
        hooks_.count("failed");
        return;
    }
    const std::string who = from + " (zcrelay " + hello->get("release") + ")";
    unsigned version = 0;
    for (unsigned v = 1; v <= kVersion; ++v)
        if (speaks(hello->get("versions"), v)) version = v;
    if (version == 0)
        return refuse(channel.get(), "version",
                      "it speaks protocol versions " + hello->get("versions") + ", this relay " +
                          versionList(),
                      from);
    if (std::string why = hooks_.refusal(); !why.empty())
        return refuse(channel.get(), "draining", why, from);

    std::vector<HandedSocket> sockets = hooks_.offer();
    Message offer("OFFER");
    offer.set("version", std::to_string(version))
        .set("pid", self)
        .set("release", ourRelease())
        .set("sockets", std::to_string(sockets.size()));
    auto failed = [&](const std::string& why) {
        hooks_.withdraw();
        LOG_WARN("takeover by %s failed: %s; this relay serves on", who.c_str(), why.c_str());
        hooks_.count("failed");
    };
    if (auto sent = send(channel.get(), offer, monotonicMs() + kStepMs); !sent)
        return failed(sent.error());
    for (HandedSocket& s : sockets) {
        Message m("SOCKET");
        m.set("kind", s.kind).set("listen", s.listen.toString()).set("bound", s.bound.toString());
        if (!s.name.empty()) m.set("name", s.name);
        if (s.systemd) m.set("held", "systemd");
        const int fd = s.fd.get();
        if (auto sent = send(channel.get(), m, monotonicMs() + kStepMs, {&fd, 1}); !sent)
            return failed(sent.error());
        s.fd.reset();
    }
    if (auto sent = send(channel.get(), Message("END"), monotonicMs() + kStepMs); !sent)
        return failed(sent.error());
    LOG_INFO("takeover: passed %zu sockets to %s; serving until it is ready", sockets.size(),
             who.c_str());

    // The taker starts now: discovery's first answers, the sockmap program, its workers. No
    // bound here but its life: it says READY or ABORT, or it dies and the channel closes.
    // Meanwhile a second taker is refused, not queued behind this one.
    for (;;) {
        pollfd p[3] = {{channel.get(), POLLIN, 0},
                       {listen_ ? listen_.get() : -1, POLLIN, 0},
                       {wake_.get(), POLLIN, 0}};
        const int n = ::poll(p, 3, 1000);
        if (n < 0 && errno != EINTR) return failed(errnoText("poll"));
        if (stopping_.load()) return failed("this relay is stopping");
        if (p[2].revents) {
            uint64_t v = 0;
            ssize_t ignored = ::read(wake_.get(), &v, sizeof v);
            (void)ignored;
        }
        if ((p[1].revents & POLLIN) || p[2].revents) refuseWaiting(who);
        if (p[0].revents) break;
    }
    auto answer = receive(channel.get(), monotonicMs() + kStepMs);
    if (!answer)
        return failed(answer.error() == "closed" ? "it exited before it was ready"
                                                 : answer.error());
    if (answer->verb == "ABORT") return failed(answer->get("reason"));
    if (answer->verb != "READY") return failed("expected READY, got " + answer->line());

    handed_over_.store(true);
    // Version 2: the workers hand over what the taker takes, each on a dup of the channel.
    std::shared_ptr<handover::Outbound> out;
    if (version >= 2) {
        UniqueFd dup(::fcntl(channel.get(), F_DUPFD_CLOEXEC, 0));
        if (dup)
            out = std::make_shared<handover::Outbound>(std::move(dup),
                                                       handover::Acceptance::from(*answer),
                                                       hooks_.workers, monotonicMs() + kHandOverMs);
        else
            LOG_WARN("takeover: dup of the channel: %s; no connection is handed over",
                     strerror(errno));
    }
    const size_t listeners = hooks_.hand_over(out);
    listen_.reset();  // the taker's now: closed here, the file left to it
    LOG_INFO(
        "takeover: pid %s is ready; handed over %zu listening sockets to it in %.1f ms; no longer "
        "accepting, draining",
        answer->get("pid").c_str(), listeners,
        static_cast<double>(monotonicUs() - started_us) / 1000.0);
    if (out && !out->waitForWorkers(monotonicMs() + kHandOverMs + kStepMs))
        LOG_WARN("takeover: the workers did not finish handing connections over in time");
    Message done("DONE");
    done.set("listeners", std::to_string(listeners));
    (void)send(channel.get(), done, monotonicMs() + kStepMs);
    hooks_.count("handed_over");
}

}  // namespace zcrelay::takeover
