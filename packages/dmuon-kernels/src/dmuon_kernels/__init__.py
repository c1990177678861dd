"""dmuon-kernels: Newton-Schulz orthogonalisation and symmetric (SYRK) kernels.

Numbers in, numbers out: nothing here knows about torch.distributed or models, so any optimizer
can use it alone (``pip install dmuon-kernels``).
"""

from dmuon_kernels._torch_support import require_torch

require_torch("dmuon-kernels")

__version__ = "0.1.0"
