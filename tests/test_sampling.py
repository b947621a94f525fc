"""Schedule, noise, packing and the Euler/CFG loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from vramgraph.models import sampling

# (side, mu, sigmas) for 4 steps: the reference test vectors (shared/reference/flux2-klein.md)
VECTORS = [
    (1024, 2.291180, [1, 0.967384, 0.908144, 0.767200, 0]),
    (512, 2.030690, [1, 0.958085, 0.883982, 0.717497, 0]),
    (2048, 3.229986, [1, 0.986986, 0.961947, 0.893915, 0]),
]


@pytest.mark.parametrize(("side", "mu", "want"), VECTORS)
def test_schedule_vectors(side, mu, want):
    seq = (side // 16) ** 2
    assert sampling.empirical_mu(seq, 4) == pytest.approx(mu, abs=1e-6)
    assert sampling.sigmas(4, seq) == pytest.approx(want, abs=1e-6)


def test_schedule_matches_diffusers_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")
    for seq, steps in ((4096, 4), (1024, 50), (9000, 20), (16, 1)):
        mu = compute_empirical_mu(seq, steps)
        assert sampling.empirical_mu(seq, steps) == pytest.approx(mu, rel=1e-12)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        assert sampling.sigmas(steps, seq) == pytest.approx(sched.sigmas.tolist(), abs=1e-6)


def test_noise_is_comfyui_noise_on_any_device():
    torch.manual_seed(1234)
    want = torch.randn((2, 128, 4, 5), dtype=torch.float32, generator=torch.manual_seed(1234), device="cpu")
    got = sampling.noise(1234, 2, 4, 5)
    assert torch.equal(got, want)
    assert not torch.equal(got, sampling.noise(1235, 2, 4, 5))
    assert got.device.type == "cpu" and got.dtype == torch.float32


def test_pack_unpack_row_major():
    lat = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
    tok = sampling.pack(lat)
    assert tok.shape == (2, 20, 3)
    assert torch.equal(tok[0, 6], lat[0, :, 1, 1])  # token 6 = row 1, column 1
    assert torch.equal(sampling.unpack(tok, 4, 5), lat)


def test_latent_size_rejects_bad_sides():
    assert sampling.latent_size(1024, 512) == (32, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        sampling.latent_size(1000, 1024)


def test_reference_preparation_area_and_multiples():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (1500, 1100, 3), dtype=np.uint8))
    px = sampling.prepare_reference(img)
    _, c, h, w = px.shape
    assert c == 3 and h % 16 == 0 and w % 16 == 0 and h * w <= 1024 * 1024
    assert h > w and px.min() >= -1 and px.max() <= 1
    small = sampling.prepare_reference(Image.new("RGB", (100, 70), (255, 0, 0)))
    assert small.shape == (1, 3, 64, 96)
    assert torch.allclose(small[0, :, 10, 10], torch.tensor([1.0, -1.0, -1.0]))


def test_reference_ids_step_in_time():
    refs = sampling.pack_references([torch.zeros(1, 128, 2, 3), torch.zeros(1, 128, 4, 1)])
    assert refs.tokens.shape == (1, 10, 128)
    assert refs.ids[:6, 0].tolist() == [10] * 6 and refs.ids[6:, 0].tolist() == [20] * 4
    assert refs.ids[5].tolist() == [10, 1, 2, 0]


class _Velocity(torch.nn.Module):
    """A stand-in transformer: v = mean of context + sigma, per sample; records its inputs."""

    def __init__(self):
        super().__init__()
        from vramgraph.models.flux2 import Flux2Config

        self.cfg = Flux2Config(hidden=8, heads=1, head_dim=128)
        self.img_in = torch.nn.Linear(1, 1)
        self.calls = []

    @property
    def dtype(self):
        return torch.float32

    def forward(self, img, txt, sigma, rope, n):
        self.calls.append((img.shape, txt.shape, sigma.clone(), rope.shape, n))
        v = txt.mean(dim=(1, 2))[:, None, None] + sigma[:, None, None]
        return v.expand(img.shape[0], n, img.shape[2])


def test_euler_with_cfg_and_references():
    model = _Velocity()
    lat = torch.zeros(1, 128, 2, 2)
    ctx, neg = torch.full((1, 5, 3), 2.0), torch.full((1, 5, 3), 1.0)
    refs = sampling.pack_references([torch.zeros(1, 128, 1, 3)])
    sig = [1.0, 0.5, 0.0]
    out = sampling.sample(model, lat, ctx, sig, negative=neg, guidance=3.0, references=refs)
    # v = u + g (c - u) = (1 + s) + 3 * 1 ; x = sum (s_next - s) v
    want = (0.5 - 1.0) * (2.0 + 3.0) + (0.0 - 0.5) * (1.5 + 3.0)
    assert torch.allclose(out, torch.full_like(out, want))
    img_shape, txt_shape, s, rope_shape, n = model.calls[0]
    assert img_shape == (2, 4 + 3, 128) and txt_shape == (2, 5, 3) and n == 4
    assert rope_shape[0] == 5 + 4 + 3
    assert s.tolist() == [1.0, 1.0] and len(model.calls) == 2
    # guidance 1 runs one pass without the negative
    model.calls.clear()
    sampling.sample(model, lat, ctx, sig, negative=neg, guidance=1.0)
    assert model.calls[0][0] == (1, 4, 128)
