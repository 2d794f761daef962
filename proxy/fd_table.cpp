#include "fd_table.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace zcrelay {

size_t growFdTable() {
    rlimit nofile{};
    if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur > 64) {
        const rlim_t top = std::min<rlim_t>(nofile.rlim_cur, kMaxFdTable) - 1;
        // F_DUPFD takes the lowest free fd at or above `top`: the table grows to hold it.
        const int fd = ::fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, static_cast<int>(top));
        if (fd >= 0) ::close(fd);
    }
    std::FILE* status = std::fopen("/proc/self/status", "re");
    if (status == nullptr) return 0;
    char line[256];
    size_t size = 0;
    while (std::fgets(line, sizeof line, status) != nullptr)
        if (std::strncmp(line, "FDSize:", 7) == 0) size = std::strtoul(line + 7, nullptr, 10);
    std::fclose(status);
    return size;
}

}  // namespace zcrelay
