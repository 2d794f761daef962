// The config as YAML: the effective one (renderConfig, which loads back to an equal Config:
// --dump-config and the reload's child rely on it), and the example config with every key's
// help and range (defaultConfigYaml, --print-default-config), both from the key tables.
#include <cstdio>

#include "config_yaml.hpp"

namespace zcrelay {
namespace config_detail {
namespace {

// A YAML double-quoted scalar that reads back as exactly `text`, whatever bytes it holds.
std::string yamlQuoted(std::string_view text) {
    std::string out = "\"";
    for (unsigned char c : text) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += static_cast<char>(c);
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\r') {
            out += "\\r";
        } else if (c == '\t') {
            out += "\\t";
        } else if (c < 0x20 || c == 0x7f) {
            // Not for bytes >= 0x80: YAML's \xNN is the code point U+00NN, which reads back as
            // two UTF-8 bytes. They came out of a YAML document as they are; written back as
            // they are, they read back the same (found by tests/fuzz/config_fuzz.cpp).
            char hex[5];
            std::snprintf(hex, sizeof hex, "\\x%02x", c);
            out += hex;
        } else {
            out += static_cast<char>(c);
        }
    }
    return out + "\"";
}

template <class T>
std::string renderValue(const T& target, const Key<T>& key) {
    const auto show = [&](const auto& value) -> std::string {
        using V = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<V, unsigned>)
            return value == 0 && key.zero_is_unset ? "" : std::to_string(value);
        if constexpr (std::is_same_v<V, uint64_t>)
            return key.kind == Kind::Size ? formatSize(value) : std::to_string(value);
        if constexpr (std::is_same_v<V, Duration>) return formatDuration(value);
        // IPv6 must be quoted: a plain "[" would open a YAML sequence.
        if constexpr (std::is_same_v<V, SocketAddress>)
            return value.family() == AF_INET ? value.toString() : yamlQuoted(value.toString());
        if constexpr (std::is_enum_v<V>) return std::string(Choices<V>::name(value));
        if constexpr (std::is_same_v<V, std::string>) {
            if (key.kind == Kind::Text) return yamlQuoted(value);
            // Quoted so names such as "null" or "-" read back as the same string.
            return value.empty() ? "" : yamlQuoted(value);
        }
        if constexpr (std::is_same_v<V, bool>) return value ? "true" : "false";
    };
    return std::visit([&](auto member) { return show(target.*member); }, key.member);
}

// `first_indent` replaces `indent` on the first line (the "- " of a sequence item).
template <class T>
void renderKeys(std::string& out, const T& target, std::span<const Key<T>> keys, bool with_help,
                std::string_view indent, std::string_view first_indent, std::string_view skip = {},
                std::string_view skip_too = {}) {
    for (size_t i = 0; i < keys.size(); ++i) {
        const Key<T>& key = keys[i];
        if (key.name == skip || key.name == skip_too) continue;
        const std::string_view line_indent = i == 0 ? first_indent : indent;
        const std::string value = renderValue(target, key);
        if (with_help) {
            const std::string range = rangeText(key);
            // Above a sequence item ("  - name:"), the comment lines up with the dash.
            out += std::string(line_indent.substr(0, line_indent.find('-'))) + "# " +
                   std::string(key.help) + (range.empty() ? "" : " (" + range + ")") + "\n";
        }
        // Unset (workers resolved at load): shown commented out so the example still names it.
        if (value.empty() && !with_help) continue;
        out += std::string(line_indent) + (value.empty() ? "# " : "") + std::string(key.name) +
               ":" + (value.empty() ? "" : " " + value) + "\n";
    }
}

void renderCluster(std::string& out, const ClusterConfig& c, bool with_help) {
    renderKeys<ClusterConfig>(out, c, kClusterKeys, with_help, "    ", "  - ");
    out += "    tcp_keepalive:\n";
    renderKeys<KeepaliveConfig>(out, c.tcp_keepalive, kKeepaliveKeys, with_help, "      ",
                                "      ");
    if (c.health_check.enabled) {
        out += "    health_check:\n";
        renderKeys<HealthCheckConfig>(out, c.health_check, kHealthCheckKeys, with_help, "      ",
                                      "      ");
        if (c.health_check.http.enabled) {
            out += "      http:\n";
            renderKeys<HttpCheckConfig>(out, c.health_check.http, kHttpCheckKeys, with_help,
                                        "        ", "        ");
        } else if (with_help) {
            out +=
                "      # http:                 # an HTTP check instead of send/expect\n"
                "      #   method: OPTIONS\n"
                "      #   path: /primary\n"
                "      #   expect_status: \"200\"\n";
        }
    }
    if (c.discovery.enabled()) {
        out += "    discovery:\n";
        renderKeys<DiscoveryConfig>(out, c.discovery, kDiscoveryKeys, with_help, "      ", "      ",
                                    c.discovery.dns.empty() ? "dns" : "srv",
                                    c.discovery.dns.empty() ? "weight" : "");
        return;
    }
    out += "    backends:\n";
    for (const BackendConfig& b : c.backends)
        renderKeys<BackendConfig>(out, b, kBackendKeys, with_help, "        ", "      - ");
}

void renderNames(std::string& out, const char* key, const std::vector<std::string>& names) {
    if (names.empty()) return;
    out += std::string("        ") + key + ": [";
    for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + yamlQuoted(names[i]);
    out += "]\n";
}

void renderRoute(std::string& out, const RouteConfig& r) {
    out += "      - name: " + yamlQuoted(r.name) + "\n";
    renderNames(out, "sni", r.sni);
    renderNames(out, "alpn", r.alpn);
    out += "        cluster: " + yamlQuoted(r.cluster) + "\n";
}

std::string render(const Config& config, bool with_help) {
    std::string out;
    renderKeys<Config>(out, config, kTopKeys, with_help, "", "");
    out += "metrics:\n";
    renderKeys<MetricsConfig>(out, config.metrics, kMetricsKeys, with_help, "  ", "  ");
    out += "access_log:\n";
    renderKeys<AccessLogConfig>(out, config.access_log, kAccessLogKeys, with_help, "  ", "  ");
    out += "resolvers:\n";
    if (with_help) out += "  # nameservers: [\"127.0.0.1:53\"]   # up to 3; unset: resolv_conf's\n";
    if (!config.resolvers.nameservers.empty()) {
        out += "  nameservers: [";
        for (size_t i = 0; i < config.resolvers.nameservers.size(); ++i)
            out += (i ? ", " : "") + yamlQuoted(config.resolvers.nameservers[i].toString());
        out += "]\n";
    }
    renderKeys<ResolversConfig>(out, config.resolvers, kResolversKeys, with_help, "  ", "  ");
    out += "admin:\n";
    renderKeys<AdminConfig>(out, config.admin, kAdminKeys, with_help, "  ", "  ");
    if (!config.clusters.empty()) {
        out += "clusters:\n";
        for (const ClusterConfig& c : config.clusters) renderCluster(out, c, with_help);
    } else if (with_help) {
        // The default has no cluster; the example still documents every cluster key, commented
        // out so it stays loadable.
        ClusterConfig sample;
        sample.name = "app";
        sample.health_check.enabled = true;
        for (const auto& [address, weight] :
             {std::pair{"127.0.0.1:9001", 2u}, {"127.0.0.1:9002", 1u}}) {
            BackendConfig b;
            b.address = parseAddress(address).value();
            b.weight = weight;
            sample.backends.push_back(b);
        }
        std::string block = "clusters:\n";
        renderCluster(block, sample, true);
        ClusterConfig discovered;
        discovered.name = "web";
        discovered.balance = Balance::LeastConn;
        discovered.discovery.dns = "web.default.svc.cluster.local";
        discovered.discovery.port = 8080;
        block += "  # Or the backends are a DNS name's addresses (A/AAAA), or its SRV records':\n";
        renderCluster(block, discovered, true);
        out += "# A listener names a cluster of backends instead of one `upstream`:\n";
        for (size_t at = 0; at < block.size();) {
            const size_t end = block.find('\n', at);
            const std::string_view line(block.data() + at, end - at);
            out += "# " + std::string(line) + "\n";
            at = end + 1;
        }
    }
    out += "listeners:\n";
    for (const ListenerConfig& listener : config.listeners) {
        // A listener routes by `cluster` or by `upstream` (or by `routes` alone): the other key
        // is left out.
        const bool no_default = listener.cluster.empty() && listener.upstream.length == 0;
        renderKeys<ListenerConfig>(out, listener, kListenerKeys, with_help, "    ", "  - ",
                                   listener.cluster.empty() ? "cluster" : "upstream",
                                   no_default ? "upstream" : "");
        out += "    tcp_keepalive:\n";
        renderKeys<KeepaliveConfig>(out, listener.tcp_keepalive, kKeepaliveKeys, with_help,
                                    "      ", "      ");
        if (!listener.routes.empty()) {
            out += "    routes:\n";
            for (const RouteConfig& r : listener.routes) renderRoute(out, r);
        } else if (with_help) {
            out +=
                "    # routes: route by the client's TLS ClientHello instead of one cluster; "
                "the first match wins\n"
                "    #   - {sni: [api.example.com], cluster: api}\n"
                "    #   - {name: apps, sni: [\"*.apps.example.com\"], alpn: [h2, "
                "http/1.1], cluster: apps}\n"
                "    #   - {cluster: fallback}   # no condition: the default route\n";
        }
    }
    return out;
}

}  // namespace
}  // namespace config_detail

std::string_view defaultConfigYaml() {
    static const std::string yaml = [] {
        constexpr std::string_view kHeader =
            "# zcrelay configuration, printed by `zcrelay --print-default-config`.\n"
            "# Every key shows its default. Required: listeners[].listen, and .upstream or "
            ".cluster.\n"
            "# Durations: 100us (rounded up to 1ms), 250ms, 5s, 2m, 1h; \"0\" alone means zero.\n"
            "# Sizes: bytes, or B, KiB, MiB, GiB (K, M, G mean the same powers of 1024).\n"
            "# Addresses are numeric, never resolved: 127.0.0.1:10000, or quoted \"[::1]:10000\".\n"
            "\n";
        constexpr std::string_view kDefaultListener =
            "listeners: [{name: default, listen: 127.0.0.1:10000, upstream: 127.0.0.1:9999}]";
        const Config example = config_detail::parseConfig(kDefaultListener, "<default>");
        return std::string(kHeader) + config_detail::render(example, true);
    }();
    return yaml;
}

std::string renderConfig(const Config& config) { return config_detail::render(config, false); }

}  // namespace zcrelay
