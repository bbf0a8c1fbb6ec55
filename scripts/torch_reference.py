#!/usr/bin/python3
"""A PyTorch reference for Trellis: rebuilds the GPT from a Trellis HDF5 checkpoint and recomputes
the loss of one global batch, independently of the C++ code.

    /usr/bin/python3 scripts/torch_reference.py RUN/ckpt/step_00000002.h5 --step 2

prints `loss = <9 significant digits>`: the mean cross-entropy over every token of the global batch
of step index 2 (0-based), computed with the parameters in the file. A checkpoint named
step_0000000N.h5 holds the parameters after N optimizer steps, i.e. those that step index N uses,
so `--step N` (the default: the file's `step` attribute) reproduces the loss that metrics.csv
reports in its row N + 1.

Everything it needs comes from the file: the model's shape and the data from the `deck` attribute
(the effective deck), the weights from `model/<name>` (global shapes, whatever layout wrote them).
Needs torch, h5py and numpy (Debian: python3-torch python3-h5py python3-numpy). Data sources:
`text` (the bytes of data.path) and `tokens` (llm.c uint16/uint32 or raw uint16 shards); `synthetic` is not
reimplemented here.
"""
import argparse
import bisect
import configparser
import glob
import math
import os
import sys

import h5py
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------------
# The model. Each module mirrors one Trellis kernel (lib/backend/cpu/) and one part of
# GPT::block_forward / GPT::forward (lib/model/gpt.cpp). Parameter names are the checkpoint's
# (lib/model/params.cpp), with `.weight` added to the two embeddings.

LN_EPS = 1e-5  # CpuBackend::layernorm_forward: 1 / sqrt(var + 1e-5), biased variance


class CausalSelfAttention(nn.Module):
    """CpuBackend::attention_forward: causal softmax(Q·Kᵀ / sqrt(hd))·V with grouped key/value
    heads. c_attn's output rows are the query heads, then the key heads, then the value heads,
    hd rows each; query head h reads key/value head h // (heads / kv_heads)."""

    def __init__(self, d_model, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d_model // heads
        # matmul_forward: y = x·Wᵀ + b with W (out, in), as nn.Linear
        self.c_attn = nn.Linear(d_model, (heads + 2 * kv_heads) * self.hd)
        self.c_proj = nn.Linear(heads * self.hd, d_model)

    def forward(self, x):
        B, T, _ = x.shape
        H, KV, hd = self.heads, self.kv_heads, self.hd
        qkv = self.c_attn(x)  # (B, T, (H + 2·KV)·hd)
        q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
        q = q.view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, KV, hd).transpose(1, 2)
        group = H // KV  # query heads per key/value head: head h uses h // group
        k = k.repeat_interleave(group, dim=1)  # (B, H, T, hd)
        v = v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))  # causal_softmax_rows: j ≤ i only
        y = scores.softmax(dim=-1) @ v  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, H * hd)  # out (B, T, H·hd), head h at columns h·hd
        return self.c_proj(y)


class MLP(nn.Module):
    """c_fc (column parallel in Trellis), GELU, c_proj (row parallel)."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.c_fc = nn.Linear(d_model, d_ff)
        self.c_proj = nn.Linear(d_ff, d_model)

    def forward(self, x):
        # CpuBackend::gelu_forward: ½x(1 + tanh(√(2/π)(x + 0.044715x³)))
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """GPT::block_forward: res2 = x + attn(ln_1(x)); res3 = res2 + mlp(ln_2(res2))."""

    def __init__(self, d_model, heads, kv_heads, d_ff):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=LN_EPS)
        self.attn = CausalSelfAttention(d_model, heads, kv_heads)
        self.ln_2 = nn.LayerNorm(d_model, eps=LN_EPS)
        self.mlp = MLP(d_model, d_ff)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT::forward: token + position embeddings, the blocks, ln_f, LM head tied to wte (no bias),
    mean cross-entropy."""

    def __init__(self, layers, d_model, heads, kv_heads, d_ff, seq_len, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)  # embedding_forward; also the LM head
        self.wpe = nn.Embedding(seq_len, d_model)  # position_forward: row n gets wpe[n % T]
        self.h = nn.ModuleList(Block(d_model, heads, kv_heads, d_ff) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model, eps=LN_EPS)

    def forward(self, inputs, targets):
        B, T = inputs.shape
        x = self.wte(inputs) + self.wpe(torch.arange(T, device=inputs.device))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # (B, T, V): matmul_forward with wte, no bias
        # crossentropy_max / _sums / _finish: log Σ exp(l − max) + max − l[target], mean over
        # every token (GPT::forward averages a micro-batch, Trainer::train_step the global batch;
        # all micro-batches have B·T tokens, so this is the same mean).
        return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))


# ------------------------------------------------------------------------------------------------
# The deterministic sampler (lib/data/sampler.cpp, lib/data/rng.hpp): sequence j of step s is
# window hash(train.seed, s, j) mod W of the source, W = num_windows(seq_len + 1). All arithmetic
# is on uint64, so every product and sum is masked to 64 bits.

M64 = 0xFFFFFFFFFFFFFFFF
GOLDEN = 0x9E3779B97F4A7C15


def mix64(z):
    """data_rng::mix64, the splitmix64 finalizer."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def hash_combine(h, v):
    """data_rng::hash_combine: mix64(h + golden + mix64(v))."""
    return mix64((h + GOLDEN + mix64(v & M64)) & M64)


def window_index(seed, step, index, windows):
    """Sampler::sequence: which window sequence `index` of step `step` reads."""
    h = hash_combine(mix64((seed & M64) ^ 0x53414D504C4552), step)
    h = hash_combine(h, index)
    return h % windows


class Permutation:
    """data_rng::Permutation: a keyed bijection of [0, n) (a six-round Feistel network on the
    smallest 4^h >= n, walked until the value falls below n)."""

    def __init__(self, n, key):
        self.n, self.key, self.half = n, mix64(key & M64), 0
        while self.half < 32 and (1 << (2 * self.half)) < n:
            self.half += 1
        self.mask = (1 << self.half) - 1

    def _feistel(self, x):
        left, right = x >> self.half, x & self.mask
        for r in range(6):
            f = hash_combine((self.key + r) & M64, right) & self.mask
            left, right = right, left ^ f
        return (left << self.half) | right

    def __call__(self, i):
        x = self._feistel(i)
        while x >= self.n:
            x = self._feistel(x)
        return x


def epoch_window_index(seed, position, piece_sizes, seq_len):
    """Sampler::sequence with data.sampling = epochs: the window (in TokenSource::window's
    numbering) of sequence number `position` of the run's stream — the windows at offsets
    k*seq_len of each piece (shard), in a keyed order each epoch."""
    strided_before, first_window, before = [0], [], 0
    for n in piece_sizes:
        windows = max(0, n - seq_len)  # of seq_len + 1 tokens
        first_window.append(before)
        before += windows
        strided_before.append(strided_before[-1] + ((windows - 1) // seq_len + 1 if windows else 0))
    per_epoch = strided_before[-1]
    epoch, g = divmod(position, per_epoch)
    order = Permutation(per_epoch, hash_combine(mix64((seed & M64) ^ 0x45504F4348), epoch))
    k = order(g)
    piece = bisect.bisect_right(strided_before, k) - 1  # std::upper_bound − 1
    return first_window[piece] + (k - strided_before[piece]) * seq_len


class TextSource:
    """lib/data/text.cpp: the bytes of one file, one window = len consecutive bytes."""

    def __init__(self, path):
        self.data = np.fromfile(path, dtype=np.uint8)

    def num_windows(self, length):
        return max(0, len(self.data) - length + 1)

    def piece_sizes(self):
        return [len(self.data)]

    def window(self, k, length):
        return self.data[k : k + length].astype(np.int64)


class TokensSource:
    """lib/data/tokens.cpp: token shards matching a glob, sorted by name (llm.c format with its
    256 × int32 header — magic 20240520 version 1 for uint16 tokens, 20240801 version 7 for
    uint32 ones — or raw uint16); a window never crosses a shard."""

    LLMC = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}  # magic: (version, token type)

    def __init__(self, pattern):
        paths = sorted(glob.glob(pattern), key=os.fsencode)  # byte order, as std::sort
        if not paths:
            sys.exit(f"torch_reference: data.path: no file matches '{pattern}'")
        self.shards = []
        for p in paths:
            raw = np.fromfile(p, dtype=np.uint8)
            magic = int(raw[:4].view(np.int32)[0]) if len(raw) >= 4 else None
            if magic in self.LLMC:
                version, dtype = self.LLMC[magic]
                header = raw[:1024].view(np.int32)
                if int(header[1]) != version:
                    sys.exit(f"torch_reference: {p}: llm.c magic {magic} with version "
                             f"{int(header[1])}; only version {version} is read")
                width = np.dtype(dtype).itemsize
                count = int(header[2])
                self.shards.append(raw[1024 : 1024 + width * count].view(dtype))
            else:
                self.shards.append(raw.view(np.uint16))

    def _prefix(self, length):  # prefix[i] = windows in shards [0, i)
        prefix = [0]
        for s in self.shards:
            prefix.append(prefix[-1] + max(0, len(s) - length + 1))
        return prefix

    def num_windows(self, length):
        return self._prefix(length)[-1]

    def piece_sizes(self):
        return [len(s) for s in self.shards]

    def window(self, k, length):
        prefix = self._prefix(length)
        shard = bisect.bisect_right(prefix, k) - 1  # std::upper_bound − 1: skips empty shards
        offset = k - prefix[shard]
        return self.shards[shard][offset : offset + length].astype(np.int64)


def global_batch(source, seed, step, batch, seq_len, first_position=None):
    """Sampler::batch over the whole global batch: inputs = window[0:T], targets = window[1:T+1].
    `first_position`: with data.sampling = epochs, the step's first sequence number in the run's
    stream (None: random sampling)."""
    windows = source.num_windows(seq_len + 1)
    if windows <= 0:
        sys.exit(f"torch_reference: the data has fewer than seq_len + 1 = {seq_len + 1} tokens")
    if first_position is None:
        index = [window_index(seed, step, j, windows) for j in range(batch)]
    else:
        sizes = source.piece_sizes()
        index = [epoch_window_index(seed, first_position + j, sizes, seq_len) for j in range(batch)]
    rows = [source.window(k, seq_len + 1) for k in index]
    w = torch.from_numpy(np.stack(rows))  # (batch, T + 1)
    return w[:, :-1], w[:, 1:]


# ------------------------------------------------------------------------------------------------


def text_attr(f, name):
    v = f.attrs[name]
    return v.decode() if isinstance(v, bytes) else str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a Trellis checkpoint, RUN/ckpt/step_NNNNNNNN.h5")
    ap.add_argument("--step", type=int, default=None,
                    help="the step index (0-based) whose global batch to evaluate "
                         "(default: the checkpoint's step attribute)")
    ap.add_argument("--data-path", default=None,
                    help="override the deck's data.path (e.g. when it was relative to another "
                         "directory)")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                    help="compute precision (default float64; the weights are float32)")
    args = ap.parse_args()

    with h5py.File(args.checkpoint, "r") as f:
        deck = configparser.ConfigParser(interpolation=None)
        deck.read_string(text_attr(f, "deck"))
        ckpt_step = int(f.attrs["step"])
        tokens_seen = int(f.attrs["tokens_seen"]) if "tokens_seen" in f.attrs else None
        weights = {name: torch.from_numpy(f["model"][name][()]) for name in f["model"]}

    m, t, d = deck["model"], deck["train"], deck["data"]
    layers, d_model, heads = m.getint("layers"), m.getint("d_model"), m.getint("heads")
    kv_heads, d_ff = m.getint("kv_heads"), m.getint("d_ff")
    seq_len, vocab = m.getint("seq_len"), m.getint("vocab")
    batch, seed = t.getint("global_batch"), t.getint("seed")
    step = ckpt_step if args.step is None else args.step

    dtype = getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)
    model = GPT(layers, d_model, heads, kv_heads, d_ff, seq_len, vocab)
    rename = {"wte": "wte.weight", "wpe": "wpe.weight"}
    state = {rename.get(k, k): v.to(dtype) for k, v in weights.items()}
    model.load_state_dict(state, strict=True)  # every tensor present, every shape as built

    source_kind = d.get("source")
    path = args.data_path or d.get("path")
    if source_kind == "text":
        source = TextSource(path)
    elif source_kind == "tokens":
        source = TokensSource(path)
    else:
        sys.exit(f"torch_reference: data.source = {source_kind} is not reimplemented here "
                 "(text and tokens are)")
    first_position = None  # data.sampling = random
    if d.get("sampling", "random") == "epochs":
        # The stream stood at tokens_seen / seq_len at the checkpoint; steps on from there take
        # the deck's global batch each (as Sampler::start_at).
        seen = tokens_seen if tokens_seen is not None else ckpt_step * batch * seq_len
        first_position = seen // seq_len + (step - ckpt_step) * batch
    # Steps before the checkpoint took the deck's global batch only when its tokens say so: a run
    # resumed with another train.global_batch drew its earlier batches at another size (and, with
    # epochs, at other stream positions), which this file does not record.
    if (step < ckpt_step and tokens_seen is not None
            and tokens_seen != ckpt_step * batch * seq_len):
        sys.exit(f"torch_reference: step {step} is before this checkpoint's step {ckpt_step}, and "
                 f"the run changed train.global_batch on the way (tokens_seen {tokens_seen}, not "
                 f"{ckpt_step} x {batch} x {seq_len}): give a step from {ckpt_step} on, or a "
                 "checkpoint written before the change")
    inputs, targets = global_batch(source, seed, step, batch, seq_len, first_position)

    print(f"checkpoint {args.checkpoint}: step {ckpt_step}; model L{layers} C{d_model} "
          f"H{heads} KV{kv_heads} F{d_ff} T{seq_len} V{vocab}; batch of step index {step}: "
          f"{batch} x {seq_len} tokens of {source_kind} '{path}'; {args.dtype}")
    with torch.no_grad():
        loss = model(inputs, targets).item()
    print(f"loss = {loss:.9g}")


if __name__ == "__main__":
    main()
