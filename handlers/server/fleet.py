"""Several models on one endpoint, as SageMaker's multi-model endpoints ask of a container:
models loaded by name at runtime (`POST /models`), listed, described, unloaded, and each served by
an engine of its own beside the server's own model: a generation engine, or an embedding model's
(`Served.embeds`), which answers embeddings as an embeddings-only server does.

Loading is memory-aware: a model's need is estimated from its weight files; when it would not
fit in the memory left (the container's cgroup limit where there is one), or when
`option.max_models` are loaded already, the least recently used idle models are unloaded first;
a model that cannot fit even so is refused (507, SageMaker's cue to unload models itself) with
nothing unloaded for it. The composition root says how a model is built (`Build`): the server
layer imports no engine.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from handlers.engine.base import Embedder, Engine
from handlers.engine.memory import available_memory
from handlers.server.context import Served

log = logging.getLogger(__name__)

# (name, model directory) -> its engine: a generation engine not started, or an embedding
# model's, started
Build = Callable[[str, Path], Engine | Embedder]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
# What a model takes beyond its weight files: activations, caches, the runtime's own.
OVERHEAD = 1.25
HEADROOM_BYTES = 256 << 20  # memory always left free for the server itself


class FleetError(Exception):
    """A model request refused; `status` is SageMaker's contract's answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class FleetModel:
    served: Served[Engine | Embedder]
    url: str  # as the load request gave it
    need: int  # bytes it is estimated to take
    used: float = field(default_factory=time.monotonic)  # last asked for


Heard = Callable[[str, Engine | Embedder], None]  # (name, engine): loaded or unloaded


class Fleet:
    def __init__(self, build: Build, max_models: int | None = None,
                 available: Callable[[], int] | None = None) -> None:
        self._build = build
        self.max_models = max_models
        self.on_loaded: Heard = lambda _name, _engine: None  # the server's metrics hear of them
        self.on_unloaded: Heard = lambda _name, _engine: None
        self._available = available or available_memory
        self.models: dict[str, FleetModel] = {}
        self._loading: set[str] = set()
        self._lock = asyncio.Lock()  # one load or unload at a time: each measures memory

    def get(self, name: str) -> FleetModel | None:
        """A loaded model, marked as used now."""
        model = self.models.get(name)
        if model is not None:
            model.used = time.monotonic()
        return model

    async def load(self, name: str, path: Path, url: str) -> FleetModel:
        """Load `path` as `name` (409 for a name taken, 507 when it cannot fit), in a worker
        thread."""
        if name in self.models or name in self._loading:
            raise FleetError(409, f"model {name!r} is already loaded")
        self._loading.add(name)
        try:
            async with self._lock:
                need = weights_bytes(path)
                await self._make_room(name, need)
                engine = await asyncio.to_thread(self._build, name, path)
                embeds = isinstance(engine, Embedder)
                if not embeds:
                    await engine.start()
            model = FleetModel(Served(name, engine, embeds=embeds), url, need)
            self.models[name] = model
            self.on_loaded(name, engine)
            log.info("model %s loaded from %s (~%d MiB)", name, url, need >> 20)
            return model
        finally:
            self._loading.discard(name)

    async def unload(self, name: str) -> None:
        """Stop model `name`'s engine and free what it held (404 when it is not loaded)."""
        model = self.models.pop(name, None)
        if model is None:
            raise FleetError(404, f"model {name!r} is not loaded")
        engine, model.served.engine = model.served.engine, None
        if model.served.embeds:
            engine.stop()  # what it queued is still answered
        else:
            await engine.shutdown()
        self.on_unloaded(name, engine)
        del engine, model
        await asyncio.to_thread(_release_memory)
        log.info("model %s unloaded", name)

    async def _make_room(self, name: str, need: int) -> None:
        """Unload idle models, least recently used first, until `need` bytes and one more model
        fit; 507, unloading nothing, when even all of them would not make the room."""
        idle = sorted((m for m in self.models.values() if _idle(m)), key=lambda m: m.used)
        room = self._available() - HEADROOM_BYTES
        over = 0 if self.max_models is None else len(self.models) + 1 - self.max_models
        if need > room + sum(m.need for m in idle) or over > len(idle):
            raise FleetError(507, f"model {name!r} needs ~{need >> 20} MiB, and "
                             f"{max(room, 0) >> 20} MiB are free with "
                             f"{len(self.models)} model(s) loaded "
                             f"(option.max_models={self.max_models})")
        for model in idle:
            if need <= self._available() - HEADROOM_BYTES and over <= 0:
                break
            log.info("unloading model %s, the least recently used, to make room for %s",
                     model.served.name, name)
            await self.unload(model.served.name)
            over -= 1
        if need > self._available() - HEADROOM_BYTES:
            raise FleetError(507, f"model {name!r} needs ~{need >> 20} MiB, more than the "
                             "memory left after unloading the idle models")


def _idle(model: FleetModel) -> bool:
    engine = model.served.engine
    if model.served.embeds:
        return True  # unloading stops it once it has answered what it queued
    stats = engine.stats() if engine is not None else {}
    return not stats.get("running_requests") and not stats.get("waiting_requests")


def weights_bytes(path: Path) -> int:
    """What the model in `path` is estimated to take in memory: its weight files, and some."""
    files = [path] if path.is_file() else [p for p in path.rglob("*")
                                            if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    return int(sum(p.stat().st_size for p in files) * OVERHEAD)


def _release_memory() -> None:
    """Collect what the unloaded engine held and hand freed heap back to the system (glibc
    keeps freed pages otherwise, and RSS would not show the room made)."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
