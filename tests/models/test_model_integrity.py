"""A model whose weights are damaged never decodes: a converted-model cache entry whose bytes were
overwritten in place (same size, same header) fails its checksum and is converted again, or named
where it cannot be replaced; an entry written before checksums is converted again; and any loaded
model whose logits are NaN or infinite is refused by name."""

import json
import struct

import pytest
import torch

from specdec import models
from specdec.core.errors import InvalidInput
from specdec.models import (
    ModelSpec,
    check_finite_logits,
    context_length_of,
    load_model,
    tiny_random_model,
    tiny_random_tokenizer,
)

IDS = torch.tensor([[5, 9, 200, 3]])  # [1, T]




def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


def _overwrite_tensor_bytes(weights) -> None:
    """Overwrite the first bytes of every tensor with 0xFF (a float32 NaN), in place: the size and the
    header stay as they were, as after a faulty copy or disk."""
    with open(weights, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    with open(weights, "r+b") as f:
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                f.seek(8 + n + start)
                f.write(b"\xff" * min(end - start, 64))


def test_bytes_overwritten_in_place_fail_the_checksum_and_are_converted_again(fake_gguf, tmp_path, caplog):
    gguf, calls = fake_gguf
    load_model(ModelSpec(gguf_file=str(gguf)))
    (entry,) = (tmp_path / "cache").iterdir()
    weights = entry / "model.safetensors"
    size, manifest = weights.stat().st_size, (entry / models.MANIFEST).read_text()
    _overwrite_tensor_bytes(weights)
    assert weights.stat().st_size == size and models._safetensors_problem(weights) is None  # sizes and header pass
    model, _ = load_model(ModelSpec(gguf_file=str(gguf)))
    assert len(calls) == 2
    assert f"{weights}: its SHA-256 is not the one written at conversion" in caplog.text
    assert "converting it again" in caplog.text
    assert (entry / models.MANIFEST).read_text() == manifest  # the same conversion, the same checksums
    assert torch.equal(_logits(model, IDS), _logits(tiny_random_model(seed=5), IDS))


def test_a_damaged_entry_that_cannot_be_replaced_is_named_with_what_to_delete(fake_gguf, tmp_path, monkeypatch):
    gguf, _ = fake_gguf
    load_model(ModelSpec(gguf_file=str(gguf)))
    (entry,) = (tmp_path / "cache").iterdir()
    _overwrite_tensor_bytes(entry / "model.safetensors")

    def read_only(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(models.os, "rename", read_only)  # someone else's cache, read-only to us
    with pytest.raises(RuntimeError, match=rf"{entry} is damaged .*SHA-256.*delete {entry}"):
        load_model(ModelSpec(gguf_file=str(gguf)))


def test_the_manifest_records_a_checksum_of_every_file(fake_gguf, tmp_path):
    gguf, _ = fake_gguf
    load_model(ModelSpec(gguf_file=str(gguf)))
    (entry,) = (tmp_path / "cache").iterdir()
    manifest = json.loads((entry / models.MANIFEST).read_text())
    assert set(manifest["sha256"]) == set(manifest["files"]) and "model.safetensors" in manifest["files"]
    assert manifest["sha256"]["config.json"] == models._sha256(entry / "config.json")


def test_an_entry_written_before_checksums_is_converted_again(fake_gguf, tmp_path, caplog):
    gguf, calls = fake_gguf
    load_model(ModelSpec(gguf_file=str(gguf)))
    (entry,) = (tmp_path / "cache").iterdir()
    manifest = json.loads((entry / models.MANIFEST).read_text())
    del manifest["sha256"]
    (entry / models.MANIFEST).write_text(json.dumps(manifest))
    load_model(ModelSpec(gguf_file=str(gguf)))
    assert len(calls) == 2 and "has no checksums" in caplog.text
    assert "sha256" in json.loads((entry / models.MANIFEST).read_text())


def test_the_context_check_reads_the_config_without_hashing_the_weights(fake_gguf, tmp_path, monkeypatch):
    gguf, _ = fake_gguf
    load_model(ModelSpec(gguf_file=str(gguf)))
    hashed = []
    real = models._sha256
    monkeypatch.setattr(models, "_sha256", lambda path: hashed.append(path.name) or real(path))
    assert context_length_of(ModelSpec(gguf_file=str(gguf))) == 512
    assert hashed and "model.safetensors" not in hashed  # the small files are hashed, the weights are not


def test_a_model_directory_with_nan_weights_is_refused_by_name(tmp_path):
    """The damage a checksum cannot see (a directory saved from a broken model): the probe pass."""
    model = tiny_random_model(seed=0)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 7] = float("nan")
    model.save_pretrained(tmp_path / "broken")
    tiny_random_tokenizer().save_pretrained(tmp_path / "broken")
    with pytest.raises(InvalidInput, match=r"model target .*broken.*logits .* NaN or infinite in float32; its "
                                           r"weights hold NaN .*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(ModelSpec(path=str(tmp_path / "broken"), name="target"))


def test_finite_weights_whose_logits_overflow_are_told_to_run_in_float32():
    model = tiny_random_model(seed=0).to(torch.float16)
    with torch.no_grad():
        model.lm_head.weight.mul_(3e4)  # finite in float16, logits beyond its range
    with pytest.raises(InvalidInput, match=r"model draft: .* in float16; its weights are finite.*dtype=float32"):
        check_finite_logits(model, "draft")


def test_a_healthy_model_passes_the_probe_and_loads():
    model, _ = load_model(ModelSpec(path="tiny_random"))
    check_finite_logits(model, "target")
