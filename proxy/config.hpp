#pragma once
// The relay's configuration: plain structs out, every error found before anything starts.
// Loading is the config_*.cpp files' (keys, yaml, sections, checks, render, load), the only
// ones that include yaml-cpp; config.cpp has the names and lookups declared here.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "access_log.hpp"
#include "address.hpp"
#include "balance.hpp"
#include "data_path.hpp"
#include "units.hpp"

namespace zcrelay {

// The PROXY protocol header sent to a backend before any relayed byte (proxy_protocol.hpp).
enum class ProxyVersion : uint8_t { Off, V1, V2 };
std::string_view proxyVersionName(ProxyVersion v);

std::string_view logFormatName(AccessLogFormat f);

// SO_KEEPALIVE with TCP_KEEPIDLE/TCP_KEEPINTVL/TCP_KEEPCNT; idle 0 leaves keepalive off.
// user_timeout: TCP_USER_TIMEOUT (HAProxy's tcp-ut), 0 leaves the kernel's.
struct KeepaliveConfig {
    Duration idle{0};
    Duration interval = std::chrono::seconds(10);
    unsigned count = 6;
    Duration user_timeout{0};

    bool operator==(const KeepaliveConfig&) const = default;
};

// An HTTP/1.1 check (HAProxy's `option httpchk` + `http-check expect status`, what Patroni's
// REST API is checked with): `method path` with a Host header and `Connection: close`; the
// reply's status must be in `expect_status`, and, if set, `expect_body` must appear in the
// first kMaxReply bytes of the reply after its headers (as sent: chunked framing is not
// decoded).
struct HttpCheckConfig {
    bool enabled = false;  // set by the presence of the `http` map
    std::string method = "GET";
    std::string path = "/";
    std::string host;                       // "" = the checked address
    std::string expect_status = "200-399";  // codes and ranges: "200", "200,204", "200-299"
    std::string expect_body;
    // expect_status parsed at load: inclusive ranges.
    std::vector<std::pair<uint16_t, uint16_t>> statuses{{200, 399}};

    // What a check reads of a reply at most: a 10 MB answer costs 16 KiB (HAProxy's
    // tune.chksize default).
    static constexpr size_t kMaxReply = 16 * 1024;
    bool statusPasses(unsigned code) const {
        for (auto [lo, hi] : statuses)
            if (code >= lo && code <= hi) return true;
        return false;
    }
    bool operator==(const HttpCheckConfig&) const = default;
};

// Active checks: a TCP connect every `interval` (optionally `send` bytes and `expect` a reply
// starting with a prefix, or an HTTP request and its status), each bounded by `timeout`. `rise`
// passes in a row bring a down backend up, `fall` failures in a row take an up one down. The
// check goes to the backend's address, on `port` when set (Patroni: the REST port, 8008), or
// to a backend's own `check_address`.
struct HealthCheckConfig {
    bool enabled = false;  // set by the presence of the `health_check` map
    Duration interval = std::chrono::seconds(2);
    Duration timeout = std::chrono::seconds(1);
    unsigned rise = 2;
    unsigned fall = 3;
    unsigned port = 0;  // 0 = the backend's
    std::string send;
    std::string expect;
    HttpCheckConfig http;

    bool operator==(const HealthCheckConfig&) const = default;
};

struct BackendConfig {
    SocketAddress address;  // TCP (IPv4/IPv6) or unix:/path
    unsigned weight = 1;
    ProxyVersion send_proxy = ProxyVersion::Off;  // the cluster's unless the backend sets it
    // Takes connections only while no backend of a lower tier is up (HAProxy's `backup`: tier
    // 1). SRV records' priorities are tiers too (discovery.hpp).
    bool backup = false;
    unsigned tier = 0;            // 0 = the primaries; backup: true is 1; an SRV priority's rank
    SocketAddress check_address;  // unset: the backend's address (on health_check.port if set)
    // Connections it may have at once, connecting included (HAProxy's `maxconn`); 0 = no
    // limit. Past it new clients go to another backend, or wait in the cluster's queue.
    unsigned max_connections = 0;

    bool operator==(const BackendConfig&) const = default;
};

// Where a discovered cluster's backends come from: the addresses (A/AAAA) of `dns`, each at
// `port`, or the targets of the SRV records of `srv` at their ports and weights. Resolved by
// discovery.hpp on its own thread; the set is refreshed when the answer's TTL runs out,
// within [refresh_min, refresh_max].
enum class AddressFamilies : uint8_t { Any, Ipv4, Ipv6 };  // which of A and AAAA are asked
// What a failing name does once `hold` has passed since its last good answer (HAProxy's `hold`):
// drop its backends (no new connections; /readyz 503) or keep the last good set.
enum class AfterHold : uint8_t { Empty, Keep };
// At start, a name that does not resolve stops the relay (HAProxy's default init-addr) or
// starts the cluster empty (HAProxy's `init-addr none`) and keeps asking.
enum class StartupPolicy : uint8_t { Fail, Empty };

std::string_view familiesName(AddressFamilies f);

struct DiscoveryConfig {
    std::string dns;    // an A/AAAA name; its addresses are the backends, at `port`
    std::string srv;    // or an SRV name (_service._proto.name): targets, ports, weights
    unsigned port = 0;  // with dns: required; with srv: none (each record has its own)
    AddressFamilies family = AddressFamilies::Any;
    unsigned weight = 1;  // of each backend from `dns` (SRV records carry their own)
    Duration refresh_min = std::chrono::seconds(1);
    Duration refresh_max = std::chrono::seconds(30);
    Duration hold = std::chrono::seconds(30);
    AfterHold after_hold = AfterHold::Empty;
    StartupPolicy startup = StartupPolicy::Fail;
    unsigned max_backends = 64;  // bounds the backend label's cardinality too

    bool enabled() const { return !dns.empty() || !srv.empty(); }
    const std::string& name() const { return dns.empty() ? srv : dns; }
    bool operator==(const DiscoveryConfig&) const = default;
};

// What happens to a backend's live connections when checks take it down (HAProxy's
// `on-marked-down shutdown-sessions`), and to the backups' when a primary comes back up
// (`on-marked-up shutdown-backup-sessions`). `none`: they finish on their own.
enum class OnMarkedDown : uint8_t { None, ShutdownSessions };
enum class OnMarkedUp : uint8_t { None, ShutdownBackupSessions };

struct ClusterConfig {
    std::string name;  // unique; the `cluster` label of its metrics
    Balance balance = Balance::RoundRobin;
    ProxyVersion send_proxy = ProxyVersion::Off;
    // Connect attempts after the first, each to another backend, all within the listener's
    // connect_timeout.
    unsigned retries = 2;
    // Passive ejection: this many connect failures in a row take a backend down, until health
    // checks bring it back or, without them, for fail_timeout. 0 = never.
    unsigned max_fails = 3;
    Duration fail_timeout = std::chrono::seconds(10);
    // Local address for upstream sockets (port 0: IP_BIND_ADDRESS_NO_PORT); unset = the kernel's.
    SocketAddress source;
    KeepaliveConfig tcp_keepalive;
    HealthCheckConfig health_check;
    OnMarkedDown on_marked_down = OnMarkedDown::None;
    OnMarkedUp on_marked_up = OnMarkedUp::None;
    // With every primary down: all backups up take connections (HAProxy's `option
    // allbackups`), or only the first in the list.
    bool all_backups = false;
    // A backend that comes up (checks, passive ejection's end, the runtime API's ready, added
    // by discovery or a reload) takes a share of its weight that grows linearly to all of it
    // over this (HAProxy's `slowstart`); 0 = at once.
    Duration slow_start{0};
    // With every backend that may take a client at its max_connections: clients wait for a
    // place, at most queue_size per worker and queue_timeout each (HAProxy's queue and `timeout
    // queue`); past either they are closed (queue_full, queue_timeout).
    unsigned queue_size = 1024;
    Duration queue_timeout = std::chrono::seconds(5);
    // Either backends, or discovery (then backends is empty here: the Runtime takes the
    // discovered set).
    std::vector<BackendConfig> backends;
    DiscoveryConfig discovery;

    bool operator==(const ClusterConfig&) const = default;
};

// One of a listener's `routes`: the first route whose conditions all hold takes the client
// (routes.hpp). Conditions come from the TLS ClientHello, which is peeked, never consumed.
struct RouteConfig {
    std::string name;  // unique in its listener; unset: the cluster's name
    // Server names, lowercase without a trailing dot, compared case-insensitively;
    // "*.example.com" matches exactly one label before ".example.com". Empty: any (or none).
    std::vector<std::string> sni;
    // ALPN protocol names: the route matches when the client offers any of them. Empty: any.
    std::vector<std::string> alpn;
    std::string cluster;

    bool conditional() const { return !sni.empty() || !alpn.empty(); }
    bool operator==(const RouteConfig&) const = default;
};

struct ListenerConfig {
    std::string name;  // unique; the `listener` label of every metric
    SocketAddress listen;
    // Where clients go: a named cluster, or `upstream`, the shorthand for a cluster of one
    // backend that carries the listener's name (clustersOf() makes it); at most one of the two.
    // With `routes`, that cluster is the default route (named after it) unless a route without
    // a condition comes first; without `routes`, one of the two is required.
    std::string cluster;
    SocketAddress upstream;
    // Route by the client's TLS ClientHello (server name, ALPN): each client's first bytes are
    // inspected, for at most inspect_timeout and inspect_max_size, before a backend is chosen.
    std::vector<RouteConfig> routes;
    Duration inspect_timeout = std::chrono::seconds(5);
    uint64_t inspect_max_size = 16 * 1024;
    // Expect a PROXY v1/v2 header from each client first (proxy_protocol.hpp); the address in
    // it is the client's from then on. A header not complete within proxy_timeout, malformed,
    // or longer than proxy_max_size closes the connection.
    bool accept_proxy = false;
    Duration proxy_timeout = std::chrono::seconds(5);
    uint64_t proxy_max_size = 1024;
    // Live connections this listener holds at most (0 = no limit); at the limit it stops
    // accepting and clients wait in the kernel's accept queue.
    uint64_t max_connections = 0;
    // Live connections one client address may hold (0 = no limit); past it a new one is closed.
    uint64_t max_connections_per_source = 0;
    KeepaliveConfig tcp_keepalive;  // on the client socket
    Mode mode = Mode::Splice;
    // mode auto: a worker promotes an interactive connection to sockmap only while it relays at
    // most this many of the listener's connections. 0: none is ever promoted.
    unsigned auto_sockmap_max = 2;
    uint64_t pipe_size = 1 << 20;  // the size a busy direction's pipe grows to (starts at 64 KiB)
    Duration connect_timeout = std::chrono::seconds(5);
    Duration idle_timeout = std::chrono::seconds(300);  // 0 = never
    // Half-closed connections (HAProxy's `timeout client-fin` / `server-fin`): once the
    // backend's FIN was passed on to the client, the client may stay this long without a byte
    // either way (client_fin_timeout); once the client's FIN was passed on to the backend, the
    // backend may (server_fin_timeout). 0 = idle_timeout alone.
    Duration client_fin_timeout{0};
    Duration server_fin_timeout{0};
    // A connection older than this (plus up to `jitter`, fixed per connection) is ended
    // gracefully: both sides stop being read, what was read is delivered, both get a FIN.
    // 0 = no limit.
    Duration max_connection_duration{0};
    Duration max_connection_duration_jitter{0};
    // TCP_NODELAY on the client and upstream sockets. On by default, as in nginx: request/response
    // traffic must not wait for Nagle. Off lets the kernel coalesce a bulk flow's small sends.
    bool tcp_nodelay = true;
    // TCP_NOTSENT_LOWAT on both sockets in splice and copy mode (0: not set): unsent bytes a
    // socket takes before it reports itself full, so that bulk bytes wait in the relay's pipe
    // and the relay sends them, not the peer's ACK processing on another CPU (tcp_options.cpp).
    uint64_t notsent_lowat = 128 * 1024;
    // Bytes moved by copy (copy mode, sockmap's passed bytes, a splice direction without a pipe)
    // are sent with IORING_OP_SEND_ZC when a send has at least 16 KiB: less CPU per byte, but
    // each buffer stays held until the peer acknowledged its bytes (pump/copy_pump.hpp).
    bool send_zerocopy = false;

    bool operator==(const ListenerConfig&) const = default;
};

// The HTTP endpoint of /metrics, /healthz and /readyz (http_server.hpp has what each limit
// does).
struct MetricsConfig {
    bool enabled = true;   // `metrics: {listen: ""}` or `metrics: {enabled: false}` turns it off
    SocketAddress listen;  // default 127.0.0.1:9100
    SocketAddress health_listen;  // unset: probes are served on `listen` only
    Duration request_timeout = std::chrono::seconds(5);
    unsigned max_connections = 64;  // per address served
    uint64_t max_request_size = 8192;

    bool operator==(const MetricsConfig&) const = default;
};

// How discovery asks DNS (c-ares): nameservers from resolv_conf unless listed here; search
// domains and ndots from resolv_conf always (Kubernetes relies on them).
struct ResolversConfig {
    std::vector<SocketAddress> nameservers;  // "127.0.0.1:53"; empty: resolv_conf's
    std::string resolv_conf = "/etc/resolv.conf";
    Duration timeout = std::chrono::seconds(1);  // per attempt, per nameserver
    unsigned attempts = 3;

    bool operator==(const ResolversConfig&) const = default;
};

// The runtime API (admin_api.hpp): JSON over HTTP on its own address, off unless `listen` is
// set. Without token_file it must be loopback or a unix socket; with it, every request needs
// "Authorization: Bearer <the file's first line>".
struct AdminConfig {
    SocketAddress listen;
    std::string token_file;
    Duration request_timeout = std::chrono::seconds(5);
    unsigned max_connections = 16;

    bool enabled() const { return listen.length != 0; }
    bool operator==(const AdminConfig&) const = default;
};

// One line per finished connection (access_log.hpp). path "" = off, "-" or "stdout" = stdout.
struct AccessLogConfig {
    std::string path;
    AccessLogFormat format = AccessLogFormat::Json;

    bool operator==(const AccessLogConfig&) const = default;
};

struct Config {
    unsigned workers = 0;  // 0 in the struct never escapes loading: resolved to online CPUs
    Duration drain_timeout = std::chrono::seconds(30);
    uint64_t max_pipes = 4096;  // pipes (2 fds each) the whole process may hold; 0 = never splice
    // Live connections over all listeners (0 = no limit): accepting stops at the limit.
    uint64_t max_connections = 0;
    // Once the listeners are bound and the sockmap program is loaded, run as this user and
    // group, keeping only CAP_NET_BIND_SERVICE (privileges.hpp). "" = stay as started.
    // `group` defaults to the user's primary group. Resolved at load: uid/gid are the ids (the
    // name's, or the number written), valid when `user` is set.
    std::string user;
    std::string group;
    uint32_t uid = 0;
    uint32_t gid = 0;
    // Where `zcrelay --takeover` reaches this relay for its listening sockets (takeover.hpp):
    // an absolute path of a unix socket, or "" for none.
    std::string takeover_socket;
    MetricsConfig metrics;
    AccessLogConfig access_log;
    ResolversConfig resolvers;
    AdminConfig admin;
    std::vector<ClusterConfig> clusters;  // as declared; see clustersOf()
    std::vector<ListenerConfig> listeners;

    bool operator==(const Config&) const = default;
};

// Every cluster a config runs: the declared ones, then one per `upstream:` listener (named
// after it, one backend, defaults otherwise). Listener i's `cluster` or `upstream` is
// clustersOf(c)[clusterIndex(c, i)]; kNoCluster when it has neither (routes only).
std::vector<ClusterConfig> clustersOf(const Config& config);
inline constexpr size_t kNoCluster = SIZE_MAX;
size_t clusterIndex(const Config& config, size_t listener);
// The index in clustersOf(c) of the declared cluster `name` (checked at load: it exists).
size_t clusterNamed(const Config& config, std::string_view name);
// With routes: the cluster of the default route the listener's `cluster` or `upstream` adds
// after them (the route is named after it), or "" when it adds none (neither key, or a route
// without a condition is the default already).
std::string_view implicitDefaultRoute(const ListenerConfig& listener);

// Thrown only while loading; main() catches it. what() reads e.g.
//   "config.yaml:7:5: listeners[0].pipe_size: \"32MiB\" is out of range (4KiB..16MiB)"
// i.e. source:line:column: key path: what is wrong.
class ConfigError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// Reads only a regular file of at most `max_size` bytes (without blocking on a FIFO, without
// reading a device until memory runs out); anything else is a ConfigError naming what it is.
inline constexpr uint64_t kMaxConfigSize = 1 << 20;
Config loadConfigFile(const std::string& path, uint64_t max_size = kMaxConfigSize);
// `source` names the text in errors (a file name, "<default>", "<command line>").
Config loadConfigString(std::string_view yaml, std::string_view source);

// The embedded default: one listener 127.0.0.1:10000 -> 127.0.0.1:9999, metrics on
// 127.0.0.1:9100. `zcrelay --print-default-config` prints it; loading it yields the defaults.
std::string_view defaultConfigYaml();

// The effective configuration, as YAML that loadConfigString() accepts back (printed at start).
std::string renderConfig(const Config& config);

// Sets one key from a command-line flag through the same parsing, range checks and messages as
// the YAML key; errors read "<command line>: --workers: ...". `key` is a top-level key
// ("workers"), "metrics.listen" (an address, or "" to turn metrics off; any address turns them
// on), or a listener key ("listen", "mode", ...), which is set on every listener.
void applyFlag(Config& config, std::string_view key, std::string_view value, std::string_view flag);

}  // namespace zcrelay
