"""The CPU decode step compiled ahead of time by inductor, built beside the server and cached.

A one-row float32 decode step is bound by how fast the linears read their weights: oneDNN's
GEMV read SmolLM2's at ~20 GB/s where the machine reads 28-30 (Zen 3, 2 cores), and inductor's
C++ GEMM template over frozen weights reached 28 (`bench/linear_kernels.py --inductor`). One
graph for the whole step (the Llama stack and the LM head, its KV writes included) also drops the
per-op Python: measured 24 vs 42 ms per one-row step, 66 vs 94 at 16 rows.

Compiling takes minutes (each GEMM candidate is C++ compiled and timed), and compiling in the
server's own process starved its serving of the GIL (eager steps 8-80x slower meanwhile). So a
niced subprocess exports the step (`torch.export`, rows and lengths dynamic) and packages it with
AOTInductor into the cache directory (decode_step.py), keyed by the weights, torch, the CPU
level it targets (graph_target.py) and the code compiled; the server serves eagerly until a
package appears, then loads it and decodes through it. A restart finds the packages and loads
them in about a second. Two graphs: one row (the GEMV shape autotuned for itself) and 2..slots
rows; their constants are mapped from files beside them (graph_constants.py).

An image compiles its default model's graphs ahead, for each level (graphs_ahead.py), into a
read-only folder ($LMI_PREBUILT_GRAPHS): a server looks there first, for the best level its CPU
runs, and then in its writable cache, so that a container starts compiling nothing.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch
from torch import nn

from handlers.engine.torch import (
    decode_step,
    graph_constants,
    graph_runner,
    graph_target,
    invariant_attention,
    kv_dtype,
)
from handlers.engine.torch.decode_step import GraphSpec, graph_specs
from handlers.engine.torch.llama_model import is_llama
from handlers.engine.torch.loader import LoadedModel
from handlers.model_fetch import default_cache_dir

log = logging.getLogger(__name__)

# Free memory wanted, in weights: the subprocess's model, its frozen copy and the constants it
# stores, then the graphs' mapped constants (the packed weights, once for both).
MEMORY_FACTOR = 6
PREBUILT_ENV = "LMI_PREBUILT_GRAPHS"  # a read-only folder of graphs compiled ahead (an image's)
_EXIT_GRACE_S = 60  # how long a compile that left every graph may take to exit
_CODE = ("decode_step.py", "llama_stack.py", "llama_model.py", "attention.py",
         "invariant_attention.py", "fused_projections.py", "graph_constants.py",
         "quant_linear.py", "quant_linear.cpp", "graph_target.py", "kv_dtype.py",
         "invariant_attention.cpp")
Graph = Callable[..., torch.Tensor]
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


class DecodeGraphs:
    """The compiled decode graphs of one model: loaded from the cache or compiled beside the
    server, usable by `for_rows` once each is loaded."""

    def __init__(self, directory: Path, job: dict, specs: list[GraphSpec],
                 model: nn.Module | None = None) -> None:
        self.directory, self._job, self._specs = directory, job, specs
        self._model = model  # whose unchanged tensors the graphs read instead of copies
        self.shared_constants: dict[str, int] = {}  # per graph: constants that are the model's
        self.kv_dtype = kv_dtype.DTYPES[job["kv_cache_dtype"]]  # the cache they read and write
        self._graphs: dict[str, Graph] = {}
        self._constants = graph_constants.ConstantStore(directory)
        self._process: subprocess.Popen | None = None
        self.ready = threading.Event()  # every graph loaded, or given up on
        self._thread = threading.Thread(target=self._run, name="decode-graphs", daemon=True)
        self._lock = threading.Lock()

    @staticmethod
    def for_model(loaded: LoadedModel, num_slots: int, max_len: int,
                  cache_dir: Path | None = None,
                  prebuilt_dir: Path | None = None,
                  kv_cache_dtype: str = "auto") -> DecodeGraphs | None:
        """The graphs for `loaded` (before its linears are repacked) over a KV cache of
        option.kv_cache_dtype's dtype, or None, logged, where they do not apply: compiled ahead
        in `prebuilt_dir` (default: $LMI_PREBUILT_GRAPHS) for a level this CPU runs, else in
        `cache_dir`'s (compiled there when missing)."""
        why_not = _not_applicable(loaded)
        if why_not:
            log.info("decode step runs eagerly: %s", why_not)
            return None
        job = job_for(loaded, num_slots, max_len, kv_cache_dtype)
        specs = graph_specs(num_slots, job["dtype"], job["quantize"])
        weights = weights_digest(loaded.model, job)
        found = _prebuilt(prebuilt_dir or prebuilt_root(), weights, specs, job["dtype"])
        if found is not None:
            level, directory = found
            log.info("decode graphs compiled ahead for %s found in %s: nothing to compile",
                     level, directory)
            return DecodeGraphs(directory, {**job, "target": level}, specs, loaded.model)
        target = graph_target.for_compile(job["dtype"])
        directory = (cache_dir or default_cache_dir()) / "decode-graphs" / _key(weights, target)
        log.info("decode graphs for %s: from the writable cache, %s (compiled there where "
                 "missing)", target, directory)
        return DecodeGraphs(directory, {**job, "target": target}, specs, loaded.model)

    def start(self) -> None:
        """Load the graphs from the cache, or compile them beside the server (once)."""
        with self._lock:
            if not self._thread.is_alive() and not self.ready.is_set():
                atexit.register(self.close)
                self._thread.start()

    def for_rows(self, rows: int) -> Graph | None:
        for spec in self._specs:
            if spec.min_rows <= rows <= spec.max_rows:
                return self._graphs.get(spec.name)
        return None

    def counts(self) -> dict[str, int]:
        return {"decode_graphs_ready": len(self._graphs), "decode_graphs_total": len(self._specs)}

    def close(self) -> None:
        """Stop a compile still running (what it finished stays cached)."""
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()

    def _run(self) -> None:
        try:
            # The ops the graphs call, registered before the graphs load (the quantized
            # linears' and norms' load with the model).
            invariant_attention.available()
            pending = [spec for spec in self._specs if not self._load_cached(spec)]
            if pending:
                self._compile(pending)
        except Exception:  # a graph is a speed-up: without it the eager step serves
            log.exception("decode graphs failed; the decode step stays eager")
        finally:
            self.ready.set()

    def _load_cached(self, spec: GraphSpec) -> bool:
        path = self.directory / f"{spec.name}.pt2"
        if not path.exists():
            return False
        began = time.perf_counter()
        constants = self.directory / f"{spec.name}{graph_constants.SUFFIX}"
        for file in (path, constants) if constants.exists() else (path,):
            _read_ahead(file)
        graph = graph_runner.load(path)
        _remove_extracted()
        shared = 0
        if constants.exists():  # else they are in the package (bf16's packed weights)
            shared = self._constants.attach(graph, spec.name, self._own_tensors())
        self.shared_constants[spec.name] = shared
        self._graphs[spec.name] = graph
        log.info("decode graph %s ready (%s, loaded in %.1f s; %d of its constants the "
                 "server's own tensors)", spec.name, path, time.perf_counter() - began, shared)
        return True

    def _own_tensors(self) -> dict[str, torch.Tensor]:
        """The model's tensors as the step names them (every alias of a shared one), as they
        are now: after the engine repacked what it repacks."""
        if self._model is None:
            return {}
        named = (*self._model.named_parameters(remove_duplicate=False),
                 *self._model.named_buffers(remove_duplicate=False))
        return {f"model.{name}": tensor.detach() for name, tensor in named}

    def _compile(self, pending: list[GraphSpec]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        began, compile_log = time.perf_counter(), self.directory / "compile.log"
        log.info("compiling decode graphs %s in a subprocess (minutes; serving eagerly "
                 "meanwhile; its log: %s)", ", ".join(s.name for s in pending), compile_log)
        job = {**self._job, "directory": str(self.directory), "graphs": [s.name for s in pending]}
        with compile_log.open("ab") as sink:
            self._process = subprocess.Popen(
                [sys.executable, "-m", decode_step.__name__, json.dumps(job)], stdout=sink,
                stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19))
        pending = watch_compile(self._process, pending, self._load_cached)
        if pending:
            log.warning("decode graphs %s were not compiled (exit code %s; see %s); the decode "
                        "step stays eager for them", ", ".join(s.name for s in pending),
                        self._process.returncode, compile_log)
        else:
            log.info("decode graphs compiled in %.0f s", time.perf_counter() - began)


def watch_compile(process: subprocess.Popen, pending: list[GraphSpec],
                  load: Callable[[GraphSpec], bool], poll_s: float = 1.0) -> list[GraphSpec]:
    """Load each graph as the compiling `process` leaves it; what it left unloaded once it
    exited. The process is always waited for (reaped), even when every graph loaded before it
    exited: else it stays <defunct> for the server's lifetime."""
    try:
        while pending:
            finished = process.poll() is not None  # before looking: files it left count
            pending = [spec for spec in pending if not load(spec)]
            if finished:
                break
            time.sleep(poll_s)
    finally:
        try:
            process.wait(timeout=_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("the decode-graph compile did not exit once done; killing it")
            process.kill()
            process.wait()
    return pending


def _read_ahead(path: Path) -> None:
    """Bring the package into the page cache first, from Python, which lets other threads run
    between reads: the loader reads it holding the GIL (a cold GB stalled the server's HTTP
    thread for 14 s; warm, loading leaves it at most ~0.15 s)."""
    buffer = bytearray(16 << 20)
    with path.open("rb", buffering=0) as file:
        while file.readinto(buffer):
            pass


def _remove_extracted() -> None:
    """Delete the directories loading extracted packages into (a GB each, in the temporary
    directory, and left there when the process is killed): what they hold stays mapped."""
    maps = Path("/proc/self/maps").read_text().split()
    for path in {Path(word) for word in maps if "/aotinductor_" in word}:
        extracted = next(p for p in path.parents if p.name.startswith("aotinductor_"))
        shutil.rmtree(extracted, ignore_errors=True)


def job_for(loaded: LoadedModel, num_slots: int, max_len: int,
            kv_cache_dtype: str = "auto") -> dict:
    """What the graphs of `loaded` are compiled from (decode_step.compile_graphs' job, less
    its directory, graphs and target), over a cache of option.kv_cache_dtype's dtype."""
    return {"source": loaded.source, "dtype": _DTYPES[loaded.dtype],
            "max_model_len": loaded.max_model_len, "num_slots": num_slots, "max_len": max_len,
            "quantize": loaded.quantize_mode,
            # the cache's dtype as chosen (part of the key: the graphs read and write it)
            "kv_cache_dtype": kv_dtype.name(kv_dtype.choose(kv_cache_dtype, loaded.dtype)[0])}


def prebuilt_root() -> Path | None:
    """$LMI_PREBUILT_GRAPHS (where an image keeps the graphs it compiled ahead), or None."""
    value = os.environ.get(PREBUILT_ENV)
    return Path(value) if value else None


def prebuilt_directory(root: Path, weights: hashlib._Hash, level: str) -> Path:
    return root / "decode-graphs" / _key(weights, level)


def _prebuilt(root: Path | None, weights: hashlib._Hash, specs: list[GraphSpec],
              dtype: str) -> tuple[str, Path] | None:
    """The best level this CPU runs whose every graph `root` holds, and their folder. Levels
    the CPU lacks are never looked at: their code would fault on it."""
    if root is None or dtype != "fp32":  # bf16 graphs are this CPU's own (graph_target.py)
        return None
    if not root.is_dir():
        log.warning("%s=%s is not a folder: no decode graphs compiled ahead", PREBUILT_ENV, root)
        return None
    for level in graph_target.runnable():
        directory = prebuilt_directory(root, weights, level)
        if all((directory / f"{spec.name}.pt2").exists() for spec in specs):
            return level, directory
    log.info("no decode graphs compiled ahead in %s for this model and CPU (levels %s)", root,
             ", ".join(graph_target.runnable()) or "none")
    return None


def _not_applicable(loaded: LoadedModel) -> str | None:
    if loaded.device.type != "cpu" or loaded.dtype not in _DTYPES:
        return (f"compiled only for float32 and bfloat16 on the CPU (here {loaded.dtype} on "
                f"{loaded.device})")
    if not is_llama(loaded.model):
        return f"compiled only for Llama-architecture models (not {type(loaded.model).__name__})"
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    available = psutil.virtual_memory().available
    if available < MEMORY_FACTOR * weights:
        return (f"compiling wants {MEMORY_FACTOR}x the weights' {weights / 2**30:.2f} GiB free, "
                f"{available / 2**30:.2f} GiB are")
    return None


def _key(weights: hashlib._Hash, target: str) -> str:
    """A package's key: `weights` (weights_digest) and the CPU level, or the CPU, it targets."""
    digest = weights.copy()
    digest.update(graph_target.key_part(target).encode())
    return digest.hexdigest()[:24]


def weights_digest(model: nn.Module, job: dict) -> hashlib._Hash:
    """What a package depends on but its target: the weights (each tensor's name, shape, dtype
    and the CRC-32 of its bytes), the job, torch, and the code it was traced from."""
    digest = hashlib.sha256(json.dumps({**job, "source": None}, sort_keys=True).encode())
    for part in (torch.__version__, *(Path(__file__).with_name(n).read_bytes() for n in _CODE)):
        digest.update(part if isinstance(part, bytes) else part.encode())
    tensors = model.state_dict()
    # zlib releases the GIL: two threads take ~0.045 s over SmolLM2's 0.27 GB of bf16 (a float
    # sum took 0.09 s, and its last bits could move with the number of threads).
    with ThreadPoolExecutor(2) as pool:
        crcs = pool.map(_crc32, tensors.values())
        for (name, tensor), crc in zip(tensors.items(), crcs, strict=True):
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}{crc}".encode())
    return digest


def _crc32(tensor: torch.Tensor) -> int:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(raw.numpy())
