"""The open outer optimizer (issue 25): any torch optimizer steps DiLoCo's outer copy; the native
Nesterov path is one implementation of it, chosen by a pure function of the config."""

from __future__ import annotations

import pytest
import torch

from zeroband.config import DilocoConfig


def test_the_outer_optimizer_is_a_pure_function_of_the_config():
    from zeroband.outer.optimizer import NesterovSGD, TorchOuter, build_outer_optimizer, choose
    from zeroband.outer.placement import OuterCopy

    shipped = DilocoConfig()
    assert choose(shipped) == choose(DilocoConfig()) and hash(choose(shipped)) == hash(choose(DilocoConfig()))
    assert choose(shipped).cls is torch.optim.SGD
    assert dict(choose(shipped).settings) == {"lr": 0.7, "momentum": 0.5, "nesterov": True, "fused": True}
    assert dict(choose(DilocoConfig(outer_optimizer="sgd")).settings)["nesterov"] is False
    assert dict(choose(DilocoConfig(outer_momentum=0.0)).settings)["nesterov"] is False  # torch refuses it without momentum
    adam = DilocoConfig(outer_optimizer="adam", outer_lr=0.01, outer_kwargs={"betas": [0.9, 0.95]})
    assert choose(adam).cls is torch.optim.Adam and dict(choose(adam).settings) == {"lr": 0.01, "betas": (0.9, 0.95)}
    assert choose(DilocoConfig(outer_optimizer="torch.optim.RAdam", outer_lr=0.01)).cls is torch.optim.RAdam
    copy = OuterCopy([torch.zeros(3)], shipped)
    assert type(build_outer_optimizer(copy, shipped)) is NesterovSGD
    assert type(build_outer_optimizer(copy, DilocoConfig(outer_optimizer="sgd", outer_momentum=0.0))) is NesterovSGD
    assert type(build_outer_optimizer(copy, adam)) is TorchOuter
    # SGD the native kernel does not compute (dampening) runs torch's own step
    damped = build_outer_optimizer(copy, shipped, lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.5, dampening=0.1))
    assert type(damped) is TorchOuter


@pytest.mark.parametrize("kwargs, says", [
    ({"outer_optimizer": "adam"}, "diloco.outer_lr must be set for diloco.outer_optimizer = 'adam'"),
    ({"outer_optimizer": "os.system", "outer_lr": 1.0}, "diloco.outer_optimizer='os.system' is not an outer optimizer"),
    ({"outer_optimizer": "adam", "outer_lr": 0.01, "outer_kwargs": {"betaz": 0.9}},
     "diloco.outer_kwargs has 'betaz', which Adam does not take"),
    ({"outer_optimizer": "adam", "outer_lr": 0.01, "outer_momentum": 0.9}, "diloco.outer_momentum applies to the SGD"),
    ({"outer_optimizer": "adam", "outer_lr": 0.01, "overlap": True},
     "diloco.overlap_rule='eager' previews the outer step, which only SGD can"),
], ids=["no_lr", "unknown", "kwargs", "momentum", "overlap"])
def test_outer_optimizer_settings_are_refused_in_one_line(kwargs: dict, says: str):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="Value error, " + says.replace("(", r"\(").replace(")", r"\)")):
        DilocoConfig(**kwargs)
