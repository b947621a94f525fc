"""`--vram` as people name cards (docs/cards.md): 8GiB, 8GB and 8G are the card sold as 8 GB; a request a little above
the device's total is the whole card; a rejected plan names the --vram that works, and that --vram plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vramgraph.api.pipeline import Pipeline
from vramgraph.cli.main import main
from vramgraph.graph.engine import budget as budget_mod
from vramgraph.graph.engine.budget import WHOLE_CARD, card_needed, card_on_device, parse_size, whole_card
from vramgraph.graph.plan.planner import GiB, PlanError

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
WORKFLOW = str(ROOT / "workflows" / "text_to_image.json")
# CUDA totals (torch's "total capacity") that real cards report on Linux, and the size each is sold as; the sources
# are in docs/cards.md. The driver keeps 0.2-0.4 GiB of each for itself.
REPORTED = [(7.75, 8), (7.76, 8), (7.78, 8), (7.80, 8), (9.78, 10), (10.76, 11), (11.75, 12), (5.79, 6), (23.61, 24),
            (23.64, 24), (23.68, 24)]
NVIDIA_SMI = [(8188, 8), (8192, 8), (12282, 12), (12288, 12), (24564, 24), (24576, 24)]  # MiB, GB


@pytest.mark.parametrize("text", ["8GiB", "8GB", "8G", "8 gb", "8g", "8gib", "8192MiB", "8192MB", "8192M"])
def test_every_way_of_naming_an_8_gb_card_is_8_gib(text: str) -> None:
    assert parse_size(text) == 8 * GiB


def test_sizes_without_a_unit_or_with_an_unknown_one_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="write 12GiB"):
        parse_size("12")
    with pytest.raises(ValueError, match="12GB"):
        parse_size("12 gigs")


@pytest.mark.parametrize(("total_gib", "sold"), REPORTED + [(m / 1024, g) for m, g in NVIDIA_SMI])
def test_the_size_a_card_is_sold_as_is_the_whole_card(total_gib: float, sold: int) -> None:
    """On a real card `--vram 8GB` is the whole card, whatever less than 8 GiB its driver reports, and whole_card
    names it as sold."""
    total = int(total_gib * GiB)
    assert card_on_device(sold * GiB, total) == total
    assert whole_card(total) == f"{sold}GB"
    assert card_on_device(total - GiB, total) == total - GiB  # a smaller card is emulated as itself


def test_a_card_larger_than_the_device_is_refused_naming_what_to_write() -> None:
    total = int(10.76 * GiB)  # an 11 GB RTX 2080 Ti
    with pytest.raises(ValueError, match=r"--vram 12GB is more than this device has: it reports 10\.76 GiB .*--vram "
                                         r"11GB for the whole card"):
        card_on_device(12 * GiB, total, "12GB")
    ecc = int(44.43 * GiB)  # an RTX 6000 Ada sold as 48 GB, with ECC on: no whole GiB near its total
    assert card_on_device(int(ecc * (1 + WHOLE_CARD)), ecc) == ecc
    with pytest.raises(ValueError, match="for the whole card"):
        card_on_device(48 * GiB, ecc, "48GB")


def test_the_budget_on_a_real_8_gb_card(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device reporting 8188 MiB: --vram 8GiB, 8GB and 8G are all the whole card (they were refused), the same
    budget as --vram 8188MiB; torch's allocator is capped below the card."""
    torch = pytest.importorskip("torch")
    total, context = 8188 * MiB, 500 * MiB
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: 0)
    monkeypatch.setattr(budget_mod, "blas_workspace", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (total - context, total))
    caps: list[float] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, index=None: caps.append(f))
    exact = budget_mod.budget_for("cuda", "8188MiB", host="32GiB")
    for text in ("8GiB", "8GB", "8G"):
        b = budget_mod.budget_for("cuda", text, host="32GiB")
        assert b == exact and b.card == total
        assert b.gpu == total - context - budget_mod.CARD_MARGIN - b.reserve
        assert 0 < caps[-1] < 1
    with pytest.raises(ValueError, match="--vram 8GB for the whole card"):
        budget_mod.budget_for("cuda", "9GB", host="32GiB")
    with pytest.raises(ValueError, match=r"leaves nothing.*give a card larger than 0\.77GiB"):  # 500 + 160 + 128 MiB
        budget_mod.budget_for("cuda", "700MiB", host="32GiB")


def _rejection(args: list[str], capsys: pytest.CaptureFixture) -> dict:
    assert main(["plan", WORKFLOW, *args, "--json", "--svg", ""]) == 3
    return json.loads(capsys.readouterr().err)["error"]


def test_a_rejected_plan_names_the_vram_that_plans(capsys: pytest.CaptureFixture) -> None:
    """The budget a node needs is what is left of a card after the context, the margin and the reserve: the message
    names the card (the --vram to type), and that card plans where a hundredth of a GiB less does not."""
    error = _rejection(["--vram", "2GiB"], capsys)
    vram = error["extra_info"]["min_vram"]
    assert f"plan with --vram {vram} or larger" in error["message"]
    need = error["extra_info"]["min_card_bytes"]
    assert need == error["extra_info"]["needed_bytes"] + budget_mod.CONTEXT_ESTIMATE + budget_mod.CARD_MARGIN + \
        budget_mod.DEFAULT_RESERVE
    assert parse_size(vram) >= need > parse_size(vram) - GiB // 100
    assert main(["plan", WORKFLOW, "--vram", vram, "--svg", ""]) == 0
    capsys.readouterr()
    smaller = f"{float(vram[:-3]) - 0.01:.2f}GiB"
    assert _rejection(["--vram", smaller], capsys)["extra_info"]["min_vram"] == vram


def test_the_api_names_the_card_too(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path / "no-models", vram="2GB", host="32GiB")
    with pytest.raises(PlanError) as info:
        pipe.plan("text_to_image.json")
    e = info.value
    assert e.to_dict()["extra_info"]["min_vram"] in e.to_dict()["message"]
    assert card_needed(e.needed, pipe.plan("text_to_image.json", vram=e.extra["min_vram"]).budget) == \
        e.extra["min_card_bytes"]


def test_the_card_margin_holds_every_measured_growth_of_the_context() -> None:
    """Each ContextGrowth is its results file's figure (bench/oom_matrix.py: the largest context after a cell less the
    context at the start), and CARD_MARGIN holds the largest; what is not measured is named."""
    assert budget_mod.CONTEXT_GROWTH and budget_mod.UNMEASURED_GROWTH
    for g in budget_mod.CONTEXT_GROWTH:
        report = json.loads((ROOT / g.data.split()[0]).read_text())
        assert report["env"]["gpu"] == g.device
        after = max(c["context_after_gib"] for c in report["cells"] if c.get("context_after_gib") is not None)
        assert g.growth == round((after - report["start_context_gib"]) * 1024) * MiB, g
        assert budget_mod.CARD_MARGIN >= g.growth


def test_the_plan_says_how_its_budget_was_made(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", WORKFLOW, "--vram", "12GB", "--json", "--svg", ""]) == 0
    out = json.loads(capsys.readouterr().out)
    text = out["budget_text"]
    assert text.startswith("card 12.00 GiB = budget 11.02 + CUDA context and cuBLAS workspace 0.70 (the H200's, "
                           "estimated: planned off the GPU) + card margin 0.16")
    assert all(path in text for path in budget_mod.UNMEASURED_GROWTH)
