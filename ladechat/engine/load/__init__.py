"""Loading a model for lookahead: a hub id, a folder or a GGUF file (loading), a GGUF's config,
tokenizer and tensors (gguf), its quantized weights read into the kernels' layout and kept
(quantized, head: the Q8_0 output layer; kept: the file that keeps them), and the Linear weights
packed for oneDNN (packing)."""
