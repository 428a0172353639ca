"""A GGUF file, read as llama.cpp writes it: its header (header), its config, tokenizer and
tensors (files), its quantized Linear weights in the kernels' layout (quantized; head: a Q8_0
output layer), the file that keeps that layout for later loads (kept), and blocks dequantized by
torch where no kernel takes them (dequantize)."""
