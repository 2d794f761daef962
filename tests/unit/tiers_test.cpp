// Which backends serve: primaries while one of them takes connections, then the backups
// (the first one up, or all of them with all_backups), then nobody.
#include <gtest/gtest.h>

#include <memory>

#include "runtime.hpp"
#include "unit/config_values.hpp"

namespace zcrelay {
namespace {

ClusterRt cluster(std::initializer_list<bool> backups, bool all_backups) {
    ClusterRt c;
    c.config.name = "db";
    c.config.all_backups = all_backups;
    int port = 5432;
    for (bool backup : backups) {
        BackendRt b;
        b.config.address = unit::addr("127.0.0.1:" + std::to_string(port++));
        b.config.backup = backup;
        b.config.tier = backup ? 1 : 0;
        b.key = b.config.address.toString();
        b.state = std::make_shared<BackendState>(1);
        c.tiered = c.tiered || backup;
        c.backends.push_back(std::move(b));
    }
    return c;
}

std::string servingSet(const ClusterRt& c) {
    const Serving s = c.serving();
    std::string out;
    for (size_t i = 0; i < c.backends.size(); ++i) out += s.admits(c.backends, i) ? '1' : '0';
    return out;
}

TEST(Tiers, BackupsServeOnlyWhileEveryPrimaryIsDown) {
    ClusterRt c = cluster({false, false, true, true}, false);
    EXPECT_EQ(servingSet(c), "1100");
    c.backends[0].state->markUp(false);
    EXPECT_EQ(servingSet(c), "0100");
    c.backends[1].state->admin.store(AdminState::Maint);  // the runtime API counts as down too
    EXPECT_EQ(servingSet(c), "0010") << "without all_backups, the first backup only";
    c.backends[2].state->markUp(false);
    EXPECT_EQ(servingSet(c), "0001") << "the next backup when the first is down";
    c.backends[3].state->markUp(false);
    EXPECT_EQ(servingSet(c), "0000");
    EXPECT_FALSE(c.serving().any);
    c.backends[1].state->admin.store(AdminState::Ready);
    EXPECT_EQ(servingSet(c), "0100") << "a primary's return takes the traffic back";
}

TEST(Tiers, AllBackupsShareTheLoad) {
    ClusterRt c = cluster({true, false, true}, true);
    EXPECT_EQ(servingSet(c), "010");
    c.backends[1].state->markUp(false);
    EXPECT_EQ(servingSet(c), "101");
}

TEST(Tiers, AClusterWithoutBackupsServesEveryBackendThatIsUp) {
    ClusterRt c = cluster({false, false}, false);
    EXPECT_FALSE(c.tiered);
    c.backends[1].state->weight_override.store(0);
    EXPECT_EQ(servingSet(c), "10");
}

}  // namespace
}  // namespace zcrelay
