"""The Kubernetes manifests in deploy/k8s are checked against the objects' shape and the CLIs they call.

Every document must be a well-formed object of a kind listed here (required fields, containers with
images and commands, mounts of declared volumes, services selecting a workload, StatefulSets naming
their headless service). Every command a container runs (`python -m MODULE`, `torchrun ... -m
MODULE`, and the engine command the checkpoint-engine daemon starts) is run with `--help` here, and
every flag the manifest passes must be one that command accepts; `--set` overrides and `--config`
files of the RL job are resolved by the job itself (`--print-config`).
"""

from __future__ import annotations

import functools
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy" / "k8s"
IMAGE_APP_DIR = "/app"  # where the image holds this repository (deploy/k8s/README.md)
WORKLOADS = {"Deployment", "StatefulSet", "Job", "Pod"}
KNOWN_KINDS = WORKLOADS | {"Service", "ConfigMap", "PersistentVolumeClaim"}
STS_POD_NAME = "statefulset.kubernetes.io/pod-name"  # label the StatefulSet controller puts on each pod


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def pod_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def pod_labels(doc: dict) -> dict:
    meta = doc["metadata"] if doc["kind"] == "Pod" else doc["spec"]["template"].get("metadata", {})
    return meta.get("labels", {})


def containers() -> list[tuple[str, str, dict]]:
    return [
        (f, doc["metadata"]["name"], c)
        for f, doc in documents()
        if doc["kind"] in WORKLOADS
        for c in pod_spec(doc).get("initContainers", []) + pod_spec(doc)["containers"]
    ]


def test_there_are_manifests_for_both_layouts():
    names = {p.name for p in K8S.glob("*.yaml")}
    assert {"colocated.yaml", "disaggregated.yaml"} <= names, names


@pytest.mark.parametrize("name,doc", documents(), ids=lambda v: v if isinstance(v, str) else v.get("kind", "?"))
def test_object_shape(name, doc):
    assert isinstance(doc, dict), f"{name}: a document must be a mapping"
    for key in ("apiVersion", "kind", "metadata"):
        assert key in doc, f"{name}: missing {key}"
    kind = doc["kind"]
    assert kind in KNOWN_KINDS, f"{name}: unexpected kind {kind}"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), doc["metadata"]["name"]
    if kind in {"Deployment", "StatefulSet"}:
        assert doc["apiVersion"] == "apps/v1"
        selector = doc["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels(doc).items(), f"{name}: selector {selector} does not match the pod"
    if kind == "Job":
        assert doc["apiVersion"] == "batch/v1"
        assert pod_spec(doc).get("restartPolicy") in ("Never", "OnFailure")
    if kind in WORKLOADS:
        spec = pod_spec(doc)
        volumes = {v["name"] for v in spec.get("volumes", [])}
        seen = set()
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["name"] not in seen, f"{name}: two containers named {c['name']}"
            seen.add(c["name"])
            assert c.get("image"), f"{name}/{c['name']}: no image"
            assert isinstance(c.get("command"), list) and all(isinstance(x, str) for x in c["command"])
            assert all(isinstance(x, str) for x in c.get("args", [])), f"{name}/{c['name']}: args must be strings"
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{name}/{c['name']}: mounts undeclared volume {m['name']}"
            for p in c.get("ports", []):
                assert isinstance(p["containerPort"], int) and 0 < p["containerPort"] < 65536
    if kind == "Service":
        for p in doc["spec"]["ports"]:
            assert isinstance(p["port"], int)


def selects(selector: dict, workload: dict) -> bool:
    """Whether `selector` matches a pod of `workload`, counting the pod-name label a StatefulSet adds."""
    labels = dict(pod_labels(workload))
    pod_name = selector.get(STS_POD_NAME)
    if workload["kind"] == "StatefulSet" and pod_name is not None:
        names = {f"{workload['metadata']['name']}-{i}" for i in range(workload["spec"].get("replicas", 1))}
        if pod_name in names:
            labels[STS_POD_NAME] = pod_name
    return selector.items() <= labels.items()


def test_services_select_a_workload_and_statefulsets_name_theirs():
    docs = [d for _, d in documents()]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    for name, svc in services.items():
        sel = svc["spec"].get("selector", {})
        assert any(selects(sel, w) for w in workloads), f"service {name} selects no pod"
    for d in docs:
        if d["kind"] == "StatefulSet":
            svc = services.get(d["spec"]["serviceName"])
            assert svc is not None, f"StatefulSet {d['metadata']['name']}: no Service {d['spec']['serviceName']}"
            assert svc["spec"].get("clusterIP") == "None", "a StatefulSet's service must be headless"


# ── the commands ──────────────────────────────────────────────────────────────────────────────────


@functools.cache
def help_text(argv: tuple[str, ...]) -> str:
    r = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, f"{' '.join(argv)} --help failed:\n{r.stderr[-2000:]}"
    return r.stdout


def flags_of(args: list[str]) -> list[str]:
    """`--flag` tokens before a bare `--` (after it the arguments belong to another program)."""
    out = []
    for a in args:
        if a == "--":
            break
        if a.startswith("--"):
            out.append(a.split("=", 1)[0])
    return out


def module_and_args(cmd: list[str]) -> tuple[list[str], str, list[str]]:
    """(launcher flags, module, module args) of `python -m M ...` or `torchrun ... -m M ...`."""
    assert cmd[0] in ("python", "python3", "torchrun"), f"unexpected program {cmd[0]}"
    i = cmd.index("-m")
    return cmd[1:i], cmd[i + 1], cmd[i + 2 :]


def check_module_flags(module: str, args: list[str], where: str) -> None:
    accepted = help_text((sys.executable, "-m", module))
    for flag in flags_of(args):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", accepted), (
            f"{where}: `python -m {module}` has no flag {flag}"
        )


def option_value(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag and i + 1 < len(args)] + [
        a.split("=", 1)[1] for a in args if a.startswith(flag + "=")
    ]


def full_command(c: dict) -> list[str]:
    cmd = list(c["command"]) + list(c.get("args", []))
    if cmd[:2] in (["sh", "-c"], ["bash", "-c"]):
        cmd = shlex.split(cmd[2])
    return cmd


@pytest.mark.parametrize("name,workload,c", containers(), ids=lambda v: v if isinstance(v, str) else v["name"])
def test_container_command_flags_exist(name, workload, c):
    cmd = full_command(c)
    if cmd[0] == "etcd":  # the etcd image's own program: checked against the etcd installed here
        if shutil.which("etcd") is None:
            pytest.skip("no etcd binary here to check its flags")
        accepted = help_text(("etcd",))
        for flag in flags_of(cmd[1:]):
            assert flag in accepted, f"{name}/{c['name']}: etcd has no flag {flag}"
        return
    assert cmd[0] in ("python", "python3", "torchrun"), f"{name}/{c['name']}: unexpected program {cmd[0]}"
    launcher, module, args = module_and_args(cmd)
    where = f"{name}/{workload}/{c['name']}"
    if cmd[0] == "torchrun":
        accepted = help_text((sys.executable, "-m", "torch.distributed.run"))
        for flag in flags_of(launcher):
            assert flag in accepted, f"{where}: torchrun has no flag {flag}"
    check_module_flags(module, args, where)
    for engine_cmd in option_value(args, "--engine-cmd"):  # the daemon starts this per rank
        inner = shlex.split(engine_cmd.replace("{", "").replace("}", ""))
        _, inner_module, inner_args = module_and_args(inner)
        check_module_flags(inner_module, inner_args, f"{where} --engine-cmd")


@pytest.mark.parametrize(
    "name,workload,c",
    [x for x in containers() if "orchestrator" in full_command(x[2])],
    ids=lambda v: v if isinstance(v, str) else v["name"],
)
def test_rl_job_config_resolves(name, workload, c, tmp_path):
    """The RL job's --config (inside the image) and --set overrides make a valid config."""
    _, _, args = module_and_args(full_command(c))
    argv = [sys.executable, "-m", "orchestrator", "--output-dir", str(tmp_path), "--print-config"]
    for path in option_value(args, "--config"):
        assert path.startswith(IMAGE_APP_DIR + "/"), f"--config {path} must be a file of the image's {IMAGE_APP_DIR}"
        local = REPO / path[len(IMAGE_APP_DIR) + 1 :]
        assert local.is_file(), f"--config {path}: no {local.relative_to(REPO)} in the repository"
        argv += ["--config", str(local)]
    for kv in option_value(args, "--set"):
        argv += ["--set", kv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, f"{name}/{c['name']}: the job rejects its config:\n{r.stderr[-2000:]}"
