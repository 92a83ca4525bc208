"""Decode-shaped GEMMs on one GPU (diagnostic, standalone: the library does not use this file's kernel).

For the Qwen3-4B (or 8B, or 50M fixture) shape's projections (q, k (or v), o, gate, down, and the fused k/v, q/k/v
and gate/up; the 2026-12-01 file's "kv" is today's "k"), with 1, 8 and 16 rows:
cuBLAS `F.linear`, cuBLAS on the transposed product, and a small-M Triton kernel swept over tile sizes and split-K
(the best configuration kept), each timed inside one CUDA graph over enough weight copies to exceed the L2 cache,
so every call reads its weight from memory. `floor_us` is the weight's bytes over the measured copy bandwidth.
Set INDUCTOR=1 to add `torch.compile(mode="max-autotune-no-cudagraphs")` (slow; not in the committed run).

    python benchmarks/decode_gemm_micro.py 4b     # writes $OUT/gemv_4b.json (or ./gemv_4b.json)
    python benchmarks/decode_gemm_micro.py code50m qkv,gate_up,o,down   # a subset of the shapes

The committed result (benchmarks/results/decode_gemm_4b_h200.json) motivated `generation/fused_projections.py`:
q, k and v as one GEMM cost about half of three, while the Triton kernel did not beat cuBLAS on the shapes that
matter, so the library keeps cuBLAS.
"""
import json, os, sys, time, itertools, torch, torch.nn.functional as F
import triton, triton.language as tl

dev = "cuda"; dt = torch.bfloat16
OUT = os.environ.get("OUT", ".")


@triton.jit
def _skinny(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    for k0 in range(0, k_span, BLOCK_K):
        rk = pid_k * k_span + k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                    other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptr + rm[:, None] * stride_om + rn[None, :], acc, mask=mask, sem="relaxed")


def skinny(x, w, cfg, buf=None):
    M, K = x.shape; N = w.shape[0]
    bn, bk, sk, warps, stages = cfg
    grid = (triton.cdiv(N, bn), sk)
    if sk == 1:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
        _skinny[grid](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=16, BLOCK_N=bn,
                      BLOCK_K=bk, SPLIT_K=1, num_warps=warps, num_stages=stages)
        return out
    acc = torch.zeros(M, N, device=x.device, dtype=torch.float32)
    _skinny[grid](x, w, acc, M, N, K, x.stride(0), w.stride(0), acc.stride(0), BLOCK_M=16, BLOCK_N=bn,
                  BLOCK_K=bk, SPLIT_K=sk, num_warps=warps, num_stages=stages)
    return acc.to(x.dtype)


def graph_time(fns, reps=3):
    """us per fn call: all fns (one per weight copy) in one graph, replayed; median of 5."""
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:2]: f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns: f()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(5):
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / reps / len(fns))
    return sorted(ts)[2]


out = {}
x = torch.empty(2 ** 30, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
y.copy_(x); torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(5): y.copy_(x)
torch.cuda.synchronize(); bw = 2 * x.numel() * 5 / (time.perf_counter() - t); del x, y
out["copy_GBps"] = bw / 1e9; print("copy GB/s", bw / 1e9, flush=True)

which = sys.argv[1] if len(sys.argv) > 1 else "4b"
H, I, Q, KV = {"4b": (2560, 9728, 4096, 1024), "8b": (4096, 12288, 4096, 1024),
                "code50m": (512, 1536, 512, 256)}[which]
shapes = {"q": (Q, H), "k": (KV, H), "kv": (2 * KV, H), "o": (H, Q), "gate": (I, H), "down": (H, I),
          "qkv": (Q + 2 * KV, H), "gate_up": (2 * I, H)}
if len(sys.argv) > 2:  # a subset of the shapes, comma-separated
    shapes = {key: shapes[key] for key in sys.argv[2].split(",")}
TILES = ((16, 256), (16, 512), (32, 128), (32, 256), (64, 128), (64, 256))
if which == "code50m":  # small weights: smaller tiles, more programs
    TILES = ((16, 64), (16, 128), (32, 64), (32, 128), (64, 64), (64, 128))
CFGS = [(bn, bk, sk, w, st) for bn, bk in TILES for sk in (1, 2, 4) for w in (4,) for st in (3, 4)]
ROWS = (1, 8, 16)
try:  # PYTHONPATH=src: time the library's kernel too
    from dspark_hf.generation.skinny_linear import skinny_linear as library_linear
    from dspark_hf.generation.skinny_linear import tiles as library_tiles
except ImportError:
    library_linear = None
compiled = torch.compile(lambda a, b: F.linear(a, b), mode="max-autotune-no-cudagraphs", dynamic=False)
for key, (n, k) in shapes.items():
    nbytes = n * k * 2
    copies = max(2, -(-400_000_000 // nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=dt) / 50 for _ in range(copies)]
    for m in ROWS:
        xx = torch.randn(m, k, device=dev, dtype=dt)
        ref = F.linear(xx, ws[0]).float()
        floor = nbytes / bw * 1e6
        row = dict(floor_us=floor, cublas=graph_time([lambda w=w: F.linear(xx, w) for w in ws]))
        row["cublas_wxT"] = graph_time([lambda w=w: torch.mm(w, xx.T) for w in ws])
        if os.environ.get("INDUCTOR"):
          try:
            t0 = time.perf_counter(); compiled(xx, ws[0]); row["inductor_compile_s"] = time.perf_counter() - t0
            row["inductor_max_autotune"] = graph_time([lambda w=w: compiled(xx, w) for w in ws])
          except Exception as e:
            row["inductor_error"] = repr(e)[:300]
        if library_linear is not None and m <= 16:  # the library's kernel with its own tiles
            row["library_tiles"] = list(library_tiles(n, k))
            row["library"] = graph_time([lambda w=w: library_linear(xx, w) for w in ws])
            row["library_error"] = ((library_linear(xx, ws[0]).float() - ref).abs().max() / ref.abs().max()).item()
        best = None
        for cfg in CFGS:
            try:
                got = skinny(xx, ws[0], cfg).float()
                err = (got - ref).abs().max().item() / ref.abs().max().item()
                if err > 2e-2:
                    row.setdefault("bad", []).append([cfg, err]); continue
                us = graph_time([lambda w=w: skinny(xx, w, cfg) for w in ws])
            except Exception as e:
                row.setdefault("cfg_errors", []).append([cfg, repr(e)[:200]]); continue
            row.setdefault("triton", []).append([cfg, us])
            if best is None or us < best[1]: best = (cfg, us)
        row["triton_best"] = best
        out[f"{which}/m{m}/{key}"] = row
        print(which, m, key, f"floor {floor:.1f} cublas {row['cublas']:.1f} wxT {row['cublas_wxT']:.1f} "
              f"inductor {row.get('inductor_max_autotune', float('nan')):.1f} "
              f"library {row.get('library', float('nan')):.1f} triton {best}", flush=True)
    del ws
json.dump(out, open(os.path.join(OUT, f"gemv_{which}.json"), "w"), indent=1)
