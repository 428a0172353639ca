"""`ladechat bench`: methods side by side on a JSONL prompt set (schema: ../shared/data/README.md).

Every item runs each method back to back (so machine noise hits them alike); multi-turn items
run as conversations, each method answering with its own previous answers in the context.
ladechat's methods answer through the chat's own backend (backends/local.Bot, one per method for
the whole run, as a chat keeps one): a bench figure is a chat's, its text decoded as it streams. Peers
(peers.py: another engine behind an OpenAI-compatible server) run as methods of their own, last.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ladechat import templates
from ladechat.backends.local import Bot
from ladechat.bench import peers as peer_bench
from ladechat.bench.hf_static import StaticGenerate, cache_length
from ladechat.conversation import Conversation
from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.draft.store import AnswerStore
from ladechat.engine.events import Done
from ladechat.engine.models import transformers_model
from ladechat.errors import UserError
from ladechat.settings import Settings

# lookahead-full: every step carries the whole window and all candidates (no sizing from the
# step-cost curve), as on a GPU; its compression is what a GPU run would see, on any machine.
# hf-lookup-K: HF prompt lookup proposing K tokens after a match (hf-lookup: K = 10, HF's usual)
LOOKUP = {"hf-lookup-3": 3, "hf-lookup-5": 5, "hf-lookup": 10}
# hf-static: HF generate on one static cache, compiled where ladechat's methods are (hf_static.py)
# HF's methods run on the model as transformers loads it (Linear weights unpacked, engine/load/packing.py),
# as a user of transformers would run them; hf-packed: HF generate on ladechat's packed weights, which
# splits ladechat's gain into the weights' layout (hf-packed over hf) and the decoding (the rest), and
# is the reference ladechat's greedy answers must equal (fp32 sums differ in the last bits by layout).
HF_METHODS = ("hf", *LOOKUP, "hf-static", "hf-packed")
# only-X: lookahead with one draft source alone (the ablation): the conversation's suffix matches,
# the store of past answers, the Jacobi window and its n-gram pool, the recycled top-k.
ONLY = {
    "only-context": {"window": 1, "ngram": 2, "candidates": 0, "recycle": 0, "store": False},
    "only-store": {"window": 1, "ngram": 2, "candidates": 0, "context_candidates": 0, "recycle": 0, "store": True},
    "only-window": {"context_candidates": 0, "recycle": 0, "store": False},
    "only-recycle": {"window": 1, "ngram": 2, "candidates": 0, "context_candidates": 0, "store": False},
}
METHODS = (*HF_METHODS, "plain", "lookahead", "lookahead-full", *ONLY)
STORE_MODES = ("cold", "warm", "off")
WARM_UP = {"turns": ["Hello"]}  # what each method answers (8 tokens) before the measured items
DATASETS = {"mtbench": "mtbench-dev.jsonl", "humaneval": "humaneval-dev.jsonl", "gsm8k": "gsm8k-dev.jsonl"}


class BenchError(UserError, ValueError):
    pass


def find_dataset(name: str) -> Path:
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if name in DATASETS:
        for folder in (Path("shared/data"), Path("../shared/data")):
            if (folder / DATASETS[name]).is_file():
                return folder / DATASETS[name]
        raise BenchError(f"dataset {name!r}: {DATASETS[name]} not found in ./shared/data or ../shared/data")
    raise BenchError(f"dataset {name!r} is neither a file nor one of {', '.join(DATASETS)}")


def load_items(name: str, limit: int | None) -> list[dict]:
    """The items of a JSONL prompt set; BenchError (one line) names the first bad line."""
    path = find_dataset(name)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"cannot read {path}: {exc}") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchError(f"{path}, line {number}: not valid JSON ({exc.msg})") from None
        turns = item.get("turns") if isinstance(item, dict) else None
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise BenchError(f'{path}, line {number}: an item needs "turns", a non-empty list of strings')
        items.append(item)
    return items[:limit] if limit else items


@dataclass
class MethodTally:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    identical: int = 0  # items whose answer equals the reference's (hf, or hf-packed for ladechat's methods)
    comparable: bool = True  # False for a peer (another engine): identity is not applicable
    identical_to_hf: int = 0  # items whose answer equals hf's
    items: int = 0
    per_item: list = field(default_factory=list)  # (tokens, seconds) per item
    by_depth: list = field(default_factory=list)  # steps that accepted a guess at depth 1, 2, ...

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def add_item(self, tokens: int, seconds: float, steps: int | None, by_depth: list[int],
                 identical: bool | None, identical_to_hf: bool | None) -> None:
        """identical, identical_to_hf: None for an answer that is not compared (a peer's)."""
        self.tokens += tokens
        self.seconds += seconds
        self.steps += steps or 0
        self.items += 1
        self.comparable = self.comparable and identical is not None
        self.identical += int(bool(identical))
        self.identical_to_hf += int(bool(identical_to_hf))
        self.per_item.append((tokens, seconds))
        self.by_depth = _add(self.by_depth, by_depth)

    def add_summary(self, d: dict) -> None:
        """A prompt set's summary (_summary), for the totals over every set."""
        self.tokens += d["tokens"]
        self.seconds += d["seconds"]
        self.steps += d["steps"]
        self.items += d["items"]
        self.comparable = self.comparable and d["identical_items"] is not None
        self.identical += d["identical_items"] or 0
        self.identical_to_hf += d["identical_to_hf_items"] or 0
        self.per_item += d["per_item"]
        self.by_depth = _add(self.by_depth, d["accepted_by_depth"])


def _sampling_arguments(sampling: SamplingConfig) -> dict:
    """generate's arguments for `sampling`."""
    if not sampling.greedy:
        return {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k, "min_p": sampling.min_p or None,
                "repetition_penalty": sampling.repetition_penalty}
    return {"do_sample": False, "repetition_penalty": sampling.repetition_penalty}


def _hf_answer(model, ids: list[int], sampling: SamplingConfig, eos: list[int], lookup: int
               ) -> tuple[list[int], float]:
    extra: dict = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    extra.update(_sampling_arguments(sampling))
    start = time.perf_counter()
    with torch.inference_mode():
        ids_t = torch.tensor([ids], device=model.device)
        out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=sampling.max_new_tokens,
                             eos_token_id=eos, pad_token_id=eos[0], **extra)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def method_config(method: str, la: LookaheadConfig) -> LookaheadConfig:
    """The lookahead settings a ladechat method runs with."""
    return LookaheadConfig(**{**la.__dict__, "enabled": method != "plain", **ONLY.get(method, {})})


def method_settings(method: str, settings: Settings, store: bool = True) -> Settings:
    """The settings a ladechat method's chat runs with; store=False: without a store of past
    answers, whatever the method's own."""
    return settings.updated({"lookahead": method != "plain", **ONLY.get(method, {}), **({} if store else {"store": False})})


def answer_item(bot: Bot, item: dict):
    """Every turn of `item` answered by `bot` as a fresh chat answers it (Bot.new_conversation: an
    item's figures do not depend on the items before it but through the store; its text decoded
    as it streams, each answer in the context of the next turn). Returns (all answer ids, seconds,
    steps, guesses accepted per depth); the seconds run from the question to the answer's end."""
    bot.new_conversation()
    conversation = Conversation()
    answers: list[int] = []
    seconds, steps, by_depth = 0.0, 0, []
    for turn in item["turns"]:
        conversation.messages.append({"role": "user", "content": turn})
        start = time.perf_counter()
        done = next(event for event in bot.reply(conversation) if isinstance(event, Done))
        seconds += time.perf_counter() - start
        answers += done.text_tokens
        steps += done.stats.steps
        by_depth = _add(by_depth, done.stats.accepted_by_position)
        conversation.messages.append({"role": "assistant", "content": done.text})
    return answers, seconds, steps, by_depth


def hf_item(loaded, item: dict, method: str, sampling: SamplingConfig, template: str | None, runner=None,
            layouts=None, hf_model=None):
    """answer_item for one of HF's methods, transformers' generate over the loaded modules (its
    forward, as transformers_model makes it). runner: hf-static's StaticGenerate (required there).
    layouts: the loaded model's two weight layouts (None: the model as it is). Steps: None (HF does
    not report its forward passes)."""
    tok = loaded.tokenizer
    eos = sorted(loaded.eos_ids)
    messages: list[dict] = []
    answers: list[int] = []
    seconds = 0.0
    for turn in item["turns"]:
        messages.append({"role": "user", "content": turn})
        ids = templates.encode(tok, messages, template)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        if loaded.threads:  # the count a chat's step would set (engine/threads.py)
            loaded.threads.adjust()
        with nullcontext() if method == "hf-packed" or layouts is None else layouts.as_loaded():
            if method == "hf-static":
                answer, took = runner.answer(ids, _sampling_arguments(sampling), sampling.max_new_tokens, eos)
            else:
                answer, took = _hf_answer(hf_model or transformers_model(loaded.model), ids, sampling, eos,
                                          LOOKUP.get(method, 0))
        seconds += took
        answers += answer
        messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
    return answers, seconds, None, []


def _add(a: list[int], b) -> list[int]:
    """Element-wise sum of two count lists of any lengths."""
    a, b = list(a), list(b)
    return [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)))]


def _warm_stores(loaded, stores: dict, warm_items: list[dict], measured: list[dict], settings: Settings) -> int:
    """Fill every method's store with the model's greedy answers to `warm_items`, which must share
    no prompt with the measured items (a warm store is never built from what is measured)."""
    measured_turns = {turn for item in measured for turn in item["turns"]}
    if any(turn in measured_turns for item in warm_items for turn in item["turns"]):
        raise BenchError("--warm-from shares prompts with the measured items; warm the store on a different set")
    builder = AnswerStore()  # to read the answers back
    greedy = {"temperature": 0, "max_new_tokens": 256, "store": True, "repetition_penalty": 1.0, "stop": [],
              "format": None}
    bot = Bot(loaded, method_settings("lookahead", settings.updated(greedy)), store=builder)
    for item in warm_items:
        answer_item(bot, item)
    text = builder.index.tokens()
    ends = [i for i, tok in enumerate(text) if tok < 0]
    answers = [text[start + 1 if start >= 0 else 0 : end] for start, end in zip([-1] + ends, ends)]
    for store in stores.values():
        for answer in answers:
            store.add(answer)
    return len(answers)


def check_methods(methods: list[str]) -> None:
    for m in methods:
        if m not in METHODS:
            raise BenchError(f"unknown method {m!r} (choose from {', '.join(METHODS)})")


def _order(methods: list[str], packed: bool, greedy: bool) -> tuple[list[str], list[str]]:
    """(the methods in the order they run, ladechat's among them): hf first, the reference; on
    packed weights hf-packed second, the reference of ladechat's answers, before any answer
    compared with it (greedy runs, or when asked)."""
    check_methods(methods)
    if "hf-packed" in methods and not packed:
        raise BenchError("hf-packed needs packed (oneDNN) weights, which ladechat uses only on an x86-64 CPU in "
                         "fp32 or bf16 without --compile, for the Linear weights that do not run at 4 or 8 bits "
                         "(--weights packed packs them all); here it would be hf again")
    others = [m for m in dict.fromkeys(methods) if m not in ("hf", "hf-packed")]
    ours = [m for m in others if m not in HF_METHODS]
    wants_packed = "hf-packed" in methods or (packed and ours and greedy)
    return ["hf"] + (["hf-packed"] if wants_packed else []) + others, ours


def _check_store(store: str, warm_from: list[str] | None) -> None:
    if store not in STORE_MODES:
        raise BenchError(f"unknown store mode {store!r} (choose from {', '.join(STORE_MODES)})")
    if (store == "warm") != bool(warm_from):
        raise BenchError("--store warm needs --warm-from (a prompt set to build it from), and only it")


def run(loaded, datasets: list[str], methods: list[str], settings: Settings, limit: int | None, progress=None,
        compile: bool = False, single_turn: bool = False, store: str = "cold", warm_from: list[str] | None = None,
        warm_limit: int | None = None, on_item=None, peers: dict[str, peer_bench.Peer] | None = None) -> dict:
    """Greedy runs also report whether each method's answers equal HF greedy's, token for token
    (hf always runs, first, as the reference; on packed weights hf-packed runs too, second, as the
    reference of ladechat's methods, whose fp32 sums differ from hf's in the last bits); sampled
    runs (temperature > 0) cannot, and report speed and compression only (and run hf-packed only
    if asked). Per method: the ratio of summed tokens/s to hf's, and per item the
    geometric mean and 10th percentile of its speed over hf's on the same item and the share of
    items slower than hf. compile: ladechat's methods run fixed-shape compiled steps (one runner
    per method, compiled once). single_turn: only each item's first turn. store: each ladechat
    method gets its own store of past answers, empty at the start of the run and filled with that
    method's answers as it goes ("cold", what a new user has), filled first with the answers to
    the items of `warm_from` ("warm"), or none ("off"). on_item: called with a dict after each item
    (every method answered it), so a run cut short keeps what it measured: the prompt set, the item's
    index, and per method its tokens, seconds, steps and whether it equals the reference and hf.
    peers: methods of their own, last, answered by other engines (peers.py; identity None)."""
    sampling, template = settings.sampling_config(), settings.template
    packed = loaded.packed
    methods, ours = _order(methods, packed, sampling.greedy)
    peers = peers or {}
    methods += list(peers)
    _check_store(store, warm_from)
    stores = {m: AnswerStore() for m in ours} if store != "off" else {}
    results: dict = {"model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."),
                     "device": str(loaded.device), **settings.as_dict(), "single_turn": single_turn,
                     "store": store, "datasets": {}}  # store: the mode (cold, warm, off), not the setting
    results["compiled"] = compile
    results["packed_weights"] = packed  # ladechat's methods and hf-packed; HF's others run unpacked
    # HF's methods run transformers' forward over the loaded modules (one copy of the weights)
    hf_model = transformers_model(loaded.model)
    layouts = loaded.as_loaded_switch(hf_model) if packed else None  # a second copy of the Linear weights
    measured = {name: load_items(name, limit) for name in datasets}
    if single_turn:
        measured = {name: [{**item, "turns": item["turns"][:1]} for item in items] for name, items in measured.items()}
    runners = {}
    if "hf-static" in methods:
        runners["hf-static"] = StaticGenerate(hf_model, _static_length(loaded, measured, sampling, template),
                                              compile)
    bots = {m: Bot(loaded, method_settings(m, settings.updated({"max_new_tokens": 8}), store=False), compile=compile,
                   store=stores.get(m), full_steps=m == "lookahead-full") for m in ours}
    for m in methods:  # first calls allocate and pick kernels (and compile)
        if m in peers:
            peer_bench.sample_like(peers[m], settings)
            peer_bench.warm_up(peers[m], loaded.tokenizer)
        elif m in bots:  # with no store yet, so that its warm-up answer is not in it
            answer_item(bots[m], WARM_UP)
            bots[m].configure(method_settings(m, settings, store=store != "off"))  # now with its (cold) store
        else:
            hf_item(loaded, WARM_UP, m, SamplingConfig(max_new_tokens=8), template, runners.get(m), layouts, hf_model)
    if store == "warm":
        warm_items = [item for name in warm_from for item in load_items(name, warm_limit)]
        results["warm_answers"] = _warm_stores(loaded, stores, warm_items,
                                               [i for items in measured.values() for i in items], settings)

    def answer(item: dict, method: str):
        if method in peers:
            return None, *peer_bench.answer(peers[method], item, loaded.tokenizer), None, []
        if method in bots:
            ids, seconds, steps, by_depth = answer_item(bots[method], item)
        else:
            ids, seconds, steps, by_depth = hf_item(loaded, item, method, sampling, template, runners.get(method),
                                                    layouts, hf_model)
        return ids, len(ids), seconds, steps, by_depth

    for name in datasets:
        results["datasets"][name] = _run_set(name, measured[name], methods, answer, sampling.greedy,
                                             lambda m: "hf-packed" if packed and m in ours else "hf", on_item,
                                             progress)
    results["overall"] = _overall(results["datasets"], methods)
    if "hf-static" in runners:
        results["hf_static"] = runners["hf-static"].report()
    if compile:  # compiled graphs that torch ran without CUDA graphs ("skipping cudagraphs ...")
        from torch._dynamo.utils import counters

        results["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
    results["peers"] = {name: peer.info() for name, peer in peers.items()}
    return results


def _static_length(loaded, measured: dict[str, list[dict]], sampling: SamplingConfig, template: str | None) -> int:
    """hf-static's one cache length: room for the longest conversation of the run."""
    longest = 0
    for items in measured.values():
        for item in items:
            asked = len(templates.encode(loaded.tokenizer, [{"role": "user", "content": "\n".join(item["turns"])}],
                                         template))
            longest = max(longest, cache_length(asked, len(item["turns"]), sampling.max_new_tokens,
                                                loaded.context_length))
    return max(longest, cache_length(8, 1, sampling.max_new_tokens, loaded.context_length))  # the warm-up's


def _overall(sets: dict[str, dict], methods: list[str]) -> dict:
    """Each method's summary over every prompt set."""
    total = {m: MethodTally() for m in methods}
    for rows in sets.values():
        for m in methods:
            total[m].add_summary(rows[m])
    return {m: _summary(t, total["hf"]) for m, t in total.items()}


def _run_set(name: str, items: list[dict], methods: list[str], answer, greedy: bool, reference, on_item,
             progress) -> dict:
    """One prompt set: each item answered by every method in turn (answer(item, method): its ids
    or None, tokens, seconds, steps, accepted by depth), each answer compared with its reference
    method's (reference(method)) and hf's, but a peer's; per method, its summary against hf."""
    tallies = {m: MethodTally() for m in methods}
    for i, item in enumerate(items):
        answers: dict[str, list[int]] = {}
        per_method: dict[str, dict] = {}
        for m in methods:
            ids, tokens, seconds, steps, by_depth = answer(item, m)  # ids None: a peer's (not compared)
            answers[m] = ids
            identical = None if ids is None else greedy and ids == answers.get(reference(m))
            identical_to_hf = None if ids is None else greedy and ids == answers["hf"]
            tallies[m].add_item(tokens, seconds, steps, by_depth, identical, identical_to_hf)
            per_method[m] = {"tokens": tokens, "seconds": seconds, "steps": steps, "identical": identical,
                             "identical_to_hf": identical_to_hf}
        if on_item:
            on_item({"dataset": name, "item": i, "turns": len(item["turns"]), "methods": per_method})
        if progress:
            progress(name, i + 1, len(items))
    return {m: _summary(t, tallies["hf"]) for m, t in tallies.items()}


def _summary(t: MethodTally, hf: MethodTally) -> dict:
    base = hf.tokens_per_s()
    ratios = [(tok / sec) / (hf_tok / hf_sec) for (tok, sec), (hf_tok, hf_sec) in zip(t.per_item, hf.per_item)
              if tok and sec and hf_tok and hf_sec]
    return {"tokens": t.tokens, "seconds": round(t.seconds, 3), "steps": t.steps, "items": t.items,
            "tokens_per_s": round(t.tokens_per_s(), 2),
            "speedup_vs_hf": round(t.tokens_per_s() / base, 3) if base else None,
            "item_geomean_vs_hf": round(math.exp(statistics.fmean(map(math.log, ratios))), 3) if ratios else None,
            "item_p10_vs_hf": round(_percentile(ratios, 0.1), 3) if ratios else None,
            "items_slower_than_hf": sum(r < 1.0 for r in ratios),
            "compression": round(t.tokens / t.steps, 3) if t.steps else None,
            "ms_per_step": round(1000 * t.seconds / t.steps, 2) if t.steps else None,
            "accepted_by_depth": t.by_depth,
            "identical_items": t.identical if t.comparable else None,
            "identical_to_hf_items": t.identical_to_hf if t.comparable else None, "per_item": t.per_item}


def _percentile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between the sorted values."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)
