"""The Hydra configuration: every file in conf/ composes against the schema, misspelt keys and wrong
types fail at composition naming the key, and bad values fail in `validate` naming the key, before
any model loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from specdec.models import tiny_random_model, tiny_random_tokenizer
from specdec.study import experiment
from specdec.study.config import ConfigError, model_spec, validate

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
GROUPS = ["target", "draft", "method", "data", "generation", "logger", "engine", "experiment"]
PLUGIN_LAUNCHERS = ["submitit_local", "submitit_slurm", "joblib"]


def _compose(overrides: list[str], hydra_config: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra_config)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_every_group_has_options():
    for group in GROUPS:
        assert _options(group), group
    assert {"autoregressive", "draft"} <= set(_options("method"))
    assert {"quick", "spec_bench_greedy", "spec_bench_sampling", "tiny_smoke"} <= set(_options("experiment"))


@pytest.mark.parametrize("override", [f"{g}={o}" for g in GROUPS for o in _options(g)])
def test_every_config_composes_and_validates(override, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # from anywhere: no default may point at a file beside the repository
    group, option = override.split("=")
    # The default run (experiment=overview) includes the heads trained for the embedded target: another
    # target runs its methods alone (that refusal is tested below).
    cfg = _compose(["~experiment", override] if group == "target" and option != "smollm2_135m" else [override])
    if group == "method":
        assert cfg.method.name == option
        assert cfg.method.proposer is None or "_target_" in cfg.method.proposer
    if override == "draft=none":
        cfg.method.needs_draft = False  # the default method needs a draft; draft=none serves the others
    if override == "data=hf":  # hf has no default source: give it a local file
        (tmp_path / "prompts.jsonl").write_text('{"text": "Hello?"}\n')
        cfg.data.path = str(tmp_path / "prompts.jsonl")
    if override == "method=eagle3":  # no EAGLE-3 drafter ships for the embedded target: the refusal says what to set
        with pytest.raises(ConfigError, match=r"^method.heads_path: method=eagle3 needs a drafter: set "
                                              r"method.heads_path=<folder>"):
            validate(cfg)
        return
    if override == "method=mtp":  # the embedded target is a GGUF file: no MTP weights; the refusal names target.path
        with pytest.raises(ConfigError, match=r"^target.path: method=mtp reads the MTP weights from the target's "
                                              r"safetensors; .* is a GGUF file"):
            validate(cfg)
        return
    if override.startswith("method=vllm"):  # vLLM runs in an environment of its own: none is named here
        monkeypatch.delenv("SPECDEC_VLLM_PYTHON", raising=False)
        with pytest.raises(ConfigError, match=r"^method.decoder: method=vllm runs vLLM out of process: set "
                                              r"method.decoder.python="):
            validate(cfg)
        return
    validate(cfg)


@pytest.mark.parametrize("preset", [p for p in _options("experiment")
                                    if _compose([f"experiment={p}"]).data.source == "spec_bench"])
def test_spec_bench_presets_need_nothing_beside_the_package(preset, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPECDEC_SPEC_BENCH", raising=False)
    cfg = _compose([f"experiment={preset}", *TINY[1:]])  # the preset replaces the default one
    assert cfg.data.path is None  # the copy shipped in the package
    validate(cfg)
    prompts = experiment.load_data(cfg)
    assert {"translation", "rag", "multi_turn"} <= {p.category for p in prompts}


def test_no_default_points_outside_the_repository():
    for path in CONF.rglob("*.yaml"):
        text = path.read_text()
        assert "../" not in text and "SPECDEC_SPEC_BENCH" not in text, path


@pytest.mark.parametrize("launcher", _options("hydra/launcher") + PLUGIN_LAUNCHERS)
def test_launchers_compose(launcher):
    cfg = _compose([f"hydra/launcher={launcher}"], hydra_config=True)
    assert "_target_" in cfg.hydra.launcher
    if launcher == "slurm":
        assert cfg.hydra.launcher._target_.endswith("SlurmLauncher") and cfg.hydra.launcher.gpus_per_node == 1


def test_defaults():
    cfg = _compose([], hydra_config=True)
    # the default run: plain decoding, n-gram lookup and the shipped EAGLE-style drafter on the embedded target
    assert cfg.target.path == "embedded" and cfg.method.name == "eagle" and list(cfg.compare) == ["ngram"]
    assert cfg.method.heads_path == "embedded"
    # without the preset: the self-draft, a check of the machinery (also experiment=self_draft)
    for overrides in (["~experiment"], ["experiment=self_draft"]):
        cfg = _compose(overrides)
        assert cfg.method.name == "draft" and cfg.draft.path == "self" and not cfg.compare
    cfg = _compose([], hydra_config=True)
    assert cfg.data.source == "builtin" and cfg.logger.kind == "wandb"
    assert cfg.hydra.callbacks.sweep_summary._target_ == "specdec.study.sweep.SweepSummary"


def test_wandb_mode_follows_the_environment(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert _compose([]).logger.mode == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert _compose([]).logger.mode == "disabled"


def test_a_wandb_mode_wandb_does_not_know_is_refused_before_any_model_loads(monkeypatch):
    """A typo in the mode would otherwise surface at wandb.init, after the run began, and the run
    would go on without W&B; with logger=none the mode is not read at all."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(ConfigError, match=r"^logger.mode: 'onlin' \(from logger.mode\) is not one of online, "):
        validate(_compose(["logger.mode=onlin"]))
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(ConfigError, match=r"^logger.mode: 'ofline' \(from the WANDB_MODE environment variable\)"):
        validate(_compose([]))
    validate(_compose(["logger=none"]))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    validate(_compose([]))


def test_experiment_presets_list_only_changes():
    cfg = _compose(["experiment=spec_bench_sampling"])
    assert cfg.data.source == "spec_bench" and cfg.generation.temperature == 1.0
    assert cfg.method.name == "draft" and cfg.target.path == "embedded"  # untouched
    assert cfg.data.category_map["writing"] == "multi_turn"
    # the command line beats a preset's group choice
    cfg = _compose(["experiment=spec_bench_greedy", "target=tiny_random"])
    assert cfg.target.path == "tiny_random" and cfg.data.source == "spec_bench"


@pytest.mark.parametrize("override, key", [
    ("method.num_speculatve_tokens=3", "method.num_speculatve_tokens"),
    ("generation.max_new_tokens=abc", "generation.max_new_tokens"),
    ("generation.temprature=0.5", "generation.temprature"),
    ("data.limit=ten", "data.limit"),
    ("seed=one", "seed"),
])
def test_schema_errors_name_the_key(override, key):
    with pytest.raises((ConfigCompositionException, ValidationError, ConfigKeyError)) as err:
        _compose([override])
    text = str(err.value) + str(err.value.__cause__)
    assert key in text


def test_unknown_method_lists_the_methods():
    with pytest.raises(ConfigCompositionException) as err:
        _compose(["method=medusa_v9"])
    assert "method/medusa_v9" in str(err.value) and "draft" in str(err.value)


TINY = ["~experiment", "target=tiny_random", "draft=tiny_random", "logger=none"]  # method=draft alone


@pytest.mark.parametrize("override, key", [
    ("method.num_speculative_tokens=0", "method.num_speculative_tokens"),
    ("data.limit=0", "data.limit"),
    ("data.limit=-3", "data.limit"),
    ("generation.temperature=-0.1", "generation.temperature"),
    ("generation.top_p=0", "generation.top_p"),
    ("generation.top_p=1.5", "generation.top_p"),
    ("generation.top_k=-1", "generation.top_k"),
    ("generation.batch_size=0", "generation.batch_size"),
    ("generation.max_new_tokens=0", "generation.max_new_tokens"),
    ("method.schedule=telepathic", "method.schedule"),
    ("method.verifier=oracle", "method.verifier"),
    ("method.verifier=greedy generation.temperature=0.7", "method.verifier"),
    ("method.proposer._target_=specdec.proposers.nope.Nope", "method.proposer._target_"),
    ("draft=none", "draft"),
    ("device=gpu", "device"),
    pytest.param("device=cuda", "device", marks=pytest.mark.skipif(
        __import__("torch").cuda.is_available(), reason="CUDA is available here")),
    ("dtype=float8", "dtype"),
    ("engine.overlap=sometimes", "engine.overlap"),
    ("engine.compile_options.cuda_graphs=static", "engine.compile_options.cuda_graphs"),
    ("engine.packed_linear=always", "engine.packed_linear"),
    ("compile=sometimes", "compile: must be one of off, on, auto"),
    # the old spellings of compile= name what replaced them
    ("compile=autotune", "compile=autotune is now `compile=on engine.compile_options.autotune=true`"),
    ("compile=frozen", "compile=frozen is now `compile=on engine.compile_options.freeze_weights=true`"),
    ("engine.compile_options.autotune=true engine.compile_options.freeze_weights=true",
     "engine.compile_options.freeze_weights: and engine.compile_options.autotune are both true"),
    # an argument added without `+` to a free-form node is checked against the part that takes it
    ("method=draft_forced method.verifier_args.acceptanse=0.5", "verifier=forced takes no verifier_args ['acceptanse']"),
    ("method.schedule=heuristic method.schedule_args.grow=x", "schedule_args.grow"),
    ("data=spec_bench data.path=/no/such/question.jsonl", "data.path"),
    ("data=hf", "data.path"),
    ("data.categories=[poetry]", "data.categories"),
    ("data.path=/tmp/prompts.jsonl", "data.path"),  # data=builtin reads no file: it would be ignored
    ("data=spec_bench data.hf_name=squad", "data.hf_name"),
    ("target.path=/no/such/model", "target.path"),
    ("target.path=/no/such/model.gguf", "target.path"),
    ("target.path=/tmp target.gguf_file=nope.gguf", "target.gguf_file"),
    ("draft.path=/no/such/draft", "draft.path"),  # method=draft needs it
    ("data.text_field=question", "data.text_field"),  # data=builtin reads no field names
    ("data=hf data.path=/tmp/prompts.jsonl data.hf_name=squad", "data.hf_name"),
    ("generation.temperature=inf", "generation.temperature"),
    ("threads=100000", "threads"),
    ("logger.init_timeout=-1", "logger.init_timeout"),  # W&B would wait for ever
    ("target.num_layers=100000", "target.num_layers"),
    ("target.vocab_size=1", "target.vocab_size"),
    ("+foo=1", "foo"),  # `+` adds a key the schema lacks: nothing would read it
    ("+generation.temprature=0.7", "generation.temprature"),
    ("+method.proposer.bogus=3", "method.proposer.bogus"),  # method=draft: DraftModelProposer's arguments
    # a proposer's, a hybrid part's and a schedule's arguments of the wrong type, by their annotations
    ("method=ngram method.proposer.max_ngram=abc", "method.proposer.max_ngram: must be an integer, got 'abc'"),
    ("method=ngram method.proposer.max_ngram=2.5", "method.proposer.max_ngram: must be an integer, got 2.5"),
    ("method=hybrid +method.proposer.parts.suffix.max_depth=x", "method.proposer.parts.suffix.max_depth: must be"),
    ("method=hybrid method.proposer.margin=[1]", "method.proposer.margin: must be a number"),
    ("method.schedule=cost_aware +method.schedule_args.margin=abc", "schedule_args.margin: must be a number"),
])
def test_bad_values_fail_before_models_load(override, key, monkeypatch, tmp_path):
    cfg = _compose([*TINY, *override.split()])

    def no_models(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(experiment, "load_model", no_models)
    with pytest.raises((ConfigError, ValueError)) as err:
        experiment.run(cfg, tmp_path)
    assert key in str(err.value)
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.parametrize("key, value", [
    ("generation.max_new_tokens", None),
    ("generation.max_new_tokens", 8.5),
    ("generation.temperature", "0.5"),
    ("generation.top_p", None),
    ("generation.top_k", True),
    ("generation.batch_size", "2"),
    ("seed", None),
    ("seed", "0"),
    ("threads", 1.5),
    ("data.limit", "ten"),
    ("method.num_speculative_tokens", None),
])
def test_values_of_the_wrong_type_name_the_key(key, value, monkeypatch, tmp_path):
    """A config built in Python (not through the schema) gets the same checks as the command line."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(OmegaConf.to_container(_compose(TINY)))  # untyped: accepts anything
    OmegaConf.update(cfg, key, value)
    monkeypatch.setattr(experiment, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match=rf"^{key}: must be an? (integer|number).*got {value!r}"):
        experiment.run(cfg, tmp_path)


def _hydra_started_in(cwd: Path):
    """A context in which HydraConfig holds a run started in `cwd` (as inside `python -m specdec`)."""
    import contextlib

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    @contextlib.contextmanager
    def context():
        cfg = _compose(TINY, hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.runtime.cwd = str(cwd)
        instance = HydraConfig.instance()
        previous = instance.cfg
        instance.set_config(cfg)
        try:
            yield
        finally:
            instance.cfg = previous

    return context()


def test_tilde_in_paths_is_the_home_folder(tmp_path, monkeypatch):
    home, start = tmp_path / "home", tmp_path / "start"
    (home / "sets").mkdir(parents=True)
    start.mkdir()
    (home / "sets" / "q.jsonl").write_text('{"question_id": 1, "category": "qa", "turns": ["Hi?"]}\n')
    monkeypatch.setenv("HOME", str(home))
    from specdec.study.config import resolve_path

    with _hydra_started_in(start):
        assert resolve_path("~/sets/q.jsonl") == home / "sets" / "q.jsonl"
        assert resolve_path("sets/q.jsonl") == start / "sets" / "q.jsonl"
        cfg = _compose([*TINY, "data=spec_bench", "data.path='~/sets/q.jsonl'"])
        validate(cfg)
        assert [p.prompt_id for p in experiment.load_data(cfg)] == ["1"]
        assert model_spec(_compose(["target.path='~/models/mine'"]).target, "target").path == \
            str(home / "models" / "mine")


def test_hf_data_path_by_file_type(tmp_path):
    (tmp_path / "prompts.txt").write_text("What is rain?\n")
    validate(_compose([*TINY, "data=hf", f"data.path={tmp_path / 'prompts.txt'}"]))
    (tmp_path / "prompts.tsv").write_text("text\tkind\n")
    with pytest.raises(ConfigError, match=r"^data.path: .*prompts\.tsv: data=hf reads local \.json, \.jsonl, "
                                          r"\.csv, \.parquet or \.txt files"):
        validate(_compose([*TINY, "data=hf", f"data.path={tmp_path / 'prompts.tsv'}"]))
    with pytest.raises(ConfigError, match=r"^data.path: file not found: .*missing\.txt"):
        validate(_compose([*TINY, "data=hf", f"data.path={tmp_path / 'missing.txt'}"]))


def test_relative_data_path_resolves_against_the_start_directory(tmp_path, monkeypatch):
    (tmp_path / "q.jsonl").write_text('{"question_id": 1, "category": "qa", "turns": ["Hi?"]}\n')
    monkeypatch.chdir(tmp_path)
    cfg = _compose([*TINY, "data=spec_bench", "data.path=q.jsonl"])
    validate(cfg)
    assert [p.prompt_id for p in experiment.load_data(cfg)] == ["1"]


@pytest.mark.parametrize("context_known", [True, False])
def test_k_too_large_for_the_context_blames_k_not_the_prompts(tmp_path, monkeypatch, context_known):
    """Said by `validate` where the config tells the context, else after loading, in the same words."""
    if not context_known:  # as for a GGUF file not converted yet
        monkeypatch.setattr("specdec.models.context_length_of", lambda spec: None)
    where = "target's context of 512 tokens \\(max_position_embeddings\\)" if context_known else \
        "models' context of 512 tokens"
    cfg = _compose([*TINY, "method.num_speculative_tokens=1000", "data.limit=1", "warmup=false", "plots=false"])
    with pytest.raises(ConfigError, match=rf"^method.num_speculative_tokens: max_new_tokens=64 plus up to 1000 drafted .*"
                                          rf"more than the {where}; lower method.num_speculative_tokens$") as err:
        experiment.run(cfg, tmp_path)
    assert "prompt exceeds" not in str(err.value)
    cfg = _compose([*TINY, "generation.max_new_tokens=600", "data.limit=1", "warmup=false", "plots=false"])
    with pytest.raises(ConfigError, match=rf"^generation.max_new_tokens: .*{where}; lower generation.max_new_tokens$"):
        experiment.run(cfg, tmp_path / "second")


def test_top_p_and_top_k_at_temperature_0_are_said_to_be_ignored(caplog):
    validate(_compose([*TINY, "generation.top_p=0.9", "generation.top_k=5"]))
    assert "temperature=0 decodes greedily and ignores top_p=0.9 and top_k=5" in caplog.text
    caplog.clear()
    validate(_compose([*TINY, "generation.top_p=0.9", "generation.temperature=0.7"]))
    validate(_compose(TINY))
    assert "ignores" not in caplog.text


def test_a_verifier_set_for_plain_decoding_is_said_to_be_ignored(caplog):
    validate(_compose([*TINY, "method=autoregressive", "method.verifier=typical"]))
    assert "method.verifier=typical: plain decoding (autoregressive) drafts nothing" in caplog.text
    caplog.clear()
    validate(_compose([*TINY, "method=autoregressive"]))
    validate(_compose([*TINY, "method=ngram", "method.verifier=typical"]))
    assert "verifies nothing" not in caplog.text


def test_max_new_tokens_past_the_context_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """The target's and the used draft's config.json tell their context; no weights are read."""
    short = tmp_path / "short"
    tiny_random_model(max_position_embeddings=96).save_pretrained(short)
    tiny_random_tokenizer(256).save_pretrained(short)
    monkeypatch.setattr("specdec.models.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    validate(_compose([*TINY, f"draft.path={short}", "generation.max_new_tokens=91"]))  # 1 + 91 + k=4 = 96
    for role in ("target", "draft"):
        cfg = _compose([*TINY, f"{role}.path={short}", "generation.max_new_tokens=92"])
        with pytest.raises(ConfigError, match=rf"^generation.max_new_tokens: max_new_tokens=92 plus up to 4 drafted tokens "
                                              rf"a step need 97 positions with a one-token prompt \(draft\), more than the "
                                              rf"{role}'s context of 96 tokens .*; lower generation.max_new_tokens$"):
            validate(cfg)
    cfg = _compose([*TINY, f"target.path={short}", "method.num_speculative_tokens=95", "generation.max_new_tokens=1"])
    with pytest.raises(ConfigError, match=r"^method.num_speculative_tokens: max_new_tokens=1 plus up to 95 .* 97 "
                                          r"positions .*; lower method.num_speculative_tokens$"):
        validate(cfg)
    validate(_compose([*TINY, "method=ngram", f"draft.path={short}", "generation.max_new_tokens=96"]))  # draft unused
    validate(_compose([*TINY, "method=autoregressive", f"target.path={short}", "generation.max_new_tokens=95"]))


def test_prompts_that_all_exceed_the_context_are_a_config_error(tmp_path):
    """An input error (one `Error:` line on the command line), naming what to lower."""
    cfg = _compose([*TINY, "method=ngram", "generation.max_new_tokens=500", "data.limit=1", "warmup=false",
                    "plots=false"])
    with pytest.raises(ConfigError, match=r"^data: every selected prompt needs more than the models' context of 512 "
                                          r"tokens with max_new_tokens=500; lower generation.max_new_tokens"):
        experiment.run(cfg, tmp_path)


@pytest.mark.parametrize("overrides", [["target=tiny_random"], ["~experiment", "method=medusa", "target=tiny_random"]])
def test_embedded_heads_are_refused_for_another_target_before_any_model_loads(overrides):
    cfg = _compose(overrides)
    with pytest.raises(ConfigError, match="heads_path: `embedded` is the (eagle|medusa) checkpoint trained for the "
                                          "embedded target .* not for target.path=tiny_random.*~experiment"):
        validate(cfg)
    cfg.target.path = "embedded"
    validate(cfg)  # the same config on the embedded target passes


def test_a_missing_target_is_named_before_the_default_runs_heads(tmp_path):
    # The default run includes heads trained for the embedded target: a mistyped target.path must be
    # reported as a missing model, not as heads trained for another target.
    cfg = _compose([f"target.path={tmp_path / 'no_such_model'}"])
    with pytest.raises(ConfigError, match=r"^target.path: Model directory .*no_such_model' does not exist"):
        validate(cfg)



def test_a_broken_or_wrong_heads_checkpoint_is_refused_before_any_model_loads(tmp_path):
    """Only the file's header is read: a file that is not safetensors, or holds the other kind of heads."""
    broken = tmp_path / "heads.safetensors"
    broken.write_text("not a checkpoint")
    cfg = _compose(["~experiment", "method=eagle", "target=tiny_random", f"method.heads_path={broken}"])
    with pytest.raises(ConfigError, match=rf"^method.heads_path: {re.escape(str(broken))} is not a safetensors "
                                          r"checkpoint \(.*\): a file cut short"):
        validate(cfg)
    cfg.method.heads_path = str(ROOT / "tests" / "assets" / "tiny_random_medusa.safetensors")
    with pytest.raises(ConfigError, match=r"^method.heads_path: .*tiny_random_medusa.safetensors holds medusa heads, "
                                          r"not eagle"):
        validate(cfg)
    cfg.method.heads_path = str(ROOT / "tests" / "assets" / "tiny_random_eagle.safetensors")
    validate(cfg)


def test_the_hybrids_trained_part_is_refused_for_another_target_and_null_leaves_it_out():
    cfg = _compose(["~experiment", "method=hybrid", "target=tiny_random", "draft=self"])
    with pytest.raises(ConfigError, match=r"method.heads_path: `embedded` is the eagle checkpoint .*"
                                          r"leave the eagle part out: method.heads_path=null"):
        validate(cfg)
    cfg.method.heads_path = None
    validate(cfg)  # the hybrid without its trained part
    cfg.method.verifier = "block"  # with the tree part, a verifier with no tree form is refused
    cfg.method.heads_path = "embedded"
    cfg.target.path = "embedded"
    with pytest.raises(ConfigError, match="drafts token trees"):
        validate(cfg)


ASSETS = ROOT / "tests" / "assets"
TINY_EAGLE = f"method.heads_path={ASSETS / 'tiny_random_eagle.safetensors'}"  # heads of the tiny random target
TINY_MEDUSA = f"method.heads_path={ASSETS / 'tiny_random_medusa.safetensors'}"


def _refused_before_any_model_loads(overrides: list[str], message: str, monkeypatch, tmp_path) -> None:
    cfg = _compose(overrides)
    monkeypatch.setattr(experiment, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match=message):
        experiment.run(cfg, tmp_path)
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.parametrize("overrides, message", [
    ([*TINY, "method=eagle", TINY_EAGLE, "method.tree=[[0],[1]]"],
     r"^method.tree: is set to \[\[0\], \[1\]\], but method=eagle does not read it \(it would be ignored\): "
     r"EagleProposer takes no tree \(it takes: heads_path, budget, topk, width, depth\); method=medusa reads it$"),
    ([*TINY, "method=ngram", "method.tree=[[0],[1]]"],
     r"^method.tree: .* but method=ngram does not read it .*: NgramProposer takes no tree .*; method=medusa reads it$"),
    ([*TINY, "method=ngram", "method.heads_path=/no/such/heads.safetensors"],
     r"^method.heads_path: is set to '/no/such/heads.safetensors', but method=ngram does not read it \(it would be "
     r"ignored\): NgramProposer takes no heads_path .*; method=eagle, eagle3, hybrid or medusa read it$"),
    ([*TINY, "method=autoregressive", "method.heads_path=embedded"],
     r"^method.heads_path: .* method=autoregressive drafts nothing \(plain decoding\); method=eagle, eagle3, hybrid or "),
    ([*TINY, "method=hf_prompt_lookup", "method.tree=[[0]]"], r"^method.tree: .* HFPromptLookup takes no tree"),
    # the proposer given its own checkpoint, and the method another
    ([*TINY, "method=eagle", f"method.proposer.{TINY_EAGLE.removeprefix('method.')}", "method.heads_path=/my.pt"],
     r"^method.heads_path: is set to '/my.pt', but method=eagle does not read it \(it would be ignored\): "
     r"EagleProposer reads method.proposer.heads_path, which does not refer to it; set method.proposer.heads_path "
     r"instead$"),
    # the hybrid reads heads_path only through its eagle part
    ([*TINY, "method=hybrid", "~method.proposer.parts.eagle", "method.heads_path=/my/eagle.safetensors"],
     r"^method.heads_path: .* method=hybrid does not read it .*HybridProposer takes no heads_path"),
    # a method of the default run's comparison (experiment=overview), named by its own key
    ([*TINY[1:], TINY_EAGLE, "compare.ngram.tree=[[0]]"],
     r"^compare.ngram.tree: .* compare.ngram=ngram does not read it .*; method=medusa reads it$"),
])
def test_a_method_setting_the_method_does_not_read_is_refused_before_any_model_loads(overrides, message,
                                                                                      monkeypatch, tmp_path):
    """heads_path and tree reach a proposer only where its config refers to them (`${..tree}`): set for
    another method they would be ignored and recorded as if used."""
    _refused_before_any_model_loads([*overrides, "data.limit=1"], message, monkeypatch, tmp_path)


def test_method_settings_that_the_method_reads_pass():
    validate(_compose([*TINY, "method=medusa", TINY_MEDUSA, "method.tree=[[0],[1],[0,0]]"]))
    validate(_compose([*TINY, "method=hybrid", TINY_EAGLE]))  # read by the eagle part
    validate(_compose([*TINY, "method=hybrid", "~method.proposer.parts.eagle"]))  # the file's default, unread
    # the proposer given its checkpoint itself: the method's own default (embedded) is left unread
    validate(_compose([*TINY, "method=eagle", f"method.proposer.{TINY_EAGLE.removeprefix('method.')}"]))


def test_a_checkpoint_given_to_the_proposer_itself_is_checked_under_its_own_key(monkeypatch, tmp_path):
    _refused_before_any_model_loads([*TINY, "method=eagle", "method.proposer.heads_path=/no/such/heads.safetensors"],
                                    r"^method.proposer.heads_path: file not found: /no/such/heads.safetensors$",
                                    monkeypatch, tmp_path)


@pytest.mark.parametrize("overrides, key", [
    (["method=suffix_tree", "method.proposer.budget=600"], "method.proposer.budget"),
    (["method=eagle", TINY_EAGLE, "method.proposer.budget=600"], "method.proposer.budget"),
    (["method=hybrid", TINY_EAGLE, "method.proposer.parts.eagle.budget=600"], "method.proposer.parts.eagle.budget"),
])
def test_a_tree_budget_past_the_context_blames_the_budget(overrides, key, monkeypatch, tmp_path):
    """A tree's nodes, not k, set the width of its step (each is scored): the budget is what to lower."""
    _refused_before_any_model_loads(
        [*TINY, "data.limit=1", *overrides],
        rf"^{key}: max_new_tokens=64 plus up to 600 drafted tokens a step need 665 positions with a one-token prompt "
        rf"\(\w+\), more than the target's context of 512 tokens \(max_position_embeddings\); lower {key}$",
        monkeypatch, tmp_path)


def test_a_tree_budget_past_a_context_known_only_once_loaded_blames_the_budget(monkeypatch, tmp_path):
    monkeypatch.setattr("specdec.models.context_length_of", lambda spec: None)  # as for a GGUF file not converted yet
    cfg = _compose([*TINY, "method=suffix_tree", "method.proposer.budget=600", "data.limit=1", "warmup=false",
                    "plots=false"])
    with pytest.raises(ConfigError, match=r"^method.proposer.budget: max_new_tokens=64 plus up to 600 drafted tokens "
                                          r".*models' context of 512 tokens; lower method.proposer.budget$"):
        experiment.run(cfg, tmp_path)


@pytest.mark.parametrize("overrides, message", [
    (["method=eagle", TINY_EAGLE, "method.proposer.topk=129"],
     r"^method.proposer.topk: is 129, but the drafter proposes from 128 tokens \(the checkpoint reduced the "
     r"vocabulary\); use a topk of at most 128$"),
    (["method=hybrid", TINY_EAGLE, "method.proposer.parts.eagle.topk=129"],
     r"^method.proposer.parts.eagle.topk: is 129, but the drafter proposes from 128 tokens"),
    (["method=medusa", TINY_MEDUSA, "method.tree=[[0],[128]]"],
     r"^method.tree: rank 128 asks each head for more guesses than the 128 tokens it proposes from \(the checkpoint "
     r"reduced the vocabulary\); use ranks below 128$"),
    (["method=medusa", TINY_MEDUSA, "method.tree=[[0],[0,0],[0,0,0],[0,0,0,0]]"],
     r"^method.tree: is 4 deep but the checkpoint has 3 heads; use a tree at most 3 deep$"),
    (["method=medusa", TINY_MEDUSA, "method.proposer.tree=[[0],[0,1,0]]"],
     r"^method.proposer.tree: path \[0, 1, 0\] has no parent"),
])
def test_drafts_the_checkpoint_cannot_give_are_refused_before_any_model_loads(overrides, message, monkeypatch,
                                                                              tmp_path):
    """The heads' vocabulary and depth are in the checkpoint's header: the constructor's checks, made early."""
    _refused_before_any_model_loads([*TINY, "data.limit=1", *overrides], message, monkeypatch, tmp_path)
    validate(_compose([*TINY, "method=eagle", TINY_EAGLE, "method.proposer.topk=128"]))  # the largest that fits
    validate(_compose([*TINY, "method=medusa", TINY_MEDUSA, "method.tree=[[0],[127],[0,0],[0,0,0]]"]))


@pytest.mark.parametrize("override, message", [
    ("method.proposer.max_ngram=0", "method.proposer: need 1 <= min_ngram <= max_ngram"),
    ("method=layer_skip method.proposer.exit_layer=50", "method.proposer.exit_layer=50: must be in [1, 1]"),
])
def test_a_proposer_argument_refused_once_the_models_load_is_a_config_error(override, message, tmp_path):
    """Values that need the model to be judged (an exit layer past the last) or that only the
    proposer checks fail as ConfigError, which the command line prints as one `Error:` line."""
    cfg = _compose([*TINY, "method=ngram", *override.split()])
    with pytest.raises(ConfigError, match=re.escape(message)):
        experiment.run(cfg, tmp_path)


def test_a_draft_no_method_needs_is_not_looked_for():
    validate(_compose([*TINY, "method=ngram", "draft.path=/no/such/draft"]))


def _command_line(tmp_path, *args: str):
    """`python -m specdec ARGS` in a subprocess, its run folder under `tmp_path`."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "specdec", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300)


def test_the_command_line_reports_a_bad_prompt_file_in_one_line_without_a_traceback(tmp_path):
    """A prompt file passes the config's checks (it exists) and fails as it is read: the reader's own
    error comes out in specdec's one-line form too, not as Hydra's traceback."""
    bad = tmp_path / "questions.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["Hi?"]}\n', encoding="utf-8")
    proc = _command_line(tmp_path, *TINY, "data=spec_bench", f"data.path={bad}")
    assert proc.returncode == 1
    assert f"Error: {bad}, line 1: missing field(s) ['category']" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_the_command_line_reports_a_bad_config_in_one_line_without_a_traceback(tmp_path):
    proc = _command_line(tmp_path, "method.num_speculative_tokens=-1", "logger=none")
    assert proc.returncode == 1
    assert "Error: method.num_speculative_tokens: k must be >= 1, got -1" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("overrides, hint", [
    (["method.k=8"], "`method.k` is not a setting; did you mean `method.num_speculative_tokens`?"),
    (["temperature=0.7"], "`temperature` is not a setting; did you mean `generation.temperature`?"),
    (["generation.temprature=0.5"], "did you mean `generation.temperature`?"),
    (["target.model=x"], "`target.model` is not a setting; did you mean `target.path`?"),
    (["compare.ngram.k=2"], "did you mean `compare.ngram.num_speculative_tokens`?"),
    (["exact_gredy=false"], "did you mean `engine.exact_greedy`?"),
    # the engine's switches that were top-level keys, and a compile option without its group
    (["packed_linear=on"], "`packed_linear` is not a setting; did you mean `engine.packed_linear`?"),
    (["overlap=off"], "did you mean `engine.overlap`?"),
    (["exact_greedy=false"], "did you mean `engine.exact_greedy`?"),
    (["cuda_graphs=explicit"], "did you mean `engine.compile_options.cuda_graphs`?"),
    (["compile_options.autotune=true"], "did you mean `engine.compile_options.autotune`?"),
    (["engine.autotune=true"], "did you mean `engine.compile_options.autotune`?"),
    # a misspelt node of free form is a schema key: it still fails, with a hint
    (["method.verifer_args.acceptance=0.5"], "did you mean `method.verifier_args`?"),
    (["data.source_arg.n=3"], "did you mean `data.source_args`?"),
    (["zzz=1"], "`zzz` is not a setting; `python -m specdec --cfg job` prints them all"),
])
def test_a_key_hydra_refuses_gets_the_setting_probably_meant(overrides, hint):
    from specdec.study.config import override_hints

    with pytest.raises((ConfigCompositionException, ValidationError, ConfigKeyError)):
        _compose(overrides)  # Hydra refuses it: the hint adds to its message
    hints = override_hints(overrides)
    assert len(hints) == 1 and hint in hints[0], hints


def test_keys_hydra_accepts_get_no_hint():
    from specdec.study.config import override_hints

    fine = ["method=eagle", "experiment=quick", "method.num_speculative_tokens=3", "+extra=1", "~experiment",
            "hydra.run.dir=x", "method.proposer.n=3", "method.schedule_args.margin=0.1", "method/schedule=constant",
            "compare.ngram.num_speculative_tokens=2", "generation.temperature=0.7", "threads=2", "-m",
            "engine=default", "compile=on", "engine.overlap=off", "engine.compile_options.autotune=true",
            "method.verifier_args.acceptance=[0.8,0.6]", "data.source_args.n=3", "compare.ngram.verifier_args.x=1"]
    assert override_hints(fine) == []


def test_the_command_line_adds_the_hint_to_hydras_refusal(tmp_path):
    proc = _command_line(tmp_path, "method.k=8", "logger=none")
    assert proc.returncode == 1
    assert "Key 'k' not in 'MethodConfig'" in proc.stderr  # Hydra's own message, then the hint
    assert proc.stderr.rstrip().endswith("Hint: `method.k` is not a setting; did you mean `method.num_speculative_tokens`?")


def test_config_names_the_cuda_graph_modes_of_the_engine():
    """specdec.study.config checks cuda_graphs= without importing torch: its list is specdec.accel.cuda_graphs'."""
    from specdec.accel.cuda_graphs import CUDA_GRAPH_MODES
    from specdec.study import config

    assert config.CUDA_GRAPH_MODES == CUDA_GRAPH_MODES


def test_config_names_the_packed_linear_modes_of_the_engine():
    """specdec.study.config checks packed_linear= without importing torch: its list is specdec.accel.packed_linear's."""
    from specdec.accel.packed_linear import PACKED_LINEAR_MODES
    from specdec.study import config

    assert config.PACKED_LINEAR_MODES == PACKED_LINEAR_MODES


FREE_FORM = [  # every node of free form: a new key without `+`, as the docs write it
    ("method.verifier=forced", "method.verifier_args.acceptance=[0.8,0.6]", "method.verifier_args.acceptance", [0.8, 0.6]),
    ("method.schedule=heuristic", "method.schedule_args.grow=2", "method.schedule_args.grow", 2),
    ("data=builtin", "data.source_args.subset=qa", "data.source_args.subset", "qa"),
    ("data=spec_bench", "data.category_map.qa=questions", "data.category_map.qa", "questions"),
    ("+method@compare.forced=draft", "compare.forced.verifier_args.acceptance=0.5",
     "compare.forced.verifier_args.acceptance", 0.5),
    ("+method@compare.h=ngram", "compare.h.schedule_args.grow=3", "compare.h.schedule_args.grow", 3),
]


@pytest.mark.parametrize("choice, override, key, value", FREE_FORM)
def test_free_form_nodes_take_new_keys_without_plus(choice, override, key, value):
    from omegaconf import OmegaConf

    cfg = _compose([*TINY, choice, override])
    assert OmegaConf.select(cfg, key) == value
    assert OmegaConf.select(_compose([*TINY, choice, f"+{override}"]), key) == value  # `+` still works
    with pytest.raises(ConfigCompositionException, match="Could not override"):  # the schema's own nodes stay closed
        _compose([*TINY, choice, override.replace("_args.", "_arg.").replace("category_map.", "category_mop.")])


def test_the_command_line_takes_free_form_keys_without_plus(tmp_path):
    """Through the app itself (`python -m specdec --cfg job`): Hydra's parsing of the command line."""
    from omegaconf import OmegaConf

    overrides = [o for choice, override, _, _ in FREE_FORM for o in (choice, override) if choice != "data=builtin"]
    proc = _command_line(tmp_path, "--cfg", "job", *TINY, *overrides, "data.source_args.n=3")
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    for _, _, key, value in FREE_FORM:
        if key != "data.source_args.subset":
            assert OmegaConf.select(cfg, key) == value, key
    assert cfg.data.source_args.n == 3 and cfg.data.category_map.writing == "multi_turn"


def test_an_argument_added_without_plus_is_checked_against_its_part():
    validate(_compose([*TINY, "method.verifier=forced", "method.verifier_args.acceptance=[0.8,0.6,0.5,0.4]"]))
    with pytest.raises(ConfigError, match="^data.source: .*n"):
        validate(_compose([*TINY, "data.source_args.n=3"]))  # the built-in prompts take no arguments


def test_the_engine_file_holds_the_schemas_defaults():
    """conf/engine/default.yaml documents every engine switch with the study behind it; its values
    are the schema's, so a config built without it (or with an engine file of one's own) agrees."""
    import dataclasses

    import yaml

    from specdec.study.config import CompileOptions, EngineConfig

    written = yaml.safe_load((CONF / "engine" / "default.yaml").read_text())
    options = {f.name: f.default for f in dataclasses.fields(CompileOptions)}
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name != "compile_options"}
    assert written == {**defaults, "compile_options": options}
    cfg = _compose([])
    assert cfg.compile == "auto" and cfg.engine.overlap == "auto" and cfg.engine.exact_greedy is True
    for option in ("autotune", "freeze_weights", "cpp_wrapper", "cuda_graphs"):  # each option names its study
        line = next(x for x in (CONF / "engine" / "default.yaml").read_text().splitlines() if x.strip().startswith(option))
        assert option in line
    assert (CONF / "engine" / "default.yaml").read_text().count("LOG.md#") >= 4


def test_method_files_list_only_what_differs_from_the_defaults():
    import dataclasses

    import yaml

    from specdec.study.config import MethodConfig

    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else {} for f in dataclasses.fields(MethodConfig)}
    for path in sorted((CONF / "method").glob("*.yaml")):
        written = yaml.safe_load(path.read_text())
        same = [key for key, value in written.items() if key != "name" and value == defaults[key]]
        assert not same, f"{path.name} repeats the defaults of {same}"


@pytest.mark.parametrize("overrides, device, resolved", [
    (["compile=off"], "cpu", "off"),
    (["compile=on"], "cpu", "on"),
    (["compile=on", "engine.compile_options.autotune=true"], "cpu", "autotune"),
    (["compile=on", "engine.compile_options.freeze_weights=true"], "cpu", "frozen"),
    (["compile=auto", "engine.compile_options.autotune=true"], "cpu", "off"),  # auto keeps a CPU eager
    (["compile=off", "engine.compile_options.autotune=true"], "cpu", "off"),
    (["compile=auto", "engine.compile_options.autotune=true"], "cuda", "autotune"),  # auto compiles on CUDA
    (["compile=auto", "engine.compile_options.freeze_weights=true"], "cuda", "frozen"),
    (["compile=auto"], "cuda", "on"),
])
def test_compile_and_its_options_become_the_engines_passes(overrides, device, resolved, monkeypatch):
    """`experiment.accelerated`, the one place the config becomes `Accelerated`'s arguments, as
    `Accelerated` settles them on `device` (nothing runs there: a CPU-only machine checks CUDA's)."""
    import torch

    monkeypatch.setattr(experiment, "resolve_device", lambda name: torch.device(name))
    cfg = _compose([*TINY, f"device={device}", "engine.packed_linear=off", *overrides])
    passes = experiment.accelerated(cfg)
    passes.settle(torch.device(device), torch.float32)
    assert passes.describe() == {"compile": resolved, "packed_linear": "off"}


def test_cpp_wrapper_reaches_the_compiled_passes():
    """`engine.compile_options.cpp_wrapper=true` becomes each compiled caller's option, and a caller a
    proposer adds beside the target's (`options()`) inherits it."""
    from specdec.core.engine import Engine
    from specdec.models import tiny_random_model

    for value in (True, False):
        cfg = _compose([*TINY, "compile=on", f"engine.compile_options.cpp_wrapper={value}"])
        engine = Engine(tiny_random_model(seed=2, eos_token_id=None), dtype="float32", passes=experiment.accelerated(cfg))
        assert engine.target.compiled.cpp_wrapper is value
        assert engine.target.compiled.options()["cpp_wrapper"] is value


def test_the_engines_switches_reach_the_run(tmp_path):
    cfg = _compose([*TINY, "dtype=float32", "data.limit=1", "generation.max_new_tokens=4", "warmup=false", "plots=false",
                    "engine.exact_greedy=false", "engine.overlap=on", "engine.packed_linear=on", "compile=off"])
    summary = experiment.run(cfg, tmp_path).summary
    assert summary["exact_greedy"] is False and summary["overlap"] == "on"
    assert summary["compile"] == "off" and summary["packed_linear"] == "on"


def test_compile_options_under_compile_off_are_said_to_be_ignored(caplog):
    validate(_compose([*TINY, "compile=off", "engine.compile_options.cuda_graphs=explicit"]))
    assert "compile=off runs every pass eagerly and ignores engine.compile_options.cuda_graphs=explicit" in caplog.text
    caplog.clear()
    validate(_compose([*TINY, "compile=on", "engine.compile_options.autotune=true"]))
    assert "ignores" not in caplog.text


def test_a_corpus_that_is_not_a_file_is_refused_before_any_model_loads(monkeypatch, tmp_path):
    _refused_before_any_model_loads([*TINY, "method=suffix", "method.proposer.corpus=/no/such/corpus.jsonl"],
                                    r"^method.proposer.corpus: /no/such/corpus.jsonl is not a file; give a JSONL file",
                                    monkeypatch, tmp_path)
