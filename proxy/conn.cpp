#include "conn.hpp"

#include <cstdlib>

#include "log.hpp"

namespace zcrelay {
namespace {

// The edges drawn above ConnState, as a bit set of the states each one may go to.
constexpr uint32_t bit(ConnState s) { return 1u << static_cast<unsigned>(s); }

constexpr uint32_t kEdges[] = {
    /* Free */ bit(ConnState::Accepted) | bit(ConnState::Relaying),
    /* Accepted */
    bit(ConnState::Queued) | bit(ConnState::ReadingProxy) | bit(ConnState::Inspecting) |
        bit(ConnState::Connecting) | bit(ConnState::Closing),
    /* Queued */
    bit(ConnState::ReadingProxy) | bit(ConnState::Inspecting) | bit(ConnState::Connecting) |
        bit(ConnState::Closing),
    /* ReadingProxy */
    bit(ConnState::Inspecting) | bit(ConnState::Connecting) | bit(ConnState::Closing),
    /* Inspecting */ bit(ConnState::Connecting) | bit(ConnState::Closing),
    /* Connecting */ bit(ConnState::Relaying) | bit(ConnState::Closing),
    /* Relaying */ bit(ConnState::HandingOver) | bit(ConnState::Closing),
    /* HandingOver */ bit(ConnState::Relaying) | bit(ConnState::Closing),
    /* Closing */ bit(ConnState::Free),
};
static_assert(std::size(kEdges) == static_cast<size_t>(ConnState::Closing) + 1);

}  // namespace

const char* name(ConnState s) {
    static constexpr const char* kNames[] = {"Free",         "Accepted",    "Queued",
                                             "ReadingProxy", "Inspecting",  "Connecting",
                                             "Relaying",     "HandingOver", "Closing"};
    return kNames[static_cast<size_t>(s)];
}

bool isEdge(ConnState from, ConnState to) {
    return (kEdges[static_cast<size_t>(from)] & bit(to)) != 0;
}

void enter(Conn& c, ConnState to) {
    if (!isEdge(c.state, to)) {
        LOG_ERROR("connection state %s -> %s is not an edge of the lifecycle: bookkeeping bug",
                  name(c.state), name(to));
#if !defined(NDEBUG) || defined(ZCRELAY_SANITIZED)
        std::abort();
#endif
    }
    c.state = to;
}

}  // namespace zcrelay
