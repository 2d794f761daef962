#pragma once
// Internal to the config loader (the config_*.cpp files); everything else includes config.hpp.
// Reading YAML nodes against the key tables (config_keys.hpp) with each error's line and
// column, and the steps of parseConfig() that one config_*.cpp calls in another. The
// config_*.cpp files are the only ones that include yaml-cpp: the structs of config.hpp are
// what the rest of the relay sees.
#include <yaml-cpp/yaml.h>

#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "config_keys.hpp"

namespace zcrelay::config_detail {

// The error location of a node, of its mark, or of the value of `key` in `map` (the map itself
// when the key is absent).
Where whereAt(std::string_view source, const YAML::Mark& mark, std::string path);
Where whereOf(std::string_view source, const YAML::Node& node, std::string path);
Where whereOfKey(std::string_view source, const YAML::Node& map, const char* key, std::string path);
// "a map", "a sequence", "a scalar" or "nothing", for "expected ..., got ..." errors.
std::string typeName(const YAML::Node& node);

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
                                       const std::string& path, std::string_view item);

// The steps of loading, in the order parseConfig() takes them; errors are thrown (fail()).

// config_load.cpp: the text, as one YAML document, to a Config; everything but resolving
// `workers`, so the embedded default can be rendered machine-neutral.
Config parseConfig(std::string_view yaml, std::string_view source);

// config_sections.cpp: one map of the config each (`nested` is the top level's, by key).
void parseResolvers(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                    ResolversConfig& resolvers);
void parseAdmin(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                AdminConfig& admin);
void parseMetrics(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                  MetricsConfig& metrics);
void resolveRunAs(std::string_view source, const YAML::Node& root, Config& config);
// `takeover_socket`: an absolute path short enough for a unix socket address, or unset.
void checkTakeoverSocket(std::string_view source, const YAML::Node& root, const Config& config);
void parseClusters(std::string_view source, const YAML::Node& list, Config& config);
void parseListeners(std::string_view source, const YAML::Node& list, Config& config);

// config_checks.cpp: the rules a value must follow beyond its key's range, and the checks
// across sections.
void checkTcpAddress(std::string_view source, const YAML::Node& map, const char* key,
                     const std::string& path, const SocketAddress& a);
bool validDnsName(std::string_view name);
bool loopbackOrUnix(const SocketAddress& a);
void checkAdminOwnAddress(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                          const Config& config);
std::vector<std::pair<std::string, SocketAddress>> ownAddresses(const Config& config);
void checkBackendTarget(const Where& at, const SocketAddress& a,
                        const std::vector<std::pair<std::string, SocketAddress>>& own,
                        std::optional<std::vector<SocketAddress>>& local);
void checkBackendTargets(std::string_view source, const std::map<std::string, YAML::Node>& nested,
                         const Config& config);

}  // namespace zcrelay::config_detail
