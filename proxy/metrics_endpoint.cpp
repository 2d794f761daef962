#include "metrics_endpoint.hpp"

#include <CivetServer.h>
#include <prometheus/collectable.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace zcrelay {

// One path: its body comes from `respond`, which returns the HTTP status and the text.
class MetricsEndpoint::Handler : public CivetHandler {
  public:
    using Respond = std::function<std::pair<int, std::string>()>;
    Handler(const char* content_type, Respond respond)
        : content_type_(content_type), respond_(std::move(respond)) {}

    bool handleGet(CivetServer*, mg_connection* conn) override {
        auto [status, body] = respond_();
        mg_printf(conn,
                  "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                  "Connection: close\r\n\r\n",
                  status, mg_get_response_code_text(conn, status), content_type_, body.size());
        mg_write(conn, body.data(), body.size());
        return true;
    }

  private:
    const char* content_type_;
    Respond respond_;
};

namespace {

std::pair<int, std::string> check(const std::function<std::string()>& probe, int bad_status,
                                  const char* good) {
    std::string why = probe();
    if (why.empty()) return {200, std::string(good) + "\n"};
    return {bad_status, why + "\n"};
}

}  // namespace

MetricsEndpoint::MetricsEndpoint(const SocketAddress& listen,
                                 std::shared_ptr<prometheus::Collectable> metrics,
                                 std::function<std::string()> unhealthy,
                                 std::function<std::string()> unready)
    : address_(listen) {
    metrics_ = std::make_unique<Handler>("text/plain; version=0.0.4; charset=utf-8", [metrics] {
        return std::pair{200, prometheus::TextSerializer().Serialize(metrics->Collect())};
    });
    healthz_ = std::make_unique<Handler>("text/plain; charset=utf-8", [unhealthy] {
        return check(unhealthy, 500, "ok");
    });
    readyz_ = std::make_unique<Handler>("text/plain; charset=utf-8", [unready] {
        return check(unready, 503, "ready");
    });
    // Two threads: a readiness probe is answered while a scrape is being built. civetweb
    // throws CivetException (a std::exception) when it cannot listen.
    std::vector<std::string> options = {"listening_ports", listen.toString(), "num_threads", "2"};
    server_ = std::make_unique<CivetServer>(options);
    server_->addHandler("/metrics", metrics_.get());
    server_->addHandler("/healthz", healthz_.get());
    server_->addHandler("/readyz", readyz_.get());
}

MetricsEndpoint::~MetricsEndpoint() {
    // civetweb's mg_stop() raises a flag and joins its listening thread, which looks at the flag
    // only between poll() rounds of 2 s: shutting down would take up to 2 s for nothing. A
    // connection to our own port ends the round at once. Bounded: the loop ends when the
    // server is gone, which the poll quantum guarantees anyway.
    SocketAddress self = address_;
    self.setPort(port());
    std::atomic<bool> stopped{false};
    std::thread kick([&] {
        while (!stopped.load()) {
            int fd = ::socket(self.family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
            if (fd < 0) break;
            ::connect(fd, self.sockaddrPtr(), self.length);
            ::close(fd);
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
    });
    server_.reset();
    stopped.store(true);
    kick.join();
}

uint16_t MetricsEndpoint::port() const {
    auto ports = server_->getListeningPorts();
    return ports.empty() ? 0 : static_cast<uint16_t>(ports.front());
}

}  // namespace zcrelay
