"""Helpers shared by the Python deploy checks: zcrelay's units and addresses, running the binary."""
import os
import re
import subprocess
import sys
import tempfile

_failures = []


def check(ok, message):
    """Records a failure and goes on, so one run lists every mismatch."""
    if not ok:
        _failures.append(message)
        print(f"FAIL: {message}", file=sys.stderr)
    return ok


def finish(what):
    if _failures:
        print(f"{what}: {len(_failures)} failure(s)", file=sys.stderr)
        sys.exit(1)
    print(f"{what} OK")


def seconds(value):
    """zcrelay's durations (100us, 250ms, 5s, 2m, 1h, 0) in seconds."""
    m = re.fullmatch(r"(\d+)(us|ms|s|m|h)?", str(value).strip())
    if not m:
        raise ValueError(f"not a zcrelay duration: {value!r}")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]
    return int(m.group(1)) * scale


def host_port(address):
    """'0.0.0.0:10000' or '[::]:10000' -> ('0.0.0.0', 10000)."""
    m = re.fullmatch(r"\[(.*)\]:(\d+)|([^:\[\]]*):(\d+)", str(address))
    if not m:
        raise ValueError(f"not a host:port address: {address!r}")
    return (m.group(1), int(m.group(2))) if m.group(1) is not None else (m.group(3), int(m.group(4)))


def drain_timeout(config):
    return seconds(config.get("drain_timeout", "30s"))


def listener_ports(config):
    return sorted(host_port(l["listen"])[1] for l in config.get("listeners", []))


def metrics_address(config):
    m = config.get("metrics") or {}
    return host_port(m.get("listen", "127.0.0.1:9100"))


def check_config(binary, text, name):
    """Runs `zcrelay --check-config` on text; returns (ok, output)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=name.replace("/", "_") + "-",
                                     delete=False) as f:
        f.write(text)
        path = f.name
    try:
        r = subprocess.run([binary, "--check-config", path], capture_output=True, text=True,
                           timeout=20)
        return r.returncode == 0, (r.stdout + r.stderr).strip()
    finally:
        os.unlink(path)
