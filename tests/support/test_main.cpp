// The main of every test binary (instead of gtest_main): the process moves into a network
// namespace of its own before gtest starts any case (support/netns.hpp), and it can print the
// ctest labels its cases declare (support/labels.hpp) for the build to attach.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>

#include "support/labels.hpp"
#include "support/netns.hpp"

int main(int argc, char** argv) {
    // --zcrelay_ctest_labels=FILE --zcrelay_ctest_base=LABEL [--zcrelay_ctest_prefix=P]: write
    // the labels the cases declare, as set_tests_properties() calls for ctest, and exit.
    std::string labels_file, base_label, prefix;
    for (int i = 1; i < argc; ++i) {
        const std::string_view arg = argv[i];
        for (auto [flag, value] :
             {std::pair{std::string_view("--zcrelay_ctest_labels="), &labels_file},
              std::pair{std::string_view("--zcrelay_ctest_base="), &base_label},
              std::pair{std::string_view("--zcrelay_ctest_prefix="), &prefix}}) {
            if (arg.substr(0, flag.size()) == flag) *value = arg.substr(flag.size());
        }
    }
    ::testing::InitGoogleTest(&argc, argv);
    if (!labels_file.empty())
        return zcrelay::test::writeCtestLabels(labels_file, base_label, prefix) ? 0 : 1;
    // ZCRELAY_TEST_LEAVE_OUT=LABEL[,LABEL]: the cases that declare one are not run, as ctest's
    // -LE leaves them out when it runs each case itself (tests/sanitize/run.sh sets it).
    if (const char* leave_out = std::getenv("ZCRELAY_TEST_LEAVE_OUT"); leave_out && *leave_out)
        zcrelay::test::leaveOutLabelled(leave_out);
    // Listing the cases (ctest's discovery at build time) needs no namespace.
    if (!GTEST_FLAG_GET(list_tests)) {
        zcrelay::test::isolate();
        zcrelay::test::holdHostResources();
    }
    return RUN_ALL_TESTS();
}
