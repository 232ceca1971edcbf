"""One CP attention call, decided once: the ``CallPlan``.

The forward handler builds the plan from the op's bound arguments (``handlers/spec.py``),
the custom op carries it (``encode()``, a graph constant when compiled), the step cache
records it, and the backward runs the recorded one, after checking the plan its grad op's
arguments give against it (``backward_mismatch``). Everything a strategy needs to know
about the call is here: the layout, the mask on global positions, the CP topology (W,
this rank's chunk, the Ulysses degree), the algorithm, the packed documents, the step
kernel and the merge. The step-cache policy is not: it is the step cache's business
(``step_cache.py``).

Also here, because the plan decides them: the head split of Ulysses (``head_plan``) and the
algorithm, in one function (``decide_algorithm``; its ``"auto"`` cost model: ``choose_algorithm``,
by bytes per rank).
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
from .npu_ops import describe
from .placement import CONTIGUOUS, HEAD_TAIL

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_CP_DIMS",
    "EXCHANGES",
    "GRAD_PARTIALS",
    "check_exchange_options",
    "MaskSpec",
    "CallPlan",
    "HeadPlan",
    "head_plan",
    "ulysses_degree",
    "bytes_per_rank",
    "choose_algorithm",
    "decide_algorithm",
]

ALGORITHMS = ("ring", "ulysses", "hybrid", "auto")
EXCHANGES = ("direct", "ring")  # how the ring's K/V rows travel (CallPlan.exchange)
GRAD_PARTIALS = ("float32", "input")  # the dtype of the ring backward's dK/dV partials (CallPlan.grad_partials)


def check_exchange_options(exchange: str, keep_kv: bool, grad_partials: str) -> None:
    """ValueError unless the ring's exchange can run with these options: keeping the received K/V
    and partials in the input dtype need the direct exchange (the rows each rank received are what
    it keeps; each partial goes straight home, rounded once)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r} is not a cp_cache exchange; use one of {EXCHANGES}")
    if keep_kv not in (False, True):
        raise ValueError(f"keep_kv={keep_kv!r} is not a cp_cache keep_kv; use one of (False, True)")
    if grad_partials not in GRAD_PARTIALS:
        raise ValueError(f"grad_partials={grad_partials!r} is not a cp_cache grad_partials; use one of "
                         f"{GRAD_PARTIALS}")
    if keep_kv and exchange != "direct":
        raise ValueError(f"keep_kv=True needs exchange='direct' (the rows each rank received are what it "
                         f"keeps), got exchange={exchange!r}")
    if grad_partials != "float32" and exchange != "direct":
        raise ValueError(f"grad_partials={grad_partials!r} needs exchange='direct' (each partial goes "
                         f"straight home, rounded once), got exchange={exchange!r}")
# how many mesh dimensions sharded on the sequence each algorithm runs over
ALGORITHM_CP_DIMS = {"ring": 1, "ulysses": 1, "hybrid": 2}


def _flat(obj) -> dict:
    # dataclasses.asdict deep-copies: 10x slower on a path taken every call
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


# what the grad op's arguments repeat of its forward's plan (with a given mask, the algorithm too)
_GRAD_REPEATS = ("layout", "head_num", "scale", "keep_prob", "mask", "documents", "placement", "capacity", "sink")
_READ_GRAD_REPEATS = {False: operator.attrgetter(*_GRAD_REPEATS),
                      True: operator.attrgetter(*_GRAD_REPEATS, "algorithm")}


@dataclass(frozen=True)
class CallPlan:
    """What one CP attention call runs, shared by its forward and backward.

    world_size, rank: the ranks the sequence is split over and this rank's chunk (nested
        over the CP mesh dimensions, outer first); cp_sizes: the sizes of those mesh
        dimensions, outer first (() when a strategy is driven directly: one dimension of
        world_size). The Ulysses degree (``ulysses_size``) follows from them and the algorithm.
    layout: the op's input_layout (TND: packed documents, ``documents`` their global
        cumulative ends); head_num: the local query heads.
    load_balance: whether the local shards are head-tail (rank r holds chunks r and
        2W-1-r of 2W) rather than contiguous; for TND, whether torch's load balancing was on.
    placement: TND: where the documents are (``placement.py``: "balanced", "head_tail",
        "contiguous"); "" otherwise (``document_placement`` reads it).
    kernel, fused_merge: the step kernel's name and whether ring steps merge with the
        fused NPU op; "" / False when a strategy is driven directly.
    exchange: how the ring's K/V reach the ranks: "direct" (each rank sends each other rank
        the rows of its block that rank's queries may attend to, and nothing else) or "ring"
        (whole blocks relayed round the ring).
    sink: whether the call has attention sinks (merged once into the strategy's result by the
        custom ops, ``handlers/attention.py``; the strategies never see them).
    keep_kv: the ring's forward keeps the K/V rows it received (in its step records) and its
        backward uses them instead of receiving them again (the direct exchange only).
    grad_partials: "float32" or "input": the dtype of the dK/dV partials the ring's backward
        returns to their owners (the direct exchange only).
    capacity: TND: the rows every rank holds (its placed tokens first, then padding that attends
        to nothing), the global length W x capacity; None: the rows its placement gives it.
    """

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
        """How many ranks form a Ulysses group: all for Ulysses, the inner CP dimension for
        hybrid, 1 for the ring (0: the algorithm cannot run on these CP dimensions)."""
        return ulysses_degree(self.algorithm, self.cp_sizes or (self.world_size,))

    @property
    def causal(self) -> bool:
        return self.mask.causal

    @property
    def packed(self) -> bool:
        """Packed documents (layout TND)."""
        return self.layout == L.TND

    @property
    def document_placement(self) -> str:
        """Where the packed documents are: ``placement``, or for a plan that names none (a
        strategy driven directly) per-document head-tail under load balancing, else contiguous."""
        return self.placement or (HEAD_TAIL if self.load_balance else CONTIGUOUS)

    @property
    def document_mesh(self) -> tuple[int, ...]:
        """The CP mesh sizes packed documents lie over (``documents.mesh_sizes``): hybrid's two,
        (W0, W1) (the placement over W0, each share cut in W1 contiguous slices), else (W,)."""
        if self.algorithm == "hybrid" and len(self.cp_sizes) == 2:
            return self.cp_sizes
        return (self.world_size,)

    @property
    def uneven_allowed(self) -> bool:
        """Whether the ranks may hold local sequences of different lengths. Packed documents:
        always, under every algorithm (the layout gives each rank's tokens; the strategy checks
        this rank's local length against it and derives the others'). Dense: the ring alone (not
        Ulysses' all-to-alls, nor a hybrid's ring on their results), for full attention or causal
        attention on contiguous shards (each block is then wholly before, on, or after the
        diagonal whatever the lengths); windows, masks and head-tail shards are positional."""
        if self.packed:
            return True
        if self.algorithm != "ring":
            return False
        return not (self.mask.window or self.mask.given or (self.mask.causal and self.load_balance))

    def ring_part(self, ring_size: int, ring_rank: int, head_num: int) -> "CallPlan":
        """The plan of the ring over the outer CP dimension of a hybrid call, on the head
        shards Ulysses gathered: dense, BNSD and contiguous; packed documents, TND and the
        call's placement over the outer ranks (each holding its share whole)."""
        if self.packed:
            return replace(self, world_size=ring_size, rank=ring_rank, head_num=head_num, algorithm="ring",
                           cp_sizes=(ring_size,))
        return replace(self, world_size=ring_size, rank=ring_rank, head_num=head_num, layout="BNSD",
                       load_balance=False, algorithm="ring", cp_sizes=(ring_size,))

    # ------------------------------------------------------------ encoding

    def encode(self) -> str:
        """The plan as a string: the custom op's argument and the step cache's record (``text``)."""
        return self.text

    @staticmethod
    def decode(text: str) -> "CallPlan":
        return _decode(text)

    def backward_mismatch(self, called: "CallPlan") -> Optional[str]:
        """Why a backward whose arguments give ``called`` cannot use this recorded forward plan,
        or None. The grad op repeats the forward's arguments; the mesh must be the same; with a
        given mask, so must the algorithm and the load balancing that picked the mask's rows."""
        names = _GRAD_REPEATS + (("algorithm",) if self.mask.given else ())
        read = _READ_GRAD_REPEATS[self.mask.given]
        if read(self) != read(called):
            mine, theirs = (dict(zip(names, read(p))) for p in (self, called))
            return f"backward called with {theirs} but its forward ran with {mine}"
        # the backward runs what the forward ran, on the same mesh: the forward's algorithm on the
        # backward's CP dimensions must give the forward's Ulysses degree
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


@functools.lru_cache(maxsize=256)
def _decode(text: str) -> CallPlan:
    values = json.loads(text)
    return CallPlan(**dict(values, mask=MaskSpec(**values["mask"]), documents=tuple(values["documents"]),
                           cp_sizes=tuple(values["cp_sizes"])))


# ---------------------------------------------------------------- topology


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

    @property
    def local_nkv(self) -> int:
        return self.nkv * self.kv_repeats // self.world


def head_plan(nq: int, nkv: int, world: int) -> HeadPlan:
    """The head split of Ulysses; ValueError naming N, Nkv and W when it cannot be done."""
    if nq % nkv:
        raise ValueError(f"the query head count N={nq} is not a multiple of the K/V head count Nkv={nkv}")
    if nq % world == 0 and nkv % world == 0:
        return HeadPlan(nq, nkv, world, 1)
    if nq % world == 0 and world % nkv == 0:
        return HeadPlan(nq, nkv, world, world // nkv)
    raise ValueError(
        f"Ulysses context parallelism splits the heads over W={world} ranks: it needs the query head "
        f"count N divisible by W and the K/V head count Nkv divisible by W or dividing W; got N={nq}, "
        f"Nkv={nkv}, W={world} (heads per rank, after any tensor-parallel split)"
    )


def ulysses_degree(algorithm: str, cp_sizes: Sequence[int]) -> int:
    """The Ulysses degree of ``algorithm`` on a mesh whose CP dimensions have these sizes,
    outer first: all of one dimension for Ulysses, the inner one for hybrid, 1 for the ring;
    0 where the algorithm cannot run on such a mesh."""
    if algorithm == "ulysses":
        return cp_sizes[0] if len(cp_sizes) == 1 else 0
    if algorithm == "hybrid":
        return cp_sizes[1] if len(cp_sizes) == 2 else 0
    return 1


# ---------------------------------------------------------------- algorithm="auto"


def bytes_per_rank(algorithm: str, *, nq: int, nkv: int, world: int, batch: int, local_seq: int,
                   head_dim: int, itemsize: int, v_head_dim: Optional[int] = None,
                   exchange: str = "direct", keep_kv: bool = False, grad_partials: str = "float32") -> int:
    """Bytes one rank sends for one attention call, forward plus backward, with full attention
    (what ``call_stats()`` reports; other masks let the direct exchange send less). ``head_dim``:
    Q/K's head size; ``v_head_dim``: V's (MLA; default Q/K's), the head size of V, the output,
    its gradient and dV.

    ring: forward W-1 K/V blocks; backward W-1 K/V blocks (none with ``keep_kv``: the forward kept
    them) and W-1 float32 dK/dV blocks (each partial straight back to its owner;
    ``exchange="ring"``: W, the accumulators travel home; ``grad_partials="input"``: at the
    input's itemsize).
    ulysses: the (W-1)/W share not kept of q, k, v (K/V repeated when Nkv < W) and of the
    output and LSE (forward); of q, k, v, output, output gradient, LSE, and dq, dk, dv
    (backward; dk, dv in float32 when K/V heads are repeated).
    """
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
    """What ``algorithm="auto"`` runs on one CP mesh dimension of ``world`` ranks.

    Ulysses when its head split exists (N and Nkv as ``head_plan`` needs), the mask is not a
    given one (the ring skips wholly masked blocks and takes every mask shape), and it sends
    fewer bytes per rank than the ring for this call's shapes (``bytes_per_rank``: apart from
    the small LSE, only the head counts and W matter); the ring otherwise, ties included (the
    ring hides its transfers behind the step kernels, Ulysses' all-to-alls are not hidden).
    For MHA that is Ulysses from W = 2 up (the ring's backward sends W-1 float32 dK/dV blocks);
    for GQA with few K/V heads, the ring. ``keep_kv``, ``grad_partials``: as the ring will run
    (``bytes_per_rank``).
    """
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
    """The algorithm a call runs: the one place it is decided.

    ``configured``: the enabled one ("auto" included); ``cp_dims``: the mesh dimensions sharded on
    the sequence. A forward resolves "auto": hybrid on two CP dimensions, else the ring for packed
    documents (their traffic follows documents a handler may not know yet) and for a dense call
    without ``costs``, else ``choose_algorithm(given_mask=..., **costs())``; an algorithm that cannot
    run over these dimensions raises NotImplementedError (``placements``: named in it). A backward
    says only what its arguments need (it runs what its forward recorded): packed documents their
    layout's (hybrid or ring), a dense call the configured one, "auto" staying "auto" on one
    dimension unless a given mask makes it the ring (the cost model is not run again)."""
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
