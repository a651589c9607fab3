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
