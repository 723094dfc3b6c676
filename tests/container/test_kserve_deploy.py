"""examples/kserve/: the ClusterServingRuntime and the InferenceService, checked without a cluster
against KServe's own schema as the `kserve` package ships it (its OpenAPI-generated model
classes, with Kubernetes' from the `kubernetes` package), then against what lmi-serve needs:
the ports it listens on, a startup probe that outlasts model loading, and a configuration that
serves the model KServe downloads under the InferenceService's name."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from k8s_schema import Document, SchemaBuilder, load_schema, schema_errors

from handlers.config import Config, check_effects, load_config, parse_args
from handlers.engine import registry

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "kserve"
RUNTIME_FILE = EXAMPLES / "cluster-serving-runtime.yaml"
SERVICE_FILE = EXAMPLES / "inference-service.yaml"
RUNTIME_KIND = ("serving.kserve.io/v1alpha1", "ClusterServingRuntime")
SERVICE_KIND = ("serving.kserve.io/v1beta1", "InferenceService")
MODEL_MOUNT = "/mnt/models"  # where KServe's storage initializer puts the storageUri
KSERVE_CONTAINER = "kserve-container"  # the runtime container KServe merges the model spec into

# --- KServe's schema, from the kserve and kubernetes packages' model classes (tests/k8s_schema.py)


@pytest.fixture(scope="module")
def schema() -> SchemaBuilder:
    return load_schema("examples/kserve/")


# --- the documents ------------------------------------------------------------------------------


def load(path: Path, kind: tuple[str, str]) -> Document:
    document = yaml.safe_load(path.read_text())
    assert (document["apiVersion"], document["kind"]) == kind, path
    return document


@pytest.fixture
def runtime() -> Document:
    return load(RUNTIME_FILE, RUNTIME_KIND)


@pytest.fixture
def service() -> Document:
    return load(SERVICE_FILE, SERVICE_KIND)


def server_container(runtime: Document) -> Document:
    return next(c for c in runtime["spec"]["containers"] if c["name"] == KSERVE_CONTAINER)


def model_spec(service: Document) -> Document:
    return service["spec"]["predictor"]["model"]


def test_documents_match_kserve_schema(schema: SchemaBuilder, runtime: Document,
                                       service: Document) -> None:
    assert schema_errors(schema, "V1alpha1ClusterServingRuntime", runtime) == []
    assert schema_errors(schema, "V1beta1InferenceService", service) == []


def _misspell_formats(runtime: Document, _service: Document) -> tuple[str, Document]:
    spec = runtime["spec"]
    spec["supportedModelFormat"] = spec.pop("supportedModelFormats")
    return "V1alpha1ClusterServingRuntime", runtime


def _misspell_probe(runtime: Document, _service: Document) -> tuple[str, Document]:
    container = server_container(runtime)
    container["startUpProbe"] = container.pop("startupProbe")  # a Kubernetes type's key
    return "V1alpha1ClusterServingRuntime", runtime


def _misplace_protocol(_runtime: Document, service: Document) -> tuple[str, Document]:
    service["spec"]["predictor"]["protocolVersion"] = model_spec(service).pop("protocolVersion")
    return "V1beta1InferenceService", service


@pytest.mark.parametrize(("mistake", "where", "key"), [
    (_misspell_formats, "spec", "supportedModelFormat"),
    (_misspell_probe, "spec/containers/0", "startUpProbe"),
    (_misplace_protocol, "spec/predictor", "protocolVersion"),
])
def test_schema_catches_a_misspelled_or_misplaced_key(
    schema: SchemaBuilder, runtime: Document, service: Document,
    mistake: Callable[[Document, Document], tuple[str, Document]], where: str, key: str,
) -> None:
    root, document = mistake(copy.deepcopy(runtime), copy.deepcopy(service))
    assert f"{where}: Additional properties are not allowed ('{key}' was unexpected)" in (
        schema_errors(schema, root, document))


# --- what lmi-serve needs -----------------------------------------------------------------------


@pytest.fixture
def served(tmp_path: Path, runtime: Document, service: Document) -> Config:
    """The configuration lmi-serve starts with in the pod, checked as `lmi-serve` checks it: the
    runtime's arguments and environment with the InferenceService's merged in and {{.Name}}
    rendered, as KServe does, and a Hugging Face checkpoint's files in place of /mnt/models."""
    mount = tmp_path / "models"
    mount.mkdir()
    (mount / "config.json").write_text("{}")
    (mount / "model.safetensors").touch()
    container = server_container(runtime)
    args = [arg.replace(MODEL_MOUNT, str(mount)) for arg in container["args"]]
    env = {var["name"]: var["value"].replace("{{.Name}}", service["metadata"]["name"])
           for var in [*container.get("env", []), *model_spec(service).get("env", [])]}
    config = load_config(parse_args(args), env=env)
    check_effects(config)
    registry.check(config)
    return config


def test_runtime_serves_the_downloaded_model_as_the_service_name(
    served: Config, service: Document, tmp_path: Path
) -> None:
    assert served.model_dir == (tmp_path / "models").resolve()
    assert served.model_files == "hf"
    assert served.model_name == service["metadata"]["name"]


def test_runtime_exposes_http_and_kserve_grpc(served: Config, runtime: Document) -> None:
    assert {"v1", "v2", "grpc-v2"} <= set(runtime["spec"]["protocolVersions"])
    ports = server_container(runtime)["ports"]
    # KServe points the predictor Service's port 80 at the first port; Knative and KServe route
    # gRPC (HTTP/2 cleartext) to the port named h2c.
    assert ports[0]["containerPort"] == served.port == 8080
    assert {p["name"]: p["containerPort"] for p in ports}["h2c"] == served.grpc_port == 8081


def test_probes_wait_for_the_model(served: Config, runtime: Document) -> None:
    container = server_container(runtime)
    startup = container["startupProbe"]
    window = startup.get("initialDelaySeconds", 0) + startup["failureThreshold"] * startup.get(
        "periodSeconds", 10)
    assert window >= served.model_loading_timeout == 1800
    ready_paths = {"/ping", "/v2/health/ready"}  # 503 until the model has loaded
    assert startup["httpGet"]["path"] in ready_paths
    assert container["readinessProbe"]["httpGet"]["path"] in ready_paths
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == served.port, probe


def test_service_selects_the_runtime(runtime: Document, service: Document) -> None:
    """As KServe's controller checks an InferenceService that names its runtime: the protocol
    version, then the format (`name`, or `name:version` when a version is given)."""
    model = model_spec(service)
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    supported = {label for f in runtime["spec"]["supportedModelFormats"]
                 for label in (f["name"], format_label(f))}
    assert format_label(model["modelFormat"]) in supported
    assert model["storageUri"]


def format_label(model_format: Document) -> str:
    version = model_format.get("version")
    return model_format["name"] if version is None else f"{model_format['name']}:{version}"


def test_service_routes_to_several_replicas_that_each_report_their_load(
        service: Document, runtime: Document) -> None:
    """Several replicas behind the InferenceService, scaled by the autoscaler Standard mode
    runs (an HPA: cpu or memory), each scraped for its own load: KServe's Prometheus
    annotations point at the runtime's /metrics, which carries vLLM's gauges (as the inference
    gateway reads them: tests/e2e/test_e2e_lmi.py)."""
    predictor = service["spec"]["predictor"]
    assert 2 <= predictor["minReplicas"] <= predictor["maxReplicas"]
    assert predictor["scaleMetric"] in ("cpu", "memory") and 0 < predictor["scaleTarget"] <= 100
    annotations = runtime["spec"]["annotations"]  # what KServe puts on the replicas' pods
    assert annotations.get("prometheus.kserve.io/path") == "/metrics"
