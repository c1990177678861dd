"""dmuon_titan: distributed Muon in torchtitan, behind one switch.

On the command line, run torchtitan's own job configs with dmuon by naming this module instead
of the model's::

    torchrun --nproc-per-node 8 -m torchtitan.train --module dmuon_titan --config llama3_8b \\
        --dmuon.lr 0.02

In Python, ``dmuon_titan.enable(config)`` turns a torchtitan ``Trainer.Config`` into one whose
``build()`` gives a ``DMuonTrainer``. The Muon matrices of the transformer blocks get one owner
rank each (``dmuon.dedicate_params`` before the first ``fully_shard``), the rest keeps the job's
AdamW settings, and the train step clips with ``dmuon.clip_grad_norm_``.

``qk_clip_titan(model_part, optimizer)``: MuonClip's QK-clip (``dmuon.QKClip``) on the
multi-head latent attention of torchtitan's DeepSeek-V3 / Kimi K2 models, as the Kimi K2 report
clips MLA; ``mla_attention_heads(model_part)`` is its description alone (``dmuon.MLAHeads``).
"""

from dmuon_titan.config import DMuonConfig
from dmuon_titan.optimizer import DMuonOptimizers
from dmuon_titan.qk_clip import mla_attention_heads, qk_clip_titan
from dmuon_titan.trainer import DMuonTrainer, enable

__version__ = "0.1.0"

__all__ = [
    "DMuonConfig",
    "DMuonOptimizers",
    "DMuonTrainer",
    "__version__",
    "enable",
    "mla_attention_heads",
    "qk_clip_titan",
]
