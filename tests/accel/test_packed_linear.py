"""packed_linear: a model's float32 and bfloat16 CPU linear layers through oneDNN's packed weights
inside `PackedLinears` (`specdec.accel.packed_linear`). The packed product matches `nn.Linear` to float32
rounding (bit for bit in bfloat16) and a row's result does not depend on the rows fed with it; one
float32 row, autograd and anything outside the context run `nn.Linear` itself; holders are counted; a
changed weight is repacked; `auto` resolves on only for eager float32 and (with bfloat16 units)
bfloat16 CPU engines; and greedy tokens through an Engine are the same with the layers packed and
unpacked (plain decoding, a draft model, layer skipping, ragged batches).
"""

import copy

import pytest
import torch

import specdec.accel.packed_linear as packed_linear
from specdec.accel.packed_linear import PACKED_LINEAR_MODES, PackedLinears, available, resolve_packed_linear
from specdec.accel.passes import Accelerated
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.models import tiny_random_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.layer_skip import LayerSkipProposer
from tests.conftest import RAGGED_PROMPTS, load_script

needs_kernel = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN packed linear kernels")
BF16_UNITS = available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_bf16_units = pytest.mark.skipif(not BF16_UNITS, reason="this CPU has no bfloat16 units for oneDNN's kernels")

CPU = torch.device("cpu")
RTOL = 1e-5  # of the output's largest magnitude: float32 rounding, far below any real difference


def _model(seed: int = 0) -> torch.nn.Module:
    """Two linear layers the kernel blocks as it blocks a real model's (widths not a multiple of its
    tiles), one with a bias and one without, and a tiny Llama's layers beside them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.ModuleDict({
            "wide": torch.nn.Linear(576, 1539),
            "nobias": torch.nn.Linear(96, 40, bias=False),
            "llama": tiny_random_model(seed=seed, eos_token_id=None),
        }).eval()


def _layers(model) -> dict[str, torch.nn.Linear]:
    llama = model["llama"]
    return {"wide": model["wide"], "nobias": model["nobias"], "q_proj": llama.model.layers[0].self_attn.q_proj,
            "down_proj": llama.model.layers[1].mlp.down_proj, "lm_head": llama.lm_head}


def _rows(layer: torch.nn.Linear, n: int, seed: int = 0) -> torch.Tensor:  # -> [n, in]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, layer.in_features, generator=g)


def _linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """What `nn.Linear` computes, whatever the layer's forward is now."""
    return torch.nn.Linear.forward(layer, x)


def _swapped(layer: torch.nn.Module) -> bool:
    return "forward" in layer.__dict__ or hasattr(layer, "_specdec_packed")


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> bool:
    return bool((a - b).abs().max() <= rtol * b.abs().max())


@needs_kernel
@torch.inference_mode()
def test_packed_rows_match_nn_linear_and_do_not_depend_on_their_companions():
    model = _model()
    with PackedLinears(model):
        for name, layer in _layers(model).items():
            assert _swapped(layer), name
            x = _rows(layer, 24)
            full = layer(x)
            assert _close(full, _linear(layer, x)), name
            for n in range(2, 24):  # a row's bits whatever else is fed with it (the module docstring's claim)
                assert torch.equal(layer(x[:n]), full[:n]), f"{name}: {n} rows"
                assert torch.equal(layer(x[24 - n:]), full[24 - n:]), f"{name}: the last {n} rows"
            # batch x tokens, as a model feeds it: the same rows, the same bits
            assert torch.equal(layer(x.view(4, 6, -1)), full.view(4, 6, -1)), name
            # the packed product of one row alone (the layer sends one row to MKL: below) is that row's too
            one = torch.ops.mkldnn._linear_pointwise(x[5:6], layer._specdec_packed, layer.bias, "none", [], "")
            assert torch.equal(one, full[5:6]), name


@needs_kernel
@torch.inference_mode()
def test_one_row_runs_nn_linear_itself():
    """Plain decoding at batch 1 feeds one row: MKL's matrix-vector product, bit for bit as unpacked."""
    model = _model()
    with PackedLinears(model):
        for name, layer in _layers(model).items():
            x = _rows(layer, 1)
            for shape in ((1, -1), (-1,), (1, 1, -1)):
                assert torch.equal(layer(x.view(shape)), _linear(layer, x.view(shape))), f"{name} {shape}"


@needs_bf16_units
@torch.inference_mode()
def test_bfloat16_rows_run_packed_and_equal_nn_linear_bit_for_bit():
    """In bfloat16 every width runs packed, one row included, and computes exactly what the unpacked
    layer does: switching packing on changes no token of a bfloat16 run."""
    model = _model().to(torch.bfloat16)
    with PackedLinears(model):
        for name, layer in _layers(model).items():
            assert _swapped(layer), name
            x = _rows(layer, 12).to(torch.bfloat16)
            packed = torch.ops.mkldnn._linear_pointwise(x, layer._specdec_packed, layer.bias, "none", [], "")
            assert torch.equal(layer(x), packed), name  # the layer took the packed path
            for n in (1, 2, 5, 12):
                assert torch.equal(layer(x[:n]), _linear(layer, x[:n])), f"{name}: {n} rows"
                assert torch.equal(layer(x[:n]), packed[:n]), f"{name}: {n} rows alone"
            assert torch.equal(layer(x[:1].view(-1)), _linear(layer, x[:1].view(-1))), name
            with pytest.raises(RuntimeError, match="same dtype"):  # another dtype: nn.Linear's own forward, which refuses
                layer(x.float())
    assert not any(_swapped(m) for m in model.modules())


@needs_kernel
@torch.inference_mode()
def test_leaving_restores_the_layers_and_holders_are_counted():
    model = _model()
    layers = _layers(model)
    view = torch.nn.ModuleList([model["llama"].model.layers[0]])  # another model over shared layers (layer skipping)
    q, wide = layers["q_proj"], layers["wide"]
    x = _rows(wide, 5)
    unpacked = _linear(wide, x)
    outer, inner, other = PackedLinears(model), PackedLinears(model), PackedLinears(view)
    with outer:
        with inner, other:
            assert all(_swapped(layer) for layer in layers.values())
        assert all(_swapped(layer) for layer in layers.values()), "a layer went back under a holder still inside"
        # the packed product: its last bits differ from MKL's at this width (at 64 they may not)
        assert _close(wide(x), unpacked) and not torch.equal(wide(x), unpacked)
        with other:  # the view alone: its layers counted again, the model's stay as they are
            pass
        assert _swapped(q)
    for name, layer in layers.items():  # all back: nn.Linear's forward, bit for bit
        assert not _swapped(layer), name
        rows = _rows(layer, 5)
        assert torch.equal(layer(rows), _linear(layer, rows)), name
    assert torch.equal(wide(x), unpacked)
    assert not packed_linear._HELD
    with other:  # the view's holder alone swaps only the view's layers
        assert _swapped(q) and not _swapped(layers["lm_head"]) and not _swapped(layers["wide"])
    assert not _swapped(q) and not packed_linear._HELD
    with outer:  # a holder enters again after leaving
        assert _swapped(q)
    assert not _swapped(q)


@needs_kernel
@torch.inference_mode()
def test_a_failed_entry_gives_back_what_it_took(monkeypatch):
    model = _model()
    packed = packed_linear._packed
    calls = []

    def fail_third(module):
        calls.append(module)
        if len(calls) == 3:
            raise MemoryError("no room for another pack")
        return packed(module)

    monkeypatch.setattr(packed_linear, "_packed", fail_third)
    with pytest.raises(MemoryError):
        with PackedLinears(model):
            pass
    assert not any(_swapped(layer) for layer in model.modules()) and not packed_linear._HELD


@needs_kernel
@torch.inference_mode()
def test_layers_not_nn_linears_own_forward_are_left_alone():
    class Scaled(torch.nn.Linear):  # a LoRA-like subclass: its forward is not nn.Linear's
        def forward(self, x):
            return 2 * super().forward(x)

    hooked = torch.nn.Linear(8, 8)
    hooked.forward = lambda x: torch.nn.Linear.forward(hooked, x) + 1  # as accelerate's hooks replace it
    model = torch.nn.ModuleDict({"scaled": Scaled(8, 8), "hooked": hooked, "f16": torch.nn.Linear(8, 8).half()})
    x = torch.randn(3, 8)
    with PackedLinears(model):
        assert not hasattr(model["scaled"], "_specdec_packed") and "forward" not in model["scaled"].__dict__
        assert not hasattr(hooked, "_specdec_packed") and not hasattr(model["f16"], "_specdec_packed")
        assert torch.equal(model["scaled"](x), 2 * _linear(model["scaled"], x))
        assert torch.equal(hooked(x), _linear(hooked, x) + 1)
    assert "forward" in hooked.__dict__  # someone else's forward stays


@needs_kernel
def test_a_changed_weight_is_repacked_on_the_next_entry():
    model = _model()
    layer = _layers(model)["wide"]
    x = _rows(layer, 6)
    with torch.inference_mode(), PackedLinears(model):
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: the same tensor, its version counter bumped
    with torch.inference_mode(), PackedLinears(model):
        assert _close(layer(x) - layer.bias, 2 * (before - layer.bias))
        assert _close(layer(x), _linear(layer, x))
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))  # another tensor
    with torch.inference_mode(), PackedLinears(model):
        assert _close(layer(x), _linear(layer, x))
    # New memory under the same tensor, same version, often at the address just freed
    # (`nn.Module.to` sets `.data`): the values rounded to bfloat16 must be the ones run.
    for _ in range(5):
        with torch.inference_mode(), PackedLinears(model):
            layer(x)
        version = layer.weight._version
        layer.to(torch.bfloat16).to(torch.float32)
        assert layer.weight._version == version
        with torch.inference_mode(), PackedLinears(model):
            assert _close(layer(x), _linear(layer, x))
        with torch.no_grad():
            layer.weight.add_(torch.randn_like(layer.weight) * 1e-3)  # values bfloat16 does not hold


@needs_kernel
def test_autograd_runs_nn_linear():
    """Training (grad recorded): nn.Linear's own forward, bit for bit, and gradients that flow."""
    model = _model()
    layer = _layers(model)["wide"]
    x = _rows(layer, 7).requires_grad_()
    with PackedLinears(model):
        y = layer(x)
        assert y.grad_fn is not None and torch.equal(y, _linear(layer, x))
        y.sum().backward()
    assert layer.weight.grad is not None and x.grad is not None
    with torch.no_grad(), PackedLinears(model):  # no autograd: packed
        assert not torch.equal(layer(x), _linear(layer, x)) and _close(layer(x), _linear(layer, x))


def test_resolve_packed_linear(monkeypatch):
    f32, bf16 = torch.float32, torch.bfloat16
    assert PACKED_LINEAR_MODES == ("auto", "on", "off")
    assert resolve_packed_linear("auto", CPU, f32, compiled=False) is available()
    assert resolve_packed_linear("auto", CPU, bf16, compiled=False) is BF16_UNITS
    for mode in ("auto", "off", False):
        assert resolve_packed_linear(mode, CPU, bf16, compiled=True) is False
        assert resolve_packed_linear(mode, CPU, f32, compiled=True) is False
        assert resolve_packed_linear(mode, torch.device("cuda"), f32, compiled=False) is False
        assert resolve_packed_linear(mode, CPU, torch.float16, compiled=False) is False
    assert resolve_packed_linear("off", CPU, f32, compiled=False) is False
    for device, dtype, compiled, why in [(CPU, torch.float16, False, "float16"), (CPU, f32, True, "compile=off"),
                                         (torch.device("cuda"), f32, False, "cuda")]:
        for mode in ("on", True):
            with pytest.raises(ValueError, match=f"packed_linear=on cannot apply: .*{why}"):
                resolve_packed_linear(mode, device, dtype, compiled)
    for bad in ("always", "ON", "", None, 1):
        with pytest.raises(ValueError, match="is not one of: auto, on, off"):
            resolve_packed_linear(bad, CPU, f32, compiled=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # AVX2: bfloat16 emulated
    assert resolve_packed_linear("auto", CPU, bf16, compiled=False) is False
    assert resolve_packed_linear("auto", CPU, f32, compiled=False) is available()
    with pytest.raises(ValueError, match="no bfloat16 units"):
        resolve_packed_linear("on", CPU, bf16, compiled=False)
    monkeypatch.setattr(packed_linear, "available", lambda: False)  # a torch without oneDNN
    assert resolve_packed_linear("auto", CPU, f32, compiled=False) is False
    with pytest.raises(ValueError, match="no oneDNN"):
        resolve_packed_linear("on", CPU, f32, compiled=False)


@needs_kernel
def test_resolve_on_engine_and_on_refused_before_models_move():
    model = tiny_random_model(seed=3, eos_token_id=None)
    assert Engine(model, dtype="float32").passes is None  # the core's engine: eager, nothing packed
    assert Engine(model, dtype="float32", passes=Accelerated()).passes.packed_linear is True  # auto, compile=off
    assert Engine(model, dtype="float32", passes=Accelerated(packed_linear="on")).passes.packed_linear is True
    assert Engine(model, dtype="float32", passes=Accelerated(packed_linear="off")).passes.packed_linear is False
    assert Engine(model, dtype="float32", passes=Accelerated(compile="on")).passes.packed_linear is False
    other = tiny_random_model(seed=4, eos_token_id=None)
    with pytest.raises(ValueError, match="packed_linear=on cannot apply"):
        Engine(other, dtype="float16", passes=Accelerated(packed_linear="on"))
    assert next(other.parameters()).dtype == torch.float32  # refused before converting the model
    with pytest.raises(ValueError, match="packed_linear=on cannot apply"):
        Engine(other, dtype="float32", passes=Accelerated(compile="on", packed_linear="on"))


def _counting(monkeypatch) -> list[int]:
    """Rows of each layer call that ran packed, from here on."""
    rows: list[int] = []
    forward = packed_linear._packed_forward

    def counted(self, x):
        if x.numel() != x.shape[-1] and not torch.is_grad_enabled():
            rows.append(x.numel() // x.shape[-1])
        return forward(self, x)

    monkeypatch.setattr(packed_linear, "_packed_forward", counted)
    return rows


def _decode(engine, method: str, k: int, prompts, exact_greedy: bool):
    proposer = {"plain": None, "draft": lambda: DraftModelProposer(engine),
                "layer_skip": lambda: LayerSkipProposer(engine, exit_layer=1)}[method]
    decoder = SpeculativeDecoder(engine, proposer and proposer(), num_speculative_tokens=k, exact_greedy=exact_greedy)
    return decoder.generate(prompts, max_new_tokens=20)


@needs_kernel
@pytest.mark.parametrize("method, k", [("plain", 0), ("draft", 4), ("layer_skip", 3)])
@pytest.mark.parametrize("batch", ["single", "ragged"])
@pytest.mark.parametrize("exact_greedy", [True, False])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16_units)])
def test_greedy_tokens_equal_packed_and_unpacked(target, unrelated_draft, monkeypatch, method, k, batch, exact_greedy,
                                                 dtype):
    """Lossless: the same greedy tokens with the layers packed as with nn.Linear, and speculative
    output equal to plain decoding's with them packed (in bfloat16 too, where one row runs packed)."""
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS
    draft = unrelated_draft if method == "draft" else None
    if dtype != "float32":  # the shared fixtures stay float32 for the other tests' engines
        target, draft = copy.deepcopy(target), copy.deepcopy(draft)
    rows = _counting(monkeypatch)
    unpacked = _decode(Engine(target, draft, dtype=dtype, passes=Accelerated(packed_linear="off")), method, k, prompts, exact_greedy)
    assert not rows
    engine = Engine(target, draft, dtype=dtype, passes=Accelerated(packed_linear="on"))
    packed = _decode(engine, method, k, prompts, exact_greedy)
    assert packed.output_ids == unpacked.output_ids
    assert all(len(o) == 20 for o in packed.output_ids)
    assert rows and max(rows) > 1, "nothing ran packed"
    if method != "plain" and (dtype == "float32" or exact_greedy):  # bfloat16's widths round apart without exact greedy
        plain = _decode(engine, "plain", 0, prompts, exact_greedy)
        assert packed.output_ids == plain.output_ids
    assert not any(_swapped(m) or id(m) in packed_linear._HELD for m in target.modules())  # restored after


@needs_kernel
def test_the_layer_cost_study_runs_both_paths(tmp_path):
    """experiments/gpu/packed_linear.py, the measurement behind `packed_linear=auto`, on a tiny model:
    every row count timed through both paths (no timing is asserted)."""
    study = load_script("packed_linear", "experiments/gpu")
    out = study.main(["--model", "tiny_random", "--rows", "1,3", "--repeats", "1", "--out", str(tmp_path / "r.json")])
    assert set(out["ms"]) == {"mkl", "packed"} and all(set(v) == {1, 3} for v in out["ms"].values())
    assert all(ms > 0 for v in out["ms"].values() for ms in v.values()) and out["layers"] > 0
