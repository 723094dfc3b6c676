"""LoRA adapters applied unmerged, so one batch mixes rows of different adapters and the base.

Each projection LoRA may target becomes a `LoraLinear` around the layer it was (the fused q/k/v
and gate/up of fused_projections.py count as one, its parts' updates side by side). It holds the
loaded adapters' A matrices stacked, `down` [in, W], and their scaled B matrices, `up` [W, out],
W being the sum of their ranks; column j belongs to the adapter in slot `columns[j]`. A pass then
adds `((x · down) ⊙ mask) · up` to the base output, where `mask[row, j]` is 1 when the row's
adapter owns column j: two small matmuls per projection for the whole batch, whatever mix of
adapters it holds (vLLM's punica kernels gather per row instead; on the CPU two dense GEMMs of a
few dozen columns cost less than a gather). A pass whose rows all use the base model skips it.

`LoraSet` owns the adapters and the slots: registered from any thread, stacked into a slot
between passes, in the engine's thread.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from handlers.engine.torch.fused_projections import GROUPS, ProjectionPart
from handlers.engine.torch.lora_weights import AdapterWeights, ModuleUpdate, read_adapter
from handlers.engine.torch.quant_linear import QuantLinear
from handlers.engine.types import AdapterError

SINGLE = ("o_proj", "down_proj", *(name for group in GROUPS for name in group))


class RowAdapters:
    """Which slot each row of the current pass uses (0: the base model), and the masks built
    from it, once per column layout."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None  # [rows]; None: every row is the base model's
        self._masks: dict[int, torch.Tensor] = {}

    def use(self, slots: torch.Tensor | None) -> None:
        """The next pass's rows' slots (None: no row has an adapter)."""
        self.slots = slots
        self._masks = {}

    def mask(self, columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        mask = self._masks.get(id(columns))
        if mask is None:
            mask = (self.slots[:, None] == columns[None, :]).to(dtype)[:, None, :]
            self._masks[id(columns)] = mask
        return mask


@dataclass(frozen=True)
class _Part:
    name: str  # the module's name in the model (what PEFT's keys name)
    offset: int  # where its output starts in the projection's
    size: int


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, parts: list[_Part],
                 rows: RowAdapters) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.parts, self.rows = in_features, parts, rows
        self.out_features = sum(part.size for part in parts)
        self.down: torch.Tensor | None = None  # [in, W]
        self.up: torch.Tensor | None = None  # [W, out]
        self.columns: torch.Tensor | None = None  # [W]: the slot owning each column

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.rows.slots is None or self.down is None:
            return out
        mask = self.rows.mask(self.columns, x.dtype)
        return out + torch.matmul(torch.matmul(x, self.down) * mask, self.up)

    def load(self, adapters: list[tuple[int, AdapterWeights]],
             layouts: dict[tuple[int, ...], torch.Tensor]) -> None:
        """Stack the updates of `adapters` (slot, weights) that target this projection."""
        downs, ups, owners = [], [], []
        for slot, adapter in adapters:
            for part in self.parts:
                update = adapter.modules.get(part.name)
                if update is None:
                    continue
                up = update.up.new_zeros(self.out_features, update.rank)
                up[part.offset : part.offset + part.size] = update.up
                downs.append(update.down)
                ups.append(up)
                owners += [slot] * update.rank
        if not downs:
            self.down = self.up = self.columns = None
            return
        self.down = torch.cat(downs).t().contiguous()
        self.up = torch.cat(ups, dim=1).t().contiguous()
        # Projections with the same layout share one tensor, so they share one mask per pass.
        owned = tuple(owners)
        if owned not in layouts:
            layouts[owned] = torch.tensor(owners, device=self.down.device)
        self.columns = layouts[owned]


class LoraSet:
    """The adapters a model serves: every registered one read and kept, at most `max_loras` of
    them stacked into the projections at once, each in a slot (1..max_loras; 0 is the base
    model). As vLLM's max_loras: the adapters one batch may mix; a request for another waits
    until a slot's adapter has no sequence running."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.rows = RowAdapters()
        self._registered: dict[str, AdapterWeights] = {}
        self._lock = threading.Lock()  # registering runs in a worker, stacking in the engine's
        self._stacked: dict[int, AdapterWeights] = {}  # slot -> the adapter stacked there
        self.pinned: set[str] = set()  # kept stacked once stacked (DJL's `pin`)
        self._used = itertools.count()
        self._last_used: dict[int, int] = {}  # slot -> when a sequence last took it
        self._sites: list[LoraLinear] = []
        self._parts: dict[str, LoraLinear] = {}
        self._layouts: dict[tuple[int, ...], torch.Tensor] = {}  # column owners -> tensor
        self._device = torch.device("cpu")
        self._dtype = torch.float32

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._registered)

    def attach(self, model: nn.Module) -> None:
        """Wrap the model's projections (after fusing, before packing them). Once per model:
        a model whose projections are wrapped already keeps them."""
        self._device, self._dtype = model.device, model.dtype
        if self._sites:
            return
        wrapped = [m for m in model.modules() if isinstance(m, LoraLinear)]
        if wrapped:  # another LoraSet's (a model served again): take its projections over
            for site in wrapped:
                site.rows, site.down, site.up, site.columns = self.rows, None, None, None
                self._add_site(site)
            return
        for prefix, module in list(model.named_modules()):
            for group in GROUPS:
                first = getattr(module, group[0], None)
                if isinstance(first, ProjectionPart):
                    shared = first.shared
                    parts, offset = [], 0
                    for name, size in zip(group, shared.sizes, strict=True):
                        parts.append(_Part(_joined(prefix, name), offset, size))
                        offset += size
                    shared.fused = self._add_site(
                        LoraLinear(shared.fused, shared.fused.in_features, parts, self.rows))
            for name in SINGLE:
                child = getattr(module, name, None)
                if type(child) in (nn.Linear, QuantLinear):
                    part = _Part(_joined(prefix, name), 0, child.out_features)
                    setattr(module, name, self._add_site(
                        LoraLinear(child, child.in_features, [part], self.rows)))

    def _add_site(self, site: LoraLinear) -> LoraLinear:
        self._sites.append(site)
        for part in site.parts:
            self._parts[part.name] = site
        return site

    def shape(self, module: str) -> tuple[int, int] | None:
        site = self._parts.get(module)
        if site is None:
            return None
        part = next(p for p in site.parts if p.name == module)
        return site.in_features, part.size

    def register(self, name: str, path: Path) -> AdapterWeights:
        """Read `path`'s adapter and serve it as `name` (any thread); AdapterError when it does
        not fit the model."""
        if name in self._registered:
            raise AdapterError(f"an adapter named {name!r} is served already")
        weights = read_adapter(name, path, self.shape, self.max_rank, self._dtype)
        weights = AdapterWeights(name, path, {
            module: ModuleUpdate(update.down.to(self._device), update.up.to(self._device))
            for module, update in weights.modules.items()})
        with self._lock:
            if name in self._registered:
                raise AdapterError(f"an adapter named {name!r} is served already")
            self._registered[name] = weights
        return weights

    def unregister(self, name: str) -> AdapterWeights:
        """Serve `name` no more (any thread): new requests cannot name it; sequences running
        with it finish with it."""
        with self._lock:
            if name not in self._registered:
                raise AdapterError(f"no LoRA adapter {name!r} is served", missing=True)
            self.pinned.discard(name)
            return self._registered.pop(name)

    def pin(self, name: str, pinned: bool) -> None:
        """Keep `name` stacked once it is (pinned) or let its slot go to others; one slot at
        least stays for the adapters not pinned."""
        self.describe(name)
        with self._lock:
            if pinned and name not in self.pinned and len(self.pinned) + 1 >= self.max_loras:
                raise AdapterError(f"{len(self.pinned)} adapters are pinned already; with "
                                   f"option.max_loras={self.max_loras} one slot must stay free")
            (self.pinned.add if pinned else self.pinned.discard)(name)

    def describe(self, name: str) -> AdapterWeights:
        with self._lock:
            if name not in self._registered:
                raise AdapterError(f"no LoRA adapter {name!r} is served", missing=True)
            return self._registered[name]

    def slot_for(self, name: str, busy: set[int]) -> int | None:
        """The slot holding adapter `name`, stacking it into one first where needed (the
        engine's thread, between passes): a free slot, else one whose adapter no running
        sequence uses (`busy` are the slots in use). None when every slot is busy."""
        with self._lock:
            weights = self._registered.get(name)
        if weights is None:
            raise AdapterError(f"no LoRA adapter {name!r} is served", missing=True)
        for slot, stacked in self._stacked.items():
            if stacked is weights:
                self._last_used[slot] = next(self._used)
                return slot
        with self._lock:
            held = {slot for slot, stacked in self._stacked.items()
                    if stacked.name in self.pinned and self._registered.get(stacked.name)
                    is stacked}
        idle = [slot for slot in range(1, self.max_loras + 1) if slot not in busy | held]
        if not idle:
            return None
        # A slot never used first, else the least recently used one.
        slot = min(idle, key=lambda s: self._last_used.get(s, -1))
        self._last_used[slot] = next(self._used)
        modules = set(weights.modules)
        if slot in self._stacked:
            modules |= set(self._stacked[slot].modules)
        self._stacked[slot] = weights
        self._restack(modules)
        return slot

    def _restack(self, modules: set[str]) -> None:
        adapters = sorted(self._stacked.items(), key=lambda pair: pair[0])
        for site in {id(self._parts[m]): self._parts[m] for m in modules}.values():
            site.load(adapters, self._layouts)


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
