#pragma once
// The relay's configuration: plain structs out, every error found before anything starts.
// config.cpp is the only file that includes yaml-cpp.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "address.hpp"
#include "units.hpp"

namespace zcrelay {

// How a listener's connections move bytes.
//   Splice: socket -> pipe -> socket with splice(2); the bytes never enter user space.
//   Copy:   io_uring recv/send through a provided buffer ring (the baseline and the fallback).
//   Sockmap: an eBPF sk_skb verdict redirects each socket's bytes to the other's egress inside
//           the kernel (bpf/relay.bpf.c): the low-latency path. Runs as splice where the
//           program cannot load (no CAP_BPF/CAP_NET_ADMIN).
enum class Mode : uint8_t { Splice, Copy, Sockmap };
std::string_view modeName(Mode m);

struct ListenerConfig {
    std::string name;  // unique; the `listener` label of every metric
    SocketAddress listen;
    SocketAddress upstream;
    Mode mode = Mode::Splice;
    uint64_t pipe_size = 1 << 20;  // the size a busy direction's pipe grows to (starts at 64 KiB)
    Duration connect_timeout = std::chrono::seconds(5);
    Duration idle_timeout = std::chrono::seconds(300);  // 0 = never
    // TCP_NODELAY on the client and upstream sockets. On by default, as in nginx: request/response
    // traffic must not wait for Nagle. Off lets the kernel coalesce a bulk flow's small sends.
    bool tcp_nodelay = true;
    // TCP_NOTSENT_LOWAT on both sockets in splice and copy mode (0: not set): unsent bytes a
    // socket takes before it reports itself full, so that bulk bytes wait in the relay's pipe
    // and the relay sends them, not the peer's ACK processing on another CPU (tcp_options.cpp).
    uint64_t notsent_lowat = 128 * 1024;

    bool operator==(const ListenerConfig&) const = default;
};

struct MetricsConfig {
    bool enabled = true;   // `metrics: {listen: ""}` or `metrics: {enabled: false}` turns it off
    SocketAddress listen;  // default 127.0.0.1:9100

    bool operator==(const MetricsConfig&) const = default;
};

struct Config {
    unsigned workers = 0;  // 0 in the struct never escapes loading: resolved to online CPUs
    Duration drain_timeout = std::chrono::seconds(30);
    uint64_t max_pipes = 4096;  // pipes (2 fds each) the whole process may hold; 0 = never splice
    MetricsConfig metrics;
    std::vector<ListenerConfig> listeners;

    bool operator==(const Config&) const = default;
};

// Thrown only while loading; main() catches it. what() reads e.g.
//   "config.yaml:7:5: listeners[0].pipe_size: \"32MiB\" is out of range (4KiB..16MiB)"
// i.e. source:line:column: key path: what is wrong.
class ConfigError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

Config loadConfigFile(const std::string& path);
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
