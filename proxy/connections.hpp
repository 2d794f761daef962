#pragma once
// A worker's connections: the slot table, and the lifecycle that takes each one through the
// states drawn above ConnState (conn.hpp). Each step hands the connection to its owner and
// acts on the verdict: the acceptor for limits (acceptor.hpp), the PROXY header in
// (proxy_reader.hpp), the route from the TLS ClientHello (hello_reader.hpp), the upstream side for the backend and the connect (upstream.hpp), a pump
// per direction for the bytes (pump/). Closing is the one path out: release the accounting,
// let the pumps tear down, close the sockets; the slot is reused once every SQE issued for it
// has completed.
#include <cstdint>
#include <memory>
#include <vector>

#include "acceptor.hpp"
#include "conn.hpp"
#include "generation.hpp"
#include "handover.hpp"
#include "hello_reader.hpp"
#include "process_shared.hpp"
#include "proxy_reader.hpp"
#include "pump/paths.hpp"
#include "pump/pump.hpp"
#include "stats.hpp"
#include "upstream.hpp"
#include "uring/ring.hpp"
#include "uring/user_data.hpp"

struct io_uring_cqe;

namespace zcrelay {

// The Acceptor's host: it serves the clients the Acceptor lets in, when the Acceptor says.
class Connections final : public Acceptor::Host {
  public:
    // `now_ms`: the worker's clock, read for every timestamp. `max_conns`: the worker's share of
    // the fd budget, in connections. `paths`: the worker's path table, which picks each
    // direction's pump and keeps what a path holds in the kernel per connection.
    Connections(unsigned worker, Ring& ring, ProcessShared& process, WorkerStats& stats,
                PumpEnv& pumps, Acceptor& acceptor, Generations& generations, const int64_t& now_ms,
                uint32_t max_conns, Paths& paths);

    // Slots not Free (Closing ones included).
    uint32_t live() const override { return live_; }
    // A client accepted on listener `listener` of the current generation, from `peer`; false
    // when the slot space is exhausted (the caller closes it).
    bool accept(int fd, int32_t listener, const SocketAddress& peer) override;
    // A completion of an SQE issued for a connection.
    void onCompletion(UserData ud, const io_uring_cqe* cqe);
    // Idle timeouts, the PROXY header timeout, the drain deadline (`drain_deadline`: close
    // everything), and pipes that stayed idle through a tick of `tick_ms`.
    void sweep(bool drain_deadline, int64_t tick_ms);
    // The sockmap program signalled (Op::PathSignal): each connection it named looks at what
    // the kernel did (passed bytes to move, a stream marked broken).
    void onPathSignal(uint32_t ring, int res);
    // Copy directions that found no free buffer, once some came back.
    void retryStarved();
    // Clients waiting in the queue for a place under a backend's max_connections: each tries
    // again, in order; those past queue_timeout are closed. The worker calls it when a place
    // came free on this worker (freedPlace) and on every tick, which is short while anyone
    // waits: a place freed on another worker is seen within it.
    void retryQueued();
    bool freedPlace() { return upstream_.takeFreed(); }
    bool queued() const { return !queued_.empty(); }
    // Every connection to the backend whose state is `backend` (connecting or relaying, in
    // any generation) is closed now, as `reason`: admin_shutdown (the runtime API),
    // backend_down or backup_shutdown (health checks). Returns how many.
    uint32_t endBackend(const BackendState* backend, CloseReason reason);

    // ---- across a takeover (handover.hpp, connections_handover.cpp)
    // Hands every connection `out` admits over to the next relay: relaying on splice, not being
    // ended. Each goes once nothing of it is in flight; the rest stay here and drain. `out`
    // hears when this worker is done.
    void handOver(std::shared_ptr<handover::Outbound> out);
    // A connection the previous relay handed over: relayed from here on, in the state it was
    // in. One the config here has no listener, cluster or backend for is closed, counted lost.
    void adopt(handover::HandedConn& h);
    // The worker stops: a handover it has not finished is over for it (the Outbound hears),
    // whatever it still had waiting to cross being gone with its connections.
    void endHandOver();

  private:
    static constexpr uint32_t kChunk = 256;
    // max_connection_duration: how long an ending connection has to finish gracefully.
    static constexpr int64_t kEndGraceMs = 2000;

    // A free slot (Free); UINT32_MAX when the slot space is exhausted.
    uint32_t allocConn();
    Conn& conn(uint32_t slot) { return chunks_[slot / kChunk][slot % kChunk]; }
    // Whether the cluster queue's entry `ud` still waits: not closed, not connecting since, the
    // slot not reused.
    bool waitsInQueue(UserData ud) {
        const Conn& c = conn(ud.slot);
        return c.generation == ud.generation && c.state == ConnState::Connecting &&
               c.queued_until_ms != 0;
    }
    ListenerStats& lstats(const Conn& c) { return listenerStats(c, id_); }
    // An admitted connection's next step: its PROXY header, or its backend.
    void serve(Conn& c, uint32_t slot) override;
    // The admit queue's connections, as the Acceptor hands them back.
    Conn* queued(UserData ud) override;
    void refuse(Conn& c, uint32_t slot) override;
    void onProxyRead(Conn& c, uint32_t slot, int res);
    void proxyFailed(Conn& c, uint32_t slot, ProxyFailure why);
    // The client is known: its per-source limit, then its route (routes) or its backend.
    void clientKnown(Conn& c, uint32_t slot);
    void onHelloRead(Conn& c, uint32_t slot, int res);
    // The route is chosen (or none is): counted, then to the upstream side or closed.
    void routeChosen(Conn& c, uint32_t slot, RouteChoice choice);
    // The cluster is known: to the upstream side.
    void startConnect(Conn& c, uint32_t slot);
    void connect(Conn& c, uint32_t slot);
    void onConnectStep(Conn& c, uint32_t slot, ConnectStep step);
    void retryFdWaiter(UserData ud) override;
    // The client came from one of the relay's own upstream sockets (loop_guard.hpp): its
    // backend is taken down; true when c was closed for it.
    bool closedAsLoop(Conn& c, uint32_t slot);
    // Connected: the PROXY header out, then a pump per direction.
    void startRelaying(Conn& c, uint32_t slot);
    PumpPort port(Conn& c, uint32_t slot, int d);
    void onPumpCompletion(Conn& c, uint32_t slot, int d, Op op, int res, uint32_t flags,
                          uint8_t aux);
    // A pump's verdict: bytes, finish, failure, fallback.
    void apply(Conn& c, uint32_t slot, int d, Step step);
    void addBytes(Conn& c, int d, uint64_t n);
    // What the kernel did for `c`'s paths: passed bytes for a pump to move, a broken stream.
    // At the program's signal, and once a tick for every connection with kernel state: the
    // signal's races are closed (relay.bpf.c), and this keeps any wake-up lost all the same
    // from stalling a connection for more than a tick.
    void lookAtKernel(Conn& c, uint32_t slot);
    // mode auto: the connection turned interactive (Paths::observe); moves it to sockmap if
    // the path table can now, and starts the pumps it replaced.
    void promoteToSockmap(Conn& c, uint32_t slot);
    void finishDirection(Conn& c, uint32_t slot, int d);
    // Half-closed (one direction finished, the other flowing): the finished source's peer is
    // watched for a reset. Armed by the sweep, not at the FIN (connections_sweep.cpp).
    void watchFinished(Conn& c, uint32_t slot);
    void failDirection(Conn& c, uint32_t slot, int d, bool on_src, int err);
    // Relaying: the half-close timeouts and max_connection_duration; true if c was closed.
    bool lifetimeSweep(Conn& c, uint32_t slot, const ListenerConfig& l);
    // max_connection_duration: both sides stop being read; the pumps deliver what they read
    // and pass the FINs on as for any EOF.
    void endGracefully(Conn& c, uint32_t slot);
    HelloNames* helloNames(uint32_t slot) {
        return names_.empty() ? nullptr : &names_[slot / kChunk][slot % kChunk];
    }
    // The kernel left c's stream beyond repair (Step::Broken, Paths::broken): both peers get an
    // RST instead of a FIN.
    void resetBroken(Conn& c, uint32_t slot, int side);
    // Release accounting, let the pumps tear down, close the sockets.
    void closeConn(Conn& c, uint32_t slot, CloseReason reason);
    void countClose(Conn& c, uint32_t slot, CloseReason reason);
    void logConnection(Conn& c, uint32_t slot, CloseReason reason);
    void freeConn(Conn& c, uint32_t slot);
    // Whether c can cross (handOver): relaying, not ending, on a known backend; on sockmap,
    // on a ring this worker reads.
    bool handable(const Conn& c) const;
    // c (HandingOver) has nothing in flight: a splice or copy connection goes now, a sockmap
    // one when its whole ring is at rest (tryRing).
    void rested(Conn& c, uint32_t slot);
    // Ring `ring` crosses once every connection on it is at rest and its poll is back: RING,
    // then each connection's CONN.
    void tryRing(uint32_t ring);
    void sendRing(uint32_t ring);
    // Every connection on `ring` that was HandingOver relays on here, and its poll is armed
    // again: past the deadline, or when the ring could not be sent.
    void keepRing(uint32_t ring, handover::Outcome why);
    // A connection that was HandingOver relays on here: its send failed, or a copy direction
    // could not pass on what it held in time. Its pumps arm their waits again.
    void resumeHere(Conn& c, uint32_t slot);
    // Relaying c's pumps arm their waits afresh: after resumeHere, or adopted.
    void rearm(Conn& c, uint32_t slot);
    // The same past the handover's deadline: it stays, counted kept.
    void keepHere(Conn& c, uint32_t slot);
    // c (HandingOver) has nothing in flight: its sockets and pipes go to the next relay, and it
    // closes here as handed_over; if the send fails it relays on here.
    void sendHandOver(Conn& c, uint32_t slot);
    // A connection left HandingOver: the last one tells the Outbound this worker is done.
    void handedOne();

    const unsigned id_;
    Ring& ring_;
    ProcessShared& process_;
    WorkerStats& stats_;
    PumpEnv& pumps_;
    Acceptor& acceptor_;
    Generations& generations_;
    const int64_t& now_ms_;
    const uint32_t max_conns_;
    Paths& paths_;
    UpstreamSide upstream_;
    LoopGuard::Table& loops_;  // this worker's upstream sockets (loop_guard.hpp)
    ProxyReader proxy_reader_;
    HelloReader hello_reader_;
    std::vector<std::unique_ptr<Conn[]>> chunks_;
    // With an access log, the names each slot's ClientHello gave (chunked like chunks_), kept
    // beside the slots so a connection without routes or log pays nothing for them.
    std::vector<std::unique_ptr<HelloNames[]>> names_;
    uint32_t free_head_ = UINT32_MAX;
    uint32_t slots_used_ = 0;  // high-water mark of slots ever handed out
    uint32_t live_ = 0;
    std::vector<uint64_t> starved_;  // packed UserData of copy directions waiting for a buffer
    std::vector<uint64_t> starved_retry_;  // swapped with starved_: both reserved, no allocation
    // Packed UserData of clients waiting for a backend's place, oldest first; per worker (no
    // lock, no cross-thread wake-up: the tick sees other workers' frees), bounded by each
    // cluster's queue_size.
    std::vector<uint64_t> queued_;
    std::vector<uint64_t> queued_retry_;
    // A handover under way (handOver): connections HandingOver, and whether the walk that
    // starts them is still going (the last one sent before it ended is not the last).
    std::shared_ptr<handover::Outbound> outbound_;
    uint32_t handing_ = 0;
    bool walking_ = false;
    // A copy direction sends what it holds before it crosses; one whose peer does not take it
    // by then stays here (the tick checks).
    int64_t handing_deadline_ms_ = 0;
    uint32_t handed_counts_[3] = {0, 0, 0};  // handed over, kept, failed: for the log line
    // Per wake-up ring (Paths::rings()), while handing over: whether its connections cross, how
    // many of them are not at rest yet, and the map set's id once the RING went.
    struct RingHandOff {
        bool crossing = false;
        bool sent = false;
        uint32_t waiting = 0;
        uint32_t map_id = 0;
    };
    std::vector<RingHandOff> ring_handoffs_;
};

}  // namespace zcrelay
