#pragma once
// A SIGHUP's config is read, parsed and checked by a child process, never by the relay:
//
//   /proc/self/exe ARGS... --dump-config
//
// the same binary with the relay's own arguments, so it loads exactly what a start would. Its
// stdout is the config rendered whole (renderConfig: canonical YAML that loads back to an equal
// Config), its stderr the error. The relay then loads that rendering, whose size follows what
// the config configures, not what the file holds.
//
// Why a process. yaml-cpp holds every node of a file in memory, about 500 bytes each, so 1 MiB
// of `[1],[1],...` takes 260 MiB to parse. Parsed in the relay, that memory was the relay's:
// under an address-space limit the first allocation to fail was as likely another thread's (the
// metrics endpoint building a scrape: an uncaught std::bad_alloc, the relay gone with every
// connection) as the parser's; under a cgroup memory limit (a pod's) the OOM killer would end
// the relay. The child caps its own address space and makes itself the OOM killer's first
// choice (limitConfigReader), and the relay kills it past a deadline, so whatever a file does
// (a hung filesystem included) ends the child, never the relay.
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "config.hpp"
#include "units.hpp"

namespace zcrelay {

// How long the child may take before it is killed and the reload refused.
inline constexpr Duration kConfigReadDeadline = std::chrono::seconds(10);

class ConfigReader {
  public:
    using Outcome = std::variant<Config, std::string>;  // the config, or why it was refused

    // Starts a thread that runs the child with `args` (the relay's argv past argv[0]) and
    // waits for it. `source` names the config in errors (its path, or "<command line>"). Never throws: a
    // child or thread that cannot start is an outcome like any other.
    ConfigReader(const std::vector<std::string>& args, const std::string& source);
    // The outcome, once there is one (the child ended, or was killed at the deadline).
    std::optional<Outcome> take();

    struct State;  // shared with the reading thread (config_reader.cpp)

  private:
    std::shared_ptr<State> state_;
};

// In the child (main() with --dump-config), before anything is read: RLIMIT_AS to what a config
// of at most `max_config_size` bytes may need, and oom_score_adj 1000. Not in sanitizer builds,
// whose shadow memory needs terabytes of address space.
void limitConfigReader(uint64_t max_config_size);
// The address space the child is given: 512 MiB, and 128 bytes for each byte of file (the worst
// YAML measured needs about 260 MiB for 1 MiB).
uint64_t configReaderAddressSpace(uint64_t max_config_size);

}  // namespace zcrelay
