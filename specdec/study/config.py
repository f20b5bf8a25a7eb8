"""The experiment configuration: typed schema (structured configs) and the checks run before any model loads.

`conf/` holds one small YAML per option of each group (target, draft, method, data, generation, logger,
experiment); the dataclasses here are the schema they are merged into. Registered in Hydra's ConfigStore
as `base_config` and listed first in `conf/config.yaml`'s defaults, they make a misspelt key or a value
of the wrong type fail at composition, with Hydra naming the key.

What a schema cannot say (k >= 1, top_p in (0, 1], a data file that must exist, a method that needs a
draft) is checked by `validate`, which the experiment calls before it loads anything heavy, so a bad
value costs a second, not a model load. Every message names the offending key.

A method is one YAML in `conf/method/` (see `MethodConfig`): its `proposer` is instantiated by Hydra
with the engine (`_target_` plus any arguments), so a new method needs a module and that file only.
"""

import dataclasses
import difflib
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from specdec.core.errors import InvalidInput

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPILE_MODES = ("off", "on", "auto")  # the rest of specdec.accel.compiled.COMPILE_MODES are engine.compile_options
# Old spellings of compile= and the settings that took their place (validate names them).
COMPILE_MOVED = {"autotune": "engine.compile_options.autotune=true", "frozen": "engine.compile_options.freeze_weights=true"}
OVERLAP_MODES = ("auto", "on", "off")  # specdec.core.decoding.OVERLAP_MODES' names
CUDA_GRAPH_MODES = ("trees", "explicit")  # specdec.accel.cuda_graphs.CUDA_GRAPH_MODES
PACKED_LINEAR_MODES = ("auto", "on", "off")  # specdec.accel.packed_linear.PACKED_LINEAR_MODES


class ConfigError(InvalidInput):
    """A configuration value that cannot work; the message starts with the key."""


def free_form(element_type: Any = Any) -> Callable[[], DictConfig]:
    """The default factory of a node of free form (a part's arguments, a category map): an empty
    mapping of str to `element_type` that takes new keys from the command line without `+`
    (`method.verifier_args.acceptance=[0.8,0.6]`). Hydra closes every other node, so that a misspelt
    setting fails; what a free-form node holds is checked against the part that takes it (`validate`)."""

    def empty() -> DictConfig:
        return DictConfig({}, key_type=str, element_type=element_type, ref_type=dict[str, element_type],
                          is_optional=False, flags={"struct": False})

    return empty


@dataclass
class ModelConfig:
    """A target or draft model. `path`: a directory, a hub id in the local HF cache, a `.gguf` file,
    `embedded` (SmolLM2-135M-Instruct), `tiny_random`; for a draft also `self` (the target itself) or
    null (no draft). Results name the model from what was loaded (`specdec.models.describe_model`);
    `name` is an optional label of your own, recorded beside it as `target_name` / `draft_name`."""

    name: str | None = None
    path: str | None = None
    gguf_file: str | None = None
    seed: int = 0  # tiny_random only
    num_layers: int = 2  # tiny_random only
    vocab_size: int = 256  # tiny_random only
    tp_size: int = 1  # target only: ranks the target's heads are split over (torchrun --nproc-per-node tp_size)
    tp_check: bool = True  # target only, with tp_size > 1: check every pass that the ranks feed the same tokens


@dataclass
class MethodConfig:
    """One way of decoding; one file per method in `conf/method/`.

    proposer: `{_target_: module.Class, ...args}` instantiated with `engine=<Engine>`, or null for
              plain autoregressive decoding.
    schedule: the name of a file in `conf/method/schedule/` (constant, heuristic, confidence, cost_aware,
              ...) or a `{_target_: ...}` node, built with `num_speculative_tokens` and `schedule_args`.
    verifier: the name of a file in `conf/method/verifier/` (auto: greedy at temperature 0, else
              speculative sampling; greedy, speculative_sampling, block, typical, forced, ...) or a
              `{_target_: ...}` node, built with `verifier_args` (see `specdec.study.registry`).
    decoder:  instead of a proposer, `{_target_: ...}` of a whole decoder with SpeculativeDecoder's
              `generate` (the `transformers` anchors in `specdec.study.anchors`), instantiated with
              `engine`, `num_speculative_tokens` and `tokenizer`.
    heads_path, tree: for methods that draft with trained heads over a token tree (medusa, eagle): the
              checkpoint, and the tree as rank paths; their proposer reads them as `${..heads_path}`.
              Such a setting (`proposer=True` in its field's metadata: `PROPOSER_SETTINGS`) is read only
              by a method whose proposer refers to it; `validate` refuses one set for another method.
    """

    name: str = MISSING
    proposer: Any = None
    decoder: Any = None
    num_speculative_tokens: int = 4
    schedule: Any = "constant"  # a name (conf/method/schedule/<name>.yaml) or a `_target_` node
    schedule_args: dict[str, Any] = field(default_factory=free_form())
    verifier: Any = "auto"  # a name (conf/method/verifier/<name>.yaml) or a `_target_` node
    verifier_args: dict[str, Any] = field(default_factory=free_form())
    needs_draft: bool = False
    # trained heads (medusa, eagle): a checkpoint of scripts/train_heads.py, or `embedded`
    heads_path: str | None = field(default=None, metadata={"proposer": True})
    # a static tree as rank paths, [[0], [1], [0, 0], ...] (null: the method's default)
    tree: Any = field(default=None, metadata={"proposer": True})


# The method's settings that only its proposer reads, where its config refers to them (`${..heads_path}`).
PROPOSER_SETTINGS = tuple(f.name for f in dataclasses.fields(MethodConfig) if f.metadata.get("proposer"))


@dataclass
class DataConfig:
    """A prompt set (`specdec.study.data.load_prompts`). `source`: a name, the file `conf/data/source/<name>.yaml`
    that names its reader with `_target_`, or such a node; the reader takes the settings below that it
    names and `source_args`, its own. Relative paths resolve against the directory the
    command was started from. `limit` keeps the first `limit` prompts of each category (or overall when
    `per_category` is false); `category_map` renames categories before selection (Spec-Bench reports
    its eight MT-bench categories as one, `multi_turn`)."""

    source: Any = "builtin"
    source_args: dict[str, Any] = field(default_factory=free_form())
    path: str | None = None
    limit: int | None = None
    categories: list[str] | None = None
    per_category: bool = True
    category_map: dict[str, str] = field(default_factory=free_form(str))
    system_prompt: str | None = None
    hf_name: str | None = None  # source=hf: a dataset name (needs a network unless cached)
    split: str = "train"
    text_field: str = "text"
    category_field: str | None = None
    id_field: str | None = None


@dataclass
class GenerationConfig:
    """Decoding settings, the same for the method and the baseline. temperature 0 is greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 1


@dataclass
class LoggerConfig:
    """`kind`: a name, the file `conf/logger/kind/<name>.yaml` that names the tracker with `_target_`
    (none, wandb), or such a node; the tracker takes the settings below that it names. W&B runs offline
    unless WANDB_MODE (or `mode`) says otherwise; `group` defaults to the sweep's name in a multirun."""

    kind: Any = "none"
    project: str = "specdec"
    entity: str | None = None
    mode: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    init_timeout: float = 15.0


@dataclass
class CompileOptions:
    """How passes compile where `compile` turns compiling on (ignored under compile=off). Each option
    paid on some machine in experiments/gpu/LOG.md; conf/engine/default.yaml says where.

    autotune:       inductor's GEMM autotuning (about twice the compile time).
    freeze_weights: the weights frozen into the graphs on a GPU too (a CPU's graphs freeze them
                    anyway); q/k/v and gate/up concatenated, copies of those weights in memory.
    cuda_graphs:    on CUDA, `trees` (inductor's CUDA graphs) or `explicit` (specdec's own, a whole
                    pipelined step captured as one graph).
    cpp_wrapper:    each graph calls its kernels from C++ (inductor's `cpp_wrapper`): fewer host
                    cycles a pass, 1.5x the compile time.
    """

    autotune: bool = False
    freeze_weights: bool = False
    cuda_graphs: str = "trees"
    cpp_wrapper: bool = False


@dataclass
class EngineConfig:
    """The engine's switches besides `compile` (`conf/engine/default.yaml`). None changes the tokens
    but `exact_greedy`, which keeps bfloat16 greedy output equal to plain decoding's.

    overlap:       auto | on | off: queue step n+1 before reading step n (plain decoding, and a
                   greedy draft model under compile); auto is on for CUDA.
    packed_linear: auto | on | off: eager float32 passes on a CPU run linear layers of two or more
                   rows, bfloat16 ones every layer, through oneDNN's packed weights; auto is on
                   where that applies.
    exact_greedy:  greedy runs score every target pass at one width (the run's largest k + 1) over
                   the whole cache buffer, so speculative output equals plain decoding bit for bit.
    """

    overlap: str = "auto"
    packed_linear: str = "auto"
    exact_greedy: bool = True
    compile_options: CompileOptions = field(default_factory=CompileOptions)


@dataclass
class Config:
    target: ModelConfig = field(default_factory=ModelConfig)
    draft: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    # More methods measured in the same run, interleaved with `method` and the baseline; filled by
    # presets with `- /method@compare.<name>: <name>` in their defaults (see experiment=vs_hf).
    compare: dict[str, MethodConfig] = field(default_factory=dict)
    # Variants of `method` measured in the same run, one per combination of the lists given
    # (`grid.method.num_speculative_tokens=[2,4,8]`, `grid.methods=[ngram,suffix]`); `expand` turns
    # them into `method` and `compare` entries before anything is checked.
    grid: dict[str, Any] = field(default_factory=free_form())
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on a GPU or a CPU with bfloat16 units) | float32 | bfloat16 | float16
    compile: str = "auto"  # off | on | auto (on for CUDA, off on a CPU): torch.compile at static shapes
    seed: int = 0
    repeats: int = 1  # the interleaved comparison, run this many times (intervals resample repeats too)
    threads: int | None = 1  # torch CPU threads per job; null keeps torch's default (all cores)
    warmup: bool = True  # one short untimed generation per method before measuring
    plots: bool = True
    progress: bool | None = None  # progress bars: null shows them only on a terminal


# Names researchers type for a setting that specdec calls otherwise.
ALIASES = {"k": "num_speculative_tokens", "gamma": "num_speculative_tokens", "num_draft_tokens": "num_speculative_tokens",
           "draft_tokens": "num_speculative_tokens", "max_tokens": "max_new_tokens", "temp": "temperature",
           "model": "path", "batch": "batch_size"}


def _settings(node=Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema under `node` (a `compare.<name>` entry counts as its MethodConfig)."""
    keys = []
    for f in dataclasses.fields(node):
        key = prefix + f.name
        keys.append(key)
        if dataclasses.is_dataclass(f.type):
            keys += _settings(f.type, key + ".")
    return keys


def _unknown_part(parts: list[str]) -> int | None:
    """The index of the first part of a dotted key that names nothing in the schema, or None (the key
    is a setting, or reaches a value or a free-form node such as `method.proposer`)."""
    node, i = Config, 0
    while i < len(parts):
        kinds = {f.name: f.type for f in dataclasses.fields(node)}
        if parts[i] not in kinds:
            return i
        if node is Config and parts[i] == "compare":  # compare.<name>.<setting>: a MethodConfig
            node, i = MethodConfig, i + 2
            continue
        if not dataclasses.is_dataclass(kinds[parts[i]]):
            return None
        node, i = kinds[parts[i]], i + 1
    return None


def _with_rest(key: str, rest: list[str]) -> str:
    """`key` followed by `rest` where that names a setting (`compile_options.autotune` found as
    `engine.compile_options`: `engine.compile_options.autotune`), else `key`."""
    whole = ".".join([key, *rest])
    return whole if rest and _unknown_part(whole.split(".")) is None else key


def override_hints(overrides: list[str]) -> list[str]:
    """For command-line overrides that Hydra refused, the settings that were probably meant: `method.k=8`
    -> `method.num_speculative_tokens`, `temperature=0.7` -> `generation.temperature`. Only keys that
    name no setting of the schema get a hint (a group choice such as `method=eagle`, `+`/`~` overrides,
    Hydra's own and free-form nodes, such as `method.proposer.*`, are left alone)."""
    here = Path(__file__).resolve().parents[1]  # the configs: a wheel's specdec/conf, or a clone's conf/
    groups = {"hydra", "experiment"} | {p.name for conf in (here / "conf", here.parent / "conf") if conf.is_dir()
                                        for p in conf.iterdir() if p.is_dir()}
    every = _settings()
    hints = []
    for override in overrides:
        key = override.split("=", 1)[0]
        if "=" not in override or key.startswith(("+", "~", "-", "hydra.")) or "/" in key or "@" in key:
            continue
        parts = key.split(".")
        if len(parts) == 1 and key in groups:
            continue
        bad = _unknown_part(parts)
        if bad is None:
            continue
        wanted = ALIASES.get(parts[bad], parts[bad])
        # Where the key was going first (the setting under the same node), then anywhere by that name
        # (a setting that moved: `packed_linear` -> `engine.packed_linear`, the rest of the key kept where
        # it names a setting there), then a near spelling, under the same node or, for a top-level key,
        # of any setting's own name.
        beside = ".".join([*parts[:bad], wanted])
        near = ([beside] if bad and _unknown_part(beside.split(".")) is None else
                [_with_rest(k, parts[bad + 1:]) for k in every if k.rsplit(".", 1)[-1] == wanted])
        scope = ".".join(parts[:bad])
        under = [k[len(scope) + 1:] for k in every if k.startswith(scope + ".")] if bad else every
        near = near or [f"{scope}.{c}" if bad else c for c in difflib.get_close_matches(parts[bad], under, n=1, cutoff=0.75)]
        if not near and not bad:
            names = difflib.get_close_matches(parts[0], {k.rsplit(".", 1)[-1] for k in every}, n=1, cutoff=0.75)
            near = [k for k in every if k.rsplit(".", 1)[-1] in names]
        if near:
            hints.append(f"`{key}` is not a setting; did you mean {' or '.join(f'`{k}`' for k in near)}?")
        else:
            hints.append(f"`{key}` is not a setting; `python -m specdec --cfg job` prints them all")
    return hints


def register() -> None:
    """Put the schema in Hydra's ConfigStore (`conf/config.yaml` lists `base_config` first)."""
    ConfigStore.instance().store(name="base_config", node=Config)


register()


# ---------------------------------------------------------------- checks before anything loads


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"{key}: {message}")


def resolve_path(path: str | Path) -> Path:
    """A path from the config: `~` is the home folder, a relative path is relative to the directory the
    command was started from (Hydra's runtime cwd inside a job, else the current directory)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import to_absolute_path

    path = Path(path).expanduser()  # first: to_absolute_path would make "~/x" into "<cwd>/~/x"
    if HydraConfig.initialized():
        return Path(to_absolute_path(str(path)))
    return path.absolute()


def _check_type(key: str, value: Any, kind: type, optional: bool = False) -> None:
    """`value` must be an int (kind int) or a number (kind float), or None if `optional`. A config built
    in Python bypasses the schema's conversions, so "0.5" or None would otherwise fail later as a bare
    TypeError far from the key."""
    from specdec.study.registry import type_problem

    problem = type_problem(value, kind, optional)
    if problem:
        _fail(key, problem)


def _check_target(key: str, target: Any) -> None:
    """`_target_` must name an importable attribute (checked without instantiating anything)."""
    from specdec.study.registry import target_of

    try:
        target_of(target, key.removesuffix("._target_"))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_known_keys(node: DictConfig, path: str = "") -> None:
    """Every key of a schema node is the schema's: Hydra's `+key=value` adds one the schema lacks,
    which nothing reads (a misspelt `+generation.temprature=0.7` would run greedy unsaid). Nodes of
    free form (a proposer's arguments) are checked against their class instead (`_check_arguments`)."""
    import dataclasses

    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        names = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            if key not in names and not (path == "" and key == "hydra"):
                _fail(f"{path}{key}", f"is not a setting (added with `+`?); {path.rstrip('.') or 'the config'} "
                                      f"has: {', '.join(names)}")
        children = names
    elif schema is dict:
        children = list(node)
    else:
        return
    for key in children:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            _check_known_keys(child, f"{path}{key}.")


def _cores() -> int:
    """The cores this process may run on (its affinity: a container's or a job's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


TINY_MAX_LAYERS = 64  # a test model: deeper than this is a typo, and would build for minutes
TINY_MIN_VOCAB = 16  # ids 0-2 are pad, eos and unk; the built-in prompts need a few more


def _check_tiny(role: str, m: DictConfig) -> None:
    """A tiny random Llama's size (`specdec.models.tiny_random_model`) that can decode the prompts."""
    _check_type(f"{role}.num_layers", m.num_layers, int)
    _check_type(f"{role}.vocab_size", m.vocab_size, int)
    if not 1 <= m.num_layers <= TINY_MAX_LAYERS:
        _fail(f"{role}.num_layers", f"a tiny random model has 1 to {TINY_MAX_LAYERS} layers, got {m.num_layers}")
    if m.vocab_size < TINY_MIN_VOCAB:
        _fail(f"{role}.vocab_size", f"a tiny random model needs >= {TINY_MIN_VOCAB} tokens, got {m.vocab_size}")


def model_spec(model_cfg: DictConfig, role: str):
    """The `specdec.models.ModelSpec` of `target` or `draft` (`role`): a local path resolves against the
    directory the command was started from (`resolve_path`)."""
    from specdec.models import ModelSpec

    path = model_cfg.path
    if path and path not in ("embedded", "tiny_random") and (path.startswith((".", "~")) or Path(path).exists()):
        path = str(resolve_path(path))
    return ModelSpec(path=path, gguf_file=model_cfg.gguf_file, name=role, seed=model_cfg.seed,
                     num_layers=model_cfg.num_layers, vocab_size=model_cfg.vocab_size)


def _check_model(cfg: DictConfig, role: str) -> None:
    """`role`'s files are where its config says (`specdec.models.locate`: no model is read)."""
    from specdec.core.errors import InputError
    from specdec.models import locate

    try:
        locate(model_spec(cfg[role], role))
    except InputError as err:
        key = f"{role}.gguf_file" if cfg[role].gguf_file and not str(cfg[role].path or "").endswith(".gguf") \
            else f"{role}.path"
        _fail(key, str(err))


def room_message(key: str, new: int, k: int, need: int, method: str, context: str) -> str:
    """Why a method's request cannot fit the context even after a one-token prompt (`key` is blamed:
    what sets the width of a step, the method's k or a tree's budget, or max_new_tokens): said the same
    before the models load (`validate`) and after."""
    return (f"{key}: max_new_tokens={new} plus up to {k} drafted tokens a step need {need} positions with a "
            f"one-token prompt ({method}), more than {context}; lower {key}")


def _check_context(cfg: DictConfig, role: str) -> None:
    """Every method's max_new_tokens and k fit `role`'s context after a one-token prompt, where its
    config alone tells the context (`specdec.models.context_length_of`). A step drafts up to the
    schedule's k_max, or a tree's nodes where its config tells them (`_tree_width`: a `budget`, a
    `tree`), and that key is blamed; exact greedy's scoring width may reserve more: the exact check,
    with the prompts, runs once the models are loaded (`experiment._check_room`)."""
    from specdec.models import context_length_of

    context = context_length_of(model_spec(cfg[role], role))
    if context is None:
        return
    new = cfg.generation.max_new_tokens
    for key, m in method_configs(cfg):
        if role == "draft" and not m.needs_draft:
            continue
        k, width = step_width(key, m)
        need = 1 + new + k
        if need > context:
            blame = width if k and 2 + k > context else "generation.max_new_tokens"
            raise ConfigError(room_message(blame, new, k, need, m.name,
                                           f"the {role}'s context of {context} tokens (max_position_embeddings)"))


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError, naming the key, for any value that cannot work. Loads no model."""
    from specdec.core.sampling import SamplingParams
    from specdec.study.data import HF_FILE_TYPES, READER_SETTINGS
    from specdec.study.tracking import TRACKER_SETTINGS

    _check_known_keys(cfg)
    g = cfg.generation
    for key, kind, optional in (
        ("generation.max_new_tokens", int, False), ("generation.temperature", float, False),
        ("generation.top_p", float, False), ("generation.top_k", int, False),
        ("generation.batch_size", int, False), ("seed", int, False), ("threads", int, True),
        ("data.limit", int, True), ("repeats", int, False),
    ):
        _check_type(key, OmegaConf.select(cfg, key), kind, optional)
    if g.max_new_tokens < 1:
        _fail("generation.max_new_tokens", f"must be >= 1, got {g.max_new_tokens}")
    if g.batch_size < 1:
        _fail("generation.batch_size", f"must be >= 1, got {g.batch_size}")
    if cfg.repeats < 1:
        _fail("repeats", f"must be >= 1 (how many times the comparison runs), got {cfg.repeats}")
    if not 0 <= g.temperature < math.inf:
        _fail("generation.temperature", f"must be finite and >= 0 (0 is greedy), got {g.temperature}")
    if not 0 < g.top_p <= 1:
        _fail("generation.top_p", f"must be in (0, 1], got {g.top_p}")
    if g.top_k < 0:
        _fail("generation.top_k", f"must be >= 0 (0 disables it), got {g.top_k}")
    filters = [f"{key}={g[key]}" for key, off in (("top_p", 1.0), ("top_k", 0)) if g[key] != off]
    if g.temperature == 0 and filters:  # a warning, not an error: a sweep over temperatures includes 0
        log.warning("generation.temperature=0 decodes greedily and ignores %s; set a temperature > 0 to "
                    "sample from the filtered distribution", " and ".join(filters))

    # Where the models are comes before the methods: a mistyped target.path is that, not a method's
    # checkpoint trained for another target.
    if not cfg.target.path and not cfg.target.gguf_file:
        _fail("target.path", "is empty; set target=smollm2_135m, target=tiny_random or target.path=<model>")
    if cfg.target.path == "self":
        _fail("target.path", "`self` is for drafts only")
    roles = ["target"]
    if cfg.draft.path not in ("self", None) and any(m.needs_draft for _, m in method_configs(cfg)):
        # (draft=none with a method that needs a draft is the method's error, below)
        roles.append("draft")
    for role in roles:
        _check_model(cfg, role)

    params = SamplingParams(g.temperature, g.top_k, g.top_p)
    for key, m in method_configs(cfg):
        _validate_method(key, m, cfg, params)

    for role in roles:
        _check_context(cfg, role)

    d = cfg.data
    reader = _check_part("data.source", "data/source", d.source, d.source_args, {k: d[k] for k in READER_SETTINGS})
    _check_reader_reads(reader, d)
    if d.limit is not None and d.limit < 1:
        _fail("data.limit", f"must be >= 1 (or null for all prompts), got {d.limit}")
    if d.source == "hf" and not (d.path or d.hf_name):
        _fail("data.path", "data=hf needs data.path (a local json/jsonl/csv/parquet/txt file) or data.hf_name")
    if d.path:  # spec_bench without a path reads the copy in the package
        path = resolve_path(d.path)
        suffix = path.suffix.lower()
        if d.source == "hf" and path.is_file() and suffix not in HF_FILE_TYPES:
            _fail("data.path", f"{path}: data=hf reads local .json, .jsonl, .csv, .parquet or .txt files (and "
                               f"dataset folders); {suffix or 'a file without a suffix'} is none of them")
        if (d.source == "spec_bench" or suffix in HF_FILE_TYPES) and not path.is_file():
            _fail("data.path", f"file not found: {path}")

    device = str(cfg.device)
    if device not in DEVICES and not device.startswith("cuda:"):
        _fail("device", f"must be one of {', '.join(DEVICES)} (or cuda:N), got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            _fail("device", f"{device} requested but CUDA is not available here; use device=auto or cpu")
    if cfg.dtype not in DTYPES:
        _fail("dtype", f"must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    _check_engine(cfg)
    if cfg.threads is not None and not 1 <= cfg.threads <= _cores():
        _fail("threads", f"must be between 1 and this machine's {_cores()} cores, or null (torch's default), "
                         f"got {cfg.threads}")
    if not 0 < cfg.logger.init_timeout < math.inf:
        _fail("logger.init_timeout", f"must be a positive number of seconds, got {cfg.logger.init_timeout}")
    for role in ("target", "draft"):
        if cfg[role].path == "tiny_random":
            _check_tiny(role, cfg[role])
    _check_tensor_parallel(cfg)
    tracker = _check_part("logger.kind", "logger/kind", cfg.logger.kind,
                          offered={k: cfg.logger[k] for k in TRACKER_SETTINGS})
    _check_tracker_mode(tracker, cfg.logger.mode)


def _check_tensor_parallel(cfg: DictConfig) -> None:
    """`target.tp_size` > 1 shards the target over that many torchrun processes
    (`specdec.core.tensor_parallel`): the launch, the target's heads, the device, and the parts that
    would make the ranks decode apart (decisions from measured time, transformers' own loop) or that
    do not run on sharded weights (compile, packed linear layers)."""
    from specdec.core.errors import InputError
    from specdec.core.tensor_parallel import check_heads, check_launch

    _check_type("target.tp_size", cfg.target.tp_size, int)
    _check_type("target.tp_check", cfg.target.tp_check, bool)
    if cfg.draft.tp_size != 1:
        _fail("draft.tp_size", f"the draft runs whole on every rank; only target.tp_size shards, got {cfg.draft.tp_size}")
    tp = cfg.target.tp_size
    if tp < 1:
        _fail("target.tp_size", f"must be >= 1 (1: one process holds the whole target), got {tp}")
    if tp == 1:
        return
    try:
        check_launch(tp, "target.tp_size")
        config = _model_config(cfg.target)
        if config is not None:  # else the load checks the heads
            check_heads(config, tp, key="target.tp_size")
    except InputError as err:
        _fail("target.tp_size", str(err))
    if str(cfg.device).startswith("cuda:"):
        _fail("device", f"{cfg.device} would put every rank of target.tp_size={tp} on one GPU; use device=cuda "
                        "(each rank takes the GPU of its LOCAL_RANK), auto or cpu")
    for key, value in (("compile", cfg.compile), ("engine.packed_linear", cfg.engine.packed_linear)):
        if value == "on":
            _fail(key, f"runs on whole weights, not the shards of target.tp_size={tp}; set {key}=off (auto is off "
                       "with tp)")
    from specdec.study.registry import build_schedule, target_of

    for key, m in method_configs(cfg):
        if m.decoder is not None:
            _fail(f"{key}.decoder", f"{m.name} runs transformers' own decoding loop, whose draws specdec does not "
                                    f"keep equal across the ranks of target.tp_size={tp}; compare specdec's methods")
        timed = [f"{key}.schedule" for s in [build_schedule(m.schedule, max(m.num_speculative_tokens, 1),
                                                            m.schedule_args)] if _timed(type(s))]
        if m.proposer is not None and _timed(target_of(m.proposer._target_, f"{key}.proposer")):
            timed.append(f"{key}.proposer")
        if timed:
            _fail(timed[0], f"{m.name} decides from time measured in this process, which differs from rank to rank: "
                            f"with target.tp_size={tp} the ranks would draft differently and decode apart; use a "
                            "schedule and proposer that decide from tokens alone (constant, heuristic, confidence)")


def _timed(part: Any) -> bool:
    """Whether a schedule or proposer class decides from measured time: the adaptive wing's do."""
    return getattr(part, "__module__", "").startswith("specdec.adaptive")


def _model_config(model_cfg: DictConfig) -> Any:
    """The transformers config of a model, read without its weights; None where only loading it would
    tell (a GGUF file)."""
    from specdec.models import locate, tiny_random_model

    spec = model_spec(model_cfg, "target")
    if spec.path == "tiny_random":
        import torch

        with torch.device("meta"):
            return tiny_random_model(num_layers=1, vocab_size=spec.vocab_size).config
    source = locate(spec)
    if isinstance(source, Path) and source.is_file():
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(source))


def _check_engine(cfg: DictConfig) -> None:
    """`compile` and the `engine` switches take one of their values; the old spellings of compile=
    name the settings that replaced them; autotuning and frozen weights are one or the other."""
    if cfg.compile in COMPILE_MOVED:
        _fail("compile", f"compile={cfg.compile} is now `compile=on {COMPILE_MOVED[cfg.compile]}` "
                         "(compile is off, on or auto)")
    if cfg.compile not in COMPILE_MODES:
        _fail("compile", f"must be one of {', '.join(COMPILE_MODES)}, got {cfg.compile!r}")
    e, options = cfg.engine, cfg.engine.compile_options
    for key, value, modes in (("engine.packed_linear", e.packed_linear, PACKED_LINEAR_MODES),
                              ("engine.overlap", e.overlap, OVERLAP_MODES),
                              ("engine.compile_options.cuda_graphs", options.cuda_graphs, CUDA_GRAPH_MODES)):
        if value not in modes:
            _fail(key, f"must be one of {', '.join(modes)}, got {value!r}")
    if options.autotune and options.freeze_weights:
        _fail("engine.compile_options.freeze_weights", "and engine.compile_options.autotune are both true; "
                                                       "compiled passes take one of them: set the other false")
    changed = [f"engine.compile_options.{f.name}={options[f.name]}" for f in dataclasses.fields(CompileOptions)
               if options[f.name] != f.default]
    if cfg.compile == "off" and changed:  # a warning, not an error: a sweep over compile= includes off
        log.warning("compile=off runs every pass eagerly and ignores %s; set compile=on or auto to use them",
                    " and ".join(changed))


def _check_part(key: str, folder: str, spec: Any, args: Any = None, offered: Any = None) -> Any:
    """A part named by `key` (see `specdec.study.registry`) must exist and take the arguments given; nothing is
    built. Returns the class or function it names."""
    from specdec.study.registry import resolve

    try:
        return resolve(folder, spec, key, args, offered=offered)[1]
    except ValueError as err:
        _fail(key, str(err))



def _check_reader_reads(reader: Any, d: DictConfig) -> None:
    """A reader setting changed from its default (`path`, `hf_name`, `split`, the field names) is one
    the data source reads: the reader is offered only the settings it takes, so a file named for a
    source that reads none (data=builtin data.path=mine.jsonl) would otherwise run the built-in
    prompts unsaid. data=hf reads a file or a dataset, not both."""
    from specdec.study.data import READER_SETTINGS
    from specdec.study.registry import takes

    source = d.source if isinstance(d.source, str) else "<node>"
    for name in READER_SETTINGS:
        if d[name] != DataConfig.__dataclass_fields__[name].default and not takes(reader, name):
            _fail(f"data.{name}", f"is set, but data.source={source} does not read it (it would be ignored); "
                                  "data=spec_bench data.path=<file> reads a Spec-Bench question file, data=hf "
                                  "reads a json/jsonl/csv/parquet/txt file (data.path) or a dataset (data.hf_name), "
                                  "with data.split, data.text_field, data.category_field and data.id_field")
    if d.path and d.hf_name and takes(reader, "path") and takes(reader, "hf_name"):
        _fail("data.hf_name", f"and data.path are both set ({d.hf_name!r}, {d.path!r}): give one, the dataset "
                              "name or the local file")


def _check_tracker_mode(tracker: Any, mode: str | None) -> None:
    """A tracker that lists its `MODES` gets one of them: `mode` as it will resolve it
    (`WandbTracker.resolve_mode`: `logger.mode`, else `WANDB_MODE`)."""
    modes = getattr(tracker, "MODES", None)
    if not modes:
        return
    mode = tracker.resolve_mode(mode)
    if mode not in modes:
        source = "the WANDB_MODE environment variable" if os.environ.get("WANDB_MODE") == mode else "logger.mode"
        _fail("logger.mode", f"{mode!r} (from {source}) is not one of {', '.join(modes)}; "
                             "offline keeps the run local (wandb sync uploads it later), logger=none turns W&B off")


def _check_tree_verifier(key: str, m: DictConfig, verifier: Any, params: Any) -> None:
    """A proposer that drafts token trees takes only the verifiers with a tree form, at any temperature
    (block verification and lossy rules would otherwise be swapped silently for the tree rule)."""
    from specdec.core.sampling import SamplingParams
    from specdec.core.tree_verify import TREE_VERIFIERS
    from specdec.core.verify import make_verifier
    from specdec.study.registry import build_verifier

    names = {verifier.name}
    if params.greedy:  # the rule it would be at temperature > 0, where rules differ
        try:
            names.add(make_verifier(build_verifier(m.verifier, m.verifier_args), SamplingParams(1.0)).name)
        except ValueError:  # a greedy-only rule
            pass
    if not names <= set(TREE_VERIFIERS):
        spec = m.verifier if isinstance(m.verifier, str) else ", ".join(sorted(names))
        _fail(f"{key}.verifier", f"{key}={m.name} drafts token trees, which take verifier=auto, greedy or "
                                 f"speculative_sampling (the rules with a tree form); verifier={spec} has none")


def method_configs(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """(config key, method config) of `method` and of every `compare` entry, in that order."""
    return [("method", cfg.method)] + [(f"compare.{name}", m) for name, m in cfg.compare.items()]


def _plain(value: Any) -> Any:
    """A config value as plain Python (a list for a ListConfig)."""
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def _refers_to(node: Any, target: Any) -> bool:
    """Whether the config node `node` is, or holds, an interpolation of the node `target`
    (`${..heads_path}`, `${....heads_path}`, absolute or inside a string); a reference that does not
    resolve (a method file read alone, `${method.heads_path}`) refers to nothing."""
    import re

    from omegaconf import AnyNode
    from omegaconf.errors import OmegaConfBaseException

    if not node._is_interpolation():
        return False
    for ref in re.findall(r"\$\{\s*(\.*[A-Za-z_][\w.]*)\s*\}", str(node._value())):
        try:
            if AnyNode(f"${{{ref}}}", parent=node._get_parent())._maybe_dereference_node() is target:
                return True
        except OmegaConfBaseException:
            continue
    return False


def _nodes(node: Any) -> Iterator[Any]:
    """`node` and every node under it."""
    yield node
    if isinstance(node, (DictConfig, ListConfig)) and not (node._is_none() or node._is_missing()
                                                           or node._is_interpolation()):
        for k in node.keys() if isinstance(node, DictConfig) else range(len(node)):
            yield from _nodes(node._get_node(k))


def reads(m: DictConfig, name: str) -> bool:
    """Whether the method config `m`'s proposer or decoder refers to the method's own setting `name`
    (`heads_path: ${..heads_path}`, a hybrid part's `${....heads_path}`): only then is it used."""
    if name not in m:
        return False
    target = m._get_node(name)
    return any(_refers_to(n, target) for part in ("proposer", "decoder") if part in m for n in _nodes(m._get_node(part)))


def _setting_key(key: str, m: DictConfig, label: str, spec: DictConfig, arg: str) -> str:
    """The key that sets argument `arg` of the part configured at `label` (`spec`): the method's own
    setting where the part refers to it (`method.heads_path`), else the part's (`method.proposer.budget`)."""
    if arg in spec:
        node = spec._get_node(arg)
        for name in m:
            if _refers_to(node, m._get_node(name)):
                return f"{key}.{name}"
    return f"{label}.{arg}"


def _method_files() -> dict[str, DictConfig]:
    """Every method's file in conf/method/ (a wheel's specdec/conf, or a clone's conf/), each read alone
    over the schema (a file lists only what differs from `MethodConfig`'s defaults)."""
    from omegaconf.errors import OmegaConfBaseException

    here = Path(__file__).resolve().parents[1]
    folder = next((c / "method" for c in (here / "conf", here.parent / "conf") if (c / "method").is_dir()), None)
    files = {}
    for path in sorted(folder.glob("*.yaml")) if folder else []:
        try:
            files[path.stem] = OmegaConf.merge(OmegaConf.structured(MethodConfig), OmegaConf.load(path))
        except OmegaConfBaseException:  # not a method over the schema: it names no setting a method reads
            continue
    return files


def _check_read(key: str, m: DictConfig, given: dict[str, tuple[Any, DictConfig]]) -> None:
    """A proposer's setting kept on the method (`PROPOSER_SETTINGS`: heads_path, tree) that is changed
    from its default is one the method's proposer reads (`reads`): `method.tree=` for eagle or ngram,
    or a heads checkpoint for ngram, would otherwise be ignored and recorded as if used. The default is
    the method file's (eagle's `heads_path: embedded`), else the schema's. `given`: config key ->
    (class, its config) of the proposer or decoder and a hybrid's parts."""
    for name in PROPOSER_SETTINGS:
        value = _plain(m[name])
        if value == MethodConfig.__dataclass_fields__[name].default or reads(m, name):
            continue
        files, default = _method_files(), MethodConfig.__dataclass_fields__[name].default
        if m.name in files and value == _plain(files[m.name].get(name, default)):  # the method's own default
            continue
        if not given:
            why = f"{key}={m.name} drafts nothing (plain decoding)"
        else:
            import inspect

            cls = next(c for label, (c, _) in given.items() if label in (f"{key}.proposer", f"{key}.decoder"))
            takers = [(lbl, c) for lbl, (c, _) in given.items() if name in inspect.signature(c).parameters]
            if takers:  # the part is given its own value
                _fail(f"{key}.{name}", f"is set to {value!r}, but {key}={m.name} does not read it (it would be "
                                       f"ignored): {takers[0][1].__name__} reads {takers[0][0]}.{name}, which does "
                                       f"not refer to it; set {takers[0][0]}.{name} instead")
            else:
                params = [n for n, p in inspect.signature(cls).parameters.items()
                          if n != "engine" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                why = f"{cls.__name__} takes no {name}" + (f" (it takes: {', '.join(params)})" if params else "")
        readers = sorted(n for n, f in files.items() if reads(f, name))
        who = (f"method={' or '.join([', '.join(readers[:-1]), readers[-1]] if len(readers) > 1 else readers)} "
               f"read{'s' if len(readers) == 1 else ''} it") if readers else "no method here reads it"
        _fail(f"{key}.{name}", f"is set to {value!r}, but {key}={m.name} does not read it (it would be ignored): "
                               f"{why}; {who}")


def _check_heads(where: str, path: str | None, key: str, m: DictConfig, cfg: DictConfig, kind: str,
                 optional: bool) -> Path | None:
    """`path` (set by the key `where`) names a checkpoint of `kind` that exists and, if `embedded`, a
    target it was trained for; returns the file. `optional` (a hybrid's part): null leaves the part
    out instead of failing (None)."""
    drop = f", or leave the {kind} part out: {where}=null" if optional else ""
    if not path:
        if optional:
            return None
        _fail(where, f"{key}={m.name} needs trained heads: set {where}=<checkpoint> "
                     "(train one with scripts/train_heads.py)")
    from specdec.proposers.heads import resolve_heads_path

    if path != "embedded":
        heads = resolve_path(path)
    elif cfg.target.path != "embedded":
        _fail(where, f"`embedded` is the {kind} checkpoint trained for the embedded target "
                     f"(SmolLM2-135M), not for target.path={cfg.target.path}. Train one for this target "
                     f"(scripts/train_heads.py kind={kind} target.path=...) and set {where}=<it>"
                     + (drop or ", or leave this method out: the default run (experiment=overview) "
                        "includes it, `~experiment method=<name>` runs one method alone"))
    else:
        heads = resolve_heads_path(path, kind)
    if not heads.is_file():
        _fail(where, f"file not found: {heads}{drop}")
    from specdec.proposers.heads import checkpoint_info

    try:
        checkpoint_info(heads, kind)  # the header only: a broken file fails here, before any model loads
    except ValueError as err:
        _fail(where, str(err).removeprefix("method.heads_path=") + drop)
    return heads


def _checkpoint_vocab(path: Path) -> tuple[dict, int | None, bool]:
    """A heads checkpoint's metadata, the number of tokens its drafts come from and whether that is a
    reduced vocabulary (its `vocab_ids`), from the file's header alone."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = json.loads((f.metadata() or {}).get("meta", "{}"))
        if "vocab_ids" in f.keys():
            return meta, f.get_slice("vocab_ids").get_shape()[0], True
    return meta, meta.get("vocab_size"), False


def _check_proposer_part(key: str, m: DictConfig, cfg: DictConfig, label: str, cls: Any, spec: DictConfig,
                         optional: bool) -> None:
    """A proposer's (or a hybrid part's) tree and checkpoint, each blamed on the key that sets it: the
    tree is a valid one; the checkpoint exists and holds heads of the proposer's kind; the drafts it
    is asked for fit it (topk and tree ranks within its vocabulary, a tree no deeper than its heads),
    checked from the checkpoint's header as the proposer's constructor checks them with the model."""
    import inspect

    from specdec.core.tree import static_tree

    shape = None
    if spec.get("tree") is not None:
        try:
            shape = static_tree(_plain(spec.tree))
        except ValueError as err:
            _fail(_setting_key(key, m, label, spec, "tree"), str(err).removeprefix("method.tree "))
    corpus = spec.get("corpus")
    if corpus is not None and not resolve_path(corpus).is_file():
        _fail(_setting_key(key, m, label, spec, "corpus"), f"{corpus} is not a file; give a JSONL file of other "
              "prompts' outputs (a results.jsonl, or scripts/train_heads.py kind=corpus out=<file>.jsonl)")
    if "heads_path" not in spec:
        return
    kind = getattr(cls, "name", m.name)
    meta, info = {}, None
    if hasattr(cls, "heads_info"):  # a drafter of a published format: its own reader checks it
        where = _setting_key(key, m, label, spec, "heads_path")
        if optional and not spec.heads_path:
            return
        path = spec.heads_path
        try:  # None: not a published drafter's folder (eagle's, medusa's), a checkpoint checked below
            info = cls.heads_info(str(resolve_path(path)) if path and path != "embedded" else path)
        except (ValueError, OSError, ImportError) as err:
            _fail(where, str(err).removeprefix(f"{where}=").removeprefix("method.heads_path="))
    if info is not None:
        vocab, reduced, *more = info  # (tokens, reduced) or with {"num_heads": K}
        meta = more[0] if more else {}
    else:
        heads = _check_heads(_setting_key(key, m, label, spec, "heads_path"), spec.heads_path, key, m, cfg, kind,
                             optional)
        if heads is None:
            return
        meta, vocab, reduced = _checkpoint_vocab(heads)
    reduced = " (the checkpoint reduced the vocabulary)" if reduced else ""
    params = inspect.signature(cls).parameters
    topk = spec.get("topk", params["topk"].default if "topk" in params else None)
    if vocab and isinstance(topk, int) and topk > vocab:
        _fail(_setting_key(key, m, label, spec, "topk"), f"is {topk}, but the drafter proposes from {vocab} "
                                                         f"tokens{reduced}; use a topk of at most {vocab}")
    if shape is not None:
        where, depth = _setting_key(key, m, label, spec, "tree"), meta.get("num_heads")
        if depth and shape.max_depth > depth:
            _fail(where, f"is {shape.max_depth} deep but the checkpoint has {depth} heads; use a tree at most "
                         f"{depth} deep")
        if vocab and max(shape.ranks) >= vocab:
            _fail(where, f"rank {max(shape.ranks)} asks each head for more guesses than the {vocab} tokens it "
                         f"proposes from{reduced}; use ranks below {vocab}")


def _parts(key: str, m: DictConfig) -> dict[str, tuple[Any, DictConfig]]:
    """Config key -> (class, its config) of the method's proposer, or of a hybrid's parts (a proposer
    with a `parts` mapping); empty without a proposer."""
    from specdec.study.registry import target_of

    if m.proposer is None:
        return {}
    if isinstance(m.proposer.get("parts"), DictConfig):
        return {f"{key}.proposer.parts.{name}": (target_of(spec._target_, f"{key}.proposer.parts.{name}"), spec)
                for name, spec in m.proposer.parts.items() if isinstance(spec, DictConfig) and "_target_" in spec}
    return {f"{key}.proposer": (target_of(m.proposer._target_, f"{key}.proposer"), m.proposer)}


def step_width(key: str, m: DictConfig) -> tuple[int, str]:
    """The most tokens a step of the method at `key` drafts, as its config tells (the schedule's k_max,
    or a tree's nodes where more: `_tree_width`), and the key that sets that number; (0, the k key)
    for plain decoding and for a whole decoder (`decoder`), whose k is its own."""
    from specdec.study.registry import build_schedule

    k, width = 0, f"{key}.num_speculative_tokens"
    if m.proposer is not None:
        k = build_schedule(m.schedule, max(m.num_speculative_tokens, 1), m.schedule_args).k_max
        tree = _tree_width(key, m)
        if tree is not None and tree[0] > k:
            k, width = tree
    return k, width


def _tree_width(key: str, m: DictConfig) -> tuple[int, str] | None:
    """The most nodes a step of the method's tree proposer (or a hybrid's tree part) scores, from its
    config, and the key that sets that number: a `budget`, or a `tree`'s nodes. None where no tree
    part's config tells (Medusa's default tree, cut to the checkpoint's heads: small)."""
    import inspect

    from specdec.core.tree import static_tree

    widest = None
    for label, (cls, spec) in _parts(key, m).items():
        params = inspect.signature(cls).parameters
        if not getattr(cls, "drafts_trees", False) or ("heads_path" in spec and spec.heads_path is None):
            continue  # not a tree, or a hybrid's part left out
        if "budget" in params:
            nodes, arg = spec.get("budget", params["budget"].default), "budget"
        elif spec.get("tree") is not None:
            nodes, arg = static_tree(_plain(spec.tree)).num_nodes, "tree"
        else:
            continue
        if isinstance(nodes, int) and (widest is None or nodes > widest[0]):
            widest = (nodes, _setting_key(key, m, label, spec, arg))
    return widest


def _check_arguments(key: str, cls: Any, spec: DictConfig) -> None:
    """Every argument `spec` gives is one `cls` takes, of the type its annotation says where that is
    a scalar (a misspelt or `+`-added one, or `max_ngram=abc`, would otherwise fail only once the
    models have loaded)."""
    from specdec.study.registry import takes, wrong_types

    unknown = [str(k) for k in spec if not str(k).startswith("_") and not takes(cls, str(k))]
    if unknown:
        import inspect

        params = [n for n in inspect.signature(cls).parameters if n != "engine"]
        _fail(f"{key}.{unknown[0]}", f"{cls.__name__} takes no argument {unknown[0]!r}; it takes: {', '.join(params)}")
    # heads_path is `_check_heads`'s: null there leaves a hybrid's part out
    wrong = wrong_types(cls, {k: v for k, v in spec.items() if not str(k).startswith("_") and k != "heads_path"})
    if wrong:
        _fail(f"{key}.{wrong[0]}", wrong[1])


def _validate_method(key: str, m: DictConfig, cfg: DictConfig, params: Any) -> None:
    _check_type(f"{key}.num_speculative_tokens", m.num_speculative_tokens, int)
    for part in ("proposer", "decoder"):
        spec = m[part]
        if spec is not None:
            if not isinstance(spec, DictConfig) or "_target_" not in spec:
                _fail(f"{key}.{part}", f"must be null or a mapping with a `_target_` (the {part} class)")
            _check_target(f"{key}.{part}._target_", spec._target_)
    if m.proposer is not None and m.decoder is not None:
        _fail(key, "set either a proposer or a decoder, not both")
    if m.proposer is not None or m.decoder is not None:
        if m.num_speculative_tokens < 1 and m.decoder is None:
            _fail(f"{key}.num_speculative_tokens", f"k must be >= 1, got {m.num_speculative_tokens}")
        from specdec.study.registry import build_schedule

        try:
            build_schedule(m.schedule, max(m.num_speculative_tokens, 1), m.schedule_args)
        except (ValueError, TypeError) as err:
            _fail(f"{key}.schedule", str(err))
    from specdec.core.verify import make_verifier
    from specdec.study.registry import build_verifier

    try:
        verifier = make_verifier(build_verifier(m.verifier, m.verifier_args), params)  # raises on a name, args or temperature it cannot serve
        if hasattr(verifier, "check_k"):  # a verifier whose arguments depend on k (forced: one a_i per draft)
            verifier.check_k(m.num_speculative_tokens)
    except (ValueError, TypeError) as err:
        _fail(f"{key}.verifier", str(err))
    if m.proposer is None and m.decoder is None and (m.verifier != "auto" or m.verifier_args):
        # a warning, not an error: a sweep over methods may set one verifier for all of them
        log.warning("%s.verifier=%s: plain decoding (%s) drafts nothing, so it verifies nothing; the verifier "
                    "setting is ignored", key, m.verifier, m.name)
    from specdec.study.registry import target_of

    # The proposer, or a hybrid's parts: config key -> (class, its config); a hybrid's part with heads is optional.
    parts = _parts(key, m)
    hybrid = m.proposer is not None and isinstance(m.proposer.get("parts"), DictConfig)
    given = dict(parts)  # every node whose arguments a class takes: the parts, the hybrid itself, a decoder
    if hybrid:
        given[f"{key}.proposer"] = (target_of(m.proposer._target_, f"{key}.proposer"), m.proposer)
    if m.decoder is not None:
        given[f"{key}.decoder"] = (target_of(m.decoder._target_, f"{key}.decoder"), m.decoder)
    for label, (cls, spec) in given.items():
        _check_arguments(label, cls, spec)
    _check_read(key, m, given)
    if m.decoder is not None and hasattr(given[f"{key}.decoder"][0], "check_setup"):  # an anchor out of process
        try:
            given[f"{key}.decoder"][0].check_setup(m.decoder, m.num_speculative_tokens, cfg.target.path)
        except (ValueError, FileNotFoundError) as err:  # InvalidInput, MissingInput
            _fail(f"{key}.decoder", str(err))
    if any(getattr(cls, "drafts_trees", False) for cls, _ in parts.values()):
        _check_tree_verifier(key, m, verifier, params)
    for label, (cls, spec) in parts.items():
        _check_proposer_part(key, m, cfg, label, cls, spec, optional=hybrid)
        if hasattr(cls, "check_target"):  # a drafter inside the target's own files (MTP): they must hold it
            from specdec.models import ModelSpec, locate

            try:
                path = cfg.target.path
                cls.check_target(path if path == "tiny_random" else
                                 locate(ModelSpec(path=path, gguf_file=cfg.target.get("gguf_file"))))
            except (ValueError, OSError) as err:
                _fail("target.path", str(err))
    if m.needs_draft and cfg.draft.path is None:
        _fail("draft", f"{key}={m.name} needs a draft model but draft=none; "
                       "set draft=self, draft=tiny_random or draft.path=<model>")
