"""examples/k8s: valid Kubernetes objects, on the ftctl image, non-root, with real commands.

`kubernetes-validate` (dev extra) checks each object offline against the OpenAPI schemas
of a pinned Kubernetes release, strictly (unknown fields fail). Every `ftctl` command line
in a manifest, a container's own or an exec probe's, is parsed by the real CLI (options,
values, subcommands) without running it.
"""

from __future__ import annotations

import re
import shlex
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import pytest
import typer
import yaml

from dynamo_ftctl import __version__
from dynamo_ftctl.cli.main import app
from dynamo_ftctl.errors import InvalidInput

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "k8s"
# The oldest Kubernetes release in upstream support (2026-11; its schemas ship inside
# kubernetes-validate, so no network is needed); the failover pod's shared GPU claim
# (resource.k8s.io/v1) needs >= 1.34.
KUBERNETES_VERSION = "1.35"
IMAGE = f"ftctl:{__version__}"  # what docs/container.md builds: docker build -t ftctl:VERSION .
FTCTL_UID = 10001  # the Dockerfile's USER


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file:index, object) for every YAML document under examples/k8s."""
    found = []
    for path in sorted(EXAMPLES.rglob("*.y*ml")):
        for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                found.append((f"{path.relative_to(ROOT)}:{index}", doc))
    return found


MANIFESTS = manifests()


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of each Pod and workload template."""
    for where, doc in MANIFESTS:
        if doc["kind"] == "Pod":
            yield where, doc["spec"]
        elif doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield where, doc["spec"]["template"]["spec"]


def containers() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, pod spec, container) of every container and init container."""
    for where, spec in pod_specs():
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            yield f"{where}:{container['name']}", spec, container


def ftctl_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """The containers that run the ftctl image."""
    return [c for c in containers() if c[2]["image"].split(":")[0].endswith("ftctl")]


def ftctl_invocations() -> list[tuple[str, list[str]]]:
    """(where, argv after `ftctl`) of every ftctl command line in the manifests."""
    found = []
    for where, _, container in containers():
        if container["image"] == IMAGE:
            argv = [*container.get("command", ["ftctl"]), *container.get("args", [])]
        else:
            argv = [*container.get("command", []), *container.get("args", [])]
        if argv[:1] == ["ftctl"]:
            found.append((where, argv[1:]))
        hooks = container.get("lifecycle", {})
        for probe in ("startupProbe", "readinessProbe", "livenessProbe", "postStart"):
            command = (hooks if probe == "postStart" else container).get(probe, {}) \
                .get("exec", {}).get("command", [])
            if command[:1] == ["ftctl"]:
                found.append((f"{where}:{probe}", command[1:]))
    return found


def option_values(argv: list[str], option: str) -> list[str]:
    """The values of `option` in `argv`."""
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == option]


def entrypoint_invocation() -> list[str]:
    """argv after `ftctl` of examples/entrypoint.sh's `exec ftctl ...`, with the script's
    defaults (`: "${NAME:=value}"`) substituted for its variables."""
    script = (ROOT / "examples" / "entrypoint.sh").read_text()
    defaults = dict(re.findall(r'^: "\$\{(\w+):=([^}]*)\}"$', script, flags=re.MULTILINE))
    line = script[script.index("exec ftctl "):].replace("\\\n", " ").splitlines()[0]
    argv = shlex.split(string.Template(line).substitute(defaults))
    return argv[2:]


def parse_ftctl(args: list[str]) -> str:
    """Parse `ftctl ARGS` with the real CLI down to its leaf command; its path (`ftctl a b`).

    Raises click's UsageError (unknown command or option, bad value, missing argument)
    as running it would; nothing is invoked.
    """
    command: click.Command = typer.main.get_command(app)
    ctx = command.make_context("ftctl", list(args))
    while isinstance(ctx.command, click.Group):
        # click 8.2 moved the subcommand's words to `_protected_args` (the public name warns).
        head = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
        words = [*head, *ctx.args]
        if not words:  # a group that runs by itself (`ftctl canary --watch`)
            assert ctx.command.invoke_without_command, ctx.command_path
            break
        name, sub, rest = ctx.command.resolve_command(ctx, words)
        assert sub is not None, name
        ctx = sub.make_context(name, rest, parent=ctx)
    return ctx.command_path


@pytest.mark.parametrize(("where", "doc"), MANIFESTS, ids=[w for w, _ in MANIFESTS])
def test_valid_for_kubernetes(where: str, doc: dict[str, Any]) -> None:
    """Each object validates strictly against the pinned Kubernetes release's schema."""
    assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_validation_catches_a_misspelt_field() -> None:
    """The schema check is strict: an unknown container field fails (the check can fail)."""
    _, doc = next(m for m in MANIFESTS if m[1]["kind"] == "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_proxy_and_daemon_run_from_the_image() -> None:
    """The proxy and the canary daemon examples run the ftctl image, tagged with this version."""
    roles = {tuple(c.get("args", [])[:1] + (["--watch"] if "--watch" in c.get("args", []) else []))
             for _, _, c in ftctl_containers()}
    assert {("proxy",), ("canary", "--watch")} <= roles
    for where, _, container in ftctl_containers():
        assert container["image"] == IMAGE, where
        assert "command" not in container, f"{where}: the image's entrypoint is ftctl"


def test_ftctl_containers_are_locked_down() -> None:
    """Image containers run as the image's non-root uid, no privilege escalation, read-only
    root, every capability dropped, with resource requests; those that serve (--listen),
    with HTTP probes on their port."""
    for where, spec, container in ftctl_containers():
        pod = spec.get("securityContext", {})
        own = container.get("securityContext", {})
        assert own.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
        assert own.get("runAsUser", pod.get("runAsUser", FTCTL_UID)) == FTCTL_UID, where
        assert own["allowPrivilegeEscalation"] is False, where
        assert own["readOnlyRootFilesystem"] is True, where
        assert own["capabilities"]["drop"] == ["ALL"], where
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), where
        if "--listen" not in container["args"]:  # a batch job (the load shards)
            continue
        listen = container["args"][container["args"].index("--listen") + 1]
        port = int(listen.rpartition(":")[2])
        assert listen.startswith("0.0.0.0:"), f"{where}: other pods must reach it"
        assert [p["containerPort"] for p in container["ports"]] == [port], where
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": port}, where
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/etc/ftctl" in mounts, f"{where}: FTCTL_INVENTORY is /etc/ftctl/ftctl.yaml"


def test_services_target_the_ports_their_pods_name() -> None:
    """Each Service selects a workload of the examples and targets a port it declares."""
    workloads = {doc["metadata"]["name"]: doc for _, doc in MANIFESTS
                 if doc["kind"] in ("Deployment", "StatefulSet")}
    services = [doc for _, doc in MANIFESTS if doc["kind"] == "Service"]
    assert services
    for service in services:
        target = next(w for w in workloads.values()
                      if w["spec"]["selector"]["matchLabels"] == service["spec"]["selector"])
        names = {p["name"] for c in target["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, service["metadata"]["name"]


def test_every_ftctl_command_line_parses() -> None:
    """Each ftctl invocation (container args, exec probes) is accepted by the real CLI."""
    invocations = ftctl_invocations()
    assert len(invocations) >= 5  # the proxy, the daemon, two canary probes, the load job
    paths = {parse_ftctl(args) for _, args in invocations}
    assert paths == {"ftctl proxy", "ftctl canary", "ftctl canary record", "ftctl load"}


def _expanded_args(container: dict[str, Any], values: dict[str, str]) -> list[str]:
    """The container's args with Kubernetes' `$(VAR)` expanded: literal env values, and
    `values` for those the API server fills in (field references)."""
    env = {e["name"]: e.get("value", values.get(e["name"])) for e in container.get("env", [])}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container["args"]]


def test_the_load_job_runs_one_shard_per_index() -> None:
    """load-job.yaml: an Indexed Job whose pod I runs `--shard I/N` (N = completions =
    parallelism, I from the completion index), all from one start time, results to a
    volume; each index's command line is a valid run."""
    from dynamo_ftctl.loadgen.config import parse_shard, parse_start_at

    jobs = [doc for where, doc in MANIFESTS
            if where.startswith("examples/k8s/load-job.yaml") and doc["kind"] == "Job"]
    assert len(jobs) == 1
    job = jobs[0]["spec"]
    assert job["completionMode"] == "Indexed"
    count = job["completions"]
    assert job["parallelism"] == count
    (container,) = job["template"]["spec"]["containers"]
    index_env = next(e for e in container["env"] if e["name"] == "JOB_COMPLETION_INDEX")
    assert index_env["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    outs = set()
    for index in range(count):
        args = _expanded_args(container, {"JOB_COMPLETION_INDEX": str(index)})
        assert parse_ftctl(args) == "ftctl load"
        assert parse_shard(args[args.index("--shard") + 1]).index == index
        assert parse_shard(args[args.index("--shard") + 1]).count == count
        parse_start_at(args[args.index("--start-at") + 1])
        out = args[args.index("--out") + 1]
        assert any(out.startswith(m + "/") for m in mounts), out
        outs.add(out)
    assert len(outs) == count  # each shard its own directory
    assert "/tmp" in mounts  # --procs writes there under a read-only root


def test_the_failover_entrypoint_parses() -> None:
    """examples/entrypoint.sh (failover-pod.yaml's command) runs a valid `ftctl failover run`."""
    args = entrypoint_invocation()
    assert args[:2] == ["failover", "run"]
    assert args[args.index("--") + 1:][:2] == ["vllm", "serve"]
    assert parse_ftctl(args) == "ftctl failover run"


@pytest.mark.parametrize("args", [
    ["proxy", "--listn", "0.0.0.0:8000"],
    ["canary", "--watch", "--timeout", "soon"],
    ["lock", "acquir"],
    ["failover", "run"],
])
def test_parse_rejects_what_ftctl_would(args: list[str]) -> None:
    """The command-line check fails on a misspelt option or command, a bad value, a
    missing argument."""
    with pytest.raises((click.UsageError, InvalidInput)):  # unknown commands: InvalidInput
        parse_ftctl(args)


def test_every_canary_set_a_manifest_reads_is_recorded_before_it_is_read() -> None:
    """A `--set PATH` of a probe or daemon is written by a `canary record --out PATH` of the
    same pod that runs before it (an init container, or the engine's postStart hook, which
    the kubelet finishes before it starts probes): no manifest names a set nobody has."""
    readers = 0
    for where, spec in pod_specs():
        before = [[*c.get("command", ["ftctl"]), *c.get("args", [])]
                  for c in spec.get("initContainers", [])]
        before += [c.get("lifecycle", {}).get("postStart", {}).get("exec", {})
                   .get("command", []) for c in spec["containers"]]
        recorded = {path for argv in before if argv[:3] == ["ftctl", "canary", "record"]
                    for path in option_values(argv, "--out")}
        for container in spec["containers"]:
            lines = [[*container.get("command", []), *container.get("args", [])]]
            lines += [container.get(probe, {}).get("exec", {}).get("command", [])
                      for probe in ("startupProbe", "readinessProbe", "livenessProbe")]
            for argv in lines:
                for path in option_values(argv, "--set"):
                    readers += 1
                    assert path in recorded, f"{where}: --set {path} is recorded by nobody"
    assert readers >= 3  # the daemon and the two probes


def test_sleep_mode_engines_run_in_vllm_dev_mode() -> None:
    """vLLM serves /sleep only with VLLM_SERVER_DEV_MODE=1: the entrypoint that starts it with
    --enable-sleep-mode sets and exports it, and no container asks for sleep mode without."""
    script = (ROOT / "examples" / "entrypoint.sh").read_text()
    if "--enable-sleep-mode" in script:
        assert re.search(r"^VLLM_SERVER_DEV_MODE=1$", script, flags=re.MULTILINE)
        assert re.search(r"^export .*\bVLLM_SERVER_DEV_MODE\b", script, flags=re.MULTILINE)
    for where, _, container in containers():
        argv = [*container.get("command", []), *container.get("args", [])]
        if "--enable-sleep-mode" in argv:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("VLLM_SERVER_DEV_MODE") == "1", where


def test_both_engines_of_the_failover_pod_claim_the_same_gpu() -> None:
    """Primary and shadow name one pod-level claim, made from a template in the examples
    that asks for a GPU device: the sleeping shadow wakes on the primary's GPU."""
    templates = {doc["metadata"]["name"]: doc for _, doc in MANIFESTS
                 if doc["kind"] == "ResourceClaimTemplate"}
    pod = next(doc for _, doc in MANIFESTS if doc["metadata"]["name"] == "llm-failover"
               and doc["kind"] == "Pod")
    claims = {c["name"]: c["resourceClaimTemplateName"] for c in pod["spec"]["resourceClaims"]}
    engines = pod["spec"]["containers"]
    assert len(engines) == 2
    named = [{c["name"] for c in e["resources"]["claims"]} for e in engines]
    assert named[0] == named[1] != set()
    for claim in named[0]:
        template = templates[claims[claim]]
        requests = template["spec"]["spec"]["devices"]["requests"]
        assert any(r["exactly"]["deviceClassName"] == "gpu.nvidia.com" for r in requests)
        assert all("nvidia.com/gpu" not in e["resources"].get("limits", {}) for e in engines)


def test_the_discovery_example_follows_its_headless_service() -> None:
    """vllm-discovery.yaml: the proxy's inventory (ConfigMap) loads and resolves the headless
    Service's name in the namespace the file says; the Service is headless over ready pods
    and names the StatefulSet's port `http` (so its SRV records are `_http._tcp`)."""
    from dynamo_ftctl.inventory import load_inventory, parse_inventory

    docs = {(d["kind"], d["metadata"]["name"]): d for w, d in MANIFESTS
            if w.startswith("examples/k8s/vllm-discovery.yaml")}
    service = docs[("Service", "vllm")]["spec"]
    assert service["clusterIP"] == "None"
    assert service["publishNotReadyAddresses"] is False
    assert docs[("StatefulSet", "vllm")]["spec"]["serviceName"] == "vllm"
    inventory = parse_inventory(docs[("ConfigMap", "ftctl-vllm-inventory")]["data"]["ftctl.yaml"])
    (source,) = inventory.discovery
    assert source.dns == "vllm.llm.svc.cluster.local"
    assert "kubectl -n llm apply" in (EXAMPLES / "vllm-discovery.yaml").read_text()
    assert service["ports"][0]["name"] == "http"
    assert source.port == service["ports"][0]["port"]
    (example,) = load_inventory(ROOT / "examples" / "discovery.yaml").discovery
    assert (example.dns, example.port) == (source.dns, source.port)
