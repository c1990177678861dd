"""The test oracle, a plain single-process Muon + AdamW: ``dmuon.testing.ReferenceMuonAdamW``
(its module docstring gives the update rules), under the name the test modules import it by.

Its one copy lives in dmuon-core's ``dmuon.testing`` so the benchmarks share it without importing
the test suite; change it there.
"""

from dmuon.testing import MUON_RMS_MATCHING_FACTOR, ReferenceMuonAdamW, hf_no_decay

__all__ = ["MUON_RMS_MATCHING_FACTOR", "ReferenceMuonAdamW", "hf_no_decay"]
