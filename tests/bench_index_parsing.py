"""What indexing costs, this tree against another (not a test: ``python tests/bench_index_parsing.py``).

Two checkpoints are written once: a safetensors folder (48 MoE layers x 128 experts, four
shards and an index json: 18,432 expert tensors) and a GGUF file with a 262,144-token
vocabulary (tokens, scores, token types: a large real header) and 48 layers of 128 merged
experts. Each is indexed by ``load_index`` in a fresh interpreter, this tree's and, with
``--base DIR``, the one under ``DIR`` (``git archive <commit> | tar -x -C DIR``), alternating
the two ``--rounds`` times (the disk's and the machine's speed drift; side by side, medians).
Per run: the median wall time of five ``load_index`` calls, then the ``tracemalloc`` peak of one.
Prints one JSON object.

``--json-factors`` instead measures what ``json.loads`` costs per input byte (``tracemalloc``
peak / input size) on the shapes a hostile header can take, and on a real-shaped header.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def write_checkpoints(folder: Path) -> dict[str, Path]:
    import gguf
    import numpy as np

    from iosched.tools.synth import write_safetensors_moe

    st = write_safetensors_moe(folder / "st", n_layers=48, n_experts=128, hidden=8, intermediate=4,
                               dtype="float16", n_shards=4, dense=False, experts_per_token=8)
    path = folder / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), arch="qwen3moe")
    writer.add_expert_used_count(8)
    writer.add_expert_count(128)
    n_vocab = 262_144
    writer.add_token_list([f"token{i}" for i in range(n_vocab)])
    writer.add_token_scores([float(i) for i in range(n_vocab)])
    writer.add_token_types([1] * n_vocab)
    for layer in range(48):
        for role in ("gate", "up", "down"):
            writer.add_tensor(f"blk.{layer}.ffn_{role}_exps.weight", np.zeros((128, 4, 8), np.float16))
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", np.zeros((128, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"safetensors": st, "gguf": path}


def run_one(source: str) -> dict[str, float]:
    """In this interpreter: median seconds of five indexings, then the peak of one."""
    import gguf  # noqa: F401  imported first, so no run pays for it

    from iosched import load_index

    load_index(source)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        load_index(source)
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    load_index(source)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"seconds": statistics.median(times), "peak_mib": peak / 2**20}


def measure(tree: Path, source: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--run", str(source)], env=env, check=True,
                         capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout
    result: dict[str, float] = json.loads(out)
    return result


def json_factors() -> dict[str, float]:
    """Peak bytes per input byte of ``json.loads``, per shape of input."""
    n = 2_000_000
    real = {f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.gate_proj.weight":
            {"dtype": "BF16", "shape": [768, 2048], "data_offsets": [i * 100, i * 100 + 100]} for i in range(100_000)}
    shapes = {
        "empty objects [{},...]": b"[" + b"{}," * n + b"{}]",
        "empty lists [[],...]": b"[" + b"[]," * n + b"[]]",
        "short strings": b"[" + b'"ab",' * n + b'"ab"]',
        "distinct keys": b"{" + b",".join(b'"%d":0' % i for i in range(n)) + b"}",
        "floats": b"[" + b"0.5," * n + b"0.5]",
        "small integers": b"[" + b"0," * n + b"0]",
        "real-shaped header (100,000 entries)": json.dumps(real).encode(),
    }
    out = {}
    for name, blob in shapes.items():
        tracemalloc.start()
        value = json.loads(blob)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del value
        out[f"{name}, {len(blob) / 1e6:.1f} MB"] = round(peak / len(blob), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="another tree to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--formats", default="safetensors,gguf", help="which checkpoints (comma-separated)")
    parser.add_argument("--json-factors", action="store_true", help="json.loads memory per input byte")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json_factors:
        print(json.dumps(json_factors(), indent=2))
        return
    if args.run:
        print(json.dumps(run_one(args.run)))
        return
    trees = {"this": HERE} | ({"base": args.base.resolve()} if args.base else {})
    with tempfile.TemporaryDirectory() as tmp:
        sources = {fmt: path for fmt, path in write_checkpoints(Path(tmp)).items()
                   if fmt in args.formats.split(",")}
        runs: dict[str, dict[str, list[dict[str, float]]]] = {f: {t: [] for t in trees} for f in sources}
        for _ in range(args.rounds):
            for fmt, source in sources.items():
                for name, tree in trees.items():
                    runs[fmt][name].append(measure(tree, source))
    print(json.dumps({fmt: {name: {key: round(statistics.median(r[key] for r in rs), 4)
                                   for key in ("seconds", "peak_mib")}
                            for name, rs in by_tree.items()}
                      for fmt, by_tree in runs.items()}, indent=2))


if __name__ == "__main__":
    main()
