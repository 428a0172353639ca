"""Where the weights go and in what: the device and dtype a spec asks for on this machine (what a
spec cannot check without torch), from_pretrained's placement (a device map, bitsandbytes), and
what a user is told where a step's rows round otherwise than plain decoding's one row."""

from __future__ import annotations

from pathlib import Path

import torch

from ladechat.engine.kernels import int4
from ladechat.engine.load import packing
from ladechat.engine.load.spec import LoadError, LoadSpec
from ladechat.paths import cache_root

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX), from /proc/cpuinfo unless given."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set(cpuinfo.split())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    """The device --device names; a GPU always with its index (a device map needs one)."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = "a CPU-only torch build" if torch.version.cuda is None else "no visible CUDA device"
            raise LoadError(f"--device {name} asked for a GPU, but CUDA is not available here ({build}); "
                            "use --device cpu")
        index = name.removeprefix("cuda").removeprefix(":")
        count = torch.cuda.device_count()
        if index and not (index.isdigit() and int(index) < count):
            raise LoadError(f"--device {name}: no such GPU ({count} visible: cuda:0 to cuda:{count - 1})")
        return torch.device("cuda", int(index) if index else torch.cuda.current_device())
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps" and torch.backends.mps.is_available():
        return torch.device("mps")
    raise LoadError(f"unknown or unavailable --device {name!r} (choose auto, cpu, cuda, cuda:N)")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    return choose_dtype(name, device.type, name == "auto" and has_native_bf16(device))


def choose_dtype(name: str, device_type: str, native_bf16: bool) -> torch.dtype:
    """--dtype NAME on a device of this type, which computes bf16 natively or not. auto: bf16 where
    native; else fp16 on a GPU (T4 and V100 only emulate bf16, several times slower) and fp32 elsewhere."""
    if name == "auto":
        if native_bf16 and device_type in ("cuda", "cpu"):
            return torch.bfloat16
        return torch.float16 if device_type == "cuda" else torch.float32
    if name not in DTYPES:
        raise LoadError(f"unknown --dtype {name!r} (choose auto, float32, bfloat16, float16)")
    return DTYPES[name]


def has_native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        if torch.version.hip:  # ROCm GPUs compute bf16; their CUDA compute capability means nothing
            return torch.cuda.is_bf16_supported(including_emulation=False)
        # is_bf16_supported() asks about the current device, which need not be the chosen cuda:N;
        # bf16 units came with Ampere (compute capability 8.0).
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu" and cpu_has_native_bf16()


def arguments(spec: LoadSpec, device: torch.device) -> dict:
    """from_pretrained's device_map (and max_memory) arguments. Quantized weights cannot be moved with
    .to() after loading, so they are placed on --device while they load; without a device map
    transformers would put them on the current GPU whatever --device says. Other weights go straight
    to a GPU too (read into CPU memory first, a model would need its size in RAM and a second copy);
    on the CPU they need no map."""
    if spec.device_map:
        kwargs: dict = {"device_map": spec.device_map}
        if spec.max_memory is not None:
            # Layers that fit nowhere are offloaded to disk, into a folder of ours.
            kwargs["max_memory"] = {int(d) if d.isdigit() else d: size for d, size in spec.memory_limits}
            kwargs["offload_folder"] = str(cache_root() / "offload")
        return kwargs
    if spec.load_in_4bit or spec.load_in_8bit or device.type != "cpu":
        return {"device_map": {"": str(device)}}
    return {}


def checked(spec: LoadSpec) -> tuple[torch.device, torch.dtype]:
    """The device and dtype `spec` asks for on this machine (the spec checked itself when built)."""
    # --quantize's blocks run on the CPU: there by default, whatever GPU there is
    device = resolve_device("cpu" if spec.quantize and spec.device == "auto" else spec.device)
    if spec.quantize and device.type != "cpu":
        raise LoadError(f"--quantize runs on ladechat's CPU kernels, not on {device}; there --load-in-4bit or "
                        "--load-in-8bit quantize with bitsandbytes")
    dtype = resolve_dtype(spec.dtype, device)
    if spec.weights == "int4" and not int4.supported(device):
        raise LoadError(f"--weights int4 runs on an x86-64 CPU with torch's int4 kernel "
                        f"(torch.ops.aten.{int4.KERNEL}), not on {device}; use --weights auto")
    if spec.weights == "packed" and not packing.supported(device, dtype):
        raise LoadError(f"--weights packed needs an x86-64 CPU with oneDNN (bf16: with native bf16), "
                        f"not {device} in {str(dtype).removeprefix('torch.')}; use --weights auto")
    return device, dtype


def quantization_config(spec: LoadSpec, dtype: torch.dtype, notices: list[str]) -> dict:
    """from_pretrained's quantization_config for --load-in-4bit / --load-in-8bit ({} for neither)."""
    if not (spec.load_in_4bit or spec.load_in_8bit):
        return {}
    flag = "--load-in-4bit" if spec.load_in_4bit else "--load-in-8bit"
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise LoadError(f"{flag} needs bitsandbytes, which is not installed or does not import ({exc}): "
                        "pip install 'ladechat[quant]'") from None
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=spec.load_in_4bit, load_in_8bit=spec.load_in_8bit,
                                                      bnb_4bit_compute_dtype=dtype if spec.load_in_4bit else None)}


def parting_notices(device_type: str, dtype: torch.dtype, four_bit: bool, eight_bit: bool) -> list[str]:
    """What a user is told where a lookahead step's rows need not round as plain decoding's one row
    does, so a greedy answer can part from plain decoding's after a near-tie (measured on an H200:
    BENCHMARKS.md). A GPU's products pick their kernel and reduction order by the number of rows;
    LLM.int8 splits outlier columns by all of a step's rows, on any device."""
    if eight_bit:
        return ["8-bit weights (LLM.int8) compute each row of a step in ways that depend on the other rows, "
                "so lookahead answers can differ from plain decoding after a near-tie"
                + ("; --load-in-4bit keeps them identical" if device_type == "cpu" else "")]
    if device_type != "cuda":
        return []
    if four_bit:
        return [("4-bit weights (bitsandbytes) on a GPU run a one-row step on another kernel than a step of "
                 "several rows, so lookahead answers can differ from plain decoding after a near-tie")]
    if dtype in (torch.bfloat16, torch.float16):
        return [(f"on a GPU in {str(dtype).removeprefix('torch.')} a lookahead step's rows can round differently "
                 "from plain decoding's one row, so an answer can part from plain decoding's after a near-tie "
                 "(--dtype float32 makes that rarer)")]
    return []
