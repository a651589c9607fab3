"""docs/k8s/deltafleet-inferencepool.yaml (docs/kubernetes.md): the InferencePool selects the
Deployment's pods on the port the server listens on, the HTTPRoute sends to that pool, and the
server's arguments compose into a valid serve configuration (no cluster here: the structure only)."""
from __future__ import annotations

from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[1]


def test_the_manifest_wires_the_pool_to_the_servers():
    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "docs/k8s/deltafleet-inferencepool.yaml").read_text())}
    assert set(docs) == {"Deployment", "InferencePool", "HTTPRoute"}
    dep, pool, route = docs["Deployment"], docs["InferencePool"], docs["HTTPRoute"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    pod = dep["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (server,) = pod["spec"]["containers"]
    args = dict(a.split("=", 1) for a in server["args"])
    (target,) = pool["spec"]["targetPorts"]
    assert target["number"] == int(args["port"]) == server["ports"][0]["containerPort"]
    assert server["readinessProbe"]["httpGet"] == {"path": "/health", "port": int(args["port"])}
    assert args["host"] == "0.0.0.0"  # a pod's address, not loopback
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == 9002
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                       "name": pool["metadata"]["name"]}
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="serve", overrides=server["args"])
    assert cfg.port == 8000 and cfg.model.name == "smollm2" and cfg.base_dir.startswith("/data/")


def test_the_helm_chart_the_docs_install_makes_the_picker_the_pool_names():
    """Found by a fresh user: docs/kubernetes.md installed the extension's chart as release
    ``deltafleet-epp``, whose picker Service the chart names ``<release>-epp`` (``deltafleet-epp-epp``)
    and whose pool ``<release>``: the manifest's ``endpointPickerRef`` named no Service there was."""
    import re

    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "docs/k8s/deltafleet-inferencepool.yaml").read_text())}
    pool, dep = docs["InferencePool"], docs["Deployment"]
    (release,) = re.findall(r"helm install (\S+) \S+/charts/inferencepool", (REPO / "docs/kubernetes.md").read_text())
    assert f"{release}-epp" == pool["spec"]["endpointPickerRef"]["name"]
    assert release == pool["metadata"]["name"]  # the chart's pool is the manifest's own
    labels = dict(re.findall(r"--set inferencePool\.modelServers\.matchLabels\.(\w+)=(\S+?)[`\s]",
                             (REPO / "docs/kubernetes.md").read_text()))
    assert labels and labels.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_the_replicas_run_the_installed_command_and_write_nothing_to_the_shared_volume():
    """The container runs ``deltafleet serve`` (an image with the package installed has no
    ``serve/run.py`` in its working folder), mounts the family read-only, and keeps Hydra's run
    folder in the pod: ``paths.root=/data`` alone put it on the shared volume, which every replica
    wrote into (and a read-only claim refused, so the server never started)."""
    from deltafleet.cli import JOBS

    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "docs/k8s/deltafleet-inferencepool.yaml").read_text())}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    assert server["command"][0] == "deltafleet" and JOBS[server["command"][1]][0] == "deltafleet.serve.run"
    args = dict(a.split("=", 1) for a in server["args"])
    (mount,) = server["volumeMounts"]
    assert mount["readOnly"] is True and args["paths.root"] == mount["mountPath"]
    assert not Path(args["hydra.run.dir"]).is_relative_to(mount["mountPath"])
