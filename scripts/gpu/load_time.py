"""How long a GGUF takes to read onto a device, its dense tensors dequantized by torch where they go
(engine/load/gguf/dequantize.py) against gguf-py's numpy on the host, in one process, and whether both
give the same weights bit for bit.

    python3 scripts/gpu/load_time.py RESULTS NAME GGUF [--device cuda] [--dtype bfloat16]

Loads the file twice with ladechat's load(): gguf-py first (which also writes the file's prepared
folder, so its `load_s` includes the metadata's one parse), then torch. Appends one JSON line to
RESULTS: each load's seconds, the part spent in gguf_files.read_tensors, the GPU's peak allocation, and
`same_weights`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def timed_load(path: str, device: str, dtype: str, by_torch: bool) -> tuple[object, dict]:
    import torch

    from ladechat.engine.load.gguf import dequantize
    from ladechat.engine.load.gguf import files as gguf_files
    from ladechat.engine.load.loading import LoadSpec, load

    spent = {"read_tensors_s": 0.0}
    read_tensors, supported = gguf_files.read_tensors, dequantize.supported

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return read_tensors(*args, **kwargs)
        finally:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            spent["read_tensors_s"] += time.perf_counter() - start

    gguf_files.read_tensors = timed
    if not by_torch:
        dequantize.supported = lambda kind: False
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        loaded = load(LoadSpec(model=path, device=device, dtype=dtype, pack_weights=False))
    finally:
        gguf_files.read_tensors, dequantize.supported = read_tensors, supported
    spent["load_s"] = time.perf_counter() - start
    if device.startswith("cuda"):
        spent["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return loaded.model, {key: round(value, 2) for key, value in spent.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("name")
    parser.add_argument("gguf")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    import torch

    record = {"name": args.name, "gguf": args.gguf, "device": args.device, "dtype": args.dtype,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    old, record["gguf_py"] = timed_load(args.gguf, args.device, args.dtype, by_torch=False)
    old_state = old.state_dict()
    new, record["torch"] = timed_load(args.gguf, args.device, args.dtype, by_torch=True)
    new_state = new.state_dict()
    differ = [name for name, tensor in old_state.items() if not torch.equal(new_state[name], tensor)]
    record["same_weights"] = not differ and set(new_state) == set(old_state)
    record["differ"] = differ[:5]
    with open(args.results, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)
    return 0 if record["same_weights"] else 1


if __name__ == "__main__":
    sys.exit(main())
