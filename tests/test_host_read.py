"""Host loads read tensors byte for byte into one buffer (models/common.py `_host_weights`): the same
weights as the per-tensor path in every layout, converted where the dtype differs, and a clear error for
damaged or truncated files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import save
from refmodels import diffusers_transformer, transformer_to_bfl
from vramgraph.models import common, flux2
from vramgraph.models.headers import CheckpointError, read_header, read_headers, strip_prefix


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    ref = diffusers_transformer(seed=5)
    d = tmp_path_factory.mktemp("hostread")
    bfl = transformer_to_bfl(ref.state_dict())
    save({k: v.to(torch.bfloat16) for k, v in bfl.items()}, d / "bfl_bf16.safetensors")
    save(bfl, d / "bfl_fp32.safetensors")
    ref.to(torch.bfloat16).save_pretrained(d / "hf", max_shard_size="3MB")
    return d


def _infos(files, name):
    if name == "hf":
        return read_headers(sorted((files / "hf").glob("*.safetensors")))
    return strip_prefix(read_header(files / f"{name}.safetensors")[0], flux2.BFL_PREFIXES)


def _per_tensor(infos, dtype):
    """The reference: every tensor read through safetensors' memory map, rearranged and cast one by one."""
    cfg = flux2.config_from_checkpoint(infos)
    srcs = flux2.sources(cfg, infos.keys())
    with torch.device("meta"):
        m = flux2.Flux2Transformer(cfg)
    shapes = {n: (tuple(t.shape), dtype) for n, t in m.state_dict(keep_vars=True).items()}
    return common._tensor_by_tensor(srcs, infos, shapes, torch.device("cpu")), srcs, shapes


@pytest.mark.parametrize(("name", "dtype", "converted"), [("bfl_bf16", torch.bfloat16, 0), ("hf", torch.bfloat16, 0),
                                                          ("bfl_fp32", torch.bfloat16, None)])
def test_same_weights_as_reading_tensor_by_tensor(files, name, dtype, converted):
    infos = _infos(files, name)
    expected, srcs, shapes = _per_tensor(infos, dtype)
    spans = [common._byte_spans(srcs[n], s, infos, dt) for n, (s, dt) in shapes.items()]
    if converted == 0:  # stored in the wanted dtype: every tensor is read in place, q|k|v and swapped halves too
        assert all(s is not None for s in spans)
        ops = {srcs[n].op for n in shapes}
        assert ops >= {"cat0", "swap_halves"} if name == "hf" else ops == {"copy"}
    else:
        assert all(s is None for s in spans)
    model = flux2.load_transformer(infos, dtype=dtype, device="cpu")
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for k in expected:
        assert got[k].dtype == dtype
        assert torch.equal(got[k], expected[k]), k
    # all parameters are views of one buffer
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1


@pytest.mark.parametrize("stage", [4096, 200_000, common.STAGE_BYTES])
@pytest.mark.parametrize("name", ["bfl_bf16", "hf", "bfl_fp32"])
def test_staged_device_path_gives_the_same_weights(files, name, stage, monkeypatch):
    """The path to a GPU (run here on the CPU): pieces through two staging buffers, tensors split across them
    where a stage is smaller than a tensor, converted tensors on their own; every byte as tensor by tensor."""
    infos = _infos(files, name)
    expected, srcs, shapes = _per_tensor(infos, torch.bfloat16)
    monkeypatch.setattr(common, "STAGE_BYTES", stage)
    spans = {n: common._byte_spans(srcs[n], s, infos, dt) for n, (s, dt) in shapes.items()}
    got = common._staged({n: sp for n, sp in spans.items() if sp is not None}, shapes, torch.device("cpu"),
                         stage=stage)
    got.update(common._device_weights(srcs, infos, {n: shapes[n] for n, sp in spans.items() if sp is None}, "cpu"))
    assert got.keys() == expected.keys()
    assert (len(got) > 0 and all(sp is None for sp in spans.values())) == (name == "bfl_fp32")
    for k in expected:
        assert got[k].dtype == expected[k].dtype and got[k].shape == expected[k].shape, k
        assert torch.equal(got[k], expected[k]), k
    whole = common._device_weights(srcs, infos, shapes, "cpu")
    assert all(torch.equal(whole[k], expected[k]) for k in expected)


def test_truncated_file_names_it(files, tmp_path):
    raw = (files / "bfl_bf16.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[: len(raw) - 1000])
    infos = strip_prefix(read_header(cut)[0], flux2.BFL_PREFIXES)  # the header alone is intact
    with pytest.raises(CheckpointError, match=r"cut\.safetensors: the file ends before its tensors do"):
        flux2.load_transformer(infos, dtype=torch.bfloat16)


def test_damaged_header_is_refused(files, tmp_path):
    raw = (files / "bfl_bf16.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8 : 8 + n])
    key = next(k for k in table if k != "__metadata__")
    table[key]["data_offsets"][1] -= 2
    head = json.dumps(table).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n :])
    with pytest.raises(CheckpointError, match="stored size does not match its dtype and shape: the file is damaged") \
            as e:
        read_header(bad)
    assert key not in str(e.value), "the message never quotes the file's header"


@pytest.mark.parametrize(("content", "reason"), [
    (b"root:x:0:0:root:/root:/bin/bash\n", "its header length is not plausible"),
    (b"\x10\x00\x00\x00\x00\x00\x00\x00[1, 2, 3]   ", "its header is not a table of tensors"),
    (b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}", "a tensor in its header is described wrongly"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00{{", "its header is not JSON"),
    (b"\x00" * 8 + b"secret", "its header length is not plausible"), (b"secrets", "too short to be one")])
def test_a_file_that_is_no_checkpoint_is_never_quoted(tmp_path, content, reason):
    """The reader's errors name the file and what is wrong, never bytes of it or numbers read from it."""
    path = tmp_path / "passwd"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"passwd: not a safetensors file \({reason}\)$") as e:
        read_header(path)
    message = str(e.value)
    for leaked in ("root", str(struct.unpack("<Q", content[:8].ljust(8, b"\0"))[0]), "secret", "[1, 2, 3]", '"a"'):
        assert leaked not in message.replace(str(tmp_path), ""), (leaked, message)
