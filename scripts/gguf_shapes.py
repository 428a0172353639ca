#!/usr/bin/env python3
"""GGUF files of real model shapes with random weights, as users download them (issue #41): an F16
file written with gguf-py, one tensor at a time (a 7B shape never sits in memory whole), then, with
--quantize, llama.cpp's own `llama-quantize` into the block layouts of the files people run
(Q4_K_M above all). The tokenizer is the embedded model's (its 49,152-token vocabulary, so the
embedding and the output layer are smaller than the real models' 32,000-128,256 x hidden for the
Llama 3 shapes and larger for Llama 2's): speed, memory and load time are real; what it says is noise.

    python3 scripts/gguf_shapes.py llama-3.2-1b /tmp/1b-f16.gguf --quantize Q4_K_M /tmp/1b-q4km.gguf
    python3 scripts/gguf_shapes.py llama-2-7b /tmp/7b-f16.gguf --quantize Q4_0 /tmp/7b-q4_0.gguf
    python3 scripts/gguf_shapes.py --vocab-only /tmp/vocab.gguf     # the tokenizer alone (~1 MB), to carry
    python3 scripts/gguf_shapes.py llama-3.2-1b /tmp/1b-f16.gguf --tokenizer-from /tmp/vocab.gguf

llama-quantize: .llama.cpp/bin/llama-quantize (bash scripts/llama_cpp.sh builds it) or --llama-quantize PATH.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# hidden, intermediate, layers, heads, kv heads, context, tied embeddings, rope base
SHAPES = {
    "tiny": (256, 512, 2, 4, 2, 2048, True, 10000.0),  # a dry run of a script meant for a real size
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 131072, True, 500000.0),
    "llama-3.2-3b": (3072, 8192, 28, 24, 8, 131072, True, 500000.0),
    "llama-2-7b": (4096, 11008, 32, 32, 32, 4096, False, 10000.0),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 131072, False, 500000.0),
}


def tokenizer_fields(reader) -> list:
    """The embedded model's tokenizer.* fields: (key, value, type, array sub-type)."""
    from gguf import GGUFValueType

    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        out.append((key, field.contents(), kind, sub))
    return out


def tokenizer_source(path: Path | None) -> Path:
    if path is not None:
        return path
    from ladechat.engine.load.gguf.files import embedded_gguf

    return embedded_gguf()


def write_vocab(source: Path, path: Path) -> None:
    """A GGUF holding `source`'s tokenizer fields and no tensors (a machine without the embedded
    model's package makes shapes from it)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value, kind, sub in tokenizer_fields(gguf.GGUFReader(source)):
        writer.add_key_value(key, value, kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def random_f16(rng, dims: tuple[int, ...], period: int = (1 << 24) + 7):
    """N(0, 0.02) weights in F16; past `period` values they repeat (shifted against the rows: the
    period is no multiple of a row), which keeps an 8B shape's writing to seconds and changes nothing
    a timing or a memory figure sees."""
    size = int(np.prod(dims))
    block = (rng.standard_normal(min(size, period), dtype=np.float32) * 0.02).astype(np.float16)
    return np.resize(block, size).reshape(dims)


def write_f16(shape: str, path: Path, seed: int = 0, tokenizer: Path | None = None) -> None:
    import gguf

    hidden, inter, layers, heads, kv_heads, context, tied, rope = SHAPES[shape]
    fields = tokenizer_fields(gguf.GGUFReader(tokenizer_source(tokenizer)))
    vocab = len(next(value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens"))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random {shape}")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, kind, sub in fields:
        writer.add_key_value(key, value, kind, sub_type=sub)
    head_dim = hidden // heads
    tensors = [("token_embd.weight", (vocab, hidden))]
    for layer in range(layers):
        tensors += [(f"blk.{layer}.attn_norm.weight", (hidden,)), (f"blk.{layer}.ffn_norm.weight", (hidden,)),
                    (f"blk.{layer}.attn_q.weight", (hidden, hidden)),
                    (f"blk.{layer}.attn_k.weight", (kv_heads * head_dim, hidden)),
                    (f"blk.{layer}.attn_v.weight", (kv_heads * head_dim, hidden)),
                    (f"blk.{layer}.attn_output.weight", (hidden, hidden)),
                    (f"blk.{layer}.ffn_gate.weight", (inter, hidden)), (f"blk.{layer}.ffn_up.weight", (inter, hidden)),
                    (f"blk.{layer}.ffn_down.weight", (hidden, inter))]
    tensors.append(("output_norm.weight", (hidden,)))
    if not tied:
        tensors.append(("output.weight", (vocab, hidden)))
    for name, dims in tensors:  # norms in F32, as llama.cpp's converter writes them
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in tensors:
        if len(dims) == 1:
            data = np.ones(dims, np.float32)
        else:
            data = random_f16(rng, dims)
        writer.write_tensor_data(data)
    writer.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("f16", nargs="?", type=Path, help="the F16 file to write")
    parser.add_argument("--tokenizer-from", type=Path, help="a GGUF whose tokenizer the file gets "
                        "(default: the embedded model's)")
    parser.add_argument("--vocab-only", type=Path, metavar="OUT",
                        help="write the tokenizer alone (of --tokenizer-from) to OUT and stop")
    parser.add_argument("--quantize", nargs=2, metavar=("TYPE", "OUT"), help="e.g. Q4_K_M out.gguf")
    parser.add_argument("--llama-quantize", default=str(REPO / ".llama.cpp" / "bin" / "llama-quantize"))
    args = parser.parse_args(argv)
    if args.vocab_only:
        write_vocab(tokenizer_source(args.tokenizer_from), args.vocab_only)
        return 0
    if args.shape is None or args.f16 is None:
        parser.error("a shape and the F16 file to write are needed")
    start = time.monotonic()
    if not args.f16.is_file():  # written whole or not at all: a cut-short run leaves no file behind
        partial = args.f16.with_name(args.f16.name + ".partial")
        write_f16(args.shape, partial, tokenizer=args.tokenizer_from)
        partial.rename(args.f16)
        print(f"{args.f16}: {args.f16.stat().st_size / 2**30:.2f} GiB in {time.monotonic() - start:.0f} s",
              file=sys.stderr)
    if args.quantize:
        kind, out = args.quantize
        if not Path(args.llama_quantize).is_file():
            print(f"gguf_shapes.py: no llama-quantize at {args.llama_quantize} (bash scripts/llama_cpp.sh builds it)",
                  file=sys.stderr)
            return 1
        subprocess.run([args.llama_quantize, str(args.f16), out, kind], check=True, stdout=subprocess.DEVNULL)
        print(f"{out}: {Path(out).stat().st_size / 2**30:.2f} GiB ({kind})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
