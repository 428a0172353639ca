"""Loading a model for lookahead: a hub id, a folder or a GGUF file (loading), a checkpoint's
safetensors read by name (checkpoint) or quantized as it loads (requantize), a GGUF file's header,
config, tokenizer and blocks (gguf/), and the Linear weights packed for oneDNN (packing)."""
