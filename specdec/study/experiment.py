"""The body of one Hydra job: check, load, run the method and the baseline side by side, record, report.

One run:
  1. validate  the config, its grid expanded and its methods named apart (specdec.study.variants), with
               specdec.study.config.validate, then load the prompts: bad values and missing files
               fail here, before any model loads
  2. build     target (+ draft if method.needs_draft; tokenizers checked), Engine, proposer, schedule,
               the method's decoder and the autoregressive baseline decoder on the same engine; the
               baseline is one token wide, and a greedy run with exact greedy adds plain decoding at
               the methods' scoring width, whose tokens the methods must equal (`set_exact_greedy`)
  3. warm up   one short untimed generation per decoder
  4. measure   batch by batch, the method and the baseline alternate which goes first (order effects
               cancel); a multi-turn prompt is answered turn by turn, each turn continuing the
               conversation's KV cache (`past=`); results.jsonl is rewritten after every batch;
               `repeats=N` runs all of it N times, each repeat rotating the order once more
  5. report    summary.json (95% intervals: specdec.study.intervals), plots, the W&B run (never
               blocking), the printed table, table.md and table.csv

Batches (generation.batch_size > 1) hold consecutive prompts with the same number of turns. A row's
`wall_s`, `draft_s` and `verify_s` are then its batch's times divided by the batch size (so they add
up to the run's time); `latency_s` is the time until that row finished and `ttft_s` the batch's time
to first token, since every row's first token arrives at the end of the batch's prefill (both are
latencies of a request, not shares of the run). At batch size 1 they are simply the prompt's own.

Cache reuse across turns is one policy for the whole run (`Setup.cache_reuse`, recorded in
summary.json as `cache_reuse`): every method continues a conversation from its previous turn's cache,
or, when some method cannot (transformers' assisted generation and prompt lookup), every method
re-prefills every turn, so that no ratio between methods mixes in the cost of a prefill.

The decoding loop knows nothing of Hydra or W&B; this module knows nothing of KV caches.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specdec.accel.compiled import resolve_compile
from specdec.accel.passes import Accelerated
from specdec.core.decoding import Generation, SpeculativeDecoder
from specdec.core.engine import Engine, resolve_device
from specdec.core.errors import InputError, NoSpace
from specdec.core.metrics import speedup
from specdec.core.tensor_parallel import check_ranks_agree, guard_passes, is_main
from specdec.models import check_tokenizers_compatible, describe_model, load_model
from specdec.study import report
from specdec.study.config import (
    ConfigError,
    method_configs,
    model_spec,
    resolve_path,
    room_message,
    step_width,
    validate,
)
from specdec.study.data import Prompt, build_turn_input, load_prompts, select_prompts
from specdec.study.registry import build_schedule, build_verifier
from specdec.study.report import BASELINE, format_comparison, format_table, make_plots, summarize
from specdec.study.results import PromptResult
from specdec.study.run_dirs import check_no_results, release_run_dir
from specdec.study.tracking import Tracker, make_tracker, sigterm_raises, write_atomic, write_local_results
from specdec.study.variants import expand

log = logging.getLogger("specdec")

WARMUP_TOKENS = 8
TURN_OVERHEAD_TOKENS = 16  # chat-template tokens around one answer, for sizing a conversation's cache


@dataclass
class ExperimentResult:
    out_dir: Path
    summary: dict
    rows: list[PromptResult]
    wandb_run_dir: Path | None
    table: str


@dataclass
class Setup:
    """What `build` makes: the engine, the tokenizer, the decoders of the methods by name (`method`
    first, then `compare`; the baseline itself is never among them), the baseline's decoder, and what
    was loaded as target and draft (`specdec.models.describe_model`, by role)."""

    engine: Engine
    tokenizer: object
    methods: dict[str, SpeculativeDecoder]
    baseline: SpeculativeDecoder
    models: dict[str, dict] = field(default_factory=dict)
    # Exact greedy's plain decoding, scored at the methods' width: the tokens every greedy method must
    # equal, measured beside the one-token-wide baseline that speedups are over (`set_exact_greedy`).
    reference: SpeculativeDecoder | None = None

    @property
    def reference_name(self) -> str | None:
        if self.reference is None:
            return None
        return f"{BASELINE}[exact greedy, width {self.reference.score_width}]"

    @property
    def plain(self) -> list[tuple[str, SpeculativeDecoder]]:
        """Plain decoding's decoders by name: the baseline, and exact greedy's reference if there is one."""
        return [(BASELINE, self.baseline)] + ([(self.reference_name, self.reference)] if self.reference else [])

    @property
    def decoders(self) -> list[tuple[str, SpeculativeDecoder]]:
        """Every decoder the run measures, by name: the methods, then plain decoding's."""
        return [*self.methods.items(), *self.plain]

    @property
    def k_max(self) -> int:
        return max((d.k for d in self.methods.values()), default=0)

    @property
    def cannot_reuse_cache(self) -> list[str]:
        """The methods that cannot continue a conversation from the previous turn's cache. specdec's
        decoders all can; an anchor says whether it can with `continues_cache`."""
        return [name for name, d in self.methods.items() if not getattr(d, "continues_cache", True)]

    @property
    def cache_reuse(self) -> bool:
        """The run's policy: turns continue the previous turn's cache only if every method can."""
        return not self.cannot_reuse_cache


# ---------------------------------------------------------------- 1. data


def load_data(cfg: DictConfig) -> list[Prompt]:
    """The prompt set of `cfg.data`: categories renamed by `category_map`, then selected."""
    d = cfg.data
    path = str(resolve_path(d.path)) if d.path else None
    prompts = load_prompts(d.source, path, hf_name=d.hf_name, split=d.split, text_field=d.text_field,
                           category_field=d.category_field, id_field=d.id_field, source_args=d.source_args)
    mapping = dict(d.category_map or {})
    if mapping:
        prompts = [Prompt(p.prompt_id, mapping.get(p.category, p.category), p.turns) for p in prompts]
    categories = list(d.categories) if d.categories is not None else None
    prompts = select_prompts(prompts, d.limit, categories, d.per_category)
    if not prompts:
        raise ConfigError(f"data: no prompts selected from data.source={d.source} (data.categories, data.limit)")
    return prompts


# ---------------------------------------------------------------- 2. build


def build(cfg: DictConfig) -> Setup:
    """Load the models and make the decoders. The draft loads only if some method needs one."""
    target_spec = model_spec(cfg.target, "target")
    device = cfg.device
    if cfg.target.tp_size > 1:
        target, tokenizer, device = load_sharded_target(target_spec, cfg)
    else:
        target, tokenizer = load_model(target_spec)
    models = {"target": describe_model(target_spec, target)}
    draft = None
    if any(m.needs_draft for _, m in method_configs(cfg)):
        if cfg.draft.path == "self":
            draft = target  # its own cache: the same weights propose and verify
            models["draft"] = {**models["target"], "label": "self"}
        else:
            draft_spec = model_spec(cfg.draft, "draft")
            draft, draft_tokenizer = load_model(draft_spec)
            check_tokenizers_compatible(tokenizer, draft_tokenizer, target, draft)
            models["draft"] = describe_model(draft_spec, draft)
    engine = Engine(target, draft, device=device, dtype=cfg.dtype, passes=accelerated(cfg))
    for described in models.values():
        described["dtype"] = str(engine.dtype).removeprefix("torch.")
    log.info("target %s, draft %s on %s (%s)", models["target"]["label"],
             models["draft"]["label"] if "draft" in models else "none", engine.device,
             str(engine.dtype).removeprefix("torch."))
    baseline = SpeculativeDecoder(engine, tokenizer=tokenizer, exact_greedy=False)  # one token wide
    methods = {}
    for key, m in method_configs(cfg):
        decoder = make_decoder(m, engine, tokenizer, key)
        if decoder is not None:
            if m.name in methods:  # `variants.expand` names them apart; a config built by hand may not
                raise ConfigError(f"{key}.name: two methods of the run are named {m.name}; name this one: "
                                  f"{key}.name=<name>")
            methods[m.name] = decoder
    width = set_exact_greedy(list(methods.values()), cfg.engine.exact_greedy)
    reference = None
    if width > 1 and cfg.generation.temperature == 0:
        reference = SpeculativeDecoder(engine, tokenizer=tokenizer)
        reference.exact_greedy, reference.score_width = True, width
    setup = Setup(engine, tokenizer, methods, baseline, models, reference)
    for _, decoder in setup.decoders:  # plain decoding, and a draft model's steps (`specdec.accel.pipeline`)
        if isinstance(decoder, SpeculativeDecoder):
            decoder.overlap = cfg.engine.overlap
    return setup


def load_sharded_target(spec, cfg: DictConfig) -> tuple[torch.nn.Module, object, torch.device]:
    """(model, tokenizer, this rank's device) of a target sharded over `target.tp_size` torchrun
    ranks (`specdec.core.tensor_parallel`). transformers shards a model as it reads a saved folder: a
    GGUF file is read from its converted folder, a tiny random model is saved to a temporary one
    first (each rank builds the same one from its seed). With `target.tp_check` every target pass
    first checks that the ranks feed it the same tokens."""
    import tempfile

    from specdec.core.engine import resolve_dtype
    from specdec.core.tensor_parallel import init, load_sharded
    from specdec.models import _checkpoint_dir, check_finite_logits, tiny_random_model, tiny_random_tokenizer

    tp = cfg.target.tp_size
    device = init(tp, cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    with tempfile.TemporaryDirectory(prefix="specdec-tp-") as folder:
        if spec.path == "tiny_random":
            # written file by file: under a process group `save_pretrained` writes on rank 0 alone
            from safetensors.torch import save_file

            model = tiny_random_model(seed=spec.seed, vocab_size=spec.vocab_size, num_layers=spec.num_layers)
            model.config.save_pretrained(folder)
            save_file(model.state_dict(), f"{folder}/model.safetensors", metadata={"format": "pt"})
            tiny_random_tokenizer(spec.vocab_size).save_pretrained(folder)
            source = folder
        else:
            source = _checkpoint_dir(spec)
        model, tokenizer = load_sharded(source, tp, device, dtype)
    check_finite_logits(model, f"target {spec.path or spec.gguf_file!r} (rank shard)")
    if cfg.target.tp_check:
        guard_passes(model, "target")
    log.info("target sharded over %d ranks (tensor parallel), this rank on %s", tp, device)
    return model, tokenizer, device


def accelerated(cfg: DictConfig) -> Accelerated:
    """The engine's passes: the one place where `compile` and `engine` become `Accelerated`'s
    arguments. Its `compile` string folds in `engine.compile_options`: autotune as `autotune`,
    freeze_weights as `frozen` (validate refuses both at once), where passes compile at all
    (`compile=auto` compiles on CUDA only, and leaves a CPU eager with either option). A sharded
    target (`target.tp_size` > 1) runs eagerly: compile and packed linear layers need whole weights."""
    options = cfg.engine.compile_options
    if cfg.target.tp_size > 1:
        return Accelerated(compile="off", cuda_graphs=options.cuda_graphs, packed_linear="off")
    mode = cfg.compile
    if mode != "off" and (options.autotune or options.freeze_weights):
        compiles = resolve_compile(mode, resolve_device(cfg.device))
        mode = ("autotune" if options.autotune else "frozen") if compiles else "off"
    return Accelerated(compile=mode, cuda_graphs=options.cuda_graphs, packed_linear=cfg.engine.packed_linear,
                       cpp_wrapper=options.cpp_wrapper)


def set_exact_greedy(methods: list, on: bool) -> int:
    """Exact greedy for a run's methods: every specdec decoder among them scores at one width, the
    widest any of them needs (largest k + 1), so that their greedy outputs agree bit for bit; returns
    that width when exact greedy is on, else 1. Decoders it cannot apply to (`exact_greedy_blocked`:
    trees, compile=on) score as they are.

    Plain decoding is not among them: the baseline every speedup is over stays one token wide, and
    `build` adds plain decoding at this width beside it (`Setup.reference`), whose tokens the methods
    must equal and whose tokens/s against the baseline's is what exact greedy costs. A wide baseline
    would slow the baseline and inflate every speedup, the more the wider the widest method. A run
    with no specdec method (the baseline against transformers' anchors) has width 1: plain decoding
    keeps its own shapes, as `generate()` has them."""
    ours = [d for d in methods if isinstance(d, SpeculativeDecoder)]
    width = max((d.k + 1 for d in ours if d.exact_greedy_blocked is None), default=1)
    for d in ours:
        d.exact_greedy, d.score_width = on and width > 1, width
    return width if on else 1


def exact_greedy_state(decoder, cfg: DictConfig) -> str:
    """For summary.json: `on`, `off`, or `not applied: <why>` where a greedy run asked for exact
    greedy and this decoder cannot have it (README, numerics)."""
    if not cfg.engine.exact_greedy or cfg.generation.temperature != 0:
        return "off"
    if not isinstance(decoder, SpeculativeDecoder):
        return f"not applied: {getattr(decoder, 'engine_name', 'transformers')}'s own decoding loop"
    if decoder.exact_greedy_blocked is not None:
        return f"not applied: {decoder.exact_greedy_blocked}"
    return "on" if decoder.exact_greedy else "off"


@contextlib.contextmanager
def _arguments_of(key: str) -> Iterator[None]:
    """Hydra's instantiate wraps what a constructor raises; an argument it refuses (ValueError,
    TypeError) comes out as a ConfigError that names `key`, unless the message names its key itself."""
    from hydra.errors import InstantiationException

    try:
        yield
    except InstantiationException as err:
        cause = err.__cause__
        if not isinstance(cause, (ValueError, TypeError)) or isinstance(cause, ConfigError):
            raise
        message = str(cause)
        raise ConfigError(message if message.startswith(("method.", "compare.")) else f"{key}: {message}") from cause


def make_decoder(m: DictConfig, engine: Engine, tokenizer, key: str = "method"):
    """The decoder of one method config (`key`: where it is in the config); None for the
    autoregressive baseline itself. An argument its proposer or decoder refuses (a value that cannot
    work with this model, such as an exit layer past the last) is a ConfigError naming the key."""
    with _arguments_of(f"{key}.decoder" if m.decoder is not None else f"{key}.proposer"):
        if m.decoder is not None:  # a whole decoder from elsewhere (the transformers anchors)
            return instantiate(m.decoder, engine=engine, num_speculative_tokens=m.num_speculative_tokens,
                               tokenizer=tokenizer)
        if m.proposer is None:
            return None
        proposer = instantiate(m.proposer, engine=engine)
    schedule = build_schedule(m.schedule, m.num_speculative_tokens, m.schedule_args)
    verifier = build_verifier(m.verifier, m.verifier_args)
    return SpeculativeDecoder(engine, proposer, m.num_speculative_tokens, verifier=verifier, tokenizer=tokenizer,
                              schedule=schedule)


# ---------------------------------------------------------------- 3-4. measure


def make_batches(prompts: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    """Consecutive prompts with the same number of turns, at most `batch_size` per batch."""
    batches: list[list[Prompt]] = []
    for p in prompts:
        last = batches[-1] if batches else None
        if last and len(last) < batch_size and len(last[0].turns) == len(p.turns):
            last.append(p)
        else:
            batches.append([p])
    return batches


def conversation_positions(decoder, tokenizer, prompt: Prompt, cfg: DictConfig) -> int:
    """Cache positions `decoder` needs for a whole conversation: its last turn's input rendered with
    empty answers, each earlier answer and every turn's template tokens around an answer, and then the
    last answer (`positions_needed` adds that and the decoder's own room). Too few only costs the
    reuse of a cache across turns (a fresh prefill), not correctness."""
    turns = prompt.turns
    ids = build_turn_input(tokenizer, [(u, "") for u in turns[:-1]], turns[-1], cfg.data.system_prompt)
    new = cfg.generation.max_new_tokens
    before_last_answer = len(ids) + (len(turns) - 1) * new + (len(turns) > 1) * len(turns) * TURN_OVERHEAD_TOKENS
    return decoder.positions_needed(before_last_answer, new)


def run_batch(decoder: SpeculativeDecoder, role: str, batch: list[Prompt], cfg: DictConfig, seed: int,
              tokenizer, reuse_cache: bool = True) -> list[PromptResult]:
    """Answer every turn of the batch's prompts with one decoder; one result per prompt. With
    `reuse_cache` a turn continues the previous turn's cache (`past=`), else it is prefilled afresh."""
    g = cfg.generation
    turns = len(batch[0].turns)
    reserve = 0  # a conversation's later turns continue the first turn's caches: room for all of them
    if turns > 1 and reuse_cache:
        reserve = max(conversation_positions(decoder, tokenizer, p, cfg) for p in batch)
    histories: list[list[tuple[str, str]]] = [[] for _ in batch]
    generations: list[Generation] = []
    past: Generation | None = None
    for t in range(turns):
        inputs = [build_turn_input(tokenizer, histories[j], p.turns[t], cfg.data.system_prompt)
                  for j, p in enumerate(batch)]
        out = decoder.generate(inputs, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                               top_k=g.top_k, top_p=g.top_p, seed=seed + t, past=past, reserve=reserve)
        # a sharded target's ranks must emit the same tokens (a no-op in one process)
        check_ranks_agree(torch.tensor([i for row in out.output_ids for i in (*row, -1)]).reshape(1, -1),
                          f"{role}, turn {t + 1} of prompts {', '.join(p.prompt_id for p in batch)}: the tokens emitted")
        generations.append(out)
        for j, p in enumerate(batch):
            histories[j].append((p.turns[t], out.texts[j]))
        past = out if reuse_cache else None
    return [PromptResult.from_generations(p.prompt_id, p.category, role, seed, generations, j)
            for j, p in enumerate(batch)]


def drop_too_long(prompts: list[Prompt], setup: Setup, cfg: DictConfig) -> tuple[list[Prompt], list[str]]:
    """Prompts whose conversation fits every decoder's context; the ids of the others (warned, and listed
    in summary.json). Both methods skip the same prompts, so the comparison stays side by side."""
    decoders = [d for _, d in setup.decoders]
    _check_room(setup, cfg)
    kept, dropped = [], []
    for p in prompts:
        fits = all(d.fits(conversation_positions(d, setup.tokenizer, p, cfg)) for d in decoders)
        (kept if fits else dropped).append(p)
    context = min((d.context_length for d in decoders if d.context_length is not None), default=None)
    if dropped:
        log.warning("skipping %d prompt(s) longer than the context of %d tokens (with max_new_tokens=%d): %s",
                    len(dropped), context, cfg.generation.max_new_tokens, ", ".join(p.prompt_id for p in dropped))
    if not kept:
        raise ConfigError(f"data: every selected prompt needs more than the models' context of {context} tokens "
                          f"with max_new_tokens={cfg.generation.max_new_tokens}; lower generation.max_new_tokens "
                          "or select shorter prompts")
    return kept, [p.prompt_id for p in dropped]


def _check_room(setup: Setup, cfg: DictConfig) -> None:
    """k and max_new_tokens must leave room for a prompt in the context: if not, blame them, not the prompts."""
    new = cfg.generation.max_new_tokens
    keys = {m.name: step_width(key, m)[1] for key, m in method_configs(cfg)}  # k, or a tree's budget
    for name, decoder in setup.decoders:
        need = decoder.positions_needed(1, new)
        if decoder.fits(need):
            continue
        key = keys.get(name, "method.num_speculative_tokens")
        key = key if not decoder.fits(decoder.positions_needed(1, 1)) else "generation.max_new_tokens"
        raise ConfigError(room_message(key, new, decoder.k, need, name,
                                       f"the models' context of {decoder.context_length} tokens"))


def warm_up(decoders: list[SpeculativeDecoder], prompt: Prompt, cfg: DictConfig, tokenizer) -> None:
    """One short untimed generation per decoder: first calls pay for allocations and kernel choices."""
    ids = build_turn_input(tokenizer, [], prompt.turns[0], cfg.data.system_prompt)
    g = cfg.generation
    for decoder in decoders:
        decoder.generate([ids], max_new_tokens=min(WARMUP_TOKENS, g.max_new_tokens),
                         temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, seed=cfg.seed)


def measure(setup: Setup, prompts: list[Prompt], cfg: DictConfig, on_batch=None) -> list[PromptResult]:
    """Run every method and the baseline on every batch; the order rotates from batch to batch, so
    each goes first, second, ... equally often and order effects cancel. With `repeats=N` the whole
    comparison runs N times (each result keeps its `repeat`), the order shifted by one more each time,
    so that a prompt's decoders take turns at going first; the seeds are the same in every repeat."""
    roles = setup.decoders
    method_name = " / ".join(setup.methods) or BASELINE
    rows: list[PromptResult] = []
    batches = make_batches(prompts, cfg.generation.batch_size)
    disable = (None if cfg.progress is None else not cfg.progress) if is_main() else True
    with tqdm(total=len(prompts) * cfg.repeats, desc=f"{method_name} vs {BASELINE}", unit="prompt",
              disable=disable,
              file=sys.stderr, leave=False) as bar:
        for repeat in range(cfg.repeats):
            for i, batch in enumerate(batches):
                shift = (i + repeat) % len(roles)
                order = roles[shift:] + roles[:shift]
                for role, decoder in order:
                    measured = run_batch(decoder, role, batch, cfg, cfg.seed + i, setup.tokenizer,
                                         setup.cache_reuse)
                    rows += [replace(r, repeat=repeat) for r in measured]
                bar.update(len(batch))
                if on_batch is not None:
                    on_batch(rows)
    return rows


# ---------------------------------------------------------------- 5. the whole job


def run_info(cfg: DictConfig, setup: Setup | None = None) -> dict:
    """The run's settings for summary.json. Target and draft are named from what `build` loaded
    (`<role>_model`: label, source, type, dtype...); without a setup, from the configured path. A config
    group's name is never a model's label; a `name` given in the config is kept as `<role>_name`."""
    needs_draft = any(m.needs_draft for _, m in method_configs(cfg))
    models = setup.models if setup is not None else {}
    info = {
        "target": models["target"]["label"] if "target" in models else cfg.target.path or cfg.target.gguf_file,
        "target_path": cfg.target.path,
        "target_model": models.get("target"),
        "draft": (models["draft"]["label"] if "draft" in models else cfg.draft.path) if needs_draft else "none",
        "draft_path": cfg.draft.path if needs_draft else None,
        "draft_model": models.get("draft") if needs_draft else None,
        "num_speculative_tokens": cfg.method.num_speculative_tokens if not is_baseline(cfg.method) else 0,
        "schedule": cfg.method.schedule,
        "data": cfg.data.source,
        "temperature": cfg.generation.temperature,
        "max_new_tokens": cfg.generation.max_new_tokens,
        "batch_size": cfg.generation.batch_size,
        "device": cfg.device,
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        **{f"{role}_name": cfg[role].name for role in ("target", "draft") if cfg[role].get("name")},
        # Every method's full arguments (proposer or decoder with its arguments, k, schedule, verifier),
        # so that runs compare from summary.json alone (specdec.study.compare).
        "method_configs": {m.name: OmegaConf.to_container(m, resolve=True) for _, m in method_configs(cfg)},
    }
    if setup is not None:
        info["device"] = str(setup.engine.device)
        info["dtype"] = str(setup.engine.dtype).removeprefix("torch.")
        info["cache_reuse"] = "across_turns" if setup.cache_reuse else "none"
        info["exact_greedy"] = bool(cfg.engine.exact_greedy)
        info["overlap"] = "on" if setup.baseline.overlaps() else "off"  # what plain decoding ran with
        info.update(setup.engine.passes.describe())  # what compile and packed_linear resolved to
        if setup.engine.compile and setup.engine.device.type == "cuda":
            info["cuda_graphs"] = cfg.engine.compile_options.cuda_graphs
        # the methods' scoring width under exact greedy (plain decoding's there: the reference's);
        # the baseline that speedups are over is one token wide
        info["score_width"] = setup.reference.score_width if setup.reference is not None else 1
        if not setup.cache_reuse:
            info["cache_reuse_blocked_by"] = setup.cannot_reuse_cache
    if cfg.target.tp_size > 1:  # the target's layers were split over this many ranks: timings are not one device's
        info["target_tp_size"] = cfg.target.tp_size
    return info


def is_baseline(m: DictConfig) -> bool:
    """A method config that is the autoregressive baseline itself: no proposer and no decoder of its own."""
    return m.proposer is None and m.decoder is None


def job_identity(method_name: str) -> tuple[str, str | None]:
    """(W&B run name, W&B group). In a multirun the group is the sweep folder's name, shared by all its
    jobs, and the name lists this job's values of the swept parameters; otherwise the name lists the
    command-line overrides."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from specdec.study.sweep import swept_keys_of

    if not HydraConfig.initialized():
        return method_name, None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return hc.job.override_dirname or method_name, None
    values = dict(o.lstrip("+~").split("=", 1) for o in hc.overrides.task if "=" in o)
    swept = [f"{k}={values[k]}" for k in swept_keys_of(hc.sweep.dir) if k in values]
    return ",".join(swept) or f"{method_name}-{hc.job.num}", Path(hc.sweep.dir).name


def run(cfg: DictConfig, out_dir: str | Path) -> ExperimentResult:
    """One experiment; writes results.jsonl, summary.json, plots, table.md and table.csv into `out_dir`."""
    out_dir = Path(out_dir)
    try:
        cfg = expand(cfg)  # grids into variants, every method named apart (specdec.study.variants)
        validate(cfg)
        prompts = load_data(cfg)  # a missing file or unknown category fails here, before models load
    except InputError:
        release_run_dir(out_dir)  # a refused run leaves no folder that looks like a failed one
        raise
    # A sharded target's ranks all run the job; rank 0 alone writes results, W&B and the table, and the
    # others log warnings only, into their own Hydra folder, removed at the end if nothing was logged.
    main = is_main()
    if main:
        check_no_results(out_dir, "out_dir")  # never over another run's results (specdec.study.run_dirs)
        out_dir.mkdir(parents=True, exist_ok=True)
    else:
        log.setLevel(logging.WARNING)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    _quiet_transformers()

    method_names = [m.name for _, m in method_configs(cfg) if not is_baseline(m)]
    method_name = method_names[0] if method_names else BASELINE
    greedy = cfg.generation.temperature == 0
    job_name, sweep_group = job_identity(method_name)
    lg = cfg.logger
    tracker = make_tracker(lg.kind, project=lg.project, entity=lg.entity, mode=lg.mode, tags=[*lg.tags, method_name],
                           init_timeout=lg.init_timeout) if main else Tracker()
    config = OmegaConf.to_container(cfg, resolve=True)
    info = run_info(cfg)
    saved: list[PromptResult] = []  # the rows of the last save that was written: what a failure leaves behind
    exact: dict[str, str] = {}  # per method, whether exact greedy applied (known once the decoders are built)
    reference: list[str] = []  # exact greedy's plain decoding, where the run has one (`Setup.reference`)

    def save(rows: list[PromptResult], complete: bool = False, error: str | None = None) -> dict:
        """`rows` is `saved` when a failure is recorded: results.jsonl holds them (once one was written),
        so only the summary is rewritten."""
        summary = summarize(rows, method_names or [BASELINE], info, greedy, exact, *reference)
        summary["complete"] = complete
        if error is not None:
            summary["error"] = error  # how the run ended early; a sweep marks the job failed
        if not main:
            return summary
        with _room_to_write(out_dir, saved):
            write_local_results(out_dir, None if rows is saved and saved else [r.to_dict() for r in rows], summary)
        saved[:] = rows
        return summary

    # A SIGTERM (Slurm, `timeout`) raises here like any failure: partial results are saved with
    # complete=false and the error, the tracker closes its run as failed, the exit status is non-zero.
    with tracker, sigterm_raises():
        try:
            tracker.start(config, name=job_name, group=lg.group or sweep_group, out_dir=out_dir)
            setup = build(cfg)
            prompts, skipped = drop_too_long(prompts, setup, cfg)
            info.update(run_info(cfg, setup), skipped_prompts=skipped)
            exact.update({name: exact_greedy_state(d, cfg) for name, d in setup.decoders})
            reference[:] = [setup.reference_name] if setup.reference is not None else []
            for name, state in exact.items():
                if state.startswith("not applied"):
                    log.warning("%s: exact greedy %s; its greedy output may differ from plain decoding's "
                                "outside float32 (README, numerics)", name, state)
            if cfg.warmup:
                warm_up([d for _, d in setup.decoders], prompts[0], cfg, setup.tokenizer)
            rows = measure(setup, prompts, cfg, on_batch=save)
            summary = save(rows, complete=True)
        except BaseException as exc:  # every way out, Ctrl-C and SIGTERM included; re-raised below
            try:
                partial = save(saved, error=f"{type(exc).__name__}: {exc}".removesuffix(": "))
            except OSError as write_error:  # a full disk: the last save's files are what is left
                if not isinstance(exc, NoSpace):  # whose message says so already
                    log.warning("could not record the failure in %s (%s)", out_dir, write_error)
            else:
                tracker.log_summary(partial, [r.to_dict() for r in saved], {})
            raise
        table = format_table(summary)
        if len(method_names) > 1 or reference:  # exact greedy's reference is a row of its own
            table += "\n\n" + format_comparison(summary)
        if not main:
            release_run_dir(out_dir)
            return ExperimentResult(out_dir, summary, rows, None, table)
        plots = _plots(summary, out_dir) if cfg.plots else {}
        with _room_to_write(out_dir, rows):
            write_atomic({out_dir / "table.md": table + "\n",
                          out_dir / "table.csv": report.csv_text(report.table_rows(summary))})
        plots.update(_report(summary, table, config, plots, out_dir))
        tracker.log_rows(per_prompt(rows, method_name))
        tracker.log_summary(summary, [r.to_dict() for r in rows], plots)
    print(table, flush=True)
    log.info("results in %s", out_dir)
    return ExperimentResult(out_dir, summary, rows, tracker.run_dir, table)


@contextlib.contextmanager
def _room_to_write(out_dir: Path, kept: list[PromptResult]) -> Iterator[None]:
    """A full disk (or quota) while writing into `out_dir` is a NoSpace error that says what is kept:
    the files of the last save (`kept`), whole, since a failed write changes none of them."""
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        n = len({r.prompt_id for r in kept})
        what = (f"results.jsonl and summary.json keep the results up to prompt {n}" if n else
                "no results were written")
        raise NoSpace(f"no space left writing {out_dir} ({err.strerror}); {what}; free some space, or pick "
                      "another hydra.run.dir, and run again") from err


def per_prompt(rows: list[PromptResult], method_name: str) -> list[dict]:
    """One W&B history step per prompt and repeat: the method's numbers and its speedup over the baseline
    on that prompt in that repeat."""
    base = {r.unit: r for r in rows if r.method == BASELINE}
    out = []
    for i, r in enumerate(r for r in rows if r.method == method_name):
        b = base[r.unit]
        out.append({
            "index": i,
            "repeat": r.repeat,
            "new_tokens": r.new_tokens,
            "wall_s": r.wall_s,
            "tokens_per_s": r.tokens_per_s,
            "baseline_tokens_per_s": b.tokens_per_s,
            "speedup": speedup(r.tokens_per_s, b.tokens_per_s),
            "acceptance_rate": r.acceptance_rate,
            "mean_accepted_length": r.mean_accepted_length,
            "ttft_s": r.ttft_s,
        })
    return out


def _plots(summary: dict, out_dir: Path) -> dict[str, Path]:
    """Plots are a convenience: failing to draw them must not fail a run whose results are written."""
    try:
        return make_plots(summary, out_dir)
    except Exception as exc:  # matplotlib problems (fonts, backends) are not worth a lost run
        log.warning("plots failed (%s: %s); results are written", type(exc).__name__, exc)
        return {}


def _report(summary: dict, table: str, config: dict, plots: dict[str, Path], out_dir: Path) -> dict[str, Path]:
    """report.html (specdec.study.html_report): {"report": its path}, or nothing where it could not be
    written; like the plots, a convenience that must not fail a run whose results are written."""
    from specdec.study.html_report import write_run_report

    try:
        return {"report": write_run_report(out_dir, summary, table, config, plots)}
    except Exception as exc:
        log.warning("report.html failed (%s: %s); results are written", type(exc).__name__, exc)
        return {}


def _quiet_transformers() -> None:
    """transformers' weight-loading progress bars would interleave with ours."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
