#!/usr/bin/python3
"""Reading a Trellis checkpoint with h5py: /usr/bin/python3 scripts/h5py_example.py FILE.h5

Every parameter is a float32 dataset model/<name> with its global shape; AdamW's moments are
optim/m/<name> and optim/v/<name>; the run's metadata are attributes on the root group.
"""
import configparser
import sys

import h5py
import numpy as np

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
