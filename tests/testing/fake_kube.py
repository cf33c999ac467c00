#!/usr/bin/env python3
"""A stand-in for the API server and the kubelet, over real HTTPS on loopback (test double).

Serves:  POST  /api/v1/namespaces/<ns>/events          (201; an existing name: 409)
         PATCH /api/v1/namespaces/<ns>/events/<name>   (200; unknown name: 404)
         GET   /pods                                   (the PodList in --pods-file)
         GET   /api/v1/namespaces/<ns>/persistentvolumeclaims/<name>
                                                       (bound to the volume --pvcs-file names for
                                                        "<ns>/<name>"; else 404)
         GET   <path>, PATCH <path>                    (any object --objects-file maps <path> to;
                                                        a PATCH answers the object unchanged)
         POST   /api/v1/namespaces/<ns>/pods           (201 with a uid and phase Pending; an
                                                        existing name: 409 AlreadyExists)
         GET    /api/v1/namespaces/<ns>/pods[?labelSelector=a=b,c=d]   (a PodList)
         GET    /api/v1/namespaces/<ns>/pods/<name>    (404 if absent)
         DELETE /api/v1/namespaces/<ns>/pods/<name>    (removes it at once; 404 if absent)
                ...?graceful=true                      (test-only: keeps it with a deletionTimestamp,
                                                        as the API server does until the kubelet has
                                                        stopped it; a plain DELETE then removes it)
         PATCH  /api/v1/namespaces/<ns>/pods/<name>/status  (merges "status": a test evicts a pod)
         The pods are also written to --pod-store-file after each change (a JSON object by
         "<ns>/<name>"), for tests to read.
Every request is appended to --log as one JSON line {"verb","path","auth","body"}; stderr says
"req VERB path" as it arrives and "done VERB:path" once it has been handled and answered (a
form that what tests look for in "req" lines does not match).
--mode-file, re-read per request, makes it misbehave: "ok", "500", "401", "403", "garbage", "slow".
The chosen port is written to --port-file once listening.
"""
import argparse, json, os, ssl, sys, threading, uuid, urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--cert", required=True)
p.add_argument("--key", required=True)
p.add_argument("--log", required=True)
p.add_argument("--port-file", required=True)
p.add_argument("--pods-file", default="")
p.add_argument("--mode-file", default="")
p.add_argument("--pvcs-file", default="")
p.add_argument("--objects-file", default="")
p.add_argument("--pod-store-file", default="")
args = p.parse_args()
lock = threading.Lock()
events = {}
pods = {}  # "<ns>/<name>" -> pod


def save_pods():
    if not args.pod_store_file:
        return
    tmp = args.pod_store_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(pods, f)
    os.rename(tmp, args.pod_store_file)


def selected(pod, selector):
    labels = pod.get("metadata", {}).get("labels", {})
    for term in filter(None, selector.split(",")):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    return True


def mode():
    try:
        with open(args.mode_file) as f:
            return f.read().strip() or "ok"
    except OSError:
        return "ok"


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, code, body):
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def handle_any(self, verb):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n).decode() if n else ""
        with lock:
            with open(args.log, "a") as f:
                f.write(json.dumps({"verb": verb, "path": self.path, "auth": self.headers.get("Authorization", ""),
                                    "body": body}) + "\n")
            print("req", verb, self.path, flush=True, file=sys.stderr)
        m = mode()
        if m == "slow":
            # A kubelet/API server that takes 30 s to answer: this handler thread is parked (the
            # delay is the behaviour under test, not a synchronisation).
            threading.Event().wait(30)
        if m in ("500", "401", "403"):
            return self.reply(int(m), '{"kind":"Status","code":%s}' % m)
        if m == "garbage":
            return self.reply(200, b"\x00{not json")
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) >= 5 and parts[:2] == ["api", "v1"] and parts[2] == "namespaces" and parts[4] == "pods":
            return self.pods(verb, parts, body)
        if verb in ("GET", "PATCH") and args.objects_file:
            try:
                with open(args.objects_file) as f:
                    objects = json.load(f)
            except (OSError, ValueError):
                objects = {}
            obj = objects.get(self.path.split("?")[0])
            if obj is not None:
                return self.reply(200, json.dumps(obj))
        if verb == "GET" and parts == ["pods"]:
            with open(args.pods_file) as f:
                return self.reply(200, f.read())
        if verb == "GET" and len(parts) == 6 and parts[:2] == ["api", "v1"] and parts[4] == "persistentvolumeclaims":
            try:
                with open(args.pvcs_file) as f:
                    bound = json.load(f)
            except (OSError, ValueError):
                bound = {}
            key = parts[3] + "/" + parts[5]
            if key in bound:
                return self.reply(200, json.dumps({"kind": "PersistentVolumeClaim",
                                                   "metadata": {"namespace": parts[3], "name": parts[5]},
                                                   "spec": {"volumeName": bound[key]}}))
            return self.reply(404, '{"kind":"Status","code":404}')
        if len(parts) >= 5 and parts[:2] == ["api", "v1"] and parts[4] == "events":
            if verb == "POST" and len(parts) == 5:
                ev = json.loads(body)
                name = ev["metadata"]["name"]
                with lock:
                    if name in events:
                        return self.reply(409, '{"kind":"Status","code":409}')
                    events[name] = ev
                return self.reply(201, body)
            if verb == "PATCH" and len(parts) == 6:
                with lock:
                    if parts[5] not in events:
                        return self.reply(404, '{"kind":"Status","code":404}')
                    events[parts[5]].update(json.loads(body))
                    return self.reply(200, json.dumps(events[parts[5]]))
        self.reply(404, '{"kind":"Status","code":404}')

    def pods(self, verb, parts, body):
        ns = parts[3]
        with lock:
            if verb == "POST" and len(parts) == 5:
                pod = json.loads(body)
                key = ns + "/" + pod["metadata"]["name"]
                if key in pods:
                    return self.reply(409, json.dumps({"kind": "Status", "code": 409, "reason": "AlreadyExists",
                                                       "message": "pods \"%s\" already exists" % pod["metadata"]["name"]}))
                pod["metadata"]["namespace"] = ns
                pod["metadata"]["uid"] = str(uuid.uuid4())
                pod["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
                pod["status"] = {"phase": "Pending"}
                pods[key] = pod
                save_pods()
                return self.reply(201, json.dumps(pod))
            if verb == "GET" and len(parts) == 5:
                query = urllib.parse.parse_qs(self.path.partition("?")[2])
                selector = query.get("labelSelector", [""])[0]
                items = [p for k, p in sorted(pods.items()) if k.startswith(ns + "/") and selected(p, selector)]
                return self.reply(200, json.dumps({"kind": "PodList", "apiVersion": "v1", "items": items}))
            key = ns + "/" + parts[5] if len(parts) >= 6 else ""
            if verb == "GET" and len(parts) == 6:
                if key not in pods:
                    return self.reply(404, '{"kind":"Status","code":404,"reason":"NotFound"}')
                return self.reply(200, json.dumps(pods[key]))
            if verb == "DELETE" and len(parts) == 6:
                if key not in pods:
                    return self.reply(404, '{"kind":"Status","code":404,"reason":"NotFound"}')
                query = urllib.parse.parse_qs(self.path.partition("?")[2])
                if query.get("graceful", [""])[0] == "true":
                    pods[key]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:30Z"
                    save_pods()
                    return self.reply(200, json.dumps(pods[key]))
                pod = pods.pop(key)
                save_pods()
                return self.reply(200, json.dumps(pod))
            if verb == "PATCH" and len(parts) == 7 and parts[6] == "status":
                if key not in pods:
                    return self.reply(404, '{"kind":"Status","code":404,"reason":"NotFound"}')
                pods[key].setdefault("status", {}).update(json.loads(body).get("status", {}))
                save_pods()
                return self.reply(200, json.dumps(pods[key]))
        self.reply(405, '{"kind":"Status","code":405}')

    def do_DELETE(self):
        self.handle_any("DELETE")
        print("done", "DELETE:" + self.path, flush=True, file=sys.stderr)

    def do_GET(self):
        self.handle_any("GET")
        print("done", "GET:" + self.path, flush=True, file=sys.stderr)

    def do_POST(self):
        self.handle_any("POST")
        print("done", "POST:" + self.path, flush=True, file=sys.stderr)

    def do_PATCH(self):
        self.handle_any("PATCH")
        print("done", "PATCH:" + self.path, flush=True, file=sys.stderr)


srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(args.cert, args.key)
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
tmp = args.port_file + ".tmp"
with open(tmp, "w") as f:
    f.write(str(srv.server_address[1]))
os.rename(tmp, args.port_file)
print("listening", srv.server_address[1], flush=True, file=sys.stderr)
srv.serve_forever()
