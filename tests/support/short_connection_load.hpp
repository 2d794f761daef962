#pragma once
// A continuous client load of short connections through a relay, for the cases that change the
// relay's backends while clients keep coming (the runtime API's drain and maint, discovery
// scaling a name up and down): each of a few threads opens one connection after another, a few
// milliseconds apart, and every connection is recorded with the moment it started, the tag
// byte of the backend that served it and what went wrong. The case then asks which backends
// served the connections started after its change, and whether any failed.
//
// What one connection does (how deep it checks the relay) is the case's: it passes it in.
// Bounded: at most `max_per_thread` connections and 60 s per thread; stop() (the destructor
// too) ends and joins every thread.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "support/loopback.hpp"

namespace zcrelay::test {

// One short connection of a load, or made alone.
struct ShortVisit {
    Clock::time_point started;
    char tag = 0;       // the tag byte of the backend that served it; 0: no backend answered
    std::string error;  // empty: every step the connection checks succeeded
    int thread = 0;     // the load's thread that made it
};

class ShortConnectionLoad {
  public:
    // Makes connection number `i` of thread `thread` and says how it went; `stop` is set once
    // the load is stopping (a wait may end early on it).
    using Connect =
        std::function<ShortVisit(int thread, int i, const std::atomic<bool>& stop)>;

    ShortConnectionLoad(Connect connect, int threads, int max_per_thread);
    ~ShortConnectionLoad();
    ShortConnectionLoad(const ShortConnectionLoad&) = delete;
    ShortConnectionLoad& operator=(const ShortConnectionLoad&) = delete;

    void stop();
    size_t total() const;
    bool waitForTotal(size_t n, Millis timeout) const;
    // Each thread finished a connection it started at or after `since`: every connection any
    // thread started before `since` is over (a thread runs one at a time).
    bool waitEachThreadPast(Clock::time_point since, Millis timeout) const;
    // Per tag, the connections that started at or after `since` (tag 0: no backend answered).
    std::map<char, int> tagsSince(Clock::time_point since) const;
    std::vector<std::string> failures() const;
    // "N of M connections failed" and the first five errors.
    std::string describeFailures() const;

  private:
    void run(int thread);

    Connect connect_;
    int threads_count_;
    int max_per_thread_;
    std::atomic<bool> stop_{false};
    mutable std::mutex mu_;
    std::vector<ShortVisit> visits_;
    std::vector<std::thread> threads_;  // last: started once the rest is built
};

}  // namespace zcrelay::test
