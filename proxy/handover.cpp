#include "handover.hpp"

#include <algorithm>
#include <cstdlib>

#include "clock.hpp"
#include "process_shared.hpp"
#include "reasons.hpp"

namespace zcrelay::handover {

static_assert(kHandoverResults == idx(Outcome::kCount));

namespace {

std::string number(uint64_t v) { return std::to_string(v); }

// A decimal field of `m`; false when absent or not a number (or past `max`).
bool readNumber(const takeover::Message& m, const char* key, uint64_t& out,
                uint64_t max = UINT64_MAX) {
    const std::string text = m.get(key);
    if (text.empty() || text.size() > 20) return false;
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
    if (*end != '\0' || errno != 0 || v > max || text[0] == '-') return false;
    out = v;
    return true;
}

std::string dirKey(const char* name, int d) { return name + std::to_string(d); }

}  // namespace

takeover::Message toMessage(const HandedConn& h) {
    takeover::Message m("CONN");
    m.set("listener", h.listener).set("cluster", h.cluster).set("backend", h.backend);
    if (!h.route.empty()) m.set("route", h.route);
    if (h.client.length != 0) m.set("client", h.client.toString());
    if (h.local.length != 0) m.set("local", h.local.toString());
    m.set("start", number(static_cast<uint64_t>(std::max<int64_t>(0, h.start_unix_us))))
        .set("age", number(static_cast<uint64_t>(std::max<int64_t>(0, h.age_us))))
        .set("quiet", number(static_cast<uint64_t>(std::max<int64_t>(0, h.quiet_ms))))
        .set("connect", number(static_cast<uint64_t>(std::max<int64_t>(0, h.connect_us))))
        .set("attempts", number(h.attempts))
        .set("up", number(h.bytes[0]))
        .set("down", number(h.bytes[1]));
    for (int d = 0; d < 2; ++d) {
        const RestingDirection& dir = h.dir[d];
        if (dir.finished) m.set(dirKey("fin", d), "1");
        if (dir.eof) m.set(dirKey("eof", d), "1");
        if (dir.hup) m.set(dirKey("hup", d), "1");
        if (dir.in_pipe > 0) m.set(dirKey("pipe", d), number(dir.in_pipe));
        if (dir.copy) m.set(dirKey("copy", d), "1");
    }
    return m;
}

tl::expected<HandedConn, std::string> fromMessage(takeover::Message& m) {
    auto bad = [&](const std::string& what) {
        return tl::unexpected("CONN listener=" + m.get("listener") + ": " + what);
    };
    if (m.verb != "CONN") return tl::unexpected("expected CONN, got " + m.line());
    HandedConn h;
    h.listener = m.get("listener");
    h.cluster = m.get("cluster");
    h.backend = m.get("backend");
    h.route = m.get("route");
    if (h.listener.empty() || h.cluster.empty() || h.backend.empty())
        return bad("no listener, cluster or backend");
    for (const char* key : {"client", "local"}) {
        const std::string text = m.get(key);
        if (text.empty()) continue;
        auto a = parseAddress(text);
        if (!a) return bad(std::string("a bad ") + key + " address");
        (std::string(key) == "client" ? h.client : h.local) = *a;
    }
    uint64_t start = 0, age = 0, quiet = 0, connect = 0, attempts = 0;
    if (!readNumber(m, "start", start, INT64_MAX) || !readNumber(m, "age", age, INT64_MAX) ||
        !readNumber(m, "quiet", quiet, INT64_MAX) ||
        !readNumber(m, "connect", connect, INT64_MAX) ||
        !readNumber(m, "attempts", attempts, UINT8_MAX) || !readNumber(m, "up", h.bytes[0]) ||
        !readNumber(m, "down", h.bytes[1]))
        return bad("a missing or bad number");
    h.start_unix_us = static_cast<int64_t>(start);
    h.age_us = static_cast<int64_t>(age);
    h.quiet_ms = static_cast<int64_t>(quiet);
    h.connect_us = static_cast<int64_t>(connect);
    h.attempts = static_cast<uint32_t>(attempts);
    size_t fds_wanted = 2;
    for (int d = 0; d < 2; ++d) {
        RestingDirection& dir = h.dir[d];
        dir.finished = m.get(dirKey("fin", d)) == "1";
        dir.eof = m.get(dirKey("eof", d)) == "1";
        dir.hup = m.get(dirKey("hup", d)) == "1";
        dir.copy = m.get(dirKey("copy", d)) == "1";
        uint64_t in_pipe = 0;
        if (!m.get(dirKey("pipe", d)).empty() &&
            !readNumber(m, dirKey("pipe", d).c_str(), in_pipe, UINT32_MAX))
            return bad("a bad pipe" + std::to_string(d));
        dir.in_pipe = static_cast<uint32_t>(in_pipe);
        if (dir.copy && dir.in_pipe > 0) return bad("a copy direction with a pipe");
        if (dir.in_pipe > 0) fds_wanted += 2;
    }
    if (m.fds.size() != fds_wanted)
        return bad(std::to_string(m.fds.size()) + " fds came, " + std::to_string(fds_wanted) +
                   " expected");
    size_t at = 0;
    h.client_fd = std::move(m.fds[at++]);
    h.upstream_fd = std::move(m.fds[at++]);
    for (int d = 0; d < 2; ++d) {
        if (h.dir[d].in_pipe == 0) continue;
        h.pipe_read[d] = std::move(m.fds[at++]);
        h.pipe_write[d] = std::move(m.fds[at++]);
    }
    return h;
}

// ---- what a taker takes --------------------------------------------------------------------

bool Acceptance::takes(const std::string& listener, const std::string& cluster,
                       const std::string& backend) const {
    return std::find(listeners.begin(), listeners.end(), listener) != listeners.end() &&
           std::find(backends.begin(), backends.end(), cluster + "/" + backend) != backends.end();
}

void Acceptance::addTo(takeover::Message& m) const {
    m.set("fds", number(fds));
    for (const std::string& l : listeners) m.set("listener", l);
    for (const std::string& b : backends) m.set("backend", b);
}

Acceptance Acceptance::from(const takeover::Message& m) {
    Acceptance a;
    if (!readNumber(m, "fds", a.fds)) a.fds = 0;
    a.listeners = m.all("listener");
    a.backends = m.all("backend");
    return a;
}

// ---- the old relay's side ----------------------------------------------------------------

Outbound::Outbound(UniqueFd channel, Acceptance accepts, unsigned workers, int64_t deadline_ms)
    : channel_(std::move(channel)),
      accepts_(std::move(accepts)),
      deadline_ms_(deadline_ms),
      fds_left_(static_cast<int64_t>(std::min<uint64_t>(accepts_.fds, INT64_MAX))),
      workers_left_(workers) {}

bool Outbound::admits(const std::string& listener, const std::string& cluster,
                      const std::string& backend, uint32_t fds) {
    if (failed_.load() || !accepts_.takes(listener, cluster, backend)) return false;
    if (fds_left_.fetch_sub(fds) >= fds) return true;
    fds_left_.fetch_add(fds);
    return false;
}

tl::expected<void, std::string> Outbound::send(const HandedConn& h, std::span<const int> fds) {
    if (failed_.load()) return tl::unexpected(std::string("an earlier send failed"));
    auto sent = takeover::send(channel_.get(), toMessage(h), deadline_ms_, fds);
    if (!sent) failed_.store(true);
    return sent;
}

void Outbound::workerDone() {
    std::lock_guard lock(mutex_);
    if (workers_left_ > 0) --workers_left_;
    done_.notify_all();
}

bool Outbound::waitForWorkers(int64_t deadline_ms) {
    std::unique_lock lock(mutex_);
    while (workers_left_ > 0) {
        const int64_t left = deadline_ms - monotonicMs();
        if (left <= 0) return false;
        done_.wait_for(lock, std::chrono::milliseconds(left));
    }
    return true;
}

}  // namespace zcrelay::handover
