"""dmuon-hf: HuggingFace integration for dmuon.

- ``default_predicate(model)`` / ``PREDICATES``: which parameters ``dmuon.dedicate_params``
  gives to Muon, per ``config.model_type``.
- ``DMuonTrainer``: ``transformers.Trainer`` that trains a dedicated + ``fully_shard``-ed model
  as it is (no DDP/FSDP re-wrap), with ``optimizers=(dmuon.Muon(model, ...), scheduler)``.
"""

from dmuon_hf.predicates import PREDICATES, Predicate, ProjectionPredicate, default_predicate
from dmuon_hf.trainer import DMuonTrainer

__version__ = "0.1.0"

__all__ = [
    "PREDICATES",
    "DMuonTrainer",
    "Predicate",
    "ProjectionPredicate",
    "__version__",
    "default_predicate",
]
