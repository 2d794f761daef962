#pragma once
// The in-kernel data path, one direction of it: the kernel redirects src's bytes to dst while
// this watches for what is left to user space (the kernel side, and why each step is needed,
// is in sockmap_kernel.hpp).
//
//   Redirecting ─passed bytes─▶ CatchingUp ─dst queued all redirected─▶ Copying ─caught up─┐
//        ▲  │                                                              │              │
//        │  └─FIN (POLLRDHUP), confirmed by a peek──▶ Ending ◀──FIN read──┘              │
//        └─────────────────────────────────────────────┼───────────────────────────────────┘
//                                                      └─dst queued every byte─▶ Finished
//
//   Redirecting  the program moves the bytes; a watch on src waits for its FIN (or an RST).
//   CatchingUp   the program passed bytes to user space and stopped redirecting: they may go
//                only once dst has queued everything redirected before them (a barrier,
//                looked at on a backing-off timer).
//   Copying      the passed bytes move by copy (a CopyPump, reading with MSG_DONTWAIT and only
//                while the program's count says bytes are there); once all are consumed the
//                program redirects again on its own.
//   Ending       src's stream ended: the FIN waits until dst has queued every byte src
//                received (the psock's backlog drains in the kernel, unseen). Past
//                max_connection_duration (PumpPort::ending) the program was told to stop
//                redirecting as the end was seen, and the FIN waits for the bytes this
//                direction moved, redirected and copied, since src goes on receiving.
//   Finished     dst was shut down for writing; src is still watched for an RST, since it is
//                the other direction's destination, written by the kernel alone.
//
// Handing over (PumpPort::handing): each step that would arm a watch, a barrier's timer or a
// recv arms nothing, and the phase stays where it is; a copy still sends what it holds. With
// nothing in flight and nothing held the direction is at rest in any phase: the kernel goes on
// redirecting (or passing) meanwhile, and restart() takes the phase's step again, in this relay
// or the next (resting(), adopted()).
#include <cstdint>

#include "pump/copy_pump.hpp"
#include "pump/pump.hpp"
#include "pump/sockmap_kernel.hpp"

namespace zcrelay {

class SockmapPump {
  public:
    // `pair_record`: the record of the connection's client socket (SockmapPair::record);
    // `dir`: which socket is src. `src_skipped`: bytes read from src and never sent (a PROXY
    // header taken), `dst_extra`: bytes written to dst outside the data path (a PROXY header
    // sent, and the early bytes sent on with it), both part of the kernel's counts the FIN
    // barrier compares. `dst_before`: every byte written to dst before this pump started, which
    // dst's count holds before the first redirected byte: dst_extra, or for a connection
    // promoted from splice (mode auto), all that splice moved too.
    // `carried`: the watch on src of the pump this one replaces, if any (one poll per socket).
    // `map`: the maps the pair's sockets are in (a relay's own, or those it adopted with the
    // connection at a handover).
    SockmapPump(Sockmap& map, uint32_t pair_record, uint8_t dir, uint32_t src_skipped,
                uint32_t dst_extra, uint64_t dst_before, const SourceWatch& carried = {})
        : copy_(carried),
          map_(&map),
          pair_record_(pair_record),
          dir_(dir),
          src_skipped_(src_skipped),
          dst_extra_(dst_extra),
          dst_before_(dst_before) {}

    Step start(const PumpPort& p, PumpEnv& env);
    // A direction at rest (nothing in flight, nothing held): its phase and counts, which the
    // maps' records go on from.
    RestingDirection resting() const;
    // Resumes a direction another relay handed over at rest, on the maps it adopted with it.
    static SockmapPump adopted(Sockmap& map, uint32_t pair_record, uint8_t dir,
                               const RestingDirection& r);
    // Takes the phase's step again after a handover: in the relay that adopted the direction,
    // or in the one that kept it. A Finished direction re-arms its error watch.
    Step restart(const PumpPort& p, PumpEnv& env);
    // Holds no passed bytes in user space (empty() of its copy).
    bool empty() const { return copy_.empty(); }
    // Watch, Barrier, and the copy's Recv, Send and PollOut completions.
    Step onCompletion(const PumpPort& p, PumpEnv& env, Op op, int res, uint32_t flags,
                      uint8_t aux);
    // The program signalled this socket's worker: passed bytes waiting for user space?
    Step scan(const PumpPort& p, PumpEnv& env);
    // After Step::starved: buffers came back to the ring.
    Step resume(const PumpPort& p, PumpEnv& env);
    // Bytes the kernel redirected since the last look (they count as the path's bytes).
    uint64_t kernelBytes(PumpEnv&) { return fold(*map_); }
    void quiet(PumpEnv&) {}
    // The connection closes: a barrier timer holds no file, so the socket cancels miss it.
    void abort(const PumpPort& p, PumpEnv& env);
    // The slot is freed: the copy's queued buffers go back to the ring.
    void reclaim(PumpEnv& env) { copy_.reclaim(env); }

    // Cuts what the program marked as seen before (relay.bpf.c) out of `len` passed bytes just
    // received into `data`; returns how many are left.
    uint32_t dropReplayed(Sockmap& map, ListenerStats& counts, char* data, uint32_t len);

  private:
    enum class Phase : uint8_t { Redirecting, CatchingUp, Copying, Ending, Finished };

    uint32_t record() const { return pair_record_ + dir_; }
    uint64_t fold(Sockmap& map);
    bool hasPassed(Sockmap& map) const;
    // Past max_connection_duration: every byte the program passed before it stopped is taken.
    // (end_passed_ stays UINT64_MAX, which no count reaches, until the program stopped.)
    bool endReached() const { return taken_ >= end_passed_; }
    // To the FIN: what this direction moved must reach dst first (finBarrier).
    void startEnding(const PumpPort& p, PumpEnv& env, Step& out);
    bool eofSeen() const { return phase_ >= Phase::Ending || copy_.eof(); }
    // The step the phase waits for, again: after a barrier's `timer`, or resuming (restart).
    void stepAgain(const PumpPort& p, PumpEnv& env, Step& out, bool timer);
    // Back to the kernel path: watch for the FIN, unless passed bytes or the FIN wait.
    void redirect(const PumpPort& p, PumpEnv& env, Step& out);
    void onWatch(const PumpPort& p, PumpEnv& env, int res, Step& out);
    void checkEnd(const PumpPort& p, PumpEnv& env, Step& out);
    void startCatchUp(const PumpPort& p, PumpEnv& env, Step& out);
    void catchUp(const PumpPort& p, PumpEnv& env, Step& out);
    void advanceCopy(const PumpPort& p, PumpEnv& env, Step& out);
    void finBarrier(const PumpPort& p, PumpEnv& env, Step& out);
    // Past max_connection_duration, once: the program passes src's bytes from now on.
    void stopIfEnding(const PumpPort& p, PumpEnv& env);
    // True if the barrier `b` is passed; otherwise it waits (timer) or failed (out).
    bool barrierDone(const PumpPort& p, const SockmapBarrier& b, Step& out);
    // A timer for the next look; `back_off`: wait longer than last time (nothing moved).
    void armBarrier(const PumpPort& p, bool back_off);

    CopyPump copy_;  // the passed bytes; its watch on src is the direction's only watch
    Sockmap* map_;
    uint32_t pair_record_;
    uint8_t dir_;
    Phase phase_ = Phase::Redirecting;
    bool barrier_armed_ = false;  // a timer to look at a barrier (or the EOF) again
    bool stopped_ = false;        // the program was told to stop redirecting (stopIfEnding)
    uint8_t barrier_step_ = 0;    // how many times it waited in a row (the back-off)
    uint32_t src_skipped_;
    uint32_t dst_extra_;
    uint64_t dst_before_;
    uint64_t seen_ = 0;   // record.redirected already folded into the byte counts
    uint64_t taken_ = 0;  // passed bytes received by user space
    // record.passed when the program stopped redirecting (stopIfEnding): what it passes after
    // that is what the peer sent past max_connection_duration, which stays unread.
    uint64_t end_passed_ = UINT64_MAX;
    uint64_t consumed_ = 0;      // of those, bytes sent to dst or skipped (mirrored in the record)
    uint64_t copied_ = 0;        // of those, bytes sent to dst
    uint64_t barrier_left_ = 0;  // bytes the barrier still waited for last time
};

}  // namespace zcrelay
