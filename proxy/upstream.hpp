#pragma once
// The upstream side of a connection: the backend the cluster picks, the socket to it, the
// connect (bounded by a linked timeout), retries on another backend within connect_timeout,
// passive ejection of a backend that keeps failing, and the PROXY header sent on.
#include <cstdint>
#include <utility>

#include "address.hpp"
#include "generation.hpp"
#include "reasons.hpp"
#include "result.hpp"
#include "unique_fd.hpp"
#include "uring/ring.hpp"

namespace zcrelay {

// A nonblocking stream socket to reach `backend` (TCP, or unix for a unix: address), bound to
// `source` when that is set (length != 0) and the backend is TCP. The caller applies the
// listener's TCP options.
Result<UniqueFd> openUpstreamSocket(const SocketAddress& backend, const SocketAddress& source);

// The metric reason for a connect CQE's -errno. -ECANCELED is the linked timeout firing.
ConnectFailure classifyConnectError(int err);

// What the upstream side did; the connection's lifecycle acts on it.
struct ConnectStep {
    enum Kind : uint8_t {
        Pending,    // a connect is in flight (a retry included)
        OutOfFds,   // no fd for the upstream socket: the backend is kept; try again later
        Connected,  // the connect completed and is counted: relay
        Close,      // give up: `reason`
        Queue,      // every backend that may take it is at max_connections: wait for a place
    };
    Kind kind = Pending;
    CloseReason reason = CloseReason::ConnectFailed;
};

class UpstreamSide {
  public:
    explicit UpstreamSide(unsigned worker) : worker_(worker) {}

    // The first attempt: the connect budget (connect_timeout) starts now.
    ConnectStep start(Ring& ring, Conn& c, uint32_t slot);
    // An attempt: a backend (the one held by a connection that waited for an fd, or a new
    // pick), its socket, the connect and its linked timeout.
    ConnectStep connect(Ring& ring, Conn& c, uint32_t slot);
    // The connect's CQE. A failure counts against the backend (ejection) and retries another
    // within the budget.
    ConnectStep onConnect(Ring& ring, Conn& c, uint32_t slot, int res, int64_t now_ms);
    // send_proxy: the header, on the socket that just connected. 0, or the errno of a send
    // that failed or could not take it whole.
    int sendProxyHeader(Conn& c);
    // The connection ends: its backend has one connection less (least_conn), and a place
    // under max_connections more.
    void release(Conn& c);
    // Whether a place under some backend's max_connections came free since the last call:
    // then the queue (Connections::retryQueued) may move.
    bool takeFreed() { return std::exchange(freed_, false); }
    // c was handed over by the previous relay, connected: counted on its backend as a connect
    // that succeeded here would be.
    void adopted(Conn& c);
    // Backend `b` of `cluster` leads back to this relay: the connection `looped` (accepted from
    // one of our upstream sockets, any worker's) is the proof. The backend goes down, even a
    // cluster's only one (a loop serves nobody), until its health checks bring it back or,
    // without checks, for fail_timeout; logged once per time it goes down.
    void ejectLoop(const ClusterRt& cluster, size_t b, Conn& looped, int64_t now_ms);

  private:
    // A backend for the next attempt, -1 if none is up (and untried).
    int pickBackend(Conn& c);
    ConnectStep failed(Ring& ring, Conn& c, uint32_t slot, int err, int64_t now_ms);
    // Gives c's place under its backend's max_connections back, if it holds one.
    void releasePlace(Conn& c);

    unsigned worker_;
    bool freed_ = false;
};

}  // namespace zcrelay
