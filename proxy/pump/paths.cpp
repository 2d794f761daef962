#include "pump/paths.hpp"

#include <bpf/libbpf.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "log.hpp"

namespace zcrelay {

namespace {

// The in-flight bound per direction (the psock's backlog plus the peer's send queue): four
// pipes' worth, comparable to what splice has the kernel hold for a direction (one pipe plus
// the socket buffers). pipe_size is the one knob for both.
uint64_t inFlightLimit(uint64_t pipe_size) { return std::max<uint64_t>(4 * pipe_size, 64 * 1024); }

// mode auto: the largest turn that still counts as a message, and how many such turns in a row
// make a connection interactive (two round trips). 16 KiB is splice's own line between a small
// read and a bulk one (kSmallRead in splice_pump.cpp): a larger message costs splice no more
// wake-ups than the kernel path, and a stream of them is what the in-flight bound would make
// the program pass to user space.
constexpr uint64_t kAutoSmallTurn = 16 * 1024;
constexpr uint8_t kAutoTurns = 4;

}  // namespace

Paths::Paths(Ring& ring, Sockmap* sockmap, uint32_t base, uint32_t max_conns, WorkerStats& stats,
             uint32_t worker)
    : ring_(ring),
      sockmap_(sockmap),
      base_(base),
      max_conns_(max_conns),
      stats_(stats),
      worker_(worker) {}

Result<void> Paths::startSignal() {
    if (sockmap_ == nullptr) return {};
    woken_.reserve(ZCR_WAKE_RING_BYTES / 16);
    WakeRing own;
    own.map = sockmap_;
    own.index = worker_;
    own.own = true;
    if (auto opened = openRing(own); !opened) return opened;
    rings_.push_back(std::move(own));
    armSignal(0);
    return {};
}

Result<void> Paths::openRing(WakeRing& r) {
    r.reader = ring_buffer__new(r.map->wakeRingFd(r.index), &Paths::onWake, this, nullptr);
    if (r.reader == nullptr) return sysError("mapping a sockmap wake-up ring");
    r.lost = r.map->wakeLost(r.index);
    return {};
}

Paths::~Paths() {
    for (WakeRing& r : rings_)
        if (r.reader != nullptr) ring_buffer__free(r.reader);
}

void Paths::enter(PathState& state, const PairSetUp& s, ListenerStats& counts) {
    for (int i = 0; i < 2; ++i)
        if (state.sockmap.in_map[i]) stats_.sockmap_sockets.add();
    if (state.sockmap.any()) counts.sockmap_connections.add();
    if (s.fell_back) counts.sockmap_fallbacks[idx(s.reason)].add();
}

void Paths::choose(const PathRequest& r, PathState& state, Pump& up, Pump& down) {
    DataPath path[2] = {DataPath::Splice, DataPath::Splice};
    if (r.mode == Mode::Copy) path[0] = path[1] = DataPath::Copy;
    // The sockmap program relays TCP sockets only; a unix backend runs splice.
    bool kernel_path = ownMaps() && !r.unix_backend;
    if (r.mode == Mode::Sockmap && kernel_path) {
        PairSetUp s;
        if (r.partly_read) {
            s.fell_back = true;
            s.reason = SockmapFallback::PartlyRead;
            s.path[0] = s.path[1] = DataPath::Splice;
        } else if (r.slot < max_conns_) {
            // What went to the upstream before the sockets entered the map: proxy_out counts
            // the PROXY header sent and the early bytes (HelloReader::forward).
            const uint64_t sent_before[2] = {r.proxy_out, 0};
            s = setUpPair(*sockmap_, state.sockmap, r.fd, base_ + 2 * r.slot,
                          inFlightLimit(r.pipe_size), sent_before);
        } else {
            // Slots stay below max_conns (the fd budget bounds live connections); defensive.
            s.fell_back = true;
            s.reason = SockmapFallback::NoRecord;
            s.path[0] = s.path[1] = DataPath::Splice;
        }
        enter(state, s, r.counts);
        if (s.fell_back)
            LOG_DEBUG("%s: sockmap fallback %s", r.listener.c_str(),
                      std::string(label(s.reason)).c_str());
        path[0] = s.path[0];
        path[1] = s.path[1];
    }
    // mode auto: splice first, watched for promote(). By the time it is promoted, splice has
    // read whatever a PROXY header or a ClientHello was read from: a promotion happens only
    // when the last splice found the client's socket empty.
    state.watch.on = r.mode == Mode::Auto && kernel_path && r.slot < max_conns_ && r.auto_max > 0;
    Pump* pumps[2] = {&up, &down};
    for (int d = 0; d < 2; ++d) {
        switch (path[d]) {
            case DataPath::Splice:
                pumps[d]->emplace<SplicePump>();
                break;
            case DataPath::Copy:
                pumps[d]->emplace<CopyPump>();
                break;
            case DataPath::Sockmap:
                // The PROXY headers taken and sent are bytes of direction 0's sockets.
                pumps[d]->emplace<SockmapPump>(*sockmap_, state.sockmap.record,
                                               static_cast<uint8_t>(d), d == 0 ? r.proxy_in : 0,
                                               d == 0 ? r.proxy_out : 0, d == 0 ? r.proxy_out : 0);
                break;
            case DataPath::kCount:  // not a path: the table's size
                break;
        }
    }
    // The early bytes went out by copy before the sockets entered the map: the sockmap
    // direction counts them as copied.
    if (r.early > 0 && path[0] == DataPath::Sockmap) r.counts.sockmap_copied.add(r.early);
}

bool Paths::observe(PathState& state, int d, uint64_t n) {
    AutoWatch& w = state.watch;
    if (!w.on) return false;
    if (d != w.last) {
        // The other side speaks: the turn before this one is over.
        if (w.last >= 0) w.turns = w.turn_bytes <= kAutoSmallTurn ? w.turns + 1 : 0;
        w.last = static_cast<int8_t>(d);
        w.turn_bytes = 0;
    }
    w.turn_bytes += n;
    if (w.turn_bytes > kAutoSmallTurn) w.turns = 0;
    return w.turns >= kAutoTurns;
}

unsigned Paths::promote(const PromoteRequest& r, PathState& state, Pump& up, Pump& down,
                        PipePool& pipes) {
    Pump* pumps[2] = {&up, &down};
    for (Pump* pump : pumps) {
        auto* splice = std::get_if<SplicePump>(pump);
        if (splice == nullptr || !splice->betweenReads()) return 0;
    }
    if (!ownMaps()) {
        // Its ring crossed at a handover: no one here would hear its connections.
        state.watch.on = false;
        return 0;
    }
    if (r.live > r.auto_max) {
        // Too many connections for the kernel path to pay: look again after as many turns
        // (some may have closed by then).
        state.watch.turns = 0;
        return 0;
    }
    state.watch.on = false;
    SourceWatch watch[2];
    for (int d = 0; d < 2; ++d) {
        auto& splice = std::get<SplicePump>(*pumps[d]);
        watch[d] = splice.watch();
        splice.releaseIdle(pipes);
    }
    // Everything splice wrote (and a PROXY header before it) is in each destination's count,
    // which the barriers and the in-flight bound compare with: taken from the kernel.
    const uint64_t sent_before[2] = {queuedOn(r.fd[1]), queuedOn(r.fd[0])};
    PairSetUp s = setUpPair(*sockmap_, state.sockmap, r.fd, base_ + 2 * r.slot,
                            inFlightLimit(r.pipe_size), sent_before);
    enter(state, s, r.counts);
    unsigned replaced = 0;
    for (int d = 0; d < 2; ++d) {
        switch (s.path[d]) {
            case DataPath::Splice:
                break;  // the kernel would not take it: the splice pump goes on as it was
            case DataPath::Copy:
                // The client's socket went in and the upstream's did not: what the client
                // sends is passed to user space, where only a read (not splice) finds it.
                pumps[d]->emplace<CopyPump>(watch[d]);
                replaced |= 1u << d;
                break;
            case DataPath::Sockmap:
                pumps[d]->emplace<SockmapPump>(*sockmap_, state.sockmap.record,
                                               static_cast<uint8_t>(d), d == 0 ? r.proxy_in : 0,
                                               d == 0 ? r.proxy_out : 0, sent_before[d], watch[d]);
                replaced |= 1u << d;
                break;
            case DataPath::kCount:
                break;
        }
        if (s.path[d] != DataPath::Splice)
            r.counts.path_switches[idx(s.path[d])][idx(SwitchReason::Interactive)].add();
    }
    if (state.sockmap.any()) {
        state.promoted = true;
        for (int fd : r.fd) leaveSendingToTheKernel(fd);
    }
    return replaced;
}

Step Paths::fallBack(Pump& pump, const PumpPort& p, PumpEnv& env, PipeFallback why) {
    stats_.pipe_fallbacks[idx(why)].add();
    // Only the splice pump falls back. Its watch on src, if armed, is the copy's now: one poll
    // per socket.
    SourceWatch watch = std::get<SplicePump>(pump).watch();
    return pump.emplace<CopyPump>(watch).start(p, env);
}

void Paths::armSignal(uint32_t ring) {
    WakeRing& r = rings_[ring];
    if (r.polling || r.held || r.handed) return;
    // One-shot and level-triggered: wake-ups written while it was not armed fire it at once.
    io_uring_sqe* sqe = ring_.sqe();
    io_uring_prep_poll_add(sqe, r.map->wakeRingFd(r.index), POLLIN);
    io_uring_sqe_set_data64(sqe, UserData{Op::PathSignal, 0, ring, 0}.pack());
    r.polling = true;
}

bool Paths::drainSignal(WakeRing& r) {
    woken_.clear();
    woken_overflow_ = false;
    ring_buffer__consume(r.reader);
    uint64_t lost = r.map->wakeLost(r.index);
    bool all = lost != r.lost || woken_overflow_;
    r.lost = lost;
    if (r.own) stats_.sockmap_wakeups_lost.set(lost);
    return all;
}

uint32_t Paths::slotOf(const WakeRing& r, uint32_t index) const {
    if (r.own)
        return index >= base_ && (index - base_) / 2 < max_conns_ ? (index - base_) / 2
                                                                  : UINT32_MAX;
    const uint32_t* slot = r.entry(index);
    return slot != nullptr ? *slot : UINT32_MAX;
}

uint32_t* Paths::WakeRing::entry(uint32_t record) {
    const uint64_t first = uint64_t{index} * map->recordsPerWorker();
    if (record < first || (record - first) / 2 >= slot_of.size()) return nullptr;
    return &slot_of[(record - first) / 2];
}

int Paths::onWake(void* self, void* data, size_t size) {
    auto* paths = static_cast<Paths*>(self);
    if (size < sizeof(uint32_t)) return 0;
    if (paths->woken_.size() == paths->woken_.capacity()) {
        // More than the ring holds arrived while it was read: look at everything instead.
        paths->woken_overflow_ = true;
        return 0;
    }
    uint32_t index;
    std::memcpy(&index, data, sizeof index);
    paths->woken_.push_back(index);
    return 0;
}

bool Paths::broken(const PathState& state, int& side) const {
    return state.sockmap.any() && pairBroken(*state.sockmap.map, state.sockmap, side);
}

void Paths::tearDown(PathState& state, ListenerStats& counts) {
    if (!state.sockmap.any()) return;
    Sockmap& map = *state.sockmap.map;
    for (int d = 0; d < 2; ++d)
        if (state.sockmap.linked[d])
            counts.sockmap_replays.add(loadRelaxed(map.record(state.sockmap.record + d).replayed));
    // Out of the maps before close(): see pump/sockmap_kernel.hpp.
    forget(state);
    tearDownPair(map, state.sockmap);
}

// ---- handover --------------------------------------------------------------------------------

int Paths::ringOf(const PathState& state) const {
    if (!state.sockmap.any()) return -1;
    const uint32_t index = state.sockmap.map->ringOf(state.sockmap.record);
    for (size_t i = 0; i < rings_.size(); ++i)
        if (rings_[i].map == state.sockmap.map && rings_[i].index == index)
            return static_cast<int>(i);
    return -1;
}

void Paths::holdSignal(uint32_t ring) {
    WakeRing& r = rings_[ring];
    r.held = true;
    if (!r.polling) return;
    ring_.cancelRequest(UserData{Op::PathSignal, 0, ring, 0}.pack());
}

void Paths::releaseSignal(uint32_t ring) {
    rings_[ring].held = false;
    armSignal(ring);
}

void Paths::ringHandedOver(uint32_t ring) {
    WakeRing& r = rings_[ring];
    r.handed = true;
    if (r.own) own_handed_ = true;
}

void Paths::takeBack(uint32_t ring) {
    WakeRing& r = rings_[ring];
    if (!r.handed) return;
    r.handed = false;
    r.held = false;
    if (r.own) own_handed_ = false;
    armSignal(ring);
}

void Paths::handedOver(PathState& state) { forget(state); }

void Paths::forget(PathState& state) {
    for (int i = 0; i < 2; ++i)
        if (state.sockmap.in_map[i]) stats_.sockmap_sockets.sub();
    if (int ring = ringOf(state); ring >= 0 && !rings_[ring].own)
        if (uint32_t* slot = rings_[ring].entry(state.sockmap.record)) *slot = UINT32_MAX;
}

Result<uint32_t> Paths::adoptRing(Sockmap& map, uint32_t index) {
    for (size_t i = 0; i < rings_.size(); ++i)
        if (rings_[i].map == &map && rings_[i].index == index) return static_cast<uint32_t>(i);
    if (woken_.capacity() == 0) woken_.reserve(ZCR_WAKE_RING_BYTES / 16);
    WakeRing r;
    r.map = &map;
    r.index = index;
    r.slot_of.assign(map.recordsPerWorker() / 2 + 1, UINT32_MAX);
    if (auto opened = openRing(r); !opened) return tl::unexpected(opened.error());
    rings_.push_back(std::move(r));
    const auto at = static_cast<uint32_t>(rings_.size() - 1);
    armSignal(at);
    return at;
}

void Paths::watchAdopted(PathState& state, Mode mode, bool unix_backend, uint32_t slot,
                         unsigned auto_max) {
    state.watch = AutoWatch{};
    state.watch.on = mode == Mode::Auto && ownMaps() && !unix_backend && slot < max_conns_ &&
                     auto_max > 0 && !state.sockmap.any() && !state.promoted;
}

void Paths::adopt(PathState& state, uint32_t slot) {
    for (int i = 0; i < 2; ++i)
        if (state.sockmap.in_map[i]) stats_.sockmap_sockets.add();
    const int ring = ringOf(state);
    if (ring < 0 || rings_[ring].own) return;
    if (uint32_t* entry = rings_[ring].entry(state.sockmap.record)) *entry = slot;
}

}  // namespace zcrelay
