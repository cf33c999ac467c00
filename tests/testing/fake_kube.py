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
Every request is appended to --log as one JSON line {"verb","path","auth","body"}.
--mode-file, re-read per request, makes it misbehave: "ok", "500", "401", "403", "garbage", "slow".
The chosen port is written to --port-file once listening.
"""
import argparse, json, os, ssl, sys, threading
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
args = p.parse_args()
lock = threading.Lock()
events = {}


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

    def do_GET(self):
        self.handle_any("GET")

    def do_POST(self):
        self.handle_any("POST")

    def do_PATCH(self):
        self.handle_any("PATCH")


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
