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

std::string bits(const bool (&b)[2]) { return std::string{b[0] ? '1' : '0', b[1] ? '1' : '0'}; }

bool readBits(const std::string& text, bool (&b)[2]) {
    if (text.size() != 2) return false;
    for (int i = 0; i < 2; ++i) {
        if (text[i] != '0' && text[i] != '1') return false;
        b[i] = text[i] == '1';
    }
    return true;
}

// A sockmap direction's state at rest: its fields in order, comma-separated.
std::string sockmapText(const SockmapResting& k) {
    std::string t;
    for (uint64_t v :
         {uint64_t{k.phase}, uint64_t{k.stopped}, uint64_t{k.src_skipped}, uint64_t{k.dst_extra},
          k.dst_before, k.seen, k.taken, k.end_passed, k.consumed, k.copied}) {
        if (!t.empty()) t += ',';
        t += number(v);
    }
    return t;
}

bool readSockmap(const std::string& text, SockmapResting& k) {
    uint64_t v[10];
    size_t n = 0, at = 0;
    while (n < std::size(v)) {
        const size_t comma = text.find(',', at);
        const std::string part = text.substr(at, comma == std::string::npos ? comma : comma - at);
        if (part.empty() || part.size() > 20 || part[0] == '-') return false;
        char* end = nullptr;
        errno = 0;
        v[n++] = std::strtoull(part.c_str(), &end, 10);
        if (*end != '\0' || errno != 0) return false;
        if (comma == std::string::npos) break;
        at = comma + 1;
    }
    if (n != std::size(v) || v[0] > UINT8_MAX || v[1] > 1 || v[2] > UINT32_MAX || v[3] > UINT32_MAX)
        return false;
    k = {static_cast<uint8_t>(v[0]),
         v[1] != 0,
         static_cast<uint32_t>(v[2]),
         static_cast<uint32_t>(v[3]),
         v[4],
         v[5],
         v[6],
         v[7],
         v[8],
         v[9]};
    return true;
}

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
    if (h.proxy_in > 0 || h.proxy_out > 0)
        m.set("proxy", number(h.proxy_in) + "," + number(h.proxy_out));
    for (int d = 0; d < 2; ++d) {
        const RestingDirection& dir = h.dir[d];
        if (dir.finished) m.set(dirKey("fin", d), "1");
        if (dir.eof) m.set(dirKey("eof", d), "1");
        if (dir.hup) m.set(dirKey("hup", d), "1");
        if (dir.in_pipe > 0) m.set(dirKey("pipe", d), number(dir.in_pipe));
        if (dir.copy) m.set(dirKey("copy", d), "1");
        if (dir.sockmap) m.set(dirKey("sm", d), sockmapText(dir.kernel));
    }
    if (h.pair.map_id != 0) {
        m.set("map", number(h.pair.map_id))
            .set("record", number(h.pair.record))
            .set("linked", bits(h.pair.linked))
            .set("in", bits(h.pair.in_map));
        if (h.pair.promoted) m.set("promoted", "1");
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
    if (const std::string proxy = m.get("proxy"); !proxy.empty()) {
        const size_t comma = proxy.find(',');
        char* end = nullptr;
        const unsigned long in = std::strtoul(proxy.c_str(), &end, 10);
        const bool in_ok = comma != std::string::npos && end == proxy.c_str() + comma;
        const unsigned long out = in_ok ? std::strtoul(proxy.c_str() + comma + 1, &end, 10) : 0;
        if (!in_ok || *end != '\0' || in > UINT16_MAX || out > UINT16_MAX || proxy[0] == '-' ||
            proxy[comma + 1] == '-')
            return bad("a bad proxy");
        h.proxy_in = static_cast<uint32_t>(in);
        h.proxy_out = static_cast<uint32_t>(out);
    }
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
        const std::string sm = m.get(dirKey("sm", d));
        dir.sockmap = !sm.empty();
        if (dir.sockmap && !readSockmap(sm, dir.kernel)) return bad("a bad sm" + std::to_string(d));
        if (dir.sockmap && (dir.copy || dir.in_pipe > 0))
            return bad("a sockmap direction with a pipe or on copy");
    }
    if (!m.get("map").empty()) {
        uint64_t id = 0, record = 0;
        if (!readNumber(m, "map", id, UINT32_MAX) || id == 0 ||
            !readNumber(m, "record", record, UINT32_MAX - 1) ||
            !readBits(m.get("linked"), h.pair.linked) || !readBits(m.get("in"), h.pair.in_map))
            return bad("a bad sockmap pair");
        h.pair.map_id = static_cast<uint32_t>(id);
        h.pair.record = static_cast<uint32_t>(record);
        h.pair.promoted = m.get("promoted") == "1";
    }
    if ((h.dir[0].sockmap || h.dir[1].sockmap) && h.pair.map_id == 0)
        return bad("a sockmap direction without its pair");
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

takeover::Message toMessage(const HandedRing& h) {
    takeover::Message m("RING");
    m.set("map", number(h.map_id))
        .set("rings", number(h.rings))
        .set("rpw", number(h.records_per_worker))
        .set("ring", number(h.ring))
        .set("layout", h.layout);
    return m;
}

tl::expected<HandedRing, std::string> ringFromMessage(takeover::Message& m) {
    if (m.verb != "RING") return tl::unexpected("expected RING, got " + m.line());
    HandedRing h;
    uint64_t id = 0, rings = 0, rpw = 0, ring = 0;
    if (!readNumber(m, "map", id, UINT32_MAX) || id == 0 || !readNumber(m, "rings", rings, 4096) ||
        rings == 0 || !readNumber(m, "rpw", rpw, UINT32_MAX) || rpw == 0 ||
        !readNumber(m, "ring", ring, rings - 1))
        return tl::unexpected("RING: a missing or bad number: " + m.line());
    h.map_id = static_cast<uint32_t>(id);
    h.rings = static_cast<uint32_t>(rings);
    h.records_per_worker = static_cast<uint32_t>(rpw);
    h.ring = static_cast<uint32_t>(ring);
    h.layout = m.get("layout");
    if (m.fds.size() != kRingFds)
        return tl::unexpected("RING map=" + m.get("map") + ": " + std::to_string(m.fds.size()) +
                              " fds came, " + std::to_string(kRingFds) + " expected");
    for (size_t i = 0; i < kRingFds; ++i) h.fds[i] = std::move(m.fds[i]);
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
    if (!sockmap.empty()) m.set("sockmap", sockmap);
}

Acceptance Acceptance::from(const takeover::Message& m) {
    Acceptance a;
    if (!readNumber(m, "fds", a.fds)) a.fds = 0;
    a.listeners = m.all("listener");
    a.backends = m.all("backend");
    a.sockmap = m.get("sockmap");
    return a;
}

// ---- the old relay's side ----------------------------------------------------------------

Outbound::Outbound(UniqueFd channel, Acceptance accepts, unsigned workers, int64_t deadline_ms)
    : channel_(std::move(channel)),
      accepts_(std::move(accepts)),
      deadline_ms_(deadline_ms),
      fds_left_(static_cast<int64_t>(std::min<uint64_t>(accepts_.fds, INT64_MAX))),
      workers_left_(workers) {}

bool Outbound::reserve(uint64_t fds) {
    const auto n = static_cast<int64_t>(std::min<uint64_t>(fds, INT64_MAX / 2));
    if (fds_left_.fetch_sub(n) >= n) return true;
    fds_left_.fetch_add(n);
    return false;
}

tl::expected<void, std::string> Outbound::send(const takeover::Message& m,
                                               std::span<const int> fds) {
    if (failed_.load()) return tl::unexpected(std::string("an earlier send failed"));
    auto sent = takeover::send(channel_.get(), m, deadline_ms_, fds);
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
