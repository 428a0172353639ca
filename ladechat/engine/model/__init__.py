"""Preparing a model for lookahead: loading (a hub id, a folder, a GGUF file), GGUF conversion
(gguf), the grouped-query attention function (attention), and the Linear weights' layouts and
kernels (packing: oneDNN's packed layout; int4: a GGUF's 4-bit blocks)."""
