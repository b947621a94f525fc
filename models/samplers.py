"""ComfyUI's k-diffusion samplers for a FLUX.2 flow model, as plain functions over a denoiser.

A denoiser maps (x, sigma) to the denoised estimate x0; for FLUX (ComfyUI's CONST model sampling)
x_sigma = (1 - sigma) x0 + sigma noise and x0 = x - sigma v. Each sampler below is the published method
(Karras et al. 2022: Euler, Heun, ancestral steps; Lu et al. 2022: DPM-Solver++ 2M, SDE; Luo et al. 2023:
LCM) in the form ComfyUI runs it for a CONST model, step for step in float32 on x's device:

- euler_ancestral takes the rectified-flow ancestral step (ComfyUI's euler_ancestral_RF): step down to
  sigma_down = sigma_next^2 / sigma, rescale by (1 - sigma_next) / (1 - sigma_down) and add fresh noise
  of std sqrt(sigma_next^2 - sigma_down^2 (1 - sigma_next)^2 / (1 - sigma_down)^2) (eta 1);
- dpmpp_sde and dpmpp_2m_sde work in half-log-SNR lambda = log((1 - sigma) / sigma), after moving a first
  sigma of 1 (lambda = -inf) to the sigma at 0.01 % of the schedule; dpmpp_2m works in -log(sigma) as
  for any model (ComfyUI does not special-case it);
- lcm replaces x by x0 and re-noises it to the next sigma with fresh noise.

Fresh noise is drawn as ComfyUI draws it: `seeded_noise` (a generator on x's device seeded with the seed,
plus one on the CPU) for the ancestral and LCM samplers, `BrownianNoise` (torchsde's Brownian tree,
reimplemented here value for value, see below) for the SDE samplers. Nothing here holds state between calls.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from .schedules import percent_to_sigma

Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, sigma: 0-dim float32) -> x0
NoiseSampler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (sigma, sigma_next) -> unit noise like x
Callback = Callable[[int, torch.Tensor], None]  # (step index, that step's x0)

SAMPLERS = ("euler", "euler_ancestral", "heun", "dpmpp_sde", "dpmpp_2m", "dpmpp_2m_sde", "lcm")  # ComfyUI's order
SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF
SNR_OFFSET = 1e-4  # a first sigma of 1 moves to percent_to_sigma(1e-4) for the half-log-SNR samplers


def seeded_noise(x: torch.Tensor, seed: int) -> NoiseSampler:
    """ComfyUI's default noise sampler: randn like x from one generator on x's device, seeded with `seed`
    (`seed + 1` on the CPU), drawn afresh at every call."""
    g = torch.Generator(device=x.device)
    g.manual_seed((int(seed) + (1 if x.device.type == "cpu" else 0)) & SEED_MASK)
    return lambda sigma, sigma_next: torch.randn(x.size(), dtype=x.dtype, layout=x.layout, device=x.device,
                                                  generator=g)


# ------------------------------------------------------------------------------------------------ samplers


def _to_d(x: torch.Tensor, sigma: torch.Tensor, denoised: torch.Tensor) -> torch.Tensor:
    return (x - denoised) / sigma


def euler(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, callback: Callback | None = None,
          seed: int = 0) -> torch.Tensor:
    """Euler steps of the probability-flow ODE dx/dsigma = (x - x0) / sigma."""
    for i in range(len(sigmas) - 1):
        denoised = denoise(x, sigmas[i])
        if callback is not None:
            callback(i, denoised)
        x = x + _to_d(x, sigmas[i], denoised) * (sigmas[i + 1] - sigmas[i])
    return x


def euler_ancestral(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, callback: Callback | None = None,
                    seed: int = 0, eta: float = 1.0) -> torch.Tensor:
    """Ancestral Euler for a flow model (eta 1): a deterministic step to sigma_down, then fresh noise up to
    sigma_next, keeping x on the flow's (1 - sigma) x0 + sigma noise line."""
    noise = seeded_noise(x, seed)
    for i in range(len(sigmas) - 1):
        denoised = denoise(x, sigmas[i])
        if callback is not None:
            callback(i, denoised)
        if sigmas[i + 1] == 0:
            x = denoised
            continue
        sigma_down = sigmas[i + 1] * (1 + (sigmas[i + 1] / sigmas[i] - 1) * eta)
        alpha_next, alpha_down = 1 - sigmas[i + 1], 1 - sigma_down
        renoise = (sigmas[i + 1] ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2) ** 0.5
        ratio = sigma_down / sigmas[i]
        x = ratio * x + (1 - ratio) * denoised
        if eta > 0:
            x = (alpha_next / alpha_down) * x + noise(sigmas[i], sigmas[i + 1]) * 1.0 * renoise
    return x


def heun(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, callback: Callback | None = None,
         seed: int = 0) -> torch.Tensor:
    """Heun's second-order method (Karras et al. 2022, algorithm 1); Euler on the step to sigma 0."""
    for i in range(len(sigmas) - 1):
        denoised = denoise(x, sigmas[i])
        d = _to_d(x, sigmas[i], denoised)
        if callback is not None:
            callback(i, denoised)
        dt = sigmas[i + 1] - sigmas[i]
        if sigmas[i + 1] == 0:
            x = x + d * dt
        else:
            x_2 = x + d * dt
            d_2 = _to_d(x_2, sigmas[i + 1], denoise(x_2, sigmas[i + 1]))
            x = x + (d + d_2) / 2 * dt
    return x


def dpmpp_2m(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, callback: Callback | None = None,
             seed: int = 0) -> torch.Tensor:
    """DPM-Solver++(2M) in t = -log(sigma): first order on the first step and on the step to 0."""
    old = None
    for i in range(len(sigmas) - 1):
        denoised = denoise(x, sigmas[i])
        if callback is not None:
            callback(i, denoised)
        t, t_next = sigmas[i].log().neg(), sigmas[i + 1].log().neg()
        h = t_next - t
        if old is None or sigmas[i + 1] == 0:
            x = (t_next.neg().exp() / t.neg().exp()) * x - (-h).expm1() * denoised
        else:
            r = (t - sigmas[i - 1].log().neg()) / h
            blended = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old
            x = (t_next.neg().exp() / t.neg().exp()) * x - (-h).expm1() * blended
        old = denoised
    return x


def _half_log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """lambda = log(alpha / sigma) = log((1 - sigma) / sigma) for a flow model."""
    return sigma.logit().neg()


def _snr_sigma(lam: torch.Tensor) -> torch.Tensor:
    return lam.neg().sigmoid()


def _offset_first(sigmas: torch.Tensor) -> torch.Tensor:
    if len(sigmas) > 1 and sigmas[0] >= 1:
        sigmas = sigmas.clone()
        sigmas[0] = percent_to_sigma(SNR_OFFSET)
    return sigmas


def _ancestral_step(sigma_from: torch.Tensor, sigma_to: torch.Tensor, eta: float) -> tuple:
    """(sigma_down, sigma_up) of a variance-exploding ancestral step (k-diffusion's get_ancestral_step)."""
    if not eta:
        return sigma_to, 0.0
    up = min(sigma_to, eta * (sigma_to ** 2 * (sigma_from ** 2 - sigma_to ** 2) / sigma_from ** 2) ** 0.5)
    return (sigma_to ** 2 - up ** 2) ** 0.5, up


def _noise_range(sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return sigmas[sigmas > 0].min(), sigmas.max()


def dpmpp_2m_sde(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, callback: Callback | None = None,
                 seed: int = 0, eta: float = 1.0) -> torch.Tensor:
    """DPM-Solver++(2M) SDE, midpoint variant, in half-log-SNR, with Brownian-tree noise."""
    if len(sigmas) <= 1:
        return x
    noise = BrownianNoise(x, *_noise_range(sigmas), seed=seed)
    sigmas = _offset_first(sigmas)
    old, h, h_last = None, None, None
    for i in range(len(sigmas) - 1):
        denoised = denoise(x, sigmas[i])
        if callback is not None:
            callback(i, denoised)
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            lam_s, lam_t = _half_log_snr(sigmas[i]), _half_log_snr(sigmas[i + 1])
            h = lam_t - lam_s
            h_eta = h * (eta + 1)
            alpha_t = sigmas[i + 1] * lam_t.exp()
            x = sigmas[i + 1] / sigmas[i] * (-h * eta).exp() * x + alpha_t * (-h_eta).expm1().neg() * denoised
            if old is not None:
                r = h_last / h
                x = x + 0.5 * alpha_t * (-h_eta).expm1().neg() * (1 / r) * (denoised - old)
            if eta > 0:
                x = x + noise(sigmas[i], sigmas[i + 1]) * sigmas[i + 1] * (-2 * h * eta).expm1().neg().sqrt() * 1.0
        old, h_last = denoised, h
    return x


def dpmpp_sde(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, callback: Callback | None = None,
              seed: int = 0, eta: float = 1.0, r: float = 0.5) -> torch.Tensor:
    """DPM-Solver++ (stochastic, two stages per step: to the lambda midpoint, then the whole step), in
    half-log-SNR, with Brownian-tree noise."""
    if len(sigmas) <= 1:
        return x
    noise = BrownianNoise(x, *_noise_range(sigmas), seed=seed)
    sigmas = _offset_first(sigmas)
    for i in range(len(sigmas) - 1):
        denoised = denoise(x, sigmas[i])
        if callback is not None:
            callback(i, denoised)
        if sigmas[i + 1] == 0:
            x = denoised
            continue
        lam_s, lam_t = _half_log_snr(sigmas[i]), _half_log_snr(sigmas[i + 1])
        h = lam_t - lam_s
        lam_s1 = lam_s + r * h
        fac = 1 / (2 * r)
        sigma_s1 = _snr_sigma(lam_s1)
        alpha_s = sigmas[i] * lam_s.exp()
        alpha_s1 = sigma_s1 * lam_s1.exp()
        alpha_t = sigmas[i + 1] * lam_t.exp()
        sd, su = _ancestral_step(lam_s.neg().exp(), lam_s1.neg().exp(), eta)
        h_ = sd.log().neg() - lam_s
        x_2 = (alpha_s1 / alpha_s) * (-h_).exp() * x - alpha_s1 * (-h_).expm1() * denoised
        if eta > 0:
            x_2 = x_2 + alpha_s1 * noise(sigmas[i], sigma_s1) * 1.0 * su
        denoised_2 = denoise(x_2, sigma_s1)
        sd, su = _ancestral_step(lam_s.neg().exp(), lam_t.neg().exp(), eta)
        h_ = sd.log().neg() - lam_s
        blended = (1 - fac) * denoised + fac * denoised_2
        x = (alpha_t / alpha_s) * (-h_).exp() * x - alpha_t * (-h_).expm1() * blended
        if eta > 0:
            x = x + alpha_t * noise(sigmas[i], sigmas[i + 1]) * 1.0 * su
    return x


def lcm(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, callback: Callback | None = None,
        seed: int = 0) -> torch.Tensor:
    """Latent consistency sampling: jump to x0, then re-noise it to the next sigma, (1 - s) x0 + s noise."""
    noise = seeded_noise(x, seed)
    for i in range(max(1, len(sigmas) - 1)):
        denoised = denoise(x, sigmas[i])
        if callback is not None:
            callback(i, denoised)
        x = denoised
        if sigmas[i + 1] > 0:
            s = sigmas[i + 1]
            x = s * (1.0 * noise(sigmas[i], s)) + (1.0 - s) * x
    return x


FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "euler": euler, "euler_ancestral": euler_ancestral, "heun": heun, "dpmpp_sde": dpmpp_sde,
    "dpmpp_2m": dpmpp_2m, "dpmpp_2m_sde": dpmpp_2m_sde, "lcm": lcm}


def run(name: str, denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, seed: int = 0,
        callback: Callback | None = None) -> torch.Tensor:
    """Sampler `name` from x at sigmas[0] down the float32 `sigmas` (on x's device)."""
    fn = FUNCTIONS.get(name)
    if fn is None:
        raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
    return fn(denoise, x, sigmas, callback, seed)


# ---------------------------------------------------------------------------------- Brownian-tree noise
#
# ComfyUI's SDE samplers draw their noise from torchsde's BrownianTree (entropy = the seed, tolerance 1e-6,
# pool size 24, on the CPU, float32, x's shape) over [smallest nonzero sigma, largest sigma] and divide each
# increment by sqrt(|sigma_next - sigma|). The tree is the dyadic one: the root carries W(t1) - W(t0) =
# sqrt(t1 - t0) N(0, 1); every interval [s, e] splits at m = round((s + e) / 2, 6) and its left part gets the
# Brownian-bridge sample (m - s) / (e - s) W + sqrt((m - s)(e - m) / (e - s)) N(0, 1), its right part the
# rest. Each N(0, 1) comes from a CPU generator seeded from numpy's SeedSequence(seed, spawn_key=(k, depth),
# pool_size=24), k the interval's position at its depth (root (0, 0); children of (k, d): (2k, d+1), (2k+1,
# d+1)); the root's own draw uses SeedSequence(seed, pool_size=24)'s first state. A query [a, b] is the sum,
# left to right, of the largest tree intervals that tile it. Reproducing those facts gives the same numbers
# as torchsde without depending on it (tests/test_samplers.py checks this against torchsde when installed).

TREE_TOL = 1e-6
TREE_POOL = 24
TREE_CACHE = 64  # interval increments kept between queries (each is one latent); others are recomputed


class _Interval:
    __slots__ = ("_children", "_mid", "_seed", "depth", "end", "is_left", "key", "parent", "start")

    def __init__(self, start: float, end: float, parent: _Interval | None, is_left: bool, key: int,
                 depth: int) -> None:
        self.start, self.end, self.parent, self.is_left = start, end, parent, is_left
        self.key, self.depth = key, depth
        self._mid: float | None = None
        self._seed: int | None = None
        self._children: tuple[_Interval, _Interval] | None = None

    def children(self, tree: BrownianTree) -> tuple[_Interval, _Interval]:
        if self._children is None:
            self._mid = tree.round(0.5 * (self.end + self.start))
            ss = np.random.SeedSequence(entropy=tree.entropy, spawn_key=(self.key, self.depth),
                                        pool_size=TREE_POOL)
            self._seed = int(ss.generate_state(4)[0])
            self._children = (_Interval(self.start, self._mid, self, True, 2 * self.key, self.depth + 1),
                              _Interval(self._mid, self.end, self, False, 2 * self.key + 1, self.depth + 1))
        return self._children

    @property
    def mid(self) -> float:
        assert self._mid is not None
        return self._mid


class BrownianTree:
    """A Brownian motion on [t0, t1] fixed by `entropy`: `increment(a, b)` = W(b) - W(a), as torchsde's
    BrownianTree(t0, zeros(shape), t1, entropy) gives it (CPU, float32)."""

    def __init__(self, t0: float, t1: float, shape: tuple[int, ...], entropy: int) -> None:
        if t0 > t1:
            raise ValueError(f"t0 {t0} must not exceed t1 {t1}")
        self.shape, self.entropy = tuple(shape), int(entropy)
        ndigits = -int(math.log10(TREE_TOL))
        self.round = lambda v: round(v, ndigits)
        self.root = _Interval(self.round(t0), self.round(t1), None, False, 0, 0)
        first = int(np.random.SeedSequence(entropy=self.entropy, pool_size=TREE_POOL).generate_state(3)[0])
        self._root_w = self._randn(first) * math.sqrt(t1 - t0)
        self._cache: OrderedDict[_Interval, torch.Tensor] = OrderedDict()

    def _randn(self, seed: int) -> torch.Tensor:
        g = torch.Generator("cpu").manual_seed(seed)
        return torch.randn(self.shape, dtype=torch.float32, generator=g)

    def _child_w(self, node: _Interval, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The increments over `node`'s two halves given its own `w`: the Brownian bridge at its midpoint."""
        left, right = node.children(self)
        if left in self._cache and right in self._cache:
            self._cache.move_to_end(left)
            self._cache.move_to_end(right)
            return self._cache[left], self._cache[right]
        h_rec = 1 / (node.end - node.start)
        left_diff, right_diff = node.mid - node.start, node.end - node.mid
        left_w = left_diff * w * h_rec + math.sqrt(left_diff * right_diff * h_rec) * self._randn(node._seed)
        right_w = w - left_w
        for k, v in ((left, left_w), (right, right_w)):
            self._cache[k] = v
            self._cache.move_to_end(k)
        while len(self._cache) > TREE_CACHE:
            self._cache.popitem(last=False)
        return left_w, right_w

    def increment(self, a: float, b: float) -> torch.Tensor:
        a = min(max(float(a), self.root.start), self.root.end)
        b = min(max(float(b), self.root.start), self.root.end)
        if a > b:
            raise ValueError(f"query times must respect a <= b, got {a} and {b}")
        a, b = self.round(a), self.round(b)
        if a == b:
            return torch.zeros(self.shape, dtype=torch.float32)
        # Walk down from the root, carrying each interval's increment, and add up the largest intervals that tile
        # [a, b], left to right.
        total = None
        todo = [(self.root, self._root_w, a, b)]
        while todo:
            node, w, a, b = todo.pop()
            if a == node.start and b == node.end:
                total = w if total is None else total + w
                continue
            left, right = node.children(self)
            left_w, right_w = self._child_w(node, w)
            if b <= node.mid:
                todo.append((left, left_w, a, b))
            elif a >= node.mid:
                todo.append((right, right_w, a, b))
            else:  # right first on the stack, so the left part comes out first
                todo.append((right, right_w, node.mid, b))
                todo.append((left, left_w, a, node.mid))
        return total


class BrownianNoise:
    """ComfyUI's BrownianTreeNoiseSampler (CPU tree): unit-variance noise for the step sigma -> sigma_next,
    (W(sigma_next) - W(sigma)) / sqrt(|sigma_next - sigma|), on x's device and dtype."""

    def __init__(self, x: torch.Tensor, sigma_min: torch.Tensor, sigma_max: torch.Tensor, seed: int) -> None:
        lo, hi = float(sigma_min.detach().cpu()), float(sigma_max.detach().cpu())
        self.sign = 1 if lo < hi else -1
        self.tree = BrownianTree(min(lo, hi), max(lo, hi), tuple(x.shape), seed)
        self.device, self.dtype = x.device, x.dtype

    def __call__(self, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        t0, t1 = torch.as_tensor(sigma), torch.as_tensor(sigma_next)
        a, b, sign = (t0, t1, 1) if t0 < t1 else (t1, t0, -1)
        w = self.tree.increment(float(a.detach().cpu().float()), float(b.detach().cpu().float()))
        w = w.to(device=t0.device, dtype=t0.dtype) * (self.sign * sign)
        return w / (t1 - t0).abs().sqrt()
