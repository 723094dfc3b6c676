"""Kubernetes and KServe object schemas, checked without a cluster: JSON Schemas built from the
OpenAPI-generated model classes the `kubernetes` and `kserve` packages ship (their
`openapi_types` and `attribute_map`), each class a closed object so that a misspelled or
misplaced key fails. tests/container/test_kserve_deploy.py and test_multinode_manifests.py use
them on examples/."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from types import ModuleType
from typing import Any

import pytest
from jsonschema import Draft202012Validator

INSTALL = "pip install --no-deps kserve==0.21.0 && pip install kubernetes==36.0.3"

Document = dict[str, Any]

PRIMITIVES: dict[str, dict[str, Any]] = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "date": {"type": "string", "format": "date"},
    "datetime": {"type": "string", "format": "date-time"},
    "object": {},  # free-form: IntOrString (a probe's port), a resource's status
}
LIST = re.compile(r"list\[(.+)\]")
DICT = re.compile(r"dict[(\[]str, (.+)[)\]]")  # kserve writes dict(str, T), kubernetes dict[str, T]
# The generator keeps OpenAPI's `required` only in each setter's None check.
REQUIRED = re.compile(r"Invalid value for `(\w+)`, must not be `None`")


def import_kserve_models() -> ModuleType:
    """`kserve.models` alone. kserve/__init__.py imports KServe's whole model server (fastapi,
    pandas, grpc, ...): the dependencies `pip install --no-deps kserve` leaves out, some pinned
    against this project's. The generated models need only six and urllib3, so `kserve` is
    registered as a bare package (its __path__, its __init__ not run) before `kserve.models` is
    imported."""
    if "kserve" not in sys.modules:
        spec = importlib.util.find_spec("kserve")
        if spec is None:
            raise ImportError("No module named 'kserve'")
        sys.modules["kserve"] = importlib.util.module_from_spec(spec)
    return importlib.import_module("kserve.models")


class SchemaBuilder:
    """A JSON Schema from OpenAPI-generated model classes (`openapi_types`: attribute -> type
    name, `attribute_map`: attribute -> JSON key). Each class is one closed object in $defs
    (additionalProperties: false, so a misspelled key fails), referenced by $ref so that
    recursive types end."""

    def __init__(self, classes: dict[str, type]) -> None:
        self.classes = classes
        self.defs: dict[str, Any] = {}

    def document(self, root: str) -> dict[str, Any]:
        ref = self.type_schema(root)
        return {"$defs": self.defs, **ref}

    def type_schema(self, name: str) -> dict[str, Any]:
        if match := LIST.fullmatch(name):
            return {"type": "array", "items": self.type_schema(match[1])}
        if match := DICT.fullmatch(name):
            return {"type": "object", "additionalProperties": self.type_schema(match[1])}
        if name in PRIMITIVES:
            return PRIMITIVES[name]
        cls = self.classes.get(name)
        if cls is None or not cls.openapi_types:
            # Named with no class (ResourceQuantity, Knative's status types) or a class with no
            # fields (V1Time, a string on the wire): the packages do not say their shape.
            return {}
        if name not in self.defs:
            self.defs[name] = {}  # claimed before its fields: a cycle refers back to it
            self.defs[name] = self._object(cls)
        return {"$ref": f"#/$defs/{name}"}

    def _object(self, cls: type) -> dict[str, Any]:
        keys = cls.attribute_map
        # A composed class (with_worker_spec) has no source: its base's says what is required.
        defining = next(c for c in cls.__mro__ if "__init__" in vars(c))
        required = dict.fromkeys(REQUIRED.findall(inspect.getsource(defining)))
        return {
            "type": "object",
            "properties": {keys[attr]: self.type_schema(kind)
                           for attr, kind in cls.openapi_types.items()},
            "required": [keys[attr] for attr in required],
            "additionalProperties": False,
        }


def schema_errors(schema: SchemaBuilder, root: str, document: Document) -> list[str]:
    validator = Draft202012Validator(schema.document(root))
    return sorted(f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
                  for error in validator.iter_errors(document))


def load_schema(what: str) -> SchemaBuilder:
    """The builder over both packages' model classes; the test fails, saying what to install,
    where one is missing."""
    try:
        modules = [importlib.import_module("kubernetes.client.models"), import_kserve_models()]
    except ImportError as exc:
        problem = str(exc)
    else:
        classes = {name: cls for module in modules for name, cls in vars(module).items()
                   if isinstance(cls, type) and hasattr(cls, "openapi_types")}
        return SchemaBuilder(with_worker_spec(classes))
    # Failed outside the except block, so that the report is this message alone.
    pytest.fail(f"{problem}. Checking {what} against KServe's and Kubernetes' schemas needs the "
                f"kserve and kubernetes packages: {INSTALL}", pytrace=False)


def with_worker_spec(classes: dict[str, type]) -> dict[str, type]:
    """`classes` and a ServingRuntime's workerSpec. kserve 0.21's models name its type,
    V1alpha1WorkerSpec, but ship no such class (the builder would take any workerSpec). KServe's
    Go type (pkg/apis/serving/v1alpha1/servingruntime_types.go) is ServingRuntimePodSpec inline
    plus pipelineParallelSize and tensorParallelSize: composed here from the package's
    V1alpha1ServingRuntimePodSpec and the two sizes' entries in its V1beta1WorkerSpec (an
    InferenceService's workerSpec, which has them)."""
    if "V1alpha1WorkerSpec" in classes:
        return classes
    pod, sizes = classes["V1alpha1ServingRuntimePodSpec"], classes["V1beta1WorkerSpec"]
    extra = ("pipeline_parallel_size", "tensor_parallel_size")
    worker = type("V1alpha1WorkerSpec", (pod,), {
        "openapi_types": {**pod.openapi_types, **{a: sizes.openapi_types[a] for a in extra}},
        "attribute_map": {**pod.attribute_map, **{a: sizes.attribute_map[a] for a in extra}},
    })
    return {**classes, "V1alpha1WorkerSpec": worker}
