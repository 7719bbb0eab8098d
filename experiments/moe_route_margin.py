"""qwen3-moe as e2e builds it (2 layers, seed 0, bf16, CPU, unsharded HF model), e2e's prefill input at seq 4096:
the last token's top-8 routing margin per layer, and the last-position logits' change when each MoE block's output
is perturbed by bf16-rounding-sized noise (as a sum of 8 bf16 rows in another order would be).

Fiftieth session, on the CPU (2 cores, ~250 s per forward): ``python3 experiments/moe_route_margin.py 4096 1``.
Whether rounding noise could flip the last token's routing and explain the e2e ``ep`` rows' 1.4e-1 glitch
(``docs/design.md``): it does not (6.0e-3, margins held; ``docs/results.md``, fiftieth session)."""
import dataclasses
import sys
import time

import torch

from flashoverlap_inductor.bench import models

seq = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
draws = int(sys.argv[2]) if len(sys.argv) > 2 else 4
torch.set_num_threads(2)
spec = dataclasses.replace(models.PRESETS["qwen3-moe"], layers=2)
model = models.build(spec, torch.device("cpu"), torch.bfloat16, 0, seq).eval()
gen = torch.Generator().manual_seed(0 * 1000003 + seq)
ids = torch.randint(0, spec.vocab, (1, seq), generator=gen)
margins, noise = {}, {"scale": 0.0, "gen": None}


def router_hook(i):
    def hook(mod, inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        p = logits.float().softmax(-1)[-1]  # the last token (its own row)
        top = p.sort(descending=True).values
        margins.setdefault(i, []).append((float(top[7]), float(top[8])))
    return hook


def moe_hook(mod, inp, out):
    if not noise["scale"]:
        return out
    y = out[0] if isinstance(out, tuple) else out
    z = y * (1 + noise["scale"] * (torch.rand(y.shape, generator=noise["gen"]) * 2 - 1)).to(y.dtype)
    return (z, *out[1:]) if isinstance(out, tuple) else z


for i, layer in enumerate(model.model.layers):
    layer.mlp.gate.register_forward_hook(router_hook(i))
    layer.mlp.register_forward_hook(moe_hook)


def last_logits():
    t0 = time.time()
    with torch.no_grad():
        out = model(ids).logits[0, -1].double()
    print(f"  forward {time.time() - t0:.0f} s", flush=True)
    return out


ref = last_logits()
print("last token p8 / p9 per layer:", {i: m[-1] for i, m in margins.items()}, flush=True)
for d in range(draws):
    noise["scale"], noise["gen"] = 2.0 ** -8, torch.Generator().manual_seed(d + 1)
    got = last_logits()
    err = float((got - ref).norm() / ref.norm())
    print(f"draw {d}: rel err {err:.3g}; p8 / p9 {[m[-1] for m in margins.values()]}", flush=True)
