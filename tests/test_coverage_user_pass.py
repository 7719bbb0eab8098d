"""``model_coverage`` records the graphs in Inductor's ``post_grad_custom_post_pass`` without taking that slot from
the user: a pass set there (Inductor's config or the call's ``options``) still runs on every graph, right after the
recording. CPU, one process, no collective (the recording works on any graph)."""

from __future__ import annotations

import pytest
import torch

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import model_coverage


def _model_and_input() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)), torch.randn(4, 16)


@pytest.mark.parametrize("where", ["inductor_config", "options"])
def test_a_users_post_grad_pass_still_runs_under_model_coverage(where):
    seen: list[int] = []

    def user_pass(graph: torch.fx.Graph) -> None:
        seen.append(sum(1 for n in graph.nodes if n.op == "call_function"))

    torch._dynamo.reset()
    model, x = _model_and_input()
    if where == "options":
        cov = model_coverage(model, x, options={compat.POST_PASS_KEY: user_pass})
    else:
        with compat.inductor_config().patch({compat.POST_PASS_KEY: user_pass}):
            cov = model_coverage(model, x)
    assert set(cov.graphs) == {"forward", "backward"}, cov.graphs  # the recording ran on both graphs
    assert len(seen) == 2 and all(seen), seen  # and so did the user's pass, once per graph
    assert getattr(compat.inductor_config(), compat.POST_PASS_KEY) is None  # model_coverage never sets it globally


def test_without_a_users_pass_only_the_recording_runs():
    torch._dynamo.reset()
    model, x = _model_and_input()
    assert getattr(compat.inductor_config(), compat.POST_PASS_KEY) is None
    cov = model_coverage(model, x, backward=False)
    assert set(cov.graphs) == {"forward"}, cov.graphs
    assert getattr(compat.inductor_config(), compat.POST_PASS_KEY) is None
