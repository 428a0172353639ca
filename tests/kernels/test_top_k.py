"""step_ops.cpp's top_k: the k best logits of each row, ranked as torch.topk ranks them (NaN first,
then larger, then the lower index), a row's ranking the same alone or among a step's rows."""


import torch


def test_top_k_ranks_as_torch_and_breaks_ties_by_index(step_kernel):
    from ladechat.engine.draft.recycle import TOP_K
    from ladechat.engine.runner import top_k

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(13, 49152, generator=generator) * 5  # no ties among the best in fp32
    expected = logits.topk(TOP_K, dim=-1).indices.numpy()
    assert (top_k(logits) == expected).all()
    ours = torch.ops.ladechat_step.top_k(logits.bfloat16(), TOP_K)  # bf16: equal logits, in index order
    for row, ids in zip(logits.bfloat16(), ours, strict=True):
        values = row[ids].float().tolist()
        assert values == sorted(values, reverse=True)
        assert values[-1] >= row.float().topk(TOP_K).values[-1]  # nothing better left out
        for a, b in zip(ids[:-1].tolist(), ids[1:].tolist(), strict=True):
            assert row[a] > row[b] or a < b
        assert ids[0] == row.argmax()  # the first best, as argmax picks
    tied = torch.tensor([[1.0, 3.0, 3.0, float("nan"), 3.0, 2.0]])
    assert torch.ops.ladechat_step.top_k(tied, 5).tolist() == [[3, 1, 2, 4, 5]]  # NaN first, as torch.topk
    assert torch.ops.ladechat_step.top_k(tied, 3).tolist() == [[3, 1, 2]]  # a tie at the k-th place: the lowest index
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.ops.ladechat_step.top_k(logits[5:6], TOP_K)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], torch.ops.ladechat_step.top_k(logits, TOP_K)[5])


def test_top_k_of_long_fp32_rows_with_ties_and_nans_ranks_as_one_pass_does(step_kernel):
    """Past the first k, fp32 rows are scanned 8 logits at a time for what may enter (above the
    k-th best, or NaN): the ranking stays NaN first (by index), then larger, then lower index."""
    generator = torch.Generator().manual_seed(8)
    for trial in range(30):
        logits = torch.randint(-6, 6, (3, 1003), generator=generator).float()  # many ties
        if trial % 2:
            logits[trial % 3, torch.randint(8, 1003, (2,), generator=generator)] = float("nan")  # NaNs late
        if trial % 5 == 0:
            logits[(trial + 1) % 3, torch.randperm(1003, generator=generator)[:12]] = float("nan")  # a NaN k-th best
        for row, ids in zip(logits, torch.ops.ladechat_step.top_k(logits, 8), strict=True):
            want = sorted(range(len(row)), key=lambda i: (not row[i].isnan(), -row[i].nan_to_num().item(), i))[:8]
            assert ids.tolist() == want
