"""EngineLoad's waiting-queue fields: the fullness test, reading Stats answers and entries of
newer engines."""

from __future__ import annotations

import json

import pytest

from conveyor.common.engine_registry import EngineEntry, EngineLoad
from conveyor.v1 import engine_pb2


@pytest.mark.parametrize(("load", "full"), [
    (EngineLoad(num_waiting=300), False),  # 0: no limit
    (EngineLoad(num_waiting=7, max_num_waiting_seqs=8), False),
    (EngineLoad(num_waiting=8, max_num_waiting_seqs=8), True),
    (EngineLoad(num_waiting_tokens=4095, max_num_waiting_tokens=4096), False),
    (EngineLoad(num_waiting_tokens=4096, max_num_waiting_tokens=4096), True),
])
def test_is_waiting_full(load, full):
    assert load.is_waiting_full is full


def test_a_stats_answer_gives_every_load_field():
    message = engine_pb2.EngineStats(
        num_running=1, num_waiting=2, kv_usage=0.5, num_free_blocks=3, num_blocks=4,
        num_waiting_tokens=40, max_num_waiting_seqs=8, max_num_waiting_tokens=512,
        lora_adapters=["sql"], prefix_cache_hit_rate=0.25, num_requests_shed=7)
    assert EngineLoad.from_stats(message) == EngineLoad(
        1, 2, 0.5, num_free_blocks=3, num_blocks=4, num_waiting_tokens=40,
        max_num_waiting_seqs=8, max_num_waiting_tokens=512, lora_adapters=("sql",))


def test_an_entry_round_trips_and_unknown_load_fields_are_ignored():
    load = EngineLoad(1, 2, 0.5, num_free_blocks=3, num_blocks=4, num_waiting_tokens=40,
                      max_num_waiting_seqs=8, max_num_waiting_tokens=512)
    entry = EngineEntry("e", "e:50052", "m", load)
    assert EngineEntry.from_json(entry.to_json()) == entry
    data = json.loads(entry.to_json())
    data["load"]["from_a_newer_engine"] = 1
    del data["load"]["max_num_waiting_tokens"]  # from an older engine
    read = EngineEntry.from_json(json.dumps(data))
    assert read.load.max_num_waiting_tokens == 0 and read.load.num_waiting_tokens == 40


def test_held_adapters_round_trip_as_a_tuple_and_older_entries_read_without_them():
    entry = EngineEntry("e", "e:50052", "m", EngineLoad(lora_adapters=("sql", "chat")),
                        max_loras=4)
    read = EngineEntry.from_json(entry.to_json())
    assert read == entry and read.load.lora_adapters == ("sql", "chat") and read.serves_adapters
    data = json.loads(entry.to_json())
    del data["max_loras"], data["load"]["lora_adapters"]  # from an engine before LoRA
    older = EngineEntry.from_json(json.dumps(data))
    assert older.max_loras == 0 and older.load.lora_adapters == () and not older.serves_adapters
