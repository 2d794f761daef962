#include "support/short_connection_load.hpp"

#include <algorithm>
#include <utility>

namespace zcrelay::test {

ShortConnectionLoad::ShortConnectionLoad(Connect connect, int threads, int max_per_thread)
    : connect_(std::move(connect)), threads_count_(threads), max_per_thread_(max_per_thread) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this, i] { run(i); });
}

ShortConnectionLoad::~ShortConnectionLoad() { stop(); }

void ShortConnectionLoad::stop() {
    stop_.store(true);
    for (auto& t : threads_)
        if (t.joinable()) t.join();
}

size_t ShortConnectionLoad::total() const {
    std::lock_guard lock(mu_);
    return visits_.size();
}

bool ShortConnectionLoad::waitForTotal(size_t n, Millis timeout) const {
    return waitUntil([&] { return total() >= n; }, timeout);
}

bool ShortConnectionLoad::waitEachThreadPast(Clock::time_point since, Millis timeout) const {
    return waitUntil(
        [&] {
            std::lock_guard lock(mu_);
            for (int t = 0; t < threads_count_; ++t) {
                if (std::none_of(visits_.begin(), visits_.end(), [&](const ShortVisit& v) {
                        return v.thread == t && v.started >= since;
                    }))
                    return false;
            }
            return true;
        },
        timeout);
}

std::map<char, int> ShortConnectionLoad::tagsSince(Clock::time_point since) const {
    std::lock_guard lock(mu_);
    std::map<char, int> out;
    for (const ShortVisit& v : visits_)
        if (v.started >= since) ++out[v.tag];
    return out;
}

std::vector<std::string> ShortConnectionLoad::failures() const {
    std::lock_guard lock(mu_);
    std::vector<std::string> out;
    for (const ShortVisit& v : visits_)
        if (!v.error.empty()) out.push_back(v.error);
    return out;
}

std::string ShortConnectionLoad::describeFailures() const {
    auto f = failures();
    std::string out =
        std::to_string(f.size()) + " of " + std::to_string(total()) + " connections failed";
    for (size_t i = 0; i < f.size() && i < 5; ++i) out += "\n  " + f[i];
    return out;
}

void ShortConnectionLoad::run(int thread) {
    const auto begin = Clock::now();
    for (int i = 0; i < max_per_thread_ && !stop_.load() && secondsSince(begin) < 60; ++i) {
        ShortVisit v = connect_(thread, i, stop_);
        v.thread = thread;
        {
            std::lock_guard lock(mu_);
            visits_.push_back(std::move(v));
        }
        // A few ms apart: a steady stream, not a flood (about 200 a second per thread).
        std::this_thread::sleep_for(Millis{4});
    }
}

}  // namespace zcrelay::test
