// The labels a case declares beside its code (support/labels.hpp) reach ctest under the names
// gtest_discover_tests gives the cases: a name that differs would label nothing, silently.
#include "support/labels.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

namespace zcrelay::test {
namespace {

class LabelledByMode : public ::testing::TestWithParam<std::string> {};

TEST_P(LabelledByMode, OnlyTheDeclaredInstancesCarryTheLabel) { SUCCEED(); }
ZCRELAY_LABEL(LabelledByMode, OnlyTheDeclaredInstancesCarryTheLabel, "copy,sock*", kSanitizeSkip,
              "this file's own check of the declaration");

INSTANTIATE_TEST_SUITE_P(Modes, LabelledByMode, ::testing::Values("splice", "copy", "sockmap"),
                         [](const auto& info) { return info.param; });

TEST(LabelledPlain, CarriesTwoLabels) { SUCCEED(); }
ZCRELAY_LABEL(LabelledPlain, CarriesTwoLabels, "", kCpuBound, "this file's own check");
ZCRELAY_LABEL(LabelledPlain, CarriesTwoLabels, "", kSanitizeSkip, "this file's own check");

// What the binary writes for ctest, as the build asks for it: every case, whatever filter ctest
// ran this one case with.
std::string written(const std::string& prefix) {
    const std::string filter = GTEST_FLAG_GET(filter);
    GTEST_FLAG_SET(filter, "*");
    char path[] = "/tmp/zcrelay-labels-XXXXXX";
    const int fd = ::mkstemp(path);
    EXPECT_GE(fd, 0);
    ::close(fd);
    EXPECT_TRUE(writeCtestLabels(path, "unit", prefix));
    GTEST_FLAG_SET(filter, filter);
    std::ifstream f(path);
    std::stringstream text;
    text << f.rdbuf();
    ::unlink(path);
    return text.str();
}

TEST(Labels, AreWrittenUnderCtestsNamesWithTheirProperties) {
    const std::string out = written("");
    EXPECT_NE(out.find("set_tests_properties(\"Modes/LabelledByMode."
                       "OnlyTheDeclaredInstancesCarryTheLabel/copy\" PROPERTIES LABELS "
                       "\"unit;sanitize-skip\")"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("OnlyTheDeclaredInstancesCarryTheLabel/sockmap\""), std::string::npos)
        << out;
    EXPECT_EQ(out.find("OnlyTheDeclaredInstancesCarryTheLabel/splice"), std::string::npos) << out;
    EXPECT_NE(out.find("set_tests_properties(\"LabelledPlain.CarriesTwoLabels\" PROPERTIES LABELS "
                       "\"unit;cpu-bound;sanitize-skip\" PROCESSORS 2 RESOURCE_LOCK cpu_bound COST 1000)"),
              std::string::npos)
        << out;
}

TEST(Labels, CarryTheRerunsPrefix) {
    EXPECT_NE(written("send_zerocopy.").find("\"send_zerocopy.LabelledPlain.CarriesTwoLabels\""),
              std::string::npos);
}

// A binary run as one process (the sanitizer trees' unit cases) leaves out what ctest's -LE
// would, by adding the labelled instances to the filter's negative part, after what it had.
TEST(Labels, LeftOutCasesJoinTheFiltersNegativePatterns) {
    const std::string filter = GTEST_FLAG_GET(filter);
    GTEST_FLAG_SET(filter, "*Labelled*-Other.Case");
    leaveOutLabelled("sanitize-skip,unknown-label");
    const std::string got = GTEST_FLAG_GET(filter);
    GTEST_FLAG_SET(filter, "*Labelled*");
    leaveOutLabelled("cpu-bound");
    const std::string only_cpu = GTEST_FLAG_GET(filter);
    GTEST_FLAG_SET(filter, filter);
    EXPECT_EQ(got,
              "*Labelled*-Other.Case:LabelledPlain.CarriesTwoLabels:"
              "Modes/LabelledByMode.OnlyTheDeclaredInstancesCarryTheLabel/copy:"
              "Modes/LabelledByMode.OnlyTheDeclaredInstancesCarryTheLabel/sockmap");
    EXPECT_EQ(only_cpu, "*Labelled*-LabelledPlain.CarriesTwoLabels");
}

}  // namespace
}  // namespace zcrelay::test
