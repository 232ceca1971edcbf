"""The native store seen from Python: handle lifetime, stack discipline, counters,
and the handle travelling through real autograd and torch.utils.checkpoint."""

import threading

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import cp_cache
from cp_cache import _C


@pytest.fixture
def store():
    return _C.StepCacheStore()


def seed(value):
    return torch.tensor([value], dtype=torch.int64)


def test_handle_owns_cache_until_last_shared_storage_dies(store):
    owned = seed(7)
    cache = store.create()
    cache.add_step("full", [owned, seed(8)])
    cache.set_meta("causal", True)
    cache.set_meta("world_size", 2)
    cache.set_meta("scale", 0.5)
    cache.set_meta("layout", "BNSD")
    handle = store.attach(cache)
    cache_id = cache.id
    del cache
    assert handle.dtype == torch.int64 and handle.shape == (1,) and int(handle) == cache_id
    views = [handle.detach(), handle.view(1), handle[0:1]]
    del handle
    for view in views:
        resolved = store.resolve(view)
        assert resolved.id == cache_id
        assert resolved.meta("causal") is True
        assert resolved.meta("world_size") == 2
        assert resolved.meta("scale") == 0.5
        assert resolved.meta("layout") == "BNSD"
        assert resolved.steps[0][0] == "full"
        assert torch.equal(resolved.steps[0][1][0], owned)
    del resolved, view
    assert store.stats()["live_entries"] == 1
    assert store.stats()["live_bytes"] == 16
    del views
    stats = store.stats()
    assert stats["live_entries"] == 0 and stats["live_bytes"] == 0
    assert stats["created"] == stats["released"] == 1


@pytest.mark.parametrize(
    "make_foreign, cause",
    [
        (lambda h: torch.tensor([int(h)]), "whose storage no handle created"),
        (lambda h: h.clone(), "saved-tensor hook"),
        (lambda h: torch.zeros(3, 4), "dtype Float"),
        (lambda h: h.to(torch.float64), "whose storage no handle created"),
    ],
)
def test_foreign_tensors_raise_with_cause(store, make_foreign, cause):
    handle = store.attach(store.create())
    with pytest.raises(RuntimeError, match=cause):
        store.resolve(make_foreign(handle))
    assert not store.is_handle(make_foreign(handle))
    assert store.is_handle(handle)


def test_handle_of_another_store_and_expired_handle(store):
    other = _C.StepCacheStore()
    handle = other.attach(other.create())
    with pytest.raises(RuntimeError, match="another step-cache store"):
        store.resolve(handle)
    mine = store.attach(store.create())
    assert store.release(mine) is True
    assert store.stats()["live_entries"] == 0
    with pytest.raises(RuntimeError, match="expired"):
        store.resolve(mine)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_resolve_rejects_non_tensors_and_dtensor_like_wrappers(store):
    with pytest.raises(TypeError):
        store.resolve(3)
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(RuntimeError, match="no handle created"):
        store.resolve(nested)


def test_stack_lifo_mispairing_and_limits(store):
    first, second = store.create(), store.create()
    ids = first.id, second.id
    assert store.push(first) and store.push(second)
    del first, second
    assert store.depth == 2 and store.stats()["stack_depth"] == 2
    with pytest.raises(RuntimeError, match=f"expected key {ids[0]} but the top of the stack is cache {ids[1]} with key {ids[1]}"):
        store.pop(ids[0])
    assert store.depth == 2
    assert store.pop(ids[1]).id == ids[1]
    assert store.pop().id == ids[0]
    keyed = store.create()
    keyed.pairing_key = 12345
    store.push(keyed)
    assert store.pop(12345) is keyed
    del keyed
    with pytest.raises(RuntimeError, match="empty step-cache stack"):
        store.pop()
    store.max_stack_depth = 1
    store.push(store.create())
    with pytest.raises(RuntimeError, match="depth 1, limit 1"):
        store.push(store.create())
    assert store.clear() == 1
    with pytest.raises(ValueError, match="max_stack_depth must be positive"):
        store.max_stack_depth = 0
    stats = store.stats()
    assert stats["live_entries"] == 0 and stats["pushed"] == 4 and stats["popped"] == 3


def test_peak_and_reset(store):
    caches = [store.create() for _ in range(3)]
    for cache in caches:
        cache.add_step("full", [torch.zeros(4)])
    del caches, cache
    stats = store.stats()
    assert (stats["peak_entries"], stats["peak_bytes"], stats["live_entries"]) == (3, 48, 0)
    store.reset_peak()
    assert store.stats()["peak_entries"] == 0 and store.stats()["peak_bytes"] == 0


def test_module_api_uses_the_process_wide_store():
    assert cp_cache.store() is cp_cache.store()
    before = cp_cache.stats()["created"]
    handle = cp_cache.store().attach(cp_cache.store().create())
    assert cp_cache.stats()["created"] == before + 1
    del handle
    cp_cache.reset_peak()
    assert cp_cache.current_graph_task_id() == -1
    assert set(cp_cache.stats()) >= {
        "live_entries", "live_bytes", "peak_entries", "peak_bytes", "created",
        "released", "stack_depth", "skipped_recompute_pushes",
    }


# --- the handle through real autograd -------------------------------------------------

STORE = _C.StepCacheStore()
OBSERVED = {"forward_task_ids": [], "backward_cache_ids": [], "forward_cache_ids": []}


@torch.library.custom_op("cp_cache_test::scale_with_cache", mutates_args=())
def scale_with_cache(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cache = STORE.create()
    cache.add_step("full", [seed(1)])
    OBSERVED["forward_task_ids"].append(_C.current_graph_task_id())
    OBSERVED["forward_cache_ids"].append(cache.id)
    return x * 2, STORE.attach(cache)


@scale_with_cache.register_fake
def _(x):
    return torch.empty_like(x), torch.empty(1, dtype=torch.int64)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _backward(ctx, grad_out, grad_handle):
    (handle,) = ctx.saved_tensors
    OBSERVED["backward_cache_ids"].append(STORE.resolve(handle).id)
    return grad_out * 2


scale_with_cache.register_autograd(_backward, setup_context=_setup_context)


def layer(x):
    return scale_with_cache(x)[0].sin()


def run_mode(mode, x):
    if mode == "plain":
        return layer(x)
    if mode == "no_grad":
        with torch.no_grad():
            return layer(x)
    return checkpoint.checkpoint(layer, x, use_reentrant=(mode == "reentrant"))


@pytest.mark.parametrize(
    "mode, live_after_forward",
    [("plain", 1), ("non_reentrant", 0), ("reentrant", 0), ("no_grad", 0)],
)
def test_cache_lifetime_through_autograd(mode, live_after_forward):
    for values in OBSERVED.values():
        values.clear()
    x = torch.randn(5, requires_grad=True)
    out = run_mode(mode, x)
    assert STORE.stats()["live_entries"] == live_after_forward
    if mode != "no_grad":
        out.sum().backward()
        expected = torch.cos(2 * x.detach()) * 2
        torch.testing.assert_close(x.grad, expected)
    del out
    assert STORE.stats()["live_entries"] == 0
    assert STORE.stats()["live_bytes"] == 0
    if mode in ("non_reentrant", "reentrant"):
        original, recompute = OBSERVED["forward_cache_ids"]
        assert OBSERVED["forward_task_ids"][0] == -1
        assert OBSERVED["forward_task_ids"][1] >= 0
        # backward resolved the recompute's cache, not the original one
        assert OBSERVED["backward_cache_ids"] == [recompute]
    elif mode == "plain":
        assert OBSERVED["backward_cache_ids"] == OBSERVED["forward_cache_ids"]


def test_threaded_stress_keeps_counters_exact():
    store = _C.StepCacheStore()
    errors = []
    pushes = []

    def worker(index):
        try:
            held = []
            pushed = 0
            for step in range(2000):
                cache = store.create()
                cache.add_step("full", [seed(step)])
                if step % 3 == 0:
                    pushed += store.push(cache)
                elif step % 3 == 1:
                    held.append(store.attach(cache))
                    assert store.resolve(held[-1]).id == int(held[-1])
                else:
                    try:
                        store.pop()
                        pushed -= 1
                    except RuntimeError:
                        pass
                if len(held) > 10:
                    held.clear()
            pushes.append(pushed)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    assert not any(thread.is_alive() for thread in threads)
    stats = store.stats()
    assert stats["pushed"] - stats["popped"] == store.depth == sum(pushes)
    assert stats["created"] - stats["released"] == stats["live_entries"] == store.depth
    assert stats["live_bytes"] == 8 * store.depth
    store.clear()
    assert store.stats()["live_entries"] == 0 and store.stats()["live_bytes"] == 0
