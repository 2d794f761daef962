#!/usr/bin/env python3
"""Captures real TLS ClientHellos on loopback, for tests/unit/tls_hello_test.cpp.

Re-run it from anywhere (it writes the .bin files next to itself, replacing the old ones):

    python3 tests/data/hellos/capture.py            # every client found on this machine
    python3 tests/data/hellos/capture.py curl go    # only these

For each client it listens on 127.0.0.1 (port 0: the kernel picks a free one), starts the client
against that port, reads whole TLS records until the handshake message they carry is complete,
saves exactly those bytes as NAME.bin and closes the connection (the client then fails its
handshake and exits). Nothing leaves loopback; every client and every read is bounded by a
timeout. A client that is not installed is skipped and its old .bin file kept.

The summary it prints (records, size, SNI, ALPN, extension types) is read with this script's own
small parser, independent of the C++ one, and is what README.md and the unit test expect. The
bytes change on every run (random, key shares, session ids) and the extensions may change with
the clients' versions: after a re-run, check the summary against README.md and the test.
"""
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 5  # seconds, for every accept, read and client
SNI = "api.example.com"


def read_hello(conn):
    """Reads whole records until they hold the complete handshake message; returns
    (the bytes of those records, the number of records)."""
    conn.settimeout(TIMEOUT)
    data = b""

    def have(n):
        nonlocal data
        while len(data) < n:
            chunk = conn.recv(65536)
            if not chunk:
                raise EOFError(f"client closed after {len(data)} bytes")
            data += chunk

    pos, handshake, records = 0, b"", 0
    while True:
        have(pos + 5)
        if data[pos] != 22 or data[pos + 1] != 3:
            raise ValueError(f"not a TLS handshake record at {pos}: {data[pos:pos + 5].hex()}")
        length = int.from_bytes(data[pos + 3:pos + 5], "big")
        have(pos + 5 + length)
        handshake += data[pos + 5:pos + 5 + length]
        pos += 5 + length
        records += 1
        if len(handshake) >= 4 and len(handshake) >= 4 + int.from_bytes(handshake[1:4], "big"):
            return data[:pos], records


def summary(raw):
    """SNI, ALPN and extension types of a captured hello (assumed well formed: it is a check
    for a person to read, not a parser for the relay)."""
    hs, pos = b"", 0
    while pos < len(raw):
        length = int.from_bytes(raw[pos + 3:pos + 5], "big")
        hs += raw[pos + 5:pos + 5 + length]
        pos += 5 + length
    b = hs[4:]
    p = 2 + 32
    p += 1 + b[p]  # session id
    suites = int.from_bytes(b[p:p + 2], "big") // 2
    p += 2 + 2 * suites
    p += 1 + b[p]  # compression
    sni, alpn, types = "", [], []
    if p < len(b):
        end = p + 2 + int.from_bytes(b[p:p + 2], "big")
        p += 2
        while p < end:
            t = int.from_bytes(b[p:p + 2], "big")
            n = int.from_bytes(b[p + 2:p + 4], "big")
            d = b[p + 4:p + 4 + n]
            types.append(t)
            if t == 0:
                sni = d[5:5 + int.from_bytes(d[3:5], "big")].decode("ascii", "replace")
            elif t == 16:
                q = 2
                while q < len(d):
                    alpn.append(d[q + 1:q + 1 + d[q]].decode("ascii", "replace"))
                    q += 1 + d[q]
            p += 4 + n
    return {
        "version": f"{b[0]:02x}{b[1]:02x}",
        "suites": suites,
        "sni": sni,
        "alpn": alpn,
        "types": types,
    }


class Command:
    """A client run as a program; `argv(port)` gives its command line."""

    def __init__(self, tool, argv, cwd=None):
        self.tool, self.argv, self.cwd = tool, argv, cwd

    def available(self):
        return shutil.which(self.tool) is not None

    def start(self, port):
        self.proc = subprocess.Popen(self.argv(port), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=self.cwd)

    def stop(self):
        try:
            self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class PythonClient:
    """A client in this process (Python's ssl module, OpenSSL underneath), in a thread."""

    def __init__(self, alpn=None, ciphers=None, server_hostname=SNI):
        self.alpn, self.ciphers, self.server_hostname = alpn, ciphers, server_hostname

    def available(self):
        return True

    def start(self, port):
        def run():
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            if self.alpn:
                ctx.set_alpn_protocols(self.alpn)
            if self.ciphers:
                ctx.set_ciphers(self.ciphers)
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
                    with ctx.wrap_socket(s, server_hostname=self.server_hostname):
                        pass
            except (OSError, ssl.SSLError):
                pass  # the server hangs up after the hello: expected

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self):
        self.thread.join(TIMEOUT)


# Go's crypto/tls: its own TLS stack, with a post-quantum hybrid key share (X25519MLKEM768,
# about 1.2 KB) by default since Go 1.24. Built once into a temporary directory.
GO_CLIENT = r"""
package main

import (
	"crypto/tls"
	"net"
	"os"
	"time"
)

func main() {
	c, err := net.DialTimeout("tcp", "127.0.0.1:"+os.Args[1], 5*time.Second)
	if err != nil {
		os.Exit(1)
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	t := tls.Client(c, &tls.Config{ServerName: "api.example.com",
		NextProtos: []string{"h2", "http/1.1"}, InsecureSkipVerify: true})
	t.Handshake()
}
"""

# Java's JSSE: another TLS stack of its own. Run as a single source file (JDK 11 and later).
JAVA_CLIENT = r"""
import java.net.InetSocketAddress;
import java.net.Socket;
import java.util.List;
import javax.net.ssl.*;

public class Hello {
    public static void main(String[] args) throws Exception {
        Socket plain = new Socket();
        plain.connect(new InetSocketAddress("127.0.0.1", Integer.parseInt(args[0])), 5000);
        plain.setSoTimeout(5000);
        SSLSocket s = (SSLSocket) ((SSLSocketFactory) SSLSocketFactory.getDefault())
            .createSocket(plain, "127.0.0.1", plain.getPort(), true);
        SSLParameters p = s.getSSLParameters();
        p.setServerNames(List.of(new SNIHostName("api.example.com")));
        p.setApplicationProtocols(new String[] {"h2", "http/1.1"});
        s.setSSLParameters(p);
        try { s.startHandshake(); } catch (Exception e) { }
    }
}
"""


def openssl(*extra):
    return Command("openssl", lambda port: ["openssl", "s_client", "-connect",
                                            f"127.0.0.1:{port}", *extra])


def big_alpn():
    # 300 names of 100 bytes: a 30 KB hello, more than one 2^14-byte record can carry, so
    # OpenSSL fragments the handshake message over records (RFC 8446 5.1).
    return [f"proto-{i:03d}-".ljust(100, "x") for i in range(300)]


def clients(tmp):
    go_bin = os.path.join(tmp, "hello_go")
    java_src = os.path.join(tmp, "Hello.java")
    return {
        # OpenSSL's command line client, TLS 1.3 (and 1.2) offered.
        "openssl_sni_alpn": openssl("-servername", SNI, "-alpn", "h2,http/1.1"),
        # Only TLS 1.2 offered: no supported_versions, key_share, psk_key_exchange_modes.
        "openssl_tls12": openssl("-servername", SNI, "-alpn", "h2,http/1.1", "-tls1_2"),
        # No -servername: -connect's host is an IP address, which RFC 6066 3 keeps out of SNI.
        "openssl_no_sni": openssl(),
        # curl (libcurl with OpenSSL on Debian), ALPN h2,http/1.1 of its own accord.
        "curl": Command("curl", lambda port: [
            "curl", "-sk", "--max-time", "3", "-o", "/dev/null",
            "--resolve", f"{SNI}:{port}:127.0.0.1", f"https://{SNI}:{port}/"]),
        "python_sni_alpn": PythonClient(alpn=["h2", "http/1.1"]),
        "python_big_alpn": PythonClient(alpn=big_alpn()),
        # Every cipher suite OpenSSL knows, the insecure ones too: a long cipher_suites vector.
        "python_many_ciphers": PythonClient(ciphers="ALL:COMPLEMENTOFALL:@SECLEVEL=0"),
        # wget with GnuTLS (Debian's build): a third stack. It has no --resolve, so it connects
        # to "localhost" (-4: 127.0.0.1, what we listen on), which is then its SNI.
        "wget_gnutls": Command("wget", lambda port: [
            "wget", "-4", "-q", "-O", "/dev/null", "--timeout=3", "--tries=1",
            "--no-check-certificate", f"https://localhost:{port}/"]),
        "go": Command("go", lambda port: [go_bin, str(port)]),
        "java": Command("java", lambda port: ["java", java_src, str(port)]),
    }


def prepare(name, tmp):
    """Builds what a client needs before it can start; False if it cannot be."""
    if name == "go":
        src = os.path.join(tmp, "main.go")
        with open(src, "w") as f:
            f.write(GO_CLIENT)
        r = subprocess.run(["go", "build", "-o", os.path.join(tmp, "hello_go"), src], cwd=tmp,
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
        if r.returncode != 0:
            print(f"go: build failed: {r.stderr.decode(errors='replace')}", file=sys.stderr)
            return False
    if name == "java":
        with open(os.path.join(tmp, "Hello.java"), "w") as f:
            f.write(JAVA_CLIENT)
    return True


def capture(name, client):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(TIMEOUT * 4)  # the JVM and a first `go build` run take a while to start
        port = srv.getsockname()[1]
        client.start(port)
        try:
            conn, _ = srv.accept()
            with conn:
                raw, records = read_hello(conn)
        finally:
            client.stop()
    with open(os.path.join(HERE, name + ".bin"), "wb") as f:
        f.write(raw)
    s = summary(raw)
    types = ",".join(f"{t:#06x}" if t > 255 else str(t) for t in s["types"])
    print(f"{name}: {len(raw)} bytes, {records} record(s), version {s['version']}, "
          f"{s['suites']} suites, sni {s['sni']!r}, alpn {len(s['alpn'])} "
          f"{','.join(s['alpn'][:3])}{'...' if len(s['alpn']) > 3 else ''}, extensions [{types}]")
    return records


def main():
    wanted = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        for name, client in clients(tmp).items():
            if wanted and name not in wanted:
                continue
            if not client.available():
                print(f"{name}: client not installed, skipped", file=sys.stderr)
                continue
            if not prepare(name, tmp):
                continue
            records = capture(name, client)
            if name == "python_big_alpn" and records < 2:
                sys.exit(f"{name}: expected the hello split over several records, got {records}")


if __name__ == "__main__":
    main()
