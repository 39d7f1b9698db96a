"""What every causal LM offers the model runner."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from engine.backends import Backends
from engine.cache.tensors import CacheTensors
from engine.forward_batch import ForwardBatch
from engine.model_config import ModelConfig
from engine.models.layers import RMSNorm, layer_output
from kernels.env import env_switch


def fused_residual_adds() -> bool:
    """``TANDEM_FUSED_RESIDUAL``: 1 (default) carries each layer's residual sum into the next norm; 0 adds it
    after every layer, then a plain norm — the kernels before the fusion, for A / B runs of the one-process
    forward (same values on the reference path: the same adds in another place). Pipeline stages
    (engine/parallel/runner.py) always carry the pair and add it once at their boundary."""
    return env_switch("TANDEM_FUSED_RESIDUAL", True)


class CausalLM(nn.Module):
    """embed -> decoder layers -> final norm -> lm_head. Subclasses build ``self.layers``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.backends: Backends | None = None
        self.aux_layer_ids: tuple[int, ...] = ()
        """Layers whose output (-1: the embedding) is captured at the logits rows for a drafter."""
        self.aux_states: torch.Tensor | None = None
        """[S, len(aux_layer_ids) * hidden] for the rows of batch.logits_indices, after each forward."""
        self.layer_hooks: list[Callable[[int, ForwardBatch], None]] = []
        """Called after each layer with (layer index, batch): the P/D producer streams the layer's
        finished pages and state from here while the next layers compute."""
        self.fuse_residual = fused_residual_adds()
        self.fuse_next_norm = True
        """Layers may run the norm after them in their last launch (``_norm_after``); off under TP, whose hooks
        all-reduce each block's partial output, which must not be normed first (engine/parallel/tp.py)."""

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        """Returns final-normed hidden states [T, hidden]."""
        assert self.backends is not None, "set model.backends before running"
        h, residual, normed = self._embed(batch.input_ids)
        taps: dict[int, torch.Tensor] = {}
        if -1 in self.aux_layer_ids:
            taps[-1] = (residual if normed else h)[batch.logits_indices]
        for i, layer in enumerate(self.layers):
            # layer i's output is h + residual, or with `normed` residual, h being the next norm's output
            h, residual, normed = layer(h, residual, batch, cache, self.backends, normed, self._norm_after(i))
            if not self.fuse_residual:
                h, residual = layer_output(h, residual), None
            if i in self.aux_layer_ids:
                idx = batch.logits_indices
                taps[i] = residual[idx] if normed else layer_output(h[idx], None if residual is None else residual[idx])
            for hook in self.layer_hooks:
                hook(i, batch)
        if self.aux_layer_ids:
            self.aux_states = torch.cat([taps[i] for i in self.aux_layer_ids], dim=-1)
        if normed:  # the last layer ran the final norm in its last launch
            return h
        if residual is None:
            return self.model.norm(h, self.backends)
        return self.model.norm.add(h, residual, self.backends)[0]

    def _embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The first layer's input: ``(embeddings, None, False)``, or with the first input norm run by the gather's
        launch where the norm backend has one (``embed_rms_norm``), ``(that norm's output, embeddings, True)``."""
        emb = self.model.embed_tokens.weight
        if self.fuse_residual and len(self.layers):
            norm = self.layers[0].input_layernorm
            fused = self.backends.norm.embed_rms_norm(emb, ids, norm.weight, norm.eps)
            if fused is not None:
                return fused[0], fused[1], True
        # a row gather by advanced indexing: nn.Embedding's index_select takes a one-block-per-slice CUDA kernel
        # at decode batches (11 us for 16 rows on the H200, against ~2 us); same rows, any device
        return emb[ids], None, False

    def _norm_after(self, i: int) -> RMSNorm | None:
        """The norm that follows layer i (the next layer's input norm, or the final norm), for the layer to run in
        its last launch where its backend can (``PreNormDecoderLayer.feed_forward_add_norm``); None with the
        residual adds unfused (``TANDEM_FUSED_RESIDUAL=0``), whose layers hand on their whole output."""
        if not (self.fuse_residual and self.fuse_next_norm):
            return None
        return self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.model.norm

    def pack_weights(self) -> None:
        """Stack the weights that one input multiplies into one tensor per block (views keep the parameter
        names): fewer, larger GEMMs. Done once after loading and placement; the engine does it on CUDA."""
        for m in self.modules():
            if m is not self and hasattr(m, "pack_weights"):
                m.pack_weights()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_raw_logits(hidden).float()

    def compute_raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's output in the model's dtype (bf16 on the GPU): what a device-side argmax reads, with no
        fp32 copy of the [T, V] logits when nothing else needs them."""
        return self.lm_head(hidden)


def pack_for_device(model: CausalLM, device: torch.device) -> None:
    """Pack the weights (CausalLM.pack_weights) on CUDA, and return the replaced tensors' memory to the device
    before the cache is sized from what is free. ``TANDEM_PACK_WEIGHTS=1`` packs on any device (tests of the
    packed layout on the host, e.g. under TP), ``0`` never."""
    choice = os.environ.get("TANDEM_PACK_WEIGHTS", "auto").strip().lower() or "auto"
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"TANDEM_PACK_WEIGHTS must be auto, 0 or 1, got {choice!r}")
    if choice == "0" or (choice == "auto" and device.type != "cuda"):
        return
    model.pack_weights()
    if device.type == "cuda":
        torch.cuda.empty_cache()
