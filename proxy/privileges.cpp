#include "privileges.hpp"

#include <dirent.h>
#include <grp.h>
#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "result.hpp"

namespace zcrelay {
namespace {

constexpr int kKept = CAP_NET_BIND_SERVICE;
constexpr uint64_t bit(int cap) { return uint64_t{1} << cap; }

// The highest capability this kernel knows, which may be above the headers' CAP_LAST_CAP.
int lastCap() {
    int last = CAP_LAST_CAP;
    if (FILE* f = std::fopen("/proc/sys/kernel/cap_last_cap", "re")) {
        int n = 0;
        if (std::fscanf(f, "%d", &n) == 1 && n > 0 && n < 64) last = n;
        std::fclose(f);
    }
    return last;
}

// Threads of this process, from /proc/self/task; -1 if it cannot be read.
int threadCount() {
    DIR* dir = opendir("/proc/self/task");
    if (dir == nullptr) return -1;
    int n = 0;
    while (dirent* e = readdir(dir))
        if (e->d_name[0] != '.') ++n;
    closedir(dir);
    return n;
}

// capset() through the raw syscall: libcap is not a dependency, and the v3 ABI is two 32-bit
// halves per set.
int setCaps(uint64_t effective, uint64_t permitted, uint64_t inheritable) {
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2]{};
    for (int i = 0; i < 2; ++i) {
        data[i].effective = static_cast<uint32_t>(effective >> (32 * i));
        data[i].permitted = static_cast<uint32_t>(permitted >> (32 * i));
        data[i].inheritable = static_cast<uint32_t>(inheritable >> (32 * i));
    }
    return static_cast<int>(syscall(SYS_capset, &header, data));
}

std::string capsText(uint64_t caps) {
    if (caps == 0) return "none";
    if (caps == bit(kKept)) return "cap_net_bind_service";
    char hex[32];
    std::snprintf(hex, sizeof hex, "0x%llx", static_cast<unsigned long long>(caps));
    return hex;
}

std::string idsText(uint32_t uid, uint32_t gid) {
    return "uid " + std::to_string(uid) + ", gid " + std::to_string(gid);
}

// Every check after the switch: the ids (real, effective, saved), the groups, the three
// capability sets, the bounding set, and that root cannot be taken back.
tl::expected<void, std::string> verify(uint32_t uid, uint32_t gid, uint64_t keep, int last) {
    uid_t ru, eu, su;
    gid_t rg, eg, sg;
    if (getresuid(&ru, &eu, &su) != 0 || getresgid(&rg, &eg, &sg) != 0)
        return tl::unexpected(errnoText("getresuid"));
    if (ru != uid || eu != uid || su != uid)
        return tl::unexpected("uids are " + std::to_string(ru) + "/" + std::to_string(eu) + "/" +
                              std::to_string(su) + ", not " + std::to_string(uid));
    if (rg != gid || eg != gid || sg != gid)
        return tl::unexpected("gids are " + std::to_string(rg) + "/" + std::to_string(eg) + "/" +
                              std::to_string(sg) + ", not " + std::to_string(gid));
    gid_t groups[4];
    int n = getgroups(4, groups);
    if (n != 1 || groups[0] != gid)
        return tl::unexpected("supplementary groups are not just " + std::to_string(gid));
    auto caps = currentCaps();
    if (!caps) return tl::unexpected(caps.error());
    if (caps->effective != keep || caps->permitted != keep || caps->inheritable != 0)
        return tl::unexpected("capabilities are effective " + capsText(caps->effective) +
                              ", permitted " + capsText(caps->permitted) + ", inheritable " +
                              capsText(caps->inheritable) + "; wanted " + capsText(keep));
    for (int c = 0; c <= last; ++c) {
        if (c == kKept) continue;
        if (prctl(PR_CAPBSET_READ, c, 0, 0, 0) != 0)
            return tl::unexpected("capability " + std::to_string(c) +
                                  " is still in the bounding set");
    }
    if (prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) != 1)
        return tl::unexpected(std::string("no_new_privs is not set"));
    if (uid != 0 && setresuid(static_cast<uid_t>(-1), 0, static_cast<uid_t>(-1)) == 0)
        return tl::unexpected(std::string("setresuid(-1, 0, -1) still succeeds"));
    return {};
}

}  // namespace

tl::expected<CapSets, std::string> currentCaps() {
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2]{};
    if (syscall(SYS_capget, &header, data) != 0) return tl::unexpected(errnoText("capget"));
    CapSets sets;
    for (int i = 0; i < 2; ++i) {
        sets.effective |= uint64_t{data[i].effective} << (32 * i);
        sets.permitted |= uint64_t{data[i].permitted} << (32 * i);
        sets.inheritable |= uint64_t{data[i].inheritable} << (32 * i);
    }
    return sets;
}

tl::expected<std::string, std::string> dropPrivileges(uint32_t uid, uint32_t gid,
                                                      const std::string& who) {
    const std::string target = who + " (" + idsText(uid, gid) + ")";
    uid_t ru, eu, su;
    gid_t rg, eg, sg;
    if (getresuid(&ru, &eu, &su) != 0 || getresgid(&rg, &eg, &sg) != 0)
        return tl::unexpected(errnoText("getresuid"));
    if (ru == uid && eu == uid && su == uid && rg == gid && eg == gid && sg == gid)
        return "already running as " + target + "; privileges unchanged";
    if (eu != 0) {
        return tl::unexpected("cannot switch to " + target + ": that needs root, and the relay " +
                              "runs as " + idsText(eu, eg) + "; start it as root, or drop " +
                              "`user`/`group` from the config");
    }
    // The one-thread precondition (see the header): a thread started earlier would keep root's
    // bounding set, and the capability sets of whatever it was started with.
    if (int threads = threadCount(); threads != 1) {
        return tl::unexpected("cannot switch to " + target + ": " + std::to_string(threads) +
                              " threads are running; the drop must come before any starts");
    }
    auto before = currentCaps();
    if (!before) return tl::unexpected(before.error());
    // Kept only if we have it: a root without it (a container that dropped it) cannot bind
    // below 1024 before the switch either.
    const uint64_t keep = before->permitted & bit(kKept);
    const int last = lastCap();
    auto failed = [&](const std::string& step) {
        return tl::unexpected("switching to " + target + ": " + step);
    };

    for (int c = 0; c <= last; ++c) {
        if (c == kKept) continue;
        // EINVAL: a capability this kernel does not know (last is read from it, so none).
        if (prctl(PR_CAPBSET_DROP, c, 0, 0, 0) != 0 && errno != EINVAL) {
            const int code = errno;
            return failed(errnoText(("PR_CAPBSET_DROP " + std::to_string(c)).c_str(), code));
        }
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0)
        return failed(errnoText("PR_CAP_AMBIENT_CLEAR_ALL"));
    if (prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0) return failed(errnoText("PR_SET_KEEPCAPS 1"));
    const gid_t groups[1] = {gid};
    if (setgroups(1, groups) != 0) return failed(errnoText("setgroups"));
    if (setresgid(gid, gid, gid) != 0) return failed(errnoText("setresgid"));
    if (setresuid(uid, uid, uid) != 0) return failed(errnoText("setresuid"));
    if (setCaps(keep, keep, 0) != 0) return failed(errnoText("capset"));
    if (prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0) != 0) return failed(errnoText("PR_SET_KEEPCAPS 0"));
    // The relay never executes anything: no set-uid binary may hand root back through execve.
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        return failed(errnoText("PR_SET_NO_NEW_PRIVS"));

    if (auto ok = verify(uid, gid, keep, last); !ok) return failed(ok.error());
    return "running as " + target + "; capabilities kept: " + capsText(keep) +
           " (effective, permitted and bounding set); no_new_privs";
}

}  // namespace zcrelay
