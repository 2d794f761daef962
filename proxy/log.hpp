#pragma once
// Leveled logging to stderr. One write(2) per line so lines from different workers never
// interleave; formatting happens on the caller's stack, no allocation.
#include <cstdarg>

namespace zcrelay {

enum class LogLevel { Debug, Info, Warn, Error };

void setLogLevel(LogLevel level);
bool logEnabled(LogLevel level);
// The calling thread's prefix, e.g. "w0" for worker 0; "main" by default.
void setLogThreadName(const char* name);
void logLine(LogLevel level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace zcrelay

#define ZLOG(level, ...)                                                          \
    do {                                                                          \
        if (::zcrelay::logEnabled(level)) ::zcrelay::logLine(level, __VA_ARGS__); \
    } while (0)
#define LOG_DEBUG(...) ZLOG(::zcrelay::LogLevel::Debug, __VA_ARGS__)
#define LOG_INFO(...) ZLOG(::zcrelay::LogLevel::Info, __VA_ARGS__)
#define LOG_WARN(...) ZLOG(::zcrelay::LogLevel::Warn, __VA_ARGS__)
#define LOG_ERROR(...) ZLOG(::zcrelay::LogLevel::Error, __VA_ARGS__)
