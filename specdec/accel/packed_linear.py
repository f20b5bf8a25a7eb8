"""A model's linear layers through oneDNN's packed kernels on a CPU (`packed_linear=`).

Eagerly, `nn.Linear` on a CPU calls MKL in float32 and oneDNN on an unpacked weight in bfloat16.
In float32 one row is a matrix-vector product that streams the weight at the memory's pace, but two
or more rows take a matrix-matrix path that streams it far slower. In bfloat16 every call reorders
the weight for the kernel first. oneDNN's kernels on a weight packed once do neither
(`experiments/gpu/packed_linear.py` times every linear layer of the embedded SmolLM2 both ways;
experiments/gpu/LOG.md, "This CPU in float32: packed linear layers"; experiments/peers/LOG.md for
bfloat16). A speculative step scores T = k + 1 tokens, so its verification costs what the second
path costs: packing makes width cheaper, which is what speculation needs of the target pass; in
bfloat16 it also makes plain decoding's one row about twice as fast.

`PackedLinears(model)` is a context in which every float32 or bfloat16 `nn.Linear` of `model` on the
CPU calls `torch.ops.mkldnn._linear_pointwise` on a packed copy of its weight instead (another copy
of the weights in memory). In float32, one row keeps MKL's matrix-vector product, the path that
streams the weight fastest, so plain decoding at batch 1 computes exactly what it did. In bfloat16
every width runs packed: the packed product equals the unpacked one bit for bit (both are oneDNN's
kernels; tested), so no token changes.
Packs are made on the first entry and remade where a weight changed since: another tensor, the same
one written in place (its version counter), or new memory under the same tensor (`.data =`, as
`model.to(bfloat16).to(float32)` does, often at the freed address and with the same version: the
old memory's liveness tells them apart), so a reloaded or edited model never runs stale weights.
Outside the context, and wherever autograd records (training), the layers run as they are; a
subclass of `nn.Linear` with a forward of its own (a LoRA or quantized layer) is left alone. The
swap is counted like the attention swap (`attention._Swap`): engines in other threads may share the
model, and a layer goes back when its last holder leaves.

A row's result through the packed product does not depend on how many rows are fed with it (tested);
in float32 it differs from MKL's in the last bits, as MKL's one-row and many-row paths differ from
each other.
"""

from __future__ import annotations

import threading
import types
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from specdec.core.engine import cpu_has_bfloat16_units
from specdec.core.errors import InvalidInput

PACKED_LINEAR_MODES = ("auto", "on", "off")
PACKED_DTYPES = (torch.float32, torch.bfloat16)

_LOCK = threading.Lock()
_HELD: dict[int, int] = {}  # id(nn.Linear) -> holders of its swap
# nn.Linear -> (weight key, packed weight); weak, so a dropped model's packs go with it
_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def available() -> bool:
    """Whether this torch has oneDNN's packed linear kernels (x86 builds with mkldnn)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def resolve_packed_linear(mode: str | bool, device: torch.device, dtype: torch.dtype, compiled: bool) -> bool:
    """Whether an engine's models run their linear layers packed. `auto`: on a CPU in float32, or in
    bfloat16 where the CPU has bfloat16 units, when passes run eagerly (compiled graphs pack their
    weights themselves, at freezing), where it serves rows faster (module docstring); `on` insists,
    and says why where it cannot apply; `off` keeps `nn.Linear` as it is."""
    if mode is True:
        mode = "on"
    if mode is False:
        mode = "off"
    if mode not in PACKED_LINEAR_MODES:
        raise ValueError(f"packed_linear={mode!r} is not one of: {', '.join(PACKED_LINEAR_MODES)}")
    if mode == "off":
        return False
    why_not = None
    if device.type != "cpu":
        why_not = f"it is a CPU kernel and this engine runs on {device}"
    elif dtype not in PACKED_DTYPES:
        why_not = f"it packs float32 and bfloat16 weights and this engine runs {str(dtype).removeprefix('torch.')}"
    elif dtype == torch.bfloat16 and not cpu_has_bfloat16_units():
        why_not = "this CPU has no bfloat16 units (AVX512-BF16 or AMX) for oneDNN's bfloat16 kernels"
    elif compiled:
        why_not = "compiled passes pack their own weights (inductor's freezing); use compile=off"
    elif not available():
        why_not = "this torch build has no oneDNN (mkldnn) linear kernels"
    if why_not is not None and mode == "on":  # InvalidInput: a ValueError the command line reports in one line
        raise InvalidInput(f"packed_linear=on cannot apply: {why_not}. Use packed_linear=auto or off.")
    return why_not is None


def _weight_key(weight: torch.Tensor) -> tuple | None:
    """What identifies a weight's values; None for a tensor made under inference mode, which keeps
    no version counter: its pack is remade on every first entry. The address and version alone do
    not: memory set under the same tensor (`.data =`) keeps its version and may land on the address
    just freed, so the key holds a weak reference to the memory, and an expired one never matches."""
    if weight.is_inference():
        return None
    return StorageWeakRef(weight.untyped_storage()), weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype


def _same_weight(key: tuple | None, held: tuple | None) -> bool:
    """Whether a pack made under key `held` still holds the values of the weight keyed `key`: its
    memory still alive (then nothing else sits at its address) and all else equal."""
    if key is None or held is None or held[0].expired():
        return False
    return held[0].cdata == key[0].cdata and held[1:] == key[1:]


def _packable(module: torch.nn.Module) -> bool:
    """A float32 or bfloat16 CPU `nn.Linear` that computes what `nn.Linear.forward` does: a subclass
    with its own forward (LoRA, quantized layers) would lose it to the packed product."""
    w = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward
            and isinstance(w, torch.Tensor) and w.dtype in PACKED_DTYPES and w.device.type == "cpu"
            and w.dim() == 2 and not w.is_mkldnn)


def _packed(module: torch.nn.Linear) -> torch.Tensor:
    """The packed copy of `module.weight`, made (or remade, after a change) here."""
    key = _weight_key(module.weight)
    held = _PACKS.get(module)
    if held is None or not _same_weight(key, held[0]):
        with torch.no_grad():
            held = (key, torch.ops.mkldnn._reorder_linear_weight(module.weight.detach()))
        _PACKS[module] = held
    return held[1]


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward` through the packed weight: `x: [..., in]` -> `[..., out]`. Where autograd
    records, or an input not of the weight's dtype on the CPU: the layer's own forward. One float32
    row (plain decoding at batch 1) too: MKL's matrix-vector product, which one row gets no faster
    than; one bfloat16 row runs packed (module docstring)."""
    w = self.weight
    if (torch.is_grad_enabled() or x.dtype != w.dtype or x.device.type != "cpu"
            or (x.numel() == x.shape[-1] and w.dtype == torch.float32)):
        return torch.nn.Linear.forward(self, x)
    return torch.ops.mkldnn._linear_pointwise(x, self._specdec_packed, self.bias, "none", [], "")


class PackedLinears:
    """The swap of `model`'s float32 and bfloat16 CPU linear layers to packed ones, for as long as it is held.
    Counted per layer, not per model: a view of another model's layers (layer skipping's draft)
    shares them, and a layer goes back when its last holder leaves. A layer whose `forward` another
    library has replaced (accelerate's hooks) is left alone."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._held: list[torch.nn.Linear] = []

    def __enter__(self):
        with _LOCK:
            try:
                for module in self.model.modules():
                    if not _packable(module):
                        continue
                    if id(module) not in _HELD:
                        if "forward" in module.__dict__:
                            continue
                        module._specdec_packed = _packed(module)
                        module.forward = types.MethodType(_packed_forward, module)
                    _HELD[id(module)] = _HELD.get(id(module), 0) + 1
                    self._held.append(module)
            except BaseException:
                # A context whose entry fails is never left (`with`, ExitStack): give back what it took,
                # or those layers would stay swapped, and counted, for good.
                self._release()
                raise
        return self

    def __exit__(self, *exc):
        with _LOCK:
            self._release()

    def _release(self) -> None:
        """Drop this holder's count on each layer it holds; the last holder restores the layer. Under _LOCK."""
        for module in self._held:
            _HELD[id(module)] -= 1
            if _HELD[id(module)] == 0:
                del _HELD[id(module)], module.forward, module._specdec_packed
        self._held = []
