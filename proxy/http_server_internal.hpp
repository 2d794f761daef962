#pragma once
// Internal to the HTTP server (http_server.cpp, http_server_limits.cpp,
// http_server_framing.cpp, http_server_routes.cpp); callers include http_server.hpp. One
// connection's record and libmicrohttpd's callbacks, each defined in the file of its job.
#include <microhttpd.h>

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <list>
#include <string>

#include "clock.hpp"
#include "http_server.hpp"

namespace zcrelay {

// One connection. Phases, each with its own deadline request_timeout away:
//
//   connected ──request line──▶ reading ──request in──▶ answering ──response sent──▶ idle
//       ▲                                                                          │
//       └────────────────────────────── keep-alive ◀───────────────────────────────┘
//
// `connected` and `idle` wait for a request, `reading` for the rest of it (headers and body,
// under the one deadline, so trickling the body buys nothing the headers did not). `answering`
// waits for the client to take the response. Any phase past its deadline is shut down
// (`timeout`); any phase but `answering` is idle for eviction. shut_down marks one we closed,
// until libmicrohttpd sees the FIN and reports the close.
struct HttpServer::Client {
    std::list<Client>::iterator self;
    int fd = -1;
    int64_t deadline_ms = 0;
    bool reading = false;    // a request line arrived; the handler has not run for it yet
    bool answering = false;  // the handler ran; the response is not all sent yet
    bool shut_down = false;
    // The body of the request being read: reserved once at its Content-Length (at most the
    // route's max_body) when the headers are in, filled as libmicrohttpd hands it over, and
    // freed when the request ends, so an idle keep-alive connection holds none.
    std::string body;
    uint64_t body_left = 0;  // of the Content-Length, not yet handed over
    // The request target as the request line had it, seen before libmicrohttpd cuts it at '?'
    // and parses the query in place: where it starts, its length up to the first NUL, and
    // whether those bytes are all allowed (no CTL, no SP). badFraming() compares the length
    // with the line's layout to find a NUL that a C string hides.
    const char* target = nullptr;
    size_t target_len = 0;
    bool target_clean = false;
};

// libmicrohttpd's callbacks, all run on the server's thread.
struct HttpServer::Callbacks {
    static HttpServer& server(void* cls) { return *static_cast<HttpServer*>(cls); }
    static Client* client(MHD_Connection* conn) {
        const MHD_ConnectionInfo* info =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        return info != nullptr ? static_cast<Client*>(info->socket_context) : nullptr;
    }
    // Moves `c` to the back of the list with a fresh deadline: a phase change.
    static void touch(HttpServer& s, Client& c) {
        c.deadline_ms = monotonicMs() + s.limits_.request_timeout.count();
        s.clients_.splice(s.clients_.end(), s.clients_, c.self);
    }

    // A connection opens or closes; a request ends; the library logs (http_server_limits.cpp).
    static void onConnection(void* cls, MHD_Connection* conn, void** socket_context,
                             MHD_ConnectionNotificationCode code);
    static void onCompleted(void* cls, MHD_Connection* conn, void** request,
                            MHD_RequestTerminationCode);
    static void onLibraryLog(void* cls, const char* fmt, va_list ap);
    static void answering(HttpServer& s, Client& c);
    // The request line, its target as sent (http_server_framing.cpp).
    static void* onRequestLine(void* cls, const char* uri, MHD_Connection* conn);
    // The headers, the body, the handler (http_server_routes.cpp).
    static MHD_Result onRequest(void* cls, MHD_Connection* conn, const char* url,
                                const char* method, const char* version, const char* upload_data,
                                size_t* upload_size, void** request);
    static MHD_Result onHeaders(HttpServer& s, Client* c, MHD_Connection* conn, const char* url,
                                const char* method, const char* version);
};

// What RFC 9112 has a server refuse and libmicrohttpd lets through, in a request whose headers
// are in; null if none (http_server_framing.cpp).
const char* badFraming(MHD_Connection* conn, const char* method, const char* version,
                       const char* target, size_t target_len, bool target_clean);

}  // namespace zcrelay
