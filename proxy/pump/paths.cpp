#include "pump/paths.hpp"

#include <algorithm>
#include <string>

#include "log.hpp"

namespace zcrelay {

Paths::Paths(Ring& ring, Sockmap* sockmap, uint32_t base, uint32_t max_conns, WorkerStats& stats)
    : ring_(ring), sockmap_(sockmap), base_(base), max_conns_(max_conns), stats_(stats) {}

void Paths::choose(const PathRequest& r, PathState& state, Pump& up, Pump& down) {
    DataPath path[2] = {DataPath::Splice, DataPath::Splice};
    if (r.mode == DataPath::Copy) path[0] = path[1] = DataPath::Copy;
    // The sockmap program relays TCP sockets only; a unix backend runs splice.
    if (r.mode == DataPath::Sockmap && sockmap_ != nullptr && !r.unix_backend) {
        PairSetUp s;
        if (r.partly_read) {
            s.fell_back = true;
            s.reason = SockmapFallback::PartlyRead;
            s.path[0] = s.path[1] = DataPath::Splice;
        } else if (r.slot < max_conns_) {
            // In flight per direction (the psock's backlog plus the peer's send queue): four
            // pipes' worth, comparable to what splice has the kernel hold for a direction (one
            // pipe plus the socket buffers). pipe_size is the one knob for both.
            uint64_t limit = std::max<uint64_t>(4 * r.pipe_size, 64 * 1024);
            s = setUpPair(*sockmap_, state.sockmap, r.fd, base_ + 2 * r.slot, limit);
        } else {
            // Slots stay below max_conns (the fd budget bounds live connections); defensive.
            s.fell_back = true;
            s.reason = SockmapFallback::NoRecord;
            s.path[0] = s.path[1] = DataPath::Splice;
        }
        for (int i = 0; i < 2; ++i)
            if (state.sockmap.in_map[i]) stats_.sockmap_sockets.add();
        if (state.sockmap.any()) {
            if (holders_++ == 0) armScan();
            r.counts.sockmap_connections.add();
        }
        if (s.fell_back) {
            r.counts.sockmap_fallbacks[idx(s.reason)].add();
            LOG_DEBUG("%s: sockmap fallback %s", r.listener.c_str(),
                      std::string(label(s.reason)).c_str());
        }
        path[0] = s.path[0];
        path[1] = s.path[1];
    }
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
                pumps[d]->emplace<SockmapPump>(state.sockmap.record, static_cast<uint8_t>(d),
                                               d == 0 ? r.proxy_in : 0, d == 0 ? r.proxy_out : 0);
                break;
            case DataPath::kCount:  // not a path: the table's size
                break;
        }
    }
    // The early bytes went out by copy before the sockets entered the map: the sockmap
    // direction counts them as copied.
    if (r.early > 0 && path[0] == DataPath::Sockmap) r.counts.sockmap_copied.add(r.early);
}

Step Paths::fallBack(Pump& pump, const PumpPort& p, PumpEnv& env, PipeFallback why) {
    stats_.pipe_fallbacks[idx(why)].add();
    // Only the splice pump falls back. Its watch on src, if armed, is the copy's now: one poll
    // per socket.
    SourceWatch watch = std::get<SplicePump>(pump).watch();
    return pump.emplace<CopyPump>(watch).start(p, env);
}

void Paths::armScan() {
    static constexpr __kernel_timespec kScan = {0, 10000000};
    io_uring_sqe* sqe = ring_.sqe();
    io_uring_prep_timeout(sqe, const_cast<__kernel_timespec*>(&kScan), 0, 0);
    io_uring_sqe_set_data64(sqe, UserData{Op::PathScan}.pack());
}

bool Paths::broken(const PathState& state, int& side) const {
    return state.sockmap.any() && pairBroken(*sockmap_, state.sockmap, side);
}

void Paths::tearDown(PathState& state, ListenerStats& counts) {
    if (!state.sockmap.any()) return;
    for (int d = 0; d < 2; ++d)
        if (state.sockmap.linked[d])
            counts.sockmap_replays.add(
                loadRelaxed(sockmap_->record(state.sockmap.record + d).replayed));
    // Out of the maps before close(): see pump/sockmap_kernel.hpp.
    for (int i = 0; i < 2; ++i)
        if (state.sockmap.in_map[i]) stats_.sockmap_sockets.sub();
    tearDownPair(*sockmap_, state.sockmap);
    --holders_;
}

}  // namespace zcrelay
