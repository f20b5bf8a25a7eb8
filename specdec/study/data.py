"""Prompt sets and chat inputs: what the decoding loop is asked to answer.

Three sources, one entry point (`load_prompts`, fed by the `data` config group; a source is the
file `conf/data/source/<name>.yaml` naming its reader with `_target_`, so a new one is a function
returning prompts and one such file):

- `builtin`: a small prompt set written for this project and shipped with the package
  (`specdec/data/builtin.jsonl`), so every run has a workload without downloads.
- `spec_bench`: Spec-Bench's `question.jsonl`, the standard workload on which speculative-decoding
  methods are compared, shipped with the package (`specdec/data/spec_bench/`, with its source and
  licence), or any file in its format; acceptance differs a lot between its categories (summaries and
  RAG copy from the prompt, translation does not), so prompts carry their category.
- `hf`: anything `datasets.load_dataset` can open: local json/jsonl/csv/parquet files, a local
  dataset folder, or a hub name when a network exists (kept offline unless the caller says
  otherwise); and a plain .txt file, one prompt per non-blank line.
- `speed_bench`: SPEED-Bench (https://huggingface.co/datasets/nvidia/SPEED-Bench), read from local
  files; see below.

Prompt files must be UTF-8: a byte that is not, or a lone surrogate from a JSON escape, fails naming
the file and the line here, rather than deep inside a tokenizer later.

A prompt has one or more user turns. The caller answers them turn by turn with `build_turn_input`,
which renders the whole conversation so far through the tokenizer's chat template. Turn 2's ids
start with turn 1's input + answer ids only when the answer ids are the tokenizer's own encoding of the
answer text and the template re-renders earlier turns unchanged (true for SmolLM2-135M-Instruct); a
model may generate another tokenization of the same text, and some templates strip or rewrite earlier
turns. So a caller reuses the KV cache up to `common_prefix_len` and feeds only the rest.

SPEED-Bench's published format (its dataset card, https://huggingface.co/datasets/nvidia/SPEED-Bench,
and the readers of NeMo-Skills' nemo_skills/dataset/speed-bench/prepare.py, vLLM's `--dataset-name
speed_bench`, SGLang's bench_serving and AIPerf's docs/tutorials/speed-bench.md). Six subsets (the hub's
configs, one split `test` each): `qualitative`, 880 prompts in 11 categories, and `throughput_1k`,
`_2k`, `_8k`, `_16k`, `_32k`, 1,536 prompts of about that many input tokens each, whose `category` is
an entropy tier (`low_entropy`, `mixed`, `high_entropy`, 512 each). A row holds `question_id` (32 hex
characters), `category`, `sub_category`, `turns` (the user turns), `source`, `src_id`, `difficulty` and
`multiturn`. The hub's parquet files hold a placeholder instead of the prompts whose sources forbid
redistribution, so they are prepared first: NeMo-Skills' prepare.py writes `<subset>.jsonl`, with
`turns` turned into `messages` ([{role: user, content}], the JSONL that vLLM, SGLang and AIPerf read),
and NVIDIA Model-Optimizer's examples/specdec_bench writes `test.parquet` with `turns`. `data.path` is
such a file, or a folder holding `<subset>.jsonl`, `<subset>.parquet` or a folder `<subset>/` of them.
A qualitative prompt's category is its own; a throughput prompt's is `<bucket>-<tier>` (`8k-low_entropy`),
so results of several buckets stay apart. The field names are configurable (`data.id_field`,
`data.category_field`, `data.source_args.turns_field`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specdec.core.errors import InvalidInput, MissingInput, described
from specdec.core.types import common_prefix_len  # noqa: F401  (handed on)

# The `data.*` settings a source's reader is given when it names them (besides data.source_args).
READER_SETTINGS = ("path", "hf_name", "split", "text_field", "category_field", "id_field")
SPEC_BENCH_FIELDS = ("question_id", "category", "turns")
SPEC_BENCH_RESOURCE = "data/spec_bench/question.jsonl"  # inside the package, with its README and LICENSE
# Local files `datasets` reads with a packaged builder, by extension; .txt is read here, a line a prompt.
HF_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
HF_FILE_TYPES = (*HF_BUILDERS, ".txt")
# SPEED-Bench: its subsets (a throughput subset is `throughput_<bucket>`), the entropy tiers that are the
# throughput rows' categories, the text the hub ships where a prompt may not be redistributed, its files.
SPEED_BENCH_SUBSET = re.compile(r"qualitative|throughput_(\d+k)")
SPEED_BENCH_TIERS = ("low_entropy", "mixed", "high_entropy")
SPEED_BENCH_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
SPEED_BENCH_FILE_TYPES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Prompt:
    """One request: its id, its category (for per-category statistics) and its user turns."""

    prompt_id: str
    category: str
    turns: tuple[str, ...]


def _make_prompt(prompt_id: str, category: str, turns: Any, where: str) -> Prompt:
    """Build a Prompt from raw fields, refusing empty turns or non-text turns."""
    if isinstance(turns, str):
        turns = [turns]
    if turns is not None and not isinstance(turns, (list, tuple)):
        raise InvalidInput(f"{where}: prompt {prompt_id!r} is {type(turns).__name__}, not text (a string, or "
                           "a list of strings for several turns)")
    if not turns:
        raise InvalidInput(f"{where}: prompt {prompt_id!r} has no turns")
    for i, turn in enumerate(turns):
        if not isinstance(turn, str):
            raise InvalidInput(f"{where}: prompt {prompt_id!r} turn {i} is {type(turn).__name__}, not text")
        if not turn.strip():
            raise InvalidInput(f"{where}: prompt {prompt_id!r} turn {i} is empty")
        try:
            turn.encode("utf-8")
        except UnicodeEncodeError as err:  # "\\ud83d" alone in JSON parses, then breaks every tokenizer
            raise InvalidInput(
                f"{where}: prompt {prompt_id!r} turn {i} holds a lone surrogate "
                f"{turn[err.start].encode('unicode_escape').decode()} at character {err.start}: not a "
                "character; fix the escape (a pair such as \\ud83d\\ude00 is one character)"
            ) from None
    return Prompt(prompt_id=prompt_id, category=category, turns=tuple(turns))


def _parse_spec_bench(lines: Iterable[str], name: str) -> list[Prompt]:
    """Parse Spec-Bench JSONL lines (`question_id`, `category`, `turns`; other fields are ignored)."""
    prompts = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name}, line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidInput(f"{where}: malformed JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise InvalidInput(f"{where}: expected a JSON object, got {type(row).__name__}")
        missing = [f for f in SPEC_BENCH_FIELDS if f not in row]
        if missing:
            raise InvalidInput(
                f"{where}: missing field(s) {missing}; a Spec-Bench line has {list(SPEC_BENCH_FIELDS)}"
            )
        if isinstance(row["turns"], str):
            raise InvalidInput(f"{where}: `turns` must be a list of strings")
        prompts.append(_make_prompt(str(row["question_id"]), str(row["category"]), row["turns"], where))
    if not prompts:
        raise InvalidInput(f"{name} is empty: it holds no prompts")
    return prompts


def _decode_lines(data: bytes, name: str) -> list[str]:
    """The lines of a UTF-8 file; a byte that is not UTF-8 fails naming the file, line and column."""
    lines = data.splitlines()
    for lineno, line in enumerate(lines, start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidInput(
                f"{name}, line {lineno}: not UTF-8 (byte 0x{line[err.start]:02x} at column {err.start + 1}); "
                "save the file as UTF-8"
            ) from None
    return [line.decode("utf-8") for line in lines]


def _package_lines(resource: str) -> list[str]:
    return _decode_lines(resources.files("specdec").joinpath(resource).read_bytes(), f"specdec/{resource}")


def load_builtin() -> list[Prompt]:
    """The prompt set shipped with the package."""
    return _parse_spec_bench(_package_lines("data/builtin.jsonl"), "specdec/data/builtin.jsonl")


def _require_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise MissingInput(f"data file not found: {path} (set data.path)")
    return path


def load_spec_bench(path: str | Path | None = None) -> list[Prompt]:
    """A Spec-Bench `question.jsonl` file (or any file in its format); None: the copy in the package."""
    if path is None:
        return _parse_spec_bench(_package_lines(SPEC_BENCH_RESOURCE), f"specdec/{SPEC_BENCH_RESOURCE}")
    path = _require_file(path)
    return _parse_spec_bench(_decode_lines(path.read_bytes(), str(path)), str(path))


def load_text(path: str | Path) -> list[Prompt]:
    """A plain text file: one single-turn prompt per non-blank line, its id the line number."""
    path = _require_file(path)
    lines = _decode_lines(path.read_bytes(), str(path))
    prompts = [_make_prompt(str(n), "hf", line.strip(), f"{path}, line {n}")
               for n, line in enumerate(lines, start=1) if line.strip()]
    if not prompts:
        raise InvalidInput(f"{path} is empty: it holds no prompts")
    return prompts


def _check_local_file(path: Path) -> None:
    """What `datasets` reports badly, said plainly before it reads `path`: not UTF-8, empty, header only."""
    if path.suffix.lower() == ".parquet":
        return
    lines = _decode_lines(path.read_bytes(), str(path))
    rows = [line for line in lines if line.strip()]
    if not rows:
        raise InvalidInput(f"{path} is empty: it holds no prompts")
    if path.suffix.lower() == ".csv" and len(rows) == 1:
        raise InvalidInput(f"{path} holds a header but no rows: it holds no prompts")
    if path.suffix.lower() in (".json", ".jsonl"):
        _check_json(path, lines)


def _check_json(path: Path, lines: list[str]) -> None:
    """A .json file is one JSON document or JSON lines (`datasets` reads both), a .jsonl file JSON
    lines, one object a line: the first line that is not names its line and column (`datasets` says
    only that generating the dataset failed)."""
    if path.suffix.lower() == ".json":
        try:
            json.loads("\n".join(lines))
            return
        except json.JSONDecodeError:
            pass  # JSON lines, then, or broken: the line that fails says where
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidInput(f"{path}, line {lineno}: not JSON ({err.msg} at column {err.colno}); "
                             "a JSON-lines file holds one JSON object a line") from None
        if not isinstance(row, dict):
            raise InvalidInput(f"{path}, line {lineno}: a JSON {type(row).__name__}, not an object with the "
                             "prompt's fields (data.text_field)")


def _cause(err: BaseException) -> str:
    """The first line of what went wrong: `datasets` wraps a parser's error in its own."""
    cause = err.__cause__ if err.__cause__ is not None and type(err).__name__ == "DatasetGenerationError" else err
    return described(cause)


def load_hf(
    path: str | None = None,
    hf_name: str | None = None,
    split: str = "train",
    text_field: str = "text",
    category_field: str | None = None,
    id_field: str | None = None,
) -> list[Prompt]:
    """Any source `datasets.load_dataset` opens, or a .txt file (a line a prompt); a text field holding a
    list of strings is multi-turn."""
    # `datasets` reads these once, at its import: set them first so even local loads never reach for a
    # hub (if something imported `datasets` earlier, its settings stand). An exported value wins.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if path is not None and Path(path).expanduser().is_file() and Path(path).suffix.lower() not in HF_FILE_TYPES:
        raise InvalidInput(
            f"{path}: data=hf reads local .json, .jsonl, .csv, .parquet or .txt files (and dataset folders); "
            f"{Path(path).suffix or 'a file without a suffix'} is none of them"
        )
    if path is not None and Path(path).suffix.lower() == ".txt":
        return load_text(path)
    import datasets
    from datasets.exceptions import DatasetGenerationError

    # what `datasets` raises for a source it cannot read (pandas' and pyarrow's parse errors are ValueErrors)
    unreadable = (OSError, ValueError, DatasetGenerationError)
    if path is not None and Path(path).suffix.lower() in HF_BUILDERS:
        local = _require_file(path)
        _check_local_file(local)
        builder = HF_BUILDERS[local.suffix.lower()]
        try:  # naming the split in data_files lets any split name select the single file
            ds = datasets.load_dataset(builder, data_files={split: str(local)}, split=split)
        except unreadable as err:  # a CSV quote left open, a file of another format
            raise InvalidInput(f"data.path={local}: not a readable {builder} file ({_cause(err)}); fix or "
                               "replace the file") from err
        name = str(local)
    elif hf_name or path:
        name = hf_name or path
        try:
            ds = datasets.load_dataset(name, split=split)
        except unreadable as err:  # offline and not cached, no such split, a folder of mixed or bad files
            key = "data.hf_name" if hf_name else "data.path"
            raise InvalidInput(f"{key}={name}: `datasets` cannot open it here ({_cause(err)}). "
                               "This machine reads datasets offline: give a local file (data.path=<json/jsonl/"
                               "csv/parquet/txt>) or a dataset already in the local Hugging Face cache") from err
    else:
        raise InvalidInput("data.source=hf needs data.hf_name (a dataset name) or data.path (a local file)")

    columns = list(ds.column_names)
    for key, field in (
        ("text_field", text_field),
        ("category_field", category_field),
        ("id_field", id_field),
    ):
        if field is not None and field not in columns:
            raise InvalidInput(f"{name}: no field {field!r} (data.{key}); available columns: {columns}")

    prompts = []
    for index, row in enumerate(ds):
        prompt_id = str(row[id_field]) if id_field else str(index)
        category = str(row[category_field]) if category_field else "hf"
        prompts.append(_make_prompt(prompt_id, category, row[text_field], f"{name}, row {index}"))
    return prompts


def _speed_bench_files(path: Path, subset: str | None) -> tuple[list[Path], str | None]:
    """The files `path` names for `subset`, and the subset they hold (None: a file not named for one)."""
    if not path.exists():
        raise MissingInput(f"SPEED-Bench data not found: {path} (set data.path to a prepared file such as "
                           "qualitative.jsonl, or to the folder holding them)")
    if path.is_file():
        if path.suffix.lower() not in SPEED_BENCH_FILE_TYPES:
            raise InvalidInput(f"{path}: data=speed_bench reads .jsonl or .parquet files (SPEED-Bench's published "
                               f"formats); {path.suffix or 'a file without a suffix'} is neither")
        named = path.stem if SPEED_BENCH_SUBSET.fullmatch(path.stem) else None
        if subset and named and subset != named:
            raise InvalidInput(f"{path} holds the subset {named}, but data.source_args.subset={subset}: set "
                               f"data.source_args.subset={named}, or point data.path at the {subset} file")
        return [path], subset or named
    subset = subset or "qualitative"
    for suffix in SPEED_BENCH_FILE_TYPES:
        if (path / f"{subset}{suffix}").is_file():
            return [path / f"{subset}{suffix}"], subset
    folder = path / subset
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in SPEED_BENCH_FILE_TYPES) \
        if folder.is_dir() else []
    if not files:
        present = sorted(f.name for f in path.iterdir())[:12]
        raise MissingInput(f"{path}: no SPEED-Bench {subset} data in this folder (looked for {subset}.jsonl, "
                           f"{subset}.parquet and a folder {subset}/ of .jsonl or .parquet files; it holds "
                           f"{present or 'nothing'}); prepare that subset, or set data.source_args.subset")
    return files, subset


def _speed_bench_rows(file: Path) -> Iterator[tuple[str, dict]]:
    """(where, row) for each row of a SPEED-Bench .parquet file or JSON-lines file."""
    if file.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:  # pyarrow's ArrowInvalid is a ValueError
            rows = pq.read_table(file).to_pylist()
        except (OSError, ValueError) as err:
            raise InvalidInput(f"{file}: not a readable parquet file ({described(err)}); fix or replace the "
                               "file") from None
        yield from ((f"{file}, row {i}", row) for i, row in enumerate(rows))
        return
    for lineno, line in enumerate(_decode_lines(file.read_bytes(), str(file)), start=1):
        if not line.strip():
            continue
        where = f"{file}, line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidInput(f"{where}: not JSON ({err.msg} at column {err.colno}); a SPEED-Bench JSON-lines "
                               "file holds one JSON object a line") from None
        if not isinstance(row, dict):
            raise InvalidInput(f"{where}: a JSON {type(row).__name__}, not an object with SPEED-Bench's fields")
        yield where, row


def _speed_bench_turns(row: dict, turns_field: str | None, where: str) -> Any:
    """The user turns of a row: `turns` (strings) or `messages` ({role, content}), or `turns_field`."""
    field = turns_field or next((f for f in ("turns", "messages") if f in row), None)
    if field is None or field not in row:
        wanted = f"`{turns_field}` (data.source_args.turns_field)" if turns_field else \
            "`turns` (a list of strings) or `messages` (a list of {role, content})"
        raise InvalidInput(f"{where}: no field {wanted}; the row has {sorted(row)} (data.source_args.turns_field "
                           "names the field that holds the turns)")
    turns = row[field]
    if isinstance(turns, list) and turns and all(isinstance(m, dict) for m in turns):
        others = sorted({str(m.get("role")) for m in turns} - {"user"})
        if others:
            raise InvalidInput(f"{where}: `{field}` holds {others} messages; only user turns are read (the "
                               "decoder writes the answers)")
        turns = [m.get("content") for m in turns]
    if isinstance(turns, list) and any(isinstance(t, str) and t.startswith(SPEED_BENCH_PLACEHOLDER) for t in turns):
        raise InvalidInput(
            f"{where}: the prompt is SPEED-Bench's placeholder, not its text (the hub's files leave out what their "
            "sources may not redistribute). Prepare the subset first: NeMo-Skills' "
            "nemo_skills/dataset/speed-bench/prepare.py --config <subset> writes <subset>.jsonl, NVIDIA "
            "Model-Optimizer's examples/specdec_bench writes test.parquet; point data.path at the result")
    return turns


def load_speed_bench(
    path: str | Path | None = None,
    subset: str | None = None,
    tier: str | list[str] | None = None,
    id_field: str | None = None,
    category_field: str | None = None,
    turns_field: str | None = None,
) -> list[Prompt]:
    """SPEED-Bench prompts from local files (see the module's docstring for the format). `subset`:
    qualitative or throughput_<bucket> (None: the file's name, else qualitative); `tier`: the entropy
    tiers of a throughput subset to keep (None: all three)."""
    if path is None:
        raise MissingInput("data=speed_bench needs data.path: a prepared SPEED-Bench file (qualitative.jsonl, "
                           "throughput_8k.jsonl, test.parquet) or the folder holding them")
    if subset is not None and not SPEED_BENCH_SUBSET.fullmatch(subset):
        raise InvalidInput(f"data.source_args.subset={subset!r}: SPEED-Bench's subsets are qualitative and "
                           "throughput_1k, throughput_2k, throughput_8k, throughput_16k, throughput_32k")
    tiers = [tier] if isinstance(tier, str) else tier
    unknown = [t for t in tiers or () if t not in SPEED_BENCH_TIERS]
    if unknown:
        raise InvalidInput(f"data.source_args.tier: unknown tier(s) {unknown}; the tiers are {list(SPEED_BENCH_TIERS)}")
    ids, categories = id_field or "question_id", category_field or "category"
    files, subset = _speed_bench_files(Path(path).expanduser(), subset)
    rows = []
    for file in files:
        for where, row in _speed_bench_rows(file):
            missing = [f"`{name}` (data.{key})" for name, key in ((ids, "id_field"), (categories, "category_field"))
                       if name not in row]
            if missing:
                raise InvalidInput(f"{where}: no field {' or '.join(missing)}; a SPEED-Bench row has question_id, "
                                   f"category and turns (or messages); this one has {sorted(row)}")
            rows.append((where, row))
    if not rows:
        raise InvalidInput(f"{', '.join(map(str, files))}: empty, it holds no prompts")
    if subset is None:  # a file not named for its subset: qualitative, unless its rows are tiers
        if all(str(row[categories]) in SPEED_BENCH_TIERS for _, row in rows):
            raise InvalidInput(f"{files[0]}: its rows are entropy tiers of a throughput subset; say which "
                               "input-length bucket it holds: data.source_args.subset=throughput_<1k|2k|8k|16k|32k>")
        subset = "qualitative"
    bucket = SPEED_BENCH_SUBSET.fullmatch(subset).group(1)  # None for qualitative
    if tiers and bucket is None:
        raise InvalidInput("data.source_args.tier selects the entropy tiers of a throughput subset; the qualitative "
                           "subset has categories: select them with data.categories=[coding,math]")
    prompts = []
    for where, row in rows:
        category = str(row[categories])
        if (category in SPEED_BENCH_TIERS) != (bucket is not None):
            raise InvalidInput(
                f"{where}: category {category!r} is not one of a {subset} file's; the throughput subsets' rows are "
                f"tiers {list(SPEED_BENCH_TIERS)}, the qualitative subset's are domains (coding, math, ...): give "
                "the file of the subset named in data.source_args.subset, or name the subset this file holds")
        if tiers and category not in tiers:
            continue
        label = f"{bucket}-{category}" if bucket else category
        prompts.append(_make_prompt(str(row[ids]), label, _speed_bench_turns(row, turns_field, where), where))
    if not prompts:
        present = sorted({str(row[categories]) for _, row in rows})
        raise InvalidInput(f"{', '.join(map(str, files))}: no rows of tier {tiers} (data.source_args.tier); "
                           f"the tiers present: {present}")
    return prompts


def select_prompts(
    prompts: list[Prompt],
    limit: int | None = None,
    categories: list[str] | None = None,
    per_category: bool = True,
) -> list[Prompt]:
    """Keep the requested categories, then the first `limit` prompts of each (or overall), in order."""
    if categories is not None:
        existing = sorted({p.category for p in prompts})
        unknown = [c for c in categories if c not in existing]
        if unknown:
            raise InvalidInput(f"unknown data.categories {unknown}; existing categories: {existing}")
        prompts = [p for p in prompts if p.category in categories]
    if limit is None:
        return prompts
    if not per_category:
        return prompts[:limit]
    taken: dict[str, int] = {}
    kept = []
    for p in prompts:
        if taken.get(p.category, 0) < limit:
            taken[p.category] = taken.get(p.category, 0) + 1
            kept.append(p)
    return kept


def load_prompts(
    source: Any,
    path: str | None = None,
    limit: int | None = None,
    categories: list[str] | None = None,
    per_category: bool = True,
    hf_name: str | None = None,
    split: str = "train",
    text_field: str = "text",
    category_field: str | None = None,
    id_field: str | None = None,
    source_args: dict | None = None,
) -> list[Prompt]:
    """Load a prompt set and select from it. `source`: a name, the file `conf/data/source/<name>.yaml`
    holding its `_target_` (builtin, spec_bench, hf, ... see `specdec.study.registry`), or such a node. The
    target returns the prompts; it is called with the settings here that it names (`path`, `hf_name`,
    `split`, ...; None is not passed) and with `source_args`, its own. `path` None with spec_bench: the
    Spec-Bench questions shipped with the package.

    `limit` keeps the first `limit` prompts of each category when `per_category` (Spec-Bench studies
    use a fixed number per category), else the first `limit` overall. File order is preserved.
    """
    from specdec.study.registry import build

    if limit is not None and limit < 1:
        raise InvalidInput(f"data.limit must be >= 1 (or null for all prompts), got {limit}")
    settings = dict(zip(READER_SETTINGS, (path, hf_name, split, text_field, category_field, id_field)))
    prompts = list(build("data/source", source, "data.source", source_args, offered=settings))

    seen: set[str] = set()
    for p in prompts:
        if p.prompt_id in seen:
            raise InvalidInput(
                f"duplicate prompt id {p.prompt_id!r} in data.source={source}; ids must be unique"
            )
        seen.add(p.prompt_id)
    return select_prompts(prompts, limit, categories, per_category)


def build_turn_input(
    tokenizer: Any,
    history: list[tuple[str, str]],
    user_turn: str,
    system_prompt: str | None = None,
) -> list[int]:
    """Token ids of the conversation so far plus `user_turn`, ending where the assistant's answer starts.

    `history` holds (user_text, assistant_text) pairs of earlier turns. With a chat template the ids are
    the template's rendering; without one, a plain "User: ...\\nAssistant: ..." transcript.
    Turn 2's ids need not start with turn 1's input + generated ids: the template closes the answer with
    its end-of-turn marker, the model may have tokenized the answer another way, and plain text may
    merge tokens across the boundary. Compare with `common_prefix_len` before reusing a KV cache.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        for user_text, assistant_text in history:
            messages += [
                {"role": "user", "content": user_text},
                {"role": "assistant", "content": assistant_text},
            ]
        messages.append({"role": "user", "content": user_turn})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding (a dict) by default; older versions a plain list.
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    text = f"{system_prompt}\n" if system_prompt else ""
    for user_text, assistant_text in history:
        text += f"User: {user_text}\nAssistant: {assistant_text}\n"
    text += f"User: {user_turn}\nAssistant:"
    return list(tokenizer.encode(text, add_special_tokens=True))
