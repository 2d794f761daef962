#include "support/labels.hpp"

#include <fcntl.h>
#include <fnmatch.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string_view>
#include <vector>

namespace zcrelay::test {
namespace {

struct Declaration {
    std::string suite;
    std::string test_case;
    std::vector<std::string> params;  // globs of instance names; empty: every instance
    std::string label;
    std::string why;
    bool matched = false;
};

std::vector<Declaration>& declarations() {
    static std::vector<Declaration> all;
    return all;
}

// "a,b" -> {"a", "b"}; "" -> {}.
std::vector<std::string> split(std::string_view s, char separator) {
    std::vector<std::string> out;
    while (!s.empty()) {
        const size_t at = s.find(separator);
        out.emplace_back(s.substr(0, at));
        if (at == std::string_view::npos) break;
        s.remove_prefix(at + 1);
    }
    return out;
}

// The host-wide resource a label's cases hold one at a time, or nullptr (labels.hpp says why).
const char* resourceLock(const std::string& label) {
    if (label == kCpuBound) return "cpu_bound";
    if (label == kHostPipePages) return "host_pipe_pages";
    return nullptr;
}

// What a label makes ctest do besides carrying it.
std::string extraProperties(const std::string& label) {
    const char* lock = resourceLock(label);
    const std::string resource = lock ? std::string(" RESOURCE_LOCK ") + lock : "";
    if (label == kCpuBound) return " PROCESSORS 2" + resource + " COST 1000";
    return resource;
}

// The name CMake's gtest_discover_tests gives a case with NO_PRETTY_VALUES
// (tests/CMakeLists.txt): the suite and the case as gtest names them, "Modes/Suite.Case/splice".
// Its default would append the parameter's printed value, which for a struct is its bytes,
// pointers included: a name that changes from one run of the binary to the next.
std::string ctestName(const std::string& prefix, const ::testing::TestInfo& t) {
    return prefix + t.test_suite_name() + "." + t.name();
}

// gtest's --gtest_filter, which gtest applies only once RUN_ALL_TESTS runs: "POS:POS-NEG:NEG",
// each a glob of "Suite.Case".
bool selected(const std::string& full_name) {
    const std::string filter = GTEST_FLAG_GET(filter);
    const size_t dash = filter.find('-');
    auto any = [&](std::string_view globs) {
        for (const std::string& glob : split(globs, ':'))
            if (!glob.empty() && ::fnmatch(glob.c_str(), full_name.c_str(), 0) == 0) return true;
        return false;
    };
    const std::string_view all(filter);
    const std::string_view positive = all.substr(0, dash);
    const bool in = positive.empty() || any(positive);
    return in && (dash == std::string::npos || !any(all.substr(dash + 1)));
}

// Calls fn(case, declaration) for each declaration that names a case --gtest_filter selects.
template <class F>
void forEachDeclaredCase(F&& fn) {
    const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
    for (int s = 0; s < unit.total_test_suite_count(); ++s) {
        const ::testing::TestSuite& suite = *unit.GetTestSuite(s);
        // "Modes/RelayTest" for a parametrised suite: the declaration names the class.
        std::string_view suite_name = suite.name();
        if (const size_t slash = suite_name.find('/'); slash != std::string_view::npos)
            suite_name.remove_prefix(slash + 1);
        for (int i = 0; i < suite.total_test_count(); ++i) {
            const ::testing::TestInfo& t = *suite.GetTestInfo(i);
            // --gtest_filter: the reruns run only some cases.
            if (!selected(ctestName("", t))) continue;
            std::string_view name = t.name(), param;
            if (const size_t slash = name.find('/'); slash != std::string_view::npos) {
                param = name.substr(slash + 1);
                name = name.substr(0, slash);
            }
            for (Declaration& d : declarations()) {
                if (d.suite != suite_name || d.test_case != name) continue;
                bool wanted = d.params.empty();
                const std::string param_name(param);
                for (const std::string& p : d.params)
                    wanted = wanted || ::fnmatch(p.c_str(), param_name.c_str(), 0) == 0;
                if (wanted) fn(t, d);
            }
        }
    }
}

// ctest reads the file as CMake: quote the name, escape what a quoted argument interprets.
std::string quoted(const std::string& s) {
    std::string out = "\"";
    for (char ch : s) {
        if (ch == '"' || ch == '\\' || ch == '$' || ch == ';') out += '\\';
        out += ch;
    }
    return out + "\"";
}

}  // namespace

bool declareLabel(const char* suite, const char* test_case, const char* params, const char* label,
                  const char* why) {
    declarations().push_back({suite, test_case, split(params, ','), label, why});
    return true;
}

bool writeCtestLabels(const std::string& file, const std::string& base_label,
                      const std::string& prefix) {
    // name -> its labels beyond the base one, and the properties they bring.
    std::map<std::string, std::pair<std::vector<std::string>, std::string>> cases;
    forEachDeclaredCase([&](const ::testing::TestInfo& t, Declaration& d) {
        d.matched = true;
        auto& [labels, extra] = cases[ctestName(prefix, t)];
        labels.push_back(d.label);
        extra += extraProperties(d.label);
    });
    bool ok = true;
    for (const Declaration& d : declarations()) {
        // A filtered binary (the send_zerocopy reruns) legitimately runs only some cases.
        if (!d.matched && GTEST_FLAG_GET(filter) == "*") {
            std::fprintf(
                stderr,
                "ZCRELAY_LABEL(%s, %s, \"%s\"): no instance of the case has those parameters\n",
                d.suite.c_str(), d.test_case.c_str(),
                d.params.empty() ? "" : d.params.front().c_str());
            ok = false;
        }
    }
    std::ostringstream out;
    out << "# Written by the test binary (--zcrelay_ctest_labels): the labels its cases declare.\n";
    for (const auto& [name, what] : cases) {
        std::string labels = base_label;
        for (const std::string& l : what.first) labels += ";" + l;
        out << "set_tests_properties(" << quoted(name) << " PROPERTIES LABELS "
            << "\"" << labels << "\"" << what.second << ")\n";
    }
    std::ofstream f(file, std::ios::trunc);
    f << out.str();
    if (!f) {
        std::fprintf(stderr, "cannot write %s\n", file.c_str());
        return false;
    }
    return ok;
}

void leaveOutLabelled(const std::string& labels) {
    const std::vector<std::string> wanted = split(labels, ',');
    std::set<std::string> names;  // a case may declare two of them
    forEachDeclaredCase([&](const ::testing::TestInfo& t, Declaration& d) {
        if (std::find(wanted.begin(), wanted.end(), d.label) != wanted.end())
            names.insert(ctestName("", t));  // gtest's own full name, as the filter takes it
    });
    if (names.empty()) return;
    std::string filter = GTEST_FLAG_GET(filter);
    for (const std::string& name : names) {
        filter += filter.find('-') == std::string::npos ? "-" : ":";
        filter += name;
    }
    GTEST_FLAG_SET(filter, filter);
}

void holdHostResources() {
    // A std::set: every process takes its locks in the same order, so two cannot deadlock.
    std::set<std::string> locks;
    forEachDeclaredCase([&](const ::testing::TestInfo&, Declaration& d) {
        if (const char* lock = resourceLock(d.label)) locks.insert(lock);
    });
    for (const std::string& name : locks) {
        const std::string path = "/tmp/zcrelay-test-" + name + ".lock";
        // O_CLOEXEC: a relay the case starts must not hold the lock after the case is gone.
        // The descriptor stays open, and the lock held, until this process exits.
        const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (fd < 0) {
            std::fprintf(stderr, "cannot open %s (%s): running without that lock\n", path.c_str(),
                         std::strerror(errno));
            continue;
        }
        if (::flock(fd, LOCK_EX | LOCK_NB) == 0) continue;
        std::fprintf(stderr, "waiting for %s: another test process holds it\n", path.c_str());
        while (::flock(fd, LOCK_EX) != 0 && errno == EINTR) {
        }
    }
}

}  // namespace zcrelay::test
