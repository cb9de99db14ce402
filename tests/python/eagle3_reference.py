"""An independent numpy implementation of the EAGLE-3 draft head, written from the published
equations (Li et al., arXiv 2503.01840; vLLM ``llama_eagle3.py``; the ``speculators``
library's ``eagle3`` model), for the tests of ``specdraft.Eagle3Head``.

For the row of token ``t`` at position ``p``, given ``c``, the target's hiddens at the
captured layers side by side (computed at ``p - 1``, the hidden whose logits picked ``t``)::

    fused    = fc(c)                          a later draft step: the previous output h
    x        = [input_layernorm(embed(t)) | hidden_norm(fused)]      (2 * hidden wide)
    residual = fused                          hidden_norm(fused) with norm_before_residual
    q, k, v  = x Wq^T, x Wk^T, x Wv^T         RoPE (rotate-half) at the row's position
    h        = residual + o_proj(causal attention over the head's own rows, GQA)
    h        = h + down(silu(gate(n)) * up(n)),  n = post_attention_layernorm(h)
    logits   = lm_head(norm(h))               over the draft vocabulary
    draft    = d + d2t[d],  d = argmax logits   (the next step embeds this target id)

RoPE only sees position differences, so giving each row its token's position (as here) or
its hidden's (one less, as vLLM does) is the same attention.

Numerics: every BF16 activation is rounded where the Rust CPU kernels round it, with the
kernels' summation orders, through the primitives of ``mtp_reference.py`` (its numpy models
of RMSNorm, linear, attention dot products and sigmoid). The two then differ only by f32
summation order inside a kernel: a logit is within ``max|logit| / 256`` (one BF16 step at the
logits' scale) of the Rust head's.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("mtp_reference", _HERE / "mtp_reference.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

bf16, rms_norm, linear = ref.bf16, ref.rms_norm, ref.linear


def read_checkpoint(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(config.json, tensors)``: BF16/F32 tensors as float32, integer ones as int64."""
    cfg = json.loads((folder / "config.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, (dtype, shape, raw) in ref.st.read_safetensors(f).items():
            if dtype in ("I64", "I32"):
                tensors[name] = np.frombuffer(raw, "<i8" if dtype == "I64" else "<i4").astype(
                    np.int64
                )
            elif dtype != "BOOL":
                tensors[name] = ref.st.to_float32(dtype, shape, raw)
    return cfg, tensors


class Eagle3:
    """The head of one checkpoint folder (speculators or original layout), with its own KV."""

    def __init__(self, folder: Path, embed: np.ndarray | None = None):
        cfg, t = read_checkpoint(folder)
        layer_cfg = cfg.get("transformer_layer_config", cfg)
        self.h = layer_cfg["hidden_size"]
        self.heads = layer_cfg["num_attention_heads"]
        self.kvh = layer_cfg.get("num_key_value_heads", self.heads)
        self.hd = layer_cfg.get("head_dim", self.h // self.heads)
        self.eps = np.float32(layer_cfg.get("rms_norm_eps", 1e-6))
        self.vocab = layer_cfg["vocab_size"]
        self.norm_before_residual = bool(cfg.get("norm_before_residual", False))
        p = "midlayer." if "midlayer.self_attn.q_proj.weight" in t else "layers.0."
        self.embed = t["embed_tokens.weight"] if embed is None else embed
        self.fc = t["fc.weight"]
        self.input_ln, self.hidden_norm = (
            t[p + "input_layernorm.weight"],
            t[p + "hidden_norm.weight"],
        )
        self.post_ln = t[p + "post_attention_layernorm.weight"]
        self.wq, self.wk, self.wv, self.wo = (t[p + f"self_attn.{x}_proj.weight"] for x in "qkvo")
        self.wg, self.wu, self.wd = (t[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up", "down"))
        self.norm, self.lm = t["norm.weight"], t["lm_head.weight"]
        dv = self.lm.shape[0]
        d2t = t.get("d2t", np.zeros(dv, np.int64))
        self.draft_to_target = np.arange(dv, dtype=np.int64) + d2t
        base = float(layer_cfg.get("rope_theta", 10000.0))
        self.inv_freq = np.array(
            [1.0 / base ** (2.0 * i / self.hd) for i in range(self.hd // 2)], dtype=np.float64
        ).astype(np.float32)
        self.rows: list[tuple[int, np.ndarray, np.ndarray]] = []  # (position, k, v)

    def rope(self, x: np.ndarray, pos: int) -> np.ndarray:
        x = x.copy()
        half = len(self.inv_freq)
        ang = np.float32(pos) * self.inv_freq
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        a, b = x[:, :half].copy(), x[:, half : 2 * half].copy()
        x[:, :half] = bf16(a * cos - b * sin)
        x[:, half : 2 * half] = bf16(b * cos + a * sin)
        return x

    def step(self, token: int, hidden: np.ndarray, pos: int, from_target: bool, logits=True):
        """One row: writes its KV; returns ``(logits over the draft vocabulary, output h)``."""
        e = rms_norm(self.embed[token], self.input_ln, self.eps)
        fused = linear(hidden[None], self.fc)[0] if from_target else hidden
        hn = rms_norm(fused, self.hidden_norm, self.eps)
        residual = hn if self.norm_before_residual else fused
        x = np.concatenate([e, hn])[None]
        q = linear(x, self.wq)[0].reshape(self.heads, self.hd)
        k = linear(x, self.wk)[0].reshape(self.kvh, self.hd)
        v = linear(x, self.wv)[0].reshape(self.kvh, self.hd)
        q, k = self.rope(q, pos), self.rope(k, pos)
        self.rows.append((pos, k, v))
        if not logits:
            return None, None
        keys = np.stack([r[1] for r in self.rows])
        values = np.stack([r[2] for r in self.rows])
        group = self.heads // self.kvh
        out = np.zeros((self.heads, self.hd), np.float32)
        scale = np.float32(1.0) / np.sqrt(np.float32(self.hd))
        for hh in range(self.heads):
            g = hh // group
            s = ref.dot8(q[hh], keys[:, g, :]) * scale
            w = np.exp(s - s.max()).astype(np.float32)
            total = ref.seq_sum(w)
            for j in range(len(w)):
                out[hh] = out[hh] + (w[j] / total) * values[j, g, :]
        attn = bf16(out).reshape(-1)
        h = bf16(residual + linear(attn[None], self.wo)[0])
        n = rms_norm(h, self.post_ln, self.eps)
        gg, uu = linear(n[None], self.wg)[0], linear(n[None], self.wu)[0]
        m = bf16(gg * ref.sigmoid(gg) * uu)
        h = bf16(h + linear(m[None], self.wd)[0])
        return ref.dot16(rms_norm(h, self.norm, self.eps), self.lm), h

    def draft(self, token: int, captured: np.ndarray, pos: int, n: int, mask=None):
        """``n`` drafts (target ids) from the token at ``pos`` and its captured rows; with a
        ``mask`` (a set of allowed target ids) only draft ids whose target id it allows.
        Returns ``(drafts, logits of the last step)``."""
        drafts, hidden, logits = [], captured, None
        for j in range(n):
            logits, hidden = self.step(token, hidden, pos + j, j == 0)
            masked = logits
            if mask is not None:
                ok = np.array([int(t) in mask for t in self.draft_to_target])
                masked = np.where(ok, logits, -np.inf)
            token = int(self.draft_to_target[int(np.argmax(masked))])
            drafts.append(token)
        return drafts, logits

    def keep_through(self, position: int) -> None:
        """Drops every row after ``position`` (a verify's rejected drafts)."""
        self.rows = [r for r in self.rows if r[0] <= position]
