"""CUDA-graph replay of a fixed tensor function, one graph per (shape, strides, dtype, device).

Owns capture, replay and the fall back to eager. Newton-Schulz launches a few dozen small kernels
per matrix; replaying them as one graph removes the launch gaps (the host cost that dominates
small matrices). It must not know what the function computes, and must never change a result:

- the first call with a new signature runs eagerly, so everything lazy inside the function (SYRK
  autotuning, kernel compilation, handle creation) happens outside any capture;
- the second call captures on a private stream after one more eager run on that stream, replays
  once, and keeps the graph only if the replay is bit-identical to that eager run;
- a capture that fails (or a replay that differs) warns once for that signature and leaves it
  eager for good; the failed graph object is dropped, so it can never be replayed, and later
  signatures capture on a fresh pool and stream (a failure on the CUDA side can leave the old
  pool marked as still recording);
- Python's cyclic garbage collector is off while a graph is captured (see ``_capture``);
- inputs on the CPU, inputs that need grad, inputs over ``GRAPH_MAX_NUMEL`` elements (or the
  call's ``max_numel``), calls made while another capture is in progress, and everything when
  ``DMUON_NS_CUDA_GRAPH=0`` run eagerly;
- each capture (its eager reference run, the capture, the check replay) is timed as a
  ``capture`` phase (``dmuon_kernels._log``) and announced with its seconds
  (``DMUON_SYRK_AUTOTUNE_LOG=0`` silences the line).

A graph keeps its input, outputs and intermediates allocated for good. For a large input that
costs gigabytes (a batch of 48 projections of a 1 B model: about 3 GiB) and saves nothing, since
its kernels are long and launching them is not what limits it; so large inputs stay eager.

Streams: a call runs on the caller's current stream, and the graphs of one pool share memory
(inputs, intermediates, outputs), so a replay (or a capture's check replay, or a caller writing
into ``static_input``) on another stream than the last replay on that device waits for it to
finish first (one event per replay). One instance can then serve callers on several streams: an
overlapped optimizer step replays on its side stream while a later call may come from the compute
stream, or two pipeline stages' side streams share one ``NewtonSchulz``.

The function must be a pure function of its one tensor argument (same input, same outputs), and
must not keep references to its intermediates. Each call returns a fresh tensor: a graph's
outputs live in its memory pool, which the next replay of any graph sharing that pool may
overwrite, so they never leave this module. With a ``finish`` the function's last step runs
eagerly on them right after the replay and allocates the result (Newton-Schulz's final product),
which costs one launch instead of a copy of the result; without one the output is copied.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dmuon_kernels._env import NS_CUDA_GRAPH_ENV as CUDA_GRAPH_ENV
from dmuon_kernels._env import env_flag, progress_lines_enabled
from dmuon_kernels._log import CAPTURE, log_rank_tagged, timed_phase

# (shape, strides, dtype, device); the shape as torch.Size, which hashes and compares as a tuple
Signature = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]
Outputs = Tensor | tuple[Tensor, ...]  # what the captured function returns

GRAPH_MAX_NUMEL = 2**26
"""Inputs up to this many elements (a batch of 64 matrices of 1024 x 1024) replay a graph."""


def cuda_graphs_enabled() -> bool:
    """False when ``DMUON_NS_CUDA_GRAPH`` is 0/false/no/off; on by default (``env_flag``: any
    other value raises ValueError)."""
    return env_flag(CUDA_GRAPH_ENV, default=True)


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    static_input: Tensor
    static_outputs: tuple[Tensor, ...]


class GraphedFunction:
    """Call ``finish(*fn(x))``: ``fn`` through a CUDA graph per input signature (eagerly where it
    cannot), ``finish`` eagerly.

    ``fn(x)`` returns a tensor or a tuple of tensors. ``finish`` takes them and returns a tensor
    it allocates (never one of its arguments or a view of one: those are the graph's memory); it
    must not be captured because its result has to outlive the next replay. Without ``finish``,
    ``fn`` returns one tensor and the call returns a copy of it. ``enabled=None`` reads
    ``DMUON_NS_CUDA_GRAPH`` now. ``name`` appears in warnings.
    """

    def __init__(
        self,
        fn: Callable[[Tensor], Outputs],
        *,
        finish: Callable[..., Tensor] | None = None,
        name: str = "Newton-Schulz",
        enabled: bool | None = None,
    ) -> None:
        self.fn = fn
        self.finish = finish
        self.name = name
        self.enabled = cuda_graphs_enabled() if enabled is None else bool(enabled)
        self._captured: dict[Signature, _Captured] = {}
        self._warmed: set[Signature] = set()  # ran eagerly once; capture on the next call
        self._eager_only: dict[Signature, str] = {}  # signature -> why it stays eager
        self._pools: dict[torch.device, object] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # device -> (stream, event after it) of the last replay of one of its graphs
        self._last_use: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Event]] = {}

    def __call__(
        self,
        x: Tensor,
        *,
        max_numel: int | None = None,
        finish: Callable[..., Tensor | None] | None = None,
    ) -> Tensor | None:
        """``finish(*fn(x))``, always a fresh tensor (or None: see ``finish``).

        ``max_numel`` (default ``GRAPH_MAX_NUMEL``): the largest input that may be captured, for
        a caller whose launches cost more than the graph's memory (an overlapped step's
        Newton-Schulz calls, launched from backward); a graph already captured always replays.
        ``finish``: this call's own last step instead of the instance's, which may also write
        its result into tensors of the caller's and return None (the Muon update written by
        the final product: ``dmuon_kernels.update_epilogue``)."""
        finish = self.finish if finish is None else finish
        signature = _signature(x)
        captured = self._captured.get(signature)
        if captured is not None:
            self._after_last_use(x.device)
            if x is not captured.static_input:  # callers may write the input there directly
                captured.static_input.copy_(x)
            captured.graph.replay()
            result = self._finished(finish, captured.static_outputs, static=True)
            return self._used(x.device, result)
        if not self._may_capture(x, signature, max_numel):
            return self._finished(finish, _as_tuple(self.fn(x)), static=False)
        if signature not in self._warmed:
            self._warmed.add(signature)
            return self._finished(finish, _as_tuple(self.fn(x)), static=False)
        announce = progress_lines_enabled()  # an invalid switch raises before any work
        shape, _, dtype, _ = signature
        what = f"{self.name} shape={tuple(shape)} dtype={_dtype_name(dtype)}"
        with timed_phase(CAPTURE, what) as phase:
            outputs = self._capture(x, signature)
        captured = signature in self._captured
        if announce and captured:
            log_rank_tagged(f"captured a CUDA graph of {what} in {phase.seconds:.2f} s")
        result = self._finished(finish, outputs, static=captured)
        return self._used(x.device, result) if captured else result

    def static_input(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor | None:
        """The captured graph's input buffer for contiguous inputs of this shape, or None.

        A caller that produces the input anyway can write it there and pass the buffer itself,
        which saves the copy into the graph (Newton-Schulz normalises straight into it). The
        caller's current stream is ordered after the device's last replay, so the write is too.
        """
        strides, step = [], 1
        for size in reversed(shape):  # the strides of a contiguous tensor of `shape`
            strides.insert(0, step)
            step *= max(size, 1)
        captured = self._captured.get((tuple(shape), tuple(strides), dtype, device))
        if captured is None:
            return None
        self._after_last_use(device)
        return captured.static_input

    def mode(self, x: Tensor) -> str:
        """``"graph"`` when ``x``'s signature replays a graph, else ``"eager"`` (for tests/reports)."""
        return "graph" if _signature(x) in self._captured else "eager"

    @property
    def graph_count(self) -> int:
        """How many signatures replay a captured graph."""
        return len(self._captured)

    def eager_reasons(self) -> dict[Signature, str]:
        """Signatures that stay eager because capture failed, with the reason."""
        return dict(self._eager_only)

    def clear(self) -> None:
        """Drop every graph (their memory returns to the allocator when no tensor uses it)."""
        self._captured.clear()
        self._warmed.clear()
        self._eager_only.clear()
        self._pools.clear()
        self._last_use.clear()

    def _after_last_use(self, device: torch.device) -> None:
        """Order the current stream after the last replay on ``device``, if that was on another
        stream (its graphs' memory is about to be written again)."""
        last = self._last_use.get(device)
        if last is not None:
            stream, done = last
            current = torch.cuda.current_stream(device)
            if stream != current:
                current.wait_event(done)

    def _used(self, device: torch.device, result: Tensor | None) -> Tensor | None:
        """Record the replay (and its ``finish``) just enqueued as the device's last one."""
        stream = torch.cuda.current_stream(device)
        done = torch.cuda.Event()
        done.record(stream)
        self._last_use[device] = (stream, done)
        return result

    def _may_capture(self, x: Tensor, signature: Signature, max_numel: int | None) -> bool:
        return (
            self.enabled
            and x.is_cuda
            and x.numel() <= (GRAPH_MAX_NUMEL if max_numel is None else max_numel)
            and not (x.requires_grad and torch.is_grad_enabled())
            and signature not in self._eager_only
            and not torch.cuda.is_current_stream_capturing()
        )

    def _capture(self, x: Tensor, signature: Signature) -> tuple[Tensor, ...]:
        """Capture fn for ``signature``; return fn(x): the graph's outputs, or eager ones when
        the capture failed (then ``signature`` is not in ``_captured``)."""
        device = x.device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = torch.cuda.graph_pool_handle()
        static_input = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
        static_input.copy_(x)
        self._after_last_use(device)  # the check replay below writes into the pool
        caller_stream = torch.cuda.current_stream(device)
        stream.wait_stream(caller_stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                # One eager run on the capture stream: lazy per-stream state (e.g. a cuBLAS
                # workspace) is created outside the capture, and it is the replay's reference.
                expected = _as_tuple(self.fn(static_input))
            # Cyclic garbage can hold CUDA graphs (a dropped NewtonSchulz refers to itself
            # through its graph caches); destroying one in the middle of this capture is an
            # illegal call that invalidates it. torch.cuda.graph no longer collects first, so
            # collection waits until the capture is over.
            collecting = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(
                    graph, pool=pool, stream=stream, capture_error_mode="thread_local"
                ):
                    static_outputs = _as_tuple(self.fn(static_input))
            finally:
                if collecting:
                    gc.enable()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph.replay()
            identical = len(static_outputs) == len(expected) and all(
                torch.equal(output, reference)
                for output, reference in zip(static_outputs, expected)
            )
        except Exception as exc:  # any failure inside capture leaves this signature eager
            del graph
            # torch.cuda.graph does not leave its stream when capture_end raises: go back first.
            torch.cuda.set_stream(caller_stream)
            caller_stream.wait_stream(stream)
            # Later captures start on a new pool and stream: a capture invalidated on the CUDA
            # side can leave its pool marked as recording ("beginAllocateToPool: already
            # recording to mempool_id" for every later capture on it).
            self._pools.pop(device, None)
            self._streams.pop(device, None)
            reason = f"capture failed ({type(exc).__name__}: {exc})"
            recovery_problem = _end_generator_capture(device)
            if recovery_problem is not None:
                reason += (
                    f"; resetting the CUDA generator afterwards failed too ({recovery_problem})"
                )
            self._stay_eager(signature, reason)
            return _as_tuple(self.fn(x))
        if not identical:
            del graph
            self._stay_eager(signature, "the graph replay was not bit-identical to eager")
            return expected
        self._captured[signature] = _Captured(graph, static_input, static_outputs)
        return static_outputs

    def _finished(
        self,
        finish: Callable[..., Tensor | None] | None,
        outputs: tuple[Tensor, ...],
        *,
        static: bool,
    ) -> Tensor | None:
        """The call's result from fn's outputs; ``static``: they are a graph's, to be left to
        it."""
        if finish is None:
            (output,) = outputs
            return output.clone() if static else output
        result = finish(*outputs)
        if static and result is not None and _shares_memory(result, outputs):
            raise RuntimeError(
                f"{self.name}: finish returned (a view of) a graph's output, which the next "
                "replay overwrites; it must allocate its result"
            )
        return result

    def _stay_eager(self, signature: Signature, reason: str) -> None:
        self._eager_only[signature] = reason
        shape, _, dtype, device = signature
        message = (
            f"{self.name}: CUDA-graph replay is off for shape={tuple(shape)} dtype={dtype} on "
            f"{device} "
            f"because {reason}; this shape runs eagerly (same results, more launch overhead). "
            f"Set {CUDA_GRAPH_ENV}=0 to skip capture altogether."
        )
        warnings.warn(message, RuntimeWarning, stacklevel=4)
        log_rank_tagged(message)


def _end_generator_capture(device: torch.device) -> str | None:
    """Leave the CUDA random generator usable after a capture that failed midway; returns why
    that failed too, or None.

    A capture whose end raises leaves torch's CUDA generator in capture mode, and every later
    random op fails with "Offset increment outside graph capture encountered unexpectedly". One
    small successful capture (own stream, own pool) runs the generator's capture prologue and
    epilogue and so ends that mode (test_failed_capture_does_not_leave_a_replayable_graph).
    """
    caller_stream = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            torch.empty(1, device=device).zero_()  # one node: never an "empty graph"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        torch.cuda.set_stream(caller_stream)
        del graph
    return None


def _signature(x: Tensor) -> Signature:
    return (x.shape, x.stride(), x.dtype, x.device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_tuple(outputs: Outputs) -> tuple[Tensor, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _shares_memory(result: Tensor, outputs: tuple[Tensor, ...]) -> bool:
    storage = result.untyped_storage().data_ptr()
    return any(output.untyped_storage().data_ptr() == storage for output in outputs)
