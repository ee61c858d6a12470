"""The deployment files, checked without a cluster or a container engine (neither is on the
development machines): the Kubernetes manifests against the Kubernetes API schemas and the
real ``payloadd`` command line and settings, and the Dockerfile against the repository and
the same command line. This catches a flag, a variable or a path that drifted from the code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from payloadd import __version__
from payloadd.cli._health import add_health_flags
from payloadd.cli._main import _parser
from payloadd.server._sockets import StartError
from payloadd.server._tokens import load_admin_token
from payloadd.settings._settings import Settings

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
DOCKERFILE = REPO / "deploy" / "container" / "Dockerfile"
DOCKERIGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")

UID = 10001
"""The daemon's uid and gid in the image and the manifests."""
DRAIN_S = 30
"""How long the daemon finishes requests in flight after SIGTERM (docs/operations.md)."""
SCHEMA_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
"""1.29: the first release with native sidecars on by default; and the newest known."""
NODE_NAME = "gpu-node-7.cluster.example"
"""What the downward API's spec.nodeName gives in these checks."""
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "Job", "Pod"}


def manifest_files() -> list[Path]:
    return sorted(KUBERNETES.glob("*.yaml"))


def documents() -> list[tuple[str, dict[str, Any]]]:
    """Every YAML document under deploy/kubernetes, with an id: file name and index."""
    docs = []
    for path in manifest_files():
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs.append((f"{path.name}#{i}", doc))
    return docs


def workloads() -> list[tuple[str, dict[str, Any]]]:
    return [(name, doc) for name, doc in documents() if doc.get("kind") in WORKLOADS]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    return spec


def all_containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])


def daemon_container(spec: dict[str, Any]) -> dict[str, Any]:
    """The one container that runs ``payloadd serve``."""
    found = [c for c in all_containers(spec) if c.get("command", [])[:1] == ["payloadd"]]
    assert len(found) == 1, "a workload runs exactly one payloadd container"
    assert found[0]["command"] == ["payloadd", "serve"], found[0]["command"]
    return found[0]


def effective(spec: dict[str, Any], container: dict[str, Any], key: str) -> Any:
    """A security setting of a container: its own, else the pod's."""
    own = container.get("securityContext", {})
    return own[key] if key in own else spec.get("securityContext", {}).get(key)


def env_value(var: dict[str, Any]) -> str:
    """The value a container's environment variable has at run time, for these checks."""
    if "value" in var:
        return str(var["value"])
    field = var["valueFrom"].get("fieldRef", {}).get("fieldPath")
    assert field == "spec.nodeName", f"{var['name']}: only spec.nodeName is expected, got {var}"
    return NODE_NAME


def serve_settings(
    args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Settings:
    """The `Settings` that ``payloadd serve ARGS`` builds in environment ``env``: parsed by the
    real command line, validated by the real settings."""
    for name in [n for n in os.environ if n.startswith("PAYLOADD_")]:
        monkeypatch.delenv(name)
    # no config file: the image has none (/etc/payloadd/payloadd.toml, read when present,
    # may exist on the machine running the tests)
    monkeypatch.setenv("PAYLOADD_CONFIG", "")
    for name, value in env.items():
        unknown = name.startswith("PAYLOADD_") and name[9:].lower() not in Settings.model_fields
        assert not unknown, f"{name} is not a payloadd setting (it would be ignored)"
        monkeypatch.setenv(name, value)
    try:
        parsed = _parser().parse_args(["serve", *args])
    except SystemExit:
        pytest.fail(f"payloadd serve does not take {args}")
    return Settings(**{k: v for k, v in vars(parsed).items() if k != "command"})


def health_args(command: list[str]) -> Any:
    """The flags of a ``payloadd health ...`` command, parsed by the real parser."""
    assert command[:2] == ["payloadd", "health"], command
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    add_health_flags(parser)
    return parser.parse_args(command[2:])


def container_settings(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Settings:
    env = {v["name"]: env_value(v) for v in container.get("env", [])}
    return serve_settings(container.get("args", []), env, monkeypatch)


def mounts(container: dict[str, Any]) -> dict[str, str]:
    """mountPath -> volume name."""
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def volume_of(spec: dict[str, Any], container: dict[str, Any], path: Path) -> dict[str, Any]:
    """The volume a container sees at ``path`` (a mount point or below one)."""
    best = max(
        (Path(m) for m in mounts(container) if path == Path(m) or Path(m) in path.parents),
        key=lambda m: len(m.parts),
        default=None,
    )
    assert best is not None, f"{path} is on no volume of container {container['name']}"
    name = mounts(container)[str(best)]
    return next(v for v in spec["volumes"] if v["name"] == name)


# --- every document ---


def test_the_expected_files_are_there() -> None:
    names = {p.name for p in manifest_files()}
    assert {"sidecar.yaml", "daemonset.yaml", "secret.example.yaml"} <= names
    assert {name.split("#")[0] for name, _ in documents()} == names  # none is empty


@pytest.mark.parametrize(("name", "doc"), documents(), ids=[n for n, _ in documents()])
def test_document_names_itself(name: str, doc: dict[str, Any]) -> None:
    for key in ("apiVersion", "kind"):
        assert isinstance(doc.get(key), str) and doc[key], f"{name}: no {key}"
    assert isinstance(doc.get("metadata", {}).get("name"), str), f"{name}: no metadata.name"
    assert "namespace" not in doc["metadata"], "the namespace is chosen at apply time"


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize(("name", "doc"), documents(), ids=[n for n, _ in documents()])
def test_document_fits_the_kubernetes_schema(name: str, doc: dict[str, Any], version: str) -> None:
    # strict: an unknown or misplaced field is an error, not silently dropped
    kubernetes_validate.validate(doc, version, strict=True)


def test_schema_check_can_fail() -> None:
    doc = dict(workloads()[0][1])
    doc["spec"] = {**doc["spec"], "replica": 1}
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(doc, SCHEMA_VERSIONS[0], strict=True)


def test_every_payloadd_variable_named_is_a_setting() -> None:
    # commented examples included: uncommenting one must give a real setting
    for path in [*manifest_files(), DOCKERFILE]:
        for name in set(re.findall(r"\bPAYLOADD_[A-Z0-9_]+", path.read_text())):
            assert name[9:].lower() in Settings.model_fields, f"{path.name}: {name}"


# --- the workloads ---


@pytest.mark.parametrize(("name", "doc"), workloads(), ids=[n for n, _ in workloads()])
def test_payloadd_serve_takes_the_flags_and_variables(
    name: str, doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    container = daemon_container(pod_spec(doc))
    settings = container_settings(container, monkeypatch)
    assert settings.node == NODE_NAME  # from the downward API
    assert settings.admin_token is None and settings.admin_token_file is not None


def test_flag_check_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(pytest.fail.Exception, match="does not take"):
        serve_settings(["--roots=/x"], {}, monkeypatch)
    with pytest.raises(AssertionError, match="PAYLOADD_FSYNC_MODE is not a payloadd setting"):
        serve_settings([], {"PAYLOADD_FSYNC_MODE": "always"}, monkeypatch)
    with pytest.raises(ValueError, match="fsync"):
        serve_settings([], {"PAYLOADD_FSYNC": "sometimes"}, monkeypatch)


@pytest.mark.parametrize(("name", "doc"), workloads(), ids=[n for n, _ in workloads()])
def test_probes_run_payloadd_health_on_the_daemons_socket(
    name: str, doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    container = daemon_container(pod_spec(doc))
    settings = container_settings(container, monkeypatch)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        args = health_args(probe["exec"]["command"])
        assert Path(args.socket) == settings.socket, kind
        # its own timeout first, so that the probe's failure says why
        assert args.timeout < probe.get("timeoutSeconds", 1), kind


@pytest.mark.parametrize(("name", "doc"), workloads(), ids=[n for n, _ in workloads()])
def test_volumes_for_socket_root_and_token(
    name: str, doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = pod_spec(doc)
    container = daemon_container(spec)
    settings = container_settings(container, monkeypatch)
    socket_dir = settings.socket.parent
    assert str(socket_dir) in mounts(container), "the socket directory is a volume of its own"
    socket_volume = volume_of(spec, container, settings.socket)
    root_volume = volume_of(spec, container, settings.root)
    assert {"persistentVolumeClaim", "hostPath"} & root_volume.keys(), root_volume
    assert settings.admin_token_file is not None
    token_volume = volume_of(spec, container, settings.admin_token_file)
    secret = token_volume["secret"]
    assert secret["secretName"] == secret_example()["metadata"]["name"]
    assert secret["defaultMode"] == 0o440  # the daemon's group reads it; nobody else
    mount = next(Path(m) for m, v in mounts(container).items() if v == token_volume["name"])
    assert [mount / item["path"] for item in secret["items"]] == [settings.admin_token_file]
    assert [item["key"] for item in secret["items"]] == list(secret_example()["stringData"])
    if doc["kind"] == "DaemonSet":
        assert socket_volume["hostPath"]["path"] == str(socket_dir)  # the node's, for its pods
        assert root_volume["hostPath"]["path"] == str(settings.root)
    else:
        assert "emptyDir" in socket_volume


def test_sidecar_shares_the_socket_with_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    [deployment] = [doc for name, doc in workloads() if name.startswith("sidecar.yaml")]
    spec = pod_spec(deployment)
    daemon = daemon_container(spec)
    settings = container_settings(daemon, monkeypatch)
    socket_volume = mounts(daemon)[str(settings.socket.parent)]
    others = [c for c in all_containers(spec) if c is not daemon]
    assert others, "the sidecar example has an inference container"
    for c in others:
        assert mounts(c).get(str(settings.socket.parent)) == socket_volume, c["name"]
        env = {v["name"]: env_value(v) for v in c.get("env", [])}
        assert Path(env["PAYLOADD_SOCKET"]) == settings.socket, c["name"]
        # the token is the daemon's: the inference container has no way to it
        assert "payloadd-token" not in mounts(c).values()
    # a native sidecar: an init container that keeps running, ready before vLLM starts
    assert daemon in spec["initContainers"] and daemon["restartPolicy"] == "Always"
    assert "startupProbe" in daemon
    # at most one daemon per node prefix (the node's name): one such pod per node
    [term] = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_daemonset_updates_one_node_at_a_time_and_tolerates_gpus() -> None:
    [ds] = [doc for _, doc in workloads() if doc["kind"] == "DaemonSet"]
    # a new daemon cannot start while the old one holds the socket's lock
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0
    keys = {t["key"] for t in pod_spec(ds)["tolerations"]}
    assert "nvidia.com/gpu" in keys


@pytest.mark.parametrize(("name", "doc"), workloads(), ids=[n for n, _ in workloads()])
def test_daemon_runs_unprivileged(name: str, doc: dict[str, Any]) -> None:
    spec = pod_spec(doc)
    c = daemon_container(spec)
    assert effective(spec, c, "runAsNonRoot") is True
    assert effective(spec, c, "runAsUser") == UID and effective(spec, c, "runAsGroup") == UID
    assert spec["securityContext"]["fsGroup"] == UID  # the secret's file; the clients' group
    assert effective(spec, c, "readOnlyRootFilesystem") is True
    assert effective(spec, c, "allowPrivilegeEscalation") is False
    assert effective(spec, c, "capabilities") == {"drop": ["ALL"]}
    assert effective(spec, c, "seccompProfile") == {"type": "RuntimeDefault"}
    assert "privileged" not in c.get("securityContext", {})


@pytest.mark.parametrize(("name", "doc"), workloads(), ids=[n for n, _ in workloads()])
def test_no_container_gets_more_than_it_needs(name: str, doc: dict[str, Any]) -> None:
    spec = pod_spec(doc)
    for c in all_containers(spec):
        assert effective(spec, c, "allowPrivilegeEscalation") is False, c["name"]
        caps = effective(spec, c, "capabilities")
        assert caps["drop"] == ["ALL"], c["name"]
        # only the DaemonSet's host-dirs step runs as root, to chown the host directories
        assert set(caps.get("add", [])) <= {"CHOWN", "FOWNER"}, c["name"]
        if effective(spec, c, "runAsNonRoot") is not True:
            assert c["name"] == "host-dirs" and caps["add"], c["name"]
        for var in c.get("env", []):  # no secret in a manifest
            assert "TOKEN" not in var["name"] or "value" not in var, var["name"]


@pytest.mark.parametrize(("name", "doc"), workloads(), ids=[n for n, _ in workloads()])
def test_grace_period_covers_the_drain(name: str, doc: dict[str, Any]) -> None:
    assert pod_spec(doc)["terminationGracePeriodSeconds"] >= DRAIN_S + 10


def test_host_dirs_step_prepares_the_directories_the_daemon_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    [ds] = [doc for _, doc in workloads() if doc["kind"] == "DaemonSet"]
    spec = pod_spec(ds)
    settings = container_settings(daemon_container(spec), monkeypatch)
    [init] = spec["initContainers"]
    prepared = {
        next(v for v in spec["volumes"] if v["name"] == name)["hostPath"]["path"]
        for path, name in mounts(init).items()
        if path in shlex.split(init["command"][-1])
    }
    assert prepared == {str(settings.root), str(settings.socket.parent)}
    assert f"chown {UID}:{UID}" in init["command"][-1]


# --- the secret ---


def secret_example() -> dict[str, Any]:
    [secret] = yaml.safe_load_all((KUBERNETES / "secret.example.yaml").read_text())
    assert isinstance(secret, dict)
    return secret


def test_example_secret_cannot_be_used_as_it_is(tmp_path: Path) -> None:
    # the placeholder must stop the daemon, not become a token everybody knows
    [token] = secret_example()["stringData"].values()
    path = tmp_path / "token"
    path.write_text(token)
    with pytest.raises(StartError, match="visible ASCII characters only"):
        load_admin_token(Settings(admin_token_file=path), warn=False)
    path.write_text("0123456789abcdef0123456789abcdef")  # while a real one is taken
    assert load_admin_token(Settings(admin_token_file=path), warn=False) is not None


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_reads_every_manifest(tmp_path: Path) -> None:
    # offline: kustomize parses and re-emits every document (no cluster needed)
    files = [p.name for p in manifest_files()]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": files}))
    for path in manifest_files():
        shutil.copy(path, tmp_path / path.name)
    out = subprocess.run(
        ["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    emitted = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout)}
    assert emitted == {(d["kind"], d["metadata"]["name"]) for _, d in documents()}


# --- the Dockerfile ---


def dockerfile_stages() -> list[list[dict[str, Any]]]:
    """The Dockerfile's instructions, stage by stage (comments left out)."""
    stages: list[list[dict[str, Any]]] = []
    for ins in DockerfileParser(str(DOCKERFILE)).structure:
        if ins["instruction"] == "FROM":
            stages.append([])
        if stages and ins["instruction"] != "COMMENT":
            stages[-1].append(ins)
    return stages


def instructions(stage: list[dict[str, Any]], name: str) -> list[str]:
    return [" ".join(ins["value"].split()) for ins in stage if ins["instruction"] == name]


def exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed), value
    return parsed


def test_dockerfile_copies_files_that_exist_and_the_context_keeps() -> None:
    kept = [ln[1:] for ln in DOCKERIGNORE.read_text().splitlines() if ln.startswith("!")]
    assert "*" in DOCKERIGNORE.read_text().splitlines()  # everything else stays out
    copies = [c for stage in dockerfile_stages() for c in instructions(stage, "COPY")]
    assert copies
    for copy in copies:
        *sources, _dest = copy.split()
        assert not any(s.startswith("--from") for s in sources)
        for source in sources:
            assert (REPO / source).exists(), source
            assert source.rstrip("/").split("/")[0] in kept, f"{source} is not in the context"


def test_dockerfile_final_stage_runs_payloadd_serve_unprivileged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    build, final = dockerfile_stages()
    assert "AS build" in build[0]["value"]
    [user] = instructions(final, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit() and int(uid) == int(gid) == UID  # numeric, non-root
    [entrypoint] = instructions(final, "ENTRYPOINT")
    assert exec_form(entrypoint) == ["payloadd", "serve"]
    [stopsignal] = instructions(final, "STOPSIGNAL")
    assert stopsignal == "SIGTERM"
    # the default command: flags payloadd serve takes, in the image's environment
    parser = DockerfileParser(str(DOCKERFILE))
    [cmd] = instructions(final, "CMD")
    settings = serve_settings(exec_form(cmd), parser.envs, monkeypatch)
    volumes = exec_form(instructions(final, "VOLUME")[0])
    assert {str(settings.root), str(settings.socket.parent)} <= set(volumes)
    # the health check asks the socket the daemon serves on
    [healthcheck] = instructions(final, "HEALTHCHECK")
    options, _, command = healthcheck.partition(" CMD ")
    args = health_args(exec_form(command))
    assert Path(args.socket or parser.envs["PAYLOADD_SOCKET"]) == settings.socket
    timeout = re.search(r"--timeout=(\d+)s", options)
    assert timeout is not None and args.timeout < int(timeout.group(1))


def test_dockerfile_final_stage_installs_only_built_wheels() -> None:
    build, final = dockerfile_stages()
    assert any("pip wheel --wheel-dir /wheels" in r for r in instructions(build, "RUN"))
    [install] = [r for r in instructions(final, "RUN") if "pip install" in r]
    assert "--mount=type=bind,from=build,source=/wheels" in install and "--no-index" in install
    assert not instructions(final, "COPY")  # no sources, no wheels in a layer
    envs = DockerfileParser(str(DOCKERFILE)).envs
    assert envs["PIP_NO_CACHE_DIR"] == "1"


def test_dockerfile_base_is_pinned_and_labelled() -> None:
    parser = DockerfileParser(str(DOCKERFILE))
    for image in parser.parent_images:
        _, _, tag = image.partition(":")
        assert tag and tag != "latest" and "3.11" in tag, image
    labels = parser.labels
    assert labels["org.opencontainers.image.version"] == __version__
    for key in ("title", "description", "licenses", "base.name"):
        assert labels[f"org.opencontainers.image.{key}"], key
