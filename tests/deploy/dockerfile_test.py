#!/usr/bin/env python3
"""deploy/Dockerfile, read without docker: its two stages, that the runtime stage installs exactly
the packages of the libraries the built binary links, and that EXPOSE, HEALTHCHECK and the
command agree with the config the image ships.

Usage: dockerfile_test.py ZCRELAY_BINARY SOURCE_DIR
"""
import json
import os
import re
import shlex
import subprocess
import sys

import yaml

from deploy_common import check, check_config, finish, host_port, listener_ports, metrics_address

# In debian:12-slim already (apt needs them): never listed, always there.
BASE_IMAGE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6"}


def instructions(path):
    """[(KEYWORD, args)], continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in open(path, encoding="utf-8"):
        line = raw.rstrip("\n")
        if not pending and re.match(r"\s*#", line):
            continue
        if re.match(r"\s*#", line):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            out.append((keyword.upper(), args.strip()))
    return out


def stages(instrs):
    """[{'image', 'name', 'instrs'}] split at FROM."""
    result = []
    for keyword, args in instrs:
        if keyword == "FROM":
            words = args.split()
            words = [w for w in words if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            result.append({"image": words[0], "name": name, "instrs": []})
        elif result:
            result[-1]["instrs"].append((keyword, args))
    return result


def exec_form(args):
    """JSON exec form, or a shell form split like sh would."""
    args = args.strip()
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def owning_package(path):
    """The Debian package of a library file; usrmerge means dpkg may know it by /lib or /usr/lib."""
    real = os.path.realpath(path)
    candidates = []
    for p in (real, path):
        candidates += [p, p.removeprefix("/usr"), "/usr" + p]
    for p in candidates:
        r = subprocess.run(["dpkg", "-S", p], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout:
            return r.stdout.splitlines()[0].split(":")[0]
    return None


def linked_packages(binary):
    """(packages of the NEEDED libraries, packages of every library ldd loads)."""
    dynamic = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True, check=True)
    needed = re.findall(r"\(NEEDED\).*\[(.+)\]", dynamic.stdout)
    ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    paths = dict(re.findall(r"^\s*(\S+) => (/\S+)", ldd, re.M))
    direct, closure = {}, set()
    for soname, path in paths.items():
        pkg = owning_package(path)
        check(pkg is not None, f"no Debian package owns {soname} ({path})")
        closure.add(pkg)
        if soname in needed:
            direct[soname] = pkg
    for soname in needed:
        check(soname in direct, f"ldd does not resolve {soname}, which the binary needs")
    return direct, closure


def main():
    binary, src = sys.argv[1], sys.argv[2]
    dockerfile = os.path.join(src, "deploy", "Dockerfile")
    st = stages(instructions(dockerfile))
    if not check(len(st) >= 2, f"{len(st)} stage(s), want a build and a runtime stage"):
        finish("Dockerfile")
    build, runtime = st[0], st[-1]

    # Build stage: Debian 12, the repository's dependency script, CMake.
    check(build["image"] in ("debian:12", "debian:bookworm"), f"build stage FROM {build['image']}")
    check(build["name"] is not None, "the build stage has no name (FROM ... AS build)")
    runs = [a for k, a in build["instrs"] if k == "RUN"]
    check(any("./deploy/install-deps.sh" in r for r in runs), "build stage does not run ./deploy/install-deps.sh")
    check(any(k == "COPY" and "deploy/install-deps.sh" in a for k, a in build["instrs"]),
          "build stage does not copy deploy/install-deps.sh")
    build_dir = None
    for r in runs:
        m = re.search(r"cmake\s+-S\s+\S+\s+-B\s+(\S+)", r)
        if m:
            build_dir = m.group(1)
    check(build_dir is not None, "build stage runs no `cmake -S . -B DIR`")

    # Runtime stage: slim, no build tools.
    check(runtime["image"] in ("debian:12-slim", "debian:bookworm-slim"), f"runtime stage FROM {runtime['image']}")
    rt = runtime["instrs"]
    rt_runs = " ".join(a for k, a in rt if k == "RUN")
    check("install-deps.sh" not in rt_runs, "the runtime stage runs install-deps.sh (build and test tools)")
    installed = set()
    for m in re.finditer(r"apt-get install ((?:[^&;|]|\\\n)+)", rt_runs):
        installed |= {w for w in m.group(1).split() if not w.startswith("-")}
    check(installed, "the runtime stage installs no package")
    check(not [p for p in installed if p.endswith("-dev")], f"-dev packages at run time: {sorted(installed)}")

    # Those packages against what the built binary links, on this Debian 12.
    direct, closure = linked_packages(binary)
    for soname, pkg in sorted(direct.items()):
        if pkg in BASE_IMAGE_PACKAGES:
            continue
        check(pkg in installed, f"the binary needs {soname} ({pkg}); the runtime stage does not install {pkg}")
    for pkg in sorted(installed - closure):
        check(False, f"the runtime stage installs {pkg}, which no library the binary loads comes from")
    print(f"runtime packages {sorted(installed)}; the binary's: {sorted(set(direct.values()))}")

    # The binary comes from the build stage's build dir.
    copies = [exec_form(a) for k, a in rt if k == "COPY"]
    from_build = [c for c in copies if c and c[0] == f"--from={build['name']}"]
    check(any(c[1:] == [f"{build_dir}/zcrelay", "/usr/bin/zcrelay"] for c in from_build),
          f"no COPY --from={build['name']} {build_dir}/zcrelay /usr/bin/zcrelay")
    local = {c[-1]: c[-2] for c in copies if c and not c[0].startswith("--")}

    # The command reads the config the image ships.
    entry = next((exec_form(a) for k, a in reversed(rt) if k == "ENTRYPOINT"), [])
    cmd = next((exec_form(a) for k, a in reversed(rt) if k == "CMD"), [])
    argv = entry + cmd
    check(argv[:1] == ["/usr/bin/zcrelay"], f"the image runs {argv}, not /usr/bin/zcrelay")
    config_path = argv[argv.index("-c") + 1] if "-c" in argv[:-1] else None
    if not check(config_path in local, f"-c {config_path}: no COPY puts a config there"):
        finish("Dockerfile")
    config_src = os.path.join(src, local[config_path])
    text = open(config_src, encoding="utf-8").read()
    ok, out = check_config(binary, text, "docker")
    check(ok, f"{local[config_path]} fails --check-config: {out}")
    config = yaml.safe_load(text)

    # Ports: every listener and the metrics port exposed, and nothing else; reachable from outside.
    exposed = set()
    for k, a in rt:
        if k == "EXPOSE":
            exposed |= {int(p.split("/")[0]) for p in a.split()}
    mhost, mport = metrics_address(config)
    want = set(listener_ports(config)) | {mport}
    check(exposed == want, f"EXPOSE {sorted(exposed)}, the config listens on {sorted(want)}")
    for l in config["listeners"]:
        check(host_port(l["listen"])[0] in ("0.0.0.0", "::"), f"listener {l['listen']} is not reachable from outside the container")
    check(mhost in ("0.0.0.0", "::"), f"metrics on {mhost}: not reachable by a published port")

    # HEALTHCHECK: the probe script, on the metrics port, asking /healthz.
    hc = [a for k, a in rt if k == "HEALTHCHECK"]
    check(len(hc) == 1, f"{len(hc)} HEALTHCHECK instructions")
    if hc:
        m = re.search(r"\bCMD\s+(.*)$", hc[0])
        probe = exec_form(m.group(1)) if m else []
        check(probe[:1] and probe[0] in local, f"HEALTHCHECK runs {probe[:1]}, which no COPY provides")
        if probe[:1] and probe[0] in local:
            script = open(os.path.join(src, local[probe[0]]), encoding="utf-8").read()
            check("/healthz" in script, f"{local[probe[0]]} does not ask /healthz")
        check(probe[1:] == [str(mport)], f"HEALTHCHECK probes port {probe[1:]}, metrics are on {mport}")

    stop = [a for k, a in rt if k == "STOPSIGNAL"]
    check(stop == ["SIGTERM"], f"STOPSIGNAL {stop}, want SIGTERM (zcrelay drains on it)")
    user = [a for k, a in rt if k == "USER"]
    uid = user[-1].split(":")[0] if user else "0"
    check(uid.isdigit() and int(uid) != 0, f"USER {user}: want a numeric non-root uid")

    ignore = os.path.join(src, "deploy", "Dockerfile.dockerignore")
    patterns = open(ignore).read().split() if os.path.exists(ignore) else []
    check("build" in patterns and ".git" in patterns, "deploy/Dockerfile.dockerignore must exclude build and .git")
    finish("Dockerfile")


if __name__ == "__main__":
    main()
