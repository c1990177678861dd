"""torchao's float8 training on dedicated weights: the order it needs, checked at the first
forward.

Owns the refusal of a module swapped after ``dedicate_params`` (torchao's
``convert_to_float8_training`` is the common one). It must not import torchao, change a module or
issue collectives: it only compares the model's modules with the ones dmuon moves weights on.

[Note: float8 training on dedicated weights]
torchao's ``Float8Linear`` reads ``self.weight`` in its forward and casts it to float8 with a
scale computed from that tensor (dynamic scaling, every recipe: tensorwise, rowwise,
rowwise_with_gw_hp). Converted *before* ``dedicate_params``, the module dmuon selects is the
``Float8Linear`` itself, so during forward its ``weight`` is dmuon's unsharded parameter (the
owner's master broadcast in ``param_dtype``) and the cast sees exactly the tensor a single-process
run would: the owner keeps the fp32 master, the forward computes in float8 as torchao does, and
the weight gradient reaches the owner as any other. torchao's option for FSDP2's float8
all-gather (``enable_fsdp_float8_all_gather``) wraps the weight in a tensor subclass that dmuon
adopts as a plain value: the dedicated weights then travel in ``param_dtype`` and are cast per
forward, while the modules FSDP2 shards keep their float8 all-gather. Carrying a dedicated
weight in float8 on the broadcast is not built ([Note: a float8 broadcast]).

[Note: a float8 broadcast]
What it would take, and why it is not built. With the tensorwise recipe the broadcast could carry
the weight in float8 and its one fp32 scale instead of the bf16 weight, at half the bytes, and
stay exact: ``Float8Linear`` passes a weight that already is a ``Float8TrainingTensor`` to its
matmul as it is (``tensor_already_casted_to_fp8``) and uses that same float8 weight for the
forward GEMM and, since ``cast_config_weight_for_grad_input`` is the weight's own tensorwise
cast, for the grad-input GEMM, while the weight gradient never reads the weight. A segment root
that casts the bf16 value of its local segment with torchao's ``hp_tensor_to_float8_dynamic``
(role WEIGHT, the module's ``linear_mm_config`` and config) therefore hands every rank the very
float8 tensor its own cast of the bf16 broadcast would make: checked on the CPU with torchao
0.18, a ``Float8Linear`` given the pre-cast ``Float8TrainingTensor`` as its parameter returns a
bit-equal output, input gradient and (plain, high-precision) weight gradient. FSDP2's
``enable_fsdp_float8_all_gather`` rests on the same property. Rowwise and rowwise_with_gw_hp
cannot: the forward scales the weight per row and the grad-input GEMM per column (or
tensorwise), two casts of the bf16 value that no single float8 tensor serves, so the option would
refuse them at ``dedicate_params`` (torchao itself refuses its float8 all-gather for them).

Building it touches the layout of every module that owns a piece of the path: a segment would
carry a second buffer (the float8 bytes, plus one fp32 scale per parameter) that the non-roots
receive instead of the bf16 one, the root casting into it in ``unshard`` after the last
``refresh_from_masters`` (``dmuon.group``); the unsharded parameter would be an ``nn.Parameter``
over a ``Float8TrainingTensor`` of views of those buffers instead of a view of the bf16 buffer
(``DedicatedParam.bind_unsharded``); the option would come in through ``dedicate_params`` and be
refused with expert stacks, tensor parallelism and any module that is not a tensorwise
``Float8Linear``; and every reader of ``p.unsharded`` as a bf16 value would have to be checked.
The gain is half the broadcast's bytes and nothing else (the forward casts the same either
way): worth it only where a multi-GPU step shows the broadcast not hidden behind compute, which
``benchmarks/e2e/bench_float8.py`` (one GPU, nothing broadcast) cannot tell; measure that first.

Converted *after* ``dedicate_params``, ``convert_to_float8_training`` builds a new module that
takes over the old one's 0-element placeholder, while dmuon's hooks keep moving the weight on the
old module, now outside the model: the new module would compute with no weight. The first forward
refuses that here, naming the parameter, the new module's type and the fix.
"""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from dmuon.param import DedicatedParam

MODULE_SWAPPED_ERROR = (
    "dmuon.dedicate_params selected {fqn!r} on a {old} that is no longer part of the model: "
    "{replaced}. dmuon moves that weight on the module dedicate_params saw, so {new_module} "
    "would compute with the 0-element placeholder instead of the weight. {fix}"
)
FLOAT8_FIX = (
    "Convert before dmuon.dedicate_params: torchao.float8.convert_to_float8_training(model, "
    "...), then dmuon.dedicate_params, then fully_shard (torchtitan's model converters run "
    "before parallelize in the same order)."
)
SWAP_FIX = "Replace or wrap modules before dmuon.dedicate_params, then dedicate and shard."


def refuse_modules_swapped_later(model: nn.Module, params: dict[str, DedicatedParam]) -> None:
    """Register a forward pre-hook on ``model`` that, at the first forward, raises
    ``MODULE_SWAPPED_ERROR`` if a dedicated parameter's module was replaced since
    ``dedicate_params`` ([Note: float8 training on dedicated weights]); it removes itself once
    the check passed."""
    handle: RemovableHandle | None = None

    def check_once(module: nn.Module, args: tuple) -> None:
        check_modules_in_place(model, params)
        handle.remove()

    handle = model.register_forward_pre_hook(check_once)


def check_modules_in_place(model: nn.Module, params: dict[str, DedicatedParam]) -> None:
    in_model = {id(module) for module in model.modules()}
    for p in params.values():
        if id(p.module) in in_model:
            continue
        path, new = _holder_of_placeholder(model, p)
        old = type(p.module).__name__
        if new is None:
            replaced = "it was removed and no module of the model holds its placeholder"
            new_module = "the model"
        else:
            replaced = f"{path or '<root>'} is now a {type(new).__module__}.{type(new).__name__}"
            new_module = f"that {type(new).__name__}"
        is_float8 = new is not None and type(new).__module__.startswith("torchao.float8")
        raise RuntimeError(
            MODULE_SWAPPED_ERROR.format(
                fqn=p.fqn,
                old=old,
                replaced=replaced,
                new_module=new_module,
                fix=FLOAT8_FIX if is_float8 else SWAP_FIX,
            )
        )


def _holder_of_placeholder(model: nn.Module, p: DedicatedParam) -> tuple[str, nn.Module | None]:
    """The module (and its path) that now holds ``p``'s placeholder, if any."""
    for path, module in model.named_modules():
        if module._parameters.get(p.attr) is p.placeholder:
            return path, module
    return "", None
