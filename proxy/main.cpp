// zcrelay: argv -> config -> Server -> wait for signals (signals.hpp) -> drain -> exit code.
// A SIGHUP's config is read by a child process (config_reader.hpp), this binary run with
// --dump-config.
//
// Exit codes: 0 after a clean drain (or --help/--version/--print-default-config, or a valid
// --check-config); 1 for a bad config or a failed start; 2 for bad command-line usage.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <variant>

#include "cli.hpp"
#include "clock.hpp"
#include "config_reader.hpp"
#include "fd_table.hpp"
#include "log.hpp"
#include "server.hpp"
#include "service_notify.hpp"
#include "signals.hpp"
#include "takeover.hpp"
#include "upgrade.hpp"
#include "version.hpp"

using namespace zcrelay;

namespace {

// stdout is the machine-readable part (tests and scripts wait for "zcrelay: ready" and, after
// SIGHUP, "zcrelay: reloaded"); logs go to stderr.
void printListeners(const Server& server) {
    const Config& cfg = server.config();
    for (size_t i = 0; i < cfg.listeners.size(); ++i) {
        const ListenerConfig& l = cfg.listeners[i];
        std::string to = !l.cluster.empty()        ? "cluster " + l.cluster
                         : l.upstream.length != 0 ? l.upstream.toString()
                                                  : std::string();
        if (!l.routes.empty()) {
            // "routes api,apps then cluster fallback": where a ClientHello can send a client.
            std::string names;
            for (const RouteConfig& r : l.routes) names += (names.empty() ? "" : ",") + r.name;
            to = "routes " + names + (to.empty() ? "" : " then " + to);
        }
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
    if (server.healthPort() != 0) {
        SocketAddress h = cfg.metrics.health_listen;
        h.setPort(server.healthPort());
        std::printf("zcrelay: health probes on http://%s/healthz\n", h.toString().c_str());
    }
    const ListenerConfig& first = cfg.listeners.front();
    SocketAddress up = first.upstream;
    if (first.cluster.empty() && first.routes.empty() && up.family() != AF_UNIX) {
        std::printf(
            "zcrelay: try it: `nc -l %s %u > received` as the upstream, then `nc -N %s %u < "
            "file`\n",
            up.family() == AF_INET6 ? "::1" : "127.0.0.1", up.port(),
            server.boundAddresses()[0].family() == AF_INET6 ? "::1" : "127.0.0.1",
            server.boundAddresses()[0].port());
    }
    if (const SocketAddress admin = server.adminAddress(); admin.length != 0)
        std::printf("zcrelay: admin API on %s\n", admin.toString().c_str());
    std::printf("zcrelay: ready\n");
    std::fflush(stdout);
}

// Applies a SIGHUP's loaded config with the same checks and messages as at start. Any error
// keeps the running config; either way one line says what happened. The line is written
// before the reload is counted: whoever sees zcrelay_config_reloads_total move (a scrape, an
// alert, a test) can rely on the line that explains it being in the log already.
void reload(Server& server, ConfigReader::Outcome outcome) {
    ProcessShared& process = server.process();
    if (auto* why = std::get_if<std::string>(&outcome)) {
        LOG_ERROR("SIGHUP: reload refused, the running config stays: %s", why->c_str());
        process.reloads_failed.fetch_add(1);
        return;
    }
    auto done = server.reload(std::move(std::get<Config>(outcome)));
    if (!done) {
        LOG_ERROR("SIGHUP: reload refused, the running config stays: %s", done.error().c_str());
        process.reloads_failed.fetch_add(1);
        return;
    }
    LOG_INFO("SIGHUP: reloaded (generation %llu); effective config:\n%s",
             static_cast<unsigned long long>(server.current()->generation),
             renderConfig(server.config()).c_str());
    printListeners(server);
    std::printf("zcrelay: reloaded\n");
    std::fflush(stdout);
    process.reloads_ok.fetch_add(1);
}

// One line for a signal that does nothing, then at most one every 10 s per signal: a script
// sending SIGUSR2 in a loop must not flood the log.
class IgnoredSignals {
  public:
    void taken(const SignalSpec& spec, size_t index) {
        const int64_t now = monotonicMs();
        Entry& e = entries_[index];
        if (e.logged_ms != 0 && now - e.logged_ms < 10'000) {
            ++e.suppressed;
            return;
        }
        const std::string more =
            e.suppressed ? " (" + std::to_string(e.suppressed) + " more since the last line)" : "";
        LOG_WARN(
            "%s: %s; zcrelay drains on SIGTERM, reloads on SIGHUP, upgrades on SIGUSR2, reopens "
            "the access log on SIGUSR1%s",
            std::string(spec.name).c_str(), std::string(spec.what).c_str(), more.c_str());
        e.logged_ms = now;
        e.suppressed = 0;
    }

  private:
    struct Entry {
        int64_t logged_ms = 0;
        uint64_t suppressed = 0;
    };
    std::array<Entry, kSignals.size()> entries_{};
};

// How this process starts: on sockets a running relay hands it (takeover.hpp), or on its own.
struct Taking {
    StartWith with;
    std::optional<takeover::Taken> taken;  // READY goes back to the giver once ready
    bool fallback = false;                 // a takeover was asked for and did not take
};

// With --takeover, or as a SIGUSR2 child: the running relay's sockets, or the reason to bind
// its own (said loudly), in `taking`. Returns why the process must not start at all, or "".
std::string takeOver(const CliOptions& options, const Config& config, Taking& taking) {
    auto inherited = takeSuccessorChannel();
    if (!inherited) return inherited.error();
    UniqueFd channel = std::move(*inherited);
    // A SIGUSR2 child's parent is running and serving: a child that cannot take over from it
    // must not bind sockets beside it.
    const bool child = channel.valid();
    if (!channel && !options.takeover) return "";
    if (!channel) {
        if (config.takeover_socket.empty())
            return "--takeover: the config sets no takeover_socket to find the running relay at";
        auto connected = takeover::connectTo(config.takeover_socket);
        if (!connected) {
            LOG_WARN("takeover: no relay answers on %s (%s); starting on sockets of its own",
                     config.takeover_socket.c_str(), connected.error().why.c_str());
            taking.fallback = true;
            return "";
        }
        channel = std::move(*connected);
    }
    auto taken = takeover::take(std::move(channel));
    if (taken) {
        LOG_INFO("takeover: pid %d (zcrelay %s) passed %zu sockets; starting on them",
                 static_cast<int>(taken->giver), taken->giver_release.c_str(),
                 taken->sockets.size());
        taking.with.handed = std::move(taken->sockets);
        taking.with.taking_over = true;
        taking.taken = std::move(*taken);
        return "";
    }
    takeover::TakeError& e = taken.error();
    taking.fallback = true;
    switch (e.kind) {
        case takeover::TakeError::Refused:
            return "takeover: " + e.why;
        case takeover::TakeError::Version:
            // The issue of two protocol versions is the operator's to finish: both relays
            // listen (SO_REUSEPORT), and the old one's queued connections are reset when it
            // stops unless net.ipv4.tcp_migrate_req=1.
            LOG_ERROR(
                "takeover: %s. BINDING LISTENERS OF ITS OWN beside the running relay: both "
                "serve until pid %d is stopped (SIGTERM), and the connections queued on its "
                "sockets then are reset",
                e.why.c_str(), static_cast<int>(e.giver));
            taking.with.replace_takeover_socket = true;
            return "";
        case takeover::TakeError::Draining:
            LOG_WARN("takeover: %s; starting on sockets of its own", e.why.c_str());
            taking.with.replace_takeover_socket = true;
            return "";
        case takeover::TakeError::Broken:
            // Nothing came: the giver may be alive and slow (busy with another taker), and
            // sockets bound beside it would make two relays. Starting again decides: a giver
            // that died is no longer at its path.
            if (e.partial.empty())
                return "takeover: the conversation with pid " + std::to_string(e.giver) +
                       " broke off before any socket came (" + e.why +
                       "); not starting beside a relay that may still run";
            // Whatever came is kept (closing it could be the last reference to a socket with
            // connections queued); the rest is bound.
            LOG_ERROR(
                "takeover: the conversation with pid %d broke off (%s); starting on the %zu "
                "sockets that came and binding the rest",
                static_cast<int>(e.giver), e.why.c_str(), e.partial.size());
            taking.with.handed = std::move(e.partial);
            taking.with.replace_takeover_socket = true;
            return "";
        case takeover::TakeError::Unreachable:
            if (child) return "takeover: " + e.why + "; the relay that started this one serves on";
            LOG_WARN("takeover: %s; starting on sockets of its own", e.why.c_str());
            return "";
    }
    return "";
}

// SIGUSR2: the binary on disk, started as the next relay with a channel to take the sockets
// over through. This process goes on serving until the child says it is ready.
void upgrade(Server& server, const std::vector<std::string>& args, bool draining,
             pid_t& successor) {
    if (draining) {
        LOG_WARN("SIGUSR2: draining (or handed over already); no upgrade from this process");
        return;
    }
    if (successor > 0) {
        LOG_WARN("SIGUSR2: pid %d is taking over already; wait for it",
                 static_cast<int>(successor));
        return;
    }
    auto next = spawnSuccessor(startedBinary(), args);
    if (!next) {
        LOG_ERROR("SIGUSR2: %s; serving on", next.error().c_str());
        server.process().takeovers[takeoverResult("failed")].fetch_add(1);
        return;
    }
    LOG_INFO("SIGUSR2: started %s as pid %d to take the listening sockets over",
             startedBinary().c_str(), static_cast<int>(next->pid));
    successor = next->pid;
    server.addTakeoverChannel(std::move(next->channel), next->pid);
}

// A SIGUSR2 child that exited is reaped, and its end said (after a hand-over it serves on and
// outlives this process: nothing to reap then).
void reapSuccessor(pid_t& successor) {
    int status = 0;
    const pid_t got = ::waitpid(successor, &status, WNOHANG);
    if (got == 0) return;
    if (got == successor) {
        if (WIFEXITED(status))
            LOG_WARN("SIGUSR2: the new process (pid %d) exited with status %d",
                     static_cast<int>(successor), WEXITSTATUS(status));
        else if (WIFSIGNALED(status))
            LOG_WARN("SIGUSR2: the new process (pid %d) was killed by signal %d",
                     static_cast<int>(successor), WTERMSIG(status));
    }
    successor = -1;
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
            std::printf("zcrelay %s\n", releaseVersion());
            return 0;
        case CliAction::PrintDefaultConfig:
            std::fputs(std::string(defaultConfigYaml()).c_str(), stdout);
            return 0;
        default:
            break;
    }
    // Signals are taken by this thread alone, with sigtimedwait: blocked before any thread
    // starts, so every thread inherits the mask (signals.hpp), and before the config is read,
    // so a logrotate's SIGUSR1 during a slow start is taken once it runs instead of ending it.
    // Only for a run: --check-config and --dump-config keep the defaults (Ctrl-C ends them).
    sigset_t set;
    if (options.action == CliAction::Run) blockSignals(set);
    // A SIGHUP's reader (config_reader.hpp), or anyone's `nginx -T`: limited before a byte is
    // read.
    if (options.action == CliAction::DumpConfig) limitConfigReader(maxConfigSize(options));
    Config config;
    try {
        config = resolveConfig(options);
    } catch (const ConfigError& e) {
        std::fprintf(stderr, "zcrelay: %s\n", e.what());
        return 1;
    }
    if (options.action == CliAction::DumpConfig) {
        std::fputs(renderConfig(config).c_str(), stdout);
        return std::fflush(stdout) == 0 ? 0 : 1;
    }
    if (options.action == CliAction::CheckConfig) {
        std::printf("zcrelay: %s: OK (%zu listener%s)\n",
                    options.config_path.value_or("<default>").c_str(), config.listeners.size(),
                    config.listeners.size() == 1 ? "" : "s");
        return 0;
    }

    LOG_INFO("zcrelay %s, %u worker%s; effective config:\n%s", releaseVersion(), config.workers,
             config.workers == 1 ? "" : "s", renderConfig(config).c_str());
    startedBinary();  // the path SIGUSR2 executes, read before anything can replace the file
    // Before the first thread: grown later, with threads, each growth stalls them all.
    const size_t fd_table = growFdTable();
    LOG_DEBUG("fd table: %zu fds", fd_table);
    Taking taking;
    if (std::string why = takeOver(options, config, taking); !why.empty()) {
        std::fprintf(stderr, "zcrelay: %s\n", why.c_str());
        return 1;
    }
    auto server = Server::start(std::move(config), std::move(taking.with));
    if (!server) {
        if (taking.taken) takeover::sayAborted(*taking.taken, server.error());
        std::fprintf(stderr, "zcrelay: %s\n", server.error().c_str());
        return 1;
    }
    // Taking over, "ready" is said once the old relay has stopped accepting: a script that
    // waits for it knows the upgrade is done.
    ProcessShared& process = (*server)->process();
    const bool took_over = taking.taken.has_value();
    if (took_over) {
        Server& relay = **server;
        const std::string said = takeover::sayReady(
            *taking.taken, relay.acceptance(),
            [&](std::optional<handover::HandedConn> conn) { relay.adopt(std::move(conn)); },
            [&](handover::HandedRing ring) { relay.adoptRing(std::move(ring)); });
        LOG_INFO("takeover: %s", said.c_str());
        process.takeovers[takeoverResult("taken_over")].fetch_add(1);
        taking.taken.reset();
    } else if (taking.fallback) {
        process.takeovers[takeoverResult("fallback")].fetch_add(1);
    }
    printReady(**server);
    // After a takeover the service's main process is this one (the unit has NotifyAccess=all).
    notifyServiceManager(took_over ? "MAINPID=" + std::to_string(::getpid()) + "\nREADY=1"
                                   : std::string("READY=1"));

    IgnoredSignals ignored;
    pid_t successor = -1;  // a SIGUSR2 child not yet reaped
    bool draining = false;
    const std::string source = options.config_path.value_or("<command line>");
    std::optional<ConfigReader> loading;  // a SIGHUP's read under way
    bool reload_again = false;          // a SIGHUP came while it was: load the file once more
    while (!(*server)->finished()) {
        // Short waits while a load runs, to apply it soon after it is done, and while draining,
        // to exit as soon as the last connection is gone: under systemd's restart the next
        // relay starts only then.
        timespec wait{0, (loading || draining ? 10 : 200) * 1000 * 1000};
        const int sig = sigtimedwait(&set, nullptr, &wait);
        if (!draining && (*server)->handedOver()) draining = true;  // the giver logged it
        if (successor > 0) reapSuccessor(successor);
        const size_t index = signalIndex(sig);
        if (index < kSignals.size()) {
            const SignalSpec& spec = kSignals[index];
            process.signals[index].fetch_add(1);
            switch (spec.action) {
                case SignalAction::Drain:
                    if (!draining) {
                        LOG_INFO("%s: no longer accepting; draining live connections (up to %s)",
                                 std::string(spec.name).c_str(),
                                 formatDuration((*server)->config().drain_timeout).c_str());
                        notifyServiceManager("STOPPING=1");
                        (*server)->drain();
                        draining = true;
                    } else {
                        LOG_INFO("%s again: closing every connection now",
                                 std::string(spec.name).c_str());
                        (*server)->stop();
                    }
                    break;
                case SignalAction::Reload:
                    if (draining) break;
                    (*server)->reopenAccessLog();
                    if (loading)
                        reload_again = true;
                    else
                        loading.emplace(args, source);
                    break;
                case SignalAction::ReopenLog:
                    (*server)->reopenAccessLog();
                    LOG_INFO("%s: %s", std::string(spec.name).c_str(),
                             (*server)->config().access_log.path.empty()
                                 ? "no access log file to reopen"
                                 : "reopening the access log");
                    break;
                case SignalAction::Upgrade:
                    upgrade(**server, args, draining, successor);
                    break;
                case SignalAction::Ignore:
                    ignored.taken(spec, index);
                    break;
            }
        }
        if (!loading) continue;
        std::optional<ConfigReader::Outcome> outcome = loading->take();
        if (!outcome) continue;
        loading.reset();
        if (draining) {  // a drain wins over a reload that finished after it
            LOG_INFO("SIGHUP: the reload finished after the drain began; not applied");
            continue;
        }
        notifyServiceManager("RELOADING=1");
        reload(**server, std::move(*outcome));
        notifyServiceManager("READY=1");
        if (std::exchange(reload_again, false)) loading.emplace(args, source);
    }
    (*server)->join();
    LOG_INFO("drained; exiting");
    return 0;
}
