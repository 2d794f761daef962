#pragma once
// A real DNS server for the tests of DNS service discovery: dnsmasq on 127.0.0.1:<port>, UDP and
// TCP, serving the zone "test." from files in its own temp dir, whose records a test changes
// while it runs. Only the PID it started is ever signalled; every wait is bounded.
//
// What dnsmasq is told, and why:
//   --keep-in-foreground          stays our child, so we hold its PID (it forks a short-lived
//                                 child per TCP connection itself; SIGTERM ends those too)
//   --conf-file=/dev/null --no-hosts --no-resolv --no-poll
//                                 nothing from /etc: no dnsmasq.conf, no /etc/hosts, no upstream
//                                 servers from resolv.conf
//   --listen-address=127.0.0.1 --bind-interfaces --port=P
//                                 binds 127.0.0.1:P only (not the wildcard), UDP and TCP
//   --local=/test/                a name under test. without records answers NXDOMAIN and is
//                                 never forwarded; names outside test. answer REFUSED
//   --hostsdir=DIR                A/AAAA records: one hosts file per name. dnsmasq watches the
//                                 directory with inotify, re-reads a file renamed into it and drops
//                                 the records of a deleted one: no signal, and the very next query
//                                 sees the change (SIGHUP with --addn-hosts sometimes let one
//                                 stale answer through: the signal arrives after the query)
//   --srv-host=...                SRV records: read at start only, so setSrv() restarts dnsmasq
//   --servers-file=FILE           server=/DOMAIN/127.0.0.1#P lines for failWithServfail(); unlike
//                                 --server it is re-read on SIGHUP
//   --cache-size=0                nothing forwarded is cached (hosts-file records are served from
//                                 the files' data, not a cache of it, so they are never stale)
//   --local-ttl=T                 the TTL of every A, AAAA and SRV answer, literally (0 too)
//   --log-queries --log-facility=FILE
//                                 a "query[TYPE] NAME from ADDR" line per query, for queriesFor()
//   --user=root (when root)       stays root to read our 0700 temp dir (it would become "nobody")
//
// What it answers, measured with dnsmasq 2.90 (tests/integration/dns_server_test.cpp):
// - 40 A records for one name, over UDP without EDNS (as c-ares asks by default): TC set and the
//   30 records that fit in 512 bytes; over TCP all 40. With EDNS (1232 bytes) all 40 over UDP.
// - Unknown name under test.: NXDOMAIN. A name with A records asked for AAAA: NOERROR with no
//   records (NODATA). Neither carries an SOA, so a resolver has no negative TTL to cache by.
// - SRV answers also carry the targets' A/AAAA records in the additional section (dropped,
//   without TC, when they do not fit).

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "support/relay_process.hpp"

namespace zcrelay::test {

// Mutators return an AssertionResult (ASSERT_TRUE(dns.setAddresses(...))): a change that has not
// reached dnsmasq's answers is a failure, with dnsmasq's stderr and log tail. Before start() and
// after stop() a change is only recorded, and served from the next start() or restart().
class DnsServer {
  public:
    struct Options {
        // TTL of every A, AAAA and SRV answer (dnsmasq --local-ttl). 0 is sent as 0.
        uint32_t ttl = 5;
    };
    struct Srv {
        uint16_t priority = 0;
        uint16_t weight = 0;
        uint16_t port = 0;
        std::string target;  // e.g. "web.test"; a trailing dot is optional
    };

    // The source address of this class's own verification queries. dnsmasq logs it, and
    // queriesFor() leaves those queries out, so they do not disturb refresh-rate counts.
    static constexpr const char* kSelfQuerySource = "127.0.0.2";

    DnsServer();
    ~DnsServer();  // stop()
    DnsServer(const DnsServer&) = delete;
    DnsServer& operator=(const DnsServer&) = delete;

    // Starts dnsmasq on 127.0.0.1 at a free port (a new port if the bind races with another
    // process), and returns once it answers a query over TCP (at most ~10 s; it takes ~10 ms).
    [[nodiscard]] ::testing::AssertionResult start(Options options);
    [[nodiscard]] ::testing::AssertionResult start() { return start(Options{}); }
    uint16_t port() const { return port_; }
    std::string address() const;  // "127.0.0.1:PORT"

    // Replaces all A and AAAA records of `name` (under test., e.g. "web.test") with `addrs`
    // (IPv4 or IPv6 text, any mix); empty removes the name (NXDOMAIN after). Returns once
    // queries over TCP to dnsmasq itself return exactly these records (at most ~5 s).
    [[nodiscard]] ::testing::AssertionResult setAddresses(const std::string& name,
                                                          const std::vector<std::string>& addrs);

    // Replaces all SRV records of `name` (e.g. "_app._tcp.web.test"); empty removes them.
    // dnsmasq reads SRV records only at start, so this RESTARTS dnsmasq on the same port: for
    // 15-40 ms queries go unanswered (as after stop()). Returns once the SRV answer matches.
    [[nodiscard]] ::testing::AssertionResult setSrv(const std::string& name,
                                                    const std::vector<Srv>& records);

    // Queries for `domain` (under test.) and every name under it answer SERVFAIL, at once (dig
    // measures 0-4 ms, over UDP and TCP). dnsmasq never makes up a SERVFAIL for local data, and
    // for an upstream that does not answer it sends nothing at all (the client times out), so
    // the domain is forwarded (--servers-file + SIGHUP) to a responder thread in this process
    // on 127.0.0.1 (UDP and TCP) that answers SERVFAIL to everything; dnsmasq passes that on.
    // Local records still win: a name with A records keeps answering A (its AAAA query is
    // forwarded and fails), so this refuses a domain that has any: setAddresses(domain, {})
    // first. Returns once an A query for `domain` answers SERVFAIL.
    [[nodiscard]] ::testing::AssertionResult failWithServfail(const std::string& domain);
    // Undoes failWithServfail(domain): names there answer from local records (or NXDOMAIN) again.
    [[nodiscard]] ::testing::AssertionResult stopFailing(const std::string& domain);

    // SIGTERM to the dnsmasq this started (SIGKILL after 5 s), and reap it. Queries then get no
    // answer. TCP: connection refused. UDP: usually an ICMP port unreachable (a connected client
    // sees ECONNREFUSED at once), but the kernel rate-limits those host-wide (icmp_msgs_per_sec),
    // so under load the query just times out: a test must accept both.
    void stop();
    // Starts dnsmasq again on the same port with the same records, TTL and failing domains.
    [[nodiscard]] ::testing::AssertionResult restart();
    bool running();

    // Queries dnsmasq logged for `name` (case-insensitive; of QTYPE `type` only, e.g. "A",
    // "AAAA", "SRV", when given), across restarts, from anyone but kSelfQuerySource. dnsmasq
    // writes the log line before it answers, so a query whose answer arrived is counted.
    size_t queriesFor(const std::string& name, const std::string& type = "") const;

    const std::string& dir() const { return dir_.path(); }
    std::string logPath() const { return dir_.file("dnsmasq.log"); }
    // Exit status if dnsmasq died, the tail of its stderr and of its log: for failure messages.
    std::string diagnostics() const;

  private:
    class ServfailResponder;

    std::vector<std::string> argv() const;
    // Spawns dnsmasq on port_ and waits until it answers. PortLaunch::Retry when the port was
    // taken (dnsmasq exits 2, "Address already in use").
    PortLaunch launch(std::string& why);
    ::testing::AssertionResult writeServersFile();
    ::testing::AssertionResult reloadServers();  // SIGHUP: dnsmasq re-reads --servers-file

    TempDir dir_;
    Options options_;
    uint16_t port_ = 0;
    std::unique_ptr<ChildProcess> child_;
    std::vector<std::pair<std::string, std::vector<Srv>>> srv_;  // in setSrv() order
    std::set<std::string> failing_;                              // failWithServfail domains
    std::unique_ptr<ServfailResponder> responder_;
};

}  // namespace zcrelay::test
