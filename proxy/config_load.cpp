// Loading: a file (only a regular one, within its size), a string (one YAML document), a
// command-line flag (one key); parseConfig() runs the sections and checks in their order.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/eventhandler.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "config_yaml.hpp"
#include "file_kind.hpp"
#include "unique_fd.hpp"

namespace zcrelay {
namespace config_detail {
namespace {

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

}  // namespace

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
    parseMetrics(source, nested, config.metrics);
    checkAdminOwnAddress(source, nested, config);
    parseNestedMap<AccessLogConfig>(source, nested, "access_log", "access_log", kAccessLogKeys,
                                    config.access_log);
    resolveRunAs(source, root, config);
    checkTakeoverSocket(source, root, config);

    if (const auto clusters = nested.find("clusters"); clusters != nested.end())
        parseClusters(source, clusters->second, config);
    const auto listeners = nested.find("listeners");
    if (listeners == nested.end()) fail(whereOf(source, root, "listeners"), "missing required key");
    parseListeners(source, listeners->second, config);
    checkBackendTargets(source, nested, config);
    return config;
}

}  // namespace config_detail

namespace {

unsigned onlineCpus() {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return static_cast<unsigned>(std::clamp(n, 1L, 256L));
}

}  // namespace

Config loadConfigString(std::string_view yaml, std::string_view source) {
    // Whatever goes wrong while loading is a refused config, never an exception that ends the
    // process: yaml-cpp's own (a node read as what it is not), memory running out.
    try {
        Config config = config_detail::parseConfig(yaml, source);
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

void applyFlag(Config& config, std::string_view key, std::string_view value,
               std::string_view flag) {
    using namespace config_detail;  // here only: a unity build batches this file with others
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
