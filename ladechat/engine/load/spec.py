"""What to load and how: the record every front end builds from its flags and the loader trusts.

It is checked when it is built, without importing torch, so a bad flag or two flags that cannot go
together are one line (LoadError) before anything slow runs. What depends on the machine (is there
a GPU, does this CPU pack bf16: placement.checked; is a compiler installed) the loader checks."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ladechat.engine.load.gguf.files import EMBEDDED_NAME
from ladechat.errors import UserError

DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
ATTENTION = ("sdpa", "eager", "flash")
# --weights: auto (the fastest this machine has: a GGUF's 4-bit blocks at 4 bits on ladechat's
# kernel, else torch's int4 one; the other Linear weights packed for oneDNN), dense (as transformers
# loads them), packed (all packed for oneDNN, none at 4 bits), int4 (a GGUF's 4-bit blocks at 4
# bits, the rest packed).
WEIGHTS = ("auto", "dense", "packed", "int4")
QUANTIZE = {"q4": "Q4_0", "q8": "Q8_0"}  # --quantize's values and the block types they make
MIN_CONTEXT = 64


class LoadError(UserError):
    """Loading failed for a reason the user can act on; the message is one line."""


@dataclass(frozen=True)
class LoadSpec:
    model: str | None = None  # None: the embedded default
    dtype: str = "auto"  # one of DTYPE_NAMES
    device: str = "auto"  # auto, cpu, mps, cuda or cuda:N
    attn: str = "sdpa"  # one of ATTENTION
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    device_map: str | None = None
    max_memory: str | None = None  # for device_map, as --max-memory gives it: '0=20GiB,cpu=64GiB'
    # Linear weights in oneDNN's packed layout where measured to pay (x86-64 CPUs, fp32/bf16;
    # engine/load/packing.py). Off for compiled steps, whose graphs take the model's own Linear
    # modules: then every Linear stays as loaded, whatever `weights` says (for_steps).
    pack_weights: bool = True
    weights: str = "auto"  # one of WEIGHTS
    context_size: int | None = None  # --ctx: the most tokens a conversation holds; None: context.context_cap's default
    quantize: str | None = None  # --quantize: a Hugging Face model's weights into blocks at load (QUANTIZE)
    # Run a family ladechat has its own model file for (engine/models/) by that file; off for
    # compiled steps, whose graphs trace transformers' forward
    own_forward: bool = True

    def __post_init__(self) -> None:
        _check_names(self)
        _check_together(self)

    @property
    def memory_limits(self) -> tuple[tuple[str, str], ...]:
        """--max-memory as (device, size) pairs, e.g. (('0', '20GiB'), ('cpu', '64GiB'))."""
        return parse_max_memory(self.max_memory) if self.max_memory is not None else ()

    def for_steps(self, compiled: bool) -> LoadSpec:
        """This spec for steps that are compiled or not: compiled steps trace the model's own Linear
        modules and transformers' forward (no packing, no blocks, no model file of ours)."""
        if not compiled:
            return self
        if self.weights not in ("auto", "dense"):
            raise LoadError(f"--compile compiles the model's own Linear modules: it cannot run --weights {self.weights}")
        if self.quantize:
            raise LoadError("--compile compiles the model's own Linear modules: it cannot run --quantize")
        return replace(self, pack_weights=False, own_forward=False)


def _check_names(spec: LoadSpec) -> None:
    """Each option on its own: a known name, a number in range."""
    if spec.dtype not in DTYPE_NAMES:
        raise LoadError(f"unknown --dtype {spec.dtype!r} (choose auto, float32, bfloat16, float16)")
    if spec.device not in ("auto", "cpu", "mps", "cuda") and not spec.device.startswith("cuda:"):
        raise LoadError(f"unknown or unavailable --device {spec.device!r} (choose auto, cpu, cuda, cuda:N)")
    if spec.attn not in ATTENTION:
        raise LoadError(f"unknown --attn {spec.attn!r} (choose {', '.join(ATTENTION)})")
    if spec.weights not in WEIGHTS:
        raise LoadError(f"unknown --weights {spec.weights!r} (choose {', '.join(WEIGHTS)})")
    if spec.quantize is not None and spec.quantize not in QUANTIZE:
        raise LoadError(f"unknown --quantize {spec.quantize!r} (choose {', '.join(QUANTIZE)})")
    if spec.context_size is not None and spec.context_size < MIN_CONTEXT:
        raise LoadError(f"--ctx must be at least {MIN_CONTEXT} tokens, got {spec.context_size}")
    spec.memory_limits  # noqa: B018 (parsed to be checked)


def _check_together(spec: LoadSpec) -> None:
    """Options that cannot go together, whatever the model and machine."""
    if spec.load_in_4bit and spec.load_in_8bit:
        raise LoadError("choose one of --load-in-4bit and --load-in-8bit")
    placed = [flag for flag, on in (("--load-in-4bit", spec.load_in_4bit), ("--load-in-8bit", spec.load_in_8bit),
                                    ("--device-map", bool(spec.device_map))) if on]
    if spec.weights in ("packed", "int4") and placed:
        raise LoadError(f"--weights {spec.weights} cannot be combined with {placed[0]}, which places the weights itself")
    if spec.quantize is not None:
        if placed:
            raise LoadError(f"--quantize cannot be combined with {placed[0]}: choose one way to place the weights")
        if spec.weights != "auto":
            raise LoadError(f"--quantize puts the Linear weights on ladechat's kernels: --weights {spec.weights} "
                            "cannot go with it")
    if spec.max_memory is not None and not spec.device_map:
        raise LoadError("--max-memory needs --device-map (e.g. --device-map auto)")
    if (spec.load_in_4bit or spec.load_in_8bit or spec.quantize) and (spec.model is None or spec.model.endswith(".gguf")):
        name = Path(spec.model).name if spec.model else EMBEDDED_NAME
        flags = "--quantize takes" if spec.quantize else "--load-in-4bit and --load-in-8bit take"
        raise LoadError(f"{name} is a GGUF file, already quantized: {flags} a Hugging Face model (its own blocks run "
                        "at their bits here)")


def parse_max_memory(text: str) -> tuple[tuple[str, str], ...]:
    """'0=20GiB,cpu=64GiB' -> (('0', '20GiB'), ('cpu', '64GiB')); devices: N, cuda:N, cpu, disk."""
    pairs = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        device, eq, size = item.partition("=")
        device = device.strip().removeprefix("cuda:")
        size = size.strip()
        ok_size = size[:1].isdigit() and size.rstrip("BbIiKkMmGgTt").replace(".", "", 1).isdigit()
        if not eq or not ok_size or not (device.isdigit() or device in ("cpu", "disk")):
            raise LoadError(f"--max-memory wants DEVICE=SIZE pairs like '0=20GiB,cpu=64GiB', got {item!r}")
        pairs.append((device, size))
    if not pairs:
        raise LoadError("--max-memory is empty")
    return tuple(pairs)
