"""A small Kubernetes API server over real HTTP, for the run driver's tests: the official client talks to it.

It serves the few endpoints the driver calls, as the API server answers them (JSON bodies, Status objects
for errors, 404/409 codes):

    GET    /apis/batch/v1/namespaces/{ns}/cronjobs?labelSelector=a=b,c=d     list
    GET    /apis/batch/v1/namespaces/{ns}/jobs/{name}                       get
    POST   /apis/batch/v1/namespaces/{ns}/jobs                              create (409 when it exists)
    DELETE /apis/batch/v1/namespaces/{ns}/jobs/{name}                       delete
    PUT    /apis/batch/v1/namespaces/{ns}/jobs/{name}/status                replace the status
    GET    /api/v1/namespaces/{ns}/pods?labelSelector=...                   list
    GET    /api/v1/namespaces/{ns}/pods/{name}/log?tailLines=N              a pod's log (plain text, `logs`)
    GET    /apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets?labelSelector=...   list
    GET    /api/v1/namespaces/{ns}/configmaps/{name}                        get (and the other core kinds)
    GET    /api/v1/nodes, /api/v1/namespaces/{name}                         cluster-scoped list and get
    POST   /apis/authorization.k8s.io/v1/selfsubjectaccessreviews           answered from the Role
    DELETE .../{plural}/{name}?propagationPolicy=Background                 delete, with garbage collection

Every request is authorized against the rules of a Role (the driver's rendered Role): a verb the Role does
not grant answers 403 as RBAC would (a rule with resourceNames grants only those names, and no list), so the
tests also show the Role is enough. No controller runs but the garbage collector: deleting an object deletes
the objects whose ownerReferences name its uid (unless the policy is Orphan, the API's default for a batch/v1
Job), and an object created with an owner that does not exist is collected at once. A test moves Jobs along
itself (`set_status`) and adds the pods a failed Job would have left (`add`).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client

# The API classes the run driver's Cluster builds, loaded with this helper: the official client loads each on first
# use (a second or more here), which would otherwise count against whichever test first talks to the fake API.
from kubernetes.client import BatchV1Api, CoreV1Api, CustomObjectsApi, RbacAuthorizationV1Api  # noqa: F401

_PATH = re.compile(r"^/(?P<prefix>api/v1|apis/batch/v1|apis/jobset\.x-k8s\.io/v1alpha2|apis/kueue\.x-k8s\.io/v1beta1"
                   r"|apis/rbac\.authorization\.k8s\.io/v1)/namespaces/(?P<ns>[^/]+)/"
                   r"(?P<plural>[a-z]+)"
                   r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>status|log))?$")
# Cluster-scoped: nodes and namespaces (read by `doctor`), and the access reviews it asks.
_CLUSTER_PATH = re.compile(r"^/(?P<prefix>api/v1|apis/authorization\.k8s\.io/v1)/"
                           r"(?P<plural>nodes|namespaces|selfsubjectaccessreviews)(?:/(?P<name>[^/]+))?$")
_GROUP = {"api/v1": "", "apis/batch/v1": "batch", "apis/jobset.x-k8s.io/v1alpha2": "jobset.x-k8s.io",
          "apis/authorization.k8s.io/v1": "authorization.k8s.io",
          "apis/kueue.x-k8s.io/v1beta1": "kueue.x-k8s.io",
          "apis/rbac.authorization.k8s.io/v1": "rbac.authorization.k8s.io"}
_KIND = {"cronjobs": "CronJob", "jobs": "Job", "pods": "Pod", "jobsets": "JobSet", "configmaps": "ConfigMap",
         "services": "Service", "serviceaccounts": "ServiceAccount", "roles": "Role",
         "rolebindings": "RoleBinding", "workloads": "Workload", "namespaces": "Namespace", "secrets": "Secret",
         "nodes": "Node", "localqueues": "LocalQueue"}
_PLURAL = {kind: plural for plural, kind in _KIND.items()}
Key = tuple[str, str, str]  # (plural, namespace, name)


class AdmissionDenied(Exception):  # noqa: N818 - named as the API server says it
    """Raised by an `on_create` hook: the request is denied as a validating admission webhook denies it."""


def _matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors (`a=b,c=d`), the only kind the driver sends."""
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKubeApi:
    """The objects of one small cluster and the HTTP server that serves them."""

    def __init__(self, role: dict[str, Any] | None = None) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.role = role
        self.requests: list[tuple[str, str]] = []  # (verb, plural) of every request served
        self.deleted: list[tuple[Key, str]] = []  # every object deleted, with the propagation policy
        self.logs: dict[tuple[str, str], str] = {}  # (namespace, pod) -> its container's log, as a test sets it
        self.on_create: Callable[[dict[str, Any]], None] | None = None
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        # A short poll: stop() waits for the serving loop to notice, which at the default 0.5 s is most of a test.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def api_client(self) -> Any:
        """An ApiClient of the official client configured for this server, as a kubeconfig would."""
        config = client.Configuration(host=self.url)
        return client.ApiClient(config)

    def kubeconfig(self) -> str:
        """A kubeconfig naming this server, for a process that loads its configuration itself."""
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        })

    # What kubectl would do, and what the Job controller would report: no authorization, no HTTP.

    def add(self, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        plural = _PLURAL[obj["kind"]]
        self._stamp(obj)
        namespace = obj["metadata"].get("namespace", "")
        with self._lock:
            self.objects[(plural, namespace, obj["metadata"]["name"])] = obj
            uids = {o["metadata"]["uid"] for (_, ns, _), o in self.objects.items() if ns == namespace}
            owners = obj["metadata"].get("ownerReferences") or []
            if owners and not any(ref["uid"] in uids for ref in owners):
                # The garbage collector deletes an object none of whose owners exists.
                self._collect((plural, namespace, obj["metadata"]["name"]), "Background")

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            found = self.objects.get((plural, namespace, name))
            return copy.deepcopy(found) if found else None

    def names(self, plural: str) -> list[str]:
        with self._lock:
            return sorted(name for (p, _, name) in self.objects if p == plural)

    def set_status(self, namespace: str, name: str, status: dict[str, Any], plural: str = "jobs") -> None:
        with self._lock:
            self.objects[(plural, namespace, name)]["status"] = status

    def delete(self, plural: str, namespace: str, name: str, policy: str | None = None) -> None:
        """Delete as the API server does; `policy` None is the API's default (Orphan for a batch/v1 Job)."""
        with self._lock:
            self._collect((plural, namespace, name), policy or ("Orphan" if plural == "jobs" else "Background"))

    def _collect(self, key: Key, policy: str) -> None:
        gone = self.objects.pop(key)
        self.deleted.append((key, policy))
        if policy == "Orphan":
            return
        uid = gone["metadata"]["uid"]
        for other, obj in list(self.objects.items()):
            if other in self.objects and other[1] == key[1] and any(
                    ref["uid"] == uid for ref in obj["metadata"].get("ownerReferences") or []):
                self._collect(other, "Background")

    @staticmethod
    def _stamp(obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta.setdefault("resourceVersion", "1")
        obj.setdefault("status", {})

    def _allowed(self, verb: str, group: str, plural: str, name: str = "") -> bool:
        if self.role is None:
            return True
        return any(group in rule["apiGroups"] and plural in rule["resources"] and verb in rule["verbs"]
                   and ("resourceNames" not in rule or (name and name in rule["resourceNames"]))
                   for rule in self.role["rules"])

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._send(code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                  "message": message, "reason": reason, "code": code})

            def _body(self) -> dict[str, Any]:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"{}")

            @contextmanager
            def _route(self, method: str) -> Iterator[tuple[dict[str, str], dict[str, list[str]]] | None]:
                url = urlsplit(self.path)
                match = _PATH.match(url.path) or _CLUSTER_PATH.match(url.path)
                if match is None:
                    self._status(404, "NotFound", f"no route for {url.path}")
                    yield None
                    return
                parts = {"ns": "", "sub": "", **{k: v or "" for k, v in match.groupdict().items()}}
                query = parse_qs(url.query)
                verb = {"GET": "get" if parts["name"] else "list", "POST": "create", "DELETE": "delete",
                        "PUT": "update"}[method]
                if "watch" in query:
                    verb = "watch"
                resource = parts["plural"] + (f'/{parts["sub"]}' if parts["sub"] else "")
                api.requests.append((verb, resource))
                # Every authenticated user may ask what it may do (the API server's default ClusterRole).
                reviewing = parts["plural"] == "selfsubjectaccessreviews"
                if not reviewing and not api._allowed(verb, _GROUP[parts["prefix"]], resource, parts["name"]):
                    self._status(403, "Forbidden",
                                 f'{parts["plural"]} is forbidden: User "system:serviceaccount:{parts["ns"]}:driver" '
                                 f'cannot {verb} resource "{resource}" in API group "{_GROUP[parts["prefix"]]}" '
                                 f'in the namespace "{parts["ns"]}"')
                    yield None
                    return
                yield parts, query

            def do_GET(self) -> None:  # noqa: N802 - http.server's names
                with self._route("GET") as routed:
                    if routed is None:
                        return
                    parts, query = routed
                    if parts["sub"] == "log":
                        self._log(parts, query)
                        return
                    if parts["name"]:
                        found = api.get(parts["plural"], parts["ns"], parts["name"])
                        if found is None:
                            self._status(404, "NotFound", f'{parts["plural"]} "{parts["name"]}" not found')
                        else:
                            self._send(200, found)
                        return
                    selector = query.get("labelSelector", [""])[0]
                    with api._lock:
                        items = [copy.deepcopy(o) for (p, ns, _), o in sorted(api.objects.items())
                                 if p == parts["plural"] and ns == parts["ns"]
                                 and _matches(o["metadata"].get("labels") or {}, selector)]
                    version = parts["prefix"].removeprefix("apis/").removeprefix("api/")
                    self._send(200, {"kind": _KIND[parts["plural"]] + "List", "apiVersion": version,
                                     "metadata": {"resourceVersion": "1"}, "items": items})

            def _log(self, parts: dict[str, str], query: dict[str, list[str]]) -> None:
                """A pod's log as the kubelet serves it through the API server: plain text, `tailLines` honoured."""
                if api.get("pods", parts["ns"], parts["name"]) is None:
                    self._status(404, "NotFound", f'pods "{parts["name"]}" not found')
                    return
                text = api.logs.get((parts["ns"], parts["name"]))
                if text is None:
                    self._status(400, "BadRequest", f'container in pod "{parts["name"]}" is waiting to start')
                    return
                if "tailLines" in query:
                    text = "".join(text.splitlines(keepends=True)[-int(query["tailLines"][0]):])
                data = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802
                with self._route("POST") as routed:
                    if routed is None:
                        return
                    parts, _ = routed
                    body = self._body()
                    if parts["plural"] == "selfsubjectaccessreviews":
                        self._review(body)
                        return
                    body["metadata"].setdefault("namespace", parts["ns"])
                    key = (parts["plural"], parts["ns"], body["metadata"]["name"])
                    with api._lock:
                        exists = key in api.objects
                    if exists:
                        self._status(409, "AlreadyExists", f'{parts["plural"]} "{key[2]}" already exists')
                        return
                    if api.on_create is not None:
                        try:
                            api.on_create(body)
                        except AdmissionDenied as denied:
                            self._status(403, "Forbidden", f'admission webhook "validate.example.io" denied the '
                                                           f"request: {denied}")
                            return
                    api.add(body)
                    self._send(201, api.get(*key) or {})

            def _review(self, body: dict[str, Any]) -> None:
                """A SelfSubjectAccessReview, answered from the Role the requests are authorized against."""
                attrs = body["spec"]["resourceAttributes"]
                resource = attrs["resource"] + (f'/{attrs["subresource"]}' if attrs.get("subresource") else "")
                allowed = api._allowed(attrs["verb"], attrs.get("group", ""), resource)
                self._send(201, {**body, "status": {"allowed": allowed}})

            def do_DELETE(self) -> None:  # noqa: N802
                with self._route("DELETE") as routed:
                    if routed is None:
                        return
                    parts, _ = routed
                    if api.get(parts["plural"], parts["ns"], parts["name"]) is None:
                        self._status(404, "NotFound", f'{parts["plural"]} "{parts["name"]}" not found')
                        return
                    policy = (parse_qs(urlsplit(self.path).query).get("propagationPolicy", [None])[0]
                              or self._body().get("propagationPolicy"))
                    api.delete(parts["plural"], parts["ns"], parts["name"], policy)
                    self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

            def do_PUT(self) -> None:  # noqa: N802
                with self._route("PUT") as routed:
                    if routed is None:
                        return
                    parts, _ = routed
                    if not parts["sub"] or api.get("jobs", parts["ns"], parts["name"]) is None:
                        self._status(404, "NotFound", f'{parts["plural"]} "{parts["name"]}" not found')
                        return
                    api.set_status(parts["ns"], parts["name"], self._body().get("status") or {})
                    self._send(200, api.get("jobs", parts["ns"], parts["name"]) or {})

        return Handler
