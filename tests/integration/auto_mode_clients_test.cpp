// Real bulk clients through a mode auto listener: iperf3 both ways and curl fetching 256 MiB
// from nginx (nc is nc_test.cpp's, with mode auto among its modes). Each run must leave at
// least 95 % of its bytes in the kernel (splice or the sockmap redirect), which is what mode
// sockmap failed with these same clients: 97-99.6 % of their bytes copied through user memory,
// because a long stream keeps meeting the program's in-flight bound.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <csignal>
#include <fstream>
#include <string>

#include "integration/auto_mode_fixture.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"
#include "units.hpp"

namespace zcrelay::test::auto_mode_clients_test {
namespace {

using auto_mode_test::mostlyInTheKernel;
using auto_mode_test::pathBytes;
using auto_mode_test::PathBytes;

constexpr Millis kRun{60'000};

class AutoModeClientsTest : public ::testing::Test {
  protected:
    void startRelay(uint16_t upstream_port) {
        ASSERT_TRUE(
            relay_.start(singleListenerConfig(loopbackHostPort(AF_INET, upstream_port), "auto")));
        ASSERT_EQ(relay_.metric(metric::kDatapathInfo, metric::datapath("auto")), 1.0)
            << relay_.diagnostics();
    }

    TempDir dir_;
    RelayProcess relay_;
};

// iperf3 -c through the relay for 2 s, upload then download (-R), against one server. Its
// control connection is small and may be promoted; the data connection is one long stream.
TEST_F(AutoModeClientsTest, Iperf3BothWaysStaysInTheKernel) {
    auto iperf3 = findExecutable("iperf3");
    ASSERT_TRUE(iperf3) << "iperf3 is not installed (deploy/install-deps.sh installs it)";
    ChildProcess server;
    const uint16_t server_port = startIperf3Server(server, dir_);
    ASSERT_NE(server_port, 0);
    ASSERT_NO_FATAL_FAILURE(startRelay(server_port));
    for (bool reverse : {false, true}) {
        SCOPED_TRACE(reverse ? "download (-R)" : "upload");
        PathBytes before = pathBytes(relay_);
        std::vector<std::string> argv = {*iperf3, "-c", "127.0.0.1", "-p",
                                         std::to_string(relay_.port()), "-t", "2", "-J"};
        if (reverse) argv.push_back("-R");
        CommandResult client = runCommand(argv, kRun);
        ASSERT_TRUE(client.status.cleanExit()) << client.describe();
        ASSERT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
        PathBytes after = pathBytes(relay_);
        PathBytes run{after.splice - before.splice, after.copy - before.copy,
                      after.sockmap - before.sockmap,
                      after.sockmap_copied - before.sockmap_copied};
        RecordProperty(reverse ? "download_bytes" : "upload_bytes",
                       std::to_string(static_cast<long long>(run.total())));
        EXPECT_TRUE(mostlyInTheKernel(run, 100.0 * kMiB)) << client.out.substr(0, 2000);
    }
    server.sendSignal(SIGTERM);
    EXPECT_TRUE(server.waitExit(Millis{5'000})) << readFileText(dir_.file("iperf3-server.err"));
}

// curl fetching 256 MiB from nginx through the relay (HTTP/1.1, one connection).
TEST_F(AutoModeClientsTest, Curl256MiBFromNginxStaysInTheKernel) {
    auto nginx = findExecutable("nginx");
    auto curl = findExecutable("curl");
    ASSERT_TRUE(nginx && curl) << "nginx and curl come with deploy/install-deps.sh";
    constexpr uint64_t kFile = 256 * kMiB;
    const std::string root = dir_.file("www");
    ASSERT_EQ(::mkdir(root.c_str(), 0755), 0);
    {
        std::ofstream f(root + "/big.bin", std::ios::binary);
        f.seekp(static_cast<std::streamoff>(kFile - 1));
        f.put('\n');  // a sparse file: nginx sends it with sendfile() all the same
    }
    ChildProcess server;
    uint16_t server_port = 0;
    ASSERT_TRUE(startOnFreeLoopbackPort(AF_INET, [&](uint16_t port, std::string& why) {
        const std::string conf = dir_.file("nginx.conf");
        std::ofstream c(conf);
        const std::string d = dir_.path();
        c << "daemon off;\nmaster_process off;\nuser root;\npid " << d << "/nginx.pid;\n"
          << "error_log " << d << "/nginx.err;\nevents {}\nhttp {\n  access_log off;\n"
          << "  client_body_temp_path " << d << "/body;\n  proxy_temp_path " << d << "/proxy;\n"
          << "  fastcgi_temp_path " << d << "/fcgi;\n  uwsgi_temp_path " << d << "/uwsgi;\n"
          << "  scgi_temp_path " << d << "/scgi;\n"
          << "  server { listen 127.0.0.1:" << port << "; root " << root << "; }\n}\n";
        c.close();
        ChildProcess::Options o;
        o.argv = {*nginx, "-c", conf, "-e", d + "/nginx.err"};
        o.stderr_path = dir_.file("nginx.stderr");
        if (!server.spawn(o, why)) return PortLaunch::Failed;
        if (waitUntil([&] { return listensOnLoopback4(port); }, Millis{5'000})) {
            server_port = port;
            return PortLaunch::Up;
        }
        why = "nginx never listened: " + readFileText(d + "/nginx.err");
        server.killAndWait();
        return PortLaunch::Retry;
    }));
    ASSERT_NO_FATAL_FAILURE(startRelay(server_port));
    CommandResult got = runCommand(
        {*curl, "-sS", "-o", "/dev/null", "-w", "%{http_code} %{size_download}",
         "http://127.0.0.1:" + std::to_string(relay_.port()) + "/big.bin"},
        kRun);
    ASSERT_TRUE(got.status.cleanExit()) << got.describe();
    EXPECT_EQ(got.out, "200 " + std::to_string(kFile)) << got.describe();
    ASSERT_TRUE(relay_.waitForMetric(metric::kConnectionsActive, metric::listener(), 0));
    PathBytes b = pathBytes(relay_);
    EXPECT_TRUE(mostlyInTheKernel(b, static_cast<double>(kFile)));
    server.sendSignal(SIGQUIT);
    server.waitExit(Millis{5'000});
}

}  // namespace
}  // namespace zcrelay::test::auto_mode_clients_test
