#include "support/haproxy.hpp"

#include <csignal>
#include <fstream>
#include <sstream>

namespace zcrelay::test {

bool listeningOn(int family, uint16_t port) {
    std::ifstream f(family == AF_INET6 ? "/proc/net/tcp6" : "/proc/net/tcp");
    std::string line;
    std::getline(f, line);  // header
    for (int i = 0; i < 100'000 && std::getline(f, line); ++i) {
        std::istringstream fields(line);
        std::string sl, local, remote, state;
        if (!(fields >> sl >> local >> remote >> state)) continue;
        size_t colon = local.rfind(':');
        if (colon == std::string::npos || state != "0A") continue;  // 0A: LISTEN
        if (std::stoul(local.substr(colon + 1), nullptr, 16) == port) return true;
    }
    return false;
}

::testing::AssertionResult HaproxyProcess::start(
    int family, const std::function<std::string(const std::string&)>& config) {
    return startOnFreeLoopbackPort(family, [&](uint16_t port, std::string& why) {
        port_ = port;
        std::string path = dir_.writeFile("haproxy.cfg", config(loopbackHostPort(family, port_)));
        child_ = std::make_unique<ChildProcess>();
        ChildProcess::Options opts;
        opts.argv = {binary_, "-f", path, "-db"};
        opts.stdout_path = dir_.file("haproxy.out");
        opts.stderr_path = dir_.file("haproxy.err");
        std::string error;
        if (!child_->spawn(opts, error)) {
            why = "spawn haproxy: " + error;
            return PortLaunch::Failed;
        }
        bool up = waitUntil([&] { return !child_->running() || listeningOn(family, port_); },
                            Millis{10'000});
        if (up && child_->running()) return PortLaunch::Up;
        why = "haproxy did not listen on port " + std::to_string(port_) +
              "; stderr: " + fileTail(dir_.file("haproxy.err"));
        stop();
        return PortLaunch::Retry;
    });
}

void HaproxyProcess::stop() {
    if (!child_) return;
    if (child_->running()) {
        child_->sendSignal(SIGTERM);
        if (!child_->waitExit(Millis{5'000})) child_->killAndWait();
    }
    child_.reset();
}

}  // namespace zcrelay::test
