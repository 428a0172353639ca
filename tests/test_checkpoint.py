"""A Llama-family Hugging Face checkpoint read by name from its safetensors files into
engine/models/llama.py's model (engine/load/checkpoint.py), without transformers' from_pretrained;
what that reader cannot take whole still loads through from_pretrained."""

import copy
import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import COMMON, FAMILIES, tiny_tokenizer
from transformers import AutoModelForCausalLM, GenerationConfig

from ladechat.engine.load import checkpoint, memory, placement
from ladechat.engine.load.loading import LoadError, LoadSpec, load
from ladechat.engine.models import llama


def saved(path, family: str = "llama", dtype: torch.dtype = torch.float32, shard: str | None = None, **changes):
    """A tiny random model of `family` saved in `dtype` with tiny_tokenizer() (in shards of at most
    `shard` where given), and a generation_config.json of its own."""
    config_cls, model_cls, extra = FAMILIES[family]
    tokenizer = tiny_tokenizer()
    torch.manual_seed(3)
    model = model_cls(config_cls(**{**COMMON, **extra, "vocab_size": len(tokenizer), **changes})).to(dtype)
    model.generation_config = GenerationConfig(temperature=0.6, top_p=0.9, do_sample=True, eos_token_id=2)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    tokenizer.save_pretrained(path)
    return path


def reference(folder, dtype: torch.dtype):
    """transformers' own load of the folder (from_pretrained)."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@pytest.fixture
def no_from_pretrained(monkeypatch):
    """from_pretrained made to fail, its calls counted: a load that reads the checkpoint itself never asks."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("from_pretrained was called")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    return calls


@pytest.mark.parametrize("family,saved_in,run_in,shard,changes", [
    ("llama", torch.float32, "float32", None, {}),
    ("llama", torch.bfloat16, "float32", "40KB", {"attention_bias": True}),  # shards; cast as it is read
    ("qwen2", torch.bfloat16, "bfloat16", "40KB", {"tie_word_embeddings": True}),  # tied: no lm_head in the files
    ("mistral", torch.float16, "float16", None, {}),
])
def test_a_checkpoint_of_the_family_is_read_by_name_into_the_llama(tmp_path, monkeypatch, family, saved_in, run_in,
                                                                   shard, changes):
    """Every parameter is the one from_pretrained reads, bit for bit, under the same name (a tied
    output layer the embedding itself), the folder's generation config is the model's, and the
    Llama scores a sequence as transformers' model does; from_pretrained is never called."""
    folder = saved(tmp_path / family, family, saved_in, shard, **changes)
    if shard:
        assert (folder / checkpoint.INDEX).is_file() and len(list(folder.glob("*.safetensors"))) > 1
    dtype = placement.DTYPES[run_in]
    theirs = reference(folder, dtype)
    refused = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: refused.append(a))
    own = load(LoadSpec(model=str(folder), dtype=run_in, device="cpu", weights="dense")).model
    assert not refused and isinstance(own, llama.Llama) and own.dtype == dtype
    params = dict(own.named_parameters(remove_duplicate=False))
    assert set(params) == set(dict(theirs.named_parameters(remove_duplicate=False)))
    for name, param in theirs.named_parameters(remove_duplicate=False):
        assert params[name].dtype == param.dtype and torch.equal(params[name], param), name
    assert (own.lm_head.weight is own.model.embed_tokens.weight) is bool(changes.get("tie_word_embeddings"))
    assert (own.generation_config.temperature, own.generation_config.top_p) == (0.6, 0.9)
    ids = torch.tensor([[5, 9, 2, 7, 7, 1, 30, 31, 12, 60]])
    with torch.inference_mode():
        assert torch.equal(own(ids).logits, theirs(input_ids=ids).logits)


def with_tensors(folder, extra: dict[str, torch.Tensor]) -> None:
    """The folder's model.safetensors rewritten with `extra` tensors added."""
    path = folder / checkpoint.SINGLE
    save_file({**load_file(path), **extra}, path, {"format": "pt"})


def test_older_checkpoints_rotary_tables_are_not_read(tmp_path, no_from_pretrained):
    """A checkpoint that keeps each layer's rotary frequencies (older Llama ones) is still read by
    name: the model computes them."""
    folder = saved(tmp_path / "old")
    with_tensors(folder, {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)})
    assert isinstance(load(LoadSpec(model=str(folder), device="cpu", weights="dense")).model, llama.Llama)
    assert not no_from_pretrained


def test_what_the_reader_cannot_take_whole_goes_through_from_pretrained(tmp_path, monkeypatch):
    """A .bin checkpoint, and safetensors with a tensor the model has not, are read by
    from_pretrained (counted) and still run by the Llama; the weights are the same."""
    bin_folder = saved(tmp_path / "bin")
    state = reference(bin_folder, torch.float32).state_dict()
    (bin_folder / checkpoint.SINGLE).unlink()
    torch.save(state, bin_folder / "pytorch_model.bin")
    odd = saved(tmp_path / "odd")
    with_tensors(odd, {"model.extra.weight": torch.zeros(4)})
    assert checkpoint.misfit(llama.Llama.empty(reference(odd, torch.float32).config, torch.float32),
                             checkpoint.tensors(odd)) == "it has tensors the model has not (model.extra.weight)"
    real, calls = AutoModelForCausalLM.from_pretrained, []

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counted)
    for folder in (bin_folder, odd):
        own = load(LoadSpec(model=str(folder), dtype="float32", device="cpu", weights="dense")).model
        assert isinstance(own, llama.Llama) and calls[-1] == str(folder)
        assert torch.equal(own.model.layers[1].mlp.down_proj.weight, state["model.layers.1.mlp.down_proj.weight"])


def test_an_output_layer_of_its_own_under_a_tied_config_is_kept_as_transformers_keeps_it(tmp_path):
    """A checkpoint whose config ties the output layer to the embedding but whose file holds one of
    its own (some fine-tunes): from_pretrained keeps the file's where it differs, so the reader
    leaves it to from_pretrained, and the Llama runs that output layer."""
    folder = saved(tmp_path / "own-head", "qwen2", tie_word_embeddings=True)
    with_tensors(folder, {"lm_head.weight": torch.randn(len(tiny_tokenizer()), 64)})
    theirs = reference(folder, torch.float32)
    config = copy.deepcopy(theirs.config)
    assert checkpoint.misfit(llama.Llama.empty(config, torch.float32), checkpoint.tensors(folder)) == \
        "it has an output layer of its own, though its config ties it to the embedding"
    own = load(LoadSpec(model=str(folder), dtype="float32", device="cpu", weights="dense")).model
    assert isinstance(own, llama.Llama)
    assert torch.equal(own.lm_head.weight, theirs.lm_head.weight)
    assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == \
        (own.lm_head.weight is own.model.embed_tokens.weight)


def test_a_single_file_is_read_before_an_index_as_from_pretrained_reads_it(tmp_path):
    folder = saved(tmp_path / "both")
    (folder / checkpoint.INDEX).write_text(json.dumps({"weight_map": {"lm_head.weight": "stale.safetensors"}}))
    (folder / "stale.safetensors").write_bytes((folder / checkpoint.SINGLE).read_bytes())
    assert checkpoint.files(folder) == [folder / checkpoint.SINGLE]


def test_misfit_names_the_first_tensor_that_does_not_fit(tmp_path):
    folder = saved(tmp_path / "m")
    config = reference(folder, torch.float32).config
    found = checkpoint.tensors(folder)
    model = llama.Llama.empty(config, torch.float32)
    assert checkpoint.misfit(model, found) is None
    short = {name: where for name, where in found.items() if name != "model.norm.weight"}
    assert checkpoint.misfit(model, short) == "it has no tensor model.norm.weight"
    name = "model.layers.0.mlp.up_proj.weight"
    bent = {**found, name: checkpoint.Tensor(found[name].file, torch.float32, (64, 64))}
    assert checkpoint.misfit(model, bent) == f"its {name} is [64, 64], not [128, 64]"
    whole = {**found, name: checkpoint.Tensor(found[name].file, torch.int32, (128, 64))}
    assert checkpoint.misfit(model, whole) == f"its {name} is int32"


@pytest.mark.parametrize("damage", ["cut short", "a Git LFS pointer"])
def test_a_file_safetensors_refuses_is_left_to_from_pretrained_and_its_one_line_error(tmp_path, damage):
    folder = saved(tmp_path / "bad")
    path = folder / checkpoint.SINGLE
    if damage == "cut short":
        path.write_bytes(path.read_bytes()[:-100])
    else:  # what a clone without git-lfs holds
        path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 1024\n")
    assert checkpoint.tensors(folder) is None
    with pytest.raises(LoadError, match=r"^cannot load model .*bad: [^\n]+$"):
        load(LoadSpec(model=str(folder), device="cpu"))


def test_a_checkpoint_the_reader_cannot_parse_is_left_to_from_pretrained_and_its_error(tmp_path):
    folder = saved(tmp_path / "bad")
    path = folder / checkpoint.SINGLE
    path.write_bytes(struct.pack("<Q", 7) + b"{not js" + path.read_bytes()[8:])
    assert checkpoint.tensors(folder) is None
    with pytest.raises(LoadError, match=r"^cannot load model .*bad: [^\n]+$"):
        load(LoadSpec(model=str(folder), device="cpu"))
    (folder / checkpoint.INDEX).write_text(json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}))
    assert checkpoint.tensors(folder) is None  # a shard the index names is missing


def test_weights_cast_that_would_not_fit_in_memory_are_refused_before_reading(tmp_path, monkeypatch,
                                                                            no_from_pretrained):
    """Weights to be cast are copies, counted against the memory available before anything is read;
    in the file's own dtype they are the file's pages (--quantize reads them so), not counted."""
    folder = saved(tmp_path / "big", dtype=torch.bfloat16)
    monkeypatch.setattr(memory, "available_memory", lambda: 10_000)
    with monkeypatch.context() as patched:
        patched.setattr(checkpoint, "read_into", lambda *a, **k: pytest.fail("read"))
        with pytest.raises(LoadError, match=r"^not enough memory for .*big: its weights are \d+ MiB in float32, "
                                            r"and 0 MiB is available$"):
            load(LoadSpec(model=str(folder), dtype="float32", device="cpu"))
    assert isinstance(load(LoadSpec(model=str(folder), dtype="bfloat16", device="cpu", weights="dense")).model,
                      llama.Llama)


def test_auto_reads_the_checkpoint_in_its_configs_dtype_else_its_first_floats(tmp_path):
    """--quantize reads a checkpoint in its own dtype, as from_pretrained's dtype="auto" does."""
    folder = saved(tmp_path / "h", dtype=torch.float16)
    found = checkpoint.tensors(folder)
    config = reference(folder, torch.float32).config
    config.dtype = "bfloat16"
    assert checkpoint.checkpoint_dtype(found, config) == torch.bfloat16
    config.dtype = None
    assert checkpoint.checkpoint_dtype(found, config) == torch.float16


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file the process maps at the tensor's first byte (/proc/self/maps), or None."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        lines = maps.read().splitlines()
    for line in lines:
        fields = line.split()
        start, end = (int(n, 16) for n in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) > 5 else None
    return None


def test_weights_in_the_files_dtype_are_views_of_the_file_never_written_back(tmp_path):
    """In the file's dtype a weight is the file's own bytes, mapped (no copy), and a write to it
    stays in the process; cast to another dtype it is memory of its own."""
    folder = saved(tmp_path / "v")
    path = folder / checkpoint.SINGLE
    before = path.read_bytes()
    config = reference(folder, torch.float32).config
    kept_dtype, cast = llama.Llama.empty(config, torch.float32), llama.Llama.empty(config, torch.bfloat16)
    checkpoint.read_into(kept_dtype, checkpoint.tensors(folder), torch.float32)
    checkpoint.read_into(cast, checkpoint.tensors(folder), torch.bfloat16)
    weight = kept_dtype.model.layers[1].mlp.up_proj.weight
    assert mapped_file(weight) == str(path) and mapped_file(cast.model.layers[1].mlp.up_proj.weight) != str(path)
    with torch.no_grad():
        weight.add_(1.0)
    assert path.read_bytes() == before


def test_on_hf_mount_the_files_are_read_not_mapped(tmp_path, monkeypatch):
    """Where transformers reads a file into memory rather than mapping it (hf-mount's FUSE
    filesystem: a mapping deadlocks under parallel page faults), so does the reader."""
    from transformers import modeling_utils

    folder = saved(tmp_path / "mounted")
    monkeypatch.setattr(modeling_utils, "_is_on_hf_mount", lambda path: True)
    model = llama.Llama.empty(reference(folder, torch.float32).config, torch.float32)
    checkpoint.read_into(model, checkpoint.tensors(folder), torch.float32)
    assert mapped_file(model.model.layers[0].self_attn.q_proj.weight) != str(folder / checkpoint.SINGLE)
