// Self-test of tests/support/dns_server.*: a real dnsmasq on a loopback port, checked with real
// `dig` queries (loopback only). What each case pins down is what the DNS discovery tests rely
// on: records change while it runs and the next query sees it, large answers truncate over UDP
// and come whole over TCP, NXDOMAIN/NODATA/SERVFAIL are what they say, TTLs are literal, a
// restart keeps port and records, and queries are counted.
#include "support/dns_server.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace zcrelay::test::dns_server_test {
namespace {

struct Record {
    std::string name;
    long ttl = -1;
    std::string type;
    std::string data;  // "127.0.0.5", "::1", "10 20 8080 web.test."
};

struct DigResult {
    CommandResult run;
    std::string status;              // "NOERROR", "NXDOMAIN", ...; empty when nothing came back
    std::vector<std::string> flags;  // "qr", "aa", "tc", ...
    std::vector<Record> answers;     // the ANSWER SECTION
    long query_ms = -1;              // ";; Query time: N msec"
    bool retried_over_tcp = false;   // ";; Truncated, retrying in TCP mode."

    bool hasFlag(const std::string& f) const {
        return std::find(flags.begin(), flags.end(), f) != flags.end();
    }
    std::vector<std::string> data(const std::string& type) const {
        std::vector<std::string> out;
        for (const Record& r : answers)
            if (r.type == type) out.push_back(r.data);
        std::sort(out.begin(), out.end());
        return out;
    }
    std::string describe() const { return run.describe(); }
};

// `dig @127.0.0.1 -p PORT +tries=1 +time=2 [extra...] NAME TYPE`: one query, at most 2 s.
DigResult dig(uint16_t port, const std::string& name, const std::string& type,
              const std::vector<std::string>& extra = {}) {
    static const std::string binary = findExecutable("dig").value_or("dig");
    std::vector<std::string> argv = {binary,     "@127.0.0.1", "-p", std::to_string(port),
                                     "+tries=1", "+time=2"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.push_back(name);
    argv.push_back(type);
    DigResult d;
    d.run = runCommand(argv, Millis{10'000});
    std::smatch m;
    const std::string& out = d.run.out;
    if (std::regex_search(out, m, std::regex(R"(status: ([A-Z]+))"))) d.status = m[1];
    if (std::regex_search(out, m, std::regex(R"(;; flags: ([a-z ]*);)"))) {
        std::istringstream flags(m[1].str());
        for (std::string f; flags >> f;) d.flags.push_back(f);
    }
    if (std::regex_search(out, m, std::regex(R"(;; Query time: (\d+) msec)")))
        d.query_ms = std::stol(m[1]);
    d.retried_over_tcp = out.find(";; Truncated, retrying in TCP mode.") != std::string::npos;
    // With retries the output holds a header per attempt; the answer of the last one counts.
    size_t section = out.rfind(";; ANSWER SECTION:\n");
    if (section != std::string::npos) {
        std::istringstream lines(out.substr(section + 19));
        for (std::string line; std::getline(lines, line) && !line.empty();) {
            std::istringstream fields(line);
            Record r;
            std::string klass;
            fields >> r.name >> r.ttl >> klass >> r.type;
            std::getline(fields >> std::ws, r.data);
            d.answers.push_back(r);
        }
    }
    return d;
}

std::vector<std::string> sorted(std::vector<std::string> v) {
    std::sort(v.begin(), v.end());
    return v;
}

class DnsServerTest : public ::testing::Test {
  protected:
    void SetUp() override {
        if (!findExecutable("dnsmasq")) GTEST_SKIP() << "dnsmasq is not installed";
        if (!findExecutable("dig")) GTEST_SKIP() << "dig (bind9-dnsutils) is not installed";
    }
};

TEST_F(DnsServerTest, AddressChangesAreVisibleToTheNextQuery) {
    DnsServer dns;
    ASSERT_TRUE(dns.start());
    EXPECT_EQ(dns.address(), "127.0.0.1:" + std::to_string(dns.port()));

    auto t0 = Clock::now();
    ASSERT_TRUE(dns.setAddresses("web.test", {"127.0.0.5", "::1"}));
    std::cout << "setAddresses took " << secondsSince(t0) * 1000 << " ms\n";
    DigResult a = dig(dns.port(), "web.test", "A");
    EXPECT_EQ(a.status, "NOERROR") << a.describe();
    EXPECT_EQ(a.data("A"), std::vector<std::string>{"127.0.0.5"}) << a.describe();
    DigResult aaaa = dig(dns.port(), "web.test", "AAAA");
    EXPECT_EQ(aaaa.data("AAAA"), std::vector<std::string>{"::1"}) << aaaa.describe();

    // Replaced, not added to: the old address is gone from the very next query (UDP, served by
    // dnsmasq's main process, so no cache of the old answer exists anywhere).
    for (int round = 0; round < 3; ++round) {
        std::string last = "127.0.0." + std::to_string(10 + round);
        t0 = Clock::now();
        ASSERT_TRUE(dns.setAddresses("Web.Test.", {"127.0.0.6", last, "::ffff:127.0.0.8"}));
        std::cout << "setAddresses took " << secondsSince(t0) * 1000 << " ms\n";
        a = dig(dns.port(), "web.test", "A");
        EXPECT_EQ(a.data("A"), sorted({"127.0.0.6", last})) << a.describe();
        aaaa = dig(dns.port(), "web.test", "AAAA");
        EXPECT_EQ(aaaa.data("AAAA"), std::vector<std::string>{"::ffff:127.0.0.8"})
            << aaaa.describe();
    }

    // Other names are untouched by a change to one.
    ASSERT_TRUE(dns.setAddresses("other.test", {"127.0.0.20"}));
    EXPECT_EQ(dig(dns.port(), "web.test", "A").data("A"), sorted({"127.0.0.6", "127.0.0.12"}));

    // Empty removes the name.
    ASSERT_TRUE(dns.setAddresses("web.test", {}));
    a = dig(dns.port(), "web.test", "A");
    EXPECT_EQ(a.status, "NXDOMAIN") << a.describe();
    EXPECT_TRUE(a.answers.empty()) << a.describe();
    EXPECT_EQ(dig(dns.port(), "other.test", "A").data("A"), std::vector<std::string>{"127.0.0.20"});

    EXPECT_FALSE(dns.setAddresses("web.example", {"127.0.0.1"})) << "outside test.";
    EXPECT_FALSE(dns.setAddresses("web.test", {"not-an-address"}));
}

TEST_F(DnsServerTest, SrvChangesRestartOnTheSamePort) {
    DnsServer dns;
    ASSERT_TRUE(dns.start());
    uint16_t port = dns.port();
    ASSERT_TRUE(dns.setAddresses("web.test", {"127.0.0.5"}));

    auto t0 = Clock::now();
    ASSERT_TRUE(dns.setSrv("_app._tcp.web.test", {{10, 20, 8080, "web.test"}}));
    std::cout << "setSrv (a restart of dnsmasq) took " << secondsSince(t0) * 1000 << " ms\n";
    EXPECT_EQ(dns.port(), port);
    DigResult srv = dig(port, "_app._tcp.web.test", "SRV");
    EXPECT_EQ(srv.status, "NOERROR") << srv.describe();
    EXPECT_EQ(srv.data("SRV"), std::vector<std::string>{"10 20 8080 web.test."}) << srv.describe();
    // dnsmasq adds the targets' addresses as additional records: not in the answer section.
    EXPECT_TRUE(srv.data("A").empty()) << srv.describe();

    ASSERT_TRUE(dns.setSrv("_app._tcp.web.test",
                           {{10, 60, 8081, "web.test"}, {20, 0, 9090, "backup.test."}}));
    EXPECT_EQ(dns.port(), port);
    srv = dig(port, "_app._tcp.web.test", "SRV");
    EXPECT_EQ(srv.data("SRV"), sorted({"10 60 8081 web.test.", "20 0 9090 backup.test."}))
        << srv.describe();
    // The restart kept the A records (they live in the hosts directory).
    EXPECT_EQ(dig(port, "web.test", "A").data("A"), std::vector<std::string>{"127.0.0.5"});

    ASSERT_TRUE(dns.setSrv("_app._tcp.web.test", {}));
    srv = dig(port, "_app._tcp.web.test", "SRV");
    EXPECT_EQ(srv.status, "NXDOMAIN") << srv.describe();
}

TEST_F(DnsServerTest, NxdomainNodataAndRefusedOutsideTheZone) {
    DnsServer dns;
    ASSERT_TRUE(dns.start());
    ASSERT_TRUE(dns.setAddresses("v4only.test", {"127.0.0.5"}));

    DigResult nx = dig(dns.port(), "nope.test", "A");
    EXPECT_EQ(nx.status, "NXDOMAIN") << nx.describe();
    EXPECT_TRUE(nx.answers.empty());
    DigResult nodata = dig(dns.port(), "v4only.test", "AAAA");
    EXPECT_EQ(nodata.status, "NOERROR") << nodata.describe();
    EXPECT_TRUE(nodata.answers.empty()) << nodata.describe();
    // Outside test. there is nowhere to forward to (no upstream servers at all).
    DigResult outside = dig(dns.port(), "name.invalid", "A");
    EXPECT_EQ(outside.status, "REFUSED") << outside.describe();
}

TEST_F(DnsServerTest, FailingDomainAnswersServfailQuickly) {
    DnsServer dns;
    ASSERT_TRUE(dns.start());
    ASSERT_TRUE(dns.setAddresses("web.test", {"127.0.0.5"}));
    ASSERT_TRUE(dns.setAddresses("down.test", {"127.0.0.6"}));
    EXPECT_FALSE(dns.failWithServfail("down.test")) << "local records would answer first";
    ASSERT_TRUE(dns.setAddresses("down.test", {}));

    auto t0 = Clock::now();
    ASSERT_TRUE(dns.failWithServfail("down.test"));
    std::cout << "failWithServfail took " << secondsSince(t0) * 1000 << " ms\n";
    for (const auto& [name, type, extra] :
         std::vector<std::tuple<std::string, std::string, std::vector<std::string>>>{
             {"down.test", "A", {}},
             {"down.test", "AAAA", {"+noedns"}},
             {"api.down.test", "SRV", {}},
             {"down.test", "A", {"+tcp"}}}) {
        DigResult d = dig(dns.port(), name, type, extra);
        EXPECT_EQ(d.status, "SERVFAIL") << d.describe();
        EXPECT_GE(d.query_ms, 0) << d.describe();
        EXPECT_LT(d.query_ms, 500) << d.describe();
        std::cout << "SERVFAIL for " << name << " " << type << (extra.empty() ? "" : " " + extra[0])
                  << " in " << d.query_ms << " ms\n";
    }
    // Two queries on one TCP connection: dnsmasq keeps its connection to the responder too.
    DigResult two = dig(dns.port(), "down.test", "AAAA", {"+tcp", "+keepopen", "down.test", "A"});
    size_t servfails = 0;
    for (size_t at = 0; (at = two.run.out.find("status: SERVFAIL", at)) != std::string::npos; ++at)
        ++servfails;
    EXPECT_EQ(servfails, 2u) << two.describe();

    // Everything else still answers.
    EXPECT_EQ(dig(dns.port(), "web.test", "A").data("A"), std::vector<std::string>{"127.0.0.5"});
    EXPECT_EQ(dig(dns.port(), "nope.test", "A").status, "NXDOMAIN");

    // Still failing after a restart; then healed.
    ASSERT_TRUE(dns.restart());
    EXPECT_EQ(dig(dns.port(), "down.test", "A").status, "SERVFAIL");
    ASSERT_TRUE(dns.stopFailing("down.test"));
    EXPECT_EQ(dig(dns.port(), "down.test", "A").status, "NXDOMAIN");
}

TEST_F(DnsServerTest, FortyRecordsTruncateOverUdpAndComeWholeOverTcp) {
    DnsServer dns;
    ASSERT_TRUE(dns.start());
    std::vector<std::string> addrs;
    for (int i = 10; i < 50; ++i) addrs.push_back("127.0.1." + std::to_string(i));
    ASSERT_TRUE(dns.setAddresses("many.test", addrs));

    // No EDNS, as c-ares sends by default: 40 * 16 bytes of answers do not fit in 512.
    DigResult udp = dig(dns.port(), "many.test", "A", {"+noedns", "+ignore"});
    EXPECT_EQ(udp.status, "NOERROR") << udp.describe();
    EXPECT_TRUE(udp.hasFlag("tc")) << udp.describe();
    EXPECT_LT(udp.answers.size(), 40u) << udp.describe();
    std::cout << "UDP without EDNS: TC set, " << udp.answers.size() << " of 40 records\n";

    DigResult tcp = dig(dns.port(), "many.test", "A", {"+tcp", "+noedns"});
    EXPECT_FALSE(tcp.hasFlag("tc")) << tcp.describe();
    EXPECT_EQ(tcp.data("A"), sorted(addrs)) << tcp.describe();

    // What a resolver does with TC: retry over TCP, and get them all.
    DigResult retried = dig(dns.port(), "many.test", "A", {"+noedns"});
    EXPECT_TRUE(retried.retried_over_tcp) << retried.describe();
    EXPECT_EQ(retried.data("A"), sorted(addrs)) << retried.describe();

    // With EDNS (1232 bytes) they fit in one UDP answer.
    DigResult edns = dig(dns.port(), "many.test", "A", {"+ignore"});
    EXPECT_FALSE(edns.hasFlag("tc")) << edns.describe();
    EXPECT_EQ(edns.answers.size(), 40u) << edns.describe();
}

TEST_F(DnsServerTest, AnswersCarryTheConfiguredTtlLiterally) {
    for (uint32_t ttl : {0u, 5u, 86400u}) {
        SCOPED_TRACE("ttl " + std::to_string(ttl));
        DnsServer dns;
        ASSERT_TRUE(dns.start({.ttl = ttl}));
        ASSERT_TRUE(dns.setAddresses("web.test", {"127.0.0.5", "::1"}));
        ASSERT_TRUE(dns.setSrv("_app._tcp.web.test", {{1, 1, 80, "web.test"}}));
        for (const char* type : {"A", "AAAA", "SRV"}) {
            DigResult d = dig(dns.port(),
                              type == std::string("SRV") ? "_app._tcp.web.test" : "web.test", type);
            ASSERT_EQ(d.answers.size(), 1u) << d.describe();
            EXPECT_EQ(d.answers[0].ttl, static_cast<long>(ttl)) << type << "\n" << d.describe();
        }
    }
}

TEST_F(DnsServerTest, StopAndRestartKeepPortAndRecords) {
    DnsServer dns;
    ASSERT_TRUE(dns.start());
    uint16_t port = dns.port();
    ASSERT_TRUE(dns.setAddresses("web.test", {"127.0.0.5"}));

    dns.stop();
    EXPECT_FALSE(dns.running());
    auto t0 = Clock::now();
    // UDP: refused (ICMP port unreachable) or, when the kernel rate-limits ICMP, a timeout.
    DigResult down = dig(port, "web.test", "A", {"+time=1"});
    EXPECT_TRUE(down.status.empty()) << down.describe();
    EXPECT_NE(down.run.status.code, 0) << down.describe();
    std::cout << "query to the stopped server failed after " << secondsSince(t0) * 1000
              << " ms: " << down.run.out.substr(0, down.run.out.find('\n')) << "\n";
    DigResult down_tcp = dig(port, "web.test", "A", {"+tcp"});
    EXPECT_TRUE(down_tcp.status.empty()) << down_tcp.describe();

    // Changes while stopped are kept for the restart.
    ASSERT_TRUE(dns.setAddresses("web.test", {"127.0.0.6"}));
    ASSERT_TRUE(dns.restart());
    EXPECT_TRUE(dns.running());
    EXPECT_EQ(dns.port(), port);
    EXPECT_EQ(dig(port, "web.test", "A").data("A"), std::vector<std::string>{"127.0.0.6"});
    EXPECT_EQ(dig(port, "web.test", "A", {"+tcp"}).data("A"),
              std::vector<std::string>{"127.0.0.6"});
}

TEST_F(DnsServerTest, RecordsSetBeforeStartAreServedFromTheFirstQuery) {
    DnsServer dns;
    ASSERT_TRUE(dns.setAddresses("web.test", {"127.0.0.5"}));
    ASSERT_TRUE(dns.setSrv("_app._tcp.web.test", {{1, 2, 3, "web.test"}}));
    ASSERT_TRUE(dns.start());
    EXPECT_EQ(dig(dns.port(), "web.test", "A").data("A"), std::vector<std::string>{"127.0.0.5"});
    EXPECT_EQ(dig(dns.port(), "_app._tcp.web.test", "SRV").data("SRV"),
              std::vector<std::string>{"1 2 3 web.test."});
}

TEST_F(DnsServerTest, QueriesForCountsLoggedQueriesButNotItsOwn) {
    DnsServer dns;
    ASSERT_TRUE(dns.start());
    ASSERT_TRUE(dns.setAddresses("web.test", {"127.0.0.5", "::1"}));
    EXPECT_EQ(dns.queriesFor("web.test"), 0u) << "the verification queries are left out";

    for (int i = 0; i < 3; ++i) dig(dns.port(), "web.test", "A");
    dig(dns.port(), "web.test", "AAAA");
    dig(dns.port(), "web.test", "AAAA", {"+tcp"});
    dig(dns.port(), "nope.test", "A");
    EXPECT_EQ(dns.queriesFor("web.test"), 5u);
    EXPECT_EQ(dns.queriesFor("WEB.test."), 5u);
    EXPECT_EQ(dns.queriesFor("web.test", "A"), 3u);
    EXPECT_EQ(dns.queriesFor("web.test", "AAAA"), 2u);
    EXPECT_EQ(dns.queriesFor("nope.test"), 1u);
    EXPECT_EQ(dns.queriesFor("other.test"), 0u);

    // The log is appended to across restarts.
    ASSERT_TRUE(dns.restart());
    dig(dns.port(), "web.test", "A");
    EXPECT_EQ(dns.queriesFor("web.test"), 6u);
}

}  // namespace
}  // namespace zcrelay::test::dns_server_test
