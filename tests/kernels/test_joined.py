"""Siblings multiplied in one call (kernels/linear.py's joint_product, the Llama's JOINED groups) and
kept together (load/joined.py), for every block kind: each output the bits of its module's own
product, the modules' buffers views of the joint ones, and never a second copy of weights."""

import numpy as np
import pytest
import torch

from ladechat.engine.kernels import int4, linear, q4
from ladechat.engine.load import joined
from ladechat.engine.load.gguf import quantized
from ladechat.engine.models import llama

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(not int4.supported(torch.device("cpu")),
                                reason="the block kernels are built with x86-64 vector instructions")

KINDS = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F16", "BF16"]
# where each block type holds its fp16 scales (made finite and small here; every other byte random)
HALVES = {"Q4_0": (0, 1), "Q5_0": (0, 1), "Q8_0": (0, 1), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
          "Q5_K": (0, 2), "Q6_K": (104, 1)}
COLS = 256
ATTENTION = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64}


def blocks(kind: str, rows: int, seed: int) -> np.ndarray:
    """A GGUF tensor's data of `kind`, rows x COLS weights, random but finite."""
    rng = np.random.default_rng(seed)
    if kind in ("F16", "BF16"):
        weights = torch.from_numpy(rng.standard_normal((rows, COLS)).astype(np.float32) * 0.05)
        return weights.to(torch.float16 if kind == "F16" else torch.bfloat16).view(torch.uint8).numpy()
    block, size = gguf.GGML_QUANT_SIZES[T[kind]]
    data = rng.integers(0, 256, (rows, COLS // block, size), dtype=np.uint8)
    at, count = HALVES[kind]
    scales = (rng.standard_normal((rows, COLS // block, count)) * 0.01).astype(np.float16)
    data.view(np.float16)[..., at : at + count] = scales
    return data.reshape(rows, -1)


def attention_of(kinds: dict[str, str], bias: bool = False, seed: int = 0):
    """(a module tree with self_attn.{q,k,v,o}_proj as nn.Linear, their buffers in the kernels'
    layouts as a kept file holds them before joining, {module: kind})."""
    torch.manual_seed(seed)
    tree = torch.nn.Module()
    tree.self_attn = torch.nn.Module()
    arrays, names = {}, {}
    for i, (name, rows) in enumerate(ATTENTION.items()):
        setattr(tree.self_attn, name, torch.nn.Linear(COLS, rows, bias=bias))
        kind = kinds.get(name, kinds["q_proj"])
        order = np.arange(rows)
        buffers = quantized.kernel_form(kind, blocks(kind, rows, seed + i), rows, COLS, lambda order=order: order)
        arrays.update({f"self_attn.{name}.{buffer}": value for buffer, value in buffers.items()})
        names[f"self_attn.{name}"] = kind
    return tree, arrays, names


def placed(tree, arrays, names) -> dict[str, torch.nn.Module]:
    quantized.replace_linears(tree, joined.KeptReader(arrays.__getitem__, arrays, tree), names, [], q4.best_path(), [])
    return {name: tree.get_submodule(f"self_attn.{name}") for name in ATTENTION}


def assert_outputs_are_each_modules_own(product, apart: list, rows=(1, 3, 7)):
    for count in rows:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(count, COLS).to(dtype)
            want = torch.cat([module.product(dtype)(x) for module in apart], dim=1)
            assert torch.equal(product(x), want), (count, dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_siblings_of_every_kind_are_kept_together_and_multiplied_in_one_call(kernel, kind, bias):
    tree, arrays, names = attention_of({"q_proj": kind}, bias)
    alone = placed(*attention_of({"q_proj": kind}, bias))
    kept = joined.join_in_place(dict(arrays))
    assert not any(key.startswith(("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")) for key in kept)
    assert any(key.startswith("self_attn.q_proj+k_proj+v_proj.") for key in kept)
    assert any(key.startswith("self_attn.o_proj.") for key in kept)  # o_proj takes another input
    modules = placed(tree, kept, names)
    siblings = [modules[name] for name in ("q_proj", "k_proj", "v_proj")]
    storages = {buffer.untyped_storage().data_ptr() for m in siblings for buffer in m.buffers()}
    q_k_v, qkv = llama._siblings(siblings, torch.float32)
    assert qkv is not None
    # views of what was read: joining copied nothing
    assert {buffer.untyped_storage().data_ptr() for m in siblings for buffer in m.buffers()} == storages
    assert len(storages) == len(siblings[0].BUFFERS)
    assert_outputs_are_each_modules_own(qkv, [alone[name] for name in ("q_proj", "k_proj", "v_proj")])
    x = torch.randn(2, COLS)
    assert all(torch.equal(a, alone[name](x)) for a, name in zip(q_k_v(x), ("q_proj", "k_proj", "v_proj"), strict=True))
    assert all(torch.equal(m(x), alone[name](x)) for m, name in zip(siblings, ("q_proj", "k_proj", "v_proj"), strict=True))


def test_a_run_of_one_kind_is_joined_and_a_sibling_of_another_called_apart(kernel):
    """llama-quantize's Q4_K_M: q and k Q4_K, v Q6_K in some layers."""
    kinds = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K"}
    tree, arrays, names = attention_of(kinds, bias=True)
    alone = placed(*attention_of(kinds, bias=True))
    kept = joined.join_in_place(dict(arrays))
    assert "self_attn.q_proj+k_proj.tiles" in kept and "self_attn.v_proj.tiles" in kept
    modules = placed(tree, kept, names)
    siblings = [modules[name] for name in ("q_proj", "k_proj", "v_proj")]
    assert linear.joint_product(siblings, torch.float32) is None
    assert llama._siblings(siblings, torch.float32)[1] is None  # not one tensor
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, COLS).to(dtype)
        assert all(torch.equal(a, alone[name].product(dtype)(x))
                   for a, name in zip(llama._siblings(siblings, dtype)[0](x), ("q_proj", "k_proj", "v_proj"), strict=True))
    assert joined.runs(("q_proj", "k_proj", "v_proj"), {"q_proj": 1, "k_proj": 2, "v_proj": 2}.get) == [("k_proj", "v_proj")]
    assert joined.runs(("q_proj", "k_proj", "v_proj"), {"q_proj": 1, "v_proj": 1}.get) == []  # not consecutive


def test_modules_of_their_own_memory_are_copied_once_into_one_and_point_at_it(kernel):
    alone = placed(*attention_of({"q_proj": "Q8_0"}))
    modules = placed(*attention_of({"q_proj": "Q8_0"}))
    siblings = [modules[name] for name in ("q_proj", "k_proj", "v_proj")]
    product = linear.joint_product(siblings, torch.bfloat16)
    assert product is not None
    for buffer in siblings[0].BUFFERS:  # each module's rows of one tensor now: the parts were freed
        assert len({getattr(m, buffer).untyped_storage().data_ptr() for m in siblings}) == 1
    assert_outputs_are_each_modules_own(product, [alone[name] for name in ("q_proj", "k_proj", "v_proj")])
    # a second build finds them side by side: a view, no copy
    again = linear.joint_product(siblings, torch.float32)
    assert again is not None and siblings[0].tiles.untyped_storage().data_ptr() == \
        siblings[2].tiles.untyped_storage().data_ptr()


def test_what_cannot_be_one_call_or_would_cost_memory_is_called_apart(kernel):
    modules = placed(*attention_of({"q_proj": "Q4_0"}))
    q, k, _, o = (modules[name] for name in ATTENTION)
    assert linear.joint_product([q], torch.float32) is None  # one module
    assert linear.joint_product([q, k], torch.float16) is None  # a dtype the kernels' products do not take
    assert linear.joint_product([q, torch.nn.Linear(COLS, 32)], torch.float32) is None  # dense
    five = placed(*attention_of({"q_proj": "Q5_0"}))["k_proj"]
    assert linear.joint_product([q, five], torch.float32) is None  # 4-bit and 5-bit tiles
    # parts of one allocation that are not one after another: a copy would keep both
    shared = torch.cat([q.tiles, o.tiles, k.tiles])
    q.tiles, k.tiles = shared[: q.tiles.shape[0]], shared[-k.tiles.shape[0]:]
    assert linear.joint_product([q, k], torch.float32) is None
    dense = int4.Int4Linear.from_kernel_layout(q.tiles, q.scales, q.lows)
    assert linear.joint_product([dense, int4.Int4Linear.from_kernel_layout(k.tiles, k.scales, k.lows)],
                                torch.bfloat16) is None  # torch's int4 kernel: its own blocking


def test_kept_runs_read_back_as_views_of_one_read(kernel):
    tree, arrays, names = attention_of({"q_proj": "Q4_1"})
    kept = joined.join_in_place(dict(arrays))
    reads = []

    def get(key):
        reads.append(key)
        return kept[key]

    read = joined.KeptReader(get, kept, tree)
    parts = [read(f"self_attn.{name}", "tiles") for name in ("q_proj", "k_proj", "v_proj")]
    assert reads == ["self_attn.q_proj+k_proj+v_proj.tiles"]  # read once for the run
    assert all(torch.equal(part, arrays[f"self_attn.{name}.tiles"])
               for part, name in zip(parts, ("q_proj", "k_proj", "v_proj"), strict=True))
    with pytest.raises(KeyError):
        read("self_attn.q_proj", "missing")
    # tiles laid out one after another in one allocation (a GGUF's first read): kept as a view
    names = ("q_proj", "k_proj", "v_proj")
    whole = torch.cat([arrays[f"self_attn.{name}.tiles"].reshape(-1) for name in names])
    at = 0
    for name in names:
        size = arrays[f"self_attn.{name}.tiles"].numel()
        arrays[f"self_attn.{name}.tiles"] = whole[at : at + size].view(arrays[f"self_attn.{name}.tiles"].shape)
        at += size
    together = joined.join_in_place(dict(arrays))["self_attn.q_proj+k_proj+v_proj.tiles"]
    assert together.data_ptr() == whole.data_ptr() and torch.equal(together, kept["self_attn.q_proj+k_proj+v_proj.tiles"])
    assert llama.JOINED == (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
