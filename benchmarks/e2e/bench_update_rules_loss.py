"""Loss curves of the opt-in update rules on the tiny decoder, on CPU: do they keep quality?

Trains ``dmuon.testing.TinyDecoder`` (3 layers, d_model 30) with ``dmuon.Muon`` in one process
(``dedicate_params(model, None, ...)``: every matrix owned here, the update exactly the
distributed one's) for ``--steps`` steps per variant, every variant from the same initial
weights and on the same batches, for each of ``--seeds`` seeds (initialisation and data):

- ``muon``: the default (fp32 momentum), the baseline;
- ``muon+bf16m``: ``momentum_dtype=torch.bfloat16``; ``muon+int8m``: ``torch.int8``;
- ``normuon``: ``normuon=True``; ``normuon+bf16m``: both;
- ``muon+heads``: ``row_blocks``: each q_proj (30 x 30) orthogonalised as 5 heads of 6 rows.

The data is learnable: token sequences of a fixed sparse Markov chain (each token has
``SUCCESSORS`` likely successors), so the loss falls from log(VOCAB) towards the chain's entropy
and a worse optimizer shows. Reported per variant: the mean over the last ``TAIL`` steps of the
loss (and over steps ``EARLY``, while it still falls fast), averaged over seeds, its difference
from the baseline, and the baseline's seed-to-seed
spread (what a difference must exceed to mean anything); the optimizer's Muon state bytes.

Usage (repository root)::

    python benchmarks/e2e/bench_update_rules_loss.py             # 200 steps x 3 seeds, ~1 min
    python benchmarks/e2e/bench_update_rules_loss.py --steps 20 --seeds 1 --out /tmp/x.json

Writes JSON (default ``benchmarks/results/update-rules-loss-cpu-<date>.json``) with the inputs,
versions, git sha and every loss.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

# The repository root, where `benchmarks` is a package: see benchmarks/README.md.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _common

_common.add_package_sources_if_missing()  # before dmuon is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dmuon  # noqa: E402
from dmuon.testing import VOCAB, TinyDecoder, proj_predicate  # noqa: E402

VARIANTS = {
    "muon": {},
    "muon+bf16m": {"momentum_dtype": torch.bfloat16},
    "muon+int8m": {"momentum_dtype": torch.int8},
    "normuon": {"normuon": True},
    "normuon+bf16m": {"normuon": True, "momentum_dtype": torch.bfloat16},
    "muon+heads": {"row_blocks": {"layers.*.q_proj.weight": 6}},
}
BASELINE = "muon"
SUCCESSORS = 3  # likely next tokens per token in the Markov chain
BATCH, SEQ = 16, 33
TAIL = 20  # steps averaged for the final loss
EARLY = (20, 40)  # steps [start, stop) averaged for the early loss, where optimizers differ most
LR, ADAMW_LR, WEIGHT_DECAY = 0.02, 3e-3, 0.01


def markov_batches(steps: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches (BATCH, SEQ) of a fixed sparse random Markov chain over VOCAB tokens."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.stack(
        [torch.randperm(VOCAB, generator=generator)[:SUCCESSORS] for _ in range(VOCAB)]
    )
    weights = torch.tensor([0.6, 0.3, 0.1])[:SUCCESSORS]
    batches = []
    for _ in range(steps):
        tokens = torch.empty(BATCH, SEQ, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=generator)
        for t in range(1, SEQ):
            choice = torch.multinomial(weights.expand(BATCH, -1), 1, generator=generator)[:, 0]
            tokens[:, t] = successors[tokens[:, t - 1], choice]
        batches.append(tokens)
    return batches


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def muon_state_bytes(optimizer: dmuon.Muon) -> int:
    return sum(
        t.numel() * t.element_size()
        for group in optimizer.param_groups
        if group["route"] == "muon"
        for p in group["params"]
        for t in optimizer.state[p].values()
    )


def train(variant: str, seed: int, batches: list[torch.Tensor]) -> dict:
    options = dict(VARIANTS[variant])
    row_blocks = options.pop("row_blocks", None)
    torch.manual_seed(seed)
    model = TinyDecoder()
    dmuon.dedicate_params(model, None, proj_predicate, row_blocks=row_blocks)
    optimizer = dmuon.Muon(model, lr=LR, adamw_lr=ADAMW_LR, weight_decay=WEIGHT_DECAY, **options)
    losses = []
    for tokens in batches:
        loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "muon_state_bytes": muon_state_bytes(optimizer)}


def main(argv: list[str] | None = None) -> int:
    _common.compile_kernels_first()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    _common.add_record_options(
        parser, "default: benchmarks/results/update-rules-loss-cpu-<date>.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)  # dmuon's routing lines (INFO) not per variant
    runs: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    started = time.perf_counter()
    for seed in range(args.seeds):
        batches = markov_batches(args.steps, seed=1000 + seed)
        for variant in VARIANTS:
            runs[variant].append(train(variant, seed, batches))
    seconds = time.perf_counter() - started
    tail = min(TAIL, args.steps)
    final = {
        variant: [statistics.fmean(run["losses"][-tail:]) for run in per_seed]
        for variant, per_seed in runs.items()
    }
    start, stop = EARLY
    early = {
        variant: statistics.fmean(
            statistics.fmean(run["losses"][start:stop] or run["losses"]) for run in per_seed
        )
        for variant, per_seed in runs.items()
    }
    baseline = statistics.fmean(final[BASELINE])
    spread = max(final[BASELINE]) - min(final[BASELINE])
    summary = {}
    print(
        f"tiny decoder, {args.steps} steps x {args.seeds} seeds on CPU ({seconds:.0f} s); early / "
        f"final loss = mean of steps [{start}, {stop}) / of the last {tail}, averaged over seeds; "
        "log(VOCAB) = "
        f"{torch.log(torch.tensor(float(VOCAB))).item():.3f}"
    )
    print(
        f"{'variant':<15} {'early loss':>10} {'vs muon':>9} {'final loss':>10} {'vs muon':>9} "
        f"{'final per seed':>26} {'Muon state B':>13}"
    )
    for variant, values in final.items():
        mean = statistics.fmean(values)
        per_seed = " ".join(f"{v:.4f}" for v in values)
        state = runs[variant][0]["muon_state_bytes"]
        early_delta = early[variant] - early[BASELINE]
        print(
            f"{variant:<15} {early[variant]:>10.4f} {early_delta:>+9.4f} {mean:>10.4f} "
            f"{mean - baseline:>+9.4f} {per_seed:>26} {state:>13}"
        )
        summary[variant] = {
            "final_loss_mean": mean,
            "final_loss_per_seed": values,
            "difference_from_baseline": mean - baseline,
            "early_loss_mean": early[variant],
            "early_difference_from_baseline": early[variant] - early[BASELINE],
            "muon_state_bytes": state,
        }
    print(f"baseline seed-to-seed spread (max - min of the final loss): {spread:.4f}")
    date = _common.utc_now()
    record = {
        "benchmark": "bench_update_rules_loss",
        "inputs": {
            "model": "dmuon.testing.TinyDecoder()",
            "steps": args.steps,
            "seeds": args.seeds,
            "batch": BATCH,
            "seq": SEQ,
            "data": f"sparse Markov chain, {SUCCESSORS} successors per token",
            "lr": LR,
            "adamw_lr": ADAMW_LR,
            "weight_decay": WEIGHT_DECAY,
            "variants": {name: repr(options) for name, options in VARIANTS.items()},
            "tail": tail,
            "early_steps": list(EARLY),
        },
        "device": "cpu",
        **_common.versions(dmuon=dmuon.__version__),
        "git_sha": _common.git_sha(args.git_sha),
        "date": _common.iso_seconds(date),
        "seconds": seconds,
        "baseline_seed_spread": spread,
        "summary": summary,
        "losses": {
            variant: [run["losses"] for run in per_seed] for variant, per_seed in runs.items()
        },
    }
    out = args.out or _common.result_path("update-rules-loss", "cpu", date)
    _common.write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
