"""KV pool sizing: --kv-pages, the CPU default, a share of memory, and the error for none."""

import pytest
import torch

from replicas.engines.sim import SimEngine
from replicas.engines.torch_engine import TorchEngine
from replicas.kv_sizing import DEFAULT_PAGES, page_bytes, plan_kv_pages
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
