// The lifecycle (connections.hpp, the states drawn above ConnState in conn.hpp) in-process:
// Connections built as Worker::setUp builds it, on a real io_uring, fed real accepted client
// sockets and a real backend on loopback, its completions handed to onCompletion() as the
// worker's loop does. Time is the test's: the clock Connections reads (now_ms) is a variable
// here, moved forward before a sweep(), so idle, PROXY, inspect, fin and max-duration timeouts
// and the drain deadline are checked to the millisecond without waiting for them.
//
// The oracle is what the relay counts (the listener's and backend's counters, close reasons,
// live()) and what the peers see on their sockets.
#include "connections.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <liburing.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "acceptor.hpp"
#include "clock.hpp"
#include "config.hpp"
#include "generation.hpp"
#include "handover.hpp"
#include "pipe_pool.hpp"
#include "process_shared.hpp"
#include "pump/copy_pump.hpp"
#include "runtime.hpp"
#include "stats.hpp"
#include "support/loopback.hpp"
#include "support/seqpacket_pair.hpp"
#include "unique_fd.hpp"
#include "uring/buf_ring.hpp"
#include "uring/ring.hpp"

namespace zcrelay {
namespace {

using namespace std::chrono_literals;
using test::Clock;
using test::Fd;
using test::IoStatus;
using test::Millis;

constexpr Millis kDeadline{10'000};
constexpr int64_t kTickMs = 100;

// One worker's Connections, and the backend it connects to. `listener` is YAML for the one
// listener's keys besides listen/upstream (indented for a list item); `top` for the config's
// top level; `backend` overrides the backend address (a port nothing listens on).
struct Given {
    std::string listener;
    std::string top;
    std::string backend;
    uint64_t pipes = 16;
    bool upstream = true;  // the listener's `upstream` (with routes: the default route)

    Given& keys(std::string k) {
        listener = std::move(k);
        return *this;
    }
    Given& topLevel(std::string t) {
        top = std::move(t);
        return *this;
    }
    Given& backendAt(std::string b) {
        backend = std::move(b);
        return *this;
    }
    Given& pipeLimit(uint64_t n) {
        pipes = n;
        return *this;
    }
    Given& noUpstream() {
        upstream = false;
        return *this;
    }
    // Tiny receive buffers on the accepted client sockets and the backend's: a peer that stops
    // reading fills everything up with kilobytes, not the megabytes autotuning allows.
    Given& smallBuffers() {
        small = true;
        return *this;
    }
    // The Acceptor listens itself, on the listener's socket (a dup of it): run() hands it the
    // Accept CQEs, as the worker does. Otherwise the test accepts (client()).
    Given& acceptorListens() {
        listens = true;
        return *this;
    }
    bool small = false;
    bool listens = false;
};

class Lifecycle {
  public:
    explicit Lifecycle(const Given& s) {
        front_ = test::listenLoopback(AF_INET);
        back_ = test::listenLoopback(AF_INET);
        if (!front_.fd || !back_.fd) {
            ADD_FAILURE() << "listen: " << front_.error << back_.error;
            return;
        }
        if (s.small) {
            int bytes = 4096;
            for (int fd : {front_.fd.get(), back_.fd.get()})
                ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
        }
        std::string backend =
            s.backend.empty() ? "127.0.0.1:" + std::to_string(back_.port) : s.backend;
        std::string yaml = "workers: 1\n" + s.top +
                           "listeners:\n"
                           "  - name: front\n"
                           "    listen: 127.0.0.1:" +
                           std::to_string(front_.port) + "\n" +
                           (s.upstream ? "    upstream: " + backend + "\n" : "") + s.listener;
        try {
            rt_ = Runtime::build(loadConfigString(yaml, "test.yaml"), nullptr, 1);
        } catch (const std::exception& e) {
            ADD_FAILURE() << "config: " << e.what() << "\n" << yaml;
            return;
        }
        auto ring = Ring::create(256);
        if (!ring) {
            ADD_FAILURE() << ring.error().message();
            return;
        }
        ring_ = std::move(*ring);
        SendZcSupport zc = ring_->probeSendZc();
        auto bufs = BufRing::create(ring_->raw(), 0, 16, 16 * 1024, 16);
        if (!bufs) {
            ADD_FAILURE() << bufs.error().message();
            return;
        }
        bufs_ = std::move(*bufs);
        pipes_ = std::make_unique<PipePool>(s.pipes, INT32_MAX, stats_);
        holds_ = std::make_unique<ZerocopyHolds>(8);
        env_.reset(new PumpEnv{*bufs_, *pipes_, stats_, zc, *holds_});
        // Unless asked to listen, the Acceptor gets no listening socket: the test accepts the
        // clients itself (on front_) and hands them to Connections as the Acceptor does;
        // admission, the admit queue and resumption are the Acceptor's all the same.
        gens_ = std::make_unique<Generations>(rt_, 0);
        std::vector<ListenSocket> sockets;
        if (s.listens) {
            // Nonblocking, as the relay's listening sockets are (openListener).
            ::fcntl(front_.fd.get(), F_SETFL, ::fcntl(front_.fd.get(), F_GETFL) | O_NONBLOCK);
            sockets.push_back({0, UniqueFd(::dup(front_.fd.get()))});
        }
        acceptor_ = std::make_unique<Acceptor>(0, std::move(sockets), *gens_, process_, 64,
                                               stats_.accept_paused);
        now_ms = monotonicMs();
        paths_ = std::make_unique<Paths>(*ring_, nullptr, 0, 64, stats_, 0);
        conns_ = std::make_unique<Connections>(0, *ring_, process_, stats_, *env_, *acceptor_,
                                               *gens_, now_ms, 64, *paths_);
        acceptor_->start(*ring_, *conns_);
    }
    ~Lifecycle() {
        if (!conns_) return;
        // Everything still open goes as at a drain deadline, and every slot is waited for, so
        // no SQE of a connection is left when the ring goes.
        acceptor_->drain();
        conns_->sweep(true, kTickMs);
        run([&] { return conns_->live() == 0; }, 2000ms);
    }

    bool ok() const { return conns_ != nullptr; }
    Connections& conns() { return *conns_; }
    ListenerStats& listener() { return rt_->listeners[0].shared->stats[0]; }
    // The backend of the listener's own cluster (named after it), the one the test runs.
    BackendState& backend() {
        for (const ClusterRt& c : rt_->clusters)
            if (c.config.name == "front" && !c.backends.empty()) return *c.backends[0].state;
        return *rt_->clusters[0].backends[0].state;
    }
    BackendStats& backendStats() { return backend().stats[0]; }
    uint64_t closed(CloseReason r) { return listener().closed[idx(r)].get(); }
    WorkerStats& stats() { return stats_; }
    Acceptor& acceptor() { return *acceptor_; }
    int listening() const { return front_.fd.get(); }
    // Queued SQEs (the Acceptor's first accepts, say) go to the kernel, and no task work runs.
    void submit() { ring_->submit(); }
    // The next relay took the listeners over (takeover.hpp), and this one drains.
    void handOver() {
        process_.listeners_handed_over.store(true);
        acceptor_->drain();
    }

    // A client connects to the listener; the test accepts it and hands it to Connections.
    // Returns the client's end (blocking).
    Fd client() {
        test::Connected c = test::connectTo("127.0.0.1", front_.port);
        if (!c.fd) {
            ADD_FAILURE() << "connect: " << c.error;
            return Fd{};
        }
        sockaddr_storage ss{};
        socklen_t len = sizeof ss;
        pollfd p{front_.fd.get(), POLLIN, 0};
        ::poll(&p, 1, 5000);
        int fd = ::accept4(front_.fd.get(), reinterpret_cast<sockaddr*>(&ss), &len,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            ADD_FAILURE() << "accept: " << strerror(errno);
            return Fd{};
        }
        accepted_before_us = monotonicUs();
        if (!conns_->accept(fd, 0, addressFromSockaddr(reinterpret_cast<sockaddr*>(&ss), len))) {
            ADD_FAILURE() << "no slot";
            ::close(fd);
        }
        // After accept() returned: no later than the connection's own accepted_mono_us.
        accepted_after_us = monotonicUs();
        return std::move(c.fd);
    }

    // The backend's end of the next upstream connection, once the relay's connect reached it.
    Fd upstream() {
        Fd out;
        run([&] {
            pollfd p{back_.fd.get(), POLLIN, 0};
            if (::poll(&p, 1, 0) != 1) return false;
            out = Fd(::accept4(back_.fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
            return true;
        });
        if (!out) ADD_FAILURE() << "no upstream connection came";
        return out;
    }

    // The worker's loop, without accepts, ticks or wakes: every CQE of a connection goes to
    // onCompletion, then starved directions and the admit queue get their turn, until `done()`
    // holds or the deadline passes. Returns done().
    bool run(const std::function<bool()>& done, Millis timeout = kDeadline) {
        auto deadline = Clock::now() + timeout;
        while (!done()) {
            if (Clock::now() >= deadline) return false;
            io_uring_cqe* cqe = nullptr;
            __kernel_timespec ts{0, 10'000'000};
            int r = io_uring_submit_and_wait_timeout(ring_->raw(), &cqe, 1, &ts, nullptr);
            if (r < 0 && r != -ETIME && r != -EINTR) {
                ADD_FAILURE() << "io_uring_submit_and_wait_timeout: " << strerror(-r);
                return false;
            }
            unsigned head, count = 0;
            io_uring_for_each_cqe(ring_->raw(), head, cqe) {
                UserData ud = UserData::unpack(cqe->user_data);
                if (ud.op == Op::Accept)
                    acceptor_->onAccept(ud.slot, ud.aux, cqe->res, now_ms);
                else if (ud.op != Op::Ignore && ud.op != Op::PathSignal)
                    conns_->onCompletion(ud, cqe);
                ++count;
            }
            io_uring_cq_advance(ring_->raw(), count);
            if (bufs_->replenished()) conns_->retryStarved();
            acceptor_->afterBatch();
        }
        return true;
    }

    void sweep(bool drain = false) { conns_->sweep(drain, kTickMs); }

    // The peers' reads, while the relay runs: one thread is both, so a peer never blocks.
    // Exactly `n` bytes from fd (fewer if it ended first).
    std::string read(int fd, size_t n) {
        std::string got;
        IoStatus end = IoStatus::Ok;
        run([&] { return got.size() >= n || (end = readSome(fd, got, n)) != IoStatus::Ok; });
        return got;
    }
    // Everything until fd's peer closed it: Eof (a FIN), Reset, or Timeout.
    IoStatus readToEnd(int fd, std::string& got) {
        IoStatus end = IoStatus::Ok;
        if (!run([&] { return (end = readSome(fd, got, SIZE_MAX)) != IoStatus::Ok; }))
            return IoStatus::Timeout;
        return end;
    }
    IoStatus peerEnd(int fd) {
        std::string ignored;
        return readToEnd(fd, ignored);
    }

    // One nonblocking read into `got` (at most up to `cap` bytes in all): Ok while the stream
    // goes on, Eof or Reset once it ended.
    static IoStatus readSome(int fd, std::string& got, size_t cap) {
        char buf[4096];
        size_t want = std::min(sizeof buf, cap - got.size());
        ssize_t n = ::recv(fd, buf, want, MSG_DONTWAIT);
        if (n > 0) got.append(buf, static_cast<size_t>(n));
        if (n == 0 && want > 0) return IoStatus::Eof;
        if (n < 0 && (errno == ECONNRESET || errno == EPIPE)) return IoStatus::Reset;
        return IoStatus::Ok;
    }

    int64_t now_ms = 0;  // the clock Connections reads
    // monotonicUs() around the last Connections::accept, which reads it for the connection's
    // start (max_connection_duration): a time from `before` is never past a limit the
    // connection reached, one from `after` never short of it.
    int64_t accepted_before_us = 0;
    int64_t accepted_after_us = 0;
    std::shared_ptr<const Runtime> rt_;

  private:
    test::Listening front_;
    test::Listening back_;
    ProcessShared process_;
    WorkerStats stats_;
    std::unique_ptr<Ring> ring_;
    std::unique_ptr<BufRing> bufs_;
    std::unique_ptr<PipePool> pipes_;
    std::unique_ptr<ZerocopyHolds> holds_;
    std::unique_ptr<PumpEnv> env_;
    std::unique_ptr<Generations> gens_;
    std::unique_ptr<Acceptor> acceptor_;
    std::unique_ptr<Paths> paths_;
    std::unique_ptr<Connections> conns_;
};

// ---------------------------------------------------------------------------------------------
// Accepted -> Connecting -> Relaying -> Closing -> Free, on every path a listener can ask for.

struct PathCase {
    const char* name;
    const char* mode;
    uint64_t pipes;
    DataPath counted;  // the path its bytes are counted under
    PipeFallback fallback;
    bool falls_back;
};

class ConnectionsPath : public ::testing::TestWithParam<PathCase> {};

TEST_P(ConnectionsPath, RelaysBothWaysHalfClosesThenEndsDone) {
    const PathCase& pc = GetParam();
    Lifecycle r(Given{}.keys(std::string("    mode: ") + pc.mode + "\n").pipeLimit(pc.pipes));
    ASSERT_TRUE(r.ok());
    Fd c = r.client();
    ASSERT_TRUE(c);
    EXPECT_EQ(r.listener().accepted.get(), 1u);
    EXPECT_EQ(r.conns().live(), 1u);
    Fd u = r.upstream();
    ASSERT_TRUE(u);
    ASSERT_TRUE(r.run([&] { return r.backendStats().connections.get() == 1; }));
    ASSERT_TRUE(test::writeAll(c.get(), "ping", 4).ok());
    EXPECT_EQ(r.read(u.get(), 4), "ping");
    ASSERT_TRUE(test::writeAll(u.get(), "pong!", 5).ok());
    EXPECT_EQ(r.read(c.get(), 5), "pong!");
    // The client's FIN reaches the backend; the other way keeps flowing.
    ::shutdown(c.get(), SHUT_WR);
    ASSERT_TRUE(r.run([&] { return r.listener().half_closed.get() == 1; }));
    std::string rest;
    EXPECT_EQ(r.readToEnd(u.get(), rest), IoStatus::Eof);
    EXPECT_EQ(rest, "");
    ASSERT_TRUE(test::writeAll(u.get(), "late", 4).ok());
    ::shutdown(u.get(), SHUT_WR);
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.readToEnd(c.get(), rest), IoStatus::Eof);
    EXPECT_EQ(rest, "late");
    EXPECT_EQ(r.closed(CloseReason::Done), 1u);
    EXPECT_EQ(r.listener().half_closed.get(), 0u);
    EXPECT_EQ(r.listener().bytes[0][idx(pc.counted)].get(), 4u);
    EXPECT_EQ(r.listener().bytes[1][idx(pc.counted)].get(), 9u);
    EXPECT_EQ(r.backendStats().bytes_upstream.get(), 4u);
    EXPECT_EQ(r.backendStats().bytes_downstream.get(), 9u);
    EXPECT_EQ(r.backend().active.load(), 0);
    uint64_t fallbacks = r.stats().pipe_fallbacks[idx(pc.fallback)].get();
    EXPECT_EQ(fallbacks, pc.falls_back ? 2u : 0u) << "one per direction";
}

INSTANTIATE_TEST_SUITE_P(, ConnectionsPath,
                         ::testing::Values(PathCase{"splice", "splice", 16, DataPath::Splice,
                                                    PipeFallback::PoolExhausted, false},
                                           PathCase{"copy", "copy", 16, DataPath::Copy,
                                                    PipeFallback::PoolExhausted, false},
                                           PathCase{"splice_without_pipes", "splice", 0,
                                                    DataPath::Copy, PipeFallback::PoolExhausted,
                                                    true}),
                         [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// Relaying -> Closing: resets, timeouts, the end of life, drain, the runtime API.

struct Relayed {
    Fd client;
    Fd upstream;
};

Relayed relay(Lifecycle& r) {
    Relayed out;
    out.client = r.client();
    out.upstream = r.upstream();
    r.run([&] { return r.backendStats().connections.get() == 1; });
    return out;
}

TEST(Connections, AClientResetResetsTheUpstream) {
    Lifecycle r(Given{});
    ASSERT_TRUE(r.ok());
    Relayed p = relay(r);
    ASSERT_TRUE(p.upstream);
    test::closeWithReset(p.client);
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.closed(CloseReason::ClientReset), 1u);
    EXPECT_EQ(r.peerEnd(p.upstream.get()), IoStatus::Reset)
        << "the survivor gets an RST, not a FIN";
}

TEST(Connections, AnUpstreamResetResetsTheClient) {
    Lifecycle r(Given{});
    ASSERT_TRUE(r.ok());
    Relayed p = relay(r);
    ASSERT_TRUE(p.upstream);
    test::closeWithReset(p.upstream);
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.closed(CloseReason::UpstreamReset), 1u);
    EXPECT_EQ(r.peerEnd(p.client.get()), IoStatus::Reset);
}

TEST(Connections, IdleTimeoutClosesAndTheSlotWaitsForItsSqes) {
    Lifecycle r(Given{}.keys("    idle_timeout: 30s\n"));
    ASSERT_TRUE(r.ok());
    Relayed p = relay(r);
    ASSERT_TRUE(p.upstream);
    r.now_ms += 30'000 - 1;
    r.sweep();
    EXPECT_EQ(r.closed(CloseReason::IdleTimeout), 0u) << "a millisecond early";
    r.now_ms += 1;
    r.sweep();
    EXPECT_EQ(r.closed(CloseReason::IdleTimeout), 1u);
    // Closing: each direction's poll on its src is still in flight, so the slot is not Free
    // until their CQEs (cancelled) came back.
    EXPECT_EQ(r.conns().live(), 1u);
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.peerEnd(p.client.get()), IoStatus::Eof);
    EXPECT_EQ(r.peerEnd(p.upstream.get()), IoStatus::Eof);
}

TEST(Connections, BytesKeepAConnectionFromIdling) {
    Lifecycle r(Given{}.keys("    idle_timeout: 30s\n"));
    ASSERT_TRUE(r.ok());
    Relayed p = relay(r);
    ASSERT_TRUE(p.upstream);
    r.now_ms += 20'000;
    ASSERT_TRUE(test::writeAll(p.client.get(), "x", 1).ok());
    ASSERT_TRUE(r.run([&] { return r.listener().bytes[0][idx(DataPath::Splice)].get() == 1; }));
    r.now_ms += 20'000;  // 40 s since accept, 20 since the byte
    r.sweep();
    EXPECT_EQ(r.closed(CloseReason::IdleTimeout), 0u);
    r.now_ms += 10'000;
    r.sweep();
    EXPECT_EQ(r.closed(CloseReason::IdleTimeout), 1u);
}

struct FinCase {
    const char* name;
    bool client_first;  // the client sends its FIN first (else the backend does)
    CloseReason reason;
};

class ConnectionsFin : public ::testing::TestWithParam<FinCase> {};

TEST_P(ConnectionsFin, AHalfClosedConnectionSilentPastItsFinTimeoutCloses) {
    Lifecycle r(Given{}.keys("    client_fin_timeout: 2s\n    server_fin_timeout: 3s\n"));
    ASSERT_TRUE(r.ok());
    Relayed p = relay(r);
    ASSERT_TRUE(p.upstream);
    const bool client_first = GetParam().client_first;
    ::shutdown((client_first ? p.client : p.upstream).get(), SHUT_WR);
    ASSERT_TRUE(r.run([&] { return r.listener().half_closed.get() == 1; }));
    // The client closed first: the backend's turn, server_fin_timeout (3 s); else 2 s.
    const int64_t fin = client_first ? 3000 : 2000;
    r.now_ms += fin - 1;
    r.sweep();
    EXPECT_EQ(r.closed(GetParam().reason), 0u);
    r.now_ms += 1;
    r.sweep();
    EXPECT_EQ(r.closed(GetParam().reason), 1u);
    EXPECT_EQ(r.listener().half_closed.get(), 0u);
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
}

INSTANTIATE_TEST_SUITE_P(
    , ConnectionsFin,
    ::testing::Values(FinCase{"client_closed_first", true, CloseReason::ServerFinTimeout},
                      FinCase{"server_closed_first", false, CloseReason::ClientFinTimeout}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Connections, MaxConnectionDurationEndsGracefully) {
    Lifecycle r(Given{}.keys("    max_connection_duration: 60s\n"));
    ASSERT_TRUE(r.ok());
    Relayed p = relay(r);
    ASSERT_TRUE(p.upstream);
    ASSERT_TRUE(test::writeAll(p.client.get(), "abc", 3).ok());
    ASSERT_TRUE(test::writeAll(p.upstream.get(), "de", 2).ok());
    ASSERT_TRUE(r.run([&] {
        return r.listener().bytes[0][idx(DataPath::Splice)].get() == 3 &&
               r.listener().bytes[1][idx(DataPath::Splice)].get() == 2;
    }));
    r.now_ms = r.accepted_before_us / 1000 + 60'000 - 1;
    r.sweep();
    EXPECT_EQ(r.closed(CloseReason::MaxDuration), 0u);
    r.now_ms = r.accepted_after_us / 1000 + 60'000;
    r.sweep();
    // Both sides stop being read; what was read is delivered; both get a FIN.
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.closed(CloseReason::MaxDuration), 1u);
    std::string got;
    EXPECT_EQ(r.readToEnd(p.upstream.get(), got), IoStatus::Eof);
    EXPECT_EQ(got, "abc");
    EXPECT_EQ(r.readToEnd(p.client.get(), got = ""), IoStatus::Eof);
    EXPECT_EQ(got, "de");
}

TEST(Connections, AConnectionThatCannotEndGracefullyIsResetAfterTheGrace) {
    Lifecycle r(
        Given{}.keys("    max_connection_duration: 60s\n    pipe_size: 64KiB\n").smallBuffers());
    ASSERT_TRUE(r.ok());
    Relayed p = relay(r);
    ASSERT_TRUE(p.upstream);
    int bytes = 4096;
    ::setsockopt(p.client.get(), SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
    // The backend reads nothing: the client's bytes fill everything up to the relay's pipe,
    // which client -> upstream can then never empty.
    test::setNonBlocking(p.client.get(), true);
    std::string chunk(16 * 1024, 'x');
    uint64_t last = 0;
    int quiet = 0;
    ASSERT_TRUE(r.run([&] {
        bool wrote = ::send(p.client.get(), chunk.data(), chunk.size(), MSG_DONTWAIT) > 0;
        uint64_t now = r.listener().bytes[0][idx(DataPath::Splice)].get();
        quiet = wrote || now != last ? 0 : quiet + 1;
        last = now;
        return quiet >= 3;
    })) << "the upstream never filled up";
    r.now_ms = r.accepted_after_us / 1000 + 60'000;
    r.sweep();  // ending: both sides stop being read
    // upstream -> client had nothing left: it finishes (its FIN kept); the other cannot.
    ASSERT_TRUE(r.run([&] { return r.listener().half_closed.get() == 1; }));
    r.now_ms = r.accepted_before_us / 1000 + 60'000 + 2000 - 1;  // Connections::kEndGraceMs
    r.sweep();
    EXPECT_EQ(r.closed(CloseReason::MaxDuration), 0u);
    r.now_ms = r.accepted_after_us / 1000 + 60'000 + 2000;
    r.sweep();
    EXPECT_EQ(r.closed(CloseReason::MaxDuration), 1u);
    EXPECT_EQ(r.listener().half_closed.get(), 0u);
    // Neither peer may take the cut for a clean end.
    EXPECT_EQ(r.peerEnd(p.client.get()), IoStatus::Reset);
    EXPECT_EQ(r.peerEnd(p.upstream.get()), IoStatus::Reset);
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
}

TEST(Connections, TheDrainDeadlineClosesWhatIsLeft) {
    Lifecycle r(Given{});
    ASSERT_TRUE(r.ok());
    Relayed p = relay(r);
    ASSERT_TRUE(p.upstream);
    r.sweep(/*drain=*/true);
    EXPECT_EQ(r.closed(CloseReason::Drain), 1u);
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.peerEnd(p.client.get()), IoStatus::Eof);
}

// Across a takeover: a connection that ends while it waits to cross (here the drain deadline,
// its polls' cancels not yet back) counts out of the worker's handover, and the worker tells the
// Outbound it is done, so the takeover's thread does not wait out its deadline for it.
TEST(Connections, AConnectionEndingWhileItWaitsToCrossStillLetsTheWorkerFinish) {
    Lifecycle r(Given{});
    ASSERT_TRUE(r.ok());
    Relayed p = relay(r);
    ASSERT_TRUE(p.upstream);
    test::SeqpacketPair channel;
    handover::Acceptance takes;
    takes.fds = 100;
    takes.listeners = {"front"};
    for (const ClusterRt& c : r.rt_->clusters)
        for (const BackendRt& b : c.backends) takes.backends.push_back(c.config.name + "/" + b.key);
    auto out =
        std::make_shared<handover::Outbound>(std::move(channel.a), takes, 1, monotonicMs() + 5000);
    r.conns().handOver(out);  // HandingOver: its polls' cancels are queued, not yet back
    EXPECT_FALSE(out->waitForWorkers(monotonicMs())) << "done before its connection was";
    r.sweep(/*drain=*/true);
    EXPECT_EQ(r.closed(CloseReason::Drain), 1u);
    EXPECT_TRUE(out->waitForWorkers(monotonicMs() + 100)) << "the worker never said it was done";
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.peerEnd(p.client.get()), IoStatus::Eof);
}

TEST(Connections, EndBackendClosesItsConnectionsAsAdminShutdown) {
    Lifecycle r(Given{});
    ASSERT_TRUE(r.ok());
    Relayed p = relay(r);
    ASSERT_TRUE(p.upstream);
    EXPECT_EQ(r.conns().endBackend(&r.backend(), CloseReason::AdminShutdown), 1u);
    EXPECT_EQ(r.closed(CloseReason::AdminShutdown), 1u);
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.backend().active.load(), 0);
}

// ---------------------------------------------------------------------------------------------
// Connecting -> Closing.

TEST(Connections, EveryConnectRefusedClosesAsConnectFailed) {
    test::Bound nobody = test::bindLoopbackNoListen(AF_INET);
    ASSERT_TRUE(nobody.fd) << nobody.error;
    Lifecycle r(Given{}.backendAt("127.0.0.1:" + std::to_string(nobody.port)));
    ASSERT_TRUE(r.ok());
    Fd c = r.client();
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.closed(CloseReason::ConnectFailed), 1u);
    // The first attempt and `retries` (2) more, each refused.
    EXPECT_EQ(r.listener().connect_failures[idx(ConnectFailure::Refused)].get(), 3u);
    EXPECT_EQ(r.backendStats().attempts.get(), 3u);
    EXPECT_EQ(r.peerEnd(c.get()), IoStatus::Eof);
}

TEST(Connections, NoBackendUpClosesAsNoBackend) {
    Lifecycle r(Given{});
    ASSERT_TRUE(r.ok());
    r.backend().up.store(false);
    Fd c = r.client();
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.closed(CloseReason::NoBackend), 1u);
    EXPECT_EQ(r.backendStats().attempts.get(), 0u);
    EXPECT_EQ(r.peerEnd(c.get()), IoStatus::Eof);
}

// ---------------------------------------------------------------------------------------------
// Accepted -> Queued -> served or closed; Accepted -> Closing.

TEST(Connections, AtMaxConnectionsAClientWaitsQueuedUntilOneEnds) {
    Lifecycle r(Given{}.keys("    max_connections: 1\n"));
    ASSERT_TRUE(r.ok());
    Relayed first = relay(r);
    ASSERT_TRUE(first.upstream);
    EXPECT_FALSE(r.acceptor().belowLimits(0));
    // An accept armed before the limit was reached completes: held, unserved.
    Fd second = r.client();
    EXPECT_EQ(r.conns().live(), 2u);
    EXPECT_TRUE(r.acceptor().limitPaused());
    ASSERT_TRUE(test::writeAll(second.get(), "queued", 6).ok());
    EXPECT_FALSE(r.run([&] { return r.backendStats().attempts.get() > 1; }, 50ms))
        << "a queued client was connected";
    // The first ends; the queued one is served in its place.
    ::shutdown(first.client.get(), SHUT_WR);
    ::shutdown(first.upstream.get(), SHUT_WR);
    ASSERT_TRUE(r.run([&] { return r.closed(CloseReason::Done) == 1; }));
    Fd u = r.upstream();
    ASSERT_TRUE(u);
    EXPECT_EQ(r.read(u.get(), 6), "queued");
    EXPECT_EQ(r.backendStats().connections.get(), 2u);
}

TEST(Connections, AQueuedClientIsClosedAtDrain) {
    Lifecycle r(Given{}.keys("    max_connections: 1\n"));
    ASSERT_TRUE(r.ok());
    Relayed first = relay(r);
    ASSERT_TRUE(first.upstream);
    Fd second = r.client();
    EXPECT_EQ(r.conns().live(), 2u);
    r.acceptor().drain();
    EXPECT_EQ(r.closed(CloseReason::Drain), 1u);
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 1; }));
    EXPECT_EQ(r.peerEnd(second.get()), IoStatus::Eof);
    EXPECT_EQ(r.backendStats().attempts.get(), 1u) << "never connected";
}

// Accepting after a hand-over: the next relay accepts on the same socket, and the drain cancels
// this one's accepts. One of them woken for a client, but cancelled before its task work ran,
// spent the kernel's only wakeup for it (tests/kernel/accept_wakeup_test.cpp): the next
// relay's accept sleeps on. The Acceptor sweeps the queue once its accepts are back, and the
// client is served here.
TEST(Connections, AClientWhoseWakeupTheDrainCancelledIsServedAfterAHandOver) {
    Lifecycle r(Given{}.acceptorListens());
    ASSERT_TRUE(r.ok());
    r.submit();  // the Acceptor's accepts: first in the socket's wait queue
    io_uring next{};
    ASSERT_EQ(io_uring_queue_init(4, &next, 0), 0);
    io_uring_sqe* sqe = io_uring_get_sqe(&next);
    io_uring_prep_accept(sqe, r.listening(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    ASSERT_EQ(io_uring_submit(&next), 1);

    test::Connected c = test::connectTo("127.0.0.1", r.rt_->config.listeners[0].listen.port());
    ASSERT_TRUE(c.fd) << c.error;
    pollfd queued{r.listening(), POLLIN, 0};
    ASSERT_EQ(::poll(&queued, 1, 5000), 1);
    r.handOver();  // the cancels go in before this ring waits: the woken accept never ran

    EXPECT_TRUE(r.run([&] { return r.listener().accepted.get() == 1; }, 3000ms))
        << "the client was left in the accept queue, its wakeup spent";
    Fd u = r.upstream();
    ASSERT_TRUE(u);
    ASSERT_TRUE(test::writeAll(c.fd.get(), "ping", 4).ok());
    EXPECT_EQ(r.read(u.get(), 4), "ping");
    io_uring_cqe* cqe = nullptr;
    EXPECT_NE(io_uring_peek_cqe(&next, &cqe), 0) << "the next relay accepted it too";
    io_uring_queue_exit(&next);
}

TEST(Connections, PastMaxConnectionsPerSourceAClientIsClosedAtOnce) {
    Lifecycle r(Given{}.keys("    max_connections_per_source: 1\n"));
    ASSERT_TRUE(r.ok());
    Relayed first = relay(r);
    ASSERT_TRUE(first.upstream);
    Fd second = r.client();
    EXPECT_EQ(r.closed(CloseReason::SourceLimit), 1u);
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 1; }));
    EXPECT_EQ(r.peerEnd(second.get()), IoStatus::Eof);
}

// ---------------------------------------------------------------------------------------------
// ReadingProxy.

TEST(Connections, APROXYHeaderIsConsumedThenTheClientIsConnected) {
    Lifecycle r(Given{}.keys("    accept_proxy: true\n"));
    ASSERT_TRUE(r.ok());
    Fd c = r.client();
    const std::string header = "PROXY TCP4 192.0.2.7 127.0.0.1 5555 80\r\n";
    ASSERT_TRUE(test::writeAll(c.get(), (header + "hello").data(), header.size() + 5).ok());
    Fd u = r.upstream();
    ASSERT_TRUE(u);
    EXPECT_EQ(r.read(u.get(), 5), "hello") << "the header is not relayed";
    ASSERT_TRUE(r.run([&] { return r.listener().bytes[0][idx(DataPath::Splice)].get() == 5; }));
}

TEST(Connections, ASlowPROXYHeaderTimesOut) {
    Lifecycle r(Given{}.keys("    accept_proxy: true\n    proxy_timeout: 3s\n"));
    ASSERT_TRUE(r.ok());
    Fd c = r.client();
    ASSERT_TRUE(test::writeAll(c.get(), "PROXY TCP4 ", 11).ok());
    r.now_ms += 3000 - 1;
    r.sweep();
    EXPECT_EQ(r.closed(CloseReason::ProxyProtocol), 0u);
    r.now_ms += 1;
    r.sweep();
    EXPECT_EQ(r.closed(CloseReason::ProxyProtocol), 1u);
    EXPECT_EQ(r.listener().proxy_errors[idx(ProxyFailure::Timeout)].get(), 1u);
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.backendStats().attempts.get(), 0u);
}

TEST(Connections, AMalformedPROXYHeaderCloses) {
    Lifecycle r(Given{}.keys("    accept_proxy: true\n"));
    ASSERT_TRUE(r.ok());
    Fd c = r.client();
    ASSERT_TRUE(test::writeAll(c.get(), "GET / HTTP/1.1\r\n\r\n", 18).ok());
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.closed(CloseReason::ProxyProtocol), 1u);
    EXPECT_EQ(r.backendStats().attempts.get(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Inspecting.

// Cluster `a` has a backend nothing listens on: a client routed there would fail to connect.
constexpr const char* kClusterA =
    "clusters:\n  - name: a\n    backends: [{address: 127.0.0.1:1}]\n";
constexpr const char* kRoutesNoDefault =
    "    routes:\n"
    "      - {sni: [a.example], cluster: a}\n";

TEST(Connections, NotTlsWithoutADefaultRouteClosesAsNoRoute) {
    Lifecycle r(Given{}.keys(kRoutesNoDefault).topLevel(kClusterA).noUpstream());
    ASSERT_TRUE(r.ok());
    Fd c = r.client();
    ASSERT_TRUE(test::writeAll(c.get(), "GET / HTTP/1.1\r\n\r\n", 18).ok());
    ASSERT_TRUE(r.run([&] { return r.conns().live() == 0; }));
    EXPECT_EQ(r.closed(CloseReason::NoRoute), 1u);
    EXPECT_EQ(r.listener().inspect_failures[idx(InspectFailure::NotTls)].get(), 1u);
    // Its bytes were peeked, never read: closing a socket with unread bytes sends an RST
    // (tcp_close), so such a client sees a reset, not a FIN.
    EXPECT_EQ(r.peerEnd(c.get()), IoStatus::Reset);
}

TEST(Connections, NotTlsGoesToTheDefaultRouteWithItsBytesIntact) {
    // The listener's own upstream is the default route, after the routes.
    Lifecycle r(Given{}.keys(kRoutesNoDefault).topLevel(kClusterA));
    ASSERT_TRUE(r.ok());
    Fd c = r.client();
    ASSERT_TRUE(test::writeAll(c.get(), "GET / HTTP/1.1\r\n\r\n", 18).ok());
    Fd u = r.upstream();
    ASSERT_TRUE(u);
    // Peeked to choose, never consumed: the backend gets every byte.
    EXPECT_EQ(r.read(u.get(), 18), "GET / HTTP/1.1\r\n\r\n");
    EXPECT_EQ(r.listener().inspect_failures[idx(InspectFailure::NotTls)].get(), 1u);
}

TEST(Connections, AnInspectTimeoutTakesTheDefaultRoute) {
    Lifecycle r(Given{}
                    .keys(std::string(kRoutesNoDefault) + "    inspect_timeout: 2s\n")
                    .topLevel(kClusterA));
    ASSERT_TRUE(r.ok());
    Fd c = r.client();
    r.now_ms += 2000 - 1;
    r.sweep();
    EXPECT_EQ(r.listener().inspect_failures[idx(InspectFailure::Timeout)].get(), 0u);
    EXPECT_EQ(r.backendStats().attempts.get(), 0u);
    r.now_ms += 1;
    r.sweep();
    EXPECT_EQ(r.listener().inspect_failures[idx(InspectFailure::Timeout)].get(), 1u);
    Fd u = r.upstream();
    ASSERT_TRUE(u);
    ASSERT_TRUE(test::writeAll(c.get(), "late", 4).ok());
    EXPECT_EQ(r.read(u.get(), 4), "late");
}

}  // namespace
}  // namespace zcrelay
