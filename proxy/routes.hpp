#pragma once
// Which route a client takes, from what its TLS ClientHello says (tls_hello.hpp).
//
// Routes are tried in order and the first whose conditions all hold wins: its server names
// (exact, or "*.example.com" for exactly one label in front, compared without case and
// without a trailing dot: DNS names are case-insensitive, RFC 4343) and its ALPN protocols (any
// the client offers, compared exactly: RFC 7301 3.1). Whatever does not end in a conditional
// route (no ClientHello at all, none complete in time, none with a matching name) goes to the
// default route if the listener has one, counted as an inspection failure either way.
#include <cstdint>
#include <string_view>

#include "reasons.hpp"
#include "runtime.hpp"
#include "tls_hello.hpp"

namespace zcrelay {

struct RouteChoice {
    uint32_t route = ListenerRt::kNoRoute;  // index into ListenerRt::routes; kNoRoute: none
    bool failed = false;                    // no conditional route matched: `why`
    InspectFailure why = InspectFailure::NoRoute;
};

// `hello` null: there was no ClientHello to match on, for the reason `why`.
RouteChoice chooseRoute(const ListenerRt& l, const tls_hello::ClientHello* hello,
                        InspectFailure why = InspectFailure::NoRoute);

// Whether `pattern` (lowercase, no trailing dot, maybe "*.rest") names `server_name` (as the
// client sent it: any case, maybe a trailing dot).
bool serverNameMatches(std::string_view pattern, std::string_view server_name);

}  // namespace zcrelay
