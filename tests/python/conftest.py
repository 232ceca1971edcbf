"""Session setup of the test suite: rank processes (``run_ranks``) forked from a forkserver that
imported torch and cp_cache once, instead of each spawned rank importing them again
(CP_CACHE_RANK_START=spawn: spawned, as ``run_ranks`` does by default)."""

import os

from cp_cache.testing import multiprocess

multiprocess.START_METHOD = os.environ.get("CP_CACHE_RANK_START", "forkserver")
