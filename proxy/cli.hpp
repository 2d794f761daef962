#pragma once
// argv -> what main() should do. No I/O here besides building the usage text.
#include <optional>
#include <string>
#include <vector>

#include "config.hpp"

namespace zcrelay {

// In order of precedence: `-c x --dump-config --help` shows help.
enum class CliAction { Run, DumpConfig, CheckConfig, PrintDefaultConfig, Version, Help };

struct CliOptions {
    CliAction action = CliAction::Run;
    std::optional<std::string> config_path;  // -c FILE / --config FILE, or --check-config FILE
    // The config-less shorthand: --listen A --upstream B [--mode splice|copy] [--workers N].
    // --workers and --mode may also override a file or the default config.
    std::optional<std::string> listen;
    std::optional<std::string> upstream;
    std::optional<std::string> mode;
    std::optional<std::string> workers;
    std::optional<std::string> metrics;  // --metrics ADDR | --metrics off
    std::optional<std::string> max_config_size;  // --max-config-size SIZE (kMaxConfigSize)
    bool takeover = false;  // --takeover: from the relay on the config's takeover_socket
};

// Throws ConfigError naming the flag ("--workers: expected a number, got \"x\"", "unknown option
// --foo", "--listen needs --upstream").
CliOptions parseCli(const std::vector<std::string>& args);

// The config a Run/CheckConfig should use: the file (-c) or the embedded default, with the
// shorthand flags applied on top and validated exactly like the YAML (same messages, source
// "<command line>"). Throws ConfigError.
Config resolveConfig(const CliOptions& options);
// --max-config-size, or kMaxConfigSize. Throws ConfigError.
uint64_t maxConfigSize(const CliOptions& options);

std::string usageText();

}  // namespace zcrelay
