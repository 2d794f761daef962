#pragma once
// The clocks a worker reads, and the timespec io_uring timeouts take.
#include <linux/time_types.h>
#include <time.h>

#include <cstdint>

#include "units.hpp"

namespace zcrelay {

inline int64_t clockUs(clockid_t clock) {
    timespec ts{};
    clock_gettime(clock, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

// The loop's clock, read once per batch of completions: coarse (no vDSO time read to speak of).
inline int64_t monotonicMs() { return clockUs(CLOCK_MONOTONIC_COARSE) / 1000; }
// Connect times, durations, check deadlines: fine-grained, read once or twice per event.
inline int64_t monotonicUs() { return clockUs(CLOCK_MONOTONIC); }
inline int64_t wallClockUs() { return clockUs(CLOCK_REALTIME); }

inline __kernel_timespec usToTimespec(int64_t us) {
    __kernel_timespec ts{};
    ts.tv_sec = us / 1000000;
    ts.tv_nsec = (us % 1000000) * 1000;
    return ts;
}

inline __kernel_timespec toTimespec(Duration d) { return usToTimespec(d.count() * 1000); }

}  // namespace zcrelay
