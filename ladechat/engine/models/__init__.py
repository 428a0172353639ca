"""The model families ladechat runs itself: one file per family owns its layers (under the
checkpoint's own names), its prefill and its step. Every other family, a GPU, a device map over
several devices and `--compile` run transformers' forward (engine/runner.py's DynamicRunner and
StaticRunner)."""


def transformers_model(model):
    """transformers' model of `model`: itself, or, for a model ladechat runs itself, the twin
    over its very modules (what HF's generate runs in the bench and the tests)."""
    from ladechat.engine.models.llama import Llama

    return model.transformers_twin() if isinstance(model, Llama) else model
