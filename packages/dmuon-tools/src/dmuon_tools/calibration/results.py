"""Reading the committed benchmark results: which files the H200's figures come from, and what
the calibration takes from each file.

Owns the names of the files the H200 preset is fitted on (``machine.H200_SOURCES`` names the same
ones), the loaders of each family of files (``bench_e2e.py``, ``overlap_ab.py``, ``bench_step.py``,
``profile_host.py``, ``bench_ns.py``, ``bench_syrk.py`` JSON) and the two questions asked of a file
before it is used (did it run on the CPU; did an ``overlap_ab.py`` run measure the defaults). It
must not fit a constant or predict anything (``fit`` and ``report`` do).

[Note: reading a benchmark file]
Each family of files has a loader that takes what the simulator needs and says, naming the file
and the key, when something is missing; files of a family the report does not use are ignored,
and the protocol runs are listed as excluded with the reason (their ``seconds`` time the whole
check, reference model included, not a training step).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dmuon.inspect import SPECULATION_CHUNKS
from dmuon_tools.model_shapes import DecoderShape
from dmuon_tools.ns_table import shape_key
from dmuon_tools.simulator import Workload

# The files the H200 preset's figures come from (see machine.H200_SOURCES).
GEMM_FILE = "syrk-h200-2026-11-29-final.json"
NS_FILE = "ns-h200-2026-11-29-autotune-graphs.json"
STEP_FILE = "step-h200-2026-12-01-48aeddf.json"
E2E_FILE = "e2e-h200-w1-2026-12-01-48aeddf.json"
HOST_FILE = "host-gpt2-h200-2026-12-01-576a0bf.json"
GLOO_FILE = "e2e-h200-gloo-w4-2026-12-01-f6373d6.json"
DMUON_NS_CANDIDATE = "dmuon gram"
CUBLAS_NS_CANDIDATE = "dmuon gram cublas"
REFERENCE_NS_CANDIDATE = "torch.optim.Muon"

# The speculation chunks of the ``overlap_ab.py`` runs that predate recording them: the default
# was four until it became two.
UNRECORDED_SPECULATION_CHUNKS = 4


def read_result(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a ValueError naming the file when it cannot be read."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read the benchmark result {path}: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(data).__name__}.")
    return data


def value_at(data: Mapping[str, Any], keys: str, path: Path) -> Any:
    """``data[k1][k2]`` for ``keys`` "k1.k2"; a ValueError naming the file and the key when absent."""
    value: Any = data
    for key in keys.split("."):
        if not isinstance(value, Mapping) or key not in value:
            raise ValueError(
                f"{path.name}: no {keys!r} in the file; it is not a result of the benchmark its "
                "name says, or was written by an older version of it."
            )
        value = value[key]
    return value


def bench_e2e_shape(model: Mapping[str, Any], where: str) -> DecoderShape:
    """bench_e2e's Llama of ``ModelConfig`` (vocab, dim, layers, heads, kv_heads, ffn)."""
    try:
        dim, heads = int(model["dim"]), int(model["heads"])
        return DecoderShape(
            name=f"bench_e2e Llama d{dim} L{model['layers']}",
            hidden_size=dim,
            intermediate_size=int(model["ffn"]),
            num_hidden_layers=int(model["layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(model["kv_heads"]),
            head_dim=dim // heads,
            vocab_size=int(model["vocab"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: model {model!r} is not bench_e2e's ModelConfig.") from error


def model_config_text(text: str) -> dict[str, float]:
    """``"ModelConfig(vocab=50257, dim=768, ...)"`` (profile_host's record) as a dict."""
    return {key: float(value) for key, value in re.findall(r"(\w+)=([0-9.]+)", str(text))}


def measured_ns_ms(path: Path, candidate: str) -> dict[tuple[int, int], float]:
    data = read_result(path)
    table = {
        shape_key(row["shape"]): float(row["median_ms"])
        for row in value_at(data, "results", path)
        if row.get("candidate") == candidate and not row.get("error") and row.get("median_ms")
    }
    if not table:
        raise ValueError(f"{path.name}: no measurements of candidate {candidate!r}.")
    return table


def bench_step_counts(data: Mapping[str, Any], path: Path) -> dict[tuple[int, int], int]:
    """NS shape -> how many matrices, of bench_step's layer stack."""
    layers = int(value_at(data, "num_layers", path))
    counts: dict[tuple[int, int], int] = {}
    for dims in value_at(data, "layer_shapes", path).values():
        key = shape_key(dims)
        counts[key] = counts.get(key, 0) + layers
    return counts


def e2e_workload(inputs: Mapping[str, Any]) -> Workload:
    return Workload(
        seq_len=int(inputs["seq"]),
        micro_batch=int(inputs["micro_batch"]),
        activation_checkpointing=bool(inputs.get("checkpoint", True)),
        param_bytes=4 if "float32" in str(inputs.get("param_dtype")) else 2,
    )


def ran_on_cpu(path: Path) -> bool:
    return device_of(path) == "cpu"


def device_of(path: Path) -> str | None:
    """The ``device`` a result file records (a GPU's name, or "cpu"), or None."""
    data = json.loads(path.read_text())
    device = data.get("device") if isinstance(data, dict) else None
    return device if isinstance(device, str) else None


def overlap_what_if(path: Path) -> str | None:
    """Why an ``overlap_ab.py`` run measured settings the simulator does not model, or None."""
    data = read_result(path)
    chunks = data.get("speculation_chunks", UNRECORDED_SPECULATION_CHUNKS)
    priority = data.get("speculation_stream_priority", 0)
    if (chunks, priority) == (SPECULATION_CHUNKS, 0):
        return None
    return (
        f"run with speculation chunks {chunks}, side-stream priority {priority}; the "
        f"simulator models the defaults ({SPECULATION_CHUNKS} chunks, priority 0)"
    )
