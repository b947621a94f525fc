"""ComfyUI's sigma schedules for a FLUX.2 model, as plain functions (KSampler's and BasicScheduler's `scheduler`).

ComfyUI samples every FLUX.2 model with CONST model sampling (x_sigma = (1 - sigma) x0 + sigma noise) and a
fixed time shift: its `ModelSamplingFlux` with shift 2.02 (FLUX.2's sampling settings) holds a table of 10000
sigmas, sigma(t) = e^shift / (e^shift + 1/t - 1) at t = k/10000, k = 1..10000, and its timestep of a sigma is
the sigma itself. The schedulers below read that table (or its ends) exactly as ComfyUI's do, in float32, so
the same scheduler and step count give the same sigmas here and there. Flux2Scheduler's resolution-dependent
schedule is another thing (`sampling.sigmas`); KSampler does not use it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

FLUX2_SHIFT = 2.02  # ComfyUI's sampling_settings of every FLUX.2 model
TABLE_SIZE = 10000  # ModelSamplingFlux's number of timesteps
SCHEDULERS = ("simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal",
              "linear_quadratic", "kl_optimal")  # ComfyUI's order
KARRAS_RHO = 7.0
BETA_ALPHA = BETA_BETA = 0.6


def flux_shift(shift: float, t: torch.Tensor | float) -> torch.Tensor | float:
    """sigma of flow time t under the shift: e^shift / (e^shift + (1/t - 1))."""
    e = math.exp(shift)
    return e / (e + (1 / t - 1))


def sigma_table(shift: float = FLUX2_SHIFT) -> torch.Tensor:
    """ModelSamplingFlux's 10000 sigmas, ascending, float32 (the last is 1)."""
    t = torch.arange(1, TABLE_SIZE + 1, 1) / TABLE_SIZE
    return flux_shift(shift, t)


def percent_to_sigma(percent: float, shift: float = FLUX2_SHIFT) -> float:
    """ModelSamplingFlux.percent_to_sigma: the sigma at `percent` of the way from the start (1) to the end (0)."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    return flux_shift(shift, 1.0 - percent)


def _with_zero(sigmas: torch.Tensor) -> torch.Tensor:
    return torch.cat([sigmas, sigmas.new_zeros([1])])


def simple(table: torch.Tensor, steps: int) -> torch.Tensor:
    """Every len/steps-th sigma of the table from the top, then 0."""
    stride = len(table) / steps
    return torch.tensor([float(table[-(1 + int(i * stride))]) for i in range(steps)] + [0.0], dtype=torch.float32)


def normal(table: torch.Tensor, steps: int, shift: float = FLUX2_SHIFT, sgm: bool = False) -> torch.Tensor:
    """Timesteps evenly spaced from sigma_max's to sigma_min's, each mapped through sigma(t); then 0.

    For FLUX the timestep of a sigma is the sigma, so this shifts the table's ends once more (ComfyUI does the
    same). `sgm` (sgm_uniform): steps + 1 points with the last dropped, instead of steps points."""
    start, end = table[-1], table[0]  # timestep(sigma_max), timestep(sigma_min)
    with_zero = True
    if sgm:
        ts = torch.linspace(start, end, steps + 1)[:-1]
    else:
        if math.isclose(float(flux_shift(shift, end)), 0, abs_tol=0.00001):
            steps += 1
            with_zero = False
        ts = torch.linspace(start, end, steps)
    out = [float(flux_shift(shift, ts[i])) for i in range(len(ts))]
    return torch.tensor(out + ([0.0] if with_zero else []), dtype=torch.float32)


def karras(steps: int, sigma_min: float, sigma_max: float, rho: float = KARRAS_RHO) -> torch.Tensor:
    """Karras et al. (2022), eq. 5: (sigma_max^(1/rho) + i/(n-1) (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho."""
    ramp = torch.linspace(0, 1, steps)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return _with_zero((hi + ramp * (lo - hi)) ** rho)


def exponential(steps: int, sigma_min: float, sigma_max: float) -> torch.Tensor:
    """Evenly spaced in log sigma from sigma_max to sigma_min, then 0."""
    return _with_zero(torch.linspace(math.log(sigma_max), math.log(sigma_min), steps).exp())


def ddim_uniform(table: torch.Tensor, steps: int) -> torch.Tensor:
    """Every len//steps-th table entry from index 1 up, descending, after a 0 (ComfyUI's ddim_uniform)."""
    sigs: list[float] = []
    if math.isclose(float(table[1]), 0, abs_tol=0.00001):
        steps += 1
    else:
        sigs = [0.0]
    stride = max(len(table) // steps, 1)
    sigs += [float(table[i]) for i in range(1, len(table), stride)]
    return torch.tensor(sigs[::-1], dtype=torch.float32)


def beta(table: torch.Tensor, steps: int, alpha: float = BETA_ALPHA, b: float = BETA_BETA) -> torch.Tensor:
    """Lee et al. (2024, arXiv 2407.12173): table indices at the Beta(alpha, b) quantiles of 1 - i/steps,
    rounded to the nearest index; repeated indices once; then 0."""
    last = len(table) - 1
    q = 1 - np.linspace(0, 1, steps, endpoint=False)
    idx = np.rint(np.array([beta_ppf(float(p), alpha, b) for p in q]) * last)
    out, prev = [], -1.0
    for t in idx:
        if t != prev:
            out.append(float(table[int(t)]))
        prev = t
    return torch.tensor([*out, 0.0], dtype=torch.float32)


def linear_quadratic(steps: int, sigma_max: float = 1.0, threshold: float = 0.025,
                     linear_steps: int | None = None) -> torch.Tensor:
    """Genmo's Mochi schedule: linear in the first half up to `threshold`, quadratic after; 1 - that."""
    if steps == 1:
        sched = [1.0, 0.0]
    else:
        n = steps // 2 if linear_steps is None else linear_steps
        lin = [i * threshold / n for i in range(n)]
        diff = n - threshold * steps
        quad_steps = steps - n
        qa = diff / (n * quad_steps ** 2)
        qb = threshold / n - 2 * diff / (quad_steps ** 2)
        qc = qa * (n ** 2)
        sched = [1.0 - x for x in lin + [qa * i ** 2 + qb * i + qc for i in range(n, steps)] + [1.0]]
    return torch.tensor(sched, dtype=torch.float32) * sigma_max


def kl_optimal(steps: int, sigma_min: float, sigma_max: float) -> torch.Tensor:
    """The KL-optimal schedule (AUTOMATIC1111 #15608): tan of a linear blend of atan(sigma_max), atan(sigma_min)."""
    if steps < 2:
        raise ValueError(f"the kl_optimal scheduler needs at least 2 steps, got {steps}")
    w = torch.arange(steps, dtype=torch.float).div_(steps - 1)
    out = w.new_zeros(steps + 1)
    out[:-1] = (w * math.atan(sigma_min) + (1 - w) * math.atan(sigma_max)).tan_()
    return out


def schedule(name: str, steps: int, shift: float = FLUX2_SHIFT) -> torch.Tensor:
    """ComfyUI's `calculate_sigmas(model_sampling, name, steps)` for a FLUX model with this shift (float32)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    table = sigma_table(shift)
    lo, hi = float(table[0]), float(table[-1])
    if name == "simple":
        return simple(table, steps)
    if name in ("normal", "sgm_uniform"):
        return normal(table, steps, shift, sgm=name == "sgm_uniform")
    if name == "karras":
        return karras(steps, lo, hi)
    if name == "exponential":
        return exponential(steps, lo, hi)
    if name == "ddim_uniform":
        return ddim_uniform(table, steps)
    if name == "beta":
        return beta(table, steps)
    if name == "linear_quadratic":
        return linear_quadratic(steps, hi)
    if name == "kl_optimal":
        return kl_optimal(steps, lo, hi)
    raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}")


# ------------------------------------------------------------------------ the Beta distribution's quantile


def _beta_cf(x: float, a: float, b: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz), converged to double precision."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        even = m * (b - m) * x / ((a + m2 - 1) * (a + m2))
        odd = -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1))
        for num in (even, odd):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def beta_cdf(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln_front) * _beta_cf(x, a, b) / a
    return 1.0 - math.exp(ln_front) * _beta_cf(1.0 - x, b, a) / b


def beta_ppf(q: float, a: float, b: float) -> float:
    """The Beta(a, b) quantile of q: I_x(a, b) = q solved by bisection to the last bit of a double."""
    if q <= 0.0:
        return 0.0
    if q >= 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if beta_cdf(mid, a, b) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
