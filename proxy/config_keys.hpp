#pragma once
// Internal to the config loader (the config_*.cpp files); everything else includes config.hpp.
// A config key as one row of a table (name, kind, default, range, help), and the parsing every
// key's text goes through. The tables are in config_keys.cpp; the YAML reader (parseMap), the
// rendering (config_render.cpp) and applyFlag() all read them, so defaults, ranges, help and
// error texts cannot drift apart. No yaml-cpp here: a command-line flag takes the same path.
#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>

#include "config.hpp"
#include "units.hpp"

namespace zcrelay::config_detail {

// Where a value came from, for the one-line error "source:line:column: key path: what".
struct Where {
    std::string_view source;
    int line = 0;  // 1-based; 0 when the text has no position (a command-line flag)
    int column = 0;
    std::string path;
};

// Throws the ConfigError "source:line:column: path: what" (no line and column when `at` has none).
[[noreturn]] void fail(const Where& at, std::string_view what);

// The named values of each enum a key can take, in the order help texts list them.
template <class E>
struct Choices;
template <>
struct Choices<Mode> {
    static constexpr std::string_view noun = "mode";
#define ZCRELAY_MODE_VALUE(name, label) Mode::name,
    static constexpr std::array values = {ZCRELAY_MODES(ZCRELAY_MODE_VALUE)};
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

template <>
struct Choices<OnMarkedDown> {
    static constexpr std::string_view noun = "choice of on_marked_down";
    static constexpr std::array values = {OnMarkedDown::None, OnMarkedDown::ShutdownSessions};
    static std::string_view name(OnMarkedDown m) {
        return m == OnMarkedDown::None ? "none" : "shutdown_sessions";
    }
};
template <>
struct Choices<OnMarkedUp> {
    static constexpr std::string_view noun = "choice of on_marked_up";
    static constexpr std::array values = {OnMarkedUp::None, OnMarkedUp::ShutdownBackupSessions};
    static std::string_view name(OnMarkedUp m) {
        return m == OnMarkedUp::None ? "none" : "shutdown_backup_sessions";
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
                            OnMarkedDown T::*, OnMarkedUp T::*, std::string T::*, bool T::*>;

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

// The tables, one per map of the config (config_keys.cpp).
extern const std::span<const Key<Config>> kTopKeys;
extern const std::span<const Key<AccessLogConfig>> kAccessLogKeys;
extern const std::span<const Key<KeepaliveConfig>> kKeepaliveKeys;
extern const std::span<const Key<HealthCheckConfig>> kHealthCheckKeys;
extern const std::span<const Key<HttpCheckConfig>> kHttpCheckKeys;
extern const std::span<const Key<BackendConfig>> kBackendKeys;
extern const std::span<const Key<ClusterConfig>> kClusterKeys;
extern const std::span<const Key<DiscoveryConfig>> kDiscoveryKeys;
extern const std::span<const Key<ResolversConfig>> kResolversKeys;
extern const std::span<const Key<AdminConfig>> kAdminKeys;
extern const std::span<const Key<MetricsConfig>> kMetricsKeys;
extern const std::span<const Key<ListenerConfig>> kListenerKeys;
extern const std::span<const Key<RouteConfig>> kRouteKeys;

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

}  // namespace zcrelay::config_detail
