"""KV pool sizing: --kv-pages, the CPU default, a share of memory, and the error for none."""

import pytest
import torch

from replicas.engines.sim import SimEngine
from replicas.engines.torch_engine import TorchEngine
from replicas.kv_sizing import DEFAULT_PAGES, RECURRENT_SHARE, page_bytes, plan_kv_pages
from replicas.service import ReplicaService
from replicas.settings import ReplicaSettings


def test_page_bytes_sum_one_page_of_every_pool():
    engine = TorchEngine.from_preset("tiny-hybrid")
    engine.cache_config(1, 16, True)
    # full and sliding pages: [1 layer, K/V, 16 tokens, 2 kv heads, 16] float32; recurrent
    # [1 layer, 64] float32.
    assert page_bytes(engine.page_layouts()) == 2 * (2 * 16 * 2 * 16 * 4) + 64 * 4


@pytest.mark.parametrize("settings, pages, source", [
    ({"kv_pages": 40}, 40, "--kv-pages"),
    ({}, DEFAULT_PAGES, "default on the CPU"),
])
def test_explicit_pages_and_the_cpu_default(settings, pages, source):
    plan = plan_kv_pages(ReplicaSettings(engine="torch", preset="tiny", tokens_per_block=16,
                                         **settings), TorchEngine.from_preset("tiny"))
    assert plan.num_pages == pages and plan.source.startswith(source)
    assert plan.bytes_per_page == 2 * 2 * 16 * 2 * 16 * 4  # 2 layers of K/V in one pool


def test_engines_without_page_storage_get_the_default():
    plan = plan_kv_pages(ReplicaSettings(), SimEngine())
    assert (plan.num_pages, plan.bytes_per_page) == (DEFAULT_PAGES, 0)


def test_a_share_of_host_memory(monkeypatch):
    monkeypatch.setattr("replicas.kv_sizing._available_host_bytes", lambda: 10 * 2**20)
    engine = TorchEngine.from_preset("tiny")
    plan = plan_kv_pages(ReplicaSettings(engine="torch", tokens_per_block=16,
                                         kv_memory_fraction=0.5), engine)
    assert plan.num_pages == (5 * 2**20) // (2 * 2 * 16 * 2 * 16 * 4)  # 640 pages of 8 KiB


def test_too_little_memory_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("replicas.kv_sizing._available_host_bytes", lambda: 4096)
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        plan_kv_pages(ReplicaSettings(engine="torch", tokens_per_block=16,
                                      kv_memory_fraction=0.5), TorchEngine.from_preset("tiny"))


def test_the_service_builds_its_pools_from_the_plan(caplog):
    caplog.set_level("INFO", logger="replicas")
    service = ReplicaService(ReplicaSettings(engine="torch", preset="tiny", kv_pages=12,
                                             tokens_per_block=16))
    assert service.manager.config.num_pages == 12
    assert service.manager.page_storage(0).shape == (12, 2, 2, 16, 2, 16)
    assert service.manager.page_storage(0).dtype == torch.float32
    assert ("KV cache: 12 pages in each of 1 pools (192 tokens per pool, 0.1 MiB "
            "reserved; --kv-pages)") in caplog.messages


def test_a_hybrid_model_splits_the_budget_between_attention_and_states(monkeypatch):
    """tiny-hybrid at 16 tokens a block: full and sliding pages of 4 KiB each, a recurrent
    page of 256 B. The recurrent pool takes RECURRENT_SHARE of the bytes; the attention
    pools the same count each from the rest."""
    monkeypatch.setattr("replicas.kv_sizing._available_host_bytes", lambda: 2 * 2**20)
    plan = plan_kv_pages(ReplicaSettings(engine="torch", tokens_per_block=16,
                                         kv_memory_fraction=0.5), TorchEngine.from_preset(
                                             "tiny-hybrid"))
    budget = 2**20
    states = int(budget * RECURRENT_SHARE) // 256
    assert plan.num_pages == ((budget - states * 256) // 8192,) * 2 + (states,) == (96, 96, 1024)
    assert plan.pool_bytes == (4096, 4096, 256)


def test_the_recurrent_pool_holds_two_states_per_running_sequence_at_least(monkeypatch):
    monkeypatch.setattr("replicas.kv_sizing._available_host_bytes", lambda: 2 * 2**20)
    plan = plan_kv_pages(ReplicaSettings(engine="torch", tokens_per_block=16, max_num_seqs=800,
                                         kv_memory_fraction=0.5),
                         TorchEngine.from_preset("tiny-hybrid"))
    assert plan.num_pages == ((2**20 - 1600 * 256) // 8192,) * 2 + (1600,)


def test_a_page_count_per_pool(caplog):
    caplog.set_level("INFO", logger="replicas")
    service = ReplicaService(ReplicaSettings(engine="torch", preset="tiny-hybrid",
                                             kv_pages="40,20,8", tokens_per_block=16))
    assert service.manager.config.pool_pages == (40, 20, 8)
    assert [service.manager.page_storage(i).shape[0] for i in range(3)] == [40, 20, 8]
    assert ("KV cache: full 40, sliding(24) 20, recurrent 8 pages (16 tokens per attention "
            "page, 0.2 MiB reserved; --kv-pages)") in caplog.messages


def test_a_wrong_number_of_page_counts_names_the_pools():
    with pytest.raises(ValueError, match=r"2 page counts for this model's 3 pools "
                                         r"\(full, sliding\(24\), recurrent\)"):
        ReplicaService(ReplicaSettings(engine="torch", preset="tiny-hybrid", kv_pages="40,20"))


@pytest.mark.parametrize("value, parsed", [("12", 12), (12, 12), ("40,20,8", (40, 20, 8)),
                                           ([40, 20, 8], (40, 20, 8))])
def test_kv_pages_takes_one_count_or_one_per_pool(value, parsed):
    assert ReplicaSettings(kv_pages=value).kv_pages == parsed


@pytest.mark.parametrize("value", ["40,x", "0", "4,0,2", "", [True]])
def test_bad_page_counts_say_what_to_give(value):
    with pytest.raises(ValueError, match="kv_pages"):
        ReplicaSettings(kv_pages=value)
