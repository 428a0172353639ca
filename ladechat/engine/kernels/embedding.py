"""A token embedding kept as a GGUF file's blocks: the rows a step looks up are dequantized when
looked up, never the whole table (at 4 bytes a weight a 128k-token vocabulary is 1-2 GB; its blocks
are a fifth to a seventh of that, and only the pages of the tokens used are read). Each row gets the
bits a whole-table dequantization gives it (gguf-py's, block by block, then cast to the dtype)."""

from __future__ import annotations

import numpy as np
import torch


class BlockEmbedding(torch.nn.Module):
    """nn.Embedding's lookup over `blocks` (rows, bytes a row: one row's blocks, as gguf-py reads
    a tensor; a memory map of the file, say) of block type `kind` (gguf.GGMLQuantizationType)."""

    def __init__(self, blocks: np.ndarray, kind, cols: int, dtype: torch.dtype):
        super().__init__()
        self.blocks, self.kind, self.dtype = blocks, kind, dtype
        self.num_embeddings, self.embedding_dim = int(blocks.shape[0]), cols

    def rows(self, flat: np.ndarray) -> torch.Tensor:
        """The table's rows `flat` (token ids), (len(flat), embedding_dim) in the dtype."""
        from gguf import dequantize

        if not len(flat):  # gguf-py cannot reshape an empty selection
            return torch.empty((0, self.embedding_dim), dtype=self.dtype)
        found = dequantize(np.ascontiguousarray(self.blocks[flat]), self.kind).reshape(len(flat), self.embedding_dim)
        return torch.from_numpy(np.require(found, np.float32, ["C", "W"])).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        return self.rows(flat).reshape(*ids.shape, self.embedding_dim).to(ids.device)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, dense (computed on each read: for tests and tools, never a step)."""
        return self.rows(np.arange(self.num_embeddings))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind.name} blocks"
