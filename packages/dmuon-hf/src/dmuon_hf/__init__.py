"""dmuon-hf: HuggingFace integration for dmuon.

- ``default_predicate(model)`` / ``PREDICATES``: which parameters ``dmuon.dedicate_params``
  gives to Muon, per ``config.model_type``.
- ``DMuonTrainer``: ``transformers.Trainer`` that shards a plain model from
  ``TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2, ...})`` with dmuon, or trains a
  dedicated + ``fully_shard``-ed model as it is (no DDP/FSDP re-wrap).
- ``qk_clip_hf(model, optimizer, threshold=100.0)``: MuonClip's QK-clip (``dmuon.QKClip``) on
  every attention layer of a Llama / Qwen2 / Qwen3 / DeepSeek-V3 (MLA) model, observed through
  its attention implementation.
- ``DMuonAccelerator``: Accelerate's ``Accelerator`` for the same without the Trainer
  (``prepare``, ``clip_grad_norm_``, ``save_state``/``load_state``).

Modules: ``predicates`` -> ``sharding`` (the FSDP2 plugin applied with dmuon) -> ``trainer``,
``accelerator``; ``qk_clip`` apart.
"""

from dmuon_hf.accelerator import DMuonAccelerator
from dmuon_hf.predicates import PREDICATES, Predicate, ProjectionPredicate, default_predicate
from dmuon_hf.qk_clip import qk_clip_hf
from dmuon_hf.trainer import DMuonTrainer

__version__ = "0.1.0"

__all__ = [
    "PREDICATES",
    "DMuonAccelerator",
    "DMuonTrainer",
    "Predicate",
    "ProjectionPredicate",
    "__version__",
    "default_predicate",
    "qk_clip_hf",
]
