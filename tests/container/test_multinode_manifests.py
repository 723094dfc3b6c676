"""The multi-node manifests, checked without a cluster: examples/kserve/multinode/ (a KServe
ServingRuntime with a workerSpec, and its InferenceService) and examples/lws/ (a LeaderWorkerSet
and its Service).

- Schemas. KServe's objects against the schema the `kserve` package's models carry, the
  ServingRuntime's workerSpec composed as KServe's Go type is (tests/k8s_schema.py); the
  LeaderWorkerSet's pod templates and the Service against the `kubernetes` package's
  (V1PodTemplateSpec, V1Service). No package here carries LeaderWorkerSet's own schema
  (leaderworkerset.x-k8s.io/v1: its CRD ships with LWS's Go code only), so of its spec only the
  fields this shape depends on are checked, by name and value.
- Each pod's configuration. Its environment is built as the kubelet builds it, with what the
  operator adds, as their code does (LWS puts LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and
  LWS_WORKER_INDEX first; KServe appends TENSOR_PARALLEL_SIZE, PIPELINE_PARALLEL_SIZE,
  RAY_NODE_COUNT, ... last), $(VAR) expanded from the variables before it (in args, from all
  of them); then lmi-serve's own configuration loads it, refusing what it would refuse.
- Agreement. Every node holds the same degrees, node count and rendezvous; the ranks are 0 ..
  nnodes-1 with the server on rank 0; tensor x pipeline equals the nodes' GPUs; every node's
  option.master_addr reaches the leader.
- vLLM's engine arguments (option.nnodes, ...) are checked against the installed vLLM where it is
  (the vLLM lane), else that test skips.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from k8s_schema import Document, SchemaBuilder, load_schema, schema_errors
from optional_deps import need

from handlers.config import Config, check_effects, load_config, parse_args

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KSERVE_RUNTIME = EXAMPLES / "kserve" / "multinode" / "cluster-serving-runtime.yaml"
KSERVE_SERVICE = EXAMPLES / "kserve" / "multinode" / "inference-service.yaml"
LWS_FILE = EXAMPLES / "lws" / "leader-worker-set.yaml"
MODEL_MOUNT = "/mnt/models"
GPU = "nvidia.com/gpu"
NAMESPACE = "models"
GENERATION = "1"  # the InferenceService's, in KServe's head Service name
# vLLM's multi-node arguments, as docs/deployment.md lists them: the only settings lmi-serve
# passes to vLLM by name here; a misspelled OPTION_* would add another.
MULTI_NODE_ARGS = {"nnodes", "node_rank", "master_addr", "master_port"}
# KServe refuses these in an InferenceService's env: it sets them from workerSpec.
KSERVE_OWN = {"TENSOR_PARALLEL_SIZE", "PIPELINE_PARALLEL_SIZE"}
# LeaderWorkerSet's restart policies (its API: RecreateGroupOnPodRestart, RecreateGroupAfterStart,
# None).
LWS_RESTART = {"RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"}


def load_all(path: Path) -> list[Document]:
    return list(yaml.safe_load_all(path.read_text()))


# --- a pod as the kubelet starts it ---------------------------------------------------------


@dataclass
class Pod:
    """One pod of a group: its container, the variables its operator adds (LWS first, KServe
    last), its downward API values, and what lmi-serve makes of it all."""

    ip: str
    container: Document
    first: dict[str, str] = field(default_factory=dict)
    last: dict[str, str] = field(default_factory=dict)
    rendered: Callable[[str], str] = str  # KServe's {{.Name}} in a runtime's containers
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)

    def start(self) -> Pod:
        fields = {"status.podIP": self.ip, "metadata.namespace": NAMESPACE}
        raw = dict(self.first)
        for var in self.container.get("env", []):
            value = var["value"] if "value" in var else fields[
                var["valueFrom"]["fieldRef"]["fieldPath"]]
            raw.setdefault(var["name"], self.rendered(value))
        raw.update(self.last)  # KServe overwrites a variable in place, or appends it
        for name, value in raw.items():
            self.env[name] = expand(value, self.env)  # from the variables before it only
        self.args = [expand(self.rendered(arg), self.env) for arg in self.container["args"]]
        return self

    def config(self, mount: Path) -> Config:
        argv = [arg.replace(MODEL_MOUNT, str(mount)) for arg in self.args]
        config = load_config(parse_args(argv), env=self.env)
        check_effects(config)
        return config

    @property
    def gpus(self) -> int:
        return int(self.container["resources"]["limits"][GPU])


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; a reference to an unknown variable stays as written."""
    return re.sub(r"\$\((\w+)\)", lambda ref: env.get(ref[1], ref[0]), text)


@dataclass
class Group:
    """The pods of one copy of the model, leader first, and the cluster DNS names that reach
    them."""

    pods: list[Pod]
    dns: dict[str, str]

    def resolve(self, host: str) -> str:
        return self.dns.get(host, host)


def kserve_group() -> Group:
    """The pods KServe's controller makes of the two documents (multiNodeProcess,
    computeRayNodeAndGPUs in pkg/controller/v1beta1/inferenceservice/components/predictor.go)."""
    runtime, service = load_all(KSERVE_RUNTIME)[0], load_all(KSERVE_SERVICE)[0]
    name = service["metadata"]["name"]
    spec, worker_spec = runtime["spec"], runtime["spec"]["workerSpec"]
    sizes = {**worker_spec, **service["spec"]["predictor"].get("workerSpec", {})}
    tp, pp = sizes["tensorParallelSize"], sizes["pipelineParallelSize"]
    head_container = spec["containers"][0]
    worker_container = worker_spec["containers"][0]
    head_gpus = int(head_container["resources"]["requests"][GPU])
    worker_gpus = int(worker_container["resources"]["requests"][GPU])
    nodes = math.ceil(tp * pp / worker_gpus)
    assert tp * pp <= head_gpus + worker_gpus * (nodes - 1), "KServe: not enough GPUs"
    head_service = f"{name}-head-{GENERATION}"
    rendered = lambda text: text.replace("{{.Name}}", name)  # noqa: E731
    head = Pod("10.0.0.10", head_container, rendered=rendered, last={
        "TENSOR_PARALLEL_SIZE": str(tp), "PIPELINE_PARALLEL_SIZE": str(pp),
        "RAY_NODE_COUNT": str(nodes), "REQUEST_GPU_COUNT": str(head_gpus), "MODEL_NAME": name,
        "MODEL_DIR": MODEL_MOUNT})
    workers = [Pod(f"10.0.0.{11 + i}", worker_container, rendered=rendered, last={
        "RAY_NODE_COUNT": str(nodes), "REQUEST_GPU_COUNT": str(worker_gpus), "ISVC_NAME": name,
        "HEAD_SVC": head_service}) for i in range(nodes - 1)]  # the worker Deployment's replicas
    # The head Service is headless and publishes the head before it is ready: its name is the
    # head pod's address.
    return Group([pod.start() for pod in [head, *workers]],
                 {f"{head_service}.{NAMESPACE}.svc.cluster.local": head.ip})


def lws_group() -> Group:
    """The pods of the LeaderWorkerSet's first group (LWS's pod webhook: AddLWSVariables)."""
    lws = load_all(LWS_FILE)[0]
    name, template = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    size, leader = template["size"], f"{name}-0.{name}.{NAMESPACE}"
    pods = [Pod(f"10.0.1.{10 + index}",
                template["leaderTemplate" if index == 0 else "workerTemplate"]["spec"][
                    "containers"][0],
                first={"LWS_LEADER_ADDRESS": leader, "LWS_GROUP_SIZE": str(size),
                       "LWS_WORKER_INDEX": str(index)}).start() for index in range(size)]
    return Group(pods, {leader: pods[0].ip})


GROUPS = {"kserve": kserve_group, "lws": lws_group}


@pytest.fixture(params=sorted(GROUPS))
def group(request: pytest.FixtureRequest) -> Group:
    return GROUPS[request.param]()


@pytest.fixture
def mount(tmp_path: Path) -> Path:
    """A Hugging Face checkpoint's files where the pods see /mnt/models."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").touch()
    return tmp_path


@pytest.fixture(scope="module")
def schema() -> SchemaBuilder:
    return load_schema("the multi-node examples")


# --- schemas --------------------------------------------------------------------------------


def test_kserve_documents_match_kserve_schema(schema: SchemaBuilder) -> None:
    (runtime,), (service,) = load_all(KSERVE_RUNTIME), load_all(KSERVE_SERVICE)
    assert schema_errors(schema, "V1alpha1ClusterServingRuntime", runtime) == []
    assert schema_errors(schema, "V1beta1InferenceService", service) == []
    assert runtime["spec"]["workerSpec"]["containers"], "KServe requires the worker's container"


def test_schema_catches_a_misspelled_worker_spec_key(schema: SchemaBuilder) -> None:
    """The runtime's workerSpec is checked, not taken as anything (tests/k8s_schema.py)."""
    (runtime,) = load_all(KSERVE_RUNTIME)
    worker = runtime["spec"]["workerSpec"]
    worker["tensorParallelism"] = worker.pop("tensorParallelSize")
    assert ("spec/workerSpec: Additional properties are not allowed ('tensorParallelism' was "
            "unexpected)") in schema_errors(schema, "V1alpha1ClusterServingRuntime", runtime)


def test_lws_pod_templates_and_service_match_kubernetes_schema(schema: SchemaBuilder) -> None:
    lws, service = load_all(LWS_FILE)
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        assert schema_errors(schema, "V1PodTemplateSpec", template[role]) == [], role
    assert schema_errors(schema, "V1Service", service) == []
    # What LWS's schema would say of the fields this shape depends on.
    assert isinstance(lws["spec"]["replicas"], int) and lws["spec"]["replicas"] >= 1
    assert isinstance(template["size"], int) and template["size"] >= 2
    assert template["restartPolicy"] in LWS_RESTART


# --- what each pod starts -------------------------------------------------------------------


def test_every_setting_is_one_lmi_serve_takes(group: Group, mount: Path) -> None:
    """Each pod's configuration loads as lmi-serve loads it; the only settings passed to vLLM by
    name are its multi-node ones (a misspelled OPTION_* would be one more), each resolved (no
    $(VAR) left), and none is a variable KServe sets itself."""
    for pod in group.pods:
        config = pod.config(mount)
        assert set(config.engine_args) == MULTI_NODE_ARGS, pod.ip
        unresolved = [text for text, _ in config.engine_args.values() if "$(" in text]
        assert unresolved == [], pod.ip
        assert config.rolling_batch == "vllm" and config.model_dir == mount.resolve()
        assert not KSERVE_OWN & {var["name"] for var in pod.container.get("env", [])}


def test_the_nodes_make_one_engine(group: Group, mount: Path) -> None:
    """Every node holds the same split and rendezvous; ranks 0 .. nnodes-1, one a pod; each
    node's GPUs hold its share of tensor x pipeline; every node's master address reaches the
    leader, the pod serving the ports."""
    configs = [pod.config(mount) for pod in group.pods]
    arg = lambda config, name: config.engine_args[name][0]  # noqa: E731
    shared = {(c.tensor_parallel_degree, c.pipeline_parallel_degree, arg(c, "nnodes"),
               arg(c, "master_port")) for c in configs}
    assert len(shared) == 1, shared
    ((tp, pp, nnodes, _port),) = shared
    assert int(nnodes) == len(group.pods)
    assert [int(arg(c, "node_rank")) for c in configs] == list(range(len(group.pods)))
    assert all(pod.gpus * int(nnodes) == tp * pp for pod in group.pods)
    leader = group.pods[0]
    assert {group.resolve(arg(c, "master_addr")) for c in configs} == {leader.ip}
    assert [bool(pod.container.get("ports")) for pod in group.pods] == [
        True, *[False] * (len(group.pods) - 1)]
    assert leader.container["ports"][0]["containerPort"] == configs[0].port


def test_lws_service_sends_requests_to_the_leaders_only() -> None:
    lws, service = load_all(LWS_FILE)
    template = lws["spec"]["leaderWorkerTemplate"]
    # LWS labels every pod of the set with its name.
    labels = {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}
    selector = service["spec"]["selector"].items()
    leader_labels = {**template["leaderTemplate"]["metadata"]["labels"], **labels}
    worker_labels = {**template["workerTemplate"].get("metadata", {}).get("labels", {}), **labels}
    assert selector <= leader_labels.items() and not selector <= worker_labels.items()
    ports = {p["name"]: p["containerPort"]
             for p in template["leaderTemplate"]["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {ports["http"], ports["h2c"]}


def test_vllm_takes_the_engine_arguments(group: Group, mount: Path) -> None:
    """Where vLLM is installed: its engine arguments accept each pod's, and rank 0 serves while
    every other rank runs as a follower."""
    need("vllm", "vLLM's engine arguments are checked where vLLM is installed (the vLLM lane)")
    from handlers.engine import registry
    from handlers.engine.vllm.args import engine_kwargs, vllm_fields

    for rank, pod in enumerate(group.pods):
        config = pod.config(mount)
        registry.check(config)
        kwargs = engine_kwargs(config, str(mount), vllm_fields(), pod.gpus)
        assert {name: kwargs[name] for name in ("nnodes", "node_rank")} == {
            "nnodes": len(group.pods), "node_rank": rank}
        follow = registry.follower(config)
        assert (follow is None) == (rank == 0)
