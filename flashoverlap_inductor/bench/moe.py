"""An expert-parallel MoE block built from a HuggingFace sparse-MoE block (Qwen3-MoE or Mixtral).

Each rank of the group holds ``experts / world`` consecutive experts and sees its own tokens (the ``ep`` plan
shards the sequence, see ``plans.py``). Per forward, on ``T`` local tokens of width ``H``, top-``k`` routing:

1. router: ``softmax(x @ Wr.T)`` in fp32, top-k, renormalized when the model says so (Mixtral always, Qwen3-MoE
   with ``norm_topk_prob``); the router weight is replicated and its gradient summed over the group
   (``_AllReduceGrad``: each rank routes different tokens);
2. dispatch: the ``T * k`` (token, slot) pairs sorted by expert (so by destination rank), one
   ``all_to_all_single`` of the per-expert counts, the send / receive split sizes read on the host
   (``.tolist()``: one device sync; under ``torch.compile`` unbacked SymInts, which needs
   ``torch._dynamo.config.capture_scalar_outputs``), then ``all_to_all_single_autograd`` of the rows: dropless, no
   capacity factor, no padding;
3. experts: the received rows grouped by local expert (a stable sort; skipped when a rank holds one expert), then
   per expert ``silu(x @ Wg.T) * (x @ Wu.T) @ Wd.T``, as a loop of ``mm`` or one ``torch._grouped_mm`` per
   projection (``gemm="grouped"``: bf16 only);
4. combine: the rows put back in arrival order (``index_copy``; none with one local expert), the inverse
   ``all_to_all_single_autograd``, then the routing weights applied and the k slots summed per token
   (``index_add``) on the token's own rank.

The weights are applied after the combine (HF applies them inside each expert), which is the same sum; it keeps
the down-projection GEMM directly in front of the combine all_to_all when a rank holds one expert, the case the
FlashOverlap pass can fuse. With several local experts the un-permutation (``index_copy``, an ``index_put`` in the
post-grad graph) stands between them; ``coverage.py`` reports it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

EXPERT_GEMMS = ("auto", "loop", "grouped")


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; the gradient is summed over the group (a replicated weight applied to per-rank tokens)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_reduce(grad, "sum", ctx.group_name), None


class AllReduceGrad(nn.Module):
    """A parametrization (``torch.nn.utils.parametrize``) that sums the parameter's gradient over the group."""

    def __init__(self, group_name: str) -> None:
        super().__init__()
        self.group_name = group_name

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return _AllReduceGrad.apply(w, self.group_name)


def hf_moe_weights(block: nn.Module) -> dict:
    """Router and expert weights of a HF sparse-MoE block, as ``{"router" [E, H], "gate_up" [E, 2I, H],
    "down" [E, H, I], "top_k", "normalize", "act"}``. Handles the fused 3-D expert layout of transformers 5
    (``experts.gate_up_proj`` / ``experts.down_proj``) and the per-expert module lists of transformers 4
    (Qwen3-MoE ``gate_proj/up_proj/down_proj``, Mixtral ``w1/w3/w2``)."""
    gate, experts = block.gate, block.experts
    router = gate.weight
    top_k = getattr(gate, "top_k", None) or block.top_k
    if hasattr(gate, "norm_topk_prob"):
        normalize = bool(gate.norm_topk_prob)
    elif hasattr(block, "norm_topk_prob"):
        normalize = bool(block.norm_topk_prob)
    else:
        normalize = True  # Mixtral renormalizes the top-k probabilities
    if hasattr(experts, "gate_up_proj"):
        gate_up, down, act = experts.gate_up_proj, experts.down_proj, experts.act_fn
    else:
        first = experts[0]
        if hasattr(first, "w1"):
            g, u, d = ([getattr(e, n).weight for e in experts] for n in ("w1", "w3", "w2"))
        else:
            g, u, d = ([getattr(e, n).weight for e in experts] for n in ("gate_proj", "up_proj", "down_proj"))
        gate_up = torch.stack([torch.cat([a, b]) for a, b in zip(g, u)])
        down = torch.stack(d)
        act = first.act_fn
    return {"router": router, "gate_up": gate_up, "down": down, "top_k": int(top_k), "normalize": normalize,
            "act": act}


class ExpertParallelMoE(nn.Module):
    """A drop-in replacement for a HF sparse-MoE block on one rank of ``group`` (see the module docstring).
    Input and output: this rank's tokens ``[batch, seq_local, hidden]``."""

    def __init__(self, block: nn.Module, group: dist.ProcessGroup, gemm: str = "auto") -> None:
        super().__init__()
        if gemm not in EXPERT_GEMMS:
            raise ValueError(f"gemm must be one of {EXPERT_GEMMS}, not {gemm!r}")
        w = hf_moe_weights(block)
        self.world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group_name = group.group_name  # a name, not the group: the module must deep-copy
        self.experts = w["router"].shape[0]
        if self.experts % self.world:
            raise ValueError(f"{self.experts} experts do not divide by the expert-parallel group of {self.world}")
        self.local = self.experts // self.world
        self.top_k, self.normalize, self.act = w["top_k"], w["normalize"], w["act"]
        lo, hi = rank * self.local, (rank + 1) * self.local
        self.router = nn.Parameter(w["router"].detach().clone())
        self.gate_up = nn.Parameter(w["gate_up"].detach()[lo:hi].clone())  # [E_local, 2I, H]
        self.down = nn.Parameter(w["down"].detach()[lo:hi].clone())  # [E_local, H, I]
        if gemm == "auto":
            gemm = "grouped" if self._grouped_ok() else "loop"
        self.gemm = gemm

    def _grouped_ok(self) -> bool:
        return (self.local > 1 and hasattr(torch, "_grouped_mm") and self.gate_up.is_cuda
                and self.gate_up.dtype == torch.bfloat16)

    def extra_repr(self) -> str:
        return (f"experts={self.experts}, local={self.local}, top_k={self.top_k}, world={self.world}, "
                f"gemm={self.gemm}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        # 1. routing
        logits = F.linear(tokens, _AllReduceGrad.apply(self.router, self.group_name))
        probs = logits.float().softmax(-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        # 2. dispatch: (token, slot) pairs sorted by expert; counts exchanged, then the rows
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        source = order // self.top_k  # the token of each sorted pair
        counts = torch.zeros(self.experts, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))
        each = [self.local] * self.world
        recv_counts = funcol.all_to_all_single(counts, each, each, self.group_name)
        send = counts.view(self.world, self.local).sum(1).tolist()
        recv_counts = recv_counts.view(self.world, self.local)
        recv = recv_counts.sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(tokens[source], recv, send, self.group_name)
        # 3. experts (rows arrive ordered by source rank, then local expert)
        if self.local == 1:
            gate, up = (rows @ self.gate_up[0].t()).chunk(2, dim=-1)
            out = (self.act(gate) * up) @ self.down[0].t()
        else:
            expert_of_row = torch.repeat_interleave(torch.arange(self.local, device=x.device).repeat(self.world),
                                                    recv_counts.flatten(), output_size=rows.shape[0])
            perm = expert_of_row.argsort(stable=True)
            grouped = self._experts(rows[perm], recv_counts.sum(0))
            out = torch.empty_like(grouped).index_copy(0, perm, grouped)
        # 4. combine, then weight and sum the k slots of each token on its own rank
        back = funcol.all_to_all_single_autograd(out, send, recv, self.group_name)
        y = torch.zeros_like(tokens).index_add(0, source, back * weights.flatten()[order].unsqueeze(-1))
        return y.view(shape)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``rows`` grouped by local expert (``counts[e]`` rows each) through the experts' gated MLPs."""
        if self.gemm == "grouped":
            offs = counts.cumsum(0).to(torch.int32)
            gate, up = torch._grouped_mm(rows, self.gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            return torch._grouped_mm(self.act(gate) * up, self.down.transpose(-2, -1), offs=offs)
        outs = []
        for e, seg in enumerate(rows.split(counts.tolist())):
            gate, up = (seg @ self.gate_up[e].t()).chunk(2, dim=-1)
            outs.append((self.act(gate) * up) @ self.down[e].t())
        return torch.cat(outs)


def replace_moe_blocks(model: nn.Module, group: dist.ProcessGroup, gemm: str = "auto") -> int:
    """Replace every HF sparse-MoE ``mlp`` of ``model``'s decoder layers by an ``ExpertParallelMoE`` holding this
    rank's experts; returns how many were replaced."""
    n = 0
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate"):
            layer.mlp = ExpertParallelMoE(layer.mlp, group, gemm)
            n += 1
    return n
