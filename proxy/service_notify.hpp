#pragma once
// sd_notify(3)'s protocol without libsystemd: one datagram to the unix socket NOTIFY_SOCKET
// names (a path, or "@name" for the abstract namespace). The shipped unit is Type=notify, so
// systemd learns when the relay listens (READY=1), drains (STOPPING=1), reloads (RELOADING=1,
// then READY=1), and, after a SIGUSR2 upgrade, that the new process is the service's main one
// (MAINPID=, which needs NotifyAccess=all: the sender is not the pid systemd started). Without
// NOTIFY_SOCKET nothing is sent; a send that fails is logged once and the relay goes on.
#include <string>

namespace zcrelay {

// Sends `state` ("READY=1\nMAINPID=123") if the process runs under a service manager.
void notifyServiceManager(const std::string& state);

}  // namespace zcrelay
