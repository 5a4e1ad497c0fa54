"""Lesson 29's set-up, before any rank starts: where a compile writes its caches, and whether
inductor can build CPU kernels on this machine (it needs a C++ compiler).

Where torch 2.14.1 writes when it compiles, read in the pinned source:

* TORCHINDUCTOR_CACHE_DIR (unset: $TMPDIR/torchinductor_$USER, runtime/cache_dir_utils.py;
  common/__init__.py sets it to runs/.torchinductor): inductor's FX graph cache, AOTAutograd's
  cache, the generated C++ and its .so files, and on a GPU triton's kernels (triton_cache_dir,
  unless TRITON_CACHE_DIR is set).
* $TMPDIR/torchinductor_$USER/precompiled_headers: the precompiled header every CPU kernel
  includes. codecache.py (line 3682) builds that path from default_cache_dir(), which never
  reads TORCHINDUCTOR_CACHE_DIR, when torch._inductor.codecache is first imported.
* $TMPDIR: the C++ compiler's own temporary files, removed when it exits.

keep_caches() points both at runs/ (TMPDIR only for this lesson and the processes it starts),
so a run leaves nothing in the learner's /tmp or home, and `make clean` removes it all.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def keep_caches(cold: Path | None = None) -> Path:
    """The compile cache this run uses, with TMPDIR inside it: TORCHINDUCTOR_CACHE_DIR as set
    (runs/.torchinductor, warm from earlier runs), or `cold`, emptied now (--cold-cache; it stays
    after the run, the generated C++ in it to read, until the next --cold-cache run). Call it
    before anything imports torch._inductor.codecache; the ranks inherit both."""
    if cold is not None:
        shutil.rmtree(cold, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cold)
    cache = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path(tempfile.gettempdir()) / "torchinductor")
    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(cache / "tmp")  # gcc's files and inductor's precompiled headers
    tempfile.tempdir = None  # Python reads TMPDIR again at its next tempfile.gettempdir()
    return cache


def folder_size(folder: Path) -> tuple[int, int]:
    """(bytes, files) under a folder: what the cache holds."""
    files = [p for p in Path(folder).rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def cxx_compiler() -> str | None:
    """The C++ compiler inductor will use for CPU kernels, with its version ("g++ (Debian
    12.2.0-14) 12.2.0"), or None if there is none. Inductor's own search (config.cpp.cxx: $CXX,
    else g++, clang++ on macOS): without one, the first compiled step fails with
    InductorError: InvalidCxxCompiler, deep in a rank. PRIVATE API: torch._inductor."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        compiler = get_cpp_compiler()
    except InvalidCxxCompiler:
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    return (version.splitlines() or [compiler])[0]


def cache_hits(counters) -> dict[str, int]:
    """Inductor's FX graph cache and AOTAutograd's cache, as dynamo's counters saw them in this
    process: hits (compiled code read back, from this run or an earlier one) and misses
    (compiled now, C++ compiler and all). Both are inductor's: aot_eager caches nothing."""
    return {"hits": counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
            "misses": counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]}
