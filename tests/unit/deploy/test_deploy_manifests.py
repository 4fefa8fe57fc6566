"""The Kubernetes manifests in deploy/k8s are checked against the objects' shape and the CLIs they call.

Every document must be a well-formed object of a kind listed here (required fields, containers with
images and commands, mounts of declared volumes, services selecting a workload, StatefulSets naming
their headless service). Every command a container runs (`python -m MODULE`, `torchrun ... -m
MODULE`, and the engine command the checkpoint-engine daemon starts) is run with `--help` here, and
every flag the manifest passes must be one that command accepts; `--set` overrides and `--config`
files of the RL job are resolved by the job itself (`--print-config`).

Access: a checkpoint-engine daemon bound beyond loopback takes its bearer token from a Secret (a
mounted file, `--token-file`, or `CKPT_ENGINE_TOKEN` from `secretKeyRef`) and every RL job calling
it gets the same Secret; no token is written in a manifest; vLLM's dev-mode routes (`/collective_rpc`)
have no Service port, a vLLM server started directly in dev mode binds 127.0.0.1, and an engine gate
bound beyond loopback (it proxies those routes) is reachable only from this job's pods (NetworkPolicy).
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
KNOWN_KINDS = WORKLOADS | {"Service", "ConfigMap", "PersistentVolumeClaim", "NetworkPolicy"}
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
        for p in doc["spec"].get("ports", []):
            assert isinstance(p["port"], int)
    if kind == "NetworkPolicy":
        assert doc["apiVersion"] == "networking.k8s.io/v1"
        assert "podSelector" in doc["spec"] and doc["spec"].get("policyTypes"), f"{name}: {doc['spec']}"


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


# ── access: the daemon's token, vLLM's dev-mode routes ────────────────────────────────────────────────
TOKEN_ENV = "CKPT_ENGINE_TOKEN"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def workloads() -> list[tuple[str, dict]]:
    return [(f, d) for f, d in documents() if d["kind"] in WORKLOADS]


def is_daemon(c: dict) -> bool:
    cmd = full_command(c)
    return (
        cmd[0] in ("python", "python3", "torchrun") and "-m" in cmd and module_and_args(cmd)[1] == "checkpoint_engine"
    )


def secret_env(c: dict, name: str) -> tuple[str, str] | None:
    """(secret, key) of env `name` when it comes from a Secret; AssertionError for a literal value."""
    for e in c.get("env", []):
        if e["name"] == name:
            assert "value" not in e, f"{c['name']}: {name} written in the manifest; take it from a Secret"
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            return (ref["name"], ref["key"]) if ref else None
    return None


def secret_file(spec: dict, c: dict, path: str) -> tuple[str, str] | None:
    """(secret, key) of the file at `path` when a Secret volume mounted in `c` provides it."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        secret = volumes.get(m["name"], {}).get("secret")
        prefix = m["mountPath"].rstrip("/") + "/"
        if secret is None or not path.startswith(prefix):
            continue
        rel = path[len(prefix) :]
        items = {i["path"]: i["key"] for i in secret.get("items", [])}
        return secret["secretName"], items.get(rel, rel) if items else rel
    return None


def daemon_token(spec: dict, c: dict) -> tuple[str, str] | None:
    _, _, args = module_and_args(full_command(c))
    files = option_value(args, "--token-file")
    if files:
        found = secret_file(spec, c, files[-1])
        assert found is not None, f"{c['name']}: --token-file {files[-1]} is not in a mounted Secret"
        return found
    return secret_env(c, TOKEN_ENV)


def test_no_token_is_written_in_a_manifest():
    for name, doc in documents():
        assert doc["kind"] != "Secret", f"{name}: a Secret with a token belongs to the cluster, not the repository"
    for name, _, c in containers():
        secret_env(c, TOKEN_ENV)  # asserts: no literal value
        assert not any("--token=" in a or a == "--token" for a in full_command(c)), f"{name}/{c['name']}"


def test_a_daemon_beyond_loopback_takes_its_token_from_a_secret():
    seen = 0
    for name, doc in workloads():
        spec = pod_spec(doc)
        for c in spec["containers"]:
            if not is_daemon(c):
                continue
            _, _, args = module_and_args(full_command(c))
            host = (option_value(args, "--host") or ["127.0.0.1"])[-1]
            if host in LOOPBACK or option_value(args, "--uds"):
                continue
            seen += 1
            assert daemon_token(spec, c) is not None, f"{name}/{c['name']}: --host {host} without a token from a Secret"
    assert seen, "disaggregated.yaml's daemon listens beyond loopback: it must be checked here"


def test_rl_jobs_calling_a_remote_daemon_send_its_token():
    daemons = {}
    for _, doc in workloads():
        spec = pod_spec(doc)
        for c in spec["containers"]:
            if is_daemon(c):
                token = daemon_token(spec, c)
                if token is not None:
                    daemons[doc["metadata"]["name"]] = token
    for name, doc in workloads():
        for c in pod_spec(doc)["containers"]:
            cmd = full_command(c)
            if "orchestrator" not in cmd:
                continue
            sets = dict(kv.split("=", 1) for kv in option_value(module_and_args(cmd)[2], "--set"))
            endpoint = sets.get("engine.endpoint", "")
            host = endpoint.split("://", 1)[-1].split(":", 1)[0].split("/", 1)[0]
            if sets.get("engine.type") != "daemon" or host in LOOPBACK:
                continue
            assert secret_env(c, TOKEN_ENV) in set(daemons.values()), (
                f"{name}/{c['name']}: calls the daemon at {endpoint} without its token ({TOKEN_ENV} from the "
                f"daemon's Secret {sorted(set(daemons.values()))})"
            )


def engine_commands(c: dict) -> list[list[str]]:
    """The vLLM commands a container runs: itself, or the engine command of a daemon."""
    cmd = full_command(c)
    out = [cmd]
    if is_daemon(c):
        out += [shlex.split(e.replace("{", "").replace("}", "")) for e in option_value(cmd, "--engine-cmd")]
    return out


def test_vllm_dev_mode_is_not_reachable_beyond_the_pod():
    docs = documents()
    policies = [d for _, d in docs if d["kind"] == "NetworkPolicy"]
    own_labels = [pod_labels(d) for _, d in docs if d["kind"] in WORKLOADS]
    for name, doc in workloads():
        spec = pod_spec(doc)
        declared = {p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        for c in spec["containers"]:
            dev_env = any(e["name"] == "VLLM_SERVER_DEV_MODE" for e in c.get("env", []))
            for cmd in engine_commands(c):
                module = module_and_args(cmd)[1] if "-m" in cmd else cmd[0]
                host = (option_value(cmd, "--host") or [None])[-1]
                if module in ("vllm", "vllm.entrypoints.openai.api_server") or cmd[:2] == ["vllm", "serve"]:
                    if dev_env:  # vLLM binds 0.0.0.0 unless told: dev mode must say 127.0.0.1
                        assert host in LOOPBACK, f"{name}/{c['name']}: dev-mode vLLM on {host or '0.0.0.0'}"
                if module == "vllm_ext.launch" and (host or "127.0.0.1") not in LOOPBACK:
                    # vLLM itself is on 127.0.0.1 behind the gate: beyond loopback the gate serves the
                    # OpenAI API only (its dev-mode routes answer 403), and only this job's pods reach it
                    remote = (option_value(cmd, "--gate-remote-routes") or ["all"])[-1]
                    assert remote == "serving", (
                        f"{name}/{c['name']}: a gate on {host} must pass --gate-remote-routes serving"
                    )
                    covering = [p for p in policies if selects(p["spec"]["podSelector"].get("matchLabels", {}), doc)]
                    assert covering, f"{name}/{c['name']}: engine gate on {host} with no NetworkPolicy"
                    for p in covering:
                        assert "Ingress" in p["spec"]["policyTypes"]
                        for rule in p["spec"].get("ingress", []):
                            peers = rule.get("from")
                            assert peers, f"{p['metadata']['name']}: an ingress rule open to every source"
                            for peer in peers:
                                assert set(peer) == {"podSelector"}, f"{p['metadata']['name']}: peer {peer}"
                                sel = peer["podSelector"].get("matchLabels", {})
                                assert sel and any(sel.items() <= lab.items() for lab in own_labels), sel
        # a Service reaches only the ports a container declares (engines' ports are never declared)
        for _, svc in docs:
            if svc["kind"] == "Service" and selects(svc["spec"].get("selector", {}), doc):
                for p in svc["spec"].get("ports", []):
                    assert p.get("targetPort", p["port"]) in declared, (
                        f"service {svc['metadata']['name']}: port {p['port']} is no declared port of {name}"
                    )


# ── weights across nodes: from the trainer's memory, not through a shared volume ──────────────────────
def test_weight_versions_cross_nodes_from_the_trainers_memory_not_a_shared_volume():
    """An RL job whose daemon runs in another workload (another node) sends its versions from its memory
    (sync.source=memory, at its pod's address, the daemon's P2P protocol), the daemon relays them
    (--mode relay); no claim is mounted by both (no ReadWriteMany volume for weights); every engine's
    --model is a folder its own pod has; the trainer's pod admits only the daemon's pods."""
    docs = documents()
    seen = 0
    for name, trainer in [(f, d) for f, d in docs if d["kind"] in WORKLOADS]:
        for c in pod_spec(trainer)["containers"]:
            if "orchestrator" not in full_command(c):
                continue
            sets = dict(kv.split("=", 1) for kv in option_value(module_and_args(full_command(c))[2], "--set"))
            if sets.get("engine.type") != "daemon" or sets.get("engine.colocated") == "true":
                continue
            seen += 1
            where = f"{name}/{trainer['metadata']['name']}"
            assert sets.get("sync.source") == "memory", f"{where}: versions across nodes need sync.source=memory"
            assert sets.get("sync.p2p_host") == "$(POD_IP)", f"{where}: sync.p2p_host must be the pod's address"
            assert any(e["name"] == "POD_IP" for e in c.get("env", [])), where
            daemons = [
                (d, dc) for f, d in docs if f == name and d["kind"] in WORKLOADS for dc in pod_spec(d)["containers"]
            ]
            daemons = [(d, dc) for d, dc in daemons if is_daemon(dc)]
            assert daemons, f"{where}: no daemon beside it"
            for d, dc in daemons:
                args = module_and_args(full_command(dc))[2]
                assert option_value(args, "--mode") == ["relay"], f"{name}: the daemon must run --mode relay"
                protocol = (option_value(args, "--p2p-protocol") or ["tcp"])[-1]
                assert sets.get("sync.p2p_protocol", "tcp") == protocol, f"{where}: P2P protocols differ"
                claims = lambda doc: {
                    v["persistentVolumeClaim"]["claimName"]
                    for v in pod_spec(doc).get("volumes", [])
                    if "persistentVolumeClaim" in v
                }
                shared = claims(d) & claims(trainer)
                assert not shared, f"{name}: claims {shared} shared by the trainer and the daemon's pods"
                mounted = {m["mountPath"] for m in dc.get("volumeMounts", [])}
                for engine_cmd in option_value(args, "--engine-cmd"):
                    model = option_value(shlex.split(engine_cmd.replace("{", "").replace("}", "")), "--model")[-1]
                    assert any(model == m or model.startswith(m.rstrip("/") + "/") for m in mounted), (
                        f"{name}: the engines' --model {model} is on no volume of the daemon's pod"
                    )
                writers = [
                    ic
                    for ic in pod_spec(d).get("initContainers", [])
                    if option_value(module_and_args(full_command(ic))[2], "--write-engine-model")
                ]
                assert writers, f"{name}: nothing writes the engines' --model folder in the daemon's pod"
            policies = [
                p
                for f, p in docs
                if f == name
                and p["kind"] == "NetworkPolicy"
                and p["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(trainer).items()
            ]
            assert policies, f"{where}: the trainer's Mooncake port is open to every pod (no NetworkPolicy)"
    assert seen, "disaggregated.yaml's trainer calls a daemon on other nodes: it must be checked here"
