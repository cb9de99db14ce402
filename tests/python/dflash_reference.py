"""An independent numpy implementation of the DFlash draft head, written from the published
equations (arXiv 2602.06036; z-lab's ``dflash/model.py``: ``DFlashDraftModel``,
``Qwen3DFlashAttention``, ``dflash_generate``), for the tests of ``specdraft.DFlashHead``.

Context: for each committed position ``q`` the target's hiddens at the tapped layers, side by
side (``extract_context_feature``: ``hidden_states[id + 1]``, the output of layer ``id``)::

    x_q = hidden_norm(fc(c_q))                  the same x_q feeds every draft layer
    k_q = k_norm(k_proj(x_q)), RoPE at q        per layer; no input_layernorm on x_q
    v_q = v_proj(x_q)

The block after the token ``t`` at position ``p``: rows ``[t, mask, ..., mask]`` (``γ`` of them)
at positions ``p .. p + γ - 1``, embedded with the target's embedding; per draft layer::

    n    = input_layernorm(h)
    q    = q_norm(q_proj(n)), RoPE;  k = k_norm(k_proj(n)), RoPE;  v = v_proj(n)
    h    = h + o_proj(attention of q over [context keys; block keys], NOT causal, GQA)
    h    = h + down(silu(gate(m)) * up(m)),  m = post_attention_layernorm(h)

then ``norm`` and the target's LM head; the draft for position ``p + j`` is the argmax of
block row ``j`` (``j = 1 .. γ - 1``). The block's keys never stay: the cache is cropped to the
committed length each round (``past_key_values_draft.crop(start)``).

Numerics: every BF16 activation is rounded where the Rust CPU kernels round it, through the
primitives of ``mtp_reference.py`` (RMSNorm with the kernel's lane sums, linear with its
16-lane dot products, the attention's 8-lane dot products). The two then differ only by f32
summation order and the kernels' exp: a logit is within ``max|logit| / 256`` (one BF16 step at
the logits' scale) of the Rust head's.
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


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps (``build_target_layer_ids``)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [
        int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)
    ]


class DFlash:
    """The head of one checkpoint folder, given the target's ``[vocab, hidden]`` embedding
    and LM head (as the target holds them), with its own context keys and values."""

    def __init__(self, folder: Path, embed: np.ndarray, lm_head: np.ndarray, draft_vocab=None):
        cfg = json.loads((folder / "config.json").read_text())
        t: dict[str, np.ndarray] = {}
        for f in sorted(folder.glob("*.safetensors")):
            for name, (dtype, shape, raw) in ref.st.read_safetensors(f).items():
                t[name] = ref.st.to_float32(dtype, shape, raw)
        self.h = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.kvh = cfg.get("num_key_value_heads", self.heads)
        self.hd = cfg.get("head_dim", self.h // self.heads)
        self.eps = np.float32(cfg.get("rms_norm_eps", 1e-6))
        self.block_size = cfg["block_size"]
        d = cfg["dflash_config"]
        self.mask_token_id = d["mask_token_id"]
        self.taps = d.get("target_layer_ids") or build_target_layer_ids(
            cfg["num_target_layers"], cfg["num_hidden_layers"]
        )
        self.fc, self.hidden_norm, self.norm = (
            t["fc.weight"],
            t["hidden_norm.weight"],
            t["norm.weight"],
        )
        self.layers = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            w = {x: t[p + f"self_attn.{x}_proj.weight"] for x in "qkvo"}
            w["q_norm"], w["k_norm"] = (
                t[p + "self_attn.q_norm.weight"],
                t[p + "self_attn.k_norm.weight"],
            )
            w["in_ln"], w["post_ln"] = (
                t[p + "input_layernorm.weight"],
                t[p + "post_attention_layernorm.weight"],
            )
            for x in ("gate", "up", "down"):
                w[x] = t[p + f"mlp.{x}_proj.weight"]
            self.layers.append(w)
        self.embed = embed
        self.lm = lm_head[: draft_vocab or lm_head.shape[0]]
        base = float(cfg.get("rope_theta", 10000.0))
        self.inv_freq = np.array(
            [1.0 / base ** (2.0 * i / self.hd) for i in range(self.hd // 2)], dtype=np.float64
        ).astype(np.float32)
        # Per layer, the context rows: (position, k [kvh, hd], v [kvh, hd]).
        self.ctx: list[list[tuple[int, np.ndarray, np.ndarray]]] = [[] for _ in self.layers]

    def rope(self, x: np.ndarray, pos: int) -> np.ndarray:
        """Rotate-half RoPE of ``x`` ``[heads, hd]`` at ``pos``."""
        x = x.copy()
        half = len(self.inv_freq)
        ang = np.float32(pos) * self.inv_freq
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        a, b = x[:, :half].copy(), x[:, half : 2 * half].copy()
        x[:, :half] = bf16(a * cos - b * sin)
        x[:, half : 2 * half] = bf16(b * cos + a * sin)
        return x

    def _kv(self, w, n: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        k = rms_norm(linear(n[None], w["k"])[0].reshape(self.kvh, self.hd), w["k_norm"], self.eps)
        v = linear(n[None], w["v"])[0].reshape(self.kvh, self.hd)
        return self.rope(k, pos), v

    def add_context(self, rows: np.ndarray, first: int) -> None:
        """Context rows from captured rows ``[k, taps * hidden]`` computed at ``first ..``."""
        for i, c in enumerate(rows):
            x = rms_norm(linear(c[None], self.fc)[0], self.hidden_norm, self.eps)
            for layer, w in zip(self.ctx, self.layers, strict=True):
                layer.append((first + i, *self._kv(w, x, first + i)))

    def keep_before(self, position: int) -> None:
        """Drops the context rows at or after ``position``."""
        self.ctx = [[r for r in layer if r[0] < position] for layer in self.ctx]

    def block(self, token: int, pos: int, mask: set[int] | None = None):
        """The block after ``token`` at ``pos``: ``(drafts, logits [γ - 1, draft vocab])``; with
        ``mask`` (allowed ids) only allowed ids are drafted, ending before a row with none."""
        g = self.block_size
        h = self.embed[[token] + [self.mask_token_id] * (g - 1)].astype(np.float32)
        group = self.heads // self.kvh
        scale = np.float32(1.0) / np.sqrt(np.float32(self.hd))
        for ctx, w in zip(self.ctx, self.layers, strict=True):
            n = rms_norm(h, w["in_ln"], self.eps)
            q = [
                self.rope(
                    rms_norm(
                        linear(n[j][None], w["q"])[0].reshape(self.heads, self.hd),
                        w["q_norm"],
                        self.eps,
                    ),
                    pos + j,
                )
                for j in range(g)
            ]
            block_kv = [self._kv(w, n[j], pos + j) for j in range(g)]
            keys = np.stack([r[1] for r in ctx] + [kv[0] for kv in block_kv])
            values = np.stack([r[2] for r in ctx] + [kv[1] for kv in block_kv])
            attn = np.zeros((g, self.heads * self.hd), np.float32)
            for j in range(g):  # every row sees every key: non-causal
                out = np.zeros((self.heads, self.hd), np.float32)
                for hh in range(self.heads):
                    kv = hh // group
                    s = ref.dot8(q[j][hh], keys[:, kv, :]) * scale
                    e = np.exp(s - s.max()).astype(np.float32)
                    total = ref.seq_sum(e)
                    for m in range(len(e)):
                        out[hh] = out[hh] + (e[m] / total) * values[m, kv, :]
                attn[j] = bf16(out).reshape(-1)
            h = bf16(h + linear(attn, w["o"]))
            m = rms_norm(h, w["post_ln"], self.eps)
            gg, uu = linear(m, w["gate"]), linear(m, w["up"])
            h = bf16(h + linear(bf16(gg * ref.sigmoid(gg) * uu), w["down"]))
        logits = ref.dot16(rms_norm(h[1:], self.norm, self.eps), self.lm)
        drafts = []
        for row in logits:
            if mask is not None:
                ok = np.array([i in mask for i in range(len(row))])
                if not ok.any():
                    break
                row = np.where(ok, row, -np.inf)
            drafts.append(int(np.argmax(row)))
        return drafts, logits
