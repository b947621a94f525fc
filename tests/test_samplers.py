"""ComfyUI's samplers and schedulers for FLUX.2 (models/samplers.py, models/schedules.py), each checked against
its published formula re-derived here in float64, plus the Brownian-tree noise against torchsde when installed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from vramgraph.models import samplers, schedules

SHIFT = 2.02
E = math.exp(SHIFT)


def shifted(t: np.ndarray | float) -> np.ndarray | float:
    """FLUX's time shift sigma(t) = e^mu / (e^mu + 1/t - 1), mu = 2.02 (ComfyUI's ModelSamplingFlux)."""
    return E / (E + 1 / np.asarray(t, dtype=np.float64) - 1)


TABLE = shifted(np.arange(1, 10001) / 10000)  # float64 reference of the 10000-entry table
SIGMA_MIN, SIGMA_MAX = TABLE[0], TABLE[-1]


def close(got: torch.Tensor, want: np.ndarray | list, tol: float = 2e-6) -> None:
    got = got.double().numpy()
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------- schedules


def test_sigma_table_is_model_sampling_flux():
    t = schedules.sigma_table()
    assert t.dtype == torch.float32 and t.shape == (10000,)
    close(t, TABLE)
    assert float(t[-1]) == 1.0 and float(t[0]) == pytest.approx(7.5334e-4, rel=1e-4)
    assert schedules.percent_to_sigma(0.0) == 1.0 and schedules.percent_to_sigma(1.0) == 0.0
    assert schedules.percent_to_sigma(1e-4) == pytest.approx(shifted(1 - 1e-4), rel=1e-12)


@pytest.mark.parametrize("steps", [1, 2, 4, 7, 20])
def test_simple(steps):
    idx = [int(i * 10000 / steps) for i in range(steps)]
    close(schedules.schedule("simple", steps), [TABLE[-1 - k] for k in idx] + [0.0])


@pytest.mark.parametrize("steps", [1, 3, 20])
def test_karras_rho_7(steps):
    rho, ramp = 7.0, np.linspace(0, 1, steps)
    want = (SIGMA_MAX ** (1 / rho) + ramp * (SIGMA_MIN ** (1 / rho) - SIGMA_MAX ** (1 / rho))) ** rho
    close(schedules.schedule("karras", steps), [*want, 0.0], 1e-5)


@pytest.mark.parametrize("steps", [1, 3, 20])
def test_exponential(steps):
    want = np.exp(np.linspace(math.log(SIGMA_MAX), math.log(SIGMA_MIN), steps))
    close(schedules.schedule("exponential", steps), [*want, 0.0], 1e-5)


@pytest.mark.parametrize("steps", [1, 4, 20])
def test_normal_and_sgm_uniform_shift_the_timesteps_again(steps):
    # FLUX's timestep of a sigma is the sigma itself, so evenly spaced timesteps are shifted once more (ComfyUI)
    close(schedules.schedule("normal", steps), [*shifted(np.linspace(SIGMA_MAX, SIGMA_MIN, steps)), 0.0], 1e-5)
    sgm = shifted(np.linspace(SIGMA_MAX, SIGMA_MIN, steps + 1)[:-1])
    close(schedules.schedule("sgm_uniform", steps), [*sgm, 0.0], 1e-5)


@pytest.mark.parametrize("steps", [1, 2, 4, 6, 8, 20, 50])
@pytest.mark.parametrize("shift", [SHIFT, 1.15, 3.0])
def test_normal_is_comfyuis_float32_arithmetic_bit_for_bit(steps, shift):
    # ComfyUI's normal_scheduler for ModelSamplingFlux, step by step in its float32: the table t = k / 10000
    # (arange / int), sigma(t) = e^mu / (e^mu + 1/t - 1); torch.linspace from the table's last entry to its
    # first (timestep(sigma) = sigma); each timestep through sigma(t) again; sigma(first) is not within 1e-5 of
    # 0, so a 0 is appended. Bit equality matters: dpmpp_2m magnifies the last sigmas (next test).
    e = math.exp(shift)
    table = e / (e + (1 / (torch.arange(1, 10001, 1) / 10000) - 1))
    assert table.dtype == torch.float32 and not math.isclose(float(e / (e + 1 / table[0] - 1)), 0, abs_tol=1e-5)
    ts = torch.linspace(table[-1], table[0], steps)
    want = torch.cat([e / (e + (1 / ts - 1)), torch.zeros(1)])
    assert torch.equal(schedules.schedule("normal", steps, shift), want)


def _beta_reference(steps: int, ppf) -> list[float]:
    ts = np.rint(np.array([ppf(q) for q in 1 - np.arange(steps) / steps]) * 9999)
    out = [TABLE[int(t)] for k, t in enumerate(ts) if k == 0 or t != ts[k - 1]]
    return [*out, 0.0]


@pytest.mark.parametrize("steps", [1, 2, 5, 20, 33])
def test_beta_alpha_beta_06(steps):
    got = schedules.schedule("beta", steps)
    close(got, _beta_reference(steps, lambda q: schedules.beta_ppf(q, 0.6, 0.6)))
    assert float(got[0]) == 1.0 and float(got[-1]) == 0.0 and bool((got[:-1] > got[1:]).all())
    stats = pytest.importorskip("scipy.stats")
    close(got, _beta_reference(steps, lambda q: float(stats.beta.ppf(q, 0.6, 0.6))))


def test_beta_quantile():
    # I_x(a, a) is symmetric about 1/2; at a = b = 1 it is x; the quantile inverts the distribution function
    for q in (1e-9, 0.01, 0.3, 0.5, 0.77, 0.999):
        x = schedules.beta_ppf(q, 0.6, 0.6)
        assert schedules.beta_cdf(x, 0.6, 0.6) == pytest.approx(q, rel=1e-12, abs=1e-15)
        assert schedules.beta_ppf(1 - q, 0.6, 0.6) == pytest.approx(1 - x, abs=1e-12)
        assert schedules.beta_ppf(q, 1.0, 1.0) == pytest.approx(q, abs=1e-14)
    # I_x(1/2, 1/2) = (2/pi) asin(sqrt x): the arcsine law
    assert schedules.beta_cdf(0.2, 0.5, 0.5) == pytest.approx(2 / math.pi * math.asin(math.sqrt(0.2)), rel=1e-12)


@pytest.mark.parametrize("steps", [1, 4, 20])
def test_ddim_uniform_linear_quadratic_kl_optimal(steps):
    stride = 10000 // steps
    close(schedules.schedule("ddim_uniform", steps), [*[TABLE[k] for k in range(1, 10000, stride)][::-1], 0.0])
    if steps == 1:
        close(schedules.schedule("linear_quadratic", 1), [1.0, 0.0])
    else:
        n, q = steps // 2, steps - steps // 2
        lin = [i * 0.025 / n for i in range(n)]
        a = (n - 0.025 * steps) / (n * q * q)
        b = 0.025 / n - 2 * (n - 0.025 * steps) / (q * q)
        quad = [a * i * i + b * i + a * n * n for i in range(n, steps)]
        close(schedules.schedule("linear_quadratic", steps), [1 - v for v in [*lin, *quad, 1.0]])
        w = np.arange(steps) / (steps - 1)
        kl = np.tan(w * math.atan(SIGMA_MIN) + (1 - w) * math.atan(SIGMA_MAX))
        close(schedules.schedule("kl_optimal", steps), [*kl, 0.0], 1e-5)
    with pytest.raises(ValueError, match="at least 2 steps"):
        schedules.schedule("kl_optimal", 1)


def test_schedule_names_and_bad_input():
    from vramgraph.nodes.core import SCHEDULERS

    assert tuple(SCHEDULERS) == schedules.SCHEDULERS
    with pytest.raises(ValueError, match=r"unknown scheduler 'bogus'.*simple"):
        schedules.schedule("bogus", 4)
    with pytest.raises(ValueError, match="at least 1"):
        schedules.schedule("simple", 0)


# ------------------------------------------------------------------------------------ a toy flow model

MU, S = 0.3, 0.7  # data x0 ~ N(MU, S^2) per element; x_sigma = (1 - sigma) x0 + sigma n


def gaussian_x0(x: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
    """E[x0 | x_sigma] for Gaussian data: the exact denoiser, in closed form."""
    a = 1 - sigma
    return MU + a * S * S * (x - a * MU) / (a * a * S * S + sigma * sigma)


class Recorder:
    def __init__(self):
        self.sigmas: list[float] = []

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        assert sigma.dtype == torch.float32 and sigma.ndim == 0
        self.sigmas.append(float(sigma))
        return gaussian_x0(x, sigma)


def start(seed: int = 3, shape: tuple = (1, 128, 4, 4)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def f64(v: torch.Tensor | float) -> float:
    return float(v)


SIGMAS = schedules.schedule("simple", 6)


def cpu_noise(seed: int, like: torch.Tensor):
    """ComfyUI's default noise on the CPU: one generator seeded with seed + 1, a fresh randn per call."""
    g = torch.Generator().manual_seed(seed + 1)
    return lambda: torch.randn(like.shape, generator=g).double()


def test_euler_is_the_ode_step():
    x = start()
    got = samplers.run("euler", Recorder(), x, SIGMAS)
    y = x.double()
    for s, sn in zip(SIGMAS.tolist()[:-1], SIGMAS.tolist()[1:], strict=True):
        y = y + (y - gaussian_x0(y, s)) / s * (sn - s)
    close(got, y.numpy(), 1e-5)


def test_heun_is_karras_algorithm_1():
    x, rec = start(), Recorder()
    got = samplers.run("heun", rec, x, SIGMAS)
    y, seen = x.double(), []
    for s, sn in zip(SIGMAS.tolist()[:-1], SIGMAS.tolist()[1:], strict=True):
        d = (y - gaussian_x0(y, s)) / s
        seen.append(s)
        if sn == 0:
            y = y + (sn - s) * d
        else:
            y1 = y + (sn - s) * d
            y = y + (sn - s) * 0.5 * (d + (y1 - gaussian_x0(y1, sn)) / sn)
            seen.append(sn)
    close(got, y.numpy(), 1e-5)
    assert rec.sigmas == pytest.approx(seen)  # two evaluations a step, one on the step to 0


@pytest.mark.parametrize("scheduler", ["simple", "normal", "karras"])
def test_dpmpp_2m_is_the_multistep_data_prediction_solver(scheduler):
    # Lu et al. 2022 (DPM-Solver++(2M)) in lambda = -log sigma: x' = (s'/s) x + (1 - s'/s) D, with
    # D = (1 + 1/2r) x0_i - 1/2r x0_{i-1}, r = h_{i-1} / h_i; first order on the first and the last step
    # (ComfyUI's sample_dpmpp_2m, which has no other special case: not for the normal schedule's tiny last sigma)
    x = start()
    sigmas = schedules.schedule(scheduler, 6)
    got = samplers.run("dpmpp_2m", Recorder(), x, sigmas)
    sig = sigmas.tolist()
    y, old = x.double(), None
    for i in range(len(sig) - 1):
        s, sn = sig[i], sig[i + 1]
        x0 = gaussian_x0(y, s)
        dd = x0
        if old is not None and sn > 0:
            r = math.log(sig[i - 1] / s) / math.log(s / sn)
            dd = (1 + 1 / (2 * r)) * x0 - old / (2 * r)
        y = sn / s * y + (1 - sn / s) * dd
        old = x0
    close(got, y.numpy(), 1e-5)


def test_dpmpp_2m_extrapolates_tenfold_into_the_normal_schedules_last_sigma():
    # Why dpmpp_2m + normal is the one pair whose picture is sensitive to the model's rounding: normal's sigmas
    # fall from sigma(0.2-ish) to sigma(sigma_min) ~ 0.0057 in one step, so that step's h = log(s/s') dwarfs the
    # previous one and D = (1 + 1/2r) x0_i - 1/2r x0_{i-1} weighs the two denoised estimates by about +10.8
    # and -9.8 (at 6 steps; the other schedulers stay under 2.6). Every scheduler here, in float64.
    def weights(sig):
        """1 + 1/2r of each second-order step, r = h_{i-1} / h_i."""
        return [1 + math.log(sig[i] / sig[i + 1]) / (2 * math.log(sig[i - 1] / sig[i]))
                for i in range(1, len(sig) - 1) if sig[i + 1] > 0]

    normal = [*shifted(np.linspace(SIGMA_MAX, SIGMA_MIN, 6)), 0.0]
    assert normal[-2] == pytest.approx(shifted(SIGMA_MIN)) and normal[-2] < 0.006
    assert 10.5 < weights(normal)[-1] < 11 and max(weights(normal)[:-1]) < 2.3
    others = {"simple": [TABLE[-1 - int(i * 10000 / 6)] for i in range(6)] + [0.0],
              "karras": [*(SIGMA_MAX ** (1 / 7) + np.linspace(0, 1, 6) * (SIGMA_MIN ** (1 / 7) - SIGMA_MAX ** (1 / 7)))
                         ** 7, 0.0],
              "exponential": [*np.exp(np.linspace(math.log(SIGMA_MAX), math.log(SIGMA_MIN), 6)), 0.0]}
    assert all(max(weights(sig)) < 2.6 for sig in others.values())
    # so a change e of the model's output v (x0 = x - sigma v) at the call before that step moves its result by
    # (s_i - s_i+1) e (1 + 1/2r), where Euler's moves by (s_i - s_i+1) e: the picture's differences grow w-fold
    sigmas = torch.tensor(normal, dtype=torch.float32)
    x, bump, at = start(), 1e-3, float(sigmas[4])

    def changed(x, sigma):
        return gaussian_x0(x, sigma) - (sigma * bump if float(sigma) == at else 0)

    moved = {name: (samplers.run(name, changed, x, sigmas) - samplers.run(name, gaussian_x0, x, sigmas)).abs().mean()
             for name in ("dpmpp_2m", "euler")}
    assert float(moved["dpmpp_2m"] / moved["euler"]) == pytest.approx(weights(normal)[-1], rel=1e-3)


def test_euler_ancestral_is_the_rectified_flow_ancestral_step():
    seed, x = 11, start()
    got = samplers.run("euler_ancestral", Recorder(), x, SIGMAS, seed=seed)
    z, y = cpu_noise(seed, x), x.double()
    for s, sn in zip(SIGMAS.tolist()[:-1], SIGMAS.tolist()[1:], strict=True):
        x0 = gaussian_x0(y, s)
        if sn == 0:
            y = x0
            continue
        down = sn * sn / s  # eta 1: step down to sigma_next^2 / sigma ...
        y = down / s * y + (1 - down / s) * x0
        # ... then scale onto the flow line at sigma_next and add the missing noise variance
        y = (1 - sn) / (1 - down) * y + math.sqrt(sn ** 2 - (down * (1 - sn) / (1 - down)) ** 2) * z()
    close(got, y.numpy(), 1e-5)


def test_lcm_jumps_to_x0_and_renoises():
    seed, x = 5, start()
    got = samplers.run("lcm", Recorder(), x, SIGMAS, seed=seed)
    z, y = cpu_noise(seed, x), x.double()
    for s, sn in zip(SIGMAS.tolist()[:-1], SIGMAS.tolist()[1:], strict=True):
        y = gaussian_x0(y, s)
        if sn > 0:
            y = (1 - sn) * y + sn * z()
    close(got, y.numpy(), 1e-5)


def half_log_snr(s: float) -> float:
    return math.log((1 - s) / s)


def snr_sigmas() -> list[float]:
    """SIGMAS with a first sigma of 1 moved to the sigma at 0.01 % of the schedule (lambda(1) = -inf)."""
    sig = SIGMAS.tolist()
    sig[0] = float(torch.tensor(shifted(1 - 1e-4), dtype=torch.float32))
    return sig


def test_dpmpp_2m_sde_is_the_stochastic_multistep_solver():
    # DPM-Solver++(2M) SDE, midpoint, eta 1, alpha = 1 - sigma, lambda = log(alpha / sigma), h = lambda' - lambda:
    # x' = (s'/s) e^-h x + alpha' (1 - e^-2h) x0 + 1/2 alpha' (1 - e^-2h) (x0 - x0_old) h / h_old
    #      + s' sqrt(1 - e^-2h) z,   z the Brownian-tree increment over [s', s] / sqrt(s - s')
    seed, x, rec = 7, start(), Recorder()
    got = samplers.run("dpmpp_2m_sde", rec, x, SIGMAS, seed=seed)
    noise = samplers.BrownianNoise(x, SIGMAS[SIGMAS > 0].min(), SIGMAS.max(), seed)
    sig = snr_sigmas()
    assert rec.sigmas[0] == sig[0] < 1.0
    y, old, h_old = x.double(), None, None
    for i in range(len(sig) - 1):
        s, sn = sig[i], sig[i + 1]
        x0 = gaussian_x0(y, s)
        if sn == 0:
            y = x0
            continue
        h = half_log_snr(sn) - half_log_snr(s)
        g = 1 - math.exp(-2 * h)
        y = sn / s * math.exp(-h) * y + (1 - sn) * g * x0
        if old is not None:
            y = y + 0.5 * (1 - sn) * g * (h / h_old) * (x0 - old)
        y = y + sn * math.sqrt(g) * noise(torch.tensor(s), torch.tensor(sn)).double()
        old, h_old = x0, h
    close(got, y.numpy(), 1e-5)


def test_dpmpp_sde_is_the_two_stage_stochastic_solver():
    # DPM-Solver++ (stochastic, r = 1/2): a first-order SDE step to the lambda midpoint s1, then the whole step
    # with the midpoint's x0 ((1 - 1/2r) x0 + 1/2r x0(s1) = x0(s1)); each stage adds noise alpha * sigma_up * z
    # (the variance-exploding ancestral split in the e^-lambda scale)
    seed, x, rec = 9, start(), Recorder()
    got = samplers.run("dpmpp_sde", rec, x, SIGMAS, seed=seed)
    noise = samplers.BrownianNoise(x, SIGMAS[SIGMAS > 0].min(), SIGMAS.max(), seed)
    sig = snr_sigmas()

    def stage(y, x0, lam_s, lam_t, s, t_sigma):
        e_s, e_t = math.exp(-lam_s), math.exp(-lam_t)  # VE sigmas sigma/alpha
        up = min(e_t, math.sqrt(e_t ** 2 * (e_s ** 2 - e_t ** 2) / e_s ** 2))
        down = math.sqrt(e_t ** 2 - up ** 2)
        alpha_s, alpha_t = 1 - s, 1 - t_sigma
        # exponential integrator in the VE variable x/alpha, landing at e^-lambda = down
        y = alpha_t * (down / e_s * y / alpha_s + (1 - down / e_s) * x0)
        return y, alpha_t * up

    y, seen = x.double(), []
    for i in range(len(sig) - 1):
        s, sn = sig[i], sig[i + 1]
        x0 = gaussian_x0(y, s)
        seen.append(s)
        if sn == 0:
            y = x0
            continue
        ls, lt = half_log_snr(s), half_log_snr(sn)
        ls1 = ls + 0.5 * (lt - ls)
        s1 = 1 / (1 + math.exp(ls1))
        y1, amp = stage(y, x0, ls, ls1, s, s1)
        y1 = y1 + amp * noise(torch.tensor(s), torch.tensor(s1, dtype=torch.float32)).double()
        x01 = gaussian_x0(y1, s1)
        seen.append(s1)
        y, amp = stage(y, x01, ls, lt, s, sn)
        y = y + amp * noise(torch.tensor(s), torch.tensor(sn)).double()
    close(got, y.numpy(), 2e-5)
    assert rec.sigmas == pytest.approx(seen, rel=1e-6)


@pytest.mark.parametrize("name", ["dpmpp_sde", "dpmpp_2m_sde"])
def test_sde_samplers_sample_the_data_distribution(name):
    """With the exact denoiser the SDE solvers end on N(MU, S^2) (30 karras steps: within 3 %); a wrong noise
    scale would not. (The first-order ancestral and LCM samplers lose variance at this step count by design.)"""
    x = start(1, (1, 128, 8, 8))  # 8192 draws
    out = samplers.run(name, gaussian_x0, x, schedules.schedule("karras", 30), seed=1)
    assert float(out.mean()) == pytest.approx(MU, abs=0.03)
    assert float(out.std()) == pytest.approx(S, rel=0.03)


@pytest.mark.parametrize("name", samplers.SAMPLERS)
def test_determinism_by_seed(name):
    x = start()
    a = samplers.run(name, gaussian_x0, x, SIGMAS, seed=42)
    assert torch.equal(a, samplers.run(name, gaussian_x0, x, SIGMAS, seed=42))
    other = samplers.run(name, gaussian_x0, x, SIGMAS, seed=43)
    assert torch.equal(a, other) == (name in ("euler", "heun", "dpmpp_2m"))


def test_unknown_sampler():
    with pytest.raises(ValueError, match=r"unknown sampler 'dpm_fast'.*euler"):
        samplers.run("dpm_fast", gaussian_x0, start(), SIGMAS)
    from vramgraph.nodes.core import SAMPLERS

    assert tuple(SAMPLERS) == samplers.SAMPLERS


# ------------------------------------------------------------------------------------- Brownian noise


def test_brownian_tree_is_a_brownian_motion():
    tree = samplers.BrownianTree(0.01, 1.0, (40000,), entropy=123)
    a, b, c = 0.2, 0.45, 0.9
    ab, bc, ac = tree.increment(a, b), tree.increment(b, c), tree.increment(a, c)
    assert torch.allclose(ab + bc, ac, atol=1e-5)  # increments add up
    assert float(ab.var()) == pytest.approx(b - a, rel=0.05) and float(bc.var()) == pytest.approx(c - b, rel=0.05)
    assert abs(float((ab * bc).mean())) < 0.015  # disjoint increments are independent
    root = torch.randn(40000, generator=torch.Generator().manual_seed(
        int(np.random.SeedSequence(123, pool_size=24).generate_state(3)[0]))) * math.sqrt(0.99)
    assert torch.equal(tree.increment(0.01, 1.0), root)  # the root is the first SeedSequence state's draw
    assert torch.equal(tree.increment(0.3, 0.3), torch.zeros(40000))
    again = samplers.BrownianTree(0.01, 1.0, (40000,), entropy=123)
    assert torch.equal(again.increment(b, c), bc)  # the same numbers whatever was asked before


@pytest.mark.filterwarnings("ignore:Should have ta>=t0")  # torchsde clamps a query below t0 that rounds to it
def test_brownian_noise_matches_torchsde():
    torchsde = pytest.importorskip("torchsde")
    x = torch.zeros(2, 128, 3, 5)
    for scheduler, seed in (("karras", 12345), ("simple", 0), ("beta", 2**63 + 5)):
        sig = schedules.schedule(scheduler, 8)
        lo, hi = sig[sig > 0].min(), sig.max()
        ours = samplers.BrownianNoise(x, lo, hi, seed)
        tree = torchsde.BrownianTree(lo, torch.zeros_like(x), hi, entropy=seed)  # as ComfyUI builds it

        def reference(s, sn, tree=tree):
            w = tree(sn.float(), s.float()) * -1  # ComfyUI sorts the query and flips the sign back
            return w / (sn - s).abs().sqrt()

        for i in range(len(sig) - 2):
            for sn in (sig[i + 1], (sig[i] + sig[i + 1]) / 2):
                assert torch.equal(ours(sig[i], sn), reference(sig[i], sn))
