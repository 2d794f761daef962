#pragma once
// HAProxy as a test peer, for the cross-checks that hold zcrelay to what HAProxy does:
// `haproxy -f CONFIG -db` in a temp dir of its own, on a loopback port reserved for it. Only
// the PID it started is ever signalled.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "support/relay_process.hpp"

namespace zcrelay::test {

// True when /proc/net/tcp (tcp6 for AF_INET6) lists a socket in LISTEN on loopback port `port`.
bool listeningOn(int family, uint16_t port);

// The start of every cross-check's config: HAProxy in `mode tcp` with the timeouts the relay's
// cases use, `global_extra` ("    tune.bufsize 65536\n") among the global settings. The case
// appends its frontend and backends.
inline std::string haproxyTcpPreamble(const std::string& global_extra = "") {
    return "global\n"
           "    maxconn 64\n" +
           global_extra +
           "defaults\n"
           "    mode tcp\n"
           "    timeout connect 5s\n"
           "    timeout client 30s\n"
           "    timeout server 30s\n";
}

class HaproxyProcess {
  public:
    // `binary`: the haproxy to run (findExecutable("haproxy")).
    explicit HaproxyProcess(std::string binary) : binary_(std::move(binary)) {}
    ~HaproxyProcess() { stop(); }
    HaproxyProcess(const HaproxyProcess&) = delete;
    HaproxyProcess& operator=(const HaproxyProcess&) = delete;

    // `config(bind)`: the whole config, its frontend bound on `bind` ("127.0.0.1:PORT").
    // haproxy cannot report a port the kernel picked, so one is reserved, released and bound;
    // another process could take it in between, so a failed start retries on a new port.
    ::testing::AssertionResult start(int family,
                                     const std::function<std::string(const std::string&)>& config);
    // SIGTERM (HAProxy's hard stop: everything closes now), SIGKILL if it has not exited in 5 s.
    void stop();
    uint16_t port() const { return port_; }

  private:
    std::string binary_;
    TempDir dir_;
    std::unique_ptr<ChildProcess> child_;
    uint16_t port_ = 0;
};

}  // namespace zcrelay::test
