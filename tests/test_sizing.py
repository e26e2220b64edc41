"""Self-sizing: k from the checkpoint, the token cycle, ``budget="auto"``, the warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from iosched import _settings
from iosched._errors import BudgetError, CheckpointError
from iosched.formats._checkpoint import load_index
from iosched.runtime import _sizing
from iosched.runtime._store import ExpertStore
from iosched.tools.synth import write_gguf_moe, write_safetensors_moe

LAYERS, EXPERTS, HIDDEN, INTER = 3, 4, 32, 16
EXPERT_BYTES = 3 * HIDDEN * INTER * 2  # gate, up, down in float16
CYCLE_PER_K = LAYERS * EXPERT_BYTES


def st(folder: Path, k: int | None = None) -> Path:
    return write_safetensors_moe(
        folder, n_layers=LAYERS, n_experts=EXPERTS, hidden=HIDDEN, intermediate=INTER,
        dtype="float16", experts_per_token=k,
    )


# ------------------------------------------------------------------ k from the checkpoint


def test_k_from_config_json(tmp_path: Path) -> None:
    folder = st(tmp_path, k=2)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_experts_per_tok"] == 2
    assert load_index(folder).experts_per_token == 2


def test_no_config_json_means_unknown(tmp_path: Path) -> None:
    folder = st(tmp_path)
    assert not (folder / "config.json").exists()
    assert load_index(folder).experts_per_token is None


@pytest.mark.parametrize("key", ["num_experts_per_token", "moe_topk", "top_k"])
def test_other_spellings(tmp_path: Path, key: str) -> None:
    folder = st(tmp_path)
    (folder / "config.json").write_text(json.dumps({key: 3}))
    assert load_index(folder).experts_per_token == 3


def test_nested_text_config(tmp_path: Path) -> None:
    folder = st(tmp_path)
    (folder / "config.json").write_text(json.dumps({"text_config": {"num_experts_per_tok": 1}}))
    assert load_index(folder).experts_per_token == 1


def test_config_without_k(tmp_path: Path) -> None:
    folder = st(tmp_path)
    (folder / "config.json").write_text(json.dumps({"hidden_size": HIDDEN}))
    assert load_index(folder).experts_per_token is None


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "malformed config.json"),
        ("[1, 2]", "not an object"),
        (json.dumps({"num_experts_per_tok": "two"}), "'num_experts_per_tok' is 'two'"),
        (json.dumps({"num_experts_per_tok": 0}), "'num_experts_per_tok' is 0"),
        (json.dumps({"num_experts_per_tok": True}), "'num_experts_per_tok' is True"),
        (json.dumps({"text_config": {"moe_topk": -1}}), "'text_config.moe_topk' is -1"),
    ],
)
def test_malformed_config_json_names_the_file(tmp_path: Path, text: str, needle: str) -> None:
    folder = st(tmp_path)
    (folder / "config.json").write_text(text)
    with pytest.raises(CheckpointError) as info:
        load_index(folder)
    assert str(folder / "config.json") in str(info.value)
    assert needle in str(info.value)


def test_k_above_the_experts_of_a_layer(tmp_path: Path) -> None:
    folder = st(tmp_path)
    (folder / "config.json").write_text(json.dumps({"top_k": 50}))  # a generation top_k
    with pytest.raises(CheckpointError, match=r"config.json key 'top_k'.*50.*more than 4 experts"):
        load_index(folder)


def test_k_from_gguf(tmp_path: Path) -> None:
    path = write_gguf_moe(tmp_path / "m.gguf", n_layers=LAYERS, n_experts=EXPERTS, hidden=HIDDEN,
                          intermediate=INTER, experts_per_token=3)
    import gguf

    reader = gguf.GGUFReader(path, "r")
    assert reader.fields["qwen3moe.expert_used_count"].contents() == 3
    del reader
    assert load_index(path).experts_per_token == 3
    assert load_index(tmp_path).experts_per_token == 3  # a folder with the one .gguf


def test_gguf_default_k_is_unchanged(tmp_path: Path) -> None:
    path = write_gguf_moe(tmp_path / "m.gguf", n_layers=LAYERS, n_experts=EXPERTS, hidden=HIDDEN,
                          intermediate=INTER)
    assert load_index(path).experts_per_token == 2


def test_gguf_malformed_k_names_the_key(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), arch="qwen3moe")
    writer.add_string("qwen3moe.expert_used_count", "two")
    writer.add_tensor("blk.0.ffn_up_exps.weight", __import__("numpy").zeros((2, 4, 8), "float16"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"bad.gguf.*'qwen3moe.expert_used_count' is 'two'"):
        load_index(path)


# ------------------------------------------------------------------ arithmetic


def test_token_cycle_bytes(tmp_path: Path) -> None:
    index = load_index(st(tmp_path))
    assert _sizing.token_cycle_bytes(index, 1) == CYCLE_PER_K
    assert _sizing.token_cycle_bytes(index, 2) == 2 * LAYERS * EXPERT_BYTES
    for bad in (0, -1, True):
        with pytest.raises(BudgetError, match="experts_per_token"):
            _sizing.token_cycle_bytes(index, bad)


def test_token_cycle_uses_the_largest_expert_of_each_layer(tmp_path: Path) -> None:
    from dataclasses import replace

    index = load_index(st(tmp_path))
    small = replace(index.experts[(0, 1)], nbytes=EXPERT_BYTES // 2)
    large = replace(index.experts[(1, 2)], nbytes=EXPERT_BYTES * 5)
    skewed = replace(index, experts={**index.experts, (0, 1): small, (1, 2): large})
    assert _sizing.token_cycle_bytes(skewed, 2) == 2 * (EXPERT_BYTES + 5 * EXPERT_BYTES + EXPERT_BYTES)


def test_auto_budget_is_whole_cycles(tmp_path: Path) -> None:
    index = load_index(st(tmp_path))
    td = _sizing.token_cycle_bytes(index, 1)
    # 2.5 cycles usable (half of 5 cycles' worth) -> 2 whole cycles
    assert _sizing.auto_budget(index, 1, 5 * td) == 2 * td
    assert _sizing.auto_budget(index, 1, 2 * td) == td
    # never more cycles than it takes to hold every expert (EXPERTS cycles at k=1)
    assert _sizing.auto_budget(index, 1, 1000 * td) == EXPERTS * td
    with pytest.raises(BudgetError) as info:
        _sizing.auto_budget(index, 1, td)
    assert str(td) in str(info.value) and f"MemAvailable {td}" in str(info.value)


def test_mem_available_parses_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:         10 kB\nMemAvailable:    123 kB\n")
    assert _sizing.mem_available(str(meminfo)) == 123 * 1024
    meminfo.write_text("MemTotal:       1000 kB\n")
    with pytest.raises(BudgetError, match="no MemAvailable"):
        _sizing.mem_available(str(meminfo))
    with pytest.raises(BudgetError, match="cannot read"):
        _sizing.mem_available(str(tmp_path / "missing"))


def test_mem_available_here() -> None:
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc/meminfo")
    assert _sizing.mem_available() > 0


# ------------------------------------------------------------------ the store


@pytest.mark.asyncio
async def test_auto_budget_at_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = st(tmp_path, k=2)
    td = 2 * CYCLE_PER_K
    monkeypatch.setattr(_sizing, "mem_available", lambda: 39 * td // 10)  # 1.95 cycles usable
    async with await ExpertStore.open(folder, budget_bytes="auto", backend="pread") as store:
        stats = store.stats()
        assert stats["budget_bytes"] == td  # whole cycles: 1.95 rounds down
        assert stats["td_bytes"] == td
        assert stats["budget_cycles"] == 1
        assert stats["experts_per_token"] == 2
        async with store.acquire((0, 0)) as view:
            assert view.data.nbytes == EXPERT_BYTES


@pytest.mark.asyncio
async def test_auto_budget_that_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = st(tmp_path, k=2)
    monkeypatch.setattr(_sizing, "mem_available", lambda: CYCLE_PER_K)
    with pytest.raises(BudgetError, match="one token cycle is"):
        await ExpertStore.open(folder, budget_bytes="auto", backend="pread")


@pytest.mark.asyncio
async def test_auto_without_k(tmp_path: Path) -> None:
    with pytest.raises(BudgetError, match="pass experts_per_token"):
        await ExpertStore.open(st(tmp_path), budget_bytes="auto", backend="pread")


@pytest.mark.asyncio
async def test_override_k(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = st(tmp_path, k=2)
    monkeypatch.setattr(_sizing, "mem_available", lambda: 100 * CYCLE_PER_K)
    async with await ExpertStore.open(folder, budget_bytes="auto", backend="pread",
                                      experts_per_token=1) as store:
        stats = store.stats()
        assert stats["experts_per_token"] == 1
        assert stats["td_bytes"] == CYCLE_PER_K
        assert stats["budget_bytes"] == 2 * CYCLE_PER_K  # auto_start_cycles, grown later
    with _settings.override(auto_start_cycles=1000):
        async with await ExpertStore.open(folder, budget_bytes="auto", backend="pread",
                                          experts_per_token=1) as store:
            # capped at the whole checkpoint
            assert store.stats()["budget_bytes"] == EXPERTS * CYCLE_PER_K
    # the override also sizes "auto" on a checkpoint that does not say
    async with await ExpertStore.open(st(tmp_path / "nok"), budget_bytes="auto", backend="pread",
                                      experts_per_token=1) as store:
        assert store.stats()["td_bytes"] == CYCLE_PER_K


@pytest.mark.asyncio
async def test_warning_below_one_cycle(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = st(tmp_path, k=2)
    td = 2 * CYCLE_PER_K
    caplog.set_level(logging.WARNING, logger="iosched")
    async with await ExpertStore.open(folder, budget_bytes=td - 1, backend="pread") as store:
        stats = store.stats()
        assert stats["td_bytes"] == td
        assert 0 < stats["budget_cycles"] < 1
    warnings = [r.getMessage() for r in caplog.records if "token cycle" in r.getMessage()]
    assert len(warnings) == 1
    assert str(td - 1) in warnings[0] and str(td) in warnings[0] and "LRU hits nothing" in warnings[0]
    caplog.clear()
    async with await ExpertStore.open(folder, budget_bytes=td, backend="pread"):
        pass
    assert not [r for r in caplog.records if "token cycle" in r.getMessage()]


@pytest.mark.asyncio
async def test_stats_when_k_is_unknown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="iosched")
    async with await ExpertStore.open(st(tmp_path), budget_bytes=1 << 20, backend="pread") as store:
        stats = store.stats()
        assert stats["td_bytes"] is None
        assert stats["budget_cycles"] is None
        assert stats["experts_per_token"] is None
    assert not [r for r in caplog.records if "token cycle" in r.getMessage()]


@pytest.mark.asyncio
@pytest.mark.parametrize("budget", ["Auto", "1GB", "", 0, -5, True, 1.5, None])
async def test_bad_budgets_still_raise(tmp_path: Path, budget: object) -> None:
    with pytest.raises(BudgetError) as info:
        await ExpertStore.open(st(tmp_path, k=2), budget_bytes=budget, backend="pread")  # type: ignore[arg-type]
    assert repr(budget) in str(info.value)


@pytest.mark.asyncio
@pytest.mark.parametrize("k", [0, -1, True, "2"])
async def test_bad_experts_per_token(tmp_path: Path, k: object) -> None:
    with pytest.raises(BudgetError, match="experts_per_token"):
        await ExpertStore.open(st(tmp_path, k=2), budget_bytes=1 << 20, backend="pread",
                               experts_per_token=k)  # type: ignore[arg-type]
