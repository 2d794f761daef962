#include "http_server.hpp"

#include <microhttpd.h>
#include <netinet/in.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <utility>

#include "clock.hpp"
#include "file_kind.hpp"
#include "listener.hpp"
#include "log.hpp"
#include "result.hpp"
#include "unique_fd.hpp"

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

namespace {

constexpr int64_t kReportEveryMs = 10'000;

// What the handler queues: libmicrohttpd copies the body, sends Content-Length, and leaves the
// body out for HEAD (MHD_queue_response marks it sent).
MHD_Result queue(MHD_Connection* conn, int status, const std::string& content_type,
                 const std::string& body, const char* allow = nullptr, bool close = false) {
    MHD_Response* response = MHD_create_response_from_buffer(
        body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
    if (response == nullptr) return MHD_NO;  // out of memory: libmicrohttpd closes it
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, content_type.c_str());
    if (allow != nullptr) MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, allow);
    // libmicrohttpd closes the connection after sending a response that says so.
    if (close) MHD_add_response_header(response, MHD_HTTP_HEADER_CONNECTION, "close");
    const MHD_Result queued = MHD_queue_response(conn, static_cast<unsigned>(status), response);
    MHD_destroy_response(response);
    return queued;
}

MHD_Result queue(MHD_Connection* conn, const HttpReply& reply) {
    return queue(conn, reply.status, reply.content_type, reply.body);
}

const std::string kTextPlain = "text/plain; charset=utf-8";

bool hasBody(MHD_Connection* conn) {
    const char* length =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    const char* chunked =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
    return chunked != nullptr || (length != nullptr && std::strcmp(length, "0") != 0);
}

// A header's value ("" if absent), as libmicrohttpd holds it in the connection's memory pool
// until the request ends. With the header sent twice, the first, as libmicrohttpd's own
// Content-Length reading does. Without trailing whitespace: libmicrohttpd skips the leading
// whitespace only, and RFC 9110 §5.5 makes neither part of the value.
std::string_view headerValue(MHD_Connection* conn, const char* name) {
    const char* value = nullptr;
    size_t size = 0;
    if (MHD_lookup_connection_value_n(conn, MHD_HEADER_KIND, name, std::strlen(name), &value,
                                      &size) != MHD_YES ||
        value == nullptr)
        return {};
    while (size > 0 && (value[size - 1] == ' ' || value[size - 1] == '\t')) --size;
    return {value, size};
}

// RFC 9110 §5.6.2's tchar: what a method and a field name are made of (no CTL, no SP, none of
// the delimiters).
bool isTchar(unsigned char ch) {
    if ((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z'))
        return true;
    return ch != '\0' && std::strchr("!#$%&'*+-.^_`|~", ch) != nullptr;
}

// RFC 9110 §5.5: a field value may hold HTAB, SP, visible ASCII and obs-text (0x80-0xFF), never
// another control byte (0x00-0x1F, 0x7F).
bool isCtl(unsigned char ch) { return ch < 0x20 || ch == 0x7f; }

// The request's header block, walked against the pieces libmicrohttpd handed over.
//
// libmicrohttpd 0.9.75 parses the request line and the header lines in place, in one buffer
// from the method to the end of the blank line (MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE bytes):
// it overwrites with NUL the SP after the method, the SP before the version, the ':' after each
// field name and each line's CR LF (or bare LF), and leaves every other byte as sent. It then
// hands over C strings (its MHD_get_connection_values_n sizes are strlen() of them too), so a
// NUL the client sent ends a value early and hides the rest of the line: `Bearer <token>\0junk`
// reads as `Bearer <token>`, a target `/a\0x` as `/a`; a header line that starts with NUL is
// even taken for the blank line, and what follows it read as the body. So every byte of the
// block must be one of those pieces (method, target, version, each field's name and value, in
// the order sent) or a NUL libmicrohttpd wrote itself where the grammar puts one; a byte left
// over is one a C string hid. One case stays invisible: a NUL sent just before a bare LF leaves
// the same two NULs as a CR LF; nothing follows it on its line, so nothing is hidden.
struct Framing {
    uintptr_t begin = 0, end = 0;  // the block
    const char* at = nullptr;      // the first byte not yet accounted for
    const char* why = nullptr;     // the first fault found
    unsigned lengths = 0;          // Content-Length fields
    bool encoded = false;          // a Transfer-Encoding field

    // Whether [p, p + size] (the terminating NUL included) lies in the block. A folded line's
    // value (obs-fold) is copied elsewhere in libmicrohttpd's pool: outside, so refused as RFC
    // 9112 §5.2 allows.
    bool inside(const char* p, size_t size) const {
        const auto a = reinterpret_cast<uintptr_t>(p);
        return a >= begin && a < end && size < end - a;
    }
    // Whether only a line end (one NUL for LF, two for CR LF) lies between `at` and `next`.
    bool lineEndBefore(const char* next) const {
        const auto a = reinterpret_cast<uintptr_t>(at), n = reinterpret_cast<uintptr_t>(next);
        return (n == a + 1 && at[0] == '\0') || (n == a + 2 && at[0] == '\0' && at[1] == '\0');
    }

    static MHD_Result field(void* cls, MHD_ValueKind, const char* name, size_t name_size,
                            const char* value, size_t value_size) {
        Framing& f = *static_cast<Framing*>(cls);
        if (!f.inside(name, name_size) || !f.inside(value, value_size)) {
            f.why = "a header line out of place (a folded line?)";
            return MHD_NO;
        }
        if (!f.lineEndBefore(name)) {
            f.why = "a NUL byte in a line";
            return MHD_NO;
        }
        if (name_size == 0 || name[name_size] != '\0' ||
            !std::all_of(name, name + name_size,
                         [](char ch) { return isTchar(static_cast<unsigned char>(ch)); })) {
            f.why = "a control byte, space or delimiter in a header name";
            return MHD_NO;
        }
        // Between the ':' and the value only the optional whitespace libmicrohttpd skipped.
        const char* p = name + name_size + 1;
        while (p != value && (*p == ' ' || *p == '\t')) ++p;
        if (p != value) {
            f.why = "a NUL byte in a header value";
            return MHD_NO;
        }
        if (std::any_of(value, value + value_size, [](char ch) {
                return ch != '\t' && isCtl(static_cast<unsigned char>(ch));
            })) {
            f.why = "a control byte in a header value";
            return MHD_NO;
        }
        const std::string_view n(name, name_size);
        const auto is = [&](std::string_view want) {
            return n.size() == want.size() && ::strncasecmp(n.data(), want.data(), n.size()) == 0;
        };
        if (is(MHD_HTTP_HEADER_CONTENT_LENGTH)) ++f.lengths;
        if (is(MHD_HTTP_HEADER_TRANSFER_ENCODING)) f.encoded = true;
        f.at = value + value_size;
        return MHD_YES;
    }
};

// What RFC 9112 says a server must refuse and libmicrohttpd lets through, in a request whose
// headers are in; null if none. `target` and `target_len` are the target as the request line had
// it (the URI log callback's view: strlen up to the first NUL), `target_clean` whether those
// bytes were free of CTL and SP.
const char* badFraming(MHD_Connection* conn, const char* method, const char* version,
                       const char* target, size_t target_len, bool target_clean) {
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
    if (info == nullptr || method == nullptr || version == nullptr || target == nullptr)
        return "a request line libmicrohttpd did not report";
    Framing f;
    f.begin = reinterpret_cast<uintptr_t>(method);
    f.end = f.begin + info->header_size;
    // RFC 9112 §3: method SP request-target SP HTTP-version (libmicrohttpd skips extra SPs
    // before the target; that much tolerance is harmless).
    const size_t method_len = ::strnlen(method, info->header_size);
    if (method_len == 0 || !f.inside(method, method_len) ||
        !std::all_of(method, method + method_len,
                     [](char ch) { return isTchar(static_cast<unsigned char>(ch)); }))
        return "a control byte in the method";
    const char* p = method + method_len + 1;
    while (f.inside(p, 0) && p != target && *p == ' ') ++p;
    if (p != target || !f.inside(target, target_len + 1)) return "a NUL byte in the method";
    // RFC 9112 §3.2: the target has no CTL and no SP; a NUL shows as a target shorter than the
    // bytes between the two SPs.
    if (!target_clean) return "a control byte or space in the request target";
    if (target + target_len + 1 != version) return "a NUL byte in the request target";
    f.at = version + ::strnlen(version, f.end - reinterpret_cast<uintptr_t>(version));
    MHD_get_connection_values_n(conn, MHD_HEADER_KIND, &Framing::field, &f);
    if (f.why != nullptr) return f.why;
    // After the last line's end only the blank line: two to four NULs (LF or CR LF, twice).
    const uintptr_t rest = f.end - reinterpret_cast<uintptr_t>(f.at);
    if (rest < 2 || rest > 4 || std::any_of(f.at, f.at + rest, [](char ch) { return ch != '\0'; }))
        return "a NUL byte in a line";
    // RFC 9112 §6.3: a Content-Length next to a Transfer-Encoding, or several Content-Lengths
    // (libmicrohttpd takes the first, another server in the path may take the last), let two
    // parsers disagree on where the body ends: the request-smuggling shape. Even equal repeated
    // lengths are refused; no client sends them.
    if (f.lengths > 1) return "more than one Content-Length";
    if (f.lengths > 0 && f.encoded) return "both Content-Length and Transfer-Encoding";
    return nullptr;
}

// libmicrohttpd decodes %XX in the path in place before handlers see it; this keeps it as sent,
// so routes match and handlers parse the bytes the client sent (no "%2F" turned into a "/"
// after matching). It also leaves query arguments undecoded, which nothing here reads.
size_t keepEscaped(void*, MHD_Connection*, char* s) { return std::strlen(s); }

// "GET, HEAD" (an Allow header) and "only GET and HEAD\n" (a 405's text) for `methods`.
std::string allowHeader(const std::vector<std::string>& methods) {
    std::string out;
    for (const std::string& m : methods) out += (out.empty() ? "" : ", ") + m;
    return out;
}
std::string notAllowedText(const std::vector<std::string>& methods) {
    std::string out = "only";
    for (size_t i = 0; i < methods.size(); ++i)
        out += (i == 0 ? " " : i + 1 == methods.size() ? " and " : ", ") + methods[i];
    return out + "\n";
}

// Makes way for a unix socket at `path`: nothing there, or a stale socket (one nobody listens
// on: connect() is refused), which is removed. Anything else is refused and left as it is: a
// regular file or a directory (a typo in the config must not delete data), a symlink (lstat:
// never followed), a socket another server listens on (its clients would be cut off silently).
tl::expected<void, std::string> clearUnixPath(const SocketAddress& listen,
                                              const std::string& path) {
    const std::string where = listen.toString();
    struct stat st {};
    if (::lstat(path.c_str(), &st) < 0) {
        if (errno == ENOENT) return {};
        const std::string why = errnoText("lstat");
        return tl::unexpected(where + ": " + why);
    }
    if (!S_ISSOCK(st.st_mode))
        return tl::unexpected(where + ": " + path + " exists and is " + fileKind(st.st_mode) +
                              ", not a socket; refusing to remove it");
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!probe) {
        const std::string why = errnoText("socket");
        return tl::unexpected(where + ": " + why);
    }
    const int connected = ::connect(probe.get(), listen.sockaddrPtr(), listen.length);
    const int err = errno;
    // Accepted, or queued behind a full backlog: someone listens.
    if (connected == 0 || err == EAGAIN)
        return tl::unexpected(where + ": " + path +
                              " is a socket another server is listening on; not removing it");
    if (err != ECONNREFUSED && err != ENOENT)
        return tl::unexpected(where + ": cannot tell whether the socket " + path + " is in use (" +
                              errnoText("connect", err) + "); not removing it");
    if (::unlink(path.c_str()) < 0 && errno != ENOENT) {
        const std::string why = errnoText("unlink");
        return tl::unexpected(where + ": removing the stale socket " + path + ": " + why);
    }
    return {};
}

}  // namespace

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

    static void onConnection(void* cls, MHD_Connection* conn, void** socket_context,
                             MHD_ConnectionNotificationCode code) {
        HttpServer& s = server(cls);
        if (code == MHD_CONNECTION_NOTIFY_STARTED) {
            Client& c = s.clients_.emplace_back();
            c.self = std::prev(s.clients_.end());
            const MHD_ConnectionInfo* info =
                MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
            c.fd = info != nullptr ? info->connect_fd : -1;
            c.deadline_ms = monotonicMs() + s.limits_.request_timeout.count();
            *socket_context = &c;
            ++s.open_;
            s.stats_.connections.fetch_add(1, std::memory_order_relaxed);
            if (s.open_ > s.limits_.max_connections) s.evictFor(c);
            return;
        }
        auto* c = static_cast<Client*>(*socket_context);
        if (c == nullptr) return;
        // Closed in the middle of a request onCompleted() was not told about.
        if (!c->shut_down && c->reading) s.reject(HttpReject::BadRequest);
        if (!c->shut_down) --s.open_;
        s.stats_.connections.fetch_sub(1, std::memory_order_relaxed);
        s.clients_.erase(c->self);
        *socket_context = nullptr;
    }

    // Called with the target before libmicrohttpd cuts the query off at '?' and parses it in
    // place (a "%01" there becomes a byte 1): the one moment the target is as sent, up to the
    // first NUL.
    static void* onRequestLine(void* cls, const char* uri, MHD_Connection* conn) {
        if (Client* c = client(conn)) {
            c->reading = true;
            c->target = uri;
            c->target_len = 0;
            c->target_clean = uri != nullptr;
            for (const char* p = uri; p != nullptr && *p != '\0'; ++p, ++c->target_len)
                if (*p == ' ' || isCtl(static_cast<unsigned char>(*p))) c->target_clean = false;
        }
        (void)cls;
        return nullptr;  // the request's state: null until the handler runs
    }

    // Called once when the request line and headers are in (`*request` still null), then once
    // per piece of the body libmicrohttpd has read (`*upload_size` > 0), then once more when the
    // whole request is in (`*upload_size` 0). libmicrohttpd 0.9.75 takes a response only on the
    // first call or the last (MHD_queue_response refuses one while a body is being read), and
    // closes the connection after a response queued on the first ("early": it will not read
    // what follows). So every refusal is decided on the first call, from the headers alone, and
    // answers wait for the last call, keeping keep-alive.
    static MHD_Result onRequest(void* cls, MHD_Connection* conn, const char* url,
                                const char* method, const char* version, const char* upload_data,
                                size_t* upload_size, void** request) {
        HttpServer& s = server(cls);
        Client* c = client(conn);
        if (*request == nullptr) {
            *request = &s;  // the handler has seen this request
            return onHeaders(s, c, conn, url, method, version);
        }
        if (*upload_size != 0) {
            // A piece of the body. For a Content-Length body libmicrohttpd hands over at most
            // what the length has left (process_request_body), and onHeaders() reserved it all;
            // anything else would be a body onHeaders() did not agree to: close.
            if (c == nullptr || *upload_size > c->body_left) return MHD_NO;
            c->body.append(upload_data, *upload_size);
            c->body_left -= *upload_size;
            *upload_size = 0;
            return MHD_YES;
        }
        if (c != nullptr) answering(s, *c);
        const HttpRoute* route = s.findRoute(url);
        if (route == nullptr) {
            s.reject(HttpReject::NotFound);
            return queue(conn, 404, kTextPlain, "not found\n");
        }
        s.stats_.requests.fetch_add(1, std::memory_order_relaxed);
        const HttpRequest req{method, url, c != nullptr ? std::string_view(c->body) : "",
                              headerValue(conn, MHD_HTTP_HEADER_AUTHORIZATION)};
        return queue(conn, route->handler(req));
    }

    // The request's headers are in: refuse it now (400, 405, 411, 413; the connection is
    // closed after the refusal, its body never read), or let libmicrohttpd read its body, if
    // any, under the deadline the headers had.
    static MHD_Result onHeaders(HttpServer& s, Client* c, MHD_Connection* conn, const char* url,
                                const char* method, const char* version) {
        const auto refuse = [&](HttpReject why, int status, const std::string& text,
                                const char* allow = nullptr, bool close = false) {
            s.reject(why);
            if (c != nullptr) answering(s, *c);
            return queue(conn, status, kTextPlain, text, allow, close);
        };
        // Before routing: the route is chosen by the target, which may be what a NUL cut short.
        // Closed after the 400 whether or not a body was announced: RFC 9112 §6.3 has a server
        // that cannot tell where a request ends close the connection, and the next request's
        // start is exactly what a malformed one leaves in doubt.
        if (const char* why =
                badFraming(conn, method, version, c != nullptr ? c->target : nullptr,
                           c != nullptr ? c->target_len : 0, c != nullptr && c->target_clean))
            return refuse(HttpReject::BadRequest, 400, std::string("bad request: ") + why + "\n",
                          nullptr, /*close=*/true);
        const HttpRoute* route = s.findRoute(url);
        if (route == nullptr) {
            // No route: refused as a method when no route takes it (the only answer a server
            // of GET/HEAD routes ever gave a POST), as a body when it has one, else 404 after.
            if (!s.anyRouteTakes(method))
                return refuse(HttpReject::Method, 405, s.all_not_allowed_, s.all_allow_.c_str());
            if (hasBody(conn))
                return refuse(HttpReject::Body, 413, "no request body is accepted\n");
            return MHD_YES;
        }
        const size_t at = static_cast<size_t>(route - s.routes_.data());
        if (std::find(route->methods.begin(), route->methods.end(), method) == route->methods.end())
            return refuse(HttpReject::Method, 405, s.not_allowed_[at], s.allow_[at].c_str());
        if (route->max_body == 0) {
            // Refused before the body: whatever Content-Length promised is never read.
            if (hasBody(conn))
                return refuse(HttpReject::Body, 413, "no request body is accepted\n");
            return MHD_YES;
        }
        // A body of unknown length (chunked, or any Transfer-Encoding, which libmicrohttpd
        // would read until the client closes) is refused: 411 asks for a Content-Length, which
        // lets the size be checked before a byte of the body is read.
        if (MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING) !=
            nullptr)
            return refuse(HttpReject::Body, 411,
                          "a request body needs a Content-Length (chunked bodies are refused)\n");
        // libmicrohttpd answered 400 (not digits) or 413 (past 2^64-1) itself before this call,
        // so the value is all digits and fits.
        const std::string_view length = headerValue(conn, MHD_HTTP_HEADER_CONTENT_LENGTH);
        uint64_t size = 0;
        if (!length.empty() &&
            std::from_chars(length.data(), length.data() + length.size(), size).ec != std::errc())
            return refuse(HttpReject::BadRequest, 400, "bad Content-Length\n");
        if (size > route->max_body)
            return refuse(
                HttpReject::Body, 413,
                "the request body is larger than " + std::to_string(route->max_body) + " bytes\n");
        if (size == 0) return MHD_YES;
        if (c == nullptr) return MHD_NO;  // nowhere to hold it (cannot happen: onConnection)
        // The one allocation for the body, of exactly its size: no growth while it arrives.
        c->body.reserve(size);
        c->body_left = size;
        return MHD_YES;  // libmicrohttpd sends 100 Continue first if the client asked for it
    }

    // The request is in (or refused): its response has request_timeout to be taken.
    static void answering(HttpServer& s, Client& c) {
        c.reading = false;
        c.answering = true;
        touch(s, c);
    }

    // The end of a request libmicrohttpd told us the start of (its request line): answered, or
    // refused by libmicrohttpd itself before our handler saw it (400, 414, 431), or cut off
    // (before the end of its headers or of its body).
    static void onCompleted(void* cls, MHD_Connection* conn, void** request,
                            MHD_RequestTerminationCode) {
        HttpServer& s = server(cls);
        Client* c = client(conn);
        if (c == nullptr) return;
        if ((*request == nullptr || c->reading) && !c->shut_down) s.reject(HttpReject::BadRequest);
        c->answering = false;
        c->reading = false;
        std::string().swap(c->body);  // freed, not kept for the next request
        c->body_left = 0;
        if (!c->shut_down) touch(s, *c);
    }

    static void onLibraryLog(void* cls, const char* fmt, va_list ap) {
        // libmicrohttpd's own complaints (a failed accept, a reset peer): useful when debugging,
        // noise under attack; what it refused is counted and reported by reportRejects().
        if (!logEnabled(LogLevel::Debug)) return;
        char line[512];
        std::vsnprintf(line, sizeof line, fmt, ap);
        line[std::strcspn(line, "\n")] = '\0';
        LOG_DEBUG("%s: libmicrohttpd: %s", server(cls).name_.c_str(), line);
    }
};

HttpServer::HttpServer(std::string name, SocketAddress address, const HttpLimits& limits,
                       std::vector<HttpRoute> routes, HttpStats& stats)
    : name_(std::move(name)),
      address_(address),
      limits_(limits),
      routes_(std::move(routes)),
      stats_(stats) {
    std::vector<std::string> every;
    for (size_t i = 0; i < routes_.size(); ++i) {
        const HttpRoute& r = routes_[i];
        allow_.push_back(allowHeader(r.methods));
        not_allowed_.push_back(notAllowedText(r.methods));
        for (const std::string& m : r.methods)
            if (std::find(every.begin(), every.end(), m) == every.end()) every.push_back(m);
        if (r.prefix) prefix_order_.push_back(i);
    }
    all_allow_ = allowHeader(every);
    all_not_allowed_ = notAllowedText(every);
    std::stable_sort(prefix_order_.begin(), prefix_order_.end(), [&](size_t a, size_t b) {
        return routes_[a].path.size() > routes_[b].path.size();
    });
}

const HttpRoute* HttpServer::findRoute(std::string_view path) const {
    for (const HttpRoute& r : routes_)
        if (!r.prefix && r.path == path) return &r;
    for (size_t i : prefix_order_)
        if (path.starts_with(routes_[i].path)) return &routes_[i];
    return nullptr;
}

bool HttpServer::anyRouteTakes(std::string_view method) const {
    for (const HttpRoute& r : routes_)
        if (std::find(r.methods.begin(), r.methods.end(), method) != r.methods.end()) return true;
    return false;
}

tl::expected<std::unique_ptr<HttpServer>, std::string> HttpServer::start(
    const std::string& name, const SocketAddress& listen, const HttpLimits& limits,
    std::vector<HttpRoute> routes, HttpStats& stats) {
    for (const HttpRoute& r : routes)
        if (!r.handler) return tl::unexpected("the route " + r.path + " has no handler");
    const bool unix_socket = listen.family() == AF_UNIX;
    if (!unix_socket && listen.family() != AF_INET && listen.family() != AF_INET6)
        return tl::unexpected(listen.toString() +
                              ": only TCP and unix socket addresses are served");
    UniqueFd fd;
    SocketAddress bound_address = listen;
    // Until the server owns it, the socket file this call created is removed on any failure.
    std::string unix_path;
    struct stat unix_file {};
    struct RemoveOnFailure {
        const std::string& path;
        ~RemoveOnFailure() {
            if (!path.empty()) ::unlink(path.c_str());
        }
    } remove_on_failure{unix_path};
    if (!unix_socket) {
        fd = UniqueFd(::socket(listen.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        if (!fd) return tl::unexpected(std::string("socket: ") + std::strerror(errno));
        int one = 1;
        ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (listen.family() == AF_INET6)
            ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
        if (::bind(fd.get(), listen.sockaddrPtr(), listen.length) < 0)
            return tl::unexpected("bind " + listen.toString() + ": " + std::strerror(errno));
        // A deep backlog: under a connection flood the probe waits in it for one accept round,
        // not for a SYN retransmit (1 s) after an overflow. The kernel caps it at
        // net.core.somaxconn.
        if (::listen(fd.get(), SOMAXCONN) < 0)
            return tl::unexpected("listen " + listen.toString() + ": " + std::strerror(errno));
        auto bound = boundAddress(fd.get());
        if (!bound) return tl::unexpected(bound.error().message());
        bound_address = *bound;
    } else {
        const auto& sun = *reinterpret_cast<const sockaddr_un*>(&listen.storage);
        const size_t length = ::strnlen(sun.sun_path, sizeof sun.sun_path);
        if (length == 0 || length == sizeof sun.sun_path || sun.sun_path[0] != '/')
            return tl::unexpected(listen.toString() +
                                  ": a unix socket needs an absolute path, e.g. unix:/run/x.sock");
        const std::string path(sun.sun_path, length);
        if (auto cleared = clearUnixPath(listen, path); !cleared)
            return tl::unexpected(cleared.error());
        fd = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        if (!fd) return tl::unexpected(std::string("socket: ") + std::strerror(errno));
        if (::bind(fd.get(), listen.sockaddrPtr(), listen.length) < 0)
            return tl::unexpected("bind " + listen.toString() + ": " + std::strerror(errno));
        unix_path = path;
        // Before listen(): until then a connect() is refused whatever the mode, so no client
        // gets in under the umask's mode in between.
        if (::chmod(path.c_str(), 0660) < 0) {
            const std::string why = errnoText("chmod 0660");
            return tl::unexpected(listen.toString() + ": " + why);
        }
        if (::lstat(path.c_str(), &unix_file) < 0) {
            const std::string why = errnoText("lstat");
            return tl::unexpected(listen.toString() + ": " + why);
        }
        if (::listen(fd.get(), SOMAXCONN) < 0)
            return tl::unexpected("listen " + listen.toString() + ": " + std::strerror(errno));
    }

    std::unique_ptr<HttpServer> server(
        new HttpServer(name, bound_address, limits, std::move(routes), stats));
    if (unix_socket) {
        // From here the destructor removes it, the failures below included.
        server->unix_path_ = std::exchange(unix_path, std::string());
        server->unix_dev_ = unix_file.st_dev;
        server->unix_ino_ = unix_file.st_ino;
    }
    server->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (server->wake_fd_ < 0)
        return tl::unexpected(std::string("eventfd: ") + std::strerror(errno));

    // The memory pool of one connection holds its read buffer and the parsed headers, then the
    // response's headers: the request may fill all but what the response needs (1 KiB is
    // several times what ours take), past which libmicrohttpd answers 431 (or 414).
    const size_t pool = limits.max_request_size + 1024;
    // Its hard connection limit sits above ours: past it libmicrohttpd refuses the newest
    // connection (the probe), where evictFor() closes the oldest idle one. The headroom covers
    // the connections shut down but not yet reaped in the same round.
    const unsigned hard_limit = limits.max_connections * 2 + 16;
    // MHD_USE_EPOLL without an internal thread: run() owns the loop, so the deadlines and the
    // evictions happen on the thread that owns every connection. No MHD timeout: sweep() keeps
    // the deadlines, to the millisecond.
    //
    // A unix listening socket is handed over the same way: libmicrohttpd asks it SO_DOMAIN,
    // marks its connections non-IP (no TCP_NODELAY/TCP_CORK on them) and takes the 2-byte
    // address accept() gives an unnamed client. Nothing here reads a client's address: the
    // deadlines and evictions go by fd and age.
    server->daemon_ = MHD_start_daemon(
        MHD_USE_EPOLL | MHD_USE_ERROR_LOG, 0, nullptr, nullptr, &Callbacks::onRequest, server.get(),
        MHD_OPTION_LISTEN_SOCKET, fd.get(), MHD_OPTION_CONNECTION_LIMIT, hard_limit,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, pool, MHD_OPTION_CONNECTION_TIMEOUT, 0u,
        MHD_OPTION_NOTIFY_CONNECTION, &Callbacks::onConnection, server.get(),
        MHD_OPTION_NOTIFY_COMPLETED, &Callbacks::onCompleted, server.get(),
        MHD_OPTION_URI_LOG_CALLBACK, &Callbacks::onRequestLine, server.get(),
        MHD_OPTION_UNESCAPE_CALLBACK, &keepEscaped, nullptr,
        MHD_OPTION_EXTERNAL_LOGGER, &Callbacks::onLibraryLog, server.get(),
        MHD_OPTION_SIGPIPE_HANDLED_BY_APP, 1,  // main() ignores SIGPIPE for the process
        MHD_OPTION_END);
    if (server->daemon_ == nullptr)
        return tl::unexpected(std::string("libmicrohttpd did not start"));
    fd.release();  // the daemon closes it
    server->thread_ = std::thread([s = server.get()] { s->run(); });
    return server;
}

HttpServer::~HttpServer() {
    if (thread_.joinable()) {
        const uint64_t one = 1;
        ssize_t ignored = ::write(wake_fd_, &one, sizeof one);
        (void)ignored;
        thread_.join();
    }
    // Closes every connection (the CLOSED callbacks run here, the thread being gone) and the
    // listening socket.
    if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    // The socket file stays behind a closed socket: removed, unless it is no longer ours.
    struct stat st {};
    if (!unix_path_.empty() && ::lstat(unix_path_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) &&
        st.st_dev == unix_dev_ && st.st_ino == unix_ino_)
        ::unlink(unix_path_.c_str());
}

void HttpServer::run() {
    setLogThreadName("http");
    // One epoll set over libmicrohttpd's (listening socket and connections) and the stop
    // eventfd: the thread sleeps until either has something, or the next deadline.
    UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
    const MHD_DaemonInfo* info = MHD_get_daemon_info(daemon_, MHD_DAEMON_INFO_EPOLL_FD);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = info->epoll_fd;
    ::epoll_ctl(ep.get(), EPOLL_CTL_ADD, info->epoll_fd, &ev);
    ev.data.fd = wake_fd_;
    ::epoll_ctl(ep.get(), EPOLL_CTL_ADD, wake_fd_, &ev);
    for (;;) {
        epoll_event ready[2];
        const int n = ::epoll_wait(ep.get(), ready, 2, nextWakeMs(monotonicMs()));
        for (int i = 0; i < n; ++i)
            if (ready[i].data.fd == wake_fd_) return;
        MHD_run(daemon_);
        const int64_t now = monotonicMs();
        sweep(now);
        reportRejects(now);
    }
}

int HttpServer::nextWakeMs(int64_t now_ms) const {
    int64_t wake = kReportEveryMs;
    MHD_UNSIGNED_LONG_LONG mhd = 0;
    if (MHD_get_timeout(daemon_, &mhd) == MHD_YES) wake = std::min<int64_t>(wake, mhd);
    for (const Client& c : clients_) {
        if (c.shut_down) continue;
        wake = std::min(wake, std::max<int64_t>(0, c.deadline_ms - now_ms));
        break;  // the first one not shut down has the earliest deadline
    }
    return static_cast<int>(wake);
}

void HttpServer::sweep(int64_t now_ms) {
    for (Client& c : clients_) {
        if (c.deadline_ms > now_ms) break;
        if (!c.shut_down) shutDown(c, HttpReject::Timeout);
    }
}

void HttpServer::evictFor(const Client& newcomer) {
    Client* victim = nullptr;
    for (Client& c : clients_) {
        if (c.shut_down || &c == &newcomer) continue;
        if (!c.answering) {
            victim = &c;
            break;
        }
        if (victim == nullptr) victim = &c;  // the oldest being answered, if none is idle
    }
    if (victim != nullptr) shutDown(*victim, HttpReject::Evicted);
}

void HttpServer::shutDown(Client& client, HttpReject why) {
    // shutdown(), not close(): the fd stays libmicrohttpd's, which sees the FIN it causes on its
    // epoll set, closes the socket itself and reports it. Both directions, so a client still
    // sending gets an RST rather than a window that never opens.
    ::shutdown(client.fd, SHUT_RDWR);
    client.shut_down = true;
    --open_;
    reject(why);
}

void HttpServer::reject(HttpReject why) {
    stats_.rejected[idx(why)].fetch_add(1, std::memory_order_relaxed);
}

void HttpServer::reportRejects(int64_t now_ms) {
    // One line at most every kReportEveryMs, naming what was refused since the last one: a
    // flood of thousands of connections costs the log a line, not thousands.
    if (now_ms - last_report_ms_ < kReportEveryMs) return;
    std::string what;
    for (size_t r = 0; r < reported_.size(); ++r) {
        const uint64_t total = stats_.rejected[r].load(std::memory_order_relaxed);
        if (total == reported_[r]) continue;
        what += (what.empty() ? "" : ", ") + std::string(kHttpRejectLabels[r]) + " " +
                std::to_string(total - reported_[r]);
        reported_[r] = total;
    }
    if (what.empty()) return;
    last_report_ms_ = now_ms;
    LOG_WARN("%s %s: refused since the last report: %s (%u connections open, limit %u)",
             name_.c_str(), address_.toString().c_str(), what.c_str(), open_,
             limits_.max_connections);
}

}  // namespace zcrelay
