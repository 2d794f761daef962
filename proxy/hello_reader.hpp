#pragma once
// routes: the client's first bytes, peeked until a route can be chosen (routes.hpp), never
// consumed: the backend, which terminates TLS, must receive the ClientHello exactly as sent, and
// the data path after the choice stays zero-copy (splice and sockmap find the bytes still
// queued in the client's socket, as they find any bytes that came before the connect).
//
// The wait is a POLLIN | POLLRDHUP on the client, bounded by inspect_timeout (the worker's
// sweep). A hello still incomplete sets SO_RCVLOWAT to the least number of bytes at which it can
// be complete (tls_hello::Parse::wake: its handshake length plus the record headers the rest
// needs), so the next poll fires once they are all there, rather than at each segment of a
// hello split over several (with post-quantum key shares a browser's hello is larger than one
// segment), or at each record of a client that cuts it into tiny ones. tcp_poll() reports
// POLLIN only once SO_RCVLOWAT bytes are queued, or at the FIN.
#include <cstdint>
#include <vector>

#include "conn.hpp"
#include "routes.hpp"
#include "runtime.hpp"
#include "uring/ring.hpp"

namespace zcrelay {

// What the access log says of a hello: its server name and offered protocols, as text.
struct HelloNames {
    char sni[tls_hello::kMaxServerName + 1] = {};
    char alpn[64] = {};
};

struct Inspected {
    enum Kind : uint8_t {
        Wait,    // a poll is armed for more of the hello
        Chosen,  // `choice` says where the client goes (or that nowhere)
        Reset,   // the client's socket failed
    };
    Kind kind = Wait;
    RouteChoice choice;
};

// What forward() sent on: `bytes`, or the errno of the socket that failed.
struct Forwarded {
    uint32_t bytes = 0;
    int error = 0;
    bool on_src = false;  // the error is the client's (else the upstream's)
    bool cut_short = false;  // the upstream took less than was queued: the rest stays queued
};

class HelloReader {
  public:
    HelloReader();

    // Arms the wait for the hello.
    void start(Ring& ring, Conn& c, uint32_t slot);
    // The poll's CQE (`res`: its events). `names`, if not null, gets the hello's names.
    Inspected onReadable(Ring& ring, Conn& c, uint32_t slot, const ListenerRt& l, int res,
                         HelloNames* names);
    // inspect_timeout ran out: the client goes where no hello goes.
    RouteChoice onTimeout(Conn& c, const ListenerRt& l);
    // Connected: sends on what the client has queued (the hello, what came with it or after a
    // PROXY header) as far as the upstream takes it at once, and consumes exactly that;
    // counted in c.proxy_in and c.proxy_out, the bytes outside the data path. For the sockmap
    // path, before its sockets enter the map.
    Forwarded forward(Conn& c);

  private:
    // The wait is over: SO_RCVLOWAT back to 1 for the data path, if it was raised.
    static void done(Conn& c);

    std::vector<uint8_t> scratch_;  // hellos are peeked into this
    std::vector<uint8_t> work_;     // and reassembled here when split over records
};

}  // namespace zcrelay
