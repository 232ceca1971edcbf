"""The ``accuracy`` section of ``python -m cp_cache bench``: max error of the output and the
gradients of one causal head-tail call against a float64 dense reference, fp32, bf16 and fp16,
against W; in bf16 and fp16 also with the dK/dV partials returned in the input dtype
(``enable(grad_partials="input")``) beside float32 partials."""

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
    runs = [(torch.float32, "float32")] + [(dtype, partials) for dtype in (torch.bfloat16, torch.float16)
                                          for partials in ("float32", "input")[:2 if world_size > 1 else 1]]
    float32_partials = {}  # dtype: the gradients with float32 partials
    for dtype, partials in runs:
        cp_cache.enable(policy="handle", grad_partials=partials)
        with cp_cache.context_parallel(mesh):
            got, (q, k, v, dy) = attention_call(a, a["heads"], dtype, mesh, world_size, seed=123)
        if rank != 0:
            continue
        ref = dense_attention(q, k, v, dy, causal=True)
        errors = {}
        for name, x in zip(_NAMES, got):
            diff = (x.double() - ref[name]).abs()
            errors[f"{name}_max_abs"] = float(diff.max())
            errors[f"{name}_rel"] = float(diff.norm() / ref[name].norm())
        if partials == "float32":
            float32_partials[dtype] = got
        else:  # how far the input-dtype partials move dK/dV from the float32 partials' result
            errors.update({f"{name}_vs_float32_partials": float((x.double() - y.double()).norm() / y.double().norm())
                           for name, x, y in zip(_NAMES, got, float32_partials[dtype]) if name in ("dk", "dv")})
        rows.append(dict(world_size=world_size, dtype=str(dtype).replace("torch.", ""), grad_partials=partials,
                         **errors))
    cp_cache.disable()
    return rows


def print_accuracy(report: dict) -> None:
    acc = report["accuracy"]
    if not acc:
        return
    print("\nerror versus a float64 dense reference (max abs; relative norm of dk, dv)")
    rows = [[r["world_size"], r["dtype"], r.get("grad_partials", "float32")]
            + [f"{r[f'{n}_max_abs']:.1e}" for n in _NAMES] + [f"{r[f'{n}_rel']:.1e}" for n in ("dk", "dv")]
            + [f"{r[f'{n}_vs_float32_partials']:.1e}" if f"{n}_vs_float32_partials" in r else "-" for n in ("dk", "dv")]
            for r in acc]
    print(table(["W", "dtype", "dK/dV partials", *_NAMES, "dk rel", "dv rel", "dk vs f32 partials",
                 "dv vs f32 partials"], rows))


def accuracy_panel(ax, report: dict) -> None:
    """Max abs error of the output and the gradients over W, per dtype."""
    acc = report["accuracy"]
    if not acc:
        return
    for dtype, marker in (("float32", "o"), ("bfloat16", "s"), ("float16", "^")):
        rows = sorted((r for r in acc if r["dtype"] == dtype and r.get("grad_partials", "float32") == "float32"),
                      key=lambda r: r["world_size"])
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
    about="max error of output and gradients versus a float64 dense reference, fp32, bf16 and fp16 (dK/dV partials "
          "in float32 and in the input dtype), against W",
    rank=accuracy_rank, all_ranks=False, summary=print_accuracy, panels=(accuracy_panel,),
)
