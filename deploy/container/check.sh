#!/usr/bin/env bash
# make check-container: build deploy/container/Dockerfile with podman and run the image as a
# sidecar, as root, with everything it needs installed here (podman, runc, debootstrap).
#
# 1. The base: $PYTHON_IMAGE when podman has it; else a stand-in made from Debian's packages
#    (debootstrap bookworm with python3 and pip: what python:3.11-slim gives the Dockerfile,
#    `python` and a `pip` that installs system-wide), imported as localhost/payloadd-base.
# 2. The Dockerfile, unchanged but for PYTHON_IMAGE. Its build stage takes the dependencies
#    from the package index, as any build does: over the host's network, with the host's CA
#    bundle (the only build step that needs a network).
# 3. The sidecar: the daemon with no network, a read-only root file system, no capabilities,
#    uid 10001, the payload root and /run/payloadd on volumes; a client container (uid 10002,
#    in the daemon's group 10001, no network) appends and reads through the shared socket on
#    both transports; `payloadd health` from the client's side; SIGTERM (podman stop) while
#    an append is half sent: it is finished and answered; a new daemon container on the same
#    volumes serves every acknowledged row.
# 4. The Kubernetes manifests played with podman kube play (kube_play.py says what changes).
# Then it removes the containers, volumes and images it made. Output: what it saw, a line a
# check, and the image's size and contents.
set -euo pipefail

PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim-bookworm}
IMAGE=localhost/payloadd:check
BASE=localhost/payloadd-base:bookworm
WORK=$(mktemp -d /var/tmp/payloadd-check.XXXXXX)
P=pl-check-$$  # names of this run's containers and volumes
HERE=$(cd "$(dirname "$0")/../.." && pwd)

say() { printf '%s\n' "check-container: $*"; }
fail() { say "FAILED: $*"; exit 1; }

[ "$(id -u)" = 0 ] || { echo "check-container runs podman as root: run it as root"; exit 1; }
for tool in podman runc debootstrap; do
  command -v "$tool" >/dev/null || {
    say "installing podman, runc and debootstrap (Debian packages)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap >/dev/null
    break
  }
done

# runc, not crun (crun refuses this host's hybrid cgroups); limits given explicitly (the
# runtime may not raise RLIMIT_NOFILE / RLIMIT_NPROC above the host's here)
cat >"$WORK/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$WORK/containers.conf"

before_images=$(podman images -a -q --no-trunc | sort -u)
cleanup() {  # what this run made: containers, volumes, images (podman's pause image too)
  set +e
  podman rm -f -t 0 "$P-daemon" "$P-daemon2" >/dev/null 2>&1
  podman volume rm -f "$P-root" "$P-run" >/dev/null 2>&1
  for i in $(podman images -a -q --no-trunc | sort -u | comm -13 <(echo "$before_images") -); do
    podman rmi -f "$i" >/dev/null 2>&1
  done
  rm -rf "$WORK"
}
trap cleanup EXIT

# -- 1. the base ----------------------------------------------------------------------------
if podman image exists "$PYTHON_IMAGE"; then
  base=$PYTHON_IMAGE
  say "base: $base"
else
  say "base: $PYTHON_IMAGE is not here (no registry): a stand-in from Debian's packages"
  t0=$(date +%s)
  debootstrap --variant=minbase --include=python3,python3-pip bookworm "$WORK/rootfs" \
    http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 || {
    tail -20 "$WORK/debootstrap.log"; fail "debootstrap"; }
  r=$WORK/rootfs
  ln -sf python3 "$r/usr/bin/python" && ln -sf pip3 "$r/usr/bin/pip"
  rm -f "$r"/usr/lib/python3*/EXTERNALLY-MANAGED  # pip installs system-wide, as in python:*
  rm -rf "$r"/var/cache/apt/archives/*.deb "$r"/var/lib/apt/lists/* "$r"/usr/share/doc/* \
    "$r"/usr/share/man/* "$r"/usr/share/locale/*
  tar -C "$r" -c . | podman import --change 'CMD ["python3"]' - "$BASE" >/dev/null
  rm -rf "$r"
  base=$BASE
  say "base: $BASE made in $(($(date +%s) - t0)) s, $(podman image inspect -f '{{.Size}}' "$BASE" | numfmt --to=iec)"
fi

# -- 2. the image ---------------------------------------------------------------------------
# --no-cache: podman 4.3 (buildah 1.28) cannot bind-mount a build stage taken from its cache
# ("couldn't find .../merged/wheels on host", podman#16281): the install step would find no
# wheels on a second build
t0=$(date +%s)
podman build --format docker --no-cache --network host \
  -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
  --build-arg PYTHON_IMAGE="$base" -f "$HERE/deploy/container/Dockerfile" -t "$IMAGE" \
  "$HERE" >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; fail "podman build"; }
size=$(podman image inspect -f '{{.Size}}' "$IMAGE")
say "image: $IMAGE built in $(($(date +%s) - t0)) s, $(numfmt --to=iec "$size") ($size bytes)"
podman run --rm --network none --no-healthcheck --entrypoint sh "$IMAGE" -c \
  'echo "  python $(python3 -c "import sys; print(sys.version.split()[0])"), $(payloadd --version)"
   du -sh /usr/lib/python3 /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages 2>/dev/null | sed "s/^/  /"
   cd /usr/local/lib/python3*/dist-packages 2>/dev/null && du -s -- */ | sort -rn | head -8 | awk "{printf \"  %6.1f MiB %s\\n\", \$1/1024, \$2}"'

# -- 3. the sidecar -------------------------------------------------------------------------
podman volume create "$P-root" >/dev/null
podman volume create "$P-run" >/dev/null
# --read-only-tmpfs=false: no /tmp either, as Kubernetes' readOnlyRootFilesystem gives;
# PAYLOADD_NODE: the node is the container's hostname otherwise, a new one at each start
daemon() {  # $1: the container's name
  podman run -d --name "$1" --network none --read-only --read-only-tmpfs=false \
    --cap-drop all --security-opt no-new-privileges --user 10001:10001 \
    --health-interval disable -e PAYLOADD_NODE=node0 \
    -v "$P-root:/var/lib/payloadd" -v "$P-run:/run/payloadd" "$IMAGE" >/dev/null
}
client() {  # the other side: another uid in the daemon's group, no network, no root volume
  podman run --rm -i --network none --read-only --read-only-tmpfs=false --cap-drop all \
    --security-opt no-new-privileges --user 10002:10001 --no-healthcheck \
    -v "$P-run:/run/payloadd" -v "$WORK:/work" --entrypoint "$@"
}
wait_healthy() {  # the health check, run as the client would, until it passes (60 s at most)
  client payloadd "$IMAGE" health --socket /run/payloadd/payloadd.sock --timeout 2 --wait 60 \
    >"$WORK/health.txt" 2>&1 && return 0
  cat "$WORK/health.txt"; podman logs "$1" | tail -20; fail "the daemon in $1 never became healthy"
}

daemon "$P-daemon"
wait_healthy "$P-daemon"
podman healthcheck run "$P-daemon" >/dev/null || fail "the image's HEALTHCHECK"
say "sidecar: daemon up (read-only root, no capabilities, no network); health: $(tr -d '\n' <"$WORK/health.txt")"
chmod 0777 "$WORK"
client python3 "$IMAGE" - <<'EOF' || fail "appends and reads from the client container"
import msgspec
import numpy as np
from payload_client import PayloadClient

rows = np.arange(64 * 48 * 8, dtype=np.uint64).astype(np.uint8).reshape(64, 48, 8)
kept = []
for data_plane in (True, False):
    with PayloadClient(data_plane=data_plane) as c:
        for step in range(3):
            segs = c.append("routed_experts", rows, step * 64, run="sidecar", step=step)
            back = c.read_field(segs, "routed_experts", step * 64, step * 64 + 64, 0)
            assert np.array_equal(back, rows), "read back differs"
            kept.append(segs)
        st = c.stats()
        print(f"  data_plane={data_plane}: 3 appends read back bit for bit; "
              f"data-plane requests {st.data_plane_requests}, HTTP reads {st.reads}")
open("/work/segments.json", "wb").write(msgspec.json.encode(kept))
EOF
say "sidecar: a client container (uid 10002, group 10001) appended and read on both transports"

# an append in flight when SIGTERM comes: its body half sent, the rest a second later; the
# daemon must finish it (and answer its segments) before it exits
client python3 "$IMAGE" - >"$WORK/inflight.log" 2>&1 <<'EOF' &
import os
import struct
import time

import httpx
import msgspec
import numpy as np

rows = np.full((4096, 48, 8), 7, np.uint8)  # 1.5 MiB
item = {"field": "routed_experts", "dtype": "uint8", "shape": [48, 8], "rows": 4096,
        "pos": 0, "run": "inflight", "step": 0}
header = msgspec.msgpack.encode({"items": [item]})
data = rows.tobytes()


def body():
    yield struct.pack("<I", len(header)) + header + data[: len(data) // 2]
    open("/work/inflight.started", "w").close()
    time.sleep(1.0)
    yield data[len(data) // 2 :]


sock = os.environ["PAYLOADD_SOCKET"]
with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://payloadd") as h:
    size = str(4 + len(header) + len(data))  # the daemon takes no chunked body
    r = h.post("/v1/append", content=body(), timeout=30,
               headers={"Content-Type": "application/x-payload-append", "Content-Length": size})
    print(r.status_code, r.text)
    r.raise_for_status()
    open("/work/inflight.json", "wb").write(r.content)
EOF
inflight=$!
for _ in $(seq 1 100); do [ -e "$WORK/inflight.started" ] && break; sleep 0.1; done
[ -e "$WORK/inflight.started" ] || { cat "$WORK/inflight.log"; fail "the in-flight append never started"; }
t0=$(date +%s)
podman stop -t 40 "$P-daemon" >/dev/null
wait "$inflight" || { cat "$WORK/inflight.log"; fail "the append in flight at SIGTERM"; }
say "sidecar: an append half sent when SIGTERM came was finished and answered: $(cut -c1-60 "$WORK/inflight.log")..."
code=$(podman inspect -f '{{.State.ExitCode}}' "$P-daemon")
[ "$code" = 0 ] || { podman logs "$P-daemon" | tail -20; fail "exit code $code after SIGTERM"; }
say "sidecar: SIGTERM: exit 0 in $(($(date +%s) - t0)) s; the daemon's last lines:"
podman logs "$P-daemon" 2>&1 | tail -3 | sed 's/^/  /'

daemon "$P-daemon2"
wait_healthy "$P-daemon2"
client python3 "$IMAGE" - <<'EOF' || fail "reads after the restart"
import msgspec
import numpy as np
from payload_client import PayloadClient, PayloadSegment

rows = np.arange(64 * 48 * 8, dtype=np.uint64).astype(np.uint8).reshape(64, 48, 8)
data = open("/work/segments.json", "rb").read()
kept = msgspec.json.decode(data, type=list[list[PayloadSegment]])
with PayloadClient() as c:
    for segs in kept:
        lo = segs[0].pos
        assert np.array_equal(c.read_field(segs, "routed_experts", lo, lo + 64, 0), rows)
    answer = msgspec.json.decode(open("/work/inflight.json", "rb").read())
    (inflight,) = [PayloadSegment(*s) for s in answer["segments"][0]]
    got = c.read_field([inflight], "routed_experts", 0, 4096, 0)
    assert got is not None and (got == 7).all(), "the drained append's rows"
print(f"  a new daemon container on the same volumes served all {len(kept) + 1} appends"
      " (the drained one too)")
EOF
podman stop -t 40 "$P-daemon2" >/dev/null
say "sidecar: restart served every acknowledged row"

# -- 4. the Kubernetes manifests, played by podman ------------------------------------------
# kube_play.py says what it changes for podman 4.3 (images, the inference container, the
# native sidecar, the node's name, the Secret's stringData, fsGroup, a DaemonSet's pod).
# The pods get no network but loopback (--network none; kube_play.py drops the declared ports).
PY=python3
"$PY" -c 'import yaml' 2>/dev/null || PY=$HERE/.venv/bin/python
"$PY" -c 'import yaml' 2>/dev/null || fail "PyYAML is needed to rewrite the manifests (make .venv/.installed)"
before_volumes=$(podman volume ls -q | sort)
sed "s/replace me: openssl rand -hex 32/$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')/" \
  "$HERE/deploy/kubernetes/secret.example.yaml" >"$WORK/secret.raw.yaml"
"$PY" "$HERE/deploy/container/kube_play.py" "$WORK/secret.raw.yaml" "$IMAGE" >"$WORK/secret.yaml"
"$PY" "$HERE/deploy/container/kube_play.py" "$HERE/deploy/kubernetes/sidecar.yaml" "$IMAGE" \
  >"$WORK/sidecar.yaml"
mkdir -p "$WORK/host"
"$PY" "$HERE/deploy/container/kube_play.py" "$HERE/deploy/kubernetes/daemonset.yaml" "$IMAGE" \
  --host "$WORK/host" >"$WORK/daemonset.yaml"
kube_cleanup() {
  set +e
  for f in daemonset sidecar secret; do podman kube down "$WORK/$f.yaml" >/dev/null 2>&1; done
  podman secret rm payloadd-admin-token >/dev/null 2>&1
  for v in $(podman volume ls -q | sort | comm -13 <(echo "$before_volumes") -); do
    podman volume rm -f "$v" >/dev/null 2>&1
  done
}
trap 'kube_cleanup; cleanup' EXIT
healthy() {  # $1: a container of a played pod, whose liveness probe is its health check
  for _ in $(seq 1 60); do
    podman healthcheck run "$1" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  podman logs "$1" 2>&1 | tail -20; fail "the liveness probe of $1"
}
podman kube play "$WORK/secret.yaml" >/dev/null
podman kube play --network none "$WORK/sidecar.yaml" >"$WORK/play.log" 2>&1 || {
  cat "$WORK/play.log"; fail "kube play sidecar.yaml"; }
healthy vllm-pod-0-payloadd
podman exec -i vllm-pod-0-vllm python3 - <<'EOF' || fail "the client in the pod"
import numpy as np
from payload_client import PayloadClient

rows = np.arange(32 * 48 * 8, dtype=np.uint64).astype(np.uint8).reshape(32, 48, 8)
for data_plane in (True, False):
    with PayloadClient(data_plane=data_plane) as c:
        segs = c.append("routed_experts", rows, 0, run="pod", step=0)
        assert np.array_equal(c.read_field(segs, "routed_experts", 0, 32, 0), rows)
        print(f"  data_plane={data_plane}: appended and read back in {segs[0].file}")
EOF
podman exec vllm-pod-0-payloadd payloadd stat --socket /run/payloadd/payloadd.sock \
  --token-file /run/secrets/payloadd/token --interval 0 >/dev/null ||
  fail "payloadd stat with the Secret's token"
ids=$(podman exec vllm-pod-0-vllm sh -c 'echo "$(id -u) groups $(id -G)"')
say "kube play sidecar.yaml: the sidecar healthy (its liveness probe); the inference container (uid $ids) appended and read on both transports; the admin token read from the Secret"
podman kube down "$WORK/sidecar.yaml" >/dev/null

podman kube play --network none "$WORK/daemonset.yaml" >"$WORK/play.log" 2>&1 || {
  cat "$WORK/play.log"; fail "kube play daemonset.yaml (its pod)"; }
healthy payloadd-payloadd
podman run --rm -i --network none --read-only --read-only-tmpfs=false --cap-drop all \
  --user 10002:10001 --no-healthcheck -v "$WORK/host/run/payloadd:/run/payloadd" \
  --entrypoint python3 "$IMAGE" - <<'EOF' || fail "a client of the node's daemon"
import numpy as np
from payload_client import PayloadClient

rows = np.ones((32, 48, 8), np.uint8)
for data_plane in (True, False):
    with PayloadClient(data_plane=data_plane) as c:
        segs = c.append("routed_experts", rows, 0, run="node", step=0)
        assert np.array_equal(c.read_field(segs, "routed_experts", 0, 32, 0), rows)
print("  a container of another uid, the host's socket folder mounted: both transports")
EOF
say "kube play daemonset.yaml (its pod): the init container gave the host folders to the daemon ($(stat -c '%u:%g %a' "$WORK/host/run/payloadd")); it serves on the host's socket"
podman kube down "$WORK/daemonset.yaml" >/dev/null
say "OK"
