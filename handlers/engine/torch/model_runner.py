"""Forward passes over a Hugging Face causal LM with a slot KV cache: prefill chunks and decode
(the shared batcher's `Runner`, loop/runner.py).

Every sequence owns one cache slot. A decode pass runs the rows in slots 0..B-1 with one new token
each; a prefill pass runs a chunk of prompt tokens for a few sequences, padded to the longest chunk.
Both pass an explicit 4D additive attention mask and explicit positions, so rows of different
lengths share one batch without any left padding in the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from handlers.engine.loop import row_reductions
from handlers.engine.loop.runner import PrefillChunk
from handlers.engine.torch import invariant_attention
from handlers.engine.torch.attention import use_slot_cache_attention, visible_keys
from handlers.engine.torch.cuda_graphs import CudaDecodeGraphs
from handlers.engine.torch.decode_graphs import DecodeGraphs
from handlers.engine.torch.fused_projections import fuse_projections
from handlers.engine.torch.kv_cache import SavedPrefix, SlotKVCache
from handlers.engine.torch.llama_stack import LlamaStack
from handlers.engine.torch.lora import LoraSet
from handlers.engine.torch.media_prompts import prompt_embeddings
from handlers.engine.torch.onednn_linear import use_onednn_linears
from handlers.engine.types import MediaInputs

log = logging.getLogger(__name__)


class ModelRunner:
    prefix_places = None  # kept prefixes are copies of their own: as many as the budget holds

    def __init__(self, model: nn.Module, num_slots: int, max_len: int,
                 graphs: DecodeGraphs | None = None, lora: LoraSet | None = None,
                 cuda_graphs: bool = False, kv_dtype: torch.dtype = torch.float32) -> None:
        """`kv_dtype`: what the KV cache stores (TorchEngine resolves option.kv_cache_dtype:
        kv_dtype.py); `graphs` must have been compiled for it."""
        if graphs is not None and graphs.kv_dtype != kv_dtype:
            raise ValueError(f"decode graphs over a {graphs.kv_dtype} KV cache cannot serve a "
                             f"{kv_dtype} one")
        self.model = model
        self.graphs = graphs  # compiled decode steps, used for the row counts they have
        self.lora = lora  # LoRA adapters, applied to the rows whose slots use one
        self._slot_adapters = [0] * num_slots  # each slot's adapter slot (0: the base model)
        config = model.config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.device = model.device
        self.dtype = model.dtype
        # A multimodal model: what runs here (fused, rerouted attention, oneDNN) is its language
        # model; its encoders run as transformers wrote them (prompt_embeddings).
        self.multimodal = getattr(model.config, "vision_config", None) is not None
        language = model.get_decoder() if self.multimodal else model
        # On the CPU attention runs in float32, reading the cache as stored (see attention.py).
        cpu = self.device.type == "cpu"
        self.mask_dtype = torch.float32 if cpu else self.dtype
        if self.device.type == "cpu":
            use_slot_cache_attention(language)
            # Built now (a first start: seconds, minutes on a busy machine), not inside a first
            # request's step, where building past option.engine_stall_timeout stopped the server.
            row_reductions.available()
            invariant_attention.available()
        self.vocab_size = model.get_output_embeddings().out_features
        log.info("%d projection groups fused", fuse_projections(language))  # before packing
        if lora is not None:
            lora.attach(model)
        if self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16):
            log.info("%d linear layers run on oneDNN",
                     use_onednn_linears(language, self.dtype))
        self.num_slots = num_slots
        self.cache = SlotKVCache(
            num_layers=config.num_hidden_layers,
            # the CUDA graphs' padding rows write a slot of their own
            num_slots=num_slots + (1 if cuda_graphs else 0),
            num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            head_dim=head_dim,
            dtype=kv_dtype,
            device=self.device,
            max_len=max_len,
            # elsewhere transformers' attention reads keys and values in the model's dtype
            read_dtype=None if cpu else self.dtype,
        )
        self._decoder = model.get_decoder()
        # After fusing (it calls the fused projections); CPU only: with a mask, CUDA's SDPA has
        # no grouped-query kernel but the math one, slower than transformers' repeated heads.
        self._stack = LlamaStack.of(model, max_len) if self.device.type == "cpu" else None
        self._lm_head = model.get_output_embeddings()
        self._neg_inf = torch.finfo(self.mask_dtype).min
        self.cuda_graphs = CudaDecodeGraphs(self._logits, self.cache, num_slots) \
            if cuda_graphs else None
        # With fewer rows than threads, torch splits a row's reductions (RMSNorm's mean) across
        # threads, in another order than when each row has a thread: results depend on the batch
        # size. In 16-bit that flips roundings, and so sampled tokens; a 16-bit decode pass on the
        # CPU therefore runs at least this many rows, repeating row 0 (it writes the same cache
        # entry with the same bits). float32 differences stay ~1e-6, not worth a slower B=1.
        self.min_rows = torch.get_num_threads() if cpu and self.dtype != torch.float32 else 1

    @torch.inference_mode()
    def decode(self, token_ids: list[int], lengths: list[int], first_slot: int = 0) -> torch.Tensor:
        """One token for each row in the contiguous slots first_slot.., whose `lengths` tokens are
        cached already. Returns float32 logits [B, V]."""
        rows = len(token_ids)
        row_slots = list(range(first_slot, first_slot + rows))
        if self.cuda_graphs is not None and not first_slot and not self._adapted(row_slots):
            self._use_adapters(row_slots)  # none: the graphs were captured without
            try:
                return self.cuda_graphs.decode(token_ids, lengths)
            except RuntimeError:  # a model whose step cannot be captured still serves
                log.exception("capturing the decode step as a CUDA graph failed: decoding "
                              "eagerly from now on")
                self.cuda_graphs = None
        # The graphs are the base model's: a pass with adapter rows runs eagerly.
        graph = None if self.graphs is None or first_slot or self._adapted(row_slots) \
            else self.graphs.for_rows(rows)
        pad = 0 if graph is not None else max(0, self.min_rows - rows)  # a graph: one per row
        row_slots += [first_slot] * pad  # padding repeats row 0
        self._use_adapters(row_slots)
        ids = torch.tensor(token_ids + token_ids[:1] * pad, device=self.device)[:, None]
        lens = torch.tensor(lengths + lengths[:1] * pad, device=self.device)
        read_len = int(lens.max()) + 1
        keys = torch.arange(read_len, device=self.device)
        mask = self._additive(keys[None, :] <= lens[:, None])[:, None, None, :]
        slots = torch.tensor(row_slots) if pad else slice(first_slot, first_slot + rows)
        self.cache.bind(slots, lens[:, None], read_len)
        if graph is not None:
            return graph(ids, lens[:, None], mask, self.cache.keys, self.cache.values)
        hidden = self._forward(ids, lens[:, None], mask)
        return self._lm_head(hidden[:rows, -1]).float()

    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk]) -> list[torch.Tensor]:
        """Run prompt chunks; returns per chunk float32 logits [1, V] (last position) or
        [len, V] (every position, when `all_logits`)."""
        width = max(len(c.token_ids) for c in chunks)
        ids = torch.zeros((len(chunks), width), dtype=torch.long, device=self.device)
        starts = torch.tensor([c.start for c in chunks], device=self.device)
        sizes = torch.tensor([len(c.token_ids) for c in chunks], device=self.device)
        for row, chunk in enumerate(chunks):
            ids[row, : len(chunk.token_ids)] = torch.tensor(chunk.token_ids)
        offsets = torch.arange(width, device=self.device)
        positions = starts[:, None] + offsets[None, :]  # padded queries write past the end: unread
        read_len = int(positions.max()) + 1
        keys = torch.arange(read_len, device=self.device)
        visible = keys[None, None, :] <= positions[:, :, None]
        # A padded query attends to key 0 only, so its softmax stays finite.
        visible &= (offsets[None, :, None] < sizes[:, None, None]) | (keys[None, None, :] == 0)
        mask = self._additive(visible)[:, None]
        slots = torch.tensor([c.slot for c in chunks])
        self._use_adapters([c.slot for c in chunks])
        self.cache.bind(slots, positions, read_len)
        hidden = self._forward(ids, positions, mask, self._embeds(ids, chunks))
        logits = []
        for row, chunk in enumerate(chunks):
            n = len(chunk.token_ids)
            rows = hidden[row, :n] if chunk.all_logits else hidden[row, n - 1 : n]
            logits.append(self._lm_head(rows).float())
        return logits

    def verify(self, token_ids: list[list[int]], lengths: list[int]) -> list[torch.Tensor]:
        """Speculated tokens (loop/speculation.py): for each row in slots 0.., whose `lengths`
        tokens are cached, its tokens from position lengths[i] in one eager pass, float32 logits
        [len, V] per row. Its attention and linears give each position the bits a one-token
        decode step gives it (float32 linears: ~1e-5 apart from a one-row step, which oneDNN
        runs as a GEMV; docs/engines.md#speculative-decoding). Like a decode pass, a 16-bit
        one reads at least `min_rows` positions: row 0's tokens are repeated (same slot, same
        positions, same bits written)."""
        chunks = [PrefillChunk(slot=slot, token_ids=ids, start=start, all_logits=True)
                  for slot, (ids, start) in enumerate(zip(token_ids, lengths, strict=True))]
        short = self.min_rows - sum(len(ids) for ids in token_ids)
        pads = -(-short // len(token_ids[0])) if short > 0 else 0
        return self.prefill(chunks + [chunks[0]] * pads)[: len(chunks)]

    def truncate(self, slot: int, length: int) -> None:
        self.cache.truncate(slot, length)

    def _embeds(self, ids: torch.Tensor, chunks: list[PrefillChunk]) -> torch.Tensor | None:
        """The pass's input embeddings where a chunk brings its own (media), else None."""
        if all(c.embeds is None for c in chunks):
            return None
        embeds = self._decoder.get_input_embeddings()(ids)
        for row, chunk in enumerate(chunks):
            if chunk.embeds is not None:
                embeds[row, : len(chunk.token_ids)] = chunk.embeds.to(embeds.dtype)
        return embeds

    def prompt_embeddings(self, inputs: MediaInputs) -> torch.Tensor:
        return prompt_embeddings(self.model, inputs)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 embeds: torch.Tensor | None = None):
        if self._stack is not None and embeds is None:
            return self._stack.forward(ids, positions, mask, self.cache)
        tokens = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
        with visible_keys(positions + 1):  # what slot_cache_attention computes over
            out = self._decoder(**tokens, position_ids=positions, attention_mask=mask,
                                past_key_values=self.cache, use_cache=True)
        return out.last_hidden_state

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor):
        """Each row's next-token logits [B, V], row i seeing the keys `visible[i]` (the step
        cuda_graphs.py captures)."""
        mask = self._additive(visible)[:, None, None, :]
        return self._lm_head(self._forward(ids, positions, mask)[:, -1])

    def _adapted(self, slots: Iterable[int]) -> bool:
        return self.lora is not None and any(self._slot_adapters[slot] for slot in slots)

    def _use_adapters(self, slots: list[int]) -> None:
        """The next pass applies the adapters of the sequences in `slots`, one per row."""
        if self.lora is not None:
            rows = [self._slot_adapters[slot] for slot in slots]
            self.lora.rows.use(torch.tensor(rows, device=self.device) if any(rows) else None)

    def use_adapter(self, slot: int, adapter: str | None) -> bool:
        """The sequence in `slot` runs with LoRA adapter `adapter` (None: the base model);
        False when the adapter cannot be stacked now (max_loras others are running)."""
        if adapter is None:
            self._slot_adapters[slot] = 0
            return True
        if self.lora is None:
            raise ValueError(f"LoRA adapter {adapter!r}: this model serves no adapters")
        stacked = self.lora.slot_for(adapter, set(self._slot_adapters) - {0})
        if stacked is None:
            return False
        self._slot_adapters[slot] = stacked
        return True

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.mask_dtype, device=self.device)
        return torch.where(visible, zero, self._neg_inf)

    def move(self, src: int, dst: int, length: int) -> None:
        self.cache.copy_slot(src, dst, length)
        self._slot_adapters[dst] = self._slot_adapters[src]

    def swap(self, a: int, b: int, a_len: int, b_len: int) -> None:
        self.cache.swap_slots(a, b, a_len, b_len)
        adapters = self._slot_adapters
        adapters[a], adapters[b] = adapters[b], adapters[a]

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cache.bytes_per_token

    def save_prefix(self, slot: int, length: int) -> SavedPrefix:
        return self.cache.save(slot, length)

    def load_prefix(self, saved: SavedPrefix, slot: int, length: int) -> None:
        self.cache.load(saved, slot, length)

    def drop_prefix(self, saved: SavedPrefix) -> None:
        """A saved copy is memory of its own: dropping the last reference frees it."""

    def release(self, slot: int) -> None:
        """The slot's sequence ended; its next user overwrites what it cached."""
        self.cache.release(slot)
        self._slot_adapters[slot] = 0
