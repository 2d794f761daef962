// The checks' steps and bookkeeping: health_check.hpp draws the state machine.
#include "health_check.hpp"

#include <liburing.h>

#include <algorithm>
#include <cstring>

#include "clock.hpp"
#include "http_check.hpp"
#include "log.hpp"
#include "upstream.hpp"

namespace zcrelay {

namespace {

SocketAddress checkTarget(const HealthCheckConfig& hc, const BackendConfig& b) {
    SocketAddress target = b.check_address.length != 0 ? b.check_address : b.address;
    if (target.family() == AF_UNIX) return target;
    if (b.check_address.length != 0 && target.port() != 0) return target;
    if (hc.port != 0)
        target.setPort(static_cast<uint16_t>(hc.port));
    else if (b.check_address.length != 0)
        target.setPort(b.address.port());
    return target;
}

}  // namespace

void HealthChecker::reset(const Runtime& rt) {
    for (Check& ck : checks_) {
        if (ck.fd < 0) continue;
        ring_.cancelAndClose(ck.fd);
    }
    retired_ = std::move(checks_);
    checks_.clear();
    ++generation_;
    if (draining_) return;
    unsigned workers = std::max(1u, rt.config.workers);
    unsigned n = 0;
    for (const ClusterRt& cl : rt.clusters) {
        if (!cl.config.health_check.enabled) continue;
        for (const BackendRt& b : cl.backends) {
            if (n++ % workers != worker_id_) continue;
            const HealthCheckConfig& hc = cl.config.health_check;
            Check ck;
            ck.cluster = &cl;
            ck.backend = &b;
            ck.interval = toTimespec(hc.interval);
            ck.target = checkTarget(hc, b.config);
            ck.http = hc.http.enabled;
            ck.send = ck.http ? httpCheckRequest(hc.http, ck.target) : hc.send;
            ck.reply.resize(ck.http ? HttpCheckConfig::kMaxReply : hc.expect.size());
            checks_.push_back(std::move(ck));
        }
    }
    for (uint32_t i = 0; i < checks_.size(); ++i) start(i);
}

void HealthChecker::onCompletion(const UserData& ud, int res) {
    if (ud.generation != generation_) return;  // a retired check's
    switch (ud.op) {
        case Op::Check:
            onStep(ud.slot, res);
            return;
        case Op::CheckTimer:
            start(ud.slot);
            return;
        default:  // CheckTimeout: the step's own CQE says -ECANCELED
            return;
    }
}

io_uring_sqe* HealthChecker::sqe(uint32_t i, Op op) {
    io_uring_sqe* sqe = ring_.sqe();
    io_uring_sqe_set_data64(sqe, UserData{op, 0, i, generation_}.pack());
    return sqe;
}

void HealthChecker::start(uint32_t i) {
    if (draining_ || i >= checks_.size()) return;
    Check& ck = checks_[i];
    if (ck.backend->state->admin.load(std::memory_order_relaxed) == AdminState::Maint) {
        // In maintenance (runtime API) a backend is not checked, as in HAProxy: its next turn
        // comes at the interval, and checks resume once it is back.
        armTimer(i);
        return;
    }
    auto fd = openUpstreamSocket(ck.target, ck.cluster->config.source);
    if (!fd) {
        finish(i, false, "no socket");
        return;
    }
    ck.fd = fd->release();
    ck.step = Check::Step::Connect;
    ck.done = 0;
    ck.deadline_us = monotonicUs() + ck.cluster->config.health_check.timeout.count() * 1000;
    step(i);
}

void HealthChecker::step(uint32_t i) {
    Check& ck = checks_[i];
    int64_t left = ck.deadline_us - monotonicUs();
    if (left <= 0) {
        finish(i, false, "timeout");
        return;
    }
    ck.left = usToTimespec(left);
    io_uring_sqe* s = sqe(i, Op::Check);
    switch (ck.step) {
        case Check::Step::Connect:
            io_uring_prep_connect(s, ck.fd, ck.target.sockaddrPtr(), ck.target.length);
            break;
        case Check::Step::Send:
            io_uring_prep_send(s, ck.fd, ck.send.data() + ck.done, ck.send.size() - ck.done,
                               MSG_NOSIGNAL);
            break;
        case Check::Step::Recv:
            io_uring_prep_recv(s, ck.fd, ck.reply.data() + ck.done, ck.reply.size() - ck.done, 0);
            break;
        case Check::Step::Idle:
            break;
    }
    s->flags |= IOSQE_IO_LINK;
    io_uring_prep_link_timeout(sqe(i, Op::CheckTimeout), &ck.left, 0);
}

void HealthChecker::onStep(uint32_t i, int res) {
    if (i >= checks_.size()) return;
    Check& ck = checks_[i];
    const HealthCheckConfig& hc = ck.cluster->config.health_check;
    if (res == -ECANCELED) {
        finish(i, false, "timeout");
        return;
    }
    if (res < 0) {
        finish(i, false, strerror(-res));
        return;
    }
    switch (ck.step) {
        case Check::Step::Connect:
            ck.step = !ck.send.empty()                ? Check::Step::Send
                      : ck.http || !hc.expect.empty() ? Check::Step::Recv
                                                      : Check::Step::Idle;
            break;
        case Check::Step::Send:
            ck.done += static_cast<uint32_t>(res);
            if (ck.done == ck.send.size()) {
                ck.done = 0;
                ck.step = ck.http || !hc.expect.empty() ? Check::Step::Recv : Check::Step::Idle;
            }
            break;
        case Check::Step::Recv:
            if (ck.http) {
                ck.done += static_cast<uint32_t>(res);
                const HttpVerdict v =
                    judgeHttpReply(hc.http, std::string_view(ck.reply.data(), ck.done),
                                   res == 0 || ck.done == ck.reply.size());
                if (v.is == HttpVerdict::Is::More) break;
                finish(i, v.is == HttpVerdict::Is::Pass, v.why.c_str());
                return;
            }
            if (res == 0) {
                finish(i, false, "closed before the expected reply");
                return;
            }
            ck.done += static_cast<uint32_t>(res);
            if (std::memcmp(ck.reply.data(), hc.expect.data(), ck.done) != 0) {
                finish(i, false, "unexpected reply");
                return;
            }
            if (ck.done == hc.expect.size()) ck.step = Check::Step::Idle;
            break;
        case Check::Step::Idle:
            return;
    }
    if (ck.step == Check::Step::Idle)
        finish(i, true, "passed");
    else
        step(i);
}

void HealthChecker::finish(uint32_t i, bool passed, const char* why) {
    Check& ck = checks_[i];
    if (ck.fd >= 0) {
        ::close(ck.fd);  // its step completed: nothing in flight holds it
        ck.fd = -1;
    }
    ck.step = Check::Step::Idle;
    const HealthCheckConfig& hc = ck.cluster->config.health_check;
    BackendState& st = *ck.backend->state;
    const char* cluster = ck.cluster->config.name.c_str();
    const char* backend = ck.backend->key.c_str();
    if (passed) {
        st.checks_passed.fetch_add(1, std::memory_order_relaxed);
        st.check_fails.store(0, std::memory_order_relaxed);
        uint32_t passes = st.check_passes.fetch_add(1, std::memory_order_relaxed) + 1;
        if (passes >= hc.rise && st.markUp(true)) {
            st.failure_streak.store(0, std::memory_order_relaxed);
            LOG_INFO("cluster %s: backend %s up (%u checks passed)", cluster, backend, passes);
            endSessions(ck, true);
        }
    } else {
        st.checks_failed.fetch_add(1, std::memory_order_relaxed);
        st.check_passes.store(0, std::memory_order_relaxed);
        uint32_t fails = st.check_fails.fetch_add(1, std::memory_order_relaxed) + 1;
        if (fails >= hc.fall && st.markUp(false)) {
            LOG_WARN("cluster %s: backend %s down (%u checks failed, last: %s)", cluster, backend,
                     fails, why);
            endSessions(ck, false);
        } else if (fails == 1 && st.up.load(std::memory_order_relaxed)) {
            // The first failure of a streak says why, once: a flapping check is visible
            // before it takes the backend down.
            LOG_INFO("cluster %s: backend %s failed a check (%s)", cluster, backend, why);
        }
    }
    armTimer(i);
}

void HealthChecker::endSessions(const Check& ck, bool went_up) {
    const ClusterConfig& cc = ck.cluster->config;
    if (!process_.end_connections) return;
    if (!went_up) {
        if (cc.on_marked_down != OnMarkedDown::ShutdownSessions) return;
        LOG_WARN(
            "cluster %s: backend %s: closing its live connections (on_marked_down: "
            "shutdown_sessions)",
            cc.name.c_str(), ck.backend->key.c_str());
        process_.end_connections(ck.backend->state, CloseReason::BackendDown,
                                 cc.name + "/" + ck.backend->key);
        return;
    }
    // A primary is back: traffic leaves the backups, and with the option so do their sessions.
    if (cc.on_marked_up != OnMarkedUp::ShutdownBackupSessions || ck.backend->config.tier != 0)
        return;
    for (const BackendRt& b : ck.cluster->backends) {
        if (b.config.tier == 0) continue;
        LOG_WARN(
            "cluster %s: backend %s is up: closing backup %s's live connections "
            "(on_marked_up: shutdown_backup_sessions)",
            cc.name.c_str(), ck.backend->key.c_str(), b.key.c_str());
        process_.end_connections(b.state, CloseReason::BackupShutdown, cc.name + "/" + b.key);
    }
}

void HealthChecker::armTimer(uint32_t i) {
    io_uring_prep_timeout(sqe(i, Op::CheckTimer), &checks_[i].interval, 0, 0);
}

}  // namespace zcrelay
