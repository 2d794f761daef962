#pragma once
// Dropping root once the relay holds what only root could open (config keys `user`, `group`).
//
// What the kernel does, and why the steps run in this order:
// - Capabilities, the bounding set, PR_SET_KEEPCAPS and PR_SET_NO_NEW_PRIVS belong to a
//   thread, not to the process; a new thread copies its creator's. glibc's set*id() and
//   setgroups() are the exception: they signal every thread to change its ids too. So the drop
//   runs on the main thread before any other thread exists (Server::start), and every thread
//   started later (workers, the access log writer, the metrics endpoint's) inherits the reduced sets.
// - PR_CAPBSET_DROP needs CAP_SETPCAP in the effective set, which a uid 0 -> nonzero switch
//   clears: the bounding set is cut first, while still root. Cutting it leaves the permitted
//   set alone, so CAP_SETUID/CAP_SETGID still work for the next steps.
// - setuid() from root to another user empties the permitted set unless PR_SET_KEEPCAPS is on,
//   and always empties the effective and ambient sets: keep-caps carries the permitted set
//   over, capset() then keeps only CAP_NET_BIND_SERVICE, effective and permitted.
// - A uid change also makes the process non-dumpable (fs.suid_dumpable, 0 by default): no core
//   dumps, and /proc/PID/* is owned by root, so the new user cannot ptrace a process that still
//   holds fds root opened. The process itself still reads its own /proc/self.
//
// Kept: CAP_NET_BIND_SERVICE, because a reload may bind a new listener below port 1024 (the
// main thread binds it). Everything else (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_RESOURCE, ...) is
// gone for good: the sockmap program and maps are loaded and attached before the drop, and
// using their fds needs no capability; without CAP_SYS_RESOURCE pipes obey
// pipe-user-pages-soft and fs.pipe-max-size (pipe_pool.hpp).
#include <cstdint>
#include <string>
#include <tl/expected.hpp>

namespace zcrelay {

// Switches the process to `uid`/`gid` (supplementary groups: just `gid`), keeps only
// CAP_NET_BIND_SERVICE (if the process had it), empties the bounding set of everything else,
// sets no_new_privs, and checks that each of these took. `who` names the target in messages
// ("user nobody"). Call it on the only thread of the process.
//   - already running as uid/gid: nothing changes (returns what it found);
//   - not root and asked for another user: an error, nothing changes;
//   - any step refused: an error; the caller must exit, the process is half-dropped.
// Returns the line to log: who the process runs as now and what it kept.
tl::expected<std::string, std::string> dropPrivileges(uint32_t uid, uint32_t gid,
                                                      const std::string& who);

// The current thread's capability sets, as bit masks (bit N = capability N).
struct CapSets {
    uint64_t effective = 0;
    uint64_t permitted = 0;
    uint64_t inheritable = 0;
};
tl::expected<CapSets, std::string> currentCaps();

}  // namespace zcrelay
