#pragma once
// Listening sockets: one per worker per configured listener, in one SO_REUSEPORT group, so the
// kernel spreads new connections over the workers and no accepted socket ever changes thread.
#include "address.hpp"
#include "result.hpp"
#include "unique_fd.hpp"

namespace zcrelay {

// Binds and listens on `addr`. With port 0 the kernel picks; pass the port it picked to the
// other workers' sockets so they join the same group.
Result<UniqueFd> openListener(const SocketAddress& addr);
Result<SocketAddress> boundAddress(int fd);

}  // namespace zcrelay
