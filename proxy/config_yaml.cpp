#include "config_yaml.hpp"

namespace zcrelay::config_detail {

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

Where whereOfKey(std::string_view source, const YAML::Node& map, const char* key,
                 std::string path) {
    const YAML::Node value = map[key];
    return whereOf(source, value.IsDefined() ? value : map, std::move(path));
}

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

}  // namespace zcrelay::config_detail
