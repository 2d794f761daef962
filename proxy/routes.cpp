#include "routes.hpp"

#include <algorithm>

namespace zcrelay {
namespace {

char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

bool equalNoCase(std::string_view lowercase, std::string_view any) {
    return lowercase.size() == any.size() &&
           std::equal(lowercase.begin(), lowercase.end(), any.begin(),
                      [](char a, char b) { return a == lower(b); });
}

bool offersAny(const std::vector<std::string>& wanted, std::string_view alpn) {
    bool found = false;
    tls_hello::forEachProtocol(alpn, [&](std::string_view offered) {
        found = std::find(wanted.begin(), wanted.end(), offered) != wanted.end();
        return !found;
    });
    return found;
}

}  // namespace

bool serverNameMatches(std::string_view pattern, std::string_view name) {
    if (!name.empty() && name.back() == '.') name.remove_suffix(1);
    if (!pattern.starts_with("*.")) return equalNoCase(pattern, name);
    // "*.example.com": one non-empty label, then ".example.com". Not "example.com" itself and
    // not "a.b.example.com", as HAProxy's and nginx's wildcard certificates see it (RFC 6125
    // 6.4.3: the wildcard stands for one label).
    std::string_view suffix = pattern.substr(1);  // ".example.com"
    if (name.size() <= suffix.size()) return false;
    std::string_view label = name.substr(0, name.size() - suffix.size());
    return label.find('.') == std::string_view::npos &&
           equalNoCase(suffix, name.substr(label.size()));
}

RouteChoice chooseRoute(const ListenerRt& l, const tls_hello::ClientHello* hello,
                        InspectFailure why) {
    RouteChoice choice{l.default_route, true, why};
    if (hello == nullptr) return choice;
    for (uint32_t r = 0; r < l.routes.size(); ++r) {
        const RouteConfig& rc = l.routes[r].config;
        if (!rc.conditional()) break;  // the default: nothing after it (checked at load)
        bool sni = rc.sni.empty() ||
                   std::any_of(rc.sni.begin(), rc.sni.end(), [&](const std::string& p) {
                       return !hello->sni.empty() && serverNameMatches(p, hello->sni);
                   });
        if (sni && (rc.alpn.empty() || offersAny(rc.alpn, hello->alpn))) return {r, false, why};
    }
    choice.why = hello->sni.empty() ? InspectFailure::NoSni : InspectFailure::NoRoute;
    return choice;
}

}  // namespace zcrelay
