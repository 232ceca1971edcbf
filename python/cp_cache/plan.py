"""One CP attention call, decided once: the ``CallPlan``, all a strategy needs (not the cache policy).

The custom op carries it as text and the step cache records it; the backward runs the recorded one. Also here,
as the plan decides them: the Ulysses head split and the algorithm (``decide_algorithm``).
"""

from __future__ import annotations

import functools
import json
import math
import operator
from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

from . import layout as L
from .masks import MaskSpec
from .placement import CONTIGUOUS, HEAD_TAIL

__all__ = ["ALGORITHMS", "ALGORITHM_CP_DIMS", "EXCHANGES", "GRAD_PARTIALS", "check_choice", "check_exchange_options",
           "MaskSpec", "CallPlan", "HeadPlan", "head_plan", "ulysses_degree", "bytes_per_rank", "choose_algorithm",
           "decide_algorithm"]

ALGORITHMS = ("ring", "ulysses", "hybrid", "auto")
EXCHANGES = ("direct", "ring")  # how the ring's K/V rows travel (CallPlan.exchange)
GRAD_PARTIALS = ("float32", "input")  # the dtype of the ring backward's dK/dV partials (CallPlan.grad_partials)
ALGORITHM_CP_DIMS = {"ring": 1, "ulysses": 1, "hybrid": 2}  # the sequence-sharded mesh dimensions each runs over


def check_choice(name: str, value, choices: tuple, what: str = "") -> None:
    """ValueError; ``what`` names the kind (default ``name``)."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not a cp_cache {what or name}; use one of {choices}")


def check_exchange_options(exchange: str, keep_kv: bool, grad_partials: str) -> None:
    """ValueError: keeping the received K/V and partials in the input dtype need the direct exchange."""
    check_choice("exchange", exchange, EXCHANGES)
    check_choice("keep_kv", keep_kv, (False, True))
    check_choice("grad_partials", grad_partials, GRAD_PARTIALS)
    if keep_kv and exchange != "direct":
        raise ValueError(f"keep_kv=True needs exchange='direct' (the rows each rank received are what it "
                         f"keeps), got exchange={exchange!r}")
    if grad_partials != "float32" and exchange != "direct":
        raise ValueError(f"grad_partials={grad_partials!r} needs exchange='direct' (each partial goes "
                         f"straight home, rounded once), got exchange={exchange!r}")


def _flat(obj) -> dict:
    # dataclasses.asdict deep-copies: 10x slower on a path taken every call
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


# what the grad op's arguments repeat of its forward's plan, by whether the mask is given (then the algorithm too)
_GRAD_REPEATS = {given: ("layout", "head_num", "scale", "keep_prob", "mask", "documents", "placement", "capacity",
                         "sink") + (("algorithm",) if given else ()) for given in (False, True)}
_READ_GRAD_REPEATS = {given: operator.attrgetter(*names) for given, names in _GRAD_REPEATS.items()}


@functools.lru_cache(maxsize=256)
def _decode(text: str) -> "CallPlan":
    values = json.loads(text)
    return CallPlan(**dict(values, mask=MaskSpec(**values["mask"]), documents=tuple(values["documents"]),
                           cp_sizes=tuple(values["cp_sizes"])))


@dataclass(frozen=True)
class CallPlan:
    """rank: nested over the CP mesh dimensions, whose sizes ``cp_sizes`` gives outer first (() when driven directly).
    head_num: local query heads. ``capacity``: the rows every rank holds (placed tokens, then padding). load_balance:
    rank r holds chunks r and 2W-1-r of 2W. sink: merged by the custom ops, not the strategies."""
    world_size: int
    rank: int
    layout: str
    head_num: int
    scale: float
    keep_prob: float
    mask: MaskSpec = MaskSpec()
    load_balance: bool = False
    algorithm: str = "ring"
    cp_sizes: tuple[int, ...] = ()
    documents: tuple[int, ...] = ()
    placement: str = ""
    kernel: str = ""
    fused_merge: bool = False
    exchange: str = "direct"
    sink: bool = False
    keep_kv: bool = False
    grad_partials: str = "float32"
    capacity: Optional[int] = None

    def __post_init__(self):
        check_exchange_options(self.exchange, self.keep_kv, self.grad_partials)
        if self.cp_sizes and math.prod(self.cp_sizes) != self.world_size:
            raise ValueError(f"cp_sizes={self.cp_sizes} do not multiply to world_size={self.world_size}")
        # the plan as a string (the custom op's argument, the step cache's record): made once
        object.__setattr__(self, "text", json.dumps(dict(_flat(self), mask=_flat(self.mask)), sort_keys=True))

    @property
    def ulysses_size(self) -> int:
        """The Ulysses degree (``ulysses_degree``): 0 when the algorithm cannot run on these CP dimensions."""
        return ulysses_degree(self.algorithm, self.cp_sizes or (self.world_size,))

    @property
    def packed(self) -> bool:
        return self.layout == L.TND

    @property
    def document_placement(self) -> str:
        """Where no ``placement`` is named (a strategy driven directly): head-tail under load balancing."""
        return self.placement or (HEAD_TAIL if self.load_balance else CONTIGUOUS)

    @property
    def document_mesh(self) -> tuple[int, ...]:
        """Hybrid's (W0, W1), else (W,)."""
        if self.algorithm == "hybrid" and len(self.cp_sizes) == 2:
            return self.cp_sizes
        return (self.world_size,)

    @property
    def uneven_allowed(self) -> bool:
        """Dense, only the ring with full or causal attention on contiguous shards (blocks off the diagonal)."""
        if self.packed:
            return True
        if self.algorithm != "ring":
            return False
        return not (self.mask.window or self.mask.given or (self.mask.causal and self.load_balance))

    def ring_part(self, ring_size: int, ring_rank: int, head_num: int) -> "CallPlan":
        """A hybrid call's ring over the outer CP dimension: dense as contiguous BNSD; packed keeps TND."""
        dense = {} if self.packed else dict(layout="BNSD", load_balance=False)
        return replace(self, world_size=ring_size, rank=ring_rank, head_num=head_num, algorithm="ring",
                       cp_sizes=(ring_size,), **dense)

    def encode(self) -> str:
        return self.text

    decode = staticmethod(_decode)  # text -> CallPlan, cached

    def backward_mismatch(self, called: "CallPlan") -> Optional[str]:
        """Why a backward whose arguments give ``called`` cannot run this recorded plan, or None."""
        read = _READ_GRAD_REPEATS[self.mask.given]
        if read(self) != read(called):
            mine, theirs = (dict(zip(_GRAD_REPEATS[self.mask.given], read(p))) for p in (self, called))
            return f"backward called with {theirs} but its forward ran with {mine}"
        # the forward's algorithm on the backward's CP dimensions must give the forward's Ulysses degree
        degree = ulysses_degree(self.algorithm, called.cp_sizes or (called.world_size,))
        if (called.world_size, called.rank, degree) != (self.world_size, self.rank, self.ulysses_size):
            return (f"backward runs on rank {called.rank} of {called.world_size} but its forward ran on rank "
                    f"{self.rank} of {self.world_size} ({self.algorithm}, Ulysses degree {self.ulysses_size}; "
                    f"the backward's CP mesh dimensions: {list(called.cp_sizes)})")
        if self.mask.given and self.load_balance != called.load_balance:
            return (f"the forward ran with load balancing {'on' if self.load_balance else 'off'} and the "
                    f"backward picked the mask's rows with it {'on' if called.load_balance else 'off'}; keep "
                    "torch's _cp_options.enable_load_balance unchanged between a forward with a given mask "
                    "and its backward")
        return None


@dataclass(frozen=True)
class HeadPlan:
    """How the heads split over a Ulysses group of ``world`` ranks."""
    nq: int
    nkv: int
    world: int
    kv_repeats: int  # each K/V head is repeated this many times before the exchange

    @property
    def local_nq(self) -> int:
        return self.nq // self.world


def head_plan(nq: int, nkv: int, world: int) -> HeadPlan:
    """ValueError naming N, Nkv and W when it cannot be done."""
    if nq % nkv:
        raise ValueError(f"the query head count N={nq} is not a multiple of the K/V head count Nkv={nkv}")
    if nq % world == 0 and nkv % world == 0:
        return HeadPlan(nq, nkv, world, 1)
    if nq % world == 0 and world % nkv == 0:
        return HeadPlan(nq, nkv, world, world // nkv)
    raise ValueError(f"Ulysses context parallelism splits the heads over W={world} ranks: it needs the query head "
                     f"count N divisible by W and the K/V head count Nkv divisible by W or dividing W; got N={nq}, "
                     f"Nkv={nkv}, W={world} (heads per rank, after any tensor-parallel split)")


def ulysses_degree(algorithm: str, cp_sizes: Sequence[int]) -> int:
    """All of one dimension for Ulysses, the inner one for hybrid, 1 for the ring; 0 where it cannot run."""
    if algorithm == "ulysses":
        return cp_sizes[0] if len(cp_sizes) == 1 else 0
    if algorithm == "hybrid":
        return cp_sizes[1] if len(cp_sizes) == 2 else 0
    return 1


def bytes_per_rank(algorithm: str, *, nq: int, nkv: int, world: int, batch: int, local_seq: int,
                   head_dim: int, itemsize: int, v_head_dim: Optional[int] = None,
                   exchange: str = "direct", keep_kv: bool = False, grad_partials: str = "float32") -> int:
    """Bytes one rank sends for a full-attention forward plus backward, as ``call_stats()`` reports.
    ``v_head_dim``: V's head size (MLA; default ``head_dim``). ring: W-1 K/V blocks each way (backward none with
    ``keep_kv``) and W-1 float32 dK/dV blocks (W with ``exchange="ring"``; input itemsize with
    ``grad_partials="input"``). ulysses: the (W-1)/W not kept of q, k, v (repeated when Nkv < W), out and LSE
    forward; of those, dout, dq, dk, dv backward (dk, dv in float32 when heads are repeated)."""
    if world == 1:
        return 0
    qk_token = batch * local_seq * head_dim
    v_token = batch * local_seq * (head_dim if v_head_dim is None else v_head_dim)
    kv = nkv * (qk_token + v_token)
    if algorithm == "ring":
        returns = world if exchange == "ring" else world - 1
        fetches = 1 if keep_kv else 2  # the forward's, and the backward's unless kept
        return fetches * (world - 1) * kv * itemsize + returns * kv * (itemsize if grad_partials == "input" else 4)
    if algorithm == "ulysses":
        split = head_plan(nq, nkv, world)
        kv_sent = nkv * split.kv_repeats * (qk_token + v_token)
        lse = batch * nq * local_seq * 4
        q, out = nq * qk_token, nq * v_token
        forward = (q + kv_sent + out) * itemsize + lse
        # dK/dV of repeated heads travel in float32 (their copies are summed on the way back)
        kv_grads = kv_sent * (4 if split.kv_repeats > 1 else itemsize)
        backward = (q + kv_sent + 2 * out) * itemsize + lse + q * itemsize + kv_grads
        return (forward + backward) * (world - 1) // world
    raise ValueError(f"bytes_per_rank: algorithm={algorithm!r} is not 'ring' or 'ulysses'")


def choose_algorithm(*, nq: int, nkv: int, world: int, given_mask: bool, batch: int = 1, local_seq: int = 1,
                     head_dim: int = 128, itemsize: int = 2, v_head_dim: Optional[int] = None,
                     keep_kv: bool = False, grad_partials: str = "float32") -> str:
    """Ulysses when its head split exists, the mask is not given (the ring skips masked blocks) and it sends fewer
    bytes; else the ring, ties included (its transfers hide behind the kernels, Ulysses' all-to-alls do not)."""
    if world == 1 or given_mask:
        return "ring"
    try:
        head_plan(nq, nkv, world)
    except ValueError:
        return "ring"
    shape = dict(nq=nq, nkv=nkv, world=world, batch=batch, local_seq=local_seq, head_dim=head_dim,
                 itemsize=itemsize, v_head_dim=v_head_dim)
    ring = bytes_per_rank("ring", **shape, keep_kv=keep_kv, grad_partials=grad_partials)
    return "ulysses" if bytes_per_rank("ulysses", **shape) < ring else "ring"


def decide_algorithm(configured: str, cp_dims: Sequence[int], *, packed: bool, given_mask: bool,
                     backward: bool = False, costs=None, placements=()) -> str:
    """The one place it is decided; NotImplementedError where it cannot run. A backward runs what its forward
    recorded: this says only what its arguments need (a dense "auto" on one dimension stays "auto")."""
    count = len(cp_dims)
    if backward:
        if packed:
            return "hybrid" if count == 2 else "ring"
        if configured != "auto":
            return configured
        return "hybrid" if count == 2 else "ring" if given_mask else "auto"
    if configured == "auto":
        if count == 2:
            configured = "hybrid"
        elif packed or costs is None:
            configured = "ring"
        else:
            configured = choose_algorithm(given_mask=given_mask, **costs())
    needed = ALGORITHM_CP_DIMS[configured]
    if count != needed:
        hint = "; use algorithm='hybrid' for two" if needed == 1 and count == 2 else ""
        raise NotImplementedError(
            f"cp_cache algorithm={configured!r} runs over {needed} mesh dimension(s) sharded on the "
            f"sequence; the query is sharded on the sequence over {count} (mesh dims {tuple(cp_dims)}, "
            f"placements={tuple(placements)}){hint}")
    return configured
