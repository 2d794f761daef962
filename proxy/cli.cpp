#include "cli.hpp"

#include <algorithm>
#include <utility>

namespace zcrelay {
namespace {

constexpr std::string_view kSource = "<command line>";

// One flag: parseCli() and usageText() both read this table.
struct Flag {
    std::string_view name;
    std::string_view alias;  // a short form, or ""
    std::string_view arg;    // the value's name in the usage text; "" = takes no value
    std::optional<std::string> CliOptions::*target;  // where the value goes, or nullptr
    CliAction action;
    std::string_view help;
};

const Flag kFlags[] = {
    {"--config", "-c", "FILE", &CliOptions::config_path, CliAction::Run,
     "load the configuration from FILE instead of the embedded default"},
    {"--check-config", "", "FILE", &CliOptions::config_path, CliAction::CheckConfig,
     "load and validate FILE, say OK or what is wrong, exit"},
    {"--dump-config", "", "", nullptr, CliAction::DumpConfig,
     "load the config as a start or SIGHUP would (with the other flags), print it whole, exit"},
    {"--print-default-config", "", "", nullptr, CliAction::PrintDefaultConfig,
     "print the embedded default configuration (every key, commented) and exit"},
    {"--listen", "", "ADDR", &CliOptions::listen, CliAction::Run,
     "without a config file: accept clients on ADDR, e.g. 127.0.0.1:10000 (needs --upstream)"},
    {"--upstream", "", "ADDR", &CliOptions::upstream, CliAction::Run,
     "without a config file: relay each client to ADDR (needs --listen)"},
    {"--mode", "", "splice|copy|sockmap|auto", &CliOptions::mode, CliAction::Run,
     "data path of every listener (overrides the config)"},
    {"--workers", "", "N", &CliOptions::workers, CliAction::Run,
     "worker threads, 1..256 (overrides the config; default: one per online CPU)"},
    {"--metrics", "", "ADDR|off", &CliOptions::metrics, CliAction::Run,
     "Prometheus scrape address, or off (overrides the config)"},
    {"--takeover", "", "", nullptr, CliAction::Run,
     "take the listening sockets over from the relay running on the config's takeover_socket, "
     "which then drains: an upgrade or restart that refuses no connection"},
    {"--max-config-size", "", "SIZE", &CliOptions::max_config_size, CliAction::Run,
     "refuse a config file larger than SIZE (default 1MiB, at most 64MiB)"},
    {"--version", "", "", nullptr, CliAction::Version, "print the version and exit"},
    {"--help", "-h", "", nullptr, CliAction::Help, "print this help and exit"},
};

[[noreturn]] void fail(std::string_view what) {
    throw ConfigError(std::string(kSource) + ": " + std::string(what));
}

}  // namespace

CliOptions parseCli(const std::vector<std::string>& args) {
    CliOptions options;
    std::vector<std::pair<std::optional<std::string> CliOptions::*, std::string>> given;
    for (size_t i = 0; i < args.size(); ++i) {
        const std::string& arg = args[i];
        if (arg.size() < 2 || arg[0] != '-') {
            fail("unexpected argument \"" + arg + "\" (see --help)");
        }
        const size_t eq = arg.find('=');
        const std::string name = arg.substr(0, eq);
        const auto flag = std::find_if(std::begin(kFlags), std::end(kFlags), [&](const Flag& f) {
            return f.name == name || (!f.alias.empty() && f.alias == name);
        });
        if (flag == std::end(kFlags)) fail("unknown option " + name + " (see --help)");

        // Actions are ordered by precedence: `--check-config x --help` shows help.
        options.action = std::max(options.action, flag->action);
        if (flag->arg.empty()) {
            if (eq != std::string::npos) fail(name + ": takes no value");
            if (name == "--takeover") options.takeover = true;
            continue;
        }
        std::string value;
        if (eq != std::string::npos) {
            value = arg.substr(eq + 1);
        } else if (i + 1 < args.size()) {
            value = args[++i];
        } else {
            fail(name + ": needs a value (" + std::string(flag->arg) + ")");
        }
        // -c and --check-config share a target: the message names the earlier flag.
        for (const auto& [target, earlier] : given) {
            if (target == flag->target) fail(name + ": already given as " + earlier);
        }
        given.emplace_back(flag->target, name);
        options.*(flag->target) = std::move(value);
    }

    if (options.listen && !options.upstream) fail("--listen needs --upstream");
    if (options.upstream && !options.listen) fail("--upstream needs --listen");
    if (options.listen && options.config_path) {
        fail("--listen/--upstream replace the config file; use one or the other");
    }
    if (options.max_config_size) maxConfigSize(options);  // a bad size is a usage error
    return options;
}

uint64_t maxConfigSize(const CliOptions& options) {
    if (!options.max_config_size) return kMaxConfigSize;
    const auto size = parseSize(*options.max_config_size);
    if (!size) fail("--max-config-size: " + size.error());
    if (*size < 1024 || *size > (64u << 20))
        fail("--max-config-size: " + quoted(*options.max_config_size) +
             " is out of range (1KiB..64MiB)");
    return *size;
}

Config resolveConfig(const CliOptions& options) {
    const uint64_t max_size = maxConfigSize(options);
    Config config = options.config_path ? loadConfigFile(*options.config_path, max_size)
                                        : loadConfigString(defaultConfigYaml(), "<default>");
    // The shorthand is the default config's one listener ("default") with both ends replaced.
    if (options.listen) {
        applyFlag(config, "listen", *options.listen, "--listen");
        applyFlag(config, "upstream", *options.upstream, "--upstream");
    }
    if (options.workers) applyFlag(config, "workers", *options.workers, "--workers");
    if (options.mode) applyFlag(config, "mode", *options.mode, "--mode");
    if (options.metrics) {
        applyFlag(config, "metrics.listen", *options.metrics == "off" ? "" : *options.metrics,
                  "--metrics");
    }
    return config;
}

std::string usageText() {
    std::string text =
        "Usage: zcrelay [-c FILE] [--workers N] [--mode splice|copy|sockmap|auto] "
        "[--metrics ADDR|off] [--takeover]\n"
        "       zcrelay --listen ADDR --upstream ADDR [options]\n"
        "       zcrelay --check-config FILE | --print-default-config | --version | --help\n"
        "       zcrelay [-c FILE | --listen ADDR --upstream ADDR] [options] --dump-config\n"
        "\n"
        "A TCP relay: io_uring for the event loop, splice(2) to move the bytes.\n"
        "\n"
        "Options:\n";
    for (const Flag& flag : kFlags) {
        std::string left = "  " + std::string(flag.name);
        if (!flag.alias.empty()) {
            left = "  " + std::string(flag.alias) + ", " + std::string(flag.name);
        }
        if (!flag.arg.empty()) left += " " + std::string(flag.arg);
        left.resize(std::max<size_t>(left.size() + 2, 32), ' ');
        text += left + std::string(flag.help) + "\n";
    }
    text +=
        "\n"
        "Without -c or --listen, zcrelay runs its embedded default configuration (relay\n"
        "127.0.0.1:10000 to 127.0.0.1:9999); `zcrelay --print-default-config` shows it, with\n"
        "every key and its default, as a starting point for a config file.\n"
        "Addresses are numeric: 127.0.0.1:10000 or [::1]:10000; names are not resolved.\n";
    return text;
}

}  // namespace zcrelay
