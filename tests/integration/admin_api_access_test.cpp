// Who reaches the runtime API: the bearer token, the token file's checks and the addresses
// refused without one, and the unix socket, served to curl and removed at exit.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "integration/admin_api_fixture.hpp"

namespace zcrelay::test::admin_api_test {
namespace {

// =============================================================================================
// 7. The bearer token; an address reachable from other hosts without one is refused; a unix
// socket, served to curl and removed at exit.

TEST_F(AdminApiTest, BearerTokenIsRequiredWhenConfigured) {
    TaggedBackend a('a');
    ASSERT_TRUE(a.ok()) << a.error();
    const std::string token_file = relay_.dir() + "/admin.token";
    FILE* f = std::fopen(token_file.c_str(), "w");
    ASSERT_NE(f, nullptr) << std::strerror(errno);
    std::fputs("s3cret-t0ken\nignored second line\n", f);
    std::fclose(f);
    ASSERT_NO_FATAL_FAILURE(startWith({{a.address()}}, "splice", "    balance: round_robin\n",
                                      "  token_file: \"" + token_file + "\"\n"));
    const std::string path = backendPath(a.address());

    EXPECT_TRUE(isError(api("GET", "/api/v1/clusters"), 401, "token")) << "no Authorization";
    EXPECT_TRUE(isError(api("GET", "/api/v1/clusters", "", "Authorization: Bearer wrong\r\n"),
                        401, "token"))
        << "wrong token";
    EXPECT_TRUE(isError(api("GET", "/api/v1/clusters", "", "Authorization: Bearer s3cret-t0k\r\n"),
                        401, "token"))
        << "a prefix of the token";
    EXPECT_TRUE(isError(api("GET", "/api/v1/clusters", "",
                            "Authorization: Bearer s3cret-t0ken2\r\n"),
                        401, "token"))
        << "the token and more";
    EXPECT_TRUE(isError(api("GET", "/api/v1/clusters", "", "Authorization: s3cret-t0ken\r\n"),
                        401, "token"))
        << "no Bearer";
    // Unauthorized changes change nothing.
    EXPECT_TRUE(isError(api("POST", path, "{\"state\":\"drain\"}",
                            "Content-Type: application/json\r\nAuthorization: Bearer nope\r\n"),
                        401, "token"));
    EXPECT_EQ(relay_.metric(kAdminState, withLabel(backendOf(a.address()), "state", "ready")),
              1.0);

    const std::string auth = "Authorization: Bearer s3cret-t0ken\r\n";
    ApiReply ok = api("GET", "/api/v1/clusters", "", auth);
    EXPECT_EQ(ok.status, 200) << ok.describe();
    EXPECT_TRUE(ok.json && ok.json->items("clusters").size() == 1) << ok.describe();
    EXPECT_TRUE(backendReply(api("POST", path, "{\"state\":\"drain\"}", auth),
                             {.address = a.address(),
                              .state = "drain",
                              .takes_new_connections = false}));
    EXPECT_TRUE(relay_.waitForMetric(kAdminRequests, {{"result", "unauthorized"}}, 6));
    EXPECT_TRUE(relay_.waitForMetric(kAdminRequests, {{"result", "ok"}}, 2));
    EXPECT_EQ(relay_.metric(kAdminChanges, {{"change", "state_drain"}}), 1.0);
}

// The token file's first line, trimmed of spaces and tabs, is the token: one of blanks only is
// refused at start (before, the relay started and `Bearer ` plus those blanks authenticated),
// and so is one holding a control byte. Both name the file; the relay exits 1.
TEST(AdminApiConfig, ABlankOrControlByteTokenFileIsRefusedAtStart) {
    TempDir dir;
    const auto run = [&](const std::string& name, const std::string& content) {
        const std::string token = dir.writeFile(name, content);
        RelayConfig config =
            clusterConfig(adminYaml("127.0.0.1:0", "  token_file: \"" + token + "\"\n"),
                          clusterYaml({{"127.0.0.1:9"}}));
        const std::string path = dir.writeFile(name + ".yaml", config.yaml());
        return std::make_pair(token, runCommand({kRelayBinary, "-c", path}, Millis{15'000}));
    };
    for (const char* blank : {"    \n", " \t \r\nsecond-line-token\n", "   "}) {
        auto [token, r] = run("blank.token", blank);
        EXPECT_TRUE(r.status.exited && r.status.code == 1) << r.describe();
        EXPECT_NE(r.err.find("admin.token_file " + token + ": the first line is empty"),
                  std::string::npos)
            << r.describe();
    }
    auto [token, r] = run("ctl.token", std::string("s3cret\x01t0ken\n"));
    EXPECT_TRUE(r.status.exited && r.status.code == 1) << r.describe();
    EXPECT_NE(r.err.find("admin.token_file " + token + ": the token holds a control byte (0x01)"),
              std::string::npos)
        << r.describe();
}

TEST(AdminApiConfig, WildcardListenWithoutTokenIsRefused) {
    TempDir dir;
    auto check = [&](const std::string& admin) {
        RelayConfig config = clusterConfig(admin, clusterYaml({{"127.0.0.1:9"}}));
        const std::string path = dir.writeFile("zcrelay.yaml", config.yaml());
        return runCommand({kRelayBinary, "--check-config", path}, Millis{10'000});
    };
    // Only checked, never started: nothing here listens beyond loopback.
    for (const char* listen : {"0.0.0.0:9101", "[::]:9101"}) {
        CommandResult refused = check(adminYaml(listen));
        EXPECT_TRUE(refused.status.exited && refused.status.code == 1) << refused.describe();
        EXPECT_NE(refused.err.find("admin.listen"), std::string::npos) << refused.describe();
        EXPECT_NE(refused.err.find("token_file"), std::string::npos) << refused.describe();
    }
    // Loopback and unix sockets need no token; a wildcard address with a token file is taken.
    for (const std::string& admin :
         {adminYaml("127.0.0.1:9101"), adminYaml("[::1]:9101"), adminYaml("unix:/tmp/x.sock"),
          adminYaml("0.0.0.0:9101", "  token_file: /etc/zcrelay/admin.token\n")}) {
        CommandResult taken = check(admin);
        EXPECT_TRUE(taken.status.cleanExit()) << admin << "\n" << taken.describe();
    }
    // A token file without a listen address is a mistake too.
    CommandResult orphan = check("admin:\n  token_file: /etc/zcrelay/admin.token\n");
    EXPECT_TRUE(orphan.status.exited && orphan.status.code == 1) << orphan.describe();
    EXPECT_NE(orphan.err.find("admin.token_file"), std::string::npos) << orphan.describe();
}

TEST_F(AdminApiTest, UnixSocketServesCurlAndIsRemovedAtExit) {
    const auto curl = findExecutable("curl");
    if (!curl) GTEST_SKIP() << "curl is not installed";
    TaggedBackend a('a');
    ASSERT_TRUE(a.ok()) << a.error();
    const std::string sock = relay_.dir() + "/admin.sock";
    ASSERT_NO_FATAL_FAILURE(start(
        clusterConfig(adminYaml("unix:" + sock), clusterYaml({{a.address()}}))));
    struct stat st {};
    ASSERT_EQ(::lstat(sock.c_str(), &st), 0) << sock << ": " << std::strerror(errno);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0660u);

    auto curlApi = [&](const std::vector<std::string>& extra, const std::string& path) {
        std::vector<std::string> argv = {*curl, "-sS", "--max-time", "5", "--unix-socket", sock,
                                         "-w", "\n%{http_code}"};
        argv.insert(argv.end(), extra.begin(), extra.end());
        argv.push_back("http://localhost" + path);
        CommandResult r = runCommand(argv, Millis{10'000});
        ApiReply out;
        if (!r.status.cleanExit()) {
            out.error = r.describe();
            return out;
        }
        const size_t nl = r.out.rfind('\n');
        out.status = std::atoi(r.out.c_str() + nl + 1);
        out.body = r.out.substr(0, nl);
        std::string why;
        out.json = parseJson(out.body, why);
        if (!out.json) out.error = "not JSON: " + why;
        return out;
    };
    ApiReply list = curlApi({}, "/api/v1/clusters");
    EXPECT_EQ(list.status, 200) << list.describe();
    ASSERT_TRUE(list.json) << list.describe();
    ASSERT_EQ(list.json->items("clusters").size(), 1u) << list.describe();
    EXPECT_TRUE(backendIs(list.json->items("clusters")[0].items("backends").at(0),
                          {.address = a.address()}));
    EXPECT_TRUE(backendReply(curlApi({"-X", "POST", "-H", "Content-Type: application/json",
                                      "--data", "{\"weight\": 7}"},
                                     backendPath(a.address())),
                             {.address = a.address(), .weight = 7}));
    EXPECT_EQ(relay_.metric(kBackendWeight, backendOf(a.address())), 7.0);
    EXPECT_TRUE(isError(curlApi({}, "/api/v1/clusters/none"), 404, "none"));

    ExitStatus exit = relay_.terminate();
    EXPECT_TRUE(exit.cleanExit()) << exit.describe();
    const int gone = ::lstat(sock.c_str(), &st) == 0 ? 0 : errno;
    EXPECT_EQ(gone, ENOENT) << sock << " is still there after the relay exited";
}

}  // namespace
}  // namespace zcrelay::test::admin_api_test
