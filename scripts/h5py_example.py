#!/usr/bin/python3
"""Reading a Trellis checkpoint with h5py: /usr/bin/python3 scripts/h5py_example.py FILE.h5

Every parameter is a float32 dataset model/<name> with its global shape; AdamW's moments are
optim/m/<name> and optim/v/<name>; the run's metadata are attributes on the root group. Each
dataset's attribute content_digest is checked as Trellis checks it (lib/ckpt/digest.cpp); exit
status 1 where one does not match.
"""
import configparser
import sys

import h5py
import numpy as np

U64 = np.uint64
MASK = (1 << 64) - 1


def mix64(x):
    """splitmix64's finalizer, on a numpy uint64 array (wrapping mod 2^64 as Trellis's does)."""
    x = x ^ (x >> U64(30))
    x = x * U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> U64(27))
    x = x * U64(0x94D049BB133111EB)
    return x ^ (x >> U64(31))


def content_digest(name, w):
    """Sum mod 2^64 over (r, c) of mix64((mix64(r ^ key) + c*K) ^ bits*S), with key = mix64(FNV-1a
    of the dataset's name)."""
    key = 0xCBF29CE484222325
    for ch in name.encode():
        key = ((key ^ ch) * 0x100000001B3) & MASK
    key = mix64(np.array([key], dtype=U64))[0]
    w = w.reshape(w.shape[0], -1) if w.ndim == 2 else w.reshape(-1, 1)  # 1-D: one column
    cols = np.arange(w.shape[1], dtype=U64) * U64(0x9E3779B97F4A7C15)
    total = U64(0)
    with np.errstate(over="ignore"):
        for r0 in range(0, w.shape[0], 4096):  # (R, C) blocks of rows: bounded memory
            bits = w[r0:r0 + 4096].view(np.uint32).astype(U64)
            rows = mix64(np.arange(r0, r0 + bits.shape[0], dtype=U64) ^ key)
            x = (rows[:, None] + cols[None, :]) ^ (bits * U64(0xD6E8FEB86659FD93))
            total += mix64(x).sum(dtype=U64)
    return int(total)

with h5py.File(sys.argv[1], "r") as f:
    attr = lambda k: f.attrs[k].decode() if isinstance(f.attrs[k], bytes) else f.attrs[k]
    print(f"step {attr('step')}, tokens seen {attr('tokens_seen')}")
    print(f"layout: {attr('layout')}")

    deck = configparser.ConfigParser(interpolation=None)  # the effective deck, as INI text
    deck.read_string(attr("deck"))
    print("model:", dict(deck["model"]))

    total = 0
    for name, ds in f["model"].items():  # visit order is by name
        w = ds[()]  # the whole global tensor, as a numpy array
        total += w.size
        print(f"  {name:32s} {str(ds.shape):12s} |w| = {np.linalg.norm(w):.6g}"
              f"  |m| = {np.linalg.norm(f['optim/m'][name][()]):.3g}")
    print(f"{total} parameters")

    # The content digests (files written before 2026-12-06 have none).
    bad, checked = [], 0
    def check(name, obj):
        global checked
        if isinstance(obj, h5py.Dataset) and "content_digest" in obj.attrs:
            checked += 1
            if content_digest(name, obj[()]) != int(obj.attrs["content_digest"]):
                bad.append(name)
    f.visititems(check)
    print(f"content digests: {checked - len(bad)} of {checked} match"
          + (": " + ", ".join(bad) + " do not" if bad else ""))
    sys.exit(1 if bad else 0)
