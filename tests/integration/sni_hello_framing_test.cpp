// Real ClientHellos in pieces: split into two segments at every byte, re-framed into several
// TLS records, and one too large for one record. Each lands on the backend of its name with
// the client's bytes, byte-exact: the relay peeks at the hello, it never consumes it.
#include <gtest/gtest.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "integration/sni_fixture.hpp"

namespace zcrelay::test::sni_routing_test {
namespace {

// =============================================================================================
// 3. Real hellos in pieces: split into two segments at every byte, and re-framed into several
// TLS records. Each lands on the backend of its name with the client's bytes, byte-exact.

class SplitHelloTest : public SniFixture, public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        SKIP_WITHOUT_TOOLS(tools_, false, false);
        std::string error;
        ASSERT_TRUE(caps_.ok(error)) << error;
        ASSERT_NO_FATAL_FAILURE(
            startRelay(routedConfig(caps_.addrs(), {routedListener("t", GetParam())})));
        api_hello_ = HelloBank::get(
            tools_, {"api_h2", "s_client", {"api.example.test", "h2,http/1.1"}}, error);
        ASSERT_TRUE(api_hello_) << error;
        apps_hello_ =
            HelloBank::get(tools_, {"apps_h2", "s_client", {"a.apps.example.test", "h2"}}, error);
        ASSERT_TRUE(apps_hello_) << error;
    }

    // `parts` (their concatenation is what the backend must get) lands on `backend`.
    void expectLandsExact(const std::vector<std::string>& parts, const std::string& backend,
                          const std::string& what, const std::string& after = "") {
        std::string sent;
        for (const auto& p : parts) sent += p;
        sent += after;
        Landing l = caps_.through(relay_.port("t"), parts, after);
        EXPECT_EQ(l.note, "") << what;
        EXPECT_EQ(l.backend, backend) << what << ": " << l.note;
        if (l.bytes) {
            EXPECT_EQ(*l.bytes, sent) << what << ": " << firstDifference(*l.bytes, sent);
        } else {
            ADD_FAILURE() << what << ": no bytes reached a backend; " << l.note;
        }
        routes_[{"t", backend}] += 1;
    }

    CaptureSet caps_;
    std::optional<std::string> api_hello_, apps_hello_;
};

TEST_P(SplitHelloTest, EverySplitPointLandsByteExact) {
    const std::string& api = *api_hello_;
    size_t n = 0;
    for (size_t k = 1; k < api.size(); ++k) {
        expectLandsExact({api.substr(0, k), api.substr(k)}, "api", "split at " + std::to_string(k));
        ++n;
        if (HasFailure()) break;  // one broken point says it; 500 would drown it
    }
    const std::string& apps = *apps_hello_;
    for (size_t k : {size_t{1}, size_t{5}, size_t{9}, apps.size() / 2, apps.size() - 1}) {
        expectLandsExact({apps.substr(0, k), apps.substr(k)}, "apps",
                         "apps split at " + std::to_string(k));
        ++n;
    }
    std::printf("[ INFO     ] %zu connections, hello of %zu bytes\n", n, api.size());
    expectCounters();
    EXPECT_TRUE(relay_.waitForMetric(metric::kClosedTotal, metric::reason("done"), routed()))
        << relay_.diagnostics();
    EXPECT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
}
ZCRELAY_LABEL(SplitHelloTest, EverySplitPointLandsByteExact, "", kSanitizeSkip,
              "344 connections of the wait the record-split cases run");

TEST_P(SplitHelloTest, SeveralRecordsLandByteExact) {
    const std::string api = handshakeMessage(*api_hello_);
    HelloFields f = parseHello(api);
    ASSERT_TRUE(f.parsed && f.sni) << hex(api);
    struct Framing {
        std::string what;
        std::string bytes;
    };
    std::vector<Framing> framings = {
        {"a 1-byte first record", frame(api, {1})},
        {"the handshake header alone", frame(api, {4})},
        {"a record boundary inside the server name", frame(api, {f.sni_at + 2})},
        {"the server name's extension header cut", frame(api, {f.sni_at - 7})},
        {"64-byte records", frameEvery(api, 64)},
        {"1-byte records", frameEvery(api, 1)},
    };
    for (const Framing& fr : framings) {
        ASSERT_EQ(helloExtent(fr.bytes), fr.bytes.size()) << fr.what;
        ASSERT_EQ(handshakeMessage(fr.bytes), api) << fr.what;
        expectLandsExact({fr.bytes}, "api", fr.what, kSecondFlight);
    }
    // Each 64-byte record its own segment; and a segment boundary inside a record header.
    std::string framed = frameEvery(api, 64);
    expectLandsExact(recordsOf(framed), "api", "64-byte records, one segment each");
    expectLandsExact({framed.substr(0, 5 + 64 + 3), framed.substr(5 + 64 + 3)}, "api",
                     "a segment boundary inside the second record's header");
    const std::string apps = handshakeMessage(*apps_hello_);
    expectLandsExact({frameEvery(apps, 100)}, "apps", "the wildcard hello in 100-byte records");
    expectCounters();
}

INSTANTIATE_TEST_SUITE_P(Modes, SplitHelloTest, ::testing::ValuesIn(kHandOffModes), modeName);

// =============================================================================================
// 4. A large real ClientHello: Python with a long ALPN list, over 16 KiB, so OpenSSL writes it in
// two records. It routes by its name, and by an ALPN protocol in its second record.

class LargeHelloTest : public SniFixture, public ::testing::TestWithParam<std::string> {};

TEST_P(LargeHelloTest, RoutesByNameAndLateAlpn) {
    SKIP_WITHOUT_TOOLS(tools_, false, true);
    constexpr int kBig = 100;  // 100 names of 205 bytes: about 20 KiB of ALPN
    std::string error;
    std::optional<std::string> big = HelloBank::get(
        tools_, {"py_big_apps", "python", {"q.apps.example.test", "http/1.1"}, kBig}, error);
    ASSERT_TRUE(big) << error;
    ASSERT_GE(recordsOf(*big).size(), 2u) << "premise: the hello spans several records";
    ASSERT_GT(big->size(), size_t{16 * 1024});
    HelloFields f = parseHello(handshakeMessage(*big));
    ASSERT_TRUE(f.parsed);
    ASSERT_EQ(f.alpn.size(), size_t{kBig + 1});
    ASSERT_EQ(f.alpn.back(), "http/1.1");

    ASSERT_NO_FATAL_FAILURE(startTlsBackends("-www"));
    // t takes up to 64 KiB of hello; d keeps the default 16 KiB, which this hello exceeds.
    ASSERT_NO_FATAL_FAILURE(startRelay(routedConfig(
        tlsAddrs(), {routedListener("t", GetParam(), kRoutes, "    inspect_max_size: 64KiB\n"),
                     routedListener("d", GetParam())})));
    const std::vector<std::string> more = {"--big", std::to_string(kBig)};
    ClientRun a =
        python(tools_, script_, relay_.port("t"), {"api.example.test", ""}, cafile_, more);
    expectLanded(a, api_);
    count("api", "");
    ClientRun b = python(tools_, script_, relay_.port("t"), {"q.apps.example.test", "http/1.1"},
                         cafile_, more);
    expectLanded(b, apps_);
    count("apps", "");
    // Too large for d: the default route takes it, and the handshake still completes, with the
    // fallback server, because the bytes went on unchanged.
    ClientRun c =
        python(tools_, script_, relay_.port("d"), {"api.example.test", ""}, cafile_, more);
    expectLanded(c, fallback_);
    count("fallback", "too_large", "d");
}

INSTANTIATE_TEST_SUITE_P(Modes, LargeHelloTest, ::testing::ValuesIn(kHandOffModes), modeName);

}  // namespace
}  // namespace zcrelay::test::sni_routing_test
