#pragma once
// accept_proxy: the client's PROXY header, awaited, parsed and consumed exactly, so the bytes
// after it stay in the socket for the data path (proxy_protocol.hpp has the parser).
//
// The wait is a POLLIN | POLLRDHUP on the client, bounded by proxy_timeout (the worker's
// sweep). A header still incomplete sets SO_RCVLOWAT to what the parser needs, so the next
// poll fires only once that much is there, instead of at once again.
#include <cstdint>
#include <vector>

#include "config.hpp"
#include "conn.hpp"
#include "proxy_protocol.hpp"
#include "uring/ring.hpp"

namespace zcrelay {

struct ProxyRead {
    enum Kind : uint8_t {
        Wait,    // a poll is armed for more of it
        Done,    // consumed; c.client / c.local name what it said, c.proxy_in its length
        Failed,  // refused: `why`
        Reset,   // the client's socket failed
        Error,   // the header could not be consumed as peeked
    };
    Kind kind = Wait;
    ProxyFailure why = ProxyFailure::Eof;
};

class ProxyReader {
  public:
    ProxyReader() : scratch_(64 * 1024) {}

    // Arms the wait for the header.
    void start(Ring& ring, Conn& c, uint32_t slot);
    // The poll's CQE (`res`: its events).
    ProxyRead onReadable(Ring& ring, Conn& c, uint32_t slot, const ListenerConfig& l, int res);

  private:
    std::vector<uint8_t> scratch_;  // headers are peeked into this
};

}  // namespace zcrelay
