// Reloading SNI routes: new routes for new connections while a live TLS connection keeps its
// backend, and a refused reload keeps the routes.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "integration/sni_fixture.hpp"

namespace zcrelay::test::sni_routing_test {
namespace {

// =============================================================================================
// 7. Reload: routes change like clusters; a live connection keeps its backend.

class SniReloadTest : public SniFixture, public ::testing::TestWithParam<std::string> {};

TEST_P(SniReloadTest, NewRoutesForNewConnectionsLiveOnesStay) {
    SKIP_WITHOUT_TOOLS(tools_, false, true);
    ASSERT_NO_FATAL_FAILURE(startTlsBackends("-rev"));
    RelayConfig before = routedConfig(tlsAddrs(), {routedListener("t", GetParam())});
    ASSERT_NO_FATAL_FAILURE(startRelay(before));

    // A TLS connection to api, kept open across the reload by the gate file.
    const std::string gate = dir_.file("gate");
    ChildProcess held;
    ChildProcess::Options opts;
    opts.argv = {tools_.python, script_,
                 "--port",      std::to_string(relay_.port()),
                 "--sni",       "api.example.test",
                 "--cafile",    cafile_,
                 "--mode",      "hold",
                 "--gate",      gate};
    opts.stdout_path = dir_.file("held.out");
    opts.stderr_path = dir_.file("held.err");
    std::string error;
    ASSERT_TRUE(held.spawn(opts, error)) << error;
    auto heldSays = [&](const std::string& what) {
        return waitUntil(
            [&] { return readFileText(opts.stdout_path).find(what) != std::string::npos; }, kIo);
    };
    ASSERT_TRUE(heldSays("reply1=1-gnip"))
        << "the held client did not get its first answer: " << readFileText(opts.stdout_path)
        << fileTail(opts.stderr_path);
    EXPECT_NE(readFileText(opts.stdout_path).find("subject=CN = api"), std::string::npos);
    count("api", "");

    // The same names, the clusters swapped: the routes keep their names (so their counters).
    RelayConfig after = before;
    after.listeners[0].extra_yaml =
        "    routes:\n"
        "      - {name: api, sni: [api.example.test], cluster: apps}\n"
        "      - {name: apps, sni: [\"*.apps.example.test\"], alpn: [h2, http/1.1], cluster: api}\n"
        "      - {cluster: fallback}\n";
    ASSERT_TRUE(relay_.reload(after.yaml()));

    auto echo = [&](const Offer& o) {
        return python(tools_, script_, relay_.port(), o, cafile_, {"--mode", "echo"});
    };
    ClientRun a = echo({"api.example.test", ""});
    EXPECT_EQ(a.cn, "apps") << "after the reload api.example.test goes to cluster apps\n"
                            << a.transcript();
    EXPECT_NE(a.result.out.find("reply1=1-gnip"), std::string::npos) << a.transcript();
    count("api", "");

    // The live connection still talks to the api server: both ways, on its old TLS session.
    dir_.writeFile("gate", "");
    std::optional<ExitStatus> st = held.waitExit(kIo);
    ASSERT_TRUE(st) << "the held client did not finish";
    std::string out = readFileText(opts.stdout_path);
    EXPECT_TRUE(st->cleanExit()) << st->describe() << "\n" << out << fileTail(opts.stderr_path);
    EXPECT_NE(out.find("reply2=2-gnip"), std::string::npos)
        << "the connection opened before the reload stopped working\n"
        << out << fileTail(opts.stderr_path);

    // The wildcard now goes to the api server (free again: s_server serves one at a time).
    ClientRun b = echo({"b.apps.example.test", "h2"});
    EXPECT_EQ(b.cn, "api") << b.transcript();
    count("apps", "");
    // Two routes of one name (both after cluster api): the reload is refused, the routes stay.
    RelayConfig duplicate = after;
    duplicate.listeners[0].extra_yaml =
        "    routes:\n"
        "      - {sni: [api.example.test], cluster: api}\n"
        "      - {sni: [other.example.test], cluster: api}\n";
    ASSERT_TRUE(relay_.reload(duplicate.yaml(), false)) << "two routes named api";
    ClientRun c = echo({"api.example.test", ""});
    EXPECT_EQ(c.cn, "apps") << "a refused reload keeps the routes\n" << c.transcript();
    count("api", "");
}

INSTANTIATE_TEST_SUITE_P(Modes, SniReloadTest, ::testing::ValuesIn(kHandOffModes), modeName);

}  // namespace
}  // namespace zcrelay::test::sni_routing_test
