"""Whether a model honours a lookahead step's tree mask (an explicit 4D mask with position ids):
three tiny forward passes, their yes kept per local model folder; transformers' eager attention
where only that honours it."""

from __future__ import annotations

from pathlib import Path

import torch

from ladechat.engine.kernels import int4, q4, q6, q8
from ladechat.engine.load import readers
from ladechat.engine.load.spec import LoadError
from ladechat.engine.models import llama, transformers_model
from ladechat.paths import cache_root, source_digest


def check_tree_mask(model, name: str, attn: str, folder: str | None, notices: list[str]):
    """The model to run, once it honours the step's 4D mask with explicit positions (LoadError
    where it does not): itself, or transformers' model switched to eager attention (with a notice)
    where only that does (a Llama's twin over its modules: its own steps do not run eager)."""
    try:
        if honours_tree_mask(model, folder, model.config._attn_implementation):
            return model
    except NotFinite as exc:
        raise LoadError(f"{name}: {exc}") from None
    if isinstance(model, llama.Llama):
        model = model.transformers_twin()
    if attn != "eager":
        model.set_attn_implementation("eager")
        try:
            honoured = mask_probe(model)
        except NotFinite as exc:
            raise LoadError(f"{name} under eager attention: {exc}") from None
        if honoured:
            notices.append(f"{name} ignores 4D masks under {attn}; switched to eager attention")
            return model
    raise LoadError(f"{name} does not honour a 4D attention mask with position ids, "
                    "so lookahead cannot run on it")


def honours_tree_mask(model, folder: str | None, attn: str) -> bool:
    """mask_probe(model), remembered for a local model folder: a yes is kept per folder (its files'
    sizes and times), dtype, device type, attention kernel, library versions and our own code that
    builds the mask and attends under it, since the probe's three forward passes are a noticeable
    part of every start on a small CPU."""
    if folder is None:
        return mask_probe(model)
    import hashlib
    import json

    import transformers

    from ladechat.engine import layout
    from ladechat.engine.kernels import attention

    files = readers.model_files(Path(folder))
    key = json.dumps(["v1", str(Path(folder).resolve()), files, str(model.dtype), model.device.type, attn,
                      torch.__version__, transformers.__version__, source_digest(attention.__file__, layout.__file__)])
    path = cache_root() / "mask-probe" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if path.is_file():
        return True
    if not mask_probe(model):
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(key + "\n")
    except OSError:  # a read-only cache only costs the probe next time
        pass
    return True


class NotFinite(ValueError):
    """mask_probe: the model's plain logits are not finite numbers."""


def mask_probe(model) -> bool:
    """Does the model honour an explicit 4D mask + position ids? Runs three tiny forwards.

    [a, b, c] where c may not see b and sits at position 1 must give c the same logits as the
    plain sequence [a, c].
    """
    from ladechat.engine.layout import StepLayout, step_inputs

    model = transformers_model(model)  # a Llama: transformers' forward over its modules and kernels
    device, dtype = model.device, model.dtype
    vocab = model.config.get_text_config().vocab_size
    a, b, c = 1 % vocab, 2 % vocab, 3 % vocab
    layout = StepLayout([a, b, c], [-1, 0, 0], 3, range(3), [{}, {}, {}], [])
    ids, positions, mask = step_inputs(layout, 0, dtype, device)
    with torch.inference_mode():
        tree = model(input_ids=ids, position_ids=positions, attention_mask=mask).logits[0, 2].float()
        plain = model(input_ids=torch.tensor([[a, c]], device=device)).logits[0, 1].float()
        leak = model(input_ids=torch.tensor([[a, b, c]], device=device)).logits[0, 2].float()
    if not torch.isfinite(plain).all():  # no mask in that pass: the weights themselves are at fault
        raise NotFinite("its logits are NaN or infinite on a plain forward pass: the weights are not numbers "
                        "(a corrupt or badly converted file)")
    # 4-bit Linear modules round their activations (to int8 codes, or bf16 on torch's kernel): their
    # rows are as close as bf16's
    rounded_products = any(type(m) in (int4.Int4Linear, q4.Q4Linear, q6.Q6Linear, q8.Q8Linear)
                           for m in model.modules())
    tol = 1e-3 if dtype == torch.float32 and not rounded_products else 5e-2
    close = torch.allclose(tree, plain, atol=tol * max(1.0, float(plain.abs().max())), rtol=0)
    return close and not torch.allclose(tree, leak, atol=1e-6, rtol=0)
