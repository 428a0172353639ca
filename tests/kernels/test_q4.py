"""ladechat's 4-bit kernel (engine/kernels/q4.py, blocks.cpp): products against fp64 of the same int8
activation codes, the rounding those codes cost against the exact weights, the same bits for a row
whatever the step's size, the thread count or the instruction set, the layout and the module."""


import numpy as np
import pytest
import torch

from ladechat.engine.kernels import int4, native, q4

pytestmark = pytest.mark.skipif(not int4.supported(torch.device("cpu")),
                                reason="the 4-bit kernel is built with x86-64 vector instructions")


def paths() -> list[int]:
    """The kernel's paths this CPU runs: portable always, AVX2, and AVX-512 VNNI where it has them."""
    return list(range(q4.best_path() + 1))


def random_weight(rows: int, cols: int, seed: int = 0):
    """Codes, and fp16-valued scales and lows as Q4_1 blocks have them."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(rows, cols // 32, generator=generator) * 0.01).half().float()
    lows = (-torch.rand(rows, cols // 32, generator=generator) * 0.08).half().float()
    return codes, scales, lows


def dense(codes, scales, lows) -> torch.Tensor:
    return codes.double() * scales.double().repeat_interleave(32, 1) + lows.double().repeat_interleave(32, 1)


def quantized(x: torch.Tensor):
    """The kernel's int8 codes of each row, per 32 inputs, by its documented steps in fp32:
    (codes, scales, sums) as float64."""
    groups = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    scale = (amax / np.float32(127)).astype(np.float32)
    inverse = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0).astype(np.float32)
    codes = np.clip(np.rint((groups * inverse).astype(np.float32)), -127, 127)
    return codes.astype(np.float64), scale[..., 0].astype(np.float64), codes.sum(axis=-1).astype(np.float64)


def test_products_are_the_int8_rows_times_the_exact_weights(kernel):
    codes, scales, lows = random_weight(64, 96)
    layer = q4.Q4Linear(*q4.layout(codes, scales, lows))
    assert torch.equal(layer.dense_weight().double(), dense(codes, scales, lows))  # the weights, exactly
    x = torch.randn(5, 96) * torch.tensor([1.0, 0.01, 30.0, 1e-6, 1.0])[:, None]  # rows of any scale
    qa, da, sa = quantized(x)
    # per group: da * (scale * sum q qa + low * sum qa); the integer sums exact, then 3 fp32 roundings a group
    q = codes.double().numpy().reshape(64, 3, 32)
    isum = np.einsum("ngk,mgk->mng", q, qa)
    terms = da[:, None, :] * (scales.double().numpy()[None] * isum + lows.double().numpy()[None] * sa[:, None, :])
    reference = terms.sum(-1)
    bound = np.abs(terms).sum(-1) * 2**-21
    for path in paths():
        y = q4.Q4Linear(*q4.layout(codes, scales, lows), path=path)(x)
        assert y.dtype == torch.float32 and y.shape == (5, 64)
        assert (np.abs(y.double().numpy() - reference) <= bound).all(), path


def test_int8_rows_cost_at_most_half_a_code_of_each_group(kernel):
    """Against the exact product x W^T: each input moves by at most half its group's step
    (max |x| / 254), so an output by at most that times the group's |w|, summed."""
    codes, scales, lows = random_weight(48, 576, seed=3)
    weight = dense(codes, scales, lows)
    x = torch.randn(7, 576)
    x[:, 5] = 40.0  # an outlier: its group's other inputs round coarsely, within the bound still
    y = q4.Q4Linear(*q4.layout(codes, scales, lows))(x).double()
    step = x.double().abs().reshape(7, -1, 32).amax(-1) / 254  # (rows, groups)
    bound = step @ weight.abs().reshape(48, -1, 32).sum(-1).t() * 1.001 + 1e-6
    error = (y - x.double() @ weight.t()).abs()
    assert (error <= bound).all()
    assert (error > 0).any()  # it does round (this is not the exact product)


def test_the_paths_and_dtypes_give_the_same_bits(kernel):
    codes, scales, lows = random_weight(96, 320, seed=4)
    tiles = q4.layout(codes, scales, lows)
    x = torch.randn(9, 320)
    x[0, :32] = 0.0  # a group of zeros, and one whose largest is denormal-small (its scale too)
    x[1, 32:64] = torch.tensor([1e-39, 0.0] * 16)
    results = [q4.Q4Linear(*tiles, path=path)(x) for path in paths()]
    assert all(torch.equal(y, results[0]) for y in results)  # VNNI, AVX2 and portable
    layer = q4.Q4Linear(*tiles)
    rows = x.bfloat16()  # bf16 rows are read as their fp32 values; the result rounds once to bf16
    assert torch.equal(layer(rows), layer(rows.float()).bfloat16())
    assert torch.equal(layer(x.half()), layer(x.half().float()).half())  # fp16 through fp32
    assert torch.equal(layer(x[None]), results[0][None])  # a step's extra dimensions are kept
    assert torch.equal(layer.product()(x), results[0])


# rows enough for two of the VNNI kernels' passes (12 rows each) and one row left, and more than
# twice the AVX2 and F16/BF16 kernels' 4
STEP_ROWS = 25


def assert_each_row_its_own(layer_on, x: torch.Tensor) -> None:
    """The kernels (blocks.cpp, q4 and q8 alike) take a tile's rows some at a time, then the rest
    together: for every step size 1..len(x) a row's outputs are its one-row product's, on every path
    (layer_on(path): the layer on that path), and every path gives the same bits."""
    outputs = []
    for path in paths():
        layer = layer_on(path)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        for rows in range(1, len(x) + 1):
            assert torch.equal(layer(x[:rows]), alone[:rows]), (path, rows)
        outputs.append(alone)
    assert all(torch.equal(y, outputs[0]) for y in outputs)


def test_every_row_count_gives_each_row_its_own_bits(kernel):
    tiles = q4.layout(*random_weight(48, 96, seed=5))
    assert_each_row_its_own(lambda path: q4.Q4Linear(*tiles, path=path),
                            torch.randn(STEP_ROWS, 96, generator=torch.Generator().manual_seed(5)))


def assert_alone_as_among_many_on_any_thread_count(layer, x: torch.Tensor) -> None:
    """Each row of x (many: > 16 rows are quantized on 2 threads) gets alone the bits it gets among
    them all, and all of them the same bits on 1 thread and on 2: what lets a lookahead step's rows
    equal one-row steps' (plain decoding) bit for bit."""
    together = layer(x)
    assert all(torch.equal(layer(x[i:i + 1]), together[i:i + 1]) for i in range(len(x)))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(layer(x), together)
    finally:
        torch.set_num_threads(threads)


def test_a_row_is_the_same_alone_among_many_and_on_any_thread_count(kernel):
    codes, scales, lows = random_weight(1536, 576, seed=1)
    assert_alone_as_among_many_on_any_thread_count(q4.Q4Linear(*q4.layout(codes, scales, lows)),
                                                   torch.randn(40, 576, generator=torch.Generator().manual_seed(1)))


def test_the_layout_keeps_every_code_scale_and_low(kernel):
    codes, scales, lows = random_weight(32, 64, seed=5)
    tiles, tile_scales, tile_lows = q4.layout(codes, scales, lows)
    assert tiles.shape == (2, 2, 256) and tile_scales.shape == tile_lows.shape == (2, 2, 16)
    assert torch.equal(q4.codes_of(tiles), codes)
    assert torch.equal(q4.per_row(tile_scales), scales) and torch.equal(q4.per_row(tile_lows), lows)
    # the tile as blocks.cpp draws it: byte 64 p + 4 j + i holds q[j][4 p + i] low, q[j][4 (p + 4) + i] high
    assert tiles[0, 1, 64 * 2 + 4 * 3 + 1] == codes[3, 32 + 9] | (codes[3, 32 + 25] << 4)


def test_the_module_keeps_its_bias_refuses_moves_and_bad_buffers(kernel):
    codes, scales, lows = random_weight(32, 64, seed=6)
    bias = torch.randn(32)
    layer = q4.Q4Linear(*q4.layout(codes, scales, lows), bias=bias, kind="Q4_0")
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), q4.Q4Linear(*q4.layout(codes, scales, lows))(x) + bias)
    assert torch.equal(layer.product()(x), layer(x))
    state = layer.state_dict()
    assert torch.equal(state["weight"], layer.dense_weight()) and torch.equal(state["bias"], bias)
    assert "Q4_0 blocks (fp32 scales), ladechat's" in repr(layer)
    with pytest.raises(TypeError, match="4-bit weights stay on the CPU"):
        layer.to(torch.float16)
    tiles, tile_scales, tile_lows = q4.layout(codes, scales, lows)
    with pytest.raises(ValueError, match="none of the kernel's forms"):
        q4.Q4Linear(tiles, tile_scales.half(), tile_lows)
    with pytest.raises(ValueError, match="does not fit the 4-bit kernel"):
        q4.layout(codes[:24], scales[:24], lows[:24])
    with pytest.raises(RuntimeError, match="the inputs must be a multiple of 32"):
        torch.ops.ladechat_blocks.q4_mm(torch.randn(2, 48), tiles, tile_scales, tile_lows, 0)
    with pytest.raises(RuntimeError, match="codes must be"):
        torch.ops.ladechat_blocks.q4_mm(torch.randn(2, 96), tiles, tile_scales, tile_lows, 0)
    assert layer(torch.randn(0, 64)).shape == (0, 32)


def test_the_compact_forms_give_the_fp32_forms_bits(kernel):
    """fp16 scales and lows (Q4_1 as the file holds them), Q4_0's and Q5_0's fp16 d alone (the
    kernel makes the low, -8 d or -16 d) and Q4_K's packed 6-bit sc and m with an fp16 d and dmin
    per 256: the kernel widens them to the very fp32 values, so every path, row count and dtype
    gives the fp32 form's bits, from fewer bytes."""
    generator = torch.Generator().manual_seed(11)
    rows, cols = 48, 512
    codes, _, _ = random_weight(rows, cols, seed=11)
    scales16 = (torch.rand(rows, cols // 32, generator=generator) * 0.05).half()
    lows16 = (torch.randn(rows, cols // 32, generator=generator) * 0.1).half()
    sc = torch.randint(0, 64, (rows, cols // 32), dtype=torch.uint8, generator=generator)
    m = torch.randint(0, 64, (rows, cols // 32), dtype=torch.uint8, generator=generator)
    d = (torch.rand(rows, cols // 256, generator=generator) * 0.01).half().float()
    dmin = (torch.rand(rows, cols // 256, generator=generator) * 0.01).half().float()
    k_scales = d.repeat_interleave(8, 1) * sc.float()  # exact: an fp16 times an integer < 64
    k_lows = -dmin.repeat_interleave(8, 1) * m.float()
    half, k_form = q4.layout(codes, scales16, lows16), q4.layout_k(codes, sc, m, d, dmin)
    assert q4.form(*half[1:]) == "fp16" and q4.form(*k_form[1:]) == "Q4_K"
    assert q4.form(*q4.layout(codes, scales16.float(), lows16.float())[1:]) == "fp32"
    weights = rows * cols
    assert sum(t.nbytes for t in half) / weights == 0.625 and sum(t.nbytes for t in k_form) / weights == 0.5625
    assert all(torch.equal(a, b) for a, b in zip(q4.expand(*k_form[1:]), q4.layout(codes, k_scales, k_lows)[1:]))
    x = torch.randn(9, cols, generator=generator)
    for path in paths():
        for count in (1, 2, 3, 4, 5, 9):
            for rows_in in (x[:count], x[:count].bfloat16()):
                assert torch.equal(q4.Q4Linear(*half, path=path)(rows_in),
                                   q4.Q4Linear(*q4.layout(codes, scales16.float(), lows16.float()), path=path)(rows_in))
                assert torch.equal(q4.Q4Linear(*k_form, path=path)(rows_in),
                                   q4.Q4Linear(*q4.layout(codes, k_scales, k_lows), path=0)(rows_in)), (path, count)
    d16 = scales16.float()  # Q4_0's and Q5_0's d form: the low is d times the tile's factor, made by the kernel
    # with d negative, zero and past fp16's range once multiplied (where the fp16 form kept fp32)
    d16[0, :4] = torch.tensor([-0.03125, 0.0, 9000.0, -60000.0])
    for kind, five in (("Q4_0", False), ("Q5_0", True)):
        factor = q4.D_FACTORS[kind]
        coded = codes | (codes << 1 & 0x10) if five else codes  # some top bits set for Q5_0
        d_form = q4.layout_d(coded, d16, kind)
        assert q4.form(*d_form[1:]) == "fp16 d" and sum(t.nbytes for t in d_form[1:]) == d_form[1].nbytes + rows // 16
        assert torch.equal(q4.expand(*d_form[1:])[1], q4.per_tile(factor * d16))
        fp32 = q4.layout(coded, d16, factor * d16, five_bit=five)
        with pytest.raises(ValueError, match="must be -8"):
            q4.Q4Linear(d_form[0], d_form[1], -d_form[2])
        for path in paths():
            for count in (1, 2, 5):
                for rows_in in (x[:count], x[:count].bfloat16()):
                    assert torch.equal(q4.Q4Linear(*d_form, path=path)(rows_in), q4.Q4Linear(*fp32, path=0)(rows_in))
    # each compact form's kernels for every row count (one pass, two, and a row left), on every path
    many = torch.randn(STEP_ROWS, cols, generator=generator)
    for tiles in (half, k_form, d_form):
        assert_each_row_its_own(lambda path, tiles=tiles: q4.Q4Linear(*tiles, path=path), many)
    layer = q4.Q4Linear(*k_form)
    assert torch.equal(layer.dense_weight(), q4.Q4Linear(*q4.layout(codes, k_scales, k_lows)).dense_weight())
    assert all(torch.equal(a, b) for a, b in zip(q4.unpack_k(k_form[1]), (q4.per_tile(sc, torch.uint8),
                                                                          q4.per_tile(m, torch.uint8))))
    with pytest.raises(ValueError, match="multiple of 256"):
        q4.layout_k(codes[:, :288], sc[:, :9], m[:, :9], d[:, :1], dmin[:, :1])
    with pytest.raises(ValueError, match="not fp16 values"):
        q4.layout_k(codes, sc, m, d + 1e-6, dmin)


PORTABLE_SCRIPT = """
import sys
import torch
sys.path[:0] = [{tests!r}, {kernel_tests!r}]
from test_int4 import random_blocks
from test_q4 import random_weight
from test_q6 import random_layer as q6_layer
from test_q8 import random_layer as q8_layer
from ladechat.engine.kernels import q4, q6, q8
torch.ops.load_library({library!r})
ops = torch.ops.ladechat_blocks
x = torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
out = {{"best_path": ops.best_path(),
        "q4": ops.q4_mm(x, *q4.layout(*random_weight(48, 512, seed=1)), 0),
        "q4_k": ops.q4_mm(x, *q4.layout_k(*map(torch.from_numpy, q4.decode_compact("Q4_K", random_blocks("Q4_K", 32, 512, 2), 32, 512))), 0),
        "q6": ops.q6_mm(x, *q6.layout(*q6_layer(32, 512, seed=3)), 0),
        "q8": ops.q8_mm(x, *q8.kernel_layout(*q8_layer(32, 512, seed=4)), 0),
        "tiles": ops.gguf_tiles(torch.from_numpy(random_blocks("Q4_K", 32, 512, 5)), 2, 32, 512, None, None),
        "q5_k": ops.q4_mm(x, *q4.layout_k(*map(torch.from_numpy, q4.decode_compact("Q5_K", random_blocks("Q5_K", 32, 512, 6), 32, 512)), five_bit=True), 0),
        "tiles5": ops.gguf_tiles(torch.from_numpy(random_blocks("Q5_0", 32, 512, 7)), 4, 32, 512, None, None),
        "q5_0d": ops.q4_mm(x, *q4.layout_d(*map(torch.from_numpy, q4.decode_compact("Q5_0", random_blocks("Q5_0", 32, 512, 10), 32, 512)[:2]), "Q5_0"), 0),
        "half": ops.half_mm(x, (torch.randn(32, 512, generator=torch.Generator().manual_seed(8)) * 0.05).bfloat16(), 0)}}
torch.save(out, {saved!r})
"""


@pytest.mark.slow  # a compile of its own: kept out of the fast tier
def test_the_library_builds_with_the_portable_loops_alone_and_gives_their_bits(kernel, tmp_path):
    """blocks.cpp built as on a CPU that is not x86-64 (LADECHAT_PORTABLE_ONLY: no x86 header, no
    SIMD path): it names the portable path its best, and every op gives the bits the x86 build's
    portable path gives (in a process of its own: one library of a name per process)."""
    import subprocess
    import sys
    from pathlib import Path

    from test_int4 import random_blocks
    from test_q6 import random_layer as q6_layer
    from test_q8 import random_layer as q8_layer

    from ladechat.engine.kernels import q6, q8

    library = tmp_path / "blocks_portable.so"
    command = native.compile_command(Path(q4.SOURCE), library, native.COMPILER)
    built = subprocess.run([command[0], "-DLADECHAT_PORTABLE_ONLY", *command[1:]], capture_output=True, text=True,
                           check=False)
    assert built.returncode == 0, built.stderr[-2000:]
    script = PORTABLE_SCRIPT.format(tests=str(Path(__file__).parent.parent), kernel_tests=str(Path(__file__).parent), library=str(library), saved=str(tmp_path / "out.pt"))
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert ran.returncode == 0, ran.stderr[-2000:]
    theirs = torch.load(tmp_path / "out.pt")
    ops = torch.ops.ladechat_blocks
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
    ours = {"best_path": 0,
            "q4": ops.q4_mm(x, *q4.layout(*random_weight(48, 512, seed=1)), 0),
            "q4_k": ops.q4_mm(x, *q4.layout_k(*map(torch.from_numpy, q4.decode_compact("Q4_K", random_blocks("Q4_K", 32, 512, 2), 32, 512))), 0),
            "q6": ops.q6_mm(x, *q6.layout(*q6_layer(32, 512, seed=3)), 0),
            "q8": ops.q8_mm(x, *q8.kernel_layout(*q8_layer(32, 512, seed=4)), 0),
            "tiles": ops.gguf_tiles(torch.from_numpy(random_blocks("Q4_K", 32, 512, 5)), 2, 32, 512, None, None),
            "q5_k": ops.q4_mm(x, *q4.layout_k(*map(torch.from_numpy, q4.decode_compact("Q5_K", random_blocks("Q5_K", 32, 512, 6), 32, 512)), five_bit=True), 0),
            "tiles5": ops.gguf_tiles(torch.from_numpy(random_blocks("Q5_0", 32, 512, 7)), 4, 32, 512, None, None),
            "q5_0d": ops.q4_mm(x, *q4.layout_d(*map(torch.from_numpy, q4.decode_compact("Q5_0", random_blocks("Q5_0", 32, 512, 10), 32, 512)[:2]), "Q5_0"), 0),
            "half": ops.half_mm(x, (torch.randn(32, 512, generator=torch.Generator().manual_seed(8)) * 0.05).bfloat16(), 0)}
    assert theirs.keys() == ours.keys()
    assert theirs["best_path"] == 0
    for name in ("q4", "q4_k", "q6", "q8", "tiles", "q5_k", "tiles5", "q5_0d", "half"):
        assert torch.equal(theirs[name], ours[name]), name
