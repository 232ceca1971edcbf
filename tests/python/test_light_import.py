"""``import cp_cache`` stays light and the command line's help is for a user: a fresh interpreter that imports
cp_cache (or parses ``cp-cache --help``) has loaded neither dynamo nor DTensor (nor transformers, matplotlib),
and loads them when ``enable()`` is asked for; ``bench --help`` is a short list of sections and flags with no
internal file names or reST markup. (Measured on 2 cores: ``cp-cache --help`` 1.1x ``import torch``, where it
was 1.9x with dynamo and DTensor loaded at import.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cp_cache.cli.bench.registry import NAMES

HEAVY = ("torch._dynamo", "torch.distributed.tensor", "transformers", "matplotlib", "cp_cache.dispatch",
         "cp_cache.handlers")
_PROBE = """
import contextlib, io, json, sys
{code}
print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
"""


def _loaded(code: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CP_CACHE_")}
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(code=code, heavy=HEAVY)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_import_cp_cache_loads_no_dynamo_and_no_dtensor():
    assert _loaded("import cp_cache; cp_cache.stats(); cp_cache.CPConfig") == []


def test_help_loads_no_dynamo_and_no_dtensor():
    code = ("from cp_cache.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['--help'])\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['bench', '--help'])")
    assert _loaded(code) == []


def test_the_api_loads_on_first_use():
    assert {"torch._dynamo", "torch.distributed.tensor", "cp_cache.dispatch"} <= set(
        _loaded("import cp_cache; cp_cache.enable"))


def test_bench_help_is_short_and_for_a_user(capsys):
    from cp_cache.cli import main

    try:
        main(["bench", "--help"])
    except SystemExit:
        pass
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 45, text
    for internal in ("``", ".py", "registry", "driver", "SECTION:"):
        assert internal not in text, (internal, text)
    for name in NAMES:
        assert f"\n  {name} " in text, (name, text)
    assert "--only SECTION" in text and "--worlds" in text and "--quick" in text, text
