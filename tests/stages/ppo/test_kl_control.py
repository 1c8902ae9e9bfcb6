"""Tests of the KL controllers with updates worked out by hand."""

from __future__ import annotations

import pytest

from alignflow.config import PPOConfig
from alignflow.stages.ppo.kl_control import AdaptiveKLController, FixedKLController, make_kl_controller


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.05)
    assert ctl.update(current_kl=100.0, n_steps=10_000) == 0.05
    assert ctl.value == 0.05
    assert ctl.state_dict() == {"kind": "fixed", "value": 0.05}


def test_adaptive_controller_hand_computed():
    # init 0.05, target 6 nats, horizon 10,000.
    ctl = AdaptiveKLController(0.05, target=6.0, horizon=10_000)
    # KL 9: error 9/6 - 1 = 0.5, clipped to 0.2; 512 samples: x (1 + 0.2*512/10000) = x 1.01024 -> 0.050512
    assert ctl.update(9.0, 512) == pytest.approx(0.050512, rel=1e-12)
    # KL 3: error -0.5 -> -0.2: x 0.98976 -> 0.050512 * 0.98976 = 0.04999475712
    assert ctl.update(3.0, 512) == pytest.approx(0.04999475712, rel=1e-12)
    # KL 6.6: error 0.1 (inside the clip); 100 samples: x 1.001 -> 0.05004475187712
    assert ctl.update(6.6, 100) == pytest.approx(0.05004475187712, rel=1e-12)
    assert ctl.value == pytest.approx(0.05004475187712, rel=1e-12)
    # KL exactly on target: no change.
    assert ctl.update(6.0, 5000) == pytest.approx(0.05004475187712, rel=1e-12)


def test_adaptive_error_is_clipped_both_ways():
    high = AdaptiveKLController(1.0, target=1.0, horizon=100)
    low = AdaptiveKLController(1.0, target=1.0, horizon=100)
    assert high.update(1e6, 10) == pytest.approx(1.02, rel=1e-12)  # +0.2 * 10/100
    assert low.update(0.0, 10) == pytest.approx(0.98, rel=1e-12)  # -0.2 * 10/100


def test_state_dict_round_trip_and_kind_check():
    ctl = AdaptiveKLController(0.1, target=4.0, horizon=1000)
    ctl.update(8.0, 50)
    resumed = AdaptiveKLController(0.5, target=1.0, horizon=1)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.state_dict() == ctl.state_dict()
    assert resumed.update(2.0, 10) == ctl.update(2.0, 10)
    with pytest.raises(
        ValueError, match="cannot load a 'adaptive' KL controller state into a 'fixed' controller"
    ):
        FixedKLController(0.1).load_state_dict(ctl.state_dict())


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="target KL must be > 0 nats, got 0"):
        AdaptiveKLController(0.1, target=0, horizon=10)
    with pytest.raises(ValueError, match="horizon must be >= 1 sample, got 0"):
        AdaptiveKLController(0.1, target=1, horizon=0)
    with pytest.raises(ValueError, match="kl_coef must be >= 0, got -1"):
        FixedKLController(-1)


def test_factory_follows_config():
    fixed = make_kl_controller(PPOConfig(kl_coef=0.2))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.2
    adaptive = make_kl_controller(PPOConfig(adaptive_kl=True, kl_coef=0.3, target_kl=2.0, kl_horizon=500))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.3, 2.0, 500)
