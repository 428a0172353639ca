"""ladechat's row-wise attention (step_ops.cpp `attend`, kernels/attention.py ROWWISE): SDPA's results
within fp32's / bf16's rounding, and what SDPA does not promise: a row's bits depend only on the
keys it sees, not on the step's other rows, the masked keys between them or the thread count."""


import pytest
import torch

from ladechat.engine.kernels import attention, int4

pytestmark = pytest.mark.skipif(not int4.supported(torch.device("cpu")),
                                reason="the kernel is built with x86-64 vector instructions")


def paths() -> list[int]:
    """The kernel's paths this CPU runs: portable always, AVX2, AVX-512 where it has them."""
    return list(range(int(torch.ops.ladechat_step.attend_best_path()) + 1))


def attend(q, k, v, mask, rows, path=-1):
    return torch.ops.ladechat_step.attend(q, k, v, mask, 0.125, rows, path)


def tree_step(dtype, past: int, parents: list[int], dim: int = 64, heads: int = 3, groups: int = 3, seed: int = 0):
    """A step's stacked queries (groups rows per token), a cache of past + len(parents) keys (a
    view of a longer buffer, as the runner's cache is) and the additive tree mask tiled per group."""
    generator = torch.Generator().manual_seed(seed)
    size, keys = len(parents), past + len(parents)
    q = torch.randn(1, heads, groups * size, dim, generator=generator).to(dtype)
    k = torch.randn(1, heads, keys + 40, dim, generator=generator).to(dtype)[:, :, :keys]
    v = torch.randn(1, heads, keys + 40, dim, generator=generator).to(dtype)[:, :, :keys]
    sees = torch.zeros(size, size, dtype=torch.bool)
    for row, parent in enumerate(parents):
        sees[row, row] = True
        while parent >= 0:
            sees[row, parent] = True
            parent = parents[parent]
    mask = torch.zeros(1, 1, size, keys, dtype=dtype)
    mask[0, 0, :, past:].masked_fill_(~sees, torch.finfo(dtype).min)
    return q, k, v, mask.repeat(1, 1, groups, 1), sees


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
def test_the_results_are_sdpas_within_rounding(step_kernel, dtype, dim):
    q, k, v, mask, _ = tree_step(dtype, 150, [-1, 0, 1, 0, 3, -1, 5], dim=dim)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask.float(),
                                                                 scale=0.125)
    bound = 2e-6 if dtype == torch.float32 else 2e-2
    for path in paths():
        ours = attend(q, k, v, mask, 7, path)
        assert ours.dtype == dtype and ours.shape == q.shape
        assert (ours.float() - expected).abs().max() < bound, path
    # a bool mask (true: visible) is the same mask
    assert torch.equal(attend(q, k, v, mask == 0, 7), attend(q, k, v, mask, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past", [150, 1500])
def test_a_row_is_the_same_alone_as_among_a_steps_rows(step_kernel, dtype, past):
    """Row 4 of this tree sees the cache and rows 0, 3, 4: alone, over exactly those keys (as a
    one-row step of plain decoding sees them, one after the other), its bits are the same. (With
    1500 keys cached torch 2.13's SDPA gives other bits for every row here, fp32 and bf16.)"""
    parents = [-1, 0, 1, 0, 3, -1, 5]
    q, k, v, mask, sees = tree_step(dtype, past, parents)
    for path in paths():
        together = attend(q, k, v, mask, len(parents), path)
        for row in range(len(parents)):
            keys = list(range(past)) + [past + j for j in range(len(parents)) if sees[row, j]]
            alone_q = q[:, :, row::len(parents)].contiguous()  # its 3 query heads, stacked
            alone = attend(alone_q, k[:, :, keys], v[:, :, keys], None, 1, path)
            assert torch.equal(alone, together[:, :, row::len(parents)]), (path, row)


def test_the_thread_count_does_not_change_a_bit(step_kernel):
    q, k, v, mask, _ = tree_step(torch.float32, 1500, list(range(-1, 15)))
    together = attend(q, k, v, mask, 16)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(attend(q, k, v, mask, 16), together)
    finally:
        torch.set_num_threads(threads)


def test_without_a_mask_the_rows_are_causal(step_kernel):
    """A prefill (transformers leaves the mask out): row s sees the keys up to its own, in each
    group of stacked rows; with keys cached before them, those too."""
    for past in (0, 20):
        q, k, v, mask, _ = tree_step(torch.float32, past, list(range(-1, 5)))  # a chain: causal
        assert torch.equal(attend(q, k, v, None, 6), attend(q, k, v, mask, 6))


def test_a_prefill_with_more_keys_than_rows_and_no_mask_keeps_sdpa(step_kernel):
    """transformers leaves the mask out of a prefill whose keys are its rows (causal: the kernel's
    own), and also of one into an empty static cache, longer than the prompt, where SDPA's
    is_causal aligns the rows with the first keys: that one stays SDPA's."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 3, False
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(1, 9, 5, 64, generator=generator)
    for keys in (5, 12):
        key, value = torch.randn(1, 3, keys, 64, generator=generator), torch.randn(1, 3, keys, 64, generator=generator)
        ours, _ = attention.rowwise_attention(module, query, key, value, None, scaling=0.125)
        theirs = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(3, 1),
                                                                   value.repeat_interleave(3, 1), is_causal=True,
                                                                   scale=0.125)
        assert (ours - theirs.transpose(1, 2)).abs().max() < 2e-6, keys


def test_bad_inputs_are_one_line_errors(step_kernel):
    q, k, v, mask, _ = tree_step(torch.float32, 10, [-1, 0])
    with pytest.raises(RuntimeError, match="dim \\(64 or 128\\)"):
        attend(q[..., :48], k[..., :48], v[..., :48], mask, 2)
    with pytest.raises(RuntimeError, match="all one dtype"):
        attend(q, k.bfloat16(), v, mask, 2)
    with pytest.raises(RuntimeError, match="the mask must be"):
        attend(q, k, v, mask[..., :5], 2)
    with pytest.raises(RuntimeError, match="rows must divide"):
        attend(q, k, v, None, 4)


@pytest.mark.slow
def test_the_embedded_model_on_4bit_weights_attends_row_by_row(step_kernel):
    from ladechat.engine.load.loading import LoadSpec, load

    lm = load(LoadSpec(dtype="float32", device="cpu", weights="int4"))
    assert lm.model.config._attn_implementation == attention.ROWWISE
    assert lm.weights.endswith(", attention row by row (ladechat's kernel)")
    packed = load(LoadSpec(dtype="float32", device="cpu", weights="packed"))  # the fp32 path keeps SDPA
    assert packed.model.config._attn_implementation == attention.NAME
