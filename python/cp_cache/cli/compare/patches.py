"""What compare changes in torch.distributed, torch's CP options and torch_npu while it measures.

Each change lasts for this process only and is undone on exit:

* ``SentCounter`` wraps torch.distributed's sending calls to count the bytes a rank sends;
* ``lift_dropout_guard`` makes torch_npu 2.13.0's CP sharding strategies read keep_prob as 1.0
  (a measurement hack for the "guard lifted" system);
* ``set_load_balance`` / ``rotate_method`` set torch's ``_cp_options``.
"""

from __future__ import annotations

import contextlib


class SentCounter:
    """Sums the bytes this rank hands to torch.distributed's sending calls while active.

    Counted: ``send``/``isend`` (tensor bytes; ``batch_isend_irecv`` runs its P2P ops through
    ``isend``), ``all_gather``/``all_gather_into_tensor`` and functional ``all_gather_single``/
    (input bytes x (W-1), i.e. (W-1)/W of the gathered output),
    ``all_to_all``/``all_to_all_single`` (classic and functional; the parts addressed to other
    ranks; the functional ``permute_tensor`` that torch's ring uses goes through it).
    Set ``phase`` to also sum by phase (``by_phase``, ``calls_by_phase``; ``sent_by_call``: by
    phase and call, e.g. ``("forward", "send")``: the point-to-point payload alone). The bytes received by
    point-to-point calls (``recv``/``irecv``) are summed apart: ``received``,
    ``received_by_phase``.
    """

    def __init__(self):
        self.bytes = 0
        self.calls: dict[str, int] = {}
        self.phase: str | None = None
        self.by_phase: dict[str, int] = {}
        self.calls_by_phase: dict[str, dict[str, int]] = {}
        self.sent_by_call: dict[tuple, int] = {}
        self.received = 0
        self.received_by_phase: dict[str, int] = {}
        self._saved: list = []

    def _add(self, name: str, n: int) -> None:
        self.bytes += int(n)
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.phase is not None:
            self.by_phase[self.phase] = self.by_phase.get(self.phase, 0) + int(n)
            calls = self.calls_by_phase.setdefault(self.phase, {})
            calls[name] = calls.get(name, 0) + 1
            key = (self.phase, name)
            self.sent_by_call[key] = self.sent_by_call.get(key, 0) + int(n)

    # the counting hooks: each takes the wrapped call's arguments

    def _count_p2p(self, tensor, *a, **k):
        self._add("send", tensor.nbytes)

    def _count_p2p_received(self, tensor, *a, **k):
        self.received += tensor.nbytes
        if self.phase is not None:
            self.received_by_phase[self.phase] = self.received_by_phase.get(self.phase, 0) + tensor.nbytes

    def _count_all_gather(self, tensor_list, tensor, group=None, *a, **k):
        self._add("all_gather", tensor.nbytes * (_group_size(group) - 1))

    def _count_all_gather_into_tensor(self, output, tensor, group=None, *a, **k):
        self._add("all_gather_into_tensor", tensor.nbytes * (_group_size(group) - 1))

    def _count_all_gather_single(self, tensor, gather_dim, group, *a, **k):
        self._add("all_gather_single", tensor.nbytes * (_group_size(group) - 1))

    def _count_all_to_all(self, outputs, inputs, group=None, *a, **k):
        me = _rank_in(group)
        self._add("all_to_all", sum(t.nbytes for i, t in enumerate(inputs) if i != me))

    def _count_all_to_all_single(self, output, tensor, output_split_sizes=None, input_split_sizes=None, group=None,
                                 *a, **k):
        self._add("all_to_all_single", a2a_bytes(tensor, input_split_sizes, _group_size(group), _rank_in(group)))

    def _count_functional_all_to_all_single(self, tensor, output_split_sizes, input_split_sizes, group, *a, **k):
        self._add("all_to_all_single", a2a_bytes(tensor, input_split_sizes, _group_size(group), _rank_in(group)))

    def _wrap(self, module, name: str, count):
        """``module.name`` calling ``count`` first; the original saved for ``__exit__``."""
        original = getattr(module, name)

        def wrapper(*a, **k):
            count(*a, **k)
            return original(*a, **k)

        wrapper.__name__ = name
        self._saved.append((module, name, original))
        return wrapper

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as ft_c
        import torch.distributed.distributed_c10d as c10d

        # isend and send (irecv, recv): the same wrapper in both namespaces (P2POp checks op is
        # c10d.isend or c10d.irecv)
        for name in ("isend", "send", "irecv", "recv"):
            count = self._count_p2p if name.endswith("send") else self._count_p2p_received
            wrapper = self._wrap(c10d, name, count)
            self._saved.append((dist, name, getattr(dist, name)))
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)
        for module, name, count in (
            (dist, "all_gather", self._count_all_gather),
            (dist, "all_gather_into_tensor", self._count_all_gather_into_tensor),
            (dist, "all_to_all", self._count_all_to_all),
            (dist, "all_to_all_single", self._count_all_to_all_single),
            (ft_c, "all_gather_single", self._count_all_gather_single),
            (ft_c, "all_to_all_single", self._count_functional_all_to_all_single),
        ):
            setattr(module, name, self._wrap(module, name, count))
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
        return False


def _group_size(group) -> int:
    import torch.distributed as dist

    try:
        return dist.get_world_size(group)
    except Exception:  # noqa: BLE001 - a functional-collective group spec
        import torch.distributed.distributed_c10d as c10d
        from torch.distributed._functional_collectives import _resolve_group

        return c10d._get_group_size_by_name(_resolve_group(group, ""))


def _rank_in(group) -> int:
    import torch.distributed as dist

    try:
        return dist.get_rank(group)
    except Exception:  # noqa: BLE001
        return dist.get_rank()


def a2a_bytes(tensor, input_split_sizes, world: int, me: int) -> int:
    """Bytes of an all_to_all_single input addressed to other ranks."""
    if not input_split_sizes:
        return tensor.nbytes * (world - 1) // world
    row = tensor.nbytes // max(tensor.shape[0], 1) if tensor.dim() else tensor.element_size()
    return sum(int(n) * row for i, n in enumerate(input_split_sizes) if i != me)


@contextlib.contextmanager
def lift_dropout_guard(cp_module):
    """MEASUREMENT HACK, torch_npu 2.13.0 only, in this process only, undone on exit.

    torch_npu 2.13.0's CP sharding strategies withhold the sequence-sharded strategy when
    keep_prob < 1, so its handler refuses dropout ("inputs need to be redistributed"). To
    measure the gradients its ring would compute under dropout, the strategies' argument
    reader is wrapped so that keep_prob reads as 1.0 *for the strategies only*; the
    handlers read keep_prob with another function and still apply dropout. The sharding
    propagation caches are cleared on entry and exit so no cached decision leaks across.
    """
    original = cp_module._get_kw

    def _get_kw_keep_prob_one(args, kwargs, ix, name, default=None):
        value = original(args, kwargs, ix, name, default)
        return 1.0 if name == "keep_prob" else value

    cp_module._get_kw = _get_kw_keep_prob_one
    _clear_sharding_caches()
    try:
        yield
    finally:
        cp_module._get_kw = original
        _clear_sharding_caches()


def _clear_sharding_caches() -> None:
    try:
        from torch.distributed.tensor.debug import (
            _clear_fast_path_sharding_prop_cache,
            _clear_python_sharding_prop_cache,
        )
    except ImportError:  # pragma: no cover - other torch versions
        return
    _clear_python_sharding_prop_cache()
    _clear_fast_path_sharding_prop_cache()


def set_load_balance(on: bool) -> None:
    """torch's CP load balancing (head-tail sharding) on or off: ``_cp_options.enable_load_balance``."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as att

    att._cp_options.enable_load_balance = bool(on)


@contextlib.contextmanager
def rotate_method(rotate: str):
    """torch's ring rotation, "allgather" or "alltoall", inside the block (``_cp_options.rotate_method``)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as att

    before = att._cp_options.rotate_method
    att._cp_options.rotate_method = (att._RotateMethod.ALL_GATHER if rotate == "allgather"
                                     else att._RotateMethod.ALL_TO_ALL)
    try:
        yield
    finally:
        att._cp_options.rotate_method = before
