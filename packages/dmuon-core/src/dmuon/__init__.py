"""dmuon: distributed Muon for PyTorch FSDP2.

Each Muon matrix gets one owner rank. The owner broadcasts the weight in forward, receives the
averaged gradient in backward, and alone runs momentum + Newton-Schulz + update.
"""

from dmuon_kernels._torch_support import require_torch

require_torch("dmuon-core")

__version__ = "0.1.0"
