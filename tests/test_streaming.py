"""The streamed forward (models/streaming.py) on the CPU: the same partition of blocks into resident and streamed
ones as on the GPU, the streamed ones copied through the staging buffers, and the same bits as the resident model."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from vramgraph.models.flux2 import Flux2Transformer
from vramgraph.models.qwen3 import Qwen3Encoder
from vramgraph.models.sampling import sample
from vramgraph.models.streaming import _tensors, block_bytes, stream_blocks
from vramgraph.models.tiny import TINY_QWEN3, TINY_TRANSFORMER

CFG = dataclasses.replace(TINY_TRANSFORMER, depth_double=2, depth_single=3)


@pytest.fixture(scope="module")
def dit() -> Flux2Transformer:
    torch.manual_seed(0)
    return Flux2Transformer(CFG).eval().requires_grad_(False)


def _run(model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(1)
    lat = torch.randn(1, 128, 4, 4)
    ctx = torch.randn(1, 8, CFG.context_dim)
    return sample(model, lat, ctx, [1.0, 0.6, 0.3, 0.0])


@pytest.mark.parametrize("resident", [(), (0,), (1, 3), (0, 1, 2, 3), (0, 1, 2, 3, 4)])
def test_streamed_sampler_equals_resident_bit_for_bit(dit: Flux2Transformer, resident: tuple[int, ...]) -> None:
    ref = _run(dit)
    blocks = dit.streamed_blocks()
    homes = {id(t): t.data_ptr() for b in blocks for _, _, t in _tensors(b)}
    seen: dict[int, list[int]] = {}

    def spy(i: int):
        def hook(mod: torch.nn.Module, args: object) -> None:
            seen.setdefault(i, []).append(next(iter(mod.parameters())).data_ptr())
        return hook

    with stream_blocks(dit, "cpu", resident) as m:
        # registered after the streamer's own hooks, so they see the weights the block computes with
        handles = [b.register_forward_pre_hook(spy(i)) for i, b in enumerate(blocks)]
        out = _run(m)
        for h in handles:
            h.remove()
    assert torch.equal(out, ref)
    for i, b in enumerate(blocks):
        home = next(iter(b.parameters())).data_ptr()
        assert len(seen[i]) == 3  # once per step
        if i in resident:
            assert all(p == seen[i][0] for p in seen[i])  # one copy for the whole node
        else:
            assert home not in seen[i]  # computed from a staging buffer, never from the host copy
    assert all(t.data_ptr() == homes[id(t)] for b in blocks for _, _, t in _tensors(b))  # every weight is back home


def test_staging_alternates_between_two_buffers(dit: Flux2Transformer) -> None:
    order: list[int] = []
    blocks = dit.streamed_blocks()
    with stream_blocks(dit, "cpu", (0,)) as m:
        handles = [b.register_forward_pre_hook(lambda mod, a: order.append(next(iter(mod.parameters())).data_ptr()))
                   for b in blocks[1:]]
        _run(m)
        for h in handles:
            h.remove()
    assert len(set(order)) == 2  # the first tensor of each streamed block sits at offset 0 of one of two buffers
    assert all(a != b for a, b in itertools.pairwise(order))


def test_blocks_out_of_order_are_refused(dit: Flux2Transformer) -> None:
    x = torch.randn(1, 20, CFG.hidden)
    mod = tuple(torch.zeros(1, 1, CFG.hidden) for _ in range(3))
    rope = torch.zeros(20, CFG.head_dim // 2, 2, 2)
    with stream_blocks(dit, "cpu", ()), pytest.raises(RuntimeError, match="streamed block 3 ran where block 0"):
        dit.single_blocks[1](x, mod, rope)
    with pytest.raises(ValueError, match="out of range"), stream_blocks(dit, "cpu", (9,)):
        pass


def test_block_bytes_match_the_estimate(dit: Flux2Transformer) -> None:
    from vramgraph.models.flux2_config import parameter_shapes
    from vramgraph.nodes.estimates import _grouped

    total = sum(p.numel() * p.element_size() for p in dit.parameters())
    sizes, fixed = _grouped(parameter_shapes(CFG), ("double_blocks.", "single_blocks."), total)
    assert sizes == block_bytes(dit)
    assert fixed + sum(sizes) == total


def test_streamed_text_encoder_equals_resident() -> None:
    torch.manual_seed(0)
    enc = Qwen3Encoder(TINY_QWEN3).eval().requires_grad_(False)
    ids = torch.randint(0, 1000, (1, 12))
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, 9:] = 0
    with torch.inference_mode():
        ref = enc(ids, mask)
        for resident in ((), tuple(range(0, TINY_QWEN3.n_built, 2))):
            assert torch.equal(enc.forward_streamed(ids, mask, torch.device("cpu"), resident=resident), ref)


def test_sequential_cfg_matches_batched(dit: Flux2Transformer) -> None:
    """The "stream-cfg" variant runs CFG's two passes one after the other: the same velocity up to rounding."""
    torch.manual_seed(2)
    lat = torch.randn(1, 128, 4, 4)
    pos, neg = torch.randn(1, 8, CFG.context_dim), torch.randn(1, 8, CFG.context_dim)
    sig = [1.0, 0.5, 0.0]
    ref = sample(dit, lat, pos, sig, negative=neg, guidance=3.0)
    with stream_blocks(dit, "cpu", (1,)) as m:
        got = sample(m, lat, pos, sig, negative=neg, guidance=3.0, sequential_cfg=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(sample(dit, lat, pos, sig, negative=neg, guidance=1.5), ref)  # guidance matters here


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_engine_keeps_a_streamed_models_resident_part_for_the_next_prompt(tmp_path, device: str) -> None:
    """A 50 MiB budget (25 in bf16) streams a 10-block tiny transformer (44 MiB in fp32, beside a 41 MiB text encoder
    that streams too).
    After the first prompt the sampler's resident part stays on the device (on the CPU the same code path, with plain
    copies): the second prompt's sampler computes from that very buffer, uploads nothing before its first step, and
    both images are bit for bit those of an engine on the same device with room for everything."""
    import numpy as np
    from PIL import Image
    from safetensors.torch import save_file
    from vramgraph.graph.engine.budget import Budget
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.graph.plan import residency
    from vramgraph.graph.plan.planner import CostModel
    from vramgraph.graph.workflow.roles import build_prompt
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
    from vramgraph.nodes.files import Folders

    models = write_tiny_models(tmp_path / "models", names=SHIPPED_NAMES)
    torch.manual_seed(3)
    deep = Flux2Transformer(dataclasses.replace(TINY_TRANSFORMER, depth_double=2, depth_single=8))
    save_file({k: v.contiguous() for k, v in deep.state_dict().items()},
              str(models / "diffusion_models" / "flux-2-klein-4b.safetensors"))

    def folders(name: str) -> Folders:
        return Folders(models=(models,), input=tmp_path, output=tmp_path / name, temp=tmp_path / "temp")

    mib = 50 if device == "cpu" else 25  # the same plan in fp32 (the CPU's default) and bf16 (CUDA's) ...
    cost = CostModel()  # ... with the same costs (a CUDA engine would probe its own, and might plan otherwise)
    small = Engine(folders("small"), device=device, budget=Budget(gpu=mib * 2**20, host=8 * 2**30), cost=cost)
    roomy = Engine(folders("roomy"), device=device, cost=cost)
    buffers, reused = [], []
    for i in range(2):
        prompt = build_prompt(f"prompt {i}", width=64, height=64, seed=7 + i)
        got, want = small.run(prompt), roomy.run(prompt)
        assert np.array_equal(np.asarray(Image.open(got.images[0])), np.asarray(Image.open(want.images[0])))
        (sampler,) = [s for s in got.plan.steps if s.blocks is not None and s.blocks.model.startswith("transformer")]
        reused.append(sampler.blocks.reused)
        part = residency.part_key(sampler.blocks.model, sampler.blocks.resident)
        assert part in small.ledger.on_gpu and part in got.plan.end.gpu  # the ledger holds what the plan says
        kept = small.ledger.kept(sampler.blocks.model)
        assert kept.buffer.device.type == device
        buffers.append(kept.buffer)
        (cost,) = [m for m in small.ledger.residency().kept if m.key == part]
        assert cost.nbytes == kept.buffer.numel() >= sampler.blocks.resident_bytes  # its real bytes, aligned
    assert reused[0] == 0 and reused[1] == sampler.blocks.resident_bytes > 0
    assert buffers[1] is buffers[0]  # the same buffer: the second sampler did not upload its resident part again
