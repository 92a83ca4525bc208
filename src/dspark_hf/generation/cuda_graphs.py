"""Compiled rounds replayed as CUDA graphs that PyTorch captures directly (`torch.cuda.CUDAGraph`).

`torch.compile(mode="reduce-overhead")` replays a function through its CUDA-graph trees, whose host work per call
(guards, a check of every static input's address, copies of the other inputs) measured 0.2-0.5 ms for the 50M
fixture's batch-1 round and 0.9-1.3 ms for the Qwen3-4B shape's on an H200
(`benchmarks/results/cuda_graph_replay_h200.json`). That is about the GPU time of a fixture round, and a loop that
reads the device after a round leaves the GPU idle that long before the next. A replay of a captured graph cost the
host 9-36 µs there. `GraphedFunction` wraps a compiled function (torch.compile's default mode: no graphs of its own)
and replays it that way. It skips checks the trees make for their caller, so what its graphs read must stay where it
was: `reset()` when it moves (`CaptureKey` tells when).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

WARMUP_CALLS = 2  # calls before a capture: the first compiles, the second runs what the first initialised lazily
GRAPHS_VARIABLE = "DSPARK_CUDA_GRAPHS"


def direct_graphs_enabled() -> bool:
    """Whether `compile=True` on CUDA replays rounds through `GraphedFunction` (`DSPARK_CUDA_GRAPHS=direct`, the
    default since 2026-12-05) or through reduce-overhead's graph trees (`DSPARK_CUDA_GRAPHS=trees`)."""
    value = os.environ.get(GRAPHS_VARIABLE, "direct")
    if value not in ("trees", "direct"):
        raise ValueError(f"{GRAPHS_VARIABLE} must be 'trees' or 'direct', got {value!r}.")
    return value == "direct"


def direct_graphs(compile: bool | dict) -> bool:
    """Whether a fast path's `compile` argument gets `GraphedFunction`s: True (not a dict of options), unless
    `DSPARK_CUDA_GRAPHS=trees` (off CUDA they call the compiled function as it is)."""
    return compile is True and direct_graphs_enabled()


Context = Callable[[], AbstractContextManager]


def compiled_round(fn: Callable[..., Any], compile: bool | dict, device: torch.device | str,
                   pool: tuple | None = None, context: Context = nullcontext) -> Callable[..., Any]:
    """`fn` compiled as a fast path's `compile` argument asks (False: `fn` itself): a dict of `torch.compile` options
    as given; True: a `GraphedFunction` where `direct_graphs` holds, else reduce-overhead's graph trees. `context()`
    is entered around every call that runs `fn`'s Python (what its forwards need: kernel choices, hooks); a
    `GraphedFunction` enters it only to warm up and capture, not around its replays, where it would be host time
    spent for nothing (setting two models' attention implementation cost about 50 µs a round)."""
    if direct_graphs(compile):
        return GraphedFunction(torch.compile(fn, dynamic=False), device, pool=pool, context=context)
    if isinstance(compile, dict):
        fn = torch.compile(fn, **compile)
    elif compile:
        fn = torch.compile(fn, mode="reduce-overhead", dynamic=False)
    return in_context(fn, context)


def in_context(fn: Callable[..., Any], context: Context) -> Callable[..., Any]:
    """`fn` called inside `context()`."""
    def call(*args: Any) -> Any:
        with context():
            return fn(*args)

    return call


class _Capture:
    """One captured graph of a `GraphedFunction`: static copies of the call's tensor arguments, and its outputs."""

    def __init__(self, fn: Callable[..., Any], args: tuple, pool: tuple | None, context: Context = nullcontext):
        self.inputs = tuple(arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local, as reduce-overhead's trees capture: only this thread's unsafe CUDA calls are refused during the
        # capture, not another thread's (an engine can serve from its own thread beside other CUDA work)
        with context(), torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs = fn(*self.inputs)

    def replay(self, args: tuple) -> Any:
        for arg, kept in zip(args, self.inputs):
            if isinstance(kept, torch.Tensor) and kept.data_ptr() != arg.data_ptr():
                kept.copy_(arg)
        self.graph.replay()
        return self.outputs


def signature(args: tuple) -> tuple:
    """What a capture fixes about a call's arguments: each tensor's shape, dtype and device, any other value itself."""
    return tuple((tuple(arg.shape), arg.dtype, arg.device) if isinstance(arg, torch.Tensor) else (type(arg), arg)
                 for arg in args)


class GraphedFunction:
    """`fn(*args)` replayed as a CUDA graph, one per argument `signature`, after `warmup` calls of that signature.

    The first `warmup` calls of a signature run `fn` on a side stream (the first also compiles it), the next captures
    it with static copies of its tensor arguments and replays that capture. Later calls of the signature copy their
    tensor arguments into those copies and replay; their result is the captured outputs, which the next replay
    overwrites (clone what must outlive it). Everything else `fn` reads (parameters, caches, state buffers) must keep
    its address while the graphs live: call `reset()` when it moves. On a `device` other than CUDA, calls run `fn` as
    it is.

    `pool` (`torch.cuda.graph_pool_handle()`) lets several graphs share one memory pool: safe when their replays never
    overlap and no graph's outputs are read after another graph has run (the outputs themselves stay reserved).
    `context()` is entered around each call that runs `fn` (warm-ups, captures, every call off CUDA), not around
    replays.
    """

    def __init__(self, fn: Callable[..., Any], device: torch.device | str, warmup: int = WARMUP_CALLS,
                 pool: tuple | None = None, context: Context = nullcontext):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the compile and lazy initialisations must not happen inside a "
                             f"capture), got {warmup}.")
        self.fn, self.warmup, self.pool, self.context = fn, warmup, pool, context
        self.on_cuda = torch.device(device).type == "cuda"
        self.side_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.reset()

    def reset(self) -> None:
        """Drops every capture; each signature's next `warmup` calls run `fn` directly again (recompiling there)."""
        self.captures: dict[tuple, _Capture] = {}
        self.warm_calls: dict[tuple, int] = {}

    @property
    def captured(self) -> bool:
        return bool(self.captures)

    def __call__(self, *args: Any) -> Any:
        if not self.on_cuda:
            with self.context():
                return self.fn(*args)
        key = signature(args)
        capture = self.captures.get(key)
        if capture is None:
            if self.warm_calls.get(key, 0) < self.warmup:
                self.warm_calls[key] = self.warm_calls.get(key, 0) + 1
                return self._on_side_stream(args)
            capture = self.captures[key] = _Capture(self.fn, args, self.pool, self.context)
        return capture.replay(args)

    def _on_side_stream(self, args: tuple) -> Any:
        """`fn(*args)` on the side stream, after the current stream's work and before its next (the warm-up PyTorch
        asks for before a capture)."""
        current = torch.cuda.current_stream()
        self.side_stream.wait_stream(current)
        with self.context(), torch.cuda.stream(self.side_stream):
            result = self.fn(*args)
        current.wait_stream(self.side_stream)
        return result


class CaptureKey:
    """What captured graphs read besides their own buffers: the models' parameters and buffers (their addresses) and
    the kernel choices they were traced with. `changed()` tells when graphs captured under the last key must go."""

    def __init__(self):
        self.key: tuple | None = None

    def changed(self, models: Iterable[torch.nn.Module | None], *choices: object) -> bool:
        key = choices + tuple(tensor.data_ptr() for model in models if model is not None
                              for tensor in itertools.chain(model.parameters(), model.buffers()))
        changed, self.key = key != self.key, key
        return changed

    def reset_if_moved(self, functions: Iterable[Callable[..., Any] | None],
                       models: Iterable[torch.nn.Module | None], *choices: object) -> None:
        """Resets the `GraphedFunction`s among `functions` when the key `changed` (only computed when there are)."""
        graphed = [function for function in functions if isinstance(function, GraphedFunction)]
        if graphed and self.changed(models, *choices):
            for function in graphed:
                function.reset()
