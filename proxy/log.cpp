#include "log.hpp"

#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>

namespace zcrelay {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::Info)};
thread_local const char* t_name = "main";
constexpr const char* kLevelNames[] = {"debug", "info", "warn", "error"};
}  // namespace

void setLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }
bool logEnabled(LogLevel level) {
    return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed);
}
void setLogThreadName(const char* name) { t_name = name; }

void logLine(LogLevel level, const char* fmt, ...) {
    char buf[1024];
    timespec ts{};
    clock_gettime(CLOCK_REALTIME, &ts);
    tm t{};
    gmtime_r(&ts.tv_sec, &t);
    int n = std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s [%s] ",
                          t.tm_year + 1900, t.tm_mon + 1, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec,
                          ts.tv_nsec / 1000000, kLevelNames[static_cast<int>(level)], t_name);
    va_list ap;
    va_start(ap, fmt);
    int m = std::vsnprintf(buf + n, sizeof buf - n - 1, fmt, ap);
    va_end(ap);
    size_t len = n + (m < 0 ? 0 : std::min<size_t>(m, sizeof buf - n - 2));
    buf[len++] = '\n';
    ssize_t ignored = ::write(STDERR_FILENO, buf, len);
    (void)ignored;
}

}  // namespace zcrelay
