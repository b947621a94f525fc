"""Models are found the way ComfyUI finds them: a ComfyUI root or a folder one level too deep given to --models,
ComfyUI's extra_model_paths.yaml (its format and search order), and a "not found" that names the file, the folders
searched, the closest name and how to fetch it. Real folders and files; names only (empty files) where nothing is
loaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vramgraph.cli import main
from vramgraph.graph.engine.runtime import Settings, folders_from
from vramgraph.nodes.modelpaths import models_root, read_extra_model_paths

T2I = Path(__file__).resolve().parents[1] / "workflows" / "text_to_image.json"


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_a_comfyui_root_or_a_kind_folder_is_taken_for_its_models_folder(tmp_path: Path) -> None:
    root = tmp_path / "ComfyUI"
    touch(root / "models" / "vae" / "flux2-vae.safetensors")
    touch(root / "models" / "diffusion_models" / "x.safetensors")
    assert models_root(root) == root / "models"
    assert models_root(root / "models") == root / "models"
    assert models_root(root / "models" / "diffusion_models") == root / "models"
    assert models_root(tmp_path / "elsewhere") == tmp_path / "elsewhere"  # not ours to guess: taken as given
    for given in (root, root / "models", root / "models" / "diffusion_models"):
        folders = folders_from(Settings(models=[given]))
        assert folders.list("vae") == ["flux2-vae.safetensors"], given


def test_extra_model_paths_yaml_follows_comfyuis_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """base_path with ~ and $VARS, relative to the YAML's folder; a '|' block of several paths; legacy names (clip,
    unet); is_default puts a group's folders before the models folder, others come after; groups without base_path
    join paths to the YAML's folder."""
    share = tmp_path / "share"
    touch(share / "enc_a" / "qwen_3_4b.safetensors")
    touch(share / "enc_b" / "other_te.safetensors")
    touch(share / "unets" / "flux-2-klein-4b.safetensors")
    touch(tmp_path / "ComfyUI" / "fast" / "flux-2-klein-4b.safetensors")
    touch(tmp_path / "ComfyUI" / "models" / "diffusion_models" / "flux-2-klein-4b.safetensors")
    monkeypatch.setenv("SHARE_DIR", "share")
    (tmp_path / "ComfyUI" / "extra_model_paths.yaml").write_text(
        "shared:\n"
        "    base_path: ../$SHARE_DIR\n"
        "    clip: |\n"
        "        enc_a\n"
        "        enc_b\n"
        "    unet: unets/\n"
        "mine:\n"
        "    is_default: true\n"
        "    diffusion_models: fast\n"
        "empty:\n", encoding="utf-8")
    extra = read_extra_model_paths(tmp_path / "ComfyUI" / "extra_model_paths.yaml")
    assert [(e.folder, e.path, e.is_default) for e in extra] == [
        ("text_encoders", share / "enc_a", False), ("text_encoders", share / "enc_b", False),
        ("diffusion_models", share / "unets", False), ("diffusion_models", tmp_path / "ComfyUI" / "fast", True)]
    folders = folders_from(Settings(models=[tmp_path / "ComfyUI"]))  # the root's YAML is read, as ComfyUI does
    assert folders.list("text_encoders") == ["other_te.safetensors", "qwen_3_4b.safetensors"]
    assert folders.model_dirs("diffusion_models") == [tmp_path / "ComfyUI" / "fast",
                                                      tmp_path / "ComfyUI" / "models" / "diffusion_models",
                                                      share / "unets"]
    assert folders.resolve("diffusion_models", "flux-2-klein-4b.safetensors") == \
        (tmp_path / "ComfyUI" / "fast" / "flux-2-klein-4b.safetensors").resolve()
    assert folders.download_dir("diffusion_models") == tmp_path / "ComfyUI" / "fast"


def test_a_yaml_given_by_flag_or_config(tmp_path: Path) -> None:
    touch(tmp_path / "store" / "vae" / "flux2-vae.safetensors")
    yaml = tmp_path / "paths.yaml"
    yaml.write_text(f"store:\n  base_path: {tmp_path / 'store'}\n  vae: vae\n", encoding="utf-8")
    assert folders_from(Settings(extra_model_paths=[yaml])).list("vae") == ["flux2-vae.safetensors"]
    config = tmp_path / "vramgraph.json"
    config.write_text(f'{{"extra_model_paths": "{yaml}"}}')
    assert folders_from(Settings(config=config)).list("vae") == ["flux2-vae.safetensors"]
    with pytest.raises(ValueError, match="no such file"):
        folders_from(Settings(extra_model_paths=[tmp_path / "nope.yaml"]))
    yaml.write_text("store: [unclosed\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"paths\.yaml: not valid YAML"):
        folders_from(Settings(extra_model_paths=[yaml]))


def test_not_found_names_the_folders_the_closest_file_and_how_to_fetch(tmp_path: Path) -> None:
    models = tmp_path / "models"
    touch(models / "diffusion_models" / "flux-2-klein-4b-fp8.safetensors")
    touch(models / "vae" / "qwen_3_4b.safetensors")  # a text encoder put in the wrong folder
    folders = folders_from(Settings(models=[models]))
    with pytest.raises(FileNotFoundError) as e:
        folders.resolve("diffusion_models", "flux-2-klein-4b.safetensors")
    msg = str(e.value)
    assert f"searched {models / 'diffusion_models'}" in msg
    assert "did you mean 'flux-2-klein-4b-fp8.safetensors'?" in msg
    assert "vramgraph fetch --model flux-2-klein-4b.safetensors" in msg
    with pytest.raises(FileNotFoundError) as e:
        folders.resolve("text_encoders", "qwen_3_4b.safetensors")
    assert f"no text_encoders/ folder under {models}" in str(e.value) and "it is in vae/" in str(e.value)


def test_validate_says_where_it_looked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    touch(tmp_path / "ComfyUI" / "models" / "vae" / "flux2-vae.safetensors")
    assert main(["validate", str(T2I), "--models", str(tmp_path / "ComfyUI" / "models" / "vae")]) == 1
    err = capsys.readouterr().err
    assert "'flux-2-klein-4b.safetensors' not in [] (the list is empty); no diffusion_models/ folder under " \
           f"{tmp_path / 'ComfyUI' / 'models'};" in err
    assert "vramgraph fetch --model qwen_3_4b.safetensors" in err


def test_validate_finds_models_through_the_yaml_flag(tiny_models: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    yaml = tmp_path / "extra.yaml"
    yaml.write_text(f"tiny:\n  base_path: {tiny_models}\n  diffusion_models: diffusion_models\n"
                    "  text_encoders: text_encoders\n  vae: vae\n", encoding="utf-8")
    assert main(["validate", str(T2I), "--extra-model-paths-config", str(yaml)]) == 0, capsys.readouterr().err


def test_unknown_config_keys_are_refused_with_the_closest(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "vramgraph.json"
    config.write_text('{"model": "/somewhere"}')
    assert main(["validate", str(T2I), "--config", str(config)]) == 2
    assert "unknown key 'model'; did you mean 'models'?" in capsys.readouterr().err


def test_generate_takes_paths_for_its_files(tiny_models: Path, tmp_path: Path) -> None:
    from vramgraph.api.pipeline import Pipeline

    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy(tiny_models / "vae" / "flux2-vae.safetensors", loose / "my-vae.safetensors")
    pipe = Pipeline(models=tiny_models, vae=str(loose / "my-vae.safetensors"), device="cpu")
    assert pipe.files["vae"] == "my-vae.safetensors"
    assert pipe.folders.resolve("vae", "my-vae.safetensors") == (loose / "my-vae.safetensors").resolve()
    out = pipe.generate("a fox", seed=1, width=64, height=64)
    assert out.images[0].size == (64, 64)
    with pytest.raises(ValueError, match=r"nope\.safetensors: no such file"):
        Pipeline(models=tiny_models, transformer=str(tmp_path / "nope.safetensors"))
