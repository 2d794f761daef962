#pragma once
// The upstream side of a connection: its socket and what a failed connect means.
#include "address.hpp"
#include "reasons.hpp"
#include "result.hpp"
#include "unique_fd.hpp"

namespace zcrelay {

// A nonblocking stream socket to reach `backend` (TCP, or unix for a unix: address), bound to
// `source` when that is set (length != 0) and the backend is TCP. The caller applies the
// listener's TCP options.
Result<UniqueFd> openUpstreamSocket(const SocketAddress& backend, const SocketAddress& source);

// The metric reason for a connect CQE's -errno. -ECANCELED is the linked timeout firing.
ConnectFailure classifyConnectError(int err);

}  // namespace zcrelay
