"""The Kubernetes manifests (deploy/k8s): rendered with `kubectl kustomize` and every
object validated offline with kubernetes-validate --strict against the oldest and
newest Kubernetes versions it bundles; then what they promise, read from the
rendered objects."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes_validate import utils

from tests.servers import ROOT, ServerProcess, wait_for

K8S = ROOT / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed (it renders the kustomizations)"
)
VERSIONS = sorted(set(utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
CRDS = {"ServiceMonitor"}  # custom resources: kubernetes-validate has no schema for them


def render(target: str) -> str:
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(K8S / target)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def objects(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def validate(path: Path, version: str) -> tuple[int, list[str]]:
    """kubernetes-validate's exit status and its lines for one file and version."""
    done = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.returncode, (done.stdout + done.stderr).splitlines()


@needs_kubectl
@pytest.mark.parametrize("target", ["overlays/cpu", "overlays/gpu", "monitoring"])
@pytest.mark.parametrize("version", [VERSIONS[0], VERSIONS[-1]])
def test_every_rendered_object_is_valid(target: str, version: str, tmp_path: Path) -> None:
    """Each object must be reported as passed: a version without schemas for a kind
    exits 0 with only a warning, so the output is read, not just the exit status."""
    text = render(target)
    path = tmp_path / "rendered.yaml"
    path.write_text(text)
    code, lines = validate(path, version)
    assert code == 0, lines
    kinds = [o["kind"] for o in objects(text)]
    passed = [line for line in lines if " passed for resource " in line]
    assert len(passed) == len([k for k in kinds if k not in CRDS]), lines
    unexpected = [line for line in lines if "passed" not in line and "ServiceMonitor" not in line]
    assert not unexpected, unexpected


@needs_kubectl
def test_a_broken_manifest_fails_validation(tmp_path: Path) -> None:
    """The check can fail: a misspelt field in the Deployment is refused (--strict)."""
    text = render("overlays/cpu").replace("readinessProbe:", "readinesProbe:", 1)
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    code, lines = validate(path, VERSIONS[-1])
    assert code != 0 and any("readinesProbe" in line for line in lines), lines


def _deployment(text: str) -> dict[str, Any]:
    return next(o for o in objects(text) if o["kind"] == "Deployment")


def _flag(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))


@needs_kubectl
def test_the_deployment_probes_drains_and_uses_gpus_as_promised() -> None:
    for target in ("overlays/cpu", "overlays/gpu"):
        pod = _deployment(render(target))["spec"]["template"]["spec"]
        c = pod["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == 8001, probe  # native gRPC probes
        assert c["livenessProbe"]["grpc"]["service"] == "batchd.liveness"
        assert "service" not in c["readinessProbe"]["grpc"]  # "": every model ready
        sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        drain = float(_flag(c["args"], "drain-timeout")) + float(_flag(c["args"], "drain-notice"))
        assert pod["terminationGracePeriodSeconds"] > sleep + drain
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (gpus == 1) == (target == "overlays/gpu")
        # jobs in a volume, not the container's own layer, which a restart empties, and
        # one of a file system's size: past an emptyDir's sizeLimit the kubelet evicts
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        jobs = next(v for v in pod["volumes"] if v["name"] == mounts[_flag(c["args"], "jobs-dir")])
        assert "ephemeral" in jobs and "emptyDir" not in jobs
        # the HPA alone sets the count: one here reset it at every apply (review 56f)
        assert "replicas" not in _deployment(render(target))["spec"]
    cpu = _deployment(render("overlays/cpu"))["spec"]["template"]["spec"]["containers"][0]
    assert {"--workers=2", "--threads-per-worker=1"} <= set(cpu["args"])


@needs_kubectl
def test_the_autoscaler_s_metric_is_the_adapter_s_and_batchd_s() -> None:
    """The HPA scales on the metric the adapter rule names, computed from counters
    batchd exports (server/metrics.py)."""
    hpa = next(o for o in objects(render("overlays/cpu")) if o["kind"].startswith("Horizontal"))
    wanted = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    adapter = next(o for o in objects(render("monitoring")) if o["kind"] == "ConfigMap")
    rule = yaml.safe_load(adapter["data"]["config.yaml"])["rules"][0]
    assert rule["name"]["as"] == wanted
    exported = (ROOT / "server" / "metrics.py").read_text()
    for name in set(re.findall(r"batchd_[a-z_]+", rule["metricsQuery"])):
        assert name.removesuffix("_total") in exported, name


def test_the_liveness_service_is_served_until_the_process_stops(tmp_path: Path) -> None:
    """The liveness probe's service name answers SERVING on a real server, and still
    does while it drains after SIGTERM, when readiness and the models say NOT_SERVING:
    a drain must not fail the liveness probe (the kubelet would kill the pod)."""
    serving = health_pb2.HealthCheckResponse.SERVING
    server = ServerProcess(
        ROOT / "examples" / "models", "--drain-notice", "2", log_dir=tmp_path
    ).start()
    try:
        with grpc.insecure_channel(server.url) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(name: str) -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=name)).status

            assert status("batchd.liveness") == status("") == status("mlp") == serving
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: status("") != serving, 30, "readiness NOT_SERVING after SIGTERM")
            wait_for(lambda: status("mlp") != serving, 30, "the model NOT_SERVING")
            assert status("batchd.liveness") == serving
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
