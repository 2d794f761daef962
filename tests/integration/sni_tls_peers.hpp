#pragma once
// Real TLS peers for the SNI cases (sni_*_test.cpp): the programs (openssl, curl, python3), the
// certificates, `openssl s_server` backends, the clients and what they report, and the bank of
// real ClientHellos captured from those clients once per test binary.
//
// Every external program runs under runCommand's timeout or is a ChildProcess of the test,
// signalled by its own PID only.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "integration/sni_hello_bytes.hpp"
#include "support/bytes.hpp"
#include "support/loopback.hpp"
#include "support/relay_process.hpp"

namespace zcrelay::test::sni_routing_test {

inline constexpr Millis kIo{20'000};
inline constexpr Millis kTool{30'000};  // one run of openssl, curl or python

// =============================================================================================
// Real TLS peers: the programs, certificates, s_server backends and the clients.

struct Tools {
    std::string openssl, curl, python;
};

// Fills `t` with what a case needs, or says what to install.
inline std::optional<std::string> findTools(Tools& t, bool curl, bool python) {
    std::optional<std::string> p = findExecutable("openssl");
    if (!p) return "openssl is not installed (Debian package openssl)";
    t.openssl = *p;
    if (curl) {
        if (!(p = findExecutable("curl"))) return "curl is not installed (Debian package curl)";
        t.curl = *p;
    }
    if (python) {
        if (!(p = findExecutable("python3")))
            return "python3 is not installed (Debian package python3)";
        t.python = *p;
    }
    return std::nullopt;
}

#define SKIP_WITHOUT_TOOLS(tools, curl, python) \
    if (auto why = findTools(tools, curl, python)) GTEST_SKIP() << *why

// A real TLS client in Python's ssl module (OpenSSL underneath, but its own ClientHello): it
// verifies the backend's certificate against every backend's (check_hostname off: the names are
// routing keys, not the certificates'), prints the subject's CN, then talks:
//   get  - sends an HTTP GET, prints the answer (s_server -www closes after it);
//   echo - sends "ping-1", prints the line that comes back (s_server -rev reverses it);
//   hold - echo, then waits for the --gate file to appear, then "ping-2" on the same connection.
// --proxy-v1 writes a PROXY v1 line before the handshake; --big N puts N long protocol names
// before --alpn's, so the hello outgrows one TLS record and the listed ones come last.
// Every wait is bounded: socket timeouts, a byte cap on reads, a step count on the gate.
inline const char* kPythonClient = R"PY(
import argparse, os, socket, ssl, sys, time

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--sni", default="")
ap.add_argument("--alpn", default="")
ap.add_argument("--big", type=int, default=0)
ap.add_argument("--cafile", default="")
ap.add_argument("--proxy-v1", default="")
ap.add_argument("--mode", default="get", choices=["get", "echo", "hold"])
ap.add_argument("--gate", default="")
a = ap.parse_args()

ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname = False
if a.cafile:
    ctx.load_verify_locations(a.cafile)
else:
    ctx.verify_mode = ssl.CERT_NONE
protos = ["x%03d-" % i + "y" * 200 for i in range(a.big)]
protos += [p for p in a.alpn.split(",") if p]
if protos:
    ctx.set_alpn_protocols(protos)

def line(t):
    data = b""
    while not data.endswith(b"\n") and len(data) < 4096:
        chunk = t.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode("latin-1").strip()

raw = socket.create_connection(("127.0.0.1", a.port), timeout=10)
raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
if a.proxy_v1:
    raw.sendall(("PROXY " + a.proxy_v1 + "\r\n").encode())
t = ctx.wrap_socket(raw, server_hostname=a.sni or None)
subject = dict(x[0] for x in t.getpeercert()["subject"]) if a.cafile else {}
print("subject=CN = " + subject.get("commonName", ""), flush=True)
print("alpn=" + (t.selected_alpn_protocol() or ""), flush=True)
if a.mode == "get":
    t.sendall(b"GET / HTTP/1.0\r\n\r\n")
    data = b""
    while len(data) < (1 << 20):
        chunk = t.recv(65536)
        if not chunk:
            break
        data += chunk
    sys.stdout.write(data.decode("latin-1"))
else:
    t.sendall(b"ping-1\n")
    print("reply1=" + line(t), flush=True)
    if a.mode == "hold":
        for _ in range(600):
            if os.path.exists(a.gate):
                break
            time.sleep(0.05)
        t.sendall(b"ping-2\n")
        print("reply2=" + line(t), flush=True)
t.close()
)PY";

inline ::testing::AssertionResult makeCertificate(const Tools& tools, const TempDir& dir,
                                                  const std::string& cn) {
    CommandResult r =
        runCommand({tools.openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", "/CN=" + cn,
                    "-keyout", dir.file(cn + ".key"), "-out", dir.file(cn + ".crt")},
                   kTool);
    if (!r.status.cleanExit())
        return ::testing::AssertionFailure() << "openssl req for CN=" << cn << ": " << r.describe();
    return ::testing::AssertionSuccess();
}

// `openssl s_server` on a loopback port of its own, with certificate CN=`cn`. `style`: "-www"
// (answers a GET with a status page that names its command line, its certificate file too) or
// "-rev" (sends each line back reversed). It serves one connection at a time, which the cases
// here never need more of.
class TlsBackend {
  public:
    ~TlsBackend() { stop(); }

    ::testing::AssertionResult start(const Tools& tools, const TempDir& dir, const std::string& cn,
                                     const std::string& style) {
        cn_ = cn;
        cert_ = dir.file(cn + ".crt");
        if (auto made = makeCertificate(tools, dir, cn); !made) return made;
        // s_server cannot report a port the kernel picked: reserve one, release it, bind it.
        // Another process could take it in between, so a failed start retries on a new port.
        std::string why;
        for (int attempt = 0; attempt < 3; ++attempt) {
            Listening probe = listenLoopback(AF_INET);
            if (!probe.fd) return ::testing::AssertionFailure() << probe.error;
            port_ = probe.port;
            probe.fd.reset();
            child_ = std::make_unique<ChildProcess>();
            ChildProcess::Options opts;
            opts.argv = {tools.openssl, "s_server", "-accept", "127.0.0.1:" + std::to_string(port_),
                         "-cert",       cert_,      "-key",    dir.file(cn + ".key"),
                         "-quiet",      style};
            opts.stdout_path = dir.file(cn + ".s_server.out");
            opts.stderr_path = dir.file(cn + ".s_server.err");
            std::string error;
            if (!child_->spawn(opts, error))
                return ::testing::AssertionFailure() << "spawn s_server: " << error;
            // Ready when a connect succeeds (s_server drops the empty connection and goes on).
            bool up = waitUntil(
                [&] {
                    if (!child_->running()) return true;
                    return connectTo("127.0.0.1", port_, Millis{500}).fd.valid();
                },
                Millis{10'000}, Millis{20});
            if (up && child_->running()) return ::testing::AssertionSuccess();
            why = "s_server " + cn + " did not listen on port " + std::to_string(port_) +
                  "; stderr: " + fileTail(opts.stderr_path);
            stop();
        }
        return ::testing::AssertionFailure() << why;
    }

    void stop() {
        if (!child_) return;
        if (child_->running()) {
            child_->sendSignal(SIGTERM);
            if (!child_->waitExit(Millis{5'000})) child_->killAndWait();
        }
        child_.reset();
    }

    const std::string& cn() const { return cn_; }
    const std::string& certPath() const { return cert_; }
    std::string hostPort() const { return "127.0.0.1:" + std::to_string(port_); }

  private:
    std::string cn_, cert_;
    uint16_t port_ = 0;
    std::unique_ptr<ChildProcess> child_;
};

// A client's offer: the server name it sends (none: no server_name extension) and its ALPN
// protocols, comma-separated ("" = no ALPN extension).
struct Offer {
    std::optional<std::string> sni;
    std::string alpn;
};
inline std::string describe(const Offer& o) {
    return (o.sni ? "sni \"" + *o.sni + "\"" : std::string("no sni")) +
           (o.alpn.empty() ? ", no alpn" : ", alpn " + o.alpn);
}

// One run of a real TLS client and what it reported.
struct ClientRun {
    std::string what;  // the client and its offer
    CommandResult result;
    std::string cn;  // the CN of the certificate subject the client reports; "" if none
    std::string transcript() const { return what + "\n" + result.describe(); }
};

inline std::string reportedCn(const std::string& text, const std::regex& pattern) {
    std::smatch m;
    return std::regex_search(text, m, pattern) ? m[1].str() : std::string();
}

// openssl s_client: verifies against `cafile` (a failed verification ends the handshake),
// sends `stdin_path` and reads until the server closes (-ign_eof). Empty `cafile`: no checks,
// for captures.
inline ClientRun sClient(const Tools& tools, uint16_t port, const Offer& offer,
                         const std::string& cafile, const std::string& stdin_path = "/dev/null") {
    std::vector<std::string> argv = {tools.openssl, "s_client", "-connect",
                                     "127.0.0.1:" + std::to_string(port)};
    if (offer.sni)
        argv.insert(argv.end(), {"-servername", *offer.sni});
    else
        argv.push_back("-noservername");
    if (!offer.alpn.empty()) argv.insert(argv.end(), {"-alpn", offer.alpn});
    if (!cafile.empty())
        argv.insert(argv.end(), {"-CAfile", cafile, "-verify_return_error", "-ign_eof"});
    ClientRun run;
    run.what = "openssl s_client, " + describe(offer);
    run.result = runCommand(argv, kTool, stdin_path);
    static const std::regex kSubject(R"(subject=CN = ([^\s,/]+))");
    run.cn = reportedCn(run.result.out, kSubject);
    return run;
}

// curl -v -i (the answer's status line too) over https://NAME:PORT/ with NAME resolved to
// 127.0.0.1: SNI is NAME; curl offers ALPN h2 and http/1.1 itself.
inline ClientRun curlGet(const Tools& tools, uint16_t port, const std::string& name) {
    std::string p = std::to_string(port);
    ClientRun run;
    run.what = "curl, sni \"" + name + "\"";
    run.result = runCommand({tools.curl, "-sS", "-k", "-v", "-i", "--max-time", "20", "--resolve",
                             name + ":" + p + ":127.0.0.1", "https://" + name + ":" + p + "/"},
                            kTool);
    static const std::regex kSubject(R"(subject: CN=([^\s,/]+))");
    run.cn = reportedCn(run.result.err, kSubject);
    return run;
}

// kPythonClient (`script`) with `more` arguments (--mode, --big, --proxy-v1...).
inline ClientRun python(const Tools& tools, const std::string& script, uint16_t port,
                        const Offer& offer, const std::string& cafile,
                        const std::vector<std::string>& more = {}) {
    std::vector<std::string> argv = {tools.python, script, "--port", std::to_string(port)};
    if (offer.sni) argv.insert(argv.end(), {"--sni", *offer.sni});
    if (!offer.alpn.empty()) argv.insert(argv.end(), {"--alpn", offer.alpn});
    if (!cafile.empty()) argv.insert(argv.end(), {"--cafile", cafile});
    argv.insert(argv.end(), more.begin(), more.end());
    ClientRun run;
    run.what = "python ssl, " + describe(offer);
    for (const auto& m : more) run.what += " " + m;
    run.result = runCommand(argv, kTool);
    static const std::regex kSubject(R"(subject=CN = ([^\s,/]+))");
    run.cn = reportedCn(run.result.out, kSubject);
    return run;
}

// The client finished its handshake with `backend` (the certificate it reports is that
// backend's; s_client and Python also verified it against the backends' certificates) and that
// backend's HTTP answer, a status page naming its own certificate file, came back through the
// relay.
inline void expectLanded(const ClientRun& run, const TlsBackend& backend) {
    EXPECT_EQ(run.cn, backend.cn())
        << "the client should have reached backend " << backend.cn() << "\n"
        << run.transcript();
    const std::string& out = run.result.out;
    EXPECT_NE(out.find("HTTP/1.0 200 ok"), std::string::npos)
        << "no HTTP answer came back through the relay\n"
        << run.transcript();
    EXPECT_NE(out.find(backend.certPath()), std::string::npos)
        << "the answer is not the status page of s_server " << backend.cn() << "\n"
        << run.transcript();
}

// A TLS client the relay closes: no certificate, no answer.
inline void expectRefused(const ClientRun& run) {
    EXPECT_EQ(run.cn, "") << "the client reached a backend\n" << run.transcript();
    EXPECT_EQ(run.result.out.find("HTTP/1.0 200 ok"), std::string::npos) << run.transcript();
    EXPECT_FALSE(run.result.status.timed_out) << run.transcript();
}

// =============================================================================================
// Real ClientHellos, captured once per test binary: a loopback listener of the test's own reads
// what a real client sends first, until its first handshake message is complete, and closes,
// which ends that client's handshake.

struct HelloSpec {
    std::string key;
    std::string client;  // "s_client", "python" or "curl"
    Offer offer;
    int big = 0;  // python: long ALPN names before offer.alpn
};

class HelloBank {
  public:
    // The records carrying the hello of `spec`, byte for byte as its client wrote them.
    static std::optional<std::string> get(const Tools& tools, const HelloSpec& spec,
                                          std::string& error) {
        static std::mutex mu;
        static std::map<std::string, std::string> bank;
        static TempDir dir;
        std::lock_guard lock(mu);
        if (auto it = bank.find(spec.key); it != bank.end()) return it->second;

        auto got = std::make_shared<std::string>();
        ScriptedUpstream listener(AF_INET, [got](Fd& fd, ConnRecord& rec,
                                                 const std::atomic<bool>& stop, ScriptedUpstream&) {
            char buf[16384];
            for (int i = 0; i < 10'000 && helloExtent(*got) == 0; ++i) {
                IoResult r = readSome(fd.get(), buf, sizeof buf, Millis{10'000}, &stop);
                if (!r.ok()) break;
                got->append(buf, r.bytes);
            }
            rec.bytes_received = got->size();
        });
        if (!listener.ok()) {
            error = listener.error();
            return std::nullopt;
        }
        uint16_t port = listener.port();
        ClientRun run;
        if (spec.client == "s_client") {
            run = sClient(tools, port, spec.offer, "");
        } else if (spec.client == "python") {
            std::string script = dir.writeFile("client.py", kPythonClient);
            std::vector<std::string> more;
            if (spec.big > 0) more = {"--big", std::to_string(spec.big)};
            run = python(tools, script, port, spec.offer, "", more);
        } else {
            run = curlGet(tools, port, spec.offer.sni.value_or("localhost"));
        }
        if (!listener.waitForRecord(0, kIo)) {
            error = "no hello captured from " + run.transcript();
            return std::nullopt;
        }
        size_t extent = helloExtent(*got);
        if (extent == 0 || extent == kNotHandshake) {
            error = "not a complete hello: " + hex(*got) + " from " + run.transcript();
            return std::nullopt;
        }
        HelloFields f = parseHello(handshakeMessage(got->substr(0, extent)));
        if (!f.parsed || f.sni != spec.offer.sni) {
            error = spec.key + ": the captured hello does not carry the server name asked for (" +
                    f.sni.value_or("<none>") + "): " + hex(*got);
            return std::nullopt;
        }
        return bank[spec.key] = got->substr(0, extent);
    }
};

}  // namespace zcrelay::test::sni_routing_test
