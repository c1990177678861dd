"""dmuon-hf: HuggingFace integration for dmuon.

- ``default_predicate(model)`` / ``PREDICATES``: which parameters ``dmuon.dedicate_params``
  gives to Muon, per ``config.model_type``.
"""

from dmuon_hf.predicates import PREDICATES, Predicate, ProjectionPredicate, default_predicate

__version__ = "0.1.0"

__all__ = ["PREDICATES", "Predicate", "ProjectionPredicate", "__version__", "default_predicate"]
