#!/usr/bin/env python3
"""The image's HEALTHCHECK probe (deploy/docker/healthcheck.sh) against the real binary: it passes
while the relay runs, and fails once the relay is gone.

Usage: healthcheck_probe_test.py ZCRELAY_BINARY SOURCE_DIR
"""
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile

from deploy_common import check, finish

CONFIG = """\
workers: 1
drain_timeout: 1s
metrics:
  listen: 127.0.0.1:0
listeners:
  - name: probe
    listen: 127.0.0.1:0
    upstream: 127.0.0.1:9
"""


def probe(script, port):
    return subprocess.run(["bash", script, str(port)], capture_output=True, text=True, timeout=10).returncode


def main():
    binary, src = sys.argv[1], sys.argv[2]
    script = os.path.join(src, "deploy", "docker", "healthcheck.sh")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(CONFIG)
    relay = subprocess.Popen([binary, "-c", f.name], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = None
    try:
        for line in relay.stdout:  # bounded by ctest's TIMEOUT should "ready" never come
            m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
            if m:
                port = int(m.group(1))
            if line.strip() == "zcrelay: ready":
                break
        if check(port is not None, "the relay printed no metrics address"):
            check(probe(script, port) == 0, f"the probe fails against a running relay (127.0.0.1:{port}/healthz)")
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=20)
        os.unlink(f.name)
    check(relay.returncode == 0, f"the relay exited {relay.returncode} after SIGTERM")
    if port is not None:
        # Nothing listens there now (the port was the relay's, and it has exited).
        with socket.socket() as s:
            free = s.connect_ex(("127.0.0.1", port)) != 0
        if free:
            check(probe(script, port) != 0, "the probe passes with no relay")
    finish("HEALTHCHECK probe")


if __name__ == "__main__":
    main()
