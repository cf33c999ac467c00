#!/usr/bin/python3
"""Keeps k8s/ and the code from drifting apart: every manifest parses; every image is one we build
(or a pinned kubernetes-csi sidecar); every flag given to our binaries exists in their --helpfull;
socket paths agree between the agent, node-driver-registrar and the livenessprobe; the CSIDriver
name is the agent's default; example volume attributes are keys the agent reads; the webhook's
Deployment, Service, RBAC and MutatingWebhookConfiguration agree with each other and its flags.
Prints what is wrong and exits non-zero."""
import json
import os
import re
import subprocess
import sys

import yaml

root = os.environ.get("MANIFEST_ROOT", "k8s")
agent, fkserve, webhook = sys.argv[1], sys.argv[2], sys.argv[3]
problems = []


def flags_of(binary):
    out = subprocess.run([binary, "--helpfull"], capture_output=True, text=True).stdout + \
          subprocess.run([binary, "--helpfull"], capture_output=True, text=True).stderr
    return set(re.findall(r"^\s+-(\w+) \(", out, re.M)), out


agent_flags, agent_help = flags_of(agent)
fkserve_flags, _ = flags_of(fkserve)
webhook_flags, webhook_help = flags_of(webhook)
if "webhook_config_name" not in webhook_flags:
    problems.append("could not read the webhook's flags from --helpfull")
if "driver_name" not in agent_flags or "kubelet_dir" not in agent_flags:
    problems.append("could not read the agent's flags from --helpfull")

docs = []
for dirpath, _, files in os.walk(root):
    for f in sorted(files):
        if f.endswith(".yaml"):
            path = os.path.join(dirpath, f)
            try:
                for d in yaml.safe_load_all(open(path)):
                    if d:
                        docs.append((path, d))
            except yaml.YAMLError as e:
                problems.append(f"{path}: does not parse: {e}")

kust = yaml.safe_load(open(os.path.join(root, "kustomization.yaml")))
for r in kust.get("resources", []):
    if not os.path.exists(os.path.join(root, r)):
        problems.append(f"kustomization.yaml lists {r}, which does not exist")

OUR_IMAGES = {"fusekeeper/agent": ("agent", agent_flags), "fusekeeper/fkserve": ("fkserve", fkserve_flags),
              "fusekeeper/webhook": ("webhook", webhook_flags)}
SIDECARS = ("registry.k8s.io/sig-storage/csi-node-driver-registrar:",
            "registry.k8s.io/sig-storage/livenessprobe:", "busybox:")
dockerfile = open(os.path.join(root, "images", "Dockerfile")).read()
for target in ("agent", "fkserve", "webhook"):
    if f"AS {target}" not in dockerfile:
        problems.append(f"k8s/images/Dockerfile has no '{target}' target")

default_driver = re.search(r"-driver_name \(.*?\) type: string default: \"([^\"]+)\"", agent_help, re.S)
KNOWN_ATTRIBUTES = {"kind", "path", "type", "serverUid", "serverGid", "subtype", "socketVolume",
                    "socketName", "passSecrets", "serverImage", "serverCommand", "serverArgs", "serverResources"}


pv_images = []


def containers(spec):
    return spec.get("initContainers", []) + spec.get("containers", [])


for path, d in docs:
    kind = d.get("kind")
    if kind == "CSIDriver":
        if default_driver and d["metadata"]["name"] != default_driver.group(1):
            problems.append(f"{path}: CSIDriver {d['metadata']['name']} is not the agent's default "
                            f"--driver_name {default_driver.group(1)}")
        spec = d["spec"]
        if spec.get("attachRequired") is not False or spec.get("podInfoOnMount") is not True:
            problems.append(f"{path}: CSIDriver needs attachRequired: false and podInfoOnMount: true")
    pod_spec = None
    if kind in ("DaemonSet", "Deployment"):
        pod_spec = d["spec"]["template"]["spec"]
    elif kind == "Pod":
        pod_spec = d["spec"]
    if pod_spec:
        for c in containers(pod_spec):
            image = c["image"]
            name = image.split(":")[0]
            if name in OUR_IMAGES:
                which, known = OUR_IMAGES[name]
                for arg in c.get("args", []):
                    m = re.match(r"--(\w+)", arg)
                    if m and m.group(1) not in known:
                        problems.append(f"{path}: container {c['name']} passes --{m.group(1)}, "
                                        f"which {which} does not have")
            elif not image.startswith(SIDECARS):
                problems.append(f"{path}: image {image} is neither ours nor a known sidecar")
        for v in pod_spec.get("volumes", []):
            attrs = (v.get("csi") or {}).get("volumeAttributes") or {}
            for k in attrs:
                if k not in KNOWN_ATTRIBUTES:
                    problems.append(f"{path}: volume {v['name']} sets attribute {k}, which the agent does not read")
    if kind == "PersistentVolume":
        attrs = d["spec"].get("csi", {}).get("volumeAttributes") or {}
        for k in attrs:
            if k not in KNOWN_ATTRIBUTES:
                problems.append(f"{path}: PV attribute {k} is not read by the agent")
        # A declared server pod: our image at the built version, its args fkserve's flags.
        image = attrs.get("serverImage", "")
        if image.startswith("fusekeeper/"):
            name, _, tag = image.partition(":")
            if name != "fusekeeper/fkserve":
                problems.append(f"{path}: serverImage {image} is not fusekeeper/fkserve")
            pv_images.append((path, image))
            for arg in json.loads(attrs.get("serverArgs", "[]")):
                m = re.match(r"--(\w+)", arg)
                if m and m.group(1) not in fkserve_flags:
                    problems.append(f"{path}: serverArgs passes --{m.group(1)}, which fkserve does not have")
    if kind == "DaemonSet":
        spec = d["spec"]["template"]["spec"]
        by_name = {c["name"]: c for c in spec["containers"]}
        agent_c = by_name.get("fusekeeper")
        reg = by_name.get("node-driver-registrar")
        live = by_name.get("liveness-probe")
        if not (agent_c and reg and live):
            problems.append(f"{path}: DaemonSet needs the fusekeeper, node-driver-registrar and liveness-probe containers")
            continue
        endpoint = next((a.split("=", 1)[1] for a in agent_c["args"] if a.startswith("--endpoint=")), "")
        sock = endpoint.replace("unix://", "")
        for c, flag in ((reg, "--csi-address="), (live, "--csi-address=")):
            addr = next((a.split("=", 1)[1] for a in c["args"] if a.startswith(flag)), None)
            if addr != sock:
                problems.append(f"{path}: {c['name']} {flag}{addr} is not the agent's socket {sock}")
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in agent_c["volumeMounts"]}
        sock_dir = os.path.dirname(sock)
        if sock_dir not in mounts:
            problems.append(f"{path}: the agent's socket directory {sock_dir} is not a volume mount")
        else:
            host = volumes[mounts[sock_dir]["name"]]["hostPath"]["path"]
            reg_path = next(a.split("=", 1)[1] for a in reg["args"] if a.startswith("--kubelet-registration-path="))
            if reg_path != os.path.join(host, os.path.basename(sock)):
                problems.append(f"{path}: --kubelet-registration-path {reg_path} is not where the socket "
                                f"is on the host ({host}/{os.path.basename(sock)})")
        kubelet_dir = next((a.split("=", 1)[1] for a in agent_c["args"] if a.startswith("--kubelet_dir=")), None)
        km = mounts.get(kubelet_dir)
        if not km or km.get("mountPropagation") != "Bidirectional":
            problems.append(f"{path}: --kubelet_dir {kubelet_dir} must be mounted with mountPropagation: Bidirectional")
        if "/dev/fuse" not in mounts:
            problems.append(f"{path}: /dev/fuse is not mounted into the agent")
        if not agent_c.get("securityContext", {}).get("privileged"):
            problems.append(f"{path}: the agent must be privileged")


# Images follow the build: scripts/build-images.sh tags fusekeeper/<target> with the version in
# agent/version.h; kustomization.yaml's images are the one place that sets it for k8s/; examples
# applied on their own carry the same tag; the webhook injects the fkserve of the same version.
version_h = open(os.environ.get("VERSION_H", "agent/version.h")).read()
version = re.search(r'#define FUSEKEEPER_VERSION_STRING "([^"]+)"', version_h).group(1)
build_script = open(os.environ.get("BUILD_IMAGES", "scripts/build-images.sh")).read()
built = set(re.search(r"for target in ([a-z ]+); do", build_script).group(1).split())
kust_images = {i["name"]: i for i in kust.get("images", [])}
managed = set(kust.get("resources", []))
for path, d in docs:
    spec = None
    if d.get("kind") in ("DaemonSet", "Deployment"):
        spec = d["spec"]["template"]["spec"]
    elif d.get("kind") == "Pod":
        spec = d["spec"]
    for c in containers(spec or {}):
        name, _, tag = c["image"].partition(":")
        if not name.startswith("fusekeeper/"):
            continue
        target = name.split("/", 1)[1]
        if target not in built:
            problems.append(f"{path}: image {c['image']}: scripts/build-images.sh builds no '{target}'")
        if os.path.relpath(path, root) in managed:
            if tag:
                problems.append(f"{path}: image {c['image']} carries a tag; kustomization.yaml images sets it")
            if kust_images.get(name, {}).get("newTag") != version:
                problems.append(f"kustomization.yaml images: {name} must have newTag {version} (agent/version.h)")
        elif tag != version:
            problems.append(f"{path}: image {c['image']} is not the built version {version}")
for path, image in pv_images:
    if image.partition(":")[2] != version:
        problems.append(f"{path}: serverImage {image} is not the built version {version}")
for name, i in kust_images.items():
    if i.get("newTag") != version:
        problems.append(f"kustomization.yaml images: {name} newTag {i.get('newTag')} is not the built version {version}")
default_server = re.search(r"-default_server_image \(.*?\) type: string\s+default: \"([^\"]+)\"", webhook_help, re.S)
if not default_server or default_server.group(1) != f"fusekeeper/fkserve:{version}":
    problems.append(f"the webhook's --default_server_image is not fusekeeper/fkserve:{version}")


def arg_value(container, flag):
    return next((a.split("=", 1)[1] for a in container.get("args", []) if a.startswith(f"--{flag}=")), None)


# The webhook: Deployment ↔ Service ↔ MutatingWebhookConfiguration ↔ RBAC ↔ its flags.
by_kind = {}
for path, d in docs:
    by_kind.setdefault(d.get("kind"), []).append((path, d))
deployments = [(p, d) for p, d in by_kind.get("Deployment", []) if d["metadata"]["name"] == "fusekeeper-webhook"]
if len(deployments) != 1:
    problems.append("expected one Deployment fusekeeper-webhook")
else:
    path, dep = deployments[0]
    spec = dep["spec"]["template"]["spec"]
    wh = next((c for c in spec["containers"] if c["image"].split(":")[0] == "fusekeeper/webhook"), None)
    if wh is None:
        problems.append(f"{path}: no container runs fusekeeper/webhook")
    else:
        listen = arg_value(wh, "listen") or re.search(r"-listen \(.*?\) type: string default: \"([^\"]+)\"",
                                                       webhook_help, re.S).group(1)
        port = int(listen.rsplit(":", 1)[1])
        if port not in [p["containerPort"] for p in wh.get("ports", [])]:
            problems.append(f"{path}: --listen {listen} is not a containerPort of the webhook")
        services = {d["metadata"]["name"]: d for _, d in by_kind.get("Service", [])}
        svc_name = arg_value(wh, "service_name") or "fusekeeper-webhook"
        svc = services.get(svc_name)
        if svc is None:
            problems.append(f"{path}: --service_name {svc_name} names no Service")
        else:
            if svc["spec"].get("selector", {}).items() - dep["spec"]["template"]["metadata"]["labels"].items():
                problems.append(f"Service {svc_name} does not select the webhook's pods")
            if not any(p.get("targetPort") == port for p in svc["spec"]["ports"]):
                problems.append(f"Service {svc_name} does not target the webhook's port {port}")
        configs = {d["metadata"]["name"]: d for _, d in by_kind.get("MutatingWebhookConfiguration", [])}
        cfg_name = arg_value(wh, "webhook_config_name")
        cfg = configs.get(cfg_name)
        if cfg is None:
            problems.append(f"{path}: --webhook_config_name {cfg_name} names no MutatingWebhookConfiguration")
        else:
            for w in cfg["webhooks"]:
                ref = w["clientConfig"].get("service", {})
                if ref.get("name") != svc_name or ref.get("path") != "/mutate" or ref.get("namespace") != kust.get("namespace"):
                    problems.append(f"webhook {w['name']}: clientConfig must name Service {svc_name} in "
                                    f"{kust.get('namespace')}, path /mutate")
                if svc and ref.get("port", 443) not in [p["port"] for p in svc["spec"]["ports"]]:
                    problems.append(f"webhook {w['name']}: port {ref.get('port', 443)} is not a port of Service {svc_name}")
                if w.get("admissionReviewVersions") != ["v1"] or w.get("sideEffects") != "None":
                    problems.append(f"webhook {w['name']}: needs admissionReviewVersions [v1] and sideEffects None")
        driver = arg_value(wh, "driver_name")
        if default_driver and driver and driver != default_driver.group(1):
            problems.append(f"{path}: --driver_name {driver} is not the agent's {default_driver.group(1)}")
        # RBAC: its service account may do what it does, and no more than that on webhook configs.
        sa = spec.get("serviceAccountName")
        roles = {d["metadata"]["name"]: d for _, d in by_kind.get("ClusterRole", [])}
        bound = [d["roleRef"]["name"] for _, d in by_kind.get("ClusterRoleBinding", [])
                 if any(s.get("name") == sa and s.get("namespace") == kust.get("namespace") for s in d["subjects"])]
        granted = set()
        for r in bound:
            for rule in roles.get(r, {}).get("rules", []):
                for res in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((res, verb, tuple(rule.get("resourceNames", []))))
        for res in ("persistentvolumeclaims", "persistentvolumes", "storageclasses"):
            if not any(g[0] == res and g[1] == "get" for g in granted):
                problems.append(f"the webhook's service account {sa} may not get {res}")
        for verb in ("get", "patch"):
            if (("mutatingwebhookconfigurations", verb, (cfg_name,)) not in granted):
                problems.append(f"the webhook's service account {sa} needs {verb} on mutatingwebhookconfigurations "
                                f"limited to resourceNames [{cfg_name}]")



def stops_when_asked(script):
    """Runs `sh -c script` as PID 1 of a pid namespace, as a container's command runs, and asks it
    to stop as kubelet does (SIGTERM). PID 1 ignores signals it has no handler for, so a shell
    that does not trap TERM waits out the pod's whole grace period (30 s) on every deletion.
    Returns what is wrong, or None."""
    import signal
    import time
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child=SIGKILL", "sh", "-c", script],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        child, caught = None, False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not caught:  # waits for the shell's trap, bounded
            try:
                kids = open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
                child = int(kids[0]) if kids else None
                if child:
                    status = open(f"/proc/{child}/status").read()
                    caught = bool(int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16) &
                                  (1 << (signal.SIGTERM - 1)))
            except (OSError, AttributeError):
                pass
            if not caught:
                try:  # meanwhile, an early exit ends the wait
                    p.wait(timeout=0.01)
                    return f"it exited before it was asked to stop (status {p.returncode})"
                except subprocess.TimeoutExpired:
                    pass
        if not caught:
            return "its shell, PID 1 in its container, ignores SIGTERM: deleting the pod waits out the grace period"
        os.kill(child, signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "it does not stop within 10 s of SIGTERM"
        return None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


for path, d in docs:
    if "/examples/" not in path or d.get("kind") != "Pod":
        continue
    for c in containers(d["spec"]):
        cmd = c.get("command", [])
        if len(cmd) == 3 and cmd[:2] == ["sh", "-c"]:
            why = stops_when_asked(cmd[2])
            if why:
                problems.append(f"{path}: container {c['name']}: {why}")

if problems:
    print("\n".join(problems))
    sys.exit(1)
print(f"{len(docs)} manifests checked: images, flags, socket paths and attributes agree with the code")
