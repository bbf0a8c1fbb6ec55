#!/usr/bin/env python3
"""Checks a `trellis export --format hf-gpt2` directory without the transformers package.

Parses OUTDIR/model.safetensors by hand (8-byte little-endian header length, JSON header, raw
little-endian data), checks the tensor names and shapes that transformers' GPT2LMHeadModel expects
from OUTDIR/config.json, and runs GPT-2's forward with Hugging Face's conventions — Conv1D weights
(in, out) applied as x @ W + b, gelu_new, LayerNorm eps from the config, the LM head tied to wte —
in float64 on the token ids given. With --logits FILE (Trellis's `generate --logits-out`:
float32, (tokens, vocab)) it compares the two and exits 1 when they differ by more than --tol.

usage: hf_gpt2_reference.py OUTDIR --ids 72,101,108 [--logits FILE] [--tol 1e-4]
"""
import argparse
import json
import math
import struct
import sys

import numpy as np
import torch


def load_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    tensors, spans = {}, []
    for name, info in header.items():
        if info["dtype"] != "F32":
            raise SystemExit(f"{name}: dtype {info['dtype']}, expected F32")
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"])) if info["shape"] else 1
        if end - begin != 4 * count:
            raise SystemExit(f"{name}: data_offsets {begin}..{end} do not hold shape {info['shape']}")
        spans.append((begin, end))
        arr = np.frombuffer(data[begin:end], dtype="<f4").reshape(info["shape"])
        tensors[name] = torch.from_numpy(arr.astype(np.float64))
    spans.sort()
    position = 0
    for begin, end in spans:  # the data is covered exactly, without gaps or overlaps
        if begin != position:
            raise SystemExit(f"data_offsets leave a gap or overlap at byte {position}")
        position = end
    if position != len(data):
        raise SystemExit(f"{len(data) - position} bytes after the last tensor")
    return meta, tensors


def expected_shapes(cfg):
    C, V, T = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]
    F = cfg.get("n_inner") or 4 * C
    shapes = {"transformer.wte.weight": [V, C], "transformer.wpe.weight": [T, C],
              "transformer.ln_f.weight": [C], "transformer.ln_f.bias": [C]}
    for l in range(cfg["n_layer"]):
        h = f"transformer.h.{l}."
        shapes.update({
            h + "ln_1.weight": [C], h + "ln_1.bias": [C],
            h + "attn.c_attn.weight": [C, 3 * C], h + "attn.c_attn.bias": [3 * C],
            h + "attn.c_proj.weight": [C, C], h + "attn.c_proj.bias": [C],
            h + "ln_2.weight": [C], h + "ln_2.bias": [C],
            h + "mlp.c_fc.weight": [C, F], h + "mlp.c_fc.bias": [F],
            h + "mlp.c_proj.weight": [F, C], h + "mlp.c_proj.bias": [C],
        })
    return shapes


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def gpt2_logits(cfg, w, ids):
    C, H = cfg["n_embd"], cfg["n_head"]
    hd, eps = C // H, cfg["layer_norm_epsilon"]
    T = len(ids)

    def ln(x, name):
        return torch.nn.functional.layer_norm(x, (C,), w[name + ".weight"], w[name + ".bias"], eps)

    def conv1d(x, name):  # HF's Conv1D: weight (in, out)
        return x @ w[name + ".weight"] + w[name + ".bias"]

    x = w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][:T]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for l in range(cfg["n_layer"]):
        h = f"transformer.h.{l}."
        q, k, v = conv1d(ln(x, h + "ln_1"), h + "attn.c_attn").split(C, dim=-1)
        q, k, v = (t.view(T, H, hd).transpose(0, 1) for t in (q, k, v))  # (H, T, hd)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(0, 1).reshape(T, C)
        x = x + conv1d(y, h + "attn.c_proj")
        x = x + conv1d(gelu_new(conv1d(ln(x, h + "ln_2"), h + "mlp.c_fc")), h + "mlp.c_proj")
    return ln(x, "transformer.ln_f") @ w["transformer.wte.weight"].T  # tied LM head


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--ids", required=True, help="comma-separated token ids")
    ap.add_argument("--logits", help="Trellis's float32 (tokens, vocab) logits to compare with")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()

    with open(f"{a.outdir}/config.json") as f:
        cfg = json.load(f)
    for key, want in [("model_type", "gpt2"), ("activation_function", "gelu_new"),
                      ("tie_word_embeddings", True), ("scale_attn_weights", True)]:
        if cfg.get(key, want) != want:
            raise SystemExit(f"config.json: {key} = {cfg.get(key)!r}, expected {want!r}")
    meta, w = load_safetensors(f"{a.outdir}/model.safetensors")
    if meta.get("format") != "pt":
        raise SystemExit(f"__metadata__ format {meta.get('format')!r}: transformers wants 'pt'")
    shapes = expected_shapes(cfg)
    if set(w) != set(shapes):
        raise SystemExit(f"tensor names differ: missing {sorted(set(shapes) - set(w))}, "
                         f"extra {sorted(set(w) - set(shapes))}")
    for name, shape in shapes.items():
        if list(w[name].shape) != shape:
            raise SystemExit(f"{name}: shape {list(w[name].shape)}, HF GPT-2 expects {shape}")
    print(f"safetensors: {len(w)} tensors with GPT2LMHeadModel's names and shapes")

    ids = [int(t) for t in a.ids.split(",")]
    logits = gpt2_logits(cfg, w, ids)
    if not a.logits:
        print("argmax after each token:", logits.argmax(-1).tolist())
        return 0
    trellis = np.fromfile(a.logits, dtype="<f4")
    if trellis.size != logits.numel():
        raise SystemExit(f"{a.logits}: {trellis.size} values, expected {len(ids)} x {cfg['vocab_size']}")
    diff = float((torch.from_numpy(trellis.astype(np.float64)).view_as(logits) - logits).abs().max())
    scale = float(logits.abs().max())
    print(f"max |logit| = {scale:.4g}, max |trellis - hf convention| = {diff:.3g} (tolerance {a.tol:g})")
    return 0 if diff <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
