#include "admin_api.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "clock.hpp"
#include "flat_json.hpp"
#include "log.hpp"
#include "unique_fd.hpp"

namespace zcrelay {
namespace {

constexpr std::string_view kClusters = "/api/v1/clusters";
constexpr uint64_t kMaxBody = 4096;

// %XX escapes decoded (an IPv6 backend is "[::1]:80", which clients escape); anything
// malformed stays as written and simply names nothing.
std::string decode(std::string_view s) {
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '%' && i + 2 < s.size()) {
            const auto hex = [](char c) -> int {
                if (c >= '0' && c <= '9') return c - '0';
                if (c >= 'a' && c <= 'f') return c - 'a' + 10;
                if (c >= 'A' && c <= 'F') return c - 'A' + 10;
                return -1;
            };
            const int hi = hex(s[i + 1]), lo = hex(s[i + 2]);
            if (hi >= 0 && lo >= 0) {
                out += static_cast<char>(hi * 16 + lo);
                i += 2;
                continue;
            }
        }
        out += s[i];
    }
    return out;
}

// Comparing a secret: the time taken does not depend on where the first difference is.
bool sameSecret(std::string_view a, std::string_view b) {
    unsigned char diff = a.size() == b.size() ? 0 : 1;
    for (size_t i = 0; i < a.size(); ++i)
        diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
    return diff == 0;
}

tl::expected<std::string, std::string> readToken(const std::string& path) {
    UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
    if (!fd) return tl::unexpected("admin.token_file " + path + ": " + std::strerror(errno));
    struct stat st {};
    if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > 4096)
        return tl::unexpected("admin.token_file " + path + ": not a regular file of at most 4 KiB");
    char buf[4097];
    const ssize_t n = read(fd.get(), buf, sizeof buf - 1);
    if (n < 0) return tl::unexpected("admin.token_file " + path + ": " + std::strerror(errno));
    // The first line, without the spaces and tabs around it (an editor's trailing blank, an
    // indent): the Authorization header's value loses them too (RFC 9110 §5.5), so a token
    // that kept them could never match. Nothing left is refused here, not taken as a token
    // that `Bearer ` and those blanks would match.
    std::string_view line(buf, static_cast<size_t>(n));
    line = line.substr(0, line.find_first_of("\r\n"));
    const size_t first = line.find_first_not_of(" \t");
    if (first == std::string_view::npos)
        return tl::unexpected("admin.token_file " + path + ": the first line is empty");
    line = line.substr(first, line.find_last_not_of(" \t") - first + 1);
    // A control byte inside is a broken file: a client cannot send one in a header value (the
    // HTTP server refuses it, RFC 9110 §5.5), and a tab, which it could, is no character of a
    // bearer token (RFC 6750's b64token).
    for (const char ch : line)
        if (const auto byte = static_cast<unsigned char>(ch); byte < 0x20 || byte == 0x7f) {
            char hex[8];
            std::snprintf(hex, sizeof hex, "0x%02x", byte);
            return tl::unexpected("admin.token_file " + path +
                                  ": the token holds a control byte (" + hex + ")");
        }
    return std::string(line);
}

// `b` is one of `c`'s backends.
std::string backendJson(const ClusterRt& c, const BackendRt& b) {
    const BackendState& st = *b.state;
    const int32_t set = st.weight_override.load();
    std::string out = "{\"address\":" + jsonString(b.key);
    out += ",\"state\":" + jsonString(adminStateName(st.admin.load()));
    out += ",\"health\":" + std::string(st.up.load() ? "\"up\"" : "\"down\"");
    out += ",\"weight\":" + std::to_string(set >= 0 ? set : static_cast<int32_t>(b.spec_weight));
    out += ",\"config_weight\":" + std::to_string(b.spec_weight);
    out += ",\"active\":" + std::to_string(std::max(0, st.active.load()));
    out += ",\"takes_new_connections\":" + std::string(st.takesNew() ? "true" : "false");
    out += ",\"backup\":" + std::string(b.config.backup ? "true" : "false");
    out += ",\"tier\":" + std::to_string(b.config.tier);
    // Takes new connections and is in the tier that serves: a backup while every primary is
    // down, a primary otherwise.
    const bool serving =
        c.serving().admits(c.backends, static_cast<size_t>(&b - c.backends.data()));
    out += ",\"serving\":" + std::string(serving ? "true" : "false");
    // slow_start: the share of its weight it has now, in thousandths (1000 = all of it).
    out +=
        ",\"slow_start_permille\":" + std::to_string(st.ramp(c.config.slow_start, monotonicMs()));
    return out + "}";
}

}  // namespace

tl::expected<std::unique_ptr<AdminApi>, std::string> AdminApi::start(const AdminConfig& config,
                                                                     Hooks hooks, AdminStats& stats,
                                                                     UniqueFd adopted) {
    std::string token;
    if (!config.token_file.empty()) {
        auto read = readToken(config.token_file);
        if (!read) return tl::unexpected(read.error());
        token = std::move(*read);
    }
    std::unique_ptr<AdminApi> api(new AdminApi(std::move(hooks), std::move(token), stats));
    AdminApi* self = api.get();
    HttpLimits limits;
    limits.request_timeout = config.request_timeout;
    limits.max_connections = config.max_connections;
    std::vector<HttpRoute> routes;
    routes.push_back({.path = std::string(kClusters),
                      .handler = [self](const HttpRequest& r) { return self->handle(r); }});
    routes.push_back({.path = std::string(kClusters) + "/",
                      .handler = [self](const HttpRequest& r) { return self->handle(r); },
                      .prefix = true,
                      .methods = {"GET", "HEAD", "POST", "PUT"},
                      .max_body = kMaxBody});
    auto server = HttpServer::start("admin API", config.listen, limits, std::move(routes),
                                    stats.http, std::move(adopted));
    if (!server) return tl::unexpected("admin.listen: " + server.error());
    api->server_ = std::move(*server);
    LOG_INFO("admin API on %s%s", api->server_->address().toString().c_str(),
             api->token_.empty() ? "" : " (bearer token required)");
    return api;
}

HttpReply AdminApi::fail(AdminResult result, int status, const std::string& why) {
    stats_.results[idx(result)].fetch_add(1, std::memory_order_relaxed);
    HttpReply r;
    r.status = status;
    r.content_type = "application/json";
    r.body = "{\"error\":" + jsonString(why) + "}\n";
    return r;
}

HttpReply AdminApi::handle(const HttpRequest& request) {
    if (!token_.empty()) {
        constexpr std::string_view kBearer = "Bearer ";
        const std::string_view auth = request.authorization;
        if (auth.substr(0, kBearer.size()) != kBearer ||
            !sameSecret(auth.substr(kBearer.size()), token_))
            return fail(AdminResult::Unauthorized, 401,
                        "missing or wrong bearer token (Authorization: Bearer <token>)");
    }
    // The server's thread runs this: nothing may escape it (memory running out while a reply
    // is built is a 500, not a dead API).
    try {
        HttpReply reply = answer(request);
        if (reply.status < 400) stats_.results[idx(AdminResult::Ok)].fetch_add(1);
        return reply;
    } catch (const std::exception& e) {
        return fail(AdminResult::BadRequest, 500, std::string("internal error: ") + e.what());
    }
}

std::string AdminApi::clusterJson(const ClusterRt& cluster,
                                  const std::map<std::string, DiscoveryView>& views) const {
    const ClusterConfig& c = cluster.config;
    std::string out = "{\"name\":" + jsonString(c.name);
    out += ",\"balance\":" + jsonString(balanceName(c.balance));
    out += ",\"health_checks\":" + std::string(c.health_check.enabled ? "true" : "false");
    if (c.discovery.enabled()) {
        const auto v = views.find(c.name);
        out += ",\"discovery\":{\"name\":" + jsonString(c.discovery.name());
        out += ",\"type\":" + std::string(c.discovery.dns.empty() ? "\"srv\"" : "\"dns\"");
        if (v != views.end()) {
            out += ",\"state\":" + jsonString(v->second.state);
            out += ",\"last_result\":" + jsonString(label(v->second.last));
            out +=
                ",\"last_success_unix\":" + std::to_string(v->second.last_success_unix_ms / 1000);
            out += ",\"changes\":" + std::to_string(v->second.changes);
        }
        out += "}";
    }
    out += ",\"backends\":[";
    for (size_t i = 0; i < cluster.backends.size(); ++i)
        out += (i ? "," : "") + backendJson(cluster, cluster.backends[i]);
    return out + "]}";
}

HttpReply AdminApi::answer(const HttpRequest& request) {
    const std::shared_ptr<const Runtime> rt = hooks_.current();
    const auto views =
        hooks_.discovery ? hooks_.discovery() : std::map<std::string, DiscoveryView>{};
    HttpReply ok;
    ok.content_type = "application/json";

    std::string_view path = request.path;
    if (path == kClusters || path == std::string(kClusters) + "/") {
        ok.body = "{\"generation\":" + std::to_string(rt->generation) + ",\"clusters\":[";
        for (size_t i = 0; i < rt->clusters.size(); ++i)
            ok.body += (i ? "," : "") + clusterJson(rt->clusters[i], views);
        ok.body += "]}\n";
        return ok;
    }
    path.remove_prefix(kClusters.size() + 1);
    const size_t slash = path.find('/');
    const std::string name = decode(path.substr(0, slash));
    const auto cluster = std::find_if(rt->clusters.begin(), rt->clusters.end(),
                                      [&](const ClusterRt& c) { return c.config.name == name; });
    if (cluster == rt->clusters.end())
        return fail(AdminResult::NotFound, 404, "no cluster " + jsonString(name));
    const bool write = request.method == "POST" || request.method == "PUT";
    if (slash == std::string_view::npos) {
        if (write)
            return fail(AdminResult::BadRequest, 405,
                        "a cluster is read-only; POST to "
                        "/api/v1/clusters/<cluster>/backends/<address>");
        ok.body = clusterJson(*cluster, views) + "\n";
        return ok;
    }
    std::string_view rest = path.substr(slash + 1);
    constexpr std::string_view kBackends = "backends/";
    if (rest.substr(0, kBackends.size()) != kBackends || rest.size() == kBackends.size())
        return fail(AdminResult::NotFound, 404,
                    "expected /api/v1/clusters/<cluster>/backends/<address>");
    const std::string address = decode(rest.substr(kBackends.size()));
    const auto backend = std::find_if(cluster->backends.begin(), cluster->backends.end(),
                                      [&](const BackendRt& b) { return b.key == address; });
    if (backend == cluster->backends.end())
        return fail(AdminResult::NotFound, 404,
                    "cluster " + name + " has no backend " + jsonString(address));
    if (write) return change(*cluster, *backend, request.body);
    ok.body = backendJson(*cluster, *backend) + "\n";
    return ok;
}

HttpReply AdminApi::change(const ClusterRt& cluster, const BackendRt& backend,
                           std::string_view body) {
    auto parsed = parseFlatObject(body);
    if (!parsed) return fail(AdminResult::BadRequest, 400, "body: " + parsed.error());
    std::optional<AdminState> state;
    std::optional<int32_t> weight;
    bool shutdown = false;
    for (const auto& [key, value] : *parsed) {
        if (key == "state") {
            if (value.type == FlatValue::Type::String) state = parseAdminState(value.string);
            if (!state)
                return fail(AdminResult::BadRequest, 400,
                            "state must be one of \"ready\", \"drain\", \"maint\"");
        } else if (key == "weight") {
            if (value.type != FlatValue::Type::Integer || value.integer < 0 ||
                value.integer > kMaxWeight)
                return fail(
                    AdminResult::BadRequest, 400,
                    "weight must be a whole number from 0 to " + std::to_string(kMaxWeight));
            weight = static_cast<int32_t>(value.integer);
        } else if (key == "shutdown") {
            if (value.type != FlatValue::Type::Bool)
                return fail(AdminResult::BadRequest, 400, "shutdown must be true or false");
            shutdown = value.boolean;
        } else {
            return fail(
                AdminResult::BadRequest, 400,
                "unknown member " + jsonString(key) + "; expected state, weight or shutdown");
        }
    }
    if (!state && !weight && !shutdown)
        return fail(AdminResult::BadRequest, 400,
                    "nothing to change: give state, weight or \"shutdown\": true");

    BackendState& st = *backend.state;
    const std::string who = "cluster " + cluster.config.name + " backend " + backend.key;
    if (state) {
        const AdminState was = st.admin.exchange(*state);
        // Back to ready from drain or maint: slow_start ramps it like a backend that came up.
        if (*state == AdminState::Ready && was != AdminState::Ready) st.cameUp();
        stats_
            .changes[idx(*state == AdminState::Ready   ? AdminChange::StateReady
                         : *state == AdminState::Drain ? AdminChange::StateDrain
                                                       : AdminChange::StateMaint)]
            .fetch_add(1);
        LOG_INFO("admin: %s: state %s -> %s", who.c_str(), std::string(adminStateName(was)).c_str(),
                 std::string(adminStateName(*state)).c_str());
    }
    if (weight) {
        const int32_t was = st.weight_override.exchange(*weight);
        stats_.changes[idx(AdminChange::Weight)].fetch_add(1);
        LOG_INFO("admin: %s: weight %d -> %d", who.c_str(),
                 was >= 0 ? was : static_cast<int32_t>(backend.spec_weight), *weight);
        // 0 is read per pick (takesNew); any other weight is weighed by the next balancers.
        if (*weight > 0 && *weight != (was >= 0 ? was : static_cast<int32_t>(backend.spec_weight)))
            hooks_.rebuild();
    }
    if (shutdown) {
        stats_.changes[idx(AdminChange::Shutdown)].fetch_add(1);
        LOG_INFO("admin: %s: ending its %d live connections", who.c_str(),
                 std::max(0, st.active.load()));
        hooks_.end_connections(backend.state, who);
    }
    // Read back from the generation the change built, if it built one.
    const std::shared_ptr<const Runtime> rt = hooks_.current();
    const ClusterRt* in = &cluster;
    const BackendRt* now = &backend;
    for (const ClusterRt& c : rt->clusters) {
        if (c.config.name != cluster.config.name) continue;
        for (const BackendRt& b : c.backends)
            if (b.key == backend.key) in = &c, now = &b;
    }
    HttpReply ok;
    ok.content_type = "application/json";
    ok.body = backendJson(*in, *now) + "\n";
    return ok;
}

}  // namespace zcrelay
