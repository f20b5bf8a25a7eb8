"""Prompt sets (builtin, Spec-Bench, `datasets` sources) and chat inputs for multi-turn prompts; bad
prompt files fail naming the file and the line."""

import hashlib
import json
import re
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest

from specdec.study.data import Prompt, build_turn_input, common_prefix_len, load_prompts

# Spec-Bench's question.jsonl ships inside the package, so it is there in a clone and in a wheel.
SPEC_BENCH = resources.files("specdec") / "data" / "spec_bench"

WORDS = (
    "[UNK] [BOS] <s> </s> User: Assistant: user assistant system hello world how are you fine thanks be brief"
)
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant{% endif %}"
)


@pytest.fixture
def tokenizer():
    """A tiny word-level tokenizer with no chat template (so the plain-text fallback applies)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS.split())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# --- builtin ---------------------------------------------------------------------------------------


def test_builtin_set_is_complete():
    prompts = load_prompts("builtin")
    counts = Counter(p.category for p in prompts)
    assert len(counts) >= 6 and min(counts.values()) >= 4
    assert {"conversation", "translation", "summarization", "qa", "math_reasoning", "rag"} <= set(counts)
    assert sum(len(p.turns) == 2 for p in prompts if p.category == "conversation") >= 2
    assert all(isinstance(p, Prompt) and p.turns and all(t.strip() for t in p.turns) for p in prompts)
    assert len({p.prompt_id for p in prompts}) == len(prompts)


def test_builtin_limit_and_categories():
    prompts = load_prompts("builtin", limit=1, categories=["qa", "rag"])
    assert [p.category for p in prompts] == ["qa", "rag"]
    assert len(load_prompts("builtin", limit=3, per_category=False)) == 3


# --- spec_bench ------------------------------------------------------------------------------------


def test_spec_bench_ships_with_the_package_with_its_provenance():
    readme = (SPEC_BENCH / "README.md").read_text(encoding="utf-8")
    assert "hemingkx/Spec-Bench" in readme and "fd2c1cd" in readme and "Apache" in readme
    assert (SPEC_BENCH / "LICENSE").read_text(encoding="utf-8").lstrip().startswith("Apache License")
    recorded = re.search(r"SHA-256 of `question.jsonl`: `([0-9a-f]{64})`", readme).group(1)
    assert hashlib.sha256((SPEC_BENCH / "question.jsonl").read_bytes()).hexdigest() == recorded


def test_spec_bench_file(tmp_path):
    prompts = load_prompts("spec_bench")  # no path: the packaged file
    counts = Counter(p.category for p in prompts)
    assert len(prompts) == 480 and len(counts) == 13
    assert all(len(p.turns) == 2 for p in prompts if counts[p.category] == 10)  # the MT-bench part
    assert all(len(p.turns) == 1 for p in prompts if counts[p.category] == 80)

    two_each = load_prompts("spec_bench", limit=2)
    assert len(two_each) == 26 and set(Counter(p.category for p in two_each).values()) == {2}
    # File order is kept: the first two of a category are its first two lines.
    assert [p.prompt_id for p in two_each if p.category == "rag"] == [
        p.prompt_id for p in prompts if p.category == "rag"
    ][:2]

    picked = load_prompts("spec_bench", categories=["translation", "coding"], limit=3)
    assert Counter(p.category for p in picked) == {"translation": 3, "coding": 3}
    assert len(load_prompts("spec_bench", limit=5, per_category=False)) == 5

    own = write_jsonl(tmp_path / "own.jsonl", [{"question_id": "x", "category": "qa", "turns": ["Why?"]}])
    assert load_prompts("spec_bench", path=str(own)) == [Prompt("x", "qa", ("Why?",))]  # a path overrides


def test_malformed_jsonl_names_line(tmp_path):
    good = {"question_id": 1, "category": "qa", "turns": ["Why?"]}
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(good) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"q\.jsonl, line 2: malformed JSON"):
        load_prompts("spec_bench", path=str(path))

    write_jsonl(path, [good, {"question_id": 2, "turns": ["Hi"]}])
    with pytest.raises(ValueError, match=r"line 2: missing field\(s\) \['category'\]"):
        load_prompts("spec_bench", path=str(path))

    write_jsonl(path, [{"question_id": 7, "category": "qa", "turns": ["ok", "  "]}])
    with pytest.raises(ValueError, match="prompt '7' turn 1 is empty"):
        load_prompts("spec_bench", path=str(path))

    write_jsonl(path, [{"question_id": 8, "category": "qa", "turns": []}])
    with pytest.raises(ValueError, match="prompt '8' has no turns"):
        load_prompts("spec_bench", path=str(path))


def test_non_utf8_byte_names_the_file_and_line(tmp_path, hf_cache):
    good = json.dumps({"question_id": 1, "category": "qa", "turns": ["Why?"]}).encode()
    bad = b'{"question_id": 2, "category": "qa", "turns": ["caf\xe9"]}'
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(good + b"\n" + bad + b"\n")
    with pytest.raises(ValueError, match=r"latin1\.jsonl, line 2: not UTF-8 \(byte 0xe9 at column \d+\)"):
        load_prompts("spec_bench", path=str(path))
    csv = tmp_path / "latin1.csv"
    csv.write_bytes(b"text\nfine\ncaf\xe9 au lait\n")
    with pytest.raises(ValueError, match=r"latin1\.csv, line 3: not UTF-8 \(byte 0xe9"):
        load_prompts("hf", path=str(csv))


def test_lone_surrogate_names_the_file_and_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["fine"]}\n'
                    '{"question_id": 2, "category": "qa", "turns": ["ok", "half a pair \\ud83d here"]}\n')
    with pytest.raises(ValueError, match=r"q\.jsonl, line 2: prompt '2' turn 1 holds a lone surrogate "
                                         r"\\ud83d at character 12"):
        load_prompts("spec_bench", path=str(path))
    path.write_text('{"question_id": 3, "category": "qa", "turns": ["a pair \\ud83d\\ude00 is one character"]}\n')
    assert load_prompts("spec_bench", path=str(path))[0].turns == ("a pair \U0001f600 is one character",)


def test_config_errors(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*data\.path"):
        load_prompts("spec_bench", path=str(missing))
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_prompts("hf", path=str(missing))
    with pytest.raises(ValueError, match="data.limit"):
        load_prompts("builtin", limit=0)
    with pytest.raises(ValueError, match=r"existing categories: \[.*'conversation'.*'rag'"):
        load_prompts("builtin", categories=["qa", "poetry"])
    with pytest.raises(ValueError, match="builtin, hf, spec_bench"):
        load_prompts("sharegpt")


# --- hf (local files through `datasets`) -----------------------------------------------------------


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Offline `datasets` whose cache lives in tmp_path, so the tests leave nothing in the home folder."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # before `datasets` is first imported
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def test_hf_local_jsonl_and_csv(tmp_path, hf_cache):
    rows = [
        {"qid": "a", "kind": "chat", "prompt": ["Hello there.", "And then?"]},
        {"qid": "b", "kind": "qa", "prompt": ["What is two plus two?"]},
    ]
    path = write_jsonl(tmp_path / "set.jsonl", rows)
    prompts = load_prompts("hf", path=str(path), text_field="prompt", category_field="kind", id_field="qid")
    assert prompts == [
        Prompt("a", "chat", ("Hello there.", "And then?")),
        Prompt("b", "qa", ("What is two plus two?",)),
    ]

    csv = tmp_path / "set.csv"
    csv.write_text("text,topic\nWhat is rain?,weather\nName a prime.,math\nWhy is snow white?,weather\n")
    prompts = load_prompts("hf", path=str(csv), category_field="topic", limit=1)
    assert prompts == [Prompt("0", "weather", ("What is rain?",)), Prompt("1", "math", ("Name a prime.",))]
    assert load_prompts("hf", path=str(csv))[2].category == "hf"


def test_hf_text_file_is_one_prompt_per_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("What is rain?\n\n  \nName a prime.\n", encoding="utf-8")
    assert load_prompts("hf", path=str(path)) == [Prompt("1", "hf", ("What is rain?",)),
                                                  Prompt("4", "hf", ("Name a prime.",))]


def test_hf_unsupported_or_empty_files_say_what_is_wrong(tmp_path, hf_cache):
    sheet = tmp_path / "prompts.xlsx"
    sheet.write_bytes(b"PK")
    with pytest.raises(ValueError, match=r"prompts\.xlsx: data=hf reads local \.json, \.jsonl, \.csv, "
                                         r"\.parquet or \.txt files"):
        load_prompts("hf", path=str(sheet))
    for name, text in (("empty.csv", ""), ("blank.jsonl", "\n \n"), ("empty.txt", "")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"{re.escape(name)} is empty: it holds no prompts"):
            load_prompts("hf", path=str(tmp_path / name))
    header = tmp_path / "header.csv"
    header.write_text("text,topic\n")
    with pytest.raises(ValueError, match=r"header\.csv holds a header but no rows"):
        load_prompts("hf", path=str(header))


def test_hf_json_files_that_do_not_parse_name_their_line(tmp_path, hf_cache):
    """`datasets` says only that generating the dataset failed; the line and column say what to fix."""
    lines = tmp_path / "q.jsonl"
    lines.write_text('{"text": "What is rain?"}\n{"text": "Why"\n')
    with pytest.raises(ValueError, match=r"q\.jsonl, line 2: not JSON \(Expecting ',' delimiter at column 15\)"):
        load_prompts("hf", path=str(lines))
    lines.write_text('{"text": "What is rain?"}\n["a list"]\n')
    with pytest.raises(ValueError, match=r"q\.jsonl, line 2: a JSON list, not an object"):
        load_prompts("hf", path=str(lines))
    document = tmp_path / "q.json"
    document.write_text('[{"text": "What is rain?"},\n {"text": "Name a prime."}]\n')  # one document: fine
    assert [p.turns for p in load_prompts("hf", path=str(document))] == [("What is rain?",), ("Name a prime.",)]
    document.write_text('[{"text": "What is rain?"},\n {"text": }]\n')
    with pytest.raises(ValueError, match=r"q\.json, line 1: not JSON"):
        load_prompts("hf", path=str(document))


def test_hf_files_datasets_cannot_parse_are_named_in_one_line(tmp_path, hf_cache):
    """pandas' and pyarrow's parse errors come wrapped in `datasets`' own; said as bad input naming
    the file and the parser's first line, not a traceback of a hundred lines."""
    from specdec.core.errors import InputError

    quote = tmp_path / "q.csv"
    quote.write_text('text,topic\n"What is rain?,weather\n')
    junk = tmp_path / "q.parquet"
    junk.write_bytes(b"\x07" * 64)
    for file, kind in ((quote, "csv"), (junk, "parquet")):
        with pytest.raises(InputError, match=rf"data.path={re.escape(str(file))}: not a readable {kind} file \(\w+"):
            load_prompts("hf", path=str(file))
    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "a.csv").write_text('text\n"open quote\n')
    with pytest.raises(InputError, match=r"data.path=.*set: `datasets` cannot open it here \(\w+"):
        load_prompts("hf", path=str(folder))


def test_hf_missing_field_lists_columns(tmp_path, hf_cache):
    csv = tmp_path / "set.csv"
    csv.write_text("question,topic\nWhat is rain?,weather\n")
    with pytest.raises(ValueError, match=r"'text' \(data\.text_field\).*\['question', 'topic'\]"):
        load_prompts("hf", path=str(csv))
    with pytest.raises(ValueError, match=r"'label' \(data\.category_field\)"):
        load_prompts("hf", path=str(csv), text_field="question", category_field="label")


# --- chat inputs -----------------------------------------------------------------------------------


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([7], [8]) == 0


def test_turn_input_plain_text(tokenizer):
    first = build_turn_input(tokenizer, [], "hello")
    assert first == tokenizer.encode("User: hello\nAssistant:", add_special_tokens=True)
    answer = tokenizer.encode("fine thanks", add_special_tokens=False)
    second = build_turn_input(tokenizer, [("hello", "fine thanks")], "how are you")
    # Whitespace pre-tokenization makes the transcript extend exactly; a BPE tokenizer may not.
    assert second[: len(first) + len(answer)] == first + answer
    assert common_prefix_len(first + answer, second) == len(first) + len(answer)


def test_turn_input_chat_template(tokenizer):
    tokenizer.chat_template = TEMPLATE
    first = build_turn_input(tokenizer, [], "hello", system_prompt="be brief")
    assert isinstance(first, list) and all(type(i) is int for i in first)
    vocab = tokenizer.get_vocab()
    expected = "<s> system be brief </s> <s> user hello </s> <s> assistant".split()
    assert first == [vocab[w] for w in expected]

    answer = tokenizer.encode("fine thanks", add_special_tokens=False)
    second = build_turn_input(tokenizer, [("hello", "fine thanks")], "how are you", system_prompt="be brief")
    # Turn 2 extends turn 1's input + the answer; then the template closes the answer with "</s>", a
    # token the model may not have generated, so a caller re-feeds from the common prefix on.
    reused = common_prefix_len(first + answer, second)
    assert reused == len(first) + len(answer)
    assert second[:reused] == first + answer
    assert second[reused] == vocab["</s>"]


def test_bad_prompt_files_are_input_errors(tmp_path):
    """What a prompt file holds wrong is bad input (`specdec.core.errors.InputError`: one `Error:` line on
    the command line), also the ValueError or FileNotFoundError a library caller expects; a
    Spec-Bench file with no question says it is empty."""
    from specdec.core.errors import InputError

    empty = tmp_path / "questions.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"questions\.jsonl is empty: it holds no prompts") as err:
        load_prompts("spec_bench", path=str(empty))
    assert isinstance(err.value, InputError)
    with pytest.raises(FileNotFoundError) as err:
        load_prompts("spec_bench", path=str(tmp_path / "nope.jsonl"))
    assert isinstance(err.value, InputError)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": 5}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"prompt '0' is int, not text \(a string, or a list of strings"):
        load_prompts("hf", path=str(numbers))


def test_an_uncached_dataset_name_says_the_machine_reads_offline(monkeypatch):
    from specdec.core.errors import InputError

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(InputError, match="data.hf_name=no-such-org/no-such-set-xyz: `datasets` cannot open it"):
        load_prompts("hf", hf_name="no-such-org/no-such-set-xyz")
