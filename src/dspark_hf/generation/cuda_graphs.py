"""A compiled round replayed as one CUDA graph that PyTorch captures directly (`torch.cuda.CUDAGraph`).

`torch.compile(mode="reduce-overhead")` replays a function through its CUDA-graph trees, whose host work per call
(guards, a check of every static input's address, copies of the other inputs) measured 0.2-0.5 ms for the 50M
fixture's round and 0.9-1.3 ms for the Qwen3-4B shape's on an H200 (`benchmarks/results/cuda_graph_replay_h200.json`):
about the GPU time of a fixture round, so the fixture decoded at the host's pace, and every host read of a 4B round
left the GPU idle that long. A replay of a captured graph costs 10-40 µs. `GraphedFunction` wraps a compiled
function (torch.compile's default mode: no graphs of its own) and replays it that way, at the price of checks the
trees make for their caller: what the graph reads must stay where it was (`reset()` when it moves).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class GraphedFunction:
    """`fn(*args)` replayed as one CUDA graph after `warmup` calls.

    The first `warmup` calls run `fn` on a side stream (the first also compiles it), the next captures it with static
    copies of its tensor arguments and replays that capture. Later calls copy their tensor arguments into those
    copies and replay; their result is the captured outputs, which the next call overwrites (clone what must
    outlive it). A call whose tensor shapes, dtypes or other arguments differ from the capture's is captured anew.
    Everything else `fn` reads (parameters, caches, state buffers) must keep its address while the graph lives: call
    `reset()` when it moves. On a `device` other than CUDA, calls run `fn` as it is.
    """

    def __init__(self, fn: Callable[..., Any], device: torch.device | str, warmup: int = 2):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the compile and lazy initialisations must not happen inside a "
                             f"capture), got {warmup}.")
        self.fn, self.warmup = fn, warmup
        self.on_cuda = torch.device(device).type == "cuda"
        self.side_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.reset()

    def reset(self) -> None:
        """Drops the captured graph; the next `warmup` calls run `fn` directly again (a recompile happens there)."""
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple = ()
        self.outputs: Any = None
        self.warm_calls = 0

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, *args: Any) -> Any:
        if not self.on_cuda:
            return self.fn(*args)
        if self.graph is not None and not self._load(args):
            self.reset()  # (new shapes recompile: in the warm-up, never inside a capture)
        if self.graph is None:
            if self.warm_calls < self.warmup:
                self.warm_calls += 1
                return self._on_side_stream(args)
            self._capture(args)
        self.graph.replay()
        return self.outputs

    def _capture(self, args: tuple) -> None:
        self.inputs = tuple(arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs = self.fn(*self.inputs)
        self.graph = graph

    def _on_side_stream(self, args: tuple) -> Any:
        """`fn(*args)` on the side stream, after the current stream's work and before its next (the warm-up PyTorch
        asks for before a capture)."""
        current = torch.cuda.current_stream()
        self.side_stream.wait_stream(current)
        with torch.cuda.stream(self.side_stream):
            result = self.fn(*args)
        current.wait_stream(self.side_stream)
        return result

    def _load(self, args: tuple) -> bool:
        """Copies `args` into the capture's inputs; False when they do not fit it."""
        if len(args) != len(self.inputs):
            return False
        for arg, kept in zip(args, self.inputs):
            if isinstance(kept, torch.Tensor) != isinstance(arg, torch.Tensor):
                return False
            if isinstance(kept, torch.Tensor):
                if kept.shape != arg.shape or kept.dtype != arg.dtype or kept.device != arg.device:
                    return False
            elif kept is not arg and kept != arg:
                return False
        for arg, kept in zip(args, self.inputs):
            if isinstance(kept, torch.Tensor) and kept.data_ptr() != arg.data_ptr():
                kept.copy_(arg)
        return True
