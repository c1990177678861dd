"""dmuon-kernels: Newton-Schulz orthogonalisation and symmetric (SYRK) kernels.

Numbers in, numbers out: nothing here knows about torch.distributed or models, so any optimizer
can use it alone (``pip install ./packages/dmuon-kernels`` from a checkout; ``pip install
dmuon-kernels`` once it is on PyPI).
"""

from dmuon_kernels._torch_support import require_torch

require_torch("dmuon-kernels")

__version__ = "0.1.0"

from dmuon_kernels._log import log_rank_tagged  # noqa: E402
from dmuon_kernels.coefficients import (  # noqa: E402
    KELLER_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    YOU_COEFFICIENTS,
)
from dmuon_kernels.newton_schulz import NewtonSchulz, NSConfig, newton_schulz  # noqa: E402
from dmuon_kernels.status import get_backend_status, get_ns_backend  # noqa: E402

# Bound last on purpose: the package attribute ``syrk`` is the function (import names from the
# ``dmuon_kernels.syrk`` module with ``from dmuon_kernels.syrk import ...``).
from dmuon_kernels.syrk import syrk  # noqa: E402

__all__ = [
    "KELLER_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "YOU_COEFFICIENTS",
    "NSConfig",
    "NewtonSchulz",
    "__version__",
    "get_backend_status",
    "get_ns_backend",
    "log_rank_tagged",
    "newton_schulz",
    "syrk",
]
