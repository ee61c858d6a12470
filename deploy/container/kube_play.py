"""A Kubernetes manifest of deploy/kubernetes as podman kube play (4.3) takes it, to stdout:
`make check-container` plays it. What changes, and only that:

- every image -> IMAGE (the one just built); a container not running payloadd (the
  inference side) sleeps instead, with its GPU limit dropped: the check's client runs in it
  with ``podman exec``;
- a native sidecar (an init container with ``restartPolicy: Always``, Kubernetes 1.29+)
  becomes a regular container of the pod, as on older clusters: podman refuses probes on
  init containers and would wait for it to exit;
- ``fieldRef: spec.nodeName`` -> this host's name (podman has no node);
- the pod's ``fsGroup`` -> also its ``supplementalGroups``: podman gives no supplementary
  group for it, and the clients reach the 0660 sockets through it;
- container ports dropped: they only declare, and ``--network none`` refuses them;
- init containers kept after they ran (podman's "always" type: removing them races);
- a Secret's ``stringData`` -> ``data`` (podman 4.3 mounts an empty file for the former);
- a DaemonSet -> its pod (podman plays no DaemonSet), with ``--host DIR``: its hostPath
  folders moved under DIR (the check does not touch the host's /run/payloadd).

    python3 deploy/container/kube_play.py deploy/kubernetes/sidecar.yaml IMAGE [--host DIR]
"""

from __future__ import annotations

import base64
import socket
import sys
from typing import Any

import yaml


def for_podman(doc: dict[str, Any], image: str) -> dict[str, Any]:
    """``doc`` (one manifest document) changed as the module says; others unchanged."""
    if doc.get("kind") == "Secret" and "stringData" in doc:  # podman reads data only
        plain = doc.pop("stringData")
        data = {k: base64.b64encode(v.encode()).decode() for k, v in plain.items()}
        doc["data"] = {**doc.get("data", {}), **data}
        return doc
    if doc.get("kind") == "DaemonSet":  # podman plays no DaemonSet: its pod, once
        template = doc["spec"]["template"]
        meta = {"name": doc["metadata"]["name"], "labels": template["metadata"]["labels"]}
        doc = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}
    if doc.get("kind") not in ("Deployment", "Pod"):
        return doc
    spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    inits = spec.get("initContainers", [])
    sidecars = [c for c in inits if c.get("restartPolicy") == "Always"]
    rest = [c for c in inits if c.get("restartPolicy") != "Always"]
    for c in rest:
        c["image"] = image
    if rest:
        spec["initContainers"] = rest
        meta = doc["metadata"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]
        # podman 4.3 removes a "once" init container after it ran, and races its exit:
        # "cannot remove container ... as it is running"; "always" keeps it
        meta.setdefault("annotations", {})["io.podman.annotations.init.container.type"] = "always"
    else:
        spec.pop("initContainers", None)
    for c in sidecars:
        del c["restartPolicy"]
    spec["containers"] = sidecars + spec["containers"]
    group = spec.get("securityContext", {}).get("fsGroup")
    if group is not None:
        spec["securityContext"].setdefault("supplementalGroups", [group])
    for c in spec["containers"]:
        c["image"] = image
        c.pop("ports", None)  # declarative only; podman's --network none refuses them
        if "payloadd" not in (c.get("command") or ["payloadd"])[0]:
            c["command"] = ["sleep", "3600"]
            c.pop("args", None)
            c.get("resources", {}).get("limits", {}).pop("nvidia.com/gpu", None)
        for e in c.get("env", []):
            if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                del e["valueFrom"]
                e["value"] = socket.gethostname()
    return doc


def _moved(doc: dict[str, Any], host: str) -> dict[str, Any]:
    """``doc``'s hostPath folders under ``host``."""
    spec = doc.get("spec", {})
    for v in spec.get("volumes", []) if doc.get("kind") == "Pod" else []:
        if "hostPath" in v:
            v["hostPath"]["path"] = host + v["hostPath"]["path"]
    return doc


def main() -> int:
    path, image = sys.argv[1], sys.argv[2]
    host = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--host" else None
    with open(path) as f:
        docs = [for_podman(d, image) for d in yaml.safe_load_all(f) if d]
    if host is not None:
        docs = [_moved(d, host) for d in docs]
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
