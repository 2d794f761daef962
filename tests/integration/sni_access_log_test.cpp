// The access log of routed connections: the server name as sent, the offered ALPN protocols
// and the route, in JSON lines.
#include <gtest/gtest.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "integration/sni_fixture.hpp"
#include "support/json.hpp"

namespace zcrelay::test::sni_routing_test {
namespace {

// =============================================================================================
// 9. The access log: sni as sent, the offered ALPN protocols, the route.

class SniAccessLogTest : public SniFixture, public ::testing::Test {};

TEST_F(SniAccessLogTest, JsonLinesCarrySniAlpnRoute) {
    SKIP_WITHOUT_TOOLS(tools_, false, false);
    ASSERT_NO_FATAL_FAILURE(startTlsBackends("-www"));
    const std::string log_path = dir_.file("access.log");
    RelayConfig config = routedConfig(
        tlsAddrs(),
        {routedListener("t", "splice"), routedListener("n", "splice", kConditionalRoutes)});
    config.extra_yaml += "access_log:\n  path: \"" + log_path + "\"\n  format: json\n";
    ASSERT_NO_FATAL_FAILURE(startRelay(config));

    expectLanded(
        sClient(tools_, relay_.port("t"), {"api.example.test", "h2,http/1.1"}, cafile_, get_),
        api_);
    expectLanded(sClient(tools_, relay_.port("t"), {"API.Example.Test.", ""}, cafile_, get_), api_);
    expectLanded(sClient(tools_, relay_.port("t"), {std::nullopt, ""}, cafile_, get_), fallback_);
    expectRefused(sClient(tools_, relay_.port("n"), {"other.example.test", "h2"}, cafile_, get_));

    struct Want {
        std::string listener, sni, alpn, route, termination;
    };
    const std::vector<Want> wants = {
        {"t", "api.example.test", "h2,http/1.1", "api", "done"},
        {"t", "API.Example.Test.", "", "api", "done"},  // as the client sent it
        {"t", "", "", "fallback", "done"},
        {"n", "other.example.test", "h2", "", "no_route"},
    };
    std::vector<Json> lines;
    waitUntil(
        [&] {
            lines.clear();
            std::istringstream in(readFileText(log_path));
            for (std::string line; std::getline(in, line) && lines.size() < 100;) {
                std::string error;
                if (auto j = parseJson(line, error)) lines.push_back(*j);
            }
            return lines.size() >= wants.size();
        },
        Millis{10'000});
    ASSERT_EQ(lines.size(), wants.size()) << readFileText(log_path);
    for (const Want& w : wants) {
        SCOPED_TRACE(w.listener + " sni \"" + w.sni + "\"");
        const Json* found = nullptr;
        for (const Json& j : lines)
            if (j.str("listener") == w.listener && j.str("sni") == w.sni) found = &j;
        ASSERT_NE(found, nullptr) << readFileText(log_path);
        for (const char* key : {"sni", "alpn", "route"}) {
            const Json* v = found->get(key);
            ASSERT_NE(v, nullptr) << "no \"" << key << "\" field";
            EXPECT_EQ(v->type, Json::Type::String) << key;
        }
        EXPECT_EQ(found->str("alpn"), w.alpn);
        EXPECT_EQ(found->str("route"), w.route);
        EXPECT_EQ(found->str("termination"), w.termination);
    }
}

}  // namespace
}  // namespace zcrelay::test::sni_routing_test
