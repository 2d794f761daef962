#include "process_stats.hpp"

#include <dirent.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace zcrelay {
namespace {

// Entries of a /proc directory, "." and ".." aside; `each` sees every name.
template <class F>
int forEachEntry(const char* path, F each) {
    DIR* d = ::opendir(path);
    if (d == nullptr) return -1;
    int n = 0;
    while (dirent* e = ::readdir(d)) {
        if (e->d_name[0] == '.') continue;
        ++n;
        each(e->d_name);
    }
    ::closedir(d);
    return n;
}

double bootTimeSeconds() {
    FILE* f = std::fopen("/proc/stat", "r");
    if (f == nullptr) return -1;
    char line[256];
    double btime = -1;
    while (std::fgets(line, sizeof line, f) != nullptr)
        if (std::sscanf(line, "btime %lf", &btime) == 1) break;
    std::fclose(f);
    return btime;
}

}  // namespace

ProcessStats readProcessStats() {
    ProcessStats ps;
    ps.open_fds = forEachEntry("/proc/self/fd", [](const char*) {});
    // The directory handle itself is one of the fds listed.
    if (ps.open_fds > 0) --ps.open_fds;
    int iowq = 0;
    ps.threads = forEachEntry("/proc/self/task", [&](const char* tid) {
        std::string path = std::string("/proc/self/task/") + tid + "/comm";
        FILE* f = std::fopen(path.c_str(), "r");
        if (f == nullptr) return;
        char comm[32] = {};
        if (std::fgets(comm, sizeof comm, f) != nullptr && std::strncmp(comm, "iou-wrk", 7) == 0)
            ++iowq;
        std::fclose(f);
    });
    ps.iowq_workers = ps.threads < 0 ? -1 : iowq;
    rlimit nofile{};
    if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0) ps.max_fds = static_cast<int64_t>(nofile.rlim_cur);
    long page = ::sysconf(_SC_PAGESIZE);
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
        long size = 0, resident = 0;
        if (std::fscanf(f, "%ld %ld", &size, &resident) == 2) {
            ps.virtual_bytes = static_cast<int64_t>(size) * page;
            ps.rss_bytes = static_cast<int64_t>(resident) * page;
        }
        std::fclose(f);
    }
    // /proc/self/stat: utime and stime (fields 14, 15) and starttime (22), in clock ticks;
    // the fields after the command's closing parenthesis (the name may hold spaces).
    if (FILE* f = std::fopen("/proc/self/stat", "r")) {
        char buf[1024] = {};
        size_t n = std::fread(buf, 1, sizeof buf - 1, f);
        std::fclose(f);
        const char* rest = std::strrchr(buf, ')');
        unsigned long utime = 0, stime = 0;
        unsigned long long start = 0;
        if (n > 0 && rest != nullptr &&
            std::sscanf(rest + 2,
                        "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu %*d %*d %*d %*d %*d "
                        "%*d %llu",
                        &utime, &stime, &start) == 3) {
            double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
            ps.cpu_seconds = static_cast<double>(utime + stime) / tick;
            double boot = bootTimeSeconds();
            if (boot >= 0) ps.start_time_seconds = boot + static_cast<double>(start) / tick;
        }
    }
    return ps;
}

}  // namespace zcrelay
