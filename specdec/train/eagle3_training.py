"""Training an EAGLE-3 drafter (Li et al. 2025) for a target, on the target's own answers.

`scripts/train_heads.py kind=eagle3` runs the recipe; each part is a function here:

1. data      prompts as for `kind=eagle` (`head_training`), and optionally conversations read from
             local JSON/JSONL files (`read_conversations`: ShareGPT's `conversations: [{from, value}]`
             or the `messages: [{role, content}]` list) whose answers the target writes again
             (`conversation_requests`): the drafter learns what the target says, not what the
             file's assistant said.
2. features  `tap_features`: one target pass per batch keeps, at every position, the residual
             stream entering the tapped layers (transformers' `output_hidden_states[i]`; i == N is
             the decoder's normed output), the decoder's output (the output head's input, which
             gives the teacher distribution) and the target's top-1 token.
3. vocab     `draft_vocab`: the `draft_vocab_size` most frequent tokens of the training text, as
             EAGLE-3's files hold them (`d2t` offsets: target id = i + d2t[i]; `t2d` flags).
4. init      `init_from_target`: the mid-layer from the target's last decoder layer (q/k/v read
             [embedding, hidden], both halves from the target's), `norm` from its final norm,
             `lm_head` from its head's rows of the draft vocabulary, `fc` picking the last tap.
5. train     `TrainingTimeTest`: EAGLE-3's training-time test. Step 0 reads the target's taps;
             step j > 0 reads, at position t, the drafter's own output of step j-1 at t, with the
             token j places further on. Its queries see step 0's keys causally and, of each later
             step, only the key at their own position: the path a draft of depth j sees when
             decoding. The loss of step j is the cross-entropy between the target's distribution
             of the next token, restricted to the draft vocabulary, and the drafter's, weighted
             `decay`^j, at positions whose target top-1 is in the draft vocabulary.
6. held out  `ttt_accuracy`: per step, the drafter's top-1 agreement with the target's.

Data parallel: under `torchrun` (WORLD_SIZE > 1) `train_eagle3` wraps the training-time test in
DistributedDataParallel (one forward per optimisation step, all steps inside) and gives each
rank every WORLD_SIZE-th batch; the caller lets rank 0 alone write.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specdec.core.attention import grouped_attention
from specdec.core.decoder_stack import decoder_stack, hidden_source
from specdec.core.errors import InvalidInput, MissingInput
from specdec.proposers.eagle3 import Eagle3Drafter, default_layer_ids
from specdec.proposers.heads import OutputHead, frequent_tokens
from specdec.train.head_training import _optimise, _pad_stack, length_groups
from specdec.train.training import Example, _autocast, _batches, _pad

# ---------------------------------------------------------------- 1. conversations

USER_ROLES = {"human": "user", "user": "user"}
ASSISTANT_ROLES = {"gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
                   "bing": "assistant", "model": "assistant"}
SYSTEM_ROLES = {"system": "system"}
ROLES = {**USER_ROLES, **ASSISTANT_ROLES, **SYSTEM_ROLES}
FORMAT_HINT = ("each record needs `conversations: [{from, value}]` (ShareGPT) or `messages: [{role, content}]`, "
               "with roles among " + ", ".join(sorted(ROLES)))


def read_conversations(path: str | Path, limit: int | None = None) -> list[list[tuple[str, str]]]:
    """The conversations of a local JSON or JSONL file (read through `datasets`), each a list of
    (role, text) with roles normalised to system, user and assistant. InvalidInput naming the file
    and the record for anything else: no such file, not JSON, a record with neither list, a turn
    without its role or text, an unknown role."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise MissingInput(f"conversations file {path} does not exist; give a local .json or .jsonl file "
                           f"({FORMAT_HINT})")
    import datasets

    try:
        records = datasets.load_dataset("json", data_files=str(path), split="train")
    except Exception as err:  # datasets raises its own and pyarrow's errors for a file that is not JSON
        raise InvalidInput(f"conversations file {path} cannot be read as JSON or JSONL ({type(err).__name__}: "
                           f"{str(err).splitlines()[0][:200]}); {FORMAT_HINT}") from None
    out = []
    for i, record in enumerate(records):
        if limit is not None and len(out) >= limit:
            break
        out.append(_conversation(record, f"{path} record {i}"))
    if not out:
        raise InvalidInput(f"conversations file {path} holds no conversation; {FORMAT_HINT}")
    return out


def _conversation(record: dict, where: str) -> list[tuple[str, str]]:
    """One record as (role, text) turns (`read_conversations`)."""
    if record.get("conversations") is not None:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif record.get("messages") is not None:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise InvalidInput(f"{where} has neither `conversations` nor `messages`; {FORMAT_HINT}")
    if not isinstance(turns, list) or not turns:
        raise InvalidInput(f"{where}: the turns must be a non-empty list; {FORMAT_HINT}")
    out = []
    for j, turn in enumerate(turns):
        role = turn.get(role_key) if isinstance(turn, dict) else None
        text = turn.get(text_key) if isinstance(turn, dict) else None
        if not isinstance(role, str) or not isinstance(text, str):
            raise InvalidInput(f"{where} turn {j}: expected `{role_key}` and `{text_key}` strings, got {turn!r:.120}; "
                               f"{FORMAT_HINT}")
        if role.lower() not in ROLES:
            raise InvalidInput(f"{where} turn {j}: unknown role {role!r}; {FORMAT_HINT}")
        out.append((ROLES[role.lower()], text))
    return out


def conversation_requests(conversations: list[list[tuple[str, str]]],
                          max_turns: int = 1) -> list[tuple[str | None, list[tuple[str, str]], str]]:
    """(system prompt, history, user turn) for each of the first `max_turns` user turns of each
    conversation: the history holds the file's earlier (user, assistant) pairs, and the target
    answers the user turn itself. Empty user turns are skipped."""
    out = []
    for turns in conversations:
        system = next((text for role, text in turns if role == "system"), None)
        history: list[tuple[str, str]] = []
        pending: str | None = None
        taken = 0
        for role, text in turns:
            if role == "user":
                if pending is not None:  # two user turns in a row: the first gets no answer in the history
                    history.append((pending, ""))
                pending = text
                if text.strip() and taken < max_turns:
                    out.append((system, list(history), text))
                    taken += 1
            elif role == "assistant" and pending is not None:
                history.append((pending, text))
                pending = None
    return out


# ---------------------------------------------------------------- 2. features


def tap_hooks(decoder: torch.nn.Module, layer_ids: list[int], taps: dict[int, torch.Tensor]) -> list:
    """Hooks that put into `taps[i]` the residual stream entering decoder layer i (i == N: the
    decoder's normed output), as the engine keeps them while decoding (`Engine.keep_hidden_states`)."""
    layers = decoder_stack(decoder)[1]
    n = len(layers)

    def entering(i: int):
        def hook(module, args, kwargs):
            taps[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    hooks = [layers[i].register_forward_pre_hook(entering(i), with_kwargs=True) for i in layer_ids if i < n]
    if layer_ids[-1] == n:
        hooks.append(decoder.register_forward_hook(lambda module, args, out: taps.__setitem__(n, out[0])))
    return hooks


@torch.inference_mode()
def tap_features(target, examples: list[Example], layer_ids: list[int], max_tokens: int = 2048, pad_id: int = 0,
                 progress: bool = True, autocast: str | None = None) -> list[dict]:
    """Per example, over all its L positions: `taps` [L, n*Ht] (bfloat16) the concatenated taps,
    `hidden` [L, Ht] (float32) the decoder's output, `top1` [L] the target's greedy next token."""
    decoder = hidden_source(target)
    if decoder_stack(decoder) is None:
        raise InvalidInput(f"{type(target).__name__}'s decoder has no list of layers to tap; EAGLE-3 cannot train on it")
    head = OutputHead.of(target)
    out: dict[int, dict] = {}
    index = {id(e): i for i, e in enumerate(examples)}
    for batch in tqdm(_batches(examples, max_tokens), desc="target taps", unit="batch", disable=not progress):
        ids, mask = _pad(batch, pad_id)
        taps: dict[int, torch.Tensor] = {}
        hooks = tap_hooks(decoder, layer_ids, taps)
        try:
            with _autocast(target, autocast), grouped_attention(target):
                hidden = decoder(input_ids=ids, attention_mask=mask)[0]  # [B, L, Ht]
        finally:
            for h in hooks:
                h.remove()
        joined = torch.cat([taps[i] for i in layer_ids], -1)  # [B, L, n*Ht]
        for row, e in enumerate(batch):
            n = len(e.tokens)
            h = hidden[row, :n].float()
            top1 = torch.cat([head.logits(c.to(head.weight.dtype)).argmax(-1) for c in h.split(512)])
            out[index[id(e)]] = {"taps": joined[row, :n].to(torch.bfloat16).clone(), "hidden": h.clone(), "top1": top1}
    return [out[i] for i in range(len(examples))]


# ---------------------------------------------------------------- 3. vocabulary


def draft_vocab(sequences: list[torch.Tensor], size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [Vd] ascending, d2t [Vd] int64 offsets, t2d [V] bool) of the `size` most frequent tokens
    of `sequences` (all of the target's when `size` >= its vocabulary)."""
    if size >= vocab_size:
        ids = torch.arange(vocab_size)
    else:
        ids = frequent_tokens(sequences, size, vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids, ids - torch.arange(len(ids)), t2d


# ---------------------------------------------------------------- 4. the drafter


def drafter_config(target, layer_ids: list[int] | None, draft_vocab_size: int) -> dict:
    """The canonical config (`specdec.proposers.formats`) of a drafter of the target's shape: its
    width, heads, MLP and rotary; taps `layer_ids` (default [2, N//2, N-3])."""
    text = target.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" else None
    vocab = target.get_output_embeddings().out_features
    return {"hidden_size": text.hidden_size, "num_attention_heads": heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
            "intermediate_size": text.intermediate_size, "rms_norm_eps": float(getattr(text, "rms_norm_eps", 1e-6)),
            "rope_theta": float(theta), "rope_scaling": scaling,
            "max_position_embeddings": int(getattr(text, "max_position_embeddings", 2048)),
            "vocab_size": vocab, "draft_vocab_size": min(draft_vocab_size, vocab),
            "target_hidden_size": text.hidden_size,
            "layer_ids": list(layer_ids) if layer_ids is not None else default_layer_ids(text.num_hidden_layers),
            "num_layers": 1, "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
            "norm_output": False, "attention_bias": False, "mlp_bias": False}


@torch.no_grad()
def init_from_target(drafter: Eagle3Drafter, target, vocab_ids: torch.Tensor) -> list[str]:
    """Start from the target where the shapes allow (module docstring, 4); returns the tensors set."""
    decoder = hidden_source(target)
    _, layers, final_norm = decoder_stack(decoder)
    last = dict(layers[-1].named_parameters())
    mine = drafter.layers[0]
    done = []
    for name, p in mine.named_parameters():
        src = last.get(name)
        if name.startswith("self_attn.") and name.split(".")[1] in ("q_proj", "k_proj", "v_proj") and name.endswith("weight"):
            if src is not None and p.shape == (src.shape[0], 2 * src.shape[1]):
                p.copy_(torch.cat([src, src], 1).float() / 2)
                done.append(f"layers.0.{name}")
        elif name in ("input_layernorm.weight", "hidden_norm.weight"):
            src = last.get("input_layernorm.weight")
            if src is not None and src.shape == p.shape:
                p.copy_(src.float())
                done.append(f"layers.0.{name}")
        elif src is not None and src.shape == p.shape:
            p.copy_(src.float())
            done.append(f"layers.0.{name}")
    norm = getattr(final_norm, "weight", None)
    if norm is not None and norm.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(norm.float())
        done.append("norm.weight")
    head = target.get_output_embeddings().weight
    if head.shape[1] == drafter.hidden_size:
        drafter.lm_head.weight.copy_(head[vocab_ids.to(head.device)].float())
        done.append("lm_head.weight")
    h, width = drafter.hidden_size, drafter.fc.in_features
    if width >= h and drafter.target_hidden_size == h:  # the last tap passes through, the others start small
        fc = torch.randn(h, width) * 0.02 / (width ** 0.5)
        fc[:, width - h:] += torch.eye(h)
        drafter.fc.weight.copy_(fc)
        done.append("fc.weight")
    return done


def make_drafter(target, layer_ids: list[int] | None, vocab_ids: torch.Tensor, d2t: torch.Tensor) -> Eagle3Drafter:
    """A float32 drafter of the target's shape (`drafter_config`), initialised from it, with `d2t`."""
    drafter = Eagle3Drafter(drafter_config(target, layer_ids, len(vocab_ids))).float()
    drafter.d2t.copy_(d2t)
    init_from_target(drafter, target, vocab_ids)
    return drafter


# ---------------------------------------------------------------- 5. the training-time test


def ttt_sequence(example: Example, features: dict, continuation_start: int, prompt_labels: bool) -> dict:
    """The training sequence of an example of L tokens x_0..x_{L-1}: at position t = 0..L-2 step 0
    reads (x_{t+1}, taps f_t) and learns the target's distribution at t+1 (of the token after
    x_{t+1}). Held per position: `tokens` x_{t+1}, `features` f_t, `teacher` the decoder's output at
    t+1, `top1` the target's greedy token there, `mask` whether its loss counts (the next token
    lies in the continuation, or anywhere with `prompt_labels`)."""
    n = len(example.tokens) - 1
    mask = torch.ones(n, dtype=torch.bool)
    if not prompt_labels:
        mask[: max(continuation_start - 2, 0)] = False
    return {"tokens": example.tokens[1:], "features": features["taps"][:n], "teacher": features["hidden"][1:],
            "top1": features["top1"][1:], "mask": mask}


def ttt_batches(sequences: list[dict], max_tokens: int, rng: random.Random, rank: int = 0, world: int = 1):
    """Padded batches of similar lengths (at most `max_tokens` padded positions), shuffled; with
    `world` > 1 every rank takes every world-th batch, all ranks the same number of them."""
    groups = length_groups(sequences, max_tokens, rng)
    groups = groups[: len(groups) // world * world][rank::world] if world > 1 else groups
    out = []
    for group in groups:
        items = [sequences[i] for i in group]
        batch = {k: _pad_stack([x[k] for x in items], False if k == "mask" else 0) for k in items[0]}
        batch["valid"] = _pad_stack([torch.ones(len(x["tokens"]), dtype=torch.bool) for x in items], False)
        out.append(batch)
    return out


class _StepCache:
    """The keys and values of the steps run so far, for the mid-layer's attention (it calls
    `update`): step j's queries attend over steps 0..j, concatenated along the sequence."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key, value: [B, kv_heads, T, d] -> all steps' [B, kv_heads, (j+1)T, d]."""
        self.keys.append(key)
        self.values.append(value)
        return torch.cat(self.keys, 2), torch.cat(self.values, 2)


def ttt_mask(t: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, T, (step+1)T] bool, True where a query of step `step` at position q sees a key: of step
    0, those at positions <= q (causal); of each later step, the one at q (its own path)."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal, *([eye] * step)], 1)[None, None]


def _shift(x: torch.Tensor, j: int, fill) -> torch.Tensor:
    """x: [B, T, ...] -> x moved j positions left along T, the last j filled with `fill`."""
    if j == 0:
        return x
    pad = torch.full((x.shape[0], j, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, j:], pad], 1)


class TrainingTimeTest(torch.nn.Module):
    """EAGLE-3's training-time test as one module (module docstring, 5): `forward(batch)` runs the
    `steps` unrolled drafting steps and returns (loss, per-step (right, counted) top-1 counts), so one
    DistributedDataParallel forward covers an optimisation step. `embed` and `head` (the target's
    embeddings and its output head's rows of the draft vocabulary) are frozen and not registered."""

    def __init__(self, drafter: Eagle3Drafter, embed: torch.nn.Module, head: OutputHead, t2d: torch.Tensor,
                 steps: int = 4, decay: float = 0.8):
        super().__init__()
        self.drafter = drafter
        self.frozen = (embed, head, t2d)
        self.steps, self.decay = steps, decay

    def unroll(self, batch: dict):
        """Yields, per step j, (the drafter's output [B, T, H], the loss positions as (rows, columns)
        [M] each, the target's distribution there [M, Vd]): at position t, step j reads token t+1+j
        and step j-1's output at t (step 0: the target's taps f_t)."""
        embed, head, t2d = self.frozen
        tokens, valid = batch["tokens"], batch["valid"]  # [B, T]
        b, t = tokens.shape
        with torch.no_grad():
            embeds = embed(tokens)  # [B, T, H]
            p = torch.softmax(head.logits(batch["teacher"].to(head.weight.dtype)).float(), -1)  # [B, T, Vd]
            keep = batch["mask"] & valid & t2d[batch["top1"]]  # [B, T]
        cache = _StepCache()
        hidden = batch["features"]
        for j in range(self.steps):
            positions = (torch.arange(t, device=tokens.device) + j)[None].expand(b, t)
            hidden = self.drafter(_shift(embeds, j, 0), hidden, positions, ttt_mask(t, j, tokens.device), cache)
            rows, cols = _shift(keep, j, False).nonzero(as_tuple=True)
            yield hidden, (rows, cols), p[rows, cols + j]

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        total, weights = 0.0, 0.0
        counts = torch.zeros(self.steps, 2)
        for j, (out, (rows, cols), q) in enumerate(self.unroll(batch)):
            if not len(rows):
                continue
            logits = self.drafter.logits(out[rows, cols])  # [M, Vd]
            loss = -(q * F.log_softmax(logits.float(), -1)).sum(-1).mean()
            total = total + self.decay ** j * loss
            weights += self.decay ** j
            with torch.no_grad():
                counts[j, 0] = float((logits.argmax(-1) == q.argmax(-1)).sum())
                counts[j, 1] = float(len(rows))
        if weights == 0:
            return sum(w.sum() * 0 for w in self.drafter.parameters()), counts
        return total / weights, counts


def train_eagle3(ttt: TrainingTimeTest, sequences: list[dict], epochs: int, lr: float, max_tokens: int,
                 seed: int = 0, progress: bool = True, autocast: str | None = None,
                 on_epoch: Callable[[int], None] | None = None) -> list[float]:
    """AdamW on the drafter (gradient norm clipped to 1); returns the loss of every step. Under
    torchrun (WORLD_SIZE > 1, a process group set up) the test runs wrapped in
    DistributedDataParallel and each rank takes its share of the batches."""
    rng = random.Random(seed)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    module: torch.nn.Module = ttt
    rank = 0
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank = dist.get_rank()
        module = torch.nn.parallel.DistributedDataParallel(ttt)
    return _optimise(ttt.drafter, [p for p in ttt.drafter.parameters() if p.requires_grad],
                     lambda: ttt_batches(sequences, max_tokens, rng, rank, world),
                     lambda batch: module(batch)[0], epochs, lr, "eagle3", progress, autocast, on_epoch, clip_norm=1.0)


@torch.inference_mode()
def ttt_accuracy(ttt: TrainingTimeTest, sequences: list[dict], max_tokens: int = 2048) -> dict:
    """Held-out top-1 agreement with the target per unrolled step (step j reads the drafter's own
    output of step j-1: a depth-(j+1) draft along a path whose earlier drafts were the target's)."""
    was = ttt.training
    ttt.eval()
    counts = torch.zeros(ttt.steps, 2)
    for batch in ttt_batches(sequences, max_tokens, random.Random(0)):
        counts += ttt(batch)[1]
    ttt.train(was)
    return {"top1_per_step": [round(float(r / max(n, 1)), 4) for r, n in counts.tolist()]}
