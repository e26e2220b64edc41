"""``iosched demo``: the main job on an embedded default.

1. Builds once, in the cache folder, a real safetensors checkpoint shaped like the bundled
   trace's model (its layers and experts, Hugging Face tensor names), with each expert
   scaled down (hidden and intermediate sizes divided by :data:`SCALE`) so the whole run
   takes well under a minute on two cores.
2. Drops the checkpoint from the page cache (``posix_fadvise(DONTNEED)``) so the first
   reads go to the disk, as they would on a cold engine.
3. Replays the bundled real routing trace through :class:`iosched.ExpertStore` as an engine
   would: per token, per layer, lease the routed experts together (``acquire_many``), hold
   them for an emulated compute time, release.
4. Prints tokens/s, hit rate, felt wait against read service time, bytes read, per device.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iosched import ExpertStore, _settings
from iosched._checkpoint import load_index

from .synth import write_safetensors_moe
from .trace import PHASE_DECODE, RouteTrace, load_bundled_trace

# Qwen3-30B-A3B's expert shape (config.json: hidden_size 2048, moe_intermediate_size 768),
# used for every bundled trace so the demo's experts keep a real model's aspect ratio.
REAL_HIDDEN, REAL_INTERMEDIATE = 2048, 768
SCALE = 16
"""Divides the real expert dimensions: 128 x 48 bf16 experts are 36 KiB, 226 MB for 48 x 128."""
CHECKPOINT_VERSION = 1
"""Bump when the demo checkpoint's contents change, so old caches are not reused."""


@dataclass(frozen=True)
class DemoConfig:
    trace: str = "qwen"
    budget_cycles: float = 4.0
    compute_ms: float = 1.0
    backend: str = "auto"
    policy: str = "default"
    cold: bool = True
    max_tokens: int | None = None


def cache_dir() -> Path:
    configured = str(_settings.get("cache_dir"))
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "iosched"


def demo_checkpoint(trace: RouteTrace, folder: Path | None = None) -> Path:
    """The demo checkpoint for ``trace``, built on first use (atomically: build, then rename)."""
    hidden, inter = REAL_HIDDEN // SCALE, REAL_INTERMEDIATE // SCALE
    name = f"demo-v{CHECKPOINT_VERSION}-{trace.arch}-{len(trace.layers)}x{trace.n_expert}-{hidden}x{inter}"
    target = (folder or cache_dir()) / name
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_safetensors_moe(
        tmp, n_layers=len(trace.layers), n_experts=trace.n_expert, hidden=hidden,
        intermediate=inter, dtype="bfloat16", n_shards=4, seed=0,
    )
    (tmp / ".complete").write_text(f"{trace.source}\n")
    try:
        os.rename(tmp, target)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def drop_from_page_cache(paths: tuple[str, ...]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@dataclass
class DemoResult:
    trace: str
    checkpoint: str
    tokens: int
    prefill_batches: int
    decode_seconds: float
    tokens_per_s: float
    budget_bytes: int
    td_bytes: int
    stats: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "trace": self.trace, "checkpoint": self.checkpoint, "tokens": self.tokens,
            "decode_seconds": self.decode_seconds, "tokens_per_s": self.tokens_per_s,
            "td_bytes": self.td_bytes,
            "hit_rate": s["hits"] / s["requests"] if s["requests"] else 0.0,
            "budget_cycles": self.budget_bytes / self.td_bytes,
            "decode_felt_wait_per_token_ms": 1e3 * s["decode_felt_wait_s"] / max(self.tokens, 1),
            **s,
        }


async def run_demo(config: DemoConfig, progress: Any = None) -> DemoResult:
    """Build (once) and replay; ``progress`` is a rich Progress or ``None``."""
    trace = load_bundled_trace(config.trace)
    folder = await asyncio.to_thread(demo_checkpoint, trace)
    index = await asyncio.to_thread(load_index, folder)
    td = trace.k * sum(index.expert_bytes_by_layer().values())
    budget = int(config.budget_cycles * td)
    if config.cold:
        drop_from_page_cache(index.files)
    total = trace.n_decode_tokens() if config.max_tokens is None else min(config.max_tokens, trace.n_decode_tokens())
    task = progress.add_task("decoding", total=total) if progress is not None else None
    compute_s = config.compute_ms / 1e3
    token, tokens, prefill_batches = -1, 0, 0
    decode_felt_start = 0.0
    decode_start = time.perf_counter()
    async with await ExpertStore.open(folder, budget_bytes=budget, backend=config.backend,
                                      policy=config.policy) as store:
        for phase, tok, layer, experts in trace.batches():
            if phase == PHASE_DECODE and tok != token:
                if tokens == total:
                    break
                if token < 0:
                    decode_start = time.perf_counter()
                    decode_felt_start = store.stats()["felt_wait_s"]
                store.token_boundary()
                token = tok
                tokens += 1
                if task is not None:
                    progress.advance(task)
            elif phase != PHASE_DECODE:
                prefill_batches += 1
            async with store.acquire_many([(layer, e) for e in experts.tolist()]):
                await asyncio.sleep(compute_s)
        decode_seconds = time.perf_counter() - decode_start
        stats = store.stats()
        stats["decode_felt_wait_s"] = stats["felt_wait_s"] - decode_felt_start
    return DemoResult(
        trace=(f"{config.trace} ({Path(trace.model).name}, {len(trace.layers)} layers x "
               f"{trace.n_expert} experts, k={trace.k})"),
        checkpoint=str(folder), tokens=tokens, prefill_batches=prefill_batches,
        decode_seconds=decode_seconds, tokens_per_s=tokens / decode_seconds if decode_seconds else 0.0,
        budget_bytes=budget, td_bytes=td, stats=stats,
    )
