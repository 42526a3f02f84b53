"""The step cost model: seconds one engine step takes, from the shape of its schedule.

    seconds = step + decode_step * e + prefill_tokens * a + decode_seqs * b + decode_context * c
              + prefill_attention * d

``decode_step``: 1 if the step decodes at all (the decode path has a fixed cost of its own: one
decoding sequence costs more than a 16-token prompt); ``prefill_tokens``: tokens of chunks longer than one token (prompt work, linear layers);
``decode_seqs``: one-token requests (decodes: per-sequence overhead, sampling, the LM head);
``decode_context``: the K/V positions those decodes attend to (decode attention reads them all);
``prefill_attention``: sum over prefill chunks of ``n * (start + n / 2)``, the query-key pairs
causal attention computes. The coefficients are fitted (non-negative least squares, each step's
error over the square root of its time) to steps of the real engine timed by ``pagoda simulate
--calibrate``, whole steps (schedule, execute, update, emit) on the machine and settings the
simulator stands in for.

A step that moves KV blocks (swapping preempted requests out to the CPU swap pool and back) costs
``block_move_step + block_move * num_blocks_moved`` more, from the runner's block copies timed by the
same calibration. A model may be :meth:`CostModel.scaled` by the machine's speed now against its speed
during calibration (the speed probe, :func:`.calibrate.measure_speed`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from pagoda.errors import ConfigError

FEATURES = ("step", "decode_step", "prefill_tokens", "decode_seqs", "decode_context", "prefill_attention")
# seconds of a step's block moves: a fixed part whenever it moves any (one copy per layer and kind) and a
# part per block; cost models calibrated before these existed lack them (block moves then cost nothing)
MOVE_COEFFICIENTS = ("block_move_step", "block_move")
FORMAT_VERSION = 2


def step_features(num_new_tokens: Sequence[int], num_computed_before: Sequence[int]) -> tuple[float, ...]:
    """The five work measures of one step (the constant term excluded), from its ``SchedulerOutput`` lists."""
    prefill = decodes = context = attention = 0
    for n, start in zip(num_new_tokens, num_computed_before):
        if n == 1:
            decodes += 1
            context += start + 1
        else:
            prefill += n
            attention += n * (start + n * 0.5)
    return (1 if decodes else 0, prefill, decodes, context, attention)


@dataclass
class CostModel:
    """Fitted step-time coefficients (seconds per unit of each feature) and where they come from."""

    coefficients: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [f for f in FEATURES if f not in self.coefficients]
        if missing:
            raise ConfigError(f"cost model lacks coefficients {missing}; recalibrate with `pagoda simulate --calibrate`")
        bad = {k: v for k, v in self.coefficients.items() if not (isinstance(v, (int, float)) and math.isfinite(v)
                                                                  and v >= 0)}
        if bad:
            raise ConfigError(f"cost model coefficients {bad} are not finite non-negative numbers")
        self._c = tuple(float(self.coefficients[f]) for f in FEATURES)
        self._move = tuple(float(self.coefficients.get(f, 0.0)) for f in MOVE_COEFFICIENTS)

    @property
    def has_move_costs(self) -> bool:
        """Whether block moves were calibrated (False: a model from before they were, moves cost nothing)."""
        return all(f in self.coefficients for f in MOVE_COEFFICIENTS)

    def step_seconds(self, num_new_tokens: Sequence[int], num_computed_before: Sequence[int],
                     num_blocks_moved: int = 0) -> float:
        """Predicted wall time of a step that computes these chunks after moving ``num_blocks_moved`` KV blocks."""
        seconds = self.predict(step_features(num_new_tokens, num_computed_before))
        if num_blocks_moved:
            seconds += self.move_seconds(num_blocks_moved)
        return seconds

    def move_seconds(self, num_blocks_moved: int) -> float:
        """Predicted wall time of one step's block moves (swap out and in, offload-tier copies)."""
        fixed, per_block = self._move
        return fixed + per_block * num_blocks_moved if num_blocks_moved else 0.0

    def scaled(self, factor: float, reason: str = "") -> "CostModel":
        """Every coefficient times ``factor`` (a machine ``factor`` times slower than during calibration)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ConfigError(f"a cost model scale of {factor} is not a positive number")
        meta = dict(self.meta, scale=factor, scale_reason=reason)
        return CostModel({k: v * factor for k, v in self.coefficients.items()}, meta)

    def predict(self, features: Sequence[float]) -> float:
        step, e, a, b, c, d = self._c
        is_decode, prefill, decodes, context, attention = features
        return step + e * is_decode + a * prefill + b * decodes + c * context + d * attention

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": FORMAT_VERSION, "coefficients": self.coefficients, "meta": self.meta},
                                   indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no cost model at {path}; calibrate one on this machine with `pagoda simulate "
                              f"--calibrate --cost-model {path}` (about a minute), or pass --cost-model PATH")
        try:
            data = json.loads(path.read_text())
            coefficients = data["coefficients"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path} is not a pagoda cost model ({type(exc).__name__}: {exc}); recalibrate with "
                              f"`pagoda simulate --calibrate --cost-model {path}`") from None
        return cls(dict(coefficients), dict(data.get("meta", {})))


def fit(samples: Sequence[tuple[Sequence[float], float]], meta: Optional[dict] = None) -> CostModel:
    """Non-negative weighted least squares (see :func:`_nonnegative_fit`): a feature whose coefficient comes
    out negative is dropped and the rest refitted. ``meta`` gains the fit's median and p90 relative error."""
    import numpy as np

    if len(samples) < len(FEATURES):
        raise ConfigError(f"{len(samples)} timed steps cannot fit {len(FEATURES)} coefficients; calibrate over a "
                          "larger grid")
    x = np.array([(1.0, *f) for f, _ in samples], dtype=np.float64)  # [num_samples, num_features]
    y = np.array([s for _, s in samples], dtype=np.float64)  # [num_samples]
    coef = _nonnegative_fit(x, y)
    rel = np.abs(x @ coef - y) / y
    # steps slowed by something outside the engine (another process on a shared core) are outliers:
    # refit once without the worst tenth
    keep = rel <= np.percentile(rel, 90)
    if keep.sum() >= len(FEATURES) * 2:
        coef = _nonnegative_fit(x[keep], y[keep])
        rel = np.abs(x @ coef - y) / y
    meta = dict(meta or {})
    meta.update(num_samples=len(samples), median_rel_error=float(np.median(rel)),
                p90_rel_error=float(np.percentile(rel, 90)),
                # the timed steps themselves: features then seconds, to refit or inspect later
                samples=[[*map(float, f), float(s)] for f, s in samples])
    return CostModel({name: float(v) for name, v in zip(FEATURES, coef)}, meta)


def _nonnegative_fit(x, y):
    """Weighted least squares with every coefficient >= 0 (a negative one is dropped and the rest refitted)."""
    import numpy as np

    # between absolute and relative error: a step's residual counts over the square root of its time, so the
    # few long prefills of a calibration do not decide the fit alone, nor do the many short decodes (which
    # left the large decode batches that serving spends its time in 5 to 10% short under relative error)
    weights = 1.0 / np.sqrt(np.maximum(y, 1e-6))
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        scale = np.maximum(np.abs(x[:, active]).max(axis=0), 1e-12)  # columns span 1 .. 1e7: condition them
        sol, *_ = np.linalg.lstsq(x[:, active] / scale * weights[:, None], y * weights, rcond=None)
        sol = sol / scale
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor name."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1] for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu.strip()


def machine_key(model_dir: str, dtype: str, threads: Optional[int]) -> str:
    """A file name for the cost model of this model, dtype, CPU and thread count."""
    parts = [Path(model_dir).name, dtype, cpu_name(), f"{threads or os.cpu_count()}t"]
    return re.sub(r"[^A-Za-z0-9.]+", "-", "_".join(parts)).strip("-") + ".json"


def default_cost_model_path(model_dir: str, dtype: str, threads: Optional[int]) -> Path:
    """``$XDG_CACHE_HOME/pagoda/cost_models/<model>_<dtype>_<cpu>_<threads>.json`` (``~/.cache`` by default)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "pagoda" / "cost_models" / machine_key(model_dir, dtype, threads)


@dataclass(frozen=True)
class PipelineHandoff:
    """What pipeline parallelism adds to a step of a model whose cost model was calibrated whole: each of the
    ``num_stages - 1`` hand-offs sends the step's hidden states and residual (``2 x hidden_size`` values per
    token) over a link of ``latency_seconds`` and ``bytes_per_second``. With one batch in flight (what pagoda
    runs), the stages run one after another, so the step's compute is the whole model's, as calibrated."""

    num_stages: int
    latency_seconds: float
    bytes_per_second: float
    bytes_per_token: int

    def seconds(self, num_tokens: int) -> float:
        """The hand-offs of one step of ``num_tokens`` tokens."""
        one = self.latency_seconds + num_tokens * self.bytes_per_token / self.bytes_per_second
        return (self.num_stages - 1) * one
