"""How close the embedded model's 4-bit paths stay to its dense fp32 weights (the GGUF's blocks
dequantized exactly): teacher-forced over real text (the dev sets' prompts, with GSM8K's answers
and HumanEval's solutions), the share of positions whose next token agrees with the dense model's
and the mean KL divergence from it, for ladechat's kernels (int8 activations) and torch's int4
kernel (bf16 activations) on the same blocks. Behind the figures in BENCHMARKS.md and the README.

    python scripts/fidelity.py [--per-set 6] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ladechat.engine.kernels import int4, q4
from ladechat.engine.load.loading import LoadSpec, load

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def texts(per_set: int) -> list[str]:
    found = []
    for name, extra in (("mtbench", None), ("humaneval", "canonical_solution"), ("gsm8k", "answer")):
        with open(DATA / f"{name}-dev.jsonl") as fh:
            for line in list(fh)[:per_set]:
                item = json.loads(line)
                found.append(item["turns"][0] + (f"\n{item[extra]}" if extra else ""))
    return found


def on_torch_int4(model) -> None:
    """The same blocks on torch's int4 kernel (what runs where no compiler builds ladechat's)."""
    for name, module in list(model.named_modules()):
        if type(module) is q4.Q4Linear:
            model.set_submodule(name, int4.Int4Linear.from_kernel_layout(module.tiles, module.scales, module.lows,
                                                                         module.bias, module.kind))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-set", type=int, default=6, help="items of each dev set")
    parser.add_argument("--tokens", type=int, default=256, help="most tokens of each text")
    args = parser.parse_args()
    if not DATA.is_dir():
        raise SystemExit(f"fidelity: no prompt sets at {DATA}")
    dense = load(LoadSpec(dtype="float32", device="cpu", weights="dense"))
    ours = load(LoadSpec(dtype="float32", device="cpu", weights="int4"))
    torch_kernel = load(LoadSpec(dtype="float32", device="cpu", weights="int4"))
    on_torch_int4(torch_kernel.model)
    paths = {"ladechat's kernels": ours.model, "torch's int4 kernel": torch_kernel.model}
    print(f"{ours.weights}\nagainst: the dense fp32 model")
    agree = dict.fromkeys(paths, 0)
    kl = dict.fromkeys(paths, 0.0)
    positions = 0
    with torch.inference_mode():
        for text in texts(args.per_set):
            ids = torch.tensor([dense.tokenizer(text)["input_ids"][: args.tokens]])
            reference = dense.model(ids).logits[0].float().log_softmax(-1)
            positions += ids.shape[1]
            for name, model in paths.items():
                logp = model(ids).logits[0].float().log_softmax(-1)
                agree[name] += int((logp.argmax(-1) == reference.argmax(-1)).sum())
                kl[name] += float((reference.exp() * (reference - logp)).sum())
    for name in paths:
        print(f"{name}: next token agrees at {agree[name]}/{positions} = {agree[name] / positions:.4f}, "
              f"mean KL {kl[name] / positions:.5f} nats")


if __name__ == "__main__":
    main()
