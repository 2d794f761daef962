#include "signals.hpp"

#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

namespace zcrelay {
namespace {

std::string readme() {
    std::ifstream in(std::string(ZCRELAY_SOURCE_DIR) + "/docs/operating.md");
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
}

// The signal table in docs/operating.md is the one operators read; kSignals is the one the
// process obeys.
// Every signal the relay takes has its row, saying what the table here says, and no row names a
// signal it does not take.
TEST(Signals, TheOperatorsTableIsTheTableTheRelayObeys) {
    const std::string text = readme();
    ASSERT_FALSE(text.empty()) << "docs/operating.md not found under " << ZCRELAY_SOURCE_DIR;
    for (const SignalSpec& s : kSignals) {
        const std::string row = "| `" + std::string(s.name) + "` | " + std::string(s.what) + " |";
        EXPECT_NE(text.find(row), std::string::npos) << "docs/operating.md lacks the row\n" << row;
    }
    const size_t table = text.find("| signal | what zcrelay does |");
    ASSERT_NE(table, std::string::npos);
    std::istringstream lines(text.substr(table));
    std::string line;
    std::getline(lines, line);  // header
    std::getline(lines, line);  // |---|---|
    size_t rows = 0;
    while (std::getline(lines, line) && line.rfind("| `SIG", 0) == 0) ++rows;
    EXPECT_EQ(rows, kSignals.size()) << "rows in docs/operating.md's table";
}

TEST(Signals, EachSignalOnceAndNoneThatCannotBeCaught) {
    std::set<int> seen;
    for (const SignalSpec& s : kSignals) {
        EXPECT_TRUE(seen.insert(s.signo).second) << s.name << " twice";
        EXPECT_NE(s.signo, SIGKILL);
        EXPECT_NE(s.signo, SIGSTOP);
        EXPECT_EQ(signalIndex(s.signo), static_cast<size_t>(&s - kSignals.data()));
    }
    EXPECT_EQ(signalIndex(SIGSEGV), kSignals.size()) << "faults keep their default action";
}

}  // namespace
}  // namespace zcrelay
