"""Training drafting heads for a target by self-distillation, on this machine.

The recipe (`scripts/train_heads.py` runs it):

1. prompts   `training_prompts`: instructions this project writes (topics x tasks, below), plus,
             optionally, instructions the target writes itself when asked for one about a topic.
             None is an evaluation prompt: `check_disjoint` refuses the run if any equals a
             Spec-Bench question or a built-in prompt.
2. data      the target's own greedy continuations (`training.generate_continuations`), and one
             target pass over each that keeps its final hidden states (`training.teacher_targets`).
             The heads learn to say what the target says, where the target says it.
3. vocab     optionally the most frequent tokens of that text become the heads' output vocabulary.
4. train     `train_medusa`: head d learns the target's token d+1 places after the one its hidden
             state's own head predicts (cross-entropy, head d weighted decay^(d-1) as in Medusa),
             on the continuation positions only (the prompt's tokens are not the target's).
5. held out  `head_accuracy`: each head's top-1 agreement with the target on held-out text, and
             the fraction of positions where heads 1..d are all right (a chain's acceptance).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specdec.proposers.heads import OutputHead
from specdec.train.training import Example

# ---------------------------------------------------------------- 1. prompts

TOPICS = (
    "growing tomatoes on a balcony", "the water cycle", "how vaccines train the immune system", "compound interest",
    "the rules of chess", "photosynthesis", "a weekend trip to the mountains", "learning to play the guitar",
    "sorting algorithms", "the history of the printing press", "saving energy at home", "volcanoes",
    "writing a cover letter", "the causes of inflation", "caring for a new puppy", "black holes",
    "public speaking", "the human heart", "recycling plastics", "baking sourdough bread",
    "time management for students", "electric cars", "the Roman aqueducts", "machine translation",
    "how a bicycle gear works", "meditation", "ocean tides", "planning a small wedding", "prime numbers",
    "the migration of birds", "starting a vegetable garden", "how credit scores work", "renewable energy",
    "the invention of the telephone", "writing unit tests", "desert ecosystems", "making friends in a new city",
    "how rainbows form", "a healthy breakfast", "the stock market", "earthquakes", "climbing safety",
    "the life of honeybees", "negotiating a salary", "how the internet routes packets", "ancient Egypt",
    "composting", "running a first marathon", "the theory of evolution", "choosing a laptop",
    "coral reefs", "learning a second language", "how airplanes fly", "the French Revolution",
    "organising a kitchen", "solar eclipses", "version control with git", "the moon landing",
    "keeping houseplants alive", "probability with dice", "the Silk Road", "sleep and memory",
    "designing a logo", "glaciers", "a board game night", "how batteries store energy",
)

TASKS = (
    "Explain {topic} to a ten-year-old.",
    "Write a short story that involves {topic}.",
    "Give me five practical tips about {topic}.",
    "What are the most common misconceptions about {topic}?",
    "Write a haiku about {topic}.",
    "Summarize what an expert should know about {topic} in one paragraph.",
    "Create a short quiz with three questions about {topic}, with answers.",
    "Compare {topic} with something from everyday life.",
    "Write a friendly email to a colleague about {topic}.",
    "List the pros and cons of spending a month studying {topic}.",
    "Describe {topic} step by step.",
    "Write a dialogue between a teacher and a student about {topic}.",
)

ASK_FOR_INSTRUCTION = "Write one question that a curious person might ask about {topic}. Reply with the question only."


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct project-written instructions (topics x tasks), drawn with `seed`."""
    pool = [task.format(topic=topic) for topic in TOPICS for task in TASKS]
    if n > len(pool):
        raise ValueError(f"prompts.count={n} but only {len(pool)} distinct written prompts exist")
    return random.Random(seed).sample(pool, n)


def target_written_prompts(write: Callable[[list[str]], list[str]], n: int, seed: int = 0) -> list[str]:
    """Up to `n` instructions the target writes itself: `write` answers a batch of requests (one per
    topic, `ASK_FOR_INSTRUCTION`); empty or repeated answers are dropped."""
    topics = random.Random(seed + 1).sample(TOPICS, min(n, len(TOPICS)))
    seen, out = set(), []
    for text in write([ASK_FOR_INSTRUCTION.format(topic=t) for t in topics]):
        text = text.strip().split("\n")[0].strip()
        if text and text.lower() not in seen:
            seen.add(text.lower())
            out.append(text)
    return out


# Task families shaped like the workloads speculative decoding is measured on (instructions, multi-turn
# follow-ups, translation, summaries of long text, questions about passages, arithmetic word problems),
# built from text this project writes or the target writes: `FamilyPlan` runs them in stages, each
# stage's prompts made from the target's answers to the previous one.

PASSAGE_ASKS = (
    "Write a short news report about {topic}.",
    "Write an encyclopedia-style paragraph about {topic}.",
    "Write a blog post about {topic}.",
)

FOLLOW_UPS = (
    "Now explain the same thing to a ten-year-old.", "Summarize your answer in two sentences.",
    "Rewrite your answer in a more formal tone.", "Give one concrete example of what you said.",
    "What is the most important point in your answer, and why?", "Turn your answer into a short list.",
    "Critique your own answer: what is missing?", "Make your answer shorter and funnier.",
    "Now write the opposite point of view.", "Translate the first sentence of your answer into French.",
)

QA_TEMPLATES = (
    "What is {topic}?", "Who first studied {topic}?", "When did people start caring about {topic}?",
    "Why does {topic} matter?", "Where can I learn more about {topic}?", "How does {topic} work?",
)

RAG_QUESTIONS = (
    "What is the main point of the text above?", "According to the text, why does this matter?",
    "What does the text say happened first?", "Which detail in the text is the most surprising?",
    "Who or what is the text mostly about?",
)

CODE_TASKS = (
    "reverses the words of a sentence", "counts the vowels in a string", "checks whether a number is prime",
    "merges two sorted lists", "finds the most common word in a text file", "computes a moving average",
    "parses a date like 2024-03-01 and returns the weekday", "removes duplicates from a list keeping order",
    "returns the n-th Fibonacci number", "flattens a nested list", "validates an email address",
    "converts Celsius to Fahrenheit for a list of values",
)
CODE_ASKS = ("Write a Python function that {task}.", "Write a JavaScript function that {task}, with a short example.",
             "Explain how you would write a program that {task}.")

_NAMES = ("Maria", "Tom", "Aisha", "Kenji", "Lucas", "Priya", "Omar", "Elena", "Sam", "Fatima")
_ITEMS = ("apples", "notebooks", "tickets", "cupcakes", "marbles", "books", "plants", "stickers")
MATH_TEMPLATES = (
    "{name} buys {a} {item} at ${b} each and pays with a ${c} bill. How much change does {name} get?",
    "{name} has {a} {item}. {name} gives away {b} and then buys {c} more. How many {item} does {name} have now?",
    "A shop sells {item} for ${b} each. On Monday it sold {a} and on Tuesday {c} more than on Monday. "
    "How much money did it make on the two days?",
    "{name} reads {b} pages a day. The book has {a} pages more than {c} times that. How many days does "
    "{name} need to finish it?",
    "{name} saves ${b} a week. After {c} weeks {name} spends {a} percent of the savings. How much is left?",
    "A train travels at {b} miles per hour for {c} hours, then at {a} miles per hour for 2 hours. "
    "How far does it go in total?",
    "{name} splits {a} {item} equally among {c} friends and keeps the remainder. How many does each "
    "friend get, and how many are left?",
)


def math_problems(n: int, seed: int = 0) -> list[str]:
    """`n` arithmetic word problems written from templates with random names and numbers."""
    rng = random.Random(seed + 2)
    out = []
    for i in range(n):
        template = MATH_TEMPLATES[i % len(MATH_TEMPLATES)]
        out.append(template.format(name=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=rng.randint(12, 90),
                                   b=rng.randint(2, 15), c=rng.randint(3, 9)))
    return out


def _sentences(text: str) -> list[str]:
    parts = [p.strip() for p in text.replace("\n", " ").split(". ")]
    return [p.rstrip(".") + "." for p in parts if 6 <= len(p.split()) <= 30]


class FamilyPlan:
    """The staged task families. A request is (history, user_turn): history holds earlier
    (user, assistant) turns. `stage(answers)` takes the target's answers to the previous stage's
    requests (none for the first) and returns the next stage's requests ([] when done).

    stage 1: written instructions, math problems, short questions, coding tasks, passages to write, questions
             the target writes about a topic;
    stage 2: summarise one to three of its passages ("Summarize: ..."), answer a question about
             them, translate one of its sentences into German, a follow-up turn after an answer;
    stage 3: translate its German back ("Translate German to English: ...").
    """

    def __init__(self, written: int, math: int, qa: int, follow_ups: int, passages: int, code: int,
                 derived: int | None = None, seed: int = 0):
        self.rng = random.Random(seed)
        self.counts = {"written": written, "math": math, "qa": qa, "follow_ups": follow_ups,
                       "passages": passages, "code": code, "derived": derived}
        self.seed = seed
        self.step = 0
        self.requests: list[tuple[list[tuple[str, str]], str]] = []
        self.kinds: list[str] = []

    def stage(self, answers: list[str]) -> list[tuple[list[tuple[str, str]], str]]:
        rng, seed = self.rng, self.seed
        prev = list(zip(self.kinds, self.requests, answers))
        out: list[tuple[str, tuple[list, str]]] = []
        if self.step == 0:
            out += [("written", ([], t)) for t in training_prompts(self.counts["written"], seed)]
            out += [("math", ([], t)) for t in math_problems(self.counts["math"], seed)]
            qa = [q.format(topic=t) for t in TOPICS for q in QA_TEMPLATES]
            out += [("qa", ([], t)) for t in rng.sample(qa, min(self.counts["qa"], len(qa)))]
            code = [a.format(task=t) for t in CODE_TASKS for a in CODE_ASKS]
            out += [("code", ([], t)) for t in rng.sample(code, min(self.counts["code"], len(code)))]
            passages = [a.format(topic=t) for t in TOPICS for a in PASSAGE_ASKS]
            out += [("passage", ([], t)) for t in rng.sample(passages, min(self.counts["passages"], len(passages)))]
            topics = rng.sample(TOPICS, min(self.counts["passages"], len(TOPICS)))
            out += [("ask", ([], ASK_FOR_INSTRUCTION.format(topic=t))) for t in topics]
        elif self.step == 1:
            passages = [a.strip() for kind, _, a in prev if kind == "passage" and len(a.split()) > 40]
            if self.counts["derived"] is not None:  # summaries, questions and translations from this many
                passages = rng.sample(passages, min(self.counts["derived"], len(passages)))
            questions = [a.strip().split("\n")[0] for kind, _, a in prev if kind == "ask" and a.strip()]
            for i, passage in enumerate(passages):
                more = rng.sample(passages, rng.randint(0, 2))
                text = "\n\n".join([passage, *more])
                out.append(("summarize", ([], f"Summarize: {text}")))
                question = rng.choice(questions) if questions and i % 2 else rng.choice(RAG_QUESTIONS)
                out.append(("rag", ([], f"{text}\n{question}")))
                for sentence in rng.sample(_sentences(passage), min(1, len(_sentences(passage)))):
                    out.append(("to_german", ([], f"Translate English to German: {sentence}")))
            firsts = [(r, a) for kind, r, a in prev if kind in ("written", "qa", "math", "code") and a.strip()]
            for (history, user), answer in rng.sample(firsts, min(self.counts["follow_ups"], len(firsts))):
                out.append(("follow_up", ([*history, (user, answer.strip())], rng.choice(FOLLOW_UPS))))
        elif self.step == 2:
            for kind, _, answer in prev:
                german = answer.strip().split("\n")[0].strip()
                if kind == "to_german" and len(german.split()) >= 4:
                    out.append(("to_english", ([], f"Translate German to English: {german}")))
        self.step += 1
        self.kinds = [k for k, _ in out]
        self.requests = [r for _, r in out]
        return self.requests


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def check_disjoint(train: list[str], evaluation: list[str]) -> None:
    """Refuse training prompts that are (whitespace- and case-insensitively) evaluation prompts."""
    evaluation_set = {_normal(t) for t in evaluation}
    clash = [t for t in train if _normal(t) in evaluation_set]
    if clash:
        raise ValueError(f"{len(clash)} training prompts are evaluation prompts (first: {clash[0]!r}); "
                         "training data must be disjoint from Spec-Bench and the built-in prompts")


# ---------------------------------------------------------------- 4. Medusa


def vocab_index(vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[V] map from token id to index in the heads' vocabulary, -100 (ignored) for tokens outside it."""
    if vocab_ids is None:
        return torch.arange(vocab_size)
    index = torch.full((vocab_size,), -100, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    return index


def medusa_labels(example: Example, continuation_start: int, num_heads: int, index: torch.Tensor) -> torch.Tensor:
    """Labels [L-1, K] for an example whose `hidden` covers positions 0..L-2 (`start` = 1): head d at
    position t learns token t+1+d, where it lies in the continuation; -100 elsewhere."""
    tokens = example.tokens
    n = len(tokens)
    t = torch.arange(n - 1)[:, None]
    ahead = t + 1 + torch.arange(1, num_heads + 1)[None, :]  # [L-1, K]
    labels = index[tokens[ahead.clamp(max=n - 1)]]
    return labels.masked_fill((ahead >= n) | (ahead < continuation_start), -100)


def _medusa_batches(examples, labels, max_tokens: int, rng: random.Random):
    order = list(range(len(examples)))
    rng.shuffle(order)
    batch_h, batch_y, size = [], [], 0
    for i in order:
        batch_h.append(examples[i].hidden)
        batch_y.append(labels[i])
        size += len(labels[i])
        if size >= max_tokens:
            yield torch.cat(batch_h), torch.cat(batch_y)
            batch_h, batch_y, size = [], [], 0
    if batch_h:
        yield torch.cat(batch_h), torch.cat(batch_y)


def medusa_loss(heads, head: OutputHead, hidden: torch.Tensor, labels: torch.Tensor,
                decay: float = 0.8) -> torch.Tensor:
    """hidden: [M, H]; labels: [M, K] -> weighted cross-entropy summed over heads (mean over positions)."""
    logits = head.logits(heads(hidden))  # [M, K, V']
    total = hidden.new_zeros(())
    for d in range(labels.shape[1]):
        if (labels[:, d] >= 0).any():
            total = total + decay ** d * F.cross_entropy(logits[:, d].float(), labels[:, d], ignore_index=-100)
    return total


def train_medusa(heads, head: OutputHead, examples: list[Example], labels: list[torch.Tensor],
                 epochs: int, lr: float, max_tokens: int, decay: float = 0.8, seed: int = 0,
                 progress: bool = True, autocast: str | None = None,
                 on_epoch: Callable[[int], None] | None = None) -> list[float]:
    """AdamW on the heads only (the output head is frozen); returns the loss of every step."""
    rng = random.Random(seed)
    return _optimise(heads, list(heads.parameters()), lambda: list(_medusa_batches(examples, labels, max_tokens, rng)),
                     lambda batch: medusa_loss(heads, head, *batch, decay), epochs, lr, "medusa", progress,
                     autocast, on_epoch)


def _optimise(module: torch.nn.Module, params: list[torch.nn.Parameter], epoch_batches: Callable[[], list],
              batch_loss: Callable[[Any], torch.Tensor], epochs: int, lr: float, name: str, progress: bool,
              autocast: str | None, on_epoch: Callable[[int], None] | None,
              clip_norm: float | None = None) -> list[float]:
    """The training loop both drafters share: AdamW on `params`, `epoch_batches()` called once per
    epoch (it shuffles), bfloat16 autocast on the CPU when `autocast` is set, the gradient norm
    clipped to `clip_norm` when given; returns the loss of every step."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    module.train()
    for epoch in range(epochs):
        for batch in tqdm(epoch_batches(), desc=f"{name} epoch {epoch + 1}/{epochs}", disable=not progress):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
                loss = batch_loss(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip_norm)
            opt.step()
            losses.append(float(loss.detach()))
        if on_epoch is not None:
            on_epoch(epoch)
    module.eval()
    return losses


@torch.inference_mode()
def head_accuracy(heads, head: OutputHead, examples: list[Example], labels: list[torch.Tensor]) -> dict:
    """Per head, top-1 agreement with the target's token; and per depth d, the fraction of positions
    (where all d labels exist) at which heads 1..d are all right: what a chain of d Medusa guesses
    would get accepted."""
    hidden, y = torch.cat([e.hidden for e in examples]), torch.cat(labels)
    guess = head.logits(heads(hidden.to(head.weight.dtype))).argmax(-1)  # [M, K]
    right, known = guess == y, y >= 0
    per_head = [float(right[known[:, d], d].float().mean()) if known[:, d].any() else float("nan")
                for d in range(y.shape[1])]
    chain = []
    for d in range(1, y.shape[1] + 1):
        rows = known[:, :d].all(1)
        chain.append(float(right[rows, :d].all(1).float().mean()) if rows.any() else float("nan"))
    return {"top1_per_head": per_head, "chain_acceptance": chain}


# ---------------------------------------------------------------- 4'. EAGLE


def eagle_sequences(example: Example, continuation_start: int, index: torch.Tensor,
                    head: OutputHead | None = None) -> dict:
    """The drafter's training sequence from an example whose `hidden` holds f_0..f_{L-2} (`start` = 1):
    at t = 0..L-3 it reads (x_{t+1}, f_t) and learns f_{t+1} (regression) and the target's token
    x_{t+2} (classification). Inside the continuation that token is the target's greedy choice. The
    prompt's tokens are not the target's: there the label is the target's own top-1 prediction
    (`head`, the whole output head, applied to f_{t+1}), or nothing (-100) without it."""
    tokens, hidden = example.tokens, example.hidden
    n = len(tokens) - 2
    labels = index[tokens[2:]].clone()
    cut = max(continuation_start - 2, 0)
    if head is None or cut == 0:
        labels[:cut] = -100
    else:
        with torch.no_grad():
            predicted = head.logits(hidden[1 : cut + 1].to(head.weight.dtype)).argmax(-1)
        labels[:cut] = index[predicted]
    return {"tokens": tokens[1 : n + 1], "features": hidden[:n], "next": hidden[1 : n + 1], "labels": labels}


def _pad_stack(items: list[torch.Tensor], value: float) -> torch.Tensor:
    width = max(len(x) for x in items)
    out = torch.full((len(items), width, *items[0].shape[1:]), value, dtype=items[0].dtype)
    for i, x in enumerate(items):
        out[i, : len(x)] = x
    return out


def length_groups(sequences: list[dict], max_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices of `sequences` in batches of similar lengths (`tokens`), each at most `max_tokens`
    padded positions, in an order shuffled by `rng`."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]["tokens"]))
    groups, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(sequences[i]["tokens"]) > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def _eagle_batches(sequences: list[dict], max_tokens: int, rng: random.Random):
    for group in length_groups(sequences, max_tokens, rng):
        items = [sequences[i] for i in group]
        valid = _pad_stack([torch.ones(len(x["tokens"]), dtype=torch.bool) for x in items], False)
        yield ({k: _pad_stack([x[k] for x in items], -100 if k == "labels" else 0) for k in items[0]}, valid)


def eagle_loss(drafter, embed, head: OutputHead, batch: dict, valid: torch.Tensor,
               cls_weight: float = 0.1, unroll: int = 1, noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (total loss, classification loss of the first pass): smooth-L1 between predicted and true
    next features over valid positions, plus `cls_weight` x cross-entropy on the target's next tokens
    (EAGLE's mix).

    unroll > 1 trains as the drafter is used below the tree's first level: pass j reads, at position
    t, the feature that pass j-1 predicted for t (not the target's), so the drafter learns to draft
    from its own features (the training-time test of EAGLE-3); the passes' losses are averaged.
    noise: uniform noise of that amplitude on the target's features (EAGLE-1), for robustness."""
    b, t = batch["tokens"].shape
    positions = torch.arange(t)[None].expand(b, t)
    with torch.no_grad():  # the target's embedding is frozen
        embeds = embed(batch["tokens"])
    features = batch["features"]
    if noise:
        features = features + (torch.rand_like(features) * 2 - 1) * noise
    total, first_cls = 0.0, None
    for _ in range(unroll):
        predicted = drafter(embeds, features, positions)  # causal, no cache
        reg = F.smooth_l1_loss(predicted[valid].float(), batch["next"][valid].float())
        logits = head.logits(predicted[valid])
        cls = F.cross_entropy(logits.float(), batch["labels"][valid], ignore_index=-100)
        total = total + reg + cls_weight * cls
        first_cls = cls if first_cls is None else first_cls
        # the next pass: position t reads the feature predicted for it from t - 1
        features = torch.cat([batch["features"][:, :1], predicted[:, :-1].to(batch["features"].dtype)], 1)
    return total / unroll, first_cls


def train_eagle(drafter, embed, head: OutputHead, sequences: list[dict], epochs: int, lr: float,
                max_tokens: int, seed: int = 0, progress: bool = True, autocast: str | None = None,
                on_epoch: Callable[[int], None] | None = None, unroll: int = 1, noise: float = 0.0) -> list[float]:
    """AdamW on the drafter (embedding and output head frozen); returns the loss of every step."""
    rng = random.Random(seed)
    return _optimise(drafter, [p for p in drafter.parameters() if p.requires_grad],
                     lambda: list(_eagle_batches(sequences, max_tokens, rng)),
                     lambda batch: eagle_loss(drafter, embed, head, *batch, unroll=unroll, noise=noise)[0],
                     epochs, lr, "eagle", progress, autocast, on_epoch, clip_norm=1.0)


@torch.inference_mode()
def eagle_accuracy(drafter, embed, head: OutputHead, sequences: list[dict], max_tokens: int = 4096) -> dict:
    """Held-out top-1 agreement of the drafter's next-token guess with the target's, reading the
    target's true features (the first tree level's acceptance, teacher-forced)."""
    right = total = 0
    for batch, valid in _eagle_batches(sequences, max_tokens, random.Random(0)):
        b, t = batch["tokens"].shape
        predicted = drafter(embed(batch["tokens"]), batch["features"], torch.arange(t)[None].expand(b, t))
        guess = head.logits(predicted[valid]).argmax(-1)
        labels = batch["labels"][valid]
        known = labels >= 0
        right += int((guess[known] == labels[known]).sum())
        total += int(known.sum())
    return {"top1": right / max(total, 1)}
