"""Synthetic ``route_trace v1`` traces with a known structure, for robustness checks.

Why: the default policy is judged on routing traces nobody on the project has seen, and the
two bundled ones are all the real routing there is.  A change that gains on both can still be
fitted to what they share.  These traces vary what a policy may lean on, one knob at a time,
so a gain that only holds where the structure is present, and a loss where it is absent,
show up before a held-out trace shows them (docs/tried-and-dropped.md, "Synthetic traces").

The routing model, per token and MoE layer (k distinct experts out of E):

* each layer has its own popularity, Zipf with exponent ``zipf`` over a random order of its
  experts (real routers are skewed: a few experts take a large share);
* each of the previous token's picks at the layer is picked again with probability ``reuse``
  (the bundled traces reuse 36-38 % from one token to the next);
* the rest is drawn without replacement from the popularity, mixed half and half with the
  preference of the current *topic*, a hidden state that switches with probability
  ``switch`` per token.  Each topic prefers a sparse set of experts in every layer (Dirichlet
  0.1), so a topic ties the layers' picks together: cross-layer co-activation.  ``topics=0``
  leaves the layers independent, a trace where co-activation predicts nothing.

The first ``prompt`` tokens are prefill, the next ``decode`` tokens decode, one turn; the
``# layer=`` sizes alternate between two values as in the bundled models' mixed quant types.
Weights are written ``nan``: the model has no router.  Deterministic for a given seed.

    python -m iosched.tools.synth_trace OUT.csv [--seed N] [--topics T] [--layers L] [--experts E] ...
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class SynthShape:
    layers: int = 24
    experts: int = 64
    k: int = 4
    prompt: int = 40
    decode: int = 128
    topics: int = 6
    switch: float = 0.1
    reuse: float = 0.35
    zipf: float = 1.0
    expert_bytes: tuple[int, int] = (2_000_000, 2_500_000)


def synth_trace_text(shape: SynthShape, seed: int) -> str:
    """The trace as ``route_trace v1`` text."""
    s = shape
    if not (0 < s.k <= s.experts and s.layers > 0 and s.prompt >= 0 and s.decode > 0):
        raise ValueError(f"impossible shape {s}")
    rng = np.random.default_rng(seed)
    ranks = 1.0 / np.arange(1, s.experts + 1) ** s.zipf
    popularity = [rng.permutation(ranks) for _ in range(s.layers)]
    popularity = [p / p.sum() for p in popularity]
    prefer = [[rng.dirichlet(np.full(s.experts, 0.1)) for _ in range(s.layers)]
              for _ in range(max(1, s.topics))]
    sizes = [s.expert_bytes[layer % 2] for layer in range(s.layers)]
    out = ["# route_trace v1",
           f"# model=synthetic-seed{seed} arch=synthetic n_layer={s.layers} n_expert={s.experts} "
           f"n_expert_used={s.k}"]
    out += [f"# layer={layer} expert_bytes={sizes[layer]} dense_bytes=0" for layer in range(s.layers)]
    out.append("turn,phase,step,layer,slot,expert,weight,residency,expert_bytes")
    previous: list[list[int]] = [[] for _ in range(s.layers)]
    topic = 0
    for step in range(s.prompt + s.decode):
        phase = 0 if step < s.prompt else 1
        if s.topics and rng.random() < s.switch:
            topic = int(rng.integers(s.topics))
        for layer in range(s.layers):
            p = popularity[layer] if not s.topics else 0.5 * popularity[layer] + 0.5 * prefer[topic][layer]
            picks = [e for e in previous[layer] if rng.random() < s.reuse][: s.k]
            q = p.copy()
            q[picks] = 0.0
            picks += rng.choice(s.experts, s.k - len(picks), replace=False, p=q / q.sum()).tolist()
            previous[layer] = picks
            out += [f"0,{phase},{step},{layer},{slot},{e},nan,0,0" for slot, e in enumerate(picks)]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    d = SynthShape()
    p = argparse.ArgumentParser(prog="python -m iosched.tools.synth_trace", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the trace file to write")
    p.add_argument("--seed", type=int, default=1)
    for name in ("layers", "experts", "k", "prompt", "decode", "topics"):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name))
    for name in ("switch", "reuse", "zipf"):
        p.add_argument(f"--{name}", type=float, default=getattr(d, name))
    args = p.parse_args(argv)
    shape = SynthShape(layers=args.layers, experts=args.experts, k=args.k, prompt=args.prompt,
                       decode=args.decode, topics=args.topics, switch=args.switch,
                       reuse=args.reuse, zipf=args.zipf)
    args.out.write_text(synth_trace_text(shape, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
