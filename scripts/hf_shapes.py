#!/usr/bin/env python3
"""Hugging Face checkpoints of real model shapes with random weights (bf16 safetensors, in shards
written one at a time, so an 8B shape never sits in memory whole), with the embedded model's
tokenizer: the input of `--quantize` at a real size (speed, memory and load time are real; what it
says is noise). The shapes are scripts/gguf_shapes.py's.

    python3 scripts/hf_shapes.py llama-3.2-1b /tmp/shapes/1b-hf
    ladechat ask --quantize q4 --model /tmp/shapes/1b-hf "Hi"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_shapes import SHAPES, random_f16  # noqa: E402

SHARD_BYTES = 2 << 30


def tensors(shape: str, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    hidden, inter, layers, heads, kv_heads, _, tied, _ = SHAPES[shape]
    kv = kv_heads * (hidden // heads)
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        prefix = f"model.layers.{i}"
        out += [(f"{prefix}.input_layernorm.weight", (hidden,)), (f"{prefix}.post_attention_layernorm.weight", (hidden,)),
                (f"{prefix}.self_attn.q_proj.weight", (hidden, hidden)), (f"{prefix}.self_attn.k_proj.weight", (kv, hidden)),
                (f"{prefix}.self_attn.v_proj.weight", (kv, hidden)), (f"{prefix}.self_attn.o_proj.weight", (hidden, hidden)),
                (f"{prefix}.mlp.gate_proj.weight", (inter, hidden)), (f"{prefix}.mlp.up_proj.weight", (inter, hidden)),
                (f"{prefix}.mlp.down_proj.weight", (hidden, inter))]
    out.append(("model.norm.weight", (hidden,)))
    if not tied:
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


def write(shape: str, folder: Path, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    from ladechat.engine.load.gguf.files import embedded_gguf

    source = embedded_gguf()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    hidden, inter, layers, heads, kv_heads, context, tied, rope = SHAPES[shape]
    vocab = len(tokenizer)
    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
                         tie_word_embeddings=tied, rope_theta=rope, rms_norm_eps=1e-5, dtype="bfloat16",
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rng = np.random.default_rng(seed)
    shard: dict = {}
    files: dict[str, str] = {}
    names = tensors(shape, vocab)

    def flush() -> None:
        name = f"model-{len(set(files.values())) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        files.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, dims in names:
        data = np.ones(dims, np.float32) if len(dims) == 1 else random_f16(rng, dims).astype(np.float32)
        shard[name] = torch.from_numpy(data).to(torch.bfloat16)
        if sum(t.numel() * 2 for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    total = sum(int(np.prod(dims)) * 2 for _, dims in names)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": files}, indent=1))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("folder", type=Path, help="the folder to write")
    args = parser.parse_args(argv)
    start = time.monotonic()
    write(args.shape, args.folder)
    size = sum(f.stat().st_size for f in args.folder.glob("*.safetensors"))
    print(f"{args.folder}: {size / 2**30:.2f} GiB in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
