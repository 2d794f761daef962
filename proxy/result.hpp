#pragma once
// Errors as values at OS boundaries: a Result carries errno and what was being done, so the
// caller can log one precise line without exceptions on the data path.
#include <cerrno>
#include <cstring>
#include <string>
#include <tl/expected.hpp>

namespace zcrelay {

struct SysError {
    int code = 0;           // errno value
    const char* what = "";  // static text: the call that failed, e.g. "bind"

    std::string message() const { return std::string(what) + ": " + std::strerror(code); }
};

template <typename T>
using Result = tl::expected<T, SysError>;

inline tl::unexpected<SysError> sysError(const char* what, int code = errno) {
    return tl::unexpected(SysError{code, what});
}

}  // namespace zcrelay
