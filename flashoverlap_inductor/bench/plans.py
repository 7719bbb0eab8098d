"""Parallel plans of the end-to-end benchmark, applied with DTensor ``parallelize_module`` over one 1-D mesh.

* ``tp``: Megatron tensor parallelism. ``ColwiseParallel`` on q/k/v and gate/up, ``RowwiseParallel`` on o and down:
  forward, one all_reduce per row-parallel output (2 per layer); backward, one all_reduce per column-parallel input
  gradient (5 per layer). Activations between layers are replicated.
* ``sp``: tensor + sequence parallelism as torchtitan applies it. Norms are ``SequenceParallel`` (activations
  sharded along the sequence, dim 1); ``PrepareModuleInput`` on the attention and the MLP all-gathers their input
  once (kept as a DTensor, ``use_local_output=False``, so q/k/v share one all_gather); o and down are
  ``RowwiseParallel(output_layouts=Shard(1))``: a reduce_scatter each. Backward: a reduce_scatter of the summed
  input gradients of q/k/v (and of gate/up), and all_gathers.
* ``ep`` (MoE models): the attention as in ``sp``; every sparse-MoE block replaced by ``moe.ExpertParallelMoE``
  (experts sharded over the ranks, all_to_all dispatch and combine of this rank's sequence shard).

Gemma 3's layers norm each sublayer's input and output (``pre_feedforward_layernorm`` before the MLP,
``post_attention_layernorm`` / ``post_feedforward_layernorm`` on the attention's and the MLP's outputs before the
residual add): under ``sp`` all four are ``SequenceParallel``, the two output norms handing plain tensors to the add;
under ``tp`` they stay replicated.

Parameters that act on this rank's heads but are replicated (Qwen3's and Gemma 3's per-head ``q_norm`` / ``k_norm``)
get their gradient summed over the group (a parametrization, ``moe.AllReduceGrad``), else the ranks' copies would
drift apart.

Everywhere: the embedding, the final norm and ``lm_head`` stay replicated (every rank holds them whole). Under
``sp`` / ``ep`` the embedding output is cut to this rank's sequence shard at the first layer's input (a local
slice; its backward all-gathers the gradient, so the embedding's gradient is whole on every rank), and the last
layer's output is all-gathered at the final norm's input. The 1-D mesh spans the whole world.
"""

from __future__ import annotations

from torch import nn

from .models import ModelSpec

PLANS = ("tp", "sp", "ep")
ASYNC_TP_PLANS = ("sp", "ep")  # plans with all_gather -> matmul and matmul -> reduce_scatter for async-TP


def check(spec: ModelSpec, plan: str, world: int, seqs: list[int]) -> str | None:
    """Why ``plan`` cannot shard ``spec`` over ``world`` ranks at these sequence lengths (one line), or None."""
    if plan not in PLANS:
        return f"unknown plan {plan!r} (choose from {', '.join(PLANS)})"
    if plan == "ep" and not spec.moe:
        return f"plan ep needs a MoE model; {spec.name} is dense (use tp or sp)"
    if plan in ("tp", "sp") and spec.moe:
        return f"plan {plan} shards dense MLPs; {spec.name} is a MoE model (use ep)"
    for what, n in (("attention heads", spec.heads), ("kv heads", spec.kv_heads)):
        if n % world:
            return (f"{what} ({n}) of {spec.name} do not divide by the world size {world} "
                    "(override with --heads/--kv-heads)")
    if spec.heads % spec.kv_heads:
        return f"attention heads ({spec.heads}) must be a multiple of kv heads ({spec.kv_heads})"
    if not spec.moe and spec.intermediate % world:
        return f"intermediate size {spec.intermediate} does not divide by the world size {world}"
    if spec.moe and spec.experts % world:
        return f"{spec.experts} experts do not divide by the world size {world} (override with --experts)"
    if spec.moe and not 0 < spec.top_k <= spec.experts:
        return f"top-k {spec.top_k} must be in 1..{spec.experts}"
    if plan in ("sp", "ep"):
        bad = [s for s in seqs if s % world]
        if bad:
            return f"plan {plan} shards the sequence: sequence lengths {bad} do not divide by the world size {world}"
    return None


def apply(model: nn.Module, spec: ModelSpec, plan: str, mesh, expert_gemm: str = "auto") -> nn.Module:
    """``model`` (a HF ``*ForCausalLM``, identical on every rank) parallelized in place by ``plan``."""
    from torch.distributed.tensor.parallel import parallelize_module

    layers = model.model.layers
    if plan == "ep":
        from .moe import replace_moe_blocks

        replace_moe_blocks(model, mesh.get_group(), expert_gemm)
    styles = {}
    for i, layer in enumerate(layers):
        _sum_head_param_grads(layer.self_attn, mesh.get_group().group_name)
        styles.update({f"model.layers.{i}.{k}": v for k, v in _layer_plan(plan, layer).items()})
    if plan in ("sp", "ep"):
        styles.update(_sequence_edges(len(layers)))
    return parallelize_module(model, mesh, styles)


HEAD_PARAMS = ("q_norm", "k_norm")  # replicated modules applied per head, inside the attention


def _sum_head_param_grads(attn: nn.Module, group_name: str) -> None:
    from torch.nn.utils import parametrize

    from .moe import AllReduceGrad

    for name in HEAD_PARAMS:
        sub = getattr(attn, name, None)
        for pname, _ in list(sub.named_parameters(recurse=False)) if sub is not None else ():
            parametrize.register_parametrization(sub, pname, AllReduceGrad(group_name))


def _layer_plan(plan: str, layer: nn.Module) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    if plan == "tp":
        out = {name: ColwiseParallel() for name in (*attn, "mlp.gate_proj", "mlp.up_proj")}
        out.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        return out
    out = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        **{name: ColwiseParallel() for name in attn},
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    if plan == "ep":  # the MoE block takes this rank's tokens as a plain tensor
        out["post_attention_layernorm"] = SequenceParallel(use_local_output=True)
        return out
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: the norms around each sublayer (module docstring)
        out.update({"post_attention_layernorm": SequenceParallel(use_local_output=True),
                    "pre_feedforward_layernorm": SequenceParallel(),
                    "post_feedforward_layernorm": SequenceParallel(use_local_output=True)})
    else:
        out["post_attention_layernorm"] = SequenceParallel()
    out.update({
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    })
    return out


def _sequence_edges(n_layers: int) -> dict:
    """Into and out of the sequence-sharded region: the replicated embedding output becomes this rank's shard at
    the first layer's input (a slice); the final norm runs on the shards (as torchtitan's plan does) and its
    output is all-gathered at ``lm_head``'s input (so the gather feeds the GEMM)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    return {
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True),
        "model.norm": SequenceParallel(use_local_output=False),
        "lm_head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
    }
