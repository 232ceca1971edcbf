"""The ``accuracy`` section of ``python -m cp_cache bench``: max error of the output and the
gradients of one causal head-tail call against a float64 dense reference, fp32 and bf16, against W."""

from __future__ import annotations

from .._common import table
from .shared import Section, attention_call

__all__ = ["SECTION"]

_NAMES = ("out", "dq", "dk", "dv")


def accuracy_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import torch

    import cp_cache
    from ...testing.reference import dense_attention

    a = plan["attn"]
    rows = []
    cp_cache.enable(policy="handle")
    with cp_cache.context_parallel(mesh):
        for dtype in (torch.float32, torch.bfloat16):
            got, (q, k, v, dy) = attention_call(a, a["heads"], dtype, mesh, world_size, seed=123)
            if rank != 0:
                continue
            ref = dense_attention(q, k, v, dy, causal=True)
            errors = {}
            for name, x in zip(_NAMES, got):
                diff = (x.double() - ref[name]).abs()
                errors[f"{name}_max_abs"] = float(diff.max())
                errors[f"{name}_rel"] = float(diff.norm() / ref[name].norm())
            rows.append(dict(world_size=world_size, dtype=str(dtype).replace("torch.", ""), **errors))
    cp_cache.disable()
    return rows


def print_accuracy(report: dict) -> None:
    acc = report["accuracy"]
    if not acc:
        return
    print("\nerror versus a float64 dense reference (max abs)")
    rows = [[r["world_size"], r["dtype"]] + [f"{r[f'{n}_max_abs']:.1e}" for n in _NAMES] for r in acc]
    print(table(["W", "dtype", *_NAMES], rows))


def accuracy_panel(ax, report: dict) -> None:
    """Max abs error of the output and the gradients over W, per dtype."""
    acc = report["accuracy"]
    if not acc:
        return
    for dtype, marker in (("float32", "o"), ("bfloat16", "s")):
        rows = sorted((r for r in acc if r["dtype"] == dtype), key=lambda r: r["world_size"])
        if rows:
            ws = [r["world_size"] for r in rows]
            ax.plot(ws, [r["out_max_abs"] for r in rows], marker + "-", label=f"out ({dtype})")
            ax.plot(ws, [max(r["dq_max_abs"], r["dk_max_abs"], r["dv_max_abs"]) for r in rows],
                    marker + "--", label=f"max of dq, dk, dv ({dtype})")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["world_size"] for r in acc}))
    ax.set_xlabel("W")
    ax.set_ylabel("max abs error vs float64 dense")
    ax.set_title("numerical error vs W")
    ax.legend(fontsize=8)


SECTION = Section(
    name="accuracy",
    about="max error of output and gradients versus a float64 dense reference, fp32 and bf16, against W",
    rank=accuracy_rank, all_ranks=False, summary=print_accuracy, panels=(accuracy_panel,),
)
