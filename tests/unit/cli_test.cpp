#include "cli.hpp"

#include <gtest/gtest.h>

#include "unit/config_values.hpp"

namespace zcrelay {
namespace {

// The message of the ConfigError that resolving `args` throws (unit::errorOf).
std::string cliErrorOf(const std::vector<std::string>& args) {
    return unit::errorOf([&] { resolveConfig(parseCli(args)); });
}

using unit::addr;

const std::string kMinimal = std::string(ZCRELAY_SOURCE_DIR) + "/config/minimal.yaml";

TEST(ParseCli, NoArgumentsRunsTheDefault) {
    const CliOptions o = parseCli({});
    EXPECT_EQ(o.action, CliAction::Run);
    EXPECT_FALSE(o.config_path);
    EXPECT_FALSE(o.listen);
}

TEST(ParseCli, AcceptsSeparateAndEqualsValues) {
    for (const auto& args : {std::vector<std::string>{"-c", "a.yaml", "--workers", "4"},
                             std::vector<std::string>{"--config=a.yaml", "--workers=4"},
                             std::vector<std::string>{"--config", "a.yaml", "--workers=4"}}) {
        const CliOptions o = parseCli(args);
        EXPECT_EQ(o.action, CliAction::Run);
        EXPECT_EQ(o.config_path, "a.yaml");
        EXPECT_EQ(o.workers, "4");
    }
}

TEST(ParseCli, Actions) {
    EXPECT_EQ(parseCli({"--check-config", "x.yaml"}).action, CliAction::CheckConfig);
    EXPECT_EQ(parseCli({"--check-config", "x.yaml"}).config_path, "x.yaml");
    EXPECT_EQ(parseCli({"--print-default-config"}).action, CliAction::PrintDefaultConfig);
    EXPECT_EQ(parseCli({"--version"}).action, CliAction::Version);
    EXPECT_EQ(parseCli({"-h"}).action, CliAction::Help);
    EXPECT_EQ(parseCli({"--check-config", "x.yaml", "--help"}).action, CliAction::Help);
    // A SIGHUP's reader runs the relay's own arguments with --dump-config appended.
    EXPECT_EQ(parseCli({"-c", "x.yaml", "--workers", "2", "--dump-config"}).action,
              CliAction::DumpConfig);
    EXPECT_EQ(parseCli({"--listen", "127.0.0.1:1", "--upstream", "127.0.0.1:2", "--dump-config"})
                  .action,
              CliAction::DumpConfig);
    EXPECT_EQ(parseCli({"--check-config", "x.yaml", "--dump-config"}).action,
              CliAction::CheckConfig);
}

TEST(ParseCli, Shorthand) {
    const CliOptions o = parseCli(
        {"--listen", "127.0.0.1:1", "--upstream=[::1]:2", "--mode", "copy", "--metrics", "off"});
    EXPECT_EQ(o.listen, "127.0.0.1:1");
    EXPECT_EQ(o.upstream, "[::1]:2");
    EXPECT_EQ(o.mode, "copy");
    EXPECT_EQ(o.metrics, "off");
}

TEST(ParseCli, ErrorsNameTheFlag) {
    EXPECT_EQ(cliErrorOf({"--foo"}), "<command line>: unknown option --foo (see --help)");
    EXPECT_EQ(cliErrorOf({"config.yaml"}),
              "<command line>: unexpected argument \"config.yaml\" (see --help)");
    EXPECT_EQ(cliErrorOf({"--workers"}), "<command line>: --workers: needs a value (N)");
    EXPECT_EQ(cliErrorOf({"--version=1"}), "<command line>: --version: takes no value");
    EXPECT_EQ(cliErrorOf({"--listen", "127.0.0.1:1"}), "<command line>: --listen needs --upstream");
    EXPECT_EQ(cliErrorOf({"--upstream", "127.0.0.1:1"}), "<command line>: --upstream needs --listen");
    EXPECT_EQ(cliErrorOf({"-c", "a.yaml", "--listen", "127.0.0.1:1", "--upstream", "127.0.0.1:2"}),
              "<command line>: --listen/--upstream replace the config file; use one or the other");
    EXPECT_EQ(cliErrorOf({"-c", "a.yaml", "--check-config", "b.yaml"}),
              "<command line>: --check-config: already given as -c");
    EXPECT_EQ(cliErrorOf({"--workers", "1", "--workers=2"}),
              "<command line>: --workers: already given as --workers");
}

TEST(ResolveConfig, NothingGivenIsTheEmbeddedDefault) {
    EXPECT_TRUE(resolveConfig(parseCli({})) == loadConfigString(defaultConfigYaml(), "<default>"));
}

TEST(ResolveConfig, ShorthandBuildsOneDefaultListener) {
    const Config c = resolveConfig(
        parseCli({"--listen", "0.0.0.0:8080", "--upstream", "[::1]:80", "--workers", "2"}));
    ASSERT_EQ(c.listeners.size(), 1u);
    EXPECT_EQ(c.listeners[0].name, "default");
    EXPECT_EQ(c.listeners[0].listen, addr("0.0.0.0:8080"));
    EXPECT_EQ(c.listeners[0].upstream, addr("[::1]:80"));
    EXPECT_EQ(c.listeners[0].mode, Mode::Splice);
    EXPECT_EQ(c.workers, 2u);
}

TEST(ResolveConfig, FlagsOverrideTheFile) {
    const Config c = resolveConfig(
        parseCli({"-c", kMinimal, "--mode", "copy", "--workers", "5", "--metrics", "off"}));
    EXPECT_EQ(c.workers, 5u);
    EXPECT_EQ(c.listeners.at(0).mode, Mode::Copy);
    EXPECT_EQ(c.listeners.at(0).name, "listener0");
    EXPECT_FALSE(c.metrics.enabled);

    const Config m = resolveConfig(parseCli({"-c", kMinimal, "--metrics", "127.0.0.1:9300"}));
    EXPECT_TRUE(m.metrics.enabled);
    EXPECT_EQ(m.metrics.listen, addr("127.0.0.1:9300"));
}

TEST(ResolveConfig, FlagValuesGetTheYamlMessages) {
    EXPECT_EQ(cliErrorOf({"--workers", "x"}),
              "<command line>: --workers: expected a whole number, got \"x\"");
    EXPECT_EQ(cliErrorOf({"--workers", "0"}),
              "<command line>: --workers: \"0\" is out of range (1..256)");
    EXPECT_EQ(cliErrorOf({"--mode", "fast"}),
              "<command line>: --mode: \"fast\" is not a mode; expected one of: splice, copy, "
              "sockmap, auto");
    EXPECT_EQ(cliErrorOf({"--listen", "localhost:80", "--upstream", "127.0.0.1:1"}),
              "<command line>: --listen: \"localhost\" is not a numeric IP address; names are not "
              "resolved");
    EXPECT_EQ(cliErrorOf({"--listen", "127.0.0.1:80", "--upstream", "127.0.0.1"}),
              "<command line>: --upstream: missing port in \"127.0.0.1\"; expected host:port, e.g. "
              "127.0.0.1:10000 or [::1]:10000");
    EXPECT_EQ(cliErrorOf({"--metrics", "9100"}),
              "<command line>: --metrics: missing port in \"9100\"; expected host:port, e.g. "
              "127.0.0.1:10000 or "
              "[::1]:10000");
}

TEST(ResolveConfig, FileErrorsKeepTheFileName) {
    EXPECT_EQ(cliErrorOf({"-c", "/nonexistent/z.yaml"}),
              "/nonexistent/z.yaml: cannot read: No such file or directory");
}

TEST(UsageText, ListsEveryFlagAndTheDefaultConfig) {
    const std::string usage = usageText();
    for (const char* flag :
         {"-c, --config FILE", "--check-config FILE", "--print-default-config", "--version",
          "-h, --help", "--listen ADDR", "--upstream ADDR", "--mode splice|copy|sockmap|auto",
          "--workers N", "--metrics ADDR|off"}) {
        EXPECT_NE(usage.find(flag), std::string::npos) << flag;
    }
    EXPECT_NE(usage.find("`zcrelay --print-default-config`"), std::string::npos);
}

}  // namespace
}  // namespace zcrelay
