"""Preparing a model for lookahead: loading (a hub id, a folder, a GGUF file), a GGUF's config,
tokenizer and tensors (gguf), the grouped-query attention function (attention), and the Linear
weights' layouts and kernels (packing: oneDNN's packed layout; int4: a GGUF's 4-bit blocks, run by
q4's kernel or torch's; q8: its Q8_0 output layer; norms and step_ops: a step's small ops; native:
compiling the kernels)."""
