"""A slot-based KV cache: one row of preallocated key/value buffers per running sequence.

Decoding rows always occupy slots 0..B-1, so attention reads a view of the buffers, never a copy.
The length dimension grows by doubling when a sequence outgrows it (rare: O(log n) copies), and
shrinks back once the sequences that needed it are gone (`shrink`, as slots are released).
Every slot has the capacity of the longest, so a grown buffer is mostly positions no sequence
holds: on the CPU it is an anonymous mapping, whose pages the kernel provides (zeroed) only once
written and takes back when the buffer is dropped, and a resize copies only what each slot
holds. One 7,000-token prompt beside 31 empty slots used to commit and copy every slot's grown
rows (12 GB, a 22 s step for SmolLM2 in float32); now the memory is what sequences hold, and it
is given back.
Hugging Face attention layers call `update(k, v, layer_idx)`; which slots and positions a forward
pass writes is set beforehand with `bind()`. The buffers hold option.kv_cache_dtype's dtype
(kv_dtype.py); `read_dtype`, where set, is what the attention reading them takes instead.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable

import torch

from handlers.engine.torch.kv_dtype import storable

SavedPrefix = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [H, T, D]


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_len: int = 256,
        max_len: int = 8192,
        read_dtype: torch.dtype | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        self.read_dtype = None if read_dtype == dtype else read_dtype
        self.initial_len = min(initial_len, max_len)
        shape = (num_slots, num_kv_heads, self.initial_len, head_dim)
        self.keys = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.values = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.lengths = [0] * num_slots  # positions each slot holds (written, copied or loaded)
        self.resizes = 0  # how often the buffers were replaced (what a CUDA graph reads moved)
        self._rows: slice | torch.Tensor = slice(0, 0)
        self._write_index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._read_len = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, length: int) -> None:
        """Make room for positions < length (doubling), keeping every slot's contents."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the cache's {self.max_len}")
        self._resize(min(self.max_len, max(length, 2 * self.capacity)))

    def shrink(self) -> None:
        """Give memory back once the slots need a quarter of the capacity or less (halving
        the room the longest sequence holds, so that a sequence growing again does not make
        it double at once)."""
        needed = max(self.lengths)
        if self.capacity > self.initial_len and 4 * needed <= self.capacity:
            self._resize(max(self.initial_len, 2 * needed))

    def _resize(self, new_len: int) -> None:
        held = [(slot, min(length, new_len)) for slot, length in enumerate(self.lengths)
                if length]
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                resized = _zeros((*old.shape[:2], new_len, old.shape[3]), old.dtype, old.device)
                for slot, length in held:
                    resized[slot, :, :length] = old[slot, :, :length]
                buffers[i] = resized
        self.resizes += 1

    def bind(self, rows: slice | torch.Tensor, positions: torch.Tensor, read_len: int) -> None:
        """Set the slots the next forward pass uses (a slice for contiguous rows: attention then
        reads a view; else an index tensor: a gather), the positions [B, T] it writes, and how
        many positions attention reads."""
        self.reserve(max(read_len, int(positions.max()) + 1))
        device = self.keys[0].device
        if isinstance(rows, torch.Tensor):
            rows = index = rows.to(device)
        else:
            index = torch.arange(rows.start, rows.stop, device=device)
        self._rows, self._read_len = rows, read_len
        self._write_index = (index[:, None].expand_as(positions), positions.to(device))
        self.note_written(index.tolist(), (positions.amax(dim=1) + 1).tolist())

    def bind_graph(self, slots: torch.Tensor, positions: torch.Tensor, rows: int) -> None:
        """For a captured decode step (cuda_graphs.py): rows 0..rows-1 read the whole capacity,
        and row i writes at positions[i] of slot slots[i], device tensors [rows, 1] that the
        graph reads again at each replay. Nothing here reads the device: a capture cannot."""
        self._rows, self._read_len = slice(0, rows), self.capacity
        self._write_index = (slots, positions)

    def note_written(self, slots: Iterable[int], ends: Iterable[int]) -> None:
        """Each slot holds positions up to `end` now (a pass wrote them)."""
        for slot, end in zip(slots, ends, strict=True):
            self.lengths[slot] = max(self.lengths[slot], end)

    def truncate(self, slot: int, length: int) -> None:
        """Positions from `length` on are no longer held (rejected speculated tokens: the next
        pass writes them again before any query reads them)."""
        self.lengths[slot] = min(self.lengths[slot], length)

    def release(self, slot: int) -> None:
        """The slot's sequence ended: what it holds is no longer needed (nor, perhaps, the
        room it grew the buffers to)."""
        self.lengths[slot] = 0
        self.shrink()

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_: object):
        """Write this pass's keys/values [B, H, T, D] and return what attention reads."""
        rows, positions = self._write_index
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        k_buf[rows, :, positions] = storable(key.transpose(1, 2), k_buf.dtype)
        v_buf[rows, :, positions] = storable(value.transpose(1, 2), v_buf.dtype)
        k, v = k_buf[self._rows, :, : self._read_len], v_buf[self._rows, :, : self._read_len]
        if self.read_dtype is not None:
            return k.to(self.read_dtype), v.to(self.read_dtype)
        return k, v

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one position, every layer."""
        k = self.keys[0]
        return 2 * len(self.keys) * k.shape[1] * k.shape[3] * k.element_size()

    def save(self, slot: int, length: int) -> SavedPrefix:
        """A copy of the slot's first `length` positions, per layer (kept apart from the slot
        buffers, so it outlives their shrinking and their next user)."""
        return [(k[slot, :, :length].clone(), v[slot, :, :length].clone())
                for k, v in zip(self.keys, self.values, strict=True)]

    def load(self, saved: SavedPrefix, slot: int, length: int) -> None:
        """Write the first `length` positions of a `save()`d copy into `slot`."""
        self.reserve(length)
        for (k, v), k_buf, v_buf in zip(saved, self.keys, self.values, strict=True):
            k_buf[slot, :, :length] = k[:, :length]
            v_buf[slot, :, :length] = v[:, :length]
        self.lengths[slot] = length

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of one slot into another (compaction, forking)."""
        for buffers in (self.keys, self.values):
            for buf in buffers:
                buf[dst, :, :length] = buf[src, :, :length]
        self.lengths[dst] = length

    def swap_slots(self, a: int, b: int, a_len: int, b_len: int) -> None:
        """Trade the first positions of two slots (`a_len` of a's, `b_len` of b's)."""
        for buffers in (self.keys, self.values):
            for buf in buffers:
                held = buf[a, :, :a_len].clone()
                buf[a, :, :b_len] = buf[b, :, :b_len]
                buf[b, :, :a_len] = held
        self.lengths[a], self.lengths[b] = b_len, a_len


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed buffer; on the CPU an anonymous mapping, committed page by page as it is
    written and unmapped when the tensor is freed."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    mapping = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)
