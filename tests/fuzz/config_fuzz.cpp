// libFuzzer target for the config loader (tests/fuzz/CMakeLists.txt): a config file is operator input, and a reload reads
// it into a running relay. Any text must load or fail with a ConfigError; anything else thrown,
// or a crash, is a bug. A config that loads must render back to text that loads to the same.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    std::string_view text(reinterpret_cast<const char*>(data), size);
    zcrelay::Config config;
    try {
        config = zcrelay::loadConfigString(text, "<fuzz>");
    } catch (const zcrelay::ConfigError&) {
        return 0;
    }
    zcrelay::Config again = zcrelay::loadConfigString(zcrelay::renderConfig(config), "<rendered>");
    if (!(again == config)) __builtin_trap();
    return 0;
}
