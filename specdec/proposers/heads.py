"""What trained drafting heads share: the target's output head (whole or a reduced vocabulary) and
one checkpoint format.

Medusa heads and the EAGLE-style drafter both end in the target's own frozen output head. On a CPU
that head dominates their cost (SmolLM2: a 49,152 x 576 matrix, several times a decoder layer's
weights; experiments/gpu/LOG.md, "Output heads"), so a checkpoint may carry `vocab_ids`, the most
frequent tokens of its training text (FR-Spec, Zhao et al. 2025): the head then computes only those
rows and can propose only those tokens. Verification is unchanged, so this costs acceptance, never
correctness.

A checkpoint is one safetensors file (`embedded`: the one shipped for the embedded target): the trained tensors, `vocab_ids` when reduced, and metadata
(`kind`, shapes, and the name and size of the target it was trained for), checked against the target
before anything runs, so a checkpoint for another target fails with a message and not with a shape
error deep in a matmul. Since heads trained for one model would still run on another of the same shape
(losslessly, at an acceptance near zero), a checkpoint also records a sample of the target's output-head
weights (`target_signature`), which must correlate with the target's own.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from specdec.core.decoder_stack import final_logits, logit_transform
from specdec.core.device import to_device
from specdec.core.errors import InvalidInput, MissingInput
from specdec.core.files import write_whole


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A weight as one tensor: a tensor-parallel target's (`target.tp_size`) is a DTensor split over the
    ranks, which the drafters' own matrix products cannot take; every rank gathers the same whole one."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class OutputHead:
    """The target's output head restricted to `vocab_ids` (all tokens when None), frozen.

    weight: [V', H] rows of the target's head (a view when the vocabulary is whole); bias: [V'] or
    None (Phi's, GPT-J's and CodeGen's heads have one); scale, cap: what the target's forward does to
    the head's output (`decoder_stack.logit_transform`: Cohere's scale, Gemma-2's soft cap), so that
    the logits, and the distributions drafts are sampled from and trained on, are the target's.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, vocab_ids: torch.Tensor | None = None,
                 scale: float = 1.0, cap: float | None = None):
        self.weight, self.bias, self.vocab_ids = weight, bias, vocab_ids
        self.scale, self.cap = scale, cap

    @classmethod
    def of(cls, target_model: torch.nn.Module, vocab_ids: torch.Tensor | None = None,
           dtype: torch.dtype | None = None) -> OutputHead:
        """`target_model`'s head, its rows `vocab_ids` (checked against the vocabulary), in `dtype`."""
        head = target_model.get_output_embeddings()
        weight = _whole(head.weight.detach())
        bias = _whole(head.bias.detach()) if getattr(head, "bias", None) is not None else None
        if vocab_ids is not None:
            if int(vocab_ids.max()) >= weight.shape[0]:
                raise InvalidInput(f"the checkpoint's vocabulary reaches token {int(vocab_ids.max())} but the "
                                 f"target has {weight.shape[0]}; it was trained for another target")
            vocab_ids = vocab_ids.to(weight.device)
            weight = weight[vocab_ids]
            bias = None if bias is None else bias[vocab_ids]
        if dtype is not None:
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        return cls(weight, bias, vocab_ids, *logit_transform(target_model))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] -> logits over the head's vocabulary [..., V'] (the kernel, linear or
        `hidden @ weight.T`, makes no difference to an EAGLE step: experiments/gpu/LOG.md,
        "Runs 11-14")."""
        return final_logits(torch.nn.functional.linear(hidden, self.weight, self.bias), self.scale, self.cap)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the head's vocabulary -> token ids of the target's."""
        return index if self.vocab_ids is None else self.vocab_ids[index]


def unseen_positions(seen: list[int], upto: list[int], device: torch.device) -> tuple[list[int], torch.Tensor]:
    """What a drafter over the target's hidden states catches up on: per row, how many positions its
    cache has not seen (`upto[b] - seen[b]`), and those positions `[B, max count]` (a shorter row's
    repeat its last, to be dropped)."""
    counts = [u - s for u, s in zip(upto, seen)]
    pos = to_device(seen, device)[:, None] + torch.arange(max(counts), device=device)
    return counts, torch.minimum(pos, to_device(upto, device)[:, None] - 1)


def frequent_tokens(sequences: list[torch.Tensor], n: int, vocab_size: int) -> torch.Tensor:
    """The `n` most frequent token ids of `sequences`, ascending ([n] long)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(seq, minlength=vocab_size)
    return torch.sort(torch.topk(counts, min(n, vocab_size)).indices).values


SIGNATURE_SIZE = 256  # output-head weights sampled by `target_signature`
MIN_SIGNATURE_CORRELATION = 0.5  # the same model in bfloat16 or 4-bit GGUF: ~0.99; another of its shape: ~0


def target_signature(target_model: torch.nn.Module) -> list[float]:
    """`SIGNATURE_SIZE` weights of the target's output head at positions fixed by its shape, as floats:
    what tells two models of one shape apart (other weights, another seed) while the same model in
    another dtype or quantisation keeps them, up to rounding."""
    weight = target_model.get_output_embeddings().weight.detach()
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(weight.shape[0], (SIGNATURE_SIZE,), generator=gen)
    cols = torch.randint(weight.shape[1], (SIGNATURE_SIZE,), generator=gen)
    return [round(float(x), 6) for x in weight[rows.to(weight.device), cols.to(weight.device)].float().cpu()]


def signature_correlation(recorded: list[float], target_model: torch.nn.Module) -> float:
    """Pearson correlation of a checkpoint's recorded signature with the target's (1: the same weights)."""
    a = torch.tensor(recorded, dtype=torch.float64)
    b = torch.tensor(target_signature(target_model), dtype=torch.float64)
    if a.shape != b.shape or a.std() == 0 or b.std() == 0:
        return 0.0
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def save_checkpoint(path: str | Path, kind: str, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write `tensors` and `meta` (JSON-able) as one safetensors file, via a temporary file renamed
    into place: an interrupted write never leaves a file cut short at `path`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, lambda tmp: save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
                                           metadata={"kind": kind, "meta": json.dumps(meta)}))
    return path


def resolve_heads_path(path: str | Path, kind: str) -> Path:
    """`embedded`: the checkpoint of `kind` shipped for the embedded SmolLM2-135M target (trained by
    scripts/train_heads.py; its command, data and seed in the .json beside it); else a file path."""
    if str(path) == "embedded":
        return Path(str(files("specdec") / "data" / "heads" / f"smollm2-135m-{kind}.safetensors"))
    return Path(path).expanduser()


def checkpoint_info(path: str | Path, kind: str) -> dict:
    """The metadata of the checkpoint of `kind` at `path` (its header only: cheap, loads no tensor);
    ValueError for a file that is not a safetensors checkpoint of that kind."""
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"method.heads_path={path} does not exist; train heads with "
                                f"scripts/train_heads.py kind={kind} (see experiments/trees)")
    try:
        with safe_open(str(path), "pt") as f:
            info = f.metadata() or {}
    except SafetensorError as err:
        raise InvalidInput(f"method.heads_path={path} is not a safetensors checkpoint ({err}): a file cut short "
                         f"or another format; use a checkpoint of scripts/train_heads.py kind={kind}") from None
    if info.get("kind") != kind:
        raise InvalidInput(f"method.heads_path={path} holds {info.get('kind') or 'no'} heads, not {kind}; "
                         f"use a checkpoint trained with method={kind}")
    return info


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a file `save_checkpoint` wrote, of any kind (its header alone is read)."""
    try:
        with safe_open(str(path), "pt") as f:
            return "kind" in (f.metadata() or {}) and "meta" in (f.metadata() or {})
    except (SafetensorError, OSError):
        return False


def load_checkpoint(path: str | Path, kind: str, target_model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a checkpoint written by `save_checkpoint`, refusing the wrong kind or another target."""
    path = resolve_heads_path(path, kind)
    info = checkpoint_info(path, kind)
    meta = json.loads(info.get("meta", "{}"))
    cfg = target_model.config.get_text_config(decoder=True)  # a multimodal wrapper: its language model's
    want = {"hidden_size": cfg.hidden_size, "vocab_size": target_model.get_output_embeddings().out_features}
    got = {k: meta.get(k) for k in want}
    if got != want:
        raise InvalidInput(f"method.heads_path={path} was trained for a target with {got} "
                         f"({meta.get('target', 'unknown')}), this target has {want}")
    if "target_signature" in meta:  # checkpoints written before it was recorded are checked by shape only
        r = signature_correlation(meta["target_signature"], target_model)
        if r < MIN_SIGNATURE_CORRELATION:
            raise InvalidInput(
                f"method.heads_path={path} was trained for another model of this target's shape "
                f"({meta.get('target', 'unknown')}): its output-head weights correlate {r:.2f} with this "
                f"target's (the same model in another dtype or quantisation: ~1); train heads for this target "
                f"with scripts/train_heads.py target.path=<this target>")
    return load_file(str(path)), meta
