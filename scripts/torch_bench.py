#!/usr/bin/env python3
"""PyTorch beside Trellis on the same GPU, for scripts/gpu-check.sh: ratios measured side by side.

    python3 scripts/torch_bench.py [--B 64] [--T 1024] [--steps 10] [--peak-tflops 989]

Three measurements, each printed as `torch-bench:` lines (key=value) that gpu-check.sh reads:
  1. a GPT-2 124M training step in eager PyTorch as Trellis's bf16 runs it — fp32 master weights,
     bf16 autocast (bf16 GEMM operands, fp32 accumulation), causal scaled_dot_product_attention,
     tanh GELU, tied LM head, fused AdamW, gradient clipping at 1 — B·T tokens of random ids: step
     time (as `trellis bench` takes it: rounds of 3 steps, each round's fastest, the median round),
     tokens/s, MFU by Trellis's count (lib/plan/flops.cpp: 6 × the matmul parameters, LM head
     included, + 12·L·T·C per token), peak memory; with SDPA's default choice of kernel, and again
     with cuDNN's attention first where this torch has it (on Hopper often the faster);
  2. the attention alone, forward and backward, (B, 12, T, 64) bf16 causal, through each SDPA
     backend this torch has (flash, cuDNN, memory-efficient), and cuDNN's again on Trellis's
     layout (q, k, v strided views of one packed (B, T, 3·H·64) tensor): ms and TFLOP/s counted
     as Trellis's profile and `trellis bench`'s attention alone count them (3.5 × 2·B·H·T²·D: the
     causal half of the forward's two products and the backward's five);
  3. the GEMMs of the 124M and 350M steps in bf16 (torch.matmul, cuBLAS), each linear layer's
     forward, dinp and dweight: TFLOP/s.
Nothing here is Trellis code: it is the yardstick. A part that fails prints `torch-bench: error`
with the reason and the others still run.
"""
import argparse
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:  # (gpu-check.sh runs this only where torch imports)
    print(f"torch-bench: error no torch ({e})")
    sys.exit(1)


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):  # x (B, T, C)
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)  # each (B, T, C)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, C, H, T, V):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):  # idx, targets (B, T)
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # (B, T, V), the tied LM head
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def first_line(e):
    lines = str(e).splitlines()
    return (lines[0] if lines else type(e).__name__)[:200]


def per_step_ms(fn, steps, warmup=3, per_round=3):
    """fn timed one call at a time (CUDA events): each round's fastest, the median round."""
    for _ in range(warmup):
        fn()
    rounds = []
    for _ in range(max(1, steps // per_round)):
        best = float("inf")
        for _ in range(per_round):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            best = min(best, start.elapsed_time(stop))
        rounds.append(best)
    rounds.sort()
    return rounds[len(rounds) // 2]


def timed(fn, reps, warmup=3):
    """Mean ms of fn over reps runs after warmup runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


def train_step_bench(a, L=12, C=768, H=12, V=50304):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    choices = [("default", None)]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        choices.append(("cudnn", [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                  SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]))
    for sdpa, order in choices:
        try:
            if order is None:
                one_train_step_bench(a, sdpa, L, C, H, V)
            else:
                with sdpa_kernel(order, set_priority=True):
                    one_train_step_bench(a, sdpa, L, C, H, V)
        except Exception as e:
            print(f"torch-bench: error train step, sdpa={sdpa}: {first_line(e)}", flush=True)
        torch.cuda.empty_cache()


def one_train_step_bench(a, sdpa, L, C, H, V):
    torch.manual_seed(0)
    model = GPT(L, C, H, a.T, V).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=True)
    idx = torch.randint(0, V, (a.B, a.T), device="cuda")
    targets = torch.randint(0, V, (a.B, a.T), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    torch.cuda.reset_peak_memory_stats()
    ms = per_step_ms(step, a.steps)
    matmul_params = L * (C * 3 * C + C * C + 2 * C * 4 * C) + V * C
    flops_per_token = 6.0 * matmul_params + 12.0 * L * a.T * C
    tokens = a.B * a.T
    mfu = flops_per_token * tokens / (ms * 1e-3) / (a.peak_tflops * 1e12) if a.peak_tflops else 0
    print(f"torch-bench: gpt2-124m eager-bf16 sdpa={sdpa} B={a.B} T={a.T} step_ms={ms:.1f} "
          f"tokens_per_s={tokens / (ms * 1e-3):.0f} mfu={mfu:.4f} "
          f"peak_bytes={torch.cuda.max_memory_allocated()}", flush=True)
    del model, opt


def attention_bench(a, H=12, D=64):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(a.B, H, a.T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    flops = 3.5 * 2.0 * a.B * H * a.T * a.T * D
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            def fwd_bwd():  # (gradients returned, not accumulated into .grad)
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.grad(out, (q, k, v), dout)
            ms = timed(fwd_bwd, 10)
            short = name.split("_")[0].lower()
            print(f"torch-bench: attention {short} B={a.B} H={H} T={a.T} D={D} "
                  f"fwd_bwd_ms={ms:.3f} tflops={flops / (ms * 1e-3) / 1e12:.1f}", flush=True)
        except Exception as e:  # a backend this device or build does not take
            print(f"torch-bench: error attention {name}: {first_line(e)}", flush=True)
    # cuDNN again on Trellis's layout: q, k and v strided views of one packed (B, T, 3·H·D)
    # tensor (as the QKV projection writes it, and as Trellis hands them to cuDNN) — so that the
    # two attentions are timed on the same memory layout of their inputs. The gradients are taken
    # for the views themselves (no scatter into the packed tensor's gradient is timed).
    backend = getattr(SDPBackend, "CUDNN_ATTENTION", None)
    if backend is not None:
        try:
            del q, k, v
            qkv = torch.randn(a.B, a.T, 3, H, D, device="cuda", dtype=torch.bfloat16,
                              requires_grad=True)
            qp, kp, vp = (t.transpose(1, 2) for t in qkv.unbind(2))  # each (B, H, T, D), strided

            def packed_fwd_bwd():
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
                torch.autograd.grad(out, (qp, kp, vp), dout)
            ms = timed(packed_fwd_bwd, 10)
            print(f"torch-bench: attention cudnn-packed B={a.B} H={H} T={a.T} D={D} "
                  f"fwd_bwd_ms={ms:.3f} tflops={flops / (ms * 1e-3) / 1e12:.1f}", flush=True)
        except Exception as e:
            print(f"torch-bench: error attention CUDNN_ATTENTION packed: {first_line(e)}",
                  flush=True)


def gemm_bench(a, V=50304):
    """Each linear layer's three GEMMs as Trellis runs them — forward out = x·Wᵀ (W stored
    (out, in)), dinp = dout·W, dweight = doutᵀ·x — for GPT-2 124M (C 768) and 350M (C 1024): qkv,
    the attention's projection, the MLP's two, the LM head; bf16 in and out (Trellis's dweight
    GEMMs write fp32). Each is labelled as Trellis's profile labels its GEMMs (column-major
    m x n x k as cuBLAS takes them, and the ops: TN, NN, NT), to hold the two side by side."""
    N = a.B * a.T
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for C in (768, 1024):
        for name, fin, fout in (("qkv", C, 3 * C), ("proj", C, C), ("fc", C, 4 * C),
                                ("fc2", 4 * C, C), ("lm_head", C, V)):
            # (part, label, torch.matmul's two operands: views laid out as Trellis's tensors)
            parts = (("fwd", f"{fout}x{N}x{fin} TN",
                      lambda: (torch.randn(N, fin, **bf), torch.randn(fout, fin, **bf).t())),
                     ("dinp", f"{fin}x{N}x{fout} NN",
                      lambda: (torch.randn(N, fout, **bf), torch.randn(fout, fin, **bf))),
                     ("dweight", f"{fin}x{fout}x{N} NT",
                      lambda: (torch.randn(N, fout, **bf).t(), torch.randn(N, fin, **bf))))
            for part, label, make in parts:
                try:
                    x, w = make()
                    m, k = x.shape
                    n = w.shape[1]
                    ms = timed(lambda: torch.matmul(x, w), 10)
                    print(f"torch-bench: gemm C={C} {name} {part} {label} ms={ms:.3f} "
                          f"tflops={2.0 * m * n * k / (ms * 1e-3) / 1e12:.1f}", flush=True)
                except Exception as e:  # (one shape that fails leaves the others to run)
                    print(f"torch-bench: error gemm C={C} {name} {part}: {first_line(e)}",
                          flush=True)
                finally:
                    x = w = None
                    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=64)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("torch-bench: error no CUDA device for torch")
        return 1
    # (cuDNN's version: Trellis opens the cuDNN it finds, PyTorch's own where the system has none
    # — so that a difference in attention between the two is seen to be, or not be, the library's)
    print(f"torch-bench: torch={torch.__version__} device={torch.cuda.get_device_name()} "
          f"cudnn={torch.backends.cudnn.version()}", flush=True)
    failed = 0
    for part in (attention_bench, train_step_bench, gemm_bench):
        t0 = time.time()
        try:
            part(a)
        except Exception as e:
            failed = 1
            print(f"torch-bench: error {part.__name__}: {first_line(e)}", flush=True)
        torch.cuda.empty_cache()
        print(f"torch-bench: {part.__name__} took {time.time() - t0:.1f} s", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
