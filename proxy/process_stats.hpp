#pragma once
// What the process looks like from /proc/self, read at scrape time (never by a worker).
#include <cstdint>

namespace zcrelay {

struct ProcessStats {
    int threads = -1;         // every thread, io_uring's io-wq workers included
    int iowq_workers = -1;    // threads named iou-wrk-*: io_uring punted work to a thread
    int open_fds = -1;
    int64_t max_fds = -1;     // RLIMIT_NOFILE
    int64_t rss_bytes = -1;
    int64_t virtual_bytes = -1;
    double cpu_seconds = -1;  // user + system
    double start_time_seconds = -1;  // since the epoch
};

ProcessStats readProcessStats();

}  // namespace zcrelay
