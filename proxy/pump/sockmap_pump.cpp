#include "pump/sockmap_pump.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

namespace zcrelay {

bool SockmapPump::hasPassed(Sockmap& map) const {
    return std::min<uint64_t>(loadRelaxed(map.record(record()).passed), end_passed_) > taken_;
}

Step SockmapPump::start(const PumpPort& p, PumpEnv& env) {
    Step out;
    redirect(p, env, out);
    return out;
}

void SockmapPump::redirect(const PumpPort& p, PumpEnv& env, Step& out) {
    // Handing over: what would come next is restart()'s (passed bytes, the FIN, the watch).
    if (p.handing) return;
    // Back to waiting for the program's signal, which it sends only for a byte passed while
    // consumed == passed: our store of consumed and its add to passed race, so one of us must
    // see the other's. The fence orders our store before this load; the program adds first,
    // with a locked instruction, and looks at consumed after (relay.bpf.c).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (hasPassed(*map_))
        startCatchUp(p, env, out);
    else if (copy_.watch().hup)
        checkEnd(p, env, out);  // the FIN came while we were moving passed bytes
    else
        copy_.watch().arm(p, eofSeen());
}

Step SockmapPump::onCompletion(const PumpPort& p, PumpEnv& env, Op op, int res, uint32_t flags,
                               uint8_t aux) {
    Step out;
    switch (op) {
        case Op::Watch:
            onWatch(p, env, res, out);
            return out;
        case Op::Barrier:
            barrier_armed_ = false;
            stepAgain(p, env, out, true);
            return out;
        case Op::Recv: {
            if ((res == 0 || res == -EAGAIN) && hasPassed(*map_)) {
                // Not the end yet. A passed skb that finds its psock's queue busy (with the
                // other direction's bytes on their way out of this socket) is delivered later
                // by the psock worker, and the FIN behind it can be seen first: recvmsg()
                // returns 0 while the program's count says bytes are missing (measured, 1 in
                // ~30 runs of 200 concurrent echoes). The recv would keep returning 0 at once,
                // so look again on a timer until they arrived. -EAGAIN: the same bytes, not
                // yet on the psock's queue (RecvWait::Caller).
                copy_.recvDone(env, res, flags);
                armBarrier(p, true);
                return out;
            }
            int error = 0;
            auto got = copy_.onRecv(
                p, env, res, flags,
                [&](char* data, uint32_t len) {
                    uint32_t kept = dropReplayed(*map_, p.counts, data, len);
                    taken_ += len;
                    return kept;
                },
                error);
            if (got == CopyPump::Got::Failed) return Step::failed(true, error);
            if (got == CopyPump::Got::Starved) {
                out.starved = true;
                return out;
            }
            out.active = got == CopyPump::Got::Data;
            break;
        }
        case Op::Send: {
            if (copy_.notified(env, res, flags, aux)) return out;
            int64_t n = copy_.onSend(p, env, res, flags);
            if (n < 0) return Step::failed(false, static_cast<int>(-n));
            if (n > 0) {
                // Queued on dst: the program may redirect again once all passed bytes are.
                auto sent = static_cast<uint64_t>(n);
                out.moved = sent;
                copied_ += sent;
                consumed_ += sent;
                storeRelaxed(map_->record(record()).consumed, __u64{consumed_});
                p.counts.sockmap_copied.add(sent);
            }
            break;
        }
        case Op::PollOut:
            copy_.pollOutDone();
            if (res < 0) return out;
            break;
        default:
            return out;
    }
    advanceCopy(p, env, out);
    return out;
}

void SockmapPump::onWatch(const PumpPort& p, PumpEnv& env, int res, Step& out) {
    SourceWatch& watch = copy_.watch();
    watch.armed = false;
    if (res < 0) return;
    if (phase_ == Phase::Finished) {
        // The error watch of a finished source (see finBarrier): POLLHUP alone means its
        // writing side was shut too, i.e. the connection is done.
        if (res & POLLERR) out.fail(true, ECONNRESET);
        return;
    }
    if (res & POLLERR) {
        int err = pendingError(p.src);
        // The psock worker reports a send it could not make into this socket as EPIPE on
        // it. Once this socket's writing side is shut down (the other direction finished)
        // that is the FIN-time artefact of the teardown, not a broken stream.
        if (err != EPIPE || !p.src_write_shut) {
            out.fail(true, err);
            return;
        }
    }
    if (!(res & (POLLRDHUP | POLLHUP))) {
        watch.arm(p, eofSeen());
        return;
    }
    watch.hup = true;
    // Moving passed bytes: the copy reads the FIN in order after them.
    if (phase_ == Phase::CatchingUp || phase_ == Phase::Copying) return;
    checkEnd(p, env, out);
}

void SockmapPump::checkEnd(const PumpPort& p, PumpEnv& env, Step& out) {
    // Before the peek, so that what arrives from now on shows as passed bytes, which the copy
    // reads up to what had passed when the program stopped (endReached).
    stopIfEnding(p, env);
    if (endReached()) {
        // Not the peek below. After shutdown(SHUT_RD) TCP still queues what the peer sends, and
        // a read returns it: 0 comes only when the queue happens to be empty (checked on this
        // kernel). A peer that goes on sending would keep the peek finding bytes, and reading
        // them would chase its stream until the grace ran out: a reset instead of the FIN
        // whenever the relay reads slower than the peer sends.
        startEnding(p, env, out);
        return;
    }
    SockmapEof e = checkEof(p.src, p.src_write_shut);
    switch (e.kind) {
        case SockmapEof::Eof:
            if (hasPassed(*map_)) {
                // See the Recv case: passed bytes still on their way; they come first.
                startCatchUp(p, env, out);
                return;
            }
            startEnding(p, env, out);
            return;
        case SockmapEof::Again:
            armBarrier(p, true);
            return;
        case SockmapEof::Passed:
            startCatchUp(p, env, out);
            return;
        case SockmapEof::Failed:
            out.fail(true, e.error);
            return;
    }
}

void SockmapPump::startCatchUp(const PumpPort& p, PumpEnv& env, Step& out) {
    if (phase_ == Phase::CatchingUp || phase_ == Phase::Copying) return;
    phase_ = Phase::CatchingUp;
    barrier_step_ = 0;
    p.counts.sockmap_catchups.add();
    catchUp(p, env, out);
}

void SockmapPump::catchUp(const PumpPort& p, PumpEnv& env, Step& out) {
    // The program stopped redirecting when it passed the first of these bytes, so the
    // redirected count is final: once dst has queued all of it (and what we copied before),
    // the passed bytes go next, by copy.
    uint64_t expected = loadRelaxed(map_->record(record()).redirected) + copied_ + dst_before_;
    if (!barrierDone(p, checkQueued(p.dst, expected), out)) return;
    phase_ = Phase::Copying;
    advanceCopy(p, env, out);
}

void SockmapPump::advanceCopy(const PumpPort& p, PumpEnv& env, Step& out) {
    // Ending while copying: the watch's wake-up is ignored in this phase, so stop here.
    stopIfEnding(p, env);
    // Read only what the program passed. A recv armed with nothing passed would sit on a
    // socket whose bytes the kernel redirects, woken by each skb.
    switch (copy_.advance(p, env, hasPassed(*map_), RecvWait::Caller)) {
        case CopyPump::Flow::Moving:
            return;
        case CopyPump::Flow::Drained:
            // The FIN: after the kernel's backlog, like any sockmap FIN.
            startEnding(p, env, out);
            return;
        case CopyPump::Flow::Idle:
            // Past max_connection_duration with all that came before it moved: the end.
            if (endReached()) {
                startEnding(p, env, out);
                return;
            }
            // Caught up (consumed == passed): the program redirects again from the next skb.
            phase_ = Phase::Redirecting;
            redirect(p, env, out);
            return;
    }
}

void SockmapPump::startEnding(const PumpPort& p, PumpEnv& env, Step& out) {
    phase_ = Phase::Ending;
    barrier_step_ = 0;
    finBarrier(p, env, out);
}

void SockmapPump::finBarrier(const PumpPort& p, PumpEnv& env, Step& out) {
    // A Sockmap direction has both sockets linked: either stream broken stops the FIN.
    for (uint8_t side = 0; side < 2; ++side) {
        if (!recordBroken(*map_, pair_record_ + side)) continue;
        out.kind = Step::Broken;
        out.on_src = side == dir_;
        return;
    }
    stopIfEnding(p, env);
    // Past max_connection_duration src's count goes on growing with what its peer still sends,
    // which the relay no longer takes: the FIN waits for what this direction moved, as catchUp
    // does (the redirected count is final once stopped).
    const SockmapBarrier b =
        p.ending ? checkQueued(p.dst, loadRelaxed(map_->record(record()).redirected) + copied_ +
                                          dst_before_)
                 : checkFinBarrier(p.src, p.dst, src_skipped_, dst_extra_);
    if (!barrierDone(p, b, out)) return;
    out.moved += fold(*map_);
    if (!p.ending) ::shutdown(p.dst, SHUT_WR);
    phase_ = Phase::Finished;
    out.kind = Step::Finished;
    // src is done but, unless the other direction finished too, still its destination,
    // written by the kernel alone: only a poll notices an RST on it now.
    if (!p.src_write_shut) copy_.watch().armErrors(p);
}

void SockmapPump::stopIfEnding(const PumpPort& p, PumpEnv& /*env*/) {
    if (!p.ending || stopped_) return;
    stopped_ = true;
    stopRedirecting(*map_, record(), p.src);
    // No verdict runs any more that could redirect (stopRedirecting waited for the last), so
    // the bytes passed from here on arrived past the limit.
    end_passed_ = loadRelaxed(map_->record(record()).passed);
}

bool SockmapPump::barrierDone(const PumpPort& p, const SockmapBarrier& b, Step& out) {
    switch (b.kind) {
        case SockmapBarrier::Done:
            return true;
        case SockmapBarrier::Wait: {
            // A slow reader on dst holds the psock's backlog: that is progress, not idleness,
            // as long as the backlog shrinks, and the next look comes as soon; only a stall
            // backs off.
            bool progress = b.remaining != barrier_left_;
            if (progress) {
                barrier_left_ = b.remaining;
                out.active = true;
            }
            armBarrier(p, !progress);
            return false;
        }
        case SockmapBarrier::Failed:
            out.fail(b.on_src, b.error);
            return false;
    }
    return false;
}

void SockmapPump::armBarrier(const PumpPort& p, bool back_off) {
    // Read by the kernel when the SQE is submitted, so they must outlive this call.
    // 1 ms first: at the end of a 100 MiB burst the backlog took 6-20 ms to drain. Doubling
    // to 32 ms bounds both the latency added to a FIN and the polling of a stalled reader.
    static constexpr __kernel_timespec kWaits[] = {{0, 1000000}, {0, 2000000},  {0, 4000000},
                                                   {0, 8000000}, {0, 16000000}, {0, 32000000}};
    if (barrier_armed_ || p.handing) return;
    uint8_t step = std::min<uint8_t>(barrier_step_, std::size(kWaits) - 1);
    if (back_off && barrier_step_ + 1u < std::size(kWaits)) ++barrier_step_;
    io_uring_prep_timeout(p.sqe(Op::Barrier), const_cast<__kernel_timespec*>(&kWaits[step]), 0, 0);
    barrier_armed_ = true;
}

RestingDirection SockmapPump::resting() const {
    RestingDirection r;
    r.eof = eofSeen();
    r.hup = copy_.watch().hup;
    r.sockmap = true;
    r.kernel = {static_cast<uint8_t>(phase_),
                stopped_,
                src_skipped_,
                dst_extra_,
                dst_before_,
                seen_,
                taken_,
                end_passed_,
                consumed_,
                copied_};
    return r;
}

SockmapPump SockmapPump::adopted(Sockmap& map, uint32_t pair_record, uint8_t dir,
                                 const RestingDirection& r) {
    SourceWatch watch;
    watch.hup = r.hup;
    const SockmapResting& k = r.kernel;
    SockmapPump pump(map, pair_record, dir, k.src_skipped, k.dst_extra, k.dst_before, watch);
    pump.phase_ = static_cast<Phase>(std::min<uint8_t>(k.phase, uint8_t(Phase::Finished)));
    pump.stopped_ = k.stopped;
    pump.seen_ = k.seen;
    pump.taken_ = k.taken;
    pump.end_passed_ = k.end_passed;
    pump.consumed_ = k.consumed;
    pump.copied_ = k.copied;
    return pump;
}

Step SockmapPump::restart(const PumpPort& p, PumpEnv& env) {
    Step out;
    stepAgain(p, env, out, false);
    return out;
}

void SockmapPump::stepAgain(const PumpPort& p, PumpEnv& env, Step& out, bool timer) {
    switch (phase_) {
        case Phase::Redirecting:
            // A timer here is the EOF's peek asking again (checkEnd); resuming, every wait of
            // the phase is armed afresh.
            if (timer)
                checkEnd(p, env, out);
            else
                redirect(p, env, out);
            break;
        case Phase::CatchingUp:
            catchUp(p, env, out);
            break;
        case Phase::Copying:
            advanceCopy(p, env, out);
            break;
        case Phase::Ending:
            finBarrier(p, env, out);
            break;
        case Phase::Finished:
            if (!timer && !p.src_write_shut) copy_.watch().armErrors(p);
            break;
    }
}

Step SockmapPump::scan(const PumpPort& p, PumpEnv& env) {
    Step out;
    if (phase_ == Phase::Redirecting && hasPassed(*map_)) startCatchUp(p, env, out);
    return out;
}

Step SockmapPump::resume(const PumpPort& p, PumpEnv& env) {
    Step out;
    advanceCopy(p, env, out);
    return out;
}

uint64_t SockmapPump::fold(Sockmap& map) {
    uint64_t v = loadRelaxed(map.record(record()).redirected);
    if (v <= seen_) return 0;
    uint64_t n = v - seen_;
    seen_ = v;
    return n;
}

void SockmapPump::abort(const PumpPort& p, PumpEnv&) {
    if (!barrier_armed_) return;
    io_uring_sqe* sqe = p.ring.sqe();
    io_uring_prep_timeout_remove(sqe, p.tag | static_cast<uint64_t>(Op::Barrier), 0);
    io_uring_sqe_set_data64(sqe, UserData{}.pack());
}

uint32_t SockmapPump::dropReplayed(Sockmap& map, ListenerStats& counts, char* data, uint32_t len) {
    zcr_sock_stats& r = map.record(record());
    // The chunk holds passed bytes [taken, taken + len). Every queued replayed stretch inside
    // it is cut out and the rest closed up in place; a stretch reaching past its end stays
    // queued, shortened by what was cut. Rare (a few per hundred connections under heavy
    // passing), so a memmove of at most one buffer is fine.
    uint64_t from = taken_;
    uint32_t kept = len;
    uint64_t cut = 0;
    for (;;) {
        uint32_t head = loadRelaxed(r.skip_head);
        if (head == loadRelaxed(r.skip_tail)) break;
        uint32_t i = head & (ZCR_SKIPS - 1);
        uint64_t at = loadRelaxed(r.skip_at[i]);
        uint64_t end = at + loadRelaxed(r.skip_len[i]);
        uint64_t to = from + len;
        if (at >= to) break;
        uint64_t lo = std::max(at, from), hi = std::min(end, to);
        if (hi > lo) {
            // Offsets within the chunk as it is now, after earlier cuts.
            uint32_t off = static_cast<uint32_t>(lo - from - cut);
            uint32_t n = static_cast<uint32_t>(hi - lo);
            std::memmove(data + off, data + off + n, kept - off - n);
            kept -= n;
            cut += n;
        }
        if (end > to) break;  // continues into the next chunk
        storeRelaxed(r.skip_head, head + 1);
    }
    if (cut > 0) {
        // Dropped bytes count as handled, or the program would wait for them forever.
        consumed_ += cut;
        storeRelaxed(r.consumed, __u64{consumed_});
        counts.sockmap_skipped.add(cut);
    }
    return kept;
}

}  // namespace zcrelay
