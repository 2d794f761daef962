// zcrelay: argv -> config -> Server -> wait for a signal -> drain -> exit code.
//
// Exit codes: 0 after a clean drain (or --help/--version/--print-default-config, or a valid
// --check-config); 1 for a bad config or a failed start; 2 for bad command-line usage.
#include <signal.h>

#include <cstdio>
#include <cstring>

#include "cli.hpp"
#include "log.hpp"
#include "server.hpp"

using namespace zcrelay;

namespace {

// stdout is the machine-readable part (tests and scripts wait for "zcrelay: ready" and, after
// SIGHUP, "zcrelay: reloaded"); logs go to stderr.
void printListeners(const Server& server) {
    const Config& cfg = server.config();
    for (size_t i = 0; i < cfg.listeners.size(); ++i) {
        const ListenerConfig& l = cfg.listeners[i];
        std::string to = l.cluster.empty() ? l.upstream.toString() : "cluster " + l.cluster;
        std::printf("zcrelay: listener %s listening on %s -> %s (mode %s)\n", l.name.c_str(),
                    server.boundAddresses()[i].toString().c_str(), to.c_str(),
                    std::string(modeName(l.mode)).c_str());
    }
}

void printReady(const Server& server) {
    const Config& cfg = server.config();
    printListeners(server);
    if (server.metricsPort() != 0) {
        SocketAddress m = cfg.metrics.listen;
        m.setPort(server.metricsPort());
        std::printf("zcrelay: metrics on http://%s/metrics\n", m.toString().c_str());
    }
    const ListenerConfig& first = cfg.listeners.front();
    SocketAddress up = first.upstream;
    if (first.cluster.empty() && up.family() != AF_UNIX) {
        std::printf(
            "zcrelay: try it: `nc -l %s %u > received` as the upstream, then `nc -N %s %u < "
            "file`\n",
            up.family() == AF_INET6 ? "::1" : "127.0.0.1", up.port(),
            server.boundAddresses()[0].family() == AF_INET6 ? "::1" : "127.0.0.1",
            server.boundAddresses()[0].port());
    }
    std::printf("zcrelay: ready\n");
    std::fflush(stdout);
}

// SIGHUP: the same config source as at start, the same checks and messages. Any error keeps
// the running config; either way one line says what happened.
void reload(Server& server, const CliOptions& options) {
    ProcessShared& process = server.process();
    server.reopenAccessLog();
    Config next;
    try {
        next = resolveConfig(options);
    } catch (const ConfigError& e) {
        process.reloads_failed.fetch_add(1);
        LOG_ERROR("SIGHUP: reload refused, the running config stays: %s", e.what());
        return;
    }
    auto done = server.reload(std::move(next));
    if (!done) {
        process.reloads_failed.fetch_add(1);
        LOG_ERROR("SIGHUP: reload refused, the running config stays: %s", done.error().c_str());
        return;
    }
    process.reloads_ok.fetch_add(1);
    LOG_INFO("SIGHUP: reloaded (generation %llu); effective config:\n%s",
             static_cast<unsigned long long>(server.current()->generation),
             renderConfig(server.config()).c_str());
    printListeners(server);
    std::printf("zcrelay: reloaded\n");
    std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<std::string> args(argv + 1, argv + argc);
    CliOptions options;
    try {
        options = parseCli(args);
    } catch (const ConfigError& e) {
        std::fprintf(stderr, "zcrelay: %s\n%s", e.what(), "Try 'zcrelay --help'.\n");
        return 2;
    }
    switch (options.action) {
        case CliAction::Help:
            std::fputs(usageText().c_str(), stdout);
            return 0;
        case CliAction::Version:
            std::printf("zcrelay %s\n", ZCRELAY_VERSION);
            return 0;
        case CliAction::PrintDefaultConfig:
            std::fputs(std::string(defaultConfigYaml()).c_str(), stdout);
            return 0;
        default:
            break;
    }
    Config config;
    try {
        config = resolveConfig(options);
    } catch (const ConfigError& e) {
        std::fprintf(stderr, "zcrelay: %s\n", e.what());
        return 1;
    }
    if (options.action == CliAction::CheckConfig) {
        std::printf("zcrelay: %s: OK (%zu listener%s)\n",
                    options.config_path.value_or("<default>").c_str(), config.listeners.size(),
                    config.listeners.size() == 1 ? "" : "s");
        return 0;
    }

    // Signals are taken by this thread alone, with sigtimedwait: block them before any thread
    // starts so every worker inherits the mask. SIGPIPE is ignored outright: a splice to a socket
    // whose peer is gone must come back as EPIPE, not kill the process.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    signal(SIGPIPE, SIG_IGN);

    LOG_INFO("zcrelay %s, %u worker%s; effective config:\n%s", ZCRELAY_VERSION, config.workers,
             config.workers == 1 ? "" : "s", renderConfig(config).c_str());
    auto server = Server::start(std::move(config));
    if (!server) {
        std::fprintf(stderr, "zcrelay: %s\n", server.error().c_str());
        return 1;
    }
    printReady(**server);

    bool draining = false;
    while (!(*server)->finished()) {
        timespec wait{0, 200 * 1000 * 1000};
        int sig = sigtimedwait(&set, nullptr, &wait);
        if (sig == SIGTERM || sig == SIGINT) {
            if (!draining) {
                LOG_INFO("%s: no longer accepting; draining live connections (up to %s)",
                         strsignal(sig), formatDuration((*server)->config().drain_timeout).c_str());
                (*server)->drain();
                draining = true;
            } else {
                LOG_INFO("%s again: closing every connection now", strsignal(sig));
                (*server)->stop();
            }
        } else if (sig == SIGHUP && !draining) {
            reload(**server, options);
        }
    }
    (*server)->join();
    LOG_INFO("drained; exiting");
    return 0;
}
