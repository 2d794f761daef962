#!/usr/bin/env python3
"""deploy/kubernetes: every manifest parses, and each workload agrees with the zcrelay.yaml its
ConfigMap ships: that config passes --check-config, it is mounted where the command's -c reads it,
its listener ports are containerPorts that a Service targets, and its metrics port is the probes',
the scrape annotation's and the ServiceMonitor's port. Also the shutdown arithmetic
(terminationGracePeriodSeconds > preStop sleep + drain_timeout) and the security context.

Backends found through DNS (`discovery`): the name, read as a pod resolves it (resolv.conf's search
domains, ndots:5), is a headless Service among the manifests, in the relay's namespace or the one
the name gives, with named ports, selecting a workload that is not a relay and has a readiness
probe; `port` is that workload's container port (A/AAAA: clients connect to the pods), or the SRV
name's _port._proto is one of the Service's; both are applied together (the same file or both in
kustomization.yaml). The runtime API (`admin`) listens on loopback or a unix socket in an emptyDir,
never on a containerPort or a Service's port. Then each relay config that discovers runs for real
against dnsmasq standing in for the cluster DNS (the records CoreDNS serves for the headless
Service, a pod's resolv.conf): the name resolves through the first search domain, the backends come
up, a client is relayed to one of them, and the runtime API lists them.

Usage: kubernetes_test.py ZCRELAY_BINARY SOURCE_DIR
"""
import copy
import glob
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import yaml

from deploy_common import check, check_config, drain_timeout, finish, host_port, listener_ports, metrics_address

WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet")


def cpu_cores(q):
    q = str(q)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def resolve_port(port, container):
    """A probe's or Service's port (number or name) -> the container's port number, or None."""
    for p in container.get("ports", []):
        if port == p["containerPort"] or port == p.get("name"):
            return p["containerPort"]
    return None


def config_of(w, pod, container, configmaps, binary):
    """(mounted zcrelay config, parsed) that the container's -c reads, checking the mount."""
    name = w["metadata"]["name"]
    argv = container.get("command", []) + container.get("args", [])
    if not check("-c" in argv[:-1], f"{name}: the command {argv} has no -c FILE"):
        return None
    path = argv[argv.index("-c") + 1]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        v = volumes.get(m["name"], {})
        if "configMap" not in v:
            continue
        if m.get("subPath"):
            key, mounted_at = m["subPath"], m["mountPath"]
        else:
            key = os.path.relpath(path, m["mountPath"])
            mounted_at = os.path.join(m["mountPath"], key)
            # items: [{key, path}] renames keys inside the mount.
            for item in v["configMap"].get("items", []):
                if item["path"] == key:
                    key = item["key"]
        if mounted_at != path or key.startswith(".."):
            continue
        cm = configmaps.get(v["configMap"]["name"])
        if not check(cm is not None, f"{name}: ConfigMap {v['configMap']['name']} is not among the manifests"):
            return None
        text = cm.get("data", {}).get(key)
        if not check(text is not None, f"{name}: ConfigMap {cm['metadata']['name']} has no key {key}"):
            return None
        ok, out = check_config(binary, text, cm["metadata"]["name"])
        check(ok, f"ConfigMap {cm['metadata']['name']}/{key} fails zcrelay --check-config: {out}")
        print(f"{w['kind']} {name}: -c {path} = ConfigMap {cm['metadata']['name']} key {key} ({out})")
        return yaml.safe_load(text)
    check(False, f"{name}: no ConfigMap volume is mounted at {path} (the -c argument)")
    return None


def check_workload(w, configmaps, binary, image_uid):
    name, kind = w["metadata"]["name"], w["kind"]
    template = w["spec"]["template"]
    pod = template["spec"]
    labels = template["metadata"].get("labels", {})
    selector = w["spec"]["selector"]["matchLabels"]
    check(selector.items() <= labels.items(), f"{name}: selector {selector} does not match its pods {labels}")
    containers = [c for c in pod["containers"] if c["name"] == "zcrelay"]
    if not check(len(containers) == 1, f"{name}: no container named zcrelay"):
        return None
    c = containers[0]
    config = config_of(w, pod, c, configmaps, binary)
    if config is None:
        return None

    ports = {p["containerPort"] for p in c.get("ports", [])}
    for l in config["listeners"]:
        host, port = host_port(l["listen"])
        check(port in ports, f"{name}: listener {l.get('name')} port {port} is not a containerPort {sorted(ports)}")
        check(host in ("0.0.0.0", "::"), f"{name}: listener {l['listen']} is not reachable from outside the pod")
    mhost, mport = metrics_address(config)
    check(mhost in ("0.0.0.0", "::"), f"{name}: metrics on {mhost}: the kubelet's probes cannot reach it")
    check(resolve_port("metrics", c) == mport, f"{name}: containerPort 'metrics' is not the config's metrics port {mport}")
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = c.get(probe, {}).get("httpGet", {})
        check(get.get("path") == path, f"{name}: {probe} asks {get.get('path')}, want {path}")
        check(resolve_port(get.get("port"), c) == mport, f"{name}: {probe} port {get.get('port')} is not the metrics port {mport}")
    ann = template["metadata"].get("annotations", {})
    check(ann.get("prometheus.io/scrape") == "true", f"{name}: no prometheus.io/scrape: \"true\"")
    check(ann.get("prometheus.io/port") == str(mport), f"{name}: prometheus.io/port {ann.get('prometheus.io/port')}, metrics on {mport}")
    check(ann.get("prometheus.io/path", "/metrics") == "/metrics", f"{name}: prometheus.io/path {ann.get('prometheus.io/path')}")

    # Shutdown: endpoints removed while preStop sleeps, then SIGTERM and drain_timeout, all
    # within the grace period.
    sleep = 0
    pre = c.get("lifecycle", {}).get("preStop", {})
    cmd = pre.get("exec", {}).get("command", [])
    if cmd:
        check(os.path.basename(cmd[0]) == "sleep" and len(cmd) == 2, f"{name}: preStop {cmd} is not a sleep")
        sleep = float(cmd[1]) if len(cmd) == 2 else 0
    elif "sleep" in pre:
        sleep = pre["sleep"]["seconds"]
    if kind == "Deployment":
        check(sleep > 0, f"{name}: no preStop sleep: SIGTERM would come before the endpoints are removed")
        check(w["spec"].get("replicas", 1) >= 2, f"{name}: replicas {w['spec'].get('replicas', 1)}, want 2 or more")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    drain = drain_timeout(config)
    check(grace > sleep + drain, f"{name}: terminationGracePeriodSeconds {grace} <= preStop {sleep} s + drain_timeout {drain} s")

    # Not root; no capability kept; the image's uid.
    psc, csc = pod.get("securityContext", {}), c.get("securityContext", {})
    check(csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, f"{name}: runAsNonRoot is not true")
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    check(uid is not None and uid != 0, f"{name}: runAsUser {uid}")
    check(image_uid is None or uid == image_uid, f"{name}: runAsUser {uid}, the image's USER is {image_uid}")
    check(csc.get("allowPrivilegeEscalation") is False, f"{name}: allowPrivilegeEscalation is not false")
    check("ALL" in csc.get("capabilities", {}).get("drop", []), f"{name}: capabilities do not drop ALL")
    res = c.get("resources", {})
    check("cpu" in res.get("requests", {}) and "memory" in res.get("requests", {}), f"{name}: no cpu and memory requests")
    check("memory" in res.get("limits", {}), f"{name}: no memory limit")
    workers = config.get("workers")
    if workers and "cpu" in res.get("requests", {}):
        check(cpu_cores(res["requests"]["cpu"]) >= workers, f"{name}: {workers} workers on a cpu request of {res['requests']['cpu']}")
    if pod.get("hostNetwork"):
        check(pod.get("dnsPolicy") == "ClusterFirstWithHostNet", f"{name}: hostNetwork without dnsPolicy ClusterFirstWithHostNet")
        for p in c.get("ports", []):
            check(p.get("hostPort", p["containerPort"]) == p["containerPort"], f"{name}: hostNetwork with hostPort != containerPort")
    return {"workload": w, "labels": labels, "pod": pod, "container": c, "config": config, "metrics_port": mport}


# ---- discovery: the name a relay follows is a headless Service of the manifests -------------

NDOTS = 5  # a pod's resolv.conf under dnsPolicy ClusterFirst: options ndots:5
CLUSTER_DNS_POLICIES = ("ClusterFirst", "ClusterFirstWithHostNet")  # resolv.conf names the cluster DNS


def namespace_of(d):
    """metadata.namespace, or None: the namespace `kubectl apply` is given, the same for every
    manifest that names none."""
    return d["metadata"].get("namespace")


def service_of(labels, absolute, relay_ns):
    """The labels of a discovery name after any _port._proto -> (service, namespace, zone or None),
    as a pod of relay_ns resolves it: a relative name with fewer than ndots dots tries the search
    domains <ns>.svc.<zone>, svc.<zone>, <zone> first, in that order."""
    if absolute:
        if len(labels) >= 4 and labels[2] == "svc":
            return labels[0], labels[1], ".".join(labels[3:])
        raise ValueError("an absolute name of a Service is <service>.<namespace>.svc.<zone>.")
    if len(labels) == 1:
        return labels[0], relay_ns, None  # the first search domain: the pod's own namespace
    if len(labels) == 2 or (len(labels) == 3 and labels[2] == "svc"):
        return labels[0], labels[1], None
    if len(labels) >= 4 and labels[2] == "svc":
        return labels[0], labels[1], ".".join(labels[3:])
    raise ValueError("not the name of a Service: <service>[.<namespace>[.svc[.<zone>]]]")


def lookups(name, ns, zone):
    """The names a pod of namespace ns asks, in order, for `name` (c-ares as resolv.conf says)."""
    if name.endswith("."):
        return [name[:-1]]
    search = [f"{ns}.svc.{zone}", f"svc.{zone}", zone]
    candidates = [f"{name}.{domain}" for domain in search]
    return [name] + candidates if name.count(".") >= NDOTS else candidates + [name]


def check_discovery(r, services, backends, relays, file_of, kustomized):
    """Each discovered cluster of relay r against the Services; returns what the live run needs."""
    w, config, pod = r["workload"], r["config"], r["pod"]
    wname, relay_ns = w["metadata"]["name"], namespace_of(w)
    found = []
    for cl in config.get("clusters") or []:
        d = cl.get("discovery")
        if not d:
            continue
        where = f"{wname}: cluster {cl['name']}"
        name = d.get("srv") or d.get("dns")
        labels = name.rstrip(".").split(".")
        port_name = proto = None
        if d.get("srv"):
            if not check(len(labels) > 2 and labels[0].startswith("_") and labels[1].startswith("_"),
                         f"{where}: srv {name} is not _<port name>._<protocol>.<service>..."):
                continue
            port_name, proto = labels[0][1:], labels[1][1:]
            labels = labels[2:]
        try:
            svc_name, ns, zone = service_of(labels, name.endswith("."), relay_ns)
        except ValueError as e:
            check(False, f"{where}: {name}: {e}")
            continue
        # The pod's resolv.conf: the cluster DNS, and the search domains a short name needs.
        resolvers = config.get("resolvers") or {}
        check(not resolvers.get("nameservers"), f"{wname}: resolvers.nameservers replaces the cluster DNS "
              f"that the pod's resolv.conf names; {name} is a cluster name")
        check(name.endswith(".") or resolvers.get("resolv_conf", "/etc/resolv.conf") == "/etc/resolv.conf",
              f"{wname}: resolvers.resolv_conf {resolvers.get('resolv_conf')}: {name} needs the pod's search domains")
        policy = pod.get("dnsPolicy", "ClusterFirst")
        check(policy in CLUSTER_DNS_POLICIES, f"{wname}: dnsPolicy {policy}: the pod's resolv.conf would not name "
              f"the cluster DNS, which answers {name}")
        check(d.get("startup", "fail") == "empty", f"{where}: startup {d.get('startup', 'fail')}: a relay that starts "
              f"before {svc_name}'s pods are ready (kubectl apply creates both at once) would exit and crash-loop; "
              "startup: empty starts it unready and keeps asking")

        ns_text = ns if ns is not None else "of the relay"
        matches = [s for s in services if s["metadata"]["name"] == svc_name and namespace_of(s) == ns]
        if not check(matches, f"{where}: {name} is the Service {svc_name} in the namespace {ns_text}, which is "
                     f"not among the manifests (Services: {sorted(s['metadata']['name'] for s in services)})"):
            continue
        s = matches[0]
        spec = s["spec"]
        check(spec.get("clusterIP") == "None", f"Service {svc_name} ({where}) is not headless (clusterIP: None): its "
              "name would answer with one virtual IP, kube-proxy would choose the pod, and a health check would "
              "test the virtual IP")
        check(not spec.get("publishNotReadyAddresses"), f"Service {svc_name}: publishNotReadyAddresses puts pods "
              "in DNS before they are ready")
        for p in spec.get("ports", []):
            check(p.get("name"), f"Service {svc_name}: port {p.get('port')} has no name: no SRV record for it")
        sel = spec.get("selector") or {}
        chosen = lambda x: sel and sel.items() <= x["labels"].items() and namespace_of(x["workload"]) == ns
        check(not any(chosen(x) for x in relays), f"Service {svc_name} selects relay pods: {where} would relay "
              "to itself")
        selected = [b for b in backends if chosen(b)]
        if not check(selected, f"Service {svc_name} ({where}) selects no backend workload among the manifests"):
            continue
        # The port a client of the pods connects to: the container's, which is the SRV record's.
        if port_name is not None:
            ports = [p for p in spec.get("ports", []) if p.get("name") == port_name
                     and p.get("protocol", "TCP").lower() == proto.lower()]
            check(ports, f"{where}: srv {name}: Service {svc_name} has no port named {port_name} with protocol "
                  f"{proto.upper()} ({[(p.get('name'), p.get('protocol', 'TCP')) for p in spec.get('ports', [])]})")
            check(proto.lower() == "tcp", f"{where}: srv {name}: the relay connects over TCP, not {proto}")
        else:
            ports = [p for p in spec.get("ports", [])
                     if any(resolve_port(p.get("targetPort", p["port"]), c) == d.get("port")
                            for b in selected for c in b["pod"]["containers"])]
            check(ports, f"{where}: dns {name} port {d.get('port')} is not a container port that Service {svc_name} "
                  "targets: a headless Service's clients connect to the pods, at the targetPort")
        for b in selected:
            for c in b["pod"]["containers"]:
                if any(resolve_port(p.get("targetPort", p["port"]), c) for p in ports):
                    check("readinessProbe" in c, f"{b['workload']['metadata']['name']}: container {c['name']} has no "
                          "readinessProbe: DNS would list each pod as soon as it starts, before it listens")
        # Applied together: kubectl apply -k takes both, or they share a file.
        rfile, sfile = file_of[id(w)], file_of[id(s)]
        if rfile in kustomized:
            check(sfile in kustomized, f"{sfile} (Service {svc_name}, discovered by {wname}) is not in "
                  f"kustomization.yaml's resources, but {rfile} is")
        else:
            check(sfile == rfile, f"{rfile} is applied alone, but Service {svc_name} that {wname} discovers is in {sfile}")
        found.append({"cluster": cl["name"], "name": name, "srv": port_name is not None, "port": d.get("port"),
                      "service": s, "namespace": ns, "zone": zone, "backends": selected})
    return found


def check_admin(r, services):
    """The runtime API: on loopback or a unix socket in an emptyDir; never a containerPort or a
    Service's port."""
    w, config, pod, c = r["workload"], r["config"], r["pod"], r["container"]
    name = w["metadata"]["name"]
    listen = (config.get("admin") or {}).get("listen") or ""
    if not listen:
        return
    if listen.startswith("unix:"):
        directory = os.path.normpath(os.path.dirname(listen[len("unix:"):]))
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        writable = [m for m in c.get("volumeMounts", []) if os.path.normpath(m["mountPath"]) == directory
                    and "emptyDir" in volumes.get(m["name"], {}) and not m.get("readOnly")]
        check(writable, f"{name}: admin.listen {listen}: {directory} is not a writable emptyDir mount of the "
              "container (its root filesystem is read-only)")
        return
    host, port = host_port(listen)
    check(ipaddress.ip_address(host).is_loopback, f"{name}: admin.listen {listen} is not loopback: other pods "
          "would reach the runtime API")
    check(not pod.get("hostNetwork"), f"{name}: admin.listen {listen} with hostNetwork is the node's loopback, "
          "open to every process on the node: use a unix socket in an emptyDir")
    for cc in pod["containers"]:
        for p in cc.get("ports", []):
            check(port not in (p["containerPort"], p.get("hostPort")), f"{name}: the admin port {port} is a "
                  f"containerPort ({cc['name']}, {p.get('name')})")
    check(port != r["metrics_port"] and port not in listener_ports(config),
          f"{name}: the admin port {port} is also a listener's or the metrics port")
    for s in services:
        sel = s["spec"].get("selector") or {}
        if not (sel and sel.items() <= r["labels"].items()):
            continue
        for p in s["spec"].get("ports", []):
            check(port not in (p.get("port"), p.get("targetPort"), p.get("nodePort")),
                  f"Service {s['metadata']['name']} exposes port {port}, {name}'s runtime API")


# ---- the live run: the relay's config against a stand-in for the cluster DNS ----------------

def dnsmasq_path():
    return shutil.which("dnsmasq") or next((p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if os.access(p, os.X_OK)), None)


def free_port():
    """A port free on 127.0.0.1 for both UDP and TCP (dnsmasq takes both)."""
    for _ in range(50):
        with socket.socket() as t, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            t.bind(("127.0.0.1", 0))
            try:
                u.bind(("127.0.0.1", t.getsockname()[1]))
            except OSError:
                continue
            return t.getsockname()[1]
    raise RuntimeError("no port free for both UDP and TCP")


def dns_answers(port, name):
    """Asks 127.0.0.1:port for the A records of name over UDP; the answer count, or None."""
    qid = random.randrange(65536)
    q = qid.to_bytes(2, "big") + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\x00\x00\x01\x00\x01"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.settimeout(0.2)
        try:
            u.sendto(q, ("127.0.0.1", port))
            reply = u.recv(4096)
        except OSError:
            return None
    return int.from_bytes(reply[6:8], "big") if reply[:2] == q[:2] else None


def http_get(address, path):
    """(status, body) of GET path from 127.0.0.1:port or unix:/path, over HTTP/1.0."""
    if address.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX)
        target = address[len("unix:"):]
    else:
        sock = socket.socket()
        target = host_port(address)
    with sock:
        sock.settimeout(5)
        sock.connect(target)
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


class Backends:
    """TCP servers on loopback addresses standing in for pods: each answers its own address."""

    def __init__(self, count, ports):
        self.stop = threading.Event()
        self.servers, self.ips = [], []
        while len(self.ips) < count:
            ip = f"127.{random.randint(64, 250)}.{random.randint(1, 250)}.{len(self.ips) + 1}"
            socks = []
            try:
                for port in ports:
                    s = socket.socket()
                    socks.append(s)
                    s.bind((ip, port))
                    s.listen(64)
                    s.settimeout(0.2)
            except OSError:
                for s in socks:
                    s.close()
                continue
            self.ips.append(ip)
            self.servers += socks
        self.threads = [threading.Thread(target=self.serve, args=(s,), daemon=True) for s in self.servers]
        for t in self.threads:
            t.start()

    def serve(self, s):
        while not self.stop.is_set():
            try:
                c, _ = s.accept()
            except OSError:
                continue
            with c:
                host, port = s.getsockname()
                c.sendall(f"{host}:{port}\n".encode())

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join()
        for s in self.servers:
            s.close()


def live_discovery(binary, r, found, tmp):
    """Runs r's config as a pod in namespace `demo` would, against dnsmasq serving what CoreDNS
    serves for each discovered headless Service: A records of its ready pods, and an SRV record per
    named port whose target is <dashed pod IP>.<service>.<ns>.svc.<zone>."""
    name = r["workload"]["metadata"]["name"]
    dnsmasq = dnsmasq_path()
    if not check(dnsmasq, "dnsmasq not found (deploy/install-deps.sh installs dnsmasq-base): the discovery "
                 "config cannot be run against a DNS server"):
        return
    live_ns = namespace_of(r["workload"]) or "demo"
    plans, ports = [], set()
    for f in found:
        ns, zone = f["namespace"] or live_ns, f["zone"] or "cluster.local"
        svc = f["service"]["metadata"]["name"]
        # port name -> the pods' port (targetPort as the backend container declares it)
        named = {}
        for p in f["service"]["spec"].get("ports", []):
            for b in f["backends"]:
                for c in b["pod"]["containers"]:
                    cp = resolve_port(p.get("targetPort", p["port"]), c)
                    if cp:
                        named[(p.get("name"), p.get("protocol", "TCP").lower())] = cp
        ports |= set(named.values())
        plans.append({**f, "fqdn": f"{svc}.{ns}.svc.{zone}", "zone": zone, "named": named})
    pods = Backends(2, sorted(ports))
    dns_log = os.path.join(tmp, "dnsmasq.log")
    dns = relay = None
    err = ""
    try:
        for _ in range(5):  # another process may take the port between free_port() and dnsmasq's bind
            dport = free_port()
            argv = [dnsmasq, "--keep-in-foreground", "--conf-file=/dev/null", "--pid-file=", f"--port={dport}",
                    "--listen-address=127.0.0.1", "--bind-interfaces", "--no-hosts", "--no-resolv", "--no-poll",
                    "--cache-size=0", "--local-ttl=5", "--log-queries", f"--log-facility={dns_log}"]
            if os.geteuid() == 0:
                argv.append("--user=root")
            # What the test asks until dnsmasq answers: a name of its own, kept out of the relay's.
            probe = f"dnsmasq-is-up.{plans[0]['zone']}"
            argv.append(f"--host-record={probe},127.0.0.1")
            for plan in plans:
                argv.append(f"--local=/{plan['zone']}/")
                for ip in pods.ips:
                    target = ip.replace(".", "-") + "." + plan["fqdn"]
                    argv += [f"--host-record={plan['fqdn']},{ip}", f"--host-record={target},{ip}"]
                    for (pname, proto), cp in plan["named"].items():
                        argv.append(f"--srv-host=_{pname}._{proto}.{plan['fqdn']},{target},{cp},0,100")
            dns = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 10
            while dns.poll() is None and time.monotonic() < deadline and not dns_answers(dport, probe):
                time.sleep(0.05)
            if dns.poll() is None:
                break
            err = dns.stderr.read()
            dns = None
        if not check(dns is not None and dns_answers(dport, probe), f"dnsmasq did not start: {err}"):
            return

        # The pod's resolv.conf (the nameserver line is what resolvers.nameservers replaces here).
        resolv = os.path.join(tmp, "resolv.conf")
        with open(resolv, "w") as f:
            f.write(f"search {live_ns}.svc.cluster.local svc.cluster.local cluster.local\n"
                    f"nameserver 127.0.0.1\noptions ndots:{NDOTS}\n")
        cfg = copy.deepcopy(r["config"])
        cfg["workers"] = 1
        cfg["metrics"] = {**(cfg.get("metrics") or {}), "listen": "127.0.0.1:0"}
        cfg["metrics"].pop("health_listen", None)
        for l in cfg["listeners"]:
            l["listen"] = "127.0.0.1:0"
        cfg["resolvers"] = {**(cfg.get("resolvers") or {}), "nameservers": [f"127.0.0.1:{dport}"],
                            "resolv_conf": resolv}
        admin = (cfg.get("admin") or {}).get("listen")
        if admin:
            cfg["admin"]["listen"] = f"unix:{tmp}/admin.sock" if admin.startswith("unix:") else "127.0.0.1:0"
        path = os.path.join(tmp, "zcrelay.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        relay_log = os.path.join(tmp, "zcrelay.err")
        with open(relay_log, "w") as err:
            relay = subprocess.Popen([binary, "-c", path], stdout=subprocess.PIPE, stderr=err, text=True)
        watchdog = threading.Timer(30, relay.kill)  # "ready" never printed: end it, fail below
        watchdog.start()
        bound, metrics = {}, None
        for line in relay.stdout:
            m = re.match(r"zcrelay: listener (\S+) listening on (\S+) ", line)
            if m:
                bound[m.group(1)] = m.group(2)
            m = re.search(r"metrics on http://(\S+)/metrics", line)
            if m:
                metrics = m.group(1)
            if line.strip() == "zcrelay: ready":
                break
        watchdog.cancel()
        log = open(relay_log).read()
        if not check(relay.poll() is None and bound, f"{name}: the relay did not start with its discovery config "
                     f"against the stand-in DNS:\n{log}"):
            return
        m = re.search(r"admin API on (\S+)", log)
        admin_at = m.group(1) if m else None
        check(not admin or admin_at, f"{name}: the relay logged no admin API address:\n{log}")

        # Each pod at the container port: discovery.port (A/AAAA), or the SRV records' ports.
        want = {}
        for plan in plans:
            srv_ports = {cp for (pname, proto), cp in plan["named"].items()
                         if plan["name"].startswith(f"_{pname}._{proto}.")}
            want[plan["cluster"]] = {f"{ip}:{port}" for ip in pods.ips
                                     for port in (srv_ports if plan["srv"] else {plan["port"]})}
        # The backends come up (health checks pass), and the relay turns ready.
        deadline, state = time.monotonic() + 15, {}
        while time.monotonic() < deadline:
            state = {}
            for plan in plans:
                if admin_at:
                    status, body = http_get(admin_at, f"/api/v1/clusters/{plan['cluster']}")
                    j = json.loads(body) if status == 200 else {}
                    state[plan["cluster"]] = {b["address"]: b["health"] for b in j.get("backends", [])}
            ready = metrics and http_get(metrics, "/readyz")[0] == 200
            if ready and all(set(state.get(c, {})) == want[c] and set(state[c].values()) == {"up"} for c in state):
                break
            time.sleep(0.2)
        for plan in plans:
            if admin_at:
                check(set(state.get(plan["cluster"], {})) == want[plan["cluster"]],
                      f"{name}: cluster {plan['cluster']} ({plan['name']}): the runtime API lists "
                      f"{state.get(plan['cluster'])}, want {sorted(want[plan['cluster']])}")
        if metrics:
            check(http_get(metrics, "/readyz")[0] == 200, f"{name}: /readyz is not 200 with the backends up:\n{log}")

        # A client of each listener reaches one of its cluster's pods.
        clusters = {l["name"]: l.get("cluster") for l in r["config"]["listeners"]}
        for lname, address in bound.items():
            expect = want.get(clusters.get(lname))
            if not expect:
                continue
            for _ in range(4):
                with socket.create_connection(host_port(address), timeout=5) as c:
                    c.settimeout(5)
                    got = c.recv(256).decode().strip()
                check(got in expect, f"{name}: listener {lname}: a client got {got!r}, want one of {sorted(expect)}")

        # The first question is the Service's own name: the search domains as the comments say,
        # no query wasted on a name that does not exist.
        asked = re.findall(r"query\[(?:A|AAAA|SRV)\] (\S+) from", open(dns_log).read())
        for plan in plans:
            svc_lookup = plan["fqdn"]
            if plan["srv"]:
                svc_lookup = ".".join(plan["name"].rstrip(".").split(".")[:2]) + "." + plan["fqdn"]
            mine = [a for a in asked if a in lookups(plan["name"], live_ns, plan["zone"])]
            check(mine[:1] == [svc_lookup], f"{name}: cluster {plan['cluster']}: {plan['name']} from namespace "
                  f"{live_ns} asked {mine[:4]} first, want {svc_lookup}: a name with fewer dots than ndots "
                  f"({NDOTS}) tries the search domains first; end a full name with a dot")
            print(f"{name}: cluster {plan['cluster']}: {plan['name']} -> {svc_lookup} -> {sorted(want[plan['cluster']])}")
    finally:
        if relay is not None:
            if relay.poll() is None:
                relay.send_signal(signal.SIGTERM)
            try:
                relay.wait(timeout=20)
            except subprocess.TimeoutExpired:
                relay.kill()
                relay.wait()
            check(relay.returncode == 0, f"{name}: the relay exited {relay.returncode} after SIGTERM")
        if dns is not None:
            dns.terminate()
            try:
                dns.wait(timeout=10)
            except subprocess.TimeoutExpired:
                dns.kill()
                dns.wait()
        pods.close()


def main():
    binary, src = sys.argv[1], sys.argv[2]
    kdir = os.path.join(src, "deploy", "kubernetes")
    docs, files = [], sorted(glob.glob(os.path.join(kdir, "*.yaml")))
    check(files, f"no manifests in {kdir}")
    file_of = {}  # id(document) -> its file's name
    kustomized = set()  # the files kubectl apply -k takes
    for f in files:
        for d in yaml.safe_load_all(open(f, encoding="utf-8")):
            if d is None:
                continue
            if d.get("kind") == "Kustomization":
                for r in d.get("resources", []):
                    check(os.path.exists(os.path.join(kdir, r)), f"{os.path.basename(f)}: resource {r} does not exist")
                    kustomized.add(os.path.normpath(r))
                continue
            ok = check(all(k in d for k in ("apiVersion", "kind", "metadata")) and "name" in d["metadata"],
                       f"{os.path.basename(f)}: a document without apiVersion, kind or metadata.name")
            if ok:
                docs.append(d)
                file_of[id(d)] = os.path.basename(f)
    by_kind = lambda k: [d for d in docs if d["kind"] == k]
    configmaps = {d["metadata"]["name"]: d for d in by_kind("ConfigMap")}

    image_uid = None
    m = re.search(r"^USER (\d+)", open(os.path.join(src, "deploy", "Dockerfile")).read(), re.M)
    if m:
        image_uid = int(m.group(1))

    # Relays: the workloads with a container named zcrelay. The others are their backends (web.yaml).
    checked, backends = [], []
    for w in [d for d in docs if d["kind"] in WORKLOAD_KINDS]:
        pod = w["spec"]["template"]["spec"]
        if not any(c["name"] == "zcrelay" for c in pod["containers"]):
            labels = w["spec"]["template"]["metadata"].get("labels", {})
            selector = w["spec"]["selector"]["matchLabels"]
            check(selector.items() <= labels.items(), f"{w['metadata']['name']}: selector {selector} does not match its pods {labels}")
            backends.append({"workload": w, "labels": labels, "pod": pod})
            continue
        r = check_workload(w, configmaps, binary, image_uid)
        if r:
            checked.append(r)
    check(any(r["workload"]["kind"] == "Deployment" for r in checked), "no Deployment")
    check(any(r["workload"]["kind"] == "DaemonSet" for r in checked), "no DaemonSet")

    # Services: each selects a workload. A relay's Service targets its listener or metrics ports;
    # a backend's targets its containerPorts. Every Deployment's listener ports are targeted by
    # some Service.
    services = by_kind("Service")
    targeted = {}  # (workload name, port) -> [(service, port name)]
    for s in services:
        sel = s["spec"].get("selector", {})
        selected = [r for r in checked if sel and sel.items() <= r["labels"].items()]
        served = [b for b in backends if sel and sel.items() <= b["labels"].items()]
        if not check(selected or served, f"Service {s['metadata']['name']} selects no workload"):
            continue
        check(not (selected and served), f"Service {s['metadata']['name']} selects relays and backends at once")
        for b in served:
            for p in s["spec"]["ports"]:
                check(any(resolve_port(p.get("targetPort", p["port"]), c) for c in b["pod"]["containers"]),
                      f"Service {s['metadata']['name']} port {p.get('name')}: targetPort {p.get('targetPort')} is no "
                      f"containerPort of {b['workload']['metadata']['name']}")
        for r in selected:
            wanted = set(listener_ports(r["config"])) | {r["metrics_port"]}
            for p in s["spec"]["ports"]:
                target = resolve_port(p.get("targetPort", p["port"]), r["container"])
                check(target in wanted, f"Service {s['metadata']['name']} port {p.get('name')}: targetPort "
                      f"{p.get('targetPort')} is {target}, not a listener or metrics port of {r['workload']['metadata']['name']}")
                targeted.setdefault((r["workload"]["metadata"]["name"], target), []).append((s, p.get("name")))
    for r in checked:
        if r["workload"]["kind"] != "Deployment":
            continue
        wname = r["workload"]["metadata"]["name"]
        for port in listener_ports(r["config"]):
            check((wname, port) in targeted, f"{wname}: listener port {port} is targeted by no Service")

    # ServiceMonitor: a metrics Service, scraping the metrics port at /metrics.
    monitors = by_kind("ServiceMonitor")
    check(monitors, "no ServiceMonitor")
    for sm in monitors:
        name = sm["metadata"]["name"]
        check(sm["apiVersion"] == "monitoring.coreos.com/v1", f"ServiceMonitor {name}: apiVersion {sm['apiVersion']}")
        sel = sm["spec"]["selector"].get("matchLabels", {})
        matched = [s for s in services if sel.items() <= s["metadata"].get("labels", {}).items()]
        check(matched, f"ServiceMonitor {name} selects no Service")
        for ep in sm["spec"]["endpoints"]:
            check(ep.get("path", "/metrics") == "/metrics", f"ServiceMonitor {name}: path {ep.get('path')}")
            hits = [(key, s) for key, lst in targeted.items() for s, pname in lst
                    if s in matched and pname == ep.get("port")]
            check(hits, f"ServiceMonitor {name}: no selected Service has a port named {ep.get('port')}")
            for (wname, port), s in hits:
                r = next(r for r in checked if r["workload"]["metadata"]["name"] == wname)
                check(port == r["metrics_port"], f"ServiceMonitor {name}: port {ep.get('port')} of Service "
                      f"{s['metadata']['name']} is {port}, {wname}'s metrics are on {r['metrics_port']}")

    # Discovery and the runtime API, then each relay that discovers runs against a stand-in DNS.
    discovered = {}
    for r in checked:
        check_admin(r, services)
        found = check_discovery(r, services, backends, checked, file_of, kustomized)
        if found:
            discovered[r["workload"]["metadata"]["name"]] = (r, found)
    check(any(r["workload"]["kind"] == "Deployment" and any(c.get("discovery") for c in r["config"].get("clusters") or [])
              for r in checked), "no Deployment's config has a cluster with discovery (configmap.yaml's web cluster)")
    for r, found in discovered.values():
        with tempfile.TemporaryDirectory(prefix="zcrelay-k8s-") as tmp:
            live_discovery(binary, r, found, tmp)
    finish(f"Kubernetes manifests ({len(docs)} objects)")


if __name__ == "__main__":
    main()
