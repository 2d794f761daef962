#pragma once
// Config and address values as the unit cases build and check them: the error a config load
// throws, two configs compared, an address from its text, and an address printed as text.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <string_view>

#include "address.hpp"
#include "config.hpp"

namespace zcrelay {

// gtest shows failures as text, not as 128 bytes of sockaddr_storage.
inline void PrintTo(const SocketAddress& a, std::ostream* os) { *os << a.toString(); }

namespace unit {

// The message of the ConfigError that `load` throws, or a marker that fails any comparison. The
// one catch of the loader's exception for every unit case (cli_test's cliErrorOf too).
template <class F>
std::string errorOf(F&& load) {
    try {
        load();
    } catch (const ConfigError& e) {
        return e.what();
    }
    return "(no error)";
}

inline std::string errorOfYaml(const std::string& yaml) {
    return errorOf([&] { loadConfigString(yaml, "t.yaml"); });
}

// renderConfig() shows which field differs; == also covers anything it would not print.
inline void expectSameConfig(const Config& a, const Config& b) {
    EXPECT_EQ(renderConfig(a), renderConfig(b));
    EXPECT_TRUE(a == b);
}

// A text the case knows is an address; a typo fails the case instead of throwing.
inline SocketAddress addr(std::string_view text) {
    auto a = parseAddress(text);
    EXPECT_TRUE(a) << text << ": " << a.error();
    return a.value_or(SocketAddress{});
}

}  // namespace unit
}  // namespace zcrelay
