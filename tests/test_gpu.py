"""The same models and pipeline on a CUDA device (skipped without one): results agree with the CPU and
with diffusers on the GPU, in fp32 and bf16, and a seed gives the same starting latent on any device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import rel_l2, save
from refmodels import diffusers_transformer, diffusers_vae, transformer_to_bfl, transformers_qwen3, vae_to_bfl
from vramgraph.models.pipeline import generate, load_models

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    m = tmp_path_factory.mktemp("gpu") / "models"
    save(transformer_to_bfl(diffusers_transformer(seed=1).state_dict()), m / "diffusion_models" / "t.safetensors")
    te = transformers_qwen3(seed=2).state_dict()
    save({k: v for k, v in te.items() if k != "lm_head.weight"}, m / "text_encoders" / "q.safetensors")
    save(vae_to_bfl(diffusers_vae(seed=3).state_dict(), 4), m / "vae" / "v.safetensors")
    return m


def test_generation_on_gpu_matches_cpu(models_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    kw = dict(width=64, height=48, seed=7)
    cpu = generate(load_models(models_dir, dtype=torch.float32), ["a kite", "two kites"], **kw)
    gpu = generate(load_models(models_dir, dtype=torch.float32, device="cuda"), ["a kite", "two kites"], **kw)
    assert gpu.device.type == "cuda"
    assert rel_l2(gpu.cpu(), cpu) < 1e-4
    bf16 = generate(load_models(models_dir, device="cuda"), ["a kite", "two kites"], **kw)
    assert bf16.dtype == torch.bfloat16 and rel_l2(bf16.float().cpu(), cpu) < 5e-2


def test_transformer_bf16_on_gpu_matches_diffusers():
    from vramgraph.models import flux2
    from vramgraph.models.common import infos_from_state_dict

    ref = diffusers_transformer(seed=4).cuda().bfloat16()
    ours = flux2.load_transformer(infos_from_state_dict(ref.state_dict()), device="cuda")
    g = torch.Generator().manual_seed(0)
    img, ctx = torch.randn(2, 24 + 9, 128, generator=g).cuda(), torch.randn(2, 16, 192, generator=g).cuda()
    ids = torch.cat([flux2.image_ids(4, 6), flux2.image_ids(3, 3, 10)])
    sigma = torch.tensor([0.8, 0.3]).cuda()
    with torch.no_grad():
        want = ref(hidden_states=img.bfloat16(), encoder_hidden_states=ctx.bfloat16(), timestep=sigma.bfloat16(),
                   img_ids=ids.cuda(), txt_ids=flux2.text_ids(16).cuda(), guidance=None, return_dict=False)[0][:, :24]
        got = ours(img, ctx, sigma, flux2.rope_table(ours.cfg, torch.cat([flux2.text_ids(16), ids]), "cuda"), 24)
    assert rel_l2(got.float(), want.float()) < 3e-2


@pytest.mark.gpu
def test_planned_swaps_on_the_gpu_give_the_same_image(tmp_path):
    """Tight budget on CUDA: pinned one-buffer loads/unloads between nodes; same pixels as all resident."""
    import json

    import numpy as np
    from PIL import Image
    from vramgraph.graph.engine.budget import Budget
    from vramgraph.graph.engine.executor import Engine
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
    from vramgraph.nodes.files import Folders

    models = write_tiny_models(tmp_path / "models", names=SHIPPED_NAMES)
    wf = json.loads((Path(__file__).resolve().parents[1] / "workflows" / "text_to_image.json").read_text())
    wf["5"]["inputs"].update(width=128, height=128)
    images = []
    for budget in (None, "tight"):
        folders = Folders(models=(models,), input=tmp_path, output=tmp_path / f"out-{budget}", temp=tmp_path / "t")
        engine = Engine(folders, device="cuda")
        if budget == "tight":
            prep = engine.prepare(wf)
            sizes = sorted(e.info.nbytes for e in engine.ledger.entries.values())
            act = max(o.activation for c in prep.costs.values() for o in c.variants)
            engine.budget = Budget(gpu=sizes[-1] + sizes[0] + act + 2**20, host=8 * 2**30)
        for i in range(2):
            wf["4"]["inputs"]["text"] = f"prompt {i}"
            result = engine.run(wf)
        if budget == "tight":
            unloaded = {e.model for e in engine.ledger.events if e.kind == "unload"}
            assert unloaded and all(engine.ledger.entries[k].pinned for k in unloaded)
        images.append(np.asarray(Image.open(result.images[0])))
    assert np.array_equal(images[0], images[1])


@pytest.mark.gpu
def test_streamed_text_encoder_from_pinned_memory_matches_resident(tmp_path):
    """The text encoder streamed layer by layer from its pinned one-buffer copy gives the resident result."""
    from vramgraph.graph.engine.ledger import Ledger
    from vramgraph.models.qwen3 import PromptTokenizer, encode_prompts, encode_prompts_streamed
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
    from vramgraph.nodes.catalog import ModelCatalog
    from vramgraph.nodes.files import Folders

    models = write_tiny_models(tmp_path / "models", names=SHIPPED_NAMES)
    info = ModelCatalog(Folders(models=(models,))).model_info("text_encoder", SHIPPED_NAMES["text_encoder"])
    ledger = Ledger(torch.device("cuda"))
    ledger.register(info)
    tok = PromptTokenizer.bundled()
    ledger.pin(info.key)
    streamed = encode_prompts_streamed(ledger.host_module(info.key), tok, ["a kite"], torch.device("cuda"))
    assert next(ledger.host_module(info.key).parameters()).is_pinned()
    ledger.load(info.key, "pinned")
    resident = encode_prompts(ledger.module(info.key), tok, ["a kite"])
    assert torch.equal(streamed, resident)


@pytest.mark.gpu
def test_engine_peaks_span_all_nodes_of_a_run(tmp_path):
    """The server's /peer/mem peak covers a whole run, though the executor restarts torch's counters per node."""
    import json

    from vramgraph.graph.engine.executor import Engine
    from vramgraph.models.tiny import SHIPPED_NAMES, write_tiny_models
    from vramgraph.nodes.files import Folders

    models = write_tiny_models(tmp_path / "models", names=SHIPPED_NAMES)
    wf = json.loads((Path(__file__).resolve().parents[1] / "workflows" / "text_to_image.json").read_text())
    wf["5"]["inputs"].update(width=256, height=256)
    engine = Engine(Folders(models=(models,), input=tmp_path, output=tmp_path / "out", temp=tmp_path / "t"),
                    device="cuda")
    engine.peaks(reset=True)
    result = engine.run(wf)
    allocated, reserved = engine.peaks()
    biggest = max(result.nodes, key=lambda n: n.measured_bytes)
    assert biggest.class_type != "VGSaveImage" and biggest.measured_bytes > 0
    assert allocated >= biggest.measured_bytes and reserved >= allocated
    assert engine.peaks(reset=True)[0] == torch.cuda.memory_allocated()
