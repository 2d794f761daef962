// The server's life: its socket bound (TCP, or a unix socket file made way for and removed
// again), libmicrohttpd started on it with the callbacks of the other http_server_*.cpp, the
// thread's loop, and the stop.
#include "http_server.hpp"

#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "http_server_internal.hpp"
#include "listener.hpp"
#include "log.hpp"
#include "result.hpp"
#include "unique_fd.hpp"
#include "unix_path.hpp"

namespace zcrelay {

namespace {

// libmicrohttpd decodes %XX in the path in place before handlers see it; this keeps it as sent,
// so routes match and handlers parse the bytes the client sent (no "%2F" turned into a "/"
// after matching). It also leaves query arguments undecoded, which nothing here reads.
size_t keepEscaped(void*, MHD_Connection*, char* s) { return std::strlen(s); }

}  // namespace

tl::expected<std::unique_ptr<HttpServer>, std::string> HttpServer::start(
    const std::string& name, const SocketAddress& listen, const HttpLimits& limits,
    std::vector<HttpRoute> routes, HttpStats& stats, UniqueFd adopted) {
    for (const HttpRoute& r : routes)
        if (!r.handler) return tl::unexpected("the route " + r.path + " has no handler");
    const bool unix_socket = listen.family() == AF_UNIX;
    if (!unix_socket && listen.family() != AF_INET && listen.family() != AF_INET6)
        return tl::unexpected(listen.toString() +
                              ": only TCP and unix socket addresses are served");
    UniqueFd fd;
    SocketAddress bound_address = listen;
    // Until the server owns it, the socket file this call created is removed on any failure.
    std::string unix_path;
    struct stat unix_file {};
    struct RemoveOnFailure {
        const std::string& path;
        ~RemoveOnFailure() {
            if (!path.empty()) ::unlink(path.c_str());
        }
    } remove_on_failure{unix_path};
    if (adopted) {
        // Listening already, in the relay this one took over from: nothing to bind. The socket
        // file is the same one (the kernel keeps one socket for both fds), removed by whichever
        // relay stops last owning it: this one, once the other has handed it over.
        fd = std::move(adopted);
        if (unix_socket) {
            const auto& sun = *reinterpret_cast<const sockaddr_un*>(&listen.storage);
            unix_path.assign(sun.sun_path, ::strnlen(sun.sun_path, sizeof sun.sun_path));
            if (::lstat(unix_path.c_str(), &unix_file) < 0) unix_path.clear();
        } else {
            auto bound = boundAddress(fd.get());
            if (!bound) return tl::unexpected(bound.error().message());
            bound_address = *bound;
        }
    } else if (!unix_socket) {
        fd = UniqueFd(::socket(listen.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        if (!fd) return tl::unexpected(std::string("socket: ") + std::strerror(errno));
        int one = 1;
        ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (listen.family() == AF_INET6)
            ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
        if (::bind(fd.get(), listen.sockaddrPtr(), listen.length) < 0)
            return tl::unexpected("bind " + listen.toString() + ": " + std::strerror(errno));
        // A deep backlog: under a connection flood the probe waits in it for one accept round,
        // not for a SYN retransmit (1 s) after an overflow. The kernel caps it at
        // net.core.somaxconn.
        if (::listen(fd.get(), SOMAXCONN) < 0)
            return tl::unexpected("listen " + listen.toString() + ": " + std::strerror(errno));
        auto bound = boundAddress(fd.get());
        if (!bound) return tl::unexpected(bound.error().message());
        bound_address = *bound;
    } else {
        const auto& sun = *reinterpret_cast<const sockaddr_un*>(&listen.storage);
        const size_t length = ::strnlen(sun.sun_path, sizeof sun.sun_path);
        if (length == 0 || length == sizeof sun.sun_path || sun.sun_path[0] != '/')
            return tl::unexpected(listen.toString() +
                                  ": a unix socket needs an absolute path, e.g. unix:/run/x.sock");
        const std::string path(sun.sun_path, length);
        if (auto cleared = clearUnixPath(listen, path); !cleared)
            return tl::unexpected(cleared.error());
        fd = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
        if (!fd) return tl::unexpected(std::string("socket: ") + std::strerror(errno));
        if (::bind(fd.get(), listen.sockaddrPtr(), listen.length) < 0)
            return tl::unexpected("bind " + listen.toString() + ": " + std::strerror(errno));
        unix_path = path;
        // Before listen(): until then a connect() is refused whatever the mode, so no client
        // gets in under the umask's mode in between.
        if (::chmod(path.c_str(), 0660) < 0) {
            const std::string why = errnoText("chmod 0660");
            return tl::unexpected(listen.toString() + ": " + why);
        }
        if (::lstat(path.c_str(), &unix_file) < 0) {
            const std::string why = errnoText("lstat");
            return tl::unexpected(listen.toString() + ": " + why);
        }
        if (::listen(fd.get(), SOMAXCONN) < 0)
            return tl::unexpected("listen " + listen.toString() + ": " + std::strerror(errno));
    }

    std::unique_ptr<HttpServer> server(
        new HttpServer(name, bound_address, limits, std::move(routes), stats));
    if (unix_socket) {
        // From here the destructor removes it, the failures below included.
        server->unix_path_ = std::exchange(unix_path, std::string());
        server->unix_dev_ = unix_file.st_dev;
        server->unix_ino_ = unix_file.st_ino;
    }
    server->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (server->wake_fd_ < 0)
        return tl::unexpected(std::string("eventfd: ") + std::strerror(errno));

    // The memory pool of one connection holds its read buffer and the parsed headers, then the
    // response's headers: the request may fill all but what the response needs (1 KiB is
    // several times what ours take), past which libmicrohttpd answers 431 (or 414).
    const size_t pool = limits.max_request_size + 1024;
    // Its hard connection limit sits above ours: past it libmicrohttpd refuses the newest
    // connection (the probe), where evictFor() closes the oldest idle one. The headroom covers
    // the connections shut down but not yet reaped in the same round.
    const unsigned hard_limit = limits.max_connections * 2 + 16;
    // MHD_USE_EPOLL without an internal thread: run() owns the loop, so the deadlines and the
    // evictions happen on the thread that owns every connection. No MHD timeout: sweep() keeps
    // the deadlines, to the millisecond.
    //
    // A unix listening socket is handed over the same way: libmicrohttpd asks it SO_DOMAIN,
    // marks its connections non-IP (no TCP_NODELAY/TCP_CORK on them) and takes the 2-byte
    // address accept() gives an unnamed client. Nothing here reads a client's address: the
    // deadlines and evictions go by fd and age.
    server->daemon_ = MHD_start_daemon(
        MHD_USE_EPOLL | MHD_USE_ERROR_LOG, 0, nullptr, nullptr, &Callbacks::onRequest, server.get(),
        MHD_OPTION_LISTEN_SOCKET, fd.get(), MHD_OPTION_CONNECTION_LIMIT, hard_limit,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, pool, MHD_OPTION_CONNECTION_TIMEOUT, 0u,
        MHD_OPTION_NOTIFY_CONNECTION, &Callbacks::onConnection, server.get(),
        MHD_OPTION_NOTIFY_COMPLETED, &Callbacks::onCompleted, server.get(),
        MHD_OPTION_URI_LOG_CALLBACK, &Callbacks::onRequestLine, server.get(),
        MHD_OPTION_UNESCAPE_CALLBACK, &keepEscaped, nullptr,
        MHD_OPTION_EXTERNAL_LOGGER, &Callbacks::onLibraryLog, server.get(),
        MHD_OPTION_SIGPIPE_HANDLED_BY_APP, 1,  // main() ignores SIGPIPE for the process
        MHD_OPTION_END);
    if (server->daemon_ == nullptr)
        return tl::unexpected(std::string("libmicrohttpd did not start"));
    server->listen_fd_ = fd.release();  // the daemon closes it
    server->thread_ = std::thread([s = server.get()] { s->run(); });
    return server;
}

void HttpServer::handOver() {
    handing_over_.store(true);
    const uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd_, &one, sizeof one);
    (void)ignored;
    // Until the thread has quiesced, a scrape that arrives could still be this process's to
    // answer, with this process's counts, after the next relay said it was ready.
    constexpr int64_t kHandOverWaitMs = 1000;
    const int64_t deadline = monotonicMs() + kHandOverWaitMs;
    while (!quiesced_.load() && thread_.joinable() && monotonicMs() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

HttpServer::~HttpServer() {
    stopping_.store(true);
    if (thread_.joinable()) {
        const uint64_t one = 1;
        ssize_t ignored = ::write(wake_fd_, &one, sizeof one);
        (void)ignored;
        thread_.join();
    }
    // Closes every connection (the CLOSED callbacks run here, the thread being gone) and the
    // listening socket.
    if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    // The socket file stays behind a closed socket: removed, unless it is no longer ours.
    struct stat st {};
    if (!unix_path_.empty() && ::lstat(unix_path_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) &&
        st.st_dev == unix_dev_ && st.st_ino == unix_ino_)
        ::unlink(unix_path_.c_str());
}

void HttpServer::quiesce() {
    // Out of libmicrohttpd's epoll set, and ours to close: the next relay holds the socket by
    // its own fd, so this close ends nothing but this process's share. No shutdown(): that
    // would stop the socket for both.
    const MHD_socket fd = MHD_quiesce_daemon(daemon_);
    if (fd != MHD_INVALID_SOCKET) ::close(fd);
    listen_fd_ = -1;
    unix_path_.clear();  // the next relay removes the file when it stops
    quiesced_.store(true);
    LOG_INFO("%s: handed over %s; answering the connections already open", name_.c_str(),
             address_.toString().c_str());
}

void HttpServer::run() {
    setLogThreadName("http");
    // One epoll set over libmicrohttpd's (listening socket and connections) and the stop
    // eventfd: the thread sleeps until either has something, or the next deadline.
    UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
    const MHD_DaemonInfo* info = MHD_get_daemon_info(daemon_, MHD_DAEMON_INFO_EPOLL_FD);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = info->epoll_fd;
    ::epoll_ctl(ep.get(), EPOLL_CTL_ADD, info->epoll_fd, &ev);
    ev.data.fd = wake_fd_;
    ::epoll_ctl(ep.get(), EPOLL_CTL_ADD, wake_fd_, &ev);
    for (;;) {
        epoll_event ready[2];
        const int n = ::epoll_wait(ep.get(), ready, 2, nextWakeMs(monotonicMs()));
        for (int i = 0; i < n; ++i) {
            if (ready[i].data.fd != wake_fd_) continue;
            if (stopping_.load()) return;
            uint64_t value = 0;
            ssize_t ignored = ::read(wake_fd_, &value, sizeof value);
            (void)ignored;
            if (handing_over_.exchange(false) && listen_fd_ >= 0) quiesce();
        }
        MHD_run(daemon_);
        const int64_t now = monotonicMs();
        sweep(now);
        reportRejects(now);
    }
}

}  // namespace zcrelay
