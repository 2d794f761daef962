#pragma once
// The signals zcrelay takes, and what each does: one table, read by main() (which signals it
// blocks and waits for), the metrics (zcrelay_signals_total{signal}) and the table in docs/operating.md.
//
// Every signal here is blocked in every thread before the first one starts and taken by the
// main thread alone with sigtimedwait(), so none of them runs a handler, interrupts a worker's
// syscall, or carries its default action (for SIGUSR1, SIGUSR2 and SIGALRM: killing the process
// with every connection on it; for SIGTTIN/SIGTTOU: stopping it). SIGPIPE is ignored outright:
// a send to a socket whose peer is gone must come back as EPIPE.
#include <signal.h>

#include <array>
#include <cstdint>
#include <string_view>

namespace zcrelay {

enum class SignalAction : uint8_t {
    Drain,      // stop accepting, let live connections finish within drain_timeout; twice: close
    Reload,     // re-read the config file (and reopen the access log)
    ReopenLog,  // reopen the access log file (logrotate's postrotate, nginx's USR1)
    Upgrade,    // execute the binary again; the new process takes the sockets over (upgrade.hpp)
    Ignore,     // logged and counted, nothing else: sent by habit for other servers
};

struct SignalSpec {
    int signo;
    std::string_view name;  // "SIGHUP": the log's word and the metric's label
    SignalAction action;
    std::string_view what;  // for docs/operating.md and the "ignored" log line
};

inline constexpr std::array kSignals = {
    SignalSpec{SIGTERM, "SIGTERM", SignalAction::Drain,
               "drain; a second one closes every connection"},
    SignalSpec{SIGINT, "SIGINT", SignalAction::Drain, "as SIGTERM (Ctrl-C)"},
    SignalSpec{SIGQUIT, "SIGQUIT", SignalAction::Drain, "as SIGTERM: nginx's graceful stop"},
    SignalSpec{SIGHUP, "SIGHUP", SignalAction::Reload,
               "reload the config file, reopen the access log"},
    SignalSpec{SIGUSR1, "SIGUSR1", SignalAction::ReopenLog,
               "reopen the access log (nginx's convention)"},
    SignalSpec{SIGUSR2, "SIGUSR2", SignalAction::Upgrade,
               "upgrade: run the binary on disk again, hand it the listening sockets, drain "
               "(nginx's binary upgrade)"},
    SignalSpec{SIGALRM, "SIGALRM", SignalAction::Ignore, "ignored"},
    SignalSpec{SIGTTIN, "SIGTTIN", SignalAction::Ignore, "ignored (HAProxy: resume listeners)"},
    SignalSpec{SIGTTOU, "SIGTTOU", SignalAction::Ignore, "ignored (HAProxy: pause listeners)"},
    SignalSpec{SIGWINCH, "SIGWINCH", SignalAction::Ignore,
               "ignored (nginx: stop workers gracefully)"},
};

// The index of `signo` in kSignals, or kSignals.size() for a signal not taken.
inline size_t signalIndex(int signo) {
    for (size_t i = 0; i < kSignals.size(); ++i)
        if (kSignals[i].signo == signo) return i;
    return kSignals.size();
}

// Blocks every signal of kSignals in the calling thread (and so in every thread it starts) and
// ignores SIGPIPE; `set` gets the signals to wait for. The caller is the thread that waits
// (main), and wakeMainThread() reaches it.
void blockSignals(sigset_t& set);

// Not a signal anyone outside sends: another thread of the relay tells the main thread to look
// again now rather than at the end of its wait (a takeover handed over: it drains from then
// on, and exits once its last connection has crossed). In `set`, taken and not counted.
int wakeSignal();
void wakeMainThread();

}  // namespace zcrelay
