#pragma once
// ctest labels a case declares beside its own code, with the reason:
//
//   TEST_P(DiscoveryScaleTest, PublishesUnderLoad) { ... }
//   ZCRELAY_LABEL(DiscoveryScaleTest, PublishesUnderLoad, "copy,sockmap", kSanitizeSkip,
//                 "the publish path is the splice case's; those data paths run elsewhere");
//
// The declaration names the class gtest generated for the case, so renaming the case without
// it fails the build instead of silently dropping the label (a name regex did that). The third
// argument limits it to the instances whose parameter name matches one of its comma-separated
// globs ("*_100MiB*"; "" = every instance); a declaration that matches no case fails the build
// too. The build asks each test binary for its labels after linking it
// (--zcrelay_ctest_labels, tests/CMakeLists.txt) and ctest attaches them to the cases.
//
// The labels, and what each makes ctest do besides carrying the name:
//   kSanitizeSkip  sanitize-skip: tests/sanitize/run.sh leaves the case out (-LE). The reason
//                  says why its relay code is run by other cases.
//   kCpuBound      cpu-bound: PROCESSORS 2 and RESOURCE_LOCK cpu_bound. The case keeps the CPUs
//                  busy for seconds (40,000 connections, megabytes of YAML to parse) against a
//                  deadline: it takes two of ctest's -j slots, and no other such case runs
//                  beside it. The cases that mostly wait still do. COST 1000 starts these
//                  early (a fresh clone has no timings to order by): one after the other,
//                  they would otherwise end the run.
//   kHostPipePages host-pipe-pages: RESOURCE_LOCK host_pipe_pages. The case changes
//                  /proc/sys/fs/pipe-user-pages-*, which is host-wide, not per network namespace.
//
// A RESOURCE_LOCK binds one ctest only, and the sanitizer runs are ctests of their own beside
// the main one (tests/sanitize/run.sh): their cpu-bound cases ran beside the main run's, and a
// pipe-pages case of one beside another's. So the test process itself also takes the lock, as
// an flock on /tmp/zcrelay-test-LOCK.lock, before its first case (holdHostResources).
#include <gtest/gtest.h>

#include <string>

namespace zcrelay::test {

inline constexpr const char* kSanitizeSkip = "sanitize-skip";
inline constexpr const char* kCpuBound = "cpu-bound";
inline constexpr const char* kHostPipePages = "host-pipe-pages";

// Records a declaration; returns true so it can initialise a static.
bool declareLabel(const char* suite, const char* test_case, const char* params, const char* label,
                  const char* why);

// Writes `set_tests_properties(NAME PROPERTIES LABELS "BASE;label..." ...)` for every case of
// this binary that declared a label, named as ctest's gtest discovery names them (with
// `prefix`). Fails (false, with a message on stderr) on a declaration that matches no case.
bool writeCtestLabels(const std::string& file, const std::string& base_label,
                      const std::string& prefix);

// Adds to --gtest_filter's negative patterns every case that declares one of `labels`
// (comma-separated): what `ctest -LE` does for cases ctest runs one by one, for a binary that runs
// as one process (the sanitizer trees' unit cases, tests/CMakeLists.txt).
void leaveOutLabelled(const std::string& labels);

// Takes, until the process exits, the host-wide lock of each label of the cases --gtest_filter
// selects (cpu_bound, host_pipe_pages), waiting for another test process that holds one.
void holdHostResources();

}  // namespace zcrelay::test

#define ZCRELAY_LABEL_CAT2(a, b) a##b
#define ZCRELAY_LABEL_CAT(a, b) ZCRELAY_LABEL_CAT2(a, b)
#define ZCRELAY_LABEL(suite, test_case, params, label, why)                                  \
    static_assert(sizeof(GTEST_TEST_CLASS_NAME_(suite, test_case)) > 0,                      \
                  "ZCRELAY_LABEL names a case that does not exist: " #suite "." #test_case); \
    [[maybe_unused]] static const bool ZCRELAY_LABEL_CAT(zcrelay_label_, __LINE__) =         \
        ::zcrelay::test::declareLabel(#suite, #test_case, params, label, why)
