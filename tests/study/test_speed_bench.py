"""SPEED-Bench read from local files in its published formats (the prepared JSON lines with `messages`,
parquet with `turns`): the qualitative subset by category, a throughput subset by input-length bucket and
entropy tier, and files that cannot work failing with the file, the row and what is expected, before
any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from specdec.core.errors import InvalidInput, MissingInput
from specdec.study import experiment
from specdec.study.config import ConfigError, validate
from specdec.study.data import SPEED_BENCH_PLACEHOLDER, load_prompts

CONF = Path(__file__).resolve().parents[2] / "conf"
QUALITATIVE = ["coding", "math", "multilingual", "coding", "rag", "math"]
TIERS = ["low_entropy", "mixed", "high_entropy"]


def row(i: int, category: str, turns: list[str], messages: bool = True) -> dict:
    """A SPEED-Bench row with the hub's columns; `messages` as NeMo-Skills' prepare.py writes them."""
    out = {"question_id": f"{i:032x}", "category": category, "sub_category": "", "source": "test",
           "src_id": str(i), "difficulty": "", "multiturn": len(turns) > 1}
    if messages:
        out["messages"] = [{"role": "user", "content": t} for t in turns]
    else:
        out["turns"] = turns
    return out


def qualitative_rows(messages: bool = True) -> list[dict]:
    rows = [row(i, c, [f"{c} question {i}?"], messages) for i, c in enumerate(QUALITATIVE)]
    rows[2] = row(2, "multilingual", ["Translate: bonjour.", "Now into German."], messages)
    return rows


def throughput_rows(start: int = 100, messages: bool = True) -> list[dict]:
    return [row(start + i, TIERS[i % 3], [f"long context {i} ... answer now please."], messages) for i in range(6)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def speed(path: Path | None, **source_args) -> list:
    return load_prompts("speed_bench", str(path) if path else None, source_args=source_args)


# --- qualitative -----------------------------------------------------------------------------------


def test_qualitative_jsonl_in_a_folder_keeps_categories_ids_and_turns(tmp_path):
    write_jsonl(tmp_path / "qualitative.jsonl", qualitative_rows())
    prompts = speed(tmp_path)
    assert [p.category for p in prompts] == ["coding", "math", "multilingual", "coding", "rag", "math"]
    assert [p.prompt_id for p in prompts] == [f"{i:032x}" for i in range(6)]
    assert prompts[2].turns == ("Translate: bonjour.", "Now into German.")
    assert prompts[4].turns == ("rag question 4?",)


def test_qualitative_parquet_with_turns_reads_the_same_prompts(tmp_path):
    jsonl = speed(write_jsonl(tmp_path / "qualitative.jsonl", qualitative_rows()))
    parquet = speed(write_parquet(tmp_path / "prepared" / "test.parquet", qualitative_rows(messages=False)))
    assert parquet == jsonl


def test_qualitative_selection_is_per_category(tmp_path):
    path = write_jsonl(tmp_path / "qualitative.jsonl", qualitative_rows())
    picked = load_prompts("speed_bench", str(path), limit=1, categories=["math", "coding"])
    assert [(p.category, p.prompt_id[-1]) for p in picked] == [("coding", "0"), ("math", "1")]


def test_field_names_are_configurable(tmp_path):
    rows = [{"id": f"q{i}", "domain": c, "prompts": [f"{c} {i}?"]} for i, c in enumerate(["coding", "math"])]
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    prompts = load_prompts("speed_bench", str(path), id_field="id", category_field="domain",
                           source_args={"turns_field": "prompts"})
    assert [(p.prompt_id, p.category, p.turns) for p in prompts] == [("q0", "coding", ("coding 0?",)),
                                                                    ("q1", "math", ("math 1?",))]


# --- throughput ------------------------------------------------------------------------------------


def test_throughput_categories_are_bucket_and_tier(tmp_path):
    write_jsonl(tmp_path / "throughput_8k.jsonl", throughput_rows())
    write_jsonl(tmp_path / "qualitative.jsonl", qualitative_rows())
    prompts = speed(tmp_path, subset="throughput_8k")
    assert [p.category for p in prompts] == ["8k-low_entropy", "8k-mixed", "8k-high_entropy"] * 2
    # a file named for its subset needs no subset
    assert speed(tmp_path / "throughput_8k.jsonl") == prompts


def test_throughput_tier_selects_tiers(tmp_path):
    write_jsonl(tmp_path / "throughput_1k.jsonl", throughput_rows())
    assert {p.category for p in speed(tmp_path, subset="throughput_1k", tier="low_entropy")} == {"1k-low_entropy"}
    both = speed(tmp_path, subset="throughput_1k", tier=["mixed", "high_entropy"])
    assert [p.category for p in both] == ["1k-mixed", "1k-high_entropy"] * 2


def test_throughput_folder_of_parquet_files(tmp_path):
    write_parquet(tmp_path / "throughput_32k" / "test-00000-of-00002.parquet", throughput_rows(0, False)[:3])
    write_parquet(tmp_path / "throughput_32k" / "test-00001-of-00002.parquet", throughput_rows(0, False)[3:])
    prompts = speed(tmp_path, subset="throughput_32k")
    assert len(prompts) == 6 and prompts[5].category == "32k-high_entropy"


def test_an_unnamed_throughput_file_needs_its_bucket(tmp_path):
    path = write_parquet(tmp_path / "test.parquet", throughput_rows(messages=False))
    with pytest.raises(InvalidInput, match=r"test.parquet: its rows are entropy tiers.*subset=throughput_"):
        speed(path)
    assert speed(path, subset="throughput_2k")[0].category == "2k-low_entropy"


# --- errors ----------------------------------------------------------------------------------------


def test_missing_paths_say_what_to_give(tmp_path):
    with pytest.raises(MissingInput, match="needs data.path"):
        speed(None)
    with pytest.raises(MissingInput, match=r"not found: .*nowhere\.jsonl"):
        speed(tmp_path / "nowhere.jsonl")
    write_jsonl(tmp_path / "qualitative.jsonl", qualitative_rows())
    with pytest.raises(MissingInput, match=r"no SPEED-Bench throughput_16k data.*holds \['qualitative.jsonl'\]"):
        speed(tmp_path, subset="throughput_16k")


@pytest.mark.parametrize("name, content, message", [
    ("prompts.csv", "question_id,category\n", r"prompts.csv: data=speed_bench reads .jsonl or .parquet"),
    ("bad.parquet", "not parquet", r"bad.parquet: not a readable parquet file"),
    ("bad.jsonl", '{"question_id": "a", "category": "math", "turns": ["x"]}\n{oops\n', r"bad.jsonl, line 2: not JSON"),
    ("list.jsonl", '["a", "b"]\n', r"list.jsonl, line 1: a JSON list, not an object"),
    ("empty.jsonl", "\n", r"empty.jsonl: empty"),
])
def test_wrong_files_name_the_file(tmp_path, name, content, message):
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(InvalidInput, match=message):
        speed(tmp_path / name)


def test_missing_fields_name_the_row_the_field_and_the_setting(tmp_path):
    rows = qualitative_rows()
    del rows[3]["category"]
    with pytest.raises(InvalidInput, match=r"line 4: no field `category` \(data.category_field\)"):
        speed(write_jsonl(tmp_path / "a.jsonl", rows))
    rows = qualitative_rows()
    del rows[1]["messages"]
    with pytest.raises(InvalidInput, match=r"line 2: no field `turns` .* or `messages`.*turns_field"):
        speed(write_jsonl(tmp_path / "b.jsonl", rows))
    with pytest.raises(InvalidInput, match=r"line 1: no field `prompt` \(data.source_args.turns_field\)"):
        speed(tmp_path / "b.jsonl", turns_field="prompt")


def test_unprepared_hub_rows_and_answers_are_refused(tmp_path):
    rows = qualitative_rows(messages=False)
    rows[4]["turns"] = [f"{SPEED_BENCH_PLACEHOLDER}\n\n{{question}}"]
    with pytest.raises(InvalidInput, match=r"row 4: the prompt is SPEED-Bench's placeholder.*prepare.py"):
        speed(write_parquet(tmp_path / "qualitative.parquet", rows))
    rows = qualitative_rows()
    rows[0]["messages"].append({"role": "assistant", "content": "an answer"})
    with pytest.raises(InvalidInput, match=r"line 1: `messages` holds \['assistant'\] messages"):
        speed(write_jsonl(tmp_path / "answered.jsonl", rows))


def test_a_file_of_the_other_subset_is_refused(tmp_path):
    write_jsonl(tmp_path / "throughput_8k.jsonl", throughput_rows())
    with pytest.raises(InvalidInput, match=r"holds the subset throughput_8k, but data.source_args.subset=throughput_1k"):
        speed(tmp_path / "throughput_8k.jsonl", subset="throughput_1k")
    tiers = write_jsonl(tmp_path / "tiers.jsonl", throughput_rows())
    with pytest.raises(InvalidInput, match=r"tiers.jsonl, line 1: category 'low_entropy' is not one of a qualitative"):
        speed(tiers, subset="qualitative")
    domains = write_jsonl(tmp_path / "domains.jsonl", qualitative_rows())
    with pytest.raises(InvalidInput, match=r"domains.jsonl, line 1: category 'coding' is not one of a throughput_8k"):
        speed(domains, subset="throughput_8k")


def test_subset_and_tier_values_are_checked(tmp_path):
    write_jsonl(tmp_path / "throughput_1k.jsonl", throughput_rows()[:1])  # low_entropy only
    write_jsonl(tmp_path / "qualitative.jsonl", qualitative_rows())
    with pytest.raises(InvalidInput, match=r"subset='throughput_4'.*throughput_1k"):
        speed(tmp_path, subset="throughput_4")
    with pytest.raises(InvalidInput, match=r"unknown tier\(s\) \['low'\]"):
        speed(tmp_path, subset="throughput_1k", tier="low")
    with pytest.raises(InvalidInput, match=r"tier selects the entropy tiers .* data.categories"):
        speed(tmp_path, tier="mixed")
    with pytest.raises(InvalidInput, match=r"no rows of tier \['mixed'\].*present: \['low_entropy'\]"):
        speed(tmp_path, subset="throughput_1k", tier="mixed")


# --- through the configuration ---------------------------------------------------------------------


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=["experiment=tiny_smoke", "data=speed_bench", *overrides])


def test_experiment_reads_a_throughput_tier(tmp_path):
    write_jsonl(tmp_path / "throughput_2k.jsonl", throughput_rows())
    cfg = _compose([f"data.path={tmp_path}", "data.source_args.subset=throughput_2k",
                    "data.source_args.tier=[mixed,high_entropy]", "data.limit=null"])
    validate(cfg)
    prompts = experiment.load_data(cfg)
    assert [p.category for p in prompts] == ["2k-mixed", "2k-high_entropy"] * 2
    cfg = _compose([f"data.path={tmp_path}/throughput_2k.jsonl", "data.categories=[2k-low_entropy]"])
    assert [p.prompt_id for p in experiment.load_data(cfg)] == [f"{100:032x}"]  # tiny_smoke: 1 a category


def test_experiment_reads_qualitative_and_refuses_settings_it_ignores(tmp_path):
    path = write_jsonl(tmp_path / "qualitative.jsonl", qualitative_rows())
    cfg = _compose([f"data.path={path}"])
    validate(cfg)
    assert [p.category for p in experiment.load_data(cfg)] == ["coding", "math", "multilingual", "rag"]
    with pytest.raises(ConfigError, match=r"data.text_field: is set, but data.source=speed_bench does not read it"):
        validate(_compose([f"data.path={path}", "data.text_field=prompt"]))
    with pytest.raises(ConfigError, match=r"data.source.*takes no data.source_args \['tiers'\]"):
        validate(_compose([f"data.path={path}", "+data.source_args.tiers=mixed"]))
    with pytest.raises(MissingInput, match="needs data.path"):
        experiment.load_data(_compose([]))
