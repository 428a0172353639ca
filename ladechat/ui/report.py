"""Rich tables for `ladechat bench` results."""

from __future__ import annotations

from rich.table import Table


def bench_tables(results: dict) -> list[Table]:
    tables = []
    sections = [(name, rows) for name, rows in results["datasets"].items()] + [("overall", results["overall"])]
    for name, rows in sections:
        table = Table(title=f"{name} · {results['model']} · {results['dtype']} on {results['device']} · "
                            f"{results['max_new_tokens']} new tokens · W={results['W']} N={results['N']} "
                            f"G={results['G']}"
                            + (f" · T={results['temperature']}" if results.get("temperature") else "")
                            + (" · first turns only" if results.get("single_turn") else ""),
                      caption=_layout_caption(results))
        for col in ("method", "items", "tokens", "tok/s", "vs hf", "per item: geomean", "p10", "slower",
                    "tokens/step", "identical"):
            table.add_column(col, justify="left" if col == "method" else "right")
        for method, r in rows.items():
            speed = f"{r['speedup_vs_hf']:.2f}x" if r["speedup_vs_hf"] else "-"
            comp = f"{r['compression']:.2f}" if r["compression"] else "-"
            geomean = f"{r['item_geomean_vs_hf']:.2f}x" if r.get("item_geomean_vs_hf") else "-"
            p10 = f"{r['item_p10_vs_hf']:.2f}x" if r.get("item_p10_vs_hf") else "-"
            identical = ("-" if results.get("temperature") else "n/a" if r["identical_items"] is None
                         else f"{r['identical_items']}/{r['items']}")
            table.add_row(method, str(r["items"]), str(r["tokens"]), f"{r['tokens_per_s']:.1f}", speed, geomean, p10,
                          f"{r.get('items_slower_than_hf', 0)}/{r['items']}", comp, identical)
        tables.append(table)
    ablation = {m: r for m, r in results["overall"].items() if m.startswith("only-") or m == "lookahead"}
    if any(m.startswith("only-") for m in ablation):
        tables.append(ablation_table(results, ablation))
    return tables


def _layout_caption(results: dict) -> str | None:
    """Which weight layout each method ran on, when ladechat's were packed (engine/load/packing.py),
    and where each peer is and how its tokens were counted."""
    lines = [_peer_line(name, peer) for name, peer in (results.get("peers") or {}).items()]
    if results.get("packed_weights"):
        caption = ("hf and HF's prompt lookup run the weights as transformers loads them; ladechat's methods "
                   "and hf-packed run them packed")
        lines.insert(0, caption if results.get("temperature") else
                     caption + ", and their answers are compared with hf-packed's")
    return "\n".join(lines) or None


def _peer_line(name: str, peer: dict) -> str:
    counted = {"usage": "tokens: the server's usage", "tokenizer": "tokens: its text tokenized here (no usage)"}.get(
        peer.get("tokens_from"), "tokens: the server's usage, else its text tokenized here")
    return f"{name} = {peer['url']} · {counted} · identical: n/a (another engine)"


def ablation_table(results: dict, rows: dict) -> Table:
    """Each draft source alone against all of them: tokens per step, how often a step's guesses
    reached depth 1, 2, 4 and 8, time per step, speed over hf."""
    table = Table(title=f"ablation · all sets · {results['model']} · store {results.get('store', 'cold')}")
    for col in ("sources", "tokens/step", "depth >= 1", ">= 2", ">= 4", ">= 8", "ms/step", "vs hf"):
        table.add_column(col, justify="left" if col == "sources" else "right")
    for method, r in rows.items():
        depth = r.get("accepted_by_depth") or []
        reach = [f"{depth[d - 1] / r['steps']:.0%}" if r["steps"] and len(depth) >= d else "0%" for d in (1, 2, 4, 8)]
        table.add_row("all" if method == "lookahead" else method.removeprefix("only-"),
                      f"{r['compression']:.2f}" if r["compression"] else "-", *reach,
                      f"{r['ms_per_step']:.1f}" if r.get("ms_per_step") else "-",
                      f"{r['speedup_vs_hf']:.2f}x" if r["speedup_vs_hf"] else "-")
    return table


def step_cost_table(result: dict) -> Table:
    """One row per step size: ms per step of each runner and its ratio to that runner's 1-token step."""
    curves = result["curves"]
    table = Table(title=f"step cost · {result['model']} · {result['dtype']} on {result['device']} · "
                        f"{result['context']} tokens cached · median of {result['reps']} · HF generate "
                        f"{result['hf_generate_per_token_s'] * 1000:.1f} ms/token"
                        + (" (weights as loaded; the steps' packed)" if result.get("packed_weights") else ""))
    table.add_column("tokens fed", justify="right")
    for kind in curves:
        table.add_column(f"{kind} ms", justify="right")
        table.add_column(f"{kind} vs 1", justify="right")
    for size in curves["dynamic"]:
        cells = [size]
        for curve in curves.values():
            cells += [f"{curve[size] * 1000:.1f}", f"{curve[size] / curve['1']:.2f}x"]
        table.add_row(*cells)
    return table


def kept_costs_table(model: str, rows: list[dict]) -> Table:
    """`bench step-cost --show`: per step size, the measured cost, the cost the chat plans with now,
    the least the evidence allows (engine/cost_envelope.py), and whether a probe will test it."""
    table = Table(title=f"step costs kept · {model} · ms per step after 192 cached tokens")
    for col in ("rows", "measured ms", "planned ms", "vs 1 row", "could be ms", "in doubt"):
        table.add_column(col, justify="right")
    one = rows[0]["kept_s"]
    for row in rows:
        doubt = (f"yes, probed in {row['probe_in']} steps" if row["probe_in"] else "yes, probed next") if row["in_doubt"] else "no"
        table.add_row(str(row["size"]), f"{row['measured_s'] * 1000:.1f}", f"{row['kept_s'] * 1000:.1f}",
                      f"{row['kept_s'] / one:.2f}x", f"{row['could_s'] * 1000:.1f}", doubt)
    return table


def serve_bench_table(result: dict) -> Table:
    """`ladechat bench --api`: tokens/s in this process and through the server, per item and overall."""
    table = Table(title=f"serving overhead · {result['model']} · through {result['server']} · "
                        f"{result['served_vs_in_process']:.1%} of in-process tokens/s · "
                        f"{result['identical']}/{len(result['items'])} identical")
    for col in ("item", "tokens", "in process tok/s", "served tok/s", "served / in process", "identical"):
        table.add_column(col, justify="right")
    for i, r in enumerate(result["items"], 1):
        here, there = r["tokens"] / r["in_process_s"], r["served_tokens"] / r["served_s"]
        table.add_row(str(i), str(r["tokens"]), f"{here:.1f}", f"{there:.1f}", f"{there / here:.1%}",
                      "yes" if r["identical"] else "no")
    table.add_row("all", str(sum(r["tokens"] for r in result["items"])), f"{result['in_process_tokens_per_s']:.1f}",
                  f"{result['served_tokens_per_s']:.1f}", f"{result['served_vs_in_process']:.1%}",
                  f"{result['identical']}/{len(result['items'])}")
    return table
