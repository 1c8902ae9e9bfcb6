"""KL coefficient controllers for the RL stage: fixed, or adaptive toward a target KL (Ziegler et al. 2019).

Plain Python, no torch: the controller only sees the measured KL (a float) once per iteration and
hands back the coefficient to use next. It does not compute KL (see losses.kl_penalty).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from alignflow.config import PPOConfig

# Ziegler et al. clip the proportional error to +-0.2 so one outlier iteration moves the coefficient by
# at most 0.2 * n_steps / horizon (2% for 1,000 samples against a 10,000 horizon).
PROPORTIONAL_ERROR_CLIP = 0.2


class KLController(Protocol):
    """What the RL loop needs from a controller."""

    @property
    def value(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def _check_kind(state: Mapping[str, Any], expected: str) -> None:
    kind = state.get("kind")
    if kind != expected:
        raise ValueError(
            f"cannot load a {kind!r} KL controller state into a {expected!r} controller; "
            "keep ppo.adaptive_kl the same when resuming"
        )


class FixedKLController:
    """A constant KL coefficient; `update` does nothing (config ppo.adaptive_kl=false)."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self._value = float(kl_coef)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> float:
        """No-op; returns the (unchanged) coefficient."""
        return self._value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "fixed", "value": self._value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(state, "fixed")
        self._value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller on the KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human
    Preferences", section 2.2).

        error = clip(current_kl / target - 1, -0.2, 0.2)
        value <- value * (1 + error * n_steps / horizon)

    Args:
        init_kl_coef: starting coefficient (config ppo.kl_coef).
        target: KL (nats per sequence) to steer toward (config ppo.target_kl).
        horizon: samples over which the error is corrected (config ppo.kl_horizon).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target <= 0:
            raise ValueError(f"target KL must be > 0 nats, got {target}")
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1 sample, got {horizon}")
        self._value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move the coefficient after an iteration that measured `current_kl` (mean per-sequence KL)
        over `n_steps` samples (sequences); returns the new coefficient."""
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        error = current_kl / self.target - 1.0
        error = min(max(error, -PROPORTIONAL_ERROR_CLIP), PROPORTIONAL_ERROR_CLIP)
        self._value *= 1.0 + error * n_steps / self.horizon
        return self._value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "adaptive", "value": self._value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(state, "adaptive")
        self._value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


def make_kl_controller(cfg: PPOConfig) -> FixedKLController | AdaptiveKLController:
    """The controller the config asks for: adaptive_kl, kl_coef, target_kl, kl_horizon."""
    if cfg.adaptive_kl:
        return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon)
    return FixedKLController(cfg.kl_coef)
