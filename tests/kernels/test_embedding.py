"""The token embedding kept as a GGUF's blocks (engine/kernels/embedding.py): each looked-up row has
the bits a whole-table dequantization gives it, for every block type a file's table comes in."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from ladechat.engine.kernels.embedding import BlockEmbedding

ROWS, COLS = 97, 512


def blocks_of(kind: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """A table's blocks (rows, bytes a row): quantized by gguf-py where it can, else random bytes
    with finite fp16 scales (the K types, which gguf-py only reads)."""
    weights = rng.standard_normal((ROWS, COLS), dtype=np.float32)
    if kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_1,
                GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        return quantize(weights, kind)
    block = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q6_K: 210}[kind]
    raw = rng.integers(0, 256, (ROWS, COLS // 256, block), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if kind == GGMLQuantizationType.Q4_K:
        raw[..., 0:2] = scale  # d
        raw[..., 2:4] = scale  # dmin
    else:
        raw[..., 208:210] = scale  # d, at the block's end
    return raw.reshape(ROWS, -1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q6_K", "F16", "BF16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_looked_up_rows_equal_the_dequantized_table(kind, dtype):
    kind = GGMLQuantizationType[kind]
    blocks = blocks_of(kind, np.random.default_rng(0))
    table = torch.from_numpy(np.array(dequantize(blocks, kind), dtype=np.float32).reshape(ROWS, COLS)).to(dtype)
    embedding = BlockEmbedding(blocks, kind, COLS, dtype)
    ids = torch.tensor([[3, 0, 96, 3], [50, 51, 1, 2]])
    out = embedding(ids)
    assert out.shape == (2, 4, COLS) and out.dtype == dtype
    assert torch.equal(out, table[ids])
    assert torch.equal(embedding.weight, table)
    assert torch.equal(embedding.state_dict()["weight"], table)
    assert torch.equal(embedding(torch.tensor([], dtype=torch.long)), table[:0])


def test_an_id_past_the_table_is_an_error_not_a_read_past_it():
    blocks = blocks_of(GGMLQuantizationType.Q8_0, np.random.default_rng(1))
    embedding = BlockEmbedding(blocks, GGMLQuantizationType.Q8_0, COLS, torch.float32)
    with pytest.raises(IndexError, match="out of range"):
        embedding(torch.tensor([ROWS]))
    with pytest.raises(IndexError, match="out of range"):
        embedding(torch.tensor([-1]))

