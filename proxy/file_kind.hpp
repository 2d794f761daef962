#pragma once
// A file's type in words, for the errors that refuse a path: "is a directory; the config must
// be a regular file", "exists and is a FIFO, not a socket; refusing to remove it".
#include <sys/stat.h>

namespace zcrelay {

inline const char* fileKind(mode_t mode) {
    if (S_ISREG(mode)) return "a regular file";
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISLNK(mode)) return "a symlink";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "a file of no type stat(2) names";
}

}  // namespace zcrelay
