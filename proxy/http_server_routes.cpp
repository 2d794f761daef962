// Routing and answering: the route tables built at start, a request's headers judged against
// its route (405, 411, 413, or its body reserved), the handler run once the request is in, and
// the response queued.
#include <algorithm>
#include <charconv>
#include <cstring>
#include <utility>

#include "http_server_internal.hpp"

namespace zcrelay {

namespace {

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

}  // namespace

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

// Called once when the request line and headers are in (`*request` still null), then once
// per piece of the body libmicrohttpd has read (`*upload_size` > 0), then once more when the
// whole request is in (`*upload_size` 0). libmicrohttpd 0.9.75 takes a response only on the
// first call or the last (MHD_queue_response refuses one while a body is being read), and
// closes the connection after a response queued on the first ("early": it will not read
// what follows). So every refusal is decided on the first call, from the headers alone, and
// answers wait for the last call, keeping keep-alive.
MHD_Result HttpServer::Callbacks::onRequest(void* cls, MHD_Connection* conn, const char* url,
                                            const char* method, const char* version,
                                            const char* upload_data, size_t* upload_size,
                                            void** request) {
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
MHD_Result HttpServer::Callbacks::onHeaders(HttpServer& s, Client* c, MHD_Connection* conn,
                                            const char* url, const char* method,
                                            const char* version) {
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
        if (hasBody(conn)) return refuse(HttpReject::Body, 413, "no request body is accepted\n");
        return MHD_YES;
    }
    const size_t at = static_cast<size_t>(route - s.routes_.data());
    if (std::find(route->methods.begin(), route->methods.end(), method) == route->methods.end())
        return refuse(HttpReject::Method, 405, s.not_allowed_[at], s.allow_[at].c_str());
    if (route->max_body == 0) {
        // Refused before the body: whatever Content-Length promised is never read.
        if (hasBody(conn)) return refuse(HttpReject::Body, 413, "no request body is accepted\n");
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

}  // namespace zcrelay
