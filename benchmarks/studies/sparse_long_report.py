"""The tables of benchmarks/studies/sparse_long.py's record (held-out loss per position, retrieval, runs); its plan.

`oomb eval --buckets N` gives buckets of equal width (4K in the study); these tables group them into
0-4K, 4K-16K, 16K-64K, ... (powers of 4) and the last quarter of the context, token-weighted: a group's
mean NLL is its summed NLL over its tokens. An eval bucket belongs to the group its first position lies in.
"""

from __future__ import annotations

import statistics

K = 1024


def group_edges(length: int, base: int) -> list[int]:
    """0, base, 4 base, 16 base, ... while below the last quarter, then 3/4 of the length and the length."""
    edges, e = [0], base
    while e < 3 * length // 4:
        edges.append(e)
        e *= 4
    return [*edges, 3 * length // 4, length]


def label(n: int) -> str:
    if n and n % (K * K) == 0:
        return f"{n // (K * K)}M"
    return f"{n // K}K" if n and n % K == 0 else str(n)


def grouped(ev: dict, edges: list[int]) -> list[float | None]:
    """Mean NLL per group of ``edges``, then over every position."""
    sums = [[0.0, 0] for _ in edges[:-1]]
    for start, _end, tokens, nll in ev["perplexity"]["buckets"]:
        if tokens and nll is not None:
            i = max(j for j in range(len(edges) - 1) if edges[j] <= start)
            sums[i][0] += nll * tokens
            sums[i][1] += tokens
    return [a / n if n else None for a, n in sums] + [ev["perplexity"]["mean_nll"]]


def _num(x, fmt="{:.4f}") -> str:
    return "—" if x is None else fmt.format(x)


def loss_table(rows: list[tuple[str, list]], edges: list[int]) -> list[str]:
    head = [f"{label(a)}-{label(b)}" for a, b in zip(edges, edges[1:], strict=False)]
    head[-1] += " (last quarter)"
    out = ["| model | " + " | ".join(head) + " | all |", "| --- |" + " ---: |" * (len(head) + 1)]
    for name, values in rows:
        fmt = "{:+.2f}%" if name.endswith("%") else "{:.4f}"
        out.append(f"| {name} | " + " | ".join(_num(v, fmt) for v in values) + " |")
    return out


def change(new: list, base: list) -> list:
    return [None if a is None or b is None else 100 * (a - b) / b for a, b in zip(new, base, strict=True)]


def group_seconds(steps: list) -> list[tuple[int, float, float]]:
    """Per group: its steps' estimate, and that plus the steps of earlier groups it reads (a fresh machine)."""
    by, out = {st.name: st for st in steps}, []

    def ancestors(st, seen):
        for n in st.needs:
            if n not in seen:
                seen.add(n)
                ancestors(by[n], seen)
        return seen

    for g in sorted({st.group for st in steps}):
        mine = [st for st in steps if st.group == g]
        redo = set().union(*(ancestors(st, set()) for st in mine)) - {st.name for st in mine}
        here = sum(st.est_s for st in mine)
        out.append((g, here, here + sum(by[n].est_s for n in redo)))
    return out


def dry_run(steps: list) -> None:
    for g, here, fresh in group_seconds(steps):
        print(f"# group {g}: about {here / 60:.1f} min after the group before it on the same machine, "
              f"{fresh / 60:.1f} min on a fresh one\n")
        for st in (st for st in steps if st.group == g):
            print(f"## {st.name} (about {st.est_s:.0f} s)\n{st.command()}\n")
    print(f"# in all: about {sum(st.est_s for st in steps) / 60:.1f} min on one machine")


def markdown(s, state: dict, steps: list) -> str:
    evals, runs = state.get("evals", {}), state.get("runs", {})
    done = sum(state["steps"].get(st.name, {}).get("status") == "done" for st in steps)
    model, corpus = state.get("model", {}), state.get("corpus", {})
    lines = ["# Page-sparse against dense training at 256K and 1M tokens on real text",
             "", "`python -m benchmarks.studies.sparse_long`; every command, seed and number in "
             "sparse_long.json.", "",
             f"Steps done: {done} of {len(steps)}. Model: {s.preset} architecture, "
             f"{model.get('layers', '?')} layers, {model.get('parameters', 0) / 1e6:.3g}M parameters, vocabulary "
             f"{model.get('vocab_size', '?')}. Corpus: "
             + ", ".join(f"{k} {v['tokens'] / 1e6:.1f}M tokens ({', '.join(v['packages'])})"
                         for k, v in corpus.get("splits", {}).items()) + ".",
             f"Sparse runs: train.page_budget={s.budget}, every other selection key at oomb train's default.", ""]
    for w in state.get("warnings", []):
        lines += [f"**Warning**: {w}", ""]
    long = group_edges(s.long_len, s.bucket)
    rows, deltas = [], []
    for seed in s.seeds:
        d, sp = evals.get(f"B-dense-s{seed}_final"), evals.get(f"B-sparse-s{seed}_final")
        spd = evals.get(f"B-sparse-s{seed}_final-dense")
        for name, ev in ((f"dense, seed {seed}", d), (f"sparse, seed {seed}", sp),
                         (f"sparse, seed {seed}, read with dense attention", spd)):
            if ev:
                rows.append((name, grouped(ev, long)))
        if d and sp:
            deltas.append(change(grouped(sp, long), grouped(d, long)))
            rows.append((f"sparse vs dense, seed {seed}, %", deltas[-1]))
    lines += [f"## Held-out loss per position at {label(s.long_len)}, end of training (mean NLL, nats)", ""]
    lines += loss_table(rows, long) if rows else ["(not measured yet)"]
    if deltas:
        worst = max(abs(v) for row in deltas for v in row if v is not None)
        lines += ["", f"Largest |sparse - dense| over buckets and seeds: {worst:.2f}% (target: within 1% in every "
                  f"bucket: {'met' if worst <= 1 else 'missed'})."]
    over = [(name.replace("_step", " at step ").replace("_final", " at the end"), grouped(ev, long))
            for name, ev in sorted(evals.items(), key=lambda kv: _training_order(kv[0]))
            if name.startswith("B-") and (name.endswith("_final") or name.rpartition("_step")[2].isdigit())]
    lines += ["", "## Over training (the same held-out documents)", ""]
    lines += loss_table(over, long) if over else ["(not measured yet)"]
    lines += ["", "## Retrieval: a passkey in held-out code (`oomb eval --task text --prompt plain`)", ""]
    cells = [(name, ev["retrieval"]["cells"]) for name, ev in evals.items() if "retrieval" in ev]
    if cells:
        keys = [(c["length"], c["depth"]) for c in cells[0][1]]
        lines += ["| model | " + " | ".join(f"{label(n)} @ {d:g}" for n, d in keys)
                  + " | accuracy | answer log-prob |", "| --- |" + " ---: |" * (len(keys) + 2)]
        for name, cs in cells:
            acc = statistics.mean(c["accuracy"] for c in cs)
            lp = statistics.mean(c["answer_logprob"] for c in cs if c.get("answer_logprob") is not None) if any(
                c.get("answer_logprob") is not None for c in cs) else None
            lines.append(f"| {name} | " + " | ".join(f"{c['accuracy']:.2f}" for c in cs)
                         + f" | {acc:.3f} | {_num(lp, '{:.2f}')} |")
    else:
        lines.append("(not measured yet)")
    million = group_edges(s.c_len, s.bucket)
    seed = s.seeds[0]
    c, b = evals.get(f"C-sparse-s{seed}_final-1m"), evals.get(f"B-sparse-s{seed}_final-1m")
    lines += ["", f"## At {label(s.c_len)}: the sparse model trained at {label(s.c_len)} against the "
              f"{label(s.long_len)} one, same documents", ""]
    rows = [(n, grouped(ev, million)) for n, ev in ((f"C: trained to {label(s.c_len)}, seed {seed}", c),
                                                     (f"B: trained to {label(s.long_len)}, seed {seed}", b)) if ev]
    if c and b:
        rows.append(("C vs B, %", change(rows[0][1], rows[1][1])))
    lines += loss_table(rows, million) if rows else ["(not measured yet)"]
    if c and b:
        late_c, late_b = grouped(c, million)[-2], grouped(b, million)[-2]
        lines += ["", f"Last quarter: C {_num(late_c)} against B {_num(late_b)} (target: C lower: "
                  f"{'met' if late_c is not None and late_b is not None and late_c < late_b else 'missed'})."]
    lines += ["", "## Runs", "", "| run | steps | s/step (median) | loss, first -> last tenth | last val_loss | "
              "settled |", "| --- | ---: | ---: | --- | ---: | --- |"]
    for name, r in runs.items():
        m = r["metrics"]
        losses = [x["loss"] for x in m if "loss" in x]
        n = max(1, len(losses) // 10)
        val = [x["val_loss"] for x in m if "val_loss" in x]
        settled = ", ".join(f"{k} {v}" for k, v in r.get("settled", {}).items() if v is not None)
        per_step = statistics.median(x["seconds"] for x in m) if m else None
        lines.append(f"| {name} | {len(m)} | {_num(per_step, '{:.2f}')}"
                     f" | {_num(statistics.mean(losses[:n]) if losses else None)} -> "
                     f"{_num(statistics.mean(losses[-n:]) if losses else None)} | {_num(val[-1] if val else None)} | "
                     f"{settled} |")
    return "\n".join(lines) + "\n"


def _training_order(name: str):
    run, _, at = name.partition("_")
    return (run.rsplit("-s", 1)[-1], run, int(at[4:]) if at[4:].isdigit() else float("inf"))
