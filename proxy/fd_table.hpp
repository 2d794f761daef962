#pragma once
// The process's fd table, grown once at start to what the open-file limit allows (up to
// kMaxFdTable).
//
// What the kernel does: a process starts with a table of 64 fds, and opening one past its end
// grows it (expand_fdtable(), doubling). With more than one thread sharing the table, each
// growth waits for an RCU grace period (synchronize_rcu()) while holding up every thread that
// opens an fd meanwhile: pipe2() blocked 10 ms at 64 fds, 9.4 ms at 128 and 19.5 ms at 256 in
// both workers of a relay adopting connections, the main thread's recvmsg() of them too
// (strace -T, bench/results/2026-11-29-vm-handover.md), and every connection it relayed paused
// as long. A relay whose connections climb past 64, 128, 256... would pause the same way. One
// growth at start, before any thread exists, waits for no grace period, and a table never
// shrinks.
#include <cstddef>

namespace zcrelay {

// A table of 256 Ki fds is 2 MiB of pointers: past that, a limit that high grows as it must.
inline constexpr size_t kMaxFdTable = 256 * 1024;

// Grows the fd table to cover every fd RLIMIT_NOFILE allows (capped at kMaxFdTable): opens an
// fd at the top and closes it. Call before any thread starts. Returns the table's size the
// kernel reports (FDSize in /proc/self/status), 0 if it could not tell.
size_t growFdTable();

}  // namespace zcrelay
