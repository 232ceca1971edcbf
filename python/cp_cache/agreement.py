"""Agreement of the ranks before a ring exchange: one small collective per ring call.

Every rank builds a fixed-size int64 signature of everything the K/V exchange and the
result depend on (local q/k/v/mask shapes, dtypes, layout, heads, mask kind and tockens,
load balancing, scale and keep_prob as float64 bit patterns, kernel, policy, algorithm,
direction, recorded ring steps, and whether this rank's own argument checks passed).
The signatures are all-gathered on the ring's group before any K/V moves. If they differ,
every rank raises the same ``RuntimeError`` naming each differing field and each rank's
value; a rank whose own argument check failed chains its local error as the cause.

Why the exchange happens on every call (no skipping in the steady state): whether this
rank may skip depends on the other ranks' signatures of *this* call, which it cannot know
without communicating. If ranks cached "already agreed" by their local signature, a rank
whose signature changed would enter the all_gather while an unchanged rank skipped straight
to the K/V send: the changed rank would wait for a contribution that never comes and the
other for a block that never comes, until the process group's timeout, with an error that
names neither cause. Any rule that lets a rank skip on local knowledge alone has this case,
so the collective is made on every call; what is cached per distinct local configuration is
only the signature's construction. The cost (one all_gather of W x ``SIGNATURE_LEN`` int64)
is measured by ``python -m cp_cache bench --only agreement``.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["SIGNATURE_LEN", "FIELDS", "signature", "agree", "counters", "reset_counters", "describe"]

_SHAPE_DIMS = 4  # q/k/v shapes padded with -1 to this many dims (the layouts have 3 or 4)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn,
           torch.float8_e5m2, torch.int8, torch.uint8, torch.bool, torch.int32, torch.int64)
_LAYOUTS = ("BNSD", "BSND", "BSH", "SBH", "TND")
_POLICIES = ("", "handle", "stack")
_ALGORITHMS = ("", "ring", "ulysses", "hybrid")
_KERNELS = ("", "npu", "reference")
_DIRECTIONS = ("forward", "backward")
_CHECKS = ("passed", "ValueError", "NotImplementedError", "TypeError", "RuntimeError", "failed")
_MASK_BITS = (("causal", 1), ("window", 2), ("given", 4))


def _code(table: Sequence, value) -> int:
    try:
        return table.index(value)
    except ValueError:
        return -2  # not in the table: shown as "other"


def _name(table: Sequence) -> Callable[[list[int]], str]:
    def show(v: list[int]) -> str:
        return repr(table[v[0]]) if 0 <= v[0] < len(table) else f"other ({v[0]})"
    return show


def _shape(v: list[int]) -> str:
    dims = tuple(x for x in v if x >= 0)
    return "None" if not dims and v[0] == -2 else str(dims)


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _float(v: list[int]) -> str:
    return repr(struct.unpack("<d", struct.pack("<q", v[0]))[0])


def _int(v: list[int]) -> str:
    return str(v[0])


def _bool(v: list[int]) -> str:
    return str(bool(v[0]))


def _mask(v: list[int]) -> str:
    names = [n for n, bit in _MASK_BITS if v[0] & bit]
    return "+".join(names) if names else "none (full)"


def _steps(v: list[int]) -> str:
    return "-" if v[0] < 0 else str(v[0])


# (field name as in the message, width in int64 slots, formatter)
FIELDS: tuple[tuple[str, int, Callable[[list[int]], str]], ...] = (
    ("direction", 1, _name(_DIRECTIONS)),
    ("kernel", 1, _name(_KERNELS)),
    ("step-cache policy", 1, _name(_POLICIES)),
    ("algorithm", 1, _name(_ALGORITHMS)),
    ("layout", 1, _name(_LAYOUTS)),
    ("local query shape", _SHAPE_DIMS, _shape),
    ("local key shape", _SHAPE_DIMS, _shape),
    ("local value shape", _SHAPE_DIMS, _shape),
    ("query dtype", 1, _name(_DTYPES)),
    ("key dtype", 1, _name(_DTYPES)),
    ("value dtype", 1, _name(_DTYPES)),
    ("head count", 1, _int),
    ("K/V head count", 1, _int),
    ("mask kind", 1, _mask),
    ("pre_tockens", 1, _int),
    ("next_tockens", 1, _int),
    ("load balancing", 1, _bool),
    ("scale", 1, _float),
    ("keep_prob", 1, _float),
    ("local mask rows shape", _SHAPE_DIMS, _shape),
    ("ring steps recorded", 1, _steps),
    ("argument checks", 1, _name(_CHECKS)),
)
SIGNATURE_LEN = sum(w for _, w, _ in FIELDS)


def _pad(shape: Optional[Sequence[int]]) -> list[int]:
    if shape is None:
        return [-2] + [-1] * (_SHAPE_DIMS - 1)
    dims = [int(s) for s in shape][:_SHAPE_DIMS]
    return dims + [-1] * (_SHAPE_DIMS - len(dims))


def _check_code(error: Optional[BaseException]) -> int:
    if error is None:
        return 0
    for i, name in enumerate(_CHECKS[1:-1], start=1):
        if type(error).__name__ == name:
            return i
    return len(_CHECKS) - 1


_lock = threading.Lock()
_built: dict[tuple, Tensor] = {}  # local configuration -> its signature tensor (construction only)
_BUILT_MAX = 256
_counters = {"exchanges": 0, "disagreements": 0, "signatures_built": 0}


def counters() -> dict:
    """{"exchanges": collectives made, "disagreements": of them, "signatures_built": cache misses}."""
    with _lock:
        return dict(_counters)


def reset_counters() -> None:
    with _lock:
        for k in _counters:
            _counters[k] = 0
        _built.clear()


def signature(*, direction: str, config: Any, q: Tensor, k: Tensor, v: Tensor, kv_heads: int,
              kernel: str = "", mask_rows: Optional[Tensor] = None, steps: int = -1,
              error: Optional[BaseException] = None) -> Tensor:
    """The int64 [SIGNATURE_LEN] signature of one ring call on this rank (``config``: a RingConfig)."""
    mask = sum(bit for name, bit in _MASK_BITS
               if getattr(config, "given_mask" if name == "given" else name))
    key = (direction, kernel, getattr(config, "policy", ""), getattr(config, "algorithm", ""), config.layout,
           tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype, int(config.head_num),
           int(kv_heads), mask, int(config.pre_tockens), int(config.next_tockens), bool(config.load_balance),
           _float_bits(config.scale), _float_bits(config.keep_prob),
           None if mask_rows is None else tuple(mask_rows.shape), int(steps), _check_code(error))
    with _lock:
        sig = _built.get(key)
        if sig is not None:
            return sig
    values = [_code(_DIRECTIONS, key[0]), _code(_KERNELS, key[1]), _code(_POLICIES, key[2]),
              _code(_ALGORITHMS, key[3]), _code(_LAYOUTS, key[4]),
              *_pad(key[5]), *_pad(key[6]), *_pad(key[7]),
              _code(_DTYPES, key[8]), _code(_DTYPES, key[9]), _code(_DTYPES, key[10]),
              *key[11:19], *_pad(key[19]), key[20], key[21]]
    sig = torch.tensor(values, dtype=torch.int64)
    assert sig.numel() == SIGNATURE_LEN
    with _lock:
        if len(_built) >= _BUILT_MAX:
            _built.clear()
        _built[key] = sig
        _counters["signatures_built"] += 1
    return sig


def describe(signatures: list[list[int]]) -> list[str]:
    """'<field>: rank 0 <value>, rank 1 <value>, ...' for each field where the ranks differ."""
    out = []
    start = 0
    for name, width, show in FIELDS:
        parts = [s[start:start + width] for s in signatures]
        if any(p != parts[0] for p in parts[1:]):
            out.append(f"{name}: " + ", ".join(f"rank {r} {show(p)}" for r, p in enumerate(parts)))
        start += width
    return out


def agree(sig: Tensor, group, world_size: int, error: Optional[BaseException] = None) -> float:
    """All-gather ``sig`` on ``group``; raise the same RuntimeError on every rank if the ranks
    differ (chaining this rank's own ``error``, if any). Returns the seconds it took."""
    started = time.perf_counter()
    gathered = [torch.empty_like(sig) for _ in range(world_size)]
    dist.all_gather(gathered, sig, group=group)
    with _lock:
        _counters["exchanges"] += 1
    first = gathered[0]
    if all(torch.equal(first, g) for g in gathered[1:]):
        return time.perf_counter() - started
    with _lock:
        _counters["disagreements"] += 1
    differing = describe([g.tolist() for g in gathered])
    message = "cp_cache: the ranks disagree on " + "; ".join(differing)
    if error is not None:
        raise RuntimeError(message) from error
    raise RuntimeError(message)
