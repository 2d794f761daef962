#include "signals.hpp"

#include <pthread.h>

namespace zcrelay {

void blockSignals(sigset_t& set) {
    sigemptyset(&set);
    for (const SignalSpec& s : kSignals) sigaddset(&set, s.signo);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    signal(SIGPIPE, SIG_IGN);
}

}  // namespace zcrelay
