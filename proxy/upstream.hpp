#pragma once
// The upstream side of a connection: its socket and what a failed connect means.
#include "reasons.hpp"
#include "result.hpp"
#include "unique_fd.hpp"

namespace zcrelay {

// A nonblocking TCP socket for `family` (the caller applies the listener's TCP options).
Result<UniqueFd> openUpstreamSocket(int family);

// The metric reason for a connect CQE's -errno. -ECANCELED is the linked timeout firing.
ConnectFailure classifyConnectError(int err);

}  // namespace zcrelay
