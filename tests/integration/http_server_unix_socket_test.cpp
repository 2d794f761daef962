// The HTTP server on a unix socket: it serves and removes its file at shutdown, replaces a
// stale socket file, refuses what is not one, leaves a replaced file alone, and keeps its
// deadlines and eviction without client addresses.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "integration/http_server_fixture.hpp"

namespace zcrelay::test::http_server_test {
namespace {

// ---------------------------------------------------------------------------------------------
// Unix sockets.

class UnixSocketTest : public HttpServerTest {
  protected:
    ~UnixSocketTest() override { server_.reset(); }  // before dir_ goes
    std::string socketPath() const { return dir_.file("admin.sock"); }
    std::string address() const { return "unix:" + socketPath(); }
    // Starts on the socket, expecting a refusal: the error.
    std::string refusal() {
        auto listen = parseAddress(address());
        EXPECT_TRUE(listen) << listen.error();
        auto started = HttpServer::start("test server", *listen, HttpLimits{},
                                         {{"/healthz", recorder("healthz")}}, stats_);
        EXPECT_FALSE(started) << "started over what is at " << socketPath();
        return started ? "" : started.error();
    }

    TempDir dir_;
};

// Requests over the socket, bodies included; the file is a socket of mode 0660, and gone once
// the server stops.
TEST_F(UnixSocketTest, ServesRequestsAndRemovesItsFileAtShutdown) {
    ASSERT_NO_FATAL_FAILURE(start(
        {postRoute("/v1/config", recorder("config"), 4096), {"/healthz", recorder("healthz")}},
        HttpLimits{}, address()));
    EXPECT_EQ(server_->address().toString(), address());
    struct stat st {};
    ASSERT_EQ(::lstat(socketPath().c_str(), &st), 0) << std::strerror(errno);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 07777, 0660u);

    Fd fd = connectUnix(socketPath());
    ASSERT_TRUE(fd) << std::strerror(errno);
    const std::string body = "{\"backend\":\"10.0.0.1:80\",\"weight\":5}";
    Response r = exchange(fd.get(), post("/v1/config", body, "Authorization: Bearer t\r\n"));
    ASSERT_EQ(r.status, 200) << r.describe();
    EXPECT_EQ(r.body, "config:" + body);
    r = exchange(fd.get(), get("/healthz", "HEAD"), true);
    EXPECT_EQ(r.status, 200) << r.describe();
    r = exchange(fd.get(), get("/healthz"));
    EXPECT_EQ(r.body, "healthz:") << r.describe();
    r = exchange(fd.get(), post("/v1/config", std::string(4097, 'x')));
    EXPECT_EQ(r.status, 413) << r.describe();
    std::vector<Seen> s = seen();
    ASSERT_EQ(s.size(), 3u);
    EXPECT_EQ(s[0].body, body);
    EXPECT_EQ(s[0].authorization, "Bearer t");

    server_.reset();
    EXPECT_NE(::lstat(socketPath().c_str(), &st), 0) << "the socket file outlived the server";
    EXPECT_EQ(errno, ENOENT);
}

// A socket file nobody listens on (a crashed relay's) is replaced.
TEST_F(UnixSocketTest, AStaleSocketFileIsReplaced) {
    {
        Fd old(::socket(AF_UNIX, SOCK_STREAM, 0));
        sockaddr_un at{};
        at.sun_family = AF_UNIX;
        std::strncpy(at.sun_path, socketPath().c_str(), sizeof at.sun_path - 1);
        ASSERT_EQ(::bind(old.get(), reinterpret_cast<sockaddr*>(&at), sizeof at), 0)
            << std::strerror(errno);
    }  // closed: the file stays, nothing listens
    ASSERT_NO_FATAL_FAILURE(start({{"/healthz", recorder("healthz")}}, HttpLimits{}, address()));
    Fd fd = connectUnix(socketPath());
    ASSERT_TRUE(fd) << std::strerror(errno);
    EXPECT_EQ(exchange(fd.get(), get("/healthz")).status, 200);
}

// Anything else at the path is refused by name and left as it was: a regular file, a
// directory, a symlink (even to a socket: never followed), a socket another server listens on.
TEST_F(UnixSocketTest, RefusesWhatIsNotAStaleSocket) {
    const std::string path = socketPath();
    dir_.writeFile("admin.sock", "precious\n");
    std::string error = refusal();
    EXPECT_NE(error.find(path), std::string::npos) << error;
    EXPECT_NE(error.find("a regular file"), std::string::npos) << error;
    EXPECT_EQ(readFileText(path), "precious\n") << "the file was touched";

    ASSERT_EQ(::unlink(path.c_str()), 0);
    ASSERT_EQ(::mkdir(path.c_str(), 0700), 0);
    error = refusal();
    EXPECT_NE(error.find("a directory"), std::string::npos) << error;
    ASSERT_EQ(::rmdir(path.c_str()), 0);

    const std::string stale = dir_.file("stale.sock");
    {
        Fd old(::socket(AF_UNIX, SOCK_STREAM, 0));
        sockaddr_un at{};
        at.sun_family = AF_UNIX;
        std::strncpy(at.sun_path, stale.c_str(), sizeof at.sun_path - 1);
        ASSERT_EQ(::bind(old.get(), reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
    }
    ASSERT_EQ(::symlink(stale.c_str(), path.c_str()), 0);
    error = refusal();
    EXPECT_NE(error.find("a symlink"), std::string::npos) << error;
    struct stat st {};
    EXPECT_EQ(::lstat(stale.c_str(), &st), 0) << "the symlink's target was removed";
    ASSERT_EQ(::unlink(path.c_str()), 0);

    // A live server's socket.
    Fd live(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un at{};
    at.sun_family = AF_UNIX;
    std::strncpy(at.sun_path, path.c_str(), sizeof at.sun_path - 1);
    ASSERT_EQ(::bind(live.get(), reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
    ASSERT_EQ(::listen(live.get(), 16), 0);
    error = refusal();
    EXPECT_NE(error.find("another server is listening"), std::string::npos) << error;
    Fd still = connectUnix(path);
    EXPECT_TRUE(still) << "the live server's socket was taken away";
}

// At shutdown the file is removed only if it is still the one the server bound: one put there
// meanwhile (another server's, or a file) stays.
TEST_F(UnixSocketTest, AReplacedFileIsNotRemovedAtShutdown) {
    ASSERT_NO_FATAL_FAILURE(start({{"/healthz", recorder("healthz")}}, HttpLimits{}, address()));
    ASSERT_EQ(::unlink(socketPath().c_str()), 0);
    dir_.writeFile("admin.sock", "someone else's\n");
    server_.reset();
    EXPECT_EQ(readFileText(socketPath()), "someone else's\n");
}

// The deadline and the eviction go by connection, not by client address (a unix client has
// none): over the socket, past max_connections the oldest idle one is closed at once, the rest
// at request_timeout, and a request still gets through.
TEST_F(UnixSocketTest, DeadlinesAndEvictionWorkWithoutClientAddresses) {
    // request_timeout 3 s: an eviction (at once) and a timeout are told apart with room for a
    // loaded 2-core machine.
    HttpLimits limits;
    limits.request_timeout = Millis{3'000};
    limits.max_connections = 2;
    ASSERT_NO_FATAL_FAILURE(start({{"/healthz", recorder("healthz")}}, limits, address()));
    const auto start = Clock::now();
    std::vector<Fd> idle;
    for (int i = 0; i < 3; ++i) {
        idle.push_back(connectUnix(socketPath()));
        ASSERT_TRUE(idle.back()) << std::strerror(errno);
        std::this_thread::sleep_for(Millis{50});  // accepted one by one, oldest first
    }
    EXPECT_TRUE(closedByServer(idle[0].get(), Millis{2'000})) << "the oldest was not evicted";
    EXPECT_LT(secondsSince(start), 2.5) << "evicted, not timed out";
    // Counted just after the shutdown() the client saw.
    EXPECT_TRUE(waitUntil([&] { return rejected(HttpReject::Evicted) == 1; }, Millis{10'000}));
    EXPECT_TRUE(closedByServer(idle[1].get(), Millis{10'000}));
    EXPECT_GT(secondsSince(start), 2.9) << "closed before request_timeout";
    EXPECT_TRUE(closedByServer(idle[2].get(), Millis{10'000}));
    EXPECT_TRUE(waitUntil([&] { return rejected(HttpReject::Timeout) == 2; }, Millis{10'000}))
        << rejected(HttpReject::Timeout);
    EXPECT_EQ(rejected(HttpReject::Evicted), 1u);
    Fd fd = connectUnix(socketPath());
    ASSERT_TRUE(fd);
    EXPECT_EQ(exchange(fd.get(), get("/healthz")).status, 200);
}

}  // namespace
}  // namespace zcrelay::test::http_server_test
