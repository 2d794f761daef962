#pragma once
// Errors as values at OS boundaries: a Result carries errno and what was being done, so the
// caller can log one precise line without exceptions on the data path.
#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>
#include <tl/expected.hpp>

namespace zcrelay {

struct SysError {
    int code = 0;           // errno value
    const char* what = "";  // static text: the call that failed, e.g. "bind"

    std::string message() const;
};

// "lstat: No such file or directory": an OS error as text, where errors travel as strings (the
// config, the control plane, dropping privileges) rather than as a SysError on the data path.
// The default reads errno as it is at the call, so call it before anything else can change it.
inline std::string errnoText(std::string_view what, int code = errno) {
    return std::string(what) + ": " + std::strerror(code);
}

inline std::string SysError::message() const { return errnoText(what, code); }

template <typename T>
using Result = tl::expected<T, SysError>;

inline tl::unexpected<SysError> sysError(const char* what, int code = errno) {
    return tl::unexpected(SysError{code, what});
}

}  // namespace zcrelay
