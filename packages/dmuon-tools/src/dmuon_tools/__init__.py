"""dmuon-tools: diagnostics, plots and a partition planner for dmuon.

Rank-local summaries of a model prepared with ``dmuon.dedicate_params`` (no collectives; plain
JSON), also reachable as ``dmuon.summarize_param_groups`` etc.::

    import json, dmuon
    print(json.dumps(dmuon.summarize_param_groups(model, optimizer), indent=2))
    print(json.dumps(dmuon.summarize_comm_plan(model), indent=2))
    profile = dmuon.collect_forward_unshard_profile(model, synchronize=True)

Plots (``pip install dmuon-tools[plots]``) are in ``dmuon_tools.plots``; the ``dmuon-tools``
command prints the NS backend (``dmuon-tools backend``), plans partitions for model configs at
any world size (``dmuon-tools plan --config llama3-70b --mesh 8x16``) and predicts a training
step of FSDP2 + AdamW, dmuon and naive Muon on a layout (``dmuon-tools simulate --config
llama3-8b --gpus 64``; ``dmuon_tools.simulator.simulate``).
"""

__version__ = "0.1.0"

from dmuon_tools.comm_plan import summarize_comm_plan
from dmuon_tools.forward_profile import collect_forward_unshard_profile
from dmuon_tools.param_groups import summarize_param_groups
from dmuon_tools.routing import format_routing_table, print_routing

__all__ = [
    "__version__",
    "collect_forward_unshard_profile",
    "format_routing_table",
    "print_routing",
    "summarize_comm_plan",
    "summarize_param_groups",
]
