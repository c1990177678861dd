"""Newton-Schulz orthogonalisation: the precision pipeline and the gram and direct iterations.

``newton_schulz(G)`` maps G = U·diag(σ)·Vᵀ to approximately U·Vᵀ: each singular value goes
through the scalar recurrence ``x <- a·x + b·x³ + c·x⁵`` (one coefficient row per iteration),
starting from σ / ||G||_F. Pipeline: cast to fp32, orient so rows <= cols, divide each matrix by
its own Frobenius norm (+eps; accumulated in float64, so no finite G overflows it), iterate in
``dtype``, transpose back, cast to G's dtype. Batched
inputs (..., m, n) run as one batched matmul per step. ``dtype=None`` (the default) iterates in
fp16 on CUDA, where tensor cores make it fast, and in fp32 elsewhere: CPUs without matrix units
run fp16 and bf16 matmuls tens of times slower than fp32 (minutes for one 1024 x 4096 matrix).

Two iterations compute the same polynomial up to rounding (with X of shape n x m, n <= m):

- direct: ``A = X·Xᵀ; X <- (a·I + b·A + c·A²)·X``, about 20·n²·m + 10·n³ FLOPs for 5 steps
  (a·I goes onto the n x n factor's diagonal, so each step is one product without C: a GEMM
  with C = X would first copy X into its output, a pass over the long side per step).
- gram: iterate on the n x n Gram matrix R = X·Xᵀ and accumulate the polynomial Q so that the
  output is Q·X, touching the long side m only at segment starts and at the end. Per step
  ``Z = b·R + c·R²``; ``Q = Z + a·I`` at a segment start, else ``Q = a·Q + Z·Q``; then, unless
  the step ends its segment, ``R <- (a·I + Z)·R·(a·I + Z)``. Before each restart iteration
  (default 2) the segment closes: ``X <- Q·X``, ``R <- X·Xᵀ``; this bounds Q (and so fp16
  rounding) to the product of a few steps' gains.

Every symmetric product goes through ``dmuon_kernels.syrk``: X·Xᵀ and R² = R·Rᵀ (R symmetric)
through ``syrk``, and the Gram form's products of commuting symmetric matrices (Z·Q, R·Z,
Z·R_step) through ``symmetric_product``, so a faster symmetric kernel accelerates both iterations.

Gram-or-direct rule: with full products for the commuting ones (cuBLAS on small problems; it
assembles large symmetric results from block columns), the gram form costs
about 6·n²·m + 23·n³ SYRK-weighted FLOPs against 15·n²·m + 5·n³ for direct (14·n³ instead of
23·n³ with a symmetric kernel), so it only pays when the long side is at least twice the short
side (``GRAM_MIN_ASPECT_RATIO``); below that the "gram" backend runs the direct iteration (same
polynomial, fewer FLOPs, no accumulated Q).

CUDA graphs (``dmuon_kernels.graphs``): ``ns(G)`` on a contiguous G (or one whose last two dims
are transposed) replays one graph of normalisation and the iteration per (shape, strides, dtype,
device), so a warmed call is a copy of G in, one replay, the final product and the restore.
Other layouts, and callers that normalise their own input (the fused optimizer step:
``normalized_buffer`` and ``iterate_normalized``), replay a graph of the iteration alone. The
iteration's last product (Q·X, or (a·I + poly)·X) runs eagerly after the replay, into a new tensor:
the graph's own outputs are overwritten by later replays, and copying the result out of it
would cost one more pass over the output. ``update_masters_`` has that product write the Muon
update into the caller's fp32 masters instead (``dmuon_kernels.update_epilogue``).

This module must not know about devices beyond what torch gives it, nor import torch.distributed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from dmuon_kernels._env import NS_CUDA_GRAPH_ENV, NS_KERNEL_ENV, kernel_compile_mode
from dmuon_kernels._log import is_rank_zero, log_rank_tagged
from dmuon_kernels.coefficients import CoefficientTable, validate_coefficients
from dmuon_kernels.fused import DEFAULT_NS_EPS as DEFAULT_EPS
from dmuon_kernels.fused import decay_and_step, muon_apply_updates_, normalize_frobenius
from dmuon_kernels.graphs import GraphedFunction
from dmuon_kernels.syrk import matmul, symmetric_product, syrk
from dmuon_kernels.syrk.dispatch import (
    default_device,
    effective_kernel,
    ns_kernel_request,
    require_ns_kernel,
)
from dmuon_kernels.syrk.registry import (
    AUTO,
    CUBLAS,
    canonical_kernel_name,
    registry_generation,
)
from dmuon_kernels.update_epilogue import copy_into_, epilogue_enabled, final_update_

NSBackend = Literal["gram", "direct"]
BACKENDS: tuple[NSBackend, ...] = ("gram", "direct")
ITERATION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
# dtype=None: the iteration dtype follows the input's device (fp16 on CUDA, fp32 elsewhere).
AUTO_DTYPE = None
AUTO_DTYPE_NAME = "auto"
CUDA_AUTO_DTYPE = torch.float16
CPU_AUTO_DTYPE = torch.float32
DEFAULT_RESTART_ITERATIONS = (2,)
# The "gram" backend runs the direct iteration when max(m, n) < GRAM_MIN_ASPECT_RATIO·min(m, n).
GRAM_MIN_ASPECT_RATIO = 2.0


def validate_backend(backend: object) -> NSBackend:
    for name in BACKENDS:
        if backend == name:
            return name
    raise ValueError(f"backend must be 'gram' or 'direct'; got {backend!r}")


def validate_dtype(dtype: object) -> torch.dtype | None:
    if dtype is AUTO_DTYPE:
        return AUTO_DTYPE
    if isinstance(dtype, torch.dtype) and dtype in ITERATION_DTYPES:
        return dtype
    raise ValueError(
        "dtype (the iteration dtype) must be None (fp16 on CUDA, fp32 elsewhere), "
        f"torch.float16, torch.bfloat16 or torch.float32; got {dtype!r}"
    )


def iteration_dtype(requested: torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype the iteration runs in on ``device``: ``requested``, or for None fp16 on CUDA
    and fp32 elsewhere."""
    if requested is not AUTO_DTYPE:
        return requested
    return CUDA_AUTO_DTYPE if device.type == "cuda" else CPU_AUTO_DTYPE


def validate_restart_iterations(restart_iterations: object, num_iterations: int) -> tuple[int, ...]:
    """Sorted, de-duplicated restart indices in [1, num_iterations - 1], or ValueError.

    ``None`` means restart before iteration 2, when there is an iteration 2.
    """
    if restart_iterations is None:
        return tuple(i for i in DEFAULT_RESTART_ITERATIONS if i < num_iterations)
    if isinstance(restart_iterations, str | bytes) or not isinstance(restart_iterations, Iterable):
        raise ValueError(
            "restart_iterations must be a sequence of 0-based iteration indices, e.g. [2]; "
            f"got {restart_iterations!r}"
        )
    indices = list(restart_iterations)
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(
                f"restart_iterations must hold ints (0-based iteration indices); got {index!r} "
                f"in {indices!r}"
            )
        if not 1 <= index < num_iterations:
            raise ValueError(
                f"restart_iterations index {index} is out of range: with {num_iterations} "
                f"coefficient rows the gram backend can restart before iterations "
                f"1..{num_iterations - 1} (iteration 0 always starts a segment); got {indices!r}"
            )
    return tuple(sorted(set(indices)))


def validate_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0; got {eps!r}")
    return float(eps)


def direct_iteration(X: Tensor, coefficients: CoefficientTable, *, kernel: str = AUTO) -> Tensor:
    """Run ``X <- (a·I + b·A + c·A²)·X`` with A = X·Xᵀ, for X (n, m) or (B, n, m), n <= m."""
    return matmul(*_direct_factors(X, coefficients, kernel), kernel=kernel)


def _direct_factors(
    X: Tensor, coefficients: CoefficientTable, kernel: str
) -> tuple[Tensor, Tensor]:
    """``direct_iteration`` but its last product: (a·I + b·A + c·A², X) of the last step."""
    for step, (a, b, c) in enumerate(coefficients):
        A = syrk(X, kernel=kernel)  # (.., n, n)
        left = syrk(A, C=A, alpha=c, beta=b, kernel=kernel)  # b·A + c·A², A symmetric
        left.diagonal(dim1=-2, dim2=-1).add_(a)  # rounded once, as the gram form's Q = Z + a·I
        if step < len(coefficients) - 1:
            X = matmul(left, X, kernel=kernel)
    return left, X


def gram_iteration(
    X: Tensor,
    coefficients: CoefficientTable,
    restart_iterations: Sequence[int],
    *,
    kernel: str = AUTO,
) -> Tensor:
    """The Gram-matrix form of ``direct_iteration``; see the module docstring. Returns Q·X."""
    Q, X = _gram_factors(X, coefficients, restart_iterations, kernel)
    return matmul(Q, X, kernel=kernel)


def _gram_factors(
    X: Tensor, coefficients: CoefficientTable, restart_iterations: Sequence[int], kernel: str
) -> tuple[Tensor, Tensor]:
    """``gram_iteration`` but its last product: (Q, X) of the last segment."""
    last = len(coefficients) - 1
    restarts = set(restart_iterations)
    R = syrk(X, kernel=kernel)  # (.., n, n)
    Q = R  # replaced at iteration 0, which always starts a segment
    for i, (a, b, c) in enumerate(coefficients):
        starts_segment = i == 0 or i in restarts
        ends_segment = i == last or (i + 1) in restarts
        if starts_segment and i > 0:
            X = matmul(Q, X, kernel=kernel)  # (.., n, m)
            R = syrk(X, kernel=kernel)
        Z = syrk(R, C=R, alpha=c, beta=b, kernel=kernel)  # b·R + c·R²
        # Z, Q, R and R_step are polynomials in the segment's first R, so they commute and
        # every product below is symmetric: symmetric kernels compute half of it.
        if not ends_segment:
            R_step = symmetric_product(R, Z, C=R, beta=a, kernel=kernel)  # R·(a·I + Z)
            R = symmetric_product(Z, R_step, C=R_step, beta=a, kernel=kernel)  # (aI+Z)R(aI+Z)
        if starts_segment:  # Z's last use: a·I goes onto it in place (a copy costs a pass)
            Q = Z
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = symmetric_product(Z, Q, C=Q, beta=a, kernel=kernel)  # a·Q + Z·Q
    return Q, X


def _normalized_shape_of(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``normalized_shape`` for a shape alone: (n', m') or (B, n', m') with n' <= m'."""
    if len(shape) < 2 or not all(isinstance(size, int) and size > 0 for size in shape):
        raise ValueError(
            f"prepare takes shapes (m, n) or (..., m, n) of positive sizes; got {shape}"
        )
    rows, cols = sorted(shape[-2:])
    return (rows, cols) if len(shape) == 2 else (math.prod(shape[:-2]), rows, cols)


def uses_gram_form(rows: int, cols: int) -> bool:
    """Whether the "gram" backend iterates on the Gram matrix for an (rows, cols) matrix."""
    short, long = min(rows, cols), max(rows, cols)
    return long >= GRAM_MIN_ASPECT_RATIO * short


def normalized_shape(G: Tensor) -> tuple[int, ...]:
    """The shape of ``normalized_input(G)``: (n', m') or (B, n', m') with n' <= m'."""
    rows, cols = sorted(G.shape[-2:])
    return (rows, cols) if G.dim() == 2 else (math.prod(G.shape[:-2]), rows, cols)


def normalized_input(
    G: Tensor, *, eps: float, dtype: torch.dtype, out: Tensor | None = None
) -> Tensor:
    """Stage 1: G (..., m, n) -> X (n', m') or (B, n', m') in ``dtype`` with rows <= cols, each
    matrix divided by its own Frobenius norm + eps, written into ``out`` when given (contiguous,
    ``normalized_shape(G)``). Overflow-safe for every finite G (the norm accumulates in float64;
    see [Note: overflow-safe normalisation] in ``dmuon_kernels.fused``); two passes over G on
    CUDA with Triton (the norm, then the quotient and cast)."""
    X = G if G.dtype in (torch.float16, torch.bfloat16, torch.float32) else G.to(torch.float32)
    if G.shape[-2] > G.shape[-1]:
        X = X.mT
    if G.dim() > 3:
        X = X.reshape(-1, *X.shape[-2:])
    return normalize_frobenius(X, eps=eps, dtype=dtype, out=out)


def iteration_factors(
    X: Tensor,
    *,
    backend: str,
    coefficients: CoefficientTable,
    restart_iterations: Sequence[int],
    kernel: str,
) -> tuple[Tensor, Tensor]:
    """Stage 2, the iteration on a normalised X (rows <= cols), but its last product, which
    ``final_product`` computes from the two factors returned: the part CUDA graphs replay (the
    result then needs no copy out of the graph)."""
    if _gram_form(backend, X):
        return _gram_factors(X, coefficients, restart_iterations, kernel)
    return _direct_factors(X, coefficients, kernel)


def final_product(left: Tensor, X: Tensor, *, kernel: str) -> Tensor:
    """The iteration's last product from ``iteration_factors``: Q·X, or (a·I + poly)·X."""
    return matmul(left, X, kernel=kernel)


def _gram_form(backend: str, X: Tensor) -> bool:
    return backend == "gram" and uses_gram_form(X.shape[-2], X.shape[-1])


def restored_output(X: Tensor, G: Tensor) -> Tensor:
    """Stage 3: X back in G's orientation, shape and dtype."""
    if G.shape[-2] > G.shape[-1]:
        X = X.mT
    return X.reshape(G.shape).to(G.dtype)


def validate_input(G: object) -> Tensor:
    if not isinstance(G, Tensor):
        raise ValueError(f"newton_schulz expects a torch.Tensor; got {type(G).__name__}")
    if G.dim() < 2 or not G.is_floating_point():
        raise ValueError(
            "newton_schulz expects a floating-point matrix (m, n) or a batch (..., m, n); "
            f"got a {G.dim()}-D {G.dtype} tensor of shape {tuple(G.shape)}"
        )
    return G


def newton_schulz(
    G: Tensor,
    *,
    backend: str = "gram",
    coefficients: Sequence[Sequence[float]] | None = None,
    restart_iterations: Iterable[int] | None = None,
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype | None = AUTO_DTYPE,
    kernel: str = AUTO,
) -> Tensor:
    """Orthogonalise G (m, n) or a batch (..., m, n): approximately U·Vᵀ of its SVD.

    Args:
        G: floating-point matrix or batch of matrices, either orientation.
        backend: "gram" (iterate on the Gram matrix; direct form when the matrix is less than
            2x as long as wide) or "direct".
        coefficients: (a, b, c) rows, one iteration each; default POLAR_EXPRESS_COEFFICIENTS.
        restart_iterations: 0-based iterations before which "gram" restarts; default [2].
        eps: added to each matrix's Frobenius norm before dividing.
        dtype: iteration dtype: None (default: torch.float16 on CUDA, torch.float32 on other
            devices), torch.float16, torch.bfloat16 or torch.float32.
        kernel: SYRK kernel ("auto", "cublas", "quack", "cute", "cute_sm80"). "auto" honours
            the DMUON_NS_KERNEL environment variable, like ``NewtonSchulz``.

    Returns:
        A tensor of G's shape and dtype. A zero matrix gives zeros.

    Each call runs through a ``NewtonSchulz`` kept per configuration (the arguments and the
    current DMUON_NS_KERNEL and DMUON_NS_CUDA_GRAPH), so repeated calls cost what calls of one
    instance cost, CUDA-graph replay included.
    """
    return _instance_for(backend, coefficients, restart_iterations, eps, dtype, kernel)(G)


# (backend, coefficients, restarts, eps, dtype, kernel, (DMUON_NS_KERNEL, DMUON_NS_CUDA_GRAPH)),
# or (NSRequest, (DMUON_NS_KERNEL, DMUON_NS_CUDA_GRAPH)) where lists make the arguments unhashable
# -> the instance that serves newton_schulz() calls with those arguments.
_instances: dict[tuple, NewtonSchulz] = {}
# A bound for callers that vary the arguments without end (each instance keeps CUDA graphs).
MAX_CACHED_INSTANCES = 64


def _instance_for(
    backend: object,
    coefficients: object,
    restart_iterations: object,
    eps: object,
    dtype: object,
    kernel: object,
) -> NewtonSchulz:
    """The cached ``NewtonSchulz`` for these ``newton_schulz()`` arguments, built (and so
    validated) on first use. The variables a NewtonSchulz reads when it is built
    (DMUON_NS_KERNEL, DMUON_NS_CUDA_GRAPH) are part of the key: two dict lookups per call keep a
    changed value effective, as it is for a newly built NewtonSchulz."""
    environment = (os.environ.get(NS_KERNEL_ENV), os.environ.get(NS_CUDA_GRAPH_ENV))
    arguments: dict[str, object] = {
        "backend": backend,
        "coefficients": coefficients,
        "restart_iterations": restart_iterations,
        "eps": eps,
        "dtype": dtype,
        "kernel": kernel,
    }
    key: tuple = (*arguments.values(), environment)
    request = None
    try:
        instance = _instances.get(key)
    except TypeError:  # lists as coefficients or restarts: key on the validated request
        request = NSRequest.of(**arguments)
        key = (request, environment)
        instance = _instances.get(key)
    if instance is None:
        instance = NewtonSchulz._for_request(
            NSRequest.of(**arguments) if request is None else request
        )
        if len(_instances) >= MAX_CACHED_INSTANCES:
            _instances.clear()
        _instances[key] = instance
    return instance


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NSConfig:
    """What a ``NewtonSchulz`` was asked for: hashable, comparable, JSON-able via ``as_dict``.

    It holds only the request (never the resolved kernel or anything hardware-specific), so two
    ranks that asked for the same thing compare equal even on different GPUs.
    """

    backend: str
    kernel: str
    deterministic: bool
    coefficients: CoefficientTable
    restart_iterations: tuple[int, ...]
    dtype: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "kernel": self.kernel,
            "deterministic": self.deterministic,
            "coefficients": [list(row) for row in self.coefficients],
            "restart_iterations": list(self.restart_iterations),
            "dtype": self.dtype,
        }

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal configs give equal strings."""
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))

    def differences(self, other: NSConfig) -> dict[str, tuple[Any, Any]]:
        """``{field: (self's value, other's value)}`` for every field that differs."""
        mine, theirs = self.as_dict(), other.as_dict()
        return {key: (mine[key], theirs[key]) for key in mine if mine[key] != theirs[key]}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NSRequest:
    """One Newton-Schulz request with every argument validated: what ``NewtonSchulz(...)`` and
    ``newton_schulz(...)`` build once, with ``NSRequest.of``, and read from then on. Hashable, so
    ``newton_schulz()`` keys its instances on it when the arguments themselves are lists.

    ``NSConfig`` is its report form (names instead of dtypes, no eps).
    """

    backend: NSBackend
    kernel: str  # the requested kernel, aliases resolved ("cute_sm80" -> "cute")
    deterministic: bool  # asked for, or kernel == "cublas"
    coefficients: CoefficientTable
    restart_iterations: tuple[int, ...]  # sorted, within [1, len(coefficients) - 1]
    dtype: torch.dtype | None  # None: fp16 on CUDA, fp32 elsewhere
    eps: float = DEFAULT_EPS

    @classmethod
    def of(
        cls,
        *,
        backend: object = "gram",
        kernel: object = AUTO,
        coefficients: object = None,
        restart_iterations: object = None,
        deterministic: object = False,
        dtype: object = AUTO_DTYPE,
        eps: object = DEFAULT_EPS,
    ) -> NSRequest:
        """The request for these arguments, or ValueError naming the first one that is wrong
        (checked in this order: deterministic, backend, kernel, coefficients,
        restart_iterations, dtype, eps)."""
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic must be True or False; got {deterministic!r}")
        backend_name = validate_backend(backend)
        kernel_name = canonical_kernel_name(kernel)
        table = validate_coefficients(coefficients)
        return cls(
            backend=backend_name,
            kernel=kernel_name,
            deterministic=deterministic or kernel_name == CUBLAS,
            coefficients=table,
            restart_iterations=validate_restart_iterations(restart_iterations, len(table)),
            dtype=validate_dtype(dtype),
            eps=validate_eps(eps),
        )

    @property
    def config(self) -> NSConfig:
        return NSConfig(
            backend=self.backend,
            kernel=self.kernel,
            deterministic=self.deterministic,
            coefficients=self.coefficients,
            restart_iterations=self.restart_iterations,
            dtype=AUTO_DTYPE_NAME if self.dtype is AUTO_DTYPE else dtype_name(self.dtype),
        )


class NewtonSchulz:
    """A validated, reusable Newton-Schulz configuration: ``ns(G)`` orthogonalises G.

    Kernel resolution: a non-"auto" ``kernel`` always wins; "auto" defers to the environment
    variable DMUON_NS_KERNEL, then to ``deterministic=True`` (-> "cublas"), then to the hardware
    ladder (SM >= 90 with quack -> quack; the CuTe kernel -> cute; else cublas), which per-shape
    autotuning may still overrule for shapes where cuBLAS is faster. ``kernel="cublas"`` is the
    same as ``deterministic=True``. An explicit kernel that cannot run here raises RuntimeError
    now, with an install or hardware hint, rather than at the first step.

    Attributes:
        backend: "gram" or "direct".
        requested_kernel: the kernel argument, aliases resolved ("cute_sm80" -> "cute").
        kernel: the kernel that really runs on the current device for ``dtype``.
        kernel_reason: where and why, e.g. "SM90, Tri Dao quack".
        kernel_origin: what decided it: "kernel argument", "DMUON_NS_KERNEL",
            "deterministic=True" or "auto".
        kernel_compile: "background" or "wait": whether a ``dmuon.Muon`` using this instance
            compiles the "auto" kernels in a separate process while its steps run cuBLAS, then
            switches on a step every rank agrees on ("background", the default), or compiles
            and tunes them inside its first step ("wait": bit-reproducible from step 1); the
            argument, else ``DMUON_KERNEL_COMPILE`` (``dmuon_kernels.background_compile``).
        deterministic: True when asked for, or when kernel="cublas".
        coefficients: the (a, b, c) rows, one per iteration.
        restart_iterations: sorted 0-based iterations before which "gram" restarts.
        dtype: the requested iteration dtype; None (the default) means fp16 for CUDA inputs and
            fp32 for the rest, decided per call by the input's device (``iteration_dtype``).
        config: the request as an ``NSConfig``.
        graphs: the CUDA-graph cache of ``ns(G)`` calls: one graph of normalisation and the
            iteration but its last product per signature of G.
        iteration_graphs: the CUDA-graph cache of the iteration alone, which
            ``iterate_normalized``, ``normalized_buffer``, ``prepare`` and ``ns(G)`` on other
            layouts use.

    A whole-call graph keeps a static input of G's shape and dtype and the pipeline's
    intermediates allocated for good, per signature;
    ``dmuon_kernels.graphs.GRAPH_MAX_NUMEL`` bounds which inputs get one.
    """

    def __init__(
        self,
        backend: str = "gram",
        kernel: str = AUTO,
        coefficients: Sequence[Sequence[float]] | None = None,
        restart_iterations: Iterable[int] | None = None,
        deterministic: bool = False,
        dtype: torch.dtype | None = AUTO_DTYPE,
        kernel_compile: str | None = None,
    ) -> None:
        self._start(
            NSRequest.of(
                backend=backend,
                kernel=kernel,
                coefficients=coefficients,
                restart_iterations=restart_iterations,
                deterministic=deterministic,
                dtype=dtype,
            ),
            kernel_compile,
        )

    @classmethod
    def _for_request(cls, request: NSRequest) -> NewtonSchulz:
        """The ``NewtonSchulz`` of an already validated request (``newton_schulz()`` passes its
        eps this way; the constructor always uses the default)."""
        instance = cls.__new__(cls)
        instance._start(request)
        return instance

    def _start(self, request: NSRequest, kernel_compile: str | None = None) -> None:
        """Resolve the kernel for ``request`` (raising now if it cannot run here) and set up the
        graph caches."""
        self._request = request
        self.kernel_compile = kernel_compile_mode(kernel_compile)
        self._syrk_kernel, self.kernel_origin = ns_kernel_request(
            request.kernel, request.deterministic
        )
        require_ns_kernel(self._syrk_kernel, self.kernel_origin)
        device = default_device()
        self.kernel, self.kernel_reason = effective_kernel(
            self._syrk_kernel, self.iteration_dtype(device), device
        )
        # Two graph caches: ns(G) replays normalisation and the iteration (_normalized_factors),
        # so a warmed call is a copy in, one replay and the final product; the fused optimizer
        # step normalises on its own and replays the iteration alone (_factors), writing into
        # that graph's input. Both leave the final product to run eagerly into a new tensor.
        self._graphed = GraphedFunction(
            self._factors, finish=self._final_product, name=f"NewtonSchulz({self.backend!r})"
        )
        self._graphed_call = GraphedFunction(
            self._normalized_factors,
            finish=self._final_product,
            name=f"NewtonSchulz({self.backend!r}) call",
        )
        # The registry generation the graphs were captured under: when it moves (a backend
        # registered, or the background compile's switch), the graphs hold stale kernels.
        self._graphs_generation = registry_generation()

    def _drop_stale_graphs(self) -> None:
        """Drop both graph caches when the kernels "auto" may pick changed since they were
        captured ([Note: the switch] in ``dmuon_kernels.background_compile``): each shape then
        runs eagerly once (tuning there, outside any capture) and is captured again."""
        generation = registry_generation()
        if generation != self._graphs_generation:
            self._graphs_generation = generation
            self._graphed.clear()
            self._graphed_call.clear()

    @property
    def backend(self) -> NSBackend:
        return self._request.backend

    @property
    def requested_kernel(self) -> str:
        return self._request.kernel

    @property
    def deterministic(self) -> bool:
        return self._request.deterministic

    @property
    def coefficients(self) -> CoefficientTable:
        return self._request.coefficients

    @property
    def restart_iterations(self) -> tuple[int, ...]:
        return self._request.restart_iterations

    @property
    def dtype(self) -> torch.dtype | None:
        return self._request.dtype

    @property
    def config(self) -> NSConfig:
        return self._request.config

    def iteration_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the iteration runs in for inputs on ``device`` (``dtype``, or for None
        fp16 on CUDA and fp32 elsewhere)."""
        return iteration_dtype(self.dtype, device)

    def __call__(self, G: Tensor) -> Tensor:
        """Orthogonalise G (m, n) or a batch (..., m, n); returns a fresh tensor of G's shape and
        dtype.

        On CUDA each (shape, strides, dtype, device) of G replays the whole pipeline as one CUDA
        graph from its second call (bit-identical to eager; ``DMUON_NS_CUDA_GRAPH=0`` turns it
        off, see ``dmuon_kernels.graphs``).
        """
        G = validate_input(G)
        if G.numel() == 0:
            return torch.zeros_like(G)
        self._drop_stale_graphs()
        if G.is_contiguous() or G.mT.is_contiguous():
            return restored_output(self._graphed_call(G), G)
        # A graph's static input copies G's strides: for a slice with gaps that would allocate
        # the whole span it strides over, and an expanded G (stride 0) cannot be copied into.
        # Such inputs replay the iteration alone, normalised straight into its graph's input
        # buffer.
        dtype = self.iteration_dtype(G.device)
        buffer = self._graphed.static_input(normalized_shape(G), dtype, G.device)
        X = normalized_input(G, eps=self._request.eps, dtype=dtype, out=buffer)
        return restored_output(self._graphed(X), G)

    def prepare(
        self, shapes: Iterable[Sequence[int]], device: torch.device | str | None = None
    ) -> None:
        """Tune and compile now what the iteration needs for inputs of these shapes ((m, n) or
        (B, m, n), either orientation, as ``ns(G)`` or a fused step would pass them), on
        ``device`` (default: the current CUDA device, else the CPU).

        The first call of each shape does this anyway (per-shape SYRK autotune, CuTe kernel
        compilation, both kept on disk under DMUON_CACHE_DIR for later processes); calling
        ``prepare`` with the shapes a model has moves that cost to one announced place: rank 0
        prints one line per shape (which, how many left) and the total time, so a long first
        step never looks like a hang. Results never change.
        """
        device = default_device() if device is None else torch.device(device)
        dtype = self.iteration_dtype(device)
        wanted = list(dict.fromkeys(_normalized_shape_of(tuple(shape)) for shape in shapes))
        announce = is_rank_zero()
        start = time.perf_counter()
        for index, shape in enumerate(wanted, 1):
            if announce:
                log_rank_tagged(
                    f"Newton-Schulz prepare {index}/{len(wanted)}: shape={shape} "
                    f"dtype={dtype_name(dtype)} ({len(wanted) - index} left after this one; "
                    "SYRK autotune and kernel compilation on first use)"
                )
            X = torch.zeros(shape, dtype=dtype, device=device)
            self._graphed(X)  # the eager first run: autotune and compilation happen here
        if announce and wanted:
            log_rank_tagged(
                f"Newton-Schulz prepare done: {len(wanted)} shapes in "
                f"{time.perf_counter() - start:.1f} s"
            )

    def normalized_buffer(self, shape: tuple[int, int, int], device: torch.device) -> Tensor:
        """Where a caller that normalises its own input (a fused optimizer step) writes it:
        (B, n, m) with n <= m in ``iteration_dtype(device)`` — the captured graph's input buffer
        when there is one, so no copy is made into the graph."""
        dtype = self.iteration_dtype(device)
        self._drop_stale_graphs()
        buffer = self._graphed.static_input(shape, dtype, device)
        return torch.empty(shape, dtype=dtype, device=device) if buffer is None else buffer

    def iterate_normalized(
        self,
        X: Tensor,
        *,
        graph_max_numel: int | None = None,
        finish: Callable[[Tensor, Tensor], None] | None = None,
    ) -> Tensor | None:
        """The iteration alone on X (B, n, m), n <= m, in ``iteration_dtype(X.device)``, each
        matrix already divided by its Frobenius norm + eps; returns a fresh tensor of X's shape
        and dtype. ``graph_max_numel``: the largest X whose signature may get a CUDA graph
        (default ``dmuon_kernels.graphs.GRAPH_MAX_NUMEL``). ``finish`` (``update_masters_``):
        takes the last product's two factors instead, and the call returns None."""
        dtype = self.iteration_dtype(X.device)
        if X.dim() != 3 or X.dtype != dtype or X.shape[-2] > X.shape[-1]:
            raise ValueError(
                f"iterate_normalized takes (B, n, m) with n <= m in {dtype}; got "
                f"{tuple(X.shape)} in {X.dtype}. Use ns(G) for inputs it should normalise itself."
            )
        self._drop_stale_graphs()
        return self._graphed(X, max_numel=graph_max_numel, finish=finish)

    def update_masters_(
        self,
        X: Tensor,
        masters: Sequence[Tensor],
        *,
        lr: float,
        weight_decay: float,
        scales: Sequence[float],
        graph_max_numel: int | None = None,
        copies: Sequence[Tensor | None] | None = None,
    ) -> None:
        """The iteration on X as ``iterate_normalized``, then ``masters[i] = masters[i]·(1 −
        lr·weight_decay) − lr·scales[i]·O_i`` in place for its output O (B, n, m):
        ``masters[i]`` is O_i's shape or its transpose, fp32 or X's dtype. On CUDA the last
        product writes the update itself and O is never stored ([Note: the update epilogue] in
        ``dmuon_kernels.update_epilogue``); elsewhere, or with ``DMUON_UPDATE_EPILOGUE=0``, O is
        written out and applied in one more pass (``muon_apply_updates_``).

        ``copies[i]`` (None, or a tensor of ``masters[i]``'s shape in a narrower dtype: the
        weight forward computes with) receives the new master rounded to its dtype, by the
        same product's epilogue where the fused update GEMM runs, by a copy otherwise."""
        if copies is not None and len(copies) != len(masters):
            raise ValueError(
                f"update_masters_: {len(masters)} masters and {len(copies)} copies; pass one "
                "copy (or None) per master"
            )
        if not epilogue_enabled(X):
            orthogonal = self.iterate_normalized(X, graph_max_numel=graph_max_numel)
            updates = [o if m.shape == o.shape else o.mT for m, o in zip(masters, orthogonal)]
            # one pass per run of equal shape and scale
            runs = itertools.groupby(range(len(masters)), lambda i: (masters[i].shape, scales[i]))
            for (_, scale), run in runs:
                run = list(run)
                muon_apply_updates_(
                    [masters[i] for i in run], [updates[i] for i in run], lr, weight_decay, scale
                )
            copy_into_(copies, masters)
            return
        decay, _ = decay_and_step(lr, weight_decay, 1.0)
        steps = [decay_and_step(lr, weight_decay, scale)[1] for scale in scales]
        finish = functools.partial(self._final_update, masters, copies, decay, steps)
        self.iterate_normalized(X, graph_max_numel=graph_max_numel, finish=finish)  # validates X

    @property
    def graphs(self) -> GraphedFunction:
        """The CUDA-graph cache ``ns(G)`` calls replay, one whole-pipeline graph per signature of
        G (``graph_count``, ``mode(G)``, ``eager_reasons()``, ``enabled``), for reports."""
        return self._graphed_call

    @property
    def iteration_graphs(self) -> GraphedFunction:
        """The CUDA-graph cache of the iteration alone, one graph per signature of the normalised
        input (B, n, m): what ``iterate_normalized`` (the fused optimizer step) replays."""
        return self._graphed

    def _normalized_factors(self, G: Tensor) -> tuple[Tensor, Tensor]:
        """What the whole-call graphs capture: normalise G (non-empty), then ``_factors``."""
        X = normalized_input(G, eps=self._request.eps, dtype=self.iteration_dtype(G.device))
        return self._factors(X)

    def _factors(self, X: Tensor) -> tuple[Tensor, Tensor]:
        """What the iteration graphs capture: the iteration on a normalised X but its last
        product."""
        return iteration_factors(
            X,
            backend=self.backend,
            coefficients=self.coefficients,
            restart_iterations=self.restart_iterations,
            kernel=self._syrk_kernel,
        )

    def _final_product(self, left: Tensor, X: Tensor) -> Tensor:
        """The iteration's last product, run eagerly after each graph replay (``finish``)."""
        return final_product(left, X, kernel=self._syrk_kernel)

    def _final_update(
        self,
        masters: Sequence[Tensor],
        copies: Sequence[Tensor | None] | None,
        decay: float,
        steps: Sequence[float],
        left: Tensor,
        X: Tensor,
    ) -> None:
        """``update_masters_``'s last product, run eagerly after each graph replay."""
        final_update_(left, X, masters, decay=decay, steps=steps, copies=copies)

    def __repr__(self) -> str:
        return (
            f"NewtonSchulz(backend={self.backend!r}, kernel={self.requested_kernel!r} -> "
            f"{self.kernel!r}, steps={len(self.coefficients)}, "
            f"restart_iterations={list(self.restart_iterations)}, dtype={self.dtype})"
        )
