"""A target sharded across processes with transformers' tensor parallelism, launched by `torchrun`.

Each process (rank) holds a slice of every attention and MLP layer of the target: its share of the
query, key and value heads, and of the MLP's columns. transformers all-reduces the partial outputs
inside each layer and gathers the logits, so every rank sees the same logits `[B, T, V]`. The engine
needs no change for it:

- a layer's keys and values reach the cache with the rank's own heads, `[B, H / tp, T, D]`, and
  `RowCache` sizes its buffers from the first write, so each rank's cache holds its heads only;
- `grouped_sdpa` reads the grouping from the tensors (local query heads over local key heads);
- the draft, the proposers, the verifier and the sampling run whole on every rank.

That last point is the trap: every rank must feed the target the same tokens, or their caches
drift apart and the collectives pair up passes of different requests. Nothing fails: the ranks hang,
or decode garbage (transformers issue 36634). Every rank agrees when it draws the same numbers from
the same logits, and it does here:

- the decoder seeds one generator per generation from the request's seed, the same on every rank;
  draft tokens, uniforms and residual samples all come from it;
- the logits are the same bits on every rank (the all-reduce sums the same partial results and hands
  every rank the same total), and so is everything computed from them.

What is not the same on every rank is time: a decision taken from measured costs (the cost-aware
schedule, the hybrid proposer) differs, so those are refused with tp (`specdec.study.config`).
`check_ranks_agree` and `guard_passes` turn a divergence into an error naming the first pass where
the ranks disagree, before a hang.

Everything here is also usable from Python, under `torchrun --nproc-per-node N your_script.py`:
`init(N, device)`, `load_sharded(folder, N, device, dtype)`, then an `Engine` as usual, and write
results from `is_main()` only.
"""

from __future__ import annotations

import atexit
import os

import torch

from specdec.core.errors import InvalidInput

# What torchrun sets in every process it starts (`torch.distributed.run`).
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RanksDivergedError(RuntimeError):
    """The ranks of a tensor-parallel target fed it different tokens: their outputs are not one run's."""


def launched_by_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets its variables)."""
    return all(v in os.environ for v in TORCHRUN_VARIABLES)


def world_size() -> int:
    """Processes in this job: the process group's size, else torchrun's WORLD_SIZE, else 1."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def rank() -> int:
    """This process's rank: the process group's, else torchrun's RANK, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", 0))


def is_main() -> bool:
    """Whether this process writes results, logs to trackers and prints: rank 0 (or no torchrun at all)."""
    return rank() == 0


def check_launch(tp_size: int, key: str = "tp_size") -> None:
    """Raise InvalidInput unless this process can run a target over `tp_size` ranks: launched by
    torchrun with exactly `tp_size` processes (the target is the only thing sharded: one job, one
    request stream). `key` names the setting in the message."""
    if tp_size == 1:
        return
    command = f"torchrun --nproc-per-node {tp_size} -m specdec {key}={tp_size} ..."
    if not launched_by_torchrun():
        missing = ", ".join(v for v in TORCHRUN_VARIABLES if v not in os.environ)
        raise InvalidInput(f"{key}={tp_size} shards the target across {tp_size} processes, which torchrun starts; "
                           f"this process was not started by torchrun ({missing} not set). Launch it as "
                           f"`{command}`, or set {key}=1.")
    if world_size() != tp_size:
        raise InvalidInput(f"{key}={tp_size} but torchrun started {world_size()} processes (WORLD_SIZE); each "
                           f"process holds one shard, so they must be equal: launch `{command}`.")


def check_heads(config, tp_size: int, name: str = "target", key: str = "tp_size") -> None:
    """Raise InvalidInput unless `tp_size` divides the model's query and key-value heads: each rank
    computes whole heads (a text config, or a model's config whose text config is read)."""
    if tp_size == 1:
        return
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads is None:
        raise InvalidInput(f"{key}={tp_size}: the {name}'s config names no num_attention_heads, so it cannot be "
                           f"split by heads; set {key}=1.")
    for what, count in (("attention heads", heads), ("key-value heads", kv_heads)):
        if count % tp_size:
            divisors = [d for d in range(1, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0]
            raise InvalidInput(f"{key}={tp_size} does not divide the {name}'s {count} {what} ({heads} attention, "
                               f"{kv_heads} key-value): each rank computes whole heads. Pick {key} among "
                               f"{', '.join(map(str, divisors))}.")


def device_of_rank(device: str | torch.device) -> torch.device:
    """The device this rank runs on: the CPU, or the GPU of its local rank (`cuda`, `auto` on a GPU
    machine). A fixed `cuda:N` would put every rank on one GPU, so it is refused."""
    device = str(device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    raise InvalidInput(f"device={device} with a tensor-parallel target: every rank would use that one device; "
                       "use device=cuda (each rank takes the GPU of its LOCAL_RANK), auto or cpu.")


def init(tp_size: int, device: str | torch.device) -> torch.device:
    """Join the job's process group (gloo on a CPU, NCCL on GPUs, with gloo beside it for host
    tensors) and return this rank's device. Idempotent; the group is destroyed at exit."""
    check_launch(tp_size)
    device = device_of_rank(device)
    dist = torch.distributed
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=device)
        else:
            dist.init_process_group(backend="gloo")
        atexit.register(_shutdown)
    return device


def _shutdown() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def load_sharded(source: str, tp_size: int, device: str | torch.device, dtype: torch.dtype):
    """(model, tokenizer) of `source`, a folder written by `save_pretrained` (or a hub id in the local
    cache), with this rank's shard of the target: transformers' `tp_plan="auto"` over `tp_size` ranks.
    The model is in eval mode without grads, in `dtype` on this rank's device, with SDPA attention;
    its heads are checked first. Call `init` before."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_heads(AutoConfig.from_pretrained(source), tp_size)
    device = device_of_rank(device)
    kwargs = {"dtype": dtype, "attn_implementation": "sdpa", "use_kernels": False}
    try:
        from transformers import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=tp_size)
    except ImportError:  # releases before DistributedConfig take the plan directly
        kwargs |= {"tp_plan": "auto", "tp_size": tp_size}
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs).eval().requires_grad_(False)
    if next(model.parameters()).device != device:
        model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def local_heads(model: torch.nn.Module) -> tuple[int, int]:
    """(query heads, key-value heads) this rank computes per layer: the whole model's divided by the
    ranks its plan shards them over (1 when the model is not sharded)."""
    text = model.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    shards = getattr(model, "tp_size", None) or 1
    return heads // shards, kv_heads // shards


def fingerprint(tokens: torch.Tensor) -> torch.Tensor:
    """Five int64 numbers that tell token tensors `[B, T]` apart: the shape, a sum weighted by
    position (a moved token changes it), and a sum of squares."""
    flat = tokens.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64)
    shape = list(tokens.shape) + [1] * (2 - tokens.dim())
    sums = torch.stack([(flat * weights).sum(), (flat * flat).sum(), flat.sum()])
    return torch.cat([torch.tensor(shape[:2], dtype=torch.int64, device=flat.device), sums])


def check_ranks_agree(tokens: torch.Tensor, what: str) -> None:
    """Raise RanksDivergedError on every rank unless every rank holds the same `tokens: [B, T]`
    (`what` says which, for the message). A no-op without a process group. One small all-gather and
    one host read: every rank reads the same gathered values, so all raise together, none hangs."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = fingerprint(tokens).cpu()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)  # the default group: gloo, which moves host tensors
    differ = [r for r, other in enumerate(gathered) if not torch.equal(other, gathered[0])]
    if differ:
        raise RanksDivergedError(
            f"{what}: rank {differ[0]} holds other tokens than rank 0 (shape and sums "
            f"{gathered[differ[0]].tolist()} vs {gathered[0].tolist()}). Every rank must draw the same drafts "
            "and samples: use the same seed on every rank, and no decision taken from measured time (the "
            "cost-aware schedule, the hybrid proposer)."
        )


def guard_passes(model: torch.nn.Module, name: str = "target"):
    """Check before every forward pass of `model` that every rank feeds it the same tokens and
    positions (`check_ranks_agree`); returns the hook's handle (`.remove()` ends the checks). The
    first pass where the ranks disagree raises, instead of a later collective that hangs."""
    passes = [0]

    def check(module, args, kwargs):
        passes[0] += 1
        fed = [t for t in (kwargs.get("input_ids", args[0] if args else None), kwargs.get("position_ids"))
               if t is not None]
        if fed:
            check_ranks_agree(torch.cat([t.reshape(1, -1) for t in fed], dim=1),
                              f"{name} pass {passes[0]}: the tokens and positions fed")

    return model.register_forward_pre_hook(check, with_kwargs=True)
