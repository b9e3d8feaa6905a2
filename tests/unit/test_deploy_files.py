"""The deployment files parse with Ray's own schemas and agree with each other (no Ray cluster started).

- ``cluster.yaml`` (``ray up``) against ``ray/autoscaler/ray-schema.json``, then through Ray's own config
  preparation (defaults merged, as ``ray up`` does before it calls the cloud);
- ``deploy/serve_config.yaml`` and ``deploy/serve_config_cpu.yaml`` against Serve's ``ServeDeploySchema``;
  each application is built from its ``import_path`` and ``args`` and its ``deployments:`` overrides are
  applied with the Serve controller's own function, as ``serve deploy`` would;
- ``deploy/rayservice.yaml`` (KubeRay): its serveConfigV2 is the GPU serve config;
- the clusters fit the application: GPU workers hold a DiT replica, the head holds the pinned deployments.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private.application_state import override_deployment_info
from ray.serve._private.build_app import build_app as serve_build_app
from ray.serve._private.deploy_utils import deploy_args_to_deployment_info
from ray.serve.schema import ServeDeploySchema

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster.yaml"
SERVE_GPU = ROOT / "deploy" / "serve_config.yaml"
SERVE_CPU = ROOT / "deploy" / "serve_config_cpu.yaml"
RAYSERVICE = ROOT / "deploy" / "rayservice.yaml"
APP_DEPLOYMENTS = {"Ingress", "BucketCoordinator", "DiTReplica"}
HEAD_RESOURCE = "bcg_head"


def _load(path: Path):
    return yaml.safe_load(path.read_text())


def _gpu_app() -> dict:
    (app,) = _load(SERVE_GPU)["applications"]
    return app


def _resolved_deployments(serve_config: dict) -> dict:
    """Deployment infos of the config's one application after its overrides, as the Serve controller does.

    The controller imports ``import_path``, calls it with ``args``, builds the application and applies the
    config's ``deployments:`` options with ``override_deployment_info`` (``application_state.py``).
    """
    (app,) = ServeDeploySchema.model_validate(serve_config).applications
    application = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args)
    built = serve_build_app(application, name=app.name)
    infos = {
        d.name: deploy_args_to_deployment_info(
            deployment_name=d.name,
            deployment_config_proto_bytes=d._deployment_config.to_proto_bytes(),
            replica_config_proto_bytes=d._replica_config.to_proto_bytes(),
            deployer_job_id="01000000",  # any job id: no cluster is involved
            app_name=app.name,
        )
        for d in built.deployments
    }
    return override_deployment_info(infos, app)


# ------------------------------------------------------------------------------------------- cluster.yaml


def test_cluster_yaml_is_valid_for_rays_cluster_launcher():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load(CLUSTER)
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)  # raises on an unknown key or a wrong type
    prepared = prepare_config(config)  # merges the provider's defaults, as `ray up` does
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_cluster_yaml_schema_check_catches_a_typo():
    config = _load(CLUSTER)
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config["available_node_types"]["head_cpu"]["min_worker"] = 0  # misspelt: not a Ray key
    with pytest.raises(jsonschema.ValidationError, match="min_worker"):
        jsonschema.validate(config, schema)


def test_cluster_head_is_cpu_only_and_holds_the_pinned_deployments():
    config = _load(CLUSTER)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]["resources"]
    assert head["GPU"] == 0 and head["CPU"] >= 1
    # the ingress and the coordinator ask for bcg_head: the head offers it, no worker does
    infos = _resolved_deployments(_load(SERVE_GPU))
    pinned = {n for n, i in infos.items() if HEAD_RESOURCE in i.replica_config.resource_dict}
    assert pinned == {"Ingress", "BucketCoordinator"}
    demand = sum(i.replica_config.resource_dict[HEAD_RESOURCE] * i.deployment_config.num_replicas
                 for n, i in infos.items() if n in pinned)
    assert head[HEAD_RESOURCE] >= demand
    workers = {k: v for k, v in types.items() if k != config["head_node_type"]}
    assert workers and all(HEAD_RESOURCE not in v["resources"] for v in workers.values())


def test_each_gpu_worker_type_holds_a_dit_replica_and_the_cluster_holds_all():
    config = _load(CLUSTER)
    dit = _resolved_deployments(_load(SERVE_GPU))["DiTReplica"]
    need = dit.replica_config.resource_dict
    assert need["GPU"] >= 1  # the GPU serve config really asks for GPUs
    workers = {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}
    gpu_types = {k: v for k, v in workers.items() if v["resources"].get("GPU", 0) > 0}
    assert len(gpu_types) >= 2, sorted(workers)
    for name, t in gpu_types.items():
        res = t["resources"]
        assert res["GPU"] >= need["GPU"], name
        assert res["CPU"] >= need["CPU"] * (res["GPU"] // need["GPU"]), name  # CPUs for a replica per GPU
        assert 0 <= t["min_workers"] <= t["max_workers"], name
    scaling = dit.deployment_config.autoscaling_config
    assert scaling is not None and scaling.policy.policy_function == "router.autoscaling.BucketLoadPolicy"
    # the minimum replicas start with the cluster: its minimum GPU workers hold them all ...
    at_start = sum(t["min_workers"] * (t["resources"]["GPU"] // need["GPU"]) for t in gpu_types.values())
    assert at_start >= scaling.initial_replicas >= scaling.min_replicas
    # ... and its largest size holds the most the policy may ask for
    at_most = sum(t["max_workers"] * (t["resources"]["GPU"] // need["GPU"]) for t in gpu_types.values())
    assert at_most >= scaling.max_replicas
    assert config["max_workers"] >= sum(t["max_workers"] for t in workers.values())
    assert config["max_workers"] >= sum(t["min_workers"] for t in workers.values())


def test_cluster_installs_torch_first_and_mounts_the_serve_config_and_token():
    config = _load(CLUSTER)
    steps = config["setup_commands"]
    torch_at = next(i for i, c in enumerate(steps) if "install" in c and "torch" in c)
    project_at = next(i for i, c in enumerate(steps) if "~/bcg-serve" in c and "install" in c)
    assert torch_at < project_at
    mounts = config["file_mounts"]
    assert (ROOT / mounts["~/bcg-serve"] / "deploy" / "serve_config.yaml").is_file()
    assert mounts["~/.ray/auth_token"] == "~/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = [c for c in config[key] if "ray start" in c]
        assert len(start) == 1 and "RAY_AUTH_MODE=token" in start[0], key
    assert "--head" in " ".join(config["head_start_ray_commands"])


# --------------------------------------------------------------------------------------- serve configs


@pytest.mark.parametrize("path", [SERVE_GPU, SERVE_CPU], ids=["gpu", "cpu"])
def test_serve_config_is_a_valid_serve_deploy_file(path):
    data = _load(path)
    schema = ServeDeploySchema.model_validate(data)
    # ServeDeploySchema ignores unknown top-level keys (forward compatibility): catch typos here
    assert set(data) <= set(ServeDeploySchema.model_fields), set(data) - set(ServeDeploySchema.model_fields)
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("bcg", "/", "deployments.app:build_app")
    assert schema.http_options.port == 8000


@pytest.mark.parametrize("path", [SERVE_GPU, SERVE_CPU], ids=["gpu", "cpu"])
def test_serve_config_args_build_the_application_with_its_overrides(path):
    args = _load(path)["applications"][0]["args"]
    infos = _resolved_deployments(_load(path))
    assert set(infos) == APP_DEPLOYMENTS
    dit = infos["DiTReplica"]
    scaling = args["config"].get("autoscaling", {})
    if scaling.get("enabled"):
        ac = dit.deployment_config.autoscaling_config
        assert (ac.min_replicas, ac.max_replicas) == (scaling["min_replicas"], scaling["max_replicas"])
        assert ac.upscale_delay_s == ac.downscale_delay_s == 0  # the policy applies the delays
        assert ac.policy.policy_kwargs["downscale_delay_s"] == scaling["downscale_delay_s"]
    else:
        assert dit.deployment_config.num_replicas == args["dit_replicas"]
    assert dit.replica_config.ray_actor_options["num_gpus"] == args["dit_num_gpus"]
    assert infos["Ingress"].deployment_config.num_replicas == args.get("ingress_replicas", 1)
    # overrides may add a resource, never CPUs: the ingress and the coordinator stay at 0 CPUs
    assert infos["Ingress"].replica_config.resource_dict["CPU"] == 0
    assert infos["BucketCoordinator"].replica_config.resource_dict["CPU"] == 0


def test_gpu_serve_config_overrides_reach_the_deployments():
    dit = _resolved_deployments(_load(SERVE_GPU))["DiTReplica"]
    assert dit.deployment_config.graceful_shutdown_timeout_s == 120
    assert dit.deployment_config.autoscaling_config.min_replicas == 2
    assert dit.replica_config.resource_dict["GPU"] == 1


def test_an_override_of_an_unknown_deployment_is_refused():
    data = _load(SERVE_CPU)
    data["applications"][0]["deployments"] = [{"name": "DitReplica", "num_replicas": 2}]  # misspelt
    with pytest.raises(ValueError, match="DitReplica"):
        _resolved_deployments(data)


def test_cpu_serve_config_needs_no_gpu_and_no_head_resource():
    infos = _resolved_deployments(_load(SERVE_CPU))
    for name, info in infos.items():
        assert info.replica_config.resource_dict.get("GPU", 0) == 0, name
        assert HEAD_RESOURCE not in info.replica_config.resource_dict, name
    cfg = _load(SERVE_CPU)["applications"][0]["args"]["config"]
    assert cfg["model"]["device"] == "cpu" and cfg["model"]["path"] is None
    assert cfg["buckets"]["batch_sizes"] == [1, 2, 4]
    assert cfg["buckets"]["resolutions"] == ["256x256", "512x512"]


# --------------------------------------------------------------------------------------- rayservice.yaml


def test_rayservice_embeds_the_gpu_serve_config():
    service = _load(RAYSERVICE)
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(embedded)
    assert embedded == _load(SERVE_GPU)
    assert service["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__


def test_rayservice_workers_request_gpus_and_the_head_none():
    cluster = _load(RAYSERVICE)["spec"]["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    # KubeRay pastes the value into the `ray start` shell command line: a shell-quoted JSON object
    (resources,) = shlex.split(head["rayStartParams"]["resources"])
    assert json.loads(resources)[HEAD_RESOURCE] >= 1
    (head_box,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head_box["resources"]["limits"]
    need = _resolved_deployments(_load(SERVE_GPU))["DiTReplica"].replica_config.resource_dict
    per_pod = []
    for group in cluster["workerGroupSpecs"]:
        (box,) = group["template"]["spec"]["containers"]
        gpus = int(box["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus >= need["GPU"], group["groupName"]
        assert int(box["resources"]["requests"]["nvidia.com/gpu"]) == gpus
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert box["image"] == head_box["image"]
        per_pod.append((group["minReplicas"], gpus))
    scaling = _gpu_app()["args"]["config"]["autoscaling"]
    assert sum(n * (g // need["GPU"]) for n, g in per_pod) >= scaling["min_replicas"]
    assert sum(group["maxReplicas"] * (g // need["GPU"])
               for group, (_, g) in zip(cluster["workerGroupSpecs"], per_pod, strict=True)) >= scaling["max_replicas"]
    assert cluster["enableInTreeAutoscaling"] is True
