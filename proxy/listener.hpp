#pragma once
// Listening sockets: one per worker per configured listener, in one SO_REUSEPORT group, so the
// kernel spreads new connections over the workers and no accepted socket ever changes thread.
#include "address.hpp"
#include "result.hpp"
#include "unique_fd.hpp"

namespace zcrelay {

// One listening socket a worker accepts on, and the listener (its index in the generation's
// config) it serves. Usually each worker has one per listener; a listener taken over from a
// relay with more workers than this one has more (every socket of its group must be accepted
// from, or the connections the kernel hashes to it would wait forever).
struct ListenSocket {
    size_t listener = 0;
    UniqueFd fd;
};

// Binds and listens on `addr`. With port 0 the kernel picks; pass the port it picked to the
// other workers' sockets so they join the same group.
Result<UniqueFd> openListener(const SocketAddress& addr);
Result<SocketAddress> boundAddress(int fd);

}  // namespace zcrelay
