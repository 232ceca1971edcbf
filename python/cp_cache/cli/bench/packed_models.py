"""The ``packed_models`` section of ``python -m cp_cache bench``: one training step of a packed
Gemma-3 batch against the same step unpacked, memory per rank.

A tiny Gemma-3 (``transformers``, ``attn_implementation="cp_cache"``; sliding-window layers
alternating with full causal ones) takes one forward and backward under
``cp_cache.context_parallel`` on each rank of W:

* packed: documents of varied lengths flattened into one row of S tokens (what
  ``DataCollatorWithFlattening`` gives), the buffers laid out by cp_cache's document placement
  (``context_parallel(..., documents=cu_seq_lens_q)``), so every layer runs as packed
  documents (TND): a band inside each document for the sliding layers, causal for the full ones;
* unpacked: one sequence of S tokens on torch's head-tail shards (the dense path).

Per rank: the peak growth of the resident memory during the step (``/proc/self/statm``
sampled every 2 ms, less what the process held before it) and, in a second run of the same
step, the largest allocation one operator made (torch's profiler), against S x S bytes: a packed step allocates nothing that
grows with S squared (its largest blocks grow with the longest document).
"""

from __future__ import annotations

import threading
import time

from .._common import fmt_bytes, table
from .shared import Section, several_ranks

__all__ = ["SECTION", "packed_models_rank"]


class _ResidentPeak:
    """The highest resident set size seen while inside, less the size on entry (bytes; None
    without /proc)."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak, self.start = every, 0, None
        self._stop = threading.Event()

    @staticmethod
    def _resident() -> int | None:
        import os

        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return None

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._resident() or 0)
            time.sleep(self.every)

    def __enter__(self):
        self.start = self._resident()
        self.peak = self.start or 0
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int | None:
        return None if self.start is None else self.peak - self.start


def _model(shape: dict):
    import torch
    import transformers as tf

    config = tf.Gemma3TextConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=2 * shape["hidden"],
        num_hidden_layers=2, num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], query_pre_attn_scalar=shape["head_dim"], sliding_window=shape["window"],
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=shape["seq"],
        attention_dropout=0.0, use_cache=False)
    torch.manual_seed(0)
    model = tf.Gemma3ForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.set_attn_implementation("cp_cache")
    return model.train()


def _batch(shape: dict, packed: bool) -> dict:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(5)
    seq = shape["seq"]
    ids = torch.randint(0, shape["vocab"], (1, seq), generator=g)
    batch = {"input_ids": ids}
    if packed:
        lengths = shape["documents"]
        assert sum(lengths) == seq, (lengths, seq)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu
        batch["max_length_q"] = batch["max_length_k"] = max(lengths)
    else:
        batch["position_ids"] = torch.arange(seq)[None]
    batch["shift_labels"] = F.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
    return batch


def _largest_allocation(prof) -> int:
    return max((e.self_cpu_memory_usage for e in prof.events()), default=0)


def _step(model, batch: dict, mesh, packed: bool, profile: bool) -> dict:
    """One forward and backward; the resident growth, or (``profile``: with torch's profiler, whose
    own buffers would count in the resident size) the largest allocation."""
    import torch

    import cp_cache

    buffers = [batch["input_ids"], batch["position_ids"], batch["shift_labels"]]
    documents = batch["cu_seq_lens_q"] if packed else None
    labels = batch["shift_labels"]
    count = int((labels != -100).sum())
    started = time.perf_counter()
    watch = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
             if profile else _ResidentPeak())
    with watch:
        with cp_cache.context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], documents=documents):
            inputs = {k: v for k, v in batch.items() if k != "shift_labels"}
            loss = model(**inputs, labels=labels, shift_labels=labels, num_items_in_batch=count).loss
            loss.backward()
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    measured = dict(largest_allocation=_largest_allocation(watch)) if profile else dict(resident_growth=watch.growth)
    return dict(measured, seconds=seconds, loss=float(loss.detach()), live=cp_cache.stats()["live_entries"])


def packed_models_rank(plan: dict, rank: int, world_size: int, mesh) -> list[dict]:
    import cp_cache
    from cp_cache.integrations.transformers import register
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    register()
    shape = plan["packed_models"]
    model = _model(shape)
    rows = []
    load_balance = _cp_options.enable_load_balance
    cp_cache.enable("handle")
    try:
        _cp_options.enable_load_balance = True
        warm_up = dict(shape, seq=2 * shape["window"], documents=[shape["window"]] * 2)
        for profile in (False, True):  # one-time costs (lazy imports, the profiler) out of the measure
            _step(model, _batch(warm_up, True), mesh, True, profile)
        for packed in (True, False):
            batch = _batch(shape, packed)
            row = _step(model, batch, mesh, packed, profile=False)
            row["largest_allocation"] = _step(model, batch, mesh, packed, profile=True)["largest_allocation"]
            rows.append(dict(world_size=world_size, rank=rank, batch="packed" if packed else "unpacked",
                             seq=shape["seq"], documents=len(shape["documents"]) if packed else 1,
                             longest_document=max(shape["documents"]) if packed else shape["seq"],
                             window=shape["window"], seq_squared_bytes=shape["seq"] ** 2, **row))
    finally:
        _cp_options.enable_load_balance = load_balance
        cp_cache.disable()
    return rows


def print_summary(report: dict) -> None:
    rows = [r for r in report["packed_models"] if r["world_size"] > 1]
    if not rows:
        return
    r0 = rows[0]
    print(f"\nGemma-3-shaped training step (window {r0['window']}, one forward and backward), S={r0['seq']}: "
          f"memory per rank (the largest rank)")
    body = []
    for world, batch in sorted({(r["world_size"], r["batch"]) for r in rows}):
        group = [r for r in rows if r["world_size"] == world and r["batch"] == batch]
        growth = [r["resident_growth"] for r in group if r["resident_growth"] is not None]
        body.append([world, batch, group[0]["documents"], group[0]["longest_document"],
                     fmt_bytes(max(growth)) if growth else "n/a",
                     fmt_bytes(max(r["largest_allocation"] for r in group)), fmt_bytes(group[0]["seq_squared_bytes"]),
                     f"{max(r['seconds'] for r in group):.1f}"])
    print(table(["W", "batch", "documents", "longest", "peak RSS growth", "largest allocation", "S x S bytes",
                 "s/step"], body))


_DOCUMENTS_16K = [2048, 512, 1536, 1024, 3072, 256, 768, 1280, 2048, 1792, 640, 384, 1024]  # 16,384 tokens

SECTION = Section(
    name="packed_models",
    about="a packed Gemma-3-shaped training step (documents as TND, window inside each) against the same step "
          "unpacked: peak memory per rank and the largest allocation, against S x S",
    quick=dict(packed_models=dict(seq=256, documents=[32, 64, 16, 96, 48], window=8, vocab=128, hidden=32,
                                  heads=4, kv_heads=2, head_dim=8)),
    full=dict(packed_models=dict(seq=16384, documents=_DOCUMENTS_16K, window=512, vocab=256, hidden=64, heads=2,
                                 kv_heads=1, head_dim=16)),
    rank=packed_models_rank, runs_at=several_ranks, summary=print_summary,
)
