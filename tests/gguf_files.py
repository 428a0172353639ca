"""Tiny Llama GGUF files the tests write with gguf-py (2 layers, 256 wide, a 96-token vocabulary),
each Linear weight of the type a test asks for, and what every test of such a file checks last:
lookahead's answer is plain decoding's."""

from pathlib import Path

import gguf
import numpy as np

from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate

HIDDEN, FFN, VOCAB, LAYERS = 256, 512, 96, 2
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // 2, HIDDEN), "attn_v": (HIDDEN // 2, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
          "ffn_down": (HIDDEN, FFN)}


def write_llama(path: Path, weight, embedding: tuple, output: tuple | None = None) -> Path:
    """A 2-layer Llama (4 heads, 2 of keys and values; q and k permuted on loading, as llama.cpp's
    files need) at `path`. weight(layer, name, rows, cols) -> (data, GGML type or None for data's
    own dtype) for each Linear weight (SHAPES' names); embedding and output: (data, type), no
    output: the output layer is the embedding's (tied)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, 512), (writer.add_embedding_length, HIDDEN),
                       (writer.add_feed_forward_length, FFN), (writer.add_block_count, LAYERS),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 2), (writer.add_rope_freq_base, 1e4),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, VOCAB)):
        add(value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(VOCAB - 3)])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([1] * VOCAB)

    def add(name: str, data: np.ndarray, kind) -> None:
        writer.add_tensor(name, data, raw_dtype=kind) if kind is not None else writer.add_tensor(name, data)

    add("token_embd.weight", *embedding)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    if output is not None:
        add("output.weight", *output)
    for layer in range(LAYERS):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, (rows, cols) in SHAPES.items():
            add(f"blk.{layer}.{name}.weight", *weight(layer, name, rows, cols))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_lookahead_answers_as_plain(model, prompt: list[int], tokens: int = 48) -> None:
    """Plain decoding and lookahead (W 5, N 4, G 5) give the same `tokens` tokens, and lookahead
    accepted more than one token in some step (its steps of many rows were used)."""
    answers = {}
    for name, la in (("plain", LookaheadConfig(enabled=False, store=False)),
                     ("lookahead", LookaheadConfig(window=5, ngram=4, candidates=5, store=False))):
        done = list(generate(Session(model, la), prompt, SamplingConfig(max_new_tokens=tokens), ()))[-1]
        answers[name] = (list(done.text_tokens), done.stats)
    assert answers["lookahead"][0] == answers["plain"][0] and len(answers["plain"][0]) == tokens
    assert sum(n for k, n in answers["lookahead"][1].accepted_histogram.items() if k >= 2) > 0
