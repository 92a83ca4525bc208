"""The few-rows GEMM of the fast path's projections (`generation/skinny_linear.py`) under TRITON_INTERPRET=1 (CPU):
its outputs equal float32 products rounded once to the dtype (rows 1-16, widths and depths that do not fill a tile,
bias, fp16, 3-D and strided inputs); where it does not apply (float32, more rows, the switch off or unset: the
kernel is opt-in) `linear` is `F.linear`; a 16-bit model's fused groups and single projections run it eagerly and
as one operator in a compiled graph; and it compiles to a cubin for the GPU machine's sm_90 without a GPU. Skipped
without triton."""

from __future__ import annotations

import os
import subprocess
import sys

# first: switches the interpreter on
from triton_interpreter import CountingKernel, child_only, interp, run_in_child_process

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tiny_models import tiny_target  # noqa: E402

from dspark_hf.generation import skinny_linear as skinny  # noqa: E402
from dspark_hf.generation.fused_projections import fuse_projections, projection_fusion  # noqa: E402


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    monkeypatch.setenv(skinny.SWITCH_VARIABLE, "1")  # (off by default)


@child_only
def test_in_child_process():
    run_in_child_process(__file__, timeout=600)


def reference(x, weight, bias=None):
    """The product in float32, rounded once to the inputs' dtype."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def rounding_agrees(got, expected):
    """Equal, but for one unit in the last place where float32 sums taken in another order round the other way
    (at most 1 % of the entries)."""
    step = torch.finfo(got.dtype).eps * expected.float().abs().clamp_min(torch.finfo(got.dtype).tiny)
    close = (got.float() - expected.float()).abs() <= step * 1.01
    return bool(close.all()) and (got != expected).float().mean().item() <= 0.01


@interp
@pytest.mark.parametrize("rows,columns,depth,with_bias,dtype", [
    (1, 100, 70, False, torch.bfloat16),  # depth below one tile, columns past a tile
    (5, 300, 130, True, torch.bfloat16),
    (16, 64, 1030, False, torch.bfloat16),  # a full row tile; depth past the wide tiles, not a multiple
    (8, 9000, 64, True, torch.bfloat16),  # wide: the 32-column tiles
    (3, 200, 96, True, torch.float16),
])
def test_the_kernel_equals_float32_products_rounded_once(rows, columns, depth, with_bias, dtype):
    generator = torch.Generator().manual_seed(rows + columns)
    x = torch.randn(rows, depth, generator=generator).to(dtype)
    weight = (torch.randn(columns, depth, generator=generator) / depth ** 0.5).to(dtype)
    bias = torch.randn(columns, generator=generator).to(dtype) if with_bias else None
    assert skinny.skinny_linear_applies(x, weight)
    got = skinny.linear(x, weight, bias)
    assert got.dtype == dtype and got.shape == (rows, columns)
    assert rounding_agrees(got, reference(x, weight, bias))


@interp
def test_batched_and_strided_inputs_and_weight_slices():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2 * 80, generator=generator).bfloat16()[..., ::2]  # 6 rows, column stride 2
    fused = torch.randn(150, 80, generator=generator).bfloat16()
    weight = fused[50:120]  # rows of a fused weight, as a group's run reads them
    got = skinny.linear(x, weight)
    assert got.shape == (2, 3, 70)
    assert rounding_agrees(got, reference(x, weight))


@interp
def test_where_it_does_not_apply_linear_is_f_linear(monkeypatch):
    launches = []
    monkeypatch.setattr(skinny, "_skinny_linear", CountingKernel(skinny._skinny_linear, launches))
    weight = torch.randn(40, 32).bfloat16()
    cases = [torch.randn(1, 32), torch.randn(skinny.MAX_ROWS + 1, 32).bfloat16()]  # float32; too many rows
    for x in cases:
        w = weight.to(x.dtype)
        assert not skinny.skinny_linear_applies(x, w)
        assert torch.equal(skinny.linear(x, w), F.linear(x, w))
    x = torch.randn(4, 32).bfloat16()
    monkeypatch.delenv(skinny.SWITCH_VARIABLE)
    assert not skinny.skinny_linear_applies(x, weight)  # off by default
    monkeypatch.setenv(skinny.SWITCH_VARIABLE, "0")
    assert not skinny.skinny_linear_applies(x, weight)
    assert torch.equal(skinny.linear(x, weight), F.linear(x, weight)) and not launches
    monkeypatch.setenv(skinny.SWITCH_VARIABLE, "1")
    skinny.linear(x, weight)
    assert len(launches) == 1
    monkeypatch.setenv(skinny.SWITCH_VARIABLE, "fused")  # the fused groups' GEMMs only
    assert torch.equal(skinny.linear(x, weight, fused=False), F.linear(x, weight)) and len(launches) == 1
    skinny.linear(x, weight, fused=True)
    assert len(launches) == 2


@interp
def test_a_16_bit_models_projections_run_the_kernel(monkeypatch):
    """Eager and traced (fullgraph): the projections' GEMMs are the kernel's launches, one operator in the graph, and
    the logits those of the unfused model to bf16 rounding."""
    launches = []
    monkeypatch.setattr(skinny, "_skinny_linear", CountingKernel(skinny._skinny_linear, launches))
    model = tiny_target("qwen3", vocab_size=48).bfloat16()
    ids = torch.tensor([[5, 9, 11, 4, 30, 8, 17]])
    with torch.no_grad():
        expected = model(ids).logits.float()
        assert fuse_projections(model) == 2 * model.config.num_hidden_layers
        with projection_fusion():
            model(ids)  # the groups' first forward watches
            launches.clear()
            fused = model(ids).logits.float()
    # q/k/v, o, gate/up and down: one launch each per layer (the LM head, not a projection, stays on F.linear)
    assert len(launches) == 4 * model.config.num_hidden_layers
    assert (fused - expected).abs().max() <= 0.05 * expected.abs().max()
    monkeypatch.setenv(skinny.SWITCH_VARIABLE, "fused")  # q/k/v and gate/up only: o and down keep F.linear
    launches.clear()
    with torch.no_grad(), projection_fusion():
        model(ids)
    assert len(launches) == 2 * model.config.num_hidden_layers
    monkeypatch.setenv(skinny.SWITCH_VARIABLE, "1")
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda inputs: model(inputs).logits, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad(), projection_fusion():
        traced = compiled(ids).float()
    called = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert sum("dspark_hf.skinny_linear" in name for name in called) == 4 * model.config.num_hidden_layers
    assert torch.equal(traced, fused)


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dspark_hf.generation import skinny_linear as skinny
signature = {name: "*bf16" for name in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr")}
signature.update({name: "i32" for name in ("rows", "columns", "depth", "s_x", "s_w", "s_out")})
tiles = [(block_n, block_k) for block_n in (16, 32, 64) for block_k in (64, 128)]  # every pair `tiles` may pick
for index, (block_n, block_k) in enumerate(tiles):
    bias = index % 2 == 1
    constants = dict(HAS_BIAS=bias, BLOCK_M=skinny.MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=False)
    signature.update({name: "constexpr" for name in constants})
    source = ASTSource(fn=skinny._skinny_linear, signature=signature, constexprs=constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    assert kernel.asm["cubin"] and "mma" in kernel.asm["ptx"], (block_n, block_k)
print("compiled")
"""


@interp  # (once: in this process when it interprets, else in the child; the compiler runs in its own process)
def test_the_kernel_compiles_for_the_gpu_machines_architecture():
    """Triton's CUDA compiler (no GPU needed) builds the kernel with each of its tiles for sm_90, the H100/H200's."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas for Triton's CUDA backend")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
