// Request framing: what RFC 9112 has a server refuse and libmicrohttpd lets through (a NUL a C
// string hides, a control byte, two lengths), found by walking the header block against the
// pieces libmicrohttpd handed over; and the request target as sent, caught before
// libmicrohttpd cuts it at '?'.
#include <strings.h>

#include <algorithm>
#include <cstring>

#include "http_server_internal.hpp"

namespace zcrelay {

namespace {

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

}  // namespace

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

// Called with the target before libmicrohttpd cuts the query off at '?' and parses it in
// place (a "%01" there becomes a byte 1): the one moment the target is as sent, up to the
// first NUL.
void* HttpServer::Callbacks::onRequestLine(void* cls, const char* uri, MHD_Connection* conn) {
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

}  // namespace zcrelay
