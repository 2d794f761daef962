#include "config.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <initializer_list>
#include <map>
#include <span>
#include <type_traits>
#include <variant>

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

constexpr std::array kModes = {Mode::Splice, Mode::Copy, Mode::Sockmap};

// How a key's text parses, renders and states its range.
enum class Kind { Count, Duration, Size, Address, OptionalAddress, Mode, Name, Bool };

template <class T>
using Member = std::variant<unsigned T::*, uint64_t T::*, Duration T::*, SocketAddress T::*,
                            Mode T::*, std::string T::*, bool T::*>;

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
    std::string_view help;  // one line, for the example config
};

constexpr uint64_t ms(Duration d) { return static_cast<uint64_t>(d.count()); }
constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;

const Key<Config> kTopKeys[] = {
    {.name = "workers",
     .kind = Kind::Count,
     .member = &Config::workers,
     .min = 1,
     .max = 256,
     .help = "worker threads, one io_uring each; unset: one per online CPU"},
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
    {.name = "upstream",
     .kind = Kind::Address,
     .member = &ListenerConfig::upstream,
     .required = true,
     .help = "required: where each client's bytes are relayed to"},
    {.name = "mode",
     .kind = Kind::Mode,
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
};

template <class T>
std::string rangeText(const Key<T>& key) {
    switch (key.kind) {
        case Kind::Count:
            return std::to_string(key.min) + ".." + std::to_string(key.max);
        case Kind::Size:
            return formatSize(key.min) + ".." + formatSize(key.max);
        case Kind::Duration:
            return formatDuration(Duration(key.min)) + ".." + formatDuration(Duration(key.max));
        case Kind::Mode: {
            std::string names;
            for (Mode m : kModes) names += (names.empty() ? "" : ", ") + std::string(modeName(m));
            return names;
        }
        default:
            return "";
    }
}

std::string expectedText(Kind kind) {
    switch (kind) {
        case Kind::Count:
            return "a whole number";
        case Kind::Duration:
            return "a duration such as 5s";
        case Kind::Size:
            return "a size such as 64KiB";
        case Kind::Address:
        case Kind::OptionalAddress:
            return "an address such as 127.0.0.1:10000";
        case Kind::Mode:
            return "splice or copy";
        case Kind::Name:
            return "a name";
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

template <class T>
void assign(Mode& out, const Key<T>& key, std::string_view text, const Where& at) {
    for (Mode m : kModes) {
        if (modeName(m) == text) {
            out = m;
            return;
        }
    }
    fail(at, quoted(text) + " is not a mode; expected one of: " + rangeText(key));
}

template <class T>
void assign(std::string& out, const Key<T>&, std::string_view text, const Where& at) {
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
        const Where key_at = whereOf(source, pair.first, prefix + name);
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
        const Where value_at = value.IsNull() ? key_at : whereOf(source, value, prefix + name);
        if (!value.IsScalar()) {
            fail(value_at, "expected " + expectedText(key->kind) + ", got " + typeName(value));
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

void parseListeners(std::string_view source, const YAML::Node& list, Config& config) {
    const Where at = whereOf(source, list, "listeners");
    if (!list.IsSequence()) fail(at, "expected a sequence of listeners, got " + typeName(list));
    if (list.size() == 0) fail(at, "empty; at least one listener is needed");
    for (size_t i = 0; i < list.size(); ++i) {
        const YAML::Node node = list[i];
        const std::string path = "listeners[" + std::to_string(i) + "]";
        if (!node.IsMap()) {
            fail(whereOf(source, node, path), "expected a map, got " + typeName(node));
        }
        ListenerConfig listener;
        parseMap<ListenerConfig>(source, node, path + ".", kListenerKeys, listener);
        if (listener.name.empty()) listener.name = "listener" + std::to_string(i);
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

// Everything but resolving `workers`, so the embedded default can be rendered machine-neutral.
Config parseConfig(std::string_view yaml, std::string_view source) {
    YAML::Node root;
    try {
        root = YAML::Load(std::string(yaml));
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
        parseMap<Config>(source, root, "", kTopKeys, config, {"metrics", "listeners"});

    const auto metrics = nested.find("metrics");
    if (metrics != nested.end() && !metrics->second.IsMap()) {
        fail(whereOf(source, metrics->second, "metrics"),
             "expected a map, got " + typeName(metrics->second));
    }
    // An absent `metrics` parses as an empty map: every key takes its default.
    parseMap<MetricsConfig>(
        source, metrics != nested.end() ? metrics->second : YAML::Node(YAML::NodeType::Map),
        "metrics.", kMetricsKeys, config.metrics);
    config.metrics.enabled = config.metrics.enabled && config.metrics.listen.length != 0;

    const auto listeners = nested.find("listeners");
    if (listeners == nested.end()) fail(whereOf(source, root, "listeners"), "missing required key");
    parseListeners(source, listeners->second, config);
    return config;
}

unsigned onlineCpus() {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return static_cast<unsigned>(std::clamp(n, 1L, 256L));
}

template <class T>
std::string renderValue(const T& target, const Key<T>& key) {
    const auto show = [&](const auto& value) -> std::string {
        using V = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<V, unsigned>) return value == 0 ? "" : std::to_string(value);
        if constexpr (std::is_same_v<V, uint64_t>)
            return key.kind == Kind::Size ? formatSize(value) : std::to_string(value);
        if constexpr (std::is_same_v<V, Duration>) return formatDuration(value);
        // IPv6 must be quoted: a plain "[" would open a YAML sequence.
        if constexpr (std::is_same_v<V, SocketAddress>)
            return value.family() == AF_INET ? value.toString() : quoted(value.toString());
        if constexpr (std::is_same_v<V, Mode>) return std::string(modeName(value));
        // Quoted so names such as "null" or "-" read back as the same string.
        if constexpr (std::is_same_v<V, std::string>) return quoted(value);
        if constexpr (std::is_same_v<V, bool>) return value ? "true" : "false";
    };
    return std::visit([&](auto member) { return show(target.*member); }, key.member);
}

// `first_indent` replaces `indent` on the first line (the "- " of a sequence item).
template <class T>
void renderKeys(std::string& out, const T& target, std::span<const Key<T>> keys, bool with_help,
                std::string_view indent, std::string_view first_indent) {
    for (size_t i = 0; i < keys.size(); ++i) {
        const Key<T>& key = keys[i];
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

std::string render(const Config& config, bool with_help) {
    std::string out;
    renderKeys<Config>(out, config, kTopKeys, with_help, "", "");
    out += "metrics:\n";
    renderKeys<MetricsConfig>(out, config.metrics, kMetricsKeys, with_help, "  ", "  ");
    out += "listeners:\n";
    for (const ListenerConfig& listener : config.listeners) {
        renderKeys<ListenerConfig>(out, listener, kListenerKeys, with_help, "    ", "  - ");
    }
    return out;
}

}  // namespace

std::string_view modeName(Mode m) {
    switch (m) {
        case Mode::Splice:
            return "splice";
        case Mode::Copy:
            return "copy";
        case Mode::Sockmap:
            return "sockmap";
    }
    return "?";
}

Config loadConfigString(std::string_view yaml, std::string_view source) {
    Config config = parseConfig(yaml, source);
    if (config.workers == 0) config.workers = onlineCpus();
    return config;
}

Config loadConfigFile(const std::string& path) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    std::string text;
    int error = fd < 0 ? errno : 0;
    for (char buf[8192]; error == 0;) {
        const ssize_t n = read(fd, buf, sizeof(buf));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) error = errno;
        if (n <= 0) break;
        text.append(buf, static_cast<size_t>(n));
    }
    if (fd >= 0) close(fd);
    if (error != 0) throw ConfigError(path + ": cannot read: " + std::strerror(error));
    return loadConfigString(text, path);
}

std::string_view defaultConfigYaml() {
    static const std::string yaml = [] {
        constexpr std::string_view kHeader =
            "# zcrelay configuration, printed by `zcrelay --print-default-config`.\n"
            "# Every key shows its default; only listeners[].listen and .upstream are required.\n"
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
    if (const auto* top = findKey<Config>(kTopKeys, key)) {
        return parseValue(config, *top, value, at);
    }
    if (key == "metrics.listen") {
        parseValue(config.metrics, *findKey<MetricsConfig>(kMetricsKeys, "listen"), value, at);
        config.metrics.enabled = config.metrics.listen.length != 0;
        return;
    }
    if (const auto* listener_key = findKey<ListenerConfig>(kListenerKeys, key)) {
        for (ListenerConfig& listener : config.listeners) {
            parseValue(listener, *listener_key, value, at);
        }
        return;
    }
    throw std::logic_error("applyFlag: no config key " + std::string(key));
}

}  // namespace zcrelay
