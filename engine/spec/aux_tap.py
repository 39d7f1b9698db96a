"""Aux-tap drafter (the EAGLE-3 / DSpark family): fuses hidden states tapped from target layers and
proposes k tokens autoregressively with a small network of its own.

Tap convention: tap ``i >= 0`` is the *output* of target layer i (HF ``hidden_states[i + 1]``); tap
``-1`` is the embedding output (HF ``hidden_states[0]``).

Drafter step (weights in its own checkpoint, model_type ``tandem_aux_tap_drafter``):
    h_0     = fc(concat(taps))                                   # [H]
    x       = in_proj(concat(enorm(embed(token)), hnorm(h)))     # the next input token and state
    x       = x + mlp(post_norm(x))
    logits  = lm_head(norm(x));   h_next = x
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.models.layers import GatedMLP, RMSNorm
from engine.request import Request

MODEL_TYPE = "tandem_aux_tap_drafter"


class AuxTapDrafterModel(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, ht, v = cfg["hidden_size"], cfg["target_hidden_size"], cfg["vocab_size"]
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.aux_layer_ids = tuple(cfg["aux_layer_ids"])
        self.fc = nn.Linear(len(self.aux_layer_ids) * ht, h, bias=False)
        self.embed_tokens = nn.Embedding(v, h)
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.in_proj = nn.Linear(2 * h, h, bias=False)
        self.post_norm = RMSNorm(h, eps)
        self.mlp = GatedMLP(h, cfg["intermediate_size"])
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, v, bias=False)

    def step(self, hidden: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.in_proj(torch.cat([self.enorm(self.embed_tokens(token)), self.hnorm(hidden)], dim=-1))
        x = x + self.mlp(self.post_norm(x))
        return self.lm_head(self.norm(x)).float(), x


def load_drafter(path: str | Path, target_hidden: int, vocab: int, dtype: torch.dtype, device) -> AuxTapDrafterModel:
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"{path} is not an aux-tap drafter (model_type {cfg.get('model_type')!r}, want {MODEL_TYPE!r})"
        )
    if cfg["target_hidden_size"] != target_hidden or cfg["vocab_size"] != vocab:
        raise ValueError(
            f"drafter {path} was made for hidden {cfg['target_hidden_size']} / vocab {cfg['vocab_size']}, "
            f"the target has {target_hidden} / {vocab}"
        )
    model = AuxTapDrafterModel(cfg)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    want = model.state_dict()
    missing, extra = set(want) - set(state), set(state) - set(want)
    if missing or extra:
        raise ValueError(f"drafter checkpoint {path}: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
    for k, t in state.items():
        if tuple(t.shape) != tuple(want[k].shape):
            raise ValueError(f"drafter tensor {k!r} has shape {list(t.shape)}, expected {list(want[k].shape)}")
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


class AuxTapDrafter:
    needs_aux = True

    def __init__(self, model: AuxTapDrafterModel) -> None:
        self.model = model
        self.aux_layer_ids = model.aux_layer_ids

    @torch.inference_mode()
    def propose(self, req: Request, k: int, aux: torch.Tensor | None = None) -> list[int]:
        """aux: the target's taps [n_taps * hidden] at the position that produced the last token."""
        if aux is None or k <= 0:
            return []
        dev = self.model.fc.weight.device
        hidden = self.model.fc(aux.to(device=dev, dtype=self.model.fc.weight.dtype)[None])
        token = torch.tensor([req.all_token_ids[-1]], device=dev)
        out = []
        for _ in range(k):
            logits, hidden = self.model.step(hidden, token)
            token = torch.argmax(logits, dim=-1)
            out.append(int(token))
        return out


def make_tiny_drafter(
    out_dir: str | Path, target_dir: str | Path, aux_layer_ids: tuple[int, ...] = (-1, 1, 2), seed: int = 0
) -> Path:
    """A random-weight drafter for a target checkpoint (tests, demos): real format, no training."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = {
        "architectures": ["TandemAuxTapDrafter"],
        "model_type": MODEL_TYPE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "target_hidden_size": target["hidden_size"],
        "vocab_size": target["vocab_size"],
        "aux_layer_ids": list(aux_layer_ids),
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    }
    n_layers = target["num_hidden_layers"]
    bad = [t for t in aux_layer_ids if not -1 <= t < n_layers]
    if bad:
        raise ValueError(f"aux_layer_ids {bad} outside -1..{n_layers - 1}")
    torch.manual_seed(seed)
    model = AuxTapDrafterModel(cfg)
    gen = torch.Generator().manual_seed(seed)
    state = {
        k: torch.randn(v.shape, generator=gen) * (0.5 if v.dim() > 1 else 0.0) + (v.dim() == 1)
        for k, v in model.state_dict().items()
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
