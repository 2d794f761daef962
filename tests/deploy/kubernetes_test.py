#!/usr/bin/env python3
"""deploy/kubernetes: every manifest parses, and each workload agrees with the zcrelay.yaml its
ConfigMap ships: that config passes --check-config, it is mounted where the command's -c reads it,
its listener ports are containerPorts that a Service targets, and its metrics port is the probes',
the scrape annotation's and the ServiceMonitor's port. Also the shutdown arithmetic
(terminationGracePeriodSeconds > preStop sleep + drain_timeout) and the security context.

Usage: kubernetes_test.py ZCRELAY_BINARY SOURCE_DIR
"""
import glob
import os
import re
import sys

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
    return {"workload": w, "labels": labels, "container": c, "config": config, "metrics_port": mport}


def main():
    binary, src = sys.argv[1], sys.argv[2]
    kdir = os.path.join(src, "deploy", "kubernetes")
    docs, files = [], sorted(glob.glob(os.path.join(kdir, "*.yaml")))
    check(files, f"no manifests in {kdir}")
    for f in files:
        for d in yaml.safe_load_all(open(f, encoding="utf-8")):
            if d is None:
                continue
            if d.get("kind") == "Kustomization":
                for r in d.get("resources", []):
                    check(os.path.exists(os.path.join(kdir, r)), f"{os.path.basename(f)}: resource {r} does not exist")
                continue
            ok = check(all(k in d for k in ("apiVersion", "kind", "metadata")) and "name" in d["metadata"],
                       f"{os.path.basename(f)}: a document without apiVersion, kind or metadata.name")
            if ok:
                docs.append(d)
    by_kind = lambda k: [d for d in docs if d["kind"] == k]
    configmaps = {d["metadata"]["name"]: d for d in by_kind("ConfigMap")}

    image_uid = None
    m = re.search(r"^USER (\d+)", open(os.path.join(src, "deploy", "Dockerfile")).read(), re.M)
    if m:
        image_uid = int(m.group(1))

    checked = []
    for w in [d for d in docs if d["kind"] in WORKLOAD_KINDS]:
        r = check_workload(w, configmaps, binary, image_uid)
        if r:
            checked.append(r)
    check(any(r["workload"]["kind"] == "Deployment" for r in checked), "no Deployment")
    check(any(r["workload"]["kind"] == "DaemonSet" for r in checked), "no DaemonSet")

    # Services: each selects a workload, and its targetPorts are that workload's listener or
    # metrics ports. Every Deployment's listener ports are targeted by some Service.
    services = by_kind("Service")
    targeted = {}  # (workload name, port) -> [(service, port name)]
    for s in services:
        sel = s["spec"].get("selector", {})
        selected = [r for r in checked if sel and sel.items() <= r["labels"].items()]
        if not check(selected, f"Service {s['metadata']['name']} selects no workload"):
            continue
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
    finish(f"Kubernetes manifests ({len(docs)} objects)")


if __name__ == "__main__":
    main()
