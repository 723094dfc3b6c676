"""Forward passes in llama.cpp for the shared `ContinuousBatcher`: its `Runner` (loop/runner.py)
over a llama.cpp context.

Slot i is llama.cpp sequence i. A decode pass is ONE `llama_decode` over the running sequences,
one token each; a prefill pass is one `llama_decode` over the chunks of a few sequences, with
logits asked only where the batcher reads them. The KV memory is one pool of cells shared by all
sequences (`kv_unified`), so copying a prompt's cache into another slot (compaction, forking n
sequences) only tags its cells with one more sequence id: no data moves.
"""

from __future__ import annotations

import ctypes
import os
import weakref

import llama_cpp
import numpy as np
import torch

from handlers.engine.llamacpp.model import LlamaCppModel
from handlers.engine.loop.runner import PrefillChunk

_DECODE_ERRORS = {1: "the KV cache pool is full", 2: "aborted", -1: "invalid batch"}


class KVMemory:
    """The context's KV memory, by sequence (= slot)."""

    def __init__(self, ctx: ctypes.c_void_p, slots: int) -> None:
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._slots = slots  # sequences 0..slots-1 are the batch's; those above, kept prefixes

    def remove(self, seq: int, start: int = -1) -> None:
        """Drop the sequence's positions from `start` on (all of them by default)."""
        llama_cpp.llama_memory_seq_rm(self._mem, seq, start, -1)

    def copy(self, src: int, dst: int, length: int) -> None:
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, 0, length)

    def positions(self, seq: int) -> tuple[int, int]:
        """The sequence's first and last cached positions; (-1, -1) when it holds none."""
        return (llama_cpp.llama_memory_seq_pos_min(self._mem, seq),
                llama_cpp.llama_memory_seq_pos_max(self._mem, seq))

    def shrink(self) -> None:
        """Called when no sequence holds a slot: every batch cell is free again (the pool itself
        is allocated once, with the context); kept prefixes stay."""
        for seq in range(self._slots):
            self.remove(seq)


class _Batch:
    """A `llama_batch` over numpy arrays, filled by slices rather than token by token."""

    def __init__(self, capacity: int) -> None:
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        self._n_seq_id = np.ones(capacity, np.int32)
        seq_ptr = ctypes.POINTER(llama_cpp.llama_seq_id)
        base = self.seq.ctypes.data
        self._seq_ptrs = (seq_ptr * capacity)(
            *(ctypes.cast(base + 4 * i, seq_ptr) for i in range(capacity)))
        self.struct = llama_cpp.llama_batch(
            n_tokens=0, token=self.token.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token)),
            embd=None, pos=self.pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos)),
            n_seq_id=self._n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=self._seq_ptrs, logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)))


class LlamaCppRunner:
    def __init__(self, model: LlamaCppModel, num_slots: int, max_batch_tokens: int,
                 pool_tokens: int, prefix_places: int = 0) -> None:
        """`max_batch_tokens`: the most tokens one pass runs (a prefill step's budget, or a
        decode pass's rows); `pool_tokens`: the KV cells all sequences share; `prefix_places`:
        sequences beyond the slots that keep prompt prefixes (prefix_cache.py)."""
        self.vocab_size = model.vocab_size
        self.device = model.device
        self.num_slots = num_slots
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.prefix_places = prefix_places
        self._spare = list(range(num_slots, num_slots + prefix_places))
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = pool_tokens
        self._swap_seq = num_slots + prefix_places  # a sequence of its own, to trade two slots
        params.n_seq_max = num_slots + prefix_places + 1
        # llama.cpp reserves one output per sequence at init and aborts the process (not an
        # error) when a batch holds fewer: a prefill budget under the sequences' count.
        params.n_batch = params.n_ubatch = max(max_batch_tokens, params.n_seq_max)
        params.kv_unified = True
        params.type_k = params.type_v = model.kv_type.ggml
        if model.kv_type.quantized:  # llama.cpp reads a quantized V cache in flash attention only
            if hasattr(params, "flash_attn_type"):
                params.flash_attn_type = 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED
            else:
                params.flash_attn = True
        params.n_threads = params.n_threads_batch = len(os.sched_getaffinity(0))
        params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(model.handle, params)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {pool_tokens} tokens "
                               f"for {num_slots} sequences")
        weakref.finalize(self, llama_cpp.llama_free, self._ctx)  # a reset engine drops it
        self.cache = KVMemory(self._ctx, num_slots)
        self._batch = _Batch(max_batch_tokens)

    def decode(self, token_ids: list[int], lengths: list[int], first_slot: int = 0) -> torch.Tensor:
        """One token for each row in the contiguous slots first_slot.., whose `lengths` tokens
        are cached already. Returns float32 logits [B, V]."""
        rows = len(token_ids)
        batch = self._batch
        batch.token[:rows] = token_ids
        batch.pos[:rows] = lengths
        batch.seq[:rows] = np.arange(first_slot, first_slot + rows)
        batch.logits[:rows] = 1
        return self._run(rows, rows)

    def prefill(self, chunks: list[PrefillChunk]) -> list[torch.Tensor]:
        """Run prompt chunks; returns per chunk float32 logits [1, V] (last position) or
        [len, V] (every position, when `all_logits`)."""
        batch, at, outputs = self._batch, 0, []
        for chunk in chunks:
            size = len(chunk.token_ids)
            self.cache.remove(chunk.slot, chunk.start)  # its positions are this chunk's now
            span = slice(at, at + size)
            batch.token[span] = chunk.token_ids
            batch.pos[span] = np.arange(chunk.start, chunk.start + size)
            batch.seq[span] = chunk.slot
            batch.logits[span] = chunk.all_logits
            batch.logits[at + size - 1] = 1
            outputs.append(size if chunk.all_logits else 1)
            at += size
        logits = self._run(at, sum(outputs))
        return list(torch.split(logits, outputs))

    def move(self, src: int, dst: int, length: int) -> None:
        """Give slot `dst` the first `length` positions of slot `src` (src keeps them)."""
        self.cache.remove(dst)
        if length:
            self.cache.copy(src, dst, length)

    def swap(self, a: int, b: int, a_len: int, b_len: int) -> None:
        """Trade the first positions of two slots (`a_len` of a's, `b_len` of b's)."""
        self.move(a, self._swap_seq, a_len)
        self.move(b, a, b_len)
        self.move(self._swap_seq, b, a_len)
        self.cache.remove(self._swap_seq)

    def save_prefix(self, slot: int, length: int) -> int:
        """Keep the slot's first `length` positions in a spare sequence (cells are shared, not
        copied: they outlive the slot's sequence)."""
        seq = self._spare.pop()
        self.cache.copy(slot, seq, length)
        return seq

    def load_prefix(self, saved: int, slot: int, length: int) -> None:
        self.move(saved, slot, length)

    def drop_prefix(self, saved: int) -> None:
        self.cache.remove(saved)
        self._spare.append(saved)

    def use_adapter(self, slot: int, adapter: str | None) -> bool:
        if adapter is not None:  # the engine refuses such requests before they get here
            raise ValueError(f"LoRA adapter {adapter!r}: the llamacpp engine serves none")
        return True

    def release(self, slot: int) -> None:
        """The slot's sequence ended: its cells go back to the pool now."""
        self.cache.remove(slot)

    def _run(self, tokens: int, outputs: int) -> torch.Tensor:
        """llama_decode the batch's first `tokens`; the `outputs` rows of logits it asked for."""
        self._batch.struct.n_tokens = tokens
        code = llama_cpp.llama_decode(self._ctx, self._batch.struct)
        if code != 0:
            raise RuntimeError(f"llama_decode failed ({code}: "
                               f"{_DECODE_ERRORS.get(code, 'fatal error')})")
        logits = llama_cpp.llama_get_logits(self._ctx)
        rows = np.ctypeslib.as_array(logits, shape=(outputs, self.vocab_size))
        return torch.from_numpy(rows.copy())
