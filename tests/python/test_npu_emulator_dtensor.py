"""The emulator's SDPA route with DTensor inputs (1-rank gloo world, in a subprocess).

A stand-in DTensor custom-op handler for the two v3 ops runs them on the local
tensors; the check is that the route hands DTensors to the op untouched and that
values and gradients match the original SDPA.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from cp_cache.testing import install_npu_emulator, uninstall_npu_emulator
    from cp_cache.testing.reference import error_bound

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh("cpu", (1,))
    orig = F.scaled_dot_product_attention
    assert install_npu_emulator()
    seen = []

    def handler(op_call, args, kwargs):
        seen.append((str(op_call), [type(a).__name__ for a in args if isinstance(a, torch.Tensor)]))
        loc = lambda x: x.to_local() if isinstance(x, DTensor) else x
        out = op_call(*[loc(a) for a in args], **{k: loc(v) for k, v in kwargs.items()})
        return tuple(DTensor.from_local(o, mesh, [Replicate()]) if i < 3 else o for i, o in enumerate(out))

    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers[torch.ops.npu.npu_fusion_attention_v3.default] = handler
    handlers[torch.ops.npu.npu_fusion_attention_grad_v3.default] = handler
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
        for kwargs in ({"is_causal": True}, {}, {"attn_mask": torch.rand(8, 8, generator=g) > 0.2}):
            seen.clear()
            qd, kd, vd = (distribute_tensor(t, mesh, [Replicate()]).requires_grad_() for t in (q, k, v))
            y = F.scaled_dot_product_attention(qd, kd, vd, **kwargs)
            assert isinstance(y, DTensor)
            y.to_local().sum().backward()
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            yr = orig(ql, kl, vl, **kwargs)
            yr.sum().backward()
            # torch in float64: the truth; torch's float32 error bounds the route's (20x + 32 eps)
            qt, kt, vt = (t.double().requires_grad_() for t in (q, k, v))
            yt = orig(qt, kt, vt, **kwargs)
            yt.sum().backward()
            pairs = [(y.to_local(), yr, yt)] + [(a.grad.to_local(), b.grad, c.grad)
                                                for a, b, c in ((qd, ql, qt), (kd, kl, kt), (vd, vl, vt))]
            for got, plain, truth in pairs:
                err = float((got.detach().double() - truth.detach()).abs().max())
                base = float((plain.detach().double() - truth.detach()).abs().max())
                bound = error_bound(base, scale=float(truth.detach().abs().max()))
                assert err <= bound, (kwargs, err, base, bound)
            assert any("fusion_attention_v3" in s[0] and s[1][:3] == ["DTensor"] * 3 for s in seen), seen
            assert any("grad_v3" in s[0] for s in seen), seen
    finally:
        handlers.pop(torch.ops.npu.npu_fusion_attention_v3.default, None)
        handlers.pop(torch.ops.npu.npu_fusion_attention_grad_v3.default, None)
        uninstall_npu_emulator()
        dist.destroy_process_group()
    print("DTENSOR-OK")
    """
)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_sdpa_route_with_dtensor_inputs():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [os.path.join(REPO, "python")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DTENSOR-OK" in proc.stdout
