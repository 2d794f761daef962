#pragma once
// What the `mode: auto` tests of the real binary (auto_mode_*_test.cpp) share: the listener's
// byte counts by path, read from one scrape, and the bound on what moved through user memory.
//
// mode auto starts every connection on splice and promotes one that talks request/response to
// sockmap (pump/paths.hpp). The tests hold it to its two promises with the relay's own metrics:
// bulk never leaves the kernel (nothing by copy, nothing passed to user space), and a promoted
// connection keeps every byte in order across the switch.
#include <gtest/gtest.h>

#include <string>

#include "support/relay_process.hpp"

namespace zcrelay::test::auto_mode_test {

// zcrelay_bytes_total{listener="t"} by path, both directions summed, and what of it user space
// moved for the sockmap path (zcrelay_sockmap_copied_bytes_total), from one scrape.
struct PathBytes {
    double splice = 0;
    double copy = 0;
    double sockmap = 0;
    double sockmap_copied = 0;

    double total() const { return splice + copy + sockmap; }
    // Through user memory: the copy path's bytes and the ones the program passed.
    double throughUserMemory() const { return copy + sockmap_copied; }
    std::string describe() const {
        return "splice " + std::to_string(static_cast<long long>(splice)) + ", copy " +
               std::to_string(static_cast<long long>(copy)) + ", sockmap " +
               std::to_string(static_cast<long long>(sockmap)) + " (of which copied " +
               std::to_string(static_cast<long long>(sockmap_copied)) + ")";
    }
};

inline PathBytes pathBytes(const RelayProcess& relay) {
    PathBytes out;
    auto body = relay.scrape();
    if (!body) return out;
    auto value = [&](const std::string& name, const Labels& labels) {
        return findSample(*body, name, labels).value_or(0);
    };
    for (const char* direction : {"upstream", "downstream"}) {
        Labels l = metric::bytes(direction);
        l["path"] = "splice";
        out.splice += value(metric::kBytesTotal, l);
        l["path"] = "copy";
        out.copy += value(metric::kBytesTotal, l);
        l["path"] = "sockmap";
        out.sockmap += value(metric::kBytesTotal, l);
    }
    out.sockmap_copied = value(metricName(Metric::SockmapCopiedBytes), metric::listener());
    return out;
}

// zcrelay_datapath_switches_total{listener="t", from="splice", to=`to`, reason="interactive"}.
inline Labels promoted(const std::string& to = "sockmap") {
    return {{"listener", "t"}, {"from", "splice"}, {"to", to}, {"reason", "interactive"}};
}

// The bound for bulk through a mode auto listener: at most 5 % through user memory.
inline ::testing::AssertionResult mostlyInTheKernel(const PathBytes& b, double min_total) {
    if (b.total() < min_total)
        return ::testing::AssertionFailure()
               << "the relay counted " << b.describe() << ", under the " << min_total
               << " bytes the clients moved";
    if (b.throughUserMemory() > 0.05 * b.total())
        return ::testing::AssertionFailure() << "more than 5 % through user memory: " << b.describe();
    return ::testing::AssertionSuccess();
}

}  // namespace zcrelay::test::auto_mode_test
