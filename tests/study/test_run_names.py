"""Names that tell the truth: the target and draft recorded in summary.json, the table and W&B come from
what was loaded (folder or GGUF file or hub id, model type, depth, dtype), never from a config group's
name: `target.path=<another model>` with the smollm2_135m group is not labelled smollm2_135m."""

from __future__ import annotations

import json
from pathlib import Path

from hydra import compose, initialize_config_dir

from specdec.models import ModelSpec, describe_model, tiny_random_model, tiny_random_tokenizer
from specdec.study import experiment

CONF = Path(__file__).resolve().parents[2] / "conf"
FAST = ["~experiment", "logger=none", "data.limit=1", "data.categories=[qa]", "generation.max_new_tokens=2", "plots=false",
        "warmup=false", "dtype=float32"]


def _saved(folder: Path, seed: int, num_layers: int) -> Path:
    tiny_random_model(seed=seed, num_layers=num_layers).save_pretrained(folder)
    tiny_random_tokenizer(256).save_pretrained(folder)
    return folder


def test_a_path_override_is_named_by_what_it_loads(tmp_path):
    target = _saved(tmp_path / "my-target", seed=0, num_layers=2)
    draft = _saved(tmp_path / "my-draft", seed=1, num_layers=1)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        # the smollm2_135m target group and the method's default draft group, with other models' paths
        cfg = compose("config", overrides=[*FAST, f"target.path={target}", f"draft.path={draft}"])
    result = experiment.run(cfg, tmp_path / "run")
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["target"] == "my-target (llama, 2 layers)" and s["draft"] == "my-draft (llama, 1 layers)"
    assert s["target_model"]["source"] == str(target) and s["draft_model"]["source"] == str(draft)
    assert s["target_model"]["model_type"] == "llama" and s["target_model"]["dtype"] == "float32"
    assert s["draft_model"]["num_parameters"] < s["target_model"]["num_parameters"]
    assert "smollm2" not in json.dumps({k: v for k, v in s.items() if k.startswith(("target", "draft"))})
    assert "target my-target (llama, 2 layers)" in result.table and "draft my-draft" in result.table


def test_labels_of_each_kind_of_source(tmp_path):
    model = tiny_random_model(seed=0)
    assert describe_model(ModelSpec(path="tiny_random"), model)["label"] == "tiny_random seed 0 (llama, 2 layers)"
    gguf = tmp_path / "Some-Model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    described = describe_model(ModelSpec(gguf_file=str(gguf)), model)
    assert described["label"] == "Some-Model.Q8_0.gguf (llama, 2 layers)"
    assert described["gguf_file"] == gguf.name and described["source"] == str(gguf)
    hub = describe_model(ModelSpec(path="org/some-model"), model)
    assert hub["label"] == "org/some-model (llama, 2 layers)" and hub["gguf_file"] is None


def test_a_label_of_your_own_is_kept_beside_the_derived_one(tmp_path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*FAST, "target=tiny_random", "draft=tiny_random",
                                           "draft.name=my-distilled-draft"])
    s = experiment.run(cfg, tmp_path / "run").summary
    assert s["draft"] == "tiny_random seed 1 (llama, 1 layers)" and s["draft_name"] == "my-distilled-draft"
    assert "target_name" not in s
