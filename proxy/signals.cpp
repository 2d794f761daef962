#include "signals.hpp"

#include <pthread.h>

namespace zcrelay {

namespace {

pthread_t g_main_thread;
bool g_main_known = false;  // written before any other thread exists

}  // namespace

int wakeSignal() { return SIGRTMIN + 1; }  // glibc takes SIGRTMIN itself for NPTL

void blockSignals(sigset_t& set) {
    sigemptyset(&set);
    for (const SignalSpec& s : kSignals) sigaddset(&set, s.signo);
    sigaddset(&set, wakeSignal());
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    signal(SIGPIPE, SIG_IGN);
    g_main_thread = pthread_self();
    g_main_known = true;
}

void wakeMainThread() {
    if (g_main_known) pthread_kill(g_main_thread, wakeSignal());
}

}  // namespace zcrelay
