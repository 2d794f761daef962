#include "config.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <type_traits>
#include <variant>

#include "accounts.hpp"
#include "file_kind.hpp"
#include "unique_fd.hpp"

namespace zcrelay {
namespace {

using namespace std::chrono_literals;

// Where a value came from, for the one-line error "source:line:column: key path: what".
struct Where {
    std::string_view source;
    int line = 0;  // 1-based; 0 when the text has no position (a command-line flag)
    int column = 0;
    std::string path;
};

[[noreturn]] void fail(const Where& at, std::string_view what) {
    std::string message(at.source);
    if (at.line > 0) message += ":" + std::to_string(at.line) + ":" + std::to_string(at.column);
    message += ": " + at.path + ": ";
    message += what;
    throw ConfigError(message);
}

Where whereAt(std::string_view source, const YAML::Mark& mark, std::string path) {
    // yaml-cpp leaves some nodes without a mark (an empty document, a node built in code).
    if (mark.is_null()) return {source, 1, 1, std::move(path)};
    return {source, mark.line + 1, mark.column + 1, std::move(path)};
}

Where whereOf(std::string_view source, const YAML::Node& node, std::string path) {
    return whereAt(source, node.Mark(), std::move(path));
}

std::string typeName(const YAML::Node& node) {
    if (node.IsMap()) return "a map";
    if (node.IsSequence()) return "a sequence";
    if (node.IsScalar()) return "a scalar";
    return "nothing";
}

// The named values of each enum a key can take, in the order help texts list them.
template <class E>
struct Choices;
template <>
struct Choices<Mode> {
    static constexpr std::string_view noun = "mode";
#define ZCRELAY_MODE_VALUE(name, label) Mode::name,
    static constexpr std::array values = {ZCRELAY_DATA_PATHS(ZCRELAY_MODE_VALUE)};
#undef ZCRELAY_MODE_VALUE
    static std::string_view name(Mode m) { return modeName(m); }
};
template <>
struct Choices<ProxyVersion> {
    static constexpr std::string_view noun = "PROXY protocol version";
    static constexpr std::array values = {ProxyVersion::Off, ProxyVersion::V1, ProxyVersion::V2};
    static std::string_view name(ProxyVersion v) { return proxyVersionName(v); }
};
template <>
struct Choices<Balance> {
    static constexpr std::string_view noun = "balance algorithm";
    static constexpr std::array values = {Balance::RoundRobin, Balance::LeastConn, Balance::Random,
                                          Balance::SourceHash};
    static std::string_view name(Balance b) { return balanceName(b); }
};
template <>
struct Choices<AccessLogFormat> {
    static constexpr std::string_view noun = "log format";
    static constexpr std::array values = {AccessLogFormat::Json, AccessLogFormat::Text};
    static std::string_view name(AccessLogFormat f) { return logFormatName(f); }
};

template <>
struct Choices<AddressFamilies> {
    static constexpr std::string_view noun = "family";
    static constexpr std::array values = {AddressFamilies::Any, AddressFamilies::Ipv4,
                                          AddressFamilies::Ipv6};
    static std::string_view name(AddressFamilies f) { return familiesName(f); }
};
template <>
struct Choices<AfterHold> {
    static constexpr std::string_view noun = "choice of after_hold";
    static constexpr std::array values = {AfterHold::Empty, AfterHold::Keep};
    static std::string_view name(AfterHold a) { return a == AfterHold::Empty ? "empty" : "keep"; }
};
template <>
struct Choices<StartupPolicy> {
    static constexpr std::string_view noun = "choice of startup";
    static constexpr std::array values = {StartupPolicy::Fail, StartupPolicy::Empty};
    static std::string_view name(StartupPolicy p) {
        return p == StartupPolicy::Fail ? "fail" : "empty";
    }
};

template <class E>
std::string choiceList() {
    std::string names;
    for (E v : Choices<E>::values)
        names += (names.empty() ? "" : ", ") + std::string(Choices<E>::name(v));
    return names;
}

// How a key's text parses, renders and states its range.
//   Text: any string (health check bytes, a file path); Name: an identifier.
enum class Kind { Count, Duration, Size, Address, OptionalAddress, Choice, Name, Text, Bool };

template <class T>
using Member = std::variant<unsigned T::*, uint64_t T::*, Duration T::*, SocketAddress T::*,
                            Mode T::*, ProxyVersion T::*, Balance T::*, AccessLogFormat T::*,
                            AddressFamilies T::*, AfterHold T::*, StartupPolicy T::*,
                            std::string T::*, bool T::*>;

// One config key. The parser, renderConfig() and defaultConfigYaml() (the example config) all
// read these tables, so defaults, ranges and help cannot drift apart.
template <class T>
struct Key {
    std::string_view name;
    Kind kind;
    Member<T> member;
    // The default as YAML text; "" = none (the key is required, or filled in after parsing).
    std::string_view fallback = {};
    bool required = false;
    uint64_t min = 0;  // inclusive range: counts, bytes for sizes, milliseconds for durations
    uint64_t max = 0;
    std::string_view help;       // one line, for the example config
    bool zero_is_unset = false;  // 0 means "not set" (resolved later) and renders as absent
};

constexpr uint64_t ms(Duration d) { return static_cast<uint64_t>(d.count()); }

const Key<Config> kTopKeys[] = {
    {.name = "workers",
     .kind = Kind::Count,
     .member = &Config::workers,
     .min = 1,
     .max = 256,
     .help = "worker threads, one io_uring each; unset: one per online CPU",
     .zero_is_unset = true},
    {.name = "drain_timeout",
     .kind = Kind::Duration,
     .member = &Config::drain_timeout,
     .fallback = "30s",
     .max = ms(1h),
     .help = "on SIGTERM, how long live connections may finish before they are closed"},
    {.name = "max_pipes",
     .kind = Kind::Count,
     .member = &Config::max_pipes,
     .fallback = "4096",
     .max = 100000,
     .help = "pipes (2 fds each) the whole process may hold; 0 = never splice, always copy"},
    {.name = "max_connections",
     .kind = Kind::Count,
     .member = &Config::max_connections,
     .fallback = "0",
     .max = 10000000,
     .help = "live connections over all listeners; at the limit accepting stops; 0 = no limit"},
    {.name = "user",
     .kind = Kind::Name,
     .member = &Config::user,
     .help = "started as root: once listening, run as this user (name or uid), keeping only "
             "CAP_NET_BIND_SERVICE; unset: stay as started"},
    {.name = "group",
     .kind = Kind::Name,
     .member = &Config::group,
     .help = "with user: the group (name or gid), the only supplementary one too; unset: the "
             "user's primary group"},
};

const Key<AccessLogConfig> kAccessLogKeys[] = {
    {.name = "path",
     .kind = Kind::Text,
     .member = &AccessLogConfig::path,
     .help = "one line per finished connection to this file; \"-\" = stdout; \"\" = off"},
    {.name = "format",
     .kind = Kind::Choice,
     .member = &AccessLogConfig::format,
     .fallback = "json",
     .help = "json: one JSON object per line; text: space-separated fields (docs/configuring.md)"},
};

const Key<KeepaliveConfig> kKeepaliveKeys[] = {
    {.name = "idle",
     .kind = Kind::Duration,
     .member = &KeepaliveConfig::idle,
     .fallback = "0",
     .max = ms(std::chrono::hours(24 * 7)),
     .help = "TCP keepalive: first probe after this long idle; 0 = keepalive off"},
    {.name = "interval",
     .kind = Kind::Duration,
     .member = &KeepaliveConfig::interval,
     .fallback = "10s",
     .min = ms(1s),
     .max = ms(std::chrono::hours(24)),
     .help = "between probes"},
    {.name = "count",
     .kind = Kind::Count,
     .member = &KeepaliveConfig::count,
     .fallback = "6",
     .min = 1,
     .max = 127,
     .help = "unanswered probes before the connection is reset"},
    {.name = "user_timeout",
     .kind = Kind::Duration,
     .member = &KeepaliveConfig::user_timeout,
     .fallback = "0",
     .max = ms(std::chrono::hours(24)),
     .help = "TCP_USER_TIMEOUT: bytes unacknowledged this long reset the connection; 0 = "
             "the kernel's (~15 min)"},
};

const Key<HealthCheckConfig> kHealthCheckKeys[] = {
    {.name = "interval",
     .kind = Kind::Duration,
     .member = &HealthCheckConfig::interval,
     .fallback = "2s",
     .min = ms(10ms),
     .max = ms(1h),
     .help = "time between two checks of a backend"},
    {.name = "timeout",
     .kind = Kind::Duration,
     .member = &HealthCheckConfig::timeout,
     .fallback = "1s",
     .min = ms(1ms),
     .max = ms(10min),
     .help = "a check that has not passed within this fails"},
    {.name = "rise",
     .kind = Kind::Count,
     .member = &HealthCheckConfig::rise,
     .fallback = "2",
     .min = 1,
     .max = 1000,
     .help = "passed checks in a row that bring a down backend up"},
    {.name = "fall",
     .kind = Kind::Count,
     .member = &HealthCheckConfig::fall,
     .fallback = "3",
     .min = 1,
     .max = 1000,
     .help = "failed checks in a row that take an up backend down"},
    {.name = "send",
     .kind = Kind::Text,
     .member = &HealthCheckConfig::send,
     .max = 4096,
     .help = "bytes to send once connected (YAML escapes such as \\r\\n work); \"\" = none"},
    {.name = "expect",
     .kind = Kind::Text,
     .member = &HealthCheckConfig::expect,
     .max = 4096,
     .help = "the reply must start with these bytes; \"\" = connecting is enough"},
};

const Key<BackendConfig> kBackendKeys[] = {
    {.name = "address",
     .kind = Kind::Address,
     .member = &BackendConfig::address,
     .required = true,
     .help = "required: 127.0.0.1:9001, \"[::1]:9001\" or unix:/path/to.sock"},
    {.name = "weight",
     .kind = Kind::Count,
     .member = &BackendConfig::weight,
     .fallback = "1",
     .min = 1,
     .max = 256,
     .help = "share of new connections relative to the other backends"},
    {.name = "send_proxy",
     .kind = Kind::Choice,
     .member = &BackendConfig::send_proxy,
     .help = "overrides the cluster's send_proxy for this backend"},
};

const Key<ClusterConfig> kClusterKeys[] = {
    {.name = "name",
     .kind = Kind::Name,
     .member = &ClusterConfig::name,
     .required = true,
     .help = "required, unique; listeners name it in `cluster`; the `cluster` metric label"},
    {.name = "balance",
     .kind = Kind::Choice,
     .member = &ClusterConfig::balance,
     .fallback = "round_robin",
     .help = "round_robin: smooth weighted; least_conn: fewest live connections per weight; "
             "random: the less loaded of two random picks; source_hash: by client address, "
             "consistent"},
    {.name = "send_proxy",
     .kind = Kind::Choice,
     .member = &ClusterConfig::send_proxy,
     .fallback = "off",
     .help = "send a PROXY protocol header (v1 text, v2 binary) before any relayed byte"},
    {.name = "retries",
     .kind = Kind::Count,
     .member = &ClusterConfig::retries,
     .fallback = "2",
     .max = 100,
     .help = "connect attempts after the first, each to another backend, within connect_timeout"},
    {.name = "max_fails",
     .kind = Kind::Count,
     .member = &ClusterConfig::max_fails,
     .fallback = "3",
     .max = 1000,
     .help = "connect failures in a row that take a backend down (passive ejection; never the "
             "only one); 0 = never"},
    {.name = "fail_timeout",
     .kind = Kind::Duration,
     .member = &ClusterConfig::fail_timeout,
     .fallback = "10s",
     .min = ms(1ms),
     .max = ms(1h),
     .help = "without health checks, how long an ejected backend stays down"},
    {.name = "source",
     .kind = Kind::OptionalAddress,
     .member = &ClusterConfig::source,
     .help = "local address of upstream sockets; port 0 = any port (IP_BIND_ADDRESS_NO_PORT)"},
};

const Key<DiscoveryConfig> kDiscoveryKeys[] = {
    {.name = "dns",
     .kind = Kind::Text,
     .member = &DiscoveryConfig::dns,
     .max = 254,
     .help = "a name whose A/AAAA addresses are the backends, at `port` (search domains and "
             "ndots apply; a trailing dot makes it absolute)"},
    {.name = "srv",
     .kind = Kind::Text,
     .member = &DiscoveryConfig::srv,
     .max = 254,
     .help = "or an SRV name (_http._tcp.web.default.svc.cluster.local): its targets at their "
             "ports and weights; only the lowest priority present is used"},
    {.name = "port",
     .kind = Kind::Count,
     .member = &DiscoveryConfig::port,
     .fallback = "0",
     .max = 65535,
     .help = "with dns: the backends' port (required); with srv: not set"},
    {.name = "family",
     .kind = Kind::Choice,
     .member = &DiscoveryConfig::family,
     .fallback = "any",
     .help = "any: A and AAAA; ipv4: A only; ipv6: AAAA only"},
    {.name = "weight",
     .kind = Kind::Count,
     .member = &DiscoveryConfig::weight,
     .fallback = "1",
     .min = 1,
     .max = 256,
     .help = "of each backend from dns (SRV weights are the records', clamped to 1..256)"},
    {.name = "refresh_min",
     .kind = Kind::Duration,
     .member = &DiscoveryConfig::refresh_min,
     .fallback = "1s",
     .min = ms(100ms),
     .max = ms(1h),
     .help = "the name is asked again when its TTL runs out, but never sooner than this (TTL 0 "
             "included), and this soon after a failure"},
    {.name = "refresh_max",
     .kind = Kind::Duration,
     .member = &DiscoveryConfig::refresh_max,
     .fallback = "30s",
     .min = ms(100ms),
     .max = ms(24h),
     .help = "and never later than this, whatever the TTL"},
    {.name = "hold",
     .kind = Kind::Duration,
     .member = &DiscoveryConfig::hold,
     .fallback = "30s",
     .max = ms(24h * 7),
     .help = "while the name fails (timeout, SERVFAIL, NXDOMAIN, no records), the last good set "
             "keeps serving this long"},
    {.name = "after_hold",
     .kind = Kind::Choice,
     .member = &DiscoveryConfig::after_hold,
     .fallback = "empty",
     .help = "then: empty = no backends (no new connections, /readyz 503); keep = the last good "
             "set, until the name resolves again"},
    {.name = "startup",
     .kind = Kind::Choice,
     .member = &DiscoveryConfig::startup,
     .fallback = "fail",
     .help = "a name that does not resolve at start: fail = the relay does not start; empty = it "
             "starts with no backends and keeps asking"},
    {.name = "max_backends",
     .kind = Kind::Count,
     .member = &DiscoveryConfig::max_backends,
     .fallback = "64",
     .min = 1,
     .max = 1024,
     .help = "at most this many backends from the answer (the lowest addresses); bounds the "
             "`backend` label's values too"},
};

const Key<ResolversConfig> kResolversKeys[] = {
    {.name = "resolv_conf",
     .kind = Kind::Text,
     .member = &ResolversConfig::resolv_conf,
     .fallback = "/etc/resolv.conf",
     .max = 4096,
     .help = "search domains, ndots, and the nameservers unless `nameservers` lists them"},
    {.name = "timeout",
     .kind = Kind::Duration,
     .member = &ResolversConfig::timeout,
     .fallback = "1s",
     .min = ms(10ms),
     .max = ms(60s),
     .help = "for an answer to one query from one nameserver"},
    {.name = "attempts",
     .kind = Kind::Count,
     .member = &ResolversConfig::attempts,
     .fallback = "3",
     .min = 1,
     .max = 10,
     .help = "tries of each nameserver before the query fails"},
};

const Key<AdminConfig> kAdminKeys[] = {
    {.name = "listen",
     .kind = Kind::OptionalAddress,
     .member = &AdminConfig::listen,
     .fallback = "",
     .help = "the runtime API (JSON over HTTP): 127.0.0.1:9101 or unix:/run/zcrelay/admin.sock; "
             "\"\" = off. Not loopback or unix: token_file is required"},
    {.name = "token_file",
     .kind = Kind::Text,
     .member = &AdminConfig::token_file,
     .max = 4096,
     .help = "a file whose first line is the bearer token every request must carry; \"\" = none"},
    {.name = "request_timeout",
     .kind = Kind::Duration,
     .member = &AdminConfig::request_timeout,
     .fallback = "5s",
     .min = ms(10ms),
     .max = ms(10min),
     .help = "a whole request, a response, or a keep-alive wait may take this long"},
    {.name = "max_connections",
     .kind = Kind::Count,
     .member = &AdminConfig::max_connections,
     .fallback = "16",
     .min = 1,
     .max = 1024,
     .help = "open at once; past it the oldest idle one is closed"},
};

const Key<MetricsConfig> kMetricsKeys[] = {
    {.name = "listen",
     .kind = Kind::OptionalAddress,
     .member = &MetricsConfig::listen,
     .fallback = "127.0.0.1:9100",
     .help = "Prometheus scrape address; \"\" disables metrics"},
    {.name = "enabled",
     .kind = Kind::Bool,
     .member = &MetricsConfig::enabled,
     .fallback = "true",
     .help = "false disables metrics"},
    {.name = "health_listen",
     .kind = Kind::OptionalAddress,
     .member = &MetricsConfig::health_listen,
     .help = "also serve /healthz and /readyz here, apart from scrapes; \"\" = only on listen"},
    {.name = "request_timeout",
     .kind = Kind::Duration,
     .member = &MetricsConfig::request_timeout,
     .fallback = "5s",
     .min = ms(10ms),
     .max = ms(10min),
     .help = "a whole request, a response, or a keep-alive wait may take this long"},
    {.name = "max_connections",
     .kind = Kind::Count,
     .member = &MetricsConfig::max_connections,
     .fallback = "64",
     .min = 1,
     .max = 1024,
     .help = "open at once, per address; past it the oldest idle one is closed"},
    {.name = "max_request_size",
     .kind = Kind::Size,
     .member = &MetricsConfig::max_request_size,
     .fallback = "8KiB",
     .min = 2 * kKiB,
     .max = 1 * kMiB,
     .help = "request line and headers, at most; larger ones are answered 431"},
};

const Key<ListenerConfig> kListenerKeys[] = {
    {.name = "name",
     .kind = Kind::Name,
     .member = &ListenerConfig::name,
     .help = "unique; the `listener` label of its metrics; unset: listener<index>"},
    {.name = "listen",
     .kind = Kind::Address,
     .member = &ListenerConfig::listen,
     .required = true,
     .help = "required: where clients connect (port 0: the kernel picks one)"},
    {.name = "cluster",
     .kind = Kind::Name,
     .member = &ListenerConfig::cluster,
     .help = "the cluster whose backends get this listener's clients (or `upstream`)"},
    {.name = "upstream",
     .kind = Kind::OptionalAddress,
     .member = &ListenerConfig::upstream,
     .help = "shorthand for a cluster of one backend: where each client's bytes go"},
    {.name = "inspect_timeout",
     .kind = Kind::Duration,
     .member = &ListenerConfig::inspect_timeout,
     .fallback = "5s",
     .min = ms(1ms),
     .max = ms(10min),
     .help = "with routes: how long a client's TLS ClientHello may take to arrive complete"},
    {.name = "inspect_max_size",
     .kind = Kind::Size,
     .member = &ListenerConfig::inspect_max_size,
     .fallback = "16KiB",
     .min = kKiB,
     .max = 64 * kKiB,
     .help = "with routes: the most bytes a ClientHello may take (its records included)"},
    {.name = "accept_proxy",
     .kind = Kind::Bool,
     .member = &ListenerConfig::accept_proxy,
     .fallback = "false",
     .help = "clients start with a PROXY v1/v2 header; its source is the client from then on"},
    {.name = "proxy_timeout",
     .kind = Kind::Duration,
     .member = &ListenerConfig::proxy_timeout,
     .fallback = "5s",
     .min = ms(1ms),
     .max = ms(10min),
     .help = "with accept_proxy: how long the header may take to arrive"},
    {.name = "proxy_max_size",
     .kind = Kind::Size,
     .member = &ListenerConfig::proxy_max_size,
     .fallback = "1KiB",
     .min = 232,
     .max = 64 * kKiB,
     .help = "with accept_proxy: the longest v2 header (with TLVs) taken"},
    {.name = "max_connections",
     .kind = Kind::Count,
     .member = &ListenerConfig::max_connections,
     .fallback = "0",
     .max = 10000000,
     .help = "live connections of this listener; at the limit accepting stops; 0 = no limit"},
    {.name = "max_connections_per_source",
     .kind = Kind::Count,
     .member = &ListenerConfig::max_connections_per_source,
     .fallback = "0",
     .max = 10000000,
     .help = "live connections one client address may hold; past it new ones are closed; 0 = "
             "no limit"},
    {.name = "mode",
     .kind = Kind::Choice,
     .member = &ListenerConfig::mode,
     .fallback = "splice",
     .help = "splice: socket -> pipe -> socket in the kernel; copy: io_uring recv/send through "
             "user memory; sockmap: eBPF redirect in softirq, lowest latency (splice if BPF "
             "cannot load)"},
    {.name = "pipe_size",
     .kind = Kind::Size,
     .member = &ListenerConfig::pipe_size,
     .fallback = "1MiB",
     .min = 4 * kKiB,
     .max = 16 * kMiB,
     .help = "pipe a busy direction grows to; > fs.pipe-max-size needs CAP_SYS_RESOURCE"},
    {.name = "connect_timeout",
     .kind = Kind::Duration,
     .member = &ListenerConfig::connect_timeout,
     .fallback = "5s",
     .min = ms(1ms),
     .max = ms(10min),
     .help = "how long connecting to the upstream may take before the client is closed"},
    {.name = "idle_timeout",
     .kind = Kind::Duration,
     .member = &ListenerConfig::idle_timeout,
     .fallback = "300s",
     .max = ms(720h),
     .help = "close a connection after this long without a byte either way; 0 = never"},
    {.name = "client_fin_timeout",
     .kind = Kind::Duration,
     .member = &ListenerConfig::client_fin_timeout,
     .fallback = "0",
     .max = ms(720h),
     .help = "once the backend's FIN was passed to the client: how long without a byte before "
             "closing; 0 = idle_timeout only"},
    {.name = "server_fin_timeout",
     .kind = Kind::Duration,
     .member = &ListenerConfig::server_fin_timeout,
     .fallback = "0",
     .max = ms(720h),
     .help = "once the client's FIN was passed to the backend: how long without a byte before "
             "closing; 0 = idle_timeout only"},
    {.name = "max_connection_duration",
     .kind = Kind::Duration,
     .member = &ListenerConfig::max_connection_duration,
     .fallback = "0",
     .max = ms(720h),
     .help = "end older connections gracefully (stop reading, deliver what was read, FIN "
             "both ways); 0 = no limit"},
    {.name = "max_connection_duration_jitter",
     .kind = Kind::Duration,
     .member = &ListenerConfig::max_connection_duration_jitter,
     .fallback = "0",
     .max = ms(720h),
     .help = "with max_connection_duration: up to this much more, fixed per connection, so "
             "clients do not all reconnect at once"},
    {.name = "tcp_nodelay",
     .kind = Kind::Bool,
     .member = &ListenerConfig::tcp_nodelay,
     .fallback = "true",
     .help =
         "TCP_NODELAY on both sockets: small writes go out at once (false: Nagle batches bulk)"},
    {.name = "notsent_lowat",
     .kind = Kind::Size,
     .member = &ListenerConfig::notsent_lowat,
     .fallback = "128KiB",
     .max = 64 * kMiB,
     .help = "TCP_NOTSENT_LOWAT on both sockets (splice, copy): unsent bytes a socket takes "
             "before it reports full, so the relay, not the peer's ACKs, sends the rest; "
             "0 = unset"},
    {.name = "send_zerocopy",
     .kind = Kind::Bool,
     .member = &ListenerConfig::send_zerocopy,
     .fallback = "false",
     .help = "bytes moved by copy go out with IORING_OP_SEND_ZC in sends of 16KiB or more: "
             "less CPU per byte, but each buffer is held until the peer acknowledged it"},
};

const Key<RouteConfig> kRouteKeys[] = {
    {.name = "name",
     .kind = Kind::Name,
     .member = &RouteConfig::name,
     .help = "unique in the listener; the `route` label of its metrics; unset: the cluster's "
             "name"},
    {.name = "cluster",
     .kind = Kind::Name,
     .member = &RouteConfig::cluster,
     .required = true,
     .help = "required: the cluster that gets the clients this route matches"},
};

// A listener has at most this many routes: each has a counter per worker.
constexpr size_t kMaxRoutes = 64;
constexpr size_t kMaxRouteNames = 1024;  // sni or alpn entries of one route

template <class T>
std::string rangeText(const Key<T>& key) {
    switch (key.kind) {
        case Kind::Count:
            return std::to_string(key.min) + ".." + std::to_string(key.max);
        case Kind::Size:
            return formatSize(key.min) + ".." + formatSize(key.max);
        case Kind::Duration:
            return formatDuration(Duration(key.min)) + ".." + formatDuration(Duration(key.max));
        case Kind::Choice:
            return std::visit(
                [](auto member) -> std::string {
                    using V = std::remove_cvref_t<decltype(std::declval<T>().*member)>;
                    if constexpr (std::is_enum_v<V>) return choiceList<V>();
                    return "";
                },
                key.member);
        default:
            return "";
    }
}

template <class T>
std::string expectedText(const Key<T>& key) {
    switch (key.kind) {
        case Kind::Count:
            return "a whole number";
        case Kind::Duration:
            return "a duration such as 5s";
        case Kind::Size:
            return "a size such as 64KiB";
        case Kind::Address:
        case Kind::OptionalAddress:
            return "an address such as 127.0.0.1:10000";
        case Kind::Choice:
            return "one of: " + rangeText(key);
        case Kind::Name:
            return "a name";
        case Kind::Text:
            return "a string";
        case Kind::Bool:
            return "true or false";
    }
    return "";
}

template <class T>
void checkRange(const Key<T>& key, uint64_t value, std::string_view text, const Where& at) {
    if (value < key.min || value > key.max) {
        fail(at, quoted(text) + " is out of range (" + rangeText(key) + ")");
    }
}

template <class T>
uint64_t parseCount(const Key<T>& key, std::string_view text, const Where& at) {
    uint64_t value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    const bool too_large = ec == std::errc::result_out_of_range;
    if (text.empty() || end != text.data() + text.size() || (ec != std::errc() && !too_large)) {
        fail(at, "expected a whole number, got " + quoted(text));
    }
    // Past uint64 is still a number: the range says more than "not a number" would.
    if (too_large) value = UINT64_MAX;
    checkRange(key, value, text, at);
    return value;
}

// One overload per member type; the Key's kind says how to read the text.
template <class T>
void assign(unsigned& out, const Key<T>& key, std::string_view text, const Where& at) {
    out = static_cast<unsigned>(parseCount(key, text, at));
}

template <class T>
void assign(uint64_t& out, const Key<T>& key, std::string_view text, const Where& at) {
    if (key.kind == Kind::Count) {
        out = parseCount(key, text, at);
        return;
    }
    const auto size = parseSize(text);
    if (!size) fail(at, size.error());
    checkRange(key, *size, text, at);
    out = *size;
}

template <class T>
void assign(Duration& out, const Key<T>& key, std::string_view text, const Where& at) {
    const auto duration = parseDuration(text);
    if (!duration) fail(at, duration.error());
    checkRange(key, ms(*duration), text, at);
    out = *duration;
}

template <class T>
void assign(SocketAddress& out, const Key<T>& key, std::string_view text, const Where& at) {
    if (key.kind == Kind::OptionalAddress && text.empty()) {
        out = SocketAddress{};
        return;
    }
    const auto address = parseAddress(text);
    if (!address) fail(at, address.error());
    out = *address;
}

template <class T, class E>
requires std::is_enum_v<E>
void assign(E& out, const Key<T>&, std::string_view text, const Where& at) {
    for (E v : Choices<E>::values) {
        if (Choices<E>::name(v) == text) {
            out = v;
            return;
        }
    }
    fail(at, quoted(text) + " is not a " + std::string(Choices<E>::noun) +
                 "; expected one of: " + choiceList<E>());
}

template <class T>
void assign(std::string& out, const Key<T>& key, std::string_view text, const Where& at) {
    if (key.kind == Kind::Text) {
        if (key.max > 0 && text.size() > key.max)
            fail(at, "longer than " + std::to_string(key.max) + " bytes");
        out = text;
        return;
    }
    const bool valid =
        !text.empty() && text.size() <= 64 && std::all_of(text.begin(), text.end(), [](char c) {
            return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                   c == '_' || c == '.' || c == '-';
        });
    if (!valid) fail(at, quoted(text) + " is not a valid name; use 1 to 64 of [A-Za-z0-9_.-]");
    out = text;
}

template <class T>
void assign(bool& out, const Key<T>&, std::string_view text, const Where& at) {
    if (text != "true" && text != "false") fail(at, "expected true or false, got " + quoted(text));
    out = text == "true";
}

template <class T>
void parseValue(T& target, const Key<T>& key, std::string_view text, const Where& at) {
    std::visit([&](auto member) { assign(target.*member, key, text, at); }, key.member);
}

template <class T>
const Key<T>* findKey(std::span<const Key<T>> keys, std::string_view name) {
    const auto it =
        std::find_if(keys.begin(), keys.end(), [&](const Key<T>& k) { return k.name == name; });
    return it == keys.end() ? nullptr : &*it;
}

// Reads the scalar keys of `map` into `target`. Keys in `nested` (maps, sequences) are returned
// for the caller to parse. Unknown and repeated keys are errors; absent keys take their fallback
// or, if required, are errors pointing at the map.
template <class T>
std::map<std::string, YAML::Node> parseMap(std::string_view source, const YAML::Node& map,
                                           const std::string& prefix, std::span<const Key<T>> keys,
                                           T& target,
                                           std::initializer_list<std::string_view> nested = {}) {
    std::map<std::string, YAML::Node> nested_nodes;
    std::vector<std::string> given;
    for (const auto& pair : map) {
        const std::string name = pair.first.IsScalar() ? pair.first.Scalar() : "?";
        const Where key_at = whereOf(source, pair.first, prefix + clipped(name));
        if (std::find(given.begin(), given.end(), name) != given.end()) {
            fail(key_at, "key given twice");
        }
        given.push_back(name);
        if (std::find(nested.begin(), nested.end(), name) != nested.end()) {
            nested_nodes[name] = pair.second;
            continue;
        }
        const Key<T>* key = findKey(keys, name);
        if (key == nullptr) {
            std::string expected;
            for (const Key<T>& k : keys) {
                expected += (expected.empty() ? "" : ", ") + std::string(k.name);
            }
            for (std::string_view n : nested) expected += ", " + std::string(n);
            fail(key_at, "unknown key; expected one of: " + expected);
        }
        const YAML::Node& value = pair.second;
        // A missing value has the mark of whatever follows it, often the next line: use the key's.
        const Where value_at =
            value.IsNull() ? key_at : whereOf(source, value, prefix + clipped(name));
        if (!value.IsScalar()) {
            fail(value_at, "expected " + expectedText(*key) + ", got " + typeName(value));
        }
        parseValue(target, *key, value.Scalar(), value_at);
    }
    for (const Key<T>& key : keys) {
        if (std::find(given.begin(), given.end(), key.name) != given.end()) continue;
        const Where map_at = whereOf(source, map, prefix + std::string(key.name));
        if (key.required) fail(map_at, "missing required key");
        if (!key.fallback.empty()) parseValue(target, key, key.fallback, map_at);
    }
    return nested_nodes;
}

// Where the value of `key` in `map` is, or the map itself when the key is absent.
Where whereOfKey(std::string_view source, const YAML::Node& map, const char* key,
                 std::string path) {
    const YAML::Node value = map[key];
    return whereOf(source, value.IsDefined() ? value : map, std::move(path));
}

// A map-valued key (absent = an empty map: every key takes its fallback).
template <class T>
std::map<std::string, YAML::Node> parseNestedMap(
    std::string_view source, const std::map<std::string, YAML::Node>& nested, const char* key,
    const std::string& path, std::span<const Key<T>> keys, T& target,
    std::initializer_list<std::string_view> inner = {}) {
    const auto it = nested.find(key);
    if (it != nested.end() && !it->second.IsMap()) {
        fail(whereOf(source, it->second, path), "expected a map, got " + typeName(it->second));
    }
    return parseMap<T>(source, it != nested.end() ? it->second : YAML::Node(YAML::NodeType::Map),
                       path + ".", keys, target, inner);
}

// The items of a sequence-valued key, each checked to be a map.
std::vector<YAML::Node> sequenceOfMaps(std::string_view source, const YAML::Node& list,
                                       const std::string& path, std::string_view item) {
    const Where at = whereOf(source, list, path);
    if (!list.IsSequence()) {
        fail(at, "expected a sequence of " + std::string(item) + "s, got " + typeName(list));
    }
    if (list.size() == 0) fail(at, "empty; at least one " + std::string(item) + " is needed");
    std::vector<YAML::Node> items;
    for (size_t i = 0; i < list.size(); ++i) {
        const YAML::Node node = list[i];
        if (!node.IsMap()) {
            fail(whereOf(source, node, path + "[" + std::to_string(i) + "]"),
                 "expected a map, got " + typeName(node));
        }
        items.push_back(node);
    }
    return items;
}

void checkTcpAddress(std::string_view source, const YAML::Node& map, const char* key,
                     const std::string& path, const SocketAddress& a) {
    if (a.family() == AF_UNIX) {
        fail(whereOfKey(source, map, key, path + "." + key),
             "unix sockets are only supported as backend addresses");
    }
}

// A DNS name as a resolver takes it: labels of letters, digits, '-' and '_' (SRV's
// _service._proto), 1 to 63 bytes each, 253 in all, an optional trailing dot (absolute: no
// search domain is tried).
bool validDnsName(std::string_view name) {
    if (name.empty() || name.size() > 254 || (name.size() == 254 && name.back() != '.'))
        return false;
    if (name.back() == '.') name.remove_suffix(1);
    size_t label = 0;
    for (const char c : name) {
        if (c == '.') {
            if (label == 0) return false;
            label = 0;
            continue;
        }
        const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                        (c >= '0' && c <= '9') || c == '-' || c == '_';
        if (!ok || ++label > 63) return false;
    }
    return label > 0;
}

void parseDiscovery(std::string_view source, const YAML::Node& node, const std::string& path,
                    ClusterConfig& cluster) {
    if (!node.IsMap()) fail(whereOf(source, node, path), "expected a map, got " + typeName(node));
    DiscoveryConfig& d = cluster.discovery;
    parseMap<DiscoveryConfig>(source, node, path + ".", kDiscoveryKeys, d);
    if (d.dns.empty() == d.srv.empty()) {
        fail(whereOf(source, node, path),
             d.dns.empty() ? "needs `dns` (a name with `port`) or `srv` (an SRV name)"
                           : "has both `dns` and `srv`; a cluster follows one name");
    }
    const char* key = d.dns.empty() ? "srv" : "dns";
    if (!validDnsName(d.name())) {
        fail(whereOfKey(source, node, key, path + "." + key),
             quoted(d.name()) + " is not a DNS name (labels of [A-Za-z0-9_-], 1 to 63 bytes; 253 in all)");
    }
    if (!d.dns.empty() && d.port == 0)
        fail(whereOfKey(source, node, "port", path + ".port"),
             "missing: dns names addresses, `port` says where on them to connect");
    if (!d.srv.empty() && d.port != 0)
        fail(whereOfKey(source, node, "port", path + ".port"),
             "is set with srv, whose records carry their own ports; remove it");
    if (d.refresh_min > d.refresh_max)
        fail(whereOfKey(source, node, "refresh_max", path + ".refresh_max"),
             formatDuration(d.refresh_max) + " is below refresh_min " +
                 formatDuration(d.refresh_min));
    if (!d.srv.empty() && node["weight"].IsDefined())
        fail(whereOfKey(source, node, "weight", path + ".weight"),
             "is set with srv, whose records carry their own weights; remove it");
}

void parseResolvers(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                    ResolversConfig& resolvers) {
    const auto inner = parseNestedMap<ResolversConfig>(source, nested, "resolvers", "resolvers",
                                                       kResolversKeys, resolvers, {"nameservers"});
    const auto list = inner.find("nameservers");
    if (list == inner.end()) return;
    const YAML::Node& node = list->second;
    if (!node.IsSequence() || node.size() == 0 || node.size() > 3) {
        fail(whereOf(source, node, "resolvers.nameservers"),
             "expected a sequence of 1 to 3 addresses such as 127.0.0.1:53, got " +
                 typeName(node));
    }
    for (size_t i = 0; i < node.size(); ++i) {
        const Where at = whereOf(source, node[i], "resolvers.nameservers[" + std::to_string(i) + "]");
        if (!node[i].IsScalar()) fail(at, "expected an address, got " + typeName(node[i]));
        const auto address = parseAddress(node[i].Scalar());
        if (!address) fail(at, address.error());
        if (address->family() == AF_UNIX) fail(at, "a nameserver is reached over UDP/TCP, not unix");
        resolvers.nameservers.push_back(*address);
    }
}

// The runtime API changes what the relay does: without a token only this host may reach it.
bool loopbackOrUnix(const SocketAddress& a) {
    if (a.family() == AF_UNIX) return true;
    if (a.family() == AF_INET)
        return (ntohl(reinterpret_cast<const sockaddr_in*>(a.sockaddrPtr())->sin_addr.s_addr) >>
                24) == 127;
    const auto& sin6 = *reinterpret_cast<const sockaddr_in6*>(a.sockaddrPtr());
    return IN6_IS_ADDR_LOOPBACK(&sin6.sin6_addr);
}

void parseAdmin(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                AdminConfig& admin) {
    parseNestedMap<AdminConfig>(source, nested, "admin", "admin", kAdminKeys, admin);
    const auto it = nested.find("admin");
    if (it == nested.end()) return;
    if (admin.enabled() && admin.token_file.empty() && !loopbackOrUnix(admin.listen)) {
        fail(whereOfKey(source, it->second, "listen", "admin.listen"),
             admin.listen.toString() +
                 " is reachable from other hosts: set admin.token_file, or listen on loopback "
                 "or a unix socket");
    }
    if (!admin.enabled() && !admin.token_file.empty()) {
        fail(whereOfKey(source, it->second, "token_file", "admin.token_file"),
             "is set while admin.listen is off");
    }
}

void parseClusters(std::string_view source, const YAML::Node& list, Config& config) {
    const auto items = sequenceOfMaps(source, list, "clusters", "cluster");
    for (size_t i = 0; i < items.size(); ++i) {
        const YAML::Node& node = items[i];
        const std::string path = "clusters[" + std::to_string(i) + "]";
        ClusterConfig cluster;
        const auto nested =
            parseMap<ClusterConfig>(source, node, path + ".", kClusterKeys, cluster,
                                    {"health_check", "tcp_keepalive", "backends", "discovery"});
        checkTcpAddress(source, node, "source", path, cluster.source);
        cluster.health_check.enabled = nested.count("health_check") > 0;
        parseNestedMap<HealthCheckConfig>(source, nested, "health_check", path + ".health_check",
                                          kHealthCheckKeys, cluster.health_check);
        parseNestedMap<KeepaliveConfig>(source, nested, "tcp_keepalive", path + ".tcp_keepalive",
                                        kKeepaliveKeys, cluster.tcp_keepalive);
        const auto backends = nested.find("backends");
        if (const auto discovery = nested.find("discovery"); discovery != nested.end()) {
            if (backends != nested.end()) {
                fail(whereOf(source, backends->second, path + ".backends"),
                     "a cluster takes its backends from `backends` or from `discovery`, not both");
            }
            parseDiscovery(source, discovery->second, path + ".discovery", cluster);
        } else if (backends == nested.end()) {
            fail(whereOf(source, node, path + ".backends"),
                 "missing required key (or `discovery` to take them from DNS)");
        }
        const auto backend_nodes =
            backends == nested.end()
                ? std::vector<YAML::Node>{}
                : sequenceOfMaps(source, backends->second, path + ".backends", "backend");
        for (size_t b = 0; b < backend_nodes.size(); ++b) {
            const std::string bpath = path + ".backends[" + std::to_string(b) + "]";
            BackendConfig backend;
            backend.send_proxy = cluster.send_proxy;  // unless the backend sets its own
            parseMap<BackendConfig>(source, backend_nodes[b], bpath + ".", kBackendKeys, backend);
            for (size_t e = 0; e < cluster.backends.size(); ++e) {
                if (cluster.backends[e].address == backend.address) {
                    fail(whereOfKey(source, backend_nodes[b], "address", bpath + ".address"),
                         backend.address.toString() + " is already " + path + ".backends[" +
                             std::to_string(e) + "]");
                }
            }
            if (cluster.source.length != 0 && backend.address.family() != AF_UNIX &&
                backend.address.family() != cluster.source.family()) {
                fail(whereOfKey(source, backend_nodes[b], "address", bpath + ".address"),
                     backend.address.toString() + " is not in the family of source " +
                         cluster.source.toString());
            }
            cluster.backends.push_back(std::move(backend));
        }
        for (size_t j = 0; j < i; ++j) {
            if (config.clusters[j].name == cluster.name) {
                fail(whereOfKey(source, node, "name", path + ".name"),
                     quoted(cluster.name) + " is already the name of clusters[" +
                         std::to_string(j) + "]");
            }
        }
        config.clusters.push_back(std::move(cluster));
    }
}

// A server name as a route matches it: lowercase, without the trailing dot of a fully
// qualified name; "*." may stand for the first label. Anything else is refused here, where the
// operator sees it, rather than never matching.
std::string serverNamePattern(const Where& at, std::string_view text) {
    std::string name(text);
    if (!name.empty() && name.back() == '.') name.pop_back();
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    std::string_view rest = name;
    if (rest.starts_with("*.")) rest.remove_prefix(2);
    bool valid = !rest.empty() && name.size() <= 253;
    for (size_t start = 0; valid && start <= rest.size();) {
        size_t end = std::min(rest.find('.', start), rest.size());
        std::string_view label = rest.substr(start, end - start);
        valid = !label.empty() && label.size() <= 63 &&
                std::all_of(label.begin(), label.end(), [](char c) {
                    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
                           c == '_';
                });
        start = end + 1;
    }
    if (!valid) {
        fail(at, quoted(text) +
                     " is not a server name; expected DNS labels such as api.example.com, or "
                     "*.example.com for any one label in front");
    }
    return name;
}

// `sni` or `alpn`: one string or a sequence of them.
std::vector<std::string> parseNames(std::string_view source, const YAML::Node& node,
                                    const std::string& path, bool server_names) {
    std::vector<YAML::Node> items;
    if (node.IsScalar()) {
        items.push_back(node);
    } else if (node.IsSequence() && node.size() > 0) {
        for (size_t i = 0; i < node.size(); ++i) items.push_back(node[i]);
    } else {
        fail(whereOf(source, node, path),
             "expected a name or a non-empty sequence of names, got " + typeName(node));
    }
    if (items.size() > kMaxRouteNames)
        fail(whereOf(source, node, path),
             "more than " + std::to_string(kMaxRouteNames) + " names in one route");
    std::vector<std::string> names;
    for (size_t i = 0; i < items.size(); ++i) {
        const Where at = whereOf(source, items[i], path + "[" + std::to_string(i) + "]");
        if (!items[i].IsScalar()) fail(at, "expected a name, got " + typeName(items[i]));
        const std::string& text = items[i].Scalar();
        std::string name;
        if (server_names) {
            name = serverNamePattern(at, text);
        } else {
            // RFC 7301 3.1: a protocol name is 1 to 255 bytes, compared exactly.
            if (text.empty() || text.size() > 255)
                fail(at, quoted(text) + " is not an ALPN protocol name (1 to 255 bytes)");
            name = text;
        }
        if (std::find(names.begin(), names.end(), name) != names.end())
            fail(at, quoted(text) + " is listed twice");
        names.push_back(std::move(name));
    }
    return names;
}

void parseRoutes(std::string_view source, const YAML::Node& list, const std::string& path,
                 const Config& config, ListenerConfig& listener) {
    const auto items = sequenceOfMaps(source, list, path, "route");
    if (items.size() > kMaxRoutes)
        fail(whereOf(source, list, path),
             "more than " + std::to_string(kMaxRoutes) + " routes in one listener");
    for (size_t i = 0; i < items.size(); ++i) {
        const YAML::Node& node = items[i];
        const std::string rpath = path + "[" + std::to_string(i) + "]";
        RouteConfig route;
        const auto nested =
            parseMap<RouteConfig>(source, node, rpath + ".", kRouteKeys, route, {"sni", "alpn"});
        if (const auto sni = nested.find("sni"); sni != nested.end())
            route.sni = parseNames(source, sni->second, rpath + ".sni", true);
        if (const auto alpn = nested.find("alpn"); alpn != nested.end())
            route.alpn = parseNames(source, alpn->second, rpath + ".alpn", false);
        if (std::none_of(config.clusters.begin(), config.clusters.end(),
                         [&](const ClusterConfig& c) { return c.name == route.cluster; })) {
            fail(whereOfKey(source, node, "cluster", rpath + ".cluster"),
                 "no cluster named " + quoted(route.cluster));
        }
        if (route.name.empty()) route.name = route.cluster;
        for (size_t j = 0; j < listener.routes.size(); ++j) {
            if (listener.routes[j].name == route.name) {
                fail(whereOfKey(source, node, node["name"] ? "name" : "cluster", rpath + ".name"),
                     "route name " + quoted(route.name) + " is already " + path + "[" +
                         std::to_string(j) + "]'s; routes to one cluster need a `name` each");
            }
            // A route after an unconditional one could never be taken.
            if (!listener.routes[j].conditional()) {
                fail(whereOf(source, node, rpath),
                     "unreachable: " + path + "[" + std::to_string(j) +
                         "] has no condition and takes every client first");
            }
        }
        listener.routes.push_back(std::move(route));
    }
}

void parseListeners(std::string_view source, const YAML::Node& list, Config& config) {
    const auto items = sequenceOfMaps(source, list, "listeners", "listener");
    for (size_t i = 0; i < items.size(); ++i) {
        const YAML::Node& node = items[i];
        const std::string path = "listeners[" + std::to_string(i) + "]";
        ListenerConfig listener;
        const auto nested = parseMap<ListenerConfig>(source, node, path + ".", kListenerKeys,
                                                     listener, {"tcp_keepalive", "routes"});
        parseNestedMap<KeepaliveConfig>(source, nested, "tcp_keepalive", path + ".tcp_keepalive",
                                        kKeepaliveKeys, listener.tcp_keepalive);
        if (listener.name.empty()) listener.name = "listener" + std::to_string(i);
        checkTcpAddress(source, node, "listen", path, listener.listen);
        const bool has_upstream = listener.upstream.length != 0;
        if (const auto routes = nested.find("routes"); routes != nested.end())
            parseRoutes(source, routes->second, path + ".routes", config, listener);
        if (has_upstream && !listener.cluster.empty())
            fail(whereOf(source, node, path), "set `cluster` or `upstream`, not both");
        if (!has_upstream && listener.cluster.empty() && listener.routes.empty()) {
            fail(whereOf(source, node, path),
                 "missing `cluster` (or `upstream`, a one-backend cluster, or `routes`)");
        }
        if (!listener.cluster.empty()) {
            const auto it =
                std::find_if(config.clusters.begin(), config.clusters.end(),
                             [&](const ClusterConfig& c) { return c.name == listener.cluster; });
            if (it == config.clusters.end()) {
                fail(whereOfKey(source, node, "cluster", path + ".cluster"),
                     "no cluster named " + quoted(listener.cluster));
            }
        } else if (has_upstream) {
            // The shorthand's cluster carries the listener's name: it must not shadow one.
            for (size_t j = 0; j < config.clusters.size(); ++j) {
                if (config.clusters[j].name == listener.name) {
                    fail(whereOfKey(source, node, "upstream", path + ".upstream"),
                         "the cluster this makes, named after the listener, clashes with "
                         "clusters[" +
                             std::to_string(j) + "] " + quoted(listener.name) +
                             "; name the listener otherwise or use `cluster`");
                }
            }
        }
        if (const std::string_view default_cluster = implicitDefaultRoute(listener);
            !default_cluster.empty()) {
            for (size_t r = 0; r < listener.routes.size(); ++r) {
                if (listener.routes[r].name == default_cluster) {
                    fail(whereOf(source, node, path + ".routes[" + std::to_string(r) + "]"),
                         "route name " + quoted(default_cluster) +
                             " is also the name of the default route (the listener's cluster); "
                             "give this route a `name`");
                }
            }
        }
        for (size_t j = 0; j < i; ++j) {
            const ListenerConfig& earlier = config.listeners[j];
            const std::string earlier_path = "listeners[" + std::to_string(j) + "]";
            if (earlier.name == listener.name) {
                fail(whereOfKey(source, node, "name", path + ".name"),
                     quoted(listener.name) + " is already the name of " + earlier_path);
            }
            // Port 0 asks the kernel for a fresh port, so two such listeners never collide.
            if (listener.listen.port() != 0 && earlier.listen == listener.listen) {
                fail(whereOfKey(source, node, "listen", path + ".listen"),
                     listener.listen.toString() + " is already the listen address of " +
                         earlier_path);
            }
        }
        config.listeners.push_back(std::move(listener));
    }
}

// The addresses this config makes the relay listen on, by the key that sets each. Port 0 is
// left out: the kernel picks the port at bind, so no backend can name it here (discovery
// checks the bound ports: Server::ownEndpoints()).
std::vector<std::pair<std::string, SocketAddress>> ownAddresses(const Config& config) {
    std::vector<std::pair<std::string, SocketAddress>> own;
    const auto add = [&](std::string key, const SocketAddress& a) {
        if (a.length != 0 && (a.family() == AF_UNIX || a.port() != 0))
            own.emplace_back(std::move(key), a);
    };
    for (size_t i = 0; i < config.listeners.size(); ++i)
        add("listeners[" + std::to_string(i) + "].listen", config.listeners[i].listen);
    if (config.metrics.enabled) {
        add("metrics.listen", config.metrics.listen);
        add("metrics.health_listen", config.metrics.health_listen);
    }
    if (config.admin.enabled()) add("admin.listen", config.admin.listen);
    return own;
}

// A backend that connects to no service (0.0.0.0 and :: reach the local host, broadcast,
// multicast, port 0) or to the relay itself: a connection to itself is relayed to itself
// again, per client, until the fds run out. Discovery refuses the same in DNS answers.
void checkBackendTarget(const Where& at, const SocketAddress& a,
                        const std::vector<std::pair<std::string, SocketAddress>>& own,
                        std::optional<std::vector<SocketAddress>>& local) {
    if (const auto refusal = refusalOf(a))
        fail(at, a.toString() + " is refused as a backend (" + std::string(label(*refusal)) + ": " +
                     std::string(whyRefused(*refusal)) + ")");
    for (const auto& [key, listen] : own) {
        const bool wildcard = refusalOf(listen) == BackendRefusal::Unspecified;
        if (wildcard && !local) local = localAddresses();
        if (reaches(a, listen,
                    wildcard ? std::span<const SocketAddress>(*local)
                             : std::span<const SocketAddress>{}))
            fail(at, a.toString() + " is the relay's own " + key + ": a loop");
    }
}

void checkBackendTargets(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                         const Config& config) {
    const auto own = ownAddresses(config);
    std::optional<std::vector<SocketAddress>> local;  // getifaddrs once, when a wildcard needs it
    if (const auto clusters = nested.find("clusters"); clusters != nested.end()) {
        const auto items = sequenceOfMaps(source, clusters->second, "clusters", "cluster");
        for (size_t i = 0; i < items.size() && i < config.clusters.size(); ++i) {
            const YAML::Node backends = items[i]["backends"];
            if (!backends.IsDefined() || config.clusters[i].discovery.enabled()) continue;
            const std::string path = "clusters[" + std::to_string(i) + "].backends";
            const auto nodes = sequenceOfMaps(source, backends, path, "backend");
            for (size_t b = 0; b < nodes.size() && b < config.clusters[i].backends.size(); ++b) {
                const std::string key = path + "[" + std::to_string(b) + "].address";
                checkBackendTarget(whereOfKey(source, nodes[b], "address", key),
                                   config.clusters[i].backends[b].address, own, local);
            }
        }
    }
    const auto items = sequenceOfMaps(source, nested.at("listeners"), "listeners", "listener");
    for (size_t i = 0; i < items.size() && i < config.listeners.size(); ++i) {
        const SocketAddress& upstream = config.listeners[i].upstream;
        if (upstream.length == 0) continue;
        const std::string key = "listeners[" + std::to_string(i) + "].upstream";
        checkBackendTarget(whereOfKey(source, items[i], "upstream", key), upstream, own, local);
    }
}

// Line `index` (0-based) of `text`, or "" past the end.
std::string_view lineOf(std::string_view text, int index) {
    size_t start = 0;
    for (int i = 0; i < index && start != std::string_view::npos; ++i) {
        start = text.find('\n', start);
        if (start != std::string_view::npos) ++start;
    }
    if (index < 0 || start == std::string_view::npos || start >= text.size()) return "";
    return text.substr(start, text.find('\n', start) - start);
}

// `user` and `group` name accounts of this machine. They are resolved here, so that an unknown
// one is refused with its line like any other error and --check-config catches it; the switch
// itself happens in Server::start (privileges.cpp).
void resolveRunAs(std::string_view source, const YAML::Node& root, Config& config) {
    if (config.user.empty()) {
        if (!config.group.empty())
            fail(whereOfKey(source, root, "group", "group"),
                 "needs `user`: the relay switches user and group together");
        return;
    }
    const Where user_at = whereOfKey(source, root, "user", "user");
    const auto user = lookUpUser(config.user);
    if (!user) fail(user_at, user.error());
    config.uid = user->uid;
    if (config.group.empty()) {
        if (!user->gid) {
            fail(user_at,
                 "uid " + config.user + " has no passwd entry to take a group from: set `group`");
        }
        config.gid = *user->gid;
        return;
    }
    const auto gid = lookUpGroup(config.group);
    if (!gid) fail(whereOfKey(source, root, "group", "group"), gid.error());
    config.gid = *gid;
}

// Whether a YAML document has any content, and where it starts: the parser's events alone, no
// node built.
class DocumentContent : public YAML::EventHandler {
  public:
    bool seen = false;
    YAML::Mark mark;

    void OnDocumentStart(const YAML::Mark&) override {}
    void OnDocumentEnd() override {}
    void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
    void OnAlias(const YAML::Mark& m, YAML::anchor_t) override { content(m); }
    void OnScalar(const YAML::Mark& m, const std::string&, YAML::anchor_t,
                  const std::string&) override {
        content(m);
    }
    void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t,
                         YAML::EmitterStyle::value) override {
        content(m);
    }
    void OnSequenceEnd() override {}
    void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t,
                    YAML::EmitterStyle::value) override {
        content(m);
    }
    void OnMapEnd() override {}

  private:
    void content(const YAML::Mark& m) {
        if (!seen) mark = m;
        seen = true;
    }
};

// Every document after the first is looked at: one with content after `---` would otherwise be
// dropped without a word, and with it whatever its author meant to configure. An empty one (a
// trailing `---`, as generated manifests end) configures nothing and may stay. Not
// YAML::LoadAll: on some malformed input yaml-cpp 0.7's parser yields documents without end
// (fuzz.config found one: 2 GiB and growing), so at most kMaxDocuments are read, as events.
void refuseLaterDocuments(std::string_view source, const std::string& text) {
    constexpr int kMaxDocuments = 64;
    std::istringstream in(text);
    YAML::Parser parser(in);
    DocumentContent first;  // the document YAML::Load took
    if (!parser.HandleNextDocument(first)) return;
    for (int n = 2; n <= kMaxDocuments; ++n) {
        DocumentContent doc;
        if (!parser.HandleNextDocument(doc)) return;
        if (doc.seen) {
            fail(whereAt(source, doc.mark, "(document " + std::to_string(n) + ")"),
                 "a second YAML document (after `---`); the config is one document");
        }
    }
    fail(Where{source, 0, 0, "(yaml)"},
         "more than " + std::to_string(kMaxDocuments) + " YAML documents; the config is one");
}

// Everything but resolving `workers`, so the embedded default can be rendered machine-neutral.
Config parseConfig(std::string_view yaml, std::string_view source) {
    YAML::Node root;
    try {
        const std::string text(yaml);
        root = YAML::Load(text);
        refuseLaterDocuments(source, text);
    } catch (const YAML::ParserException& e) {
        std::string what = e.msg;
        // An unquoted "[::1]:80" opens a YAML flow sequence; the parser's complaint hides that.
        const std::string_view line = lineOf(yaml, e.mark.line);
        if (line.find(": [") != std::string_view::npos &&
            line.find("]:") != std::string_view::npos) {
            what += " (IPv6 addresses need quotes: \"[::1]:10000\")";
        }
        fail(whereAt(source, e.mark, "(yaml)"), what);
    }
    if (!root.IsMap()) {
        fail(whereOf(source, root, "(document)"),
             root.IsNull() ? "empty; expected a map with at least `listeners`"
                           : "expected a map of settings, got " + typeName(root));
    }
    Config config;
    const auto nested =
        parseMap<Config>(source, root, "", kTopKeys, config,
                         {"metrics", "access_log", "resolvers", "admin", "clusters", "listeners"});
    parseResolvers(source, nested, config.resolvers);
    parseAdmin(source, nested, config.admin);
    parseNestedMap<MetricsConfig>(source, nested, "metrics", "metrics", kMetricsKeys,
                                  config.metrics);
    config.metrics.enabled = config.metrics.enabled && config.metrics.listen.length != 0;
    if (const auto metrics = nested.find("metrics"); metrics != nested.end()) {
        checkTcpAddress(source, metrics->second, "listen", "metrics", config.metrics.listen);
        checkTcpAddress(source, metrics->second, "health_listen", "metrics",
                        config.metrics.health_listen);
        if (config.metrics.health_listen.length != 0 &&
            config.metrics.health_listen == config.metrics.listen &&
            config.metrics.listen.port() != 0) {
            fail(whereOfKey(source, metrics->second, "health_listen", "metrics.health_listen"),
                 "is the same address as metrics.listen; leave it unset to serve probes there");
        }
        // Probes are served by the metrics endpoint: with it off, health_listen would be a
        // port the operator expects to answer and nothing listens on.
        if (config.metrics.health_listen.length != 0 && !config.metrics.enabled) {
            fail(whereOfKey(source, metrics->second, "health_listen", "metrics.health_listen"),
                 "is set while metrics are off (listen \"\" or enabled: false); probes are "
                 "served only with the endpoint on");
        }
    }
    if (config.admin.enabled() && config.metrics.enabled && config.admin.listen.port() != 0 &&
        (config.admin.listen == config.metrics.listen ||
         config.admin.listen == config.metrics.health_listen)) {
        fail(whereOfKey(source, nested.at("admin"), "listen", "admin.listen"),
             "is the same address as metrics." +
                 std::string(config.admin.listen == config.metrics.listen ? "listen"
                                                                          : "health_listen") +
                 "; the runtime API needs its own");
    }
    parseNestedMap<AccessLogConfig>(source, nested, "access_log", "access_log", kAccessLogKeys,
                                    config.access_log);
    resolveRunAs(source, root, config);

    if (const auto clusters = nested.find("clusters"); clusters != nested.end())
        parseClusters(source, clusters->second, config);
    const auto listeners = nested.find("listeners");
    if (listeners == nested.end()) fail(whereOf(source, root, "listeners"), "missing required key");
    parseListeners(source, listeners->second, config);
    checkBackendTargets(source, nested, config);
    return config;
}

unsigned onlineCpus() {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return static_cast<unsigned>(std::clamp(n, 1L, 256L));
}

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
                std::string_view indent, std::string_view first_indent,
                std::string_view skip = {}, std::string_view skip_too = {}) {
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
    if (with_help)
        out += "  # nameservers: [\"127.0.0.1:53\"]   # up to 3; unset: resolv_conf's\n";
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
        sample.backends.push_back({parseAddress("127.0.0.1:9001").value(), 2, ProxyVersion::Off});
        sample.backends.push_back({parseAddress("127.0.0.1:9002").value(), 1, ProxyVersion::Off});
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
            out += "    # routes: route by the client's TLS ClientHello instead of one cluster; "
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

std::string_view proxyVersionName(ProxyVersion v) {
    switch (v) {
        case ProxyVersion::Off:
            return "off";
        case ProxyVersion::V1:
            return "v1";
        case ProxyVersion::V2:
            return "v2";
    }
    return "?";
}

std::string_view familiesName(AddressFamilies f) {
    switch (f) {
        case AddressFamilies::Any:
            return "any";
        case AddressFamilies::Ipv4:
            return "ipv4";
        case AddressFamilies::Ipv6:
            return "ipv6";
    }
    return "?";
}

std::string_view logFormatName(AccessLogFormat f) {
    return f == AccessLogFormat::Json ? "json" : "text";
}

std::vector<ClusterConfig> clustersOf(const Config& config) {
    std::vector<ClusterConfig> clusters = config.clusters;
    for (const ListenerConfig& l : config.listeners) {
        if (l.cluster.empty() && l.upstream.length != 0) {
            ClusterConfig c;
            c.name = l.name;
            c.backends.push_back({l.upstream, 1, ProxyVersion::Off});
            clusters.push_back(std::move(c));
        }
    }
    return clusters;
}

std::string_view implicitDefaultRoute(const ListenerConfig& listener) {
    if (listener.routes.empty() ||
        std::any_of(listener.routes.begin(), listener.routes.end(),
                    [](const RouteConfig& r) { return !r.conditional(); }))
        return {};
    if (!listener.cluster.empty()) return listener.cluster;
    // `upstream:` makes a cluster named after the listener (clustersOf).
    return listener.upstream.length != 0 ? std::string_view(listener.name) : std::string_view();
}

size_t clusterNamed(const Config& config, std::string_view name) {
    for (size_t i = 0; i < config.clusters.size(); ++i)
        if (config.clusters[i].name == name) return i;
    return kNoCluster;
}

size_t clusterIndex(const Config& config, size_t listener) {
    const ListenerConfig& l = config.listeners[listener];
    if (!l.cluster.empty()) return clusterNamed(config, l.cluster);
    if (l.upstream.length == 0) return kNoCluster;
    size_t implicit = config.clusters.size();
    for (size_t i = 0; i < listener; ++i)
        if (config.listeners[i].cluster.empty() && config.listeners[i].upstream.length != 0)
            ++implicit;
    return implicit;
}

Config loadConfigString(std::string_view yaml, std::string_view source) {
    // Whatever goes wrong while loading is a refused config, never an exception that ends the
    // process: yaml-cpp's own (a node read as what it is not), memory running out.
    try {
        Config config = parseConfig(yaml, source);
        if (config.workers == 0) config.workers = onlineCpus();
        return config;
    } catch (const ConfigError&) {
        throw;
    } catch (const std::bad_alloc&) {
        throw ConfigError(std::string(source) + ": out of memory while loading the config");
    } catch (const std::exception& e) {
        throw ConfigError(std::string(source) + ": " + clipped(e.what()));
    }
}

Config loadConfigFile(const std::string& path, uint64_t max_size) {
    // O_NONBLOCK: opening a FIFO waits for a writer otherwise, forever if none comes, and would
    // hold the thread that takes SIGTERM; the fstat below then refuses it. O_NOCTTY: a terminal
    // named as the config never becomes the process's controlling terminal.
    UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
    if (!fd) throw ConfigError(path + ": cannot read: " + std::strerror(errno));
    struct stat st {};
    if (fstat(fd.get(), &st) < 0)
        throw ConfigError(path + ": cannot stat: " + std::strerror(errno));
    // Only a regular file has an end: /dev/zero or /dev/urandom would be read until memory runs
    // out, a FIFO or a socket until its writer stops.
    if (!S_ISREG(st.st_mode))
        throw ConfigError(path + ": is " + fileKind(st.st_mode) +
                          "; the config must be a regular file");
    const auto too_large = [&] {
        return ConfigError(path + ": larger than " + formatSize(max_size) +
                           ", the most a config file may hold (--max-config-size)");
    };
    if (static_cast<uint64_t>(st.st_size) > max_size) throw too_large();
    // Read at most one byte past the cap: a file that grew since fstat is refused all the same.
    std::string text;
    for (char buf[8192];;) {
        const ssize_t n = read(fd.get(), buf, sizeof(buf));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw ConfigError(path + ": cannot read: " + std::strerror(errno));
        if (n == 0) break;
        text.append(buf, static_cast<size_t>(n));
        if (text.size() > max_size) throw too_large();
    }
    return loadConfigString(text, path);
}

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
        return std::string(kHeader) + render(parseConfig(kDefaultListener, "<default>"), true);
    }();
    return yaml;
}

std::string renderConfig(const Config& config) { return render(config, false); }

void applyFlag(Config& config, std::string_view key, std::string_view value,
               std::string_view flag) {
    const Where at{"<command line>", 0, 0, std::string(flag)};
    // The backends, checked again as the file's were once a flag moved an end: what the flag
    // makes must not be a loop either (`--listen` is always followed by its `--upstream`).
    const auto recheck = [&] {
        const auto own = ownAddresses(config);
        std::optional<std::vector<SocketAddress>> local;
        for (const ListenerConfig& l : config.listeners)
            if (l.upstream.length != 0) checkBackendTarget(at, l.upstream, own, local);
        for (const ClusterConfig& c : config.clusters)
            for (const BackendConfig& b : c.backends) checkBackendTarget(at, b.address, own, local);
    };
    if (const auto* top = findKey<Config>(kTopKeys, key)) {
        return parseValue(config, *top, value, at);
    }
    if (key == "metrics.listen") {
        parseValue(config.metrics, *findKey<MetricsConfig>(kMetricsKeys, "listen"), value, at);
        config.metrics.enabled = config.metrics.listen.length != 0;
        recheck();
        return;
    }
    if (const auto* listener_key = findKey<ListenerConfig>(kListenerKeys, key)) {
        for (ListenerConfig& listener : config.listeners) {
            parseValue(listener, *listener_key, value, at);
        }
        if (key == "upstream") recheck();
        return;
    }
    throw std::logic_error("applyFlag: no config key " + std::string(key));
}

}  // namespace zcrelay
